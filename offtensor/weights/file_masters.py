"""Masters read from files on demand (`Policy(host_budget=...)`), and the staging ring that the
loads of such scopes, and of pageable masters under `Policy(pin_memory="ring")`, go through.

# Note [masters in files]
A model larger than host RAM can still be loaded from safetensors files: `offtensor.load` with
`Policy(host_budget=B)` keeps in RAM the scopes that fit B and leaves the masters of the other
frozen scopes in the files (`plan_host_budget`). Scopes with a trainable parameter always stay in
RAM, where the optimizer steps them; when they alone exceed B the load raises, naming the fix.
The RAM scopes are spread over wrap's order by bytes, the first one first (as the VRAM budget
spreads kept scopes, Note [VRAM budget] in core/schedule.py): while a RAM scope computes, the reads
of the file scopes after it go on, so the disk rarely idles.
A file scope's parameters hold a placeholder; each master is a `FileMaster` (a StoredMaster, as
compressed masters are, so every read through the parameter — `p.data`, `state_dict()`, an op
outside its scope, `unwrap` — reads its bytes from the file, Note [compressed masters] in
weights/compress.py). Writes raise instead (`check_write`, before anything changes): a master that lives
in a file stays as the file has it. A checkpoint tensor in the parameter's dtype is read where
the checkpoint holds it; the others (compressed by `frozen_format`, converted to the model's
dtype, filled by `init=`) are written once, at load, to a cache file beside the checkpoint
(`FileStore`, unlinked at once: it goes with the process), so a load reads each master's host
bytes as they are, whatever produced them, and a compressed scope reads its compressed bytes.
"""

from __future__ import annotations

import enum
import itertools
import math
import mmap
import os
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from ..api import MasterHome, Residency
from ..core.memory import HostBuffer, PinnedMemoryError, PinningFallback
from .compress import FrozenFormat, PackedMaster, RowReader, copy_rows, packed_nbytes, unpack_bytes_into

READERS = 4  # threads reading files into the ring: several reads in flight keep an NVMe drive busy
READ_CHUNK = 16 * 2**20  # bytes per read, so one scope's read spreads over the readers
_PAGE = 4096
_IOV_MAX = 512  # iovecs per preadv, under every platform's IOV_MAX

# safetensors' dtype names (its header's "dtype")
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class FileHandle:
    """One open file, read with pread by any thread; closed with the last object holding it."""

    def __init__(self, path: str, fd: int, owner: Any = None) -> None:
        self.path = path
        self.fd = fd
        self._owner = owner  # a TemporaryFile that closes (and so deletes) itself
        self._map: mmap.mmap | None = None  # where os.preadv is missing (Windows)
        if owner is None:
            weakref.finalize(self, os.close, fd)

    def read_into(self, buffers: list[memoryview], offset: int) -> int:
        """Fill `buffers` with the file's bytes from `offset` on; returns the bytes read."""
        total = 0
        buffers = [b for b in buffers if len(b)]
        if not hasattr(os, "preadv"):
            if self._map is None:
                self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
            for b in buffers:
                b[:] = self._map[offset + total : offset + total + len(b)]
                total += len(b)
            return total
        while buffers:
            n = os.preadv(self.fd, buffers[:_IOV_MAX], offset + total)
            if n == 0:
                raise EOFError(f"{self.path}: the file ends at byte {offset + total}, before the tensor does")
            total += n
            while buffers and n >= len(buffers[0]):
                n -= len(buffers[0])
                buffers.pop(0)
            if n:
                buffers[0] = buffers[0][n:]
        return total


@dataclass(eq=False)
class FileTensor:
    """Where a checkpoint holds a tensor, and a RowReader of it (`rows()` opens one on first use):
    a RAM scope reads it as any RowReader, a file scope reads it in place (Note [masters in files])."""

    file: FileHandle
    offset: int  # of its first byte in the file
    nbytes: int
    dtype: torch.dtype
    rows: Callable[[], RowReader]
    _reader: RowReader | None = None

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        if self._reader is None:
            self._reader = self.rows()
        return self._reader(start, stop)


class FileStore:
    """The files masters are read from: checkpoint files, each opened once, and the cache file
    holding the masters no checkpoint holds as they are kept (Note [masters in files])."""

    def __init__(self, cache_dir: str | os.PathLike | None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._files: dict[str, FileHandle] = {}
        self._cache: FileHandle | None = None
        self._cache_end = 0

    def open(self, path: str | os.PathLike) -> FileHandle:
        key = str(path)
        handle = self._files.get(key)
        if handle is None:
            handle = self._files[key] = FileHandle(key, os.open(key, os.O_RDONLY | getattr(os, "O_BINARY", 0)))
        return handle

    def append(self, data: torch.Tensor, what: str) -> tuple[FileHandle, int]:
        """Write `data` (uint8, contiguous, on the CPU) at the cache file's end: (file, offset)."""
        if self._cache is None:
            if self.cache_dir is None:
                raise ValueError(
                    f"offtensor.load: {what} must be written to a cache file (it is compressed, converted "
                    "or initialized, and its scope does not fit Policy(host_budget=...)), but there is no "
                    "checkpoint directory to write it beside; pass cache_dir= (a directory on a disk, "
                    "not a RAM-backed tmpfs)")
            try:
                owner = tempfile.TemporaryFile(dir=self.cache_dir, prefix="offtensor-cache-")
            except OSError as error:
                raise OSError(error.errno, f"offtensor.load: cannot create the cache file for masters "
                              f"that stay on disk in {str(self.cache_dir)!r} ({error.strerror}); pass "
                              "cache_dir= a writable directory") from error
            self._cache = FileHandle(f"{self.cache_dir}/<offtensor cache file>", owner.fileno(), owner)
        view = data.numpy().data.cast("B")
        at, done = self._cache_end, 0
        while done < len(view):
            done += os.pwrite(self._cache.fd, view[done:], at + done) if hasattr(os, "pwrite") else \
                _write_at(self._cache.fd, view[done:], at + done)
        self._cache_end += len(view)
        return self._cache, at


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.write(fd, data)


@dataclass(eq=False)
class FileMaster:
    """A frozen master that stays in a file, read on demand (a StoredMaster, Note [masters in
    files]); its host bytes are those a RAM master would have: compressed under `format`."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    format: FrozenFormat | None
    file: FileHandle
    offset: int
    nbytes: int

    def read(self) -> torch.Tensor:
        """The master's host bytes, read now (uint8, a new tensor)."""
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            self.file.read_into([data.numpy().data], self.offset)
        return data

    def unpack(self) -> torch.Tensor:
        data = self.read()
        if self.format is None:
            return data.view(self.dtype).view(self.shape)
        numel = math.prod

        def carve(offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
            return data[offset : offset + numel(shape) * dtype.itemsize].view(dtype).view(shape)

        return PackedMaster.on(carve, 0, self.name, self.format, self.dtype, self.shape).unpack()

    def unpack_into(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        if self.format is not None:
            unpack_bytes_into(self.format, self.dtype, self.shape, out, packed)
        else:
            out.copy_(packed[: self.nbytes].view(self.dtype).view(self.shape))

    def pack(self, value: torch.Tensor | RowReader) -> None:
        self.check_write()

    def placeholder(self) -> torch.Tensor:
        fill = float("nan") if self.dtype.is_floating_point else 0
        return torch.full((), fill, dtype=self.dtype).expand(self.shape)

    def kept_as(self) -> str:
        return (f"read on demand from {self.file.path!r} (its scope did not fit "
                "Policy(host_budget=...) in host RAM)")

    def check_write(self) -> None:
        raise RuntimeError(
            f"offtensor: cannot write parameter {self.name!r}: it is {self.kept_as()}, and its "
            "master stays as the file has it; nothing was changed. Raise Policy(host_budget=...) "
            "so that its scope fits in host RAM, or call offtensor.unwrap(model) first (it reads "
            "every master into RAM)")

    def refuse_training(self) -> NoReturn:
        raise RuntimeError(
            f"offtensor: parameter {self.name!r} is {self.kept_as()} and cannot be trained: an "
            "optimizer writes its master. Leave it trainable (requires_grad=True) when calling "
            "offtensor.load, which keeps its scope in host RAM, or raise host_budget")


class FileScope:
    """Where one scope's masters are in files, and the reads that fill a staging slot with them
    (Note [masters in files])."""

    def __init__(self, name: str, store: FileStore) -> None:
        self.name = name
        self.store = store
        # (file, offset in it, offset in the scope's host layout, bytes) per master
        self._extents: list[tuple[FileHandle, int, int, int]] = []
        self._reads: list[tuple[FileHandle, int, list[tuple[int, int]]]] | None = None

    def master(self, qual: str, p: torch.Tensor, offset: int, fmt: FrozenFormat | None,
               value: torch.Tensor | RowReader) -> FileMaster:
        """The master of parameter `qual`, at `offset` bytes of the scope's host layout, from
        `value`: read where a checkpoint holds it as the master keeps it, else written to the
        cache file (compressed under `fmt`)."""
        if isinstance(value, FileTensor) and fmt is None and value.dtype == p.dtype:
            file, at, nbytes = value.file, value.offset, value.nbytes
        else:
            data = _host_bytes(qual, p, fmt, value)
            file, at = self.store.append(data, f"parameter {qual!r}")
            nbytes = data.numel()
        self._extents.append((file, at, offset, nbytes))
        return FileMaster(qual, p.dtype, torch.Size(p.shape), fmt, file, at, nbytes)

    def reads(self) -> list[tuple[FileHandle, int, list[tuple[int, int]]]]:
        """(file, offset, [(offset in the host layout, bytes), ...]) per read: masters that follow
        each other in a file are read together, in pieces of at most READ_CHUNK bytes."""
        if self._reads is None:
            reads: list[tuple[FileHandle, int, list[tuple[int, int]]]] = []
            end: tuple[FileHandle, int] | None = None
            size = 0
            for file, at, dest, n in sorted(self._extents, key=lambda e: (id(e[0]), e[1])):
                while n:
                    if end != (file, at) or size >= READ_CHUNK:
                        reads.append((file, at, []))
                        size = 0
                    take = min(n, READ_CHUNK - size)
                    reads[-1][2].append((dest, take))
                    at, dest, n, size = at + take, dest + take, n - take, size + take
                    end = (file, at)
            self._reads = reads
        return self._reads


def _host_bytes(qual: str, p: torch.Tensor, fmt: FrozenFormat | None, value: torch.Tensor | RowReader) -> torch.Tensor:
    """The bytes a RAM master of `p` would hold (compressed under `fmt`), from `value`."""
    if fmt is not None:
        buffer = HostBuffer(packed_nbytes(p.shape, p.dtype), pin=False)
        PackedMaster.on(buffer.tensor, 0, qual, fmt, p.dtype, p.shape).pack(value)
        return buffer.flat
    t = torch.empty(p.shape, dtype=p.dtype)
    copy_rows(t, value)
    return t.reshape(-1).view(torch.uint8)


def plan_host_budget(scopes: list[tuple[str, int, list[str]]], budget: int) -> set[str]:
    """(name, host bytes, its trainable parameters' names) per scope in wrap's order -> the names
    of the scopes whose masters stay in files (Note [masters in files])."""
    trainable = [(name, n, names) for name, n, names in scopes if names]
    needed = sum(n for _, n, _ in trainable)
    if needed > budget:
        first = trainable[0][2][0]
        raise ValueError(
            f"offtensor.load: the scopes with trainable offloaded parameters take {_mib(needed)} of "
            f"host RAM ({len(trainable)} scopes, e.g. parameter {first!r}), more than "
            f"Policy(host_budget={budget}) ({_mib(budget)}): trainable masters stay in host RAM, "
            "where the optimizer steps them. Raise host_budget to at least that, freeze what you do "
            "not train before offtensor.load (requires_grad_(False)), or keep the trainable "
            "parameters on the device with Policy(param_filter=offtensor.frozen_only)")
    room = budget - needed
    frozen = [(name, n) for name, n, names in scopes if not names]
    if sum(n for _, n in frozen) <= room:
        return set()
    in_ram: set[str] = set()
    rest = frozen
    if frozen[0][1] <= room:
        in_ram.add(frozen[0][0])
        room -= frozen[0][1]
        rest = frozen[1:]
    # The rest spread evenly by bytes: each scope earns the RAM share (room / rest) of its bytes,
    # and one stays in RAM when the earnings so far pay for it (in integers: x rest).
    rest_bytes = max(1, sum(n for _, n in rest))
    share, credit = room, 0
    for name, n in rest:
        credit += share * n
        if n * rest_bytes <= credit and n <= room:
            in_ram.add(name)
            room -= n
            credit -= n * rest_bytes
    return {name for name, _ in frozen if name not in in_ram}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- the staging ring ------------------------------------------------------------------------

# Note [staged loads]
# A scope whose masters are in a file (MasterHome.FILE), or in pageable memory under
# Policy(pin_memory="ring") or after pinning failed (MasterHome.RING), loads from a slot of the
# model's one StagingRing: `2 + prefetch` slots of the largest such scope's host bytes,
# page-locked on CUDA, so page-locked memory and the host memory of reads are bounded by the
# ring. `Scope._start_load` takes the scope's bytes from `acquire` in place of its host buffer
# and copies them to the device as from a host buffer (whole, not progressively), then
# `copied` hands the slot back with the copy's event; the slot is reused once that event passed
# and keeps its bytes until then, so a load soon after (the last scope of a forward, loaded
# again by its backward) reads nothing. Reads run ahead on READERS threads, in READ_CHUNK pieces
# so several are in flight: each acquire asks for the scopes the engine expects next
# (`upcoming`, from the Schedule's learned orders: the rest of this pass, then the next one) in
# the free slots, and a prefetch does not load a file scope whose read is not done (`ready`)
# but leaves it to its on-demand load, so the thread that queues kernels does not wait on the
# disk for a scope it does not need yet. A kept scope on the device (Policy(vram_budget)) loads
# nowhere in the window, so it takes no place in it. Pageable masters are read ahead only while
# no parameter of the scope is trainable or waits for a step; a fill is stale when the scope's
# `write_mark` (writes through its parameters, versions of their masters and of the `p.data`
# aliases handed out: Note [p.data aliases] in core/slot.py) changed while it was read or staged,
# and is read again. File scopes are never written (Note [masters in files]).


class SlotState(enum.Enum):
    """What a slot of the staging ring holds (Note [staged loads])."""

    FREE = "free"  # nothing
    STAGING = "staging"  # a scope's bytes, being read or read (its fill's `done`), for its next load
    COPYING = "copying"  # taken by a load: its copy reads it until `copied` passes; bytes still valid


@dataclass(eq=False)
class _Fill:
    """One scope's bytes on their way into a slot; `finished` is called by the reader threads."""

    scope: Any
    mark: tuple[Any, ...]  # scope.write_mark() when the read started
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

    def __init__(self, scopes: list[Any], *, pin: bool, slots: int, upcoming: Callable[[Any], list[Any]],
                 pinning: PinningFallback) -> None:
        self.slot_bytes = -(-max(s.nbytes for s in scopes) // _PAGE) * _PAGE
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
        self._staged: dict[Any, _Slot] = {}  # scope -> the slot holding (or reading) its bytes
        self._uses = itertools.count(1)
        self._seq = itertools.count()
        self._stats = _Stats()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._threads: list[threading.Thread] = []
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

    def ready(self, scope: Any) -> bool:
        """A load of the scope would not wait for a read: its bytes are staged, or it is a
        pageable scope, copied at once."""
        slot = self._staged.get(scope)
        if slot is not None:
            assert slot.fill is not None
            return slot.fill.done.is_set()
        return scope.home is not MasterHome.FILE

    def acquire(self, scope: Any) -> torch.Tensor:
        """The scope's host bytes in a slot, for its load to copy from; read now (waiting for it)
        unless a read-ahead has, or a recent load left them there."""
        self._after_fork()
        slot = self._staged.get(scope)
        while True:
            if slot is None:
                slot = self._take_slot(scope)
                self._fill(slot, scope, urgent=True)
            fill = slot.fill
            assert fill is not None
            fill.done.wait()
            if fill.error is None and fill.mark == scope.write_mark():
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
        return slot.flat[: scope.nbytes]

    def copied(self, scope: Any, event: Any) -> None:
        """The scope's load has enqueued its copy out of the slot; `event` follows it (None: done)."""
        slot = self._staged[scope]
        assert slot.state is SlotState.COPYING
        slot.copied = event

    # ---- slots -------------------------------------------------------------------------------

    def _read_ahead(self, scope: Any) -> None:
        ahead: list[Any] = []
        for s in self.upcoming(scope):
            # A kept scope on the device loads nowhere in this window: it would take the place
            # of one that does (Note [staged loads]).
            if s.residency is Residency.KEPT and not s.offloaded():
                continue
            if s is not scope and s.ring is self and s not in ahead:
                ahead.append(s)
                if len(ahead) == len(self._slots) - 1:
                    break
        for i, s in enumerate(ahead):
            if s in self._staged or not s.offloaded() or not (s.home is MasterHome.FILE or s.frozen_now()):
                continue
            slot = self._free_slot(keep=set(ahead[: i + 1]) | {scope})
            if slot is None:
                return
            self._fill(slot, s, urgent=False, priority=1 + i)

    def _free_slot(self, keep: set[Any]) -> _Slot | None:
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

    def _take_slot(self, scope: Any) -> _Slot:
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

    def _fill(self, slot: _Slot, scope: Any, *, urgent: bool, priority: int = 0) -> None:
        """Start reading the scope's bytes into the slot: on the reader threads, or, for a
        pageable scope that a load needs now, here."""
        fill = _Fill(scope, scope.write_mark())
        slot.state, slot.fill = SlotState.STAGING, fill
        self._staged[scope] = slot
        if scope.home is not MasterHome.FILE:
            dest = slot.flat[: scope.nbytes]
            if urgent:
                dest.copy_(scope.host_flat)
                fill.done.set()
                return
            fill.pending = 1
            self._queue(priority, _Copy(dest, scope.host_flat, fill))
            return
        reads = scope.files.reads()
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
