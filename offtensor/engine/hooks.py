"""Module and tensor hooks: where a wrapped model's forward and backward reach the engine.

# Note [backward triggers]
Backward of a scope is bracketed by tensor hooks, not module backward hooks (which break
under checkpointing and in-place ops): a hook on each forward output that requires grad
fires when the first output gradient is computed, i.e. just before the module's backward
ops run (pre_backward: load, prefetch the previous scopes). A hook on each forward input that requires
grad fires once the gradient w.r.t. that input is complete; the last of them marks the end of
the module's backward (post_backward: release).
Scopes whose inputs need no grad (the first block of a frozen-embedding model) are released
by the end-of-backward callback (engine/grads.py). Recompute under checkpointing runs the
forward hooks again inside backward; the engine recognises it by the autograd graph task id
and neither reloads nor releases.

# Note [copies of a wrapped model]
`copy.deepcopy` and pickling (`torch.save(model)`) of a wrapped model, or of part of one, give
a plain model: each offloaded parameter copies as an `nn.Parameter` holding (a copy of) its
master, on the CPU, once its deferred optimizer step is done (OffloadedParameter.__deepcopy__,
__reduce_ex__), with the attributes set on it (`p.no_decay = True`) but not offtensor's `_ot`
(a plain Parameter's deepcopy drops them; kept here, as its pickling keeps them), and the
engine attribute as None, so the copy is not wrapped (an EMA copy of a large model stays in
host memory). Parameters and buffers that were not offloaded keep their
device, as any deepcopy does. Module hooks cannot be left out of a copy, so offtensor registers
them as `Hook` objects, which copy as inert hooks: without that, a copy would share the
original's scopes, streams and buffers. Each master has a storage of its own (Note [one storage
per master] in storage/memory.py), so pickling saves each master's bytes once, as it would a
plain parameter's, whatever dtypes its scope mixes.
"""

from __future__ import annotations

import operator
import sys
import threading
from typing import Any, Protocol

import torch
from torch import nn

from ..api import Residency, ScopeState
from ..dispatch import compile as _compile
from ..dispatch import wrapper_guards as _distributed
from ..dispatch.device_copies import unmark_exposed
from ..dispatch.eager_step import OPEN as STEP_WINDOW
from ..dispatch.eager_step import close_window
from ..dispatch.ops import masters_free, resident_copies_ready
from ..dispatch.slot import in_backward
from ..scopes.experts import fill_all_experts
from ..scopes.scope import Scope
from ..scopes.write_tracking import versions_of
from .call_args import call_tensors, on_grad
from .call_checks import Home, check_distributed, check_inputs
from .engine import (
    Engine,
    end_kept_backward,
    end_kept_call,
    kept_call_is_steady,
    start_kept_backward,
    start_kept_call,
)
from .exposed_calls import EagerExposure, homes_of
from .failures import FailureCheck
from .writes import DeviceVersions

_graph_task = torch._C._current_graph_task_id  # -1 outside backward (in_backward, without its call)
_transforms = torch._C._functorch.peek_interpreter_stack  # None outside torch.func transforms
_thread_id = threading.get_ident
_PACKED = operator.attrgetter("packed")


class PassPort(Protocol):
    """What a scope's hooks ask of the model's exposed pass (ExposedPass in engine/model_hooks.py)."""

    grad: bool  # the pass began with grad enabled: its calls place the backward's triggers
    def live(self) -> bool: ...  # the pass runs: its model call was not left by an interrupt
    def end_for_calls(self) -> None: ...  # a call that cannot skip its hooks: the pass goes on as a plain one


class ScopeHooks(EagerExposure):
    """The forward hooks of one scope's module and the tensor hooks they place on its inputs
    and outputs (Note [backward triggers])."""

    def __init__(self, scope: Scope, engine: Engine) -> None:
        super().__init__(scope, engine)
        self.calls = FailureCheck()  # did the module's forward raise (in _post_forward)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        # Where the scope's parameters are registered: (module._parameters, key, slot), to
        # notice fully_shard replacing them (Note [data-parallel wrappers] in dispatch/wrapper_guards.py).
        self._homes = homes_of(scope)
        self._exposed: list[Home] | None = None  # Note [torch.compile]
        self._versions: DeviceVersions = []  # of the exposed copies (Note [writes in compiled code])
        self._compared = False  # a compiled call compared the copies with the masters
        self._in_pre_hook = False  # a forward pre-hook of the scope runs
        self.exposed_pass: PassPort | None = None  # set by the model's hooks (engine/model_hooks.py)
        self._compiled_seen = False  # compiled code called the module: never exposed for a pass

    def install(self) -> None:
        module = self.scope.module
        # Called from compiled code, the hooks also expose the device copies (Note [torch.compile]).
        self.scope.hooks = self
        pre = Hook(self._eager_pre_forward, self.compiled_pre_forward)
        post = Hook(self._eager_post_forward, self.compiled_post_forward)
        self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        self.in_pass = False
        if self._attrs is not None:  # nothing of offtensor's stays in the modules
            self._unexpose_loaded()
        if self._exposed is not None:
            self._hide()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.scope.hooks = None

    def drop_interrupted(self) -> None:
        """Forget the calls a KeyboardInterrupt left (FailureCheck)."""
        interrupted = self.calls.drop_interrupted()
        if interrupted:
            _forget_calls(self.scope, interrupted)
            if self.scope.calls.running == 0:
                self._unexpose_loaded()  # Note [writes after an interrupt]

    def exposure_live(self) -> bool:
        """The copies are still exposed once the calls an interrupt ended are forgotten (a
        stack walk: asked only for a write through a parameter whose copies are exposed)."""
        if self.in_pass and self.exposed_pass is not None:
            return self.exposed_pass.live()
        self.drop_interrupted()
        return self.scope.exposed

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """True if the scope's device copies were found current (Engine.pre_forward)."""
        scope, engine = self.scope, self.engine
        backward = in_backward()
        if not backward:
            engine.thread.check("scope", scope.name)
        # Three frames of ours: this one, its caller (_eager_pre_forward or compiled_pre_forward)
        # and theirs (`Hook`, `_call` in dispatch/compile.py, or _eager_pre_forward).
        interrupted = self.calls.enter(ours=3)
        if interrupted:
            _forget_calls(scope, interrupted)
        if scope.calls.running == 0:
            if self._exposed is not None:
                self._hide()  # an interrupted compiled call left its device copies exposed
            if self._attrs is not None:
                self._unexpose_loaded()  # likewise an eager one
        tensors = call_tensors(args, kwargs)
        if not backward:
            if _distributed.active():
                check_distributed(scope, engine, self._homes)
            check_inputs(scope, engine.device, tensors)
        current = engine.pre_forward(scope, tensors)
        if torch.is_grad_enabled():
            _hook_inputs(self, tensors)
        return current

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        engine = self.engine
        if engine.thread.foreign():
            return  # refused by ThreadOwner.check: this call changed nothing
        failed = self.calls.failed()
        expected = not failed and torch.is_grad_enabled() and _hook_outputs(self, output)
        engine.post_forward(self.scope, failed=failed, backward_expected=expected)

    # ---- torch.compile (Note [torch.compile] in dispatch/compile.py) -------------------------------

    def _eager_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The forward pre-hook run by eager code; the compiled path for a module whose own
        `forward` is compiled (Note [a compiled forward method] in dispatch/compile.py)."""
        if self.in_pass:  # Note [exposed passes] in engine/model_hooks.py: the checks inline, asked at each call
            plan, thread, exposed_pass = self._attrs, _thread_id(), self.exposed_pass
            if (_graph_task() == -1 and _transforms() is None and self.engine.thread.owner == thread
                    and exposed_pass is not None and (plan is not None or (plan := self.expose_landed()) is not None)
                    and self.scope.state is ScopeState.RESIDENT and plan.fits(self.scope)):
                if exposed_pass.grad:
                    _hook_pass_call(self, call_tensors(args, kwargs))
                    return
                if not torch.is_grad_enabled():
                    return
            if self.engine.thread.owner == thread and exposed_pass is not None:
                exposed_pass.end_for_calls()  # (another thread's call is refused below)
        if self._steady_pre(module, args, kwargs):
            return
        self._in_pre_hook = True
        try:
            if _compile.compiled_function(module.forward):
                self.compiled_pre_forward(module, args, kwargs)
                return
            current = self._pre_forward(module, args, kwargs)
            loading = self.scope.loading  # not None while LOADING
            if loading is not None and loading.landed():  # Note [a load that landed before its call]
                self.scope.compute_waits(None)  # returns at once; -> RESIDENT
        finally:
            self._in_pre_hook = False
        if self.scope.state is ScopeState.RESIDENT and self._exposed is None and self._exposure.aliases is None:
            self._expose_loaded(current)

    def resident_in_call(self) -> None:
        """The scope became RESIDENT during a running call: its load's last chunk was waited for
        by an op (Note [calls of a loaded scope]). Not from inside a pre-hook, which decides itself."""
        if not self._in_pre_hook and self._exposed is None and self._exposure.aliases is None:
            self._expose_loaded(False)

    def _eager_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.in_pass:  # a call of an exposed pass, or one refused on another thread: nothing to end
            if torch.is_grad_enabled() and self.engine.thread.owner == _thread_id():
                _hook_outputs(self, output)  # (a pass with grad off ended when grad was turned on)
            return
        if self._exposure.aliases is not None:  # exposed by _expose_loaded
            if not self._steady_end(output):
                self._end_loaded_call(module, args, kwargs, output)
        elif self._exposed is not None:  # exposed by _eager_pre_forward or a compiled caller
            self.compiled_post_forward(module, args, kwargs, output)
        else:
            self._post_forward(module, args, kwargs, output)

    def _steady_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """The pre-hook of a steady call (Note [steady calls] in engine/engine.py), if this is
        one: what _eager_pre_forward would do, and True; else False, nothing changed."""
        scope, engine = self.scope, self.engine
        # The other objects' fields read directly, not through their methods: asked at each call
        if (self._attrs is not None or self._exposed is not None or self._exposure.aliases is not None
                or scope.routed or scope.compute_dtype_differs or self.calls.records
                or engine.thread.owner != _thread_id() or _graph_task() != -1 or _compile.tracing()
                or _transforms() is not None or _distributed.active()
                or _compile.compiled_function(module.forward) or not kept_call_is_steady(engine, scope)):
            return False
        self.calls.enter(ours=3)  # this frame, _eager_pre_forward's, Hook's: nothing to drop
        tensors = call_tensors(args, kwargs)
        check_inputs(scope, engine.device, tensors)
        start_kept_call(engine, scope, tensors)
        if torch.is_grad_enabled():
            _hook_inputs(self, tensors)
        if resident_copies_ready(scope, versions_read=True):
            self._expose_plan()
        return True

    def _steady_end(self, output: Any) -> bool:
        """The forward hook of an exposed call that can end steady: what _end_loaded_call would
        do, and True; else False, nothing changed (Note [steady calls] in engine/engine.py)."""
        engine, loaded = self.engine, self._loaded
        # Only a kept scope's call ends steady (end_kept_call): a streamed one's release decides
        # more, so it is refused first, before the version read.
        if (loaded is None or self.scope.residency is not Residency.KEPT or self._exposure.aliases
                or sys.exc_info()[1] is not None
                or engine.thread.owner != _thread_id() or _graph_task() != -1
                or versions_of(loaded[0].leaves) != loaded[1]
                or not end_kept_call(engine, self.scope)):
            return False  # .data aliases taken, an exception, a copy written: the full path
        self._unexpose_loaded()
        self._loaded = None
        self.calls.failed()  # this call's record; no exception is being handled
        if torch.is_grad_enabled():
            _hook_outputs(self, output)
        return True

    # ---- eager calls of a loaded scope (Note [calls of a loaded scope]) -------------------------

    def _expose_loaded(self, current: bool) -> None:
        """Put the device copies where the scope's modules' attribute lookups find them first,
        for this call, when each is ready as it is (ParamSlot.ready_copy) and a write to it can
        be copied back exactly or refused (no compute dtype, no transform or trace).
        `current`: this call's pre-hook found no master written since its copy was made."""
        scope = self.scope
        if (scope.compute_dtype_differs or self.engine.thread.foreign() or _compile.tracing()
                or _transforms() is not None):
            return
        if resident_copies_ready(scope, versions_read=current):
            self._expose_plan()

    def _end_loaded_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The copies taken back, their writes into the masters, then the eager hook (which may
        release the scope)."""
        if self.scope.calls.running <= 1:
            try:
                self._take_back_loaded()
            except RuntimeError:
                self._post_forward(module, args, kwargs, output)  # sees the error: a failed call
                raise
        self._post_forward(module, args, kwargs, output)

    # ---- exposed passes (Note [exposed passes] in engine/model_hooks.py) -------------------------

    def exposable(self) -> bool:
        """The scope can be exposed for a whole pass of the model: kept, resident, its copies current,
        none of its calls running or recorded, nothing compiled, no master compressed or in a file
        (whose writes are refused inside a call, which an exposed pass does not count); reads only."""
        scope = self.scope
        return (scope.state is ScopeState.RESIDENT and self._kept_and_idle()
                and not scope.writes.written_since_copied()
                and resident_copies_ready(scope, versions_read=True, in_call=False))

    def reloadable(self) -> bool:
        """The scope is kept but a write to its masters released it (an optimizer step), or it is
        loading still (an earlier pass did not call it): the pass may load it and expose it at its
        first call (Note [a pass that reloads what a step wrote] in engine/model_hooks.py); reads only."""
        scope = self.scope
        return (scope.state is not ScopeState.RESIDENT and scope.copy_order is not None and self._kept_and_idle()
                and masters_free(scope))

    def _kept_and_idle(self) -> bool:
        scope = self.scope
        return (scope.residency is Residency.KEPT and scope.calls.running == 0
                and not scope.routed and not scope.compute_dtype_differs and not any(map(_PACKED, scope.slots))
                and self._attrs is None
                and self._exposed is None and self._exposure.aliases is None and not self.calls.records
                and not self._compiled_seen and not _compile.compiled_function(scope.module.forward)
                and getattr(scope.module, "_compiled_call_impl", None) is None)

    def compiled_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The forward pre-hook when compiled code calls the module: the eager hook, then the
        whole scope resident and its device copies in place of the parameters."""
        self._compiled_seen = True
        was, self._in_pre_hook = self._in_pre_hook, True  # not exposed as for an eager call
        try:
            self._pre_forward(module, args, kwargs)
            self._expose()
        finally:
            self._in_pre_hook = was

    def compiled_post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The forward hook when compiled code calls the module: the parameters back, the writes
        to their device copies into the masters (Note [writes in compiled code] in
        engine/writes.py), then the eager hook (which may release the scope)."""
        if self.scope.calls.running <= 1 and self._exposed is not None:
            self._hide()
            versions, self._versions = self._versions, []
            try:
                # Not under torch.export's trace, whose modes would record the comparison.
                compare = not (self._compared or _compile.tracing() or torch._C._len_torch_function_stack())
                self.engine.writes.compiled_call_ended(self.scope, versions, compare=compare)
            except RuntimeError:
                self._post_forward(module, args, kwargs, output)  # sees the error: a failed call
                raise
            self._compared = True  # not after a refusal: the next call compares again
        self._post_forward(module, args, kwargs, output)

    def _expose(self) -> None:
        """Make the scope resident and register its device copies where its parameters are."""
        scope = self.scope
        if self.engine.thread.foreign():
            return
        scope.make_resident()
        fill_all_experts(scope)  # compiled code reads every expert's rows (Note [routed experts in backward])
        if scope.copy_order is None:
            # No op reports its first use in compiled code (Note [progressive loads]): copy in
            # the parameters' order. Later loads are then progressive, so a prefetch enqueues
            # what no deferred optimizer step holds back instead of waiting for every step.
            scope.set_copy_order(list(scope.slots))
        if self._exposed is not None:
            return  # a nested call of the same scope
        self._plan = None  # its copies become nn.Parameters: marked again for an eager call
        self._exposed = places = self._current_homes()
        for params, key, slot in places:
            leaf = slot.use_device_copy()
            if type(leaf) is not nn.Parameter:
                # A DeviceCopy (whose repr guards against printing released storage) becomes an
                # nn.Parameter for good: parts of torch.compile refuse other tensor subclasses
                # among the graph inputs (aot_eager's analysis of the first run), and module
                # code may check `isinstance(self.weight, nn.Parameter)`. Same object and hooks.
                leaf.__class__ = nn.Parameter
                unmark_exposed(leaf)  # an ExposedCopy's marks: it pickles as a Parameter again
            params[key] = leaf
        self._versions = [(slot, slot.device_leaf, slot.device_leaf._version) for slot in self.scope.slots]

    def _hide(self) -> None:
        """Put the OffloadedParameters back where `_expose` put device copies."""
        places, self._exposed = self._exposed, None
        for params, key, slot in places or ():
            params[key] = slot.param

    def inputs_done(self) -> None:
        self.engine.post_backward(self.scope)


# Note [calls of a loaded scope]
# Every op on an OffloadedParameter pays its `__torch_function__`, a Python round trip that can
# take longer than the short kernels of a DiT block it launches. A scope already RESIDENT when its
# call starts (kept, or loaded and waited for) needs no per-op decision: every op would get its
# device copy (Note [ops in a resident scope] in dispatch/ops.py). So for that call its modules'
# attributes are the device copies (instance attributes, found before nn.Module.__getattr__ reaches
# `_parameters`, which keeps the parameters: an interrupt leaves `parameters()` and `state_dict()`
# as they are), and ops see plain tensors. A scope still LOADING takes the per-op path, which waits
# for each op's chunk only, until an op has waited for the last chunk: RESIDENT then, its copies
# are exposed for the rest of the call (`resident_in_call`); one whose load has landed when the
# call starts is RESIDENT at once (Note [a load that landed before its call]). The copies are
# `ExposedCopy`s, nn.Parameters whose `.data` aliases are noted: a write in the forward changes the
# copy, as it changes a plain parameter at once, and at the call's end each copy whose version
# moved, or whose alias's did, is copied into its master (MasterWrites.exposed_call_ended); one
# whose master is compressed or in a file raises there instead, as a write through the parameter
# does at the op (Note [compressed masters] in storage/compress.py). A recompute in backward is
# exposed too (Note [exposed recomputes]). Not exposed: a compute dtype (a write could not be
# copied back exactly), torch.func transforms and make_fx traces; nor a routed expert parameter,
# whose ops copy the rows they read (Note [routed experts] in scopes/experts.py): the rest of its
# scope is exposed around it. A call that an interrupt ends: Note [writes after an interrupt].

# Note [writes after an interrupt]
# A KeyboardInterrupt inside an exposed call ends it without the forward hook (nn.Module runs
# `always_call` hooks for an Exception only), so the copies stay in the modules' attributes until
# offtensor next looks: the next call of the scope, the model's next forward, a write through one
# of its parameters, unwrap (which takes them out before it restores the parameters). Code that
# reads an attribute in between reads the copy, equal to its master; a write through it writes
# the copy and is lost then (docs/design.md, limits). It is not copied back when the call is
# forgotten: a copy's version also moves by offtensor's own writes in between (a load, a
# device-side optimizer step), which a version read cannot tell from a user's.

# Note [a load that landed before its call]
# A prefetched scope is LOADING when its call starts, even when every copy and conversion of its
# load has run (on the CPU, where copies are done when issued, always; on a GPU, when compute was
# the slower of the two): its ops would take the per-op path to wait for chunks there is no more
# reason to wait for. So the pre-hook asks the load's events that compute has not waited for
# (`LoadProgress.landed`: queries, the host never waits) and, when all have completed, makes
# compute wait for them (it returns at once) and the scope RESIDENT: the call is exposed from
# its first op. A load that has not landed keeps the per-op path and its chunk-by-chunk waits.

# Note [exposed recomputes]
# A checkpoint's recompute in backward runs the scope's hooks again when the checkpoint wraps
# the module's `__call__` (torch.utils.checkpoint of a block, diffusers, older transformers).
# Its pre-hook loads the scope whole (Engine.pre_backward), so the call starts RESIDENT and is
# exposed as a kept scope's forward call is, kept or streamed, reentrant or not. Its ops get
# the tensor the per-op path gives them (the device leaf): the graph, what it saves and the
# gradients' path are the same. A write runs again, as in the plain model's recompute, and is
# copied into the master at the call's end. `p.data = t` writes the copy in place (on the per-op
# path it writes the master, then the copy is refreshed); both bump the copy's version, so a
# graph that saved it before raises (Note [writes under a saved graph] in dispatch/slot.py),
# where a plain parameter takes new storage and a saved view keeps the old values. Not
# exposed: a recompute that runs no hook (newer transformers checkpoint a layer's `forward`, its
# hooks outside): no call brackets it, and exposing from the scope's pre_backward to its
# post_backward would show the copies to user code that runs in between (gradient hooks). Its
# ops keep the per-op path, whose short way (ParamSlot.ready_copy) counts the scope whose
# backward runs (`OpAccess.backward_scope`) as computing: a load in backward is whole.

# Note [writes through the parameter in an exposed call]
# Module code can reach a parameter other than through its module's attribute:
# `self.parameters()`, a reference taken before the call (or before its copies were exposed).
# In an exposed call the parameter's value is its copy's, which later ops read through the
# attribute: so an in-place op on the OffloadedParameter (`p.mul_(s)` under no_grad), `p.data`
# and `p.data = t`, and `p.detach()` act on the copy as the attribute would (`exposed_copy`
# in dispatch/slot.py), and the call's end copies what they wrote into the master. Written
# into the master instead, the copy that later ops read would be stale. An alias taken in the
# call is one of the copy: kept after the call, it is not the parameter's (docs/design.md,
# Limits).


class _AllInputGrads:
    """Counts the input gradients of one forward call; the last one ends the scope's backward.
    (Not `torch.autograd.graph.register_multi_grad_hook(mode="all")`, which asks autograd
    whether it will run each input's node: unsupported for a leaf input inside
    `torch.autograd.grad`, which gradient penalties call.)"""

    def __init__(self, hooks: ScopeHooks, n: int) -> None:
        self.hooks = hooks
        self.remaining = n

    def __call__(self, grad: torch.Tensor) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            hooks = self.hooks
            if not end_kept_backward(hooks.engine, hooks.scope):
                hooks.inputs_done()


class _FirstOutputGrad:
    """The hook on one forward call's outputs: the first gradient to reach one of them in a
    backward starts the scope's backward (Note [backward triggers]); the others, in the same
    backward (graph task), find it started and the scope resident, unless another scope's
    backward started in between. (A Flux block has two outputs: each backward of it would
    otherwise start twice.)"""

    __slots__ = ("hooks", "task")

    def __init__(self, hooks: ScopeHooks) -> None:
        self.hooks = hooks
        self.task = -1  # the graph task whose backward this call's first gradient started

    def __call__(self, grad: torch.Tensor) -> None:
        hooks, task = self.hooks, torch._C._current_graph_task_id()
        scope = hooks.scope
        if (task == self.task and scope.state is ScopeState.RESIDENT
                and hooks.engine.access.backward_scope is scope):
            return
        self.task = task
        # Autograd runs a backward with grad mode set to its create_graph flag.
        create_graph = torch.is_grad_enabled()
        if create_graph or not start_kept_backward(hooks.engine, scope):
            hooks.engine.pre_backward(scope, create_graph=create_graph)


class Hook:
    """A module hook calling `fn`, or `compiled_fn` outside dynamo when compiled code calls it
    (Note [torch.compile] in dispatch/compile.py); its copies do nothing (Note [copies of a wrapped model])."""

    def __init__(self, fn: Any, compiled_fn: Any = None) -> None:
        self.fn = fn
        self.compiled_fn = fn if compiled_fn is None else compiled_fn

    def __call__(self, *args: Any) -> Any:
        if STEP_WINDOW[0] is not None:  # Note [an eager optimizer step] in dispatch/eager_step.py
            close_window()
        # in_compiled_region(), inlined: asked at each call of a scope, twice
        if torch.compiler.is_compiling() or _compile.eval_frame_callback() is not None:
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


def _hook_inputs(hooks: ScopeHooks, tensors: list[torch.Tensor]) -> None:
    """The last gradient to reach an input of the call that requires grad ends the scope's backward."""
    inputs = [t for t in tensors if t.requires_grad]
    if inputs:
        done = _AllInputGrads(hooks, len(inputs))
        for t in inputs:
            on_grad(t, done)


def _hook_pass_call(hooks: ScopeHooks, tensors: list[torch.Tensor]) -> None:
    """A call of an exposed pass with grad (Note [exposed passes] in engine/model_hooks.py): counted
    if it can add to a gradient, as a steady call is, and its inputs hooked."""
    if hooks.engine.calls.counts(tensors):
        hooks.scope.calls.grad_call()
    if torch.is_grad_enabled():
        _hook_inputs(hooks, tensors)


def _hook_outputs(hooks: ScopeHooks, output: Any) -> bool:
    """The first gradient to reach an output of the call starts the scope's backward; True if
    one requires grad (a backward is expected)."""
    outputs = [t for t in call_tensors(output) if t.requires_grad]
    if outputs:
        first = _FirstOutputGrad(hooks)
        for t in outputs:
            on_grad(t, first)
    return bool(outputs)


def _forget_calls(scope: Scope, n: int) -> None:
    """`n` calls of the scope never ended: a KeyboardInterrupt (or SystemExit) left them, which
    runs no hook (FailureCheck). Forget them; the device copy they kept resident is released
    unless another call uses it, also under no_offload(): while the scope counted as called,
    writes to its masters (an optimizer step) did not release it, so it may be older than they
    are. (Its count may have been reset since, by Engine.abort or a new pass, without a release
    under no_offload(); the copy goes all the same.)"""
    scope.calls.ended(n, failed=True)
    if scope.calls.running == 0:
        scope.release(force=True)
