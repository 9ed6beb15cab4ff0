"""The expert cache: rows of routed experts kept on the device across a streamed scope's loads,
within `Policy(expert_cache=...)` bytes.

# Note [expert cache]
A streamed MoE scope forgets its experts' rows at each release, so a decode token copies again
the experts the previous token used, though a router's choices repeat across tokens. Under
`Policy(expert_cache=B)` the model's engine holds one `ExpertCache` of at most B bytes of rows:
when an op needs an expert of a streamed scope (Note [which experts an op reads]), a row found
there is copied into the scope's device copy on the compute stream (a device-to-device copy, a
hit: nothing crosses the link), and a row copied from the host is offered to it after the
copy's event. Rows are scored by frequency with aging, counted in loads of their scope (one per
pass for a streamed scope): each use adds 1 to a score halved every HALF_LIFE loads; a full
cache admits a row only over a lower-scored one, which it evicts (rows seen but not held keep
their scores, so a row used often earns its place). Kept scopes keep their own rows and use
no cache. A row is used only while its master is as copied: the scope's `master_writes` (every
write through the parameter, an optimizer step on any thread, `p.data` handed out: engine/
writes.py), the master's version (detached aliases) and its `p.data` aliases' versions equal
those at its copy, and no deferred step is pending; else it is dropped (Note [writes during a
scope's call], the staging ring's write_mark). Rows live in their own device tensors, allocated
and read on the compute stream, outside the scopes' buffers; a VRAM budget is reduced by B
before it chooses kept scopes (Note [VRAM budget] in budget/vram.py).

# Note [cache bookkeeping per fill]
Lookups and offers take a fill's experts together (Note [one copy per run] in scopes/experts.py),
and the master's write mark is computed once per slot and fill. Each slot keeps its rows in a
heap by log2(value) + at / HALF_LIFE, an order aging does not change (the log of the score aged
to any time t, plus t / HALF_LIFE); an eviction compares the slots' lowest rows, each less its
scope's loads now / HALF_LIFE, and evicts the lowest, ties to the oldest, as a scan over all rows
would. A slot's rows share the mark they were copied at; once its master is written they are
dropped together, before a current row is evicted. A scan over every row per evicted row would
cost O(rows) per miss, and with some hundred rows held that outweighs what the cache saves.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch.slot import ParamSlot

HALF_LIFE = 8.0  # loads of the scope after which a row's score counts half
_VERSION_OF = torch._C.TensorBase._version.__get__  # type: ignore[attr-defined]
_disabled: Any = torch._C._disabled_torch_function_impl  # (fn, types, args): a read with subclass dispatch off


@dataclass
class _Score:
    value: float = 0.0
    at: int = 0  # the scope's loads when last used
    log: float = -math.inf  # log2(value) + at / HALF_LIFE: its rank at any one time (Note [cache bookkeeping per fill])

    def use(self, now: int) -> None:
        if self.at != now or self.value == 0.0:
            self.value = self.value * 0.5 ** ((now - self.at) / HALF_LIFE) + 1.0  # aged to now, plus this use
            self.at = now
            self.log = math.log2(self.value) + now / HALF_LIFE


@dataclass
class _Row:
    rows: torch.Tensor  # on the compute device, the device copy's dtype
    mark: tuple[Any, ...]  # the master's writes when it was copied
    order: int  # rows held before it (ties in eviction go to the oldest)
    score: _Score  # its entry in ExpertCache.scores


class ExpertCache:
    """Routed expert rows on the device across loads, within `capacity` bytes (Note [expert
    cache])."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # bytes held now
        self.rows: dict[tuple[ParamSlot, int], _Row] = {}
        self.scores: dict[tuple[ParamSlot, int], _Score] = {}
        self._order = 0  # rows admitted so far
        # Per slot: the experts held, the mark they were copied at (all alike), and a heap of
        # (score.log, order, expert), entries stale once the row left or was used again
        self._held: dict[ParamSlot, set[int]] = {}
        self._marks: dict[ParamSlot, tuple[Any, ...]] = {}
        self._heaps: dict[ParamSlot, list[tuple[float, int, int]]] = {}

    def take(self, slot: ParamSlot, experts: list[int]) -> dict[int, torch.Tensor]:
        """Count a use of each expert's rows; the cached rows of those current (the others are
        dropped), by expert (Note [cache bookkeeping per fill])."""
        now, scores, rows = slot.scope.loads, self.scores, self.rows
        if self._held.get(slot):
            self._drop_stale(slot, _mark(slot))
        found: dict[int, torch.Tensor] = {}
        heap = None
        for e in experts:
            key = (slot, e)
            score = scores.get(key)
            if score is None:
                score = scores[key] = _Score()
            before = score.log
            score.use(now)
            row = rows.get(key)
            if row is not None:
                found[e] = row.rows
                if score.log != before:  # its new rank; the old entry goes stale
                    heap = self._heaps[slot]
                    heapq.heappush(heap, (score.log, row.order, e))
        if heap is not None:
            self._compact(slot)
        return found

    def offer(self, slot: ParamSlot, experts: list[int], view: torch.Tensor) -> None:
        """The experts' rows were copied into `view` (the device copy, on the compute stream's
        order): keep a copy of each that fits or outscores what it would evict, in the order
        given (Note [cache bookkeeping per fill])."""
        nbytes = view[0].numel() * view.element_size()
        if nbytes > self.capacity:
            return
        now, mark = slot.scope.loads, _mark(slot)
        if self._held.get(slot):
            self._drop_stale(slot, mark)
        self._marks[slot] = mark
        lowest: list[tuple[float, int, ParamSlot, int]] | None = None  # each slot's lowest row
        held, heap = self._held.setdefault(slot, set()), self._heaps.setdefault(slot, [])
        for e in experts:
            key = (slot, e)
            if key in self.rows:
                continue
            score = self.scores.get(key)
            if score is None:
                score = self.scores[key] = _Score()
            mine = score.log - now / HALF_LIFE
            if self.used + nbytes > self.capacity and lowest is None:
                lowest = self._lowest()
            while self.used + nbytes > self.capacity and lowest and lowest[0][0] < mine:
                _, order, owner, victim = heapq.heappop(lowest)
                row = self.rows.get((owner, victim))
                if row is not None and row.order == order:  # else pushed twice, evicted already
                    self._drop((owner, victim))
                    self._push_lowest(lowest, owner)
            if self.used + nbytes > self.capacity:
                continue
            row = self.rows[key] = _Row(view[e].detach().clone(), mark, self._order, score)
            self._order += 1
            self.used += nbytes
            held.add(e)
            heapq.heappush(heap, (score.log, row.order, e))
            if lowest is not None:
                heapq.heappush(lowest, (mine, row.order, slot, e))
        self._compact(slot)

    def clear(self) -> None:
        for key in list(self.rows):
            self._drop(key)

    def _lowest(self) -> list[tuple[float, int, ParamSlot, int]]:
        """A heap of each slot's lowest row (log2 of its score now, its order, slot, expert), stale
        rows dropped first: its top is the row to evict."""
        for slot in [s for s, held in self._held.items() if held]:
            self._drop_stale(slot, _mark(slot))
        lowest: list[tuple[float, int, ParamSlot, int]] = []
        for slot in self._heaps:
            self._push_lowest(lowest, slot)
        heapq.heapify(lowest)
        return lowest

    def _push_lowest(self, lowest: list[tuple[float, int, ParamSlot, int]], slot: ParamSlot) -> None:
        """Push the slot's lowest row onto `lowest`, its entries of rows gone or used since
        popped first."""
        heap = self._heaps[slot]
        while heap:
            log, order, e = heap[0]
            row = self.rows.get((slot, e))
            if row is not None and row.order == order and row.score.log == log:
                heapq.heappush(lowest, (log - slot.scope.loads / HALF_LIFE, order, slot, e))
                return
            heapq.heappop(heap)

    def _compact(self, slot: ParamSlot) -> None:
        """Rebuild the slot's heap from its rows once it holds mostly stale entries (which
        `_push_lowest` skips: when this runs changes no decision)."""
        heap, held = self._heaps[slot], self._held.get(slot, ())
        if len(heap) > 4 * len(held) + 64:
            rows = [(e, self.rows[(slot, e)]) for e in held]
            heap[:] = [(row.score.log, row.order, e) for e, row in rows]
            heapq.heapify(heap)

    def _drop_stale(self, slot: ParamSlot, mark: tuple[Any, ...]) -> None:
        """Drop the slot's rows if its master was written since they were copied."""
        if self._marks.get(slot) != mark:
            for e in list(self._held.get(slot, ())):
                self._drop((slot, e))

    def _drop(self, key: tuple[ParamSlot, int]) -> None:
        row = self.rows.pop(key)
        self.used -= row.rows.nbytes
        self._held[key[0]].discard(key[1])


def _mark(slot: ParamSlot) -> tuple[Any, ...]:
    """The writes to the slot's master so far (Note [expert cache]); a pending step: unique.
    Asked for every slot holding rows at each eviction: the version read in C, the `p.data`
    aliases' versions only when there are some (data_versions gives () without)."""
    if slot.pending_step is not None:
        return (object(),)
    return (slot.scope.masters.master_writes, _disabled(_VERSION_OF, (), (slot.param,)),
            slot.data_versions() if slot.data_aliases else ())
