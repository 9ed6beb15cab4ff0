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
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch._ops import OpOverload

from ..api import MasterHome
from ..storage.compress import AS_PLAIN, compressed_special, packed_of, packed_property, packed_torch_function
from . import compile as _compile
from . import metadata as _metadata
from . import wrapper_guards as _distributed
from .autograd import AUTOGRAD_ENTRIES, REGISTRARS
from .eager_step import OPEN as _STEP_WINDOW
from .eager_step import STEP_OPS as _STEP_OPS
from .eager_step import STEP_READS as _STEP_READS
from .eager_step import close_on_other_op
from .masters import DERIVED_PROPERTIES, MASTER_ONLY, await_steps, master_values, without_subclass_dispatch
from .ops import (
    dispatch,
    lone_parameter,
    on_first,
    read_alone,
    requires_grad_changed,
    resident_copies,
    run_op,
    written_alone,
)
from .slot import ParamSlot, exposed_copy, on_optimizer_worker
from .writes import is_inplace, set_data, set_master, writes_by_name, written

_disabled_torch_function_impl = torch._C._disabled_torch_function_impl
_GETITEM = torch.Tensor.__getitem__


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
        window = _STEP_WINDOW[0]
        if window is not None:  # Note [an eager optimizer step] (dispatch/eager_step.py)
            if func in _STEP_OPS and args and id(args[0]) in window.marked and window.admits(args, kwargs):
                return _disabled_torch_function_impl(func, (), args, kwargs or {})
            if (func in _STEP_READS and len(args) == 2 and id(args[1]) in window.readable
                    and window.admits_read(args, kwargs)):
                return _disabled_torch_function_impl(func, (), args, kwargs or {})
            close_on_other_op()
        if _compile.compiling():  # an op outside the parameter's scope: Note [an op in compiled code]
            return _compile.run_outside_dynamo(_compiled_region_op, (func, args, kwargs or {}))
        try:
            route = _ROUTES[func]  # Note [op routing]
        except KeyError:
            route = _route(func)
        return route((func, args, kwargs or {}))

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
    return without_subclass_dispatch(_handler(func), func, args, kwargs)


# Note [op routing]
# How a torch function on an offloaded parameter is handled is decided once per function and
# kept in `_ROUTES` (one dict lookup per op, in place of a ladder of tests):
# - an entry of `_TABLE`, filled by `@implements(func, ...)` (a second handler for one function
#   raises): `torch.autograd.grad` and `backward` run with subclass dispatch on (Note [gradients
#   with respect to a parameter] in dispatch/autograd.py); the others, and every property access
#   (`p.data`, `p.grad`, `w.T`: the accessors of the tensor's attributes), once the parameters'
#   deferred steps are done and compressed masters have had their own cases (Note [compressed
#   masters] in storage/compress.py); a property access with no entry acts on the parameter itself;
# - a function that only reads (`_routed_handler`): the short path of ops in a resident scope
#   first (Note [ops in a resident scope] in dispatch/ops.py), then the default path;
# - one that writes its first argument by its name, or a query about the parameter itself
#   (`MASTER_ONLY`): the short path of a master written or asked alone first (Note [one
#   parameter on the general path's way] in dispatch/ops.py), then the default path;
# - anything else, the default path: `dispatch` gives each parameter what the op gets.
# A route is called with subclass dispatch on and the call as one tuple `(func, args, kwargs)`,
# so that turning dispatch off costs no Python frame (a partial of the C function); what it runs
# with dispatch off is the function's handler (`_handler`), which an op in compiled code runs
# directly (Note [an op in compiled code]).
Handler = Callable[..., Any]

_TABLE: dict[Any, tuple[Handler, bool]] = {}  # function -> (handler, with subclass dispatch on)
_ROUTES: dict[Any, Handler] = {}  # every function seen: how __torch_function__ runs it (one tuple)
_HANDLERS: dict[Any, Handler] = {}  # every function seen: its handler, with subclass dispatch off


def implements(*funcs: Any, with_dispatch: bool = False) -> Callable[[Handler], Handler]:
    """Register the decorated handler for `funcs` (Note [op routing]): called as
    `handler(func, args, kwargs, params)` with subclass dispatch off, `params` the offloaded
    parameters among the arguments; `with_dispatch`: `handler(offloaded ids, *args, **kwargs)`
    with it on, before anything else."""

    def register(handler: Handler) -> Handler:
        for func in funcs:
            if func in _TABLE:
                raise RuntimeError(f"offtensor: two handlers for {func!r}: {_TABLE[func][0]!r} and {handler!r}")
            _TABLE[func] = (handler, with_dispatch)
        return handler

    return register


def _accessor(name: str, which: str) -> Any:
    """`torch.Tensor.<name>.<which>`: the function `__torch_function__` gets for that property access."""
    return getattr(vars(torch._C.TensorBase)[name], which)


def _route(func: Any) -> Handler:
    """How `__torch_function__` runs `func` (Note [op routing]), decided on its first call."""
    entry = _TABLE.get(func)
    if entry is not None and entry[1]:
        route = partial(_with_dispatch, entry[0])
    else:
        route = partial(_disabled_torch_function_impl, _handler(func), ())  # handler(*call), dispatch off
    _ROUTES[func] = route
    return route


def _handler(func: Any) -> Handler:
    """What runs `func` with subclass dispatch off (Note [op routing])."""
    handler = _HANDLERS.get(func)
    if handler is None:
        entry, with_dispatch = _TABLE.get(func, (None, False))
        if getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
            handler = partial(_property_access, entry or _plain_property)
        elif entry is not None and not with_dispatch:
            handler = partial(_handled, entry)
        else:
            handler = _routed_handler(func)
        _HANDLERS[func] = handler
    return handler


def _with_dispatch(entry: Handler, call: tuple) -> Any:
    _, args, kwargs = call
    return entry({id(p) for p in find_params(args, kwargs)}, *args, **kwargs)


def _reading(func: Any, args: tuple, kwargs: dict) -> Any:
    """A function that only reads: the short path in a resident scope, else the default path."""
    if not kwargs or ("out" not in kwargs and kwargs.get("inplace") is not True):
        # Note [ops in a resident scope] (dispatch/ops.py)
        found = resident_copies(args, kwargs, indexing=func is _GETITEM)
        if found is not None:
            return run_op(func, *found)
        slot = lone_parameter(args, kwargs)  # Note [one parameter on the general path's way] (dispatch/ops.py)
        if slot is not None:
            return read_alone(func, args, kwargs, slot)
    return _default(func, args, kwargs)


def _writing(func: Any, args: tuple, kwargs: dict) -> Any:
    """A function that writes its first argument by its name: the short path for a master
    written alone (Note [one parameter on the general path's way] in dispatch/ops.py), else the default path."""
    slot = written_alone(args, kwargs)
    if slot is None:
        return _default(func, args, kwargs)
    slot.scope.master_written(slot)
    return func(*args, **kwargs)


def _querying(func: Any, args: tuple, kwargs: dict) -> Any:
    """A query about the parameter itself (`MASTER_ONLY`: `p.size()`, `torch.is_complex(p)`, which
    AdamW asks of each parameter at each step): on the master at once where the default path would
    do only that (a plain master: a compressed one's answers are packed_torch_function's; Note [one
    parameter on the general path's way] in dispatch/ops.py), else the default path."""
    if not on_first(lone_parameter(args, kwargs), args):
        return _default(func, args, kwargs)
    return func(*args, **kwargs)


def _default(func: Any, args: tuple, kwargs: dict) -> Any:
    return _handled(_dispatch, func, args, kwargs)


def _handled(handler: Handler, func: Any, args: tuple, kwargs: dict) -> Any:
    """`handler` once the parameters' deferred steps are done, compressed masters aside."""
    params = find_params(args, kwargs)
    if not on_optimizer_worker():
        await_steps(params, func)
    if any(packed_of(p) is not None for p in params):  # Note [compressed masters] (storage/compress.py)
        offloaded = {id(p) for p in params}
        writes = written(func, args, kwargs, offloaded) if is_inplace(func, args, kwargs, offloaded) else set()
        return packed_torch_function(func, args, kwargs, params, writes, MASTER_ONLY,
                                     lambda: dispatch(func, args, kwargs, params))
    return handler(func, args, kwargs, params)


def _property_access(handler: Handler, func: Any, args: tuple, kwargs: dict) -> Any:
    """A property's `__get__`, `__set__` or `__delete__` on a parameter."""
    params = find_params(args, kwargs)
    if not on_optimizer_worker():
        await_steps(params, func)
    if packed_of(args[0]) is not None:  # Note [compressed masters] (storage/compress.py)
        result = packed_property(func.__name__, getattr(func.__self__, "__name__", ""), args)
        if result is not AS_PLAIN:
            return result
    return handler(func, args, kwargs, params)


def _dispatch(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    return dispatch(func, args, kwargs, params)


def _plain_property(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    return func(*args, **kwargs)  # `p.grad`, `p.shape`: the parameter itself


@implements(_accessor("requires_grad", "__set__"))
def _set_requires_grad(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    requires_grad_changed()  # Note [requires_grad changes] (dispatch/ops.py)
    try:
        return func(*args, **kwargs)
    finally:
        _note_requires_grad(params)


@implements(torch.Tensor.requires_grad_, torch.Tensor.detach_)
def _requires_grad_(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    requires_grad_changed()  # Note [requires_grad changes] (dispatch/ops.py)
    try:
        return dispatch(func, args, kwargs, params)
    finally:
        _note_requires_grad(params)


def _note_requires_grad(params: list) -> None:
    """The slots' copies of the flag follow the masters' (Note [metadata without dispatch])."""
    for p in params:
        slot = getattr(p, "_ot", None)
        if slot is not None:
            slot.note_requires_grad()


def _routed_handler(func: Any) -> Handler:
    """The handler of a function with no entry of its own and not a property access (Note [op
    routing]): a query about the parameter itself (`MASTER_ONLY`); the default path for what it
    treats specially (compressed masters' own cases, `p[i] = v`) and for an aten overload written
    by its schema; a write by its name (`add_`, `__iadd__`); else a function that only reads, whose
    ops inside a resident scope get the device copies (Note [ops in a resident scope] in
    dispatch/ops.py; `out=` and `inplace=True` are the handler's to check)."""
    if func in MASTER_ONLY:
        return _querying
    if compressed_special(func) or func is torch.Tensor.__setitem__:
        return _default
    if writes_by_name(func):
        return _default if isinstance(func, OpOverload) else _writing
    return _reading


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
    home = slot.scope.source.home  # Note [master sources] in scopes/sources.py
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


@implements(torch.Tensor.detach)
def _detach(func: Any, args: tuple, kwargs: dict, params: list) -> torch.Tensor:
    """`p.detach()`: the master. DistributedDataParallel's constructor detaches every parameter;
    refused for offloaded ones (Note [data-parallel wrappers] in dispatch/wrapper_guards.py)."""
    p = args[0]
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
    copy = exposed_copy(p)  # Note [writes through the parameter in an exposed call] (engine/hooks.py)
    if copy is not None:
        return torch.Tensor.detach(copy)
    if slot is not None:  # Note [a write through an alias may follow at once] (engine/writes.py)
        slot.scope.master_handed_out(slot, detached=True)
    return torch.Tensor.detach(p)


def _calling(fn: Handler, func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    return fn(*args, **kwargs)


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
@implements(nn.functional.embedding, nn.functional.embedding_bag)
def _renormalizing(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    bound = _SIGNATURES[func].bind(*args, **kwargs)
    weight, max_norm = bound.arguments["weight"], bound.arguments.get("max_norm")
    if max_norm is not None and isinstance(weight, OffloadedParameter):
        indices = bound.arguments["input"].to(weight.device).contiguous()
        norm_type = float(bound.arguments.get("norm_type", 2.0))
        with torch.no_grad():
            dispatch(torch.embedding_renorm_, (weight, indices, max_norm, norm_type), {}, [weight])
        bound.arguments["max_norm"] = None
    return dispatch(func, bound.args, bound.kwargs, find_params(bound.args, bound.kwargs))


_SIGNATURES = {f: inspect.signature(f) for f in (nn.functional.embedding, nn.functional.embedding_bag)}


# ---- the table (Note [op routing]) -------------------------------------------------------------

for _func, _entry in AUTOGRAD_ENTRIES.items():  # Note [gradients with respect to a parameter]
    implements(_func, with_dispatch=True)(cast(Handler, _entry))
for _func, _registrar in REGISTRARS.items():  # Note [user gradient hooks] (dispatch/autograd.py)
    implements(_func)(partial(_calling, _registrar))
implements(*(_accessor(name, "__get__") for name in DERIVED_PROPERTIES))(_dispatch)  # `w.T` is an op on w


@implements(_accessor("data", "__set__"))
def _set_data(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    copy = exposed_copy(args[0])  # Note [writes through the parameter in an exposed call] (engine/hooks.py)
    if copy is not None:
        copy.data = args[1]  # ExposedCopy's setter: into the copy, copied to the master at the call's end
        return None
    return set_data(args[0], args[1])


@implements(_accessor("data", "__get__"))
def _get_data(func: Any, args: tuple, kwargs: dict, params: list) -> Any:
    slot = getattr(args[0], "_ot", None)
    if slot is None:
        return func(*args, **kwargs)
    copy = exposed_copy(args[0])  # Note [writes through the parameter in an exposed call] (engine/hooks.py)
    if copy is not None:
        return copy.data  # noted by ExposedCopy: a write through it reaches the master at the call's end
    slot.scope.master_handed_out(slot)  # Note [VRAM budget]
    alias = func(*args, **kwargs)
    slot.data_handed_out(alias)  # Note [p.data aliases] (dispatch/slot.py)
    return alias


