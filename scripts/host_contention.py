"""How fast the CPU optimizer steps while PCIe copies run: host memory bandwidth contention.

`backward_and_step` runs fused AdamW on the host while the device copies weights in and
gradients out. Both use host memory bandwidth. This measures, on the benchmark's shapes (8 Llama
layers, bf16, 1.75 G parameters), the plain fused AdamW step on CPU tensors:
- alone, with all threads and with one thread left to the launching thread;
- while pinned host-to-device copies stream at full speed (one direction), and both directions;
- the host's own memory bandwidth (a large tensor copy), for scale.

    PYTHONPATH=. python scripts/host_contention.py [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from offtensor.bench import FULL_SHAPE, _plain_like, _random_pool

COPY_PIECE = 256 * 2**20


def layer_shapes(layers: int) -> list[tuple[int, int]]:
    s = FULL_SHAPE
    kv = s.hidden // s.heads * s.kv_heads
    one = [(s.hidden, s.hidden), (kv, s.hidden), (kv, s.hidden), (s.hidden, s.hidden),
           (s.intermediate, s.hidden), (s.intermediate, s.hidden), (s.hidden, s.intermediate)]
    return one * layers


def step_times(opt: torch.optim.Optimizer, reps: int, threads: int, background=None) -> list[float]:
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


def copies(directions: str, seconds: float):
    """A function that enqueues pinned copies lasting about `seconds` and returns a function
    that waits for them and reports GB/s."""
    dev = torch.device("cuda")
    host_in = torch.empty(COPY_PIECE, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(COPY_PIECE, dtype=torch.uint8, pin_memory=True)
    d_in = torch.empty(COPY_PIECE, dtype=torch.uint8, device=dev)
    d_out = torch.empty(COPY_PIECE, dtype=torch.uint8, device=dev)
    s_in, s_out = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    n = max(1, int(seconds * 55e9 / COPY_PIECE))
    rates: list[float] = []

    def start():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s_in):
            for _ in range(n):
                d_in.copy_(host_in, non_blocking=True)
        if directions == "both":
            with torch.cuda.stream(s_out):
                for _ in range(n):
                    host_out.copy_(d_out, non_blocking=True)

        def done():
            torch.cuda.synchronize()
            moved = n * COPY_PIECE * (2 if directions == "both" else 1)
            rates.append(moved / (time.perf_counter() - t0) / 1e9)
        return done

    return start, rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    pool = _random_pool(torch.bfloat16, 0)
    shapes = layer_shapes(args.layers)
    params = _plain_like([torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes], pool)
    numel = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    opt.step()  # state allocated
    rows = []

    def row(name: str, times: list[float], extra: str = "") -> None:
        med = statistics.median(times) * 1e3
        rows.append((name, med, extra))
        print(f"{name:<44} {med:8.1f} ms  {numel / med / 1e6:5.2f} G params/s  {extra}", flush=True)

    big = torch.empty(2**31, dtype=torch.uint8)
    big2 = torch.empty_like(big)
    big.fill_(1)
    big2.fill_(2)
    t = []
    for _ in range(4):
        t0 = time.perf_counter()
        big2.copy_(big)
        t.append(time.perf_counter() - t0)
    bw = 2 * big.numel() / statistics.median(t[1:]) / 1e9
    print(f"host memory: {threads} threads, tensor copy {bw:.1f} GB/s (read+write)")
    del big, big2
    bytes_per_step = numel * 2 * 7  # bf16: read p, g, m, v; write p, m, v
    print(f"AdamW bf16 moves ~{bytes_per_step / 1e9:.1f} GB of host memory per step")

    row(f"alone, {threads} threads", step_times(opt, args.reps, threads))
    row(f"alone, {threads - 1} threads", step_times(opt, args.reps, threads - 1))
    if torch.cuda.is_available():
        for directions in ("h2d", "both"):
            start, rates = copies(directions, 0.6)
            times = step_times(opt, args.reps, threads - 1, start)
            row(f"{threads - 1} threads, pinned copies {directions}", times,
                f"copies {statistics.median(rates):.1f} GB/s")
    print()
    print("| AdamW bf16, 8 layers | ms | vs alone |")
    print("| --- | --- | --- |")
    for name, med, extra in rows:
        print(f"| {name} {extra} | {med:.1f} | {med / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
