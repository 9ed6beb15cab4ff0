"""Host memory for offloaded masters and their gradients.

# Note [pinned host memory without the caching allocator]
`torch.empty(..., pin_memory=True)` goes through PyTorch's pinned caching allocator, which rounds
every request up to a power of two: a 436 MB decoder layer takes 512 MB of page-locked RAM, and a
whole model can take up to twice its size. We instead allocate exactly the bytes we need with
numpy (ordinary pageable memory, untouched until written) and page-lock that range in place with
`cudaHostRegister`. The tensor is then a plain CPU tensor that CUDA copies treat as pinned
(asynchronous, full PCIe bandwidth). The registration is undone by a finalizer on the numpy
array, which runs before numpy frees the memory, i.e. once the last tensor view of it is gone.

# Note [one storage per master]
Each master is a tensor with its own storage over its own bytes of the scope's one host
allocation (`HostBuffer.tensor`: `torch.from_numpy` of a slice of the allocation's numpy array),
while `HostMasters.flat` is one more tensor over all those bytes, for the single bulk copy to the
device. To PyTorch the masters then look like separately allocated tensors: `torch.save` sees no
storage holding several dtypes (a scope can mix fp32 norms and bf16 matrices), and safetensors
(`save_model`, `save_file`) and transformers' `save_pretrained` see no shared storage, which
they would refuse or, taking the parameters for tied weights, save only once. Each storage
starts inside the registered range, so `is_pinned()` holds for every master on CUDA. The numpy
slices keep the allocation (and its registration) alive until the last master is gone.

# Note [page-locked memory as a bounded resource]
Page-locking can fail: a low `ulimit -l`, WSL and Windows cap it well below the RAM. A failed
registration raises `PinnedMemoryError`; `wrap` then keeps the masters not pinned yet in pageable
memory and stages their loads through the staging ring (`Policy(pin_memory="ring")`, Note [staged
loads] in storage/staging.py), gradients in pageable memory, and logs one warning per wrapped
model (`PinningFallback`): nothing is lost, loads are slower. `OFFTENSOR_MAX_PINNED_BYTES=N`
caps what offtensor page-locks at N bytes (registrations past it fail as a real one would), to
test that path; on a machine without CUDA it also lets `Policy(pin_memory=True)` run, pinning
by accounting only, so the fallback is tested on the CPU.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from functools import cache
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("offtensor")

# cudaHostRegister wants page-aligned ranges to pin exactly what we ask for.
_PAGE = 4096
# PyTorch's CPU allocator aligns to 64 bytes (vectorized kernels assume it is at least that).
_CPU_ALIGN = 64
MAX_PINNED_ENV = "OFFTENSOR_MAX_PINNED_BYTES"  # Note [page-locked memory as a bounded resource]
_pinned_lock = threading.Lock()
_pinned_bytes = 0  # page-locked by offtensor now (registered, not yet unregistered)


class PinnedMemoryError(RuntimeError):
    """Page-locking host memory failed (Note [page-locked memory as a bounded resource])."""


def _pinned_cap() -> int | None:
    value = os.environ.get(MAX_PINNED_ENV, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"offtensor: {MAX_PINNED_ENV}={value!r}: expected a number of bytes") from None


def pinning_available() -> bool:
    """CUDA can page-lock, or the cap's accounting stands in for it (Note [page-locked memory as
    a bounded resource])."""
    return torch.cuda.is_available() or _pinned_cap() is not None


def host_empty(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A flat, uninitialized uint8 CPU tensor of exactly `nbytes`, page-locked when `pin`."""
    return torch.from_numpy(_host_array(nbytes, pin=pin))


class HostBuffer:
    """One host allocation (page-locked when `pin`) carved into tensors with storages of their
    own (Note [one storage per master])."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self._array = _host_array(nbytes, pin=pin)
        self.flat = torch.from_numpy(self._array)  # uint8, all the bytes: the bulk copies

    @classmethod
    def over(cls, array: np.ndarray) -> HostBuffer:
        """A buffer over existing uint8 memory (shared memory: storage/shm.py), pinned or not by its
        maker; its slices keep `array` (and what it maps) alive."""
        buffer = cls.__new__(cls)
        buffer._array = array
        buffer.flat = torch.from_numpy(array)
        return buffer

    def tensor(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """An uninitialized tensor at `offset` bytes, its storage exactly its own bytes."""
        nbytes = math.prod(shape) * dtype.itemsize
        assert offset % dtype.itemsize == 0 and offset + nbytes <= self._array.size
        if nbytes == 0:
            # No bytes, so no address, as PyTorch makes empty tensors: an empty slice's storage
            # reports the allocation's first address, the first master's, and serializers keyed
            # on addresses took the two for one storage (torch.save refused it in two dtypes).
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(self._array[offset : offset + nbytes]).view(dtype).view(shape)


def _host_array(nbytes: int, *, pin: bool) -> np.ndarray:
    """Exactly `nbytes` (at least 1) of uninitialized host memory, page-aligned and page-locked
    when `pin`, else aligned as PyTorch aligns its CPU tensors."""
    nbytes = max(int(nbytes), 1)
    align = _PAGE if pin else _CPU_ALIGN
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    # A tensor's storage must begin at the registered address: `Tensor.is_pinned()` asks CUDA
    # about the storage's first byte, not the tensor's. Slices of this array keep `raw` alive.
    array = raw[start : start + nbytes]
    if pin:
        register_pinned(array, owner=raw)
    return array


def register_pinned(array: np.ndarray, owner: np.ndarray) -> None:
    """Page-lock `array`'s (page-aligned) memory with cudaHostRegister, until `owner`, the array
    that owns the memory, is freed. Registration is per process (shared memory: each maps it).
    Raises PinnedMemoryError when it fails or would pass OFFTENSOR_MAX_PINNED_BYTES."""
    global _pinned_bytes
    ptr, nbytes = array.ctypes.data, array.nbytes
    cap = _pinned_cap()
    with _pinned_lock:
        if cap is not None and _pinned_bytes + nbytes > cap:
            raise PinnedMemoryError(
                f"offtensor: page-locking {nbytes / 2**20:.1f} MiB would pass {MAX_PINNED_ENV}={cap} "
                f"({_pinned_bytes / 2**20:.1f} MiB page-locked already)")
        _pinned_bytes += nbytes
    cuda = torch.cuda.is_available()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) if cuda else 0
    if err != 0:
        clear_cuda_error()  # Note [a failed runtime call's error]
        with _pinned_lock:
            _pinned_bytes -= nbytes
        raise PinnedMemoryError(
            f"offtensor: cudaHostRegister of {nbytes / 2**20:.1f} MiB failed with CUDA error "
            f"{err}; the host may be out of lockable memory (check `ulimit -l`), or pass "
            "policy=offtensor.Policy(pin_memory='ring') to keep masters in pageable memory and stage "
            "loads through a small page-locked ring, or pin_memory=False (slower)"
        )
    weakref.finalize(owner, _unregister, ptr, nbytes, cuda)


def _unregister(ptr: int, nbytes: int, cuda: bool) -> None:
    # Runs while numpy deallocates the array, before the memory is returned to the OS.
    global _pinned_bytes
    with _pinned_lock:
        _pinned_bytes -= nbytes
    if cuda and torch.cuda.is_initialized() and int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        clear_cuda_error()  # Note [a failed runtime call's error]


# Note [a failed runtime call's error]
# A CUDA runtime call that fails also leaves its error as the thread's last error, until
# `cudaGetLastError` reads it. PyTorch reads it after each kernel launch and raises it there: a
# page-locking that failed, even one offtensor handles (Note [page-locked memory as a bounded
# resource]), would make the thread's next op raise it (error 712, "part or all of the requested
# memory range is already mapped"), inside backward_and_step after part of the step. So offtensor
# reads it at once, from the runtime library PyTorch loaded (found among the process's mapped
# files; torch's own `cudart()` bindings have no cudaGetLastError). Without one (a runtime linked
# statically) there is nothing offtensor can read it from.


def clear_cuda_error() -> None:
    """Read (and so reset) the CUDA runtime's last error on this thread (Note [a failed runtime
    call's error])."""
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


@cache
def _loaded_cudart() -> Any:
    """The CUDA runtime library this process has loaded, through ctypes; None if none is."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class PinningFallback:
    """Page-locking failed for a wrapped model: what falls back, and the one warning that says
    so (Note [page-locked memory as a bounded resource])."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, error: PinnedMemoryError, what: str) -> None:
        if not self.failed:
            # The message, not the error: a record keeps its arguments, and the error's traceback
            # holds wrap's frames, so a handler that keeps records (caplog, MemoryHandler) would
            # keep the model and its masters alive after unwrap.
            logger.warning(
                "%s. offtensor keeps %s and what it allocates after in pageable memory, the masters "
                "loaded through a small page-locked staging ring (as Policy(pin_memory='ring') "
                "does): nothing is lost, copies are slower. Raise the lockable memory limit "
                "(ulimit -l) for full speed, or pass Policy(pin_memory='ring') to choose this", str(error), what)
        self.failed = True

    def empty(self, nbytes: int, *, pin: bool, what: str) -> torch.Tensor:
        """host_empty, pageable once pinning fails."""
        if pin and not self.failed:
            try:
                return host_empty(nbytes, pin=True)
            except PinnedMemoryError as error:
                self(error, what)
        return host_empty(nbytes, pin=False)
