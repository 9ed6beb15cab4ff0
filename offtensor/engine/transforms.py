"""The engine's entry points run outside torch.func transforms and make_fx tracing.

# Note [torch.func transforms]
Under `torch.func.grad`/`vjp`/`jacrev`/`vmap` every op, offtensor's own copies included, goes
through the transform, which refuses in-place writes into tensors captured from outside it (the
device buffers a load writes). The engine's entry points (the hooks and `materialize`) therefore
run with the transforms disabled: loads, releases and gradient fetches are bookkeeping of plain
tensors, invisible to the transform, while the model's ops still run under it on the device
copies, which the transform sees as captured constants. With `functional_call` over the
parameters, the device copies are simply not used.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..dispatch import compile as _compile


def outside_transforms(method: Any) -> Any:
    """Run an engine entry point outside torch.func transforms (Note [torch.func transforms])
    and untraced by make_fx (Note [tracing with make_fx] in dispatch/compile.py)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _compile.tracing():
            return _compile.untraced(run, *args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is None:  # no transform: nothing to do
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return run
