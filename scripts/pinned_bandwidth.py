"""Host-to-device bandwidth from three kinds of page-locked host memory (CUDA only).

- torch: `torch.empty(..., pin_memory=True)` (cudaHostAlloc through PyTorch's caching allocator);
- registered: offtensor's `host_empty` (numpy memory, page-locked with cudaHostRegister);
- registered+thp: the same, with transparent huge pages requested (madvise) before first touch.

Copies of one whole buffer and of 117 MB pieces (one MLP matrix of the benchmark's Llama layer),
timed with CUDA events: tells whether offtensor's host memory costs PCIe bandwidth.

    PYTHONPATH=. python scripts/pinned_bandwidth.py
"""

from __future__ import annotations

import ctypes
import statistics

import numpy as np
import torch

from offtensor._host_memory import host_empty

NBYTES = 1 << 30
PIECE = 4096 * 14336 * 2
MADV_HUGEPAGE = 14
HUGE = 2 << 20


def registered_thp(nbytes: int) -> torch.Tensor:
    raw = np.empty(nbytes + HUGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % HUGE
    flat = raw[start : start + nbytes]
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    rc = libc.madvise(ctypes.c_void_p(flat.ctypes.data), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    flat[:] = 0  # first touch after madvise: the kernel backs it with 2 MiB pages where it can
    t = torch.from_numpy(flat)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(err) == 0 and rc == 0, (int(err), rc)
    t._keep = raw  # type: ignore[attr-defined]
    return t


def h2d_gbps(host: torch.Tensor, dev: torch.Tensor, piece: int | None, reps: int = 7) -> float:
    samples = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if piece is None:
            dev.copy_(host, non_blocking=True)
        else:
            for off in range(0, host.numel() - piece + 1, piece):
                dev[off : off + piece].copy_(host[off : off + piece], non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            samples.append(start.elapsed_time(end) / 1e3)
    moved = host.numel() if piece is None else (host.numel() // piece) * piece
    return moved / statistics.median(samples) / 1e9


def main() -> None:
    dev = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    kinds = {
        "torch pinned": torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True),
        "registered": host_empty(NBYTES, pin=True),
        "registered+thp": registered_thp(NBYTES),
    }
    kinds["registered"].zero_()
    kinds["torch pinned"].zero_()
    print(f"{'host memory':16} | whole 1 GiB copy | {PIECE / 1e6:.0f} MB pieces   (GB/s, host-to-device)")
    for name, host in kinds.items():
        print(f"{name:16} | {h2d_gbps(host, dev, None):16.1f} | {h2d_gbps(host, dev, PIECE):9.1f}")


if __name__ == "__main__":
    main()
