"""Gradients with respect to an offloaded parameter: `torch.autograd.grad(loss, params)`,
`loss.backward(inputs=params)`, and the user's gradient hooks on a parameter.

Code here is handed the offloaded parameters among the call's arguments by
`OffloadedParameter.__torch_function__` (dispatch/param.py, above), as `offloaded`, the set of
their ids; it never tests for the class.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .masters import without_subclass_dispatch
from .slot import ParamSlot

# Note [gradients with respect to a parameter]
# `torch.autograd.grad(loss, params)` and `loss.backward(inputs=params)` name the parameters
# whose gradients to compute, but autograd's graph never holds an offloaded parameter: it holds
# the tensors ops got instead (Note [dispatch of an offloaded parameter]): the scope's device
# copy, device copies retired by a create_graph backward, temporary copies made for ops outside
# the scope (`ParamSlot.graph_leaves`). Given the master, autograd would find it unused. So both
# come here (torch dispatches them to `__torch_function__` when an input is a subclass), and each
# offloaded input is replaced by those leaves:
# - `grad` asks for every leaf (allow_unused: most are not in this graph), sums each parameter's
#   and returns it as `p.grad` is, on the host in the master's dtype (differentiable under
#   create_graph); an input no leaf of which got a gradient is unused, as torch treats it.
# - `backward(inputs=...)` accumulates into the leaves, whose gradients take the usual path to
#   the host `p.grad` (Note [gradient path] in engine/grads.py); other parameters' are left alone.
# A parameter with no such leaf (frozen, or in no graph yet) is passed as a plain alias of its
# master. These two run with subclass dispatch on: a checkpoint's recompute runs the model's
# forward inside them, and its ops must get device copies. Nothing offloaded is left among the
# arguments they pass on, so torch does not dispatch back here. `torch.autograd.backward` reaches
# `__torch_function__` only in releases with pytorch/pytorch#171473 (docs/design.md, Limits).


def _leaves_for(inputs: Any, offloaded: set[int]) -> tuple[list[Any], list[int]]:
    """Autograd's inputs with each offloaded parameter replaced by its graph leaves (a plain
    alias of its master when it has none), and how many entries each input became."""
    expanded: list[Any] = []
    counts: list[int] = []
    for t in inputs:
        slot = getattr(t, "_ot", None) if id(t) in offloaded else None
        leaves = slot.graph_leaves() if slot is not None and t.requires_grad else []
        expanded.extend(leaves or [_plain(t, offloaded)])
        counts.append(len(leaves) or 1)
    return expanded, counts


def _plain(t: Any, offloaded: set[int]) -> Any:
    """An offloaded parameter as a plain tensor over its master (same requires_grad); anything
    else as it is."""
    if id(t) not in offloaded:
        return t
    alias = without_subclass_dispatch(torch.Tensor.detach, t)
    return alias.requires_grad_(True) if without_subclass_dispatch(lambda p: p.requires_grad, t) else alias


def _plain_all(tensors: Any, offloaded: set[int]) -> Any:
    """`_plain` of each of a list or tuple of tensors (as a list), or of one tensor."""
    return [_plain(t, offloaded) for t in tensors] if isinstance(tensors, (list, tuple)) else _plain(tensors, offloaded)


def autograd_grad(offloaded: set[int], outputs: Any, inputs: Any, grad_outputs: Any = None,
                  retain_graph: bool | None = None, create_graph: bool = False, only_inputs: bool = True,
                  allow_unused: bool | None = None, is_grads_batched: bool = False,
                  materialize_grads: bool = False) -> tuple:
    """`torch.autograd.grad` with offloaded parameters among `inputs` (Note [gradients with
    respect to a parameter])."""
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    expanded, counts = _leaves_for(inputs, offloaded)
    outputs = _plain_all(outputs, offloaded)
    grads = torch.autograd.grad(outputs, expanded, grad_outputs=grad_outputs, retain_graph=retain_graph,
                                create_graph=create_graph, allow_unused=True,
                                is_grads_batched=is_grads_batched)
    if allow_unused is None:
        allow_unused = materialize_grads
    result: list[torch.Tensor | None] = []
    start = 0
    for i, (t, n) in enumerate(zip(inputs, counts, strict=True)):
        found = [g for g in grads[start : start + n] if g is not None]
        start += n
        g: torch.Tensor | None = None
        if found:
            g = functools.reduce(torch.add, found)
            if id(t) in offloaded:  # as `p.grad`: on the host, the master's dtype
                # The graph's leaves are device copies, which carry no user hook: run the
                # parameter's own on the sum, as autograd runs a plain leaf's.
                slot = getattr(t, "_ot", None)
                if slot is not None:
                    g = run_grad_hooks(slot, g)
                g = g.to(device=t.device, dtype=t.dtype)
        elif materialize_grads:
            g = torch.zeros_like(t)
        elif not allow_unused:
            what = f" (offloaded parameter {t._ot.name!r})" if getattr(t, "_ot", None) is not None else ""
            raise RuntimeError(
                f"The differentiated Tensor at index {i}{what} appears to not have been used in "
                "the graph. Set allow_unused=True if this is the desired behavior."
            )
        result.append(g)
    return tuple(result)


def run_grad_hooks(slot: ParamSlot, grad: torch.Tensor) -> torch.Tensor:
    """The user's `register_hook` hooks of an offloaded parameter on one gradient of it, in
    registration order; a hook returning None keeps the gradient it got (Note [user gradient
    hooks])."""
    for hook in slot.grad_hooks.values():
        out = hook(grad)
        if out is not None:
            grad = out
    return grad


def autograd_backward(offloaded: set[int], tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                      create_graph: bool = False, inputs: Any = None, **kwargs: Any) -> None:
    """`torch.autograd.backward` (`loss.backward(inputs=...)`) with offloaded parameters among
    `inputs` (Note [gradients with respect to a parameter])."""
    if inputs is not None:
        inputs = _leaves_for(tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,), offloaded)[0]
    tensors = _plain_all(tensors, offloaded)
    torch.autograd.backward(tensors, grad_tensors=grad_tensors, retain_graph=retain_graph,
                            create_graph=create_graph, inputs=inputs, **kwargs)


# Note [user gradient hooks]
# The device copy, not the master, is what autograd differentiates, so hooks registered on the
# master would never fire. We keep them on the ParamSlot and call them from the gradient path
# (engine/grads.py): `register_hook` hooks see each backward contribution (on
# the device, before accumulation), post-accumulate-grad hooks see the parameter once its host
# `.grad` is complete, at the end of backward. `torch.autograd.grad` over an offloaded
# parameter runs its `register_hook` hooks on the sum of its leaves' gradients and returns what
# they give (`autograd_grad`), as for a plain leaf; it runs no post-accumulate-grad hook.
def hook_registrar(table: str, plain: Any) -> Any:
    """`Tensor.register_*hook` for an offloaded parameter: keeps the hook in the slot's
    `table` (see Note [user gradient hooks]); `plain` for a parameter outside offtensor."""

    def register(p: torch.Tensor, hook: Any) -> RemovableHandle:
        slot = getattr(p, "_ot", None)
        if slot is None:
            return plain(p, hook)
        hooks = getattr(slot, table)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        if table == "grad_hooks":
            slot.hook_at_once()
        return handle

    return register


# Note [gradient hooks registered before wrap]
# Hooks a parameter had when it was wrapped (a framework that registers them at setup, an
# optimizer-in-backward's post-accumulate-grad hooks) sit on the master, whose AccumulateGrad
# never runs once it is offloaded: left there, they would never fire, and the gradients they
# change would silently differ from the plain model's. So wrap moves them to the slot
# (`take_tensor_hooks`), keeping each table's dict itself: the RemovableHandles the user holds
# refer to it, and remove from it as before. The `register_hook` dict is detached from the
# master (setting `_backward_hooks` to None clears its hooks in C); the post-accumulate-grad dict
# stays registered there too, inert while the master is offloaded. Unwrap puts both back on the
# parameter (`give_back_tensor_hooks`), with the hooks registered while it was wrapped.


def take_tensor_hooks(p: torch.Tensor) -> tuple[Any, Any]:
    """The `register_hook` and post-accumulate-grad hook dicts of a plain parameter about to be
    offloaded, taken off it (Note [gradient hooks registered before wrap])."""
    grad_hooks, post_hooks = p._backward_hooks, p._post_accumulate_grad_hooks
    if grad_hooks is not None:
        p._backward_hooks = None  # type: ignore[assignment]
    return grad_hooks, post_hooks


def give_back_tensor_hooks(p: torch.Tensor, slot: ParamSlot) -> None:
    """The slot's hooks onto its parameter, made plain again by unwrap (subclass dispatch off)."""
    if slot.grad_hooks:
        p._backward_hooks = slot.grad_hooks  # type: ignore[assignment]
    if slot.post_hooks:
        p._post_accumulate_grad_hooks = slot.post_hooks  # type: ignore[assignment]


REGISTRARS = {
    torch.Tensor.register_post_accumulate_grad_hook: hook_registrar(
        "post_hooks", torch.Tensor.register_post_accumulate_grad_hook
    ),
    torch.Tensor.register_hook: hook_registrar("grad_hooks", torch.Tensor.register_hook),
}
# Called with the ids of the offloaded parameters among the arguments, then the call's own.
AUTOGRAD_ENTRIES = {torch.autograd.grad: autograd_grad, torch.autograd.backward: autograd_backward}
