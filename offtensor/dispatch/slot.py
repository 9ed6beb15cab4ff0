"""One offloaded parameter's bookkeeping (ParamSlot) and its device copy.

# Note [why storage is resized instead of reassigned]
Autograd saves the device copy of a weight for backward (F.linear saves its weight). Each
parameter's device copy (`device_leaf`) is a tensor created once, sharing the scope's device
storage. Releasing resizes that storage to 0 bytes: the memory goes back to the allocator while
the tensors autograd saved stay valid objects with an unchanged version counter. Before backward
needs them, the scope is loaded again into the same storage object (see Note [backward
triggers] in engine/hooks.py). Reassigning `.data` or allocating new tensors would either keep the
memory alive through autograd's references or break its saved-tensor checks.

# Note [deferred step fences]
`offtensor.backward_and_step` steps parameters on a worker thread while backward and the next
forward go on (Note [deferred steps] in optim/overlap.py). Whatever reads or writes a master first
waits for its pending step: the copy to the device (scopes/loading.py), an op or property access on the
parameter (dispatch/param.py), the gradient path (engine/grads.py). Those layers sit below the optimizer
overlap, so they do not call it: the overlap hands each parameter it takes a fence
(`ParamSlot.pending_step`, an object with `wait(slot)`), clears it once the step is done, and
the lower layers wait on the fence they find (`ParamSlot.wait_for_step`).

# Note [writes under a saved graph]
A graph saves the device copy an op got, not the parameter (F.linear saves its weight), and a
later backward through it reloads the scope into that same storage from the master. If the
master was written in between (`loss.backward(retain_graph=True); optimizer.step();
loss.backward()`, or a step between forward and backward), that backward would silently
differentiate with the new weights, where autograd raises "one of the variables needed for
gradient computation has been modified by an inplace operation" for a plain parameter. So a
write to the master (an in-place op that writes the parameter, `p.data = t`, `p.set_(t)`) bumps
the version counter of every tensor standing for it in a graph (`device_copies_written`): the
device copy, retired copies, temporary copies. Graphs saved earlier then raise as without
offloading; later ones save the new version. Only real writes count: an argument of an
in-place op that only reads it (`h.add_(self.bias)`) must not break the graph that saved it.
A write that no op on the parameter carries out (`p.detach().mul_()`) bumps only the master's
own version counter, which the detached alias shares. Each copy into a device copy compares
the master's version with the one its last copy was made from (`WriteTracker.note_copied` in
scopes/write_tracking.py) and bumps the device copies when it changed, before overwriting what a graph
may have saved. A scope still resident when its backward starts (the last scope of the
forward, a kept one) compares at `Engine.pre_backward` and reloads, so that the check runs.
`p.data` has a version counter of its own, invisible to autograd: for it, as for a plain
parameter, backward differentiates with the new values, and nothing raises.

# Note [p.data aliases]
`p.data` is a plain tensor over the master with a version counter of its own, so a write
through it bumps nothing a load compares (`WriteTracker.written_since_copied`). Taking it marks the
cast="host" shadow and a kept copy stale (MasterWrites.master_handed_out), but an alias kept and
written after the next load left them stale for good. So each `p.data` handed out is held
weakly with its version (`data_aliases`); the checks before reusing what outlives a load (the
shadow at each load, a kept or carried copy at each call and backward) ask `data_written`,
and each copy of the master starts the count afresh (`data_copied`). An alias gone since the
last copy counts as written: its last writes can no longer be told. This costs a check per
parameter at those points, none per op; writes through an alias inside the scope's own call
reach its copies at the next load only. Not the version counters of the device copies: as for
a plain parameter, a `p.data` write does not make a saved graph raise.
"""

from __future__ import annotations

import enum
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..api import MasterHome, Residency, ScopeState
from ..storage.compress import StoredMaster
from .call_counts import CallCounts
from .device_copies import copy_view, device_copy

# ParamSlot.retired is written by the main thread (a retire) and by the optimizer worker (a
# step of that master): both hold this lock.
_retired_lock = threading.Lock()

# Set on the thread that runs deferred optimizer steps (`active`; see Note [optimizer overlap] in
# optim/overlap.py; optim/worker.py sets it). On that thread every op acts on the masters (a scope computing on
# the main thread at the same time is not its scope), and no fence is waited on (the thread
# itself is what clears them).
worker_state = threading.local()


def on_optimizer_worker() -> bool:
    return getattr(worker_state, "active", False)


class StepFence(Protocol):
    """What a parameter with a pending deferred step waits on (Note [deferred step fences])."""

    def wait(self, slot: ParamSlot) -> None: ...


class RoutedRows(Protocol):
    """Which experts of a routed expert parameter its device copy holds (ExpertRows in
    scopes/experts.py, above: Note [routed experts])."""

    whole: bool  # every expert is on the device: ops get the device copy as any other
    held: int  # how many experts are on the device (or on their way)
    # The running call's router choice is on the device (or on its way): an op that does not
    # index the parameter reads only those rows (Note [which experts an op reads])
    hinted: bool
    # Rows a graph saved may still read were forgotten (Note [routed experts in backward])
    saved_lost: bool

    def before_op(self, func: Any, args: tuple, param: torch.Tensor) -> None: ...

    def forget(self, *, graph_reads: bool = False) -> None: ...

    def all_there(self) -> None: ...

    def fill_all(self) -> None: ...


class CountsWrites(Protocol):
    """A scope's masters as a slot's readers see them (HostMasters in scopes/host_masters.py, above):
    how often they were written."""

    master_writes: int  # writes since wrap (a staged copy or a cached expert row is stale after one)

    def written(self) -> None: ...  # one more


class StreamsLeft(Protocol):
    """A scope's streams (Streams in scopes/streams.py, above), as an entry point below the engine
    sees them."""

    def restore(self) -> None: ...  # the stream an interrupt left current goes (Note [interrupts])


class MastersAt(Protocol):
    """Where a scope's masters live, as its source says (MasterSource in scopes/sources.py, above)."""

    @property
    def home(self) -> MasterHome: ...


class SlotScope(Protocol):
    """The scope a slot belongs to (Scope in scopes/scope.py, above), as the slot and the layers that
    reach it through a slot see it. What an op, a write or a gradient needs of the engine is asked
    here too, so that nothing below the engine reaches the engine itself."""

    name: str
    state: ScopeState
    casts: bool  # the load casts to Policy.compute_dtype
    calls: CallCounts  # of the module's forward (Note [call counts] in dispatch/call_counts.py)
    copy_order: list[ParamSlot] | None
    slots: list[ParamSlot]
    grads_offloaded: Any  # event on the d2h stream after this backward's gradients
    requires_grad_seen: int  # REQUIRES_GRAD_CHANGES when its copies' flags were last matched
    holds_seen: int  # HOLDS when none of its masters was found held (Note [masters held from ops])
    # Its device copies stand in for its parameters in an eager call now (Note [calls of a loaded
    # scope] in engine/hooks.py): the parameter's value is its copy's (exposed_copy).
    exposed: bool

    def exposure_live(self) -> bool: ...  # the call that exposed them runs (not one an interrupt left)

    def in_its_backward(self) -> bool: ...  # its backward runs (a recompute with no hook computes)
    loads: int  # loads since wrap (the expert cache ages its scores by them)

    @property
    def masters(self) -> CountsWrites: ...  # its HostMasters (scopes/host_masters.py, above)

    @property
    def source(self) -> MastersAt: ...  # where its masters live and its loads copy from

    @property
    def streams(self) -> StreamsLeft: ...
    residency: Residency  # streamed, kept or carried

    @property
    def pinned(self) -> bool: ...

    @property
    def loading(self) -> LoadingNow | None: ...  # while LOADING

    @property
    def live(self) -> LoadsHeldBack: ...

    @property
    def writes(self) -> WrittenInCall: ...

    def grad_sink(self, slot: ParamSlot, leaf: torch.Tensor) -> None: ...  # a gradient handled as it arrives

    def arrived_outside(self, slot: ParamSlot) -> None: ...  # `slot.arrived`, outside the scope's backward

    def compute_waits(self, chunk: int | None) -> None: ...

    def take_old_grad(self, slot: ParamSlot) -> torch.Tensor | None: ...

    def compute_device(self) -> torch.device: ...

    def materialize(self, slot: ParamSlot, op_device: torch.device | None) -> torch.Tensor | None: ...

    def master_written(self, slot: ParamSlot) -> None: ...

    def masters_stepped(self, slots: list[ParamSlot]) -> None: ...

    def before_master_write(self, slot: ParamSlot, *, written: bool = True) -> None: ...

    def master_handed_out(self, slot: ParamSlot, *, detached: bool = False) -> None: ...

    def new_host_memory(self, nbytes: int, what: str) -> torch.Tensor: ...


class LoadingNow(Protocol):
    """A scope's load in progress, as its slots' short path reads it (LoadProgress, scopes/loading.py)."""

    chunks_waited: int  # chunks the compute stream has waited for

    @property
    def held_back(self) -> bool: ...


class LoadsHeldBack(Protocol):
    """The model's loaded scopes (LiveScopes, scopes/scope.py)."""

    @property
    def holds_back(self) -> bool: ...


class WrittenInCall(Protocol):
    """A scope's writes its device copies have not seen (WriteTracker, scopes/write_tracking.py)."""

    aliases_noted: bool  # a slot may hold `p.data` aliases

    def written_in_this_call(self, slot: ParamSlot) -> bool: ...

    def copies_current(self, n_slots: int, *, versions_read: bool) -> bool: ...  # every copy made, none written since


def exposed_copy(p: torch.Tensor) -> torch.Tensor | None:
    """The device copy standing in for offloaded parameter `p` in a running eager call of its
    scope (Note [writes through the parameter in an exposed call] in engine/hooks.py), else None.
    A routed expert parameter is never exposed (Note [calls of a loaded scope])."""
    slot = getattr(p, "_ot", None)
    if (slot is None or not slot.scope.exposed or slot.experts is not None or on_optimizer_worker()
            or not slot.scope.exposure_live()):
        return None
    return slot.device_leaf


def weakly(method: Any, *bound: Any) -> Any:
    """A hook calling `method(*bound, *args)` while the bound method's object and `bound` live,
    holding all of them weakly.

    # Note [hooks that keep a model alive]
    A tensor hook is held by the tensor's C++ autograd metadata, which the garbage collector
    cannot see into, and torch.optim's global step hooks are held for good. A device copy's
    gradient hook holding the engine's gradient sink and the slot strongly closed a cycle
    through C++ (device copy -> hook -> sink -> engine -> scopes -> slot -> device copy) that no
    collection breaks: a wrapped model that went out of scope kept its pinned masters, gradients
    and device buffers for the rest of the process. Held weakly, the model (which holds the
    engine and, through each parameter's `_ot`, the slots) is their only owner. (The function is
    held, not its object: a weakref.WeakMethod would cost a Python call per gradient.) A device
    copy's own hook is its slot's `arrived.append` (Note [gradients on arrival] in
    engine/grads.py): it holds that list, which holds the copies it lists until they are taken."""
    func, owner = method.__func__, weakref.ref(method.__self__)
    refs = [weakref.ref(b) for b in bound]
    if len(refs) == 1:  # a device copy's gradient hook: one call per parameter and backward
        (ref,) = refs

        def one(*args: Any) -> None:
            obj, b = owner(), ref()
            if obj is not None and b is not None:
                func(obj, b, *args)

        return one

    def hook(*args: Any) -> None:
        obj, objs = owner(), [r() for r in refs]
        if obj is not None and all(o is not None for o in objs):
            func(obj, *objs, *args)

    return hook


def alive(refs: list[weakref.ref]) -> list[weakref.ref]:
    return [r for r in refs if r() is not None]


# Note [masters held from ops]
# A master that a deferred optimizer step may still write (`pending_step`) or that another rank
# steps (`stepped_elsewhere`) is not read by an op's short path; a kept scope's call asks that of
# each of its parameters (ops.resident_copies_ready). `HOLDS[0]` counts the times either was set
# to a value, counted before the first is set (an interrupt between them leaves only an extra
# look): a scope that found none set at one count need not look again until the count moves
# (`SlotScope.holds_seen`). Clearing one never makes that answer wrong.
HOLDS = [0]


def holding_masters() -> None:
    """Some slots' `pending_step` or `stepped_elsewhere` are about to be set (Note [masters held from ops])."""
    HOLDS[0] += 1


def in_backward() -> bool:
    """True while the autograd engine runs (backward, and recompute under checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class ParamMeta(NamedTuple):
    """What cannot change about an offloaded parameter after wrap (Note [metadata without
    dispatch] in dispatch/metadata.py)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    ndim: int
    numel: int


_disabled = torch._C._disabled_torch_function_impl
_TensorBase = torch._C.TensorBase
# `p.requires_grad` of the master, read in C (Note [metadata without dispatch] in dispatch/metadata.py)
_REQUIRES_GRAD = _TensorBase.requires_grad.__get__  # type: ignore[attr-defined]


def meta_of(p: torch.Tensor) -> ParamMeta:
    """The parameter's ParamMeta, read with subclass dispatch off."""
    shape = _disabled(_TensorBase.shape.__get__, (), (p,))  # type: ignore[attr-defined, call-arg]
    return ParamMeta(shape, _disabled(_TensorBase.dtype.__get__, (), (p,)),  # type: ignore[attr-defined, call-arg]
                     _disabled(_TensorBase.device.__get__, (), (p,)), len(shape), shape.numel())  # type: ignore[attr-defined, call-arg]


class LeafHooks(enum.Enum):
    """The post-accumulate-grad hooks on a slot's device copy (Note [gradients on arrival] in
    engine/grads.py)."""

    NONE = "none"  # none yet: a frozen copy is hooked once unfrozen (use_device_copy)
    LISTED = "listed"  # `arrived.append`: the gradient path takes what it listed when it looks
    HANDED = "handed"  # and a Python hook handing each gradient over as it lands (hook_at_once)


# Note [slots of a ParamSlot]
# The gradient path, the hooks and every op read a few fields of each parameter's slot, once per
# parameter and step at least; where Python allows (3.11, weakref_slot), the fields are
# `__slots__`: read and written at fixed offsets, the object smaller, and nothing can be set on it
# that is not a field.
_SLOTTED: dict[str, bool] = {"slots": True, "weakref_slot": True} if sys.version_info >= (3, 11) else {}


@dataclass(eq=False, repr=False, **_SLOTTED)
class ParamSlot:
    """Per-parameter bookkeeping, stored on the parameter as `p._ot`."""

    param: nn.Parameter  # the OffloadedParameter (dispatch/param.py, the layer above)
    name: str  # qualified name in the wrapped model
    scope: SlotScope  # its Scope (scopes/scope.py, above)
    offset: int  # bytes into the scope's host buffer (master layout)
    device_offset: int  # bytes into the scope's device buffer (compute-dtype layout)
    device_leaf: torch.Tensor  # what ops see; shares the scope's device storage
    device_view: torch.Tensor  # the same bytes as a view of device_flat, for the loader's
    # writes (writing through device_leaf would bump the version counter autograd checks)
    master: torch.Tensor  # the master's bytes in host_flat as a plain tensor: what the loader
    # reads, with no subclass dispatch and nothing for autograd to record (Note [interrupts])
    host_grad: torch.Tensor | None = None  # `p.grad` after backward: on grad_buffer, or the user's
    # pinned, shaped, in the master's dtype: what host_grad aliases, reused every step (engine/grads.py)
    grad_buffer: torch.Tensor | None = None
    grad_buffer_uses: int = 0  # tensors on grad_buffer when only offtensor holds it
    grad_storage: int = 0  # grad_buffer's StorageImpl address (its storage's `_cdata`)
    grads_in_backward: int = 0  # contributions written to host_grad in the current backward
    single_grad: bool = False  # exactly one contribution in the last whole backward (Note [early handover])
    last_d2h: Any = None  # event after the latest device-to-host copy into host_grad
    old_grad: torch.Tensor | None = None  # device copy of `p.grad`, fetched for accumulation
    # The host `p.grad` that old_grad was copied from, and its version counter then.
    old_grad_source: tuple[torch.Tensor, int] | None = None
    chunk: int = 0  # which of the scope's load events covers this parameter's copy
    copy_index: int = 0  # position in the scope's copy_order
    pending_step: StepFence | None = None  # a deferred optimizer step still has to write the master
    # data_parallel(shard_optimizer=True): the sharding, while the rank that owns this shared
    # master may be stepping it; reading its values raises (Note [barrier across ranks] in
    # distributed/shared_masters.py)
    stepped_elsewhere: Any = None
    # register_hook hooks (Note [user gradient hooks] in dispatch/autograd.py)
    grad_hooks: OrderedDict = field(default_factory=OrderedDict)
    # The master is kept apart from the parameter, `master` holds no values: compressed
    # (Policy(frozen_format), Note [compressed masters] in storage/compress.py) or in a file
    # (Policy(host_budget), Note [masters in files] in storage/file_masters.py)
    packed: StoredMaster | None = None
    post_hooks: OrderedDict = field(default_factory=OrderedDict)  # post-accumulate-grad hooks
    leaf_hooks: LeafHooks = LeafHooks.NONE  # device_leaf's post-accumulate-grad hooks
    hands_at_once: bool = False  # every device copy of it gets that hook (GradOffload.hand_over_at_once)
    # Its device copies (current or retired) whose gradient autograd accumulated since the
    # gradient path last looked; appended by their hook (Note [gradients on arrival] in engine/grads.py)
    arrived: list[torch.Tensor] = field(default_factory=list)
    # Device copies of earlier storages that graphs of create_graph backwards may still read.
    retired: list[weakref.ref] = field(default_factory=list)
    # Temporary copies made with requires_grad for ops outside the scope, while graphs hold
    # them: leaves of the parameter too (Note [gradients with respect to a parameter]).
    temporaries: list[weakref.ref] = field(default_factory=list)
    # `p.data` tensors handed out, with their versions at the last look (Note [p.data aliases])
    data_aliases: list[tuple[weakref.ref, int]] = field(default_factory=list)
    data_alias_written: bool = False  # one of them was written (or dropped) since the last copy
    # A routed expert parameter: the experts its device copy holds (Note [routed experts] in scopes/experts.py)
    experts: RoutedRows | None = None
    meta: ParamMeta = field(init=False)  # shape, dtype, device: Note [metadata without dispatch]
    # The master's requires_grad, as `p.requires_grad` answers it (Note [metadata without
    # dispatch]); set again by every write of the flag (`note_requires_grad`)
    requires_grad: bool = field(init=False)

    def __post_init__(self) -> None:
        self.meta = meta_of(self.param)
        self.note_requires_grad()

    def note_requires_grad(self) -> None:
        """Take the master's requires_grad flag again: after a write of it (dispatch/param.py)."""
        self.requires_grad = _disabled(_REQUIRES_GRAD, (), (self.param,))  # type: ignore[call-arg]

    @property
    def grad_written(self) -> bool:
        """host_grad received a contribution in the current backward."""
        return self.grads_in_backward > 0

    @property
    def host_nbytes(self) -> int:
        """Bytes of the master in its scope's host buffer (compressed: values and scales)."""
        if self.packed is not None:
            return self.packed.nbytes
        return self.master.numel() * self.master.element_size()

    @property
    def used_outside(self) -> bool:
        """A temporary copy made for an op outside the scope may still get a gradient, maybe
        after the scope's backward: a graph holds it (Note [early handover] in optim/step.py)."""
        return any(ref() is not None for ref in self.temporaries)

    @property
    def step_pending(self) -> bool:
        return self.pending_step is not None

    def __repr__(self) -> str:
        # Not the fields: device_view is a plain view of the scope's device buffer, which is
        # 0 bytes while the scope is offloaded, and printing it would read freed memory.
        return f"ParamSlot({self.name!r}, {tuple(self.param.shape)}, scope {self.scope.name!r})"

    def wait_for_step(self) -> None:
        """Block until a deferred optimizer step has written this master (Note [deferred step fences])."""
        fence = self.pending_step
        if fence is not None and not on_optimizer_worker():
            fence.wait(self)

    def data_handed_out(self, alias: torch.Tensor) -> None:
        """`p.data` returned `alias` (Note [p.data aliases]). Not on the optimizer worker, whose
        steps mark their parameters written anyway."""
        if not on_optimizer_worker():
            self.data_written()  # forgets the aliases gone
            self.data_aliases = [*self.data_aliases, (weakref.ref(alias), alias._version)]
            self.scope.writes.aliases_noted = True  # Note [one version read per scope] (scopes/write_tracking.py)

    def data_written(self) -> bool:
        """A `p.data` alias may have written the master since its last copy (Note [p.data
        aliases])."""
        if self.data_aliases:
            seen = []
            for ref, version in self.data_aliases:
                alias = ref()
                if alias is None or alias._version != version:
                    self.data_alias_written = True
                if alias is not None:
                    seen.append((ref, alias._version))
            self.data_aliases = seen
        return self.data_alias_written

    def data_versions(self) -> tuple[int, ...]:
        """The versions of the `p.data` aliases handed out, -1 for one gone: two calls return the
        same only if no alias wrote in between (the staging ring's write_mark, Note [staged loads]
        in storage/staging.py)."""
        return tuple(-1 if (alias := ref()) is None else alias._version for ref, _ in self.data_aliases)

    def converts(self) -> bool:
        """The device copy is not the master's bytes: dequantized (compressed master) or cast to
        a compute dtype; a host op then reads a converted copy too (Scope.temporary_copy)."""
        return self.packed is not None or self.device_view.dtype != self.master.dtype

    def data_copied(self) -> None:
        """The master was copied: only later writes through `p.data` aliases count."""
        self.data_written()
        self.data_alias_written = False

    def hook_device_leaf(self) -> None:
        """Route the device copy's gradients to the host (Note [gradient path] in engine/grads.py);
        for a frozen parameter, once it is unfrozen (use_device_copy)."""
        self.leaf_hooks = LeafHooks.NONE
        if self.device_leaf.requires_grad:
            # `list.append`, called in C: no Python frame per gradient (Note [gradients on arrival]).
            self.device_leaf.register_post_accumulate_grad_hook(self.arrived.append)
            self.leaf_hooks = LeafHooks.LISTED
            if self.grad_hooks or self.hands_at_once:
                self.hook_at_once()

    def hook_at_once(self) -> None:
        """The device copy's gradients are handled as they arrive (Note [gradients on arrival] in
        engine/grads.py): the parameter has `register_hook` hooks, which see each gradient as
        autograd makes it (an exception in one ends the backward there), or its model steps or
        averages gradients as they land (`hands_at_once`)."""
        if self.leaf_hooks is LeafHooks.LISTED and self.device_leaf.requires_grad:
            self.device_leaf.register_post_accumulate_grad_hook(weakly(self.scope.grad_sink, self))
            self.leaf_hooks = LeafHooks.HANDED

    def device_copies_written(self) -> None:
        """The master is written: graphs that saved a device or temporary copy of it must see
        it as modified in place (Note [writes under a saved graph]); retired copies are bumped
        by `before_master_write`, which every write calls first. Also on the optimizer worker:
        version counters are atomic."""
        torch.autograd.graph.increment_version(self.device_leaf)
        for ref in self.temporaries:
            copy = ref()
            if copy is not None:
                torch.autograd.graph.increment_version(copy)

    def retired_copies_written(self) -> None:
        """The master is about to change: graphs holding a retired device copy of it must see
        it as modified in place (Note [higher-order gradients] in scopes/device_buffer.py)."""
        if not self.retired:
            return  # the common case, without the lock
        with _retired_lock: refs, self.retired = self.retired, []  # noqa: E701 (Note [interrupts])
        for ref in refs:
            leaf = ref()
            if leaf is not None:
                torch.autograd.graph.increment_version(leaf)

    def retire_device_copy(self, flat: torch.Tensor) -> weakref.ref:
        """Keep a weak reference to the current device copy and make a new one in `flat`; that
        reference (which the optimizer worker may take off `retired` at once)."""
        ref = weakref.ref(self.device_leaf)
        with _retired_lock: self.retired = alive(self.retired) + [ref]  # noqa: E701
        self._new_device_copy(flat)
        return ref

    def _new_device_copy(self, flat: torch.Tensor) -> None:
        """A new device copy in `flat`, with the current one's requires_grad, and its hooks."""
        self.device_leaf, self.device_view = device_copy(
            flat, self.device_offset, self.device_view.dtype, self.param.shape, self.device_leaf.requires_grad)
        self.hook_device_leaf()

    def take_back_device_copy(self, flat: torch.Tensor, leaf: torch.Tensor | None, hooks: LeafHooks) -> None:
        """Make `leaf`, a device copy retired in `flat`'s storage with `hooks` on it, the device
        copy again; None: no graph held it, so a new one is made in its place (Note [retired
        copies taken back] in scopes/device_buffer.py)."""
        with _retired_lock: self.retired = [r for r in self.retired if (t := r()) is not None and t is not leaf]  # noqa: E701
        if leaf is None:
            self._new_device_copy(flat)
            return
        self.device_leaf = leaf
        self.device_view = copy_view(flat, self.device_offset, self.device_view.dtype, self.param.shape)
        self.leaf_hooks = hooks
        if self.grad_hooks or self.hands_at_once:  # asked for while it was retired
            self.hook_at_once()

    def graph_leaves(self) -> list[torch.Tensor]:
        """Every tensor that stands for this parameter in an autograd graph and can receive a
        gradient: its device copy, retired copies and temporary copies still alive (Note
        [gradients with respect to a parameter] in dispatch/autograd.py)."""
        with _retired_lock: refs = list(self.retired)  # noqa: E701 (Note [interrupts])
        leaves = [self.device_leaf, *(r() for r in refs), *(r() for r in self.temporaries)]
        return [t for t in leaves if t is not None and t.requires_grad]

    def ready_copy(self) -> torch.Tensor | None:
        """The device copy an op gets (`OpAccess.materialize`, engine/access.py) when that takes no
        host work, else None: the scope computing (in a call, exposed for a pass, or in its backward:
        a recompute that runs no hook, Note [exposed recomputes] in engine/hooks.py), its copy order learned, no
        deferred step pending or shared step elsewhere, no write in this call, and the copy loaded or on its
        way (the scope resident, or every chunk of its load enqueued, nothing held back: the
        compute stream then waits for the chunk holding it, Note [progressive loads] in
        scopes/loading.py). Note [ops in a resident scope] in dispatch/ops.py."""
        scope = self.scope
        experts = self.experts  # routed: every expert there, or the call's choice (Note [ops in a resident scope])
        if ((scope.calls.running <= 0 and not scope.exposed and not scope.in_its_backward()) or scope.copy_order is None
                or self.pending_step is not None or self.stepped_elsewhere is not None
                or (experts is not None and not (experts.whole or experts.hinted))
                or scope.writes.written_in_this_call(self)):
            return None
        if scope.state is not ScopeState.RESIDENT:
            loading = scope.loading  # None but while LOADING (Note [scope states])
            if loading is None or loading.held_back or scope.live.holds_back:
                return None
            if self.chunk >= loading.chunks_waited:
                scope.compute_waits(self.chunk)
        leaf = self.device_leaf
        if leaf.requires_grad == self.requires_grad:
            return leaf  # what use_device_copy returns, without the call: asked per parameter and call
        return self.use_device_copy()

    def use_device_copy(self) -> torch.Tensor:
        leaf = self.device_leaf
        wants = self.requires_grad
        if leaf.requires_grad != wants:  # the user froze or unfroze the parameter after wrap
            leaf.requires_grad_(wants)
            if wants and self.leaf_hooks is LeafHooks.NONE:
                self.hook_device_leaf()
            elif wants and (self.grad_hooks or self.hands_at_once):
                self.hook_at_once()  # frozen when that was asked for
        return leaf
