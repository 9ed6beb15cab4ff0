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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..dispatch.slot import ParamSlot
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


class ExpertCache:
    """Routed expert rows on the device across loads, within `capacity` bytes (Note [expert
    cache])."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0  # bytes held now
        self.rows: dict[tuple[ParamSlot, int], _Row] = {}
        self.scores: dict[tuple[ParamSlot, int], _Score] = {}

    def use(self, slot: ParamSlot, expert: int) -> torch.Tensor | None:
        """Count a use of the expert's rows; its cached rows if current, else None (dropped)."""
        key = (slot, expert)
        score = self.scores.setdefault(key, _Score())
        now = slot.scope.loads
        if score.at != now or score.value == 0.0:
            score.value = _aged(score, now) + 1.0
            score.at = now
        row = self.rows.get(key)
        if row is None:
            return None
        if row.mark != _mark(slot):
            self._drop(key)
            return None
        return row.rows

    def offer(self, slot: ParamSlot, expert: int, rows: torch.Tensor) -> None:
        """The expert's rows were copied into `rows` (the device copy's, on the compute stream's
        order): keep a copy if it fits or outscores what it would evict."""
        key = (slot, expert)
        nbytes = rows.numel() * rows.element_size()
        if key in self.rows or nbytes > self.capacity:
            return
        now = slot.scope.loads
        mine = _aged(self.scores.get(key, _Score()), now)
        while self.used + nbytes > self.capacity:
            victim = min(self.rows, key=lambda k: self._standing(k))
            if self._standing(victim) >= mine:
                return
            self._drop(victim)
        self.rows[key] = _Row(rows.detach().clone(), _mark(slot))
        self.used += nbytes

    def clear(self) -> None:
        for key in list(self.rows):
            self._drop(key)

    def _standing(self, key: tuple[ParamSlot, int]) -> float:
        """A held row's score now; -1 for a stale one, evicted first."""
        if self.rows[key].mark != _mark(key[0]):
            return -1.0
        return _aged(self.scores.get(key, _Score()), key[0].scope.loads)

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
