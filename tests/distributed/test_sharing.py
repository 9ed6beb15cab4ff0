"""Frozen parameters, buffers, tied and shared weights, partially wrapped models: each keeps its
meaning under offloading.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_grads_match,
    assert_params_match,
    assert_trains_like,
    batchnorm_model,
    devices,
    mlp_of_blocks,
    only_blocks,
    random_batch,
    reference_then_offload,
    scope_states,
    tied_lm,
    tied_lm_predicate,
    tolerances,
    train_adamw,
)
from torch import nn

import offtensor

# --------------------------------------------------------------------------------------------
# Frozen parameters, buffers, sharing, partial wrapping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
@pytest.mark.parametrize("device", devices)
def test_frozen_parameters_get_no_grad(device, when):
    def freeze(m: nn.Module) -> None:
        m.blocks[0].requires_grad_(False)  # a whole scope
        m.blocks[1].fc1.weight.requires_grad_(False)  # one parameter of a scope

    model = mlp_of_blocks()
    if when == "before_wrap":
        freeze(model)
    reference = reference_then_offload(model, device)
    if when == "after_wrap":
        freeze(model)
        freeze(reference)
    batches = [random_batch(device) for _ in range(3)]

    assert_trains_like(model, reference, batches, device, grads=True)

    assert model.blocks[0].fc1.weight.grad is None
    assert model.blocks[1].fc1.weight.grad is None
    assert not model.blocks[1].fc1.weight.requires_grad
    assert model.input.weight.grad is not None, "grads must still flow through a frozen scope"


@pytest.mark.parametrize("device", devices)
def test_batchnorm_running_stats_update_in_training_like_unwrapped_model(device):
    model = batchnorm_model()
    reference = reference_then_offload(model, device)
    batches = [random_batch(device, n=8) for _ in range(3)]
    x, _ = random_batch(device, n=8)

    expected_losses = train_adamw(reference, batches)
    reference.eval()
    with torch.no_grad():
        expected = reference(x)
    losses = train_adamw(model, batches)
    model.eval()
    with torch.no_grad():
        out = model(x)

    assert int(model.blocks[0].bn.num_batches_tracked) == 3
    assert model.blocks[0].bn.running_mean.device.type == device
    torch.testing.assert_close(losses, expected_losses, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))  # includes the running stats
    torch.testing.assert_close(out, expected, **tolerances(device))


@pytest.mark.parametrize("tied_side", ["head_in_block", "embedding_selected"])
@pytest.mark.parametrize("device", devices)
def test_tied_embedding_and_head_train_like_unwrapped_model(device, tied_side):
    model = tied_lm(tied_side)
    reference = reference_then_offload(model, device, tied_lm_predicate(tied_side))
    tokens = [torch.randint(0, 32, (2, 6)).to(device) for _ in range(3)]

    def next_token_loss(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(t)[:, :-1].flatten(0, 1), t[:, 1:].flatten())

    expected = train_adamw(reference, tokens, loss_fn=next_token_loss)
    losses = train_adamw(model, tokens, loss_fn=next_token_loss)

    shared = model.embed.weight
    other = model.blocks[-1].proj.weight if tied_side == "head_in_block" else model.head.weight
    assert other is shared, "wrap must keep the two modules sharing one Parameter"
    assert isinstance(shared, offtensor.OffloadedParameter)
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_parameter_shared_by_two_scopes_trains_like_unwrapped_model(device):
    model = mlp_of_blocks()
    model.blocks[2].fc1.weight = model.blocks[0].fc1.weight
    reference = reference_then_offload(model, device)
    batches = [random_batch(device) for _ in range(3)]

    assert_trains_like(model, reference, batches, device, grads=True)

    assert model.blocks[2].fc1.weight is model.blocks[0].fc1.weight


@pytest.mark.parametrize("device", devices)
def test_partially_wrapped_model_with_resident_blocks_trains_like_unwrapped_model(device):
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, device, only_blocks(0, 2))
    batches = [random_batch(device) for _ in range(3)]

    expected = train_adamw(reference, batches)
    losses = train_adamw(model, batches)

    assert list(scope_states(model)) == ["blocks.0", "blocks.2"]
    for name, p in model.named_parameters():
        if name.startswith(("blocks.0.", "blocks.2.")):
            assert isinstance(p, offtensor.OffloadedParameter), name
        else:
            assert type(p) is nn.Parameter and p.device.type == device, name
            assert p.grad.device.type == device, name
    torch.testing.assert_close(losses, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


