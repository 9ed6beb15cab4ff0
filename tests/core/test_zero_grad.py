"""Gradients equal the unwrapped model's wherever the training loop calls `zero_grad`.

Regression: with split scopes, the end-of-forward prefetch for backward fetched `p.grad` to the
device before backward started; a `zero_grad()` between forward and backward did not clear that
copy, and the next gradient came out as the sum of two steps' (no error, wrong training).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    mlp_and_reference,
    tolerances,
)

import offtensor

WHERE = ["before_forward", "between_forward_and_backward", "after_step"]


def _train(model, optimizer, batches, *, where: str, set_to_none: bool, overlapped: bool) -> None:
    """One optimizer step over `batches` micro-batches, `zero_grad` at `where`."""
    n = len(batches)
    for i, (x, y) in enumerate(batches):
        if where == "before_forward" and i == 0:
            optimizer.zero_grad(set_to_none=set_to_none)
        loss = F.mse_loss(model(x), y) / n
        if where == "between_forward_and_backward":
            optimizer.zero_grad(set_to_none=set_to_none)  # drops earlier micro-batches, as in plain PyTorch
        if overlapped and i == n - 1:
            offtensor.backward_and_step(loss, optimizer)
        else:
            loss.backward()
    if not overlapped:
        optimizer.step()
    if where == "after_step":
        optimizer.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("where", WHERE)
def test_grads_match_unwrapped_wherever_zero_grad_is_called(device, where, split, checkpoint, overlapped):
    model, reference = mlp_and_reference(device, split=split, checkpoint=checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device)
    for step in range(3):
        set_to_none = step % 2 == 0  # both ways in one loop
        micro = 2 if step == 1 else 1  # accumulation adds to a fetched old gradient
        batches = [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)) for _ in range(micro)]
        _train(model, opt, batches, where=where, set_to_none=set_to_none, overlapped=overlapped)
        _train(reference, ref_opt, batches, where=where, set_to_none=set_to_none, overlapped=False)
        offtensor.wait_for_steps()
        assert_grads_match(model, reference, **tol)
        assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_in_place_write_to_grad_between_forward_and_backward_is_seen(device):
    """Not only zero_grad: any in-place change of `p.grad` after the forward counts."""
    model, reference = mlp_and_reference(device, split=True, checkpoint="reentrant")
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
    for m in (model, reference):
        F.mse_loss(m(x), y).backward()
    for m in (model, reference):
        loss = F.mse_loss(m(x), y)
        with torch.no_grad():
            for p in m.parameters():
                p.grad.mul_(0.5)
        loss.backward()
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("write", ["zero", "scale"])
def test_a_write_to_grad_through_its_data_between_forward_and_backward_is_seen(write):
    """Regression: `p.grad.data.zero_()` (older training loops zero or scale gradients so) has a
    version counter of its own, so the fetch of the old gradient at the end of the forward (split
    scopes under reentrant checkpointing) still looked current, and backward added to the
    gradient from before the write: no error, every gradient of that block wrong."""
    model, reference = mlp_and_reference("cpu", split=True, checkpoint="reentrant")
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for m in (model, reference):
        F.mse_loss(m(x), y).backward()
    for m in (model, reference):
        loss = F.mse_loss(m(x), y)
        for p in m.parameters():
            if write == "zero":
                p.grad.data.zero_()
            else:
                p.grad.data.mul_(0.5)
        loss.backward()
    assert_grads_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)
