"""Autograd's extension points around a wrapped model: custom `torch.autograd.Function`s given
parameters, forward-mode AD, module backward hooks, selective activation checkpointing.

Each test runs the same steps on the unwrapped reference and on the offloaded model (under
MasterGuard, so that an op reading a host master fails on the CPU as it would on CUDA) and
compares outputs, gradients and weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    reference_then_offload,
    tolerances,
)
from master_guard import MasterGuard
from torch import nn

import offtensor

CHECKPOINTING = [None, "reentrant", "non_reentrant"]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 16), torch.randn(4, 16)) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Custom autograd.Functions
# --------------------------------------------------------------------------------------------


class _Linear(torch.autograd.Function):
    """A linear layer as a custom Function that saves its weight (apex's fused layers, Liger's
    fused linear cross-entropy and unsloth's LoRA kernels are built like this)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, grad.sum(0)


class _FunctionBlock(nn.Module):
    def __init__(self, hidden: int = 16, checkpoint: str | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.checkpoint = checkpoint

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(_Linear.apply(x, self.fc.weight, self.fc.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint is None:
            return self._forward(x)
        return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=self.checkpoint == "reentrant")


class _FunctionModel(nn.Module):
    def __init__(self, checkpoint: str | None = None) -> None:
        super().__init__()
        self.input = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(_FunctionBlock(checkpoint=checkpoint) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
def test_custom_function_given_parameters_trains_like_unwrapped(checkpoint, overlapped):
    """Regression: `Function.apply` does not reach `__torch_function__`, so a custom Function
    got the host masters: its gradient went to the master by autograd's own accumulation,
    past offtensor's gradient path (a `register_hook` on the parameter never ran: here it
    doubles the gradient; on CUDA, autograd refused a device gradient for a host parameter),
    and under non-reentrant checkpointing its backward computed with the saved master."""
    model = _FunctionModel(checkpoint)
    reference = reference_then_offload(model, "cpu")
    for m in (reference, model):
        m.blocks[1].fc.weight.register_hook(lambda g: 2 * g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in _batches(3):
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        with MasterGuard(model):
            loss = F.mse_loss(model(x), y)
            if not overlapped:
                loss.backward()
        if overlapped:
            offtensor.backward_and_step(loss, opt)
            offtensor.wait_for_steps()
        torch.testing.assert_close(loss, ref_loss, **tolerances("cpu"))
        assert_grads_match(model, reference, **tolerances("cpu"))
        if not overlapped:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tolerances("cpu"))
