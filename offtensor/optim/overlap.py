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
exactly the same update as one `optimizer.step()` after backward. The rest (parameters on the
device, scopes used more than once per forward, parameters also used outside their scope) is
stepped on the calling thread once backward has returned.

# Note [deferred steps]
Even so the step cannot end before backward plus the optimizer time of the scope whose
gradients come last, and that is the model's first block, which the next forward needs first.
So `backward_and_step` returns as soon as backward has, and the worker finishes in the
background while the next forward begins. Every parameter handed to the worker carries a
fence, `ParamSlot.pending_step` (Note [step fences] in core/slot.py), until its step is done, and
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
from types import FrameType
from typing import Any

import torch

from ..core.engine import Engine
from ..dispatch.compile import in_compiled_region, run_outside_dynamo
from . import calls
from .calls import last_stepped, wait_for_steps
from .checks import check_call, check_engines, engines_of
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
                      spare_threads: int | None = None, piece_bytes: int | None = None,
                      device_share: float | None = None, **backward_kwargs: Any) -> OverlapReport:
    """`loss.backward(); optimizer.step()`, with the optimizer overlapped with backward and with
    the next forward.

    Each offloaded scope's parameters are stepped on a host thread as soon as their gradients
    reach the host, while the device continues backward through the earlier scopes, and the
    call returns as soon as backward has: the last scopes' steps finish while the next forward
    begins, each before its weights are loaded. A step then costs about max(forward+backward,
    CPU optimizer step) instead of their sum. Reading a parameter, its `.grad` or the optimizer
    waits for the steps it depends on, so per-parameter optimizers (SGD, Adam, AdamW, Adagrad and
    the like; not LBFGS) give the result of `optimizer.step()` after backward. Global-norm
    clipping and a `torch.amp.GradScaler` (which raises) need every gradient before the first
    update: use `loss.backward()` and `optimizer.step()` for them. With gradient accumulation,
    call `loss.backward()` for all but the last micro-batch. If backward raises, the parameters
    already stepped stay stepped (`last_stepped()`).

    Args:
        loss: the scalar to differentiate.
        optimizer: a `torch.optim.Optimizer` over the model's parameters (offloaded or not).
        zero_grad: set each `.grad` to None once its parameter is stepped, with no wait
            (`optimizer.zero_grad()` right after the call waits for the whole step).
        spare_threads: CPU threads the worker leaves to the thread that launches the device's
            kernels, which would else wait for a core. Default (None): `SPARE_THREADS`, 1.
        piece_bytes: parameter bytes per optimizer step of the worker, so that a piece the next
            forward needs soon never waits behind a whole scope. Default: `STEP_PIECE_BYTES`, 64 MiB.
        device_share: up to this fraction of the optimizer's offloaded bytes may be stepped on
            the device (masters, gradients and state copied there and back), for a host whose
            optimizer is slower than forward+backward: SGD, Adam and AdamW without step hooks of
            the user's (else `report.device_steps_off` says why), no VRAM budget. Default: 0.
        **backward_kwargs: passed to `loss.backward` (e.g. `retain_graph`).

    Returns:
        An `OverlapReport`, completed by the worker; `report.wait()` waits for the whole step.

    Example::

        for i, batch in enumerate(micro_batches):
            loss = model(**batch).loss / len(micro_batches)
            if i < len(micro_batches) - 1:
                loss.backward()
            else:
                offtensor.backward_and_step(loss, optimizer, zero_grad=True)
    """
    if in_compiled_region():  # called from a compiled training step: Note [torch.compile]
        return run_outside_dynamo(functools.partial(
            backward_and_step, loss, optimizer, zero_grad=zero_grad, spare_threads=spare_threads,
            piece_bytes=piece_bytes, device_share=device_share, **backward_kwargs), ())
    engines, stepper = _prepare(loss, optimizer, zero_grad, spare_threads, piece_bytes, device_share, sys._getframe())
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


def _prepare(loss: torch.Tensor, optimizer: torch.optim.Optimizer, zero_grad: bool, spare_threads: int | None,
             piece_bytes: int | None, device_share: float | None,
             call: FrameType) -> tuple[list[Engine], OverlappedStep]:
    """Check the call (defaults filled in), wait for the earlier calls' steps and make the
    optimizer's entry points and state wait for this call's: the engines of the models it steps,
    and the call's OverlappedStep, not yet started. `call`: backward_and_step's frame."""
    spare_threads = SPARE_THREADS if spare_threads is None else spare_threads
    piece_bytes = STEP_PIECE_BYTES if piece_bytes is None else piece_bytes
    device_share = DEVICE_SHARE if device_share is None else device_share
    check_call(loss, optimizer, spare_threads, piece_bytes, device_share)
    wait_for_steps()
    engines = engines_of(optimizer)
    check_engines(engines, device_share)
    install_optimizer_hooks(optimizer)
    fence_state(optimizer)
    as_of = OptimizerAsOfCall(optimizer)
    device = DeviceSteps(as_of, float(device_share), piece_bytes, any(e.grads.reducer for e in engines))
    stepper = OverlappedStep(as_of, device, zero_grad=zero_grad, spare_threads=spare_threads,
                             piece_bytes=piece_bytes, call=call)
    return engines, stepper


def _release_held(engines: list[Engine], stepper: OverlappedStep) -> None:
    """no_offload() keeps device copies that the worker's steps make stale, and the worker
    cannot release them (Threads): wait for the steps here, then let the next forward load the
    new weights. No deferred steps inside no_offload()."""
    held = [engine for engine in engines if engine.hold()]
    if held:
        stepper.wait()
        for engine in held:
            engine.release_all(force=True)
