"""What an op on offloaded parameters gets in place of each: the scope's device copy, a
temporary copy (OpAccess.materialize), or the master (Note [dispatch of an offloaded parameter]
in dispatch/param.py).

Code here is handed the offloaded parameters among an op's arguments by
`OffloadedParameter.__torch_function__` (dispatch/param.py, above): `params`, and `offloaded`,
the set of their ids; it never tests for the class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import compile as _compile
from .masters import MASTER_ONLY
from .slot import HOLDS, ParamSlot, SlotScope, exposed_copy, on_optimizer_worker, worker_state
from .writes import is_inplace, written

# Note [ops in a resident scope]
# Nearly every op on an offloaded parameter runs inside its scope's call with its copy on the
# device, or on its way: a kept scope's always, a streamed one's once its load's every chunk is
# enqueued (the first op on a chunk then makes compute wait for it, device side). There the general
# path (below) ends at the scope's device copy after a dozen checks for cases that cannot apply,
# and a DiT's blocks run many short kernels, between which the host must keep up: that host time
# per op was the gap between a kept model and the resident one. So `resident_copies` answers
# this case first: an op that only reads (`_routed_handler`, decided once per function by the
# caller), no tracing or torch.func transform, not the optimizer worker, and each parameter in
# the top-level arguments with a copy that `ParamSlot.ready_copy` (dispatch/slot.py) gives without
# host work, which is also where `OpAccess.materialize` starts. Anything else goes the general way.
# A routed expert parameter's copy is such a copy once every expert is there, or its call's router
# choice (`RoutedRows.hinted`), but not to `w[idx]`, which may index others: the general way copies
# them (Note [which experts an op reads] in scopes/experts.py).


def resident_copies(args: tuple, kwargs: dict, *,
                    indexing: bool = False) -> tuple[tuple, dict, list[torch.Tensor]] | None:
    """(args, kwargs, the parameters replaced) with each offloaded parameter (a tensor with `_ot`)
    replaced by its scope's device copy (Note [ops in a resident scope]); None: take the
    general path. `indexing`: the op is `Tensor.__getitem__`, which may read experts beyond the
    router's choice (Note [which experts an op reads] in scopes/experts.py)."""
    if (getattr(worker_state, "active", False) or _compile.tracing()  # on_optimizer_worker(), inline
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return None
    values = (*args, *kwargs.values()) if kwargs else args
    subs: list[Any] = list(values)
    params: list[torch.Tensor] = []
    for i, a in enumerate(values):
        if type(a) in SCALAR_TYPES:  # without a call: `w.transpose(-2, -1)`'s dims
            continue
        if isinstance(a, torch.Tensor):
            slot = getattr(a, "_ot", None)
            if slot is None:
                continue
            if indexing and slot.experts is not None and not slot.experts.whole:
                return None
            copy = slot.ready_copy()
            if copy is None:
                return None
            params.append(a)
            subs[i] = copy
        elif isinstance(a, (list, tuple)) and any(getattr(x, "_ot", None) is not None for x in a):
            return None  # a list holding parameters (`torch.cat([w, v])`): the general path's
    if not params:
        return None
    if not kwargs:
        return tuple(subs), {}, params
    n = len(args)
    return tuple(subs[:n]), dict(zip(kwargs, subs[n:], strict=True)), params


# Types of arguments with no tensor inside (an op's dims, a decoder layer's flags), told apart by
# `type(x) in SCALAR_TYPES`, without a call.
SCALAR_TYPES = frozenset({int, float, bool, type(None), str})


# Note [one parameter on the general path's way]
# An optimizer's step on host masters writes one parameter per op (`p.add_(g, alpha=-lr)`,
# `p.addcdiv_(m, d, value=-lr)`: torch's optimizers take the per-tensor path for host tensors),
# with only plain tensors and numbers beside it, asks about it (`torch.is_complex(p)`, at each
# AdamW step), and reads it (`grad.add(p, alpha=wd)`). The general path reaches each outcome, the
# master marked written and the op run on it, the query answered by the master, the read given
# what `materialize` gives, through a dozen checks for cases that cannot apply, several Python
# calls each, at every parameter of every step. So these ops first ask `lone_parameter`: one
# offloaded parameter among the top-level arguments (no list holding tensors), with a plain
# master in host memory (not compressed or in a file), no deferred or other rank's step on it,
# not a routed expert, neither tracing nor on the optimizer worker. Then a write of it as the
# first argument outside an exposed call (`written_alone`) goes to the master, a query to the
# master, a read to what materialize gives (`read_alone`). Anything else goes the general way.


def lone_parameter(args: tuple, kwargs: dict) -> ParamSlot | None:
    """The slot of the op's one offloaded parameter if the op may take the short path (Note [one
    parameter on the general path's way]); None: take the general path."""
    if getattr(worker_state, "active", False) or _compile.tracing():  # on_optimizer_worker(), inline
        return None
    found = None
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) in SCALAR_TYPES:
            continue
        if isinstance(a, (list, tuple)):
            return None
        slot = getattr(a, "_ot", None)
        if slot is not None:
            if found is not None:
                return None
            found = slot
    if found is None or not plain_master(found):
        return None
    return found


def plain_master(slot: ParamSlot) -> bool:
    """The slot's master is a plain one in host memory (not compressed or in a file), with no
    deferred or other rank's step on it, not a routed expert's (Note [one parameter on the general
    path's way])."""
    return (slot.packed is None and slot.pending_step is None and slot.stepped_elsewhere is None
            and slot.experts is None)


def on_first(slot: ParamSlot | None, args: tuple) -> bool:
    """`slot` is not None and the first argument's (the parameter an in-place op writes, a query
    is about)."""
    return slot is not None and bool(args) and getattr(args[0], "_ot", None) is slot


def written_alone(args: tuple, kwargs: dict) -> ParamSlot | None:
    """The slot of the op's first argument if the op writes it alone (Note [one parameter on the
    general path's way]); None: take the general path."""
    slot = lone_parameter(args, kwargs)
    if slot is None or not on_first(slot, args) or slot.scope.exposed or "out" in kwargs:
        return None
    return slot


def read_alone(func: Any, args: tuple, kwargs: dict, slot: ParamSlot) -> Any:
    """`func` with `slot`'s parameter, its one offloaded parameter (`lone_parameter`), given
    what `materialize` gives it, as `dispatch` would."""
    p = slot.param
    ids = {id(p)}
    replacement = slot.scope.materialize(slot, op_device(args, kwargs, ids))
    if replacement is None:
        return func(*args, **kwargs)
    args, kwargs = substitute(args, kwargs, {id(p): replacement}, ids)
    return run_op(func, args, kwargs, [p])


def resident_copies_ready(scope: SlotScope, *, versions_read: bool = False, in_call: bool = True) -> bool:
    """Of a RESIDENT scope: `ready_copy` would return each slot's device copy but a routed expert
    parameter's (whose ops copy the rows they read: they keep the per-op path, Note [calls of a
    loaded scope] in engine/hooks.py); the copies' requires_grad set as `use_device_copy` sets it.
    The checks of ready_copy, with the version reads one per scope (Note [one version read per
    scope] in scopes/write_tracking.py): asked at each call of a kept scope. `versions_read`: the
    masters' versions were just found unchanged since their copies (in the same pre-hook).
    `in_call=False`: asked before any call of the scope (Note [exposed passes] in engine/model_hooks.py)."""
    slots = scope.slots
    if (in_call and scope.calls.running <= 0) or scope.copy_order is None:
        return False
    if not masters_free(scope) or not scope.writes.copies_current(len(slots), versions_read=versions_read):
        return False
    changes = REQUIRES_GRAD_CHANGES[0]
    if scope.requires_grad_seen != changes:  # the user froze or unfroze parameters since the last call
        for slot in slots:
            slot.use_device_copy()
        scope.requires_grad_seen = changes
    return True


def masters_free(scope: SlotScope) -> bool:
    """No deferred optimizer step or other rank holds any of the scope's masters, looked at once
    per count of holds (Note [masters held from ops] in dispatch/slot.py)."""
    holds = HOLDS[0]
    if scope.holds_seen != holds:
        for slot in scope.slots:  # a loop over plain fields: asked per parameter
            if slot.pending_step is not None or slot.stepped_elsewhere is not None:
                return False
        scope.holds_seen = holds
    return True


# Note [requires_grad changes]
# A device copy's requires_grad follows its parameter's, set when an op gets it
# (`use_device_copy`). A kept scope's call checks all of them at once, but only when some
# parameter's requires_grad was set since its last check: every such write (`p.requires_grad =`,
# `p.requires_grad_()`, nn.Module.requires_grad_, `p.detach_()`) reaches an offloaded parameter
# through `__torch_function__`, which counts it here; a device copy is made with its parameter's
# flag (wrap) or its predecessor's (retire_device_copy), and a retired copy comes back only with
# the flag of the copy it replaces (Note [retired copies taken back] in scopes/device_buffer.py),
# so no other change can part them.
REQUIRES_GRAD_CHANGES = [0]  # writes of requires_grad to offloaded parameters, since import


def requires_grad_changed() -> None:
    REQUIRES_GRAD_CHANGES[0] += 1


def run_op(func: Any, args: tuple, kwargs: dict, params: Sequence[torch.Tensor]) -> Any:
    """`func(*args, **kwargs)`, its arguments already substituted for `params`, naming the
    parameter when a compute dtype's mismatch is what failed."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:
        error = _compute_dtype_error(func, params, e)
        if error is None:
            raise
        raise error from e


def dispatch(func: Any, args: tuple, kwargs: dict, params: Sequence[torch.Tensor]) -> Any:
    """`func(*args, **kwargs)` with each offloaded parameter among `params` replaced by what the
    op gets; an in-place write goes to the master."""
    if not params or func in MASTER_ONLY:
        return func(*args, **kwargs)
    offloaded = {id(p) for p in params}
    if is_inplace(func, args, kwargs, offloaded):
        # Writes always go to the master (under grad mode PyTorch then raises its usual
        # leaf-in-place error, as for a plain parameter). Every offloaded argument counts as
        # written (safe if a write is not recognised below); those that are surely only read
        # (`h.add_(self.bias)` in a forward) are then materialized as for any other op.
        writes = written(func, args, kwargs, offloaded)
        # In an exposed call the parameter's value is its device copy: the op writes that, and
        # the call's end copies it into the master (Note [writes through the parameter in an
        # exposed call] in engine/hooks.py).
        exposed = {id(p) for p in params if exposed_copy(p) is not None}
        writes -= exposed
        for p in params:
            slot = getattr(p, "_ot", None)
            if id(p) in exposed:
                continue
            if slot is not None and id(p) in writes:
                slot.scope.master_written(slot)
            elif slot is not None:
                slot.scope.before_master_write(slot, written=False)
        if on_optimizer_worker():  # the optimizer thread: masters only
            return func(*args, **kwargs)
        params = [p for p in params if id(p) not in writes]
        if not params:
            return func(*args, **kwargs)
    if on_optimizer_worker():  # the optimizer thread: masters only
        return func(*args, **kwargs)
    subs = replacements(params, op_device(args, kwargs, offloaded))
    if not subs:
        return func(*args, **kwargs)
    for p in params:  # routed experts: the rows the op reads (Note [routed experts] in scopes/experts.py)
        slot = getattr(p, "_ot", None)
        if slot is not None and slot.experts is not None and subs.get(id(p)) is slot.device_leaf:
            slot.experts.before_op(func, args, p)
    args, kwargs = substitute(args, kwargs, subs, offloaded)
    return run_op(func, args, kwargs, params)


def _compute_dtype_error(func: Any, params: Sequence[torch.Tensor], e: RuntimeError) -> RuntimeError | None:
    """The error to raise instead of `e` when a parameter computing in Policy(compute_dtype)
    met inputs of another dtype; None for any other error."""
    found = next(((p, s) for p in params if (s := getattr(p, "_ot", None)) is not None and s.scope.casts), None)
    if found is None or "dtype" not in str(e):
        return None
    cast, slot = found
    name, dtype, kind = getattr(func, "__name__", func), slot.device_view.dtype, slot.device_view.device.type
    if torch.is_autocast_enabled(kind):
        # CPU autocast leaves layer_norm and group_norm alone (CUDA's runs them in fp32), so
        # a norm's bf16 copy meets fp32 activations there under autocast too.
        fix = (f"torch.autocast is on, but it does not cast the inputs of {name} on {kind}: "
               f"cast them to {dtype} before this op")
    else:
        fix = f"Run the model under torch.autocast(device_type, dtype={dtype}), or cast the inputs to {dtype}"
    return RuntimeError(
        f"offtensor: {name} failed on offloaded parameter {slot.name!r}, which computes in "
        f"{dtype} (Policy(compute_dtype=...)) while its master is {cast.dtype}: the other "
        f"inputs must be of the compute dtype. {fix}"
    )


def replacements(params: Sequence[torch.Tensor], op_device: torch.device | None) -> dict[int, torch.Tensor]:
    """What an op on `params` gets in place of each (by id): a device or temporary copy
    (OpAccess.materialize); none where the op acts on the master."""
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
        replacement = slot.scope.materialize(slot, op_device)
        if replacement is None and slot.packed is not None:
            replacement = slot.packed.unpack()  # the master's values (Note [compressed masters])
        if replacement is not None:
            subs[id(p)] = replacement
    return subs


def op_device(args: tuple, kwargs: dict, offloaded: set[int]) -> torch.device | None:
    """The accelerator device of the op's tensors other than the offloaded parameters (ids in
    `offloaded`), or None when they are all on the CPU."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if id(a) not in offloaded and a.device.type != "cpu":
                return a.device
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor) and id(x) not in offloaded and x.device.type != "cpu":
                    return x.device
    return None


def _sub_one(a: Any, subs: dict[int, torch.Tensor], offloaded: set[int]) -> Any:
    if id(a) in offloaded:
        return subs.get(id(a), a)
    if isinstance(a, (list, tuple)) and any(id(x) in offloaded for x in a):
        return type(a)(subs.get(id(x), x) if id(x) in offloaded else x for x in a)
    return a


def substitute(args: tuple, kwargs: dict, subs: dict[int, torch.Tensor],
               offloaded: set[int]) -> tuple[tuple, dict]:
    """The op's arguments with each offloaded parameter (ids in `offloaded`) replaced by its
    entry in `subs`, in lists and tuples too."""
    return (tuple(_sub_one(a, subs, offloaded) for a in args),
            {k: _sub_one(v, subs, offloaded) for k, v in kwargs.items()})

