"""Host memory for offloaded masters and their gradients.

# Note [pinned host memory without the caching allocator]
`torch.empty(..., pin_memory=True)` goes through PyTorch's pinned caching allocator, which rounds
every request up to a power of two: a 436 MB decoder layer takes 512 MB of page-locked RAM, and a
whole model can take up to twice its size. We instead allocate exactly the bytes we need with
numpy (ordinary pageable memory, untouched until written) and page-lock that range in place with
`cudaHostRegister`. The tensor is then a plain CPU tensor that CUDA copies treat as pinned
(asynchronous, full PCIe bandwidth). The registration is undone by a finalizer on the numpy
array, which runs before numpy frees the memory, i.e. once the last tensor view of it is gone.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref

import numpy as np
import torch

logger = logging.getLogger("offtensor")

# cudaHostRegister wants page-aligned ranges to pin exactly what we ask for.
_PAGE = 4096


def host_empty(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A flat, uninitialized uint8 CPU tensor of exactly `nbytes`, page-locked when `pin`."""
    nbytes = max(int(nbytes), 1)
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % _PAGE
    # The tensor's storage must begin at the registered address: `Tensor.is_pinned()` asks CUDA
    # about the storage's first byte, not the tensor's.
    flat = torch.from_numpy(raw[start : start + nbytes])
    ptr = flat.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"offtensor: cudaHostRegister of {nbytes / 2**20:.1f} MiB failed with CUDA error "
            f"{int(err)}; the host may be out of lockable memory (check `ulimit -l`), or pass "
            "policy=offtensor.Policy(pin_memory=False) to keep masters in pageable memory (slower)"
        )
    weakref.finalize(raw, _unregister, ptr)
    return flat


def _unregister(ptr: int) -> None:
    # Runs while numpy deallocates the array, before the memory is returned to the OS.
    if torch.cuda.is_initialized():
        torch.cuda.cudart().cudaHostUnregister(ptr)


def is_page_locked(t: torch.Tensor) -> bool:
    """True when CUDA sees `t`'s memory as page-locked (ours or PyTorch's pinned allocator)."""
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


class PinProgress:
    """Prints pinning progress on a terminal when pinning takes long (large models: minutes)."""

    def __init__(self, total_bytes: int) -> None:
        self._total = total_bytes
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
                f"\rofftensor: pinning host memory {self._done / 2**30:.1f}/"
                f"{self._total / 2**30:.1f} GiB ({rate:.1f} GiB/s)"
            )
            sys.stderr.flush()

    def close(self) -> None:
        elapsed = time.perf_counter() - self._start
        if self._shown:
            sys.stderr.write("\n")
        logger.debug("pinned %.2f GiB in %.1f s", self._total / 2**30, elapsed)
