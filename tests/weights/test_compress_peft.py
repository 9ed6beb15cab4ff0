"""PEFT LoRA on a compressed Hugging Face base (Policy(frozen_format=...), Note [compressed
masters] in offtensor/storage/compress.py): training, and merging adapters into compressed weights.

The reference is the same PEFT model, resident and unwrapped, whose frozen base matrices hold
their compressed values (`quantize_dequantize`): on the CPU the wrapped model must match it
exactly, step after step, whatever path the training takes.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from conftest import assert_all_scopes_offloaded, devices, host, tolerances

import offtensor
from offtensor.engine.engine import find_engine as _find_engine
from offtensor.storage.compress import MIN_NUMEL, quantize_dequantize

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 128


def _tiny(arch: str, layers: int) -> torch.nn.Module:
    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    assert arch == "qwen2"  # biases on q, k, v: 1-D frozen parameters stay uncompressed
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))


def _lora(arch: str, checkpointing: bool = False, layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _tiny(arch, layers)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           init_lora_weights=False)  # B != 0: every LoRA matrix gets a gradient
    model = peft.get_peft_model(model, lora)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _compressed_reference(model: torch.nn.Module, fmt: str, device: str) -> torch.nn.Module:
    """A resident copy whose frozen layer matrices hold the values they have compressed."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if ".layers." in name and p.dim() >= 2 and not p.requires_grad and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, fmt))
    return reference.to(device)


def _n_packed(model: torch.nn.Module) -> int:
    return sum(s.packed is not None for scope in _find_engine(model).scopes for s in scope.slots)


def _train(model: torch.nn.Module, batches: list[torch.Tensor], *, wrapped: bool, mode: str,
           device: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AdamW steps; `mode` picks the path: one backward per step, two accumulated micro-batches,
    backward_and_step (the wrapped model only: the reference steps after backward), or bf16
    autocast (the wrapped model computes in Policy(compute_dtype=bf16))."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    micro = 2 if mode == "accumulation" else 1
    losses, grads = [], {}
    for ids in batches:
        for k in range(micro):
            part = ids[k::micro]
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mode == "compute_dtype"):
                loss = model(input_ids=part, labels=part).loss / micro
            if mode == "backward_and_step" and wrapped:
                offtensor.backward_and_step(loss, opt)
                offtensor.wait_for_steps()
            else:
                loss.backward()
                if k == micro - 1:
                    opt.step()
            losses.append(host(loss))
        grads = {n: host(p.grad) for n, p in model.named_parameters() if p.requires_grad}
        opt.zero_grad()
    return torch.stack(losses), grads


MODES = ["plain", "hf_checkpointing", "backward_and_step", "accumulation", "vram_budget", "compute_dtype"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("device", devices)
def test_peft_lora_on_a_compressed_base_trains_like_the_resident_model(device, arch, fmt, mode):
    layers = 5 if mode == "vram_budget" else 3
    model = _lora(arch, checkpointing=mode == "hf_checkpointing", layers=layers).train()
    reference = _compressed_reference(model, fmt, device)
    policy: dict = {"frozen_format": fmt}
    if mode == "vram_budget":  # layers of about 152 KiB: streaming room (3 of them) plus one kept
        policy["vram_budget"] = 620 * 1024
        policy["layout"] = "spread"  # the loads asserted below are the byte layout's
    if mode == "compute_dtype":  # fp32 masters, bf16 device copies (dequantized in fp32, cast)
        policy["compute_dtype"] = torch.bfloat16
    offtensor.wrap(model, device=device, policy=offtensor.Policy(**policy))
    model.to(device)
    assert _n_packed(model) == layers * 5  # q, o, gate, up, down of each layer (k, v: below MIN_NUMEL)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=gen).to(device) for _ in range(3)]
    losses, grads = _train(model, batches, wrapped=True, mode=mode, device=device)
    expected, ref_grads = _train(reference, batches, wrapped=False, mode=mode, device=device)
    # bf16 autocast: the wrapped model's LoRA matrices compute as bf16 device copies, the
    # reference's are cast by autocast; their gradients differ in the last bf16 bit, also
    # without compression: bf16 tolerances then, on the CPU too.
    tol = tolerances("cuda", torch.bfloat16) if mode == "compute_dtype" else tolerances(device)
    torch.testing.assert_close(losses, expected, **tol)
    assert grads.keys() == ref_grads.keys() and any("lora_B" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m, name=name: f"{name}: {m}", **tol)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(host(p), host(r), msg=lambda m, name=name: f"{name}: {m}", **tol)
    if mode == "vram_budget":
        assert [s.kept for s in offtensor.summary(model).scopes] == [True, False, False, False, False]
    assert_all_scopes_offloaded(model)


# ---- merging adapters into a compressed base ---------------------------------------------
# PEFT merges with `base.weight.data += delta` (Python: get `.data`, add in place, set `.data`):
# on a compressed parameter the getter unpacks and the setter requantizes, so the merged base
# holds quantize(W + delta). Unmerging subtracts delta from that and requantizes again: the base
# does not come back to W (docs/design.md, Limits: PEFT's merge_and_unload).


def _requantize_bases(model: torch.nn.Module, fmt: str) -> None:
    """What the compressed model does on a write: the base matrices hold their requantized values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() >= 2 and not p.requires_grad and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, fmt))


@pytest.mark.parametrize("held", ["streamed", "vram_budget", "no_offload"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("device", devices)
def test_peft_merge_into_a_compressed_base_requantizes_and_leaves_no_stale_copy(device, fmt, held):
    """merge_adapter / unmerge_adapter / merge_and_unload on a compressed base: each write
    requantizes the base (the reference does the same in full precision, then quantizes), and a
    device copy kept across the write (a scope kept by the budget, or held by no_offload) is not
    used afterwards. docs/design.md, Limits: merge where the masters are (`model.to("cpu")` first)."""
    model = _lora("llama").eval()
    reference = _compressed_reference(model, fmt, "cpu")
    budget = {"vram_budget": 10 * 2**20} if held == "vram_budget" else {}  # every layer kept
    offtensor.wrap(model, device=device, policy=offtensor.Policy(frozen_format=fmt, **budget))
    model.to(device)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    original = q.base_layer.weight.detach().clone()
    ctx = offtensor.no_offload(model) if held == "no_offload" else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        before = model(input_ids=ids.to(device)).logits
        tol = tolerances(device)
        torch.testing.assert_close(host(before), reference(input_ids=ids).logits, **tol)
        if held != "streamed":  # the layers' device copies outlive the forward
            assert all(s.state is offtensor.ScopeState.RESIDENT for s in offtensor.summary(model).scopes)
        model.to("cpu")  # (a no-op on the CPU) merge where the masters are
        delta = q.get_delta_weight("default")
        model.merge_adapter()
        reference.merge_adapter()
        _requantize_bases(reference, fmt)
        model.to(device)
        assert torch.equal(q.base_layer.weight.detach(), quantize_dequantize(original + delta, fmt))
        merged = model(input_ids=ids.to(device)).logits
        torch.testing.assert_close(host(merged), reference(input_ids=ids).logits, **tol)
        assert not torch.equal(merged, before)  # the merged model computes with the new bases

        model.to("cpu")
        model.unmerge_adapter()
        reference.unmerge_adapter()
        _requantize_bases(reference, fmt)
        model.to(device)
        unmerged = q.base_layer.weight.detach()
        assert torch.equal(unmerged, quantize_dequantize(quantize_dequantize(original + delta, fmt) - delta, fmt))
        assert not torch.equal(unmerged, original)  # lossy: the base does not come back (docs/design.md, Limits)
        torch.testing.assert_close(host(model(input_ids=ids.to(device)).logits), reference(input_ids=ids).logits,
                                   **tol)

        merged_model = model.to("cpu").merge_and_unload().to(device)
        plain = reference.merge_and_unload()
        _requantize_bases(plain, fmt)
        assert offtensor.is_wrapped(merged_model)
        assert type(merged_model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        torch.testing.assert_close(host(merged_model(input_ids=ids.to(device)).logits), plain(input_ids=ids).logits,
                                   **tol)
    assert_all_scopes_offloaded(merged_model)
