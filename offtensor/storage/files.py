"""The files that masters are read from: checkpoint files opened once and read with pread from any
thread, where a checkpoint holds a tensor, and the cache file for the masters no checkpoint holds
as they are kept (Note [masters in files] in storage/file_masters.py).

# Note [checkpoints that change]
A file scope reads its masters from the checkpoint at every load, so new bytes written into the
file in place would make the next passes compute with a mix of old and new scopes, then with
the new model, silently. So the staging ring checks, once per pass (at its first load, and
when a scope loaded since comes again: the next pass, or backward), that each open checkpoint
file still has the size and modification time it had when opened, and raises naming the file
otherwise: one `fstat` per file and pass, nothing per read. The reads the ring made before a
check that failed (ahead of that pass, maybe of the new bytes) are never used, even once the file
is as loaded again. It asks the open descriptor, not the path: an atomic replace (a new file
renamed over the path) leaves the descriptor on the old file, which reads as loaded, so the model
goes on as it was. A truncated file fails its read (EOFError) as well. Reads outside passes
(`p.data`, `state_dict()`, `unwrap`) are not checked.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..formats import RowReader

_IOV_MAX = 512  # iovecs per preadv, under every platform's IOV_MAX


class FileHandle:
    """One open file, read with pread by any thread; closed with the last object holding it."""

    def __init__(self, path: str, fd: int, owner: Any = None) -> None:
        self.path = path
        self.fd = fd
        self._owner = owner  # a TemporaryFile that closes (and so deletes) itself
        self._map: mmap.mmap | None = None  # where os.preadv is missing (Windows)
        # The file as opened (size, modification time), for check_unchanged; None for the cache
        # file, which is ours and written only at load.
        self._opened: tuple[int, int] | None = None
        if owner is None:
            weakref.finalize(self, os.close, fd)
            self._opened = _identity(os.fstat(fd))

    def check_unchanged(self) -> None:
        """Raise when the file was written since it was opened (Note [checkpoints that change]).
        Asks the open descriptor, not the path: a file renamed over the path (an atomic
        replace) is another file, and this one still reads as it was."""
        if self._opened is None:
            return
        now = _identity(os.fstat(self.fd))
        if now != self._opened:
            (size, mtime), (new_size, new_mtime) = self._opened, now
            raise RuntimeError(
                f"offtensor: checkpoint file {self.path!r} changed since offtensor.load opened it (size "
                f"{size} -> {new_size} bytes, modified {(new_mtime - mtime) / 1e9:+.3f} s later): the "
                "masters read from it on demand (Policy(host_budget=...)) would mix old and new weights. "
                "Leave the checkpoint as loaded while the model uses it (write a new file and rename it "
                "over the old one: the model keeps reading the old one), or load the model again with "
                "offtensor.load")

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


_MAP_AT_LEAST = 2**20  # bytes: smaller reads are one pread


def copy_from_file(handle: FileHandle, offset: int, dest: np.ndarray) -> None:
    """Fill `dest` (uint8, contiguous) with the file's bytes from `offset` on, through a mapping
    of that range closed after the copy (Note [loading at the disk's speed] in model/load.py)."""
    nbytes = dest.size
    if nbytes == 0:
        return
    if nbytes < _MAP_AT_LEAST or not hasattr(os, "preadv"):
        handle.read_into([dest.data], offset)
        return
    if os.fstat(handle.fd).st_size < offset + nbytes:  # a mapping past the end faults (SIGBUS)
        raise EOFError(f"{handle.path}: the file ends before byte {offset + nbytes}, where the tensor does")
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(handle.fd, offset + nbytes - base, offset=base, access=mmap.ACCESS_READ) as mapped:
        source = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=offset - base)
        np.copyto(dest, source)
        del source  # before the mapping closes


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

    def read_into(self, dest: torch.Tensor) -> bool:
        """Read the whole tensor into `dest` where its reader can (copy_rows)."""
        if self._reader is None:
            self._reader = self.rows()
        read_into = getattr(self._reader, "read_into", None)
        return read_into is not None and bool(read_into(dest))


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

    def check_unchanged(self) -> None:
        """Raise when a checkpoint file was written since it was opened (Note [checkpoints that
        change])."""
        for handle in self._files.values():
            handle.check_unchanged()

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


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_mtime_ns


def _write_at(fd: int, data: memoryview, offset: int) -> int:
    os.lseek(fd, offset, os.SEEK_SET)
    return os.write(fd, data)
