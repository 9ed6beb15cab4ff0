"""The existing host gradients of a scope's parameters, fetched to the device so that a backward
adds to them there (gradient accumulation).

# Note [stale gradient fetches]
When a backward will add to an existing `p.grad`, the old host gradient is fetched to the device
together with the scope's weights (`OldGrads.fetch`), once backward has started (its
pre_backward, or a prefetch in backward). Not before: the prefetch for backward at the end of
the forward loads weights only, because between forward and backward the user may change
`p.grad` in ways no check can see: `p.grad.data.zero_()` or `p.grad.data.mul_(s)` write through
a tensor with a version counter of its own, and backward added to the gradient as it was before
the write. Writes that can still come after a fetch (`optimizer.zero_grad()` in a hook, or
before the next backward when an interrupted one left a kept scope's fetch behind) are caught as
far as possible: each fetch remembers the tensor it copied and that tensor's version counter,
and `take` uses the fetched copy only if `p.grad` is still that tensor, unwritten since;
otherwise the gradient path reads `p.grad` as it is now (or starts afresh when it is None). A
fetch that no gradient takes (a parameter the forward did not use, or one unfrozen since it) is
freed at the end of the backward (`Engine.end_backward`, `OldGrads.drop`), not only at the
release: a kept or carried scope outlives the backward and would hold it beyond the budget. A
frozen parameter's `p.grad` is not fetched at all: the gradient path drops what such a parameter
gets (Note [frozen since the forward] in engine/grads.py).
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch

from ..dispatch.masters import master_grad, master_requires_grad
from ..dispatch.slot import ParamSlot
from .loading import Traffic
from .streams import Streams

_disabled: Any = torch._C._disabled_torch_function_impl  # (fn, types, args), typed loosely
_GRAD_OF = torch._C.TensorBase.grad.__get__  # type: ignore[union-attr]
_FETCHED = operator.attrgetter("old_grad_source")  # set with old_grad, the source first
_is_not = operator.is_not


class OldGrads:
    """The fetches of one scope's existing host gradients and the event that follows them."""

    def __init__(self, streams: Streams, slots: list[ParamSlot], traffic: Traffic) -> None:
        self.streams = streams
        self.slots = slots  # the scope's (the same list)
        self.traffic = traffic  # the scope's counters
        self.ready: Any = None  # event on the copy stream after the fetch's copies
        self._params: tuple[torch.Tensor, ...] | None = None  # the slots' parameters, for to_fetch

    def to_fetch(self) -> list[tuple[ParamSlot, torch.Tensor]]:
        """(slot, its host `p.grad`) for each parameter whose existing gradient is not fetched
        yet and not already added to in this backward; not a sparse one, which is added to on
        the host (Note [sparse gradients] in engine/rare_grads.py), nor one of a frozen parameter, which
        gets no gradient to add to it (Note [stale gradient fetches])."""
        # `.grad` first: after zero_grad(set_to_none=True), the common case, it alone decides.
        # Asked at each backward of each scope and for the kept scopes a prefetch looks at: the
        # master's `.grad` is read in C unless a deferred step must be waited for first.
        if self.none_held():
            return []
        todo = []
        for slot in self.slots:
            if slot.old_grad is not None or slot.grads_in_backward:
                continue
            p = slot.param
            g = _disabled(_GRAD_OF, (), (p,)) if slot.pending_step is None else master_grad(p)
            if g is not None and master_requires_grad(p) and g.layout == torch.strided:
                todo.append((slot, g))
        return todo

    def none_held(self) -> bool:
        """No parameter of the scope has a `p.grad` (zero_grad's set_to_none), read in one `map`.
        A deferred step, which master_grad would wait for, creates no gradient."""
        if self._params is None or len(self._params) != len(self.slots):
            self._params = tuple(slot.param for slot in self.slots)
        grads = _disabled(list, (), (map(_GRAD_OF, self._params),))  # off in C (Note [interrupts])
        return grads.count(None) == len(grads)

    def nbytes(self) -> int:
        """Bytes a fetch would copy now."""
        return sum(g.nbytes for _, g in self.to_fetch())

    def held_bytes(self) -> int:
        """Device bytes of the fetched gradients not taken yet."""
        return sum(s.old_grad.nbytes for s in self.slots if s.old_grad is not None)

    def fetch(self, device: torch.device) -> None:
        """Copy the gradients to fetch to `device` on the copy stream, after compute's work so far."""
        todo = self.to_fetch()
        if not todo:
            return
        streams = self.streams
        compute, h2d = streams.compute(), streams.h2d()
        fetched = [(slot, g, torch.empty(g.shape, dtype=g.dtype, device=device)) for slot, g in todo]
        streams.wait(h2d, streams.record(compute))
        with streams.on(h2d):
            for _, g, old in fetched:
                old.copy_(g, non_blocking=True)
                self.traffic.bytes_to_device += g.nbytes
        self.ready = ready = streams.record(h2d)
        streams.reads_masters(ready)
        # Only now, and the source before the copy: an interrupt between two statements (Note
        # [interrupts]) must not leave a slot with a copy that `ready` does not cover, or a
        # copy without the source `take` checks it against. A kept scope keeps both across an
        # interrupted backward into the next one.
        for slot, g, old in fetched:
            slot.old_grad_source = (g, g._version)
            slot.old_grad = old

    def drop(self) -> None:
        """Free the fetched gradients no gradient took, after their copies: the end of a
        backward that leaves the scope resident, or its release (Note [stale gradient fetches])."""
        if self.ready is None and not any(map(_is_not, map(_FETCHED, self.slots), repeat(None))):
            return  # nothing fetched (asked in C: for every kept scope at each backward's end)
        streams = self.streams
        streams.wait(streams.compute(), self.ready)
        if self.ready is not None and any(s.old_grad_source is not None for s in self.slots):
            self.ready.synchronize()  # unused fetches: their host sources may go below
        self.ready = None
        for slot in self.slots:
            slot.old_grad = slot.old_grad_source = None

    def take(self, slot: ParamSlot) -> torch.Tensor | None:
        """The device copy of `p.grad` fetched with the scope's weights, if `p.grad` is still
        that tensor with the values copied (Note [stale gradient fetches])."""
        g = slot.old_grad
        if g is None:
            return None
        slot.old_grad = None
        assert slot.old_grad_source is not None  # set together with old_grad
        source, version = slot.old_grad_source
        slot.old_grad_source = None
        if master_grad(slot.param) is not source or source._version != version:
            # zero_grad() (or any write to p.grad) since the fetch: it is stale. The copy may
            # still be reading `source` and writing `g`; both may go once it is done (rare).
            if self.ready is not None:
                self.ready.synchronize()
            return None
        self.streams.wait(self.streams.compute(), self.ready)
        return g
