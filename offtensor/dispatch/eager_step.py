"""An eager optimizer step's writes of the masters without dispatch per op: the step window,
opened by the global optimizer step pre-hook (dispatch/optimizer_step.py, above) and asked by
`OffloadedParameter.__torch_function__` (dispatch/param.py, above) first.

# Note [an eager optimizer step]
An eager step on host masters writes each parameter through a few in-place ops (AdamW:
`torch.is_complex(p)`, the decay's `p.mul_`, `p.addcdiv_`; SGD: `p.add_`), each dispatched
through `__torch_function__` to the master it reaches anyway, after `master_written` (Note [one
parameter on the general path's way] in dispatch/ops.py): host time a plain model does not pay,
at every parameter of every step. So the global step pre-hook does for each offloaded parameter
with a gradient what its first write would (`master_written`: no copy reads the master, a kept
scope's copy goes, staged copies are stale, graphs that saved a copy see it modified) and opens
a window: until it closes, an op of `STEP_OPS` on this thread whose first argument is such a
parameter, with no other offloaded parameter beside it, runs on the master at once, and so does
a host read of one beside a plain tensor under no_grad (`STEP_READS`: weight decay as L2,
`grad.add(p, alpha=wd)`) where the usual way would read the master too (no compute dtype): the
master is current, as the pre-hook released the scope's device copy and a load closes the
window. The class never changes, so anything else (`requires_grad_`, `p.data = t`, a read)
takes the usual way and, on the window's thread, closes it first. It closes at the post-hook,
and because a step that raises runs none, at anything that could make a device or staged copy
of a master current again or hold a master elsewhere: a module hook of offtensor's, a scope's
load, the next step's pre-hook, a deferred or another rank's step (`HOLDS`), unwrap. A closed
window bumps the masters' write counts once more (`masters.written()`), for a staged copy made
in between.
"""

from __future__ import annotations

import threading

import torch

from .ops import SCALAR_TYPES
from .slot import HOLDS, ParamSlot

# The in-place updates torch's optimizers make on a parameter, and the query AdamW asks of it.
STEP_OPS = frozenset({
    torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_, torch.Tensor.addcdiv_,
    torch.Tensor.addcmul_, torch.Tensor.lerp_, torch.Tensor.clamp_, torch.is_complex, torch.Tensor.is_complex,
})
# The read of a parameter beside its gradient that torch's optimizers make: weight decay as L2
# (Adam, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax: `grad.add(p, alpha=weight_decay)`).
STEP_READS = frozenset({torch.Tensor.add, torch.add})
_LISTS = (list, tuple)


class StepWindow:
    """The parameters one eager step may write without dispatch (Note [an eager optimizer step])."""

    __slots__ = ("thread", "holds", "marked", "readable", "masters")

    def __init__(self, slots: list[ParamSlot]) -> None:
        self.thread = threading.get_ident()
        self.holds = HOLDS[0]
        self.marked = {id(slot.param): slot.param for slot in slots}  # holding them: no id is reused
        # Those a host op reads as the master itself (Scope.temporary_copy converts no other)
        self.readable = {id(slot.param) for slot in slots if not slot.converts()}
        self.masters = list({id(slot.scope.masters): slot.scope.masters for slot in slots}.values())

    def admits(self, args: tuple, kwargs: dict | None) -> bool:
        """An op of `STEP_OPS` on a parameter of `marked`, `args[0]`, may run on the master at once."""
        if not self._current():
            return False
        for a in (*args[1:], *kwargs.values()) if kwargs else args[1:]:
            kind = type(a)
            if kind is torch.Tensor or kind in SCALAR_TYPES:
                continue
            if kind in _LISTS or getattr(a, "_ot", None) is not None:
                return False
        return True

    def admits_read(self, args: tuple, kwargs: dict | None) -> bool:
        """An op of `STEP_READS`, `args[0]` (a plain host tensor) with a parameter of
        `readable`, `args[1]`, may read the master at once: under no_grad (else autograd needs the
        parameter's gradient path), with scalar keywords only."""
        first = args[0]
        if type(first) is not torch.Tensor or not first.is_cpu or torch.is_grad_enabled() or not self._current():
            return False
        return not kwargs or all(type(v) in SCALAR_TYPES for v in kwargs.values())

    def _current(self) -> bool:
        """Asked on the window's thread, with no deferred or other rank's step begun since it opened."""
        return HOLDS[0] == self.holds and threading.get_ident() == self.thread


OPEN: list[StepWindow | None] = [None]  # the window open now, if any


def open_window(slots: list[ParamSlot]) -> None:
    close_window()
    if slots:
        OPEN[0] = StepWindow(slots)


def close_window() -> None:
    window = OPEN[0]
    if window is None:
        return
    OPEN[0] = None  # first: an interrupt in the loop leaves the window closed
    for masters in window.masters:
        masters.written()


def close_on_other_op() -> None:
    """An op the window does not admit, about to take the usual way: on the window's thread it
    closes the window (Note [an eager optimizer step])."""
    window = OPEN[0]
    if window is not None and window.thread == threading.get_ident():
        close_window()
