"""The optimizer worker: the thread of one backward_and_step call that steps the pieces handed to
it, on the host or, through the call's `DeviceSteps`, on the device.

# Note [worker threads]
The CPU optimizer's step is bound by the cores it runs on, but a parallel region is as slow as
its slowest thread: with as many OpenMP threads as cores, one busy thread beside them makes a
straggler of one of them (docs/benchmarks.md has the measurements). So the worker leaves
`spare_threads` cores to the thread that launches the device's kernels (autograd's, during
backward; the caller's, in the next forward) while that thread may run, and takes every core for
a piece that starts while a thread is blocked waiting for one of its steps (`PieceQueue.waiting`):
the next forward waiting for the layer it needs, `optimizer.zero_grad()`, `wait_for_steps()`.
The count is chosen per piece, so a thread that starts waiting mid-piece gets its core back at
the next piece. `torch.set_num_threads` also sets the count that threads started later begin
with (one default for the process, read by a thread at its first parallel op). The worker is
such a new thread, so it takes its count from the calling thread (`Worker.threads`) and sets
that back when it stops: restoring what it found on itself, a worker starting while another
model's worker stepped with its spare cores left would find one thread fewer and make that the
default of every later thread. While a worker steps, a thread making its first parallel op
still starts with the worker's count: a thread that trains a model of its own should call
`torch.set_num_threads` first (as the tests do) for the same numerics as the main thread.

# Note [worker steps without subclass dispatch]
On the worker, `__torch_function__` of an offloaded parameter only passes an op on to the master
(`dispatch` in dispatch/ops.py, "masters only") after marking an in-place write (`MasterWrites.master_written`): Python
per op, four per parameter in AdamW's `_init_group` alone and one per in-place update of a
single-tensor optimizer. torch.optim's own optimizers do nothing to a parameter but read its
metadata and `.grad` and update it in place, so for them the worker marks the piece's
parameters as written first and runs the step with subclass dispatch off: the same ops on the
same masters, without the Python per op (docs/benchmarks.md: the time per piece). Other
optimizers (and compressed masters, whose writes need their own dispatch) keep it: their code
or their state tensors may rely on a subclass's `__torch_function__`. The step's hooks run with
dispatch off too; on the worker dispatch only passed their ops on to the masters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ..dispatch.compile import not_compiling
from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import worker_state
from ..engine.host_grads import publish, set_grads
from .clipping import BeforeStep, record_step
from .device_steps import DeviceStep
from .piece_queue import PieceQueue, Run
from .pieces import Piece
from .report import OverlapReport, Timeline
from .views import OptimizerAsOfCall


class Worker:
    """The thread of one backward_and_step call that steps what its queue hands it, until the
    queue is closed and empty or a step raised (the error is left in the queue)."""

    def __init__(self, queue: PieceQueue, as_of: OptimizerAsOfCall, *, spare_threads: int, zero_grad: bool,
                 timeline: Timeline, report: OverlapReport, on_stop: Callable[[], None],
                 before: BeforeStep | None = None) -> None:
        self._queue = queue
        self._as_of = as_of
        self.spare_threads = spare_threads  # left to the launching thread (Note [worker threads])
        self.zero_grad = zero_grad  # each .grad set to None right after its step
        # The calling thread's intra-op thread count, which the worker starts from and leaves as
        # the default of new threads (Note [worker threads]).
        self.threads = torch.get_num_threads()
        self._timeline = timeline
        self._report = report
        self._on_stop = on_stop  # called under the queue's lock once the worker has stopped
        # With clipping or a scaler: gradients published and unscaled by the calling thread,
        # clipped here (Note [clipping in the overlapped step] in optim/clipping.py)
        self._before = before
        self._thread = threading.Thread(target=self._run, name="offtensor-optimizer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        if self._thread.is_alive():  # else not started, or starting: it finds nothing to do
            self._thread.join()

    def _run(self) -> None:
        threads, queue, report = self.threads, self._queue, self._report
        try:
            worker_state.active = True
            # OpenMP thread counts are per calling thread: this sets the worker's alone.
            spared = max(1, threads - self.spare_threads)
            current = None
            while True:
                piece, run = queue.next_piece()
                if piece is None:
                    return
                # A piece stepped on the device runs no host kernel to thread.
                wanted = threads if run is Run.ALL_THREADS else spared
                if wanted != current and run is not Run.ON_DEVICE:
                    torch.set_num_threads(wanted)
                    current = wanted
                report.all_thread_pieces += run is Run.ALL_THREADS and spared < threads
                began = time.perf_counter()
                queued = None
                try:
                    with not_compiling():  # Note [compiling beside the optimizer worker] (dispatch/compile.py)
                        queued = self._step(piece, run)
                finally:
                    report.pieces += 1
                    report.worker_busy_s += time.perf_counter() - began
                    with queue.cond:
                        queue.stepped_piece(piece, queued)
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread by a wait
            with queue.cond:
                queue.fail(e)
        finally:
            try:
                queue.finish_device_steps(block=True)
            finally:
                torch.set_num_threads(threads)
                worker_state.active = False
            with queue.cond:
                queue.stop()
                self._on_stop()

    def _step(self, piece: Piece, run: Run) -> DeviceStep | None:
        """Step one piece; for one stepped on the device, return its queued step."""
        self._timeline.began(piece.scope)
        if self._before is None:
            publish(piece.slots)
        else:
            without_subclass_dispatch(self._before.clip, [slot.param for slot in piece.slots])
        names = [s.name for s in piece.slots]
        updated = lambda: self._queue.stepped.extend(names)  # noqa: E731
        queued = None
        if run is Run.ON_DEVICE:
            queued = self._queue.device.step(piece, updated)
            self._report.device_pieces += 1
        else:
            ids = {id(s.param) for s in piece.slots}
            if self._as_of.is_torch_optim and all(slot.packed is None for slot in piece.slots):
                # Note [worker steps without subclass dispatch]
                for slot in piece.slots:
                    slot.scope.master_written(slot)
                without_subclass_dispatch(self._as_of.step, ids, updated)
            else:
                self._as_of.step(ids, updated)
        if self.zero_grad:
            without_subclass_dispatch(set_grads, piece.slots, [None] * len(piece.slots))
        # Note [a clip after the step] in optim/clipping.py
        record_step([slot.param for slot in piece.slots], [None if self.zero_grad else slot.host_grad
                                                           for slot in piece.slots])
        self._timeline.stepped(piece.scope)  # for a piece on the device: queued there
        return queued
