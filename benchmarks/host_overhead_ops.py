"""`host-overhead`'s scaling and per-op sections (see host_overhead.py).

Scaling: the kept training step's ratio to the plain model's as the number of scopes grows
(Llama with more layers): a host cost per scope independent of the number of scopes keeps it flat.

Per op: one small block (a square matrix and `k` F.linear ops on it) wrapped with every scope kept,
against the same block plain: F.linear on the parameter outside any call; the block's call with
one op (and its Python calls); an op inside the kept scope's call ((time with K ops - time with
one) / (K - 1)), with autograd on, under no_grad and under inference_mode; and metadata on the
offloaded parameter against nn.Parameter's (shape, dtype, device, numel(), requires_grad,
reading .grad, setting it to None). Each measured in turn with its plain twin, medians over rounds.
Then a block of CHAIN small Linear layers (2 * CHAIN parameters, one kept scope) called
with its caches warm and called after EVICT_MIB were written (Note [cold calls]).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

import offtensor

from .host_overhead import KEEP_ALL, MODES, Memcpy, llama, python_calls, run_row, setup

K_OPS = 9  # ops in the block's call when an op's own cost is measured
CHAIN = 10  # Linear layers of the block whose call is timed warm and cold
EVICT_MIB = 16  # written between two cold calls: more than this host's caches hold

# Note [cold calls]
# On the CPU the model's compute runs on the host's own cores: between two calls of a scope its
# matrices and activations pass through the caches and evict what the scope's hooks touch
# (each parameter's slot, master, device copy and version counter, the modules' dicts). Each of
# those reads then waits for memory, and a scope's call costs more than its Python calls alone
# would, as the plain model's own Python does. On a GPU the kernels run on the device and leave
# the host's caches to the host's Python. So the per-op section times a scope's call both ways:
# warm (calls in a row) and cold (EVICT_MIB written before each, outside the timing): the
# difference is what cold caches add to a call, which the model rows on the CPU pay.


@dataclass
class Scaling:
    scopes: int
    plain_ms: float
    ratio: float | None  # kept training step over plain, median of per-round ratios
    calls_plain: int | None
    calls_kept: int | None
    check: str
    error: str | None


def scaling(args: argparse.Namespace, device: torch.device) -> list[Scaling]:
    """The kept training step at each scope count of `args.scaling` (Llama layers)."""
    hidden, tokens = (64, 8) if args.quick else (256, 16)
    train = next(m for m in MODES if m.train)
    out = []
    for n in args.scaling:
        w = llama(n, hidden, tokens, name=f"Llama {n} layers")
        base = w.build().eval()
        models = {p: setup(p, base, w, device)[0] for p in ("plain", "kept")}
        row = run_row(w, train, models, None, Memcpy(w, base, device), device, args)
        plain, kept = row.cells["plain"], row.cells["kept"]
        out.append(Scaling(n, statistics.median(plain.seconds) * 1e3 if plain.seconds else float("nan"),
                           kept.ratio, plain.calls, kept.calls, kept.check, kept.error))
        print(f"  scaling, {n} scopes: kept train {kept.ratio}", flush=True)
    return out


def scaling_table(rows: list[Scaling]) -> list[str]:
    lines = ["| kept training step, Llama | plain ms | x plain | Python calls per step (plain / kept) "
             "| extra calls per scope | check |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for s in rows:
        ratio = f"error: {s.error}" if s.error else f"{s.ratio:.2f}" if s.ratio is not None else "-"
        extra = (s.calls_kept - s.calls_plain) / s.scopes if s.calls_kept and s.calls_plain else None
        lines.append(f"| {s.scopes} scopes | {s.plain_ms:.2f} | {ratio} | {s.calls_plain} / {s.calls_kept} | "
                     f"{'-' if extra is None else f'{extra:.0f}'} | {s.check} |")
    if len(rows) >= 2 and rows[0].ratio and rows[-1].ratio:
        lines.append(f"| {rows[-1].scopes} over {rows[0].scopes} scopes | | {rows[-1].ratio / rows[0].ratio:.2f} "
                     "| | | |")
    return lines


# ---- per op -------------------------------------------------------------------------------------


class Ops(nn.Module):
    """`k` F.linear ops on one square matrix."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n) / n**0.5)
        self.k = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.k):
            x = F.linear(x, self.weight)
        return x


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Ops(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)  # type: ignore[no-any-return]


class Chain(nn.Module):
    """CHAIN Linear layers of `n` features: a scope of 2 * CHAIN parameters."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(*[nn.Linear(n, n) for _ in range(CHAIN)])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)  # type: ignore[no-any-return]


def _chain_calls(chain: Chain, x: torch.Tensor, number: int, evict: torch.Tensor | None) -> Probe:
    """The chain block's call, with autograd on; `evict`: written before each call, untimed."""
    block = chain.blocks[0]

    def run() -> float:
        total = 0.0
        for _ in range(number):
            if evict is not None:
                evict.add_(1)
            start = time.thread_time()
            block(x)
            total += time.thread_time() - start
        return total / number

    return run


@dataclass
class PerOp:
    what: str
    plain_us: float
    offtensor_us: float
    ratio: float  # median of per-round ratios
    calls_plain: int | None = None
    calls_offtensor: int | None = None


Probe = Callable[[], float]  # seconds per op, one round


def _stmt(stmt: str, env: dict[str, Any], number: int) -> Probe:
    timer = timeit.Timer(stmt, globals=env, timer=time.thread_time)
    return lambda: timer.timeit(number) / number


def _in_call(block: Ops, x: torch.Tensor, context: Callable[[], Any], number: int) -> Probe:
    """An op's own cost inside the block's call: (K ops - one op) / (K - 1)."""
    def call(k: int) -> float:
        block.k = k
        with context():
            start = time.thread_time()
            for _ in range(number):
                block(x)
            return (time.thread_time() - start) / number

    return lambda: (call(K_OPS) - call(1)) / (K_OPS - 1)


def _with_grad(stack: Stack, x: torch.Tensor, probe: Probe) -> Probe:
    """`probe` with the block's weight holding a grad (one backward first, when it has none)."""
    block = cast(Ops, stack.blocks[0])

    def run() -> float:
        if block.weight.grad is None:
            block.k = 1
            stack(x).sum().backward()
        return probe()

    return run


def _probes(stack: Stack, x: torch.Tensor, number: int) -> dict[str, Probe]:
    block: Ops = stack.blocks[0]  # type: ignore[assignment]
    p = block.weight
    env = {"F": F, "x": x, "p": p, "block": block}
    probes = {"F.linear(x, p), outside any call": _stmt("F.linear(x, p)", env, number),
              "the scope's call, one op": _in_call_one(block, x, number)}
    for mode in MODES:
        if not mode.train:
            probes[f"an op in the scope's call, {mode.name}"] = _in_call(block, x, mode.context, number)
    for attr in ("p.shape", "p.dtype", "p.device", "p.numel()", "p.requires_grad"):
        probes[attr] = _stmt(attr, env, number * 10)
    probes["p.grad (set)"] = _with_grad(stack, x, _stmt("p.grad", env, number * 10))
    probes["p.grad = None"] = _stmt("p.grad = None", env, number * 10)
    return probes


def _in_call_one(block: Ops, x: torch.Tensor, number: int) -> Probe:
    def run() -> float:
        block.k = 1
        start = time.thread_time()
        for _ in range(number):
            block(x)
        return (time.thread_time() - start) / number

    return run


def per_op(args: argparse.Namespace, device: torch.device) -> list[PerOp]:
    """Each probe on the kept block and on the plain one, in turn, `args.rounds` times."""
    n, number = (16, 50) if args.quick else (64, 1000)
    torch.manual_seed(0)
    plain = Stack(n).to(device)
    kept = copy.deepcopy(plain)
    offtensor.wrap(kept, device=device, policy=offtensor.Policy(vram_budget=KEEP_ALL))
    kept.to(device)
    x = torch.randn(4, n, device=device)
    for model in (plain, kept):
        model(x).sum().backward()  # the first pass (offtensor learns the order), grads exist
    if not isinstance(kept.blocks[0].weight, offtensor.OffloadedParameter):
        raise AssertionError("bench host-overhead: the kept block's weight is not offloaded")
    probes = (_probes(plain, x, number), _probes(kept, x, number))
    evict = torch.zeros(EVICT_MIB * 2**18)  # float32
    chains = (Chain(n), Chain(n))
    chains[1].load_state_dict(chains[0].state_dict())
    offtensor.wrap(chains[1], device=device, policy=offtensor.Policy(vram_budget=KEEP_ALL))
    for chain, found in zip(chains, probes, strict=True):
        chain.to(device)
        chain(x)  # the first pass (offtensor learns the order)
        found[f"a call of {2 * CHAIN} parameters, warm"] = _chain_calls(chain, x, number // 10, None)
        found[f"a call of {2 * CHAIN} parameters, cold"] = _chain_calls(chain, x, number // 10, evict)
    out = []
    for what in probes[0]:
        ratios: list[float] = []
        seconds: tuple[list[float], list[float]] = ([], [])
        for r in range(args.rounds):
            if r % 2:
                b, a = probes[1][what](), probes[0][what]()
            else:
                a, b = probes[0][what](), probes[1][what]()
            seconds[0].append(a)
            seconds[1].append(b)
            ratios.append(b / a if a > 0 else float("nan"))
        out.append(PerOp(what, statistics.median(seconds[0]) * 1e6, statistics.median(seconds[1]) * 1e6,
                         statistics.median(ratios)))
    call = next(o for o in out if o.what == "the scope's call, one op")
    for model in (plain, kept):
        cast(Ops, model.blocks[0]).k = 1
    call.calls_plain = python_calls(lambda: plain.blocks[0](x))
    call.calls_offtensor = python_calls(lambda: kept.blocks[0](x))
    return out


def per_op_table(rows: list[PerOp]) -> list[str]:
    lines = ["| per op (kept scope) | nn.Parameter us | OffloadedParameter us | x plain | Python calls |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for o in rows:
        calls = f"{o.calls_plain} / {o.calls_offtensor}" if o.calls_plain is not None else ""
        lines.append(f"| {o.what} | {o.plain_us:.2f} | {o.offtensor_us:.2f} | {o.ratio:.2f} | {calls} |")
    return lines
