"""Which of a scope's masters were written since their device copies were made: by an op on the
parameter, `.data`, or a detached alias (the master's version counter).

# Note [writes during a scope's call]
A frozen parameter used as state (a step counter, an EMA codebook) may be written in its own
module's forward and read after: `self.count.add_(1)`, `self.codebook.copy_(...)` under
no_grad, `self.codebook.data.mul_(d)`, `p[i] = v`. Every such write goes to the master, but the
scope's device copy was loaded before it and is not released under a running call: later ops of
that call would read the old values (and `p[i] = v`, dispatched as an op, would write the device
copy only, lost at the next load). So a write to a master during a call of its scope marks the
parameter (`WriteTracker.in_call`: an in-place op by `before_master_write`, `.data` when it is
taken, since the write through it follows unseen), and the next op that gets the device copy
first copies the master into it, on the compute stream (`refresh`); a write through a detached
alias (`p.detach().mul_()`) is seen there by the master's version counter. The end of the call
refreshes what is still marked, since the copy may outlive the call (the last scope kept for
backward, a kept or held scope): backward then differentiates with the master's values, as for
a plain parameter. A refresh bumps the device copy's version when the master's changed
(`note_copied`), so a graph that saved the copy before an in-place write raises autograd's
in-place error. An offloaded argument that an in-place op only reads (`h.add_(self.bias)`) is
not marked. Writes through a view taken in the forward (`p[0].fill_()`) act on the device copy
itself and do not reach the master (docs/design.md, Limits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..dispatch.slot import ParamSlot
from .streams import Streams


class WriteTracker:
    """The writes to one scope's masters that its device copies may not hold yet."""

    def __init__(self, streams: Streams, slots: list[ParamSlot]) -> None:
        self.streams = streams
        self.slots = slots  # the scope's (the same list)
        # Each parameter's version counter when its copy was last enqueued, to tell writes no op
        # of ours saw (`p[0].fill_()`, `p.detach().copy_()`; Note [VRAM budget] in budget/vram.py).
        self.copied_versions: dict[ParamSlot, int] = {}
        # Parameters whose masters were written during a call of the scope, after its load: their
        # device copies are refreshed (Note [writes during a scope's call]).
        self.in_call: dict[ParamSlot, None] = {}
        # The masters of copied_versions' keys, in its order (keys are only ever added), and
        # whether a slot of the scope may hold `p.data` aliases (Note [one version read per scope]).
        self._masters: tuple[torch.Tensor, ...] = ()
        self.aliases_noted = False

    def note_copied(self, slots: Sequence[ParamSlot]) -> None:
        """The masters of `slots` are copied into their device copies now."""
        # Every scope, not only kept ones: no_offload() holds streamed scopes resident as the
        # budget keeps kept ones, and their copies go stale the same way (MasterWrites.outlives_calls).
        # Asked per load for each parameter it copies: the versions read in one map, the rest inline.
        copied = self.copied_versions
        for slot, version in zip(slots, versions_of([slot.param for slot in slots]), strict=True):
            if slot in copied and copied[slot] != version:
                # Written since its last copy by a write no op on the parameter saw
                # (`p.detach().mul_()`): this copy overwrites the storage a graph may have saved
                # (Note [writes under a saved graph] in dispatch/slot.py).
                slot.device_copies_written()
            copied[slot] = version
            if slot.data_aliases:
                slot.data_copied()
            else:  # data_copied without an alias to look at
                slot.data_alias_written = False

    def copied_now(self, slot: ParamSlot, version: int) -> None:
        """The master of `slot`, at `version`, is what its device copy holds (written back from it)."""
        self.copied_versions[slot] = version

    def written_in_this_call(self, slot: ParamSlot) -> bool:
        """The master changed since its device copy was made, in this call of the scope: by an
        op on the parameter or `.data` (marked), or through a detached alias (its version)."""
        copied = self.copied_versions  # `in` and a subscript: asked per op of a routed parameter
        return (slot in self.in_call or slot not in copied
                or copied[slot] != _disabled(_VERSION_OF, (), (slot.param,)))

    def copies_current(self, n_slots: int, *, versions_read: bool) -> bool:
        """Each of the scope's `n_slots` parameters has a device copy made from its master as the
        master is now: `written_in_this_call` false for every one (and no `p.data` alias wrote).
        `versions_read`: written_since_copied was just found false (no need to ask again)."""
        return (not self.in_call and len(self.copied_versions) == n_slots
                and (versions_read or not self.written_since_copied()))

    def refresh(self, slot: ParamSlot) -> None:
        """Copy a master written during the scope's call into its device copy, on the compute
        stream, before the next op that uses it (Note [writes during a scope's call])."""
        self.in_call.pop(slot, None)
        values = slot.packed.unpack() if slot.packed is not None else slot.master
        slot.device_view.copy_(values, non_blocking=True)  # cast to the compute dtype if need be
        self.streams.reads_masters(self.streams.record(self.streams.compute()))
        self.note_copied((slot,))

    def written_since_copied(self, skip: Callable[[ParamSlot], bool] | None = None) -> bool:
        """A kept (or held) scope's masters changed since their copies were enqueued, by writes
        that did not go through an op on the parameter (Note [VRAM budget] in budget/vram.py),
        `p.data` aliases' included (Note [p.data aliases] in dispatch/slot.py); not counting the
        slots for which `skip(slot)` is true."""
        if skip is None and not self.aliases_noted:
            copied = self.copied_versions
            if len(self._masters) != len(copied):  # a slot copied for the first time
                self._masters = tuple(s.param for s in copied)
            return versions_of(self._masters) != list(copied.values())
        for slot, v in self.copied_versions.items():
            if skip is not None and skip(slot):
                continue
            if _disabled(_VERSION_OF, (), (slot.param,)) != v:
                return True
            if (slot.data_aliases or slot.data_alias_written) and slot.data_written():
                return True
        if skip is None:  # the aliases left alive, of every slot (copied or not yet)
            self.aliases_noted = any(s.data_aliases or s.data_alias_written for s in self.slots)
        return False


# Note [one version read per scope]
# A kept scope asks at each call whether its masters were written since their copies: one
# version counter per parameter. Read one by one through Python that is a call per parameter
# and call, a large share of a host-bound step; so the versions at the last copy (the values of
# `copied_versions`) are compared as a list with the current ones, read by one `map` with
# subclass dispatch off from a tuple of the masters in the same order (its keys'), and a load
# notes its copies likewise. `p.data` aliases (Note [p.data aliases] in dispatch/slot.py)
# are versions of other tensors: a scope one of whose slots was handed one (`aliases_noted`,
# set by ParamSlot.data_handed_out) takes the per-parameter path until no alias is left.


def versions_of(params: Sequence[torch.Tensor]) -> list[int]:
    """The version counters of `params`, read in one `map` without `__torch_function__`, which
    is turned off and on again in C: an interrupt cannot leave it off (a `with` block's exit can
    be skipped, Note [interrupts] in dispatch/masters.py)."""
    return _disabled(list, (), (map(_VERSION_OF, params),))  # type: ignore[no-any-return]


def version_of(p: torch.Tensor) -> int:
    """`p._version` without `__torch_function__` (subclass dispatch off: a property read on a
    tensor subclass dispatches it otherwise): bumped by in-place writes to p and to its views
    and detached aliases. Read at every load and every op inside a scope."""
    return _disabled(_VERSION_OF, (), (p,))  # without_subclass_dispatch, one Python call less


_VERSION_OF = torch._C.TensorBase._version.__get__  # type: ignore[attr-defined]
_disabled: Any = torch._C._disabled_torch_function_impl  # (fn, types, args), typed loosely
