"""The master itself: reached with subclass dispatch off, once its deferred optimizer step is done.

Everything below `OffloadedParameter.__torch_function__` acts on the host master as a plain
tensor. These are the ways in: `without_subclass_dispatch`, the master's values, `.grad` and
`requires_grad` without a round trip through `__torch_function__`, and the wait for a pending
step before an op reads or writes it (`await_steps`), with the kinds of op that wait decides on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..storage.compress import packed_of
from .slot import in_backward, on_optimizer_worker

_disabled_torch_function_impl = torch._C._disabled_torch_function_impl
_TensorBase = torch._C.TensorBase


# Note [interrupts]
# A KeyboardInterrupt (Ctrl-C) can arrive between any two bytecodes of Python code, even inside
# a context manager's `__enter__` after it changed a setting and before the `with` body starts;
# its `__exit__` then never runs. So offtensor changes no process-wide or thread-local setting in
# Python code that an interrupt could leave half done:
# - it needs no grad mode: its copies read plain, detached tensors (`ParamSlot.master`) and
#   write tensors that do not require grad, so autograd records nothing;
# - subclass `__torch_function__` dispatch is turned off only by `without_subclass_dispatch`
#   (or its C function around a `list(map(getter, tensors))`), which restores the state itself
#   whatever the function raises (a `with DisableTorchFunctionSubclass():` is left disabled by an
#   interrupt where `with` calls `__exit__`, at the end of its body or at a `return` in it);
# - what must change for a while (the current CUDA stream during a copy, no_offload's holds, the
#   latest backward_and_step) is recorded where the next entry point (a forward, a backward, an
#   eager optimizer step) finds and undoes it if an interrupt skipped the undo (Streams.restore,
#   no_offload's weak set of holds, backward_and_step's `close_if_abandoned`; the end of
#   backward forgets its worker).
# The optimizer worker thread changes its own thread-local settings (worker_state.active, its
# intra-op thread count): signals reach only the main thread.
# tests/core/test_interrupts.py raises KeyboardInterrupt at every few traced events of a step.


def without_subclass_dispatch(fn: Any, *args: Any) -> Any:
    """`fn(*args)` with `__torch_function__` of tensor subclasses off (DisableTorchFunctionSubclass),
    turned back on in C whatever fn raises (Note [interrupts])."""
    return _disabled_torch_function_impl(fn, (), args)  # type: ignore[call-arg]


def master_values(p: torch.Tensor) -> torch.Tensor:
    """A copy of the master's values, with subclass dispatch off: a compressed master's are
    unpacked (Note [compressed masters] in storage/compress.py)."""
    packed = packed_of(p)
    return packed.unpack() if packed is not None else p.detach().clone()


def await_steps(params: Sequence[torch.Tensor], func: Any) -> None:
    """Wait for the deferred optimizer steps of the parameters an op or property access uses
    (Note [deferred step fences] in dispatch/slot.py); nothing to do unless one is pending. A shared master that
    another rank may be stepping is not read at all (Note [barrier across ranks] in distributed/shared_masters.py)."""
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
        return name == "__get__" and (prop == "data" or prop in DERIVED_PROPERTIES)
    return func not in _METADATA


def master_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad` of the master itself, once its deferred step is done (Note [deferred step fences] in
    dispatch/slot.py), without a round trip through `__torch_function__`: a property read on a tensor
    subclass dispatches it unless subclass dispatch is off, and the gradient path reads it for
    every gradient."""
    slot = getattr(p, "_ot", None)
    if slot is not None and slot.pending_step is not None and not on_optimizer_worker():
        slot.wait_for_step()
    return _disabled_torch_function_impl(_GRAD_OF, (), (p,))  # type: ignore[call-arg]


_GRAD_OF = _TensorBase.grad.__get__  # type: ignore[union-attr]


def master_requires_grad(p: torch.Tensor) -> bool:
    """`p.requires_grad` of the master, without a round trip through `__torch_function__`."""
    return without_subclass_dispatch(_REQUIRES_GRAD_OF, p)


_REQUIRES_GRAD_OF = _TensorBase.requires_grad.__get__  # type: ignore[attr-defined]


# Tensor properties that compute a new tensor from the parameter's values (`x @ w.T`): they
# are dispatched like ops. Every other property (`p.grad`, `p.data`, `p.shape`, `p.device`) is
# about the master itself.
DERIVED_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})

# What a parameter is, not what it holds (shape, layout, where it lives, its grad settings).
_ABOUT_THE_PARAMETER = {
    torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.ndimension, torch.Tensor.stride, torch.Tensor.element_size, torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_signed, torch.Tensor.__len__,
    torch.Tensor.get_device, torch.Tensor.is_pinned, torch.Tensor.data_ptr, torch.Tensor.untyped_storage,
    torch.Tensor.storage_offset, torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.is_shared,
    torch.Tensor.__hash__, torch.is_complex, torch.is_floating_point, torch.numel,
}

# Allowed while another rank may be stepping a shared master (`_reads_values`).
_METADATA = _ABOUT_THE_PARAMETER | {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}

# Queries about the master itself, and methods that change the parameter object: never
# materialized, even when grad mode would otherwise call for a differentiable copy.
MASTER_ONLY = _ABOUT_THE_PARAMETER | {
    torch.Tensor.detach, torch.Tensor.pin_memory, torch.Tensor.__format__, torch.Tensor.tolist,
    torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.type, torch.Tensor.__bool__,
}

