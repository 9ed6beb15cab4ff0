"""Timing and memory helpers shared by every measurement: device syncs, wall time, host RSS,
freeing memory between peers, and the pinned-copy bandwidth the rooflines divide by."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

GiB = 2**30


@contextlib.contextmanager
def temporarily(get: Callable[[], Any], set_: Callable[[Any], None], value: Any) -> Any:
    """`set_(value)` for the block, then back to what `get()` returned (torch's default dtype,
    its intra-op thread count)."""
    old = get()
    set_(value)
    try:
        yield
    finally:
        set_(old)


# mallopt's parameters (glibc's malloc.h) and glibc's defaults for them
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
_MALLOC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 128 * 1024}


@contextlib.contextmanager
def freed_memory_kept() -> Any:
    """Within the block glibc keeps freed blocks under 32 MiB for the next allocation, as CUDA's
    caching allocator keeps device memory (Note [page faults] in host_overhead.py): no block under
    that size is mmap'd, and the heap is not trimmed. Yields how, in words, or why not. After it,
    glibc's default sizes, without the dynamic threshold that an explicit value ends."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        yield "freed memory: the platform's allocator (no glibc mallopt)"
        return
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        yield "freed memory: glibc's defaults (mallopt refused)"
        return
    try:
        yield "freed blocks under 32 MiB kept for reuse (glibc mallopt)"
    finally:
        for param, value in _MALLOC_DEFAULTS.items():
            mallopt(param, value)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], None]) -> float:
    """Seconds `fn` takes, its device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def host_rss() -> int | None:
    """Resident set size of this process in bytes (psutil, else /proc/self/status)."""
    try:
        import psutil  # optional, imported only here

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's record of this process's peak RSS (VmHWM), so that `peak_rss` reads
    the peak from now on; False where the kernel does not allow it (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int | None:
    """The peak resident set size of this process (VmHWM) in bytes, since it started or since
    `reset_peak_rss`; None where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what this process could still allocate without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PhaseClock:
    """The phases of one timed iteration (forward, backward, step), without a host sync inside
    it: CUDA events recorded on the current stream (the device's timeline: a phase's waits for
    its copies count), read by `collect` after the iteration's sync; perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []
        self._host: list[tuple[str, float]] = []  # (phase, ms) of host-side times, this iteration
        self.samples: dict[str, list[float]] = {}  # phase -> ms per micro-batch, per iteration

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """The iteration starts; marks not collected (a warm-up iteration) are dropped."""
        self._marks, self._host = [("", self._now())], []

    def mark(self, phase: str) -> None:
        """`phase` ends now (it began at the previous mark)."""
        if self._marks:
            self._marks.append((phase, self._now()))

    def collect(self, per_step: int = 1) -> None:
        """Add the iteration's phases (summed over its micro-batches, divided by `per_step`)."""
        sums: dict[str, float] = {}
        for (_, a), (phase, b) in zip(self._marks, self._marks[1:], strict=False):
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            sums[phase] = sums.get(phase, 0.0) + ms
        for phase, ms in self._host:
            sums[phase] = sums.get(phase, 0.0) + ms
        for phase, ms in sums.items():
            self.samples.setdefault(phase, []).append(ms / per_step)
        self._marks, self._host = [], []

    def host(self, phase: str, seconds: float) -> None:
        """A host-side time of this iteration (no sync: how long the Python call took to return),
        kept beside the phases under `phase`."""
        self._host.append((phase, seconds * 1e3))

    def clear(self) -> None:
        self._marks, self._host, self.samples = [], [], {}

    def medians(self) -> dict[str, float] | None:
        return {p: statistics.median(v) for p, v in self.samples.items()} or None


def host_pss() -> tuple[int, str] | None:
    """(bytes, 'pss') of this process's proportional set size, where a page shared by k
    processes counts 1/k in each (so a node's sum counts a shared host copy once); else
    (bytes, 'rss') of its resident set size; None when neither can be read."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024, "pss"
    except OSError:
        pass
    rss = host_rss()
    return None if rss is None else (rss, "rss")


def node_used_bytes() -> int | None:
    """Memory in use on this machine (MemTotal - MemAvailable in /proc/meminfo): counts what a
    process's PSS may not, such as page-locked buffers a driver maps, but every process's too."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return fields["MemTotal"] - fields["MemAvailable"]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # cuBLAS keeps a workspace per handle and stream in allocated memory; it outlives the
        # peer that made it and would count in the next peer's peak memory.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        # Pinned blocks freed by tensors stay cached by PyTorch's host allocator; give them back
        # so the next peer's host-memory baseline is clean. The name moved between releases.
        for fn in (getattr(torch.accelerator, "empty_host_cache", None),
                   getattr(torch._C, "_host_emptyCache", None)):
            if fn is not None:
                with contextlib.suppress(Exception):
                    fn()
                break


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def setup_failed(rows: list[Any], peer: str, exc: BaseException) -> None:
    """A peer could not be set up: each of its rows is an error row saying why."""
    for r in rows:
        r.status, r.note = "error", f"setup failed: {short_error(exc)}"
    print(f"  {peer}: setup failed: {short_error(exc)}", flush=True)


def version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except Exception:  # noqa: BLE001 - a broken install is reported as missing
        return None
    return str(getattr(module, "__version__", "unknown"))


def _cuda_copy_seconds(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Median seconds of one pinned copy, CUDA events around each; two warm-up copies."""
    samples = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def _cuda_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, Any]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"method": "pinned, CUDA events",
                           "h2d": nbytes / _cuda_copy_seconds(dev, host, reps),
                           "d2h": nbytes / _cuda_copy_seconds(host, dev, reps)}
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    samples = []
    for i in range(reps + 2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
        torch.cuda.synchronize(device)
        if i >= 2:
            samples.append(time.perf_counter() - t0)
    out["bidirectional_total"] = 2 * nbytes / statistics.median(samples)
    del host, host2, dev, dev2
    free_memory(device)
    return out


def measure_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> dict[str, Any]:
    """Pinned host<->device copy bandwidth in bytes/s, median of `reps` timed copies.

    On CUDA: one large pinned buffer, CUDA events around each copy, plus both directions at
    once on two streams (for reference; the roofline uses the one-way numbers). On the CPU, the
    "transfer" offtensor does is a memcpy between two host buffers, timed with perf_counter.
    """
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps}
    if device.type == "cuda":
        return {**out, **_cuda_bandwidth(device, nbytes, reps)}
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    samples = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i >= 1:
            samples.append(time.perf_counter() - t0)
    rate = nbytes / statistics.median(samples)
    return {**out, "method": "host memcpy, perf_counter", "h2d": rate, "d2h": rate,
            "bidirectional_total": None}
