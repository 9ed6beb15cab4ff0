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
"""

from __future__ import annotations

import torch

from ..dispatch.slot import ParamSlot
from .streams import Streams


class DeviceBuffer:
    """The bytes of one scope's device copies (compute dtypes), one flat storage on the device."""

    def __init__(self) -> None:
        self.flat = torch.empty(0, dtype=torch.uint8)  # on the compute device; set by wrap
        self.nbytes = 0  # compute-dtype layout; set by wrap
        # A create_graph backward used the device copies: its graph may read them later, so
        # the release retires the storage instead of freeing it (Note [higher-order gradients]).
        self.graph_saved = False
        self.copies_made = 1  # sets of device copies made: at wrap, then at each `_retire`

    @property
    def storage(self) -> torch.UntypedStorage:
        return self.flat.untyped_storage()

    def allocate(self, streams: Streams) -> None:
        """Allocate the storage on the compute stream; the copy stream waits for that (Note
        [ordering across streams] in scopes/streams.py)."""
        self.flat.untyped_storage().resize_(self.nbytes)  # not the property: at each load
        streams.wait(streams.h2d(), streams.record(streams.compute()))  # alloc_done

    def free(self, slots: list[ParamSlot]) -> None:
        """Give the memory back (on the compute stream, after every queued use), or leave it
        to the graphs that saved it (Note [higher-order gradients])."""
        if self.graph_saved:
            self._retire(slots)
        else:
            self.flat.untyped_storage().resize_(0)

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
        for slot in slots:
            slot.retire_device_copy(flat)
        flat.untyped_storage().resize_(0)
        self.flat = flat
        self.graph_saved = False
        self.copies_made += 1
