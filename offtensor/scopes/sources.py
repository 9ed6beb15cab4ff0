"""Where a scope's masters live and its loads copy them from: one source object per scope
(`Scope.source`), chosen by wrap: the host buffer itself, a host-cast shadow, or a slot of the
staging ring.

# Note [master sources]
A load can read a scope's masters from several places: the host buffer itself (`BufferSource`,
pinned on CUDA), a compute-dtype copy cast on the host (`ShadowSource`, Policy(cast="host")), a
slot of the staging ring filled from pageable masters or from files (`StagedSource`,
`FileSource`: Note [staged loads] in storage/staging.py), or this rank's slice and the other
ranks' all-gather (`ShardedSource` in distributed/sharded_loads.py: Note [sharded loads]). They
differ in what must happen before a whole load (wait for deferred steps, notice a write that
left the shadow stale), where the bytes come from, how they are enqueued, what is done after,
what a write to a master means for them, and what a load costs. Written as branches, every kind
was tested in `Scope._start_load` and again in wrap, the prefetch and the timed layout, and a
new kind touched each (diffusers' disk offload grew that way). As objects behind one protocol,
`_start_load` keeps what is the scope's (the copy order, routed experts, cast staging) and asks
the source the rest without knowing its kind: a new kind is one class, in the layer that owns
its machinery, and the line of wrap (or data_parallel) that installs it. A source holds its own
state only (a shadow, the ring), a load's is its LoadProgress; each load calls `settle`,
`acquire`, `enqueue` and `after_load` in the order the branches ran, with the same copies. The
source is also the one place that says where the masters live (`home`: pinned, pageable, ring,
file), which summary() reports and the scope's host allocations follow (`Scope.pinned`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..api import MasterHome, Residency
from ..dispatch.slot import ParamSlot
from ..storage.staging import StagingRing
from .device_buffer import DeviceBuffer
from .host_masters import HostMasters
from .loading import LoadProgress
from .streams import Streams
from .write_tracking import WriteTracker


class SourcedScope(Protocol):
    """A scope as its source sees it (Scope in scopes/scope.py, above); also what the staging
    ring reads of it (StagedScope in storage/staging.py)."""

    name: str
    residency: Residency
    masters: HostMasters
    device: DeviceBuffer
    slots: list[ParamSlot]
    streams: Streams
    writes: WriteTracker

    def offloaded(self) -> bool: ...

    def frozen_now(self) -> bool: ...

    def write_mark(self) -> tuple[Any, ...]: ...


class MasterSource(Protocol):
    """Where a scope's loads copy its masters from, and what that means for a load, a write and
    a load's cost (Note [master sources])."""

    # A load may copy the masters a part at a time, straight from the host buffer: along the
    # learned copy order, chunk by chunk (Note [progressive loads] in scopes/loading.py), and
    # without the routed experts, which their ops copy later (Note [routed experts] in
    # scopes/experts.py). Else every load is whole and takes `enqueue`.
    progressive: bool
    # `acquire` gives bytes in the device buffer's layout and dtype (cast on the host), so a
    # scope that casts copies them without a staging buffer.
    device_layout: bool
    # A load is a collective: every rank of a group joins it (Note [sharded loads] in
    # distributed/sharded_loads.py), so none may skip one alone.
    gathers: bool

    @property
    def home(self) -> MasterHome:
        """Where the masters live (summary()'s masters column)."""
        ...

    def settle(self, scope: SourcedScope) -> None:
        """Before a whole load: the masters it copies are final (deferred steps done), and the
        writes tracker knows what it copies."""
        ...

    def acquire(self, scope: SourcedScope) -> torch.Tensor:
        """The host bytes the load copies from (uint8); may wait for a read."""
        ...

    def enqueue(self, scope: SourcedScope, loading: LoadProgress, host: torch.Tensor, h2d: Any,
                whole: bool) -> None:
        """Enqueue a whole load's copies from `host` on the copy stream `h2d` (the current one)
        and the event compute waits on (`loading.chunk_ready`); `whole`: the routed experts too."""
        ...

    def after_load(self, scope: SourcedScope, loading: LoadProgress) -> None:
        """The load's copies are enqueued (`loading.weights_ready` follows them)."""
        ...

    def ready(self, scope: SourcedScope) -> bool:
        """A load now would not wait on the host for its bytes (a read from a file)."""
        ...

    def host_bytes(self, scope: SourcedScope) -> int:
        """Host RAM the masters take for this source; none for masters in files."""
        ...

    def write_mark(self, scope: SourcedScope) -> tuple[Any, ...]:
        """The writes to the masters so far, as a copy of them made earlier is compared (the
        staging ring's, Note [staged loads] in storage/staging.py)."""
        ...

    def sample(self, scope: SourcedScope) -> torch.Tensor:
        """Host memory of the kind a load copies from, to time a copy (Note [a timed layout] in
        budget/layout.py); its contents do not matter."""
        ...

    def load_ms(self, scope: SourcedScope, copy_ms_per_byte: float, read_ms_per_byte: float) -> float:
        """What a load costs the link (and the drive), from the timed copy and reads."""
        ...


def settle_masters(scope: SourcedScope) -> None:
    """The masters as a whole load needs them: every deferred step done, and the writes tracker
    told what the load copies (Note [writes during a scope's call] in scopes/write_tracking.py)."""
    for slot in scope.slots:
        slot.wait_for_step()
    scope.writes.note_copied(scope.slots)


class BufferSource:
    """The masters' host buffer itself (pinned on CUDA): the default. The other sources of this
    module differ from it where they override it."""

    progressive = True
    device_layout = False
    gathers = False

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned  # the host buffer is page-locked (wrap falls back to pageable)

    @property
    def home(self) -> MasterHome:
        return MasterHome.PINNED if self.pinned else MasterHome.PAGEABLE

    def settle(self, scope: SourcedScope) -> None:
        settle_masters(scope)

    def acquire(self, scope: SourcedScope) -> torch.Tensor:
        return scope.masters.flat

    def enqueue(self, scope: SourcedScope, loading: LoadProgress, host: torch.Tensor, h2d: Any,
                whole: bool) -> None:
        loading.copy_all(host, scope.device.flat, scope.slots,
                         only=None if whole else [s for s in scope.slots if s.experts is None])
        self.copy_enqueued(scope, h2d)
        loading.mark_chunk(h2d)
        loading.staging = None

    def copy_enqueued(self, scope: SourcedScope, h2d: Any) -> None:
        """A whole load's copy out of `host` is enqueued on `h2d` (its conversions not yet)."""

    def after_load(self, scope: SourcedScope, loading: LoadProgress) -> None:
        pass

    def ready(self, scope: SourcedScope) -> bool:
        return True

    def host_bytes(self, scope: SourcedScope) -> int:
        return scope.masters.nbytes

    def write_mark(self, scope: SourcedScope) -> tuple[Any, ...]:
        return scope.masters.write_mark(scope.slots)

    def sample(self, scope: SourcedScope) -> torch.Tensor:
        return scope.masters.flat

    def load_ms(self, scope: SourcedScope, copy_ms_per_byte: float, read_ms_per_byte: float) -> float:
        return scope.masters.nbytes * copy_ms_per_byte


class ShadowSource(BufferSource):
    """Policy(cast="host"): a copy of the masters cast to the compute dtype, in the device
    buffer's layout, re-cast at a load after the masters changed."""

    progressive = False
    device_layout = True

    def __init__(self, shadow: torch.Tensor, pinned: bool) -> None:
        super().__init__(pinned)
        self.shadow = shadow  # uint8, device layout; pinned as the masters are
        # masters.master_writes when the shadow was cast (every write path counts there:
        # HostMasters.written); None: not cast from the masters as they are.
        self.cast_at: int | None = None
        self.read: Any = None  # event after the latest copy out of the shadow

    def settle(self, scope: SourcedScope) -> None:
        for slot in scope.slots:
            slot.wait_for_step()
        if scope.writes.written_since_copied():
            # A write no op on the parameter saw (`p[0].fill_()`, `p.detach().mul_()`) left the
            # shadow cast from the old masters.
            self.cast_at = None
        scope.writes.note_copied(scope.slots)

    def acquire(self, scope: SourcedScope) -> torch.Tensor:
        """The shadow, re-cast from the masters if they changed since. Waits (host side) for
        the previous copy out of it, rarely pending."""
        writes = scope.masters.master_writes
        if self.cast_at != writes:
            if self.read is not None:
                self.read.synchronize()
                self.read = None
            shadow = self.shadow
            for slot in scope.slots:
                dt, master = slot.device_view.dtype, slot.master
                n = master.numel() * dt.itemsize
                shadow[slot.device_offset : slot.device_offset + n].view(dt).view(master.shape).copy_(master)
            self.cast_at = writes
        return self.shadow

    def after_load(self, scope: SourcedScope, loading: LoadProgress) -> None:
        self.read = loading.weights_ready

    def host_bytes(self, scope: SourcedScope) -> int:
        return scope.masters.nbytes + self.shadow.nbytes

    def sample(self, scope: SourcedScope) -> torch.Tensor:
        return self.shadow

    def load_ms(self, scope: SourcedScope, copy_ms_per_byte: float, read_ms_per_byte: float) -> float:
        return scope.device.nbytes * copy_ms_per_byte


class StagedSource(BufferSource):
    """Pageable masters (Policy(pin_memory="ring"), or pinning failed), copied through a slot of
    the model's staging ring (Note [staged loads] in storage/staging.py)."""

    progressive = False
    # The engine's, shared by its staged scopes: set by wrap once every scope is laid out (the
    # ring's slots are as large as the largest staged scope).
    ring: StagingRing

    def __init__(self) -> None:
        super().__init__(pinned=False)  # pageable masters, or none (in files); the ring is page-locked

    @property
    def home(self) -> MasterHome:
        return MasterHome.RING

    def acquire(self, scope: SourcedScope) -> torch.Tensor:
        try:
            return self.ring.acquire(scope)
        except BaseException:  # a failed read: nothing is loading
            scope.device.storage.resize_(0)
            raise

    def copy_enqueued(self, scope: SourcedScope, h2d: Any) -> None:
        self.ring.copied(scope, scope.streams.record(h2d))  # the slot is free once the copy is

    def ready(self, scope: SourcedScope) -> bool:
        return self.ring.ready(scope)

    def sample(self, scope: SourcedScope) -> torch.Tensor:
        return self.ring.sample(scope.masters.nbytes)  # the host buffer is pageable


class FileSource(StagedSource):
    """Masters kept in files (Policy(host_budget), Note [masters in files] in
    storage/file_masters.py), read into a slot of the staging ring: never written, and in no
    host RAM but the ring's."""

    @property
    def home(self) -> MasterHome:
        return MasterHome.FILE

    def host_bytes(self, scope: SourcedScope) -> int:
        return 0

    def write_mark(self, scope: SourcedScope) -> tuple[Any, ...]:
        return ()

    def load_ms(self, scope: SourcedScope, copy_ms_per_byte: float, read_ms_per_byte: float) -> float:
        return scope.masters.nbytes * max(copy_ms_per_byte, read_ms_per_byte)
