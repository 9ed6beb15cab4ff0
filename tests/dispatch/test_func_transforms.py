"""torch.func transforms over a wrapped model match the unwrapped model.

Regression: `torch.func.grad`/`vmap` over (`functional_call` of) a wrapped model failed inside
offtensor's load ("copy_ ... would mutate a captured Tensor").
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    devices,
    mlp_of_blocks,
    reference_then_offload,
    tolerances,
)
from torch.func import functional_call, grad, jacrev, vmap


def _params(model, device):
    return {k: v.detach().to(device, copy=True) for k, v in model.named_parameters()}


TRANSFORMS = {
    # grad w.r.t. every parameter, passed in by functional_call (the device copies are unused)
    "grad_params": lambda m, x: grad(lambda p: functional_call(m, p, (x,)).pow(2).sum())(_params(m, x.device)),
    # grad w.r.t. the input: the model's own (offloaded) parameters are used as constants
    "grad_input": lambda m, x: grad(lambda t: m(t).pow(2).sum())(x),
    "jacrev_input": lambda m, x: jacrev(m)(x[:1]),
    "vmap": lambda m, x: vmap(lambda t: m(t.unsqueeze(0)).squeeze(0))(x),
    "vmap_grad": lambda m, x: vmap(grad(lambda t: m(t.unsqueeze(0)).sum()))(x),
    "per_sample_grads": lambda m, x: vmap(
        grad(lambda p, t: functional_call(m, p, (t.unsqueeze(0),)).sum()), in_dims=(None, 0)
    )(_params(m, x.device), x),
}


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_torch_func_transform_matches_unwrapped_model(device, transform):
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device)
    x = torch.randn(3, 8, device=device)
    fn = TRANSFORMS[transform]
    for _ in range(2):  # the second call runs with a learned order and prefetch
        torch.testing.assert_close(fn(model, x), fn(reference, x), **tolerances(device))
    assert_all_scopes_offloaded(model)
    # The model still trains normally afterwards.
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_match(model, reference, **tolerances(device))
