"""The gradient path's rare ways (Note [gradient path] in engine/grads.py): sparse gradients,
gradients another rank steps, and the errors the path raises.

# Note [sparse gradients]
`nn.Embedding(sparse=True)` and `nn.EmbeddingBag(sparse=True)` give a sparse COO gradient, and
a plain parameter's `p.grad` is then sparse (SparseAdam requires it; SGD and Adagrad step only
its rows). A pinned dense buffer cannot hold one (`copy_` from sparse to dense is not
implemented; densifying would change what optimizers do), so such a gradient, or any gradient
added to a sparse `p.grad`, takes another path (`accumulate_sparse`): it is copied to the host
(a blocking copy: its number of entries is known only once computed) and summed there with the
host `p.grad` the way autograd's AccumulateGrad does: kept as it is when there is none, added in
place to a dense or sparse `p.grad`, and a dense gradient added to a sparse `p.grad` makes a new
dense one. The result becomes `p.grad` at the end of backward as on the dense path. The old
gradient is never fetched to the device for it (`OldGrads.to_fetch` skips sparse ones).
Not supported with `data_parallel` (raises): sparse gradients are not averaged.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..dispatch.masters import master_grad, without_subclass_dispatch
from ..dispatch.slot import ParamSlot
from .host_grads import set_grads


def accumulate_sparse(slot: ParamSlot, grad: torch.Tensor, *, data_parallel: bool) -> bool:
    """A sparse gradient, or one added to a sparse `p.grad`: summed on the host as
    autograd's AccumulateGrad sums it (Note [sparse gradients]). True if it is the first
    contribution to the host gradient in this backward."""
    if data_parallel:
        raise RuntimeError(
            f"offtensor.data_parallel: offloaded parameter {slot.name!r} got a sparse gradient "
            "(nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True)), which is not "
            "averaged over the ranks. Use sparse=False for modules of a data-parallel model"
        )
    first = not slot.grad_written
    if first:
        slot.wait_for_step()  # a deferred step still reads p.grad (Note [deferred steps])
        slot.scope.take_old_grad(slot)  # a dense fetch is not used: the sum is made here
        current = master_grad(slot.param)
    else:
        current = slot.host_grad
    # A blocking copy: the sparse tensor's size (its nnz) is known only once it is computed.
    grad = grad.to(device="cpu", dtype=slot.param.dtype, copy=True)
    if current is None:
        current = grad
    elif current.layout != torch.strided and grad.layout == torch.strided:
        current = grad + current  # a dense sum; autograd's order of the operands
    else:
        current += grad  # into p.grad in place, dense or sparse, as autograd does
    slot.host_grad = current
    return first


class Reduces(Protocol):
    """What send_to_owner asks of the gradient path's Reducer (engine/grads.py)."""

    def reduce(self, slot: ParamSlot, grad: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor | None: ...


def send_to_owner(reducer: Reduces, slot: ParamSlot, grad: torch.Tensor) -> None:
    """Data parallel with a sharded optimizer: another rank owns this parameter's gradient.
    Send this rank's part, with what it accumulated under no_sync, and keep none: `p.grad`
    becomes None (Note [one host copy per node] in distributed/shared_masters.py)."""
    grad = grad.to(slot.param.dtype)
    current = master_grad(slot.param)
    old = slot.scope.take_old_grad(slot)
    if old is None and current is not None:
        slot.wait_for_step()
        old = current.to(grad.device)  # not non_blocking: `current` may be freed below
    reducer.reduce(slot, grad, old)
    if current is not None:
        without_subclass_dispatch(set_grads, [slot], [None])
    slot.host_grad = None


def handed_twice_error(slot: ParamSlot) -> RuntimeError:
    """A gradient for a parameter already handed to backward_and_step's worker. One handed on its
    own gradient makes its scope's next ones wait for the scope's end."""
    if slot.single_grad:
        for other in slot.scope.slots:
            other.single_grad = False
        later = "hands it over once its whole scope's backward is done"
    else:
        later = "steps this model's offloaded parameters after backward, without overlap"
    return RuntimeError(
        f"offtensor.backward_and_step: parameter {slot.name!r} received another gradient "
        "contribution after it was handed to the optimizer, which may already have "
        "stepped it on the partial gradient: this step's update of it is wrong. Its "
        "gradient came in one piece in the last backward and in several now (a module "
        "whose use changed, or reentrant checkpointing of parts of one scope). The next "
        f"backward_and_step {later}; or use loss.backward() then optimizer.step()."
    )


def graph_grad_error(slot: ParamSlot) -> RuntimeError:
    return RuntimeError(
        f"offtensor: backward(create_graph=True) would give offloaded parameter "
        f"{slot.name!r} a .grad that carries a graph, but its .grad lives on the host and "
        "cannot. For a gradient penalty, take the gradients you differentiate with "
        "torch.autograd.grad(y, inputs, create_graph=True) over tensors that are not "
        "offloaded parameters (supported), then call backward() without create_graph")
