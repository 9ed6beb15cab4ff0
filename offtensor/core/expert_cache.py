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
write through the parameter, an optimizer step on any thread, `p.data` handed out: core/
writes.py), the master's version (detached aliases) and its `p.data` aliases' versions equal
those at its copy, and no deferred step is pending; else it is dropped (Note [writes during a
scope's call], the staging ring's write_mark). Rows live in their own device tensors, allocated
and read on the compute stream, outside the scopes' buffers; a VRAM budget is reduced by B
before it chooses kept scopes (Note [VRAM budget] in budget/vram.py).

# Note [cache bookkeeping per fill]
Lookups and offers take a fill's experts together (Note [one copy per run] in core/experts.py):
the master's write mark is computed once per slot and fill, and an offer into a full cache ranks
the held rows once (a heap: stale rows first, then by score, ties to the oldest, the order the
scan over `self.rows` chose) and pops victims from it. Scanning every row, with its mark, for
each evicted row cost O(rows) per miss: a prefill misses on most experts, a decode step on some
in each layer, and a cache of some hundred rows made decode slower than no cache.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch

from .slot import ParamSlot
from .write_tracking import version_of

HALF_LIFE = 8.0  # loads of the scope after which a row's score counts half


@dataclass
class _Score:
    value: float = 0.0
    at: int = 0  # the scope's loads when last used


@dataclass
class _Row:
    rows: torch.Tensor  # on the compute device, the device copy's dtype
    mark: tuple[Any, ...]  # the master's writes when it was copied
    order: int  # rows held before it (ties in eviction go to the oldest)


class ExpertCache:
    """Routed expert rows on the device across loads, within `capacity` bytes (Note [expert
    cache])."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # bytes held now
        self.rows: dict[tuple[ParamSlot, int], _Row] = {}
        self.scores: dict[tuple[ParamSlot, int], _Score] = {}
        self._order = 0  # rows admitted so far

    def take(self, slot: ParamSlot, experts: list[int]) -> dict[int, torch.Tensor]:
        """Count a use of each expert's rows; the cached rows of those current (the others are
        dropped), by expert (Note [cache bookkeeping per fill])."""
        now, scores, rows = slot.scope.loads, self.scores, self.rows
        found: dict[int, torch.Tensor] = {}
        mark: tuple[Any, ...] | None = None
        for e in experts:
            key = (slot, e)
            score = scores.get(key)
            if score is None:
                score = scores[key] = _Score()
            if score.at != now or score.value == 0.0:
                score.value = _aged(score, now) + 1.0
                score.at = now
            row = rows.get(key)
            if row is None:
                continue
            if mark is None:
                mark = _mark(slot)
            if row.mark != mark:
                self._drop(key)
            else:
                found[e] = row.rows
        return found

    def offer(self, slot: ParamSlot, experts: list[int], view: torch.Tensor) -> None:
        """The experts' rows were copied into `view` (the device copy, on the compute stream's
        order): keep a copy of each that fits or outscores what it would evict, in the order
        given (Note [cache bookkeeping per fill])."""
        nbytes = view[0].numel() * view.element_size()
        if nbytes > self.capacity:
            return
        now, mark = slot.scope.loads, _mark(slot)
        ranked: list[tuple[float, int, tuple[ParamSlot, int]]] | None = None  # lowest first
        for e in experts:
            key = (slot, e)
            if key in self.rows:
                continue
            mine = _aged(self.scores.get(key, _Score()), now)
            if self.used + nbytes > self.capacity and ranked is None:
                ranked = self._ranked()
            while self.used + nbytes > self.capacity:
                assert ranked
                standing, _, victim = ranked[0]
                if standing >= mine:
                    break
                heapq.heappop(ranked)
                self._drop(victim)
            if self.used + nbytes > self.capacity:
                continue
            row = self.rows[key] = _Row(view[e].detach().clone(), mark, self._order)
            self._order += 1
            self.used += nbytes
            if ranked is not None:
                heapq.heappush(ranked, (mine, row.order, key))

    def clear(self) -> None:
        for key in list(self.rows):
            self._drop(key)

    def _ranked(self) -> list[tuple[float, int, tuple[ParamSlot, int]]]:
        """The held rows as a heap of (score now, age order, key), stale rows at -1 so that they
        go first; ties evict the oldest row."""
        marks: dict[ParamSlot, tuple[Any, ...]] = {}
        ranked = []
        for key, row in self.rows.items():
            slot = key[0]
            mark = marks.get(slot)
            if mark is None:
                mark = marks[slot] = _mark(slot)
            standing = -1.0 if row.mark != mark else _aged(self.scores.get(key, _Score()), slot.scope.loads)
            ranked.append((standing, row.order, key))
        heapq.heapify(ranked)
        return ranked

    def _drop(self, key: tuple[ParamSlot, int]) -> None:
        row = self.rows.pop(key)
        self.used -= row.rows.numel() * row.rows.element_size()


def _aged(score: _Score, now: int) -> float:
    return score.value * 0.5 ** ((now - score.at) / HALF_LIFE)


def _mark(slot: ParamSlot) -> tuple[Any, ...]:
    """The writes to the slot's master so far (Note [expert cache]); a pending step: unique."""
    if slot.step_pending:
        return (object(),)
    return (slot.scope.masters.master_writes, version_of(slot.param), slot.data_versions())
