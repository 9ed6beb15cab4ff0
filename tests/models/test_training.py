"""Training features: fp32 masters with low-precision compute, optimizer overlap, LoRA/frozen
bases (Policy.param_filter), gradient buffers reused across steps."""

from __future__ import annotations

import contextlib
import copy
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    reference_then_offload,
    small_llama,
    step_both,
    tolerances,
    unwrapped_reference,
)
from torch.func import functional_call

import offtensor
from offtensor.scopes.scope import Scope


def _batches(device: str, n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(6, 8, device=device, dtype=dtype), torch.randn(6, 4, device=device, dtype=dtype))
            for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Policy(compute_dtype=...): fp32 masters, bf16 device copies
# --------------------------------------------------------------------------------------------


def _hand_cast_forward(reference: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference does by hand what compute_dtype does: cast each fp32 weight to `dtype`
    for the op; autograd casts the gradient back to fp32 for the master."""
    params = {n: p.to(dtype) for n, p in reference.named_parameters()}
    return functional_call(reference, params, (x,))


def _everything(name: str, module: nn.Module) -> bool:
    return name in ("input", "head") or re.fullmatch(r"blocks\.\d+", name) is not None


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("cast", ["device", "host"])
@pytest.mark.parametrize("device", devices)
def test_compute_dtype_matches_a_reference_that_casts_by_hand(device, cast, overlap, monkeypatch):
    """With backward_and_step, cast="device" loads convert chunk by chunk (Note [progressive
    loads]) while deferred optimizer steps hold copies back: every load still reads the
    stepped masters."""
    import offtensor.scopes.loading as loading_module

    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 512)  # a chunk per matrix or two
    model = mlp_of_blocks()
    reference = unwrapped_reference(model, device)
    offload(model, device, _everything, policy=offtensor.Policy(compute_dtype=torch.bfloat16, cast=cast))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device, torch.bfloat16)
    for x, y in _batches(device, 4, torch.bfloat16):
        out = model(x)
        ref_out = _hand_cast_forward(reference, x, torch.bfloat16)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref_out, **tol)
        F.mse_loss(ref_out.float(), y.float()).backward()
        if overlap:
            offtensor.backward_and_step(F.mse_loss(out.float(), y.float()), opt, zero_grad=True)
            ref_opt.step()
            ref_opt.zero_grad()
            continue
        F.mse_loss(out.float(), y.float()).backward()
        for _, p in offloaded_parameters(model):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        step_both(model, reference, opt, ref_opt, tol)
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_compute_dtype_device_copy_has_the_compute_dtype_size(device):
    model = mlp_of_blocks()
    offload(model, device, policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    seen = {}

    def record(module, args):
        for s in offtensor.summary(model).scopes:
            if s.name == "blocks.1":
                seen["device"], seen["host"] = s.device_bytes, s.host_bytes

    model.blocks[1].register_forward_pre_hook(record)  # runs after offtensor loaded the scope
    with torch.no_grad():
        model.input.to(torch.bfloat16), model.head.to(torch.bfloat16)
        model(torch.randn(2, 8, device=device, dtype=torch.bfloat16))
    def padded(nbytes: int) -> int:  # each parameter starts 256-byte aligned
        return -(-nbytes // 256) * 256

    params = list(model.blocks[1].parameters())
    assert seen["device"] == sum(padded(p.numel() * 2) for p in params), seen
    assert seen["host"] == sum(padded(p.numel() * 4) for p in params), seen


def test_host_cast_refreshes_after_optimizer_step_and_misses_nothing_written_through_the_parameter():
    model = mlp_of_blocks()
    offload(model, "cpu", policy=offtensor.Policy(compute_dtype=torch.bfloat16, cast="host"))
    x = torch.randn(2, 8).bfloat16()
    with torch.no_grad():
        model.input.bfloat16(), model.head.bfloat16()
        before = model(x)
        model.blocks[0].fc1.weight.add_(1.0)  # through the parameter: seen
        after = model(x)
    assert not torch.equal(before, after)


WRITES_THAT_BYPASS_THE_PARAMETER = {
    "data_add": lambda p: p.data.add_(1.0),
    "view_fill": lambda p: p[0].fill_(3.0),
    "detach_mul": lambda p: p.detach().mul_(-2.0),
    "through_the_parameter": lambda p: p.mul_(0.5),
}


@pytest.mark.parametrize("write", list(WRITES_THAT_BYPASS_THE_PARAMETER))
@pytest.mark.parametrize("cast", ["host", "device"])
@pytest.mark.parametrize("device", devices)
def test_a_cast_copy_follows_every_write_to_the_master(device, cast, write):
    """Policy(cast="host") streams a bf16 shadow cast from the fp32 masters, re-cast only when
    they change: a write that no op on the parameter sees (through `p.data`, a view, a detached
    alias) left the shadow stale and the next forward computing with the old weights, a silent
    wrong answer (0.47 off here before the fix)."""
    model = mlp_of_blocks()
    reference = copy.deepcopy(model)
    offload(model, device, policy=offtensor.Policy(compute_dtype=torch.bfloat16, cast=cast))
    x = torch.randn(2, 8, device=device)
    apply = WRITES_THAT_BYPASS_THE_PARAMETER[write]
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        model(x)
        for _ in range(2):  # a second write after a load that refreshed the shadow
            for m in (model, reference):
                apply(m.blocks[1].fc1.weight)
            expected = copy.deepcopy(reference).to(device, torch.bfloat16)(x.bfloat16())
            torch.testing.assert_close(model(x).float(), expected.float(), rtol=0, atol=0)


ALIASES_OF_THE_MASTER = {
    "data": lambda p: p.data,  # a version counter of its own
    "detach": lambda p: p.detach(),
    "view": lambda p: p[0],
}


@pytest.mark.every_case  # the failing cases (cast host, p.data) must run every day
@pytest.mark.parametrize("taken", ["before_the_first_forward", "after_the_first_forward"])
@pytest.mark.parametrize("alias", list(ALIASES_OF_THE_MASTER))
@pytest.mark.parametrize("cast", ["host", "device"])
@pytest.mark.parametrize("device", devices)
def test_a_cast_copy_follows_writes_through_an_alias_kept_across_forwards(device, cast, alias, taken):
    """An alias of a master kept across forwards and written after a load refreshed the
    Policy(cast="host") shadow: `p.data` has a version counter of its own, and taking it marked
    the shadow stale only until the next load re-cast it, so a write through it after that load
    left every later forward computing with the old bf16 shadow (0.98 off here before the fix)."""
    model = mlp_of_blocks()
    reference = copy.deepcopy(model)
    offload(model, device, policy=offtensor.Policy(compute_dtype=torch.bfloat16, cast=cast))
    x = torch.randn(2, 8, device=device)
    take = ALIASES_OF_THE_MASTER[alias]
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        if taken == "after_the_first_forward":
            model(x)
        aliases = [take(m.blocks[1].fc1.weight) for m in (model, reference)]
        model(x)
        for _ in range(2):  # each write after a load that cast the shadow afresh
            for a in aliases:
                a.mul_(-3.0)
            expected = copy.deepcopy(reference).to(device, torch.bfloat16)(x.bfloat16())
            torch.testing.assert_close(model(x).float(), expected.float(), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# backward_and_step: the optimizer overlapped with backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pieces", ["per_scope", "per_param"])
@pytest.mark.parametrize("fused", [False, True], ids=["single_tensor", "fused"])
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_backward_and_step_equals_backward_then_step_with_grad_accumulation(device, checkpoint, fused, pieces,
                                                                            monkeypatch):
    """per_param: every parameter is a piece of its own, handed to the worker as soon as its
    gradient lands, before its scope's backward ends (Note [early handover])."""
    if pieces == "per_param":
        monkeypatch.setattr(offtensor.optim.overlap, "STEP_PIECE_BYTES", 1)
    model = mlp_of_blocks(n_blocks=4, checkpoint=checkpoint)
    reference = reference_then_offload(model, device)
    fused_ok = fused and device == "cpu"  # CUDA reference: fused kernels differ from CPU ones
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused_ok or None)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=fused_ok or None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    tol = tolerances(device)
    hook_grads = []
    model.blocks[1].fc1.weight.register_post_accumulate_grad_hook(lambda p: hook_grads.append(p.grad.clone()))
    for _ in range(3):
        micro = _batches(device, 3)
        for i, (x, y) in enumerate(micro):
            loss = F.mse_loss(model(x), y) / len(micro)
            if i < len(micro) - 1:
                loss.backward()
            else:
                report = offtensor.backward_and_step(loss, opt).wait()
            (F.mse_loss(reference(x), y) / len(micro)).backward()
        if pieces == "per_param":  # from the second backward on, single gradients are known
            assert report.early_pieces > 0, report
        ref_opt.step()
        assert_grads_match(model, reference, **tol)
        assert_params_match(model, reference, **tol)
        sched.step(), ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert len(hook_grads) == 9, "the user's post-accumulate-grad hook fires once per backward"
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("piece_bytes", [1, 2**30], ids=["piece_per_param", "piece_per_scope"])
@pytest.mark.parametrize("spare_threads", [0, 2])
def test_backward_and_step_worker_settings_change_the_pieces_not_the_result(spare_threads, piece_bytes):
    """spare_threads and piece_bytes tune the worker (the benchmark passes them); the steps are
    the same as backward then step, and piece_bytes sets how many optimizer steps it runs."""
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    handed = [p for _, p in offloaded_parameters(model)]
    tol = tolerances("cpu")
    for _ in range(2):
        x, y = _batches("cpu", 1)[0]
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, spare_threads=spare_threads,
                                             piece_bytes=piece_bytes).wait()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        assert_params_match(model, reference, **tol)
        opt.zero_grad()
        ref_opt.zero_grad()
    assert report.pieces == (len(handed) if piece_bytes == 1 else len(model.blocks)), report


@pytest.mark.parametrize("spare_threads", [1, 3])
def test_the_worker_leaves_spare_threads_unless_a_thread_waits_for_its_steps(spare_threads):
    """Note [worker threads]: a piece that starts while no thread waits for a step runs on
    all threads but `spare_threads` (the launching thread may need a core); one that starts
    while the caller is blocked waiting for the steps runs on every thread."""
    import threading

    model = offload(mlp_of_blocks(n_blocks=3), "cpu")
    reference = mlp_of_blocks(n_blocks=3)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    seen: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def record(*_):
        if threading.current_thread() is not threading.main_thread():
            seen.append(torch.get_num_threads())
            entered.set()
            assert release.wait(30)

    opt.register_step_pre_hook(record)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        x, y = _batches("cpu", 1)[0]
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, spare_threads=spare_threads,
                                             piece_bytes=1)
        assert entered.wait(30)  # the first piece took its threads before anything waited
        threading.Timer(0.3, release.set).start()
        report.wait()  # blocks: every later piece starts while this thread waits
        F.mse_loss(reference(x), y).backward()  # on as many threads: the same reductions
        ref_opt.step()
    finally:
        release.set()
        torch.set_num_threads(threads)
    assert len(seen) == report.pieces > 1
    assert seen[0] == 4 - spare_threads and set(seen[1:]) == {4}, seen
    assert report.all_thread_pieces == report.pieces - 1
    assert_params_match(model, reference, **tolerances("cpu"))


@pytest.mark.parametrize("kwargs, message", [
    ({"spare_threads": -1}, "spare_threads must be an int >= 0, got -1"),
    ({"piece_bytes": 0}, "piece_bytes must be an int >= 1, got 0"),
    ({"piece_bytes": 1.5}, "piece_bytes must be an int >= 1, got 1.5"),
])
def test_error_if_backward_and_step_worker_settings_are_invalid(kwargs, message):
    model = mlp_of_blocks(n_blocks=2)
    offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches("cpu", 1)[0]
    with pytest.raises(ValueError, match=re.escape(message)):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, **kwargs)


class UsedInTwoSegments(nn.Module):
    """Uses its weight once, or (split=True) in two reentrant checkpoint segments: then its
    gradient arrives in two parts, each in its own graph task."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return self.fc(x)
        h = torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=True)
        return torch.utils.checkpoint.checkpoint(self.fc, torch.tanh(h), use_reentrant=True)


def test_a_gradient_in_two_parts_after_early_handover_raises_and_the_model_stays_usable(monkeypatch):
    monkeypatch.setattr(offtensor.optim.overlap, "STEP_PIECE_BYTES", 1)
    model = BlockStack([UsedInTwoSegments(), UsedInTwoSegments()], 8, 8, 4)
    offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches("cpu", 1)[0]
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True).wait()
    model.blocks[1].split = True
    with pytest.raises(RuntimeError, match=r"'blocks\.1\.fc\.(weight|bias)' received another gradient"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True)
    offtensor.wait_for_steps()
    assert_all_scopes_offloaded(model)
    # backward_and_step no longer hands that parameter over before its scope's backward ends,
    # so it trains on, as loss.backward() and optimizer.step() do.
    reference = BlockStack([UsedInTwoSegments(), UsedInTwoSegments()], 8, 8, 4)
    reference.blocks[1].split = True
    reference.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for use_overlap in (True, False, True):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if use_overlap:
            offtensor.backward_and_step(loss, opt).wait()
        else:
            loss.backward()
            opt.step()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_match(model, reference)
    assert_all_scopes_offloaded(model)


def test_backward_and_step_reports_an_optimizer_error_on_the_calling_thread():
    model = mlp_of_blocks()
    offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(optimizer, args, kwargs):
        raise ValueError("optimizer exploded")

    opt.register_step_pre_hook(broken)
    x, y = _batches("cpu", 1)[0]
    with pytest.raises(ValueError, match="optimizer exploded"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
    # The model stays usable afterwards.
    opt._optimizer_step_pre_hooks.clear()
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Frozen bases and LoRA: Policy(param_filter=offtensor.frozen_only)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_frozen_only_offloads_frozen_weights_and_leaves_trainable_ones_as_plain_parameters(device):
    model = mlp_of_blocks()
    for block in model.blocks:
        block.fc1.weight.requires_grad_(False)
        block.fc2.weight.requires_grad_(False)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(param_filter=offtensor.frozen_only))
    offloaded = dict(offloaded_parameters(model))
    assert set(offloaded) == {f"blocks.{i}.{n}.weight" for i in range(3) for n in ("fc1", "fc2")}
    assert model.blocks[0].fc1.bias.device.type == device and not isinstance(
        model.blocks[0].fc1.bias, offtensor.OffloadedParameter
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for x, y in _batches(device, 3):
        F.mse_loss(model(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        opt.step(), ref_opt.step()
        assert_grads_match(model, reference, **tolerances(device))
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_match(model, reference, **tolerances(device))
    for p in offloaded.values():
        assert p._ot.host_grad is None, "frozen weights must never travel device-to-host"


def test_param_filter_that_keeps_nothing_is_an_error():
    model = mlp_of_blocks()
    with pytest.raises(ValueError, match="param_filter kept none"):
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(param_filter=offtensor.frozen_only))


@pytest.mark.parametrize("device", devices)
def test_peft_lora_model_with_offloaded_frozen_base_matches_unwrapped(device):
    peft = pytest.importorskip("peft")
    base = small_llama(checkpointing=False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, lora)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(param_filter=offtensor.frozen_only))
    offloaded = dict(offloaded_parameters(model))
    assert offloaded and all(not p.requires_grad for p in offloaded.values())
    assert all("lora_" not in name for name in offloaded)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), device=device)
    tol = tolerances(device)
    for _ in range(3):
        out = model(input_ids=ids, labels=ids)
        ref_out = reference(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, ref_out.logits, **tol)
        out.loss.backward()
        ref_out.loss.backward()
        assert_grads_match(model, reference, **tol)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_match(model, reference, **tol)


@pytest.mark.parametrize("device", devices)
def test_peft_merge_and_unload_of_a_wrapped_lora_model_stays_wrapped_and_matches_unwrapped(device):
    """Regression: the base model merge_and_unload returns holds the offloaded parameters, but
    is_wrapped said False and summary/unwrap refused it (the engine sat on the PeftModel)."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(small_llama(checkpointing=False), lora)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(param_filter=offtensor.frozen_only))
    ids = torch.randint(0, 64, (2, 12), device=device)

    # PEFT merges with `weight.data += delta`: on the host, where the masters are (docs/design.md, Limits).
    merged = model.to("cpu").merge_and_unload().to(device)
    ref_merged = reference.merge_and_unload()

    assert offtensor.is_wrapped(merged) and offtensor.is_wrapped(model)
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    offloaded = dict(offloaded_parameters(merged))
    assert "model.layers.0.self_attn.q_proj.weight" in offloaded
    assert_params_match(merged, ref_merged, **tolerances(device))
    assert [s.name for s in offtensor.summary(merged).scopes] == [s.name for s in offtensor.summary(model).scopes]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits,
                                   **tolerances(device))
    assert_all_scopes_offloaded(merged)

    offtensor.unwrap(merged)

    assert not offtensor.is_wrapped(merged) and not offtensor.is_wrapped(model)
    assert all(type(p) is torch.nn.Parameter for p in merged.parameters())
    merged.to(device)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits,
                                   **tolerances(device))


def test_error_if_unwrap_is_called_on_a_part_holding_only_some_scopes():
    model = offload(mlp_of_blocks(), "cpu")

    with pytest.raises(ValueError, match=r"holds 1 of the 3 scopes.*'blocks\.0'.*BlockStack"):
        offtensor.unwrap(model.blocks[1])

    assert offtensor.is_wrapped(model)
    assert [s.name for s in offtensor.summary(model.blocks[1]).scopes] == ["blocks.1"]


# --------------------------------------------------------------------------------------------
# Gradient buffers
# --------------------------------------------------------------------------------------------


def _gradient_path(path: str) -> contextlib.AbstractContextManager:
    """`copied`: the gradients are copied into the host buffers, as from a GPU (the side streams
    lag on the CPU: Note [lazy streams] in tests/lazy_streams.py); `adopted`: the CPU's own
    gradients become `.grad` (Note [gradients computed on the host] in engine/host_grads.py)."""
    if os.environ.get("OFFTENSOR_LAZY_STREAMS") == "1":  # every test's streams lag already
        if path == "adopted":
            pytest.skip("with lagging streams the gradients are copied, never adopted")
        return contextlib.nullcontext()
    if path == "adopted":
        return contextlib.nullcontext()
    from lazy_streams import lazy_streams

    return lazy_streams()


@pytest.mark.parametrize("path", ["copied", "adopted"])
def test_host_grad_buffers_are_reused_across_steps_not_reallocated(path):
    # Regression: a fresh (pinned) host buffer per step costs an allocation and, on CUDA, a
    # page-locking call on the hot path. The CPU's own gradients allocate none: each is `.grad`.
    with _gradient_path(path):
        model = offload(mlp_of_blocks(), "cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        pointers, slots = [], [p._ot for _, p in offloaded_parameters(model)]
        for x, y in _batches("cpu", 4):
            F.mse_loss(model(x), y).backward()
            pointers.append({n: p.grad.data_ptr() for n, p in offloaded_parameters(model)})
            opt.step()
            opt.zero_grad(set_to_none=True)
    if path == "copied":
        assert all(p == pointers[0] for p in pointers[1:])
    else:
        assert all(slot.grad_buffer is None for slot in slots)


@pytest.mark.parametrize("path", ["copied", "adopted"])
@pytest.mark.parametrize("kept", ["the gradient", "a view of it", "a row of it", "nothing"])
def test_a_gradient_the_user_kept_after_zero_grad_keeps_its_values(kept, path):
    """After zero_grad(set_to_none=True) the next backward reuses the pinned buffer only if no
    tensor on it is held outside offtensor: a kept `p.grad`, a view or a slice of it keeps
    the values of its step, as with a plain parameter."""
    with _gradient_path(path):
        _gradients_kept_after_zero_grad(kept, path)


def _gradients_kept_after_zero_grad(kept: str, path: str) -> None:
    model = mlp_of_blocks()
    reference = copy.deepcopy(model)
    offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    held, ref_held, pointers = [], [], []
    for x, y in _batches("cpu", 3):
        for m, o, h in ((model, opt, held), (reference, ref_opt, ref_held)):
            F.mse_loss(m(x), y).backward()
            w = m.blocks[0].fc1.weight
            if m is model:
                pointers.append(w.grad.data_ptr())
            if kept != "nothing":
                g = w.grad
                h.append({"the gradient": g, "a view of it": g.view(-1), "a row of it": g[1]}[kept])
            h.append(w.grad.clone())
            o.step()
            o.zero_grad(set_to_none=True)
    for mine, theirs in zip(held, ref_held, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    if path == "adopted":
        return  # autograd's own tensors, allocated as for the plain model
    if kept == "nothing":
        assert pointers[1:] == pointers[:1] * 2  # reused
    else:
        assert len(set(pointers)) == 3  # a new buffer each time one was kept


@pytest.mark.parametrize("path", ["copied", "adopted"])
@pytest.mark.parametrize("kept", ["the gradient", "the gradient, as another tensor's .grad only"])
def test_a_gradient_kept_from_a_reused_buffer_keeps_its_values(kept, path):
    """A `p.grad` handed out from a buffer reused since an earlier step, then kept past
    zero_grad(set_to_none=True), is seen as held, also when only C++ holds it (another
    tensor's `.grad`): the next backward writes a new buffer, not the tensor the user holds.
    Each backward hands out a tensor of its own on the buffer, which the storage's use count
    sees (Note [one gradient's host work]); handed out itself, the buffer was overwritten here."""
    with _gradient_path(path):
        _gradients_kept_from_reused_buffers(kept)


def _gradients_kept_from_reused_buffers(kept: str) -> None:
    model = mlp_of_blocks()
    reference = copy.deepcopy(model)
    offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    held, ref_held = [], []
    for step, (x, y) in enumerate(_batches("cpu", 5)):
        for m, o, h in ((model, opt, held), (reference, ref_opt, ref_held)):
            F.mse_loss(m(x), y).backward()
            if step in (1, 3):  # buffers allocated a step before: step 0's, step 2's
                g = m.blocks[0].fc1.weight.grad
                if kept == "the gradient":
                    h.append(g)
                else:
                    holder = torch.zeros_like(g, requires_grad=True)
                    holder.grad = g  # held by the holder's autograd metadata, not by Python
                    h.append(holder)
                del g
                h.append(m.blocks[0].fc1.weight.grad.clone())
            o.step()
            o.zero_grad(set_to_none=True)
    for mine, theirs in zip(held, ref_held, strict=True):
        if mine.requires_grad:
            mine, theirs = mine.grad, theirs.grad
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("device", devices)
def test_fused_adamw_steps_wrapped_parameters_like_plain_cpu_parameters(device):
    model = mlp_of_blocks()
    reference = copy.deepcopy(model)  # everything on the CPU: the optimizer's home
    offload(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        q.grad = torch.randn_like(q)
        p.grad = q.grad.clone().to(p.device)
    opt.step()
    ref_opt.step()
    ref_blocks = [q for n, q in reference.named_parameters() if n.startswith("blocks.")]
    for (name, p), q in zip(offloaded_parameters(model), ref_blocks, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)
        assert type(opt.state[p]["exp_avg"]) is torch.Tensor


@pytest.mark.parametrize("device", devices)
def test_hf_llama_with_fp32_masters_bf16_compute_and_checkpointing_trains_like_autocast(device):
    model = small_llama(checkpointing=True)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), device=device)
    for _ in range(3):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        # The reference: plain autocast over fp32 weights. It casts weights to bf16 only for the
        # ops autocast covers (matmuls); compute_dtype makes every weight bf16 (RMSNorm's
        # elementwise scale too), so the two agree to bf16 precision, not bit for bit; the exact
        # comparison is test_compute_dtype_matches_a_reference_that_casts_by_hand.
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        bf16 = tolerances("cuda", torch.bfloat16)
        torch.testing.assert_close(loss, ref_loss, **bf16)
        assert_grads_match(model, reference, **bf16)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for _, p in offloaded_parameters(model):
        assert p.dtype == torch.float32
    assert_all_scopes_offloaded(model)


def test_backward_and_step_reports_each_scope_stepped_once_wait_returns():
    model = offload(mlp_of_blocks(n_blocks=3), "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batches("cpu", 1)[0]
    report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt).wait()
    assert isinstance(report, offtensor.OverlapReport)
    assert sorted(s[0] for s in report.scopes) == ["blocks.0", "blocks.1", "blocks.2"]
    for _, queued, on_host, stepped in report.scopes:
        assert queued <= on_host <= stepped <= report.total_s
    assert report.rest_params == 4  # input and head: stepped after backward
    assert 0 < report.backward_s <= report.total_s


def _slow_steps(opt: torch.optim.Optimizer, seconds: float = 0.02) -> None:
    """Each partial optimizer step on the worker thread sleeps first: the deferred steps are
    still pending when backward_and_step returns (the calling thread's own steps do not sleep,
    so it does not wait as long as the worker, however slow the machine) and the next forward
    begins."""
    import threading
    import time

    def pause(*_):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)

    opt.register_step_pre_hook(pause)


def _pending(model: nn.Module) -> int:
    return sum(p._ot.step_pending for _, p in offloaded_parameters(model))


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_deferred_steps_finish_before_the_next_forward_uses_the_weights(device, checkpoint):
    model = mlp_of_blocks(n_blocks=4, checkpoint=checkpoint)
    reference = reference_then_offload(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _slow_steps(opt)
    tol = tolerances(device)
    pending_seen = 0
    for x, y in _batches(device, 4):
        out, ref_out = model(x), reference(x)
        torch.testing.assert_close(out, ref_out, **tol)  # the forward used the stepped weights
        offtensor.backward_and_step(F.mse_loss(out, y), opt, zero_grad=True)
        pending_seen += _pending(model)
        F.mse_loss(ref_out, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert pending_seen > 0, "no step was deferred: the test would not see a race"
    assert_params_match(model, reference, **tol)  # waits for the last steps
    assert all(p.grad is None for p in model.parameters())
    assert_all_scopes_offloaded(model)


def test_everything_that_reads_a_master_waits_for_its_deferred_step():
    model = mlp_of_blocks(n_blocks=3)
    reference = reference_then_offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.1)
    _slow_steps(opt, 0.05)
    x, y = _batches("cpu", 1)[0]
    for read in ("state_dict", "grad", "optimizer_state_dict", "data", "optimizer_step"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
        assert _pending(model) > 0
        sched.step()  # applies from the next step: the pending steps keep the old lr
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        if read == "state_dict":
            got = {k: v.clone() for k, v in model.state_dict().items()}
            for k, v in reference.state_dict().items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=0)
        elif read == "grad":
            for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        elif read == "optimizer_state_dict":
            state = opt.state_dict()["state"]
            for i, q in enumerate(reference.parameters()):
                torch.testing.assert_close(state[i]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"],
                                           rtol=0, atol=0)
        elif read == "data":
            for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
                torch.testing.assert_close(p.data.clone(), q.data, rtol=0, atol=0)
        else:  # a plain optimizer.step() by the user: after the deferred ones, so twice in all
            opt.step()
            ref_opt.step()
        assert _pending(model) == 0
        assert_params_match(model, reference, rtol=0, atol=0)
        opt.zero_grad(), ref_opt.zero_grad()
    assert_all_scopes_offloaded(model)


def test_an_error_in_a_deferred_step_is_raised_on_the_calling_thread_and_the_model_stays_usable():
    model = offload(mlp_of_blocks(n_blocks=3), "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    import threading

    def broken_on_worker(optimizer, args, kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("optimizer exploded")

    handle = opt.register_step_pre_hook(broken_on_worker)
    x, y = _batches("cpu", 1)[0]
    with pytest.raises(ValueError, match="optimizer exploded"):  # by the call or by wait()
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt).wait()
    assert _pending(model) == 0
    handle.remove()
    opt.zero_grad()
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True).wait()
    assert all(p.grad is None for p in model.parameters())
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("pieces", ["per_scope", "per_param"])
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_two_forwards_before_one_backward_and_step_give_the_full_gradient_step(checkpoint, pieces, monkeypatch):
    """A sum of two losses (contrastive, two inputs in one backward): under reentrant
    checkpointing each forward's backward is a graph task of its own, so a parameter gets two
    contributions; nothing may be stepped before both."""
    if pieces == "per_param":
        monkeypatch.setattr(offtensor.optim.overlap, "STEP_PIECE_BYTES", 1)
    model = mlp_of_blocks(checkpoint=checkpoint)
    reference = reference_then_offload(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in _batches("cpu", 3):
        def loss(m: nn.Module) -> torch.Tensor:
            return F.mse_loss(m(x), y) + F.mse_loss(m(2 * x), y)

        offtensor.backward_and_step(loss(model), opt, zero_grad=True)
        loss(reference).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("wrapped", ["model", "blocks"])
def test_a_training_step_after_an_exception_in_the_forward_releases_scopes_in_backward(wrapped, monkeypatch):
    """An exception late in the forward (the loss of a Hugging Face model, where out-of-memory
    errors happen; in the last scope when only the blocks are wrapped) must not leave the engine
    thinking every scope was called twice: the retried step still releases each scope after its
    backward, so at most a few are loaded at once."""
    model = mlp_of_blocks(n_blocks=6)
    reference = unwrapped_reference(model, "cpu")
    target = model if wrapped == "model" else model.blocks
    engine = offtensor.wrap(target, device="cpu")._offtensor_engine
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _batches("cpu", 1)[0]
    most_live = [0]
    load = Scope.load

    def counting_load(scope, **kwargs):
        load(scope, **kwargs)
        most_live[0] = max(most_live[0], len(engine.live))

    monkeypatch.setattr(Scope, "load", counting_load)

    def step(m: nn.Module, o: torch.optim.Optimizer):
        loss = F.mse_loss(m(x), y)
        if m is model:
            return offtensor.backward_and_step(loss, o).wait()
        loss.backward()
        o.step()
        return None

    step(model, opt), step(reference, ref_opt)
    fails = model.head if wrapped == "model" else model.blocks[-1].fc2
    failing = fails.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("OOM in the loss")))
    with pytest.raises(RuntimeError, match="OOM in the loss"):
        model(x)
    failing.remove()
    assert_all_scopes_offloaded(target)
    for _ in range(2):
        most_live[0] = 0
        opt.zero_grad(), ref_opt.zero_grad()
        report = step(model, opt)
        step(reference, ref_opt)
        assert most_live[0] <= 3, most_live  # computing, prefetched, kept for backward
        assert_params_match(model, reference)
    assert report.rest_params == 4, report  # input and head only: every scope went to the worker
    assert_all_scopes_offloaded(target)


def test_forwards_without_grad_between_steps_keep_the_optimizer_overlap():
    """Evaluation or generation between training steps (a reinforcement-learning loop) adds
    no gradient, so it must not make the next backward_and_step wait for the whole backward."""
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in _batches("cpu", 3):
        with torch.no_grad():
            model(x), model(2 * x)
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True).wait()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert report.rest_params == 4, report  # input and head: every scope went to the worker
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


def test_a_copy_taken_right_after_backward_and_step_has_the_stepped_weights():
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    _slow_steps(opt, 0.05)
    x, y = _batches("cpu", 1)[0]
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
    assert _pending(model) > 0
    copied = copy.deepcopy(model)  # an EMA copy
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    assert_params_match(copied, reference, rtol=0, atol=0)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_a_block_looped_more_often_than_the_order_limit_is_still_prefetched(checkpoint):
    """Recurrent-depth models call the same blocks dozens of times per forward: with the
    model's forward hooks delimiting passes, the learned order may be that long."""
    from offtensor.engine.schedule import ORDER_LIMIT

    class Looped(nn.Module):
        def __init__(self, loops: int) -> None:
            super().__init__()
            self.core = nn.ModuleList(ResidualBlock(16) for _ in range(2))
            self.loops = loops

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.loops):
                for block in self.core:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
            return x

    model = Looped(loops=ORDER_LIMIT + 4)
    reference = reference_then_offload(model, "cpu")
    engine = model._offtensor_engine
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    on_demand = []
    for _ in range(3):
        before = sum(s.loads_on_demand for s in engine.scopes)
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True).wait()
        on_demand.append(sum(s.loads_on_demand for s in engine.scopes) - before)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert on_demand[1:] == [0, 0], on_demand
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_an_optimizer_step_in_a_post_accumulate_grad_hook_acts_on_the_masters(device, monkeypatch):
    """Review finding: inside backward every op on an offloaded parameter got a device copy, so
    a per-parameter optimizer in a post-accumulate-grad hook ("optimizer in backward") made
    temporary copies and, on CUDA, created its state on the device beside CPU masters."""

    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device)
    copies = []
    real = Scope.temporary_copy
    monkeypatch.setattr(Scope, "temporary_copy", lambda *a: copies.append(a[1].name) or real(*a))
    inputs = [torch.randn(4, 8, device=device) for _ in range(2)]
    per_model = []
    for m in (model, reference):
        optimizers = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in m.parameters()}
        per_model.append(optimizers)

        def step(p, optimizers=optimizers):
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(step)
        for x in inputs:
            m(x).square().sum().backward()
    assert copies == []
    for p in model.blocks.parameters():
        assert all(t.device.type == "cpu" for t in per_model[0][p].state[p].values())
    assert_params_match(model, reference, **tolerances(device))
