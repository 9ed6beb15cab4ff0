"""`--shape flux --profile`: after a row's timed iterations, one more under torch.profiler, read
as which stream waited on which.

# Note [where a row's time goes]
A row slower than its roofline is either waiting on the link or waiting on the host. On the
device timeline of one profiled iteration, the compute kernels' busy time is what resident would
spend (plus dequantization kernels, which run on the cast stream beside it); every gap between
them is compute waiting. A gap during which a host-to-device copy is running is compute waiting
on the copy stream (the link is the bound there); a gap with no copy running is compute waiting
on the host (nothing was enqueued: Python dispatch, a host sync, a read not yet done). The link's
own idle time beside busy compute is what a deeper prefetch could use. Waiting on the host is
then split by a second profiled iteration that records the host too: the CUDA runtime calls it
spent longest in (`host_calls`). A host that blocks in a synchronizing call (an event's or a
stream's synchronize, a cudaMalloc or cudaFree of the caching allocator) lets the device run dry
however fast its Python is; one that only launches is slow in Python.
The link's idle time is split the same way (`link_gaps`), from that second iteration's device
copies and the host calls that enqueued them (the trace's correlation ids): a copy enqueued after
the link went idle was late on the host (the prefetch was issued late); one enqueued before
waited on the device for an event: of compute (the memory it reuses, Note [ordering across
streams] in scopes/streams.py) when it starts as a compute kernel ends, else of another stream.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from .profiling import busy, device_intervals, gaps, union


def where_time_goes(step: Callable[[], None], device: torch.device,
                    dump: str | None = None) -> dict[str, float] | None:
    """One call of `step` profiled; None off CUDA (no device timeline). Milliseconds. With `dump`
    (a path), the device events also go there as gzipped JSON lines: stream, name, start, end
    (µs), to read which kernel waited where."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    if dump is not None:
        _dump(prof.events(), dump)
    return split_timeline(prof.events())


def host_calls(step: Callable[[], None], device: torch.device, top: int = 6,
               dump: str | None = None) -> dict[str, float] | None:
    """One call of `step` profiled on the host: the CUDA runtime calls (`cuda*`, `cu*`) it spent
    longest in, as {"name xN": total ms}, longest first, "step" (the call's host time) and the
    link's idle time (`link_gaps`, its gaps to `dump`, a path, if given); None off CUDA (Note
    [where a row's time goes])."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        took = time.perf_counter() - start
        torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            idle = link_gaps(json.load(f)["traceEvents"], dump)
    finally:
        os.unlink(path)
    return {"step": took * 1e3, **runtime_calls(prof.events(), top), **idle}


# What link_gaps returns (milliseconds, and the gaps' count).
_LINK_KEYS = ("link idle", "copy enqueued late", "copy waited on compute", "copy waited on another stream",
              "link gaps")
# A gap in the link shorter than this is a copy's own launch latency, not idle time.
LEAST_GAP_US = 20.0
# A copy that starts this close after a compute kernel's end waited on compute's event.
AFTER_KERNEL_US = 25.0


def link_gaps(trace: list[dict[str, Any]], dump: str | None = None) -> dict[str, float]:
    """The link's idle time between the first and the last host-to-device copy of a chrome
    trace's events (µs), split by why the copy after each gap started late (Note [where a row's
    time goes]): "link idle", of which "copy enqueued late" (on the host), "copy waited on
    compute", "copy waited on another stream"; milliseconds, and the gaps' count. With `dump` (a
    path), each gap as a JSON line: when (µs after the first copy), how long, how much of it the
    host was late, the kernel that ended last before the copy started, the copy's bytes."""
    launched: dict[int, float] = {}  # correlation id -> when the host enqueued it
    copies: list[tuple[float, float, int, int]] = []  # (start, end, correlation id, bytes)
    kernels: list[tuple[float, str]] = []  # (end, name)
    for evt in trace:
        cat, args = evt.get("cat", ""), evt.get("args", {})
        if cat == "cuda_runtime" and "Memcpy" in evt.get("name", ""):
            launched[args.get("correlation", -1)] = evt["ts"]
        elif cat == "gpu_memcpy" and "HtoD" in evt.get("name", ""):
            copies.append((evt["ts"], evt["ts"] + evt.get("dur", 0.0), args.get("correlation", -1),
                           args.get("bytes", 0)))
        elif cat == "kernel":
            kernels.append((evt["ts"] + evt.get("dur", 0.0), evt.get("name", "")[:60]))
    copies.sort()
    kernels.sort()
    total = dict.fromkeys(_LINK_KEYS, 0.0)
    rows = []
    end: float | None = None
    k = 0
    for start, stop, corr, nbytes in copies:
        if end is not None and start - end > LEAST_GAP_US:
            gap = start - end
            at = launched.get(corr)
            late = min(gap, at - end) if at is not None and at > end else 0.0
            while k < len(kernels) and kernels[k][0] <= start:
                k += 1
            after = kernels[k - 1] if k else (float("-inf"), "")
            cause = "copy waited on compute" if start - after[0] <= AFTER_KERNEL_US else "copy waited on another stream"
            total["link gaps"] += 1
            total["link idle"] += gap / 1e3
            total["copy enqueued late"] += late / 1e3
            total[cause] += (gap - late) / 1e3
            rows.append({"at": start - copies[0][0], "gap": gap, "late": late, "cause": cause,
                         "after_kernel": after[1], "bytes": nbytes})
        end = stop if end is None else max(end, stop)
    if dump is not None:
        with gzip.open(dump, "wt") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return total


def runtime_calls(events: Any, top: int) -> dict[str, float]:
    """The `top` CUDA runtime and driver calls among a profiler's host events by total time, as
    {"name xN": ms}."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CPU and evt.name.startswith("cu"):
            total[evt.name] = total.get(evt.name, 0.0) + evt.time_range.elapsed_us() / 1e3
            count[evt.name] = count.get(evt.name, 0) + 1
    longest = sorted(total, key=lambda n: -total[n])[:top]
    return {f"{n} x{count[n]}": total[n] for n in longest}


def describe_host(calls: dict[str, float]) -> str:
    rest = ", ".join(f"{k} {v:.1f}" for k, v in calls.items() if k != "step" and k not in _LINK_KEYS)
    line = f"host: step {calls['step']:.1f} ms, in CUDA calls (ms): {rest}"
    if "link idle" in calls:
        line += (f"; link idle {calls['link idle']:.1f} ms in {calls['link gaps']:.0f} gaps: copy enqueued late "
                 f"{calls['copy enqueued late']:.1f}, waited on compute {calls['copy waited on compute']:.1f}, "
                 f"on another stream {calls['copy waited on another stream']:.1f}")
    return line


def _dump(events: Any, path: str) -> None:
    with gzip.open(path, "wt") as f:
        for evt in events:
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                row = [getattr(evt, "device_resource_id", None), evt.name[:80], evt.time_range.start,
                       evt.time_range.end]
                f.write(json.dumps(row) + "\n")


def split_timeline(events: Any) -> dict[str, float] | None:
    """Compute busy, compute waiting on copies, compute waiting on the host, and link busy, from
    a profiler's device events (Note [where a row's time goes])."""
    copies, _, kernels = device_intervals(events)
    if not kernels:
        return None
    t0 = min(s for s, _ in kernels + copies)
    t1 = max(e for _, e in kernels + copies)
    on_copy = on_host = 0.0
    copy_spans = union(copies)
    for lo, hi in gaps(kernels, t0, t1, least=0.0):
        during = busy(copy_spans, lo, hi)
        on_copy += during
        on_host += (hi - lo) - during
    return {"span_ms": (t1 - t0) / 1e3, "compute_busy_ms": busy(kernels, t0, t1) / 1e3,
            "waiting_on_copies_ms": on_copy / 1e3, "waiting_on_host_ms": on_host / 1e3,
            "link_busy_ms": busy(copy_spans, t0, t1) / 1e3}


def describe(p: dict[str, float]) -> str:
    return (f"profile: span {p['span_ms']:.1f} ms, compute busy {p['compute_busy_ms']:.1f}, compute waiting on "
            f"copies {p['waiting_on_copies_ms']:.1f}, on the host {p['waiting_on_host_ms']:.1f}; link busy "
            f"{p['link_busy_ms']:.1f}")
