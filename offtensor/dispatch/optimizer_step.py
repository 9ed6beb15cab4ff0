"""A compiled optimizer step over offloaded parameters: a global optimizer step pre-hook treats
it as the in-place writes of the masters that an eager step makes op by op.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import patches
from . import compile as _compile
from .masters import master_grad
from .param import OffloadedParameter
from .slot import on_optimizer_worker

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
# loads a scope. An eager step pays one hook call that returns at once.


def before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global optimizer step pre-hook (Note [a compiled optimizer step])."""
    if _compile.in_compiled_region():
        _compile.run_outside_dynamo(_before_compiled_step, (optimizer,))


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


def watch_compiled_steps() -> None:
    """Register `before_optimizer_step` once per process (Note [a compiled optimizer step])."""
    patches.optimizer_step_pre_hook(before_optimizer_step)

