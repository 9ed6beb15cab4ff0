"""Where the time of an overlapped training step goes (CUDA only).

Builds the benchmark's Llama (8 layers, bf16, 4x2048, checkpointing), wraps it, and runs
`offtensor.backward_and_step` training steps as the benchmark does (no host sync inside a
step, one at its end). After warm-up it profiles a few steps (torch.profiler, CPU and CUDA) and
prints, in ms from each step's start:
- host: when the forward returned (backward_and_step called) and when backward returned;
- the optimizer worker: each scope's pieces (first began, last ended) and the worker's idle
  spans longer than 2 ms, i.e. what the step waits on when it is longer than the worker's work;
- the device: busy time of compute kernels, host-to-device and device-to-host copies, and the
  compute stream's gaps longer than 1 ms.

    PYTHONPATH=. python scripts/profile_step.py [--steps 2] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from profile_infer import union  # this script's directory is on sys.path when it runs

import offtensor
from offtensor import _overlap
from offtensor.bench import (FULL_SHAPE, QUICK_SHAPE, ModelShape, PeerOptions, _setup_offtensor, build_model,
                             enable_checkpointing, make_adamw)


def busy(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in union(intervals))


def gaps(intervals: list[tuple[float, float]], lo: float, hi: float, least: float) -> list[tuple[float, float]]:
    out, at = [], lo
    for s, e in union(intervals):
        if e <= lo or s >= hi:
            continue
        if s - at > least:
            out.append((at, s))
        at = max(at, e)
    if hi - at > least:
        out.append((at, hi))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.quick else "cuda")
    base = QUICK_SHAPE if args.quick else FULL_SHAPE
    shape = ModelShape(**{**base.__dict__, "layers": args.layers if not args.quick else base.layers})
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    built = build_model(shape, "base", dev, 0)
    print(_setup_offtensor(built, dev, PeerOptions()))
    model = built.model.train()
    enable_checkpointing(model)
    (opt,), _ = make_adamw([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, shape.vocab, (2, 64) if args.quick else (4, 2048), device=dev)

    # The worker's pieces, in host time (the profiler does not trace threads it did not start
    # on); mapped onto the profiler's clock with a marker recorded on the main thread.
    step_piece = _overlap._OverlappedStep._step_piece
    host_pieces: list[tuple[str, float, float]] = []

    def traced(self, piece):
        began = time.perf_counter()
        try:
            return step_piece(self, piece)
        finally:
            host_pieces.append((piece.scope.rsplit(".", 1)[-1], began, time.perf_counter()))

    _overlap._OverlappedStep._step_piece = traced

    def step() -> None:
        with record_function("forward"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with record_function("backward_and_step"):
            offtensor.backward_and_step(loss, opt, zero_grad=True)

    walls = []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    offtensor.wait_for_steps()
    print(f"unprofiled steps (ms, the first ones warm up): {[round(w, 1) for w in walls]}")

    host_pieces.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("clock"):
            clock = time.perf_counter()
        for _ in range(args.steps + 1):
            sync()
            with record_function("step"):  # the period, as the benchmark times it
                step()
                sync()
        offtensor.wait_for_steps()

    ranges: dict[str, list[tuple[float, float]]] = {}
    kernels, h2d, d2h = [], [], []
    marks = ("clock", "step", "forward", "backward_and_step")
    for evt in prof.events():
        iv = (evt.time_range.start / 1e3, evt.time_range.end / 1e3)  # ms
        if evt.name in marks and evt.device_type == torch.autograd.DeviceType.CUDA:
            continue  # the same ranges mirrored onto the device timeline, not device work
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            if "HtoD" in evt.name:
                h2d.append(iv)
            elif "DtoH" in evt.name:
                d2h.append(iv)
            elif "Memcpy" not in evt.name and "Memset" not in evt.name:
                kernels.append(iv)
        elif evt.name in marks:
            ranges.setdefault(evt.name, []).append(iv)
    steps = sorted(ranges["step"])
    offset = ranges["clock"][0][0] - clock * 1e3
    pieces = [(name, (a * 1e3 + offset, b * 1e3 + offset)) for name, a, b in host_pieces]
    worker = [iv for _, iv in pieces]
    summary = []
    for k, (s0, s1) in enumerate(steps[1:], 1):  # the first profiled step follows a drained one
        nxt = steps[k + 1][0] if k + 1 < len(steps) else s1
        fwd = next(e for s, e in ranges["forward"] if s0 <= s <= s1)
        bwd = next(e for s, e in ranges["backward_and_step"] if s0 <= s <= s1)
        print(f"\nstep {k}: {s1 - s0:.1f} ms; forward returned at {fwd - s0:.1f}, backward_and_step "
              f"returned at {bwd - s0:.1f}")
        fwd_call = next(s for s, _ in ranges["backward_and_step"] if s0 <= s <= s1)
        for label, lo, hi in (("the previous step's, deferred", s0, fwd_call), ("this step's", fwd_call, nxt)):
            per_scope: dict[str, list[float]] = {}
            for name, (a, b) in pieces:
                if lo <= a < hi:
                    span = per_scope.setdefault(name, [a, b])
                    span[0], span[1] = min(span[0], a), max(span[1], b)
            print(f"  worker, {label} pieces per scope (first began-last ended): " + ", ".join(
                f"{n} {a - s0:.0f}-{b - s0:.0f}" for n, (a, b) in per_scope.items()))
        idle = gaps(worker, s0, s1, 2.0)
        print(f"  worker busy {busy(worker, s0, s1):.1f} ms; idle spans: "
              + ", ".join(f"{a - s0:.0f}-{b - s0:.0f}" for a, b in idle))
        print(f"  device: kernels {busy(kernels, s0, s1):.1f} ms, h2d {busy(h2d, s0, s1):.1f} ms, "
              f"d2h {busy(d2h, s0, s1):.1f} ms; compute gaps > 1 ms: "
              + ", ".join(f"{a - s0:.0f}-{b - s0:.0f}" for a, b in gaps(kernels, s0, s1, 1.0)))
        summary.append((s1 - s0, busy(worker, s0, s1), sum(b - a for a, b in idle)))
    print(f"\nmedian: step {statistics.median(s for s, _, _ in summary):.1f} ms, worker busy "
          f"{statistics.median(w for _, w, _ in summary):.1f} ms, worker idle "
          f"{statistics.median(i for _, _, i in summary):.1f} ms")


if __name__ == "__main__":
    main()
