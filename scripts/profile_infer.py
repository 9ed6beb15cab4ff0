"""Where the time and the peak memory of an offloaded inference forward go (CUDA only).

Builds the benchmark's Llama (8 layers, bf16), wraps it, warms up, then for one forward at a
time reports from the device timeline (torch.profiler):
- span: first to last device activity; wall: the host's time for the call;
- h2d busy: time the host-to-device copies ran (union), and the gaps between them;
- lead: from the first device activity to the first weight copy; tail: from the end of the last
  weight copy to the end of the forward;
and from the caching allocator: peak allocated and reserved, device mallocs and retries per
forward, and the allocated bytes at each scope load and release, to see where the peak is.

    PYTHONPATH=. python scripts/profile_infer.py [--batch 1 --seq 512] [--max-scope-mib 256]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import offtensor
from offtensor.bench import FULL_SHAPE, PeerOptions, _setup_offtensor, build_model

MiB = 2**20


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def timeline(prof) -> dict:
    copies, kernels = [], []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (evt.time_range.start, evt.time_range.end)
        if "HtoD" in evt.name:
            copies.append(iv)
        else:
            kernels.append(iv)
    allv = copies + kernels
    t0 = min(s for s, _ in allv)
    t1 = max(e for _, e in allv)
    cu = union(copies)
    gaps = [(cu[i][1] - t0, cu[i + 1][0] - cu[i][1]) for i in range(len(cu) - 1)]
    big = sorted((g for g in gaps if g[1] > 5), key=lambda g: -g[1])
    return {
        "span_ms": (t1 - t0) / 1e3,
        "h2d_busy_ms": sum(e - s for s, e in cu) / 1e3,
        "kernel_busy_ms": sum(e - s for s, e in union(kernels)) / 1e3,
        "lead_ms": (cu[0][0] - t0) / 1e3 if cu else 0.0,
        "tail_ms": (t1 - cu[-1][1]) / 1e3 if cu else 0.0,
        "h2d_gaps_ms": sum(g for _, g in gaps) / 1e3,
        "largest_gaps": [(round(at / 1e3, 2), round(g / 1e3, 3)) for at, g in big[:6]],
        "copies": len(copies),
    }


class MemLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage().split(";")[0]
        self.lines.append((msg, torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-scope-mib", type=float, default=None)
    ap.add_argument("--prefetch", type=int, default=None)
    ap.add_argument("--profiled", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    built = build_model(FULL_SHAPE, "base", dev, 0)
    print(_setup_offtensor(built, dev, PeerOptions(args.prefetch, args.max_scope_mib)))
    model = built.model.eval()
    ids = torch.randint(0, FULL_SHAPE.vocab, (args.batch, args.seq), device=dev)

    def fwd() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        fwd()
    walls = [fwd() for _ in range(5)]
    print(f"wall (unprofiled) median {statistics.median(walls):.2f} ms: {[round(w, 2) for w in walls]}")

    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    fwd()
    after = torch.cuda.memory_stats()
    print("allocator per forward:", {k: after.get(k, 0) - before.get(k, 0) for k in keys},
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB,"
          f" reserved {torch.cuda.max_memory_reserved() / 2**30:.3f} GiB")

    log = logging.getLogger("offtensor")
    handler = MemLog()
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.DEBUG)
    torch.cuda.reset_peak_memory_stats()
    fwd()
    log.removeHandler(handler)
    log.setLevel(old_level)
    print("allocated / peak (GiB) at each load and release:")
    prev_peak = 0.0
    for msg, alloc, peak in handler.lines:
        mark = "  <- peak rose" if peak > prev_peak + 0.005 else ""
        prev_peak = peak
        print(f"  {alloc:6.3f} {peak:6.3f}  {msg}{mark}")
    print(f"  final peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB")

    results = []
    for _ in range(args.profiled):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = fwd()
        t = timeline(prof)
        t["wall_ms"] = wall
        results.append(t)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()})
    bw = offtensor.bench.measure_bandwidth(dev, 1 << 30)["h2d"]
    print(f"pinned h2d {bw / 1e9:.1f} GB/s; wrapped bytes {built.wrapped_bytes / 1e9:.3f} GB"
          f" -> {built.wrapped_bytes / bw * 1e3:.2f} ms")
    med = {k: statistics.median(r[k] for r in results) for k in ("span_ms", "h2d_busy_ms", "lead_ms", "tail_ms", "h2d_gaps_ms")}
    print("median:", {k: round(v, 3) for k, v in med.items()})


if __name__ == "__main__":
    main()
