"""Races between streams: the offloaded model must give the same results when one stream runs
far behind the others. A missing event wait (compute reading weights before their copy lands,
a copy overwriting memory compute still reads, a gradient buffer freed before its copy to the
host) shows up here as wrong numbers, where a fast, idle GPU would hide it."""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    mlp_of_blocks,
    reference_then_offload,
    requires_cuda,
    step_both,
    tiny_qwen3_moe,
    tolerances,
)

import offtensor

# About 10 ms of GPU time per call at H100/H200 clocks: far longer than a block's kernels.
_SLEEP_CYCLES = 20_000_000


def _slow_down(model, which: str) -> None:
    """Enqueue a long sleep on one stream at every block boundary (forward, recompute and
    backward), so that stream falls behind the others."""
    engine = model._offtensor_engine

    def stream():
        if which == "compute":
            return torch.cuda.current_stream()
        return {"h2d": engine.streams.h2d, "d2h": engine.streams.d2h, "cast": engine.streams.cast}[which]()

    def sleep(*_):
        with torch.cuda.stream(stream()):
            torch.cuda._sleep(_SLEEP_CYCLES)

    def on_outputs(module, args, output):
        sleep()
        if output.requires_grad:
            output.register_hook(lambda grad: sleep())  # in backward, before the block's ops

    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: sleep())
        block.register_forward_hook(on_outputs)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("slow", ["compute", "h2d", "d2h"])
def test_training_matches_unwrapped_model_when_one_stream_lags(slow, checkpoint):
    model = mlp_of_blocks(n_blocks=5, hidden=256, checkpoint=checkpoint)
    reference = reference_then_offload(model, "cuda")
    _slow_down(model, slow)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    tol = tolerances("cuda")
    for _ in range(3):
        for _micro in range(2):  # accumulation: old grads travel host->device too
            x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 4, device="cuda")
            out = model(x)
            ref_out = reference(x)
            torch.testing.assert_close(out, ref_out, **tol)
            F.mse_loss(out, y).backward()
            F.mse_loss(ref_out, y).backward()
        step_both(model, reference, opt, ref_opt, tol)
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("slow", ["compute", "h2d"])
def test_inference_matches_unwrapped_model_when_one_stream_lags(slow):
    model = mlp_of_blocks(n_blocks=5, hidden=256)
    reference = reference_then_offload(model, "cuda")
    _slow_down(model, slow)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 8, device="cuda")
            torch.testing.assert_close(model(x), reference(x), **tolerances("cuda"))


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("slow", ["compute", "h2d", "cast"])
def test_compressed_inference_matches_when_one_stream_lags(slow, monkeypatch):
    """Converting loads (Policy(frozen_format)) dequantize chunk by chunk on the cast stream:
    compute must wait for each chunk's conversion, the conversion for its chunk's copy."""
    import offtensor
    import offtensor.scopes.loading as loading_module
    from offtensor.storage.compress import quantize_dequantize

    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 64 * 1024)  # several chunks per block
    model = mlp_of_blocks(n_blocks=5, hidden=256, dtype=torch.bfloat16).requires_grad_(False)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for block in reference.blocks:
            for p in block.parameters():
                if p.dim() == 2:
                    p.copy_(quantize_dequantize(p, "fp8"))
    reference.cuda()
    offtensor.wrap(model, device="cuda", policy=offtensor.Policy(frozen_format="fp8"))
    model.cuda()
    _slow_down(model, slow)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("slow", ["compute", "h2d", "cast"])
def test_cast_training_with_deferred_steps_matches_when_one_stream_lags(slow, monkeypatch):
    """fp32 masters cast to bf16 on the device (Policy(cast="device")), chunk by chunk, with
    backward_and_step holding loads back for deferred steps: the same numbers as a model that
    casts by hand."""
    from torch.func import functional_call

    import offtensor
    import offtensor.scopes.loading as loading_module

    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 64 * 1024)
    model = mlp_of_blocks(n_blocks=5, hidden=256)

    def everything(name, module):
        return name in ("input", "head") or re.fullmatch(r"blocks\.\d+", name) is not None

    reference = reference_then_offload(
        model, "cuda", everything, policy=offtensor.Policy(compute_dtype=torch.bfloat16, cast="device"))
    _slow_down(model, slow)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    tol = tolerances("cuda", torch.bfloat16)
    for _ in range(4):
        x = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(16, 4, device="cuda")
        out = model(x)
        ref_params = {n: p.to(torch.bfloat16) for n, p in reference.named_parameters()}
        ref_out = functional_call(reference, ref_params, (x,))
        torch.testing.assert_close(out, ref_out, **tol)
        offtensor.backward_and_step(F.mse_loss(out.float(), y), opt, zero_grad=True)
        F.mse_loss(ref_out.float(), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.cuda
@requires_cuda
def test_streams_switch_record_and_wait_as_torch_cuda_does():
    # Note [stream calls without Python wrappers] (scopes/streams.py): the C calls give the
    # streams and events torch.cuda's wrappers would, and a wait orders what follows it.
    from offtensor.scopes.streams import Streams

    streams = Streams(torch.device("cuda", torch.cuda.current_device()))
    user = torch.cuda.Stream()
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(user):  # the caller's own current stream is the compute stream
        assert streams.compute() == torch.cuda.current_stream() == user
        assert type(streams.compute()) is torch.cuda.Stream
        h2d = streams.h2d()
        with streams.on(h2d):
            assert torch.cuda.current_stream() == h2d and streams.switched_from == user
            torch.cuda._sleep(_SLEEP_CYCLES)
            x.fill_(1)
        assert torch.cuda.current_stream() == user and streams.switched_from is None
        done = streams.record(h2d)
        assert type(done) is torch.cuda.Event and not done.query()  # the sleep still runs
        streams.wait(user, done)
        y = x * 2  # on the caller's stream, after the fill
    torch.cuda.synchronize()
    assert done.query() and torch.equal(y, torch.full_like(x, 2))


@pytest.mark.cuda
@requires_cuda
def test_a_release_after_an_interrupt_before_compute_waits_for_expert_copies_waits_for_them(monkeypatch):
    """Note [copies an interrupt left] (scopes/streams.py): a KeyboardInterrupt after a routed
    expert's rows are enqueued on a lagging copy stream and before compute waits for them. The
    release that follows frees the scope's buffer only after that copy has run on the device
    (before: at once, while the copy was still to write it), and the next forward matches the
    plain model."""
    from offtensor.scopes import device_buffer
    from offtensor.scopes.experts import ExpertRows

    model = tiny_qwen3_moe().to(torch.bfloat16)  # grouped_mm's CUDA kernels take bf16
    reference = reference_then_offload(model, "cuda")
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()
    assert any(s.experts is not None for scope in model._offtensor_engine.scopes for s in scope.slots)
    streams = model._offtensor_engine.streams
    copied: list[torch.cuda.Event] = []  # recorded on the copy stream after the interrupted copy
    ran_before_free: list[bool] = []
    real_copy, real_wait, real_free = ExpertRows._copy, streams.wait, device_buffer.DeviceBuffer.free

    def slow_copy(self, experts):
        with torch.cuda.stream(streams.h2d()):
            torch.cuda._sleep(5 * _SLEEP_CYCLES)  # the copy lands about 50 ms later
        real_copy(self, experts)

    def wait(stream, event):
        if sys._getframe(1).f_code.co_name == "_copy":  # ExpertRows._copy, once
            del streams.wait
            copied.append(torch.cuda.Event())
            copied[0].record(streams.h2d())
            raise KeyboardInterrupt
        real_wait(stream, event)

    def free(self, slots):
        if copied and not ran_before_free:  # the first free after the interrupt
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream())
            freed.synchronize()
            ran_before_free.append(copied[0].query())
        real_free(self, slots)

    with torch.no_grad():
        model(ids)  # learns the orders: the next forward copies the routed experts' rows
        torch.cuda.synchronize()
        monkeypatch.setattr(ExpertRows, "_copy", slow_copy)
        monkeypatch.setattr(device_buffer.DeviceBuffer, "free", free)
        streams.wait = wait
        with pytest.raises(KeyboardInterrupt):
            model(ids)
        assert copied, "the interrupt did not come"
        out = model(ids).logits
        assert ran_before_free == [True], "the buffer was freed before the copy into it ran"
        torch.testing.assert_close(out, reference(ids).logits, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


def _write_through_an_alias(weight: torch.Tensor, how: str) -> None:
    """A write no op on the parameter carries out: the host writes its master at once."""
    if how == "detach":
        weight.detach().mul_(2.0)
    elif how == "view":
        weight.detach()[0].fill_(0.5)
    else:
        weight.data.mul_(2.0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("block", [0, 2], ids=["first_block", "last_block"])
@pytest.mark.parametrize("how", ["detach", "view", "data"])
def test_a_write_through_an_alias_right_after_the_forward_leaves_the_forward_as_it_was(how, block):
    """Note [a write through an alias may follow at once] (engine/writes.py): the copy stream lags,
    so when the forward returns on the host its copies have not read the masters yet; a write
    through `p.detach()` or `p.data` then must not reach them. Regression: the forward computed
    with the written values (the plain model's forward, stream-ordered, keeps the old ones)."""
    model = mlp_of_blocks(n_blocks=3, hidden=256)
    reference = reference_then_offload(model, "cuda")
    x = torch.randn(4, 8, device="cuda")
    model(x)  # learns the order
    h2d = model._offtensor_engine.streams.h2d()

    def lag(module, args):
        with torch.cuda.stream(h2d):
            torch.cuda._sleep(_SLEEP_CYCLES)  # before every copy of this forward

    model.register_forward_pre_hook(lag, prepend=True)
    torch.cuda.synchronize()
    outputs = []
    with torch.no_grad():
        for m in (reference, model):
            outputs.append(m(x))
            _write_through_an_alias(m.blocks[block].fc1.weight, how)
    torch.testing.assert_close(outputs[1], outputs[0], **tolerances("cuda"))
    torch.testing.assert_close(model(x), reference(x), **tolerances("cuda"))  # the written weights


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("slow", ["compute", "h2d"])
@pytest.mark.parametrize("block", [0, 2], ids=["first_block", "last_block"])
@pytest.mark.parametrize("policy", [None, offtensor.Policy(vram_budget=2**30)], ids=["streamed", "kept"])
@pytest.mark.parametrize("how", ["detach", "view", "data"])
def test_a_write_between_forward_and_backward_differentiates_as_unwrapped_when_one_stream_lags(
        how, policy, block, slow):
    """tests/optim/test_training_loop_features.py's write between forward and backward (checkpointed
    blocks, non-reentrant), with one stream lagging: the forward and the backward see the values
    the unwrapped model's do. Regression: on a busy GPU that test failed now and then, the
    forward's copy reading the written master (Note [a write through an alias may follow at once]
    in engine/writes.py)."""
    model = mlp_of_blocks(checkpoint="non_reentrant")
    reference = reference_then_offload(model, "cuda", policy=policy)
    _slow_down(model, slow)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 4, device="cuda")
    for m in (reference, model):  # a first step: the order is learned
        F.mse_loss(m(x), y).backward()
        m.zero_grad()
    losses = []
    for m in (reference, model):
        losses.append(F.mse_loss(m(x), y))
        _write_through_an_alias(m.blocks[block].fc1.weight, how)
        losses[-1].backward()
    torch.testing.assert_close(losses[1], losses[0], **tolerances("cuda"))
    assert_grads_match(model, reference, **tolerances("cuda"))


@pytest.mark.cuda
@requires_cuda
def test_the_timed_copy_leaves_memory_compute_just_freed_to_the_kernels_still_reading_it():
    """`layout="timed"` times one copy into a buffer allocated on compute, written from the copy
    stream. The caching allocator may hand it memory compute freed a moment ago whose last
    readers are still queued: the copy must wait for them. Regression: it wrote at once, and a
    queued read on compute saw the copied bytes."""
    from offtensor.budget.layout import copy_ms_per_byte

    n = 64 << 20
    src = torch.full((n,), 7, dtype=torch.uint8).pin_memory()
    x = torch.full((n,), 3, dtype=torch.uint8, device="cuda")
    h2d = torch.cuda.Stream()
    with torch.cuda.stream(h2d):
        x.clone().copy_(src, non_blocking=True)  # the first launch of a kernel may wait for the device
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    torch.cuda._sleep(5 * _SLEEP_CYCLES)  # compute lags by about 50 ms
    y = x.clone()  # queued behind the sleep
    del x  # its memory goes back to compute's pool now, before the clone has read it
    copy_ms_per_byte(src, torch.device("cuda"), h2d)
    assert torch.equal(y, torch.full_like(y, 3))
