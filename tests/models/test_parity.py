"""An offloaded model computes exactly what the unwrapped model computes.

Outputs, gradients and whole training runs (several optimizers, accumulation, clipping,
schedulers, user hooks) are compared against a plain copy of the model made before wrapping.
On the CPU the comparison is bit-exact; on CUDA it allows a few ulps (see ``tolerances``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_grads_match,
    assert_params_match,
    devices,
    dtypes,
    host,
    mlp_of_blocks,
    offload,
    offloaded_parameters,
    reference_then_offload,
    tolerances,
    unwrapped_reference,
)
from torch import nn

import offtensor

OptimizerFactory = Callable[[object], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "adamw_foreach_false": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}


def make_batches(n: int, device: str, dtype: torch.dtype = torch.float32, batch: int = 4):
    """``n`` (input, target) pairs for :func:`mlp_of_blocks` (8 features in, 4 out)."""
    return [
        (torch.randn(batch, 8).to(device, dtype), torch.randn(batch, 4).to(device, torch.float32))
        for _ in range(n)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def train(model, optimizer, batches, scheduler=None) -> torch.Tensor:
    """One optimizer step per batch; returns the losses."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(host(loss))
    return torch.stack(losses)


@pytest.fixture
def model_and_reference(device: str, dtype: torch.dtype):
    """A 3-block MLP in ``dtype``, offloaded on ``device``, and its unwrapped reference."""
    model = mlp_of_blocks(dtype=dtype)
    return model, reference_then_offload(model, device)


# --------------------------------------------------------------------------------------------
# Forward and backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("device", devices)
def test_outputs_match_unwrapped_model_under_no_grad(device, dtype, model_and_reference):
    model, reference = model_and_reference
    x = torch.randn(4, 8).to(device, dtype)

    with torch.no_grad():
        expected = reference(x)
    with torch.no_grad():
        out = model(x)

    assert out.device == expected.device
    torch.testing.assert_close(out, expected, **tolerances(device, dtype))


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("device", devices)
def test_outputs_match_unwrapped_model_with_grad_enabled(device, dtype, model_and_reference):
    model, reference = model_and_reference
    x = torch.randn(4, 8).to(device, dtype)

    expected = reference(x)
    out = model(x)

    assert out.requires_grad
    torch.testing.assert_close(out, expected, **tolerances(device, dtype))


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("device", devices)
def test_grads_match_unwrapped_model(device, dtype, model_and_reference):
    model, reference = model_and_reference
    ((x, y),) = make_batches(1, device, dtype)

    loss_fn(reference, x, y).backward()
    loss_fn(model, x, y).backward()

    assert_grads_match(model, reference, **tolerances(device, dtype))


@pytest.mark.parametrize("device", devices)
def test_eval_mode_outputs_match_unwrapped_model(device):
    model = mlp_of_blocks().eval()
    reference = reference_then_offload(model, device)
    x = torch.randn(4, 8).to(device)

    with torch.inference_mode():
        expected = reference(x)
    with torch.inference_mode():
        out = model(x)

    torch.testing.assert_close(out, expected, **tolerances(device))


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("device", devices)
def test_five_training_steps_match_unwrapped_model(device, dtype, optimizer, model_and_reference):
    make_optimizer = OPTIMIZERS[optimizer]
    model, reference = model_and_reference
    batches = make_batches(5, device, dtype)
    tol = tolerances(device, dtype)

    expected_losses = train(reference, make_optimizer(reference.parameters()), batches)
    losses = train(model, make_optimizer(model.parameters()), batches)

    torch.testing.assert_close(losses, expected_losses, **tol)
    assert_params_match(model, reference, **tol)
    assert_grads_match(model, reference, **tol)


@pytest.mark.parametrize("device", devices)
def test_training_with_lr_scheduler_matches_unwrapped_model(device):
    def run(m: nn.Module) -> torch.Tensor:
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=5e-2, total_steps=5)
        return train(m, optimizer, batches, scheduler)

    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    batches = make_batches(5, device)

    expected_losses = run(reference)
    losses = run(model)

    torch.testing.assert_close(losses, expected_losses, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_optimizer_built_before_wrap_trains_the_offloaded_parameters(device):
    # Parameters keep their identity through wrap, so an optimizer made earlier holds the very
    # objects that are now offloaded.
    model = mlp_of_blocks()
    reference = unwrapped_reference(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {name: id(p) for name, p in model.named_parameters()}
    offload(model, device)
    batches = make_batches(5, device)

    expected_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batches)
    losses = train(model, optimizer, batches)

    assert {name: id(p) for name, p in model.named_parameters()} == before
    torch.testing.assert_close(losses, expected_losses, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("dtype", dtypes)
@pytest.mark.parametrize("device", devices)
def test_grad_accumulation_over_three_micro_batches_matches_unwrapped_model(device, dtype):
    def run(m: nn.Module) -> list[dict[str, torch.Tensor]]:
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        accumulated = []
        for step in range(2):
            for x, y in batches[3 * step : 3 * step + 3]:
                (loss_fn(m, x, y) / 3).backward()
            accumulated.append({n: host(p.grad).clone() for n, p in m.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        return accumulated

    model = mlp_of_blocks(dtype=dtype)
    reference = reference_then_offload(model, device)
    batches = make_batches(6, device, dtype)
    tol = tolerances(device, dtype)

    expected = run(reference)
    got = run(model)

    for step, (grads, expected_grads) in enumerate(zip(got, expected, strict=True)):
        for name in expected_grads:
            torch.testing.assert_close(
                grads[name],
                expected_grads[name],
                msg=lambda m, step=step, name=name: f"step {step}, {name}: {m}",
                **tol,
            )
    assert_params_match(model, reference, **tol)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_in_place"])
@pytest.mark.parametrize("device", devices)
def test_zero_grad_resets_offloaded_grads(device, set_to_none):
    def run(m: nn.Module) -> None:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        loss_fn(m, *batches[0]).backward()
        optimizer.zero_grad(set_to_none=set_to_none)
        for name, p in m.named_parameters():
            if set_to_none:
                assert p.grad is None, name
            else:
                assert p.grad is not None and not p.grad.any(), name
        loss_fn(m, *batches[1]).backward()

    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    batches = make_batches(2, device)

    run(reference)
    run(model)

    # The second backward starts from nothing (or zeros), not from the first backward's grads.
    assert_grads_match(model, reference, **tolerances(device))
    for name, p in offloaded_parameters(model):
        assert p.grad.device == torch.device("cpu"), name


@pytest.mark.parametrize("device", devices)
def test_grads_accumulate_across_backward_calls_like_unwrapped_model(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    batches = make_batches(3, device)

    for x, y in batches:
        loss_fn(reference, x, y).backward()
    for x, y in batches:
        loss_fn(model, x, y).backward()

    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_clip_grad_norm_over_resident_and_offloaded_grads_matches_unwrapped_model(device):
    # The unwrapped input/head live on `device`, the blocks' grads on the CPU: clip_grad_norm_
    # sees grads on two devices (on CUDA) and must compute the same total norm and scaling.
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    batches = make_batches(3, device)

    def run(m: nn.Module) -> torch.Tensor:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        norms = []
        for x, y in batches:
            optimizer.zero_grad()
            loss_fn(m, x, y).backward()
            norms.append(host(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)))
            optimizer.step()
        return torch.stack(norms)

    expected_norms = run(reference)
    norms = run(model)

    assert (expected_norms > 0.05).all(), "clipping must actually scale the grads in this test"
    torch.testing.assert_close(norms, expected_norms, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_user_post_accumulate_grad_hook_fires_once_per_backward_with_the_cpu_grad(device):
    def record_hooks(m: nn.Module, names: list[str]) -> dict[str, list]:
        seen: dict[str, list] = {name: [] for name in names}
        params = dict(m.named_parameters())
        for name in names:

            def hook(param: torch.Tensor, name: str = name) -> None:
                assert param is params[name], "the hook receives the parameter it was registered on"
                seen[name].append((param.grad.device, host(param.grad).clone()))

            params[name].register_post_accumulate_grad_hook(hook)
        return seen

    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    names = [name for name, _ in offloaded_parameters(model)]
    batches = make_batches(2, device)

    expected = record_hooks(reference, names)
    for x, y in batches:
        loss_fn(reference, x, y).backward()
    seen = record_hooks(model, names)
    for x, y in batches:
        loss_fn(model, x, y).backward()

    assert names
    for name in names:
        assert len(seen[name]) == 2, f"{name}: hook fired {len(seen[name])} times in 2 backwards"
        for (grad_device, grad), (_, expected_grad) in zip(seen[name], expected[name], strict=True):
            assert grad_device == torch.device("cpu"), name
            # The hook sees the accumulated grad, as for a plain parameter.
            torch.testing.assert_close(grad, expected_grad, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_forward_after_optimizer_step_uses_updated_weights(device):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, device)
    ((x, y),) = make_batches(1, device)

    def step_then_forward(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        with torch.no_grad():
            before = m(x)
        loss_fn(m, x, y).backward()
        optimizer.step()
        with torch.no_grad():
            after = m(x)
        return before, after

    expected_before, expected_after = step_then_forward(reference)
    before, after = step_then_forward(model)

    assert not torch.equal(before, after), "the step must change what the model computes"
    torch.testing.assert_close(before, expected_before, **tolerances(device))
    torch.testing.assert_close(after, expected_after, **tolerances(device))
    assert all(isinstance(p, offtensor.OffloadedParameter) for _, p in offloaded_parameters(model))


@pytest.mark.parametrize("device", devices)
def test_gradient_hooks_registered_before_wrap_fire_and_come_back_at_unwrap(device):
    """Note [gradient hooks registered before wrap] in dispatch/autograd.py: hooks on a parameter
    before wrap run as on the plain model, their handles still remove them, and unwrap gives
    back every hook the parameter has."""

    def hook(m: nn.Module, seen: list[str]) -> list:
        params = dict(m.named_parameters())
        fc1, fc2 = params["blocks.0.fc1.weight"], params["blocks.1.fc1.weight"]
        return [fc1.register_hook(lambda g: g * 3.0),
                fc2.register_post_accumulate_grad_hook(lambda p: seen.append("post fc2")),
                fc1.register_post_accumulate_grad_hook(lambda p: seen.append("post fc1"))]

    model = mlp_of_blocks()
    reference = unwrapped_reference(model, device)
    seen: tuple[list[str], list[str]] = ([], [])
    handles = [hook(model, seen[0]), hook(reference, seen[1])]
    offload(model, device)
    assert isinstance(dict(model.named_parameters())["blocks.0.fc1.weight"], offtensor.OffloadedParameter)

    def backward_both(step: int) -> None:
        x, y = make_batches(1, device)[0]
        for m, s in zip((model, reference), seen, strict=True):
            m.zero_grad()
            s.clear()
            loss_fn(m, x, y).backward()
        assert sorted(seen[0]) == sorted(seen[1])
        assert_grads_match(model, reference, **tolerances(device))

    backward_both(0)
    assert seen[0]
    for hs in handles:  # removed through the handles taken before wrap
        hs[1].remove()
    backward_both(1)
    assert seen[0] == ["post fc1"]
    offtensor.unwrap(model)
    model.to(device)  # unwrap leaves the parameters on the host
    backward_both(2)  # the `register_hook` hook and fc1's post hook are back on the plain parameters
    assert seen[0] == ["post fc1"]
    for hs in handles:
        hs[0].remove()
    backward_both(3)
