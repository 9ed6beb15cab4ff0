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
    mlp_of_blocks,
    reference_then_offload,
    tolerances,
)
from master_guard import MasterGuard
from torch import nn

import offtensor

CHECKPOINTING = [None, "reentrant", "non_reentrant"]


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
    _train_and_compare(model, reference, overlapped, [(torch.randn(4, 16), torch.randn(4, 16)) for _ in range(3)])


# --------------------------------------------------------------------------------------------
# Module hooks and selective checkpointing
# --------------------------------------------------------------------------------------------


def _install_hooks(m: nn.Module) -> None:
    """Hooks on scopes, on their children and on their parents that replace inputs, outputs and
    gradients, several of them computing with the parameters."""
    m.blocks[0].register_full_backward_pre_hook(lambda mod, go: tuple(g * 0.5 for g in go))
    m.blocks[1].register_full_backward_hook(
        lambda mod, gi, go: tuple(None if g is None else g * mod.fc1.weight.norm() for g in gi))
    m.blocks[1].register_forward_hook(lambda mod, args, out: out * mod.norm.weight.mean())
    m.blocks[2].register_forward_pre_hook(lambda mod, args: (args[0] + mod.fc1.bias[:16],))
    m.blocks[2].fc2.register_forward_hook(lambda mod, args, out: out - mod.bias)
    m.blocks[0].fc1.register_full_backward_hook(lambda mod, gi, go: (gi[0] * mod.weight.abs().mean(),))
    m.register_forward_hook(lambda mod, args, out: out + 0.01 * mod.blocks[0].fc1.weight.sum())
    m.register_full_backward_hook(lambda mod, gi, go: None)


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
def test_module_hooks_on_scopes_and_parents_train_like_unwrapped(checkpoint, overlapped):
    model = mlp_of_blocks(checkpoint=checkpoint)
    reference = reference_then_offload(model, "cpu")
    for m in (reference, model):
        _install_hooks(m)
    _train_and_compare(model, reference, overlapped, [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(3)])


def _train_and_compare(model, reference, overlapped, batches, forward=None):
    forward = forward or (lambda m, x: m(x))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batches:
        ref_loss = F.mse_loss(forward(reference, x), y)
        ref_loss.backward()
        with MasterGuard(model):
            loss = F.mse_loss(forward(model, x), y)
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


def _selective_checkpointing(m, x):
    """Each block under non-reentrant checkpointing that saves the matmuls and recomputes the
    rest (torch.utils.checkpoint.create_selective_checkpoint_contexts)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    h = m.input(x)
    for block in m.blocks:
        h = checkpoint(block, h, use_reentrant=False,
                       context_fn=lambda: create_selective_checkpoint_contexts(policy))
    return m.head(h)


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
def test_selective_activation_checkpointing_trains_like_unwrapped(overlapped):
    model = mlp_of_blocks()
    reference = reference_then_offload(model, "cpu")
    _train_and_compare(model, reference, overlapped, [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(3)],
                       _selective_checkpointing)


# --------------------------------------------------------------------------------------------
# Forward-mode AD and tracing transforms
# --------------------------------------------------------------------------------------------


def _mlp(n_blocks: int = 2):
    model = mlp_of_blocks(n_blocks=n_blocks)
    return model, reference_then_offload(model, "cpu")


def _copies_of_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _dual(m, x, v):
    with torch.autograd.forward_ad.dual_level():
        primal, tangent = torch.autograd.forward_ad.unpack_dual(m(torch.autograd.forward_ad.make_dual(x, v)))
        return primal.clone(), tangent.clone()


def _dual_parameters(m, x, params):
    """Tangents on the parameters, passed in by functional_call."""
    fwd = torch.autograd.forward_ad
    with fwd.dual_level():
        duals = {k: fwd.make_dual(p, torch.ones_like(p)) for k, p in params.items()}
        primal, tangent = fwd.unpack_dual(torch.func.functional_call(m, duals, (x,)))
        return primal.clone(), tangent.clone()


FORWARD_MODE = {
    "dual_input": lambda m, x, v, params: _dual(m, x, v),
    "dual_parameters": lambda m, x, v, params: _dual_parameters(m, x, params),
    "jvp": lambda m, x, v, params: torch.func.jvp(m, (x,), (v,)),
    "jacfwd": lambda m, x, v, params: torch.func.jacfwd(m)(x[:1]),
    "hvp_forward_over_reverse": lambda m, x, v, params: torch.func.jvp(
        torch.func.grad(lambda t: m(t).pow(2).sum()), (x,), (v,)),
    "jvp_of_parameters": lambda m, x, v, params: torch.func.jvp(
        lambda p: torch.func.functional_call(m, p, (x,)), (params,),
        ({k: torch.ones_like(t) for k, t in params.items()},)),
}


@pytest.mark.parametrize("transform", list(FORWARD_MODE))
def test_forward_mode_ad_matches_unwrapped(transform):
    model, reference = _mlp()
    params = _copies_of_parameters(model)
    x, v = torch.randn(3, 8), torch.randn(3, 8)
    fn = FORWARD_MODE[transform]
    for _ in range(2):  # the second with a learned order and prefetch
        torch.testing.assert_close(fn(model, x, v, params), fn(reference, x, v, params), **tolerances("cpu"))
    # Under a dispatch mode, forward AD takes other kernels (a few ulps apart): only no master read.
    with MasterGuard(model):
        fn(model, x, v, params)
    # (A forward with grad on keeps its last scope for a backward: none came. The next one ends.)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


def test_linearize_of_functional_call_over_a_wrapped_model_matches_unwrapped():
    """Regression: a crash (exit 139). make_fx, which torch.func.linearize runs, traced
    offtensor's own loads into the graph, and calling the linearized function replayed them
    into device storage released since."""
    model, reference = _mlp()
    params = _copies_of_parameters(model)  # the parameters passed in: no device copy is used
    x, v = torch.randn(3, 8), torch.randn(3, 8)
    results = []
    for m in (reference, model):
        out, jvp_fn = torch.func.linearize(lambda t, m=m: torch.func.functional_call(m, params, (t,)), x)
        results.append((out, jvp_fn(v), jvp_fn(2 * v)))
    torch.testing.assert_close(results[1], results[0], **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


def test_error_if_make_fx_traces_an_offloaded_parameter():
    """torch.func.linearize (make_fx) over the model's own parameters would keep their device
    copies in the graph, freed when their scope is released: it raises, naming the parameter
    and the fix. (It raised an opaque dispatch error, "all __torch_dispatch__ handlers returned
    NotImplemented", and on a model whose trace got through, crashed when called.)"""
    model, _ = _mlp()
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"offtensor: .*traced.*offloaded parameter 'blocks\.0\.norm\.weight'"
                                           r".*functional_call.*offtensor\.unwrap"):
        torch.func.linearize(model, x)
    assert_all_scopes_offloaded(model)
    model(x).sum().backward()  # still usable
    assert_all_scopes_offloaded(model)


def test_torch_export_of_a_wrapped_model_matches_unwrapped():
    """Regression: a crash (exit 139) calling the exported program: torch.export's trace
    (make_fx before autograd) recorded offtensor's loads, replayed into released storage. The
    export lifts the parameters as inputs, with their masters' values."""
    model, reference = _mlp()
    x = torch.randn(3, 8)
    exported = torch.export.export(model, (x,))
    assert_all_scopes_offloaded(model)
    torch.testing.assert_close(exported.module()(x), reference(x), **tolerances("cpu"))
    torch.testing.assert_close(exported.module()(2 * x), reference(2 * x), **tolerances("cpu"))
