"""A scope's masters on the host: the flat host buffer (or, for masters in files, where in the
files), and the count of writes to them. Which of those places holds them, and where its loads
copy from, is the scope's source (scopes/sources.py, Note [master sources]).

# Note [masters moved out of the host buffer]
A tensor sent to another process through multiprocessing's ForkingPickler (a spawned
DataLoader worker given a dataset that holds the model, a torch.multiprocessing queue carrying
a state dict) is moved into shared memory in place: `share_memory_()` swaps the storage's memory
under every tensor that uses it. For a master that storage is the parameter's own, so the
parameter and `ParamSlot.master` follow the move, but the flat host buffer, a tensor over the
scope's whole host allocation, does not: the loads that copy from it (whole-scope loads,
converting loads' staging copies, sharded loads) would go on copying the weights as they were
at the move while the optimizer steps the moved masters, and the forward would compute with
stale weights. `take_back`, at each load and before data_parallel copies the masters into
shared memory, finds a moved master by its address (all compared in one map), copies it
back into its place in the host allocation and points the parameter at it again (pinned again
on CUDA). The other process keeps the copy it got; what this process writes afterwards, it does
not see.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import ParamSlot
from ..storage.file_masters import FileScope
from ..storage.memory import HostBuffer
from .write_tracking import version_of


class HostMasters:
    """The host side of one scope: its masters' allocation and the writes to them."""

    def __init__(self) -> None:
        # For masters in files (the scope's source is a FileSource, set with it by wrap): where
        # in the files each master is (Note [masters in files] in storage/file_masters.py).
        self.files: FileScope | None = None
        self.nbytes = 0  # the host buffer, master dtypes
        # Both replaced by wrap's _offload_params right after construction.
        self.flat = torch.empty(0, dtype=torch.uint8)  # all the masters' bytes; pinned when Scope.pinned
        self.buffer: HostBuffer | None = None  # the allocation `flat` spans
        # Writes through the parameters so far (`written`), for write_mark and the sources: a
        # staged copy, a host-cast shadow or a cached expert row made before one is stale.
        self.master_writes = 0
        # The host buffer's address and each master's address in it, in slot order (take_back)
        self._places: tuple[int, list[int]] | None = None

    def written(self) -> None:
        """The masters change, or may change unseen (a write through a parameter, `p.data` handed
        out, a move; engine/writes.py and here): copies made from them before are stale."""
        self.master_writes += 1

    def write_mark(self, slots: list[ParamSlot]) -> tuple[Any, ...]:
        """The writes to the masters so far, as the staging ring compares them (Note [staged
        loads] in storage/staging.py): through the parameters, their views and detached
        aliases (versions), and through `p.data` aliases (their own versions, Note [p.data
        aliases] in dispatch/slot.py)."""
        return (self.master_writes, *((version_of(slot.param), slot.data_versions()) for slot in slots))

    def move_into(self, slots: list[ParamSlot], buffer: HostBuffer) -> None:
        """Point the masters at `buffer` (a HostBuffer with this layout that already holds their
        values); each master keeps a storage of its own (Note [one storage per master] in
        storage/memory.py)."""
        for slot in slots:
            p = slot.param
            master = buffer.tensor(slot.offset, p.dtype, p.shape)
            without_subclass_dispatch(_set_master, p, master)
            slot.master = master
        self.flat = buffer.flat
        self.buffer = buffer
        self.written()

    def take_back(self, slots: list[ParamSlot]) -> None:
        """Copy the masters moved out of the host buffer (into shared memory) back into it and
        point the parameters at them (Note [masters moved out of the host buffer]). `slots`:
        the scope's, at every call (the places are worked out once per host buffer)."""
        base, buffer = self.flat.data_ptr(), self.buffer
        places = self._places
        if places is None or places[0] != base:
            self._places = places = (base, [base + slot.offset for slot in slots])
        # Every master in its place, asked in one C map at each load: none moved, nothing to do
        if list(map(_DATA_PTR, map(_MASTER, slots))) == places[1]:
            return
        for slot in slots:
            master = slot.master
            if slot.packed is not None or master.data_ptr() == base + slot.offset or master.numel() == 0:
                continue  # a compressed master is not the parameter's storage (Note [compressed masters])
            assert buffer is not None
            slot.wait_for_step()  # the worker may be writing the moved master
            place = buffer.tensor(slot.offset, master.dtype, master.shape)
            place.copy_(master)
            without_subclass_dispatch(_set_master, slot.param, place)
            slot.master = place
            self.written()


_DATA_PTR = torch._C.TensorBase.data_ptr
_MASTER = operator.attrgetter("master")


def _set_master(p: torch.Tensor, master: torch.Tensor) -> None:
    """`p.data = master` itself (not OffloadedParameter's copy into the master); call with
    subclass dispatch off."""
    torch._C.TensorBase.data.__set__(p, master)  # type: ignore[attr-defined]
