"""OffloadedParameter: an nn.Parameter whose master lives in host memory.

# Note [dispatch of an offloaded parameter]
Every torch op that receives an OffloadedParameter comes through `__torch_function__`. We decide,
per parameter, which tensor the op really sees (Engine.materialize):
- inside its own scope's forward (or the recompute of it under checkpointing): the scope's device
  copy, one per scope, shared by all ops (`ParamSlot.device_leaf`);
- anywhere else, when the op needs a gradient for it or runs on the compute device with device
  tensors (a tied embedding read by a resident head, a user's functional call): a temporary copy
  made for that op, with its own path for the gradient;
- otherwise (optimizer updates, init, state_dict, printing): the host master itself.
Property access (`p.grad`, `p.data`, `p.requires_grad`) also comes here and always acts on the
master, so `p.grad` is the host gradient and `p.device` is `cpu`. Results are never wrapped in the
subclass: ops run with subclass dispatch off (`without_subclass_dispatch`), so optimizer state, `zeros_like(p)` and
`state_dict()` hold plain tensors.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils.hooks import RemovableHandle

from .. import patches
from ..api import MasterHome
from ..core.slot import ParamSlot, in_backward, on_optimizer_worker
from ..distributed import wrappers as _distributed
from ..weights.compress import AS_PLAIN, packed_of, packed_property, packed_torch_function
from . import compile as _compile

_disabled_torch_function_impl = torch._C._disabled_torch_function_impl
_TensorBase = torch._C.TensorBase


class OffloadedParameter(nn.Parameter):
    """An `nn.Parameter` kept in (pinned) host memory and streamed to the device when used.

    `isinstance(p, nn.Parameter)` holds and `p.device` is `cpu`: the tensor itself is the host
    master. Created only by `offtensor.wrap`, which changes the class of the model's existing
    parameter objects in place (their identity, and any optimizer built on them, is kept).
    """

    _ot: ParamSlot  # its bookkeeping (core/slot.py)

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> nn.Parameter:  # type: ignore[misc]
        # Code that rebuilds a parameter as `type(p)(new_data)` (accelerate's
        # set_module_tensor_to_device, which load_checkpoint_in_model and dispatch_model use)
        # gets a plain Parameter: a new object belongs to no scope, and an OffloadedParameter
        # without one would claim to be offloaded while nothing loads or offloads it.
        return nn.Parameter(torch.empty(0) if data is None else data, requires_grad)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if _compile.compiling():  # an op outside the parameter's scope: Note [torch.compile]
            return _compile.run_outside_dynamo(_compiled_region_op, (func, args, kwargs or {}))
        entry = _AUTOGRAD_ENTRIES.get(func)
        if entry is not None:  # with dispatch on: Note [gradients with respect to a parameter]
            return entry(*args, **(kwargs or {}))
        return without_subclass_dispatch(_torch_function, func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return without_subclass_dispatch(_repr, self)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # A copy is a plain Parameter holding a copy of the master: it belongs to no scope.
        _await_steps([self], torch.Tensor.clone)  # a deferred optimizer step may still write the master
        result = without_subclass_dispatch(lambda p: nn.Parameter(master_values(p), p.requires_grad), self)
        memo[id(self)] = result
        result.__dict__.update(copy.deepcopy(_attributes(self), memo))  # `p.no_decay = True`
        return result

    def set_(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        # `Tensor.set_` does not dispatch to __torch_function__: a method of the class instead.
        _await_steps([self], torch.Tensor.set_)  # a deferred optimizer step may still write the master
        return without_subclass_dispatch(_set, self, *args, *kwargs.values())

    def __reduce_ex__(self, proto):  # type: ignore[override]
        # Pickle (torch.save) as a plain Parameter: the offloading is a runtime arrangement
        # (Note [copies of a wrapped model] in core/hooks.py).
        _await_steps([self], torch.Tensor.clone)  # pickling reads the values
        return without_subclass_dispatch(_reduce, self)


# Note [interrupts]
# A KeyboardInterrupt (Ctrl-C) can arrive between any two bytecodes of Python code, including
# inside a Python context manager's `__enter__` after it changed a setting and before the `with`
# body starts: then its `__exit__` never runs (torch.no_grad() left grad mode off for the rest
# of a process this way). So offtensor changes no process-wide or thread-local setting in Python
# code that an interrupt could leave half done:
# - it needs no grad mode: its copies read plain, detached tensors (`ParamSlot.master`) and
#   write tensors that do not require grad, so autograd records nothing;
# - `__torch_function__` dispatch of subclasses is turned off only by
#   `without_subclass_dispatch`, which calls a function under
#   torch._C._disabled_torch_function_impl: that C function restores the state itself, whatever
#   the function raises (a `with DisableTorchFunctionSubclass():` would be left disabled by an
#   interrupt raised where the `with` statement calls `__exit__`);
# - what must change for a while (the current CUDA stream during a copy, no_offload's holds,
#   the latest backward_and_step) is recorded where the next entry point finds and undoes it
#   if an interrupt skipped the undo (Streams.restore, no_offload's weak set of
#   holds, backward_and_step's stepper: the next wait closes a call whose cleanup an interrupt
#   cut short, `close_if_abandoned`, and the end of backward forgets its worker).
# The optimizer worker thread changes its own thread-local settings (worker_state.active, its
# intra-op thread count); signals reach only the main thread, and the thread ends after.
# tests/test_interrupts.py raises KeyboardInterrupt at every few traced events of a training step.


def without_subclass_dispatch(fn: Any, *args: Any) -> Any:
    """`fn(*args)` with `__torch_function__` of tensor subclasses off (DisableTorchFunctionSubclass),
    turned back on in C whatever fn raises (Note [interrupts])."""
    return _disabled_torch_function_impl(fn, (), args)  # type: ignore[call-arg]


def _compiled_region_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """`__torch_function__` seen by torch.compile (Note [torch.compile] in dispatch/compile.py). Traced,
    this function is a graph break: the compiled code calls it for the op, eagerly, as
    `__torch_function__`. Called by the compiler itself (metadata queries while it builds fake
    tensors: `p._is_view()`, `p.is_sparse`), the op reads the master: nothing is materialized."""
    if _compile.compiling():
        return without_subclass_dispatch(lambda: func(*args, **kwargs))
    return without_subclass_dispatch(_torch_function, func, args, kwargs)


def _torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """OffloadedParameter.__torch_function__, with subclass dispatch off."""
    params = _find_params(args, kwargs)
    if not on_optimizer_worker():
        _await_steps(params, func)
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        prop = getattr(func.__self__, "__name__", "")
        if packed_of(args[0]) is not None:  # Note [compressed masters] (weights/compress.py)
            result = packed_property(name, prop, args)
            if result is not AS_PLAIN:
                return result
        if name == "__set__" and prop == "data":
            return _set_data(args[0], args[1])
        if name == "__get__" and prop == "data" and getattr(args[0], "_ot", None) is not None:
            slot = args[0]._ot
            slot.scope.engine.master_handed_out(slot.scope, slot)  # Note [VRAM budget]
            alias = func(*args, **kwargs)
            slot.data_handed_out(alias)  # Note [p.data aliases] (core/slot.py)
            return alias
        if name == "__get__" and prop in _DERIVED_PROPERTIES:
            return _dispatch(func, args, kwargs, params)  # `w.T` is an op on w
        return func(*args, **kwargs)  # `p.grad`, `p.shape`: the parameter itself
    if any(packed_of(p) is not None for p in params):  # Note [compressed masters] (weights/compress.py)
        written = _written(func, args, kwargs) if _is_inplace(func, args, kwargs) else set()
        return packed_torch_function(func, args, kwargs, params, written, _MASTER_ONLY,
                                     lambda: _dispatch(func, args, kwargs, params))
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    return _dispatch(func, args, kwargs, params)


def _repr(p: OffloadedParameter) -> str:
    slot = getattr(p, "_ot", None)
    if slot is None:
        return f"OffloadedParameter(detached from offtensor, shape={tuple(p.shape)})"
    home = slot.scope.home  # Note [staged loads] in weights/file_masters.py
    where = "pinned cpu" if home is MasterHome.PINNED else "a file" if home is MasterHome.FILE else "cpu"
    return (
        f"OffloadedParameter(name={slot.name!r}, shape={tuple(p.shape)}, "
        f"dtype={p.dtype}, master on {where}, computes on {slot.scope.engine.device}, "
        f"scope={slot.scope.name!r}, state={slot.scope.state.name}, "
        f"requires_grad={p.requires_grad})"
    )


def _reduce(p: OffloadedParameter) -> tuple:
    packed = packed_of(p)  # Note [compressed masters] (weights/compress.py): its values, unpacked
    values = packed.unpack() if packed else p.detach()
    attributes = _attributes(p)
    if not attributes:
        return (torch._utils._rebuild_parameter, (values, p.requires_grad, OrderedDict()))
    return (torch._utils._rebuild_parameter_with_state, (values, p.requires_grad, OrderedDict(), attributes))


def _attributes(p: OffloadedParameter) -> dict[str, Any]:
    """The attributes set on the parameter (`p.no_decay = True`), before wrap or after, that its
    copies keep, as nn.Parameter's pickling does; not offtensor's own (`_ot`)."""
    return {k: v for k, v in p.__dict__.items() if k != "_ot"}


def master_values(p: torch.Tensor) -> torch.Tensor:
    """A copy of the master's values, with subclass dispatch off: a compressed master's are
    unpacked (Note [compressed masters] in weights/compress.py)."""
    packed = packed_of(p)
    return packed.unpack() if packed is not None else p.detach().clone()


def _await_steps(params: list[OffloadedParameter], func: Any) -> None:
    """Wait for the deferred optimizer steps of the parameters an op or property access uses
    (Note [step fences] in core/slot.py); nothing to do unless one is pending. A shared master that
    another rank may be stepping is not read at all (Note [step fence] in distributed/shared_masters.py)."""
    for p in params:
        slot = getattr(p, "_ot", None)
        if slot is not None:
            slot.wait_for_step()
            if slot.stepped_elsewhere is not None and _reads_values(func) and not in_backward():
                slot.stepped_elsewhere.refuse_read(slot)


def _reads_values(func: Any) -> bool:
    """The op or property access reads the parameter's values, not only what it is (its
    shape, dtype, `.grad`, `requires_grad`)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        prop = getattr(func.__self__, "__name__", "")
        return name == "__get__" and (prop == "data" or prop in _DERIVED_PROPERTIES)
    return func not in _METADATA


def master_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad` of the master itself, once its deferred step is done (Note [step fences] in
    core/slot.py), without a round trip through `__torch_function__`: a property read on a tensor
    subclass dispatches it unless subclass dispatch is off, and the gradient path reads it for
    every gradient."""
    slot = getattr(p, "_ot", None)
    if slot is not None and not on_optimizer_worker():
        slot.wait_for_step()
    return without_subclass_dispatch(_GRAD_OF, p)


_GRAD_OF = _TensorBase.grad.__get__  # type: ignore[union-attr]


def master_requires_grad(p: torch.Tensor) -> bool:
    """`p.requires_grad` of the master, without a round trip through `__torch_function__`."""
    return without_subclass_dispatch(_REQUIRES_GRAD_OF, p)


_REQUIRES_GRAD_OF = _TensorBase.requires_grad.__get__  # type: ignore[attr-defined]


def _dispatch(func, args: tuple, kwargs: dict, params: list[OffloadedParameter]) -> Any:
    if not params or func in _MASTER_ONLY:
        return func(*args, **kwargs)
    if _is_inplace(func, args, kwargs):
        # Writes always go to the master (under grad mode PyTorch then raises its usual
        # leaf-in-place error, as for a plain parameter). Every offloaded argument counts as
        # written (safe if a write is not recognised below); those that are surely only read
        # (`h.add_(self.bias)` in a forward) are then materialized as for any other op.
        written = _written(func, args, kwargs)
        for p in params:
            slot = getattr(p, "_ot", None)
            if slot is not None and id(p) in written:
                slot.scope.engine.master_written(slot)
            elif slot is not None:
                slot.scope.engine.before_master_write(slot, written=False)
        if on_optimizer_worker():  # the optimizer thread: masters only
            return func(*args, **kwargs)
        params = [p for p in params if id(p) not in written]
        if not params:
            return func(*args, **kwargs)
    if on_optimizer_worker():  # the optimizer thread: masters only
        return func(*args, **kwargs)
    subs = _replacements(params, _op_device(args, kwargs))
    if not subs:
        return func(*args, **kwargs)
    args, kwargs = _substitute(args, kwargs, subs)
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:
        cast = next((p for p in params if getattr(p, "_ot", None) is not None and p._ot.scope.casts), None)
        if cast is None or "dtype" not in str(e):
            raise
        slot = cast._ot
        name, dtype, kind = getattr(func, "__name__", func), slot.device_view.dtype, slot.device_view.device.type
        if torch.is_autocast_enabled(kind):
            # CPU autocast leaves layer_norm and group_norm alone (CUDA's runs them in fp32), so
            # a norm's bf16 copy meets fp32 activations there under autocast too.
            fix = (f"torch.autocast is on, but it does not cast the inputs of {name} on {kind}: "
                   f"cast them to {dtype} before this op")
        else:
            fix = f"Run the model under torch.autocast(device_type, dtype={dtype}), or cast the inputs to {dtype}"
        raise RuntimeError(
            f"offtensor: {name} failed on offloaded parameter {slot.name!r}, which computes in "
            f"{dtype} (Policy(compute_dtype=...)) while its master is {cast.dtype}: the other "
            f"inputs must be of the compute dtype. {fix}"
        ) from e


def _replacements(params: list[OffloadedParameter], op_device: torch.device | None) -> dict[int, torch.Tensor]:
    """What an op on `params` gets in place of each (by id): a device or temporary copy
    (Engine.materialize); none where the op acts on the master."""
    subs: dict[int, torch.Tensor] = {}
    tracing = _compile.tracing()
    for p in params:
        slot = getattr(p, "_ot", None)
        if slot is None:
            continue
        if tracing:
            raise RuntimeError(
                f"offtensor: make_fx traced an op on offloaded parameter {slot.name!r} "
                "(torch.func.linearize, aot_function, torch.export): the graph would keep its "
                "device copy, which offtensor frees when the scope is released. Trace "
                "torch.func.functional_call(model, params, args) with the parameters passed in "
                "as tensors on the compute device, or call offtensor.unwrap(model) first"
            )
        replacement = slot.scope.engine.materialize(slot, op_device)
        if replacement is None and slot.packed is not None:
            replacement = slot.packed.unpack()  # the master's values (Note [compressed masters])
        if replacement is not None:
            subs[id(p)] = replacement
    return subs


def _written(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """ids of the offloaded parameters an in-place op writes: `out=` when given, the arguments
    an aten overload's schema marks as written, else its first argument (`self`, the list of a
    `_foreach_*_` op, `nn.init`'s `tensor=` keyword). Note [writes the name does not show]."""
    written: tuple[Any, ...]
    if "out" in kwargs:
        written = (kwargs["out"],)
    elif isinstance(func, OpOverload) and (positions := _mutated_positions(func)):
        written = tuple(args[i] if i < len(args) else kwargs.get(name) for i, name in positions)
    else:
        written = args[:1] if args else tuple(kwargs.values())[:1]
    return {id(p) for p in _find_params(written, {})}


def _find_params(args: tuple, kwargs: dict) -> list[OffloadedParameter]:
    found: list[OffloadedParameter] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, OffloadedParameter):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, OffloadedParameter))
    return found


def _op_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The accelerator device of the op's other tensors, or None when they are all on the CPU."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if not isinstance(a, OffloadedParameter) and a.device.type != "cpu":
                return a.device
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor) and not isinstance(x, OffloadedParameter) and x.device.type != "cpu":
                    return x.device
    return None


def _sub_one(a: Any, subs: dict[int, torch.Tensor]) -> Any:
    if isinstance(a, OffloadedParameter):
        return subs.get(id(a), a)
    if isinstance(a, (list, tuple)) and any(isinstance(x, OffloadedParameter) for x in a):
        return type(a)(subs.get(id(x), x) if isinstance(x, OffloadedParameter) else x for x in a)
    return a


def _substitute(args: tuple, kwargs: dict, subs: dict[int, torch.Tensor]) -> tuple[tuple, dict]:
    return tuple(_sub_one(a, subs) for a in args), {k: _sub_one(v, subs) for k, v in kwargs.items()}


def _is_inplace(func, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("inplace") is True:
        # torch.nn.functional's `inplace=True` (F.relu, F.dropout, F.hardtanh: their own
        # dispatch passes it by keyword) writes its input: dispatched as a read, it wrote the
        # device copy only, lost at the next load.
        return True
    if func is _SETITEM:
        # `p[i] = v` writes p (dispatched as an op, it wrote the device copy inside p's scope,
        # and a temporary copy elsewhere in a forward: lost); `h[i] = p` only reads p.
        return bool(args) and isinstance(args[0], OffloadedParameter)
    # Note [writes the name does not show]
    if "out" in kwargs and _find_params((), {"out": kwargs["out"]}):
        return True
    if isinstance(func, OpOverload):
        return bool(_mutated_positions(func))
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


# Note [writes the name does not show]
# An op is taken for an in-place write by its name (`add_`, `__iadd__`), and such a write goes to
# the master. Two kinds of write have no such name: `torch.add(a, b, out=p)` writes `p`, and an
# aten overload called directly (`torch.ops.aten.add_.Tensor(p, t)`, `aten.copy_.default`) is
# named `add_.Tensor`. Dispatched as reads, both wrote the scope's device copy (or a temporary
# copy) inside a forward, and the write was lost at the next load: a step counter that never
# counted. So an `out=` holding a parameter makes the op a write of the `out` tensors, and an
# overload is a write of the arguments its schema marks as written (`Tensor(a!)`).


def _mutated_positions(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument that the overload's schema marks as written."""
    found = _MUTATED.get(func)
    if found is None:
        found = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write)
        _MUTATED[func] = found
    return found


_MUTATED: dict[OpOverload, tuple[tuple[int, str], ...]] = {}


# Note [a compiled optimizer step]
# An eager `optimizer.step()` writes each master through an in-place op on the parameter, which
# `_dispatch` sees: `before_master_write` waits for the copies still reading masters
# (`sync_master_reads`) and releases a scope that the VRAM budget keeps (its copy would be
# stale). A compiled step (`torch.compile(opt.step)`, or a compiled training step calling
# `opt.step()`) does not: dynamo traces the optimizer's ops on fake tensors (`compiling()`: the
# master's metadata), the parameters are graph inputs and AOTAutograd applies their mutations
# to the real masters after the graph ran: under aot_eager as `aten.copy_.default` on the
# parameter, once the new values are computed, under inductor in the kernel, with no op
# dispatched at all. So a kept scope's copy was stale after the step (the next forward reloads
# it, having seen the masters' versions change) and, on CUDA, a prefetch still reading a master
# could see it half written. No per-op hook exists
# inside a compiled graph, so the step itself is the hook: a global optimizer step pre-hook
# (`before_optimizer_step`), registered with the first engine, runs
# `_before_compiled_step` outside dynamo (a graph break before the step's graph, one per step;
# also for a compiled step of another optimizer once a model is wrapped). It treats each
# offloaded parameter with a gradient (those an eager step writes) as an eager in-place write
# does, before the step writes: no copy reads it, kept scopes are released, graphs that saved a
# copy see it modified. Nothing between the hook and the write loads a scope. An eager step
# pays one hook call that returns at once: `in_compiled_region()` is false.


def before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global optimizer step pre-hook (Note [a compiled optimizer step])."""
    if _compile.in_compiled_region():
        _compile.run_outside_dynamo(_before_compiled_step, (optimizer,))


def _before_compiled_step(optimizer: torch.optim.Optimizer) -> None:
    if getattr(optimizer, "_offtensor_view", False) or on_optimizer_worker():
        return  # backward_and_step's own steps, eager (Note [torch.compile] in dispatch/compile.py)
    for group in optimizer.param_groups:
        for p in group["params"]:
            slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
            if slot is not None and master_grad(p) is not None:
                slot.scope.engine.master_written(slot)


def watch_compiled_steps() -> None:
    """Register `before_optimizer_step` once per process (Note [a compiled optimizer step])."""
    patches.optimizer_step_pre_hook(before_optimizer_step)


def _set_data(p: OffloadedParameter, value: torch.Tensor, what: str = "set .data of") -> None:
    """`p.data = t` copies into the host master instead of rebinding it (the master must stay in
    the scope's pinned buffer). `model.cuda()` never gets here: see Note [moving a wrapped model]."""
    slot = getattr(p, "_ot", None)
    if slot is None:
        _TensorBase.data.__set__(p, value)  # type: ignore[attr-defined]
        return
    if value is p or (value.device.type == "cpu" and value.data_ptr() == p.data_ptr()):
        return
    if value.shape != p.shape or value.dtype != p.dtype:
        raise TypeError(
            f"offtensor: cannot {what} offloaded parameter {slot.name!r} "
            f"({tuple(p.shape)}, {p.dtype}) to a tensor of shape {tuple(value.shape)} and dtype "
            f"{value.dtype}; offloaded masters keep their shape and dtype. Copy values with "
            "p.data.copy_(t), or call offtensor.unwrap(model) first"
        )
    slot.scope.engine.master_written(slot)
    # Detached: autograd records nothing, without grad mode (Note [interrupts]); `p.detach()`
    # shares p's version counter, so the write bumps it as `p.copy_` under no_grad did.
    p.detach().copy_(value.detach())


def _set(p: OffloadedParameter, *args: Any) -> torch.Tensor:
    """`p.set_(t)` copies t's values into the host master, as `p.data = t` does: rebinding would
    leave the master outside the scope's host buffer, which loads read (`ParamSlot.master`), so
    every forward would compute with the old values. torch.nn.utils.parametrize does this when a
    parametrization with a `right_inverse` (`orthogonal`) is registered on a wrapped model."""
    slot = getattr(p, "_ot", None)
    if slot is None:
        return torch.Tensor.set_(p, *args)
    source = args[0] if len(args) == 1 else None  # set_(t); not set_(storage, offset, size, stride)
    if not isinstance(source, torch.Tensor):
        raise TypeError(
            f"offtensor: offloaded parameter {slot.name!r} cannot be set_() to a storage or to "
            "nothing: its master stays in the scope's host buffer. Copy values with "
            "p.data.copy_(t), or call offtensor.unwrap(model) first"
        )
    if torch.is_grad_enabled() and p.requires_grad:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    if slot.packed is not None:
        slot.packed.check_write()  # a master in a file (Note [masters in files] in weights/file_masters.py)
    _set_data(p, source, "set_()")
    return p


def _hook_registrar(table: str, plain):
    """`Tensor.register_*hook` for an offloaded parameter: keeps the hook in the slot's
    `table` (see Note [user gradient hooks]); `plain` for a parameter outside offtensor."""

    def register(p: OffloadedParameter, hook) -> RemovableHandle:
        slot = getattr(p, "_ot", None)
        if slot is None:
            return plain(p, hook)
        hooks = getattr(slot, table)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    return register


_SETITEM = torch.Tensor.__setitem__

# Tensor properties that compute a new tensor from the parameter's values (`x @ w.T`): they
# are dispatched like ops. Every other property (`p.grad`, `p.data`, `p.shape`, `p.device`) is
# about the master itself.
_DERIVED_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})

# What a parameter is, not what it holds (shape, layout, where it lives, its grad settings).
_ABOUT_THE_PARAMETER = {
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.ndimension, torch.Tensor.stride, torch.Tensor.element_size, torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.__len__,
    torch.Tensor.get_device, torch.Tensor.is_pinned, torch.Tensor.data_ptr, torch.Tensor.untyped_storage,
    torch.Tensor.storage_offset, torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.is_shared,
    torch.Tensor.__hash__,
}

# Allowed while another rank may be stepping a shared master (`_reads_values`).
_METADATA = _ABOUT_THE_PARAMETER | {
    torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
    torch.is_complex, torch.is_floating_point, torch.numel,
}

# Queries about the master itself, and methods that change the parameter object: never
# materialized, even when grad mode would otherwise call for a differentiable copy.
_MASTER_ONLY = _ABOUT_THE_PARAMETER | {
    torch.Tensor.detach, torch.Tensor.pin_memory, torch.Tensor.__format__, torch.Tensor.tolist,
    torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.type, torch.Tensor.__bool__,
}


def _detach(p: OffloadedParameter) -> torch.Tensor:
    """`p.detach()`: the master. DistributedDataParallel's constructor detaches every parameter;
    refused for offloaded ones (Note [data-parallel wrappers] in distributed/wrappers.py)."""
    slot = getattr(p, "_ot", None)
    if _distributed.active():
        _distributed.check_ddp_init(slot.name if slot is not None else "?")
    if slot is not None and _called_by_parameter_new():
        raise RuntimeError(
            f"offtensor: nn.Parameter(p) of offloaded parameter {slot.name!r}: the new Parameter "
            "would share the master's host memory without being offloaded. "
            "torch.nn.utils.parametrize.register_parametrization does this after offtensor.wrap "
            "when the parametrization's right_inverse returns several tensors "
            "(torch.nn.utils.parametrizations.weight_norm): register parametrizations before "
            "offtensor.wrap(model). Otherwise make the Parameter from a copy, "
            "nn.Parameter(p.detach().clone())"
        )
    return torch.Tensor.detach(p)


def _called_by_parameter_new() -> bool:
    """`nn.Parameter(p)` is detaching p: `Parameter.__new__` is a few frames up (it calls
    `data.detach()`, which reaches _detach through __torch_function__)."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code is _PARAMETER_NEW:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_PARAMETER_NEW = nn.Parameter.__new__.__code__


# Note [gradients with respect to a parameter]
# `torch.autograd.grad(loss, params)` and `loss.backward(inputs=params)` name the parameters
# whose gradients to compute, but autograd's graph never holds an offloaded parameter: it holds
# the tensors ops got instead (Note [dispatch of an offloaded parameter]): the scope's device
# copy, device copies retired by a create_graph backward, temporary copies made for ops outside
# the scope (`ParamSlot.graph_leaves`). Given the master, autograd would find it unused: `grad`
# raised "appears to not have been used in the graph", and returned None with
# `allow_unused=True`; `backward(inputs=...)` silently left `p.grad` unchanged. So both come
# here (torch dispatches them to `__torch_function__` when an input is a subclass), and each
# offloaded input is replaced by those leaves:
# - `grad` asks for every leaf (allow_unused, since most are not in this graph), sums each
#   parameter's, and returns it as the parameter is, on the host in the master's dtype
#   (differentiable under create_graph), like `p.grad`. An input no leaf of which got a
#   gradient is unused: None, zeros with materialize_grads, or the error torch gives.
# - `backward(inputs=...)` accumulates into the leaves, whose gradients take the usual path to
#   the host `p.grad` (Note [gradient path] in core/grads.py); the other parameters' gradients are
#   left alone, as autograd does.
# A frozen parameter (or one no graph holds yet) has no such leaf and is passed as a plain alias
# of its master: autograd raises its own error, or finds it unused.
# These two run with subclass dispatch on, unlike every other op of ours: a checkpoint's
# recompute runs the model's forward inside them, and its ops must get device copies (with
# dispatch off they got the host masters: a device mismatch on CUDA). Nothing offloaded is left
# among the arguments they pass on, so torch does not dispatch back here.
# `torch.autograd.backward` reaches `__torch_function__` only in PyTorch releases with
# pytorch/pytorch#171473; on older ones `backward(inputs=...)` cannot be intercepted (README).


def _leaves_for(inputs: Any) -> tuple[list[Any], list[int]]:
    """Autograd's inputs with each offloaded parameter replaced by its graph leaves (a plain
    alias of its master when it has none), and how many entries each input became."""
    expanded: list[Any] = []
    counts: list[int] = []
    for t in inputs:
        slot = getattr(t, "_ot", None) if isinstance(t, OffloadedParameter) else None
        leaves = slot.graph_leaves() if slot is not None and t.requires_grad else []
        expanded.extend(leaves or [_plain(t)])
        counts.append(len(leaves) or 1)
    return expanded, counts


def _plain(t: Any) -> Any:
    """An offloaded parameter as a plain tensor over its master (same requires_grad); anything
    else as it is."""
    if not isinstance(t, OffloadedParameter):
        return t
    alias = without_subclass_dispatch(torch.Tensor.detach, t)
    return alias.requires_grad_(True) if without_subclass_dispatch(lambda p: p.requires_grad, t) else alias


def _autograd_grad(outputs: Any, inputs: Any, grad_outputs: Any = None, retain_graph: bool | None = None,
                   create_graph: bool = False, only_inputs: bool = True, allow_unused: bool | None = None,
                   is_grads_batched: bool = False, materialize_grads: bool = False) -> tuple:
    """`torch.autograd.grad` with offloaded parameters among `inputs` (Note [gradients with
    respect to a parameter])."""
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    expanded, counts = _leaves_for(inputs)
    outputs = [_plain(t) for t in outputs] if isinstance(outputs, (list, tuple)) else _plain(outputs)
    grads = torch.autograd.grad(outputs, expanded, grad_outputs=grad_outputs, retain_graph=retain_graph,
                                create_graph=create_graph, allow_unused=True,
                                is_grads_batched=is_grads_batched)
    if allow_unused is None:
        allow_unused = materialize_grads
    result: list[torch.Tensor | None] = []
    start = 0
    for i, (t, n) in enumerate(zip(inputs, counts, strict=True)):
        found = [g for g in grads[start : start + n] if g is not None]
        start += n
        g: torch.Tensor | None = None
        if found:
            g = functools.reduce(torch.add, found)
            if isinstance(t, OffloadedParameter):  # as `p.grad`: on the host, the master's dtype
                # The graph's leaves are device copies, which carry no user hook: run the
                # parameter's own on the sum, as autograd runs a plain leaf's.
                slot = getattr(t, "_ot", None)
                if slot is not None:
                    g = run_grad_hooks(slot, g)
                g = g.to(device=t.device, dtype=t.dtype)
        elif materialize_grads:
            g = torch.zeros_like(t)
        elif not allow_unused:
            what = f" (offloaded parameter {t._ot.name!r})" if getattr(t, "_ot", None) is not None else ""
            raise RuntimeError(
                f"The differentiated Tensor at index {i}{what} appears to not have been used in "
                "the graph. Set allow_unused=True if this is the desired behavior."
            )
        result.append(g)
    return tuple(result)


def run_grad_hooks(slot: ParamSlot, grad: torch.Tensor) -> torch.Tensor:
    """The user's `register_hook` hooks of an offloaded parameter on one gradient of it, in
    registration order; a hook returning None keeps the gradient it got (Note [user gradient
    hooks])."""
    for hook in slot.grad_hooks.values():
        out = hook(grad)
        if out is not None:
            grad = out
    return grad


def _autograd_backward(tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                       create_graph: bool = False, inputs: Any = None, **kwargs: Any) -> None:
    """`torch.autograd.backward` (`loss.backward(inputs=...)`) with offloaded parameters among
    `inputs` (Note [gradients with respect to a parameter])."""
    if inputs is not None:
        inputs = _leaves_for(tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,))[0]
    tensors = [_plain(t) for t in tensors] if isinstance(tensors, (list, tuple)) else _plain(tensors)
    torch.autograd.backward(tensors, grad_tensors=grad_tensors, retain_graph=retain_graph,
                            create_graph=create_graph, inputs=inputs, **kwargs)


# Note [embeddings with max_norm]
# `F.embedding(..., max_norm=m)` and `F.embedding_bag` renormalize the rows they look up in
# place, under no_grad, before reading them: the module's weight changes for good. Dispatched as
# one op, the function got the scope's device copy and renormalized only that: each forward's
# output was right, but the master kept its old rows, so the optimizer stepped unnormalized
# weights and training drifted from the unwrapped model. So the renormalization is an op of its
# own on the parameter, an in-place write of the master (with the indices on the master's
# device: a host sync, only with max_norm), which marks the device copy for a refresh before the
# lookup (Note [writes during a scope's call] in core/scope.py); the lookup then runs without max_norm.
def _renormalizing(func: Any) -> Any:
    signature = inspect.signature(func)

    def handler(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        weight, max_norm = bound.arguments["weight"], bound.arguments.get("max_norm")
        if max_norm is not None and isinstance(weight, OffloadedParameter):
            indices = bound.arguments["input"].to(weight.device).contiguous()
            norm_type = float(bound.arguments.get("norm_type", 2.0))
            with torch.no_grad():
                _dispatch(torch.embedding_renorm_, (weight, indices, max_norm, norm_type), {}, [weight])
            bound.arguments["max_norm"] = None
        return _dispatch(func, bound.args, bound.kwargs, _find_params(bound.args, bound.kwargs))

    return handler


# Note [user gradient hooks]: the device copy, not the master, is what autograd differentiates,
# so hooks registered on the master would never fire. We keep them on the ParamSlot and call them
# from the gradient path (core/grads.py): `register_hook` hooks see each backward contribution (on
# the device, before accumulation), post-accumulate-grad hooks see the parameter once its host
# `.grad` is complete, at the end of backward. `torch.autograd.grad` over an offloaded
# parameter runs its `register_hook` hooks on the sum of its leaves' gradients and returns what
# they give (`_autograd_grad`), as for a plain leaf; it runs no post-accumulate-grad hook.
_HANDLERS = {
    torch.Tensor.register_post_accumulate_grad_hook: _hook_registrar(
        "post_hooks", torch.Tensor.register_post_accumulate_grad_hook
    ),
    torch.Tensor.register_hook: _hook_registrar("grad_hooks", torch.Tensor.register_hook),
    torch.Tensor.detach: _detach,
    nn.functional.embedding: _renormalizing(nn.functional.embedding),  # Note [embeddings with max_norm]
    nn.functional.embedding_bag: _renormalizing(nn.functional.embedding_bag),
}
_AUTOGRAD_ENTRIES = {torch.autograd.grad: _autograd_grad, torch.autograd.backward: _autograd_backward}


# Note [custom autograd Functions]
# `torch.autograd.Function.apply` is no op: it does not reach `__torch_function__`, so a custom
# Function given a parameter (`_Linear.apply(x, self.weight, self.bias)`, as apex's fused layers,
# Liger's fused linear cross-entropy and unsloth's LoRA kernels are called) got the
# OffloadedParameter itself. Autograd then recorded the master as the Function's input and
# accumulated the Function's gradient into it by its own AccumulateGrad, past the gradient path
# (Note [gradient path] in core/grads.py): the parameter's `register_hook` hooks, data_parallel's
# averaging and backward_and_step's worker never saw it, and on CUDA autograd refused a device
# gradient for a host parameter; `ctx.save_for_backward(weight)` saved the master, which a
# non-reentrant checkpoint's recompute handed to backward as a plain alias (its ops read the
# host master). So `wrap` replaces `Function.apply` (once per process, for every Function
# class) by `_function_apply`, which first gives each offloaded argument what an op would get
# (Note [dispatch of an offloaded parameter]): in its scope the device copy, elsewhere a
# temporary copy with the same gradient path. The Function computes with, saves and returns a
# gradient for that copy, as F.linear does. With no offloaded argument it is the original call
# after a scan of the arguments.


def _function_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """`torch.autograd.Function.apply` with offloaded arguments replaced (Note [custom autograd
    Functions]); counted in `recorded_functions` while its forward runs, when autograd records
    it (Note [calls inside a checkpointed region] in core/engine.py)."""
    params = _find_params(args, kwargs)
    if params and not on_optimizer_worker():
        args, kwargs = without_subclass_dispatch(_materialized_arguments, args, kwargs, params)
    if not (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return patches.PLAIN_FUNCTION_APPLY(cls, *args, **kwargs)
    depth = recorded_functions.depth
    try:  # set and restored inside: an interrupt anywhere leaves the depth as it was (Note [interrupts])
        recorded_functions.depth = depth + 1
        return patches.PLAIN_FUNCTION_APPLY(cls, *args, **kwargs)
    finally:
        recorded_functions.depth = depth


class _RecordedFunctions(threading.local):
    depth = 0  # custom autograd Functions recorded by autograd whose forward runs on this thread


recorded_functions = _RecordedFunctions()


def _materialized_arguments(args: tuple, kwargs: dict, params: list[OffloadedParameter]) -> tuple[tuple, dict]:
    _await_steps(params, _function_apply)
    subs = _replacements(params, _op_device(args, kwargs))
    return _substitute(args, kwargs, subs)


def intercept_function_apply() -> None:
    """Install `_function_apply` as `torch.autograd.Function.apply`; called by wrap, idempotent."""
    patches.function_apply(_function_apply)
