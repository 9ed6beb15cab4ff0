"""The backward_and_step calls whose steps may still be pending, and the waits for all of them:
`wait_for_steps`, before a fork, at exit; what a failed call had stepped (`last_stepped`).

# Note [calls in several threads]
Two threads may each train a wrapped model of their own with `backward_and_step` (the engines
refuse only a second thread on one model). Each call first waits for the earlier calls' steps,
but two calls can get past that wait together, so the calls whose steps may still be pending
are a list (`_calls`), not one latest call, which would forget the first of two such calls
(waits would return while its worker still stepped): `wait_for_steps()`, the optimizer's entry
points, the whole-state waits and the waits before a fork and at exit wait for each. A call
leaves the list when its steps are done, or when its error has been raised. That error is raised
on the thread that made the call while that thread runs (once it has ended, by whichever thread
waits next): a wait for every call (the next `backward_and_step` of another thread's model, its
optimizer's `step`) would otherwise raise the failure of the other thread's optimizer, which
that thread would then never see.

# Note [partial steps]
The worker steps parameters while backward is still running, so an exception in backward (an
out-of-memory error, a user hook, Ctrl-C) or in the optimizer itself can leave some parameters
stepped and others not, and which ones depends on timing. This cannot be rolled back (the
optimizer state changed too), so it is made visible: the exception is re-raised with a note
naming the parameters stepped (Python 3.10: a RuntimeError from it), and `last_stepped()` lists
them all. A parameter counts as stepped once its optimizer update is done, before the step
post-hooks run: a post-hook that raises follows an update (step_subset's `updated`).

# Note [exit while steps are deferred]
A script whose last call is `backward_and_step` ends while the worker, a daemon thread, is still
stepping; the interpreter's shutdown would tear it down inside PyTorch's C++ code, and the
process die with "terminate called without an active exception" (SIGABRT). An atexit handler
waits for the deferred steps (`settle`: a worker error is not raised there) before the
interpreter shuts down.

# Note [fork while steps are deferred]
A forked process has only the thread that forked: the optimizer worker is not there. A
DataLoader's worker processes fork at `iter(loader)`, typically right after a
`backward_and_step` returned with steps still deferred; a loader worker reading an offloaded
parameter (a dataset or collate holding the model) would wait for a fence nothing would ever
clear, on half-stepped masters. So the process waits for the deferred steps just before any fork
(`os.register_at_fork`), and the child starts from the stepped weights with no fence set. A fork
from inside a backward (a hook) cannot wait for the steps of that backward, which are still
being handed over: it forks as it is. The wait leaves a worker error in place, for the parent's
next wait to raise.
"""

from __future__ import annotations

import threading
from typing import Any, NoReturn, Protocol

import torch

from .. import patches
from ..dispatch.compile import in_compiled_region, run_outside_dynamo
from ..dispatch.slot import on_optimizer_worker


class PendingCall(Protocol):
    """What the waits need of a backward_and_step call (`OverlappedStep` in optim/step.py)."""

    @property
    def closed(self) -> bool: ...

    def close_if_abandoned(self) -> None: ...

    def wait(self, slot: Any = None, *, from_any_thread: bool = True) -> None: ...

    def settle(self) -> None: ...


# The backward_and_step calls whose steps may be pending: one per thread training a model of its
# own (Note [calls in several threads]); guarded by _calls_lock.
_calls: list[PendingCall] = []
_calls_lock = threading.Lock()
_last_stepped: list[str] = []  # what the last failed backward_and_step had stepped


def add(call: PendingCall) -> None:
    with _calls_lock: _calls.append(call)  # noqa: E701  (one line: Note [interrupts])


def pending() -> list[PendingCall]:
    """The backward_and_step calls whose steps may be pending (Note [calls in several threads])."""
    with _calls_lock: return list(_calls)  # noqa: E701


def forget(call: PendingCall) -> None:
    """`call` has nothing left to wait for: no step pending, no error to raise."""
    with _calls_lock: _calls[:] = [c for c in _calls if c is not call]  # noqa: E701  (Note [interrupts])


def last_stepped() -> list[str]:
    """Names of the parameters that the last failed `backward_and_step` had stepped before it
    raised (Note [partial steps]); empty if it raised before any step."""
    return list(_last_stepped)


def raise_partial(error: BaseException, where: str, stepped: list[str], total: int) -> NoReturn:
    """Re-raise `error`, saying which of the `total` parameters the optimizer had already stepped
    (`stepped`, kept for last_stepped()): a failed backward_and_step is a partial step (Note
    [partial steps]); `where` says what raised."""
    global _last_stepped
    _last_stepped = stepped
    if not stepped:
        note = (f"offtensor.backward_and_step: {where} raised before the optimizer stepped any "
                "parameter; no weight changed.")
    else:
        shown = ", ".join(repr(n) for n in stepped[:8]) + (", ..." if len(stepped) > 8 else "")
        note = (f"offtensor.backward_and_step: {where} raised after the optimizer had stepped "
                f"{len(stepped)} of its {total} parameters ({shown}); the others were "
                "not stepped. The model now mixes updated and old weights: reload a checkpoint, "
                "or accept the partial step. offtensor.last_stepped() lists them all.")
    if hasattr(error, "add_note"):
        error.add_note(note)
        raise error
    raise RuntimeError(f"{note} The error: {error!r}") from error  # Python 3.10


def wait_for_steps() -> None:
    """Block until the latest `backward_and_step` has stepped every parameter."""
    if in_compiled_region():  # Note [torch.compile] in dispatch/compile.py
        return run_outside_dynamo(wait_for_steps, ())
    for call in pending():
        call.close_if_abandoned()
        if not call.closed and torch._C._current_graph_task_id() != -1:
            # A gradient hook of the call's own backward: its steps end after that backward.
            raise RuntimeError(
                "offtensor.backward_and_step: optimizer.step(), optimizer.state_dict(), "
                "load_state_dict() or offtensor.wait_for_steps() inside the backward of "
                "backward_and_step (in a gradient hook) would wait for steps that end only "
                "after this backward: it waited forever. Call it after backward_and_step returns"
            )
        call.wait(from_any_thread=False)


def _settle_before_fork() -> None:
    """os.register_at_fork's `before`: Note [fork while steps are deferred]."""
    if not on_optimizer_worker():
        for call in pending():
            call.settle()


def _settle_at_exit() -> None:
    """atexit: Note [exit while steps are deferred]."""
    for call in pending():
        call.settle()


patches.before_fork_and_at_exit(_settle_before_fork, _settle_at_exit)
