"""A scope's flat device buffer: its storage allocated for each load, freed or retired at each
release.

# Note [higher-order gradients]
`torch.autograd.grad(y, x, create_graph=True)` (gradient penalties, `hvp`, `hessian`) builds a
graph of the backward itself, and that graph saves the scopes' device copies (the weight of a
linear's input gradient). Differentiating it again reads them directly, through no hook of
offtensor's, possibly several times (`retain_graph=True`) and at any later time. Resizing their
storage to 0 bytes at release would leave that graph reading freed memory. So a scope whose
backward ran with grad mode on (which is what create_graph means; the output-gradient hook sees
it) is marked `graph_saved`, and its release *retires* the device storage instead: the scope
gets a new, empty device storage (new device copies, same hooks) for its next load, and the old
one, untouched, lives exactly as long as some graph refers to it; reference counting frees it
with the last such graph. A later write to the master (an optimizer step) bumps the version
counter of the retired copies, so that differentiating the old graph raises autograd's usual
"modified by an inplace operation" error, as it would without offloading.
`backward(create_graph=True)` into an offloaded parameter's `.grad` cannot work (the host `.grad`
carries no graph) and raises.

# Note [retired copies taken back]
Autograd sums all contributions to a plain parameter's gradient in its one leaf's input buffer,
in arrival order. A scope's copies are that one leaf across its calls (a load refills them), but
after a retire the next call (an R1 penalty's second forward) would differentiate new copies:
two leaves, summed apart and added on the host, (a + b) + c against autograd's (a + c) + b. So
the load after a retire takes the retired copies back while a graph holds them (their storage is
alive) and they hold what a load would copy: no gradient left on them (a backward that raised),
the requires_grad of their parameter and of the copy they replace (Note [requires_grad changes]
in dispatch/ops.py), no write to the masters since (a seen one empties `slot.retired`, an unseen
one shows in the versions), no deferred step, no routed experts (their rows change per call),
and a source that loads alone (a sharded load is a collective). Nothing is copied, and the scope
stays `graph_saved`: the next release retires this storage again.
"""

from __future__ import annotations

import weakref

import torch

from ..dispatch.slot import LeafHooks, ParamSlot
from .streams import Streams


class DeviceBuffer:
    """The bytes of one scope's device copies (compute dtypes), one flat storage on the device."""

    def __init__(self) -> None:
        self.flat = torch.empty(0, dtype=torch.uint8)  # on the compute device; set by wrap
        self.nbytes = 0  # compute-dtype layout; set by wrap
        # A create_graph backward used the device copies: its graph may read them later, so
        # the release retires the storage instead of freeing it (Note [higher-order gradients]).
        self.graph_saved = False
        self.copies_made = 1  # sets of device copies made: at wrap, then at each `_retire` or take-back
        # The device copies the last retire left to the graphs, with the hooks on each, until the
        # next load (Note [retired copies taken back]).
        self.last_retired: list[tuple[weakref.ref, LeafHooks]] | None = None
        self.taking_back = False  # set while a take-back switches the slots' copies, one by one

    @property
    def storage(self) -> torch.UntypedStorage:
        return self.flat.untyped_storage()

    def allocate(self, streams: Streams) -> None:
        """Allocate the storage on the compute stream; the copy stream waits for that (Note
        [ordering across streams] in scopes/streams.py)."""
        self.last_retired = None
        self.flat.untyped_storage().resize_(self.nbytes)  # not the property: at each load
        streams.wait(streams.h2d(), streams.record(streams.compute()))  # alloc_done

    def free(self, slots: list[ParamSlot]) -> bool:
        """Give the memory back (on the compute stream, after every queued use), or leave it
        to the graphs that saved it (Note [higher-order gradients]): True."""
        if self.graph_saved:
            self._retire(slots)
            return True
        self.flat.untyped_storage().resize_(0)
        return False

    def free_after_enqueued(self, streams: Streams, slots: list[ParamSlot]) -> None:
        """`free`, after every copy and conversion enqueued into the buffer so far: for a load
        that raised before its scope was LOADING (Note [scope states] in scopes/scope.py)."""
        compute = streams.compute()
        for end in (streams.record(streams.h2d()), streams.record(streams.cast())):
            streams.wait(compute, end)  # the free, on compute, follows every copy into the buffer
            if end is not None:
                end.synchronize()  # host memory the copies read (staging, a cast shadow) is reusable
        self.free(slots)

    def _retire(self, slots: list[ParamSlot]) -> None:
        """A new, empty storage and new device copies; the old ones are left to the graphs
        that hold them."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.flat.device)
        retired = []
        for slot in slots:
            hooks = slot.leaf_hooks
            retired.append((slot.retire_device_copy(flat), hooks))
        flat.untyped_storage().resize_(0)
        self.flat = flat
        self.graph_saved = False
        self.copies_made += 1
        self.last_retired = retired

    def take_back_retired(self, slots: list[ParamSlot]) -> bool:
        """Make the copies the last retire left the scope's device copies again, if a graph still
        holds them and no write to a master that offtensor saw came since (the caller asks the
        rest: Note [retired copies taken back]). False: the load copies into a new storage."""
        retired = self.last_retired
        if retired is None:
            return False
        leaves = [ref() for ref, _ in retired]
        held = next((leaf for leaf in leaves if leaf is not None), None)
        if held is None or any(not slot.retired or slot.retired[-1] is not ref or slot.arrived
                               for slot, (ref, _) in zip(slots, retired, strict=True)):
            return False
        for slot, leaf in zip(slots, leaves, strict=True):
            if leaf is None:
                continue
            if leaf.grad is not None:
                return False  # a gradient the path has not taken (a backward that raised left it)
            if leaf.requires_grad != slot.device_leaf.requires_grad or leaf.requires_grad != slot.requires_grad:
                return False  # Note [requires_grad changes] in dispatch/ops.py
        flat = torch.empty(0, dtype=torch.uint8, device=self.flat.device)
        flat.set_(held.untyped_storage())
        assert flat.numel() == self.nbytes, (flat.numel(), self.nbytes)
        # An interrupt in the loop leaves some slots switched: the next load undoes them
        # (`undo_take_back`). `graph_saved` before the storage: never a free of what a graph holds.
        self.taking_back = True
        for slot, leaf, (_, hooks) in zip(slots, leaves, retired, strict=True):
            slot.take_back_device_copy(flat, leaf, hooks)
        self.graph_saved = True  # the graph still holds this storage
        self.flat = flat
        self.copies_made += 1
        self.last_retired = None
        self.taking_back = False
        return True

    def undo_take_back(self, slots: list[ParamSlot]) -> None:
        """After a take-back an interrupt cut short: the slots it switched get new copies in the
        current storage, as a retire makes them; the load then copies (Note [interrupts])."""
        storage = self.flat.untyped_storage()
        if not storage.nbytes():  # not switched yet (else only the flags below were left)
            storage.resize_(self.nbytes)  # device_copy needs the memory, as in `_retire`
            for slot in slots:
                if slot.device_leaf.untyped_storage()._cdata != storage._cdata:
                    slot.retire_device_copy(self.flat)
            storage.resize_(0)
        self.copies_made += 1
        self.last_retired = None
        self.taking_back = False
