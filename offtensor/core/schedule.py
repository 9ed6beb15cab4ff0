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
predicate selected; Policy.max_scope_bytes may split it into several scopes): with equal blocks
that is `prefetch` blocks ahead, whatever their split, so splitting lowers the peak (the scope
computing is smaller) without shortening the time a copy has to hide behind compute. Device
memory holds at most the scope computing plus the budget. Scopes under 1/TINY of the largest
scope (norms, biases) are not counted, so a tiny scope never stands between the copy of the
next large one and the compute it should overlap. A scope arriving out
of order re-learns the order from that point; the first scope of the forward order arriving
again starts a new pass and releases whatever a previous, abandoned pass left resident.
The first scope of a pass is loaded when the forward of the model given to `wrap` starts
(`begin_forward`; the scope where the pass after the last one's start began last time, so that
alternating or cycling starts are foreseen), not when the forward reaches it: what a model
computes before its first block (embeddings, masks, rotary tables; about 2 ms of host time
for a Hugging Face Llama) then hides the first copy instead of delaying it, which matters
most when the forward is transfer-bound.
Those hooks also delimit passes: inside the model's forward the first scope arriving again (a
looped block) continues the pass; a pass starting at another scope of the order follows the
order from there (decoding from cached encoder outputs), at an unknown scope relearns it; at the
end of the model's forward the order is cut where the pass ended and scopes the pass loaded but
did not use are released. Without the hooks, ORDER_LIMIT bounds the order's length.

# Note [VRAM budget]
`Policy(vram_budget=B)` bounds the device bytes the scopes' weights take together. Streaming
needs room for 2 + `prefetch` of the largest selected modules: the one computing, the one
before it, still finishing its backward when the next one's backward starts and prefetches
(autograd fires the next scope's output-gradient hook before the previous scope's last
input-gradient hook), and `prefetch` in flight. What is left keeps whole scopes resident: the
first in the order `wrap` found them (usually the forward order: the first scope of a pass is
the one whose copy nothing hides), then the others spread evenly over that order (see "Kept
scopes spread" below). A kept scope is released only when its copy would
be stale or must go: a write to one of its masters (an optimizer step on this thread), the end
of a `backward_and_step`'s backward for its trainable scopes (the worker steps them and cannot
release), an interrupted call, `unwrap`. So in inference a kept scope loads once; in training,
once per optimizer step instead of in forward and again in backward; a frozen one (a LoRA
base) once. Writes no op on the parameter sees must release it too, or the next forward computes
with the old weights: through a view or a detached alias (`p[0].fill_()`, `p.detach().mul_()`)
they bump `p._version`, which a kept scope's next forward compares with the versions its copy
was made from (`Scope.written_since_copied`); `p.data` has a version counter of its own, so
taking it releases a kept copy at once (`Engine.master_handed_out`), and a write through it
after the next load is seen by the versions of the aliases handed out (Note [p.data aliases]
in core/slot.py). A scope no_offload() holds
is checked the same way (`Engine.outlives_calls`): its copy also outlives its calls. Kept scopes do not count
against the prefetch budget (their bytes are reserved), but the old gradients a load for
backward fetches (accumulation) do. The budget covers weights: gradients on their way to the
host and activations come on top.

The streamed scopes ahead fill the streaming room (`streaming_room`, less the streamed scopes
that hold device memory now), not just `prefetch` of them. The room's 2 + `prefetch` blocks are
sized for backward, where one scope computes and the one before it is still finishing; in the
forward, and above all while a kept scope computes, most of that room is free. Kept first
scopes made this matter: with `prefetch` scopes ahead, the copies stopped one streamed scope
ahead while the kept scopes computed, and the link idled for that long in a transfer-bound pass.
Filling the room keeps the copies going from the pass's first op, within the same bytes.

Kept scopes spread: filling the room still caps how far the copies get ahead while kept scopes
compute, at the room's 2 + `prefetch` blocks. With the kept scopes first, the copies got that far
ahead during the first kept scopes and then idled for the rest of them; in a pass where a
streamed block computes a little faster than it copies (a 34B LoRA step's forward: 11 ms of
compute against 12.8 ms of fp8 copies per layer), that lead was gone after a few streamed
blocks, and each later one waited for its copy: 7 kept layers of 48 lost about 40 ms of link
time. Spread out, each kept scope comes when the copies have fallen a few blocks behind, and
its compute lets them catch up; the lead never has to exceed the room, and the link does not
idle. The passes that are transfer-bound (inference) or compute-bound move the same bytes
either way.

Filling it also leaves no slack for a guess that is wrong. Before the first backward its order is
guessed as the reverse forward order; under reentrant checkpointing (transformers' too) a split
block is recomputed from its *first* scope, so the room filled with the blocks below it while
the rest of the block still had to load on demand, on top: 5/3 of the room with prefetch 1. So a
streamed scope that backward needs and finds offloaded first releases the prefetches this
backward has not needed yet, latest first, until it fits (`Engine.pre_backward`). The forward
needs no such step: each streamed scope is released as its forward ends, before the next one
loads, so an unexpected scope finds the computing one's place free.

# Note [carried into the next forward]
Under a VRAM budget, a backward ends with the scopes the next forward computes first (the
forward order reversed), and used to release them, so the next forward began by copying them
again. In gradient accumulation and frozen layers (nothing changes their masters between the
two) that copy is pure loss, and where a streamed block computes its forward faster than it
copies (the 8-layer benchmark model at 4x2048, compiled: 5.3 ms against 7.9 ms), each forward
began with the copies behind and never caught up. (An optimizer step that writes a scope's
masters ends its carry: with PEFT adapters inside every layer, carried layers serve the
micro-batches of one step but not the next step; a frozen layer is carried across steps.) So the
backward leaves them resident (`Residency.CARRIED`): the streamed scopes at the head of the next
pass (`first_of_next_pass` and on, skipping kept ones), as many as fit the streaming room less
one block, which stays free for the next copy. They are the backward's last scopes, so they
never raise its footprint, and they count against the room like any streamed scope. (Not the
last when one backward runs through two forwards' graphs, the second's first: a scope that must
load on demand there releases carried ones, `_make_room`.) A carried scope outlives its calls as
a kept one does (`Engine.outlives_calls`): a write to its masters releases it (an optimizer
step, `p.data`, a write through an alias its next forward sees by the versions), and so do an
unused pass (the end of the model's forward releases what the pass loaded and did not use;
without that hook the next pass start does), an exception, `unwrap`. Its next forward uses it,
then streams it as usual. Not carried: trainable scopes under backward_and_step (the worker
writes their masters unseen), under data parallelism (ranks load together), and after a backward
that built a graph.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..api import Layout, Policy, Residency, ScopeState
from ..budget.layout import Prediction
from .scope import Scope

logger = logging.getLogger("offtensor")

TINY = 8  # see Note [prefetch order]
# Without the model's forward hook to tell where passes start, the learned forward order is
# relearned beyond this many entries per scope (Note [prefetch order]).
ORDER_LIMIT = 16


def streaming_bytes(largest_block: int, prefetch: int) -> int:
    """Device bytes streaming needs beside a VRAM budget's kept scopes (Note [VRAM budget]): the
    block computing, the one before it finishing its backward, `prefetch` in flight."""
    return (2 + prefetch) * largest_block


class Schedule:
    """The order in which scopes start their forward and first need their backward, learned
    from the passes so far, and which scopes to prefetch from it."""

    def __init__(self, scopes: list[Scope], policy: Policy) -> None:
        self.scopes = scopes
        self.order: list[Scope] = []  # forward order
        self.pos = 0  # where the current pass is in it
        self.learned = False  # a pass has followed the order from its head
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
        # The scopes the current backward leaves resident for the next forward (None: not
        # chosen yet in this backward; Note [carried into the next forward]).
        self._carry: set[Scope] | None = None
        self.prefetch_bytes = 0  # Policy.prefetch x the largest block (set by ready)
        # Under a VRAM budget that streams some scopes: the device bytes streamed scopes may
        # take together (Note [VRAM budget]); None without one.
        self.streaming_room: int | None = None
        self.budget: int | None = None  # Policy.vram_budget in bytes (sized, for "auto")
        self.prediction: Prediction | None = None  # the timed layout's (Note [a timed layout])
        # offtensor.set_prefetch: the scopes to load when a scope's forward (backward) starts,
        # instead of the learned order's.
        self.forward_override: dict[Scope, list[Scope]] = {}
        self.backward_override: dict[Scope, list[Scope]] = {}

    def ready(self) -> None:
        """Every scope is built: size the prefetch budget (Note [prefetch order]) and choose
        the scopes the VRAM budget keeps (Note [VRAM budget])."""
        self.largest = max((s.device_nbytes for s in self.scopes), default=0)
        blocks: dict[str, int] = {}
        for s in self.scopes:
            blocks[s.block] = blocks.get(s.block, 0) + s.device_nbytes
        largest_block = self.largest_block = max(blocks.values(), default=0)
        self.prefetch_bytes = self._policy.prefetch * largest_block
        budget = self._policy.vram_budget
        if budget == "auto":  # streams everything until the measured step sizes it (Note [a timed layout])
            total = sum(s.device_nbytes for s in self.scopes)
            budget = min(total, streaming_bytes(largest_block, self._policy.prefetch))
        if budget is not None:
            assert isinstance(budget, int)
            self.budget = budget
            self._keep_within(budget, largest_block)
            if not all(s.residency is Residency.KEPT for s in self.scopes):
                self.streaming_room = streaming_bytes(largest_block, self._policy.prefetch)

    def apply_layout(self, kept: set[Scope], budget: int, prediction: Prediction | None) -> None:
        """Keep exactly `kept` from now on, within `budget` (a timed layout, chosen between two
        passes): a kept scope no longer kept is released; everything the budget does not keep is
        the streaming room."""
        for scope in self.scopes:
            if scope in kept:
                scope.residency = Residency.KEPT
            elif scope.residency is Residency.KEPT:
                scope.residency = Residency.STREAMED
                scope.release()
        self.budget = budget
        self.prediction = prediction
        kept_bytes = sum(s.device_nbytes for s in kept)
        everything = all(s.residency is Residency.KEPT for s in self.scopes)
        self.streaming_room = None if everything else budget - kept_bytes

    def layout(self, timed: bool) -> Layout | None:
        """What the budget keeps now, for `summary()`."""
        if self.budget is None:
            return None
        kept = sum(s.device_nbytes for s in self.scopes if s.residency is Residency.KEPT)
        total = sum(s.device_nbytes for s in self.scopes)
        pred = self.prediction
        return Layout(self.budget, kept, total - kept, timed and pred is not None,
                      pred.forward_ms if pred is not None else None, pred.backward_ms if pred is not None else None)

    def _keep_within(self, budget: int, largest_block: int) -> None:
        total = sum(s.device_nbytes for s in self.scopes)
        if total <= budget:
            for scope in self.scopes:
                scope.residency = Residency.KEPT
            return
        streaming = streaming_bytes(largest_block, self._policy.prefetch)
        assert budget >= streaming  # wrap checked it (_check_budget) before anything moved
        room = budget - streaming
        first, *rest = self.scopes
        if first.device_nbytes <= room:
            first.residency = Residency.KEPT
            room -= first.device_nbytes
        else:  # a first scope larger than the room (a wrapped embedding): spread over all
            rest = self.scopes
        # The rest spread evenly by bytes: each scope earns the kept share (room / rest) of its
        # bytes, and one is kept when the earnings so far pay for it (in integers: x rest).
        rest_bytes = max(1, sum(s.device_nbytes for s in rest))
        share, credit = room, 0
        for scope in rest:
            credit += share * scope.device_nbytes
            if scope.device_nbytes * rest_bytes <= credit and scope.device_nbytes <= room:
                scope.residency = Residency.KEPT
                room -= scope.device_nbytes
                credit -= scope.device_nbytes * rest_bytes

    def prefetch(self, candidates: Iterable[Scope], current: Scope, *, with_grads: bool) -> None:
        """Load the candidates in order while their bytes fit the prefetch budget; scopes under
        1/TINY of the largest do not count (Note [prefetch order]). Under a VRAM budget the
        streamed ones fill the budget's streaming room instead (Note [VRAM budget])."""
        budget = self.prefetch_bytes
        if budget == 0:
            return
        in_flight = 0
        room = self.free_streaming_room()
        for scope in candidates:
            if scope is current:
                continue
            if scope.state is ScopeState.OFFLOADED and scope.ring is not None and not scope.ring.ready(scope):
                return  # its read is not done: its own forward loads it (Note [staged loads], file_masters.py)
            if scope.residency is Residency.KEPT:  # its weights are in the budget's kept part; old gradients are not
                grads = scope.old_grad_bytes() if with_grads else 0
                if in_flight + grads > budget:
                    return
                scope.load(with_grads=with_grads)
                in_flight += grads
                continue
            size = scope.device_nbytes
            if room is not None:
                if scope.state is ScopeState.OFFLOADED:
                    if size > room:
                        return
                    room -= size
                scope.load(with_grads=with_grads)
                continue
            counted = size if size * TINY >= self.largest else 0
            if in_flight + counted > budget:
                return
            scope.load(with_grads=with_grads)
            in_flight += counted

    def expected_after(self, scope: Scope, *, in_backward: bool, backward_next: bool) -> list[Scope]:
        """The scopes expected to load after `scope`, nearest first: the rest of this backward
        (or forward), then the pass that follows it (a backward when `backward_next`, else the
        next forward). Orders not learned yet are guessed: wrap's order, its reverse."""
        forward = self.order if self.learned else self.scopes
        backward = self._bwd_order if self._bwd_order else forward[::-1]
        if in_backward:
            return _after(backward, scope) + forward
        return _after(forward, scope) + (backward if backward_next else forward)

    def free_streaming_room(self) -> int | None:
        """What the VRAM budget's streaming room has left: the room less the streamed scopes
        that hold device memory now (loading or resident). None without a budget that streams."""
        if self.streaming_room is None:
            return None
        held = sum(s.device_nbytes for s in self.scopes if s.residency is not Residency.KEPT
                   and s.state is not ScopeState.OFFLOADED)
        return self.streaming_room - held

    def prefetch_forward(self, scope: Scope) -> None:
        """The scope's forward starts: prefetch what the override names, else the next scopes
        of the learned order."""
        override = self.forward_override.get(scope)
        if override is not None:
            for other in override:
                other.load(with_grads=False)
        else:
            self.prefetch(self.ahead_in_forward(), scope, with_grads=False)

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

    def ahead_in_forward(self) -> list[Scope]:
        """The scopes the current pass will start next, once the order is learned."""
        return self.order[self.pos :] if self.learned else []

    def is_last(self, scope: Scope) -> bool:
        """The scope ends the learned forward order, and the current pass is there."""
        return self.learned and self.pos == len(self.order) and self.order[-1] is scope

    def first_of_next_pass(self) -> Scope | None:
        """The scope where the next pass of the model's forward will likely start."""
        if not self.order:
            return None
        last = self.last_begin
        return self._next_begin.get(last, last) if last is not None else self.order[0]

    def cut(self) -> None:
        """The model's forward ended: what followed in the order ran outside it."""
        del self.order[self.pos :]

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
            new_pass = True
            self.pos = 1
        else:
            if self.learned:
                logger.debug("scope order changed at %s; relearning", scope.name)
            del order[self.pos :]
            order.append(scope)
            self.pos = len(order)
        self._index[scope] = self.pos - 1
        return new_pass

    def forget_order(self) -> None:
        self.order.clear()
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
        self._carry = None

    def carries(self, scope: Scope) -> bool:
        """The scope's backward is over: leave it resident for the next forward, which computes
        it first (Note [carried into the next forward])."""
        if self.streaming_room is None or not self.learned:
            return False
        if self._carry is None:
            self._carry = set()
            first = self.first_of_next_pass()
            room = self.streaming_room - self.largest_block  # one block left to copy into
            for ahead in self.order[self._index[first]:] if first in self._index else []:
                if ahead.residency is Residency.KEPT:
                    continue
                if ahead.device_nbytes > room:
                    break
                self._carry.add(ahead)
                room -= ahead.device_nbytes
        return scope in self._carry

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
