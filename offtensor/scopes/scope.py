"""A scope: the parameters of one selected module, moved to the device together, and the
transitions of its state.

# Note [scope states]
A scope's parameters share one flat host buffer (the masters, pinned) and one flat device buffer
of the same layout. The state says which of them holds usable weights:
- OFFLOADED: only the host buffer. The device buffer's storage is resized to 0 bytes.
- LOADING: device storage allocated and a host-to-device copy enqueued on the copy stream;
  `weights_ready` is the event recorded after it. Compute has not yet waited for all of it: ops
  wait for the part they use (Note [progressive loads] in scopes/loading.py). What the load has
  done so far is a `LoadProgress`, `Scope.loading`, which is not None in this state only.
- RESIDENT: the compute stream has waited on `weights_ready`; ops may use the device copy.
The transitions are Scope.load (OFFLOADED -> LOADING), make_resident (-> RESIDENT) and release
(-> OFFLOADED); they change `state` and `loading` together, only in `_to_loading`,
`_to_resident` and `_to_offloaded`, each asserting the state it leaves. A load is built on the
side and the scope becomes LOADING once its copies are enqueued, so a load that raises leaves
the scope OFFLOADED without a `LoadProgress`, and its device buffer freed (`DeviceBuffer.free_after_enqueued`:
a file read, a staging buffer or an interrupt can fail after the allocation and some copies; the
free, on compute, follows them, and so does the host, whose staging the copies read). The
other per-scope enums are `Residency`, how long a copy outlives its calls (Note [VRAM budget] in
budget/vram.py), and `MasterHome`, where the masters live, which its source answers (Note
[master sources] in scopes/sources.py). The scopes of one model that are not OFFLOADED are
listed, in load order, in their `LiveScopes`.

A scope delegates to its parts, each in a module of its own with its Notes: the host side
(`HostMasters`, scopes/host_masters.py: Note [masters moved out of the host buffer]), where its
masters live and its loads copy from (a `MasterSource`, scopes/sources.py: Note [master
sources]), the device buffer (`DeviceBuffer`, scopes/device_buffer.py: Note [higher-order
gradients]), a load in flight (`LoadProgress`, scopes/loading.py: Note [progressive loads]), the
writes its device copies have not seen (`WriteTracker`, scopes/write_tracking.py: Note [writes
during a scope's call]) and the fetches of old gradients (`OldGrads`, scopes/old_grads.py: Note
[stale gradient fetches]).

# Note [autocast's cast cache]
Autocast caches the reduced-precision cast of every leaf that requires grad (a device copy is
one) until the outermost autocast region exits, to cast a weight once however often it is used.
Left so, a forward under autocast would keep a cast of every scope it released on the device: a
reduced-precision copy of the whole offloaded model, also in inference and under checkpointing,
where no graph holds them. A release therefore clears the cache (it is per thread and cannot
drop one entry): casts of resident weights are made again at their next use, with the same
values. A cast still in use by a graph stays alive through it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..api import MasterHome, Policy, Residency, ScopeState
from ..dispatch.call_counts import CallCounts
from ..dispatch.eager_step import close_window
from ..dispatch.masters import master_requires_grad
from ..dispatch.slot import ParamSlot, alive, in_backward, weakly
from ..storage.memory import HostBuffer, PinningFallback
from .device_buffer import DeviceBuffer
from .host_masters import HostMasters
from .loading import LoadPlan, LoadProgress, Traffic
from .old_grads import OldGrads
from .sources import BufferSource, MasterSource
from .streams import Streams
from .write_tracking import WriteTracker

logger = logging.getLogger("offtensor")

# Each parameter starts at a multiple of this many bytes in the flat buffers (aligned loads).
ALIGN = 256


class GradSink(Protocol):
    """Where device copies' gradients go (GradOffload in engine/grads.py, above)."""

    def on_leaf_grad(self, slot: ParamSlot, leaf: torch.Tensor) -> None: ...

    def arrived_outside(self, slot: ParamSlot) -> None: ...


class OpCopies(Protocol):
    """What an op on a parameter computes with (OpAccess in engine/access.py, above)."""

    def materialize(self, slot: ParamSlot, op_device: torch.device | None) -> torch.Tensor | None: ...

    backward_scope: Scope | None  # the scope whose backward runs now


class WritesToMasters(Protocol):
    """What a write to a master does to the device copies (MasterWrites in engine/writes.py, above)."""

    def master_written(self, slot: ParamSlot) -> None: ...

    def masters_stepped(self, scope: Scope, slots: list[ParamSlot]) -> None: ...

    def before_master_write(self, slot: ParamSlot, *, written: bool = True) -> None: ...

    def master_handed_out(self, scope: Scope, slot: ParamSlot | None = None, *, detached: bool = False) -> None: ...


class ScopeEngine(Protocol):
    """The engine as its scopes see it (Engine in engine/engine.py, above): what a scope is built
    from, and what it asks for its slots (SlotScope in dispatch/slot.py)."""

    streams: Streams
    live: LiveScopes
    device: torch.device  # the compute device
    pinning: PinningFallback

    @property
    def grads(self) -> GradSink: ...

    @property
    def access(self) -> OpCopies: ...

    @property
    def writes(self) -> WritesToMasters: ...


class CallHooks(Protocol):
    """The scope's forward hooks (ScopeHooks in engine/hooks.py, above), as the scope asks them
    about its copies exposed in a call (Note [calls of a loaded scope] there)."""

    def resident_in_call(self) -> None: ...  # it became RESIDENT during one of its calls

    def exposure_live(self) -> bool: ...  # its copies are exposed by a call that still runs

    def copies_retired(self) -> None: ...  # a release retired its copies: let go of them


class LiveScopes:
    """The scopes of one wrapped model that are not OFFLOADED, in load order."""

    def __init__(self) -> None:
        self._loaded: dict[Scope, None] = {}
        self._held_back: dict[Scope, None] = {}  # LOADING with copies held back by steps

    def __iter__(self) -> Any:
        return iter(list(self._loaded))

    def __len__(self) -> int:
        return len(self._loaded)

    def loaded(self, scope: Scope) -> None:
        self._loaded[scope] = None

    def released(self, scope: Scope) -> None:
        self._loaded.pop(scope, None)
        self._held_back.pop(scope, None)

    def holding_back(self, scope: Scope, held: bool) -> None:
        if held:
            self._held_back[scope] = None
        else:
            self._held_back.pop(scope, None)

    @property
    def holds_back(self) -> bool:
        """Some scope's copies wait for deferred steps (`pump` has work)."""
        return bool(self._held_back)

    def pump(self) -> None:
        """Enqueue the copies that waited for deferred steps now done (no host wait). Called at
        each op that waits for a chunk (make_resident): nothing held back costs no allocation."""
        if not self._held_back:
            return
        for scope in list(self._held_back):
            scope.copy_more(need=-1)

    def release_all(self, *, force: bool = False, keep_carried: bool = False) -> None:
        """Release every scope on the device; `force`: kept ones too; `keep_carried`: not the
        ones carried into the next forward."""
        for scope in list(self._loaded):
            if not (keep_carried and scope.residency is Residency.CARRIED):
                scope.release(force=force)


class Scope:
    """One selected module (or, split by Policy.max_scope_bytes, part of one): its state, the
    transitions between states, and its parts."""

    state: ScopeState = ScopeState.OFFLOADED  # changed only by the `_to_*` transitions (Note [scope states])
    loading: LoadProgress | None = None  # while LOADING, and only then
    # Bumped when any scope is offloaded or its residency is set: what a forward's prefetch
    # remembered of the kept scopes ahead holds until then (Note [kept runs] in engine/schedule.py)
    kept_changes = 0

    def __init__(self, name: str, module: nn.Module, policy: Policy, engine: ScopeEngine,
                 pinned: bool, block: str | None = None) -> None:
        self.name = name
        self.block = name if block is None else block  # the selected module (Policy.max_scope_bytes)
        self.module = module
        self.policy = policy
        self.engine = engine
        self.requires_grad_seen = -1  # Note [requires_grad changes] (dispatch/ops.py)
        self.holds_seen = -1  # Note [masters held from ops] (dispatch/slot.py)
        self.exposed = False  # its copies stand in for its parameters in a call (engine/hooks.py)
        self.hooks: CallHooks | None = None  # set by the engine's hooks (install, remove)
        self.streams: Streams = engine.streams
        self.live: LiveScopes = engine.live
        self.grad_sink = engine.grads.on_leaf_grad  # gradients handled as they arrive (engine/grads.py)
        self.slots: list[ParamSlot] = []
        self.routed: list[ParamSlot] = []  # Note [routed experts] (scopes/experts.py)
        self.masters = HostMasters()
        # Where the masters live and loads copy them from: wrap chooses it (pageable or staged
        # when pinning fails), data_parallel(shard_loads=True) wraps it (Note [master sources]
        # in scopes/sources.py).
        self.source: MasterSource = BufferSource(pinned)
        self.device = DeviceBuffer()
        self.writes = WriteTracker(self.streams, self.slots)
        self.traffic = Traffic()  # bytes to the device since wrap; routed experts' hits
        self.old_grads = OldGrads(self.streams, self.slots, self.traffic)
        # The load converts: Policy.compute_dtype differs from a master's dtype (the load casts,
        # Policy.cast), or a master is compressed (dequantized on the device).
        self.casts = False
        self.compute_dtype_differs = False  # the first of those (ops compute in another dtype)
        self.first_uses: dict[ParamSlot, None] = {}  # first forward: parameters in order of use
        self.copy_order: list[ParamSlot] | None = None  # learned from first_uses
        self.load_plan: LoadPlan | None = None  # a progressive load's copies, from copy_order
        self.grads_offloaded: Any = None  # event on the d2h stream after this backward's grads
        self.calls = CallCounts()  # of the module's forward (Note [call counts] in dispatch/call_counts.py)
        self.loads = 0  # host-to-device loads of the weights, since wrap
        self.loads_on_demand = 0  # of which not prefetched: offloaded when the scope needed them
        # STREAMED, or KEPT by Policy.vram_budget (only a forced release offloads it), or
        # CARRIED: streamed, left resident by a backward's or an inference pass's end for the
        # next forward, which computes it first (Note [carried into the next forward] in budget/vram.py).
        self.residency = Residency.STREAMED  # set by set_residency

    def set_residency(self, residency: Residency) -> None:
        self.residency = residency
        Scope.kept_changes += 1

    @property
    def weights_ready(self) -> Any:
        """The event after the whole weights' copy (the copy stream runs in order); None: no copy pending."""
        loading = self.loading
        return loading.weights_ready if loading is not None else None

    @property
    def pinned(self) -> bool:
        """The masters are page-locked, and so is the host memory the scope allocates."""
        return self.source.home is MasterHome.PINNED

    def host_bytes(self) -> int:
        """Host RAM of the masters (and host shadow); none for masters in files."""
        return self.source.host_bytes(self)

    def offloaded(self) -> bool:
        return self.state is ScopeState.OFFLOADED

    def frozen_now(self) -> bool:
        """No parameter requires grad or waits for a deferred step: only a write through a
        parameter (or an alias) can change the masters, which write_mark sees."""
        return not any(master_requires_grad(slot.param) or slot.step_pending for slot in self.slots)

    def write_mark(self) -> tuple[Any, ...]:
        """The writes to the masters so far, as the staging ring compares them (MasterSource.write_mark)."""
        return self.source.write_mark(self)

    def device_bytes(self) -> int:
        return self.device.storage.nbytes() + self.old_grads.held_bytes()

    def num_params(self) -> int:
        return sum(s.param.numel() for s in self.slots)

    def learn_copy_order(self) -> None:
        """After the first forward: copy parameters in the order it first used them."""
        if self.copy_order is None and self.first_uses:
            used = list(self.first_uses)
            self.set_copy_order(used + [s for s in self.slots if s not in self.first_uses])
            self.first_uses.clear()

    def set_copy_order(self, order: list[ParamSlot]) -> None:
        """Copy in `order`, routed experts last (Note [routed experts] in scopes/experts.py)."""
        self.copy_order = sorted(order, key=lambda s: s.experts is not None)  # stable
        for i, slot in enumerate(self.copy_order):
            slot.copy_index = i

    def temporary_copy(self, slot: ParamSlot, op_device: torch.device | None,
                       needs_grad: bool) -> torch.Tensor:
        """A copy of the master for one op outside the parameter's scope (tied weights,
        functional calls). Its gradient takes the same path as the scope's device copy."""
        master = slot.param
        dtype = slot.device_view.dtype
        # A compressed master's values, unpacked on the host (Note [compressed masters]).
        values = slot.packed.unpack() if slot.packed is not None else slot.master
        if op_device is None or op_device.type == "cpu":
            copy = values.to(dtype=dtype, copy=True)
        else:
            copy = torch.empty(master.shape, dtype=dtype, device=op_device)
            # slot.master is detached: the copy is a leaf of its own, not a CopyBackwards of
            # the master, without grad mode (Note [interrupts]).
            copy.copy_(values, non_blocking=True)  # current stream: ordered with its use
            if op_device.type == "cuda":
                self.streams.reads_masters(self.streams.record(torch.cuda.current_stream(op_device)))
        self.traffic.bytes_to_device += copy.nbytes
        if needs_grad:
            copy.requires_grad_(True)
            copy.register_post_accumulate_grad_hook(weakly(self.grad_sink, slot))
            slot.temporaries = alive(slot.temporaries) + [weakref.ref(copy)]
        return copy

    def move_masters_into(self, buffer: HostBuffer) -> None:
        """Point the masters at `buffer` (a HostBuffer with this scope's layout that already
        holds their values: shared memory, Note [one host copy per node] in
        distributed/shared_masters.py). The parameter objects stay; their data moves. Only while
        OFFLOADED with no deferred step pending."""
        assert self.state is ScopeState.OFFLOADED and not any(s.step_pending for s in self.slots)
        self.masters.move_into(self.slots, buffer)

    def take_back_masters(self) -> None:
        """Masters moved out of the host buffer go back into it (Note [masters moved out of the
        host buffer] in scopes/host_masters.py)."""
        self.masters.take_back(self.slots)

    # ---- writes the device copies have not seen (Note [writes during a scope's call]) --------

    def refresh(self, slot: ParamSlot) -> None:
        self.writes.refresh(slot)
        if slot.experts is not None:
            slot.experts.all_there()

    # ---- transitions (Note [scope states]) -----------------------------------------------

    def load(self, *, with_grads: bool) -> None:
        """OFFLOADED -> LOADING: allocate on compute, copy host->device on the copy stream;
        `with_grads`: also fetch the existing host gradients (accumulation)."""
        if self.state is ScopeState.OFFLOADED:
            close_window()  # Note [an eager optimizer step] in dispatch/eager_step.py
            self._start_load()
        if with_grads:
            self.old_grads.fetch(self.device.flat.device)

    def _start_load(self) -> None:
        """Enqueue the load: progressive along the learned copy order when the source allows it,
        else whole by the source (Note [master sources] in scopes/sources.py)."""
        self.take_back_masters()
        if self.device.last_retired is not None and _take_back_retired(self):
            return
        self.device.allocate(self.streams)
        try:
            loading = _enqueue_load(self)
        except BaseException:  # Note [scope states]: nothing may hold the buffer now
            self.device.free_after_enqueued(self.streams, self.slots)
            raise
        self._to_loading(loading)
        self.loads += 1
        self.live.loaded(self)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("load %s (%.1f MiB)%s", self.name, self.masters.nbytes / 2**20, self.streams.memory())

    def copy_more(self, need: int) -> None:
        """Enqueue the next copies of a progressive load (LoadProgress.copy_more): those up to
        position `need` in copy_order even if the host must wait for their deferred steps."""
        loading = self.loading
        assert loading is not None
        with self.streams.enqueuing():  # Note [copies an interrupt left] in scopes/streams.py
            loading.copy_more(need)
        self.live.holding_back(self, loading.held_back)

    def make_resident(self, upto: ParamSlot | None = None) -> None:
        """-> RESIDENT: the compute stream waits (device side) for the weights' copy; with
        `upto`, only for the chunks up to the one holding that parameter (Note [progressive
        loads] in scopes/loading.py). Copies still held back by deferred optimizer steps are
        enqueued first, the host waiting for the steps they need."""
        if self.state is ScopeState.RESIDENT:
            return
        if self.state is ScopeState.OFFLOADED:
            self.load(with_grads=False)
        self.live.pump()
        loading = self.loading
        assert loading is not None
        if loading.held_back:
            need = loading.end - 1 if upto is None else upto.copy_index
            if need >= loading.cursor:
                self.copy_more(need)
        self.compute_waits(None if upto is None else upto.chunk)

    def resident_for_backward(self) -> None:
        """make_resident, then every routed expert if rows a graph saved may read were
        forgotten since (Note [routed experts in backward] in scopes/experts.py)."""
        self.make_resident()
        for slot in self.routed:
            if slot.experts is not None and slot.experts.saved_lost:
                slot.experts.fill_all()

    def compute_waits(self, chunk: int | None) -> None:
        """The compute stream waits (device side) for the load's chunks up to `chunk` (None:
        every chunk enqueued); -> RESIDENT once it has waited for the whole load."""
        loading = self.loading
        assert loading is not None
        if loading.compute_waits(chunk):
            self._to_resident()

    def release(self, *, force: bool = False) -> None:
        """-> OFFLOADED: free the device copy, ordered after every queued use of it. A scope
        kept by the VRAM budget stays, unless `force` (its masters changed, or unwrap)."""
        if self.state is ScopeState.OFFLOADED or (self.residency is Residency.KEPT and not force):
            return
        streams = self.streams
        if self.loading is not None:
            # A prefetch nobody used, a call that raised: the free must follow every copy and
            # conversion the load enqueued, not only its last chunk's (Note [a release after a
            # load's last event]).
            self.loading.compute_waits(None)
        streams.wait_for_left_copies()  # Note [copies an interrupt left] in scopes/streams.py
        self.old_grads.drop()
        self.writes.in_call.clear()  # the next load copies the masters as they are
        # OFFLOADED before the memory goes: an interrupt between the two leaves a buffer that the
        # next load allocates again in place, never a RESIDENT scope without memory (Note [interrupts])
        self._to_offloaded()
        # Retired instead under a saved graph (Note [higher-order gradients]), which alone keeps them
        if self.device.free(self.slots) and self.hooks is not None:
            self.hooks.copies_retired()
        _forget_routed(self)
        torch.clear_autocast_cache()  # Note [autocast's cast cache]
        if self.residency is Residency.CARRIED:
            self.set_residency(Residency.STREAMED)
        self.live.released(self)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("release %s%s", self.name, streams.memory())

    def _to_loading(self, loading: LoadProgress) -> None:
        assert self.state is ScopeState.OFFLOADED and self.loading is None, self.state
        self.state, self.loading = ScopeState.LOADING, loading

    def _to_resident(self) -> None:
        assert self.state is ScopeState.LOADING, self.state
        self.state, self.loading = ScopeState.RESIDENT, None
        if self.calls.running and self.hooks is not None:
            self.hooks.resident_in_call()  # Note [calls of a loaded scope] in engine/hooks.py

    def exposure_live(self) -> bool:
        """The copies are exposed by a call that still runs: not by one a KeyboardInterrupt ended
        (which this forgets, as the scope's next call would)."""
        return self.exposed and self.hooks is not None and self.hooks.exposure_live()

    def _to_offloaded(self) -> None:
        assert self.state is not ScopeState.OFFLOADED
        self.state, self.loading = ScopeState.OFFLOADED, None
        Scope.kept_changes += 1

    # ---- what its slots ask of the engine (SlotScope in dispatch/slot.py) -------------------------

    def compute_device(self) -> torch.device:
        return self.engine.device

    def materialize(self, slot: ParamSlot, op_device: torch.device | None) -> torch.Tensor | None:
        """The tensor an op on `slot`'s parameter computes with; None: the master (engine/access.py)."""
        return self.engine.access.materialize(slot, op_device)

    def in_its_backward(self) -> bool:
        return self.engine.access.backward_scope is self  # asked only outside the scope's calls

    def master_written(self, slot: ParamSlot) -> None:
        self.engine.writes.master_written(slot)

    def masters_stepped(self, slots: list[ParamSlot]) -> None:
        self.engine.writes.masters_stepped(self, slots)

    def before_master_write(self, slot: ParamSlot, *, written: bool = True) -> None:
        self.engine.writes.before_master_write(slot, written=written)

    def master_handed_out(self, slot: ParamSlot, *, detached: bool = False) -> None:
        self.engine.writes.master_handed_out(self, slot, detached=detached)

    def arrived_outside(self, slot: ParamSlot) -> None:
        self.engine.grads.arrived_outside(slot)

    def new_host_memory(self, nbytes: int, what: str) -> torch.Tensor:
        """Host memory of the scope's kind (page-locked unless pinning failed, storage/memory.py)."""
        return self.engine.pinning.empty(nbytes, pin=self.pinned, what=what)

    # ---- old gradients for accumulation (Note [stale gradient fetches]) ---------------------

    def take_old_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        return self.old_grads.take(slot)


def scope_of(slot: ParamSlot) -> Scope:
    """The Scope a slot belongs to, for the layers from here up (below, it is a SlotScope)."""
    return cast(Scope, slot.scope)


def _routed_loaded(scope: Scope, progressive: bool) -> bool:
    """Whether a load starting now copies the scope's routed experts whole: in backward, or
    when it converts or its source copies whole; else ops copy theirs (Note [routed experts] in
    scopes/experts.py)."""
    plain = scope.source.progressive and not scope.casts
    whole = not scope.routed or in_backward() or not (progressive or plain)
    if not whole:
        _forget_routed(scope)
        scope.writes.note_copied(scope.routed)  # what an op copies later is current then
        return False
    for slot in scope.routed:
        if slot.experts is not None:
            slot.experts.all_there()
    return True

def _forget_routed(scope: Scope) -> None:
    """At each load and release: always, as an interrupted one may have left any of the rows'
    marks set (ExpertRows.forget); marked lost to a graph while a call since the last backward
    could add to a gradient (Note [routed experts in backward] in scopes/experts.py)."""
    graph_reads = scope.calls.grad_since_backward > 0
    for slot in scope.routed:
        if slot.experts is not None:
            slot.experts.forget(graph_reads=graph_reads)


def _take_back_retired(scope: Scope) -> bool:
    """A load that takes back the copies the last retire left, when they hold what it would copy
    (Note [retired copies taken back] in scopes/device_buffer.py): OFFLOADED -> RESIDENT with
    nothing copied. False: the load copies."""
    if scope.device.taking_back:
        scope.device.undo_take_back(scope.slots)
    if (scope.routed or scope.source.gathers or any(slot.pending_step is not None for slot in scope.slots)
            or not scope.writes.copies_current(len(scope.slots), versions_read=False)
            or not scope.device.take_back_retired(scope.slots)):
        return False
    scope._to_loading(LoadProgress(scope.streams, scope.writes.note_copied, scope.traffic))
    scope.live.loaded(scope)
    scope.compute_waits(None)
    return True


def _enqueue_load(scope: Scope) -> LoadProgress:
    """The copies (and conversions) of the scope's load into its allocated device buffer, enqueued."""
    streams, source = scope.streams, scope.source
    h2d = streams.h2d()
    loading = LoadProgress(streams, scope.writes.note_copied, scope.traffic)  # the scope's once LOADING
    progressive = scope.copy_order is not None and source.progressive
    if not progressive:
        source.settle(scope)
    host = source.acquire(scope)
    whole = _routed_loaded(scope, progressive)  # Note [routed experts] (scopes/experts.py)
    with streams.enqueuing(), streams.on(h2d):  # plain tensors, no grad (Note [interrupts])
        if scope.casts and not source.device_layout:
            loading.stage(scope.masters.nbytes, scope.device.flat.device)
        if progressive:
            assert scope.copy_order is not None
            plan = scope.load_plan
            if plan is None or not plan.current(scope.copy_order):  # Note [load plans] (scopes/loading.py)
                plan = scope.load_plan = LoadPlan(scope.copy_order, scope.casts, scope.device.flat.device,
                                              routed=len(scope.routed))
            loading.follow(plan, host, scope.device.flat, routed=whole)
            loading.copy_more(-1)
            scope.live.holding_back(scope, loading.held_back)
        else:
            source.enqueue(scope, loading, host, h2d, whole)
            streams.reads_masters(loading.weights_ready)
    source.after_load(scope, loading)
    return loading
