"""Custom autograd Functions given an offloaded parameter: `torch.autograd.Function.apply`,
replaced once per process, hands them what an op would get.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import torch

from .. import patches
from .masters import await_steps, without_subclass_dispatch
from .ops import op_device, replacements, substitute
from .param import OffloadedParameter, find_params
from .slot import on_optimizer_worker

# Note [custom autograd Functions]
# `torch.autograd.Function.apply` is no op: it does not reach `__torch_function__`, so a custom
# Function given a parameter (`_Linear.apply(x, self.weight, self.bias)`, as apex's fused layers,
# Liger's fused linear cross-entropy and unsloth's LoRA kernels are called) would get the
# OffloadedParameter itself. Autograd would then record the master as the Function's input and
# accumulate the Function's gradient into it by its own AccumulateGrad, past the gradient path
# (Note [gradient path] in engine/grads.py): the parameter's `register_hook` hooks, data_parallel's
# averaging and backward_and_step's worker would not see it, and on CUDA autograd refuses a
# device gradient for a host parameter; `ctx.save_for_backward(weight)` would save the master,
# which a non-reentrant checkpoint's recompute hands to backward as a plain alias. So `wrap`
# replaces `Function.apply` (once per process, for every Function class) by `_function_apply`,
# which first gives each offloaded argument what an op would get (Note [dispatch of an offloaded
# parameter]): in its scope the device copy, elsewhere a temporary copy with the same gradient
# path. The Function computes with, saves and returns a gradient for that copy, as F.linear does.
# With no offloaded argument it is the original call after a scan of the arguments.


def _function_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """`torch.autograd.Function.apply` with offloaded arguments replaced (Note [custom autograd
    Functions]); counted in `recorded_functions` while its forward runs, when autograd records
    it (Note [calls inside a checkpointed region] in scopes/grad_calls.py)."""
    params = find_params(args, kwargs)
    if params and not on_optimizer_worker():
        args, kwargs = without_subclass_dispatch(_materialized_arguments, args, kwargs, params)
    if not (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return patches.PLAIN_FUNCTION_APPLY(cls, *args, **kwargs)
    frames = recorded_functions.frames
    frames.append(sys._getframe())
    try:
        return patches.PLAIN_FUNCTION_APPLY(cls, *args, **kwargs)
    finally:
        frames.pop()


class _RecordedFunctions(threading.local):
    """The custom autograd Functions recorded by autograd whose forward runs on this thread, by
    the frames of their `_function_apply` calls. An interrupt can skip a call's `finally` (at its
    first line) and leave its frame listed: `depth` counts only the frames still on the stack
    and forgets the others (Note [interrupts] in dispatch/masters.py)."""

    def __init__(self) -> None:
        self.frames: list[FrameType] = []

    @property
    def depth(self) -> int:
        frames = self.frames
        if frames:
            missing = {id(frame) for frame in frames}
            f: FrameType | None = sys._getframe(1)
            while f is not None and missing:  # up to the outermost listed frame, unless one is gone
                missing.discard(id(f))
                f = f.f_back
            if missing:
                frames[:] = [frame for frame in frames if id(frame) not in missing]  # in place: calls pop from it
        return len(frames)


recorded_functions = _RecordedFunctions()


def _materialized_arguments(args: tuple, kwargs: dict, params: list[OffloadedParameter]) -> tuple[tuple, dict]:
    await_steps(params, _function_apply)
    offloaded = {id(p) for p in params}
    subs = replacements(params, op_device(args, kwargs, offloaded))
    return substitute(args, kwargs, subs, offloaded)


def intercept_function_apply() -> None:
    """Install `_function_apply` as `torch.autograd.Function.apply`; called by wrap, idempotent."""
    patches.function_apply(_function_apply)
