"""Does the kind of host memory change the CPU optimizer's speed? (CUDA host; CPU works too.)

Fused `torch.optim.AdamW` over the shapes of the benchmark's 8 Llama layers (scaled by
--fraction), with parameters and grads in:
- torch: `torch.empty` (PyTorch's CPU allocator), what plain tensors use;
- numpy: offtensor's exact-size numpy buffer, not page-locked (`host_empty(pin=False)` is torch's,
  so this one is made here);
- pinned: offtensor's buffer page-locked with cudaHostRegister (`host_empty(pin=True)`), what
  the masters and their grads use.
The optimizer state is the optimizer's own (PyTorch's allocator) in all three. One warm-up step
each, then --reps rounds stepping the kinds in turn, median and spread per kind. Also prints the
host's transparent-huge-page settings.

    PYTHONPATH=. python scripts/adamw_memory_kinds.py [--dtype float32] [--fraction 0.5] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from offtensor._host_memory import host_empty
from offtensor.bench import FULL_SHAPE


def shapes(fraction: float) -> list[tuple[int, ...]]:
    s = FULL_SHAPE
    kv = s.hidden * s.kv_heads // s.heads
    layer = [(s.hidden, s.hidden), (kv, s.hidden), (kv, s.hidden), (s.hidden, s.hidden),
             (s.intermediate, s.hidden), (s.intermediate, s.hidden), (s.hidden, s.intermediate),
             (s.hidden,), (s.hidden,)]
    return layer * max(1, round(s.layers * fraction))


def make(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = int(np.prod(shape)) * dtype.itemsize
    if kind == "torch":
        flat = torch.empty(n, dtype=torch.uint8)
    elif kind == "numpy":
        flat = torch.from_numpy(np.empty(n, dtype=np.uint8))
    else:
        flat = host_empty(n, pin=True)
    t = flat.view(dtype).view(shape)
    t.normal_()
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fraction", type=float, default=0.5, help="of the 8 layers")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    for f in ("enabled", "defrag"):
        p = Path("/sys/kernel/mm/transparent_hugepage") / f
        print(f"THP {f}: {p.read_text().strip() if p.exists() else 'n/a'}")
    kinds = ["torch", "numpy"] + (["pinned"] if torch.cuda.is_available() else [])
    optimizers = {}
    for kind in kinds:
        params = []
        for shape in shapes(args.fraction):
            p = make(kind, shape, dtype)
            p.grad = make(kind, shape, dtype)
            params.append(p)
        optimizers[kind] = torch.optim.AdamW(params, lr=1e-5, fused=True)
        optimizers[kind].step()
    numel = sum(p.numel() for g in next(iter(optimizers.values())).param_groups for p in g["params"])
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.reps):
        for kind, opt in optimizers.items():
            t0 = time.perf_counter()
            opt.step()
            times[kind].append((time.perf_counter() - t0) * 1e3)
    print(f"fused AdamW, {args.dtype}, {numel / 1e6:,.0f} M params, {torch.get_num_threads()} threads, "
          f"{args.reps} rounds in turn:")
    base = statistics.median(times["torch"])
    for kind, ts in times.items():
        m = statistics.median(ts)
        print(f"  {kind:6s} median {m:7.1f} ms ({numel / m / 1e6:.2f} G params/s; {base / m:.3f}x torch's speed), "
              f"min {min(ts):.1f}, max {max(ts):.1f}")


if __name__ == "__main__":
    main()
