"""`host-overhead`'s LoRA row: the model frozen, rank-4 peft LoRA adapters on its attention's
q/k/v projections, gradient checkpointing per block; a step trains the adapters alone.

Every peer copies one LoRA base, so all start from the same adapter weights. peft initialises
lora_B to zero, which leaves lora_A without a gradient; the base fills lora_B with small seeded
values instead, so both get one. offtensor's peers offload the frozen parameters only
(`Policy(param_filter=offtensor.frozen_only)`): the adapters stay ordinary parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

RANK = 4
B_SCALE = 0.01  # lora_B's seeded values: the adapters change the output without dominating it
# Peers the row leaves out, and why.
NOT_APPLICABLE = {"fp8": "not applicable: its frozen fp8 copy is for the no-grad rows",
                  "accelerate": "not applicable: keeps no grads (its hooks replace the blocks' parameters, "
                                "the adapters among them)"}


def lora_base(base: nn.Module, targets: Sequence[str], checkpointing: Callable[[nn.Module], None]) -> nn.Module:
    """A frozen copy of `base` with rank-4 LoRA adapters on the modules named `targets` (the
    same weights at each call), `checkpointing` applied, in training mode: transformers
    checkpoints only then."""
    import peft

    model = copy.deepcopy(base).requires_grad_(False)
    torch.manual_seed(2)  # lora_A's initialisation
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, target_modules=list(targets)), model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * B_SCALE)
    checkpointing(model)
    return model.train()


def diffusers_checkpointing(model: nn.Module) -> None:
    """A diffusers model's checkpointing of each transformer block."""
    cast(Any, model).enable_gradient_checkpointing()


def transformers_checkpointing(model: nn.Module) -> None:
    """A transformers model's non-reentrant checkpointing of each decoder layer.
    `activation_checkpointing_enable` where transformers has it (5.x, where the older
    `gradient_checkpointing_enable` is a deprecated alias that warns), else the older name."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        cast(Any, model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
