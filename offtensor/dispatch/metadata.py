"""What an offloaded parameter is (shape, dtype, device, numel, requires_grad, `.grad`),
answered without a round trip through `__torch_function__`.

# Note [metadata without dispatch]
A property read on a tensor subclass with its own `__torch_function__` goes through it, a
Python round trip where an `nn.Parameter` answers in C. Module code reads these in every forward
(`x.to(self.weight.dtype)`, shape checks), and the gradient path, the optimizer and `zero_grad`
read `.grad` of every parameter, so the cost grows with the model. They are about the master
itself, which `__torch_function__` would hand them (Note [dispatch of an offloaded parameter]
in dispatch/param.py): so OffloadedParameter defines them as Python properties, found before
TensorBase's own. Shape, dtype, device and numel cannot change after wrap (a dtype change or
a new shape is refused, the master never leaves its host buffer): the slot holds them
(`ParamMeta`, dispatch/slot.py). `requires_grad` is the slot's copy of the master's flag, taken
again after each write of it (every such write comes through `__torch_function__`: Note
[requires_grad changes] in dispatch/ops.py); `.grad` is read from the master with subclass
dispatch off.
A `.grad` read or write still waits for a pending optimizer step (the worker reads and may
write it): with a fence pending, or a shared master another rank steps, these take the
dispatched path. Writes to `requires_grad` (refused on compressed masters) always do.
"""

from __future__ import annotations

from typing import Any

import torch

_disabled = torch._C._disabled_torch_function_impl
_TensorBase = torch._C.TensorBase
_GET_GRAD = _TensorBase.grad.__get__  # type: ignore[union-attr]
_SET_GRAD = _TensorBase.grad.__set__  # type: ignore[union-attr]
_GET_REQUIRES_GRAD = _TensorBase.requires_grad.__get__  # type: ignore[attr-defined]
_SET_REQUIRES_GRAD = _TensorBase.requires_grad.__set__  # type: ignore[attr-defined]


def _fixed(field: int, native: Any) -> property:
    def get(self: Any) -> Any:
        try:
            return self._ot.meta[field]
        except AttributeError:  # detached from offtensor (unwrap): what TensorBase says
            return native.__get__(self)

    return property(get)


shape = _fixed(0, _TensorBase.shape)  # type: ignore[attr-defined]
dtype = _fixed(1, _TensorBase.dtype)  # type: ignore[attr-defined]
device = _fixed(2, _TensorBase.device)  # type: ignore[attr-defined]
ndim = _fixed(3, _TensorBase.ndim)  # type: ignore[attr-defined]


def numel(self: Any) -> int:
    try:
        return self._ot.meta.numel
    except AttributeError:
        return _TensorBase.numel(self)


def element_size(self: Any) -> int:
    try:
        return self._ot.meta.dtype.itemsize
    except AttributeError:
        return _TensorBase.element_size(self)


# `.grad` is the master's own, read and written in C, when no optimizer step is pending or done
# elsewhere; else through __torch_function__, which waits for the step. Tested inline: zero_grad()
# and each optimizer step read or write it for every parameter.


# (`self._ot`, not `self.__dict__`: dynamo traces these in a compiled optimizer step.)


def _get_grad(self: Any) -> torch.Tensor | None:
    try:
        slot = self._ot
    except AttributeError:  # detached from offtensor (unwrap)
        return _GET_GRAD(self)
    if slot.arrived:  # gradients no hook of ours took yet (Note [gradients on arrival] in engine/grads.py)
        slot.scope.arrived_outside(slot)
    if slot.pending_step is None and slot.stepped_elsewhere is None:
        return _disabled(_GET_GRAD, (), (self,))  # type: ignore[call-arg]
    return _GET_GRAD(self)  # through __torch_function__: waits for the step


def _set_grad(self: Any, value: torch.Tensor | None) -> None:
    try:
        slot = self._ot
    except AttributeError:
        _SET_GRAD(self, value)
        return
    if slot.arrived:  # added first, as the backward that made them would have
        slot.scope.arrived_outside(slot)
    if slot.pending_step is None and slot.stepped_elsewhere is None:
        _disabled(_SET_GRAD, (), (self, value))  # type: ignore[call-arg]
    else:
        _SET_GRAD(self, value)


def _del_grad(self: Any) -> None:
    _set_grad(self, None)


grad = property(_get_grad, _set_grad, _del_grad)


def _get_requires_grad(self: Any) -> bool:
    try:
        return self._ot.requires_grad  # type: ignore[no-any-return]
    except AttributeError:
        return _disabled(_GET_REQUIRES_GRAD, (), (self,))  # type: ignore[call-arg]


def _set_requires_grad(self: Any, value: bool) -> None:
    _SET_REQUIRES_GRAD(self, value)  # through __torch_function__: compressed masters refuse it


requires_grad = property(_get_requires_grad, _set_requires_grad)
