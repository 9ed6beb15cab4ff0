"""The transfer engine: streams, events, prefetch order, and the scope state transitions.

# Note [streams and events]
One engine per wrapped model owns every stream and event (created lazily, CUDA only):
- compute: the current stream when a hook runs (usually the default stream); all ops and all
  device allocations and frees of scope buffers happen on it, so the caching allocator's
  stream-ordered reuse is always safe.
- h2d ("copy stream"): host-to-device copies of weights (and of existing grads when
  accumulating), so the next scope loads while the current one computes.
- d2h: device-to-host copies of gradients, on their own stream so both PCIe directions are used.
A device buffer is allocated on compute, then the copy stream waits on an event recorded there
(`alloc_done`): the memory may have just been freed by compute and still be read by queued
kernels. Compute waits on `weights_ready` before the first use, and the release (resize to 0) is
issued on compute after the last use, so it is ordered after every kernel that reads the scope.
Gradients read by a d2h copy are kept alive by holding a reference next to the copy's event
(no `record_stream`) until compute has waited on that event. The host never waits, except once at
the end of backward so that `p.grad` is complete when `backward()` returns, and before the first
write to a master while a copy from it may still be in flight.

# Note [progressive loads]
A scope's first forward records the order in which its parameters are first used. From then on
its host-to-device copy goes parameter by parameter in that order, with an event every
CHUNK_BYTES, and each op makes compute wait only for the chunk that holds its weights. The first
matmul of a block starts when its own weights have landed, not the whole block: for the first
scope of a pass, which nothing can hide, this turns a whole-block stall into a one-matrix stall.
Backward needs the whole scope before its first op (autograd reads the saved device copies
directly), so pre_backward waits for every chunk.

# Note [prefetch order]
The engine records the order in which scopes start their forward, and separately the order in
which backward first needs them. The two are not mirror images: under checkpointing, a block
split into several scopes (Policy.max_scope_bytes) is recomputed in forward order before its
backward runs in reverse, so a reverse-forward prefetch would fetch the block's last matrix first
and stall on every other one. From the second pass on, each scope's forward start prefetches the
next scopes of the forward order, and each scope's first need in backward the next ones of the
backward order (the reverse forward order until a backward has been seen). Scopes are prefetched
while their bytes fit in `policy.prefetch` times the largest block's (a block is a module the
predicate selected; Policy.max_scope_bytes may split it into several scopes): with equal blocks
that is `prefetch` blocks ahead, whatever their split, so splitting lowers the peak (the scope
computing is smaller) without shortening the time a copy has to hide behind compute. Device
memory holds at most the scope computing plus the budget. Scopes under 1/TINY of the largest
scope (norms, biases) are not counted, so a tiny scope never stands between the copy of the
next large one and the compute it should overlap. A scope arriving out
of order re-learns the order from that point; the first scope of the forward order arriving
again starts a new pass and releases whatever a previous, abandoned pass left resident.
The first scope of a pass is loaded when the forward of the model given to `wrap` starts
(`begin_forward`; the scope where the pass after the last one's start began last time, so that
alternating or cycling starts are foreseen), not when the forward reaches it: what a model
computes before its first block (embeddings, masks, rotary tables; about 2 ms of host time
for a Hugging Face Llama) then hides the first copy instead of delaying it, which matters
most when the forward is transfer-bound.
Those hooks also delimit passes: inside the model's forward the first scope arriving again (a
looped block) continues the pass; a pass starting at another scope of the order follows the
order from there (decoding from cached encoder outputs), at an unknown scope relearns it; at the
end of the model's forward the order is cut where the pass ended and scopes the pass loaded but
did not use are released. Without the hooks, ORDER_LIMIT bounds the order's length.

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

# Note [torch.func transforms]
Under `torch.func.grad`/`vjp`/`jacrev`/`vmap` every op, offtensor's own copies included, goes
through the transform, which refuses in-place writes into tensors captured from outside it (the
device buffers a load writes). The engine's entry points (the hooks and `materialize`) therefore
run with the transforms disabled: loads, releases and gradient fetches are bookkeeping of plain
tensors, invisible to the transform, while the model's ops still run under it on the device
copies, which the transform sees as captured constants. With `functional_call` over the
parameters, the device copies are simply not used.

# Note [stale gradient fetches]
When a backward will add to an existing `p.grad` (gradient accumulation), the old host gradient
is fetched to the device together with the scope's weights (`_load_old_grads`), possibly before
backward starts: at the end of the forward, a prefetch for backward. The user may change `p.grad`
in between: `optimizer.zero_grad()` between forward and backward zeroes it in place or sets it to
None. So each fetch remembers the tensor it copied and that tensor's version counter, and
`take_old_grad` uses the fetched copy only if `p.grad` is still that tensor, unwritten since;
otherwise the gradient path reads `p.grad` as it is now (or starts afresh when it is None).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _distributed
from ._api import Policy, ScopeState
from ._grads import GradOffload
from ._overlap import wait_for_step
from ._param import master_grad, worker_state
from ._scope import ParamSlot, Scope, in_backward

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("offtensor")

# The no_offload() objects entered and not exited. Weak: one whose __exit__ an interrupt
# skipped stops holding once it is collected (Note [interrupts]).
_holds: weakref.WeakSet[no_offload] = weakref.WeakSet()
CHUNK_BYTES = 32 * 2**20  # see Note [progressive loads]
TINY = 8  # see Note [prefetch order]
# Without the model's forward hook to tell where passes start, the learned forward order is
# relearned beyond this many entries per scope (Note [prefetch order]).
ORDER_LIMIT = 16
_engines: weakref.WeakSet[TransferEngine] = weakref.WeakSet()


class ModelForward(enum.Enum):
    """Where the wrapped model's own forward is; its hooks delimit passes (Note [prefetch order])."""

    OUTSIDE = "outside"  # not in the model's forward (or no hook: a ModuleList was wrapped)
    STARTING = "starting"  # in it, before any scope: the next scope's forward starts a pass
    IN_PASS = "in pass"  # in it, the pass started


def _no_engine() -> None:
    """What a pickled wrapped model's engine attribute loads as (Note [copies of a wrapped model])."""


def _outside_transforms(method: Any) -> Any:
    """Run an engine entry point outside torch.func transforms (Note [torch.func transforms])."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._functorch.peek_interpreter_stack() is None:  # no transform: nothing to do
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return run


class TransferEngine:
    """Streams, events and prefetch decisions for one wrapped model; drives scope states."""

    def __init__(self, device: torch.device, policy: Policy) -> None:
        self.device = device
        self.policy = policy
        self.is_cuda = device.type == "cuda"
        self.scopes: list[Scope] = []
        self.grads = GradOffload(self)
        self._h2d_stream: Any = None
        self._d2h_stream: Any = None
        self._order: list[Scope] = []
        self._pos = 0
        self._learned = False
        self._index: dict[Scope, int] = {}
        self._live: dict[Scope, None] = {}  # scopes not OFFLOADED, in load order
        self._partial: dict[Scope, None] = {}  # LOADING with copies held back (_copy_more)
        # The scope whose backward runs now (pre_backward to post_backward). A checkpoint
        # recompute that does not pass through the module's hooks (transformers >= 5.2x
        # checkpoints `forward`, keeping hooks outside) still uses this scope's device copy.
        self._backward_scope: Scope | None = None
        self._bwd_order: list[Scope] = []  # scopes in order of first need in backward
        self._bwd_pos = 0
        self._bwd_seen: set[Scope] = set()  # needed already in the current backward
        self._saw_backward = False  # a backward ran since the current forward pass began
        self._expect_backward = False  # one ran after the previous pass
        self._unsynced_h2d: list[Any] = []  # events of copies that may still read host masters
        self._largest = 0  # set by scopes_ready: the largest scope's device bytes
        self._prefetch_bytes = 0  # set by scopes_ready: Policy.prefetch x the largest block
        self.handles: list[torch.utils.hooks.RemovableHandle] = []  # hooks on the wrapped model
        # Set by wrap: the module it wrapped (weak: the model holds the engine) and the
        # load_state_dict pre-hooks of Note [model-wide operations on a wrapped model] (_wrap.py).
        self.root: Callable[[], nn.Module | None] = lambda: None
        self.guard_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._model_forward = ModelForward.OUTSIDE
        self._last_begin: Scope | None = None  # where the last pass of the model's forward started
        # Where the pass after one that started at a scope started, the last time: passes that
        # alternate between starts (a vision-language model's image and text-only samples) or
        # follow a cycle (encoder-decoder generation) load the right first scope early.
        self._next_begin: dict[Scope, Scope] = {}
        self._preloaded: Scope | None = None  # loaded by begin_forward in the current model forward
        self._thread: int | None = None  # the thread of the latest forward (check_thread)
        self._create_graph = False  # the backward running now builds a graph (create_graph=True)
        self._pass_counted = False  # a call of the current pass can add to a gradient
        # Per scope, where its parameters are registered: (module._parameters, key, slot),
        # to notice fully_shard replacing them (Note [data-parallel wrappers] in _distributed.py).
        self._homes: dict[Scope, list[tuple[dict[str, Any], str, ParamSlot]]] = {}
        # The current stream before `on()` made a side stream current; None when none is
        # (Note [interrupts]).
        self._switched_from: Any = None
        _engines.add(self)

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the model is not wrapped (Note [copies of a wrapped model])

    def __reduce__(self) -> tuple:
        return (_no_engine, ())

    def scopes_ready(self) -> None:
        """Called by wrap once every scope is built."""
        self._largest = max((s.device_nbytes for s in self.scopes), default=0)
        blocks: dict[str, int] = {}
        for s in self.scopes:
            blocks[s.block] = blocks.get(s.block, 0) + s.device_nbytes
        self._prefetch_bytes = self.policy.prefetch * max(blocks.values(), default=0)
        for scope in self.scopes:
            ours = {id(slot.param): slot for slot in scope.slots}
            self._homes[scope] = [(m._parameters, k, ours[id(p)]) for m in scope.module.modules()
                                  for k, p in m._parameters.items() if id(p) in ours]

    def _prefetch(self, candidates: Any, current: Scope, *, with_grads: bool) -> None:
        """Load the candidates in order while their bytes fit the prefetch budget; scopes under
        1/TINY of the largest do not count (Note [prefetch order])."""
        budget = self._prefetch_bytes
        if budget == 0:
            return
        in_flight = 0
        for scope in candidates:
            if scope is current:
                continue
            size = scope.device_nbytes
            counted = size if size * TINY >= self._largest else 0
            if in_flight + counted > budget:
                return
            self.load(scope, with_grads=with_grads)
            in_flight += counted

    # ---- streams and events (no-ops on the CPU) -------------------------------------------

    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def h2d_stream(self) -> Any:
        if self.is_cuda and self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(self.device)
        return self._h2d_stream

    def d2h_stream(self) -> Any:
        if self.is_cuda and self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(self.device)
        return self._d2h_stream

    def record(self, stream: Any) -> Any:
        if stream is None:
            return None
        # blocking: a host that does wait on it (end of backward, the optimizer worker) sleeps
        # instead of spinning on a core the CPU optimizer could use.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    @staticmethod
    def wait(stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        """`with engine.on(stream):` enqueues the block's work on `stream` (nothing on the CPU)."""
        return _OnStream(self, stream) if stream is not None else contextlib.nullcontext()

    def restore_stream(self) -> None:
        """Make the stream that was current before `on()` switched current again, if an
        interrupt skipped `_OnStream.__exit__` (Note [interrupts]); called at the entry points."""
        previous = self._switched_from
        if previous is not None:
            torch.cuda.set_stream(previous)
            self._switched_from = None

    def hold(self) -> bool:
        return len(_holds) > 0

    # ---- scope state transitions (Note [scope states]) -------------------------------------

    def load(self, scope: Scope, *, with_grads: bool) -> None:
        """OFFLOADED -> LOADING: allocate on compute, copy host->device on the copy stream."""
        if scope.state is ScopeState.OFFLOADED:
            compute, h2d = self.compute_stream(), self.h2d_stream()
            scope.device_storage.resize_(scope.device_nbytes)
            self.wait(h2d, self.record(compute))  # alloc_done
            scope.chunks_waited = 0
            scope.chunk_ready = []
            progressive = not scope.casts and scope.copy_order is not None
            if not progressive:
                for slot in scope.slots:
                    if slot.step_pending:
                        wait_for_step(slot)
            if scope.host_shadow is not None:  # Policy(cast="host")
                self._refresh_shadow(scope)
            with self.on(h2d):  # plain tensors, nothing requires grad (Note [interrupts])
                if progressive:
                    assert scope.copy_order is not None
                    scope.copy_cursor, scope.copy_end, scope.copy_unmarked = 0, len(scope.copy_order), 0
                    self._copy_more(scope, need=-1)
                else:
                    scope.copy_cursor = scope.copy_end = 0
                    if not scope.casts:
                        scope.device_flat.copy_(scope.host_flat, non_blocking=True)
                    elif scope.host_shadow is not None:  # Policy(cast="host")
                        scope.device_flat.copy_(scope.host_shadow, non_blocking=True)
                    else:
                        self._copy_and_cast(scope)
                    scope.chunk_ready = [self.record(h2d)]
                    self._note_h2d(scope.weights_ready)
            if scope.host_shadow is not None:
                scope.shadow_read = scope.weights_ready
            scope.state = ScopeState.LOADING
            scope.loads += 1
            self._live[scope] = None
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("load %s (%.1f MiB)%s", scope.name, scope.nbytes / 2**20, self._mem())
        if with_grads:
            self._load_old_grads(scope)

    def _copy_more(self, scope: Scope, need: int) -> None:
        """Enqueue the next copies of a progressive load, in the order the forward first uses
        the parameters, with an event every CHUNK_BYTES (Note [progressive loads]). A parameter
        whose deferred optimizer step is pending (Note [deferred steps]) stops the copies there,
        unless its position is at most `need`: then the host waits for its step."""
        order = scope.copy_order
        assert order is not None
        h2d = self.h2d_stream()
        i = scope.copy_cursor
        with self.on(h2d):
            while i < scope.copy_end:
                slot = order[i]
                if slot.step_pending:
                    if i > need:
                        break
                    wait_for_step(slot)
                slot.device_view.copy_(slot.master, non_blocking=True)
                slot.chunk = len(scope.chunk_ready)
                scope.copy_unmarked += slot.device_view.nbytes
                i += 1
                if scope.copy_unmarked >= CHUNK_BYTES or i == scope.copy_end:
                    self._mark_chunk(scope, h2d)
            if scope.copy_unmarked:
                self._mark_chunk(scope, h2d)
        if i > scope.copy_cursor:  # the copy stream runs in order: its last event covers the rest
            self._note_h2d(scope.chunk_ready[-1])
        scope.copy_cursor = i
        if i < scope.copy_end:
            self._partial[scope] = None
        else:
            self._partial.pop(scope, None)

    def _mark_chunk(self, scope: Scope, h2d: Any) -> None:
        scope.chunk_ready.append(self.record(h2d))
        scope.copy_unmarked = 0

    def _pump(self) -> None:
        """Enqueue the copies that waited for deferred steps now done (no host wait)."""
        for scope in list(self._partial):
            self._copy_more(scope, need=-1)

    def _copy_and_cast(self, scope: Scope) -> None:
        """Policy(cast="device"): master bytes cross PCIe into a staging buffer, cast on the
        device. Runs on the copy stream; the staging buffer is allocated on that stream, so
        freeing it right after enqueueing the casts is stream-ordered."""
        staging = torch.empty(scope.nbytes, dtype=torch.uint8, device=self.device)
        staging.copy_(scope.host_flat, non_blocking=True)
        for slot in scope.slots:
            p = slot.param
            n = p.numel() * p.element_size()
            slot.device_view.copy_(staging[slot.offset : slot.offset + n].view(p.dtype).view(p.shape))

    def _refresh_shadow(self, scope: Scope) -> None:
        """Policy(cast="host"): re-cast the masters into the compute-dtype host copy after they
        changed. Waits (host side) for the previous copy out of the shadow, rarely pending."""
        if not scope.shadow_stale:
            return
        if scope.shadow_read is not None:
            scope.shadow_read.synchronize()
            scope.shadow_read = None
        shadow = scope.host_shadow
        assert shadow is not None
        for slot in scope.slots:
            dt, master = slot.device_view.dtype, slot.master
            n = master.numel() * dt.itemsize
            shadow[slot.device_offset : slot.device_offset + n].view(dt).view(master.shape).copy_(master)
        scope.shadow_stale = False

    def make_resident(self, scope: Scope, upto: ParamSlot | None = None) -> None:
        """-> RESIDENT: the compute stream waits (device side) for the weights' copy; with
        `upto`, only for the chunks up to the one holding that parameter (Note [progressive
        loads]). Copies still held back by deferred optimizer steps are enqueued first, the host
        waiting for the steps they need."""
        if scope.state is ScopeState.RESIDENT:
            return
        if scope.state is ScopeState.OFFLOADED:
            self.load(scope, with_grads=False)
        if self._partial:
            self._pump()
        if scope.copy_cursor < scope.copy_end:
            need = scope.copy_end - 1 if upto is None else upto.copy_index
            if need >= scope.copy_cursor:
                self._copy_more(scope, need)
        last = len(scope.chunk_ready) - 1
        target = last if upto is None else min(upto.chunk, last)
        compute = self.compute_stream()
        for i in range(scope.chunks_waited, target + 1):
            self.wait(compute, scope.chunk_ready[i])
        scope.chunks_waited = max(scope.chunks_waited, target + 1)
        if scope.chunks_waited > last and scope.copy_cursor >= scope.copy_end:
            scope.chunk_ready = []
            scope.state = ScopeState.RESIDENT

    def release(self, scope: Scope) -> None:
        """-> OFFLOADED: free the device copy, ordered after every queued use of it."""
        if scope.state is ScopeState.OFFLOADED:
            return
        compute = self.compute_stream()
        self.wait(compute, scope.weights_ready)  # a prefetch nobody used: the free must follow it
        self.wait(compute, scope.grads_ready)
        if scope.grads_ready is not None and any(s.old_grad_source is not None for s in scope.slots):
            scope.grads_ready.synchronize()  # unused fetches: their host sources may go below
        scope.grads_ready = None
        scope.chunk_ready = []
        scope.copy_cursor = scope.copy_end = 0
        self._partial.pop(scope, None)
        for slot in scope.slots:
            slot.old_grad = slot.old_grad_source = None
        if scope.graph_saved:
            scope.retire_device_storage()  # Note [higher-order gradients]
        else:
            scope.device_storage.resize_(0)
        scope.state = ScopeState.OFFLOADED
        self._live.pop(scope, None)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("release %s%s", scope.name, self._mem())

    def release_all(self) -> None:
        for scope in list(self._live):
            self.release(scope)

    def _load_old_grads(self, scope: Scope) -> None:
        """Fetch existing host grads of the scope's parameters, for accumulation on the device."""
        todo = []
        for slot in scope.slots:
            if slot.old_grad is None and not slot.grad_written:
                g = master_grad(slot.param)
                if g is not None:
                    todo.append((slot, g))
        if not todo:
            return
        compute, h2d = self.compute_stream(), self.h2d_stream()
        fetched = [(slot, g, torch.empty(g.shape, dtype=g.dtype, device=self.device)) for slot, g in todo]
        self.wait(h2d, self.record(compute))
        with self.on(h2d):
            for slot, g, old in fetched:
                old.copy_(g, non_blocking=True)
                slot.old_grad = old
                slot.old_grad_source = (g, g._version)
        scope.grads_ready = self.record(h2d)
        self._note_h2d(scope.grads_ready)

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
            if slot.scope.grads_ready is not None:
                slot.scope.grads_ready.synchronize()
            return None
        self.wait(self.compute_stream(), slot.scope.grads_ready)
        return g

    # ---- materialization for ops (Note [dispatch of an offloaded parameter]) ----------------

    @_outside_transforms
    def materialize(self, slot: ParamSlot, op_device: torch.device | None) -> torch.Tensor | None:
        scope = slot.scope
        if scope.active_calls > 0 or scope is self._backward_scope:
            if scope.state is not ScopeState.RESIDENT:
                self.make_resident(scope, upto=slot)
            if scope.copy_order is None and not in_backward():
                scope.first_uses.setdefault(slot, None)
            return slot.use_device_copy()
        p = slot.param
        needs_grad = torch.is_grad_enabled() and p.requires_grad
        if op_device is None:
            if self._computing():
                # Read by another module's forward (Mamba's mixer reads `conv1d.weight` of a
                # child whose forward never runs), or with no device tensor among the op's
                # arguments (`w.T`, `w.view(...)`): the device copy, not the host master.
                op_device = self.device
            elif not needs_grad:
                return None  # act on the host master
        return self._temporary_copy(slot, op_device, needs_grad)

    def _computing(self) -> bool:
        """In a forward of the wrapped model or of a scope (a recompute in backward included),
        where ops compute on the device. Not in the rest of backward: a user's gradient hook
        (an optimizer step in a post-accumulate-grad hook) acts on the host master."""
        return self._model_forward is not ModelForward.OUTSIDE or any(s.active_calls for s in self.scopes)

    def _temporary_copy(self, slot: ParamSlot, op_device: torch.device | None,
                        needs_grad: bool) -> torch.Tensor:
        """A copy of the master for one op outside the parameter's scope (tied weights,
        functional calls). Its gradient takes the same path as the scope's device copy."""
        master = slot.param
        dtype = slot.device_view.dtype
        if op_device is None or op_device.type == "cpu":
            copy = master.detach().to(dtype=dtype, copy=True)
        else:
            copy = torch.empty(master.shape, dtype=dtype, device=op_device)
            # slot.master is detached: the copy is a leaf of its own, not a CopyBackwards of
            # the master, without grad mode (Note [interrupts]).
            copy.copy_(slot.master, non_blocking=True)  # current stream: ordered with its use
            if op_device.type == "cuda":
                self._note_h2d(self.record(torch.cuda.current_stream(op_device)))
        if needs_grad:
            slot.used_outside = True  # its grad may come after its scope's backward
            copy.requires_grad_(True)
            copy.register_post_accumulate_grad_hook(functools.partial(self.grads.on_leaf_grad, slot))
        return copy

    def _note_h2d(self, event: Any) -> None:
        if event is not None:
            self._unsynced_h2d.append(event)
            if len(self._unsynced_h2d) > 64:
                self._unsynced_h2d = [e for e in self._unsynced_h2d if not e.query()]

    def before_master_write(self, slot: ParamSlot) -> None:
        """Called before an in-place op on a master: no copy may still be reading it, and a
        device copy made from the old value is stale."""
        scope = slot.scope
        scope.shadow_stale = True
        slot.retired_copies_written()  # also for the worker's steps (atomic version bumps)
        if getattr(worker_state, "active", False):
            # The optimizer worker: no copy reads this master (docs/design.md, Threads). A
            # device copy that no_offload() keeps is released by backward_and_step.
            return
        if self._unsynced_h2d:
            for event in self._unsynced_h2d:
                event.synchronize()
            self._unsynced_h2d.clear()
        if scope.state is not ScopeState.OFFLOADED and scope.active_calls == 0:
            self.release(scope)

    # ---- forward / backward progress (called by Scope hooks and GradOffload) ---------------

    @_outside_transforms
    def pre_forward(self, scope: Scope, inputs: list[torch.Tensor]) -> None:
        """`inputs`: the tensors among the forward's arguments."""
        if self._switched_from is not None:
            self.restore_stream()
        if in_backward():
            scope.active_calls += 1
            self.pre_backward(scope)
            return
        if _distributed.active():
            self._check_distributed(scope)
        self._check_inputs(scope, inputs)
        scope.active_calls += 1
        self._advance_order(scope)
        scope.calls_in_pass += 1
        # Only a call that can add to a gradient counts: grad enabled or, for the forward that
        # reentrant checkpointing runs without grad, an input that requires grad.
        if torch.is_grad_enabled() or any(t.requires_grad for t in inputs):
            scope.calls_since_backward += 1
            scope.counted_in_pass += 1
            self._pass_counted = True
        if self._partial:
            self._pump()
        if scope.state is ScopeState.OFFLOADED:
            scope.loads_on_demand += 1
        self.load(scope, with_grads=False)
        if self._learned:
            self._prefetch(self._order[self._pos :], scope, with_grads=False)
        # No wait here: each op waits for the chunk holding its weights (materialize).

    @_outside_transforms
    def begin_forward(self) -> None:
        """The wrapped model's forward starts a pass: load now the scope where the pass after
        the last one's start began last time (where the last one started, the first time; the
        head of the order before any), after releasing what an earlier pass left resident
        (Note [prefetch order])."""
        if self._switched_from is not None:
            self.restore_stream()
        if in_backward():
            return
        if _distributed.active():
            _distributed.check_ddp_forward("the model given to offtensor.wrap")
        self._model_forward = ModelForward.STARTING
        if not self._order or self._prefetch_bytes == 0 or self.hold():
            return
        last = self._last_begin
        first = self._next_begin.get(last, last) if last is not None else self._order[0]
        for scope in list(self._live):
            if scope is not first and scope.active_calls == 0:
                self.release(scope)
        if first.state is ScopeState.OFFLOADED:
            self.load(first, with_grads=False)
            self._preloaded = first

    @_outside_transforms
    def end_forward(self, *, failed: bool) -> None:
        """The wrapped model's forward ends. After an exception (also one raised outside every
        scope, e.g. in the loss), nothing it loaded stays on the device. Otherwise the order is
        cut where this pass ended, and what the pass loaded without using is released: the
        scope begin_forward loaded (an encoder-decoder decoding from cached encoder outputs), a
        prefetch along the cut tail."""
        if in_backward():
            return
        in_pass = self._model_forward is ModelForward.IN_PASS
        self._model_forward = ModelForward.OUTSIDE
        preloaded, self._preloaded = self._preloaded, None
        if failed:
            self.abort()
            return
        if in_pass:
            del self._order[self._pos :]  # what followed ran outside the model's forward
            unused = [s for s in self._live if s.calls_in_pass == 0]
        else:  # no scope ran in this forward
            unused = [preloaded] if preloaded is not None else []
        if not self.hold():
            for scope in unused:
                if scope.active_calls == 0:
                    self.release(scope)

    @_outside_transforms
    def post_forward(self, scope: Scope, *, failed: bool, backward_expected: bool) -> None:
        scope.active_calls = max(0, scope.active_calls - 1)
        if in_backward():
            return  # a recompute: the scope's backward follows, post_backward releases it
        if failed:
            self.abort()
            return
        if scope.copy_order is None and scope.first_uses:
            used = list(scope.first_uses)
            scope.copy_order = used + [s for s in scope.slots if s not in scope.first_uses]
            for i, slot in enumerate(scope.copy_order):
                slot.copy_index = i
            scope.first_uses.clear()
        if self.hold():
            return
        last = self._learned and self._pos == len(self._order) and self._order[-1] is scope
        # Under reentrant checkpointing the forward runs without grad, so nothing says a backward
        # follows except that one followed the previous pass (in training mode), and that a
        # call of this pass could add to a gradient (an input required grad; not so in a no-grad
        # evaluation forward).
        expected = self._expect_backward and scope.module.training and self._pass_counted
        if last and (backward_expected or expected):
            # The end of the forward: backward starts with this scope, kept resident (its
            # pre_backward prefetches the next ones), or, when checkpointing recomputes a split
            # block, with another scope of that block: prefetch that while the loss is computed.
            # (Not the former: the loss's peak memory plus a prefetch would raise the peak.)
            if self._bwd_order and self._bwd_order[0] is not scope:
                self._prefetch(self._bwd_order, scope, with_grads=True)
            return  # needed early in backward: no release and reload
        if backward_expected and scope.policy.keep_for_backward:
            return
        self.release(scope)

    @_outside_transforms
    def pre_backward(self, scope: Scope, *, create_graph: bool = False) -> None:
        """The scope's backward is about to run; `create_graph`: the backward builds a graph of
        its own (Note [higher-order gradients])."""
        if self._switched_from is not None:
            self.restore_stream()
        self.grads.enter_backward()
        if create_graph:
            self._create_graph = True
        if self._create_graph:
            scope.graph_saved = True
        self._backward_scope = scope
        self._saw_backward = True
        if scope.state is ScopeState.OFFLOADED:
            scope.loads_on_demand += 1
        self.load(scope, with_grads=True)
        if scope not in self._bwd_seen:
            self._bwd_seen.add(scope)
            self._advance_bwd_order(scope)
        ahead: Any = self._bwd_order[self._bwd_pos :]
        if not ahead:  # no backward seen yet, or this one departs from it
            i = self._index.get(scope)
            ahead = reversed(self._order[:i]) if i is not None else ()
        self._prefetch(ahead, scope, with_grads=True)
        self.make_resident(scope)

    @staticmethod
    def wait_for_step(slot: ParamSlot) -> None:
        """Block until a deferred optimizer step has written this master (Note [deferred
        steps]); called where `slot.step_pending` is seen."""
        wait_for_step(slot)

    def forward_position(self, scope: Scope) -> int:
        """Where the scope comes in the learned forward order (after all others if unknown)."""
        return self._index.get(scope, len(self._order))

    def _forget_backward(self) -> None:
        """No backward in progress: the next one starts at the head of the backward order."""
        self._backward_scope = None
        self._bwd_pos = 0
        self._bwd_seen.clear()

    def _advance_bwd_order(self, scope: Scope) -> None:
        order = self._bwd_order
        if self._bwd_pos < len(order) and order[self._bwd_pos] is scope:
            self._bwd_pos += 1
            return
        del order[self._bwd_pos :]
        order.append(scope)
        self._bwd_pos = len(order)

    @_outside_transforms
    def post_backward(self, scope: Scope) -> None:
        if self._backward_scope is scope:
            self._backward_scope = None
        self.grads.scope_done(scope)
        if self.hold() or scope.calls_in_pass > 1:
            return  # a module called several times: later calls' backward still needs it
        if scope.state is not ScopeState.OFFLOADED and scope.active_calls == 0:
            self.release(scope)

    @_outside_transforms
    def end_backward(self) -> None:
        """End of the outermost backward: nothing stays resident (unless no_offload holds, or
        the backward built a graph that may be differentiated again)."""
        self._forget_backward()
        for scope in self.scopes:
            scope.active_calls = 0
            scope.calls_since_backward = 0
            scope.counted_in_pass = 0
        self._create_graph = False
        if not self.hold():
            self.release_all()

    def backward_failed(self) -> None:
        """A backward raised where offtensor sees it (backward_and_step): its end-of-backward
        callback will not run, so forget it and release the scopes now. (After a plain
        `loss.backward()` that raised, the next forward does this.)"""
        self.grads.reset_if_stale()
        self.end_backward()

    def abort(self) -> None:
        """An exception in the forward: drop every device copy and in-flight prefetch. The next
        arrival of the first scope starts a new pass (resetting the per-pass counts)."""
        self._forget_backward()
        for scope in self.scopes:
            scope.active_calls = 0
            scope.calls_in_pass = 0
            scope.calls_since_backward -= scope.counted_in_pass  # the failed pass's graph is gone
            scope.counted_in_pass = 0
        self._pos = len(self._order)
        self._model_forward = ModelForward.OUTSIDE
        if not self.hold():
            self.release_all()

    def forget_calls(self, scope: Scope, n: int) -> None:
        """`n` calls of the scope never ended: a KeyboardInterrupt (or SystemExit) left them,
        which runs no hook (FailureCheck). Forget them; the device copy they kept resident is
        released unless another call uses it, also under no_offload(): while the scope counted
        as called, writes to its masters (an optimizer step) did not release it, so it may be
        older than they are. (Its count may have been reset since, by abort() or a new pass,
        without a release under no_offload(); the copy goes all the same.)"""
        scope.active_calls = max(0, scope.active_calls - n)
        if scope.active_calls == 0:
            self.release(scope)

    def _advance_order(self, scope: Scope) -> None:
        order = self._order
        begins = self._model_forward is ModelForward.STARTING
        if begins:
            self._model_forward = ModelForward.IN_PASS
            if self._last_begin is not None:
                self._next_begin[self._last_begin] = scope
            self._last_begin = scope
            i = self._index.get(scope)
            if order and order[0] is not scope and i is not None and i < len(order) and order[i] is scope:
                # The model's forward starts at a known scope other than the head of the order
                # (decoding from cached encoder outputs, a text-only sample of a vision-language
                # model, a dropped first layer): follow the order from there.
                self._learned = True
                self._start_pass(scope)
                self._pos = i + 1
                return
            if order and order[0] is not scope:  # starts at a scope never seen: learn anew
                logger.debug("forward pass starts at %s, not %s; relearning the order", scope.name, order[0].name)
                self._forget_order()
                self._start_pass(scope)
        elif not self.handles and len(order) > ORDER_LIMIT * len(self.scopes):
            self._forget_order()  # no model hook delimits passes, and they never start at its head
        if not begins and self._pos < len(order) and order[self._pos] is scope:
            self._pos += 1
        elif order and order[0] is scope and (begins or self._model_forward is ModelForward.OUTSIDE):
            # A new pass. Inside the model's forward only begin_forward starts one: a first
            # scope called again there (a looped block) continues the pass.
            self._learned = True
            self._start_pass(scope)
            self._pos = 1
        else:
            if self._learned:
                logger.debug("scope order changed at %s; relearning", scope.name)
            del order[self._pos :]
            order.append(scope)
            self._pos = len(order)
        self._index[scope] = self._pos - 1

    def _forget_order(self) -> None:
        self._order.clear()
        self._index.clear()
        self._learned = False
        self._pos = 0

    def _start_pass(self, first: Scope) -> None:
        self.grads.reset_if_stale()
        self._create_graph = False  # a create_graph backward that raised never reached its end
        self._pass_counted = False
        self._forget_backward()
        self._expect_backward, self._saw_backward = self._saw_backward, False
        for scope in self.scopes:
            scope.calls_in_pass = 0
            scope.counted_in_pass = 0
            if scope is not first:
                scope.active_calls = 0
        if not self.hold():
            for scope in list(self._live):
                if scope is not first:
                    self.release(scope)

    def check_thread(self, where: str) -> None:
        """One forward at a time per wrapped model: its scopes' device copies, call counts and
        learned order are shared, so a second thread's forward would corrupt the first's. The
        thread of the forward in progress owns the engine; another one is refused, before any
        state changes (its post-forward hooks then do nothing: foreign_thread)."""
        thread = threading.get_ident()
        if self._thread == thread:
            return
        busy = (self._model_forward is not ModelForward.OUTSIDE or self.grads.in_backward()
                or any(s.active_calls for s in self.scopes))
        if self._thread is not None and busy:
            raise RuntimeError(
                f"offtensor: {where} was called from thread {thread} while thread {self._thread} "
                "is in a forward or backward of the same wrapped model. A wrapped model runs one forward (and "
                "backward) at a time: use one wrapped model per thread, or serialize the calls "
                "with a lock"
            )
        self._thread = thread

    def foreign_thread(self) -> bool:
        """A forward hook runs on another thread than the forward in progress (check_thread
        refused its call). Backward runs on autograd's threads: never foreign."""
        return self._thread is not None and threading.get_ident() != self._thread and not in_backward()

    def _check_distributed(self, scope: Scope) -> None:
        """A process group exists: refuse DDP around a scope called outside the wrapped model's
        forward (begin_forward checks inside it), and fully_shard having replaced the scope's
        parameters (Note [data-parallel wrappers] in _distributed.py)."""
        if self._model_forward is ModelForward.OUTSIDE:
            _distributed.check_ddp_forward(f"scope {scope.name!r}")
        for params, key, slot in self._homes.get(scope, ()):
            if params.get(key) is not slot.param:
                raise _distributed.replaced_error(slot.name, scope.name, params.get(key))

    def _check_inputs(self, scope: Scope, inputs: list[torch.Tensor]) -> None:
        for i, t in enumerate(inputs):
            if t.device != self.device and not (t.device.type == "cpu" and t.dim() == 0):
                raise RuntimeError(
                    f"offtensor: input tensor {i} of scope {scope.name!r} "
                    f"(shape {tuple(t.shape)}, {t.dtype}) is on {t.device}, but the scope "
                    f"computes on {self.device}; move inputs with .to({str(self.device)!r}) (and "
                    "the model's unwrapped parts with model.to(...); offloaded parameters stay "
                    "on the host)"
                )

    def _mem(self) -> str:
        if not self.is_cuda:
            return ""
        return f"; device memory allocated {torch.cuda.memory_allocated(self.device) / 2**20:.1f} MiB"


class _OnStream:
    """What `TransferEngine.on(stream)` returns on CUDA: makes `stream` current in the block.
    The engine records the stream to go back to before switching, so that its next entry point
    switches back if an interrupt skipped `__exit__` (Note [interrupts])."""

    def __init__(self, engine: TransferEngine, stream: Any) -> None:
        self.engine = engine
        self.stream = stream
        self.previous: Any = None

    def __enter__(self) -> None:
        engine = self.engine
        self.previous = torch.cuda.current_stream(engine.device)
        if engine._switched_from is None:  # the outermost switch: what to go back to
            engine._switched_from = self.previous
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.previous)
        if self.previous is self.engine._switched_from:
            self.engine._switched_from = None


class no_offload(contextlib.ContextDecorator):
    """Turn offloading off temporarily: scopes loaded inside stay resident until the outermost
    `no_offload()` exits, which releases them.

    Useful when the model fits the device for a while (evaluation, generation of many tokens)
    and streaming every forward would only cost time.

    Example::

        with offtensor.no_offload():
            model.generate(input_ids, max_new_tokens=64)  # weights stream once, then stay
    """

    def __init__(self) -> None:
        self._depth = 0  # the same object may be entered again (a decorated recursive function)

    def __enter__(self) -> no_offload:
        self._depth += 1
        _holds.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        _holds.discard(self)
        if not _holds:
            for engine in list(_engines):
                if not in_backward():
                    engine.release_all()
