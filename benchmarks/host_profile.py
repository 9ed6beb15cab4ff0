"""`--host-profile N`: after a row's timed iterations (`--shape flux`, `--shape qwen3-30b-a3b` and
the other MoE shapes), one more under cProfile, read as where the host's Python time went.

# Note [a row's host profile]
`--profile` tells whether a row waited on the host and in which CUDA runtime calls the host
spent its time; when those calls are a small part of it (a streamed row whose host forward is
far above the resident model's while its launches and copies cost as much), what is left is
Python: offtensor's hooks, the model's own code, a Triton launcher, the caching allocator's
Python side. One iteration under cProfile names it: the functions with the most time of their
own (builtins included: a `synchronize` or `query` there is the host waiting for the device),
and offtensor's entry points by time including what they call. cProfile slows Python code,
not the kernels it launches, so its times read as shares of the step, not as the step's time;
the step's own wall and thread time are measured without it, on the iteration before.
Runs on the CPU too (the CI's quick runs), where the kernels are the host's own time.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

from .measure import sync


def python_profile(step: Callable[[], None], device: torch.device, top: int) -> dict[str, Any]:
    """One call of `step` timed (wall and thread time, ms), then one under cProfile: the `top`
    functions by own time and offtensor's `top` by cumulative time, each
    {"function", "calls", "own_ms", "cumulative_ms"}."""
    sync(device)
    wall, thread = time.perf_counter(), time.thread_time()
    step()
    host_wall, host_thread = time.perf_counter() - wall, time.thread_time() - thread
    sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        step()
        sync(device)
    finally:
        profiler.disable()
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    entries: list[dict[str, Any]] = [
        {"function": _label(key), "calls": calls, "own_ms": own * 1e3, "cumulative_ms": cumulative * 1e3}
        for key, (_, calls, own, cumulative, _) in stats.items()]
    total = sum(e["own_ms"] for e in entries)
    ours = [e for e in entries if e["function"].startswith("offtensor/")]
    return {"host_wall_ms": host_wall * 1e3, "host_thread_ms": host_thread * 1e3, "profiled_ms": total,
            "own": sorted(entries, key=lambda e: -e["own_ms"])[:top],
            "offtensor": sorted(ours, key=lambda e: -e["cumulative_ms"])[:top]}


def _label(key: tuple[str, int, str]) -> str:
    """`package/file.py:line(function)` from site-packages or this checkout, or `{builtin}`."""
    path, line, name = key
    if path == "~":
        return name  # a builtin: "<built-in method torch._C._nn.linear>", "<method 'copy_' ...>"
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        parts = path.replace("\\", "/").split("/")
        tops = [i for i, p in enumerate(parts) if p in ("offtensor", "benchmarks")]
        path = "/".join(parts[tops[-1]:]) if tops else parts[-1]
    return f"{path}:{line}({name})"


def describe_python(profile: dict[str, Any], top: int = 12) -> list[str]:
    """Lines for the row's printout: the step's host time, then the two lists."""
    lines = [f"host profile: step {profile['host_wall_ms']:.1f} ms on the host ({profile['host_thread_ms']:.1f} ms "
             f"thread time), {profile['profiled_ms']:.1f} ms under cProfile; by own time:"]
    lines += [f"  {e['own_ms']:8.2f} ms {e['calls']:6d}x {e['function']}" for e in profile["own"][:top]]
    lines.append("offtensor, by time including what it calls:")
    lines += [f"  {e['cumulative_ms']:8.2f} ms {e['calls']:6d}x {e['function']}" for e in profile["offtensor"][:top]]
    return lines
