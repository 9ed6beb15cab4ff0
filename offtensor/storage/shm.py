"""Host memory shared by the processes of one node: a file in /dev/shm, mapped by each.

# Note [shared host memory]
`data_parallel(model, shard_optimizer=True)` keeps one copy of the offloaded masters per node
(Note [one host copy per node] in distributed/shared_masters.py). The memory is a file in /dev/shm (tmpfs:
RAM, no disk) that the first rank of the node creates and fills, and that every rank maps with
MAP_SHARED: the same physical pages appear in every process, so a write by one rank (its
optimizer step) is what every other rank reads. The file is reserved in full with
posix_fallocate when it is created, so a /dev/shm too small for it (Docker's default is 64 MiB)
is an error naming the size, not a SIGBUS at the first write of a page that does not fit. It is
unlinked as soon as every rank has mapped it: the mappings keep the memory, and nothing is left
in /dev/shm when a process dies. A mapping is page-aligned, so on CUDA each process can
page-lock it in place with cudaHostRegister (registration is per process).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

SHM_DIR = "/dev/shm"


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create(name: str, nbytes: int) -> np.ndarray:
    """A new file `name` in /dev/shm of `nbytes` (reserved), mapped shared: uint8, zeros."""
    path = shm_path(name)
    free = _free_bytes()
    if free is not None and free < nbytes:
        raise RuntimeError(
            f"offtensor.data_parallel(shard_optimizer=True): the masters need {nbytes / 2**20:.1f} "
            f"MiB of shared memory but {SHM_DIR} has {free / 2**20:.1f} MiB free; enlarge it (in "
            "Docker: --shm-size), or call offtensor.data_parallel without shard_optimizer"
        )
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as e:
            os.unlink(path)
            raise RuntimeError(
                f"offtensor.data_parallel(shard_optimizer=True): could not reserve "
                f"{nbytes / 2**20:.1f} MiB in {SHM_DIR} ({e}); enlarge it (in Docker: --shm-size), "
                "or call offtensor.data_parallel without shard_optimizer"
            ) from e
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def attach(name: str, nbytes: int) -> np.ndarray:
    """The file `name` that another process of this node created, mapped shared."""
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise RuntimeError(
                f"offtensor.data_parallel(shard_optimizer=True): {shm_path(name)} holds {size} "
                f"bytes, fewer than the {nbytes} of this rank's masters"
            )
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Remove the file (the mappings stay valid); no error if it is gone already."""
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass


def _map(fd: int, nbytes: int) -> np.ndarray:
    memory = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # The array keeps the mmap object (its buffer's owner) alive; the mapping is unmapped when
    # the last array over it is freed.
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes)


def _free_bytes() -> int | None:
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize
