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
while `Scope.host_flat` is one more tensor over all those bytes, for the single bulk copy to the
device. To PyTorch the masters then look like separately allocated tensors: `torch.save` sees no
storage holding several dtypes (a scope can mix fp32 norms and bf16 matrices), and safetensors
(`save_model`, `save_file`) and transformers' `save_pretrained` see no shared storage, which
they would refuse or, taking the parameters for tied weights, save only once. Each storage
starts inside the registered range, so `is_pinned()` holds for every master on CUDA. The numpy
slices keep the allocation (and its registration) alive until the last master is gone.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import weakref

import numpy as np
import torch

logger = logging.getLogger("offtensor")

# cudaHostRegister wants page-aligned ranges to pin exactly what we ask for.
_PAGE = 4096
# PyTorch's CPU allocator aligns to 64 bytes (vectorized kernels assume it is at least that).
_CPU_ALIGN = 64


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
        """A buffer over existing uint8 memory (shared memory: _shm.py), pinned or not by its
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
    that owns the memory, is freed. Registration is per process (shared memory: each maps it)."""
    ptr, nbytes = array.ctypes.data, array.nbytes
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"offtensor: cudaHostRegister of {nbytes / 2**20:.1f} MiB failed with CUDA error "
            f"{int(err)}; the host may be out of lockable memory (check `ulimit -l`), or pass "
            "policy=offtensor.Policy(pin_memory=False) to keep masters in pageable memory (slower)"
        )
    weakref.finalize(owner, _unregister, ptr)


def _unregister(ptr: int) -> None:
    # Runs while numpy deallocates the array, before the memory is returned to the OS.
    if torch.cuda.is_initialized():
        torch.cuda.cudart().cudaHostUnregister(ptr)


def is_page_locked(t: torch.Tensor) -> bool:
    """True when CUDA sees `t`'s memory as page-locked (ours or PyTorch's pinned allocator)."""
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


class PinProgress:
    """Prints pinning progress on a terminal when pinning takes long (large models: minutes)."""

    def __init__(self, total_bytes: int, label: str = "pinning host memory") -> None:
        self._total = total_bytes
        self._label = label  # offtensor.load: "loading weights"
        self._done = 0
        self._start = time.perf_counter()
        self._shown = False
        self._tty = sys.stderr.isatty()

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        elapsed = time.perf_counter() - self._start
        if self._tty and elapsed > 1.0:
            self._shown = True
            rate = self._done / elapsed / 2**30
            sys.stderr.write(
                f"\rofftensor: {self._label} {self._done / 2**30:.1f}/"
                f"{self._total / 2**30:.1f} GiB ({rate:.1f} GiB/s)"
            )
            sys.stderr.flush()

    def close(self) -> None:
        elapsed = time.perf_counter() - self._start
        if self._shown:
            sys.stderr.write("\n")
        logger.debug("%s: %.2f GiB in %.1f s", self._label, self._total / 2**30, elapsed)
