"""Writes to an offloaded parameter: `p.data = t` and `p.set_(t)` copy into the master, and
which ops write a parameter (an in-place write always goes to the master, never a device copy).

Code here is handed the offloaded parameters of an op by `OffloadedParameter.__torch_function__`
(dispatch/param.py, above), as `offloaded`, the set of their ids: it never tests for the class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload

_TensorBase = torch._C.TensorBase
_SETITEM = torch.Tensor.__setitem__


def set_data(p: torch.Tensor, value: torch.Tensor, what: str = "set .data of") -> None:
    """`p.data = t` copies into the host master instead of rebinding it (the master must stay in
    the scope's pinned buffer). `model.cuda()` never gets here: see Note [moving a wrapped model] in model/guards.py."""
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
    slot.scope.master_written(slot)
    # Detached: autograd records nothing, without grad mode (Note [interrupts]); `p.detach()`
    # shares p's version counter, so the write bumps it as `p.copy_` under no_grad did.
    p.detach().copy_(value.detach())


def set_master(p: torch.Tensor, *args: Any) -> torch.Tensor:
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
        slot.packed.check_write()  # a master in a file (Note [masters in files] in storage/file_masters.py)
    set_data(p, source, "set_()")
    return p


def is_inplace(func: Any, args: tuple, kwargs: dict, offloaded: set[int]) -> bool:
    """The op writes an argument (`offloaded`: the ids of the offloaded parameters among them)."""
    if kwargs.get("inplace") is True:
        # torch.nn.functional's `inplace=True` (F.relu, F.dropout, F.hardtanh: their own
        # dispatch passes it by keyword) writes its input: dispatched as a read, it wrote the
        # device copy only, lost at the next load.
        return True
    if func is _SETITEM:
        # `p[i] = v` writes p (dispatched as an op, it wrote the device copy inside p's scope,
        # and a temporary copy elsewhere in a forward: lost); `h[i] = p` only reads p.
        return bool(args) and id(args[0]) in offloaded
    # Note [writes the name does not show]
    if "out" in kwargs and _among((kwargs["out"],), offloaded):
        return True
    return writes_by_name(func)


def writes_by_name(func: Any) -> bool:
    """`func` writes its first argument by what it is, whatever it is given: an aten overload
    whose schema marks a write, or a name like `add_` or `__iadd__`."""
    if isinstance(func, OpOverload):
        return bool(_mutated_positions(func))
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


# Note [writes the name does not show]
# An op is taken for an in-place write by its name (`add_`, `__iadd__`), and such a write goes to
# the master. Two kinds of write have no such name: `torch.add(a, b, out=p)` writes `p`, and an
# aten overload called directly (`torch.ops.aten.add_.Tensor(p, t)`, `aten.copy_.default`) is
# named `add_.Tensor`. Dispatched as reads, both would write the scope's device copy (or a
# temporary copy) inside a forward, lost at the next load: a step counter that never counts. So
# an `out=` holding a parameter makes the op a write of the `out` tensors, and an
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


def written(func: Any, args: tuple, kwargs: dict, offloaded: set[int]) -> set[int]:
    """ids of the offloaded parameters (among `offloaded`) an in-place op writes: `out=` when given, the arguments
    an aten overload's schema marks as written, else its first argument (`self`, the list of a
    `_foreach_*_` op, `nn.init`'s `tensor=` keyword). Note [writes the name does not show]."""
    targets: tuple[Any, ...]
    if "out" in kwargs:
        targets = (kwargs["out"],)
    elif isinstance(func, OpOverload) and (positions := _mutated_positions(func)):
        targets = tuple(args[i] if i < len(args) else kwargs.get(name) for i, name in positions)
    else:
        targets = args[:1] if args else tuple(kwargs.values())[:1]
    return _among(targets, offloaded)


def _among(values: tuple, offloaded: set[int]) -> set[int]:
    """ids of the offloaded parameters among `values` and the lists and tuples in them."""
    found: set[int] = set()
    for a in values:
        for x in a if isinstance(a, (list, tuple)) else (a,):
            if id(x) in offloaded:
                found.add(id(x))
    return found
