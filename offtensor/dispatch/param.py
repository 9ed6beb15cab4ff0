"""OffloadedParameter: an nn.Parameter whose master lives in host memory.

# Note [dispatch of an offloaded parameter]
Every torch op that receives an OffloadedParameter comes through `__torch_function__`. We decide,
per parameter, which tensor the op really sees (OpAccess.materialize):
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
import inspect
import sys
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from ..api import MasterHome
from ..storage.compress import AS_PLAIN, compressed_special, packed_of, packed_property, packed_torch_function
from . import compile as _compile
from . import metadata as _metadata
from . import wrapper_guards as _distributed
from .autograd import AUTOGRAD_ENTRIES, REGISTRARS
from .masters import DERIVED_PROPERTIES, MASTER_ONLY, await_steps, master_values, without_subclass_dispatch
from .ops import dispatch, resident_copies, run_op
from .slot import ParamSlot, on_optimizer_worker
from .writes import is_inplace, set_data, set_master, writes_by_name, written


class OffloadedParameter(nn.Parameter):
    """An `nn.Parameter` kept in (pinned) host memory and streamed to the device when used.

    `isinstance(p, nn.Parameter)` holds and `p.device` is `cpu`: the tensor itself is the host
    master. Created only by `offtensor.wrap`, which changes the class of the model's existing
    parameter objects in place (their identity, and any optimizer built on them, is kept).
    """

    _ot: ParamSlot  # its bookkeeping (dispatch/slot.py)

    # Read without __torch_function__: Note [metadata without dispatch] (dispatch/metadata.py)
    shape = _metadata.shape  # type: ignore[assignment]
    dtype = _metadata.dtype  # type: ignore[assignment]
    device = _metadata.device  # type: ignore[assignment]
    ndim = _metadata.ndim  # type: ignore[assignment]
    numel = _metadata.numel  # type: ignore[assignment]
    element_size = _metadata.element_size  # type: ignore[assignment]
    grad = _metadata.grad  # type: ignore[assignment]
    requires_grad = _metadata.requires_grad  # type: ignore[assignment]

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> nn.Parameter:  # type: ignore[misc]
        # Code that rebuilds a parameter as `type(p)(new_data)` (accelerate's
        # set_module_tensor_to_device, which load_checkpoint_in_model and dispatch_model use)
        # gets a plain Parameter: a new object belongs to no scope, and an OffloadedParameter
        # without one would claim to be offloaded while nothing loads or offloads it.
        return nn.Parameter(torch.empty(0) if data is None else data, requires_grad)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if _compile.compiling():  # an op outside the parameter's scope: Note [an op in compiled code]
            return _compile.run_outside_dynamo(_compiled_region_op, (func, args, kwargs or {}))
        entry = AUTOGRAD_ENTRIES.get(func)
        if entry is not None:  # with dispatch on: Note [gradients with respect to a parameter]
            kwargs = kwargs or {}
            return entry({id(p) for p in find_params(args, kwargs)}, *args, **kwargs)
        return without_subclass_dispatch(_torch_function, func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return without_subclass_dispatch(_repr, self)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # A copy is a plain Parameter holding a copy of the master: it belongs to no scope.
        await_steps([self], torch.Tensor.clone)  # a deferred optimizer step may still write the master
        result = without_subclass_dispatch(lambda p: nn.Parameter(master_values(p), p.requires_grad), self)
        memo[id(self)] = result
        result.__dict__.update(copy.deepcopy(_attributes(self), memo))  # `p.no_decay = True`
        return result

    def set_(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        # `Tensor.set_` does not dispatch to __torch_function__: a method of the class instead.
        await_steps([self], torch.Tensor.set_)  # a deferred optimizer step may still write the master
        return without_subclass_dispatch(set_master, self, *args, *kwargs.values())

    def __reduce_ex__(self, proto):  # type: ignore[override]
        # Pickle (torch.save) as a plain Parameter: the offloading is a runtime arrangement
        # (Note [copies of a wrapped model] in engine/hooks.py).
        await_steps([self], torch.Tensor.clone)  # pickling reads the values
        return without_subclass_dispatch(_reduce, self)


# Note [an op in compiled code]
# A parameter read outside its own scope in compiled code (a tied weight read by another module)
# is still an OffloadedParameter there (Note [device copies as graph inputs] in
# dispatch/compile.py): its `__torch_function__` calls `run_outside_dynamo`, so the graph breaks
# at that op, which runs eagerly with a temporary device copy, as in eager mode. The compiler's
# own metadata queries on it while it builds fake tensors (`p._is_view()`, `p.is_sparse`) run
# natively with `compiling()` true and read the master: nothing is copied.


def _compiled_region_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """`__torch_function__` seen by torch.compile (Note [an op in compiled code]): the compiled
    code calls it for the op, eagerly; called by the compiler itself, the op reads the master."""
    if _compile.compiling():
        return without_subclass_dispatch(lambda: func(*args, **kwargs))
    return without_subclass_dispatch(_torch_function, func, args, kwargs)


def _torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """OffloadedParameter.__torch_function__, with subclass dispatch off."""
    if _reads_only(func) and "out" not in kwargs and kwargs.get("inplace") is not True:
        found = resident_copies(args, kwargs)  # Note [ops in a resident scope] (dispatch/ops.py)
        if found is not None:
            return run_op(func, *found)
    params = find_params(args, kwargs)
    if not on_optimizer_worker():
        await_steps(params, func)
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        prop = getattr(func.__self__, "__name__", "")
        if packed_of(args[0]) is not None:  # Note [compressed masters] (storage/compress.py)
            result = packed_property(name, prop, args)
            if result is not AS_PLAIN:
                return result
        if name == "__set__" and prop == "data":
            return set_data(args[0], args[1])
        if name == "__get__" and prop == "data" and getattr(args[0], "_ot", None) is not None:
            slot = args[0]._ot
            slot.scope.master_handed_out(slot)  # Note [VRAM budget]
            alias = func(*args, **kwargs)
            slot.data_handed_out(alias)  # Note [p.data aliases] (dispatch/slot.py)
            return alias
        if name == "__get__" and prop in DERIVED_PROPERTIES:
            return dispatch(func, args, kwargs, params)  # `w.T` is an op on w
        return func(*args, **kwargs)  # `p.grad`, `p.shape`: the parameter itself
    if any(packed_of(p) is not None for p in params):  # Note [compressed masters] (storage/compress.py)
        offloaded = {id(p) for p in params}
        writes = written(func, args, kwargs, offloaded) if is_inplace(func, args, kwargs, offloaded) else set()
        return packed_torch_function(func, args, kwargs, params, writes, MASTER_ONLY,
                                     lambda: dispatch(func, args, kwargs, params))
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    return dispatch(func, args, kwargs, params)


def _reads_only(func: Any) -> bool:
    """`func` only reads its arguments and none of the paths above or in `dispatch` treats it
    specially (property accesses, handlers, master-only ops, compressed masters' own cases, in-place
    writes by name or schema), so that inside a resident scope it gets the device copies
    (Note [ops in a resident scope] in dispatch/ops.py); `out=` and `inplace=True` are the
    caller's to check. Decided once per function."""
    try:
        known = _READS_ONLY.get(func)
    except TypeError:  # not hashable: the general path
        return False
    if known is None:
        name = getattr(func, "__name__", "")
        known = not (name in ("__get__", "__set__", "__delete__") or func in _HANDLERS or func in MASTER_ONLY
                     or compressed_special(func) or writes_by_name(func) or func is torch.Tensor.__setitem__)
        _READS_ONLY[func] = known
    return known


_READS_ONLY: dict[Any, bool] = {}


def find_params(args: tuple, kwargs: dict) -> list[OffloadedParameter]:
    """The offloaded parameters among an op's arguments and the lists and tuples in them."""
    found: list[OffloadedParameter] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, OffloadedParameter):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, OffloadedParameter))
    return found


def _repr(p: OffloadedParameter) -> str:
    slot = getattr(p, "_ot", None)
    if slot is None:
        return f"OffloadedParameter(detached from offtensor, shape={tuple(p.shape)})"
    home = slot.scope.home  # Note [staged loads] in storage/staging.py
    where = "pinned cpu" if home is MasterHome.PINNED else "a file" if home is MasterHome.FILE else "cpu"
    return (
        f"OffloadedParameter(name={slot.name!r}, shape={tuple(p.shape)}, "
        f"dtype={p.dtype}, master on {where}, computes on {slot.scope.compute_device()}, "
        f"scope={slot.scope.name!r}, state={slot.scope.state.name}, "
        f"requires_grad={p.requires_grad})"
    )


def _reduce(p: OffloadedParameter) -> tuple:
    packed = packed_of(p)  # Note [compressed masters] (storage/compress.py): its values, unpacked
    values = packed.unpack() if packed else p.detach()
    attributes = _attributes(p)
    if not attributes:
        return (torch._utils._rebuild_parameter, (values, p.requires_grad, OrderedDict()))
    return (torch._utils._rebuild_parameter_with_state, (values, p.requires_grad, OrderedDict(), attributes))


def _attributes(p: OffloadedParameter) -> dict[str, Any]:
    """The attributes set on the parameter (`p.no_decay = True`), before wrap or after, that its
    copies keep, as nn.Parameter's pickling does; not offtensor's own (`_ot`)."""
    return {k: v for k, v in p.__dict__.items() if k != "_ot"}


def _detach(p: OffloadedParameter) -> torch.Tensor:
    """`p.detach()`: the master. DistributedDataParallel's constructor detaches every parameter;
    refused for offloaded ones (Note [data-parallel wrappers] in dispatch/wrapper_guards.py)."""
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


# Note [embeddings with max_norm]
# `F.embedding(..., max_norm=m)` and `F.embedding_bag` renormalize the rows they look up in
# place, under no_grad, before reading them: the module's weight changes for good. Dispatched as
# one op, the function would get the scope's device copy and renormalize only that: each
# forward's output would be right, but the master would keep its old rows, and the optimizer
# would step unnormalized weights. So the renormalization is an op of its own on the parameter,
# an in-place write of the master (with the indices on the master's device: a host sync, only
# with max_norm), which marks the device copy for a refresh before the lookup (Note [writes
# during a scope's call] in scopes/write_tracking.py); the lookup then runs without max_norm.
def _renormalizing(func: Any) -> Any:
    signature = inspect.signature(func)

    def handler(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        weight, max_norm = bound.arguments["weight"], bound.arguments.get("max_norm")
        if max_norm is not None and isinstance(weight, OffloadedParameter):
            indices = bound.arguments["input"].to(weight.device).contiguous()
            norm_type = float(bound.arguments.get("norm_type", 2.0))
            with torch.no_grad():
                dispatch(torch.embedding_renorm_, (weight, indices, max_norm, norm_type), {}, [weight])
            bound.arguments["max_norm"] = None
        return dispatch(func, bound.args, bound.kwargs, find_params(bound.args, bound.kwargs))

    return handler


_HANDLERS: dict[Any, Any] = {
    **REGISTRARS,  # Note [user gradient hooks] (dispatch/autograd.py)
    torch.Tensor.detach: _detach,
    nn.functional.embedding: _renormalizing(nn.functional.embedding),  # Note [embeddings with max_norm]
    nn.functional.embedding_bag: _renormalizing(nn.functional.embedding_bag),
}
