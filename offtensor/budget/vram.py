"""The VRAM budget of one wrapped model: the scopes it keeps on the device, the room left to stream
the others, and the scopes a backward leaves for the next forward. The engine and the schedule
reach it through one object: a `NoBudget`, whose calls do nothing, or a `VramBudget`.

# Note [VRAM budget]
`Policy(vram_budget=B)` bounds the device bytes the scopes' weights take together. Streaming
needs room for 2 + `prefetch` of the largest blocks (`streaming_bytes`): the one computing, the
one before it, still finishing its backward when the next one's backward starts and prefetches
(autograd fires the next scope's output-gradient hook before the previous scope's last
input-gradient hook), and `prefetch` in flight. What is left keeps whole scopes resident: the
first in the order `wrap` found them (usually the first of a pass, whose copy nothing hides),
then the others spread over that order (Note [kept scopes spread]); a timed layout chooses them
from measured times instead (Note [a timed layout] in budget/layout.py). A kept scope is
released only when its copy would be stale or must go: a write to one of its masters (an
optimizer step on this thread; `p.data` taken, `MasterWrites.master_handed_out`; a write through a
view or a detached alias, seen by `WriteTracker.written_since_copied` at its next forward), the end of
a `backward_and_step`'s backward for its trainable scopes (the worker steps them and cannot
release), an interrupted call, `unwrap`. So in inference a kept scope loads once; in training,
once per optimizer step; a frozen one once. Kept scopes do not count against the prefetch
budget, but the old gradients a load for backward fetches do. The budget covers weights:
gradients on their way to the host and activations come on top.

# Note [the streaming room]
The streamed scopes ahead fill the streaming room (`free_streaming_room`: the room less the
streamed scopes holding device memory now), not just `prefetch` of them: the room is sized for
backward, where one scope computes and the one before it is still finishing, so in the forward,
and above all while a kept scope computes, most of it is free, and filling it keeps the link
busy within the same bytes. That leaves no slack for a wrong guess of the backward order: before
the first backward it is guessed as the reverse forward order, but under reentrant
checkpointing a split block is recomputed from its first scope, so the room fills with the
blocks below it while the rest of the block must load on demand. So a streamed scope that
backward needs and finds offloaded first releases the prefetches this backward has not needed
yet, and carried scopes, latest first, until it fits (`make_room`). The forward needs no such
step: each streamed scope is released as its forward ends, before the next one loads.

# Note [kept scopes spread]
Filling the streaming room still caps how far the copies get ahead while kept scopes compute:
at the room's 2 + `prefetch` blocks. With every kept scope first, the copies reach that lead
during them and then idle; where a streamed block computes a little faster than it copies, the
lead is used up after a few streamed blocks and each later one waits for its copy. Spread evenly
by bytes over the order (`keep_within`), each kept scope comes when the copies have fallen a few
blocks behind, and its compute lets them catch up. Passes that are transfer-bound or
compute-bound move the same bytes either way.

# Note [carried into the next forward]
A pass ends with the scopes the next forward computes first: a backward computes them last (the
forward order reversed), an inference pass released them long before. Copied again as the next
forward begins, they are pure loss where nothing changes their masters in between (gradient
accumulation, frozen layers, denoising steps, decoding), and a forward whose first blocks compute
faster than they copy starts behind and stays behind. So under a VRAM budget they stay or come
back resident (`Residency.CARRIED`): the streamed scopes at the head of the next pass
(`Schedule.first_of_next_pass` and on; not kept ones, nor those read from files, which the
staging ring reads ahead), as many as fit the streaming room less one block, kept free for a
copy. A backward leaves them as its last scopes end, so they never raise its footprint. The
model's forward, when no backward follows (no call of the pass can add to a gradient, or eval
mode), loads them once the rest of its order is loading (`Schedule.prefetch_forward`), in room
its own scopes no longer need. They count against the
room like any streamed scope (one backward through two forwards' graphs releases them as it
loads: `make_room`). A carried scope outlives its calls as a kept one does
(`MasterWrites.outlives_calls`): a write to its masters releases it (an optimizer step ends the
carry of what it writes), and so do an unused pass, an exception, `unwrap`, a new layout (its room
may be smaller). Its next forward uses it, then streams it. Not carried: trainable scopes under
backward_and_step (the worker writes their masters unseen), under data parallelism (ranks load
together) or no_offload(), after a backward that built a graph, out of a timed measured pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..api import Layout, MasterHome, Policy, Residency, ScopeState
from ..scopes.grad_calls import trainable
from ..scopes.scope import LiveScopes, Scope
from ..scopes.streams import Streams
from ..storage.staging import StagingRing
from .layout import Prediction
from .timed import TimedLayout


def streaming_bytes(largest_block: int, prefetch: int) -> int:
    """Device bytes streaming needs beside a VRAM budget's kept scopes (Note [VRAM budget]): the
    block computing, the one before it finishing its backward, `prefetch` in flight."""
    return (2 + prefetch) * largest_block


def keep_within(scopes: list[Scope], budget: int, streaming: int) -> None:
    """Keep what fits in `budget` beside `streaming` bytes: every scope when all fit, else the
    first in wrap's order and the others spread evenly by bytes (Note [kept scopes spread])."""
    total = sum(s.device.nbytes for s in scopes)
    if total <= budget:
        for scope in scopes:
            scope.set_residency(Residency.KEPT)
        return
    assert budget >= streaming  # wrap checked it (planning.check_budget) before anything moved
    room = budget - streaming
    first, *rest = scopes
    if first.device.nbytes <= room:
        first.set_residency(Residency.KEPT)
        room -= first.device.nbytes
    else:  # a first scope larger than the room (a wrapped embedding): spread over all
        rest = scopes
    # Each scope earns the kept share (room / rest) of its bytes, and one is kept when the
    # earnings so far pay for it (in integers: x rest).
    rest_bytes = max(1, sum(s.device.nbytes for s in rest))
    share, credit = room, 0
    for scope in rest:
        credit += share * scope.device.nbytes
        if scope.device.nbytes * rest_bytes <= credit and scope.device.nbytes <= room:
            scope.set_residency(Residency.KEPT)
            room -= scope.device.nbytes
            credit -= scope.device.nbytes * rest_bytes


class NoBudget:
    """No VRAM budget: every scope streams. The calls the engine and the schedule make on a
    budget, each doing nothing here (VramBudget does the work)."""

    # The timed layout, whose timer alone is told of calls' starts and ends (`started`, `ended`):
    # None, and the steady path (Note [steady calls] in engine/engine.py) tells nothing.
    timed: TimedLayout | None = None

    def ready(self, largest_block: int) -> None:
        """Every scope is built; `largest_block`: the largest block's device bytes."""

    def free_streaming_room(self) -> int | None:
        """What the streaming room has left (Note [the streaming room]); None: no room bounds
        the prefetch (the prefetch budget alone does)."""
        return None

    def make_room(self, scope: Scope, needed_in_backward: Callable[[Scope], bool]) -> None:
        """Before `scope` loads on demand in backward (Note [the streaming room])."""

    def carry(self, head: Callable[[], list[Scope]]) -> list[Scope]:
        """The streamed scopes to leave resident for the next forward, whose first scopes are
        `head()`: chosen once per backward or pass (Note [carried into the next forward])."""
        return []

    def carrying(self) -> list[Scope]:
        """What `carry` chose in this backward or pass (none yet: empty)."""
        return []

    def forget_backward(self) -> None:
        """No backward in progress: the next one chooses its carried scopes anew."""

    def release_stepped(self) -> None:
        """backward_and_step's worker is about to step the trainable masters: release their kept
        copies, which it cannot (Note [VRAM budget])."""

    def between_passes(self, order: list[Scope], backward_order: Callable[[], list[Scope]],
                       ring: StagingRing | None) -> None:
        """The model's forward starts: measure this pass, or lay out from the measured one
        (`order`: the learned forward order; `ring`: the staging ring or None)."""

    def started(self, scope: Scope, phase: str) -> None:
        """The scope's compute in `phase` ("forward", "backward") starts."""

    def ended(self, scope: Scope, phase: str) -> None:
        """The scope's compute in `phase` ends."""

    def pass_failed(self) -> None:
        """A forward raised."""

    def layout(self) -> Layout | None:
        """What the budget keeps now, for `summary()`."""
        return None


class VramBudget(NoBudget):
    """Policy.vram_budget: which scopes stay on the device, within which bytes (Note [VRAM budget])."""

    def __init__(self, scopes: list[Scope], policy: Policy, live: LiveScopes, timed: TimedLayout | None) -> None:
        self.scopes = scopes
        self.policy = policy
        self.live = live
        self.timed = timed  # None: kept scopes are chosen by bytes alone
        self.bytes = 0  # the budget (sized, for "auto"; set by ready)
        # Policy.expert_cache's share of it: kept scopes fit in the rest (Note [expert cache])
        self.cache_bytes = policy.expert_cache if isinstance(policy.expert_cache, int) else 0
        # The device bytes streamed scopes may take together; None when every scope is kept.
        self.streaming_room: int | None = None
        self.largest_block = 0
        self.prediction: Prediction | None = None  # the timed layout's
        # The scopes the current backward or pass leaves resident for the next forward (None:
        # not chosen yet; Note [carried into the next forward]).
        self._carry: list[Scope] | None = None

    def ready(self, largest_block: int) -> None:
        """Choose the scopes the budget keeps by bytes (Note [kept scopes spread])."""
        self.largest_block = largest_block
        streaming = streaming_bytes(largest_block, self.policy.prefetch)
        budget = self.policy.vram_budget
        if budget == "auto":  # streams everything until the measured step sizes it (Note [a timed layout])
            budget = min(sum(s.device.nbytes for s in self.scopes), streaming)
        assert isinstance(budget, int)
        self.bytes = budget
        keep_within(self.scopes, budget - self.cache_bytes, streaming)
        if not all(s.residency is Residency.KEPT for s in self.scopes):
            self.streaming_room = streaming

    def apply(self, kept: set[Scope], budget: int, prediction: Prediction | None) -> None:
        """Keep exactly `kept` from now on, within `budget` (a timed layout, chosen between two
        passes): a kept scope no longer kept is released, and so is one carried into this pass
        (chosen for the old streaming room, which may be larger than the new one); everything
        the budget does not keep is the streaming room."""
        for scope in self.scopes:
            if scope in kept:
                scope.set_residency(Residency.KEPT)
            elif scope.residency is not Residency.STREAMED:
                scope.set_residency(Residency.STREAMED)
                scope.release()
        self.bytes = budget + self.cache_bytes
        self.prediction = prediction
        kept_bytes = sum(s.device.nbytes for s in kept)
        everything = all(s.residency is Residency.KEPT for s in self.scopes)
        self.streaming_room = None if everything else budget - kept_bytes

    def layout(self) -> Layout:
        kept = sum(s.device.nbytes for s in self.scopes if s.residency is Residency.KEPT)
        total = sum(s.device.nbytes for s in self.scopes)
        pred = self.prediction
        return Layout(self.bytes, kept, total - kept, self.timed is not None and pred is not None,
                      pred.forward_ms if pred is not None else None, pred.backward_ms if pred is not None else None,
                      self.cache_bytes)

    def free_streaming_room(self) -> int | None:
        if self.streaming_room is None:
            return None
        held = sum(s.device.nbytes for s in self.scopes if s.residency is not Residency.KEPT
                   and s.state is not ScopeState.OFFLOADED)
        return self.streaming_room - held

    def make_room(self, scope: Scope, needed_in_backward: Callable[[Scope], bool]) -> None:
        """Release the streamed prefetches this backward has not needed yet, and carried scopes,
        latest first, until the scope's weights fit the streaming room."""
        room = self.free_streaming_room()
        if room is None or scope.residency is Residency.KEPT:
            return
        for other in self.releasable():
            if room >= scope.device.nbytes:
                return
            # A carried scope's backward is over, so it can go too: one backward through two
            # forwards (DPO's chosen and rejected) carries at the end of the second forward's
            # graph and then still runs the first's.
            if other.residency is Residency.KEPT or other.calls.running or (
                    needed_in_backward(other) and other.residency is not Residency.CARRIED):
                continue
            other.release()
            room += other.device.nbytes

    def releasable(self) -> list[Scope]:
        """The resident scopes `make_room` may release, in the order it tries them: latest first."""
        return list(reversed(list(self.live)))

    def carry(self, head: Callable[[], list[Scope]]) -> list[Scope]:
        if self.streaming_room is None or (self.timed is not None and self.timed.measuring):
            return []  # (a measured pass: the next one starts with a new layout, and its room)
        if self._carry is None:
            self._carry = []
            room = self.carry_room()
            for ahead in head():
                if ahead.residency is Residency.KEPT or ahead.source.home is MasterHome.FILE:
                    continue  # (read from a file: the staging ring reads it ahead instead)
                if ahead.device.nbytes > room:
                    break
                self._carry.append(ahead)
                room -= ahead.device.nbytes
        return self._carry

    def carrying(self) -> list[Scope]:
        return self._carry or []

    def carry_room(self) -> int:
        """The bytes a backward or pass may leave carried: the room less one block to copy into."""
        assert self.streaming_room is not None
        return self.streaming_room - self.largest_block

    def forget_backward(self) -> None:
        self._carry = None

    def release_stepped(self) -> None:
        for scope in self.scopes:
            if scope.residency is Residency.KEPT and trainable(scope):
                scope.release(force=True)

    def between_passes(self, order: list[Scope], backward_order: Callable[[], list[Scope]],
                       ring: StagingRing | None) -> None:
        if self.timed is None:
            return
        chosen = self.timed.between_passes(order, backward_order, ring, self.bytes - self.cache_bytes)
        if chosen is not None:
            self.apply(*chosen)

    def started(self, scope: Scope, phase: str) -> None:
        if self.timed is not None and self.timed.measuring:
            if phase == "forward":
                scope.make_resident()  # compute alone between the events (Note [a timed layout])
            self.timed.timer.start(scope, phase)

    def ended(self, scope: Scope, phase: str) -> None:
        if self.timed is not None:
            self.timed.timer.end(scope, phase)

    def pass_failed(self) -> None:
        if self.timed is not None:
            self.timed.pass_failed()


def budget_for(policy: Policy, device: torch.device, scopes: list[Scope], streams: Streams, live: LiveScopes, *,
               idle: Callable[[], bool], lockstep: Callable[[], bool]) -> NoBudget:
    """The budget of one wrapped model (the arguments: TimedLayout's): none without
    Policy.vram_budget; timed under layout="timed", vram_budget="auto", and layout="auto" on a
    CUDA device."""
    if policy.vram_budget is None:
        return NoBudget()
    timed = None
    if policy.layout == "timed" or policy.vram_budget == "auto" or (policy.layout == "auto" and device.type == "cuda"):
        timed = TimedLayout(scopes, policy, device, streams, idle=idle, lockstep=lockstep)
    return VramBudget(scopes, policy, live, timed)
