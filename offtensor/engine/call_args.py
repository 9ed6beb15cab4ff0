"""The tensors of a scope's call: its inputs and outputs as the hooks find them (`tensors`), and
the gradient hooks placed on them (`on_grad`)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import torch
import torch.utils._pytree as _pytree

from ..dispatch.ops import SCALAR_TYPES

# Note [hooks on a call's inputs and outputs]
# Each call of a scope hooks every input and output that requires grad (Note [backward
# triggers]), and never removes those hooks: they go with the tensors. `Tensor.register_hook`
# makes a RemovableHandle for each, most of its cost; so for a plain tensor `on_grad` does what
# it does without the handle: the tensor's hook dict, registered with its
# grad_fn when first made, and the hook under a key of its own, negative so that no handle's id
# (counting up from 0) can meet it. A tensor subclass keeps `register_hook` (its
# `__torch_function__` may have its own say).
_HOOK_KEYS = itertools.count(-1, -1)


def on_grad(t: torch.Tensor, hook: Any) -> None:
    """`t.register_hook(hook)` for good (Note [hooks on a call's inputs and outputs])."""
    if type(t) is not torch.Tensor:
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = OrderedDict()
        grad_fn = t.grad_fn
        if grad_fn is not None:
            grad_fn._register_hook_dict(t)
    hooks[next(_HOOK_KEYS)] = hook


def call_tensors(*trees: Any) -> list[torch.Tensor]:
    """The tensors in `trees`, as pytree finds them: a module's inputs or outputs. Tuples,
    lists and dicts are walked here (a decoder layer's kwargs: a few dozen objects at each call,
    where tree_flatten costs ~20 us); other containers pytree knows (ModelOutput) by pytree."""
    found: list[torch.Tensor] = []
    _collect(trees, found)
    return found


def _collect(tree: Any, found: list[torch.Tensor]) -> None:
    kind = type(tree)
    if kind is tuple or kind is list or kind is dict:
        for x in (tree.values() if kind is dict else tree):
            # Plain tensors and flags without a call each: a decoder layer's arguments, at each call
            sort = type(x)
            if sort is torch.Tensor:
                found.append(x)
            elif sort not in SCALAR_TYPES:
                _collect(x, found)
    elif isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, tuple):  # a namedtuple, torch.return_types: pytree takes their fields
        for x in tree:
            _collect(x, found)
    elif kind in _pytree.SUPPORTED_NODES:
        leaves, _ = _pytree.tree_flatten(tree)
        found.extend(t for t in leaves if isinstance(t, torch.Tensor))
