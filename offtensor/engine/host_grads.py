"""The host end of the gradient path (Note [gradient path] in engine/grads.py): each parameter's
pinned gradient buffer, the copies into it (Note [one pass per scope's gradients]), and `p.grad`
set on the masters."""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import ParamSlot
from ..scopes.scope import Scope, scope_of
from ..scopes.streams import Streams

_SET_GRAD = torch._C.TensorBase.grad.__set__  # type: ignore[union-attr]


class CopiesHome:
    """The device gradients' copies into their host buffers, and the device gradients they read,
    kept until compute has waited for their copy (one per engine)."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams
        self.inflight: list[tuple[Scope, Any, torch.Tensor]] = []  # (scope, d2h event, device grad)
        self.last: Any = None  # the last copy's event (d2h stream)

    def copy(self, batch: list[tuple[ParamSlot, torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (slot, host buffer, device gradient) of the batch: asynchronously wherever
        the model has a d2h stream (on CUDA; on the CPU only with the tests' lagging streams,
        tests/lazy_streams.py, which check this path there), after the compute that made the
        gradients, with one event for all (one `_foreach_copy_` on the CPU)."""
        streams = self._streams
        slots, bufs, grads = (list(column) for column in zip(*batch, strict=True))
        first = grads[0]
        if not (first.is_cuda or streams.lagging):
            torch._foreach_copy_(bufs, grads)
            return
        d2h = streams.d2h()
        streams.wait(d2h, streams.record(torch.cuda.current_stream(first.device) if first.is_cuda
                                         else streams.compute()))
        with streams.on(d2h):
            for buf, grad in zip(bufs, grads, strict=True):
                buf.copy_(grad, non_blocking=True)
        landed = self.last = streams.record(d2h)
        for slot, grad in zip(slots, grads, strict=True):
            slot.last_d2h = landed
            scope = scope_of(slot)
            scope.grads_offloaded = landed  # the d2h stream is in order
            self.inflight.append((scope, landed, grad))

    def flush(self, keep: Scope | None = None) -> None:
        """Let compute wait for finished scopes' d2h copies, then drop the device grads (their
        memory returns to the allocator, ordered after the copies)."""
        if not self.inflight:
            return
        compute = self._streams.compute()
        kept = []
        for scope, event, grad in self.inflight:
            if scope is keep:
                kept.append((scope, event, grad))
            else:
                self._streams.wait(compute, event)
        self.inflight = kept

    def wait(self) -> None:
        """The host waits for every copy issued."""
        if self.last is not None:
            self.last.synchronize()

    def forget(self) -> None:
        """The backward is over: the device gradients go (compute waited for their copies, or
        the host did)."""
        self.inflight.clear()
        self.last = None


def destination(slot: ParamSlot, current: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Where this backward's gradient for the slot goes, and whether it adds to what is
    there: into `p.grad` (`current`, read once its deferred step was done: Note [deferred
    steps]) when it exists (accumulation, in place, as PyTorch does), else the slot's pinned
    buffer from earlier steps, unless the user still holds a tensor on it (after
    `zero_grad(set_to_none=True)` a kept gradient must keep its values): then a new one."""
    if current is not None:
        return current, True
    # `p.grad` is None: a fetched old gradient is stale, and its reference to the previous
    # `p.grad` must not count as the user's below.
    if slot.old_grad is not None:
        slot.scope.take_old_grad(slot)
    slot.host_grad = None  # ours: a `p.grad` the user kept is now held by the user only
    buffer = slot.grad_buffer
    # storage_uses, without the storage object (Note [one gradient's host work] in engine/grads.py)
    if buffer is None or torch._C._storage_Use_Count(slot.grad_storage) != slot.grad_buffer_uses:
        return new_host_grad(slot), False
    return buffer.detach(), False


def publish(slots: list[ParamSlot]) -> None:
    """Point each parameter's `.grad` at its completed host gradient, then run the user's
    post-accumulate-grad hooks (all grads first, as autograd would have them)."""
    without_subclass_dispatch(set_grads, slots, [slot.host_grad for slot in slots])
    for slot in slots:
        for hook in slot.post_hooks.values():
            hook(slot.param)


def set_grads(slots: list[ParamSlot], grads: list[torch.Tensor | None]) -> None:
    """`slot.param.grad = grad` on the masters; call with subclass dispatch off. (TensorBase's
    setter, not OffloadedParameter's Python property, which would call it.)"""
    for slot, grad in zip(slots, grads, strict=True):
        _SET_GRAD(slot.param, grad)


def new_host_grad(slot: ParamSlot) -> torch.Tensor:
    """A new pinned gradient buffer for the slot (kept and reused while only offtensor holds a
    tensor on it); returns the tensor that becomes `p.grad`."""
    meta = slot.meta  # not the parameter's own properties (Note [metadata without dispatch])
    nbytes = meta.numel * meta.dtype.itemsize
    # Pageable once page-locking failed (Note [page-locked memory as a bounded resource] in storage/memory.py).
    raw = slot.scope.new_host_memory(nbytes, "gradients")
    # Kept shaped and typed (shape: not the parameter's own, Note [metadata without dispatch]).
    # Sliced to the gradient's bytes: a zero-size parameter's buffer still has one byte
    # (host_empty allocates at least one), which no dtype wider than a byte can view.
    slot.grad_buffer = raw[:nbytes].view(meta.dtype).view(meta.shape)
    del raw  # counted without it: only the buffer stays
    slot.grad_buffer_uses = storage_uses(slot.grad_buffer)
    slot.grad_storage = slot.grad_buffer.untyped_storage()._cdata  # alive while grad_buffer is
    return slot.grad_buffer.detach()


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors share `t`'s storage. Counted exactly by the storage itself (not a
    Python reference count): while it equals the count taken when the buffer was allocated,
    no tensor on the buffer exists outside offtensor (`p.grad` the user kept, a view of it)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
