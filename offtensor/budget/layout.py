"""The VRAM budget's layout from measured times: which scopes to keep resident so that the
copies of the streamed ones hide behind compute (Note [a timed layout]).

# Note [a timed layout]
Keeping scopes by bytes (spread evenly) is right only when every scope computes about as long as
it copies. A diffusion transformer's double-stream blocks copy far longer than they compute (their
modulation matrices act on one token), its single-stream ones less so: a byte layout saturates the
link through one half and idles it through the other. So under `Policy(layout="timed")` the
second pass is measured (each scope's compute between compute-stream events after its whole copy;
the bandwidth by one timed copy), and when the third starts `choose` keeps the set whose simulated
step is shortest: the best of a greedy by gain per byte and of just-in-time walks (keep a scope
only where its copy would land late) over several rooms, each leaving streaming's room (2 +
`prefetch` of the largest streamed block). What the budget does not keep is the streaming room.
`simulate` replays a pass as the engine runs it: copies in order on one link, each waiting for
room freed by a streamed scope's end, each scope computing once its copy has landed.
`vram_budget="auto"` sizes the budget at the same point from the memory the measured step left
unused at its peak, less a margin.
Under `Policy(host_budget)` a scope whose masters are in files copies no faster than the drive
reads it into the staging ring: its copy costs its bytes at the slower of the link and the
drive's time per byte over the measured pass's reads (`StagingRing.read_stats`), so the layout
keeps file scopes first, each read once and then resident; the link is timed from a ring slot
when the largest scope is staged (Note [staged loads] in storage/staging.py).
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Of the device memory a measured step left unused at its peak, what "auto" leaves free: the
# allocator's fragmentation and what the later steps allocate that the measured one did not.
AUTO_MARGIN_FRACTION = 0.05
AUTO_MARGIN_MIN = 512 * 2**20
TIE = 0.005  # predicted steps this close are equally fast (choose)


@dataclass
class ScopeCost:
    """What a scope costs a pass: its compute (ms, forward and backward), its copy (ms) and
    the device bytes it holds while loaded."""

    forward_ms: float
    backward_ms: float
    copy_ms: float
    device_bytes: int
    block: str
    copied_when_kept: bool = False  # a trainable kept scope: its step writes the masters, reloaded each step


@dataclass(frozen=True)
class Prediction:
    forward_ms: float
    backward_ms: float

    @property
    def step_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _pass(seq: Sequence[int], costs: Sequence[ScopeCost], kept: set[int], room: int, *, backward: bool,
          resident: set[int], release_at_end: set[int]) -> float:
    """The simulated length of one pass (ms) over `seq`: one link copying in order, each copy
    of a streamed scope waiting until the room holds it; `resident` scopes start loaded. A kept
    scope copies only in a forward, and only when its step rewrites it (`copied_when_kept`)."""
    link = clock = 0.0
    held = sum(costs[i].device_bytes for i in resident if i not in kept)  # room bytes loaded, not released
    released: collections.deque[tuple[float, int]] = collections.deque()  # (time, bytes), released after `link`
    ready: dict[int, float] = {}
    queue = [i for i in seq if i not in resident
             and (i not in kept or (costs[i].copied_when_kept and not backward))]
    pending = set(queue)
    q = 0
    for i in seq:
        while i in pending:  # the copies up to this scope's, in order
            j = queue[q]
            q += 1
            pending.discard(j)
            start = link
            if j not in kept:
                need = costs[j].device_bytes
                later = sum(b for _, b in released)
                while released and held + later + need > room:
                    t, b = released.popleft()
                    later -= b
                    start = max(start, t)
                if held + later + need > room:  # nothing frees enough: it loads on demand
                    start = max(start, clock)
                held += need
            link = start + costs[j].copy_ms
            ready[j] = link
        cost = costs[i]
        clock = max(clock, ready.get(i, 0.0)) + (cost.backward_ms if backward else cost.forward_ms)
        if i not in kept and i in release_at_end:
            held -= cost.device_bytes
            released.append((clock, cost.device_bytes))
        while released and released[0][0] <= link:
            released.popleft()
    return clock


def simulate(costs: Sequence[ScopeCost], forward: Sequence[int], backward: Sequence[int], kept: set[int],
             room: int) -> Prediction:
    """One step: the forward, then (if `backward` is not empty) the backward, in steady state:
    the forward starts with what the backward left resident."""
    if not backward:
        fwd = _pass(forward, costs, kept, room, backward=False, resident=set(), release_at_end=set(forward))
        return Prediction(fwd, 0.0)
    last = forward[-1] if forward else None
    # What the backward leaves for the next forward: its head, streamed, within the room less one block.
    carried: set[int] = set()
    left = room - max((costs[i].device_bytes for i in forward if i not in kept), default=0)
    for i in forward:
        if i in kept:
            continue
        if costs[i].device_bytes > left:
            break
        carried.add(i)
        left -= costs[i].device_bytes
    fwd_release = set(forward) - {last}
    fwd = _pass(forward, costs, kept, room, backward=False, resident=carried, release_at_end=fwd_release)
    bwd = _pass(backward, costs, kept, room, backward=True, resident={last} if last is not None else set(),
                release_at_end=set(backward) - carried)
    return Prediction(fwd, bwd)


def min_room(costs: Sequence[ScopeCost], kept: set[int], prefetch: int) -> int:
    """What streaming needs: 2 + `prefetch` times the largest block's streamed bytes."""
    blocks: dict[str, int] = {}
    for i, c in enumerate(costs):
        if i not in kept:
            blocks[c.block] = blocks.get(c.block, 0) + c.device_bytes
    return (2 + prefetch) * max(blocks.values(), default=0)


def _room_holds(costs: Sequence[ScopeCost], kept: set[int], used: int, budget: int, prefetch: int) -> bool:
    return budget - used >= min_room(costs, kept, prefetch)


def _greedy(costs: Sequence[ScopeCost], forward: Sequence[int], backward: Sequence[int], budget: int,
            prefetch: int) -> set[int]:
    """From nothing kept, keep the scope that shortens the simulated step most per byte."""
    kept: set[int] = set()
    used = 0
    best = simulate(costs, forward, backward, kept, budget).step_ms
    candidates = sorted(set(forward) | set(backward))
    while True:
        pick, pick_score, pick_ms = None, None, 0.0
        for i in candidates:
            if i in kept:
                continue
            size = costs[i].device_bytes
            trial = kept | {i}
            if not _room_holds(costs, trial, used + size, budget, prefetch):
                continue
            ms = simulate(costs, forward, backward, trial, budget - used - size).step_ms
            ratio = costs[i].copy_ms / max(costs[i].forward_ms + costs[i].backward_ms, 1e-6)
            score = (round((best - ms) / max(size, 1) * 2**30, 3), ratio, -i)  # ms per GiB kept
            if pick_score is None or score > pick_score:
                pick, pick_score, pick_ms = i, score, ms
        if pick is None:
            return kept
        kept.add(pick)
        used += costs[pick].device_bytes
        best = pick_ms


def _just_in_time(costs: Sequence[ScopeCost], forward: Sequence[int], budget: int, room: int, prefetch: int,
                  slack: float) -> set[int]:
    """Walk the forward with the room fixed at `room`: stream a scope when its copy would land
    within `slack` ms of its compute's start (or nothing is left to keep it with), else keep it."""
    blocks: dict[str, int] = {}
    for c in costs:
        blocks[c.block] = blocks.get(c.block, 0) + c.device_bytes
    kept: set[int] = set()
    left = budget - room
    link = clock = 0.0
    held = 0
    released: collections.deque[tuple[float, int]] = collections.deque()
    for i in forward:
        c = costs[i]
        need = c.device_bytes
        start, trial, later = link, collections.deque(released), sum(b for _, b in released)
        while trial and held + later + need > room:
            t, b = trial.popleft()
            later -= b
            start = max(start, t)
        if held + later + need > room:
            start = max(start, clock)
        ready = start + c.copy_ms
        streams = (2 + prefetch) * blocks[c.block] <= room and (ready <= clock + slack or left < need)
        if streams:
            link, released = ready, trial
            clock = max(clock, ready) + c.forward_ms
            released.append((clock, need))
        else:
            kept.add(i)
            left -= need
            clock += c.forward_ms
        while released and released[0][0] <= link:
            released.popleft()
    return kept


def choose(costs: Sequence[ScopeCost], forward: Sequence[int], backward: Sequence[int], budget: int,
           prefetch: int) -> tuple[set[int], Prediction]:
    """The kept set for `budget` (Note [a timed layout]) and the step it predicts: the best by
    simulation of the greedy set and of just-in-time walks with several rooms and slacks."""
    sizes = sorted({c.device_bytes for c in costs if c.device_bytes})
    rooms = sorted({(2 + prefetch) * s for s in sizes} | {int(min_room(costs, set(), prefetch) * f / 4)
                                                            for f in range(1, 13)})
    mean_ms = sum(c.forward_ms for c in costs) / max(len(costs), 1)
    options = [_greedy(costs, forward, backward, budget, prefetch)]
    for room in rooms:
        if room <= budget:
            options += [_just_in_time(costs, forward, budget, room, prefetch, f * mean_ms) for f in (0, 0.25, 1)]
    scored = []
    for kept in options:
        used = sum(costs[i].device_bytes for i in kept)
        if used <= budget and _room_holds(costs, kept, used, budget, prefetch):
            scored.append((simulate(costs, forward, backward, kept, budget - used), used, kept))
    if not scored:
        return set(), simulate(costs, forward, backward, set(), budget)
    fastest = min(pred.step_ms for pred, _, _ in scored)
    # Within TIE of the fastest, the one that keeps most: fewer bytes over the link, less to
    # lose when the measured times were noisy.
    pred, _, kept = max((o for o in scored if o[0].step_ms <= fastest * (1 + TIE)), key=lambda o: o[1])
    return kept, pred


class Measuring(enum.Enum):
    """Where the timed layout is: waiting for a pass to measure, measuring it, measured."""

    WAITING = "waiting"
    MEASURING = "measuring"
    MEASURED = "measured"
    DONE = "done"


class PassTimer:
    """The compute of each scope in the measured pass, between events on the compute stream
    (host clocks on a CPU device, which computes synchronously)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.state = Measuring.WAITING
        self.saw_backward = False
        self._open: dict[tuple[object, str], object] = {}
        self.spans: dict[tuple[object, str], list[tuple[object, object]]] = {}

    def _now(self) -> object:
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def restart(self) -> None:
        self.state = Measuring.WAITING
        self.saw_backward = False
        self._open.clear()
        self.spans.clear()

    def start(self, scope: object, phase: str) -> None:
        """The scope's compute in `phase` starts (a recompute inside its backward is part of it)."""
        if self.state is Measuring.MEASURING and (scope, phase) not in self._open:
            self._open[(scope, phase)] = self._now()
            if phase == "backward":
                self.saw_backward = True

    def end(self, scope: object, phase: str) -> None:
        if self.state is not Measuring.MEASURING:
            return
        begun = self._open.pop((scope, phase), None)
        if begun is not None:
            self.spans.setdefault((scope, phase), []).append((begun, self._now()))

    def total_ms(self, scope: object, phase: str) -> float:
        """The scope's compute in `phase`, summed over its calls; 0 if it had none."""
        out = 0.0
        for a, b in self.spans.get((scope, phase), []):
            if self.is_cuda:
                b.synchronize()  # type: ignore[attr-defined]  # once, when the layout is chosen
                out += a.elapsed_time(b)  # type: ignore[attr-defined]
            else:
                out += (b - a) * 1e3  # type: ignore[operator]
        return out


def copy_ms_per_byte(src: torch.Tensor, device: torch.device, h2d: object) -> float:
    """Host-to-device time per byte, from one timed copy of `src` (a host buffer as the loads
    read it: page-locked on CUDA)."""
    n = src.numel()
    if n == 0:
        return 0.0
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        dst.copy_(src)
        return (time.perf_counter() - t0) * 1e3 / n
    stream: Any = torch.cuda.current_stream(device)
    if h2d is not None:
        # `dst` was allocated on compute: its memory may have just been freed there and still be
        # read by queued kernels (Note [ordering across streams] in scopes/streams.py).
        h2d.wait_stream(stream)  # type: ignore[attr-defined]
        stream = h2d
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        dst.copy_(src, non_blocking=True)  # warm: the first copy maps the pages
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def spare_device_bytes(device: torch.device) -> int | None:
    """Device memory this process could still allocate beyond the peak it has reached (None on
    a CPU device: there is no device memory to size a budget by)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device)
    return usable - torch.cuda.max_memory_allocated(device)


def auto_margin(device: torch.device) -> int:
    if device.type != "cuda":
        return AUTO_MARGIN_MIN
    total = torch.cuda.get_device_properties(device).total_memory
    return max(AUTO_MARGIN_MIN, int(total * AUTO_MARGIN_FRACTION))


@dataclass
class Member:
    """One model under a budget shared with others that run one at a time (Note [one budget across
    models] in budget/shared.py): its scopes' costs, its measured orders (indices into `costs`) and
    how many of its passes run per cycle of the group (`weight`)."""

    costs: Sequence[ScopeCost]
    forward: Sequence[int]
    backward: Sequence[int]
    weight: float

    def step_ms(self, kept: set[int], room: int) -> float:
        return self.weight * simulate(self.costs, self.forward, self.backward, kept, room).step_ms


def _across_ms(members: Sequence[Member], kept: Sequence[set[int]], room: int) -> float:
    return sum(m.step_ms(k, room) for m, k in zip(members, kept, strict=True) if m.weight)


def room_across(members: Sequence[Member], kept: Sequence[set[int]], prefetch: int) -> int:
    """What streaming needs when the members run one at a time: the most any one of them needs."""
    return max((min_room(m.costs, k, prefetch) for m, k in zip(members, kept, strict=True)), default=0)


def _greedy_across(members: Sequence[Member], budget: int, prefetch: int) -> list[set[int]]:
    """From nothing kept, keep the scope of any member that shortens the weighted cycle most per
    byte; every member's room shrinks by what any one keeps."""
    kept: list[set[int]] = [set() for _ in members]
    used = 0
    while True:
        now = _across_ms(members, kept, budget - used)
        base: dict[int, float] = {}  # the cycle with the room less `size` bytes, by size
        pick, pick_score = None, None
        for m, member in enumerate(members):
            if not member.weight:
                continue
            for i in sorted(set(member.forward) | set(member.backward)):
                if i in kept[m]:
                    continue
                size = member.costs[i].device_bytes
                trial = [k | {i} if n == m else k for n, k in enumerate(kept)]
                room = budget - used - size
                if room < room_across(members, trial, prefetch):
                    continue
                if size not in base:
                    base[size] = _across_ms(members, kept, room)
                ms = base[size] - member.step_ms(kept[m], room) + member.step_ms(trial[m], room)
                c = member.costs[i]
                ratio = c.copy_ms / max(c.forward_ms + c.backward_ms, 1e-6)
                score = (round((now - ms) / max(size, 1) * 2**30, 3), ratio, -m, -i)
                if pick_score is None or score > pick_score:
                    pick, pick_score = (m, i), score
        if pick is None:
            return kept
        kept[pick[0]].add(pick[1])
        used += members[pick[0]].costs[pick[1]].device_bytes


def choose_across(members: Sequence[Member], budget: int, prefetch: int,
                  byte_layout: Sequence[set[int]]) -> tuple[list[set[int]], Prediction]:
    """The kept sets of models sharing `budget` (Note [one budget across models] in
    budget/shared.py) and the weighted cycle they predict: the faster by simulation of the greedy
    across them and of `byte_layout` (what the byte layout keeps now); within TIE, the one that
    keeps more."""
    options = [_greedy_across(members, budget, prefetch), [set(k) for k in byte_layout]]
    scored = []
    for kept in options:
        used = sum(m.costs[i].device_bytes for m, k in zip(members, kept, strict=True) for i in k)
        if budget - used >= room_across(members, kept, prefetch):
            scored.append((_across_ms(members, kept, budget - used), used, kept))
    if scored:
        fastest = min(ms for ms, _, _ in scored)
        _, used, kept = max((o for o in scored if o[0] <= fastest * (1 + TIE)), key=lambda o: o[1])
    else:
        used, kept = 0, [set() for _ in members]
    steps = [simulate(m.costs, m.forward, m.backward, k, budget - used) for m, k in zip(members, kept, strict=True)]
    return kept, Prediction(sum(m.weight * p.forward_ms for m, p in zip(members, steps, strict=True)),
                            sum(m.weight * p.backward_ms for m, p in zip(members, steps, strict=True)))
