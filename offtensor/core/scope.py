"""A scope: the parameters of one selected module, moved to the device together, and the
transitions of its state.

# Note [scope states]
A scope's parameters share one flat host buffer (the masters, pinned) and one flat device buffer
of the same layout. The state says which of them holds usable weights:
- OFFLOADED: only the host buffer. The device buffer's storage is resized to 0 bytes.
- LOADING: device storage allocated and a host-to-device copy enqueued on the copy stream;
  `weights_ready` is the event recorded after it. Compute has not yet waited for all of it: ops
  wait for the part they use (Note [progressive loads]). What the load has done so far is a
  `LoadProgress`, which exists only in this state (`Scope.loading`).
- RESIDENT: the compute stream has waited on `weights_ready`; ops may use the device copy.
The transitions are Scope.load (OFFLOADED -> LOADING), make_resident (-> RESIDENT) and release
(-> OFFLOADED). What a parameter "is" follows from its scope's state; the only other
per-scope enums are `Residency`, how long a copy outlives its calls (streamed: until they
end; kept or carried under a VRAM budget: Note [VRAM budget] in core/schedule.py), and
`MasterHome`, where the masters live and how a load reads them (pinned or pageable RAM, or
staged through the staging ring from pageable RAM or a file: Note [staged loads] in
weights/file_masters.py). The scopes of one model that are not OFFLOADED are listed, in load order,
in their `LiveScopes`.

# Note [progressive loads]
A scope's first forward records the order in which its parameters are first used. From then on
its host-to-device copy goes parameter by parameter in that order, with an event every
CHUNK_BYTES, and each op makes compute wait only for the chunk that holds its weights. The first
matmul of a block starts when its own weights have landed, not the whole block: for the first
scope of a pass, which nothing can hide, this turns a whole-block stall into a one-matrix stall.
Backward needs the whole scope before its first op (autograd reads the saved device copies
directly), so pre_backward waits for every chunk.
A load that converts (`Policy(cast="device")`, `Policy(frozen_format)`) is progressive too: the
master bytes of each chunk cross into a staging buffer on the copy stream, and the cast stream
converts that chunk into the device copies once its copy has landed; the chunk's event is
recorded after its conversion. The conversions thus overlap the next chunks' copies instead of
delaying them, and the first op waits for its own matrix's copy and conversion only (see Note
[streams and events]). The staging buffer (host layout, the scope's `nbytes`) lives until the
last conversion is enqueued; the allocator holds its memory until the cast stream is past it.

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

# Note [stale gradient fetches]
When a backward will add to an existing `p.grad` (gradient accumulation), the old host gradient
is fetched to the device together with the scope's weights (`_fetch_old_grads`), once backward
has started (its pre_backward, or a prefetch in backward). Not before: the prefetch for backward
at the end of the forward loads weights only, because between forward and backward the user may
change `p.grad` in ways no check can see: `p.grad.data.zero_()` or `p.grad.data.mul_(s)` write
through a tensor with a version counter of its own, and backward added to the gradient as it was
before the write. Writes that can still come after a fetch (`optimizer.zero_grad()` in a hook,
or before the next backward when an interrupted one left a kept scope's fetch behind) are caught
as far as possible: each fetch remembers the tensor it copied and that tensor's version counter,
and `take_old_grad` uses the fetched copy only if `p.grad` is still that tensor, unwritten since;
otherwise the gradient path reads `p.grad` as it is now (or starts afresh when it is None).
A fetch that no gradient takes (a parameter the forward did not use, or one unfrozen since it)
is freed at the end of the backward (`Engine.end_backward`, `drop_old_grads`), not only at the
release: a kept or carried scope outlives the backward, and held it on the device beyond the
budget until a write to its masters released the scope. A frozen parameter's `p.grad` (frozen
after training, with `zero_grad(set_to_none=False)`) is not fetched at all: the gradient path
drops what such a parameter gets (Note [frozen since the forward] in core/grads.py).

# Note [writes during a scope's call]
A frozen parameter used as state (a step counter, an EMA codebook) may be written in its own
module's forward and read after: `self.count.add_(1)`, `self.codebook.copy_(...)` under
no_grad, `self.codebook.data.mul_(d)`, `p[i] = v`. Every such write goes to the master, but the
scope's device copy was loaded before it, and is not released under a running call: later ops
of that call read the old values (and `p[i] = v`, dispatched as an op, wrote the device copy
only, lost at the next load). So a write to a master during a call of its scope marks the
parameter (`Scope.written_in_call`; an in-place op by `before_master_write`, `.data` when it is
taken, since the write through it follows unseen), and the next op that gets the device copy
first copies the master into it, on the compute stream (`Scope.refresh`); a write through a
detached alias (`p.detach().mul_()`) is seen there by the master's version counter. The end of
the call refreshes what is still marked, since the copy may outlive the call (the last scope
kept for backward, a kept or held scope): backward then differentiates with the master's
values, as it does with a plain parameter's. A refresh bumps the device copy's version when the
master's changed (`_note_copied`), so a graph that saved the copy before an in-place write
raises autograd's in-place error, as for a plain parameter. An offloaded argument that an
in-place op only reads (`h.add_(self.bias)`) is not marked. Writes through a view taken in the
forward (`p[0].fill_()`, `p.view(-1).zero_()`) act on the device copy itself, which the view is
of, and do not reach the master (docs/design.md, Limits).

# Note [autocast's cast cache]
Autocast caches the reduced-precision cast of every leaf that requires grad (a device copy is
one) until the outermost autocast region exits, to cast a weight once however often it is used.
Left so, a forward under autocast kept a cast of every scope it released on the device, a
reduced-precision copy of the whole offloaded model (8 fp32 blocks of 128 MiB on an H200,
fp16 autocast: 641 MiB held inside the region, also in inference and under checkpointing, where
no graph holds them; 192 MiB, the block kept for backward and its casts, once releases clear
the cache). A release therefore clears the cache (it is per thread and cannot drop one entry):
casts of resident weights are made again at their next use, with the same values. A cast
still in use by a graph stays alive through it.

# Note [masters moved out of the host buffer]
A tensor sent to another process through multiprocessing's ForkingPickler (a spawned
DataLoader worker given a dataset that holds the model, a torch.multiprocessing queue carrying
a state dict) is moved into shared memory in place: `share_memory_()` swaps the storage's memory
under every tensor that uses it. For a master that storage is the parameter's own, so the
parameter and `ParamSlot.master` follow the move, but `host_flat`, a tensor over the scope's
whole host allocation, does not: the loads that copy from it (whole-scope loads, converting
loads' staging copies, sharded loads) went on copying the weights as they were at the move,
while the optimizer stepped the moved masters, and the forward computed with stale weights.
`take_back_masters`, at each load and before data_parallel copies the masters into shared
memory, finds a moved master by its address (one comparison per parameter), copies it back into
its place in the host allocation and points the parameter at it again (pinned again on CUDA).
The other process keeps the copy it got; what this process writes afterwards, it does not see.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import MasterHome, Policy, Residency, ScopeState
from ..dispatch.masters import master_grad, master_requires_grad, without_subclass_dispatch
from .memory import HostBuffer
from .slot import ParamSlot, alive, weakly
from .streams import Streams

logger = logging.getLogger("offtensor")

# Each parameter starts at a multiple of this many bytes in the flat buffers (aligned loads).
ALIGN = 256
CHUNK_BYTES = 32 * 2**20  # see Note [progressive loads]


@dataclass(eq=False)
class LoadProgress:
    """What a load has enqueued and what compute has waited for; exists only while LOADING."""

    chunk_ready: list[Any] = field(default_factory=list)  # copy-stream events, one per chunk
    chunks_waited: int = 0  # of which the compute stream has waited for
    cursor: int = 0  # copy_order entries enqueued (a progressive load)
    end: int = 0  # len(copy_order) for a progressive load, else 0
    unmarked: int = 0  # bytes enqueued since the last chunk event
    # A converting load: the masters' bytes on the device (host layout) until the last chunk's
    # conversion is enqueued, and the parameters copied there since the last chunk event.
    staging: torch.Tensor | None = None
    to_convert: list[ParamSlot] = field(default_factory=list)

    @property
    def held_back(self) -> bool:
        """Copies wait for deferred optimizer steps (Note [deferred steps] in optim/overlap.py)."""
        return self.cursor < self.end


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

    def pump(self) -> None:
        """Enqueue the copies that waited for deferred steps now done (no host wait). Called at
        each op that waits for a chunk (make_resident): nothing held back costs no allocation."""
        if not self._held_back:
            return
        for scope in list(self._held_back):
            scope.copy_more(need=-1)

    def release_all(self, *, force: bool = False, keep_carried: bool = False) -> None:
        """Release every scope on the device; `force`: kept ones too; `keep_carried`: not the
        ones a backward carries into the next forward."""
        for scope in list(self._loaded):
            if not (keep_carried and scope.residency is Residency.CARRIED):
                scope.release(force=force)


class Scope:
    """One selected module (or, split by Policy.max_scope_bytes, part of one): its parameters'
    flat buffers, its state and the transitions between states."""

    def __init__(self, name: str, module: nn.Module, policy: Policy, engine: Any,
                 pinned: bool, block: str | None = None) -> None:
        self.name = name
        self.block = name if block is None else block  # the selected module (Policy.max_scope_bytes)
        self.module = module
        self.policy = policy
        self.engine = engine  # its Engine (core/engine.py): for the layers above this one
        self.streams: Streams = engine.streams
        self.live: LiveScopes = engine.live
        self.grad_sink = engine.grads.on_leaf_grad  # where device copies' gradients go (core/grads.py)
        # Where the masters live and how loads read them (Note [staged loads] in weights/file_masters.py);
        # wrap sets FILE or RING, with `ring` (the engine's StagingRing) and, for FILE, `files`
        # (a FileScope: where in the files each master is).
        self.home = MasterHome.PINNED if pinned else MasterHome.PAGEABLE
        self.ring: Any = None
        self.files: Any = None
        # Writes through the parameters so far (before_master_write, `.data` taken), for
        # write_mark: a staged copy of pageable masters read before one is stale.
        self.master_writes = 0
        self.slots: list[ParamSlot] = []
        self.nbytes = 0  # host buffer, master dtypes
        self.device_nbytes = 0  # device buffer, compute dtypes
        # Both replaced by wrap's _offload_params right after construction.
        self.host_flat = torch.empty(0, dtype=torch.uint8)  # pinned when `pinned`; all the masters' bytes
        self.host_buffer: HostBuffer | None = None  # the allocation host_flat spans
        self.device_flat = torch.empty(0, dtype=torch.uint8)  # on the compute device
        # Policy.compute_dtype differs from a master's dtype: the load casts (Policy.cast).
        self.casts = False
        self.host_shadow: torch.Tensor | None = None  # uint8, device layout (cast="host")
        self.shadow_stale = True  # masters changed since host_shadow was cast
        self.shadow_read: Any = None  # event after the latest copy from host_shadow
        self.state = ScopeState.OFFLOADED
        self.loading: LoadProgress | None = None  # while LOADING
        # A create_graph backward used the device copies: its graph may read them later, so
        # the release retires the storage instead of freeing it (Note [higher-order gradients]).
        self.graph_saved = False
        self.first_uses: dict[ParamSlot, None] = {}  # first forward: parameters in order of use
        self.copy_order: list[ParamSlot] | None = None  # learned from first_uses
        self.grads_ready: Any = None  # event on the copy stream after the old grads' copy
        self.grads_offloaded: Any = None  # event on the d2h stream after this backward's grads
        # Calls of the module's forward, counted four ways (the engine keeps them):
        self.running_calls = 0  # in progress now (a recompute in backward included)
        self.calls_this_pass = 0  # in the current forward pass (a shared module: several)
        # Calls that can add to a gradient (grad mode on, or an input requiring grad) since the
        # last backward ended: above 1, a backward may see several contributions per parameter
        # (shared modules; several forwards before one backward). Note [early handover].
        self.grad_calls_since_backward = 0
        self.grad_calls_this_pass = 0  # of those, the ones in the current pass
        self.loads = 0  # host-to-device loads of the weights, since wrap
        self.loads_on_demand = 0  # of which not prefetched: offloaded when the scope needed them
        # STREAMED, or KEPT by Policy.vram_budget (only a forced release offloads it), or
        # CARRIED: streamed, left resident by a backward's end for the next forward, which
        # computes it first (Note [carried into the next forward] in core/schedule.py).
        self.residency = Residency.STREAMED
        # A kept scope: each parameter's version counter when its copy was enqueued, to tell
        # writes no op of ours saw (`p[0].fill_()`, `p.detach().copy_()`; Note [VRAM budget]).
        self.copied_versions: dict[ParamSlot, int] = {}
        # Parameters whose masters were written during a call of the scope, after its load
        # (Note [writes during a scope's call]): their device copies are refreshed.
        self.written_in_call: dict[ParamSlot, None] = {}
        # Set by data_parallel(shard_loads=True): fills device_flat from host_flat in place of
        # the whole-scope copy (`loader.copy(scope)`, on the copy stream; it may return the
        # event that follows its work; Note [sharded loads] in distributed/sharded_loads.py). None: the
        # plain copy.
        self.loader: Any = None

    @property
    def weights_ready(self) -> Any:
        """The event after the whole weights' copy (the copy stream runs in order), or None when
        no copy is pending."""
        loading = self.loading
        return loading.chunk_ready[-1] if loading is not None and loading.chunk_ready else None

    @property
    def device_storage(self) -> torch.UntypedStorage:
        return self.device_flat.untyped_storage()

    @property
    def pinned(self) -> bool:
        return self.home is MasterHome.PINNED

    def host_bytes(self) -> int:
        """Host RAM of the masters (and host shadow); none for masters in files."""
        if self.home is MasterHome.FILE:
            return 0
        return self.nbytes + (self.device_nbytes if self.host_shadow is not None else 0)

    def offloaded(self) -> bool:
        return self.state is ScopeState.OFFLOADED

    def frozen_now(self) -> bool:
        """No parameter requires grad or waits for a deferred step: only a write through a
        parameter (or an alias) can change the masters, which write_mark sees."""
        return not any(master_requires_grad(slot.param) or slot.step_pending for slot in self.slots)

    def write_mark(self) -> tuple[Any, ...]:
        """The writes to the masters so far, as the staging ring compares them (Note [staged
        loads] in weights/file_masters.py): through the parameters, their views and detached aliases
        (versions), and through `p.data` aliases (their own versions, Note [p.data aliases] in
        core/slot.py); masters in files are never written."""
        if self.home is MasterHome.FILE:
            return ()
        return (self.master_writes, *((_version(slot.param), slot.data_versions()) for slot in self.slots))

    def device_bytes(self) -> int:
        n = self.device_storage.nbytes()
        return n + sum(s.old_grad.nbytes for s in self.slots if s.old_grad is not None)

    def old_grad_bytes(self) -> int:
        """Bytes a load with_grads would fetch now: existing host gradients (accumulation)."""
        return sum(g.nbytes for _, g in self._old_grads_to_fetch())

    def _old_grads_to_fetch(self) -> list[tuple[ParamSlot, torch.Tensor]]:
        """(slot, its host `p.grad`) for each parameter whose existing gradient is not fetched
        yet and not already added to in this backward; not a sparse one, which is added to on
        the host (Note [sparse gradients] in core/grads.py), nor one of a frozen parameter, which
        gets no gradient to add to it (Note [stale gradient fetches])."""
        return [(slot, g) for slot in self.slots if slot.old_grad is None and not slot.grad_written
                and master_requires_grad(slot.param)
                and (g := master_grad(slot.param)) is not None and g.layout == torch.strided]

    def num_params(self) -> int:
        return sum(s.param.numel() for s in self.slots)

    def learn_copy_order(self) -> None:
        """After the first forward: copy parameters in the order it first used them."""
        if self.copy_order is None and self.first_uses:
            used = list(self.first_uses)
            self.copy_order = used + [s for s in self.slots if s not in self.first_uses]
            for i, slot in enumerate(self.copy_order):
                slot.copy_index = i
            self.first_uses.clear()

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
        if needs_grad:
            copy.requires_grad_(True)
            copy.register_post_accumulate_grad_hook(weakly(self.grad_sink, slot))
            slot.temporaries = alive(slot.temporaries) + [weakref.ref(copy)]
        return copy

    def rehome_masters(self, buffer: Any) -> None:
        """Point the masters at `buffer` (a HostBuffer with this scope's layout that already
        holds their values: shared memory, Note [one host copy per node] in distributed/shared_masters.py).
        The parameter objects stay; their data moves, each master keeping a storage of its own
        (Note [one storage per master] in core/memory.py). Only while OFFLOADED with no
        deferred step pending."""
        assert self.state is ScopeState.OFFLOADED and not any(s.step_pending for s in self.slots)
        for slot in self.slots:
            p = slot.param
            master = buffer.tensor(slot.offset, p.dtype, p.shape)
            without_subclass_dispatch(_set_master, p, master)
            slot.master = master
        self.host_flat = buffer.flat
        self.host_buffer = buffer
        self.shadow_stale = True
        self.master_writes += 1

    def take_back_masters(self) -> None:
        """Masters whose storage was moved out of the host buffer (into shared memory) are
        copied back into it and the parameters pointed at them (Note [masters moved out of the
        host buffer])."""
        base, buffer = self.host_flat.data_ptr(), self.host_buffer
        for slot in self.slots:
            master = slot.master
            if slot.packed is not None or master.data_ptr() == base + slot.offset or master.numel() == 0:
                continue  # a compressed master is not the parameter's storage (Note [compressed masters])
            assert buffer is not None
            slot.wait_for_step()  # the worker may be writing the moved master
            home = buffer.tensor(slot.offset, master.dtype, master.shape)
            home.copy_(master)
            without_subclass_dispatch(_set_master, slot.param, home)
            slot.master = home
            self.shadow_stale = True
            self.master_writes += 1


    # ---- transitions (Note [scope states]) -----------------------------------------------

    def load(self, *, with_grads: bool) -> None:
        """OFFLOADED -> LOADING: allocate on compute, copy host->device on the copy stream;
        `with_grads`: also fetch the existing host gradients (accumulation)."""
        if self.state is ScopeState.OFFLOADED:
            self._start_load()
        if with_grads:
            self._fetch_old_grads()

    def _start_load(self) -> None:
        self.take_back_masters()
        streams = self.streams
        compute, h2d = streams.compute(), streams.h2d()
        self.device_storage.resize_(self.device_nbytes)
        streams.wait(h2d, streams.record(compute))  # alloc_done
        self.loading = loading = LoadProgress()
        progressive = (self.copy_order is not None and self.host_shadow is None and self.loader is None
                       and self.ring is None)
        if not progressive:
            for slot in self.slots:
                slot.wait_for_step()
            if self.host_shadow is not None and self.written_since_copied():
                # Policy(cast="host"): a write no op on the parameter saw (`p[0].fill_()`,
                # `p.detach().mul_()`) left the shadow cast from the old masters.
                self.shadow_stale = True
            self._note_copied(self.slots)
        if self.host_shadow is not None:  # Policy(cast="host")
            self._refresh_shadow()
        host = self.host_flat
        if self.ring is not None and self.loader is None:
            # A staged scope's bytes come from the staging ring (Note [staged loads] in
            # weights/file_masters.py): read from its files, or copied from pageable masters.
            try:
                host = self.ring.acquire(self)
            except BaseException:  # a failed read: nothing is loading
                self.loading = None
                self.device_storage.resize_(0)
                raise
        with streams.on(h2d):  # plain tensors, nothing requires grad (Note [interrupts])
            if self.casts and self.host_shadow is None:
                loading.staging = self._staging()
            if progressive:
                assert self.copy_order is not None
                loading.end = len(self.copy_order)
                self.copy_more(need=-1)
            elif self.loader is not None:  # data_parallel(shard_loads=True), whole-scope
                ready = self.loader.copy(self)  # an event after its copy (CUDA), else None
                loading.chunk_ready = [ready if ready is not None else streams.record(h2d)]
            else:
                if loading.staging is not None:
                    loading.staging.copy_(host, non_blocking=True)
                    loading.to_convert.extend(self.slots)
                elif self.host_shadow is not None:
                    self.device_flat.copy_(self.host_shadow, non_blocking=True)
                else:
                    self.device_flat.copy_(host, non_blocking=True)
                if self.ring is not None:
                    self.ring.copied(self, streams.record(h2d))
                self._mark_chunk(h2d)
                loading.staging = None
            if not progressive:
                streams.reads_masters(self.weights_ready)
        if self.host_shadow is not None:
            self.shadow_read = self.weights_ready
        self.state = ScopeState.LOADING
        self.loads += 1
        self.live.loaded(self)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("load %s (%.1f MiB)%s", self.name, self.nbytes / 2**20, streams.memory())

    def _staging(self) -> torch.Tensor:
        """The device buffer a converting load copies the masters' bytes into (allocated on the
        copy stream, which writes it first). The cast stream reads it: recorded as a use of that
        stream, its memory is not reused before the last conversion is done."""
        staging = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device_flat.device)
        cast = self.streams.cast()
        if cast is not None:
            staging.record_stream(cast)
        return staging

    def copy_more(self, need: int) -> None:
        """Enqueue the next copies of a progressive load, in the order the forward first uses
        the parameters, with an event every CHUNK_BYTES (Note [progressive loads]). A parameter
        whose deferred optimizer step is pending (Note [step fences]) stops the copies there,
        unless its position is at most `need`: then the host waits for its step."""
        order, loading = self.copy_order, self.loading
        assert order is not None and loading is not None
        streams = self.streams
        h2d = streams.h2d()
        staging = loading.staging
        i = start = loading.cursor
        with streams.on(h2d):
            while i < loading.end:
                slot = order[i]
                if slot.step_pending:
                    if i > need:
                        break
                    slot.wait_for_step()
                self._note_copied((slot,))
                if staging is None:
                    slot.device_view.copy_(slot.master, non_blocking=True)
                    loading.unmarked += slot.device_view.nbytes
                else:  # converted on the cast stream once its chunk has landed
                    n = slot.host_nbytes
                    staging[slot.offset : slot.offset + n].copy_(
                        self.host_flat[slot.offset : slot.offset + n], non_blocking=True)
                    loading.to_convert.append(slot)
                    loading.unmarked += n
                slot.chunk = len(loading.chunk_ready)
                i += 1
                if loading.unmarked >= CHUNK_BYTES or i == loading.end:
                    self._mark_chunk(h2d)
            if loading.unmarked:
                self._mark_chunk(h2d)
        if i > start:  # the copy stream runs in order: its last event covers the rest
            streams.reads_masters(loading.chunk_ready[-1])
        loading.cursor = i
        if i == loading.end:
            loading.staging = None  # every conversion is enqueued
        self.live.holding_back(self, loading.held_back)

    def _note_copied(self, slots: Any) -> None:
        # Every scope, not only kept ones: no_offload() holds streamed scopes resident as the
        # budget keeps kept ones, and their copies go stale the same way (Engine.outlives_calls).
        for slot in slots:
            version = _version(slot.param)
            if self.copied_versions.get(slot, version) != version:
                # Written since its last copy by a write no op on the parameter saw
                # (`p.detach().mul_()`): this copy overwrites the storage a graph may have saved
                # (Note [writes under a saved graph] in core/slot.py).
                slot.device_copies_written()
            self.copied_versions[slot] = version
            slot.data_copied()

    def written_in_this_call(self, slot: ParamSlot) -> bool:
        """The master changed since its device copy was made, in this call of the scope: by an
        op on the parameter or `.data` (marked), or through a detached alias (its version)."""
        return slot in self.written_in_call or self.copied_versions.get(slot) != _version(slot.param)

    def refresh(self, slot: ParamSlot) -> None:
        """Copy a master written during the scope's call into its device copy, on the compute
        stream, before the next op that uses it (Note [writes during a scope's call])."""
        self.written_in_call.pop(slot, None)
        values = slot.packed.unpack() if slot.packed is not None else slot.master
        slot.device_view.copy_(values, non_blocking=True)  # cast to the compute dtype if need be
        self.streams.reads_masters(self.streams.record(self.streams.compute()))
        self._note_copied((slot,))

    def written_since_copied(self, skip: Any = None) -> bool:
        """A kept (or held) scope's masters changed since their copies were enqueued, by writes that did
        not go through an op on the parameter (Note [VRAM budget] in core/schedule.py), `p.data`
        aliases' included (Note [p.data aliases] in core/slot.py); not counting the slots for which
        `skip(slot)` is true."""
        return any(_version(slot.param) != v or slot.data_written() for slot, v in self.copied_versions.items()
                   if skip is None or not skip(slot))

    def _mark_chunk(self, h2d: Any) -> None:
        """Record the event compute waits on for the copies enqueued since the last one: after
        their conversion, for a converting load (on the cast stream)."""
        loading = self.loading
        assert loading is not None
        streams = self.streams
        event = streams.record(h2d)
        if loading.to_convert:
            assert loading.staging is not None
            cast = streams.cast()
            streams.wait(cast, event)
            with streams.on(cast):
                for slot in loading.to_convert:
                    self._convert(slot, loading.staging)
            loading.to_convert.clear()
            event = streams.record(cast)
        loading.chunk_ready.append(event)
        loading.unmarked = 0

    @staticmethod
    def _convert(slot: ParamSlot, staging: torch.Tensor) -> None:
        """Write a parameter's device copy from its master's bytes in `staging` (host layout):
        dequantized (Policy(frozen_format), Note [compressed masters]) or cast to the compute
        dtype (Policy(cast="device"))."""
        if slot.packed is not None:
            slot.packed.unpack_into(slot.device_view, staging[slot.offset :])
            return
        master = slot.master
        n = master.numel() * master.element_size()
        slot.device_view.copy_(staging[slot.offset : slot.offset + n].view(master.dtype).view(master.shape))

    def _refresh_shadow(self) -> None:
        """Policy(cast="host"): re-cast the masters into the compute-dtype host copy after they
        changed. Waits (host side) for the previous copy out of the shadow, rarely pending."""
        if not self.shadow_stale:
            return
        if self.shadow_read is not None:
            self.shadow_read.synchronize()
            self.shadow_read = None
        shadow = self.host_shadow
        assert shadow is not None
        for slot in self.slots:
            dt, master = slot.device_view.dtype, slot.master
            n = master.numel() * dt.itemsize
            shadow[slot.device_offset : slot.device_offset + n].view(dt).view(master.shape).copy_(master)
        self.shadow_stale = False

    def make_resident(self, upto: ParamSlot | None = None) -> None:
        """-> RESIDENT: the compute stream waits (device side) for the weights' copy; with
        `upto`, only for the chunks up to the one holding that parameter (Note [progressive
        loads]). Copies still held back by deferred optimizer steps are enqueued first, the host
        waiting for the steps they need."""
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
        last = len(loading.chunk_ready) - 1
        target = last if upto is None else min(upto.chunk, last)
        compute = self.streams.compute()
        for i in range(loading.chunks_waited, target + 1):
            self.streams.wait(compute, loading.chunk_ready[i])
        loading.chunks_waited = max(loading.chunks_waited, target + 1)
        if loading.chunks_waited > last and not loading.held_back:
            self.loading = None
            self.state = ScopeState.RESIDENT

    def release(self, *, force: bool = False) -> None:
        """-> OFFLOADED: free the device copy, ordered after every queued use of it. A scope
        kept by the VRAM budget stays, unless `force` (its masters changed, or unwrap)."""
        if self.state is ScopeState.OFFLOADED or (self.residency is Residency.KEPT and not force):
            return
        streams = self.streams
        compute = streams.compute()
        streams.wait(compute, self.weights_ready)  # a prefetch nobody used: the free must follow it
        self.drop_old_grads()
        self.loading = None
        self.written_in_call.clear()  # the next load copies the masters as they are
        if self.graph_saved:
            self._retire_device_storage()  # Note [higher-order gradients]
        else:
            self.device_storage.resize_(0)
        torch.clear_autocast_cache()  # Note [autocast's cast cache]
        self.state = ScopeState.OFFLOADED
        if self.residency is Residency.CARRIED:
            self.residency = Residency.STREAMED
        self.live.released(self)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("release %s%s", self.name, streams.memory())

    def _retire_device_storage(self) -> None:
        """Give the scope a new, empty device storage and new device copies; the old ones are
        left to the graphs that hold them (Note [higher-order gradients])."""
        flat = torch.empty(self.device_nbytes, dtype=torch.uint8, device=self.device_flat.device)
        for slot in self.slots:
            slot.retire_device_copy(flat)
        flat.untyped_storage().resize_(0)
        self.device_flat = flat
        self.graph_saved = False

    # ---- old gradients for accumulation (Note [stale gradient fetches]) ---------------------

    def _fetch_old_grads(self) -> None:
        """Fetch existing host grads of the scope's parameters, for accumulation on the device."""
        todo = self._old_grads_to_fetch()
        if not todo:
            return
        streams = self.streams
        compute, h2d = streams.compute(), streams.h2d()
        device = self.device_flat.device
        fetched = [(slot, g, torch.empty(g.shape, dtype=g.dtype, device=device)) for slot, g in todo]
        streams.wait(h2d, streams.record(compute))
        with streams.on(h2d):
            for _, g, old in fetched:
                old.copy_(g, non_blocking=True)
        self.grads_ready = ready = streams.record(h2d)
        streams.reads_masters(ready)
        # Only now, and the source before the copy: an interrupt between two statements (Note
        # [interrupts]) must not leave a slot with a copy that grads_ready does not cover, or a
        # copy without the source take_old_grad checks it against. A kept scope keeps both
        # across an interrupted backward into the next one.
        for slot, g, old in fetched:
            slot.old_grad_source = (g, g._version)
            slot.old_grad = old

    def drop_old_grads(self) -> None:
        """Free the fetched gradients no gradient took, after their copies: the end of a
        backward that leaves the scope resident, or its release (Note [stale gradient fetches])."""
        streams = self.streams
        streams.wait(streams.compute(), self.grads_ready)
        if self.grads_ready is not None and any(s.old_grad_source is not None for s in self.slots):
            self.grads_ready.synchronize()  # unused fetches: their host sources may go below
        self.grads_ready = None
        for slot in self.slots:
            slot.old_grad = slot.old_grad_source = None

    def take_old_grad(self, slot: ParamSlot) -> torch.Tensor | None:
        """The device copy of `p.grad` fetched with the scope's weights, if `p.grad` is still
        that tensor with the values copied (Note [stale gradient fetches])."""
        g = slot.old_grad
        if g is None:
            return None
        slot.old_grad = None
        assert slot.old_grad_source is not None  # set together with old_grad
        source, version = slot.old_grad_source
        slot.old_grad_source = None
        if master_grad(slot.param) is not source or source._version != version:
            # zero_grad() (or any write to p.grad) since the fetch: it is stale. The copy may
            # still be reading `source` and writing `g`; both may go once it is done (rare).
            if self.grads_ready is not None:
                self.grads_ready.synchronize()
            return None
        self.streams.wait(self.streams.compute(), self.grads_ready)
        return g


def _version(p: torch.Tensor) -> int:
    """`p._version` without `__torch_function__` (subclass dispatch off: a property read on a
    tensor subclass dispatches it otherwise): bumped by in-place writes to p and to its views
    and detached aliases. Read at every load and every op inside a scope."""
    return without_subclass_dispatch(_VERSION_OF, p)


_VERSION_OF = torch._C.TensorBase._version.__get__  # type: ignore[attr-defined]


def _set_master(p: torch.Tensor, master: torch.Tensor) -> None:
    """`p.data = master` itself (not OffloadedParameter's copy into the master); call with
    subclass dispatch off."""
    torch._C.TensorBase.data.__set__(p, master)  # type: ignore[attr-defined]
