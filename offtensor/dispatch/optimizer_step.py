"""Optimizer steps over offloaded parameters: global optimizer step hooks treat a compiled step
as the in-place writes of the masters that an eager step makes op by op, and let an eager step's
ops reach the masters without dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import patches
from ..api import ScopeState
from . import compile as _compile
from .masters import master_grad
from .ops import written_alone
from .param import OffloadedParameter
from .slot import ParamSlot, on_optimizer_worker

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
# loads a scope. An eager step: Note [an eager optimizer step].


# Note [an eager optimizer step]
# An eager step writes each master through in-place ops on the parameter (AdamW: `is_complex(p)`,
# `p.mul_`, `p.addcdiv_`), each dispatched through OffloadedParameter's `__torch_function__` to
# the master it reaches anyway (`written_alone` in dispatch/ops.py): host time a plain model does
# not pay. So the global pre-hook does for each offloaded parameter with a gradient that such a
# write could take what its first write would (`master_written`: no copy reads the master, a kept
# scope's copy goes, staged and cached copies are stale, graphs that saved a copy see it
# modified), before the step (a write through `p.data` bumps no counter a load reads), and makes
# it an nn.Parameter: its ops run on the master as a plain parameter's. The post-hook gives the
# class back (`restore`). Not in a backward (an optimizer in a post-accumulate-grad hook), nor
# for backward_and_step's views and worker, nor for a wrapper whose step may or may not call its
# `optimizer`'s (accelerate's, in an accumulation step: the inner step's hooks act), nor for a
# parameter whose scope is in a call or still resident after the write. A step that raises runs
# no post-hook, and a closure (LBFGS) calls the model inside the step: so each module hook of
# offtensor's and each scope's load restore first; the model never computes with, loads or
# writes through a parameter of the plain class.

made_plain: list[tuple[nn.Parameter, ParamSlot]] = []  # made plain for the step running now


def before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global optimizer step pre-hook (Note [a compiled optimizer step], Note [an eager
    optimizer step])."""
    if _compile.in_compiled_region():
        _compile.run_outside_dynamo(_before_compiled_step, (optimizer,))
    elif not (getattr(optimizer, "_offtensor_view", False) or torch._C._current_graph_task_id() != -1
              or isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        _make_plain(optimizer)


def after_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global optimizer step post-hook (Note [an eager optimizer step])."""
    if made_plain:
        restore()


def _make_plain(optimizer: torch.optim.Optimizer) -> None:
    """Its offloaded parameters that the step may write alone, treated as written and made plain."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is not OffloadedParameter:
                continue
            slot = p._ot
            if slot.arrived:  # Note [gradients on arrival] in engine/grads.py
                slot.scope.arrived_outside(slot)
            if written_alone((p,), {}) is not slot or slot.scope.calls.running or master_grad(p) is None:
                continue
            slot.scope.master_written(slot)
            if slot.scope.state is not ScopeState.OFFLOADED:
                continue
            made_plain.append((p, slot))  # first: an interrupt before the class changes leaves it to restore
            p.__class__ = nn.Parameter  # type: ignore[assignment]


def restore() -> None:
    """The parameters a step made plain are offloaded parameters again; a staged copy made from
    their masters in between is stale (Note [an eager optimizer step])."""
    for p, _ in made_plain:
        p.__class__ = OffloadedParameter
    for masters in {id(slot.scope.masters): slot.scope.masters for _, slot in made_plain}.values():
        masters.written()
    made_plain.clear()  # last: an interrupt in the loops leaves them to the next restore


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
    [an eager optimizer step])."""
    patches.optimizer_step_hooks(before_optimizer_step, after_optimizer_step)

