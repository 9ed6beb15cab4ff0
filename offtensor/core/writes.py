"""What a write to an offloaded parameter's master invalidates: the copies still reading the
master must finish first, and device copies made from the old value go."""

from __future__ import annotations

from collections.abc import Callable

from ..api import Residency, ScopeState
from .scope import Scope
from .slot import ParamSlot, on_optimizer_worker
from .streams import Streams


class MasterWrites:
    """Called before each write of one wrapped model's masters: an in-place op, `p.data = t`, an
    optimizer step, `p.data` handed out."""

    def __init__(self, streams: Streams, hold: Callable[[], bool], in_backward: Callable[[], bool]) -> None:
        """`hold`: no_offload() is in effect for the model; `in_backward`: a backward of it runs."""
        self.streams = streams
        self._hold = hold
        self._in_backward = in_backward

    def outlives_calls(self, scope: Scope) -> bool:
        """The scope's device copy stays from one call to the next: kept by the VRAM budget,
        carried from a backward into the next forward, or held by no_offload(). Writes that
        bypass the parameter (`p.data`, a detached alias) leave such a copy stale; a streamed
        scope loads afresh at its next call."""
        return scope.residency is not Residency.STREAMED or self._hold()

    def master_written(self, slot: ParamSlot) -> None:
        """`before_master_write`, then graphs that saved a copy of the master see it modified
        (Note [writes under a saved graph] in core/slot.py)."""
        self.before_master_write(slot)
        slot.device_copies_written()

    def before_master_write(self, slot: ParamSlot, *, written: bool = True) -> None:
        """Before an in-place op on a master: no copy may still be reading it, and a device copy
        made from the old value is stale. `written`: False for an offloaded argument that the op
        surely only reads (`h.add_(self.bias)`)."""
        scope = slot.scope
        scope.shadow_stale = True
        scope.master_writes += 1  # a staged copy is stale (Note [staged loads] in weights/staging.py)
        slot.retired_copies_written()  # also for the worker's steps (atomic version bumps)
        if on_optimizer_worker():
            # The optimizer worker: no copy reads this master (docs/design.md, Threads). A
            # device copy that no_offload() keeps is released by backward_and_step.
            return
        self.streams.sync_master_reads()
        if scope.state is ScopeState.OFFLOADED:
            return
        if scope.running_calls == 0:
            scope.release(force=True)  # stale, also when the budget keeps it
        elif written:  # in the scope's own call: Note [writes during a scope's call] (core/write_tracking.py)
            scope.written_in_call[slot] = None

    def master_handed_out(self, scope: Scope, slot: ParamSlot | None = None) -> None:
        """`p.data` of one of the scope's parameters (`slot`'s) was taken (or, for a kept scope,
        its masters were written through a view): writes through it reach the master unseen,
        under a version counter of its own. A device copy that outlives its calls (kept, carried,
        held by no_offload()) would go stale, so it goes now; the next forward reloads it (Note
        [VRAM budget] in budget/vram.py). So does a streamed scope resident outside its calls
        (the last one of a forward, which its backward would use: Note [writes under a saved
        graph] in core/slot.py). Streamed scopes load afresh, but under Policy(cast="host") from
        a shadow cast from the masters: it is re-cast at the next load. Writes through the alias
        after that load: Note [p.data aliases] (core/slot.py)."""
        scope.shadow_stale = True
        scope.master_writes += 1  # so is a staged copy (Note [staged loads] in weights/staging.py)
        if scope.state is ScopeState.OFFLOADED or on_optimizer_worker():
            return
        if scope.running_calls and slot is not None:
            # Written through `.data` in the scope's own call, perhaps: Note [writes during a
            # scope's call] (core/scope.py).
            scope.written_in_call[slot] = None
        if not self.outlives_calls(scope) and (scope.running_calls or self._in_backward()):
            # A streamed scope's next call loads afresh; one resident outside its calls (the last
            # scope of a forward, resident into its backward) goes now, unless a backward runs.
            return
        if scope.running_calls > 1 or (scope.running_calls == 1 and not scope.written_since_copied()):
            return  # its own forward reads `.data`: no release under it
        self.streams.sync_master_reads()  # the write may follow at once: no copy may still read
        scope.release(force=True)

    def forward_starts(self, scope: Scope) -> None:
        """The scope's first running call starts. A device copy that outlived its calls is stale
        if its masters were written since by writes no op on the parameter saw (through a view
        or a detached alias: `Scope.written_since_copied`, Note [VRAM budget] in budget/vram.py)."""
        if self.outlives_calls(scope) and scope.running_calls == 1 and scope.written_since_copied():
            self.master_handed_out(scope)

    def call_ended(self, scope: Scope) -> None:
        """A call of the scope ended. Once none runs, what was written during the calls is
        refreshed in the device copy, which may outlive them (kept for backward, kept, held):
        Note [writes during a scope's call] (core/write_tracking.py)."""
        if scope.running_calls == 0 and scope.written_in_call:
            for slot in list(scope.written_in_call):
                scope.make_resident(upto=slot)
                scope.refresh(slot)

    def backward_starts(self, scope: Scope, handed: object) -> None:
        """The scope's backward is about to run. Resident since its forward (the last scope, a
        kept one) and written since by a write no op on the parameter saw, it is released for a
        reload: backward then differentiates with what the master holds, and a graph that saved
        the old copy raises (Note [writes under a saved graph] in core/slot.py). `handed`: what
        backward_and_step's worker steps in this backward (a scope whose hooks fire again after
        its first gradients were handed over), whose backward is done; None without one."""
        if (scope.state is not ScopeState.OFFLOADED and not on_optimizer_worker()
                and scope.written_since_copied(skip=handed)):
            self.streams.sync_master_reads()
            scope.release(force=True)
