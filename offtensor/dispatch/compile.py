"""torch.compile of a wrapped model: scope hooks opaque to dynamo, device copies as graph inputs.

# Note [torch.compile]
Under `torch.compile(model)` or `block.compile()` dynamo traces a scope's module call, hooks
included. Tracing offtensor's hooks or `OffloadedParameter.__torch_function__` cannot work: they
keep Python state (scope states, call counts, the learned orders, the thread) that dynamo would
either guard on (a recompile at every call: the state changes every time) or fail to trace
(threading, logging, events), and a compiled graph has no per-op point at which to wait for a
chunk of a copy or a deferred optimizer step. So the two halves are kept apart:
- The hooks run outside dynamo. `Hook.__call__` (core/hooks.py) checks `in_compiled_region()`:
  traced, `torch.compiler.is_compiling()` is a constant True; run natively by compiled code
  (dynamo compiles or skips the hook's frame after the graph break, or runs it eagerly past the
  recompile limit) the frame-evaluation callback of dynamo is installed on the thread, which it
  never is in eager mode (nor in backward, which autograd runs outside the compiled call). It
  then calls the hook through `run_outside_dynamo`, which dynamo does not trace: one graph break
  at each scope boundary, and on every run of the compiled code the hook runs eagerly, as in
  eager mode. Deciding by the callback, not by whether dynamo traced the hook, matters: past the
  recompile limit a hook frame runs eagerly while the block's forward may still be compiled.
- Inside the scope, dynamo sees plain device tensors. In a compiled region a scope's hooks are
  `ScopeHooks.compiled_pre_forward`/`compiled_post_forward` (core/hooks.py). The first runs the
  eager hook, makes the whole scope
  resident (waiting for every chunk of its copy and every deferred optimizer step, which
  `__torch_function__` would have done op by op) and registers each parameter's device copy
  (`ParamSlot.use_device_copy`, the leaf the eager path hands to ops) in its module's
  `_parameters` in place of the OffloadedParameter (`expose`); the second puts the
  parameters back (`hide`) before the eager hook, which may release the scope. The compiled
  forward reads `self.weight` as a device `nn.Parameter`, a graph input like any parameter:
  dynamo guards on its metadata (type, shape, dtype, device, requires_grad), which do not change
  from call to call, so nothing recompiles, and one graph serves every block of the same code
  and shapes. The device copies are made `nn.Parameter`s (their class changes in place, hooks
  kept): AOTAutograd's first-run analysis (aot_eager) refuses other tensor subclasses as inputs.
  A call interrupted before its post-hook (KeyboardInterrupt) leaves them registered; the
  scope's next call puts the parameters back first (ScopeHooks._pre_forward).
- Gradients take the eager path (Note [gradient path] in core/grads.py): autograd accumulates into
  the device copy, a leaf whose post-accumulate-grad hook sends the gradient to the host `.grad`.
- Backward reads what the compiled forward saved: the device copies themselves, or views of
  them (AOTAutograd saves graph inputs as they are), which share the scope's device storage.
  The scope is loaded again into that same storage before its backward runs (the output-gradient
  hook that the eager post-forward hook registers on the block's outputs, Note [backward
  triggers] in core/hooks.py), exactly as in eager mode (Note [why storage is resized instead of
  reassigned] in core/slot.py); the release follows the input gradients, which the compiled backward computes in
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
- `backward_and_step` and `wait_for_steps` (optim/overlap.py) call themselves through
  `run_outside_dynamo` in a compiled region. Called from a compiled training step
  (`torch.compile` around forward, loss and the optimizer), dynamo went on into backward with its
  frame callback installed, compiled the gradient path's frames (each parameter's shape a
  recompile, then dynamic shapes) and failed on the host copy of a gradient. Outside it, backward
  and the optimizer's steps run eagerly, as `loss.backward()` does in compiled code.
A parameter read outside its own scope in compiled code (a tied weight read by another module)
is still an OffloadedParameter there: its `__torch_function__` calls `run_outside_dynamo`, so
the graph breaks at that op, which runs eagerly with a temporary device copy as in eager mode.
The compiler's own metadata queries on such a parameter while it builds fake tensors
(`p._is_view()`) run natively with `compiling()` true and read the master: nothing is copied.
CUDA graphs (`mode="reduce-overhead"`) assume parameters keep their addresses; a scope's device
storage is allocated anew at each load. The device copies reach a compiled block's graph as
inputs, not as parameters, which CUDA graph trees copy into the graph's own buffers at each
replay: inference matches the unwrapped model (tests/test_compile.py), at the cost of that copy.
Training under it is not supported yet (the test raised an overwritten-output error).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch


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


# Note [a compiled forward method]
# `block.forward = torch.compile(block.forward)` compiles the forward alone: the module's hooks
# run before and after it in eager code, where `in_compiled_region()` is false. The eager hooks
# left the OffloadedParameters registered, so each op on one in the compiled forward was a graph
# break (`__torch_function__` runs outside dynamo): the block ran op by op, eagerly, and
# `fullgraph=True` failed at its first op. So the eager hooks also take the compiled path
# (expose the device copies, hide them after) when the module's `forward` is a function that
# torch.compile returned (`compiled_function`); called from a compiled region, the hooks take it
# anyway. Run eagerly instead (dynamo's recompile limit, an error it suppresses), the forward
# computes with the exposed device copies as a graph break inside a compiled block does.


def compiled_function(fn: Any) -> bool:
    """`fn` is what torch.compile returned for a function or method (Note [a compiled forward
    method])."""
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def _no_callback() -> None:
    return None


_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", _no_callback)


def compiling() -> bool:
    """Dynamo traces the code calling this (a constant True of the trace), or the compiler runs
    it (its metadata queries while it builds fake tensors)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


# Note [tracing with make_fx]
# make_fx (which `torch.func.linearize`, `aot_function` and non-strict `torch.export` run)
# records every aten op dispatched while its proxy mode is on, and calls of the traced graph
# replay them. A forward of a wrapped model runs offtensor's own work too: loads (copies into
# the scope's device storage), releases, gradient fetches. Traced, the graph replayed those
# copies into device storage that had been released since (resized to 0 bytes): a crash when
# the linearized function was called, even with every parameter passed in by `functional_call`
# (the scopes' hooks still run). So the engine's entry points run with make_fx's modes (proxy,
# and the fake-tensor mode it may trace under) taken off (`untraced`): its bookkeeping acts on
# real tensors and stays out of the graph. An op on an offloaded parameter under tracing
# cannot be served: the graph would keep the device copy as a constant, and that storage is
# freed when the scope is released. It raises, naming the parameter (dispatch/param.py); passing the
# parameters in (`functional_call`) or unwrapping are the ways out.

_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_TRACING_MODES = (_PROXY, _FAKE)
_get_mode = torch._C._get_dispatch_mode


def tracing() -> bool:
    """make_fx is tracing the code calling this (Note [tracing with make_fx]); also before
    autograd (pre-dispatch, as torch.export does)."""
    # Read at every engine entry point and op on an offloaded parameter: no generator.
    return (_get_mode(_PROXY) is not None or _get_mode(_FAKE) is not None
            or torch._ops._get_dispatch_mode_pre_dispatch(_PROXY) is not None)


def untraced(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with make_fx's modes off (Note [tracing with make_fx])."""
    modes = [torch._C._unset_dispatch_mode(key) for key in _TRACING_MODES]
    pre_dispatch = torch._ops.unset_mode_pre_dispatch(_PROXY)
    try:
        return fn(*args, **kwargs)
    finally:
        if pre_dispatch is not None:
            torch._ops._set_mode_pre_dispatch(pre_dispatch)
        for mode in modes:
            if mode is not None:
                torch._C._set_dispatch_mode(mode)


# Note [compiling beside the optimizer worker]
# `torch.compiler.is_compiling()` reads one flag for the whole process, which dynamo sets for as
# long as it compiles a frame, on whichever thread. The optimizer worker (Note [deferred steps]
# in optim/overlap.py) steps while the next forward runs, and the first calls of a compiled forward
# compile: its torch.optim code then took the compiler's paths, on real tensors (AdamW's bias
# corrections as float32 tensors instead of Python floats, one step in 7 or so an ulp away from
# `optimizer.step()`; foreach and fused steps skip grouping their tensors by device and dtype).
# Dynamo compiles, and holds that flag, under its `compile_lock`; the worker steps each piece
# holding the same lock (`not_compiling`), so no compilation runs beside a step: a compile
# waits for the piece being stepped, a piece for the compile. Neither waits for the other while
# holding it: compiling reads masters without waiting for their steps (`_compiled_region_op` in
# dispatch/param.py). `torch.export` sets the flag without that lock and is not covered.


def not_compiling() -> Any:
    """A context in which dynamo compiles nothing on any other thread (Note [compiling beside
    the optimizer worker]); a no-op until dynamo is imported, which this does not do."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()
