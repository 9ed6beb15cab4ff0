"""Gradient clipping and a GradScaler in backward_and_step (`BeforeStep`), and the refusal of a
clip after the step that used the gradients (`record_step`, `refuse_clip_after_step`).

# Note [clipping in the overlapped step]
Global-norm clipping needs every gradient before any update, and a GradScaler's step needs to
know whether any gradient is inf or NaN; neither needs them before the next forward. With
`max_grad_norm=` or `scaler=`, backward_and_step holds the pieces backward hands over (without
fences: nothing changes a master meanwhile), and when backward has returned, on the calling
thread: publishes their gradients, `scaler.unscale_(optimizer)`, and the total norm. Then the
pieces go to the worker, which scales each piece's gradients by torch's `_clip_grads_with_norm_`
right before stepping it (a product by one scalar: the same bits in any grouping); the rest is
scaled and stepped on the calling thread. The steps overlap the next forward behind their
fences; only the overlap with backward is given up. On inf or NaN nothing is handed over and
`scaler.step(optimizer)` runs as in the plain recipe: it skips the step (a fused optimizer takes
found_inf into its kernel). The caller then calls `scaler.update()`, as after `scaler.step`.
The norm: Note [norms taken in backward].

# Note [norms taken in backward]
The total norm is `clip_grad_norm_`'s on the unwrapped model, which reduces each gradient where
it has it, on the device. So each offloaded gradient's norm is taken there, in backward, from the
sum the gradient path copies to the host (`GradOffload._add` -> `BeforeStep.measure`), by the
kernel `_get_total_norm` uses (`torch._foreach_norm`, whose result for one tensor does not depend
on the others in its list), and the calling thread does not read every gradient again on the CPU
between backward and the first step. The norms are stacked in the order `_get_total_norm` gives
the plain model's gradients: torch's own grouping by device and dtype, run on empty stand-ins on
the device each gradient would be on there. A norm is used only if that host gradient is still
`p.grad`, unchanged since its copy (version): one a post-accumulate-grad hook wrote, one unscaled
by a scaler (with a scaler nothing is measured early) or one with no part in this backward is
measured after backward, on its plain-model device. Each device's gradients are scaled with the
total norm moved to that device once, before the steps: a move from the device on the worker
would wait for the next forward's kernels (the factor comes from the same norm by the same IEEE
operations on either device).

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
from torch.utils._foreach_utils import _has_foreach_support

from .. import patches
from ..dispatch.param import OffloadedParameter
from ..engine.engine import owning_engine

# torch's helpers decorated with `no_grad` turn grad mode off and on in Python, where an interrupt
# can land between the two and leave it off (Note [interrupts] in dispatch/masters.py): the
# grouping is called as its C function, and the norm of a model with nothing offloaded undecorated,
# on detached gradients (no graph to record either way).
_group_tensors_by_device_and_dtype = torch._C._group_tensors_by_device_and_dtype
_total_norm_of = getattr(_get_total_norm, "__wrapped__", _get_total_norm)


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
        self._norm_on: dict[torch.device, torch.Tensor] = {}  # total_norm, on each gradient's device
        self.found_inf = False
        # Norms taken on the device in backward (without a scaler, whose unscale comes after):
        # id(param) -> (its host gradient, that tensor's version then, the norm).
        self.measures_norms = max_norm is not None and self._scaler is None
        self._measured: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def measure(self, param: torch.Tensor, grad: torch.Tensor, host: torch.Tensor) -> None:
        """Backward summed `param`'s gradient `grad` on the device and enqueued its copy to
        `host`: take its norm there (Note [norms taken in backward])."""
        if grad.is_contiguous() and _has_foreach_support([grad], grad.device):
            self._measured[id(param)] = (host, host._version, torch._foreach_norm([grad], 2.0)[0])
        else:  # the plain model's gradient is dense: a strided one is measured after backward
            self._measured.pop(id(param), None)

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
            with_grads = [p for p in params if p.grad is not None]
            self.total_norm = self._total_norm(with_grads)
            self._measured = {}
            devices = {p.grad.device for p in with_grads}  # type: ignore[union-attr]
            self._norm_on = {device: self.total_norm.to(device) for device in devices}
        if self._scaler is not None:
            state = self._scaler._per_optimizer_states[id(self._optimizer)]
            # what scaler.step asks before it steps (GradScaler._maybe_opt_step)
            self.found_inf = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
        return not self.found_inf

    def _total_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """`_get_total_norm` of the params' gradients as the unwrapped model has them, from the
        norms measured in backward where they are still good (Note [norms taken in backward])."""
        grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]  # all have one
        if not any(isinstance(p, OffloadedParameter) for p in params):
            return _total_norm_of([g.detach() for g in grads], 2.0, False, None)  # clip_grad_norm_'s own first half
        norms: list[torch.Tensor | None] = []
        for p, g in zip(params, grads, strict=True):
            entry = self._measured.get(id(p))
            norms.append(entry[2] if entry is not None and entry[0] is g and entry[1] == g._version else None)
        places = [_place(p, g, n) for p, g, n in zip(params, grads, norms, strict=True)]
        stand_ins: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # one per group
        for g, d in zip(grads, places, strict=True):
            if (d, g.dtype) not in stand_ins:
                stand_ins[d, g.dtype] = torch.empty(0, dtype=g.dtype, device=d)
        ordered: list[torch.Tensor] = []
        for (device, _), (_, indices) in _group_tensors_by_device_and_dtype(
                [[stand_ins[d, g.dtype] for g, d in zip(grads, places, strict=True)]], True).items():
            if _has_foreach_support([grads[i] for i in indices], device):
                missing = [i for i in indices if norms[i] is None]
                if missing:
                    fresh = torch._foreach_norm([grads[i].to(device) for i in missing], 2.0)
                    for i, n in zip(missing, fresh, strict=True):
                        norms[i] = n
                ordered.extend(norms[i] for i in indices)  # type: ignore[misc]
            else:
                ordered.extend(torch.linalg.vector_norm(grads[i].to(device), 2.0) for i in indices)
        return torch.linalg.vector_norm(torch.stack([n.to(places[0]) for n in ordered]), 2.0)

    def clip(self, params: Iterable[torch.Tensor]) -> None:
        """clip_grad_norm_'s second half, on those of `params` it clips (any thread; on the
        worker with subclass dispatch off), each device's with the total norm on that device."""
        if self.total_norm is None:
            return
        assert self.max_norm is not None
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            if id(p) in self._clipped and p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(p)
        for device, chosen in by_device.items():
            patches.PLAIN_CLIP_GRADS_WITH_NORM(chosen, self.max_norm, self._norm_on[device], None)

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


def _place(param: torch.Tensor, grad: torch.Tensor, norm: torch.Tensor | None) -> torch.device:
    """The device the unwrapped model has this gradient on: an offloaded parameter's is its
    compute device (where its norm was measured), any other's its own."""
    if norm is not None:
        return norm.device
    if isinstance(param, OffloadedParameter):
        return owning_engine(param._ot).device
    return grad.device


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
