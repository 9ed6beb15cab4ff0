"""The staging ring: the loads of scopes whose masters are in files (`Policy(host_budget=...)`) or
in pageable memory (`Policy(pin_memory="ring")`) copy from its page-locked slots, which reader
threads fill ahead of the learned order.

# Note [staged loads]
A scope whose masters are in a file (MasterHome.FILE: `files` says where), or in pageable memory
under Policy(pin_memory="ring") or after pinning failed (MasterHome.RING), loads from a slot of the
model's one StagingRing: `2 + prefetch` slots of the largest such scope's host bytes, page-locked
on CUDA, so page-locked memory and the host memory of reads are bounded by the ring. The scope's
source (Note [master sources] in scopes/sources.py) takes its bytes from `acquire` in place of its
host buffer, its load copies them whole, and `copied` hands the slot back with the copy's event;
the slot is reused once that event passed and keeps its bytes until then, so a load soon after (the
last scope of a forward, loaded again by its backward) reads nothing. Reads run ahead on READERS
threads, in READ_CHUNK pieces so several are in flight: each acquire asks for the scopes the engine
expects next (`upcoming`, from the Schedule's learned orders: the rest of this pass, then the next
one) in the free slots, and a prefetch does not load a file scope whose read is not done (`ready`)
but leaves it to its on-demand load, so the thread that queues kernels does not wait on the disk
for a scope it does not need yet. A kept scope on the device (Policy(vram_budget)) takes no place
in the window: it loads nowhere. Pageable masters are read ahead only while no parameter of the
scope is trainable or waits for a step; a fill is stale, and read again, when the scope's
`write_mark` (writes through its parameters, versions of their masters and of the `p.data` aliases
handed out: Note [p.data aliases] in dispatch/slot.py) changed while it was read or staged. File
scopes are never written (Note [masters in files] in storage/file_masters.py).
"""

from __future__ import annotations

import enum
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..api import Residency
from .file_masters import FileScope
from .files import FileHandle
from .memory import HostBuffer, PinnedMemoryError, PinningFallback

READERS = 4  # threads reading files into the ring: several reads in flight keep an NVMe drive busy
_PAGE = 4096


class StagedMasters(Protocol):
    """A staged scope's host side as the ring reads it (HostMasters in scopes/host_masters.py, above)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def flat(self) -> torch.Tensor: ...  # the masters' bytes, pageable

    @property
    def files(self) -> FileScope | None: ...  # where in the files each master is (FILE); None: in `flat` (RING)


class StagedScope(Protocol):
    """A scope as its staging ring sees it (Scope in scopes/scope.py, above)."""

    @property
    def name(self) -> str: ...

    @property
    def residency(self) -> Residency: ...

    @property
    def masters(self) -> StagedMasters: ...

    def offloaded(self) -> bool: ...

    def frozen_now(self) -> bool: ...

    def write_mark(self) -> tuple[Any, ...]: ...  # the writes to the masters so far


class SlotState(enum.Enum):
    """What a slot of the staging ring holds (Note [staged loads])."""

    FREE = "free"  # nothing
    STAGING = "staging"  # a scope's bytes, being read or read (its fill's `done`), for its next load
    COPYING = "copying"  # taken by a load: its copy reads it until `copied` passes; bytes still valid


@dataclass(eq=False)
class _Fill:
    """One scope's bytes on their way into a slot; `finished` is called by the reader threads."""

    scope: StagedScope
    mark: tuple[Any, ...]  # StagingRing._mark(scope) when the read started
    pending: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    cancelled: bool = False  # the slot is wanted for another scope: reads not started are skipped
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self, error: Exception | None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.pending -= 1
            last = self.pending == 0
        if last:
            self.done.set()


@dataclass(eq=False)
class _Slot:
    flat: torch.Tensor  # uint8, the ring's slot_bytes
    view: memoryview  # the same bytes, for preadv
    state: SlotState = SlotState.FREE
    fill: _Fill | None = None
    copied: Any = None  # event after the latest load's copy out of it (CUDA); None: done
    used: int = 0  # when a load last took it (least recently used goes first)


class _Stats:
    """What the reader threads have read from files: bytes, and the seconds while at least one
    read was in flight (the drive's time, which a timed layout charges file scopes' copies:
    Note [a timed layout] in budget/layout.py)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_read = 0
        self.busy_s = 0.0
        self._reading = 0
        self._since = 0.0

    def begin(self) -> None:
        with self.lock:
            if self._reading == 0:
                self._since = time.perf_counter()
            self._reading += 1

    def end(self, nbytes: int) -> None:
        with self.lock:
            self.bytes_read += nbytes
            self._reading -= 1
            if self._reading == 0:
                self.busy_s += time.perf_counter() - self._since


class _Read:
    """A read of one piece of a scope's masters into a slot, on a reader thread."""

    __slots__ = ("file", "offset", "buffers", "fill", "stats")

    def __init__(self, file: FileHandle, offset: int, buffers: list[memoryview], fill: _Fill, stats: _Stats) -> None:
        self.file, self.offset, self.buffers, self.fill, self.stats = file, offset, buffers, fill, stats

    def __call__(self) -> None:
        error = None
        if not self.fill.cancelled:
            n = 0
            self.stats.begin()
            try:
                n = self.file.read_into(self.buffers, self.offset)
            except (OSError, EOFError, ValueError) as e:  # raised by the load that waits for it (acquire)
                error = e
            finally:
                self.stats.end(n)
        self.fill.finished(error)


class _Copy:
    """A copy of a scope's pageable masters into a slot, on a reader thread."""

    __slots__ = ("dest", "source", "fill")

    def __init__(self, dest: torch.Tensor, source: torch.Tensor, fill: _Fill) -> None:
        self.dest, self.source, self.fill = dest, source, fill

    def __call__(self) -> None:
        error = None
        if not self.fill.cancelled:
            try:
                # numpy, not torch: no torch kernel runs on a reader thread, whose thread-local
                # state torch's teardown at exit aborts on ("terminate called"); numpy's copy
                # releases the GIL as well.
                np.copyto(self.dest.numpy(), self.source.numpy())
            except (RuntimeError, ValueError) as e:  # raised by the load that waits for it (acquire)
                error = e
        self.fill.finished(error)


def _serve(jobs: queue.PriorityQueue) -> None:
    """A reader thread: run jobs until the ring is gone (a None job)."""
    while True:
        _, _, job = jobs.get()
        if job is None:
            return
        job()


def _stop(jobs: queue.PriorityQueue, threads: list[threading.Thread]) -> None:
    """End the reader threads and wait for them (at unwrap, collection or the interpreter's
    exit): a daemon thread still running when the interpreter finalizes is torn down where it
    stands, which aborts the process when that is inside a C++ frame."""
    for _ in threads:
        jobs.put((-1, -1, None))
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=60)


class StagingRing:
    """The staging slots of one wrapped model, the reader threads that fill them ahead of the
    learned order, and what each load of a staged scope takes from them (Note [staged loads]).
    Called by the thread that runs the model; `upcoming(scope)` gives the scopes expected to load
    after `scope`, nearest first."""

    def __init__(self, scopes: Sequence[StagedScope], *, pin: bool, slots: int,
                 upcoming: Callable[[Any], Sequence[StagedScope]],
                 pinning: PinningFallback) -> None:
        self.slot_bytes = -(-max(s.masters.nbytes for s in scopes) // _PAGE) * _PAGE
        self.upcoming = upcoming
        pin = pin and not pinning.failed
        try:
            buffer = HostBuffer(self.slot_bytes * slots, pin=pin)
        except PinnedMemoryError as error:
            pinning(error, "the staging ring")
            buffer = HostBuffer(self.slot_bytes * slots, pin=False)
        self._buffer = buffer
        flat, view = buffer.flat, buffer.flat.numpy().data
        self._slots = [_Slot(flat[i * self.slot_bytes : (i + 1) * self.slot_bytes],
                             view[i * self.slot_bytes : (i + 1) * self.slot_bytes]) for i in range(slots)]
        self._scopes = set(scopes)  # those staged through this ring
        self._staged: dict[StagedScope, _Slot] = {}  # scope -> the slot holding (or reading) its bytes
        self._uses = itertools.count(1)
        self._seq = itertools.count()
        self._stats = _Stats()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._threads: list[threading.Thread] = []
        # The checkpoint files the file scopes read, checked once per pass (Note [checkpoints that
        # change] in storage/files.py): when a scope acquired since the last check comes again.
        files = [s.masters.files for s in scopes if s.masters.files is not None]
        self._stores = list({id(f.store): f.store for f in files}.values())
        self._since_check: set[StagedScope] = set()
        self._failed_checks = 0  # passes that found a file changed: reads made before are stale
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._threads)

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self._slots)

    @property
    def bytes_read(self) -> int:
        return self._stats.bytes_read

    def read_stats(self) -> tuple[int, float]:
        """Bytes read from files since wrap, and the seconds the reads took (overlapping reads
        counted once), for a timed layout (Note [a timed layout] in budget/layout.py)."""
        with self._stats.lock:
            return self._stats.bytes_read, self._stats.busy_s

    def sample(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of a slot (page-locked as every slot), to time a copy as loads make them;
        its contents are whatever the slot holds."""
        return self._slots[0].flat[:nbytes]

    def close(self) -> None:
        """Stop the reader threads (unwrap)."""
        self._finalizer()

    def ready(self, scope: StagedScope) -> bool:
        """A load of the scope would not wait for a read: its bytes are staged, or it is a
        pageable scope, copied at once."""
        slot = self._staged.get(scope)
        if slot is not None:
            assert slot.fill is not None
            return slot.fill.done.is_set()
        return scope.masters.files is None

    def acquire(self, scope: StagedScope) -> torch.Tensor:
        """The scope's host bytes in a slot, for its load to copy from; read now (waiting for it)
        unless a read-ahead has, or a recent load left them there."""
        self._after_fork()
        if self._stores:
            self._check_files(scope)
        slot = self._staged.get(scope)
        while True:
            if slot is None:
                slot = self._take_slot(scope)
                self._fill(slot, scope, urgent=True)
            fill = slot.fill
            assert fill is not None
            fill.done.wait()
            if fill.error is None and fill.mark == self._mark(scope):
                break
            self._empty(slot)
            slot = None
            if fill.error is not None:
                raise RuntimeError(f"offtensor: reading the masters of scope {scope.name!r} into the "
                                   f"staging ring failed: {fill.error}") from fill.error
        slot.state = SlotState.COPYING
        slot.copied = None
        slot.used = next(self._uses)
        self._read_ahead(scope)
        return slot.flat[: scope.masters.nbytes]

    def _check_files(self, scope: StagedScope) -> None:
        """Check the checkpoint files once per pass: at the first load, and when a scope loaded
        since the last check loads again (the next pass, or backward after forward)."""
        if not self._since_check or scope in self._since_check:
            try:
                for store in self._stores:
                    store.check_unchanged()
            except RuntimeError:
                # Reads made so far may hold the new bytes: none is used again, even once the
                # file is as loaded again (Note [checkpoints that change] in storage/files.py).
                self._failed_checks += 1
                raise
            self._since_check.clear()
        self._since_check.add(scope)

    def copied(self, scope: StagedScope, event: Any) -> None:
        """The scope's load has enqueued its copy out of the slot; `event` follows it (None: done)."""
        slot = self._staged[scope]
        assert slot.state is SlotState.COPYING
        slot.copied = event

    # ---- slots -------------------------------------------------------------------------------

    def _read_ahead(self, scope: StagedScope) -> None:
        ahead: list[StagedScope] = []
        for s in self.upcoming(scope):
            # A kept scope on the device loads nowhere in this window: it would take the place
            # of one that does (Note [staged loads]).
            if s.residency is Residency.KEPT and not s.offloaded():
                continue
            if s is not scope and s in self._scopes and s not in ahead:
                ahead.append(s)
                if len(ahead) == len(self._slots) - 1:
                    break
        for i, s in enumerate(ahead):
            if s in self._staged or not s.offloaded() or not (s.masters.files is not None or s.frozen_now()):
                continue
            slot = self._free_slot(keep=set(ahead[: i + 1]) | {scope})
            if slot is None:
                return
            self._fill(slot, s, urgent=False, priority=1 + i)

    def _free_slot(self, keep: set[StagedScope]) -> _Slot | None:
        """A slot to fill without waiting: a free one, else the least recently used whose copy
        is done and whose scope is not in `keep`, else a read-ahead for a scope not in `keep`."""
        free = [s for s in self._slots if s.state is SlotState.FREE]
        if free:
            return free[0]
        done = sorted((s for s in self._slots if s.state is SlotState.COPYING and _passed(s.copied)
                       and s.fill is not None and s.fill.scope not in keep), key=lambda s: s.used)
        if done:
            self._empty(done[0])
            return done[0]
        ahead = [s for s in self._slots if s.state is SlotState.STAGING and s.fill is not None
                 and s.fill.scope not in keep]
        if ahead:
            self._empty(ahead[-1])
            return ahead[-1]
        return None

    def _take_slot(self, scope: StagedScope) -> _Slot:
        """A slot for a load that needs its bytes now: as _free_slot keeping nothing, else the
        least recently used once its copy is done (waits for the device's copy)."""
        slot = self._free_slot(keep={scope})
        if slot is None:
            slot = min((s for s in self._slots if s.state is SlotState.COPYING), key=lambda s: s.used)
            if slot.copied is not None:
                slot.copied.synchronize()
            self._empty(slot)
        return slot

    def _empty(self, slot: _Slot) -> None:
        """Make the slot FREE, after any read into it (reads not started are skipped)."""
        fill = slot.fill
        if fill is not None:
            fill.cancelled = True
            fill.done.wait()
            if self._staged.get(fill.scope) is slot:
                del self._staged[fill.scope]
        slot.state, slot.fill, slot.copied = SlotState.FREE, None, None

    def _mark(self, scope: StagedScope) -> tuple[Any, ...]:
        """What a read made now must still match when a load uses it: the ring's failed file
        checks (Note [checkpoints that change] in storage/files.py) and the scope's writes to its
        masters (`write_mark`)."""
        return self._failed_checks, scope.write_mark()

    def _fill(self, slot: _Slot, scope: StagedScope, *, urgent: bool, priority: int = 0) -> None:
        """Start reading the scope's bytes into the slot: on the reader threads, or, for a
        pageable scope that a load needs now, here."""
        fill = _Fill(scope, self._mark(scope))
        slot.state, slot.fill = SlotState.STAGING, fill
        self._staged[scope] = slot
        files = scope.masters.files
        if files is None:
            dest = slot.flat[: scope.masters.nbytes]
            if urgent:
                dest.copy_(scope.masters.flat)
                fill.done.set()
                return
            fill.pending = 1
            self._queue(priority, _Copy(dest, scope.masters.flat, fill))
            return
        reads = files.reads()
        fill.pending = len(reads)
        if not reads:
            fill.done.set()
        for file, offset, pieces in reads:
            self._queue(priority, _Read(file, offset, [slot.view[d : d + n] for d, n in pieces], fill, self._stats))

    def _queue(self, priority: int, job: Any) -> None:
        if len(self._threads) < READERS:
            for _ in range(READERS - len(self._threads)):
                thread = threading.Thread(target=_serve, args=(self._jobs,), name="offtensor-reader", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._jobs.put((priority, next(self._seq), job))

    def _after_fork(self) -> None:
        """In a forked child the reader threads are gone: reads in flight never finish there."""
        if os.getpid() == self._pid:
            return
        self._pid = os.getpid()
        self._jobs = queue.PriorityQueue()
        self._threads = []
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._threads)
        for slot in self._slots:
            if slot.fill is not None and not slot.fill.done.is_set():
                self._staged.pop(slot.fill.scope, None)
                slot.state, slot.fill, slot.copied = SlotState.FREE, None, None


def _passed(event: Any) -> bool:
    return event is None or event.query()
