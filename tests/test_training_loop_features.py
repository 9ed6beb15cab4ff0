"""Standard PyTorch training-loop features around a wrapped model: autograd entry points, mixed
precision with a gradient scaler, parametrizations, weight averaging, optimizer features.

Each test runs the same loop on the unwrapped reference and on the offloaded model and compares
losses, gradients and weights over several steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    host,
    mlp_and_reference,
    mlp_of_blocks,
    offload,
    reference_then_offload,
    step_both,
    tied_lm,
    tied_lm_predicate,
    tolerances,
)
from torch import nn
from torch.nn.utils import parametrizations

import offtensor


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


# --------------------------------------------------------------------------------------------
# Parametrizations (torch.nn.utils.parametrize, weight_norm, spectral_norm)
# --------------------------------------------------------------------------------------------


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


PARAMETRIZATIONS = {
    "weight_norm": lambda m: parametrizations.weight_norm(m.fc1),
    "spectral_norm": lambda m: parametrizations.spectral_norm(m.fc1),
    "orthogonal": lambda m: parametrizations.orthogonal(m.fc1),
    "register_parametrization": lambda m: parametrize.register_parametrization(m.fc2, "weight", nn.Softplus()),
    "old_weight_norm": lambda m: torch.nn.utils.weight_norm(m.fc1),
    "old_spectral_norm": lambda m: torch.nn.utils.spectral_norm(m.fc1),
}


def _parametrized_pair(kind: str, after_wrap: bool) -> tuple[nn.Module, nn.Module]:
    """Two equal models (built from one seed: a module with torch.nn.utils.weight_norm cannot be
    deep-copied), the first wrapped; each block parametrized before or after wrap."""
    models = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = mlp_of_blocks(checkpoint="non_reentrant")
        if wrapped and after_wrap:
            offload(model, "cpu")
        for block in model.blocks:
            torch.manual_seed(1)  # the power iteration's and orthogonal's random starts
            PARAMETRIZATIONS[kind](block)
        if wrapped and not after_wrap:
            offload(model, "cpu")
        models.append(model)
    reference, model = models
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    return model, reference


def _train_parametrized(model: nn.Module, reference: nn.Module, overlapped: bool) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances("cpu")
    for x, y in _batches("cpu", 3):
        losses = []
        for m in (reference, model):
            loss = F.mse_loss(m(x), y)
            losses.append(loss.detach())
            if m is model and overlapped:
                offtensor.backward_and_step(loss, opt, zero_grad=True)
            else:
                loss.backward()
        torch.testing.assert_close(losses[1], losses[0], **tol)
        if overlapped:
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            step_both(model, reference, opt, ref_opt, tol)
    assert_params_match(model, reference, **tol)  # spectral_norm's u and v buffers too
    model.eval()
    reference.eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_parametrized_layers_wrapped_after_parametrizing_train_like_unwrapped(kind, overlapped):
    """The parametrization's originals (`parametrizations.weight.original0`, `weight_g`) are the
    offloaded parameters; the weight is computed from their device copies in each forward."""
    model, reference = _parametrized_pair(kind, after_wrap=False)
    assert isinstance(model.blocks[0].fc2.bias, offtensor.OffloadedParameter)
    _train_parametrized(model, reference, overlapped)


@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal", "register_parametrization"])
def test_parametrization_registered_after_wrap_trains_like_unwrapped(kind):
    """The offloaded weight becomes `parametrizations.weight.original`, the same object.
    Regression (orthogonal): registering sets it to right_inverse(weight) with `set_()`, which
    rebound the master outside the scope's host buffer: every forward computed with the weight
    from before, silently."""
    model, reference = _parametrized_pair(kind, after_wrap=True)
    _train_parametrized(model, reference, overlapped=False)


def test_error_if_weight_norm_is_registered_after_wrap():
    """weight_norm's right_inverse returns (g, v) with v the weight itself, which
    register_parametrization makes a new Parameter: one that would share the master's memory
    without being offloaded. The error says to parametrize before wrap; nothing changed."""
    model = offload(mlp_of_blocks(), "cpu")
    with pytest.raises(RuntimeError, match=r"nn.Parameter\(p\) of offloaded parameter 'blocks.0.fc1.weight'.*"
                                           r"register parametrizations before offtensor.wrap\(model\)"):
        parametrizations.weight_norm(model.blocks[0].fc1)
    assert not parametrize.is_parametrized(model.blocks[0].fc1)
    with pytest.raises(TypeError, match="offloaded parameter 'blocks.0.fc1.weight' cannot be set_"):
        model.blocks[0].fc1.weight.set_()
    with torch.no_grad(), pytest.raises(TypeError, match=r"cannot set_\(\) offloaded parameter 'blocks.0.fc1.weight'"):
        model.blocks[0].fc1.weight.set_(torch.zeros(3))


# --------------------------------------------------------------------------------------------
# Mixed precision with a gradient scaler
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_grad_scaler_with_autocast_and_clipping_trains_like_unwrapped_skipping_inf_steps(dtype):
    """scale -> backward -> unscale_ -> clip_grad_norm_ -> scaler.step -> update; the third
    step gets an inf gradient in an offloaded parameter: skipped, weights unchanged, scale halved."""
    model, reference = mlp_and_reference("cpu")
    fused = dtype == torch.float16  # fused AdamW takes the scale and found_inf from the scaler
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=fused)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    tol = tolerances("cpu")
    for i, (x, y) in enumerate(_batches("cpu", 4)):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for m, s, o in ((reference, ref_scaler, ref_opt), (model, scaler, opt)):
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(m(x).float(), y)
            s.scale(loss).backward()
            if i == 2:
                m.blocks[1].fc1.weight.grad[0, 0] = float("inf")
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
            o.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert_params_match(model, reference, **tol)
        if i == 2:
            assert scaler.get_scale() == 2.0**7
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert_all_scopes_offloaded(model)


def test_error_if_backward_and_step_is_given_a_grad_scaler_scaled_loss():
    """Regression: the worker stepped on the scaled gradients (an inf one too), and a following
    scaler.step(optimizer) stepped again, silently. Nothing is stepped now."""
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batches("cpu", 1)[0]
    with pytest.raises(RuntimeError, match=r"scaled by a torch.amp.GradScaler.*scaler.scale\(loss\).backward\(\)"):
        offtensor.backward_and_step(scaler.scale(F.mse_loss(model(x), y)), opt)
    assert_params_match(model, reference, **tolerances("cpu"))
    offtensor.backward_and_step(F.mse_loss(model(x), y) * torch.tensor(2.0), opt)  # not a scaler's
    offtensor.wait_for_steps()
    assert not torch.equal(model.blocks[0].fc1.weight, reference.blocks[0].fc1.weight)
