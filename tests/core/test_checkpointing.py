"""Offloading composes with activation checkpointing (``torch.utils.checkpoint``).

A checkpointed block runs its forward twice: once in the forward pass and once, recomputed,
inside backward. Each run materializes the scope's weights on the device and must release
them afterwards; after backward nothing may stay resident (the seed prototype left parameters
on the GPU after backward under non-reentrant checkpointing).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CHECKPOINTING,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    assert_trains_like,
    devices,
    mlp_and_reference,
    mlp_of_blocks,
    random_batch,
    reference_then_offload,
    tolerances,
    train_step,
)

import offtensor


def each_device_and_checkpointing(test):
    """Parametrize ``test`` over every device and every kind of CHECKPOINTING."""
    return pytest.mark.parametrize("checkpoint", CHECKPOINTING)(pytest.mark.parametrize("device", devices)(test))


@pytest.fixture
def model_and_reference(device: str, checkpoint: str | None):
    """A 3-block MLP with ``checkpoint``, offloaded on ``device``, and its unwrapped reference."""
    model = mlp_of_blocks(n_blocks=3, checkpoint=checkpoint)
    return model, reference_then_offload(model, device)


@each_device_and_checkpointing
def test_outputs_and_grads_match_unwrapped_model(device, model_and_reference):
    model, reference = model_and_reference
    x, y = random_batch(device)

    expected = reference(x)
    F.mse_loss(expected, y).backward()
    out = model(x)
    F.mse_loss(out, y).backward()

    torch.testing.assert_close(out, expected, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))


@each_device_and_checkpointing
def test_five_adamw_steps_match_unwrapped_model(device, model_and_reference):
    model, reference = model_and_reference
    batches = [random_batch(device) for _ in range(5)]

    assert_trains_like(model, reference, batches, device, grads=True)


@each_device_and_checkpointing
def test_no_scope_is_resident_after_backward(device, model_and_reference):
    model, _ = model_and_reference
    x, y = random_batch(device)

    for _ in range(2):  # the second step also covers state left over by the first
        F.mse_loss(model(x), y).backward()
        assert_all_scopes_offloaded(model)


@each_device_and_checkpointing
def test_no_scope_is_resident_after_forward(device, model_and_reference):
    # Under checkpointing the forward pass must not keep weights for the recompute: they are
    # loaded again when backward reaches the block.
    model, _ = model_and_reference
    x, _ = random_batch(device)

    out = model(x)

    assert out.requires_grad
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("device", devices)
def test_checkpointed_grads_land_on_cpu_master(device, model_and_reference):
    model, _ = model_and_reference
    x, y = random_batch(device)

    F.mse_loss(model(x), y).backward()

    for name, p in model.blocks.named_parameters():
        assert isinstance(p, offtensor.OffloadedParameter), name
        assert p.grad is not None, f"blocks.{name} got no grad through the recompute"
        assert type(p.grad) is torch.Tensor, name
        assert p.grad.device == torch.device("cpu"), name


def _two_forwards_per_step_train_alike(model: torch.nn.Module, reference: torch.nn.Module, overlap: bool) -> None:
    """Two steps, each a loss over two forwards then one step (with backward_and_step when
    `overlap`), exactly as the unwrapped reference trains; nothing left on the device."""
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)}
    for _ in range(2):
        (x1, y1), (x2, y2) = random_batch("cpu"), random_batch("cpu")
        for m in (reference, model):
            loss = F.mse_loss(m(x1), y1) + F.mse_loss(m(x2), y2)
            train_step(loss, optimizers[id(m)], overlap=overlap and m is model)
    offtensor.wait_for_steps()
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
def test_two_forwards_of_split_checkpointed_blocks_then_one_step_match_unwrapped(checkpoint, overlap):
    # Reentrant checkpointing runs a block's forward without grad: its later child scopes (fc1,
    # fc2) got inputs that did not require grad and counted no call that could add to their
    # gradients. backward_and_step handed them to the optimizer after the second forward's
    # backward and raised at the first's contribution, at every step.
    model, reference = mlp_and_reference("cpu", split=True, checkpoint=checkpoint)
    _two_forwards_per_step_train_alike(model, reference, overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
def test_two_forwards_where_no_scope_begins_a_reentrant_region_then_one_step_match_unwrapped(overlap):
    # The blocks' Linears are the scopes and each block's norm, its first module, stays on the
    # device: every scope gets tensors computed without grad, so no call of the pass counted
    # and backward_and_step raised at the first step, a half-stepped model, until the calls
    # inside a recorded Function (reentrant checkpointing's) counted.
    model = mlp_of_blocks(checkpoint="reentrant")
    reference = copy.deepcopy(model)
    offtensor.wrap(model, lambda name, module: name.endswith(("fc1", "fc2")), device="cpu")
    _two_forwards_per_step_train_alike(model, reference, overlap)


def test_a_late_gradient_after_a_handover_at_a_scopes_end_steps_the_scope_after_backward_from_then_on(monkeypatch):
    # The case above with the counting of those fixes undone: every step, fc2's scope counts one
    # call, is handed over at the end of the second forward's backward, and the first's
    # contribution arrives later (so for fc1's scopes too). The error's remedy must hold from the
    # next step on, with the same miscount: the model's scopes are stepped after backward.
    from offtensor.scopes import grad_calls

    monkeypatch.setattr(grad_calls.GradCalls, "pass_counted", property(lambda self: False, lambda self, value: None),
                        raising=False)
    monkeypatch.setattr(grad_calls, "recorded_functions", SimpleNamespace(depth=0))
    model, reference = mlp_and_reference("cpu", split=True, checkpoint="reentrant")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [(random_batch("cpu"), random_batch("cpu")) for _ in range(4)]

    def loss_of(m, step):
        (x1, y1), (x2, y2) = batches[step]
        return F.mse_loss(m(x1), y1) + F.mse_loss(m(x2), y2)

    late = r"received another gradient.*steps this model's offloaded parameters after backward"
    with pytest.raises(RuntimeError, match=late):
        offtensor.backward_and_step(loss_of(model, 0), opt)
    offtensor.wait_for_steps()
    assert_all_scopes_offloaded(model)
    opt.zero_grad()
    reference.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its tensors, not the model's
    for step in range(1, 4):
        offtensor.backward_and_step(loss_of(model, step), opt).wait()
        loss_of(reference, step).backward()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)
