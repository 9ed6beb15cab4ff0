"""An eager optimizer step's ops reach the masters without dispatch per op while its window is
open (Note [an eager optimizer step] in offtensor/dispatch/eager_step.py): the window opens at the
step and closes after it, after a step that raised at the model's next call, and at any other op
on an offloaded parameter; nothing the model computes with afterwards is stale."""

from __future__ import annotations

import threading

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
from offtensor.dispatch import eager_step
from offtensor.dispatch.slot import holding_masters

POLICIES = [pytest.param(False, id="streamed"), pytest.param(True, id="kept")]


def _model_and_reference(device: str, kept: bool) -> tuple[nn.Module, nn.Module]:
    model = mlp_of_blocks(n_blocks=3)
    reference = unwrapped_reference(model, device)
    budget = 4 * device_layout_bytes(model) if kept else None
    offload(model, device, policy=offtensor.Policy(vram_budget=budget))
    return model, reference


def _offloaded(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if hasattr(p, "_ot")]


def _pairs(model: nn.Module, reference: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(offloaded parameter, the reference's of the same name)."""
    ref = dict(reference.named_parameters())
    return [(p, ref[name]) for name, p in model.named_parameters() if hasattr(p, "_ot")]


def _batches(device: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)) for _ in range(n)]


def _train_both(model: nn.Module, reference: nn.Module, opt: torch.optim.Optimizer,
                ref_opt: torch.optim.Optimizer, device: str, steps: int = 3) -> None:
    """`steps` training steps of both models; no window is open after a step."""
    for x, y in _batches(device, steps):
        for m, o in ((model, opt), (reference, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        assert eager_step.OPEN[0] is None


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
def test_the_window_is_open_for_the_step_only(device, kept):
    model, reference = _model_and_reference(device, kept)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    offloaded = {id(p) for p in _offloaded(model)}
    seen = []
    # A hook of the optimizer's own runs after the global pre-hook, right before the step
    opt.register_step_pre_hook(lambda *_: seen.append(set(eager_step.OPEN[0].marked)))
    _train_both(model, reference, opt, ref_opt, device)
    assert seen == [offloaded] * 3
    # Bit for bit on the CPU; on CUDA the reference's AdamW steps on the GPU (tolerances)
    assert_params_match(model, reference, **tolerances(device))


WEIGHT_DECAY_AS_L2 = [
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1), id="Adam"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1), id="SGD"),
    pytest.param(lambda ps: torch.optim.RMSprop(ps, lr=1e-2, weight_decay=0.1), id="RMSprop"),
]


@pytest.mark.parametrize("make", WEIGHT_DECAY_AS_L2)
@pytest.mark.parametrize("kept", POLICIES)
@pytest.mark.parametrize("device", devices)
def test_weight_decay_reads_keep_the_window_open(device, kept, make):
    """Weight decay as L2 reads each parameter beside its gradient (`grad.add(p, alpha=wd)`):
    admitted, so the window stays open to the step's end; training as the plain model."""
    model, reference = _model_and_reference(device, kept)
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    open_at_end = []
    # The optimizer's own post-hooks run before the global one that closes the window
    opt.register_step_post_hook(lambda *_: open_at_end.append(eager_step.OPEN[0] is not None))
    _train_both(model, reference, opt, ref_opt, device)
    # The first step makes the optimizer's state (`torch.zeros_like(p)`, which closes it)
    assert open_at_end[1:] == [True, True]
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("kept", POLICIES)
@pytest.mark.parametrize("device", devices)
def test_after_a_step_that_raised_writes_and_flags_are_seen(device, kept):
    """The second step writes half the masters and raises: no post-hook runs, the window stays
    open. Then a write through an op the window admits (`mul_`) and a requires_grad change
    (which closes it); the next forward computes with what the plain model has, and the frozen
    parameter gets no gradient."""
    model, reference = _model_and_reference(device, kept)
    opt, ref_opt = HalfThenRaise(model.parameters(), 2), HalfThenRaise(reference.parameters(), 2)
    pairs = _pairs(model, reference)
    for i, (x, y) in enumerate(_batches(device, 4)):
        outs = []
        for m, o in ((model, opt), (reference, ref_opt)):
            out = m(x)
            outs.append(out.detach())
            F.mse_loss(out, y).backward()
            if i != 1:
                o.step()
            else:
                with pytest.raises(RuntimeError, match="failed halfway"):
                    o.step()
                if m is model:
                    assert eager_step.OPEN[0] is not None  # left open by the step that raised
            o.zero_grad()
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        if i == 1:
            # The reference's step closed the window: opened again as the failed step left it
            eager_step.open_window([p._ot for p, _ in pairs])
            with torch.no_grad():
                for p, r in pairs[:2]:
                    p.mul_(0.5)
                    r.mul_(0.5)
            assert eager_step.OPEN[0] is not None  # admitted
            pairs[-1][0].requires_grad_(False)
            pairs[-1][1].requires_grad_(False)
            assert eager_step.OPEN[0] is None
    for p, r in pairs:
        assert (p.grad is None) == (r.grad is None)
    assert_params_match(model, reference, rtol=0, atol=0)


def test_a_read_closes_the_window_so_a_later_write_is_seen_by_the_graph_that_saved_the_value():
    model, reference = _model_and_reference("cpu", True)
    opt, ref_opt = HalfThenRaise(model.parameters(), 1), HalfThenRaise(reference.parameters(), 1)
    x, y = _batches("cpu", 1)[0]
    p, r = _pairs(model, reference)[0]
    for m, o in ((model, opt), (reference, ref_opt)):
        F.mse_loss(m(x), y).backward()
        with pytest.raises(RuntimeError, match="failed halfway"):
            o.step()
    for w in (p, r):
        saved = (w * w).sum()  # saves the value it read
        with torch.no_grad():
            w.mul_(0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()
    assert eager_step.OPEN[0] is None
    assert_params_match(model, reference, rtol=0, atol=0)


@torch.no_grad()
def _scale(p: nn.Parameter) -> None:
    p.mul_(1.0)


def test_what_the_window_admits():
    model, _ = _model_and_reference("cpu", True)
    p, q = _offloaded(model)[:2]
    masters = p._ot.scope.masters
    ones = torch.ones(p.shape)
    with torch.no_grad():
        eager_step.open_window([p._ot])
        writes = masters.master_writes
        p.mul_(1.0)
        torch.is_complex(p)
        p.addcdiv_(ones, ones, value=0.0)
        assert masters.master_writes == writes and eager_step.OPEN[0] is not None
        other = threading.Thread(target=_scale, args=(p,))  # another thread: the usual way
        other.start()
        other.join()
        assert masters.master_writes > writes and eager_step.OPEN[0] is not None
        q.mul_(1.0)  # not marked: the usual way, which closes the window
        assert eager_step.OPEN[0] is None

        eager_step.open_window([p._ot])
        p.add_(p)  # an offloaded parameter beside it
        assert eager_step.OPEN[0] is None

        values = p.detach().clone()
        eager_step.open_window([p._ot])
        decayed = torch.add(ones, p, alpha=0.5), ones.add(p, alpha=0.5)  # weight decay as L2
        assert eager_step.OPEN[0] is not None
        for d in decayed:
            assert type(d) is torch.Tensor
            torch.testing.assert_close(d, ones.add(values, alpha=0.5), rtol=0, atol=0)
        with torch.enable_grad():
            ones.add(p)  # autograd needs the parameter's gradient path: the usual way
        assert eager_step.OPEN[0] is None

        eager_step.open_window([p._ot])
        holding_masters()  # a deferred or another rank's step may hold masters now
        writes = masters.master_writes
        p.mul_(1.0)
        assert masters.master_writes > writes and eager_step.OPEN[0] is None


def test_a_read_of_a_master_cast_for_the_device_takes_the_usual_way():
    """Under Policy(compute_dtype) a host op reads a parameter as its copy in that dtype
    (Scope.temporary_copy), not the master: the window does not admit it."""
    model = offload(mlp_of_blocks(n_blocks=2), "cpu", policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    p = _offloaded(model)[0]
    ones = torch.ones(p.shape)
    values = p.detach().clone()
    with torch.no_grad():
        eager_step.open_window([p._ot])
        decayed = ones.add(p, alpha=0.5)
    assert eager_step.OPEN[0] is None
    torch.testing.assert_close(decayed, ones.add(values.to(torch.bfloat16), alpha=0.5), rtol=0, atol=0)


def test_unwrap_after_a_step_that_raised_closes_the_window():
    model, reference = _model_and_reference("cpu", True)
    opt, ref_opt = HalfThenRaise(model.parameters(), 1), HalfThenRaise(reference.parameters(), 1)
    x, y = _batches("cpu", 1)[0]
    for m, o in ((model, opt), (reference, ref_opt)):
        F.mse_loss(m(x), y).backward()
        with pytest.raises(RuntimeError, match="failed halfway"):
            o.step()
    offtensor.unwrap(model)
    assert eager_step.OPEN[0] is None
    assert {type(p) for p in model.parameters()} == {nn.Parameter}
    assert_params_match(model, reference, rtol=0, atol=0)
