"""Inference beyond one forward under the newer policies: `generate()` of tiny transformers,
denoising loops of tiny diffusers models, and a TRL-style loop alternating generation with
LoRA training, under `Policy(layout="spread", vram_budget=...)` (kept and streamed scopes), `Policy(frozen_format=
"fp8" | "int8")` and both.

The reference is the plain resident model whose compressed matrices hold their
quantize-dequantized values (`quantize_dequantize`), so on the CPU every token, every logit,
every denoised sample, every loss, gradient and parameter must be bit-identical. Between the
model's forwards (a logits processor runs there) and after each phase, no streamed scope holds
device memory and each kept scope holds a copy equal to its masters (`assert_all_scopes_offloaded`),
and `offtensor.summary` counts exactly one load per forward of a streamed scope and one load
in all for a kept scope.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from conftest import assert_all_scopes_offloaded, device_layout_bytes, devices, host, tolerances

import offtensor
from offtensor.engine.engine import find_engine as _find_engine
from offtensor.storage.compress import quantize_dequantize

transformers = pytest.importorskip("transformers")

VOCAB = 128
NEW_TOKENS = 6


# ---- helpers -------------------------------------------------------------------------------


def _scope_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    modules = dict(model.named_modules())
    return {s.name: modules[s.name] for s in offtensor.summary(model).scopes}


def _budget(blocks: list[torch.nn.Module], keep: list[int]) -> int:
    """Room for streaming (3 times the largest block: computing, the one before, one
    prefetched) plus the blocks at `keep`, and a little slack below the next block. The budget
    keeps the first block and spreads the others over the order by bytes (Note [VRAM budget]):
    `keep` must be such a layout, which the tests check in `offtensor.summary`."""
    largest = max(device_layout_bytes(b) for b in blocks)
    return 3 * largest + sum(device_layout_bytes(blocks[i]) for i in keep) + 64


def _wrap_with_reference(model: torch.nn.Module, device: str, policy: offtensor.Policy,
                         predicate=None) -> tuple[torch.nn.Module, int]:
    """Wraps `model`; returns the resident reference whose matrices compressed by the wrap hold
    their compressed values, and how many there are."""
    reference = copy.deepcopy(model)
    offtensor.wrap(model, predicate, device=device, policy=policy)
    model.to(device)
    ref_params = dict(reference.named_parameters())
    n_packed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, offtensor.OffloadedParameter) and p._ot.packed is not None:
                assert policy.frozen_format is not None
                ref_params[name].copy_(quantize_dequantize(ref_params[name], policy.frozen_format))
                n_packed += 1
    return reference.to(device), n_packed


def _assert_within_budget(model: torch.nn.Module, most_device_bytes: list[int]) -> None:
    budget = _find_engine(model).policy.vram_budget
    assert most_device_bytes[0] > 0
    if budget is not None:
        assert most_device_bytes[0] <= budget, f"{most_device_bytes[0]} device bytes over a budget of {budget}"


def _count_forwards(model: torch.nn.Module) -> Counter:
    """How many times each scope's module runs its forward, counted from now on."""
    calls: Counter = Counter()
    for name, module in _scope_modules(model).items():
        module.register_forward_pre_hook(lambda m, a, name=name: calls.update([name]))
    return calls


def _assert_loads(model: torch.nn.Module, calls: Counter, extra: dict[str, int] | None = None,
                  offloaded: tuple[str, ...] = ()) -> None:
    """Since wrap, a kept scope loaded once in all and is resident, a streamed one loaded once per
    forward (`calls`), and once more when carried into a forward still to come (the last one's
    end loaded it: Note [carried into the next forward] in budget/vram.py), plus `extra`; a kept
    one is resident, but those in `offloaded`."""
    for s in offtensor.summary(model).scopes:
        if s.kept:
            assert s.loads == 1 + (extra or {}).get(s.name, 0), f"kept {s.name}: {s.loads} loads"
            want_state = offtensor.ScopeState.OFFLOADED if s.name in offloaded else offtensor.ScopeState.RESIDENT
            assert s.state is want_state, f"kept {s.name} is {s.state}"
        else:
            want = calls[s.name] + s.carried + (extra or {}).get(s.name, 0)
            assert s.loads == want, f"{s.name}: {s.loads} loads for {want}"


class _CheckBetweenForwards(transformers.LogitsProcessor):
    """Runs between two forwards of `generate()`: no streamed scope holds device memory, and
    each kept or carried scope holds its masters' values. The identity otherwise."""

    def __init__(self, model: torch.nn.Module | None):
        self.model, self.seen = model, 0

    def __call__(self, input_ids, scores):
        if self.model is not None:
            assert_all_scopes_offloaded(self.model)
            self.seen += 1
        return scores


# ---- generate() of tiny transformers -------------------------------------------------------


def _llama(layers: int = 5) -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=5, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))


def _gpt_neox() -> torch.nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=1, eos_token_id=2))


def _t5() -> torch.nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


#: name -> (builder, matrices each compressed wrap packs: 64x64 and larger)
GENERATORS: dict[str, tuple[Callable[[], torch.nn.Module], int]] = {
    "llama": (_llama, 5 * 5),  # q, o, gate, up, down per layer (k, v are 32x64)
    "gpt2": (_gpt2, 5 * 4),  # c_attn, c_proj, c_fc, mlp.c_proj
    "gpt_neox": (_gpt_neox, 5 * 4),  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h
    "t5": (_t5, 3 * 6 + 3 * 10),  # q, k, v, o, wi, wo; the decoder's cross-attention too
}

POLICIES = ["budget", "fp8", "int8", "fp8_budget", "int8_budget"]
DECODING = {
    "greedy_cache": {"do_sample": False, "use_cache": True},
    "greedy_no_cache": {"do_sample": False, "use_cache": False},
    "sample_cache": {"do_sample": True, "top_k": 20, "temperature": 0.9, "use_cache": True},
    "sample_no_cache": {"do_sample": True, "top_k": 20, "temperature": 0.9, "use_cache": False},
}


def _policy(name: str, blocks: list[torch.nn.Module]) -> offtensor.Policy:
    fmt = name.split("_")[0] if name.startswith(("fp8", "int8")) else None
    budget = _budget(blocks, keep=[0]) if name.endswith("budget") else None
    return offtensor.Policy(frozen_format=fmt, layout="spread", vram_budget=budget)


def _generate(model: torch.nn.Module, prompt: torch.Tensor, decoding: dict, check: _CheckBetweenForwards):
    torch.manual_seed(1234)  # the sampling draws
    return model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
        logits_processor=transformers.LogitsProcessorList([check]), **decoding)


@pytest.mark.parametrize("decoding", list(DECODING))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", list(GENERATORS))
@pytest.mark.parametrize("device", devices)
def test_generate_matches_the_reference_under_budget_and_compression(device, arch, policy, decoding,
                                                                    most_device_bytes):
    build, n_matrices = GENERATORS[arch]
    model = build().eval().requires_grad_(False)
    blocks = [m for name, m in model.named_modules()
              if name.rsplit(".", 1)[0] in ("model.layers", "transformer.h", "gpt_neox.layers",
                                            "encoder.block", "decoder.block")]
    reference, n_packed = _wrap_with_reference(model, device, _policy(policy, blocks))
    assert n_packed == (0 if policy == "budget" else n_matrices)
    kept = [s.kept for s in offtensor.summary(model).scopes]
    if policy.endswith("budget"):
        assert kept == [True] + [False] * (len(kept) - 1)
    calls = _count_forwards(model)
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)

    expected = _generate(reference, prompt, DECODING[decoding], _CheckBetweenForwards(None))
    check = _CheckBetweenForwards(model)
    got = _generate(model, prompt, DECODING[decoding], check)

    assert check.seen == NEW_TOKENS
    torch.testing.assert_close(got.sequences, expected.sequences, rtol=0, atol=0)
    for step, (g, e) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(g, e, **tolerances(device), msg=lambda m, step=step: f"step {step}: {m}")
    assert_all_scopes_offloaded(model)
    # T5's encoder runs outside the model's forward (generate calls it first): the model's
    # first forward then loads the first scope of the order it learned, encoder.block.0, early
    # (Engine.begin_forward), and the decoder never runs it: one load more than its forwards,
    # unless the budget keeps it.
    extra = {"encoder.block.0": 1} if arch == "t5" and not policy.endswith("budget") else None
    _assert_loads(model, calls, extra)
    _assert_within_budget(model, most_device_bytes)


# ---- denoising loops of tiny diffusers models ------------------------------------------------


def _unet():
    d = pytest.importorskip("diffusers")
    model = d.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=8, mid_block_type=None)
    g = torch.Generator().manual_seed(1)
    sample, context = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 3, 64, generator=g)

    def call(m, x, t):
        return m(x, t, encoder_hidden_states=context.to(x.device)).sample

    # Each resnet and each transformer of the blocks is a scope: blocks of similar sizes, so
    # that a budget keeps some and streams the others (the whole down/up blocks differ 3x).
    resnet, attention = d.models.resnet.ResnetBlock2D, d.models.transformers.transformer_2d.Transformer2DModel
    return model, sample, call, lambda name, m: isinstance(m, (resnet, attention))


def _flux():
    d = pytest.importorskip("diffusers")
    model = d.FluxTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_single_layers=6,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64,
        pooled_projection_dim=64, guidance_embeds=False, axes_dims_rope=(4, 4, 8))
    g = torch.Generator().manual_seed(1)
    sample, context, pooled = (torch.randn(1, 16, 4, generator=g), torch.randn(1, 3, 64, generator=g),
                               torch.randn(1, 64, generator=g))
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                         indexing="ij"), -1).reshape(16, 3)

    def call(m, x, t):
        dev = x.device
        return m(hidden_states=x, encoder_hidden_states=context.to(dev), pooled_projections=pooled.to(dev),
                 timestep=t / 1000, img_ids=img_ids.to(dev), txt_ids=torch.zeros(3, 3, device=dev)).sample

    return model, sample, call, None


def _sd3():
    d = pytest.importorskip("diffusers")
    model = d.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=6,
        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64,
        caption_projection_dim=64, pooled_projection_dim=64, pos_embed_max_size=8)
    g = torch.Generator().manual_seed(1)
    sample, context, pooled = (torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 3, 64, generator=g),
                               torch.randn(1, 64, generator=g))

    def call(m, x, t):
        return m(hidden_states=x, encoder_hidden_states=context.to(x.device),
                 pooled_projections=pooled.to(x.device), timestep=t).sample

    return model, sample, call, None


DENOISERS = {"unet2d_condition": _unet, "flux": _flux, "sd3": _sd3}
TIMESTEPS = [999.0, 750.0, 500.0, 250.0, 1.0]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", list(DENOISERS))
@pytest.mark.parametrize("device", devices)
def test_denoising_loop_matches_the_reference_under_budget_and_compression(device, arch, policy,
                                                                          most_device_bytes):
    model, sample, call, predicate = DENOISERS[arch]()
    model.eval().requires_grad_(False)
    probe = copy.deepcopy(model)  # to find the blocks the wrap will select, and their sizes
    offtensor.wrap(probe, predicate, device="cpu")
    blocks = list(_scope_modules(probe).values())
    offtensor.unwrap(probe)
    reference, n_packed = _wrap_with_reference(model, device, _policy(policy, blocks), predicate)
    assert (n_packed > 0) == (policy != "budget")
    kept = [s.kept for s in offtensor.summary(model).scopes]
    if policy.endswith("budget"):
        assert any(kept) and not all(kept), kept
    calls = _count_forwards(model)

    x_ref = x = sample.to(device)
    with torch.no_grad():
        for t in TIMESTEPS:
            timestep = torch.full((sample.shape[0],), t, device=device)
            expected = call(reference, x_ref, timestep)
            got = call(model, x, timestep)
            torch.testing.assert_close(got, expected, **tolerances(device), msg=lambda m, t=t: f"t={t}: {m}")
            assert_all_scopes_offloaded(model)
            x_ref, x = x_ref - 0.2 * expected, x - 0.2 * got  # an Euler step on each

    assert all(calls[name] == len(TIMESTEPS) for name in calls), calls
    _assert_loads(model, calls)
    _assert_within_budget(model, most_device_bytes)


# ---- TRL-style loop: generation, then LoRA training, under a budget with an fp8 base ----------


peft = pytest.importorskip("peft")


def _lora_llama() -> torch.nn.Module:
    """Adapters on every layer but the last: a budget keeping two layers (the first, and the
    last, spread over the order) keeps one that trains and one whose copy, made in a rollout,
    serves every training step as it is."""
    model = _llama(layers=6)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           layers_to_transform=[0, 1, 2, 3, 4],
                           init_lora_weights=False)  # B != 0: the adapters change the tokens
    return peft.get_peft_model(model, lora)


def _rollout(model: torch.nn.Module, prompt: torch.Tensor, check: _CheckBetweenForwards,
             inference_mode: bool):
    model.eval()
    torch.manual_seed(99)
    with torch.inference_mode(inference_mode):  # the device copies made here serve the training next
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, pad_token_id=0, use_cache=True,
            return_dict_in_generate=True, output_logits=True,
            logits_processor=transformers.LogitsProcessorList([check]))
    return out.sequences.clone(), torch.stack(out.logits).clone()  # normal tensors out of inference mode


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor,
                overlap: bool) -> torch.Tensor:
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss
    if overlap:
        offtensor.backward_and_step(loss, opt)
        offtensor.wait_for_steps()
    else:
        loss.backward()
        opt.step()
    return loss.detach()


@pytest.mark.parametrize("loop", ["step", "backward_and_step", "inference_mode_rollouts"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("device", devices)
def test_generation_alternating_with_lora_training_matches_the_reference(device, fmt, loop,
                                                                        most_device_bytes):
    model = _lora_llama()
    layers = list(model.base_model.model.model.layers)
    policy = offtensor.Policy(frozen_format=fmt, layout="spread", vram_budget=_budget(layers, keep=[0, 5]))
    reference, n_packed = _wrap_with_reference(model, device, policy)
    assert n_packed == 6 * 5
    assert [s.kept for s in offtensor.summary(model).scopes] == [True] + [False] * 4 + [True]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (model, reference)]
    calls = _count_forwards(model)
    prompt = torch.randint(3, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1)).to(device)
    tol = tolerances(device)

    for round_ in range(3):
        inference_mode = loop == "inference_mode_rollouts"
        tokens, logits = _rollout(model, prompt, check := _CheckBetweenForwards(model), inference_mode)
        ref_tokens, ref_logits = _rollout(reference, prompt, _CheckBetweenForwards(None), inference_mode)
        assert check.seen == NEW_TOKENS
        torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0, msg=lambda m: f"round {round_} tokens: {m}")
        torch.testing.assert_close(logits, ref_logits, **tol, msg=lambda m: f"round {round_} logits: {m}")
        assert_all_scopes_offloaded(model)

        # Both train on the reference's tokens: equal on the CPU; on CUDA a last-bit difference
        # from the optimizer (tolerances) could flip a sampled token, and the steps must not
        # depend on that.
        loss = _train_step(model, opts[0], ref_tokens, overlap=loop == "backward_and_step")
        ref_loss = _train_step(reference, opts[1], ref_tokens, overlap=False)
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"round {round_} loss: {m}")
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
            if p.requires_grad:
                torch.testing.assert_close(host(p.grad), host(r.grad), **tol,
                                           msg=lambda m, name=name: f"round {round_} grad {name}: {m}")
            torch.testing.assert_close(host(p), host(r), **tol,
                                       msg=lambda m, name=name: f"round {round_} {name}: {m}")
        for opt in opts:
            opt.zero_grad()
        assert_all_scopes_offloaded(model)

    # A streamed scope (layers 1 to 4) loads once per forward and once per backward. The first
    # kept scope (layer 0) holds trained LoRA matrices: each step writes its masters and retires
    # its copy, so it loads again at the next rollout (twice) and is offloaded after the last
    # step, with no stale copy (checked above). The second (layer 5, the last, frozen) loads
    # once in all.
    names = [s.name for s in offtensor.summary(model).scopes]
    extra = {name: 3 for name in names[1:5]} | {names[0]: 2}
    _assert_loads(model, calls, extra, offloaded=(names[0],))
    _assert_within_budget(model, most_device_bytes)
