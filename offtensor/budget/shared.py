"""One VRAM budget across several wrapped models that run one at a time: the components of a
diffusers pipeline wrapped by `offtensor.wrap(pipe, policy=Policy(vram_budget=...))`
(model/components.py). Each model keeps its own engine and schedule; its budget is a `MemberBudget`
of one `SharedBudget`, which chooses what every member keeps.

# Note [one budget across models]
A Flux pipeline runs a 9.5 GB T5 once per prompt and a 23.7 GB transformer at every denoising
step. A budget per model would split the bytes up front, keeping T5 blocks that save one copy
per image beside transformer blocks streamed 28 times. So the members share one budget: the
scopes of all count against the same bytes (`held_streamed`), and as the members compute one at
a time the streaming room is the most any one needs (2 + `prefetch` of its largest block, or its
size when smaller), not their sum. The byte layout (`ready`) spreads kept scopes over all the
members' scopes in wrap's order (Note [kept scopes spread] in budget/vram.py). The timed layout
measures each member's second pass with its own `TimedLayout`; that pass is over at the member's
next pass or, when it expects no backward, at another member's pass start. Once every member
that ran is measured and none computes, `choose_across` (budget/layout.py) keeps the set whose
weighted cycle simulates shortest: each member's step times its passes per cycle, the passes
between the last two starts of the member run least (one pipeline call). So it is chosen at the
second call's first denoising step. A member that ran once and never again holds the choice back
(the byte layout stays); one that never ran keeps nothing. The candidates are the greedy across
members and the byte layout (no just-in-time walks, which are per pass). Under data parallelism
the byte layout stays. A member's `make_room` may release other members' resident streamed
scopes that are in no call and that their own backward does not need.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..api import Layout, Policy, Residency, ScopeState
from ..scopes.scope import LiveScopes, Scope
from ..scopes.streams import Streams
from ..storage.staging import StagingRing
from .layout import Measuring, Member, Prediction, choose_across
from .timed import TimedLayout
from .vram import VramBudget, keep_within, streaming_bytes

STARTS_KEPT = 4096  # pass starts remembered to weigh the members (Note [one budget across models])


@dataclass(frozen=True)
class ModelCalls:
    """What the shared budget asks of a member's engine, handed down by it."""

    idle: Callable[[], bool]  # no call runs and no_offload() holds nothing
    lockstep: Callable[[], bool]  # ranks load together (data parallel)
    expects_backward: Callable[[], bool]  # a backward follows the model's forward passes
    order: Callable[[], list[Scope]]  # the learned forward order
    backward_order: Callable[[], list[Scope]]
    needed_in_backward: Callable[[Scope], bool]  # the current backward has needed the scope
    ring: Callable[[], StagingRing | None]  # the staging ring or None


class MemberBudget(VramBudget):
    """The VRAM budget of one model among those sharing a SharedBudget: what it keeps and its
    streaming room are the group's; its timed layout only measures its passes."""

    def __init__(self, group: SharedBudget, scopes: list[Scope], policy: Policy, live: LiveScopes,
                 timed: TimedLayout | None, calls: ModelCalls) -> None:
        super().__init__(scopes, policy, live, timed)
        self.group = group
        self.calls = calls

    def ready(self, largest_block: int) -> None:
        self.largest_block = largest_block  # the group lays out once every member is built

    def free_streaming_room(self) -> int | None:
        if self.streaming_room is None:
            return None
        return self.streaming_room - self.group.held_streamed()

    def releasable(self) -> list[Scope]:
        others = [s for m in self.group.members if m is not self for s in reversed(list(m.live))
                  if s.residency is Residency.CARRIED or not m.calls.needed_in_backward(s)]
        return others + super().releasable()

    def carry_room(self) -> int:
        assert self.streaming_room is not None
        return self.streaming_room - self.group.largest_block() - self.group.held_streamed(but=self)

    def between_passes(self, order: list[Scope], backward_order: Callable[[], list[Scope]],
                       ring: StagingRing | None) -> None:
        self.group.between_passes(self)

    def layout(self) -> Layout:
        return self.group.layout()


class SharedBudget:
    """Policy.vram_budget across models that run one at a time (Note [one budget across models])."""

    def __init__(self, policy: Policy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.members: list[MemberBudget] = []
        self.timed = (policy.layout == "timed" or policy.vram_budget == "auto"
                      or (policy.layout == "auto" and device.type == "cuda"))
        self.starts: collections.deque[int] = collections.deque(maxlen=STARTS_KEPT)  # members' pass starts
        self.bytes = 0  # the budget (sized, for "auto"; set by ready)
        self.prediction: Prediction | None = None  # the timed layout's, per cycle
        self.chosen = False

    def member(self, scopes: list[Scope], streams: Streams, live: LiveScopes, calls: ModelCalls) -> MemberBudget:
        """The budget of one more model (called by its engine)."""
        timed = None
        if self.timed:
            timed = TimedLayout(scopes, self.policy, self.device, streams, idle=calls.idle, lockstep=calls.lockstep)
        budget = MemberBudget(self, scopes, self.policy, live, timed, calls)
        self.members.append(budget)
        return budget

    def scopes(self) -> list[Scope]:
        return [s for m in self.members for s in m.scopes]

    def largest_block(self) -> int:
        return max((m.largest_block for m in self.members), default=0)

    def streaming_need(self) -> int:
        """The room streaming needs: the most any one member needs, as they run one at a time."""
        return max((min(sum(s.device.nbytes for s in m.scopes), streaming_bytes(m.largest_block, self.policy.prefetch))
                    for m in self.members), default=0)

    def ready(self) -> None:
        """Every member is built: keep by bytes across them (Note [one budget across models])."""
        scopes = self.scopes()
        need = self.streaming_need()
        total = sum(s.device.nbytes for s in scopes)
        budget = self.policy.vram_budget
        if budget == "auto":
            budget = min(total, need)
        assert isinstance(budget, int)
        if budget < min(total, need):
            raise ValueError(
                f"offtensor.wrap: Policy(vram_budget={budget}) is below what streaming the components "
                f"needs: {min(total, need)} bytes ({min(total, need) / 2**30:.2f} GiB), 2 + "
                f"Policy.prefetch={self.policy.prefetch} of the largest block of the component that needs "
                "most. Raise the budget, lower prefetch, or split blocks with Policy(max_scope_bytes=...)")
        self.bytes = budget
        keep_within(scopes, budget, need)
        room = None if all(s.residency is Residency.KEPT for s in scopes) else need
        for m in self.members:
            m.streaming_room, m.bytes = room, budget

    def held_streamed(self, but: MemberBudget | None = None) -> int:
        """Device bytes the members' streamed (and carried) scopes hold now."""
        return sum(s.device.nbytes for m in self.members if m is not but for s in m.scopes
                   if s.residency is not Residency.KEPT and s.state is not ScopeState.OFFLOADED)

    def between_passes(self, member: MemberBudget) -> None:
        """A member's forward starts: measure, or choose the layout across the members once each
        that ran was measured (Note [one budget across models])."""
        self.starts.append(self.members.index(member))
        if not self.timed or self.chosen:
            return
        assert member.timed is not None
        member.timed.advance(member.calls.order(), member.calls.ring())
        if not all(m.calls.idle() for m in self.members):
            return
        for m in self.members:
            assert m.timed is not None
            if m is not member and m.timed.timer.state is Measuring.MEASURING and not m.calls.expects_backward():
                m.timed.advance(m.calls.order(), m.calls.ring())  # its measured pass is over
        ran = [m for m in self.members if m.calls.order()]
        if not ran or any(m.timed is None or m.timed.timer.state is not Measuring.MEASURED for m in ran):
            return
        weights = self.weights()
        if weights is None:
            return
        self.chosen = True
        for m in self.members:
            assert m.timed is not None
            m.timed.timer.state = Measuring.DONE
        if any(m.calls.lockstep() for m in self.members):
            return
        self._choose(weights)

    def weights(self) -> list[int] | None:
        """Each member's passes per cycle: between the last two starts of the member that ran
        least (None: it has not started twice)."""
        counts = collections.Counter(self.starts)
        least = min((i for i in counts), key=lambda i: (counts[i], i))
        at = [k for k, i in enumerate(self.starts) if i == least]
        if len(at) < 2:
            return None
        window = collections.Counter(list(self.starts)[at[-2]:at[-1]])
        return [window.get(i, 0) for i in range(len(self.members))]

    def _choose(self, weights: list[int]) -> None:
        parts, before = [], []
        for m, weight in zip(self.members, weights, strict=True):
            assert m.timed is not None
            ran = bool(m.calls.order())
            forward, backward = m.timed.indices(m.calls.order(), m.calls.backward_order) if ran else ([], [])
            parts.append(Member(m.timed.costs(m.calls.ring()), forward, backward, weight if ran else 0))
            before.append({i for i, s in enumerate(m.scopes) if s.residency is Residency.KEPT})
        assert self.members[0].timed is not None
        budget = self.members[0].timed.sized(self.bytes)
        kept, self.prediction = choose_across(parts, budget, self.policy.prefetch, before)
        for m, k in zip(self.members, kept, strict=True):
            m.apply({m.scopes[i] for i in k}, budget, None)
        scopes = self.scopes()
        everything = all(s.residency is Residency.KEPT for s in scopes)
        room = None if everything else budget - sum(s.device.nbytes for s in scopes if s.residency is Residency.KEPT)
        self.bytes = budget
        for m in self.members:
            m.streaming_room, m.bytes = room, budget

    def layout(self) -> Layout:
        scopes = self.scopes()
        kept = sum(s.device.nbytes for s in scopes if s.residency is Residency.KEPT)
        total = sum(s.device.nbytes for s in scopes)
        pred = self.prediction
        return Layout(self.bytes, kept, total - kept, pred is not None,
                      pred.forward_ms if pred is not None else None, pred.backward_ms if pred is not None else None)
