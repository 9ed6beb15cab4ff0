"""Subcommands on host memory, the resource a CPU optimizer beside PCIe copies is bound by:

- `host-contention`: the plain fused AdamW step alone, and while pinned copies stream (CUDA);
- `adamw-memory-kinds`: the same step on PyTorch's allocator's memory, on numpy memory (what
  offtensor's masters use) and on that memory page-locked (CUDA);
- `pinned-bandwidth`: host-to-device bandwidth from PyTorch's pinned memory, from numpy memory
  page-locked in place, and the same with transparent huge pages (CUDA).

offtensor's kind of host memory is rebuilt here from its description (Note [pinned host memory
without the caching allocator] in offtensor/storage/memory.py): the benchmark uses only public API.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .optimizer import ADAMW_LR, plain_like, random_pool
from .scenarios import FULL_SHAPE

_PAGE = 4096
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def numpy_host(nbytes: int, *, lock: bool, huge_pages: bool = False) -> torch.Tensor:
    """`nbytes` of numpy memory as a flat uint8 tensor, page-aligned (2 MiB with `huge_pages`,
    advised before first touch); page-locked in place with cudaHostRegister when `lock`."""
    align = _HUGE if huge_pages else _PAGE
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    flat = raw[start:start + nbytes]
    if huge_pages:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.madvise(ctypes.c_void_p(flat.ctypes.data), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
        flat[:] = 0  # first touch after madvise: the kernel backs it with 2 MiB pages where it can
    if lock:
        ptr = flat.ctypes.data
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed with CUDA error {err}")
        weakref.finalize(raw, torch.cuda.cudart().cudaHostUnregister, ptr)
    return torch.from_numpy(flat)


def layer_shapes(layers: int, norms: bool = False) -> list[tuple[int, ...]]:
    """The parameter shapes of `layers` decoder layers of the benchmark's full-size Llama."""
    s = FULL_SHAPE
    kv = s.hidden // s.heads * s.kv_heads
    one: list[tuple[int, ...]] = [(s.hidden, s.hidden), (kv, s.hidden), (kv, s.hidden), (s.hidden, s.hidden),
                                  (s.intermediate, s.hidden), (s.intermediate, s.hidden), (s.hidden, s.intermediate)]
    return (one + ([(s.hidden,), (s.hidden,)] if norms else [])) * layers


# ---- host-contention ---------------------------------------------------------------------------


def _step_times(opt: torch.optim.Optimizer, reps: int, threads: int,
                background: Callable[[], Callable[[], None]] | None = None) -> list[float]:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        for _ in range(reps):
            done = background() if background is not None else None
            t0 = time.perf_counter()
            opt.step()
            out.append(time.perf_counter() - t0)
            if done is not None:
                done()
        return out
    finally:
        torch.set_num_threads(old)


def _copies(directions: str, seconds: float, piece: int = 256 * 2**20) -> tuple[Callable, list[float]]:
    """A function that enqueues pinned copies lasting about `seconds` and returns a function
    that waits for them and records GB/s in the list returned beside it."""
    dev = torch.device("cuda")
    host_in = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    d_in = torch.empty(piece, dtype=torch.uint8, device=dev)
    d_out = torch.empty(piece, dtype=torch.uint8, device=dev)
    s_in, s_out = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    n = max(1, int(seconds * 55e9 / piece))
    rates: list[float] = []

    def start() -> Callable[[], None]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s_in):
            for _ in range(n):
                d_in.copy_(host_in, non_blocking=True)
        if directions == "both":
            with torch.cuda.stream(s_out):
                for _ in range(n):
                    host_out.copy_(d_out, non_blocking=True)

        def done() -> None:
            torch.cuda.synchronize()
            moved = n * piece * (2 if directions == "both" else 1)
            rates.append(moved / (time.perf_counter() - t0) / 1e9)
        return done

    return start, rates


def _host_copy_gbps() -> float:
    big = torch.ones(2**31, dtype=torch.uint8)
    big2 = torch.empty_like(big)
    t = []
    for _ in range(4):
        t0 = time.perf_counter()
        big2.copy_(big)
        t.append(time.perf_counter() - t0)
    return 2 * big.numel() / statistics.median(t[1:]) / 1e9


def _busy_thread() -> Callable[[], None]:
    """Start a thread running Python without pause (as autograd's thread launching a backward
    does, in bursts); returns the function that stops it."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, daemon=True)
    t.start()

    def end() -> None:
        stop.set()
        t.join()
    return end


def host_contention(argv: list[str]) -> int:
    """The plain fused AdamW step (bf16, the full-size model's layer shapes) alone with all
    threads and with one left spare, on each of --threads, beside a thread busy running Python
    (all threads and one spare: Note [worker threads] in optim/worker.py), then while pinned copies
    stream one way and both ways."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks host-contention", description=host_contention.__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, nargs="*", default=[], metavar="N",
                    help="also time the step alone on each of these thread counts")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    shapes = layer_shapes(args.layers)
    params = plain_like([torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes],
                        random_pool(torch.bfloat16, 0))
    numel = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=ADAMW_LR, fused=True)
    opt.step()  # state allocated
    print(f"host memory: {threads} threads, tensor copy {_host_copy_gbps():.1f} GB/s (read+write)")
    print(f"AdamW bf16 moves ~{numel * 2 * 7 / 1e9:.1f} GB of host memory per step")  # read p, g, m, v; write p, m, v
    rows: list[tuple[str, float, str]] = []

    def row(name: str, times: list[float], extra: str = "") -> None:
        med = statistics.median(times) * 1e3
        rows.append((name, med, extra))
        print(f"{name:<44} {med:8.1f} ms  {numel / med / 1e6:5.2f} G params/s  {extra}", flush=True)

    row(f"alone, {threads} threads", _step_times(opt, args.reps, threads))
    row(f"alone, {max(1, threads - 1)} threads", _step_times(opt, args.reps, max(1, threads - 1)))
    for n in args.threads:
        row(f"alone, {n} threads", _step_times(opt, args.reps, n))
    for n in (threads, max(1, threads - 1)):
        end = _busy_thread()
        try:
            row(f"{n} threads, a busy Python thread alongside", _step_times(opt, args.reps, n))
        finally:
            end()
    if torch.cuda.is_available():
        for directions in ("h2d", "both"):
            start, rates = _copies(directions, 0.6)
            times = _step_times(opt, args.reps, max(1, threads - 1), start)
            row(f"{threads - 1} threads, pinned copies {directions}", times,
                f"copies {statistics.median(rates):.1f} GB/s")
    print(f"\n| AdamW bf16, {args.layers} layers | ms | vs alone |\n| --- | --- | --- |")
    for name, med, extra in rows:
        print(f"| {name} {extra} | {med:.1f} | {med / rows[0][1]:.2f}x |")
    return 0


# ---- adamw-memory-kinds ------------------------------------------------------------------------


def _tensor_of(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = int(np.prod(shape)) * dtype.itemsize
    flat = torch.empty(n, dtype=torch.uint8) if kind == "torch" else numpy_host(n, lock=kind == "pinned")
    t = flat.view(dtype).view(shape)
    t.normal_()
    return t


def adamw_memory_kinds(argv: list[str]) -> int:
    """Fused AdamW over the full-size layers' shapes (scaled by --fraction) with parameters and
    grads in PyTorch's allocator's memory (torch), numpy memory (numpy: offtensor's masters,
    pageable) and numpy memory page-locked (pinned, CUDA only); the optimizer state is the
    optimizer's own. One warm-up step each, then --reps rounds in turn. Also the host's
    transparent-huge-page settings."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks adamw-memory-kinds",
                                 description=adamw_memory_kinds.__doc__)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fraction", type=float, default=0.5, help="of the 8 layers")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    for f in ("enabled", "defrag"):
        setting = Path("/sys/kernel/mm/transparent_hugepage") / f
        print(f"THP {f}: {setting.read_text().strip() if setting.exists() else 'n/a'}")
    kinds = ["torch", "numpy"] + (["pinned"] if torch.cuda.is_available() else [])
    optimizers = {}
    for kind in kinds:
        params = []
        for shape in layer_shapes(max(1, round(FULL_SHAPE.layers * args.fraction)), norms=True):
            p = _tensor_of(kind, shape, dtype)
            p.grad = _tensor_of(kind, shape, dtype)
            params.append(p)
        optimizers[kind] = torch.optim.AdamW(params, lr=ADAMW_LR, fused=True)
        optimizers[kind].step()
    numel = sum(p.numel() for p in optimizers["torch"].param_groups[0]["params"])
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
    return 0


# ---- pinned-bandwidth --------------------------------------------------------------------------


def _h2d_gbps(host: torch.Tensor, dev: torch.Tensor, piece: int | None, reps: int = 7) -> float:
    samples = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if piece is None:
            dev.copy_(host, non_blocking=True)
        else:
            for off in range(0, host.numel() - piece + 1, piece):
                dev[off:off + piece].copy_(host[off:off + piece], non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            samples.append(start.elapsed_time(end) / 1e3)
    moved = host.numel() if piece is None else (host.numel() // piece) * piece
    return moved / statistics.median(samples) / 1e9


def pinned_bandwidth(argv: list[str]) -> int:
    """Host-to-device GB/s from `torch.empty(pin_memory=True)`, from numpy memory page-locked
    in place (offtensor's masters) and the same with transparent huge pages: copies of one
    whole 1 GiB buffer and of one MLP matrix of the full-size layer at a time."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks pinned-bandwidth",
                                 description=pinned_bandwidth.__doc__)
    ap.add_argument("--mib", type=int, default=1024, help="buffer size (default 1024)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pinned-bandwidth: needs a CUDA device")
    nbytes, piece = args.mib * 2**20, FULL_SHAPE.hidden * FULL_SHAPE.intermediate * 2
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    kinds = {"torch pinned": torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True),
             "registered": numpy_host(nbytes, lock=True).zero_(),
             "registered+thp": numpy_host(nbytes, lock=True, huge_pages=True)}
    print(f"{'host memory':16} | whole {args.mib} MiB copy | {piece / 1e6:.0f} MB pieces   (GB/s, host-to-device)")
    for name, host in kinds.items():
        print(f"{name:16} | {_h2d_gbps(host, dev, None):19.1f} | {_h2d_gbps(host, dev, piece):9.1f}")
    return 0


def main(name: str, argv: list[str]) -> int:
    return {"host-contention": host_contention, "adamw-memory-kinds": adamw_memory_kinds,
            "pinned-bandwidth": pinned_bandwidth}[name](argv)
