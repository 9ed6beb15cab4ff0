"""An eager optimizer step runs on the masters as plain parameters (Note [an eager optimizer step]
in offtensor/dispatch/optimizer_step.py): the classes change for the step and come back after
it, also after a step that raised, and nothing the model computes with afterwards is stale."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_params_match,
    device_layout_bytes,
    devices,
    mlp_of_blocks,
    offload,
    tolerances,
    unwrapped_reference,
)
from torch import nn

import offtensor
from offtensor.dispatch import optimizer_step

POLICIES = [pytest.param(False, id="streamed"), pytest.param(True, id="kept")]


def _model_and_reference(device: str, kept: bool) -> tuple[nn.Module, nn.Module]:
    model = mlp_of_blocks(n_blocks=3)
    reference = unwrapped_reference(model, device)
    budget = 4 * device_layout_bytes(model) if kept else None
    offload(model, device, policy=offtensor.Policy(vram_budget=budget))
    return model, reference


def _offloaded(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if hasattr(p, "_ot")]


class HalfThenRaise(torch.optim.SGD):
    """SGD that, on step `fail_at`, writes the first half of its parameters and raises."""

    def __init__(self, params, fail_at: int) -> None:
        super().__init__(params, lr=0.1)
        self.fail_at, self.steps = fail_at, 0

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        self.steps += 1
        if self.steps != self.fail_at:
            return super().step(closure)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in params[: len(params) // 2]:
            p.add_(p.grad, alpha=-0.1)
        raise RuntimeError("the step failed halfway")


@pytest.mark.parametrize("kept", POLICIES)
@pytest.mark.parametrize("device", devices)
def test_an_eager_step_runs_on_plain_parameters_and_gives_them_back(device, kept):
    model, reference = _model_and_reference(device, kept)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    offloaded = _offloaded(model)
    seen: list[set[type]] = []
    # A hook of the optimizer's own runs after the global pre-hook, right before the step
    opt.register_step_pre_hook(lambda *_: seen.append({type(p) for p in offloaded}))
    for _ in range(3):
        x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
        for m, o in ((model, opt), (reference, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        assert {type(p) for p in offloaded} == {offtensor.OffloadedParameter}
    assert seen == [{nn.Parameter}] * 3
    assert not optimizer_step.made_plain
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("kept", POLICIES)
@pytest.mark.parametrize("device", devices)
def test_a_step_that_raises_halfway_leaves_no_stale_copy(device, kept):
    """The second step writes half the masters and raises: no post-hook runs. The next forward
    gives the classes back first and computes with the half-written masters, as the plain model
    does; training goes on bit for bit."""
    model, reference = _model_and_reference(device, kept)
    opt, ref_opt = HalfThenRaise(model.parameters(), 2), HalfThenRaise(reference.parameters(), 2)
    batches = [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)) for _ in range(4)]
    for i, (x, y) in enumerate(batches):
        outs = []
        for m, o in ((model, opt), (reference, ref_opt)):
            out = m(x)
            outs.append(out.detach())
            F.mse_loss(out, y).backward()
            if i == 1:
                with pytest.raises(RuntimeError, match="failed halfway"):
                    o.step()
            else:
                o.step()
            o.zero_grad()
        torch.testing.assert_close(outs[0], outs[1], **tolerances(device))
        # Left plain by the step that raised, until the next forward
        left = {nn.Parameter} if i == 1 else {offtensor.OffloadedParameter}
        assert {type(p) for p in _offloaded(model)} == left
        assert bool(optimizer_step.made_plain) == (i == 1)
    assert not optimizer_step.made_plain
    assert_params_match(model, reference, **tolerances(device))


def test_unwrap_after_a_step_that_raised_leaves_plain_parameters_with_the_written_values():
    model, reference = _model_and_reference("cpu", True)
    opt, ref_opt = HalfThenRaise(model.parameters(), 1), HalfThenRaise(reference.parameters(), 1)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for m, o in ((model, opt), (reference, ref_opt)):
        F.mse_loss(m(x), y).backward()
        with pytest.raises(RuntimeError, match="failed halfway"):
            o.step()
    offtensor.unwrap(model)
    assert not optimizer_step.made_plain
    assert {type(p) for p in model.parameters()} == {nn.Parameter}
    assert_params_match(model, reference, rtol=0, atol=0)


class Accumulating(torch.optim.Optimizer):
    """A wrapper as accelerate's AcceleratedOptimizer is: its step calls `optimizer.step()` only
    when the gradients are synced (the last micro-batch of an accumulation)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.sync = False
        super().__init__(optimizer.param_groups, {})
        self.param_groups, self.state = optimizer.param_groups, optimizer.state  # shared, as accelerate's

    def step(self, closure=None):  # type: ignore[override]
        if self.sync:
            self.optimizer.step(closure)


def test_a_wrapper_step_that_skips_its_optimizer_keeps_the_kept_scopes():
    """Only the inner step, when it runs, counts as writing the masters: a kept scope stays
    resident through the accumulation steps, and training matches the plain model's."""
    model, reference = _model_and_reference("cpu", True)
    opt = Accumulating(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = Accumulating(torch.optim.AdamW(reference.parameters(), lr=1e-2))
    engine_scopes = offtensor.summary(model).scopes
    for i in range(6):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        loads = sum(s.loads for s in offtensor.summary(model).scopes)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.sync = i % 3 == 2
            F.mse_loss(m(x), y).backward()
            o.step()
            if o.sync:
                o.zero_grad()
        if i % 3 == 1:  # a forward after a step that wrote nothing: nothing loaded again
            assert sum(s.loads for s in offtensor.summary(model).scopes) == loads
        assert not optimizer_step.made_plain
    assert len(engine_scopes) == 3
    assert_params_match(model, reference, rtol=0, atol=0)
