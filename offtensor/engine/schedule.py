"""The schedule: the learned forward and backward orders of the scopes, and the prefetch.

# Note [prefetch order]
The engine records the order in which scopes start their forward, and separately the order in
which backward first needs them. The two are not mirror images: under checkpointing, a block
split into several scopes (Policy.max_scope_bytes) is recomputed in forward order before its
backward runs in reverse, so a reverse-forward prefetch would fetch the block's last matrix first
and stall on every other one. From the second pass on, each scope's forward start prefetches the
next scopes of the forward order, and each scope's first need in backward the next ones of the
backward order (the reverse forward order until a backward has been seen). Scopes are prefetched
while their bytes fit in `policy.prefetch` times the largest block's (a block is a module the
predicate selected, which Policy.max_scope_bytes may split into several scopes): with equal
blocks that is `prefetch` blocks ahead, whatever their split, so splitting lowers the peak
without shortening the time a copy has to hide behind compute. Device memory holds at most the
scope computing plus that budget. Scopes under 1/TINY of the largest (norms, biases) are not
counted, so a tiny scope never stands between the copy of the next large one and the compute it
should overlap. A scope arriving out of order relearns the order from that point; the first
scope of the order arriving again starts a new pass and releases whatever an earlier, abandoned
pass left resident. A resident kept scope has only its old gradients to fetch: only the next
`prefetch + 1` of them look, so a backward costs the host the same per scope at 80 scopes as at
12. Without the model's hooks to delimit passes (Note [passes of the model's forward]),
ORDER_LIMIT bounds the order's length.

# Note [passes of the model's forward]
The forward hooks of the model given to `wrap` delimit passes. As that forward starts
(`Engine.begin_forward`) the pass's first scope loads: the one where the pass after the last
one's start began last time, so that alternating or cycling starts are foreseen. What the model
computes before its first block (embeddings, masks, rotary tables) then hides the first copy
instead of delaying it. Inside the model's forward the first scope arriving again (a looped
block) continues the pass; a pass starting at another scope of the order follows the order from
there (decoding from cached encoder outputs), at an unknown scope relearns it. At the end of the
model's forward the order is cut where the pass ended, and the scopes the pass loaded but did
not use are released.

# Note [kept runs]
A forward's prefetch skips the kept scopes ahead that are loaded: nothing to copy. Scanned at
each scope's call, they would make a call's cost grow with the number of scopes. So the run of
kept, loaded scopes a scan finds is remembered as positions of the order, and a later call inside
it starts past it, until the order changes (`_order_changes`) or any scope is offloaded or has its
residency set (`Scope.kept_changes`, bumped by `_to_offloaded` and `set_residency`): the only
ways a scope of the run stops being kept and loaded. Loads never end a run. What the prefetch
decides is the same as with the scan.

# Note [the last scope of an extended order]
The forward's last scope stays resident for the backward that starts with it (`is_last`,
Engine.post_forward). A pass that runs past the order's end (the first pass raised midway and
the order was cut there, or ran fewer blocks than this one) appends each further scope as the
order's end for the moment, and each would stay: the whole tail resident until the backward,
whatever the VRAM budget. So no scope of such a pass counts as last, and the one that was the
order's end is released when the pass runs past it (`_left_behind`); the backward loads its
first scope as a streamed one, and the next pass follows the whole order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from ..api import Policy, Residency, ScopeState
from ..budget.vram import NoBudget
from ..scopes.scope import Scope

logger = logging.getLogger("offtensor")

TINY = 8  # see Note [prefetch order]
# Without the model's forward hook to tell where passes start, the learned forward order is
# relearned beyond this many entries per scope (Note [prefetch order]).
ORDER_LIMIT = 16


class Schedule:
    """The order in which scopes start their forward and first need their backward, learned
    from the passes so far, and which scopes to prefetch from it."""

    def __init__(self, scopes: list[Scope], policy: Policy, budget: NoBudget, hold: Callable[[], bool]) -> None:
        self.scopes = scopes
        self._hold = hold  # no_offload() holds the model: nothing is released
        self.budget = budget  # the VRAM budget (budget/vram.py): its streaming room and carried scopes
        self.order: list[Scope] = []  # forward order
        self.pos = 0  # where the current pass is in it
        self.learned = False  # a pass has followed the order from its head
        self._extended = False  # the current pass ran past the order's end (Note [the last scope of an extended order])
        self._index: dict[Scope, int] = {}
        self._bwd_order: list[Scope] = []  # scopes in order of first need in backward
        self._bwd_pos = 0
        self._bwd_seen: set[Scope] = set()  # needed already in the current backward
        self.last_begin: Scope | None = None  # where the last pass of the model's forward started
        # Where the pass after one that started at a scope started, the last time: passes that
        # alternate between starts (a vision-language model's image and text-only samples) or
        # follow a cycle (encoder-decoder generation) load the right first scope early.
        self._next_begin: dict[Scope, Scope] = {}
        self._policy = policy
        self.largest = 0  # the largest scope's device bytes (set by ready)
        self.largest_block = 0  # the largest block's device bytes (set by ready)
        self.prefetch_bytes = 0  # Policy.prefetch x the largest block (set by ready)
        # The positions [start, end) of the order found kept and loaded, the order's and the
        # scopes' changes when found (Note [kept runs])
        self._kept_run: tuple[int, int, int, int] = (0, 0, -1, -1)
        # This pass's carry has loaded all it chooses, chooses none, or a backward follows the
        # pass: the rest of its calls skip it (Note [carried into the next forward] in budget/vram.py).
        self._carry_settled = False
        self._order_changes = 0
        # offtensor.set_prefetch: the scopes to load when a scope's forward (backward) starts,
        # instead of the learned order's.
        self.forward_override: dict[Scope, list[Scope]] = {}
        self.backward_override: dict[Scope, list[Scope]] = {}

    def ready(self) -> None:
        """Every scope is built: size the prefetch budget (Note [prefetch order])."""
        self.largest = max((s.device.nbytes for s in self.scopes), default=0)
        blocks: dict[str, int] = {}
        for s in self.scopes:
            blocks[s.block] = blocks.get(s.block, 0) + s.device.nbytes
        self.largest_block = max(blocks.values(), default=0)
        self.prefetch_bytes = self._policy.prefetch * self.largest_block

    def prefetch(self, candidates: Iterable[Scope], current: Scope, *, with_grads: bool) -> bool:
        """Load the candidates in order while their bytes fit the prefetch budget; scopes under
        1/TINY of the largest do not count (Note [prefetch order]). Under a VRAM budget the
        streamed ones fill the budget's streaming room instead (Note [the streaming room] in
        budget/vram.py). True when it went through every candidate."""
        limit = self.prefetch_bytes
        if limit == 0:
            return False
        in_flight = 0
        room = self.budget.free_streaming_room()
        kept_ahead = self._policy.prefetch + 1  # kept scopes whose old gradients may be fetched now
        for scope in candidates:
            if scope is current:
                continue
            if scope.state is ScopeState.OFFLOADED and not scope.source.ready(scope):
                return False  # its read is not done: its own forward loads it (Note [staged loads], storage/staging.py)
            if scope.residency is Residency.KEPT:  # its weights are in the budget's kept part; old gradients are not
                if not with_grads and scope.state is not ScopeState.OFFLOADED:
                    continue  # loaded, nothing to fetch
                if scope.state is not ScopeState.OFFLOADED:
                    # Nothing but old gradients to fetch: only for the next few kept scopes, so
                    # that a backward's cost per scope does not grow with the number of scopes
                    # (Note [prefetch order]); the others' turn comes as the backward nears them.
                    kept_ahead -= 1
                    if kept_ahead < 0:
                        continue
                grads = scope.old_grads.nbytes() if with_grads else 0
                if in_flight + grads > limit:
                    return False
                if grads == 0 and scope.state is not ScopeState.OFFLOADED:
                    continue  # loaded, no old gradient to fetch: a load would find the same
                scope.load(with_grads=with_grads)
                in_flight += grads
                continue
            size = scope.device.nbytes
            if room is not None:
                if scope.state is ScopeState.OFFLOADED:
                    if size > room:
                        return False
                    room -= size
                scope.load(with_grads=with_grads)
                continue
            counted = size if size * TINY >= self.largest else 0
            if in_flight + counted > limit:
                return False
            scope.load(with_grads=with_grads)
            in_flight += counted
        return True

    def expected_after(self, scope: Scope, *, in_backward: bool, backward_next: bool) -> list[Scope]:
        """The scopes expected to load after `scope`, nearest first: the rest of this backward
        (or forward), then the pass that follows it (a backward when `backward_next`, else the
        next forward). Orders not learned yet are guessed: wrap's order, its reverse."""
        forward = self.order if self.learned else self.scopes
        backward = self._bwd_order if self._bwd_order else forward[::-1]
        if in_backward:
            return _after(backward, scope) + forward
        return _after(forward, scope) + (backward if backward_next else forward)

    def prefetch_forward(self, scope: Scope, carry: Callable[[Scope], bool] | None = None) -> bool:
        """The scope's forward starts: prefetch what the override names, else the next scopes
        of the learned order and, once those are all loaded or loading and `carry(scope)` says
        no backward follows, the next pass's first scopes, carried (Note [carried into the next
        forward] in budget/vram.py). True when it carried some."""
        override = self.forward_override.get(scope)
        if override is not None:
            for other in override:
                other.load(with_grads=False)
            return False
        if not self.learned:
            return False
        start, order = self._past_kept(), self.order
        if start < len(order) and not self.prefetch((order[i] for i in range(start, len(order))), scope,
                                                    with_grads=False):
            return False  # some of the order's rest is not loading yet: no carry before it
        if carry is None or self._carry_settled:
            return False
        if not carry(scope):  # a backward follows: this pass carries nothing ahead
            self._carry_settled = True
            return False
        return self._carry_ahead(scope)

    def _carry_ahead(self, current: Scope) -> bool:
        """Load the next pass's first scopes that the budget carries, as the room allows, and
        mark those loaded carried; True if it marked some."""
        ahead = self.carry()
        self.prefetch(ahead, current, with_grads=False)
        carried, settled = False, True
        for scope in ahead:
            if scope.state is ScopeState.OFFLOADED:
                settled = False  # no room yet: a later call of the pass tries again
            elif scope.residency is Residency.STREAMED and not scope.calls.running:
                scope.set_residency(Residency.CARRIED)
                carried = True
        self._carry_settled = settled
        return carried

    def _past_kept(self) -> int:
        """Where the current pass goes past the kept, loaded scopes next (Note [kept runs])."""
        order, start = self.order, self.pos
        run_start, run_end, order_seen, scopes_seen = self._kept_run
        if run_start <= start <= run_end and order_seen == self._order_changes and scopes_seen == Scope.kept_changes:
            return run_end
        end, n = start, len(order)
        while (end < n and order[end].residency is Residency.KEPT
               and order[end].state is not ScopeState.OFFLOADED):
            end += 1
        self._kept_run = (start, end, self._order_changes, Scope.kept_changes)
        return end

    def prefetch_backward(self, scope: Scope) -> None:
        """The scope's backward is about to run: note it in the backward order, and prefetch
        what the override names, else the next scopes of the learned backward order."""
        ahead = self.backward_needs(scope)
        override = self.backward_override.get(scope)
        if override is not None:
            for other in override:
                other.load(with_grads=True)
        else:
            self.prefetch(ahead, scope, with_grads=True)

    # ---- forward order -------------------------------------------------------------------

    def forward_position(self, scope: Scope) -> int:
        """Where the scope comes in the learned forward order (after all others if unknown)."""
        return self._index.get(scope, len(self.order))

    def next_in_order(self, scope: Scope) -> bool:
        """The pass follows the learned order, `scope` next: its forward only steps along (`advance`)."""
        return self.learned and not self._extended and self.pos < len(self.order) and self.order[self.pos] is scope

    def is_last(self, scope: Scope) -> bool:
        """The scope ends the learned forward order, and the current pass is there."""
        return self.learned and not self._extended and self.pos == len(self.order) and self.order[-1] is scope

    def first_of_next_pass(self) -> Scope | None:
        """The scope where the next pass of the model's forward will likely start."""
        if not self.order:
            return None
        last = self.last_begin
        return self._next_begin.get(last, last) if last is not None else self.order[0]

    def cut(self) -> None:
        """The model's forward ended: what followed in the order ran outside it."""
        del self.order[self.pos :]
        self._order_changes += 1

    def abandon_pass(self) -> None:
        self.pos = len(self.order)

    def advance(self, scope: Scope, *, begins: bool, outside_model: bool, bounded: bool) -> bool:
        """The scope's forward starts; `begins`: it is the first of the model's forward,
        `outside_model`: no model forward is running, `bounded`: no model hook delimits passes
        (ORDER_LIMIT). Returns True when this starts a new pass."""
        order = self.order
        new_pass = False
        if begins:
            if self.last_begin is not None:
                self._next_begin[self.last_begin] = scope
            self.last_begin = scope
            i = self._index.get(scope)
            if order and order[0] is not scope and i is not None and i < len(order) and order[i] is scope:
                # The model's forward starts at a known scope other than the head of the order
                # (decoding from cached encoder outputs, a text-only sample of a vision-language
                # model, a dropped first layer): follow the order from there.
                self.learned = True
                self._extended = False
                self.pos = i + 1
                return True
            if order and order[0] is not scope:  # starts at a scope never seen: learn anew
                logger.debug("forward pass starts at %s, not %s; relearning the order", scope.name, order[0].name)
                self.forget_order()
                new_pass = True
        elif bounded and len(order) > ORDER_LIMIT * len(self.scopes):
            self.forget_order()  # no model hook delimits passes, and they never start at its head
        if not begins and self.pos < len(order) and order[self.pos] is scope:
            self.pos += 1
        elif order and order[0] is scope and (begins or outside_model):
            # A new pass. Inside the model's forward only its start begins one: a first scope
            # called again there (a looped block) continues the pass.
            self.learned = True
            self._extended = False
            new_pass = True
            self.pos = 1
        else:
            if self.learned:
                logger.debug("scope order changed at %s; relearning", scope.name)
            if order and self.pos == len(order) and not self._extended and not self._hold():
                _left_behind(order[-1])
            del order[self.pos :]
            order.append(scope)
            self._extended = True
            self._order_changes += 1
            self.pos = len(order)
        self._index[scope] = self.pos - 1
        return new_pass

    def forget_order(self) -> None:
        self.order.clear()
        self._order_changes += 1
        self._index.clear()
        self.learned = False
        self.pos = 0

    # ---- backward order ------------------------------------------------------------------

    def needed_in_backward(self, scope: Scope) -> bool:
        """The current backward has needed the scope already (it is computing or finishing)."""
        return scope in self._bwd_seen

    def forget_backward(self) -> None:
        """No backward in progress: the next one starts at the head of the backward order."""
        self._bwd_pos = 0
        self._bwd_seen.clear()
        self._carry_settled = False
        self.budget.forget_backward()

    def carry(self) -> list[Scope]:
        """The streamed scopes to leave resident for the next forward, which computes them first
        (Note [carried into the next forward] in budget/vram.py)."""
        return self.budget.carry(self._from_next_pass_start) if self.learned else []

    def _from_next_pass_start(self) -> list[Scope]:
        first = self.first_of_next_pass()
        return self.order[self._index[first]:] if first in self._index else []

    def backward_needs(self, scope: Scope) -> list[Scope] | Iterable[Scope]:
        """The scope's backward is about to run: note it in the backward order and return the
        scopes to prefetch after it (the reverse forward order until a backward is known)."""
        if scope not in self._bwd_seen:
            self._bwd_seen.add(scope)
            order = self._bwd_order
            if self._bwd_pos < len(order) and order[self._bwd_pos] is scope:
                self._bwd_pos += 1
            else:
                del order[self._bwd_pos :]
                order.append(scope)
                self._bwd_pos = len(order)
        ahead = self._bwd_order[self._bwd_pos :]
        if ahead:
            return ahead
        i = self._index.get(scope)  # no backward seen yet, or this one departs from it
        return reversed(self.order[:i]) if i is not None else ()

    def backward_order(self) -> list[Scope]:
        """The scopes in the order the last backward first needed them."""
        return list(self._bwd_order)

    def backward_starts_elsewhere(self, scope: Scope) -> list[Scope]:
        """At the end of the forward: the backward order when backward starts at another scope
        than `scope` (a split block recomputed under checkpointing), else nothing."""
        if self._bwd_order and self._bwd_order[0] is not scope:
            return self._bwd_order
        return []


def _after(order: list[Scope], scope: Scope) -> list[Scope]:
    """The scopes after `scope`'s first place in `order` (all of them when it has none)."""
    for i, s in enumerate(order):
        if s is scope:
            return order[i + 1 :]
    return list(order)


def _left_behind(scope: Scope) -> None:
    """A pass runs past `scope`, the order's end as its forward ended: released as the end of a
    streamed scope's forward releases it (Note [the last scope of an extended order])."""
    if scope.residency is Residency.STREAMED and not scope.calls.running and not scope.policy.keep_for_backward:
        scope.release()
