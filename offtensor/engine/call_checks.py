"""What a scope's call checks before anything runs: its inputs on the compute device, and no
data-parallel wrapper around it or in place of its parameters."""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import wrapper_guards as _distributed
from ..dispatch.slot import ParamSlot
from ..scopes.scope import Scope
from .engine import Engine, ModelForward

Home = tuple[dict[str, Any], str, ParamSlot]  # (module._parameters, key, slot): where a parameter is registered


def check_distributed(scope: Scope, engine: Engine, homes: list[Home]) -> None:
    """A process group exists: refuse DDP around a scope called outside the wrapped model's
    forward (Engine.begin_forward checks inside it), and fully_shard having replaced the scope's
    parameters, registered at `homes` at wrap (Note [data-parallel wrappers] in dispatch/wrapper_guards.py)."""
    if engine.model_forward is ModelForward.OUTSIDE:
        _distributed.check_ddp_forward(f"scope {scope.name!r}")
    for params, key, slot in homes:
        if params.get(key) is not slot.param:
            raise _distributed.replaced_error(slot.name, scope.name, params.get(key))


def check_inputs(scope: Scope, device: torch.device, inputs: list[torch.Tensor]) -> None:
    """Each input of a scope's call is on its compute `device` (a 0-d CPU tensor aside)."""
    for i, t in enumerate(inputs):
        if t.device != device and not (t.device.type == "cpu" and t.dim() == 0):
            raise RuntimeError(
                f"offtensor: input tensor {i} of scope {scope.name!r} "
                f"(shape {tuple(t.shape)}, {t.dtype}) is on {t.device}, but the scope "
                f"computes on {device}; move inputs with .to({str(device)!r}) (and "
                "the model's unwrapped parts with model.to(...); offloaded parameters stay "
                "on the host)"
            )
