"""torch.compile of a wrapped model: scope hooks opaque to dynamo, device copies as graph inputs.

# Note [torch.compile]
Under `torch.compile(model)` or `block.compile()` dynamo traces a scope's module call, hooks
included. It cannot trace offtensor's hooks or `OffloadedParameter.__torch_function__`: they
keep Python state (scope states, call counts, learned orders, a thread) that dynamo would guard
on (a recompile at every call) or fail to trace, and a compiled graph has no per-op point at
which to wait for a chunk of a copy or a deferred optimizer step. So the two are kept apart:
- the hooks run eagerly, outside dynamo: a graph break at each scope boundary (Note [hooks
  outside dynamo]);
- inside a scope, dynamo sees the device copies as `nn.Parameter`s, graph inputs (Note [device
  copies as graph inputs]); the first op of a block waits for the whole scope, since progressive
  loads (Note [progressive loads]) have no per-op hook to wait in;
- the compiled backward reads the scope's storage, loaded again before it (Note [a compiled
  backward]);
- a write to a parameter there writes its device copy, which the post-hook copies into the
  master (Note [writes in compiled code] in engine/writes.py);
- an op on a parameter outside its own scope breaks the graph and runs eagerly (Note [an op in
  compiled code] in dispatch/param.py);
- `backward_and_step` and `wait_for_steps` (optim/overlap.py) call themselves outside dynamo,
  so in a compiled training step backward and the optimizer's steps run eagerly, as
  `loss.backward()` does in compiled code. CUDA graphs: Note [CUDA graphs and scopes].
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch


def _call(fn: Any, args: tuple) -> Any:
    return fn(*args)


# Note [hooks outside dynamo]
# `Hook.__call__` (engine/hooks.py) calls its hook through `run_outside_dynamo` when
# `in_compiled_region()`. Traced, `torch.compiler.is_compiling()` is a constant True; run natively
# by compiled code (dynamo compiles or skips the hook's frame after the graph break, or runs it
# eagerly past the recompile limit), dynamo's frame-evaluation callback is installed on the
# thread, which it never is in eager mode, nor in backward (autograd runs it outside the compiled
# call). Dynamo traces neither `run_outside_dynamo` nor what it calls: a call from traced code is
# a graph break, and every run of the compiled code calls the hook eagerly. Deciding by the
# callback, not by whether dynamo traced the hook, matters: past the recompile limit a hook frame
# runs eagerly while the block's forward may still be compiled. torch._disable_dynamo imports
# dynamo on the first call only.
run_outside_dynamo = torch._disable_dynamo(_call)


def in_compiled_region() -> bool:
    """Called from code that dynamo traces or runs: `compiling()`, or a frame that dynamo runs
    without compiling it (a graph break, the recompile limit) while compiled code is running
    (its frame-evaluation callback is installed on this thread)."""
    # The call, not its flag (`_is_compiling_flag`, two Python calls fewer): traced, the call is
    # a constant True, where a read of the flag would be guarded and recompile at every call.
    return torch.compiler.is_compiling() or _eval_frame_callback() is not None


# Note [device copies as graph inputs]
# In a compiled region a scope's hooks are `ScopeHooks.compiled_pre_forward` and
# `compiled_post_forward` (engine/hooks.py). The first runs the eager hook, makes the whole scope
# resident (waiting for every chunk of its copy and every deferred optimizer step, which
# `__torch_function__` would do op by op) and registers each parameter's device copy
# (`ParamSlot.use_device_copy`, the leaf the eager path hands to ops) in its module's
# `_parameters` in place of the OffloadedParameter (`expose`); the second puts the parameters
# back (`hide`) before the eager hook, which may release the scope. Dynamo guards on the copies'
# metadata (type, shape, dtype, device, requires_grad), which do not change from call to call:
# nothing recompiles, and one graph serves every block of the same code and shapes. The copies
# are made `nn.Parameter`s (their class changed in place, hooks kept) because AOTAutograd's
# first-run analysis refuses other tensor subclasses as inputs. A call interrupted before its
# post-hook (KeyboardInterrupt) leaves them registered; the scope's next call puts the
# parameters back first (ScopeHooks._pre_forward).


# Note [a compiled backward]
# Gradients take the eager path: autograd accumulates into the device copy, a leaf whose
# post-accumulate-grad hook sends the gradient to the host `.grad` (Note [gradient path] in
# engine/grads.py). The compiled backward reads what the forward saved: the device copies or views
# of them (AOTAutograd saves graph inputs as they are), which share the scope's device storage.
# The scope is loaded again into that storage before its backward runs (the output-gradient hook
# of Note [backward triggers] in engine/hooks.py), as in eager mode (Note [why storage is resized
# instead of reassigned] in dispatch/slot.py), and released after the input gradients, which the
# compiled backward computes in the same node as the weight gradients. Tensors the forward
# computed from the weights (a transposed or cast copy) are the graph's own buffers. A checkpoint
# traced into a block's graph (transformers checkpoints a layer's `forward`, inside its hooks)
# recomputes from the saved inputs inside the compiled backward, after the pre-backward load; one
# dynamo does not trace (reentrant, or around the module call) calls the module again in
# backward, eagerly. tests/dispatch/test_compile.py checks with a backend whose compiled backward
# fails on any input with released storage.


# Note [CUDA graphs and scopes]
# CUDA graphs (`mode="reduce-overhead"`) assume parameters keep their addresses, but a scope's
# device storage is allocated anew at each load. The device copies reach a compiled block's graph
# as inputs, not as parameters, which CUDA graph trees copy into the graph's own buffers at each
# replay: inference matches the unwrapped model, at the cost of that copy. Training under CUDA
# graphs is not supported.


# Note [a compiled forward method]
# `block.forward = torch.compile(block.forward)` compiles the forward alone: the module's hooks
# run before and after it in eager code, where `in_compiled_region()` is false. Were the
# OffloadedParameters left registered, each op on one in the compiled forward would be a graph
# break (`__torch_function__` runs outside dynamo): the block would run op by op, eagerly, and
# `fullgraph=True` would fail at its first op. So the eager hooks also take the compiled path
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
# For a hook that autograd calls, never dynamo: `in_compiled_region` inlined there (Note [one
# gradient's host work] in engine/grads.py) reads this and `torch.compiler._is_compiling_flag`,
# what `torch.compiler.is_compiling()` returns outside TorchScript.
eval_frame_callback = _eval_frame_callback


def compiling() -> bool:
    """Dynamo traces the code calling this (a constant True of the trace), or the compiler runs
    it (its metadata queries while it builds fake tensors)."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


# Note [tracing with make_fx]
# make_fx (which `torch.func.linearize`, `aot_function` and non-strict `torch.export` run)
# records every aten op dispatched while its proxy mode is on, and calls of the traced graph
# replay them. A forward of a wrapped model runs offtensor's own work too: loads (copies into the
# scope's device storage), releases, gradient fetches. Traced, the graph would replay those
# copies into device storage released since (resized to 0 bytes), even with every parameter
# passed in by `functional_call` (the scopes' hooks still run). So the engine's entry points run
# with make_fx's modes (proxy, and the fake-tensor mode it may trace under) taken off
# (`untraced`): its bookkeeping acts on real tensors and stays out of the graph. An op on an
# offloaded parameter under tracing cannot be served: the graph would keep the device copy as a
# constant, and that storage is freed when the scope is released. It raises, naming the parameter
# (`replacements` in dispatch/ops.py); passing the parameters in (`functional_call`) or
# unwrapping are the ways out.

_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE
_TRACING_MODES = (_PROXY, _FAKE)
_get_mode = torch._C._get_dispatch_mode


def tracing() -> bool:
    """make_fx is tracing the code calling this (Note [tracing with make_fx]); also before
    autograd (pre-dispatch, as torch.export does)."""
    # Read at every engine entry point and op on an offloaded parameter: no generator, and the
    # pre-dispatch mode read from its stack's state directly (what _get_dispatch_mode_pre_dispatch
    # reads), from the list behind its `get(0)` where this torch has one.
    return (_get_mode(_PROXY) is not None or _get_mode(_FAKE) is not None
            or (_PRE_DISPATCH_INFRA[0] if _PRE_DISPATCH_INFRA is not None else _PRE_DISPATCH_MODES.get(0)) is not None)


_PRE_DISPATCH_MODES = torch._ops.mode_stack_state_for_pre_dispatch()  # one per process
# The list its `set` writes into and `get` reads from (a private, name-mangled attribute: None
# where a torch version has no such list, and `get(0)` is asked instead)
_PRE_DISPATCH_INFRA: list[Any] | None = getattr(_PRE_DISPATCH_MODES, "_ModeStackStateForPreDispatch__infra_modes", None)
if not (isinstance(_PRE_DISPATCH_INFRA, list) and _PRE_DISPATCH_INFRA):
    _PRE_DISPATCH_INFRA = None


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
# in optim/overlap.py) steps while the next forward runs, and the first calls of a compiled
# forward compile: its torch.optim code would then take the compiler's paths on real tensors
# (AdamW's bias corrections as float32 tensors instead of Python floats, a step an ulp away from
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
