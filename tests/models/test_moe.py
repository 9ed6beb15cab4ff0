"""Mixture-of-experts models: only the experts the router picks cross to the device (Note
[routed experts] in scopes/experts.py), and the model computes exactly as the plain one.

Tiny transformers models from config objects (random weights, nothing downloaded), their
decoder layers offloaded, in the eager (`w[expert_idx]` per expert) and grouped_mm (the whole
stacked weight, with offsets) expert implementations.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import unwrapped_reference

import offtensor

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
            bos_token_id=None)
EXPERTS = 16
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **BASE, moe_intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=2, head_dim=16),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **BASE, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=EXPERTS,
        num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(**BASE, num_local_experts=EXPERTS, num_experts_per_tok=2,
                                                  head_dim=16),
    "olmoe": lambda: transformers.OlmoeConfig(**BASE, num_experts=EXPERTS, num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **BASE, num_local_experts=EXPERTS, num_experts_per_tok=2, head_dim=16,
        layer_types=["full_attention", "sliding_attention"], sliding_window=8),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(  # shared experts beside the routed ones
        **BASE, moe_intermediate_size=32, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}
IMPLEMENTATIONS = ["eager", "grouped_mm"]


def tiny_moe(arch: str, implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config._experts_implementation = implementation
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name or "router" in name:
                p.normal_(0, 0.2)  # routers initialised to zero would pick the same experts
    return model.eval()


def routed_bytes_per_expert(layer: torch.nn.Module) -> tuple[int, int]:
    """(bytes of one expert's rows over the routed parameters, bytes of the routed parameters)."""
    routed = [p for name, p in layer.named_parameters() if ".experts." in f".{name}" and p.dim() >= 2]
    per_expert = sum(p[0].numel() * p.element_size() for p in routed)
    return per_expert, sum(p.numel() * p.element_size() for p in routed)


def router_choices(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Hooks recording, per experts module, the experts its router picked in the last call."""
    picked: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            def hook(mod, args, name=name):
                picked[name] = args[1].detach().clone()
            module.register_forward_pre_hook(hook)
    return picked


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_generation_equals_the_plain_model(arch, implementation):
    model = tiny_moe(arch, implementation)
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu")
    assert offtensor.summary(model)  # wrapped
    ids = torch.randint(1, 128, (1, 6))
    kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = reference.generate(ids, **kwargs)
    got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    summary = offtensor.summary(model)
    assert all(s.expert_misses > 0 for s in summary.scopes), summary


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_decode_token_copies_the_routed_experts_and_the_rest(arch, implementation):
    """Bytes of one decode step <= 1.10 x (non-expert bytes + the bytes of the experts the plain
    model's routers picked for that token)."""
    model = tiny_moe(arch, implementation)
    reference = unwrapped_reference(model, "cpu")
    picked = router_choices(reference)
    offtensor.wrap(model, device="cpu")
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        ref_out = reference(ids, use_cache=True)
        step = out.logits[:, -1:].argmax(-1)
        before = offtensor.summary(model).scopes
        got = model(step, past_key_values=out.past_key_values, use_cache=True).logits
        expected = reference(step, past_key_values=ref_out.past_key_values, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    after = offtensor.summary(model).scopes
    copied = sum(a.bytes_to_device - b.bytes_to_device for a, b in zip(after, before, strict=True))
    needed = 0
    for i, layer in enumerate(model.model.layers):
        per_expert, routed = routed_bytes_per_expert(layer)
        others = after[i].host_bytes - routed
        needed += others + per_expert * picked[f"model.layers.{i}.mlp.experts"].unique().numel()
    whole = sum(s.host_bytes for s in after)
    assert copied <= 1.10 * needed, (copied, needed, whole)
    assert copied < whole / 2, (copied, whole)


class StackedExperts(torch.nn.Module):
    """A user's MoE layer: one stacked weight [E, out, in], indexed per routed expert."""

    def __init__(self, experts: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.stacked = torch.nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)  # one expert per token
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            rows = choice == e
            out[rows] = x[rows] @ self.stacked[e].T
        return self.norm(x + out)


class UserModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([StackedExperts() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_user_module_indexing_a_stacked_weight_copies_the_experts_it_indexes():
    torch.manual_seed(0)
    model = UserModel()
    reference = copy.deepcopy(model)
    policy = offtensor.Policy(experts=lambda name, p: name.endswith("stacked"))
    offtensor.wrap(model, device="cpu", policy=policy)
    x = torch.randn(1, 32)
    for _ in range(3):
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    expert_bytes = 32 * 32 * 4
    before = offtensor.summary(model).bytes_to_device
    with torch.no_grad():
        model(x)
    copied = offtensor.summary(model).bytes_to_device - before
    others = sum(p.numel() * 4 for n, p in model.named_parameters() if "stacked" not in n)
    assert copied <= 1.10 * (others + 3 * expert_bytes)
    # Training: the stacked weight's gradient reaches the master exactly (zero for experts unused).
    xs = torch.randn(5, 32)
    model(xs).square().sum().backward()
    reference(xs).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


class ListExperts(torch.nn.Module):
    """Experts as separate modules (a ModuleList): not stacked, so not routed."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)


def test_experts_not_stacked_stream_as_before_with_one_log_line(caplog):
    model = torch.nn.Sequential(ListExperts(), ListExperts())
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="offtensor"):
        offtensor.wrap(model, lambda name, m: isinstance(m, ListExperts), device="cpu")
    lines = [r.getMessage() for r in caplog.records if "not routed" in r.getMessage()]
    assert len(lines) == 2 and "'0.experts'" in lines[0], lines
    x = torch.randn(2, 8)
    for _ in range(2):
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    for s, block in zip(offtensor.summary(model).scopes, model, strict=True):
        weights = sum(p.numel() * 4 for p in block.parameters())
        assert s.loads * weights <= s.bytes_to_device <= s.loads * s.host_bytes  # whole, with padding


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("experts_frozen", [False, True], ids=["trainable_experts", "frozen_experts"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_training_grads_equal_the_plain_models(implementation, experts_frozen, checkpointing):
    model = tiny_moe("qwen3_moe", implementation).train()
    if experts_frozen:  # LoRA-like: the experts frozen, attention trained
        for name, p in model.named_parameters():
            p.requires_grad_("experts" not in name)
    if checkpointing:
        model.gradient_checkpointing_enable()
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu")
    ids = torch.randint(1, 128, (2, 8))
    for _ in range(2):  # the second step accumulates into the first's grads
        model(ids, labels=ids).loss.backward()
        reference(ids, labels=ids).loss.backward()
        got, expected = _grads(model), _grads(reference)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


BLOCK_BYTES = 35 * 1024  # a StackedExperts block's weights on the device (33.5 KiB), and a little more


class SharedBlocks(torch.nn.Module):
    """Each block called twice in one forward (weight sharing, a looped model)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([StackedExperts() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.blocks, *self.blocks]:
            x = block(x) * 1.5
        return x


# A block's expert rows, forgotten by its release between two calls of one forward (or carried
# into the next call), are re-read by the backward of the first call's graph: every routed
# expert is copied before the scope's backward (Note [routed experts in backward]).
@pytest.mark.parametrize("budget_blocks", [None, 3, 5], ids=["streamed", "budget3", "budget5"])
def test_a_block_called_twice_in_a_forward_gets_exact_expert_grads(budget_blocks):
    torch.manual_seed(0)
    model = SharedBlocks()
    reference = copy.deepcopy(model)
    budget = None if budget_blocks is None else budget_blocks * BLOCK_BYTES
    offtensor.wrap(model, lambda name, m: isinstance(m, StackedExperts), device="cpu",
                   policy=offtensor.Policy(vram_budget=budget, experts=lambda name, p: name.endswith("stacked")))
    for _ in range(4):  # the order is learned at the first pass
        x = torch.randn(16, 32)
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        torch.testing.assert_close(_grads(model), _grads(reference), rtol=0, atol=0)
        model.zero_grad()
        reference.zero_grad()


def test_a_backward_after_a_forward_in_eval_mode_that_carried_routed_scopes_is_exact():
    """Eval mode with grad enabled (dropout off while training, an attribution): the forward
    carries the next call's first scopes, loaded without their experts; a backward follows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[StackedExperts() for _ in range(6)]).eval()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, lambda name, m: isinstance(m, StackedExperts), device="cpu",
                   policy=offtensor.Policy(vram_budget=4 * BLOCK_BYTES,
                                           experts=lambda name, p: name.endswith("stacked")))
    x = torch.randn(4, 32)
    with torch.no_grad():  # learns the order
        model(x)
    for step in range(3):
        loss = model(x).square().sum()
        if step == 0:  # the path under test (after a backward, eval-mode passes expect one)
            assert any(s.carried for s in offtensor.summary(model).scopes)
        loss.backward()
        reference(x).square().sum().backward()
        torch.testing.assert_close(_grads(model), _grads(reference), rtol=0, atol=0)
        x = torch.randn(4, 32)


def test_fp8_experts_routed_compute_as_fp8_experts_loaded_whole():
    model = tiny_moe("qwen3_moe", "eager").requires_grad_(False)
    whole = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(frozen_format="fp8"))
    offtensor.wrap(whole, device="cpu", policy=offtensor.Policy(frozen_format="fp8", experts=None))
    ids = torch.randint(1, 128, (1, 6))
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got, expected = model.generate(ids, **kwargs), whole.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert offtensor.summary(model).bytes_to_device < offtensor.summary(whole).bytes_to_device


def test_kept_scopes_keep_their_experts_across_tokens():
    """Under a VRAM budget that keeps every layer, an expert copied for one token is there for
    the next: only new experts cross, and the hit rate says so."""
    model = tiny_moe("qwen3_moe", "eager")
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget="1GiB"))
    ids = torch.randint(1, 128, (1, 6))
    kwargs = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got, expected = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    summary = offtensor.summary(model)
    assert all(s.kept for s in summary.scopes), summary
    for s in summary.scopes:
        assert s.expert_hit_rate is not None and s.expert_hit_rate >= 0.3, s
        assert s.bytes_to_device <= s.host_bytes  # each expert crossed at most once


# ---- the expert cache (Note [expert cache] in scopes/expert_cache.py) -------------------------------


def _layer_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(the largest decoder layer's device bytes, 256-byte aligned as wrap lays them out; the
    routed experts' bytes of all layers)."""
    largest = max(sum(-(-p.numel() * p.element_size() // 256) * 256 for p in layer.parameters())
                  for layer in model.model.layers)
    return largest, sum(routed_bytes_per_expert(layer)[1] for layer in model.model.layers)


def _cached_moe(implementation: str, cache: bool) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    """A 4-layer Qwen3-MoE and its plain reference, wrapped under a VRAM budget of the streaming
    room (3 layers: nothing kept) plus, with `cache`, a quarter of the routed experts' bytes."""
    torch.manual_seed(0)
    config = CONFIGS["qwen3_moe"]()
    config.num_hidden_layers = 4
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.config._experts_implementation = implementation
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.2)
    model.eval()
    reference = unwrapped_reference(model, "cpu")
    largest, routed = _layer_bytes(model)
    size = routed // 4
    policy = offtensor.Policy(vram_budget=3 * largest + (size if cache else 0), expert_cache=size if cache else None)
    offtensor.wrap(model, device="cpu", policy=policy)
    return model, reference, size


def _decode(model: torch.nn.Module, ids: torch.Tensor, tokens: int, each=lambda: None) -> tuple[list, list[int]]:
    """Greedy decode: the logits of each step, and the bytes each step after the prompt copied."""
    logits, copied = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits.append(out.logits[:, -1])
        for _ in range(tokens):
            before = offtensor.summary(model).bytes_to_device if offtensor.is_wrapped(model) else 0
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
            if offtensor.is_wrapped(model):
                copied.append(offtensor.summary(model).bytes_to_device - before)
            each()
    return logits, copied


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_expert_cache_keeps_hot_experts_and_decodes_exactly(implementation):
    model, reference, size = _cached_moe(implementation, cache=True)
    plain, _, _ = _cached_moe(implementation, cache=False)
    ids = torch.randint(1, 128, (1, 6))
    held = []
    got, cached = _decode(model, ids, 8, lambda: held.append(offtensor.summary(model).expert_cache_bytes))
    expected, _ = _decode(reference, ids, 8)
    _, streamed = _decode(plain, ids, 8)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    summary = offtensor.summary(model)
    assert not any(s.kept for s in summary.scopes) and summary.layout.expert_cache == size
    assert 0 < max(held) <= size, (held, size)  # never above its budget
    assert summary.expert_cache_bytes is not None and sum(s.expert_hits for s in summary.scopes) > 0
    assert sum(cached[1:]) < sum(streamed[1:]), (cached, streamed)  # hits do not cross the link
    assert all(c <= s for c, s in zip(cached, streamed, strict=True)), (cached, streamed)
    assert "expert cache holds" in str(summary) and "expert cache" in str(summary).splitlines()[-1]


def test_the_expert_cache_drops_rows_whose_masters_were_written():
    """Writes between tokens (in place, through .data, an optimizer step in training) reach the
    next token's experts: no cached row is stale."""
    model, reference, _ = _cached_moe("eager", cache=True)
    ids = torch.randint(1, 128, (1, 6))
    _decode(model, ids, 3)
    _decode(reference, ids, 3)
    for m in (model, reference):
        experts = m.model.layers[1].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.mul_(1.5)
        experts.down_proj.data.mul_(-1.0)
    got, _ = _decode(model, ids, 3)
    expected, _ = _decode(reference, ids, 3)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    model.train()
    reference.train()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    for _ in range(3):  # a step between forwards writes every expert's master
        losses = []
        for m, opt in zip((model, reference), optimizers, strict=True):
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)


def test_expert_cache_errors():
    with pytest.raises(ValueError, match="expert_cache does not combine with vram_budget='auto'"):
        offtensor.Policy(vram_budget="auto", expert_cache="1GiB")
    with pytest.raises(ValueError, match="expert_cache must be a positive number of bytes"):
        offtensor.Policy(expert_cache=0)
    model = tiny_moe("qwen3_moe", "eager")
    largest, _ = _layer_bytes(model)
    with pytest.raises(ValueError, match="leaves .* below what streaming needs"):
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=3 * largest, expert_cache=2 * largest))
