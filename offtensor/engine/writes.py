"""What a write to an offloaded parameter's master invalidates: the copies still reading the
master must finish first, and device copies made from the old value go; and writes that
compiled code made to device copies, which go to the masters (Note [writes in compiled code]).

# Note [writes in compiled code]
In a compiled forward the scope's device copies stand in for its parameters (Note [device
copies as graph inputs] in dispatch/compile.py), so a write there (`p.add_(1)` under no_grad,
`p.copy_(...)`, `p[i] = v`, `p.data.mul_(2)`) reaches the device copy only: lost at the next
load, and a kept copy and its master disagree. So the compiled pre-hook records each device
copy's version counter, and the post-hook, once no call of the scope runs, copies each copy
whose version moved into its master (`written_on_device`): the master changes as in eager mode,
and the copy, which holds the same values, stays current. One integer comparison per parameter
per call; a host sync only after a write. Not copied back, refused with the parameter's name:
a master of another dtype (the forward computes in `compute_dtype`), compressed or in a file,
or written by eager code in the same call. `p.data.mul_()` bumps no version counter when the
backend runs the graph as traced (dynamo's "eager" backend; AOTAutograd-based ones, aot_eager
and inductor, write inputs back with a counted copy): so the first compiled call of each scope
also compares every unwritten copy's bytes with its master, and refuses what differs. Such a
write made first at a later call is not seen (docs/design.md, Limits).

# Note [a load held back for its steps]
A kept scope's copies outlive its calls, so its next call first asks whether a master was
written since its copy was made (`forward_starts`). After backward_and_step, the next forward
may load a kept scope while the worker still steps it: the load holds back the copies of the
parameters whose steps are pending (Note [deferred steps] in optim/overlap.py) and enqueues them
once those steps are done. Those parameters' versions on record are the previous load's, so a
master the worker has updated, its fence not cleared yet, would read as written and the scope
would be loaded twice. So the question skips the parameters whose copies this load has not
enqueued: they will be copied from the masters as the steps leave them. Writes to the others,
copied already, are still found.

# Note [a write through an alias may follow at once]
`p.detach()` and `p.data` hand out the master itself, and a write through them (`p.data.mul_(2)`,
`p.detach()[0].fill_(x)`) runs on the host at once, past every hook. On a GPU the host runs ahead
of the device: right after a forward returns, the copy stream may not yet have read the masters
its loads copy, and a write then reaches the copy the forward computes with, where the plain
model's forward, stream-ordered, keeps the old values. So handing out an alias first waits for
every copy that may still read a master (`sync_master_reads`), as an in-place op does before it
writes. An alias kept and written later, while a later forward's copies may be in flight, is not
covered (docs/design.md, Limits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..api import Residency, ScopeState
from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import ParamSlot, on_optimizer_worker
from ..scopes.scope import Scope, scope_of
from ..scopes.streams import Streams
from ..scopes.write_tracking import version_of

# A device copy and its version counter when a compiled call of its scope started.
DeviceVersions = list[tuple[ParamSlot, torch.Tensor, int]]


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
        (Note [writes under a saved graph] in dispatch/slot.py)."""
        self.before_master_write(slot)
        slot.device_copies_written()

    def masters_stepped(self, scope: Scope, slots: list[ParamSlot]) -> None:
        """`master_written` of each of `slots`, the scope's, outside its calls and not on the
        optimizer worker, with what is the scope's done once: before an eager optimizer step
        (Note [an eager optimizer step] in dispatch/eager_step.py)."""
        scope.masters.written()
        for slot in slots:
            slot.retired_copies_written()
        self.streams.sync_master_reads()
        if scope.state is not ScopeState.OFFLOADED:
            scope.release(force=True)
        for slot in slots:
            slot.device_copies_written()

    def before_master_write(self, slot: ParamSlot, *, written: bool = True) -> None:
        """Before an in-place op on a master: no copy may still be reading it, and a device copy
        made from the old value is stale. `written`: False for an offloaded argument that the op
        surely only reads (`h.add_(self.bias)`)."""
        scope = scope_of(slot)
        scope.masters.written()  # a staged copy or host-cast shadow is stale (Note [master sources], scopes/sources.py)
        slot.retired_copies_written()  # also for the worker's steps (atomic version bumps)
        if on_optimizer_worker():
            # The optimizer worker: no copy reads this master (docs/design.md, Threads). A
            # device copy that no_offload() keeps is released by backward_and_step.
            return
        self.streams.sync_master_reads()
        if scope.state is ScopeState.OFFLOADED:
            return
        if scope.calls.running == 0:
            scope.release(force=True)  # stale, also when the budget keeps it
        elif written:  # in the scope's own call: Note [writes during a scope's call] (scopes/write_tracking.py)
            scope.writes.in_call[slot] = None

    def master_handed_out(self, scope: Scope, slot: ParamSlot | None = None, *, detached: bool = False) -> None:
        """`p.data` of one of the scope's parameters (`slot`'s) was taken (or, for a kept scope,
        its masters were written through a view): writes through it reach the master unseen,
        under a version counter of its own. A device copy that outlives its calls (kept, carried,
        held by no_offload()) would go stale, so it goes now; the next forward reloads it (Note
        [VRAM budget] in budget/vram.py). So does a streamed scope resident outside its calls
        (the last one of a forward, which its backward would use: Note [writes under a saved
        graph] in dispatch/slot.py). Streamed scopes load afresh, but under Policy(cast="host") from
        a shadow cast from the masters: it is re-cast at the next load. Writes through the alias
        after that load: Note [p.data aliases] (dispatch/slot.py). `detached`: `p.detach()`, which
        shares the parameter's version counter, so the loads see writes through it; it only waits
        for the copies (Note [a write through an alias may follow at once])."""
        worker = on_optimizer_worker()  # no copy reads a master the worker steps
        if not worker:
            self.streams.sync_master_reads()
        if detached:
            return
        scope.masters.written()  # so is a staged copy (Note [master sources] in scopes/sources.py)
        if scope.state is ScopeState.OFFLOADED or worker:
            return
        if scope.calls.running and slot is not None:
            # Written through `.data` in the scope's own call, perhaps: Note [writes during a
            # scope's call] (scopes/write_tracking.py).
            scope.writes.in_call[slot] = None
        if not self.outlives_calls(scope) and (scope.calls.running or self._in_backward()):
            # A streamed scope's next call loads afresh; one resident outside its calls (the last
            # scope of a forward, resident into its backward) goes now, unless a backward runs.
            return
        if scope.calls.running > 1 or (scope.calls.running == 1 and not scope.writes.written_since_copied()):
            return  # its own forward reads `.data`: no release under it
        scope.release(force=True)

    def forward_starts(self, scope: Scope) -> bool:
        """The scope's first running call starts. A device copy that outlived its calls is stale
        if its masters were written since by writes no op on the parameter saw (through a view
        or a detached alias: `WriteTracker.written_since_copied`, Note [VRAM budget] in budget/vram.py).
        True if it found every master as its copy (asked, and not written since)."""
        if self.outlives_calls(scope) and scope.calls.running == 1:
            loading = scope.loading  # Note [a load held back for its steps]
            skip = loading.not_copied if loading is not None and loading.held_back else None
            if not scope.writes.written_since_copied(skip=skip):
                return skip is None  # held back: some copies are still to be made
            self.master_handed_out(scope)
        return False

    def call_ended(self, scope: Scope) -> None:
        """A call of the scope ended. Once none runs, what was written during the calls is
        refreshed in the device copy, which may outlive them (kept for backward, kept, held):
        Note [writes during a scope's call] (scopes/write_tracking.py)."""
        if scope.calls.running == 0 and scope.writes.in_call:
            for slot in list(scope.writes.in_call):
                scope.make_resident(upto=slot)
                scope.refresh(slot)

    def backward_starts(self, scope: Scope, handed: Callable[[ParamSlot], bool] | None) -> None:
        """The scope's backward is about to run. Resident since its forward (the last scope, a
        kept one) and written since by a write no op on the parameter saw, it is released for a
        reload: backward then differentiates with what the master holds, and a graph that saved
        the old copy raises (Note [writes under a saved graph] in dispatch/slot.py). `handed`: what
        backward_and_step's worker steps in this backward (a scope whose hooks fire again after
        its first gradients were handed over), whose backward is done; None without one."""
        if (scope.state is not ScopeState.OFFLOADED and not on_optimizer_worker()
                and scope.writes.written_since_copied(skip=handed)):
            self.streams.sync_master_reads()
            scope.release(force=True)

    # ---- compiled code (Note [writes in compiled code]) -----------------------------------------

    def compiled_call_ended(self, scope: Scope, versions: DeviceVersions, *, compare: bool) -> None:
        """The last running compiled call of `scope` ended: copy the device copies it wrote into
        their masters; `compare`: also compare the others' bytes with their masters (the
        scope's first compiled call). Raises, naming the parameter, for a write that cannot be
        copied back, after releasing the scope: its masters keep the values from before the call."""
        self._copy_back(scope, versions, compare=compare, aliased=set(), where="a compiled forward")

    def exposed_call_ended(self, scope: Scope, versions: DeviceVersions, *, aliased: set[int]) -> None:
        """The last running eager call of `scope` with its device copies exposed ended (Note
        [calls of a loaded scope] in engine/hooks.py): as compiled_call_ended, the copies written
        being those whose version moved or whose `.data` aliases (ids in `aliased`) were written."""
        self._copy_back(scope, versions, compare=False, aliased=aliased, where="the forward")

    def _copy_back(self, scope: Scope, versions: DeviceVersions, *, compare: bool, aliased: set[int],
                   where: str) -> None:
        if scope.state is ScopeState.OFFLOADED:
            return  # released during the call (a forced release): no copy to read
        for slot, leaf, version in versions:
            written = leaf._version != version or id(leaf) in aliased
            if not written and not (compare and _differs(slot, leaf)):
                continue
            problem = _cannot_copy_back(slot, seen=written)
            if problem is not None:
                self.streams.sync_master_reads()
                scope.release(force=True)
                raise RuntimeError(
                    f"offtensor: parameter {slot.name!r} was written in place inside {where} of "
                    f"scope {scope.name!r}, where it is a device copy; {problem}. "
                    "Write it outside the forward (before or after it), or call "
                    "offtensor.unwrap(model) first. The master keeps its values from before the call"
                )
            self.written_on_device(slot, leaf)

    def written_on_device(self, slot: ParamSlot, leaf: torch.Tensor) -> None:
        """Compiled code wrote the device copy `leaf`: its values become the master's, as an
        eager write to the master would have made them. `leaf` holds them already, so it is not
        marked stale, nor are graphs that saved it (the compiled graph orders its own reads)."""
        slot.wait_for_step()
        scope = scope_of(slot)
        scope.masters.written()  # a staged copy or host-cast shadow is stale (Note [master sources], scopes/sources.py)
        slot.retired_copies_written()
        self.streams.sync_master_reads()
        # On the current stream, which ran the forward; blocking, so the host waits for it.
        without_subclass_dispatch(_copy_into_master, slot.param, leaf)
        scope.writes.copied_now(slot, version_of(slot.param))


def _copy_into_master(param: torch.Tensor, leaf: torch.Tensor) -> None:
    # `param.detach()` shares the parameter's version counter: bumped as by an eager write.
    param.detach().copy_(leaf.detach())


def _cannot_copy_back(slot: ParamSlot, *, seen: bool) -> str | None:
    """Why a device copy written in compiled code cannot become its master's values, or None."""
    if not seen:
        return ("the write bumped no version counter (`p.data.<op>_()` under a backend that runs "
                "the graph as traced, dynamo's 'eager'), so offtensor cannot see it at every call; "
                "write through the parameter instead (`with torch.no_grad(): p.mul_(2)`)")
    if slot.packed is not None:
        return "its master is compressed or kept in a file, so the write cannot reach it"
    if slot.device_leaf.dtype != slot.param.dtype:
        return (f"the forward computes in {slot.device_leaf.dtype} while the master is "
                f"{slot.param.dtype}, so copying the write back would round the master")
    if slot.stepped_elsewhere is not None:
        return "its master is stepped by another rank (data_parallel(shard_optimizer=True))"
    if slot.scope.writes.written_in_this_call(slot):
        return "eager code also wrote its master in the same call, so the two writes conflict"
    return None


def _differs(slot: ParamSlot, leaf: torch.Tensor) -> bool:
    """The device copy's bytes differ from its master's, where they are comparable (same dtype,
    a plain master, no write to it pending in this call)."""
    if (slot.packed is not None or leaf.dtype != slot.master.dtype or slot.stepped_elsewhere is not None
            or slot.pending_step is not None or slot.scope.writes.written_in_this_call(slot)):
        return False
    master = slot.master.reshape(-1).view(torch.uint8).to(leaf.device)
    return not torch.equal(leaf.detach().reshape(-1).view(torch.uint8), master)
