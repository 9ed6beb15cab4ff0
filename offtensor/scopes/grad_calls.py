"""Which calls of a scope can still add to its gradients: what tells backward_and_step when a
scope's gradients are complete, so that it may hand the scope to the optimizer.

# Note [calls inside a checkpointed region]
`Scope.calls.grad_since_backward` counts the calls whose backward may add to the scope's
gradients; `backward_and_step` hands a scope's parameters to the optimizer at the end of its
backward only when it counts one (several calls give several contributions, the later ones
after the handover). Reentrant checkpointing runs its region without grad, so a call there is
told apart from a no-grad evaluation by an input that requires grad; but only the region's
first module gets the region's inputs: a scope further in (a block split into a scope per child,
the second block of a `checkpoint_sequential` segment) gets tensors computed without grad, and
with two forwards before one backward it would be handed over after the first of its two
backwards. So once a call of the pass counted, every later call of the pass counts too: a
no-grad call inside a training forward at worst makes its scope wait for the end of backward.
Where no offloaded scope is a region's first module (a block whose norm stays on the device and
whose Linears are the scopes), nothing would count at all; so a call also counts inside the
forward of a custom autograd Function that autograd records (grad on, an input that requires
grad): reentrant checkpointing's CheckpointFunction, seen through offtensor's Function.apply
(`recorded_functions`, Note [custom autograd Functions] in dispatch/function_apply.py).

# Note [calls a built graph still holds]
A backward that builds a graph (create_graph=True: `torch.autograd.grad(d_real.sum(), real,
create_graph=True)` for an R1 penalty) keeps the graph it differentiated, and the one it built
reads the scopes' device copies of that forward, retired at release (Note [higher-order
gradients] in scopes/device_buffer.py). The calls of that forward can thus still add to the gradients,
through leaves of their own, so its end leaves `calls.grad_since_backward` as it is: reset, a
second forward before the loss's backward (`d_fake = m(fake)`) would count one call per scope,
and backward_and_step would step each scope at its first contribution, before the penalty's
arrives. A graph built and dropped unused at worst makes the next backward step its scopes
after backward; the next backward that builds none resets the counts.
"""

from __future__ import annotations

import torch

from ..dispatch.function_apply import recorded_functions
from ..dispatch.masters import master_requires_grad
from .scope import Scope


def trainable(scope: Scope) -> bool:
    """A parameter of the scope requires grad. Read without dispatch: `p.requires_grad` through
    OffloadedParameter waits for the scope's deferred step, which at the end of
    backward_and_step's backward is the wait it exists to avoid."""
    return any(master_requires_grad(slot.param) for slot in scope.slots)


class GradCalls:
    """The calls of one wrapped model's scopes that can add to their gradients, per pass and
    since the last backward (Note [calls inside a checkpointed region])."""

    def __init__(self, scopes: list[Scope]) -> None:
        self.scopes = scopes
        self.pass_counted = False  # a call of the current pass can add to a gradient
        self.create_graph = False  # the backward running now builds a graph (create_graph=True)

    def count(self, scope: Scope, inputs: list[torch.Tensor]) -> None:
        """The scope's forward starts, outside backward; `inputs`: the tensors among its
        arguments. Only a call that can add to a gradient counts: grad enabled or, for the
        forward that reentrant checkpointing runs without grad, a call inside a Function that
        autograd records, an input that requires grad, or an earlier call of this pass that
        counted."""
        if self.counts(inputs):
            scope.calls.grad_call()

    def counts(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a call with these `inputs` starting now counts (`count`), noted for the
        pass if it does; the scope's own count is the caller's."""
        counts = torch.is_grad_enabled() or self.pass_counted or recorded_functions.depth
        if not counts:
            for t in inputs:  # a loop, not any(): asked at each call of a scope
                if t.requires_grad:
                    counts = True
                    break
        if counts:
            self.pass_counted = True
        return bool(counts)

    def pass_started(self) -> None:
        self.create_graph = False  # a create_graph backward that raised never reached its end
        self.pass_counted = False
        for scope in self.scopes:
            scope.calls.grad_pass_started()

    def backward_starts(self, scope: Scope, create_graph: bool) -> None:
        """The scope's backward is about to run; `create_graph`: it builds a graph of its own
        (Note [higher-order gradients] in scopes/device_buffer.py)."""
        if create_graph:
            self.create_graph = True
        if self.create_graph:
            scope.device.graph_saved = True

    def backward_ended(self) -> None:
        """The outermost backward ended."""
        for scope in self.scopes:
            scope.calls.backward_ended(keep_since=self.create_graph)  # Note [calls a built graph still holds]
        self.create_graph = False

    def pass_failed(self) -> None:
        """A forward raised: the failed pass's graph is gone, and with it what its calls counted."""
        for scope in self.scopes:
            scope.calls.grad_pass_failed()
