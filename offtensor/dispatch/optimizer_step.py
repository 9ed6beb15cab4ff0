"""Optimizer steps over offloaded parameters: global optimizer step hooks treat a compiled step
as the in-place writes of the masters that an eager step makes op by op, and open an eager step's
window (dispatch/eager_step.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import patches
from ..api import ScopeState
from . import compile as _compile
from .eager_step import close_window, open_window
from .masters import master_grad
from .ops import plain_master
from .param import OffloadedParameter
from .slot import ParamSlot, in_backward, on_optimizer_worker

# Note [a compiled optimizer step]
# An eager `optimizer.step()` writes each master through an in-place op on the parameter, which
# `dispatch` (dispatch/ops.py) sees: `before_master_write` waits for the copies still reading
# masters (`sync_master_reads`) and releases a scope that the VRAM budget keeps (its copy would
# be stale). A compiled step (`torch.compile(opt.step)`, or a compiled training step calling
# `opt.step()`) dispatches no such op: dynamo traces the optimizer's ops on fake tensors, the
# parameters are graph inputs, and AOTAutograd applies their mutations to the real masters after
# the graph ran (under aot_eager as `aten.copy_.default` on the parameter, under inductor in the
# kernel). A kept scope's copy would be stale after the step and, on CUDA, a prefetch still
# reading a master could see it half written. No per-op hook exists inside a compiled graph, so
# the step itself is the hook: a global optimizer step pre-hook (`before_optimizer_step`),
# registered with the first engine, runs `_before_compiled_step` outside dynamo (a graph break
# before the step's graph, one per step; also for a compiled step of another optimizer once a
# model is wrapped). It treats each offloaded parameter with a gradient (those an eager step
# writes) as an eager in-place write does, before the step writes: no copy reads it, kept scopes
# are released, graphs that saved a copy see it modified. Nothing between the hook and the write
# loads a scope. An eager step: Note [an eager optimizer step] in dispatch/eager_step.py.


def before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global optimizer step pre-hook (Note [a compiled optimizer step], Note [an eager
    optimizer step] in dispatch/eager_step.py)."""
    if _compile.in_compiled_region():
        close_window()
        _compile.run_outside_dynamo(_before_compiled_step, (optimizer,))
    elif (getattr(optimizer, "_offtensor_view", False) or on_optimizer_worker() or in_backward()
          or isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        # backward_and_step's own steps, a step in a backward (an optimizer in a gradient hook),
        # a wrapper whose step may skip its optimizer's (accelerate's, in an accumulation step;
        # the inner step's hooks open a window): op by op
        close_window()
    else:
        open_window(_eagerly_written(optimizer))


def after_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global optimizer step post-hook (Note [an eager optimizer step] in dispatch/eager_step.py)."""
    close_window()


def _eagerly_written(optimizer: torch.optim.Optimizer) -> list[ParamSlot]:
    """The slots of the offloaded parameters the eager step may write through the window, each
    written as its first write would (Note [an eager optimizer step] in dispatch/eager_step.py):
    those with a gradient whose master an op writing it alone writes at once (a plain master,
    `plain_master`, outside an exposed call), whose scope is in no call."""
    if _compile.tracing():
        return []
    by_scope: dict[int, list[ParamSlot]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is not OffloadedParameter:
                continue
            slot = p._ot
            if slot.arrived:  # Note [gradients on arrival] in engine/grads.py
                slot.scope.arrived_outside(slot)
            scope = slot.scope
            if plain_master(slot) and not (scope.exposed or scope.calls.running) and master_grad(p) is not None:
                by_scope.setdefault(id(scope), []).append(slot)
    for slots in by_scope.values():
        # An entry point: the step's own device ops (GPU-resident parameters) must not run on a
        # side stream an interrupt left current (Note [interrupts] in dispatch/masters.py).
        slots[0].scope.streams.restore()
        slots[0].scope.masters_stepped(slots)
    return [slot for slots in by_scope.values() if slots[0].scope.state is ScopeState.OFFLOADED for slot in slots]


def _before_compiled_step(optimizer: torch.optim.Optimizer) -> None:
    if getattr(optimizer, "_offtensor_view", False) or on_optimizer_worker():
        return  # backward_and_step's own steps, eager (Note [torch.compile] in dispatch/compile.py)
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
            if slot is not None and slot.arrived:  # Note [gradients on arrival] in engine/grads.py
                slot.scope.arrived_outside(slot)
            if slot is not None and master_grad(p) is not None:
                slot.scope.master_written(slot)


def watch_optimizer_steps() -> None:
    """Register the global step hooks once per process (Note [a compiled optimizer step], Note
    [an eager optimizer step] in dispatch/eager_step.py)."""
    patches.optimizer_step_hooks(before_optimizer_step, after_optimizer_step)

