"""torch.compile of a wrapped model: scope hooks opaque to dynamo, device copies as graph inputs.

# Note [torch.compile]
Under `torch.compile(model)` or `block.compile()` dynamo traces a scope's module call, hooks
included. Tracing offtensor's hooks or `OffloadedParameter.__torch_function__` cannot work: they
keep Python state (scope states, call counts, the learned orders, the thread) that dynamo would
either guard on (a recompile at every call: the state changes every time) or fail to trace
(threading, logging, events), and a compiled graph has no per-op point at which to wait for a
chunk of a copy or a deferred optimizer step. So the two halves are kept apart:
- The hooks run outside dynamo. `Hook.__call__` (_scope.py) checks `in_compiled_region()`:
  traced, `torch.compiler.is_compiling()` is a constant True; run natively by compiled code
  (dynamo compiles or skips the hook's frame after the graph break, or runs it eagerly past the
  recompile limit) the frame-evaluation callback of dynamo is installed on the thread, which it
  never is in eager mode (nor in backward, which autograd runs outside the compiled call). It
  then calls the hook through `run_outside_dynamo`, which dynamo does not trace: one graph break
  at each scope boundary, and on every run of the compiled code the hook runs eagerly, as in
  eager mode. Deciding by the callback, not by whether dynamo traced the hook, matters: past the
  recompile limit a hook frame runs eagerly while the block's forward may still be compiled.
- Inside the scope, dynamo sees plain device tensors. In a compiled region a scope's hooks are
  `pre_forward`/`post_forward` below. `pre_forward` runs the eager hook, makes the whole scope
  resident (waiting for every chunk of its copy and every deferred optimizer step, which
  `__torch_function__` would have done op by op) and registers each parameter's device copy
  (`ParamSlot.use_device_copy`, the leaf the eager path hands to ops) in its module's
  `_parameters` in place of the OffloadedParameter (`expose`); `post_forward` puts the
  parameters back (`hide`) before the eager hook, which may release the scope. The compiled
  forward reads `self.weight` as a device `nn.Parameter`, a graph input like any parameter:
  dynamo guards on its metadata (type, shape, dtype, device, requires_grad), which do not change
  from call to call, so nothing recompiles, and one graph serves every block of the same code
  and shapes. The device copies are made `nn.Parameter`s (their class changes in place, hooks
  kept): AOTAutograd's first-run analysis (aot_eager) refuses other tensor subclasses as inputs.
  A call interrupted before `post_forward` (KeyboardInterrupt) leaves them registered; the
  scope's next call puts the parameters back first (Scope._pre_forward).
- Gradients take the eager path (Note [gradient path] in _grads.py): autograd accumulates into
  the device copy, a leaf whose post-accumulate-grad hook sends the gradient to the host `.grad`.
- Backward reads what the compiled forward saved: the device copies themselves, or views of
  them (AOTAutograd saves graph inputs as they are), which share the scope's device storage.
  The scope is loaded again into that same storage before its backward runs (the output-gradient
  hook that the eager post-forward hook registers on the block's outputs, Note [backward
  triggers] in _scope.py), exactly as in eager mode (Note [why storage is resized instead of
  reassigned]); the release follows the input gradients, which the compiled backward computes in
  the same node as the weight gradients. Tensors the compiled forward computed from the weights
  (a transposed or cast copy) are its own buffers, kept alive by the graph. A checkpoint traced
  into a block's graph (transformers checkpoints a layer's `forward`, inside its hooks)
  recomputes from those saved inputs inside the compiled backward, after the scope's
  pre-backward load; a checkpoint dynamo does not trace (reentrant, or around the module call)
  runs eagerly and calls the module, hooks included, again in backward, where no compiled region
  is active: the recompute runs in eager mode. tests/test_compile.py checks with a backend whose
  compiled backward fails on any input with released storage.
- Progressive loads (Note [progressive loads]) do not apply: a compiled graph has no per-op hook
  to wait in, so the first op of a block waits for the whole scope.
A parameter read outside its own scope in compiled code (a tied weight read by another module)
is still an OffloadedParameter there: its `__torch_function__` calls `run_outside_dynamo`, so
the graph breaks at that op, which runs eagerly with a temporary device copy as in eager mode.
The compiler's own metadata queries on such a parameter while it builds fake tensors
(`p._is_view()`) run natively with `compiling()` true and read the master: nothing is copied.
CUDA graphs (`mode="reduce-overhead"`) assume parameters keep their addresses; a scope's device
storage is allocated anew at each load, so they are not supported.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ._scope import ParamSlot, Scope


def _call(fn: Any, args: tuple) -> Any:
    return fn(*args)


# Dynamo neither traces this nor what it calls: a call from traced code is a graph break, and
# the compiled code calls it on every run (Note [torch.compile]). torch._disable_dynamo imports
# dynamo on the first call only.
run_outside_dynamo = torch._disable_dynamo(_call)


def in_compiled_region() -> bool:
    """Called from code that dynamo traces or runs: `compiling()`, or a frame that dynamo runs
    without compiling it (a graph break, the recompile limit) while compiled code is running
    (its frame-evaluation callback is installed on this thread)."""
    return torch.compiler.is_compiling() or _eval_frame_callback() is not None


def _no_callback() -> None:
    return None


_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", _no_callback)


def compiling() -> bool:
    """Dynamo traces the code calling this (a constant True of the trace), or the compiler runs
    it (its metadata queries while it builds fake tensors)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


Home = tuple[dict[str, Any], str, "ParamSlot"]  # (module._parameters, key, slot)

# Per scope whose device copies a compiled call exposes: where each was put, for `hide`.
_exposed: weakref.WeakKeyDictionary[Scope, list[Home]] = weakref.WeakKeyDictionary()
# Per scope, where its offloaded parameters are registered (computed at its first compiled call).
_homes: weakref.WeakKeyDictionary[Scope, list[Home]] = weakref.WeakKeyDictionary()


def homes(scope: Scope) -> list[Home]:
    """Where the scope's offloaded parameters are registered: (module._parameters, key, slot),
    a parameter shared by several modules of the scope once per module."""
    places = _homes.get(scope)
    if places is None or any(params.get(key) is not slot.param for params, key, slot in places):
        ours = {id(slot.param): slot for slot in scope.slots}
        places = [(m._parameters, k, ours[id(p)]) for m in scope.module.modules()
                  for k, p in m._parameters.items() if p is not None and id(p) in ours]
        _homes[scope] = places
    return places


def pre_forward(scope: Scope, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The scope's forward pre-hook when compiled code calls the module: the eager hook, then
    the whole scope resident and its device copies in place of the parameters."""
    scope._pre_forward(module, args, kwargs)
    expose(scope)


def post_forward(scope: Scope, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """The scope's forward hook when compiled code calls the module: the parameters back, then
    the eager hook (which may release the scope)."""
    if scope.active_calls <= 1:
        hide(scope)
    scope._post_forward(module, args, kwargs, output)


def expose(scope: Scope) -> None:
    """Make the scope resident and register its device copies where its parameters are."""
    if scope.engine.foreign_thread():
        return
    scope.engine.make_resident(scope)
    if scope.copy_order is None:
        # No op reports its first use in compiled code (Note [progressive loads]): copy in the
        # parameters' order. Later loads are then progressive, so a prefetch enqueues what no
        # deferred optimizer step holds back instead of waiting on the host for every step.
        scope.copy_order = list(scope.slots)
        for i, slot in enumerate(scope.copy_order):
            slot.copy_index = i
    if scope in _exposed:
        return  # a nested call of the same scope
    places = homes(scope)
    _exposed[scope] = places
    for params, key, slot in places:
        leaf = slot.use_device_copy()
        if type(leaf) is not nn.Parameter:
            # A DeviceCopy (whose repr guards against printing released storage) becomes an
            # nn.Parameter for good: parts of torch.compile refuse other tensor subclasses
            # among the graph inputs (aot_eager's analysis of the first run), and module code
            # may check `isinstance(self.weight, nn.Parameter)`. Same object, same hooks.
            leaf.__class__ = nn.Parameter
        params[key] = leaf


def hide(scope: Scope) -> None:
    """Put the OffloadedParameters back where `expose` put device copies."""
    places = _exposed.pop(scope, None)
    if places is None:
        return
    for params, key, slot in places:
        params[key] = slot.param
