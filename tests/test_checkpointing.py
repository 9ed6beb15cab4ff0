"""Offloading composes with activation checkpointing (``torch.utils.checkpoint``).

A checkpointed block runs its forward twice: once in the forward pass and once, recomputed,
inside backward. Each run materializes the scope's weights on the device and must release
them afterwards; after backward nothing may stay resident (the seed prototype left parameters
on the GPU after backward under non-reentrant checkpointing).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    host,
    mlp_of_blocks,
    reference_then_offload,
    tolerances,
)

import offtensor

CHECKPOINTING = [
    pytest.param(None, id="no_checkpointing"),
    pytest.param("reentrant", id="reentrant"),
    pytest.param("non_reentrant", id="non_reentrant"),
]


def checkpointed_model_and_reference(device: str, checkpoint: str | None):
    model = mlp_of_blocks(n_blocks=3)
    model.checkpoint = checkpoint
    reference = reference_then_offload(model, device)
    return model, reference


def batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8).to(device), torch.randn(4, 4).to(device)


@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_outputs_and_grads_match_unwrapped_model(device, checkpoint):
    model, reference = checkpointed_model_and_reference(device, checkpoint)
    x, y = batch(device)

    expected = reference(x)
    F.mse_loss(expected, y).backward()
    out = model(x)
    F.mse_loss(out, y).backward()

    torch.testing.assert_close(out, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_five_adamw_steps_match_unwrapped_model(device, checkpoint):
    model, reference = checkpointed_model_and_reference(device, checkpoint)
    batches = [batch(device) for _ in range(5)]

    def train(m) -> torch.Tensor:
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for x, y in batches:
            optimizer.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            optimizer.step()
            losses.append(host(loss))
        return torch.stack(losses)

    expected_losses = train(reference)
    losses = train(model)

    torch.testing.assert_close(losses, expected_losses, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_no_scope_is_resident_after_backward(device, checkpoint):
    model, _ = checkpointed_model_and_reference(device, checkpoint)
    x, y = batch(device)

    for _ in range(2):  # the second step also covers state left over by the first
        F.mse_loss(model(x), y).backward()
        assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_no_scope_is_resident_after_forward(device, checkpoint):
    # Under checkpointing the forward pass must not keep weights for the recompute: they are
    # loaded again when backward reaches the block.
    model, _ = checkpointed_model_and_reference(device, checkpoint)
    x, _ = batch(device)

    out = model(x)

    assert out.requires_grad
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_checkpointed_grads_land_on_cpu_master(device, checkpoint):
    model, _ = checkpointed_model_and_reference(device, checkpoint)
    x, y = batch(device)

    F.mse_loss(model(x), y).backward()

    for name, p in model.blocks.named_parameters():
        assert isinstance(p, offtensor.OffloadedParameter), name
        assert p.grad is not None, f"blocks.{name} got no grad through the recompute"
        assert type(p.grad) is torch.Tensor, name
        assert p.grad.device == torch.device("cpu"), name
