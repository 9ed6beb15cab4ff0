"""Races between streams: the offloaded model must give the same results when one stream runs
far behind the others. A missing event wait (compute reading weights before their copy lands,
a copy overwriting memory compute still reads, a gradient buffer freed before its copy to the
host) shows up here as wrong numbers, where a fast, idle GPU would hide it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_params_match,
    mlp_of_blocks,
    reference_then_offload,
    requires_cuda,
    step_both,
    tolerances,
)

# About 10 ms of GPU time per call at H100/H200 clocks: far longer than a block's kernels.
_SLEEP_CYCLES = 20_000_000


def _slow_down(model, which: str) -> None:
    """Enqueue a long sleep on one stream at every block boundary (forward, recompute and
    backward), so that stream falls behind the others."""
    engine = model._offtensor_engine

    def stream():
        if which == "compute":
            return torch.cuda.current_stream()
        return engine.streams.h2d() if which == "h2d" else engine.streams.d2h()

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
