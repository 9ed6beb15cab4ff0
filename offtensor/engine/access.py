"""What an op on an offloaded parameter gets (Note [dispatch of an offloaded parameter] in
dispatch/param.py): the scope's device copy while the scope computes, else a temporary copy on
the op's device, or nothing (the op acts on the host master)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..api import ScopeState
from ..dispatch.slot import ParamSlot, in_backward
from ..scopes.scope import Scope, scope_of
from .transforms import outside_transforms


class OpAccess:
    """Answers `materialize` for the offloaded parameters of one wrapped model."""

    def __init__(self, device: torch.device, computing: Callable[[], bool]) -> None:
        """`computing`: in a forward of the wrapped model or of a scope (a recompute in backward
        included), where ops compute on the device."""
        self.device = device
        self._computing = computing
        # The scope whose backward runs now (Engine.pre_backward to post_backward). A checkpoint
        # recompute that does not pass through the module's hooks (a checkpointed `forward` with
        # the hooks outside it) still uses this scope's device copy.
        self.backward_scope: Scope | None = None

    @outside_transforms
    def materialize(self, slot: ParamSlot, op_device: torch.device | None) -> torch.Tensor | None:
        """The tensor an op on `slot`'s parameter computes with; None: the host master.
        `op_device`: the device of the op's other tensors, None if it has none."""
        ready = slot.ready_copy()
        if ready is not None:
            return ready
        scope = scope_of(slot)
        if scope.calls.running > 0 or scope is self.backward_scope:
            if scope.state is not ScopeState.RESIDENT:
                scope.make_resident(upto=slot)
            if scope.writes.written_in_this_call(slot):  # Note [writes during a scope's call] (write_tracking.py)
                scope.refresh(slot)
            if scope.copy_order is None and not in_backward():
                scope.first_uses.setdefault(slot, None)
            return slot.use_device_copy()
        p = slot.param
        needs_grad = torch.is_grad_enabled() and p.requires_grad
        if op_device is None:
            if self._computing():
                # Read by another module's forward (Mamba's mixer reads `conv1d.weight` of a
                # child whose forward never runs), or with no device tensor among the op's
                # arguments (`w.T`, `w.view(...)`): the device copy, not the host master. Not in
                # the rest of backward: a user's gradient hook (an optimizer step in a
                # post-accumulate-grad hook) acts on the host master.
                op_device = self.device
            elif not needs_grad:
                return None  # act on the host master
        return scope.temporary_copy(slot, op_device, needs_grad)
