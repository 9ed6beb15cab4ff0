"""Subcommands `profile-step` and `profile-infer`: where the time (and, for a forward, the peak
device memory) of an offloaded step goes, read from torch.profiler's device timeline (CUDA;
`profile-step --quick` runs a tiny model on the CPU to check the command)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .measure import measure_bandwidth
from .model import build_model, enable_checkpointing
from .optimizer import make_adamw
from .peers import PeerOptions, setup_offtensor
from .plots import TIMELINE_PNG, missing_matplotlib, plot_timeline
from .scenarios import FULL_SHAPE, QUICK_SHAPE

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def busy(intervals: list[Interval], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in union(intervals))


def gaps(intervals: list[Interval], lo: float, hi: float, least: float) -> list[Interval]:
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


# ---- profile-infer -----------------------------------------------------------------------------


def device_intervals(events: Any) -> tuple[list[Interval], list[Interval], list[Interval]]:
    """A profiler's device events (µs) as (host-to-device copies, other copies and memsets,
    kernels)."""
    h2d: list[Interval] = []
    memory: list[Interval] = []
    kernels: list[Interval] = []
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        iv = (evt.time_range.start, evt.time_range.end)
        if "HtoD" in evt.name:
            h2d.append(iv)
        elif is_kernel(evt):
            kernels.append(iv)
        else:
            memory.append(iv)
    return h2d, memory, kernels


def is_kernel(evt: Any) -> bool:
    """A device event that is a kernel, not a copy or memset."""
    return "Memcpy" not in evt.name and "Memset" not in evt.name


def infer_timeline(prof: Any) -> dict[str, Any]:
    """Span, copy and kernel busy time, and the gaps between host-to-device copies (µs -> ms)."""
    copies, memory, compute = device_intervals(prof.events())
    kernels = memory + compute  # here every device event but the host-to-device copies
    t0 = min(s for s, _ in copies + kernels)
    t1 = max(e for _, e in copies + kernels)
    cu = union(copies)
    between = [(cu[i][1] - t0, cu[i + 1][0] - cu[i][1]) for i in range(len(cu) - 1)]
    big = sorted((g for g in between if g[1] > 5), key=lambda g: -g[1])
    return {
        "span_ms": (t1 - t0) / 1e3,
        "h2d_busy_ms": busy(cu, t0, t1) / 1e3,
        "kernel_busy_ms": sum(e - s for s, e in union(kernels)) / 1e3,
        "lead_ms": (cu[0][0] - t0) / 1e3 if cu else 0.0,
        "tail_ms": (t1 - cu[-1][1]) / 1e3 if cu else 0.0,
        "h2d_gaps_ms": sum(g for _, g in between) / 1e3,
        "largest_gaps": [(round(at / 1e3, 2), round(g / 1e3, 3)) for at, g in big[:6]],
        "copies": len(copies),
    }


class _MemLog(logging.Handler):
    """Allocated and peak device memory at each of offtensor's debug log lines (loads, releases)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage().split(";")[0]
        self.lines.append((msg, torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30))


def _memory_per_load(fwd: Callable[[], float]) -> None:
    log = logging.getLogger("offtensor")
    handler, old_level = _MemLog(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    torch.cuda.reset_peak_memory_stats()
    try:
        fwd()
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    print("allocated / peak (GiB) at each load and release:")
    prev_peak = 0.0
    for msg, alloc, peak in handler.lines:
        mark = "  <- peak rose" if peak > prev_peak + 0.005 else ""
        prev_peak = peak
        print(f"  {alloc:6.3f} {peak:6.3f}  {msg}{mark}")
    print(f"  final peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB")


def _allocator_per_forward(fwd: Callable[[], float]) -> None:
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    fwd()
    after = torch.cuda.memory_stats()
    print("allocator per forward:", {k: after.get(k, 0) - before.get(k, 0) for k in keys},
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB,"
          f" reserved {torch.cuda.max_memory_reserved() / 2**30:.3f} GiB")


def profile_infer(argv: list[str]) -> int:
    """Per forward: span, wall, h2d busy and gaps, lead and tail, allocator counts, and the
    allocated bytes at each scope load and release."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks profile-infer", description=profile_infer.__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-scope-mib", type=float, default=None)
    ap.add_argument("--prefetch", type=int, default=None)
    ap.add_argument("--profiled", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile-infer: needs a CUDA device")
    dev = torch.device("cuda")
    built = build_model(FULL_SHAPE, "base", dev, 0)
    print(setup_offtensor(built, dev, PeerOptions(args.prefetch, args.max_scope_mib)))
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
    _allocator_per_forward(fwd)
    _memory_per_load(fwd)
    results = []
    for _ in range(args.profiled):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = fwd()
        results.append({**infer_timeline(prof), "wall_ms": wall})
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in results[-1].items()})
    bw = measure_bandwidth(dev, 1 << 30)["h2d"]
    print(f"pinned h2d {bw / 1e9:.1f} GB/s; wrapped bytes {built.wrapped_bytes / 1e9:.3f} GB"
          f" -> {built.wrapped_bytes / bw * 1e3:.2f} ms")
    med = {k: statistics.median(r[k] for r in results) for k in ("span_ms", "h2d_busy_ms", "lead_ms", "tail_ms",
                                                                 "h2d_gaps_ms")}
    print("median:", {k: round(v, 3) for k, v in med.items()})
    return 0


# ---- profile-step ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Trace:
    """The profiled steps' ranges (ms on the profiler's clock) and the worker's scope spans."""

    ranges: dict[str, list[Interval]]  # marker name -> ranges on the host
    kernels: list[Interval]
    h2d: list[Interval]
    d2h: list[Interval]
    scopes: list[tuple[str, Interval]]  # (scope, from its first piece's start to its last step)


def _trace(prof: Any, calls: list[tuple[float, Any]], clock: float) -> _Trace:
    marks = ("clock", "step", "forward", "backward_and_step")
    ranges: dict[str, list[Interval]] = {}
    trace = _Trace(ranges, [], [], [], [])
    for evt in prof.events():
        iv = (evt.time_range.start / 1e3, evt.time_range.end / 1e3)  # ms
        on_device = evt.device_type == torch.autograd.DeviceType.CUDA
        if on_device and evt.name in marks:
            continue  # the same ranges mirrored onto the device timeline, not device work
        if on_device:
            if "HtoD" in evt.name:
                trace.h2d.append(iv)
            elif "DtoH" in evt.name:
                trace.d2h.append(iv)
            elif "Memcpy" not in evt.name and "Memset" not in evt.name:
                trace.kernels.append(iv)
        elif evt.name in marks:
            ranges.setdefault(evt.name, []).append(iv)
    # OverlapReport times are seconds since each call; the call's perf_counter maps them onto
    # the profiler's clock through the marker recorded at `clock`.
    offset = ranges["clock"][0][0] - clock * 1e3
    for called, report in calls:
        base = called * 1e3 + offset
        trace.scopes += [(name.rsplit(".", 1)[-1], (base + began * 1e3, base + stepped * 1e3))
                         for name, _queued, began, stepped in report.wait().scopes]
    return trace


def _print_step(k: int, t: _Trace, s0: float, s1: float, nxt: float) -> tuple[float, float, float]:
    fwd = next(e for s, e in t.ranges["forward"] if s0 <= s <= s1)
    call, bwd = next(iv for iv in t.ranges["backward_and_step"] if s0 <= iv[0] <= s1)
    print(f"\nstep {k}: {s1 - s0:.1f} ms; forward returned at {fwd - s0:.1f}, backward_and_step "
          f"returned at {bwd - s0:.1f}")
    for label, lo, hi in (("the previous step's, deferred", s0, call), ("this step's", call, nxt)):
        spans = [(n, a, b) for n, (a, b) in t.scopes if lo <= a < hi]
        print(f"  worker, {label} scopes (first piece began-last stepped): "
              + ", ".join(f"{n} {a - s0:.0f}-{b - s0:.0f}" for n, a, b in spans))
    worker = [iv for _, iv in t.scopes]
    idle = gaps(worker, s0, s1, 2.0)
    print(f"  worker busy {busy(worker, s0, s1):.1f} ms; idle spans: "
          + ", ".join(f"{a - s0:.0f}-{b - s0:.0f}" for a, b in idle))
    print(f"  device: kernels {busy(t.kernels, s0, s1):.1f} ms, h2d {busy(t.h2d, s0, s1):.1f} ms, "
          f"d2h {busy(t.d2h, s0, s1):.1f} ms; compute gaps > 1 ms: "
          + ", ".join(f"{a - s0:.0f}-{b - s0:.0f}" for a, b in gaps(t.kernels, s0, s1, 1.0)))
    return s1 - s0, busy(worker, s0, s1), sum(b - a for a, b in idle)


def _clip(intervals: list[Interval], lo: float, hi: float) -> list[list[float]]:
    """The parts of `intervals` inside [lo, hi], in ms since lo (lists: JSON-ready)."""
    return [[max(s, lo) - lo, min(e, hi) - lo] for s, e in intervals if e > lo and s < hi]


# Note [timeline resolution]
# A step on the GPU runs thousands of kernels and copies, most far shorter than a pixel of the
# picture (a 400 ms step over about 1300 pixels: 0.3 ms each). The device lanes are drawn from
# their busy spans with gaps shorter than 1/2000 of the step closed, which changes nothing one
# can see and keeps step_timeline.json small; the printed busy times above use the exact spans.
def _close_gaps(intervals: list[Interval], least: float) -> list[Interval]:
    out: list[Interval] = []
    for s, e in union(intervals):
        if out and s - out[-1][1] < least:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def step_timeline(t: _Trace, s0: float, s1: float, device: str) -> dict[str, Any]:
    """One step's lanes for plots.timeline_figure (ms since the step began): the main
    thread's forward and backward_and_step, the device's copies and kernels (CUDA), and the
    optimizer worker's scopes, the previous step's deferred ones apart from this step's."""
    fwd = next(iv for iv in t.ranges["forward"] if s0 <= iv[0] <= s1)
    call = next(iv for iv in t.ranges["backward_and_step"] if s0 <= iv[0] <= s1)
    worker = [(n, iv) for n, iv in t.scopes if iv[1] > s0 and iv[0] < s1]
    prev, this = [w for w in worker if w[1][0] < call[0]], [w for w in worker if w[1][0] >= call[0]]
    no_device = "" if device == "cuda" else (f"CUDA only: on the {device}, copies and kernels run inside "
                                             "the main thread's forward and backward")

    def lane(row: str, what: str, spans: list[list[float]], labels: list[str] | None = None) -> dict[str, Any]:
        return {"row": row, "what": what, "spans": spans, "labels": labels or [],
                "note": no_device if row.startswith("device") else ""}

    least = (s1 - s0) / 2000  # Note [timeline resolution]
    lanes = [lane("main thread", "forward", _clip([fwd], s0, s1), ["forward"]),
             lane("main thread", "backward_and_step", _clip([call], s0, s1), ["backward"]),
             lane("device: host-to-device copies", "", _clip(_close_gaps(t.h2d, least), s0, s1)),
             lane("device: kernels", "", _clip(_close_gaps(t.kernels, least), s0, s1)),
             lane("device: device-to-host copies", "", _clip(_close_gaps(t.d2h, least), s0, s1)),
             lane("optimizer worker", "the previous step's layers (deferred)",
                  _clip([iv for _, iv in prev], s0, s1), [n for n, _ in prev]),
             lane("optimizer worker", "this step's layers", _clip([iv for _, iv in this], s0, s1),
                  [n for n, _ in this])]
    worker_busy = busy([iv for _, iv in worker], s0, s1)
    return {"kind": "step_timeline", "device": device, "step_ms": s1 - s0, "lanes": lanes,
            "markers": [{"label": "forward returned", "at_ms": fwd[1] - s0},
                        {"label": "backward_and_step returned", "at_ms": call[1] - s0}],
            "title": (f"one overlapped training step on {device} (profile-step, under torch.profiler): "
                      f"{s1 - s0:.1f} ms, optimizer worker busy {worker_busy:.1f} ms")}


def _write_timeline(t: _Trace, steps: list[Interval], device: str, out_dir: str) -> None:
    """The measured step of median length (the first profiled one follows a drained step)."""
    measured = sorted(steps[1:], key=lambda s: s[1] - s[0])
    s0, s1 = measured[(len(measured) - 1) // 2]
    for path in plot_timeline(step_timeline(t, s0, s1, device), out_dir):
        print(f"profile-step: wrote {path}")


def _training_setup(args: argparse.Namespace) -> tuple[Callable[[list], None], Callable[[], None]]:
    """The overlapped training step as the benchmark runs it (checkpointing, fused AdamW,
    backward_and_step with zero_grad=True), and a device sync."""
    import offtensor

    dev = torch.device("cpu" if args.quick else "cuda")
    shape = QUICK_SHAPE if args.quick else dataclasses.replace(FULL_SHAPE, layers=args.layers)
    built = build_model(shape, "base", dev, 0)
    print(setup_offtensor(built, dev, PeerOptions()))
    model = built.model.train()
    enable_checkpointing(model)
    (opt,), _ = make_adamw([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, shape.vocab, (2, 64) if args.quick else (4, 2048), device=dev)

    def step(calls: list) -> None:
        with record_function("forward"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with record_function("backward_and_step"):
            called = time.perf_counter()
            calls.append((called, offtensor.backward_and_step(loss, opt, zero_grad=True)))

    return step, (torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))


def profile_step(argv: list[str]) -> int:
    """Overlapped training steps profiled: per step, when forward and backward_and_step returned,
    each scope's optimizer span and the worker's idle spans, and the device's busy time."""
    import offtensor

    ap = argparse.ArgumentParser(prog="python -m benchmarks profile-step", description=profile_step.__doc__)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the command")
    ap.add_argument("--unprofiled", type=int, default=6, help="steps run (and timed) before the profiled ones")
    ap.add_argument("--plot", default=None, metavar="DIR",
                    help=f"draw the median profiled step's timeline into DIR/{TIMELINE_PNG} (needs matplotlib)")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        raise SystemExit("profile-step: needs a CUDA device (or --quick)")
    if args.steps < 1 or args.unprofiled < 1:
        ap.error("--steps and --unprofiled must be >= 1")
    if args.plot is not None and (why := missing_matplotlib()) is not None:
        ap.error(why)
    step, sync = _training_setup(args)
    walls: list[float] = []
    calls: list[tuple[float, Any]] = []
    for _ in range(args.unprofiled):
        sync()
        t0 = time.perf_counter()
        step(calls)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    offtensor.wait_for_steps()
    print(f"unprofiled steps (ms, the first ones warm up): {[round(w, 1) for w in walls]}")
    calls.clear()
    activities = [ProfilerActivity.CPU] + ([] if args.quick else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        with record_function("clock"):
            clock = time.perf_counter()
        for _ in range(args.steps + 1):
            sync()
            with record_function("step"):  # the period, as the benchmark times it
                step(calls)
                sync()
        offtensor.wait_for_steps()
    t = _trace(prof, calls, clock)
    steps = sorted(t.ranges["step"])
    summary = [_print_step(k, t, s0, s1, steps[k + 1][0] if k + 1 < len(steps) else s1)
               for k, (s0, s1) in enumerate(steps[1:], 1)]  # the first follows a drained step
    print(f"\nmedian: step {statistics.median(s for s, _, _ in summary):.1f} ms, worker busy "
          f"{statistics.median(w for _, w, _ in summary):.1f} ms, worker idle "
          f"{statistics.median(i for _, _, i in summary):.1f} ms")
    if args.plot is not None:
        _write_timeline(t, steps, "cpu" if args.quick else "cuda", args.plot)
    return 0


def main(name: str, argv: list[str]) -> int:
    return {"profile-step": profile_step, "profile-infer": profile_infer}[name](argv)
