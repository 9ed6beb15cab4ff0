"""Gradient clipping and a GradScaler in backward_and_step (`BeforeStep`), and the refusal of a
clip after the step that used the gradients (`record_step`, `refuse_clip_after_step`).

# Note [clipping in the overlapped step]
Global-norm clipping needs every gradient before any update, and a GradScaler's step needs to
know whether any gradient is inf or NaN; neither needs them before the next forward. With
`max_grad_norm=` or `scaler=`, backward_and_step holds the pieces backward hands over (without
fences: nothing changes a master meanwhile), and when backward has returned, on the calling
thread: publishes their gradients, `scaler.unscale_(optimizer)`, and the total norm by torch's
own `_get_total_norm` over the grads of `clip_parameters`, in their order (the order gives the
bits of the norm of norms). Then the pieces go to the worker, which scales each piece's
gradients by torch's `_clip_grads_with_norm_` on that piece right before stepping it (a product
by one scalar: the same bits in any grouping); the rest is scaled and stepped on the calling
thread. The steps overlap the next forward behind their fences; only the overlap with backward
is given up. On inf or NaN nothing is handed over and `scaler.step(optimizer)` runs as in the
plain recipe: it skips the step (a fused optimizer takes found_inf into its kernel). The caller
then calls `scaler.update()`, as after `scaler.step`.

# Note [a clip after the step]
After `backward_and_step` the optimizer has used the gradients it was given, so a
`clip_grad_norm_` or `clip_grad_value_` then changes gradients no step will use: the update it
was to bound was made unclipped, a silently wrong run. Each step records, per parameter, the
gradient it used and that tensor's version (`record_step`); the clip functions (patched in
patches.py) raise when every gradient they are given is one a step used, unchanged since (or
all are None after `zero_grad=True`). A raise, not a warning: the run is wrong by then, and a
warning in a training log reads as noise. `max_norm=inf` (a norm measured for logging) passes.
A later backward gives new gradients or bumps their versions, so a loop that clips after its
own backward is never refused.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.nn.utils.clip_grad import _get_total_norm

from .. import patches


class BeforeStep:
    """What one backward_and_step call does between backward and the first step: unscale,
    inf check, total norm (Note [clipping in the overlapped step])."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float | None,
                 parameters: list[torch.Tensor] | None, scaler: torch.amp.GradScaler | None) -> None:
        self._optimizer = optimizer
        self.max_norm = max_norm
        # What to clip, in the order the norm is taken (default: the optimizer's parameters).
        self._parameters = parameters
        self.has_scaler = scaler is not None
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None  # None: no unscale
        self._clipped: set[int] = set()  # ids of the parameters clipped
        self.total_norm: torch.Tensor | None = None
        self.found_inf = False

    def prepare(self) -> bool:
        """Backward has returned, every gradient published: unscale and check them, take the
        total norm. True: step; False: skip (inf or NaN found by the scaler)."""
        if self._scaler is not None:
            self._scaler.unscale_(self._optimizer)
        if self.max_norm is not None:
            params = self._parameters
            if params is None:
                params = [p for g in self._optimizer.param_groups for p in g["params"]]
            self._parameters = params
            self._clipped = {id(p) for p in params}
            # clip_grad_norm_'s own first half, on the same list: the same bits
            self.total_norm = _get_total_norm([p.grad for p in params if p.grad is not None], 2.0, False, None)
        if self._scaler is not None:
            state = self._scaler._per_optimizer_states[id(self._optimizer)]
            # what scaler.step asks before it steps (GradScaler._maybe_opt_step)
            self.found_inf = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        return not self.found_inf

    def clip(self, params: Iterable[torch.Tensor]) -> None:
        """clip_grad_norm_'s second half, on those of `params` it clips (any thread; on the
        worker with subclass dispatch off)."""
        if self.total_norm is None:
            return
        assert self.max_norm is not None
        chosen = [p for p in params if id(p) in self._clipped]
        patches.PLAIN_CLIP_GRADS_WITH_NORM(chosen, self.max_norm, self.total_norm, None)

    def clip_all(self, not_in: set[int]) -> None:
        """Clip the parameters whose ids are not in `not_in`, on the calling thread."""
        self.clip([p for p in self._parameters or () if id(p) not in not_in])

    def stepping(self) -> None:
        """The step goes ahead: the scaler's record of it, as scaler.step leaves it."""
        if self._scaler is not None:
            self._scaler._per_optimizer_states[id(self._optimizer)]["stage"] = OptState.STEPPED

    def skip(self) -> None:
        """Inf or NaN found: `scaler.step(optimizer)` itself, which skips the step (Note
        [clipping in the overlapped step]); after the call's worker has stopped."""
        assert self._scaler is not None
        self._scaler.step(self._optimizer)


def check_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """A `scaler=` of backward_and_step: a GradScaler that has not unscaled or stepped this
    optimizer since its last update()."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"offtensor.backward_and_step: scaler must be a torch.amp.GradScaler, got "
                        f"{type(scaler).__name__}")
    if not scaler.is_enabled():
        return
    stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
    if stage is not OptState.READY:
        done = "unscale_(optimizer)" if stage is OptState.UNSCALED else "step(optimizer)"
        raise RuntimeError(
            f"offtensor.backward_and_step: scaler.{done} was already called since the last "
            "scaler.update(); backward_and_step(scaler.scale(loss), optimizer, scaler=scaler) unscales "
            "and steps itself. Call scaler.update() after each backward_and_step, and nothing else "
            "of the scaler's in between")


def check_clip(max_grad_norm: Any, clip_parameters: Any) -> list[torch.Tensor] | None:
    """`max_grad_norm=` and `clip_parameters=` of backward_and_step; the parameters as a list."""
    if max_grad_norm is None:
        if clip_parameters is not None:
            raise ValueError("offtensor.backward_and_step: clip_parameters= is what max_grad_norm= "
                             "clips; pass max_grad_norm too")
        return None
    if (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
            or math.isnan(max_grad_norm) or max_grad_norm < 0):
        raise ValueError("offtensor.backward_and_step: max_grad_norm must be a number >= 0 (as "
                         f"clip_grad_norm_'s max_norm; inf: measure the norm only), got {max_grad_norm!r}")
    if clip_parameters is None:
        return None
    return [clip_parameters] if isinstance(clip_parameters, torch.Tensor) else list(clip_parameters)


# ---- Note [a clip after the step] -----------------------------------------------------------

# id(param) -> (the param, weakly; the gradient a step used, weakly, or None if the step
# dropped it (zero_grad=True); that gradient's version then)
_used: dict[int, tuple[weakref.ref, weakref.ref | None, int]] = {}


def watch_clips() -> None:
    """Install the check on clip_grad_norm_ and clip_grad_value_ (once)."""
    patches.gradient_clips(refuse_clip_after_step)


def record_step(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """A step used these gradients of these parameters (None: it set the gradient to None)."""
    for p, g in zip(params, grads, strict=True):
        _used[id(p)] = (weakref.ref(p), None if g is None else weakref.ref(g), -1 if g is None else g._version)


def refuse_clip_after_step(parameters: list[torch.Tensor], what: str, bound: float) -> None:
    """Raise if every gradient given to a clip is one a step already used (Note [a clip after
    the step])."""
    if not _used or math.isinf(bound):
        return
    used = False
    for p in parameters:
        g = p.grad  # first: it waits for p's step, which records its mark
        mark = _used.get(id(p))
        if mark is not None and mark[0]() is not p:
            mark = None
        if g is None:
            used = used or (mark is not None and mark[1] is None)
            continue
        if mark is None or mark[1] is None or g._version != mark[2] or mark[1]() is not g:
            return  # a gradient no step has used yet: a clip before its step
        used = True
    if used:
        raise RuntimeError(
            f"torch.nn.utils.{what} after offtensor.backward_and_step: the optimizer step already "
            "used these gradients unclipped, so clipping them now changes nothing that matters. "
            "Pass max_grad_norm= to backward_and_step instead (it clips as clip_grad_norm_ does, "
            "before the step, and report.grad_norm is the total norm); with a GradScaler also "
            "scaler=scaler. For value clipping, clip in a hook or use loss.backward(); "
            f"{what}(...); optimizer.step()")
