"""`--shape flux --profile`: after a row's timed iterations, one more under torch.profiler, read
as which stream waited on which.

# Note [where a row's time goes]
A row slower than its roofline is either waiting on the link or waiting on the host. On the
device timeline of one profiled iteration, the compute kernels' busy time is what resident would
spend (plus dequantization kernels, which run on the cast stream beside it); every gap between
them is compute waiting. A gap during which a host-to-device copy is running is compute waiting
on the copy stream (the link is the bound there); a gap with no copy running is compute waiting
on the host (nothing was enqueued: Python dispatch, a host sync, a read not yet done). The link's
own idle time beside busy compute is what a deeper prefetch could use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .profiling import busy, device_intervals, gaps, union


def where_time_goes(step: Callable[[], None], device: torch.device) -> dict[str, float] | None:
    """One call of `step` profiled; None off CUDA (no device timeline). Milliseconds."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return split_timeline(prof.events())


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
