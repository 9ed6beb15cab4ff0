"""The pieces of one backward_and_step call between the threads that hand them over or wait for
them and the optimizer worker, under one lock: `PieceQueue`."""

from __future__ import annotations

import enum
import threading
from typing import Any

from ..dispatch.slot import ParamSlot, StepFence, holding_masters
from .device_steps import DeviceStep, DeviceSteps
from .pieces import Piece


class Run(enum.Enum):
    """How the worker steps the piece it takes next."""

    SPARING = "on the host, leaving the launching thread its spare cores (Note [worker threads])"
    ALL_THREADS = "on the host, on every core: a thread is blocked waiting for a step"
    ON_DEVICE = "on the device (Note [device steps] in optim/device_steps.py)"


class PieceQueue:
    """The pieces handed to the worker and not started, the device's (`DeviceSteps`), the
    worker's error and the threads waiting for a step, under one lock and condition. The call's
    two flags are independent: `closed` (no more pieces come) and `done` (the worker stopped,
    after its last piece or on an error, while backward may still run). `holding`: pieces come
    after `closed` too, until the call's gradients are clipped (Note [clipping in the overlapped
    step] in optim/clipping.py)."""

    def __init__(self, device: DeviceSteps, *, holding: bool = False) -> None:
        # A C lock: `with` on it has no Python __enter__ for an interrupt to land in.
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.device = device
        self._pieces: list[Piece] = []  # handed over, not yet started
        self.closed = False
        self.holding = holding
        self.done = False
        self.error: BaseException | None = None  # the worker's, to raise on a calling thread
        self.waiting = 0  # threads blocked in a wait (Note [worker threads])
        self.pieces_stepped = 0  # by the worker, failed ones included
        self.stepped: list[str] = []  # names of the parameters stepped, in order

    def locked(self, fn: Any, *args: Any) -> Any:
        """fn(*args) under the lock, on the calling thread. One line: a KeyboardInterrupt can
        land before or after, never between taking and releasing the lock (Note [interrupts])."""
        with self.lock: return fn(*args)  # noqa: E701

    # ---- under the lock ----------------------------------------------------------------------

    def put(self, piece: Piece, fence: StepFence) -> None:
        # Queued before marked pending: the worker clears the marks of what it was given, so an
        # interrupt between the two leaves no mark that nothing would clear.
        self._pieces.append(piece)
        holding_masters()
        for slot in piece.slots:
            slot.pending_step = fence  # Note [deferred step fences] in dispatch/slot.py

    def close(self) -> None:
        self.closed = True
        self.cond.notify_all()

    def drop(self) -> None:
        """No more pieces come, and those not started never will: their fences clear."""
        self.closed = True
        self.holding = False
        self.clear_pending(self._pieces)
        self._pieces.clear()
        self.cond.notify_all()

    def release(self) -> None:
        """The pieces held back are in: the worker stops once it has stepped them."""
        self.holding = False
        self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The worker raised: its error waits for a calling thread, the pieces left are dropped."""
        self.error = error
        self.clear_pending(self._pieces)
        self._pieces.clear()

    def stop(self) -> None:
        self.done = True
        self.cond.notify_all()

    def stepped_piece(self, piece: Piece, queued: DeviceStep | None) -> None:
        """The worker is through with `piece`: its fence clears, unless it was queued on the
        device, where it stays until the piece's copies back land (`finish_device_steps`)."""
        self.pieces_stepped += 1
        if queued is None:
            self.clear_pending([piece])
        else:
            self.device.add(piece, queued)
        self.cond.notify_all()

    def wait_until_stepped(self, slot: ParamSlot | None) -> DeviceStep | None:
        """Until `slot`'s step is done (every step and the worker stopped, when None), or until
        its piece is queued on the device: returned, for the caller to wait for outside the lock."""
        self.waiting += 1
        try:
            if slot is None:
                while not self.done:
                    self.cond.wait()
            else:
                while slot.step_pending:
                    on_device = self.device.holding(slot)
                    if on_device is not None:
                        return on_device
                    self.cond.wait()
        finally:
            self.waiting -= 1
        return None

    def wait_for_a_part(self) -> None:
        """Until the worker has stepped a piece, or stopped."""
        while not self.pieces_stepped and not self.done:
            self.cond.wait()

    def settle(self) -> None:
        """Until the worker has stopped, if no more pieces come."""
        while self.closed and not self.holding and not self.done:
            self.cond.wait()

    @staticmethod
    def clear_pending(pieces: list[Piece]) -> None:
        for piece in pieces:
            for slot in piece.slots:
                slot.pending_step = None

    # ---- not under the lock ------------------------------------------------------------------

    def next_piece(self) -> tuple[Piece | None, Run]:
        """For the worker: the landed piece that the next forward needs first (Note [deferred
        steps]), stepped on every core if a thread is waiting for a step as it is taken; or the
        one the device takes (Note [device steps] in optim/device_steps.py). None once all are
        done and no more come."""
        while True:
            self.finish_device_steps()
            with self.cond:
                while not self._pieces and (not self.closed or self.holding) and not self.device.busy():
                    self.cond.wait()
                if not self._pieces and not self.device.busy():
                    return None, Run.SPARING
                ready = [p for p in self._pieces if p.landed is None or p.landed.query()]
                piece = self.device.take(ready)
                if piece is not None:
                    self._pieces.remove(piece)
                    return piece, Run.ON_DEVICE
                if ready:
                    piece = min(ready, key=lambda p: p.deadline)
                    self._pieces.remove(piece)
                    return piece, Run.ALL_THREADS if self.waiting > 0 else Run.SPARING
                # Nothing to start: wait for the oldest device step, else for the first piece
                # handed over (its copies land first).
                oldest = self.device.oldest()
                wait_for = oldest if oldest is not None else self._pieces[0].landed
            wait_for.synchronize()

    def finish_device_steps(self, block: bool = False) -> None:
        """Clear the fences of the pieces stepped on the device whose copies back have landed
        (`block`: wait for all of them first). Any thread."""
        with self.cond:
            in_flight = self.device.in_flight()
        if not in_flight:
            return
        if block:
            for _, step in in_flight:
                step.synchronize()
        finished = [piece for piece, step in in_flight if step.done()]
        if finished:
            with self.cond:
                self.device.landed(finished)
                self.clear_pending(finished)
                self.cond.notify_all()
