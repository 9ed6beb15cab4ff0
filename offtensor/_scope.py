"""A scope: one selected module whose parameters move to the device together.

# Note [scope states]
A scope's parameters share one flat host buffer (the masters, pinned) and one flat device buffer
of the same layout. The state says which of them holds usable weights:
- OFFLOADED: only the host buffer. The device buffer's storage is resized to 0 bytes.
- LOADING: device storage allocated and a host-to-device copy enqueued on the copy stream;
  `weights_ready` is the event recorded after it (`chunk_ready` after each part of it). Compute
  has not yet waited for all of it: ops wait for the part they use (Note [progressive loads]).
- RESIDENT: the compute stream has waited on `weights_ready`; ops may use the device copy.
Transitions are TransferEngine.load (OFFLOADED -> LOADING), make_resident (-> RESIDENT) and
release (-> OFFLOADED). There is no other per-scope flag: what a parameter "is" follows from its
scope's state.

# Note [why storage is resized instead of reassigned]
Autograd saves the device copy of a weight for backward (F.linear saves its weight). Each
parameter's device copy (`device_leaf`) is a tensor created once, sharing the scope's device
storage. Releasing resizes that storage to 0 bytes: the memory goes back to the allocator while
the tensors autograd saved stay valid objects with an unchanged version counter. Before backward
needs them, the scope is loaded again into the same storage object (see Note [backward
triggers]). Reassigning `.data` or allocating new tensors would either keep the memory alive
through autograd's references or break its saved-tensor checks.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _compile
from ._api import Policy, ScopeState

if TYPE_CHECKING:
    from ._param import OffloadedParameter
    from ._transfer import TransferEngine

# Each parameter starts at a multiple of this many bytes in the flat buffers (aligned loads).
ALIGN = 256


class DeviceCopy(torch.Tensor):
    """The device copy of an offloaded parameter: a plain tensor to every op, but printing it
    while its scope is offloaded (storage resized to 0 bytes) says so instead of reading freed
    memory. Tracebacks that show argument values (pytest, rich, debuggers) print these after an
    exception in a forward, when the scopes have already been released."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        needed = (self.storage_offset() + self.numel()) * self.element_size()
        if self.untyped_storage().nbytes() < needed:
            return (f"<offtensor device copy {tuple(self.shape)} {self.dtype} on {self.device}: "
                    "released, its scope is offloaded>")
        return super().__repr__(*args, **kwargs)


# ParamSlot.retired is written by the main thread (a retire) and by the optimizer worker (a
# step of that master): both hold this lock.
_retired_lock = threading.Lock()


def _alive(refs: list[weakref.ref]) -> list[weakref.ref]:
    return [r for r in refs if r() is not None]


def in_backward() -> bool:
    """True while the autograd engine runs (backward, and recompute under checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def device_copy(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size,
                requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A parameter's device copy in a scope's flat device buffer (which must be allocated),
    as (the leaf ops see, the view the loader writes through)."""
    view = flat[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
    base = torch.empty(0, dtype=dtype, device=flat.device)
    base.set_(flat.untyped_storage(), offset // dtype.itemsize, shape, view.stride())
    # A leaf of its own (not a view of `flat`), made without requires_grad_(), which
    # torch.func transforms refuse (a retire can happen inside one).
    leaf = torch.Tensor._make_subclass(DeviceCopy, base, requires_grad)
    return leaf, view


@dataclass(eq=False, repr=False)
class ParamSlot:
    """Per-parameter bookkeeping, stored on the parameter as `p._ot`."""

    param: OffloadedParameter
    name: str  # qualified name in the wrapped model
    scope: Scope
    offset: int  # bytes into the scope's host buffer (master layout)
    device_offset: int  # bytes into the scope's device buffer (compute-dtype layout)
    device_leaf: torch.Tensor  # what ops see; shares the scope's device storage
    device_view: torch.Tensor  # the same bytes as a view of device_flat, for the loader's
    # writes (writing through device_leaf would bump the version counter autograd checks)
    master: torch.Tensor  # the master's bytes in host_flat as a plain tensor: what the loader
    # reads, with no subclass dispatch and nothing for autograd to record (Note [interrupts])
    host_grad: torch.Tensor | None = None  # pinned; `p.grad` points here after backward
    grads_in_backward: int = 0  # contributions written to host_grad in the current backward
    single_grad: bool = False  # exactly one contribution in the last whole backward (Note [early handover])
    host_grad_holders: tuple[int, int] = (0, 0)  # _grads._holders(host_grad) when only we hold it
    used_outside: bool = False  # ever materialized for an op outside its scope
    last_d2h: Any = None  # event after the latest device-to-host copy into host_grad
    old_grad: torch.Tensor | None = None  # device copy of `p.grad`, fetched for accumulation
    # The host `p.grad` that old_grad was copied from, and its version counter then.
    old_grad_source: tuple[torch.Tensor, int] | None = None
    chunk: int = 0  # which of the scope's chunk_ready events covers this parameter's copy
    copy_index: int = 0  # position in the scope's copy_order
    step_pending: bool = False  # a deferred optimizer step still has to write the master
    grad_hooks: OrderedDict = field(default_factory=OrderedDict)  # register_hook hooks, see Note [user gradient hooks]
    post_hooks: OrderedDict = field(default_factory=OrderedDict)  # post-accumulate-grad hooks
    leaf_hooked: bool = False  # device_leaf has the post-accumulate-grad hook (hook_device_leaf)
    # Device copies of earlier storages that graphs of create_graph backwards may still read.
    retired: list[weakref.ref] = field(default_factory=list)

    @property
    def grad_written(self) -> bool:
        """host_grad received a contribution in the current backward."""
        return self.grads_in_backward > 0

    def __repr__(self) -> str:
        # Not the fields: device_view is a plain view of the scope's device buffer, which is
        # 0 bytes while the scope is offloaded, and printing it would read freed memory.
        return f"ParamSlot({self.name!r}, {tuple(self.param.shape)}, scope {self.scope.name!r})"

    def hook_device_leaf(self) -> None:
        """Route the device copy's gradients to the host (Note [gradient path] in _grads.py);
        for a frozen parameter, once it is unfrozen (use_device_copy)."""
        self.leaf_hooked = self.device_leaf.requires_grad
        if self.leaf_hooked:
            self.device_leaf.register_post_accumulate_grad_hook(
                functools.partial(self.scope.engine.grads.on_leaf_grad, self))

    def retired_copies_written(self) -> None:
        """The master is about to change: graphs holding a retired device copy of it must see
        it as modified in place (Note [higher-order gradients] in _transfer.py)."""
        if not self.retired:
            return  # the common case, without the lock
        with _retired_lock: refs, self.retired = self.retired, []  # noqa: E701 (Note [interrupts])
        for ref in refs:
            leaf = ref()
            if leaf is not None:
                torch.autograd.graph.increment_version(leaf)

    def use_device_copy(self) -> torch.Tensor:
        leaf = self.device_leaf
        wants = self.param.requires_grad
        if leaf.requires_grad != wants:  # the user froze or unfroze the parameter after wrap
            leaf.requires_grad_(wants)
            if wants and not self.leaf_hooked:
                self.hook_device_leaf()
        return leaf


class Scope:
    """One selected module: its parameters' flat buffers, state and module hooks."""

    def __init__(self, name: str, module: nn.Module, policy: Policy, engine: TransferEngine,
                 pinned: bool, block: str | None = None) -> None:
        self.name = name
        self.block = name if block is None else block  # the selected module (Policy.max_scope_bytes)
        self.module = module
        self.policy = policy
        self.engine = engine
        self.pinned = pinned
        self.slots: list[ParamSlot] = []
        self.nbytes = 0  # host buffer, master dtypes
        self.device_nbytes = 0  # device buffer, compute dtypes
        # Both replaced by wrap's _offload_params right after construction.
        self.host_flat = torch.empty(0, dtype=torch.uint8)  # pinned when `pinned`; all the masters' bytes
        self.device_flat = torch.empty(0, dtype=torch.uint8)  # on the compute device
        # Policy.compute_dtype differs from a master's dtype: the load casts (Policy.cast).
        self.casts = False
        self.host_shadow: torch.Tensor | None = None  # uint8, device layout (cast="host")
        self.shadow_stale = True  # masters changed since host_shadow was cast
        self.shadow_read: Any = None  # event after the latest copy from host_shadow
        self.state = ScopeState.OFFLOADED
        # A create_graph backward used the device copies: its graph may read them later, so
        # the release retires the storage instead of freing it (Note [higher-order gradients]).
        self.graph_saved = False
        self.chunk_ready: list[Any] = []  # events on the copy stream after each chunk of the
        # weights' copy, while LOADING (Note [progressive loads])
        self.chunks_waited = 0  # chunks the compute stream has waited for (Note [progressive loads])
        self.copy_cursor = 0  # copy_order entries whose copy is enqueued, in the current load
        self.copy_end = 0  # len(copy_order) during a progressive load, else 0
        self.copy_unmarked = 0  # bytes enqueued since the last chunk_ready event
        self.first_uses: dict[ParamSlot, None] = {}  # first forward: parameters in order of use
        self.copy_order: list[ParamSlot] | None = None  # learned from first_uses
        self.grads_ready: Any = None  # event on the copy stream after the old grads' copy
        self.grads_offloaded: Any = None  # event on the d2h stream after this backward's grads
        self.active_calls = 0  # forward calls of the module in progress (recompute included)
        self.calls_in_pass = 0  # forward calls in the current forward pass (shared modules)
        # Forward calls since the last backward ended: above 1, a backward may see several
        # contributions per parameter (shared modules; several forwards before one backward).
        self.calls_since_backward = 0
        self.counted_in_pass = 0  # of calls_in_pass, those counted in calls_since_backward
        self.loads = 0  # host-to-device loads of the weights, since wrap
        self.loads_on_demand = 0  # of which not prefetched: offloaded when the scope needed them
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.calls = FailureCheck()  # did the module's forward raise (in _post_forward)

    @property
    def weights_ready(self) -> Any:
        """The event after the whole weights' copy (the copy stream runs in order), or None once
        compute has waited for it."""
        return self.chunk_ready[-1] if self.chunk_ready else None

    @property
    def device_storage(self) -> torch.UntypedStorage:
        return self.device_flat.untyped_storage()

    def retire_device_storage(self) -> None:
        """Give the scope a new, empty device storage and new device copies; the old ones are
        left to the graphs that hold them (Note [higher-order gradients] in _transfer.py)."""
        flat = torch.empty(self.device_nbytes, dtype=torch.uint8, device=self.device_flat.device)
        for slot in self.slots:
            with _retired_lock: slot.retired = _alive(slot.retired) + [weakref.ref(slot.device_leaf)]  # noqa: E701
            slot.device_leaf, slot.device_view = device_copy(
                flat, slot.device_offset, slot.device_view.dtype, slot.param.shape,
                slot.device_leaf.requires_grad)
            slot.hook_device_leaf()
        flat.untyped_storage().resize_(0)
        self.device_flat = flat
        self.graph_saved = False

    def host_bytes(self) -> int:
        return self.nbytes + (self.device_nbytes if self.host_shadow is not None else 0)

    def device_bytes(self) -> int:
        n = self.device_storage.nbytes()
        return n + sum(s.old_grad.nbytes for s in self.slots if s.old_grad is not None)

    def num_params(self) -> int:
        return sum(s.param.numel() for s in self.slots)

    def install_hooks(self) -> None:
        # Called from compiled code, the hooks also expose the device copies (Note [torch.compile]).
        pre = Hook(self._pre_forward, functools.partial(_compile.pre_forward, self))
        post = Hook(self._post_forward, functools.partial(_compile.post_forward, self))
        self.handles.append(self.module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(self.module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # Note [backward triggers]
    # Backward of a scope is bracketed by tensor hooks, not module backward hooks (which break
    # under checkpointing and in-place ops): a hook on each forward output that requires grad
    # fires when the first output gradient is computed, i.e. just before the module's backward
    # ops run (pre_backward: load, prefetch the previous scopes). A hook on each forward input
    # that requires grad fires once the gradient w.r.t. that input is complete, i.e. when the
    # module's backward is done (post_backward: release). Scopes whose inputs need no grad (the
    # first block of a frozen-embedding model) are released by the end-of-backward callback
    # (_grads.py). Recompute under checkpointing runs the forward hooks again inside backward;
    # the engine recognises it by the autograd graph task id and neither reloads nor releases.

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not in_backward():
            self.engine.check_thread(f"scope {self.name!r}")
        interrupted = self.calls.enter()
        if interrupted:
            self.engine.forget_calls(self, interrupted)
        if self.active_calls == 0:
            _compile.hide(self)  # an interrupted compiled call left its device copies exposed
        tensors = _tensors(args, kwargs)
        self.engine.pre_forward(self, tensors)
        if torch.is_grad_enabled():
            inputs = [t for t in tensors if t.requires_grad]
            if inputs:
                done = _AllInputGrads(self, len(inputs))
                for t in inputs:
                    t.register_hook(done)

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.engine.foreign_thread():
            return  # refused by check_thread: this call changed nothing
        failed = self.calls.failed()
        outputs = [] if failed or not torch.is_grad_enabled() else [
            t for t in _tensors(output) if t.requires_grad
        ]
        for t in outputs:
            t.register_hook(self._on_output_grad)
        self.engine.post_forward(self, failed=failed, backward_expected=bool(outputs))

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Autograd runs a backward with grad mode set to its create_graph flag.
        self.engine.pre_backward(self, create_graph=torch.is_grad_enabled())


# Note [copies of a wrapped model]
# `copy.deepcopy` and pickling (`torch.save(model)`) of a wrapped model, or of part of one, give
# a plain model: each offloaded parameter copies as an `nn.Parameter` holding (a copy of) its
# master, on the CPU, once its deferred optimizer step is done (OffloadedParameter.__deepcopy__,
# __reduce_ex__), and the engine attribute as None, so the copy is not wrapped (an EMA copy of a
# large model stays in host memory). Parameters and buffers that were not offloaded keep their
# device, as any deepcopy does. Module hooks cannot be left out of a copy, so offtensor registers
# them as `Hook` objects, which copy as inert hooks: without that, a copy would share the
# original's scopes, streams and buffers. Each master has a storage of its own (Note [one storage
# per master] in _host_memory.py), so pickling saves each master's bytes once, as it would a
# plain parameter's, whatever dtypes its scope mixes.


class Hook:
    """A module hook calling `fn`, or `compiled_fn` outside dynamo when compiled code calls it
    (Note [torch.compile] in _compile.py); its copies do nothing (Note [copies of a wrapped model])."""

    def __init__(self, fn: Any, compiled_fn: Any = None) -> None:
        self.fn = fn
        self.compiled_fn = fn if compiled_fn is None else compiled_fn

    def __call__(self, *args: Any) -> Any:
        if _compile.in_compiled_region():
            return _compile.run_outside_dynamo(self.compiled_fn, args)
        return self.fn(*args)

    def __deepcopy__(self, memo: dict) -> _InertHook:
        return _InertHook()

    def __reduce__(self) -> tuple:
        return (_InertHook, ())


class _InertHook:
    """What a copy of a wrapped model has where the original has offtensor's hooks."""

    def __call__(self, *args: Any) -> None:
        return None


class FailureCheck:
    """Tells a forward hook registered with `always_call=True` whether the forward raised, and
    a forward pre-hook whether earlier calls never ended.

    PyTorch runs such a hook inside its `except` block when the forward raises, but
    `sys.exc_info()` alone cannot tell: a module called while its caller handles an exception
    (a retry after an out-of-memory error, inside `except`) sees that exception there too. So
    the forward pre-hook records the exception being handled when the call starts (`enter`),
    and the call failed if another one is being handled when it ends (`failed`).

    PyTorch catches only `Exception` there: a call left by a `KeyboardInterrupt` (Ctrl-C in a
    notebook) or `SystemExit` runs no hook, and its record stays. So each record also holds the
    frame of the module call running the hooks (the first frame outside offtensor: PyTorch's
    `_call_impl`), which lives exactly as long as the call; `enter` drops the records of this
    thread whose frame is not on the stack any more, and says how many. (A record kept this way
    keeps that frame, and the tensors it refers to, until the module's next call; the
    interrupt's own traceback holds them as well.)"""

    def __init__(self) -> None:
        # One per call in progress: (thread, frame of the call, exception handled at entry).
        self._calls: list[tuple[int, FrameType | None, BaseException | None]] = []

    def enter(self) -> int:
        """Record a call; return how many earlier calls were found to have been interrupted."""
        frame = _outside_offtensor(sys._getframe(1))
        interrupted = self.drop_interrupted(frame)
        self._calls.append((threading.get_ident(), frame, sys.exc_info()[1]))
        return interrupted

    def drop_interrupted(self, frame: FrameType | None = None) -> int:
        """Forget this thread's calls whose frame is no longer on the stack (seen from `frame`,
        default the caller's); return how many. Dropping a record lets its frame go, and with
        it whatever that frame still holds: torch.utils.checkpoint's suspended generator keeps
        its saved-tensor hooks pushed until it is collected, and collected inside the next
        checkpointed call it would pop that call's hooks instead (the model's forward therefore
        drops every scope's interrupted calls before anything else runs)."""
        thread = threading.get_ident()
        if not any(c[0] == thread for c in self._calls):  # nothing to check: no stack walk
            return 0
        if frame is None:
            frame = _outside_offtensor(sys._getframe(1))
        on_stack, f = set(), frame
        while f is not None:
            on_stack.add(id(f))
            f = f.f_back
        live = [c for c in self._calls if c[0] != thread or id(c[1]) in on_stack]
        interrupted = len(self._calls) - len(live)
        self._calls = live
        return interrupted

    def failed(self) -> bool:
        thread = threading.get_ident()
        at_entry = None
        for i in range(len(self._calls) - 1, -1, -1):
            if self._calls[i][0] == thread:
                at_entry = self._calls.pop(i)[2]
                break
        current = sys.exc_info()[1]
        return current is not None and current is not at_entry


def _outside_offtensor(frame: FrameType | None) -> FrameType | None:
    """The first frame, from `frame` outwards, that is not offtensor's: the module call's."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("offtensor."):
        frame = frame.f_back
    return frame


class _AllInputGrads:
    """Counts the input gradients of one forward call; the last one ends the scope's backward."""

    def __init__(self, scope: Scope, n: int) -> None:
        self.scope = scope
        self.remaining = n

    def __call__(self, grad: torch.Tensor) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.scope.engine.post_backward(self.scope)


def _tensors(*trees: Any) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(trees)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
