"""The tensor types of a parameter's device copy: `DeviceCopy` (what ops get), `ExposedCopy`
(registered in place of its parameter during a kept scope's eager call) and the `Exposure` its
scope's copies share, and `device_copy`, which makes one inside a scope's flat device buffer."""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn


class DeviceCopy(torch.Tensor):
    """The device copy of an offloaded parameter: a plain tensor to every op, but printing it
    while its scope is offloaded (storage resized to 0 bytes) says so instead of reading freed
    memory. Tracebacks that show argument values (pytest, rich, debuggers) print these after an
    exception in a forward, when the scopes have already been released."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    # Note [device copies are not activations]
    # Activation offloading (TRL's and torchtune's OffloadActivations) packs every saved tensor
    # to the host except parameters and buffers, which it recognises by isinstance. A device
    # copy is what autograd saves for a linear's input gradient, so without a mark each copy of
    # a weight would cross to the host in forward and back in backward, beside offtensor's own
    # loads of the same weights.
    # `_is_buffer` is what makes `isinstance(t, nn.Buffer)` true for a tensor subclass; it
    # changes nothing else unless a device copy is assigned to a module attribute.
    _is_buffer = True

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        needed = (self.storage_offset() + self.numel()) * self.element_size()
        if self.untyped_storage().nbytes() < needed:
            return (f"<offtensor device copy {tuple(self.shape)} {self.dtype} on {self.device}: "
                    "released, its scope is offloaded>")
        return torch.Tensor.__repr__(self, *args, **kwargs)


class Exposure:
    """Whether a scope's device copies are exposed in an eager call: the `.data` aliases noted
    in the call, or None outside one (Note [calls of a loaded scope] in engine/hooks.py). Each
    ExposedCopy of the scope refers to it from its first exposure on (`mark_exposed`)."""

    __slots__ = ("aliases",)

    def __init__(self) -> None:
        self.aliases: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None


def mark_exposed(leaf: torch.Tensor, exposure: Exposure, param: torch.Tensor) -> None:
    """Make a scope's device copy an ExposedCopy of `param` for good (until the compiled path
    makes it an nn.Parameter again: `unmark_exposed`)."""
    leaf.__class__ = ExposedCopy
    marks = leaf.__dict__
    marks["_ot_exposure"] = exposure
    marks["_ot_param"] = weakref.ref(param)  # Note [copies of an exposed call]


def unmark_exposed(leaf: torch.Tensor) -> None:
    marks = leaf.__dict__
    marks.pop("_ot_exposure", None)
    marks.pop("_ot_param", None)


class ExposedCopy(nn.Parameter):
    """A kept scope's device copy registered in place of its parameter for eager calls (Note
    [calls of a loaded scope] in engine/hooks.py): an nn.Parameter to module code, with no
    `__torch_function__` of its own, whose `.data` aliases are noted while its scope's copies are
    exposed, so that a write through one (which bumps no version counter the call can compare)
    reaches the master too."""

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        alias = _DATA_GET(self)
        exposure = self.__dict__.get("_ot_exposure")
        noted = exposure.aliases if exposure is not None else None
        if noted is not None:
            noted.append((self, alias, alias._version))
        return alias

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        alias = self.data  # noted: a write through it is seen
        if value.shape != alias.shape or value.dtype != alias.dtype:
            raise RuntimeError(
                f"offtensor: `.data =` of a tensor of shape {tuple(value.shape)} and {value.dtype} "
                f"on an offloaded parameter of shape {tuple(alias.shape)} and {alias.dtype}, inside "
                "its scope's forward: its master cannot change shape or dtype. Assign a tensor of the "
                "same shape and dtype")
        with torch.no_grad():
            alias.copy_(value)
        # As `p.data = t` on the master bumps its device copies: a graph that saved this copy
        # before the write raises (Note [writes under a saved graph] in dispatch/slot.py).
        torch.autograd.graph.increment_version(self)

    # Note [copies of an exposed call]
    # A KeyboardInterrupt ends a call without its forward hook, so its copies stay in the
    # modules' attributes until the scope's next call takes them back. A deepcopy or a pickle of
    # the model in between would keep such an attribute next to the parameter it stands for, and
    # the copy's forward would read the one while its optimizer steps the other. So while it is
    # exposed (its Exposure's `aliases` set) the copy copies and pickles as its parameter does:
    # the same object as the copied module's parameter. Outside its calls it copies and pickles
    # as an nn.Parameter of its values, without offtensor's marks.
    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        param = self._exposed_param()
        if param is None:
            return super().__deepcopy__(memo)  # type: ignore[no-any-return]
        return copy.deepcopy(param, memo)

    def __reduce_ex__(self, proto: Any) -> Any:  # type: ignore[override]
        param = self._exposed_param()
        if param is not None:
            return (_same, (param,))
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_ot_")}
        if not state:
            return (torch._utils._rebuild_parameter, (self.data, self.requires_grad, OrderedDict()))
        return (torch._utils._rebuild_parameter_with_state,
                (self.data, self.requires_grad, OrderedDict(), state))

    def _exposed_param(self) -> torch.Tensor | None:
        """The parameter this copy stands for while exposed, else None."""
        marks = self.__dict__
        exposure = marks.get("_ot_exposure")
        if exposure is None or exposure.aliases is None:
            return None
        return marks["_ot_param"]()  # type: ignore[no-any-return]

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return DeviceCopy.__repr__(self, *args, **kwargs)  # type: ignore[arg-type]


def _same(obj: Any) -> Any:
    return obj


_DATA_GET = torch._C.TensorBase.data.__get__  # type: ignore[attr-defined]


def copy_view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The view of a scope's flat device buffer that a load writes a parameter's copy through."""
    return flat[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)


def device_copy(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size,
                requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A parameter's device copy in a scope's flat device buffer (which must be allocated),
    as (the leaf ops see, the view the loader writes through)."""
    view = copy_view(flat, offset, dtype, shape)
    base = torch.empty(0, dtype=dtype, device=flat.device)
    base.set_(flat.untyped_storage(), offset // dtype.itemsize, shape, view.stride())
    # A leaf of its own (not a view of `flat`), made without requires_grad_(), which
    # torch.func transforms refuse (a retire can happen inside one).
    leaf = torch.Tensor._make_subclass(DeviceCopy, base, requires_grad)
    return leaf, view
