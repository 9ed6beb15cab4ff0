"""The host end of the gradient path (Note [gradient path] in engine/grads.py): each parameter's
pinned gradient buffer, the copies into it (Note [one pass per scope's gradients]), and `p.grad`
set on the masters.

# Note [gradients computed on the host]
With the CPU as the compute device, a device copy's gradient already lies in host memory, and
step 3 of Note [gradient path] (engine/grads.py) would copy every gradient of every backward
into the buffer, a memcpy the plain model never makes. So a gradient that is the first of its
backward for a parameter without `.grad` becomes `p.grad` itself when it has the master's dtype
and shape and is contiguous (`destination`): AccumulateGrad gives the device copy a tensor
nothing else holds (it takes the incoming gradient only when no other reference to it exists,
else a clone), as it would give a plain parameter's `.grad`, and the copy keeps none
(`_on_leaf_grad`). Further contributions add into it as into any host gradient. Not for a
parameter with `register_hook` hooks (a hook may return a tensor it keeps, which autograd would
clone before making it `.grad`), on a GPU (the copy is the transfer), under data parallelism
(the reducer averages first), nor under the tests' lagging streams, which keep the copy path
checked on the CPU.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.slot import ParamSlot
from ..scopes.scope import Scope, scope_of
from ..scopes.streams import Streams

_SET_GRAD = torch._C.TensorBase.grad.__set__  # type: ignore[union-attr]
_POST_HOOKS = operator.attrgetter("post_hooks")
_PARAM = operator.attrgetter("param")
_HOST_GRAD = operator.attrgetter("host_grad")


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
            moved = [i for i, (buf, grad) in enumerate(zip(bufs, grads, strict=True)) if buf is not grad]
            if moved:  # not the adopted ones (Note [gradients computed on the host])
                torch._foreach_copy_([bufs[i] for i in moved], [grads[i] for i in moved])
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


def destination(slot: ParamSlot, current: torch.Tensor | None, grad: torch.Tensor,
                adopt: bool) -> tuple[torch.Tensor, bool]:
    """Where this backward's gradient `grad` for the slot goes, and whether it adds to what is
    there: into `p.grad` (`current`, read once its deferred step was done: Note [deferred
    steps]) when it exists (accumulation, in place, as PyTorch does), else `grad` itself where
    it may be adopted (`adopt`: no reducer, hooks or lagging streams; Note [gradients computed
    on the host]), else the slot's pinned buffer from earlier steps, unless the user still holds a
    tensor on it (after `zero_grad(set_to_none=True)` a kept gradient must keep its values):
    then a new one."""
    if current is not None:
        return current, True
    # `p.grad` is None: a fetched old gradient is stale, and its reference to the previous
    # `p.grad` must not count as the user's below.
    if slot.old_grad is not None:
        slot.scope.take_old_grad(slot)
    slot.host_grad = None  # ours: a `p.grad` the user kept is now held by the user only
    meta = slot.meta
    if (adopt and grad.device.type == "cpu" and grad.dtype == meta.dtype and grad.shape == meta.shape
            and grad.is_contiguous()):
        return grad, False
    buffer = slot.grad_buffer
    # storage_uses, without the storage object (Note [one gradient's host work] in engine/grads.py)
    if buffer is None or torch._C._storage_Use_Count(slot.grad_storage) != slot.grad_buffer_uses:
        return new_host_grad(slot), False
    return buffer.detach(), False


def publish(slots: list[ParamSlot]) -> None:
    """Point each parameter's `.grad` at its completed host gradient, then run the user's
    post-accumulate-grad hooks (all grads first, as autograd would have them)."""
    without_subclass_dispatch(set_grads, slots, list(map(_HOST_GRAD, slots)))
    if not any(map(_POST_HOOKS, slots)):  # asked in C: none, most often
        return
    for slot in slots:
        for hook in slot.post_hooks.values():
            hook(slot.param)


def set_grads(slots: list[ParamSlot], grads: list[torch.Tensor | None]) -> None:
    """`slot.param.grad = grad` on the masters; call with subclass dispatch off. (TensorBase's
    setter, not OffloadedParameter's Python property, which would call it.)"""
    assert len(slots) == len(grads)
    any(map(_SET_GRAD, map(_PARAM, slots), grads))  # a loop in C: each setter returns None


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
