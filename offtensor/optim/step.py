"""One backward_and_step call: `OverlappedStep`, which hands backward's finished parameters to
the optimizer worker, steps the rest on the calling thread and is the fence of every parameter
it handed over until that parameter is stepped.

# Note [early handover]
The step of the last block, which the next forward needs last, is the worker's last piece of
work; after it the worker idles until the next backward's first gradients land. Handing
parameters over as their own gradients land, not when their scope's backward ends, shortens that
idle time by the block's backward (its last matrix, the first to get its gradient, is the last
the forward needs). A gradient is final when it is the parameter's only contribution to this
backward, known from the last backward (`ParamSlot.single_grad`): autograd sums all uses of a
device copy in one graph task before its post-accumulate-grad hook fires, so only a parameter
used outside its scope, a scope called more than once since the last backward
(`Scope.calls.grad_since_backward`) or reentrant checkpointing of parts of one scope gives
several, and these do not change between steps. Should a second contribution arrive anyway,
backward raises rather than let it go missing, and the parameter is no longer handed over early
(a late one for a parameter handed over at its scope's end makes the model's scopes wait for the
end of backward: `GradOffload.late_gradients`). "Used outside its scope" (`ParamSlot.used_outside`,
checked at every handover) means a copy made for an op outside the scope with grad on is still
alive, so a graph holds it (a tied embedding read by the head); a copy is dead once its graph is,
so a norm of the weights logged once does not keep the parameter from the worker for good.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any, NoReturn

import torch

from ..dispatch.slot import ParamSlot
from ..engine.engine import owning_engine
from ..engine.host_grads import publish
from ..scopes.scope import Scope, scope_of
from . import calls
from .clipping import BeforeStep, record_step
from .device_steps import DeviceStep, DeviceSteps
from .piece_queue import PieceQueue
from .pieces import Piece, cut, slot_bytes
from .report import OverlapReport, Timeline
from .views import OptimizerAsOfCall
from .worker import Worker


class OverlappedStep:
    """One backward_and_step call: what backward hands to the worker, the rest, the waits."""

    def __init__(self, as_of: OptimizerAsOfCall, device: DeviceSteps, *, zero_grad: bool, spare_threads: int,
                 piece_bytes: int, call: FrameType, before: BeforeStep | None = None) -> None:
        optimizer = as_of.optimizer
        self._as_of = as_of
        self.zero_grad = zero_grad
        self.piece_bytes = piece_bytes  # parameter bytes per worker step (Note [deferred steps])
        self._ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        # What the worker may step (Note [groups stepped whole] in optim/views.py)
        self._handable = self._ids - as_of.stepped_whole if as_of.stepped_whole else self._ids
        # Names of the offloaded parameters; the others are named by their position.
        self._names = {id(p): p._ot.name if hasattr(p, "_ot") else f"param_groups[{i}][{j}]"
                       for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])}
        self._handed: set[int] = set()  # ids of the parameters handed to the worker
        self._ended: set[int] = set()  # scopes whose backward ended (post_backward can repeat)
        # Per scope: final gradients not yet a whole piece, and their bytes.
        self._early: dict[Scope, tuple[list[ParamSlot], int]] = {}
        self._rest_done = 0.0  # when the rest was stepped, in seconds since the call
        self._timeline = Timeline()
        self.report = OverlapReport(_stepper=self, device_steps_off=device.off)
        self._queue = PieceQueue(device, holding=before is not None)
        # With clipping or a scaler: the pieces handed over in backward, held until it has
        # returned (Note [clipping in the overlapped step] in optim/clipping.py).
        self._before = before
        self.measures_norms = before is not None and before.measures_norms
        self._held: list[tuple[Scope, list[tuple[list[ParamSlot], int]], Any, bool]] = []
        # The backward_and_step call's frame and thread, until closed (close_if_abandoned).
        self._call: FrameType | None = call
        self._caller = threading.get_ident()
        self._worker = Worker(self._queue, as_of, spare_threads=spare_threads, zero_grad=zero_grad,
                              timeline=self._timeline, report=self.report, on_stop=self._finish_report,
                              before=before)

    def start(self) -> None:
        self._worker.start()

    def _locked(self, fn: Any, *args: Any) -> Any:
        return self._queue.locked(fn, *args)

    def elapsed(self) -> float:
        return self._timeline.elapsed()

    # ---- handed over from backward -------------------------------------------------------------

    def grad_final(self, slot: ParamSlot, landed: Any) -> None:
        """Called right after a parameter's gradient copy was enqueued, when that gradient is
        its only one in this backward (Note [early handover]); `landed`: the copy's event."""
        scope = scope_of(slot)
        if (scope.calls.grad_since_backward > 1 or owning_engine(scope).grads.late_gradients or slot.used_outside
                or id(slot.param) not in self._handable):
            return
        batch, nbytes = self._early.get(scope, ([], 0))
        batch.append(slot)
        nbytes += slot_bytes(slot)
        if nbytes >= self.piece_bytes:
            self._early.pop(scope, None)
            self._hand(scope, [(batch, nbytes)], landed, early=True)
        else:
            self._early[scope] = (batch, nbytes)

    def grad_written(self, slot: ParamSlot, grad: torch.Tensor, host: torch.Tensor) -> None:
        """A gradient of this backward, summed on the device and copied to `host`: its norm,
        for the clip (Note [norms taken in backward] in optim/clipping.py)."""
        assert self._before is not None
        self._before.measure(slot.param, grad, host)

    def scope_done(self, scope: Scope, grads_offloaded: Any) -> None:
        """Called at a scope's post_backward, after its d2h copies were enqueued: hand over its
        parameters not handed yet."""
        self._early.pop(scope, None)
        if scope.calls.grad_since_backward > 1 or owning_engine(scope).grads.late_gradients or id(scope) in self._ended:
            return  # another call's backward may still add to these grads; or queued already
        self._ended.add(id(scope))
        order = scope.copy_order or scope.slots
        slots = [s for s in order if s.grad_written and id(s.param) in self._handable and not s.used_outside
                 and id(s.param) not in self._handed]
        self._hand(scope, cut(slots, self.piece_bytes), grads_offloaded, early=False)

    def _hand(self, scope: Scope, pieces: list[tuple[list[ParamSlot], int]], landed: Any, *, early: bool) -> None:
        """Queue pieces of one scope (each: its slots, their bytes) for the worker, each stepped
        once `landed` has passed."""
        if not pieces:
            return
        self._locked(self._put, scope, pieces, landed, early)

    def _put(self, scope: Scope, pieces: list[tuple[list[ParamSlot], int]], landed: Any, early: bool) -> None:
        if self._queue.done:
            return  # the worker failed: the error is raised on the calling thread
        if self._queue.holding:
            self._held.append((scope, pieces, landed, early))
            self._handed.update(id(slot.param) for slots, _ in pieces for slot in slots)
            return
        rank = owning_engine(scope).schedule.forward_position(scope)
        self._timeline.handed(scope.name)
        for slots, nbytes in pieces:
            first = min(slot.copy_index for slot in slots)
            self._queue.put(Piece(scope.name, slots, landed, (rank, first), nbytes), self)
            self._handed.update(id(slot.param) for slot in slots)
        if early:
            self.report.early_pieces += len(pieces)
        self._queue.cond.notify_all()

    @property
    def closed(self) -> bool:
        """No more pieces come: its backward is over (or an interrupt skipped the end of it)."""
        return self._queue.closed

    @property
    def waiting(self) -> int:
        """Threads blocked waiting for its steps (Note [worker threads] in optim/worker.py)."""
        return self._queue.waiting

    def handed(self, slot: ParamSlot) -> bool:
        """True when the worker publishes and steps this slot (finalize leaves it alone)."""
        return id(slot.param) in self._handed

    # ---- the end of the call -------------------------------------------------------------------

    def close(self) -> None:
        self._locked(self._close)

    def _close(self) -> None:
        self._queue.close()  # first: an interrupt between the two leaves the call closed
        if not self._queue.holding:  # else the call still hands over its held pieces
            self._call = None

    def close_if_abandoned(self) -> None:
        """Close a stepper whose backward_and_step call has ended without closing it: an
        interrupt can land on a line of its cleanup before `close()` runs (the `try:` of its
        `finally`), or before it released the pieces it held, and the worker would wait for
        pieces, and every wait for it, forever."""
        call = self._call
        if call is None or (self._queue.closed and not self._queue.holding):
            return
        # The calling thread's stack, from whichever thread waits (None: that thread has ended).
        frame = sys._getframe() if threading.get_ident() == self._caller else sys._current_frames().get(self._caller)
        while frame is not None:
            if frame is call:
                return  # the call is still running (a wait from inside it)
            frame = frame.f_back  # type: ignore[assignment]
        self._locked(self._abandon)

    def _abandon(self) -> None:
        self._queue.holding = False  # pieces held back are not stepped: the call was interrupted
        self._close()

    def cancel(self) -> None:
        """Backward or the rest's step raised: drop what has not started, wait for the rest.
        The exception in flight is the one the caller sees; a worker error is dropped."""
        self._locked(self._drop_pending)
        self._worker.join()
        self._queue.error = None
        calls.forget(self)

    def _drop_pending(self) -> None:
        self._queue.drop()
        self._call = None

    def raise_partial(self, error: BaseException, where: str) -> NoReturn:
        """Re-raise `error` saying what the optimizer had stepped (Note [partial steps])."""
        calls.raise_partial(error, where, self._locked(list, self._queue.stepped), len(self._ids))

    def after_backward(self) -> None:
        """Backward has returned: clip and hand over what was held; step the rest; for a class of
        the user's, wait for a part to write its attributes back (Note [attributes the
        optimizer's step sets])."""
        self.report.backward_s = self.elapsed()
        try:
            if self._before is not None:
                self._begin_steps(self._before)
            self._step_rest()
        except BaseException as e:  # noqa: BLE001 - re-raised by raise_partial, with a note
            self.cancel()
            self.raise_partial(e, "the optimizer step")
        if not self._as_of.is_torch_optim and not self.report.rest_params:
            self._locked(self._queue.wait_for_a_part)

    def _begin_steps(self, before: BeforeStep) -> None:
        """Publish the held gradients, unscale, check and clip them, then hand the held pieces
        to the worker, unless the scaler found inf or NaN (Note [clipping in the overlapped
        step] in optim/clipping.py)."""
        held = self._held
        publish([slot for _, pieces, _, _ in held for slots, _ in pieces for slot in slots])
        self.report.step_skipped = not before.prepare()
        self.report.grad_norm = before.total_norm
        if self.report.step_skipped:
            before.clip_all(not_in=set())  # as the plain recipe clips before scaler.step skips
            self._handed.clear()
        else:
            before.clip_all(not_in=self._handed)  # the worker clips its pieces
            before.stepping()
        self._locked(self._release, held)

    def _release(self, held: list[tuple[Scope, list[tuple[list[ParamSlot], int]], Any, bool]]) -> None:
        self._queue.release()
        self._held = []
        if not self.report.step_skipped:
            for entry in held:
                self._put(*entry)
        self._call = None  # closed, nothing held

    def _step_rest(self) -> None:
        """Step what the worker does not, on the calling thread (no more pieces come)."""
        error = self._queue.error
        if error is not None:
            raise error  # the worker failed during backward: stop here
        rest = self._ids - self._handed
        params = [p for g in self._as_of.optimizer.param_groups for p in g["params"] if id(p) in rest]
        if self.report.step_skipped:
            assert self._before is not None
            self._before.skip()
        elif rest:
            self.report.rest_params = len(rest)
            names = [self._names.get(i, "?") for i in rest]
            self._as_of.step(rest, lambda: self._locked(self._queue.stepped.extend, names))
            record_step(params, [None if self.zero_grad else p.grad for p in params])
        if self.zero_grad:
            for p in params:
                p.grad = None
        self._locked(self._rest_stepped)

    def _rest_stepped(self) -> None:
        self._rest_done = self.elapsed()
        self._finish_report()

    def _finish_report(self) -> None:
        """Called under the lock when the worker or the rest finishes; fills in the report and,
        when all went well, lets go of the optimizer (a kept report must not keep its state)."""
        if not (self._queue.done and self._rest_done):
            return
        self._timeline.fill(self.report, self._rest_done)
        if self._queue.error is None:
            self.report._stepper = None
            calls.forget(self)

    # ---- waits (the fence of every parameter handed over) --------------------------------------

    def wait(self, slot: ParamSlot | None = None, *, from_any_thread: bool = True) -> None:
        """Until `slot`'s step is done (every step, when None); raises a worker error once.
        `from_any_thread=False`: the error of a call made on another thread that still runs is
        left for that thread (Note [calls in several threads])."""
        if slot is None and self._queue.holding and self._call is not None and threading.get_ident() == self._caller:
            raise RuntimeError(
                "offtensor.backward_and_step: optimizer.step(), state_dict(), zero_grad() or "
                "offtensor.wait_for_steps() while the call clips or unscales the gradients (in a "
                "post-accumulate-grad hook) would wait for steps that begin only after that: it "
                "waited forever. Call it after backward_and_step returns")
        while True:
            error, on_device = self._locked(self._wait_locked, slot, from_any_thread)
            if on_device is None:
                break
            on_device.synchronize()  # its piece steps on the device: clear the fence now
            self._queue.finish_device_steps()
        if error is not None:
            calls.forget(self)  # the worker has stopped; its error is raised once, here
            # Once the call has returned, the error comes out of whatever waits next (the next
            # forward, `p.grad`, a later call): say which step it was.
            self.raise_partial(error, "the optimizer step deferred past its backward_and_step call "
                                      "(which had returned)" if self._rest_done else "the optimizer step")

    def _wait_locked(self, slot: ParamSlot | None,
                     from_any_thread: bool) -> tuple[BaseException | None, DeviceStep | None]:
        """Under the lock: wait for `slot`'s step; return the worker's error to raise, or the
        device step to wait for outside the lock."""
        queue = self._queue
        on_device = queue.wait_until_stepped(slot)
        if on_device is not None:
            return None, on_device
        if (queue.error is not None and not from_any_thread and threading.get_ident() != self._caller
                and self._caller in sys._current_frames()):
            return None, None
        error, queue.error = queue.error, None
        return error, None

    def settle(self) -> None:
        """Until the worker has stopped, if no more pieces come; its error stays to be raised
        by the next wait (Note [fork while steps are deferred])."""
        self._locked(self._queue.settle)
