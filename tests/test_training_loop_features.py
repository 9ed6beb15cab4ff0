"""Standard PyTorch training-loop features around a wrapped model: autograd entry points, mixed
precision with a gradient scaler, parametrizations, weight averaging, optimizer features.

Each test runs the same loop on the unwrapped reference and on the offloaded model and compares
losses, gradients and weights over several steps.
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
    mlp_and_reference,
    reference_then_offload,
    step_both,
    tied_lm,
    tied_lm_predicate,
    tolerances,
)


def _batches(device: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Autograd entry points
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_autograd_grad_with_respect_to_offloaded_parameters_matches_unwrapped(device):
    """Regression: autograd saw the masters, not the device copies the graph holds: it raised
    "appears to not have been used in the graph", and returned None with allow_unused=True."""
    model, reference = mlp_and_reference(device)
    for x, y in _batches(device, 2):
        results = []
        for m in (reference, model):
            params = [m.blocks[1].fc1.weight, m.head.weight, m.blocks[0].norm.bias]
            results.append(torch.autograd.grad(F.mse_loss(m(x), y), params, allow_unused=True))
        for got, expected in zip(*results, strict=True):
            assert got.device.type == "cpu"  # like p.grad: on the host
            torch.testing.assert_close(host(got), host(expected), **tolerances(device))
    assert all(p.grad is None for p in model.parameters())  # grad() accumulates nothing
    assert_all_scopes_offloaded(model)
    unused = F.mse_loss(model.head(model.input(_batches(device, 1)[0][0])), torch.zeros(4, 4, device=device))
    with pytest.raises(RuntimeError, match=r"index 0 \(offloaded parameter 'blocks.0.fc1.weight'\) "
                                           "appears to not have been used"):
        torch.autograd.grad(unused, [model.blocks[0].fc1.weight], retain_graph=True)
    (zeros,) = torch.autograd.grad(unused, [model.blocks[0].fc1.weight], materialize_grads=True)
    assert torch.equal(zeros, torch.zeros(32, 16))


@pytest.mark.parametrize("device", devices)
def test_gradient_norm_penalty_on_offloaded_parameters_trains_like_unwrapped(device):
    """autograd.grad(loss, params, create_graph=True), then a backward through those gradients."""
    model, reference = mlp_and_reference(device, checkpoint="non_reentrant")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    # Double backward sums in another order than the plain one: a few ulps apart.
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for x, y in _batches(device, 3):
        for m in (reference, model):
            loss = F.mse_loss(m(x), y)
            grads = torch.autograd.grad(loss, [p for n, p in m.named_parameters() if "fc1" in n], create_graph=True)
            (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
        step_both(model, reference, opt, ref_opt, tol)
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("tied_side", ["head_in_block", "embedding_selected"])
def test_backward_with_inputs_accumulates_only_into_the_named_parameters(tied_side):
    """Regression: `loss.backward(inputs=[p])` left an offloaded `p.grad` None, silently. A tied
    weight is in the graph twice: through its scope's device copy and a temporary copy."""
    model = tied_lm(tied_side)
    reference = reference_then_offload(model, "cpu", tied_lm_predicate(tied_side))
    tokens = torch.randint(0, 32, (2, 5))
    # The second backward accumulates: the tied weight's two contributions are then added to
    # the old gradient one by one, where autograd adds their sum (a few ulps apart).
    for tol in (tolerances("cpu"), {"rtol": 1e-6, "atol": 1e-7}):
        for m in (reference, model):
            m(tokens).logsumexp(-1).mean().backward(inputs=[m.embed.weight, m.blocks[0].fc2.bias])
        assert_grads_match(model, reference, **tol)
    assert model.blocks[1].fc1.weight.grad is None
    assert_all_scopes_offloaded(model)
