"""Optimizer overlap: step each scope's parameters on a host thread, during backward and after.
The entry points: `backward_and_step`, `wait_for_steps`, `last_stepped`, `OverlapReport`.

The parts, bottom up: `views.py` (part of the optimizer's step, as of the call), `pieces.py`,
`device_steps.py` (the device's share), `piece_queue.py` (the pieces between the threads),
`calls.py` (the calls pending, and the waits for all of them), `fenced_state.py` (the
optimizer's own waits), `checks.py` (what is refused), `worker.py` (the worker thread) and
`step.py` (one call: the handover from backward, the rest, the fences).

# Note [optimizer overlap]
With offloading, the optimizer steps on the host after backward: a step costs forward+backward
plus the CPU optimizer. But a scope's gradients are final as soon as its backward is done
(post_backward) and their device-to-host copies have landed, while backward goes on for the
scopes before it. `backward_and_step` hands each finished scope to one worker thread, which
waits (host side, off the main thread) for the scope's `grads_offloaded` event, publishes its
`.grad`s, runs user post-accumulate-grad hooks and calls the user's own optimizer's `step` on a
view of the optimizer restricted to those parameters (same state, same hooks, the param groups'
hyperparameters as they were when `backward_and_step` was called). Per-parameter optimizers
(SGD, Adam, AdamW, Adagrad, ... in any of their single-tensor, foreach or fused forms) give
exactly the same update as one `optimizer.step()` after backward, save a group whose kernel
depends on which parameters it steps (Note [groups stepped whole] in optim/views.py). The rest (parameters on the
device, scopes used more than once per forward, parameters also used outside their scope) is
stepped on the calling thread once backward has returned.

# Note [deferred steps]
Even so the step cannot end before backward plus the optimizer time of the scope whose
gradients come last, and that is the model's first block, which the next forward needs first.
So `backward_and_step` returns as soon as backward has, and the worker finishes in the
background while the next forward begins. Every parameter handed to the worker carries a
fence, `ParamSlot.pending_step` (Note [deferred step fences] in dispatch/slot.py), until its step is done, and
whatever needs its master waits on it, host side: the scope's copy to the device (parameter by
parameter, so the next forward's first matrices go as soon as they are stepped, see
`Scope.copy_more`), any op or property access on the parameter (`p.grad`, `p.data`,
`state_dict()`), and the optimizer's own `step`, `state_dict` and `load_state_dict` (hooks
registered once per optimizer). The worker steps the parameters whose gradients have landed in
the order the next forward needs them (earliest deadline first, `PieceQueue.next_piece`), in
pieces of about STEP_PIECE_BYTES so that a piece needed soon never waits long behind one needed
later.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from ..dispatch.compile import in_compiled_region, run_outside_dynamo
from ..engine.engine import Engine
from . import calls
from .calls import last_stepped, wait_for_steps
from .checks import check_call, check_engines, engines_of
from .clipping import BeforeStep, check_clip, check_scaler, watch_clips
from .device_steps import DeviceSteps
from .fenced_state import fence_state, install_optimizer_hooks
from .report import OverlapReport
from .step import OverlappedStep
from .views import OptimizerAsOfCall

__all__ = ["DEVICE_SHARE", "SPARE_THREADS", "STEP_PIECE_BYTES", "OverlapReport", "backward_and_step",
           "last_stepped", "wait_for_steps"]

STEP_PIECE_BYTES = 64 * 2**20  # backward_and_step(piece_bytes=) default; see Note [deferred steps]
# Cores the worker leaves to the thread that launches the device's kernels while that thread may
# need them (Note [worker threads] in optim/worker.py); backward_and_step(spare_threads=) default.
SPARE_THREADS = 1
# The most of the optimizer's offloaded bytes stepped on the device per call (Note [device
# steps] in optim/device_steps.py); backward_and_step(device_share=) default: none.
DEVICE_SHARE = 0.0


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, *, zero_grad: bool = False,
                      max_grad_norm: float | None = None, clip_parameters: Iterable[torch.Tensor] | None = None,
                      scaler: torch.amp.GradScaler | None = None, spare_threads: int | None = None,
                      piece_bytes: int | None = None, device_share: float | None = None,
                      **backward_kwargs: Any) -> OverlapReport:
    """`loss.backward(); optimizer.step()`, with the optimizer overlapped with backward and with
    the next forward.

    Each offloaded scope's parameters are stepped on a host thread as soon as their gradients
    reach the host, while the device continues backward, and the call returns as soon as
    backward has: the last steps finish while the next forward begins, each before its weights
    are loaded. Reading a parameter, its `.grad` or the optimizer waits for the steps it depends
    on, so per-parameter optimizers (SGD, Adam, AdamW, Adagrad; not LBFGS) give the result of
    `optimizer.step()` after backward. With `max_grad_norm` or `scaler` the steps begin when
    backward ends and overlap only the next forward (Note [clipping in the overlapped step]).
    With gradient accumulation, call `loss.backward()` for all but the last micro-batch. If
    backward raises, the parameters already stepped stay stepped (`last_stepped()`).

    Args:
        loss, optimizer: the scalar to differentiate (`scaler.scale(loss)` with a scaler); a
            `torch.optim.Optimizer` over the model's parameters (offloaded or not).
        zero_grad: set each `.grad` to None once its parameter is stepped, with no wait.
        max_grad_norm: clip as `clip_grad_norm_(clip_parameters, max_grad_norm)` does, bit for
            bit, before the step; `report.grad_norm` is the total norm it returns.
        clip_parameters: what to clip, in the order of the norm; default: the optimizer's params.
        scaler: the `torch.amp.GradScaler` that scaled `loss`: unscales (before clipping), and
            skips the step on inf or NaN as `scaler.step` does. Call `scaler.update()` after.
        spare_threads: CPU threads the worker leaves to the thread launching the device's
            kernels. Default (None): `SPARE_THREADS`, 1.
        piece_bytes: parameter bytes per step of the worker. Default: `STEP_PIECE_BYTES`, 64 MiB.
        device_share: up to this fraction of the offloaded bytes may be stepped on the device
            (SGD, Adam and AdamW, no VRAM budget). Default: 0.0 (off).
        **backward_kwargs: passed to `loss.backward` (e.g. `retain_graph`).

    Returns an `OverlapReport`, completed by the worker; `report.wait()` waits for the whole step.

    Example::

        loss = model(**batch).loss
        report = offtensor.backward_and_step(scaler.scale(loss), optimizer, zero_grad=True,
                                             max_grad_norm=1.0, scaler=scaler)
        scaler.update()
    """
    if in_compiled_region():  # called from a compiled training step: Note [torch.compile]
        return run_outside_dynamo(functools.partial(
            backward_and_step, loss, optimizer, zero_grad=zero_grad, max_grad_norm=max_grad_norm, scaler=scaler,
            clip_parameters=clip_parameters, spare_threads=spare_threads, piece_bytes=piece_bytes,
            device_share=device_share, **backward_kwargs), ())
    engines, stepper = _prepare(loss, optimizer, zero_grad, spare_threads, piece_bytes, device_share,
                                before_step(optimizer, max_grad_norm, clip_parameters, scaler), sys._getframe())
    # Everything that changes module state happens inside the try, so that an interrupt at any
    # point is undone (Note [interrupts]): an engine left pointing at a stepper would refuse
    # every later call, a worker never closed would be waited for forever.
    try:
        stepper.start()
        calls.add(stepper)
        for engine in engines:
            engine.grads.stepper = stepper
        loss.backward(**backward_kwargs)
    except BaseException as e:  # noqa: BLE001 - re-raised by raise_partial, with a note
        stepper.cancel()
        for engine in engines:
            engine.grads.backward_raised()  # if the engine's drop of the task did not (Note [a backward that raised])
        stepper.raise_partial(e, "backward")
    finally:
        # The worker waits for pieces until it is closed, and wait_for_steps() waits for the
        # worker: close() must run whatever line an interrupt lands on here, once more if it
        # landed inside the first close() itself.
        try:
            for engine in engines:
                engine.grads.stepper = None
        finally:
            try:
                stepper.close()
            except BaseException:
                stepper.close()
                raise
    stepper.after_backward()
    _release_held(engines, stepper)
    return stepper.report


def before_step(optimizer: torch.optim.Optimizer, max_grad_norm: Any, clip_parameters: Any,
                scaler: Any) -> BeforeStep | None:
    """What the call does between backward and the step, checked; None: nothing."""
    parameters = check_clip(max_grad_norm, clip_parameters)
    if scaler is not None:
        check_scaler(scaler, optimizer)
    if max_grad_norm is None and scaler is None:
        return None
    return BeforeStep(optimizer, None if max_grad_norm is None else float(max_grad_norm), parameters, scaler)


def _prepare(loss: torch.Tensor, optimizer: torch.optim.Optimizer, zero_grad: bool, spare_threads: int | None,
             piece_bytes: int | None, device_share: float | None, before: BeforeStep | None,
             call: FrameType) -> tuple[list[Engine], OverlappedStep]:
    """Check the call (defaults filled in), wait for the earlier calls' steps and make the
    optimizer's entry points and state wait for this call's: the engines of the models it steps,
    and the call's OverlappedStep, not yet started. `call`: backward_and_step's frame."""
    spare_threads = SPARE_THREADS if spare_threads is None else spare_threads
    piece_bytes = STEP_PIECE_BYTES if piece_bytes is None else piece_bytes
    device_share = DEVICE_SHARE if device_share is None else device_share
    check_call(loss, optimizer, spare_threads, piece_bytes, device_share,
               scaler_given=before is not None and before.has_scaler)
    wait_for_steps()
    engines = engines_of(optimizer)
    check_engines(engines, device_share)
    for engine in engines:
        engine.grads.hand_over_at_once()  # as gradients land (Note [early handover] in optim/step.py)
    install_optimizer_hooks(optimizer)
    fence_state(optimizer)
    watch_clips()  # Note [a clip after the step]
    as_of = OptimizerAsOfCall(optimizer)
    device = DeviceSteps(as_of, float(device_share), piece_bytes, any(e.grads.reducer for e in engines))
    stepper = OverlappedStep(as_of, device, zero_grad=zero_grad, spare_threads=spare_threads,
                             piece_bytes=piece_bytes, call=call, before=before)
    return engines, stepper


def _release_held(engines: list[Engine], stepper: OverlappedStep) -> None:
    """no_offload() keeps device copies that the worker's steps make stale, and the worker
    cannot release them (Threads): wait for the steps here, then let the next forward load the
    new weights. No deferred steps inside no_offload()."""
    held = [engine for engine in engines if engine.hold()]
    if held:
        stepper.wait()
        for engine in held:
            engine.live.release_all(force=True)
