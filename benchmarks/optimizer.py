"""The CPU optimizer on its own: the optimizer term of the step rooflines, the wrapped-vs-plain
AdamW microbenchmark, and the overlapped step measured in turn with the plain one."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .measure import free_memory, short_error, timed

ADAMW_LR = 1e-5
OPTIMIZER_SPEED_TARGET = 0.95  # fused AdamW on offloaded params >= 0.95x plain CPU tensors


@dataclass(frozen=True)
class WorkerSettings:
    """The optimizer worker's tuning knobs, passed to `offtensor.backward_and_step`; the defaults
    are the ones its docstring documents."""

    spare_threads: int = 1
    piece_bytes: int = 64 * 2**20
    device_share: float = 0.0
    max_grad_norm: float | None = None  # clip inside the step (Trainer's default is 1.0)


def make_adamw(params: list[torch.Tensor]) -> tuple[list[torch.optim.Optimizer], str]:
    """`torch.optim.AdamW(params, lr=1e-5, fused=True)`: one optimizer when torch accepts
    parameters on several devices in it (its fused step groups tensors by device and dtype),
    else one per device type, the CPU one first."""
    devices = sorted({p.device.type for p in params}, key=lambda d: d != "cpu")
    try:
        return [torch.optim.AdamW(params, lr=ADAMW_LR, fused=True)], \
            f"one fused AdamW over {'+'.join(devices)} parameters"
    except (RuntimeError, ValueError) as exc:
        if len(devices) < 2:
            raise
        why = short_error(exc)
    opts: list[torch.optim.Optimizer] = [
        torch.optim.AdamW([p for p in params if p.device.type == d], lr=ADAMW_LR, fused=True)
        for d in devices]
    return opts, f"one fused AdamW per device ({', '.join(devices)}); one over all refused: {why}"


def fill_from_pool(t: torch.Tensor, pool: torch.Tensor, offset: int) -> None:
    """Fill `t` with values from `pool` (random normals), cyclically: random data at memcpy
    speed. The AdamW kernel's speed does not depend on the values (none are denormal)."""
    flat, n, k = t.view(-1), t.numel(), pool.numel()
    pos = 0
    while pos < n:
        start = (offset + pos) % k
        m = min(n - pos, k - start)
        flat[pos:pos + m].copy_(pool[start:start + m])
        pos += m


def random_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(1 << 22, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)


def plain_like(params: Sequence[torch.Tensor], pool: torch.Tensor) -> list[torch.Tensor]:
    """Plain CPU tensors of the same shapes and dtype as `params`, random values and grads."""
    plain, offset = [], 0
    for p in params:
        t = torch.empty(p.shape, dtype=p.dtype)
        fill_from_pool(t, pool, offset)
        t.grad = torch.empty_like(t)
        fill_from_pool(t.grad, pool, offset + 7919)
        offset += p.numel()
        plain.append(t)
    return plain


def timed_steps(optimizers: list[torch.optim.Optimizer], reps: int) -> list[list[float]]:
    """One warm-up step of each optimizer (allocates its state), then `reps` rounds stepping
    each in turn (interleaved, so that both see the same machine; every other round in reverse
    order, so that neither always runs after the other). Seconds per step."""
    for opt in optimizers:
        opt.step()
    out: list[list[float]] = [[] for _ in optimizers]
    for r in range(reps):
        order = list(enumerate(optimizers))
        for i, opt in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            opt.step()
            out[i].append(time.perf_counter() - t0)
    return out


def _gparams(numel: int, seconds: float) -> float:
    return numel / seconds / 1e9


def plain_adamw_step(params: Sequence[torch.Tensor], seed: int) -> Callable[[], float]:
    """A fused AdamW over plain CPU tensors shaped as `params`, with random grads, its state
    allocated by one untimed step; returns a function that runs one more step and gives its
    milliseconds."""
    plain = plain_like(params, random_pool(params[0].dtype, seed))
    opt = torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)
    opt.step()

    def step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return (time.perf_counter() - t0) * 1e3

    return step


def measure_plain_adamw(params: Sequence[torch.Tensor], seed: int, reps: int = 5, *,
                        device: torch.device | None = None, pcie_bytes: tuple[int, int] | None = None,
                        worker: WorkerSettings | None = None) -> dict[str, Any]:
    """The optimizer term of the step rooflines: fused `torch.optim.AdamW` on plain CPU tensors
    of the shapes and dtype of `params` (the wrapped parameters), with random grads; one
    warm-up step, median of `reps`. On CUDA with `pcie_bytes` (a step's host-to-device and
    device-to-host bytes), also the same step beside those copies: see `adamw_beside_copies`."""
    dtype = params[0].dtype
    plain = plain_like(params, random_pool(dtype, seed))
    numel = sum(p.numel() for p in plain)
    opt = torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)
    (times,) = timed_steps([opt], reps)
    median = statistics.median(times)
    out = {"dtype": str(dtype).removeprefix("torch."), "params": numel, "tensors": len(plain),
           "warmup": 1, "reps": reps, "times_ms": [t * 1e3 for t in times],
           "median_ms": median * 1e3, "gparams_per_s": _gparams(numel, median),
           "threads": torch.get_num_threads()}
    if device is not None and device.type == "cuda" and pcie_bytes is not None:
        try:
            out["beside_copies"] = adamw_beside_copies(opt, device, *pcie_bytes, reps=reps,
                                                       spare_threads=(worker or WorkerSettings()).spare_threads)
        except Exception as exc:  # noqa: BLE001 - reported; the time alone stands
            out["beside_copies"] = {"error": short_error(exc)}
    return out


def adamw_beside_copies(opt: torch.optim.Optimizer, device: torch.device, h2d_bytes: int, d2h_bytes: int,
                        reps: int, spare_threads: int, piece: int = 256 * 2**20, free: bool = True) -> dict[str, Any]:
    """The optimizer step while pinned copies of one training step's PCIe traffic run, both
    directions on their own streams, enqueued just before the step, with the thread count of
    `backward_and_step`'s worker. The copy engines read and write host memory, and a CPU
    AdamW is bound by host memory bandwidth: this is the optimizer term of an overlapped step
    on this host, which no scheduling can beat (`host-contention` measures more)."""
    host_in = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(piece, dtype=torch.uint8, device=device)
    dev_out = torch.empty(piece, dtype=torch.uint8, device=device)
    s_in, s_out = torch.cuda.Stream(device), torch.cuda.Stream(device)
    old_threads = torch.get_num_threads()
    threads = max(1, old_threads - spare_threads)
    torch.set_num_threads(threads)
    times = []
    try:
        for _ in range(reps):
            torch.cuda.synchronize(device)
            with torch.cuda.stream(s_in):
                for _ in range(-(-h2d_bytes // piece)):
                    dev_in.copy_(host_in, non_blocking=True)
            with torch.cuda.stream(s_out):
                for _ in range(-(-d2h_bytes // piece)):
                    host_out.copy_(dev_out, non_blocking=True)
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            torch.cuda.synchronize(device)
    finally:
        torch.set_num_threads(old_threads)
        try:
            torch.cuda.synchronize(device)  # no copy may still use the buffers freed below
        finally:
            del host_in, host_out, dev_in, dev_out
    if free:
        free_memory(device)  # pinned blocks back to the OS: not counted in this peer's host memory
    return {"threads": threads, "h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes,
            "times_ms": [t * 1e3 for t in times], "median_ms": statistics.median(times) * 1e3}


def measure_same_time(step: Callable[[WorkerSettings], None], drain: Callable[[], None],
                      params: Sequence[torch.Tensor], seed: int, device: torch.device,
                      pcie_bytes: tuple[int, int], variants: Sequence[WorkerSettings],
                      rounds: int = 3, steps: int = 3, reports: list | None = None) -> dict[str, Any]:
    """The overlapped step and the plain optimizer step measured in turn, minutes not apart.

    The CPU AdamW step on the benchmark's host drifts by 20-30 % between minutes (other
    tenants' memory traffic), so a ratio of two measurements taken in different peers swings
    with it. Each of `rounds` rounds runs, for each worker setting in `variants`, one untimed
    overlapped training step (`step(settings)`), then `steps` timed ones, then waits for the
    last one's deferred steps (`drain`, untimed); then the plain fused AdamW on plain CPU
    tensors shaped as `params`, alone (every thread) and, on CUDA, beside one step's PCIe
    copies, on the first setting's spared thread count and on every thread (the worker takes
    every thread while the next forward waits for it: Note [worker threads] in optim/worker.py).
    Medians over the rounds.

    What a round times is the steady-state period of an overlapped training loop, as the main
    timing's median does: each step's deferred steps finish in the next step's forward
    (Note [deferred steps]), so a step's time from its start to its return is the period once
    the step before it has left work behind. The untimed first step is the one that found none
    (its forward waited for nothing), and the drain is the next step's wait. Timing those two
    as well would add one pipeline fill per `steps` steps, where a training loop pays it once.
    `reports` (the OverlapReports the steps append to) gives each round's worker busy time
    beside it."""
    plain = plain_like(params, random_pool(params[0].dtype, seed))
    opt = torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)
    opt.step()  # allocates the state
    per_variant: list[list[float]] = [[] for _ in variants]
    busy: list[list[float]] = [[] for _ in variants]
    alone: list[float] = []
    beside: list[float] = []
    beside_all: list[float] = []
    beside_threads = beside_all_threads = None
    for _ in range(rounds):
        for i, settings in enumerate(variants):
            step(settings)  # fills the pipeline: the timed steps each find the last one's deferred work
            first = len(reports) if reports is not None else 0
            total = sum(timed(device, functools.partial(step, settings)) for _ in range(steps))
            drain()
            per_variant[i].append(total / steps * 1e3)
            if reports is not None and len(reports) > first:
                busy[i].append(statistics.median(r.worker_busy_s for r in reports[first:]) * 1e3)
        alone.append(timed(device, opt.step) * 1e3)
        if device.type == "cuda":
            m = adamw_beside_copies(opt, device, *pcie_bytes, reps=1, free=False,
                                    spare_threads=variants[0].spare_threads)
            beside += m["times_ms"]
            beside_threads = m["threads"]
            if variants[0].spare_threads:
                m = adamw_beside_copies(opt, device, *pcie_bytes, reps=1, free=False, spare_threads=0)
                beside_all += m["times_ms"]
                beside_all_threads = m["threads"]
    return {"rounds": rounds, "steps": steps, "warmup_steps": 1,
            "variants": [{"spare_threads": v.spare_threads, "piece_mib": v.piece_bytes / 2**20,
                          "device_share": v.device_share, "max_grad_norm": v.max_grad_norm,
                          "times_ms": times, "median_ms": statistics.median(times),
                          "worker_busy_ms": b, "worker_busy_median_ms": statistics.median(b) if b else None}
                         for v, times, b in zip(variants, per_variant, busy, strict=True)],
            "alone_ms": alone, "alone_median_ms": statistics.median(alone),
            "beside_ms": beside, "beside_median_ms": statistics.median(beside) if beside else None,
            "beside_threads": beside_threads,
            "beside_all_ms": beside_all, "beside_all_median_ms": statistics.median(beside_all) if beside_all else None,
            "beside_all_threads": beside_all_threads}


def _random_grads(params: Sequence[torch.Tensor], pool: torch.Tensor) -> None:
    offset = 0
    for p in params:
        g = torch.empty(p.shape, dtype=p.dtype)
        fill_from_pool(g, pool, offset + 7919)
        offset += p.numel()
        p.grad = g


def measure_optimizer_speed(layers: nn.ModuleList, seed: int, reps: int = 9) -> dict[str, Any]:
    """Fused AdamW on the wrapped model's offloaded parameters (random host .grad set on each)
    against the same step on plain CPU tensors of identical shapes and dtypes: what the
    parameter subclass costs the optimizer. One warm-up step each, then `reps` rounds of one
    step of each (timed_steps); the ratio is the median of the rounds' ratios, since the host's
    speed drifts between rounds by more than the difference measured. The wrapped weights
    change by a few lr-sized steps; the grads are set back to None afterwards."""
    params = [p for p in layers.parameters() if p.requires_grad and p.device.type == "cpu"]
    if not params:
        raise RuntimeError("no trainable CPU parameters in the decoder layers")
    dtype = params[0].dtype
    pool = random_pool(dtype, seed)
    _random_grads(params, pool)
    plain = plain_like(params, pool)
    numel = sum(p.numel() for p in params)
    try:
        wrapped_t, plain_t = timed_steps([torch.optim.AdamW(params, lr=ADAMW_LR, fused=True),
                                          torch.optim.AdamW(plain, lr=ADAMW_LR, fused=True)], reps)
    finally:
        for p in params:
            p.grad = None
    wrapped_s, plain_s = statistics.median(wrapped_t), statistics.median(plain_t)
    # wrapped G params/s over plain G params/s, paired round by round
    ratio = statistics.median(p / w for p, w in zip(plain_t, wrapped_t, strict=True))
    return {"dtype": str(dtype).removeprefix("torch."), "params": numel, "tensors": len(params),
            "warmup": 1, "reps": reps, "threads": torch.get_num_threads(),
            "wrapped_times_ms": [t * 1e3 for t in wrapped_t], "plain_times_ms": [t * 1e3 for t in plain_t],
            "wrapped_ms": wrapped_s * 1e3, "plain_ms": plain_s * 1e3,
            "wrapped_gparams_per_s": _gparams(numel, wrapped_s),
            "plain_gparams_per_s": _gparams(numel, plain_s),
            "ratio": ratio, "target": OPTIMIZER_SPEED_TARGET, "meets_target": ratio >= OPTIMIZER_SPEED_TARGET}


def format_optimizer_speed(name: str, speed: dict[str, Any]) -> str:
    """measure_optimizer_speed's result in one line, with its verdict against the target."""
    if "error" in speed:
        return f"{name}: {speed['error']}"
    verdict = "PASS" if speed["ratio"] >= speed["target"] else "FAIL"
    return (f"{name}: fused AdamW {speed['dtype']}, {speed['params'] / 1e6:,.1f} M params: offloaded params "
            f"{speed['wrapped_gparams_per_s']:.3g} G params/s vs plain CPU tensors "
            f"{speed['plain_gparams_per_s']:.3g} G params/s: ratio {speed['ratio']:.3f}, "
            f"target >= {speed['target']}: {verdict}")
