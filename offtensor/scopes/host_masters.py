"""Where a scope's masters live on the host, and the host bytes its loads copy from: the flat
host buffer, the compute-dtype shadow of `Policy(cast="host")`, the staging ring or files.

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
shared memory, finds a moved master by its address (one comparison per parameter), copies it
back into its place in the host allocation and points the parameter at it again (pinned again
on CUDA). The other process keeps the copy it got; what this process writes afterwards, it does
not see.
"""

from __future__ import annotations

from typing import Any

import torch

from ..api import MasterHome
from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import ParamSlot
from ..storage.file_masters import FileScope
from ..storage.memory import HostBuffer
from ..storage.staging import StagingRing
from .write_tracking import version_of


class HostMasters:
    """The host side of one scope: its masters' allocation and what its loads read."""

    def __init__(self, pinned: bool) -> None:
        # Where the masters live and how loads read them (`home`, the one meaning of the word:
        # Note [staged loads] in storage/staging.py); wrap sets FILE or RING, with `ring` (the
        # engine's StagingRing) and, for FILE, `files` (a FileScope: where in the files each master is).
        self.home = MasterHome.PINNED if pinned else MasterHome.PAGEABLE
        self.ring: StagingRing | None = None
        self.files: FileScope | None = None
        self.nbytes = 0  # the host buffer, master dtypes
        # Both replaced by wrap's _offload_params right after construction.
        self.flat = torch.empty(0, dtype=torch.uint8)  # pinned when `pinned`; all the masters' bytes
        self.buffer: HostBuffer | None = None  # the allocation `flat` spans
        self.shadow: torch.Tensor | None = None  # uint8, device layout (cast="host")
        self.shadow_stale = True  # masters changed since the shadow was cast
        self.shadow_read: Any = None  # event after the latest copy from the shadow
        # Writes through the parameters so far (before_master_write, `.data` taken), for
        # write_mark: a staged copy of pageable masters read before one is stale.
        self.master_writes = 0

    @property
    def pinned(self) -> bool:
        return self.home is MasterHome.PINNED

    def host_bytes(self) -> int:
        """Host RAM of the masters (and the shadow); none for masters in files."""
        if self.home is MasterHome.FILE:
            return 0
        return self.nbytes + (self.shadow.nbytes if self.shadow is not None else 0)

    def write_mark(self, slots: list[ParamSlot]) -> tuple[Any, ...]:
        """The writes to the masters so far, as the staging ring compares them (Note [staged
        loads] in storage/staging.py): through the parameters, their views and detached
        aliases (versions), and through `p.data` aliases (their own versions, Note [p.data
        aliases] in dispatch/slot.py); masters in files are never written."""
        if self.home is MasterHome.FILE:
            return ()
        return (self.master_writes, *((version_of(slot.param), slot.data_versions()) for slot in slots))

    def refresh_shadow(self, slots: list[ParamSlot]) -> None:
        """Policy(cast="host"): re-cast the masters into the compute-dtype host copy after they
        changed. Waits (host side) for the previous copy out of the shadow, rarely pending."""
        if not self.shadow_stale:
            return
        if self.shadow_read is not None:
            self.shadow_read.synchronize()
            self.shadow_read = None
        shadow = self.shadow
        assert shadow is not None
        for slot in slots:
            dt, master = slot.device_view.dtype, slot.master
            n = master.numel() * dt.itemsize
            shadow[slot.device_offset : slot.device_offset + n].view(dt).view(master.shape).copy_(master)
        self.shadow_stale = False

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
        self.shadow_stale = True
        self.master_writes += 1

    def take_back(self, slots: list[ParamSlot]) -> None:
        """Copy the masters moved out of the host buffer (into shared memory) back into it and
        point the parameters at them (Note [masters moved out of the host buffer])."""
        base, buffer = self.flat.data_ptr(), self.buffer
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
            self.shadow_stale = True
            self.master_writes += 1


def _set_master(p: torch.Tensor, master: torch.Tensor) -> None:
    """`p.data = master` itself (not OffloadedParameter's copy into the master); call with
    subclass dispatch off."""
    torch._C.TensorBase.data.__set__(p, master)  # type: ignore[attr-defined]
