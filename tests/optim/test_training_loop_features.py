"""Standard PyTorch training-loop features around a wrapped model: autograd entry points, mixed
precision with a gradient scaler, parametrizations, weight averaging, optimizer features.

Each test runs the same loop on the unwrapped reference and on the offloaded model and compares
losses, gradients and weights over several steps.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from conftest import (
    BlockStack,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    batchnorm_model,
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
    train_step,
)
from master_guard import MasterGuard
from torch import nn
from torch.nn.utils import parametrizations
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

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
        offloaded = [True, False, True]  # the head is resident on the device
        for expected, got, off in zip(*results, offloaded, strict=True):  # (reference, model)
            assert got.device.type == ("cpu" if off else torch.device(device).type)  # offloaded: on the host, as p.grad
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
    """autograd.grad(loss, params, create_graph=True), then a backward through those gradients.
    Regression: the checkpoint's recompute inside autograd.grad ran with subclass dispatch off,
    so its ops got the host masters (on CUDA a device mismatch; the guard sees it on the CPU)."""
    model, reference = mlp_and_reference(device, checkpoint="non_reentrant")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    # Double backward sums in another order than the plain one: a few ulps apart.
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for x, y in _batches(device, 3):
        for m in (reference, model):
            with MasterGuard(model) if m is model else contextlib.nullcontext():
                loss = F.mse_loss(m(x), y)
                grads = torch.autograd.grad(loss, [p for n, p in m.named_parameters() if "fc1" in n],
                                            create_graph=True)
                (loss + 0.1 * sum(g.pow(2).sum() for g in grads)).backward()
        step_both(model, reference, opt, ref_opt, tol)
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("tied_side", ["head_in_block", "embedding_selected"])
@pytest.mark.skipif("has_torch_function" not in inspect.getsource(torch.autograd.backward),
                    reason="this PyTorch's torch.autograd.backward does not reach __torch_function__ "
                           "for its inputs (docs/design.md, Limits: loss.backward(inputs=params))")
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
    _assert_evaluates_like(model, reference, tol)


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
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
    scaler.step(optimizer) stepped again, silently. Without scaler= nothing is stepped now
    (with it: tests/optim/test_clipping.py)."""
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batches("cpu", 1)[0]
    with pytest.raises(RuntimeError, match=r"scaled by a torch.amp.GradScaler.*but no scaler= was passed"):
        offtensor.backward_and_step(scaler.scale(F.mse_loss(model(x), y)), opt)
    assert_params_match(model, reference, **tolerances("cpu"))
    offtensor.backward_and_step(F.mse_loss(model(x), y) * torch.tensor(2.0), opt)  # not a scaler's
    offtensor.wait_for_steps()
    assert not torch.equal(model.blocks[0].fc1.weight, reference.blocks[0].fc1.weight)


# --------------------------------------------------------------------------------------------
# Saved-tensor hooks
# --------------------------------------------------------------------------------------------


def _cloning_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Custom hooks that keep a copy of each saved tensor (the device copies of weights too)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("hooks", [torch.autograd.graph.save_on_cpu, _cloning_hooks], ids=["save_on_cpu", "custom"])
def test_saved_tensors_hooks_around_the_forward_train_like_unwrapped(hooks, checkpoint):
    model, reference = mlp_and_reference("cpu", checkpoint=checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in _batches("cpu", 3):
        for m in (reference, model):
            with hooks():
                loss = F.mse_loss(m(x), y)
            loss.backward()
        step_both(model, reference, opt, ref_opt, tolerances("cpu"))
    assert_params_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


class _ActivationOffloader(torch.autograd.graph.saved_tensors_hooks):
    """What TRL's and torchtune's activation offloading do: every saved tensor but parameters
    and buffers goes to the host (counted here, kept as is)."""

    def __init__(self) -> None:
        self.offloaded = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, (torch.nn.Parameter, torch.nn.Buffer)):
            self.offloaded += t.numel() * t.element_size()
        return t


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_activation_offloading_moves_the_same_bytes_as_for_the_unwrapped_model(checkpoint):
    """Device copies of weights are not activations: an offloader that skips parameters and
    buffers offloads exactly what it offloads for the plain model."""
    model, reference = mlp_and_reference("cpu", checkpoint=checkpoint)
    x, y = _batches("cpu", 1)[0]
    counts = []
    for m in (reference, model):
        offloader = _ActivationOffloader()
        with offloader:
            loss = F.mse_loss(m(x), y)
        loss.backward()
        counts.append(offloader.offloaded)
    assert counts[0] > 0
    assert counts[1] == counts[0]
    assert_grads_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Autograd modes and retained graphs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
def test_second_backward_through_a_retained_graph_doubles_the_gradients_under_anomaly_mode(checkpoint):
    """backward(retain_graph=True) then backward again on the same graph, inside
    set_detect_anomaly(True); then torch.autograd.backward over two roots of two forwards."""
    model, reference = mlp_and_reference("cpu", checkpoint=checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torch.autograd.set_detect_anomaly(True):
        for x, y in _batches("cpu", 2):
            for m in (reference, model):
                loss = F.mse_loss(m(x), y)
                loss.backward(retain_graph=True)
                loss.backward()
            step_both(model, reference, opt, ref_opt, tolerances("cpu"))
    for x, y in _batches("cpu", 2):
        for m in (reference, model):
            roots = [F.mse_loss(m(x), y), m(2 * x).sum()]
            torch.autograd.backward(roots, [torch.tensor(1.0), torch.tensor(0.5)])
        step_both(model, reference, opt, ref_opt, tolerances("cpu"))
    assert_params_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


def _everything(name: str, module: nn.Module) -> bool:
    return name in ("input", "head") or (name.startswith("blocks.") and name.count(".") == 1)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
def test_error_if_a_retained_graph_is_differentiated_after_an_optimizer_step(overlapped, checkpoint):
    """Regression: the second backward reloaded the stepped weights into the device copies the
    graph had saved and differentiated with them, silently, where the unwrapped model raises
    autograd's in-place error."""
    model = mlp_of_blocks(checkpoint=checkpoint)
    reference = reference_then_offload(model, "cpu", _everything)
    x, y = _batches("cpu", 1)[0]
    for m in (reference, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        loss = F.mse_loss(m(x), y)
        if overlapped and m is model:
            offtensor.backward_and_step(loss, opt, retain_graph=True)
        else:
            loss.backward(retain_graph=True)
            opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        F.mse_loss(m(x), y).backward()  # the next step (which releases what the failed backward left)
    assert_grads_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


def _write_around_the_parameter(p: torch.Tensor, how: str) -> None:
    """Writes to a parameter that no op on the parameter itself carries out."""
    if how == "detach":
        p.detach().mul_(2.0)  # shares p's version counter
    elif how == "view":
        p.detach()[0].fill_(0.5)
    elif how == "data":
        p.data.mul_(2.0)  # a version counter of its own: autograd cannot see it
    else:
        with torch.no_grad():
            p.mul_(2.0)


_KEEP_ALL = offtensor.Policy(vram_budget=2**30)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("block", [0, 2], ids=["first_block", "last_block"])
@pytest.mark.parametrize("policy", [None, _KEEP_ALL], ids=["streamed", "kept"])
@pytest.mark.parametrize("how", ["detach", "view", "data", "no_grad"])
@pytest.mark.parametrize("device", devices)
def test_a_write_between_forward_and_backward_raises_or_differentiates_as_unwrapped(device, how, policy, block,
                                                                                   checkpoint):
    """Regression: a write through a detached alias or a view of a parameter between forward and
    backward (`p.detach().mul_()`, `p.detach()[0].fill_()`) left the device copies' version
    counters alone, so backward silently differentiated with the new weights reloaded into the
    copies the graph had saved (or, for a block still resident, with the old ones), where the
    unwrapped model raises autograd's in-place error. A write through `p.data` is invisible to
    autograd: the unwrapped model differentiates with the new weights, and so must the
    offloaded one, the last block (resident from its forward into backward) included."""
    model = mlp_of_blocks(checkpoint=checkpoint)
    reference = reference_then_offload(model, device, policy=policy)
    x, y = _batches(device, 1)[0]
    for m in (reference, model):  # a first step: the order is learned, the last block kept for backward
        F.mse_loss(m(x), y).backward()
        m.zero_grad()
    outcomes = []
    for m in (reference, model):
        loss = F.mse_loss(m(x), y)
        _write_around_the_parameter(m.blocks[block].fc1.weight, how)
        try:
            loss.backward()
            outcomes.append("differentiated")
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            outcomes.append("raised")
    assert outcomes[1] == outcomes[0], f"unwrapped: {outcomes[0]}, offloaded: {outcomes[1]}"
    if outcomes[0] == "differentiated":
        assert_grads_match(model, reference, **tolerances(device))
    for m in (reference, model):  # the next step trains as the unwrapped model does
        m.zero_grad()
        F.mse_loss(m(x), y).backward()
    assert_grads_match(model, reference, **tolerances(device))
    assert_params_match(model, reference, **tolerances(device))
    if policy is None:
        assert_all_scopes_offloaded(model)


class _ReadsItsBiasInPlace(nn.Module):
    """Saves its bias for backward, then reads it in an in-place op (not a write of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        return torch.tanh(h.add_(self.scale))


def test_an_in_place_op_reading_a_saved_parameter_does_not_break_its_graph():
    model = BlockStack([_ReadsItsBiasInPlace() for _ in range(2)], 8, 16, 4)
    reference = reference_then_offload(model, "cpu")
    x, y = _batches("cpu", 1)[0]
    for m in (reference, model):
        F.mse_loss(m(x), y).backward()
    assert_grads_match(model, reference, **tolerances("cpu"))


# --------------------------------------------------------------------------------------------
# Freezing, unfreezing, dropout and eval switches
# --------------------------------------------------------------------------------------------


class _DropoutBlock(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning")  # the frozen input
@pytest.mark.parametrize("rebuild", [False, True], ids=["one_optimizer", "optimizer_per_step"])
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
def test_freezing_and_unfreezing_layers_between_steps_with_dropout_trains_like_unwrapped(
        overlapped, checkpoint, rebuild):
    """A block frozen at step 2 and unfrozen at 5, the first block and the input frozen from 4,
    an evaluation forward at step 3; dropout drawn from the same seeds in both models. With
    `optimizer_per_step`, the optimizer holds only what is trainable then."""
    model = BlockStack([_DropoutBlock() for _ in range(3)], 8, 16, 4)
    model.checkpoint = checkpoint
    reference = reference_then_offload(model, "cpu")

    def make(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)

    opt, ref_opt = make(model), make(reference)
    tol = tolerances("cpu")
    for i, (x, y) in enumerate(_batches("cpu", 7)):
        for m in (reference, model):
            if i in (2, 5):
                m.blocks[1].requires_grad_(i == 5)
            if i == 4:
                m.input.requires_grad_(False)
                m.blocks[0].requires_grad_(False)
        if rebuild:
            opt, ref_opt = make(model), make(reference)
        for m in (reference, model):
            if i == 3:
                m.eval()
                with torch.no_grad():
                    m(x)
                m.train()
            torch.manual_seed(100 + i)
            loss = F.mse_loss(m(x), y)
            if overlapped and m is model:
                offtensor.backward_and_step(loss, opt)
            else:
                loss.backward()
        assert_grads_match(model, reference, **tol)
        if not overlapped:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_params_match(model, reference, **tol)
    _assert_evaluates_like(model, reference, tol)


@pytest.mark.parametrize("device", devices)
def test_a_gradient_a_hook_returned_and_kept_keeps_its_values_as_gradients_accumulate(device):
    """A `register_hook` hook that returns a tensor it also keeps: autograd gives the parameter a
    copy of it as `.grad`, so the accumulation of the next backward leaves the kept tensor as it
    was. Offloaded, the same (Note [gradients computed on the host] in engine/host_grads.py)."""
    model, reference = mlp_and_reference(device)
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
    kept: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def keeping(held: list[torch.Tensor]):
        def hook(g: torch.Tensor) -> torch.Tensor:
            held.append(g)
            return g

        return hook

    for m, held in zip((model, reference), kept, strict=True):
        m.blocks[0].fc1.weight.register_hook(keeping(held))
    for _ in range(2):  # the second backward adds into `.grad`
        for m in (model, reference):
            F.mse_loss(m(x), y).backward()
    for mine, theirs in zip(*kept, strict=True):
        torch.testing.assert_close(host(mine), host(theirs), **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
def test_a_parameter_frozen_between_forward_and_backward_gets_no_gradient_like_unwrapped(overlapped):
    """Regression: a block (and the tied embedding, whose head is outside its scope) frozen
    after the forward got this backward's gradient and was stepped; autograd gives a parameter
    that no longer requires grad none (an older `.grad` stays as it is), though its hooks run."""
    model = tied_lm("embedding_selected")
    reference = reference_then_offload(model, "cpu", tied_lm_predicate("embedding_selected"))
    calls: dict[int, list[str]] = {id(model): [], id(reference): []}
    for m in (reference, model):
        seen = calls[id(m)]
        m.blocks[1].fc1.weight.register_hook(lambda g, c=seen: c.append("hook"))
        m.blocks[1].fc1.weight.register_post_accumulate_grad_hook(lambda p, c=seen: c.append("post"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    tokens = torch.randint(0, 32, (4, 6))
    for i in range(4):
        for m in (reference, model):
            loss = m(tokens).logsumexp(-1).mean()
            m.blocks[1].requires_grad_(i % 2 == 1)  # frozen in steps 0 and 2, with an old grad in 2
            m.embed.requires_grad_(i != 2)
            if overlapped and m is model:
                offtensor.backward_and_step(loss, opt)
            else:
                loss.backward()
        assert_grads_match(model, reference, rtol=0, atol=0)
        if not overlapped:
            opt.step()
        ref_opt.step()
        assert_params_match(model, reference, rtol=0, atol=0)
        for m, o in ((reference, ref_opt), (model, opt)):
            m.requires_grad_(True)
            o.zero_grad(set_to_none=i == 0)  # in step 2 the frozen parameters keep a zero .grad
    assert calls[id(model)] == calls[id(reference)]
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Weight averaging
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("average", ["swa", "ema"])
def test_averaged_model_and_update_bn_of_a_wrapped_model_match_unwrapped(average):
    """torch.optim.swa_utils.AveragedModel (a deep copy: plain parameters on the host) updated
    from the offloaded masters, update_bn on the average and on the wrapped model itself, and a
    hand-written EMA with lerp_ and _foreach_lerp_."""
    model = batchnorm_model()
    reference = reference_then_offload(model, "cpu")
    kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(0.9), "use_buffers": True} if average == "ema" else {}
    averaged, ref_averaged = AveragedModel(model, **kwargs), AveragedModel(reference, **kwargs)
    ema, ref_ema = copy.deepcopy(model), copy.deepcopy(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    tol = tolerances("cpu")
    for i, (x, y) in enumerate(_batches("cpu", 4)):
        for m in (reference, model):
            F.mse_loss(m(x), y).backward()
        step_both(model, reference, opt, ref_opt, tol)
        ref_averaged.update_parameters(reference)
        averaged.update_parameters(model)
        with torch.no_grad():
            for e, p in zip((*ema.parameters(), *ref_ema.parameters()), (*model.parameters(), *reference.parameters()),
                            strict=True):
                e.lerp_(p, 0.01)
            if i == 3:
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.5)
                torch._foreach_lerp_(list(ref_ema.parameters()), list(reference.parameters()), 0.5)
    assert_params_match(averaged, ref_averaged, **tol)
    assert_params_match(ema, ref_ema, **tol)
    loader = [x for x, _ in _batches("cpu", 3)]
    for a, b in ((averaged, ref_averaged), (model, reference)):
        update_bn(loader, a)
        update_bn(loader, b)
        assert_params_match(a, b, **tol)  # running statistics included
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(averaged(x), ref_averaged(x), **tol)
        torch.testing.assert_close(model(x), reference(x), **tol)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# Optimizer features
# --------------------------------------------------------------------------------------------


def _groups(m: nn.Module) -> tuple[list[dict], list[nn.Parameter]]:
    """Param groups with their own lr and weight decay, each mixing offloaded and resident
    parameters, and the parameters left for add_param_group."""
    names = [n for n, _ in m.named_parameters()]
    params = dict(m.named_parameters())
    first = [params[n] for n in names if n.startswith(("head", "blocks.0.fc"))]
    rest = [params[n] for n in names if not n.startswith(("head", "blocks.0.fc"))]
    half = len(rest) // 2
    return [{"params": first, "lr": 0.05, "weight_decay": 0.1}, {"params": rest[:half]}], rest[half:]


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_param_groups_scheduler_and_add_param_group_after_steps_train_like_unwrapped(fused, overlapped):
    model, reference = mlp_and_reference("cpu")
    (groups, rest), (ref_groups, ref_rest) = _groups(model), _groups(reference)
    opt = torch.optim.AdamW(groups, lr=1e-2, fused=fused, foreach=None if fused else True)
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, fused=fused, foreach=None if fused else True)
    # StepLR: a chainable scheduler, which takes groups added after it was made.
    sched, ref_sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5)
    for i, (x, y) in enumerate(_batches("cpu", 6)):
        if i == 2:
            opt.add_param_group({"params": rest, "lr": 0.02})
            ref_opt.add_param_group({"params": ref_rest, "lr": 0.02})
        for m in (reference, model):
            loss = F.mse_loss(m(x), y)
            if overlapped and m is model:
                offtensor.backward_and_step(loss, opt, zero_grad=True)
            else:
                loss.backward()
        if overlapped:
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            step_both(model, reference, opt, ref_opt, tolerances("cpu"))
        sched.step()
        ref_sched.step()
    assert_params_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_with_a_closure_trains_like_unwrapped(line_search):
    """Several forward/backward evaluations per step, the closure zeroing the grads each time."""
    model, reference = mlp_and_reference("cpu", checkpoint="non_reentrant")
    kwargs = {"lr": 0.5, "max_iter": 4, "history_size": 3, "line_search_fn": line_search}
    opt, ref_opt = torch.optim.LBFGS(model.parameters(), **kwargs), torch.optim.LBFGS(reference.parameters(), **kwargs)
    for x, y in _batches("cpu", 3):
        losses = []
        for m, o in ((reference, ref_opt), (model, opt)):
            def closure(m: nn.Module = m, o: torch.optim.Optimizer = o) -> torch.Tensor:
                o.zero_grad()
                loss = F.mse_loss(m(x), y)
                loss.backward()
                return loss
            losses.append(o.step(closure))
        torch.testing.assert_close(losses[1], losses[0], **tolerances("cpu"))
    assert_params_match(model, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
def test_resuming_from_saved_model_and_optimizer_state_matches_an_uninterrupted_run(overlapped, tmp_path):
    """Three steps, torch.save of the model, optimizer and scheduler state dicts, then three
    more steps in a freshly built and wrapped model: as six steps of the unwrapped model."""
    model, reference = mlp_and_reference("cpu")

    def make(m: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)

    def train(m: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
              batches: list, overlap: bool) -> None:
        for x, y in batches:
            train_step(F.mse_loss(m(x), y), opt, overlap=overlap)
            sched.step()

    batches = _batches("cpu", 6)
    train(reference, *make(reference), batches, overlap=False)
    opt, sched = make(model)
    train(model, opt, sched, batches[:3], overlapped)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
               tmp_path / "checkpoint.pt")
    torch.manual_seed(123)  # other initial weights: all of them come from the checkpoint
    resumed = offload(mlp_of_blocks(), "cpu")
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    opt, sched = make(resumed)
    opt.load_state_dict(checkpoint["opt"])
    sched.load_state_dict(checkpoint["sched"])
    train(resumed, opt, sched, batches[3:], overlapped)
    assert_params_match(resumed, reference, **tolerances("cpu"))
    assert_all_scopes_offloaded(resumed)


CLIPS = {
    "clip_grad_value_": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01),
    "clip_grad_value_foreach": lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01, foreach=True),
    "clip_grad_norm_foreach": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.1, foreach=True),
    "clip_grad_norm_inf": lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.1, norm_type="inf", foreach=False),
}


@pytest.mark.parametrize("clip", list(CLIPS))
def test_gradient_clipping_and_parameters_as_one_vector_match_unwrapped(clip):
    """Clipping the host gradients, then a hand-made SGD step through parameters_to_vector and
    vector_to_parameters (which assigns `.data`: copies into the masters)."""
    model, reference = mlp_and_reference("cpu")
    tol = tolerances("cpu")
    for x, y in _batches("cpu", 3):
        for m in (reference, model):
            F.mse_loss(m(x), y).backward()
            CLIPS[clip](list(m.parameters()))
        assert_grads_match(model, reference, **tol)
        for m in (reference, model):
            params = list(m.parameters())
            flat = torch.nn.utils.parameters_to_vector(params)
            grads = torch.nn.utils.parameters_to_vector([p.grad for p in params])
            torch.nn.utils.vector_to_parameters(flat - 0.1 * grads, params)
            m.zero_grad()
        assert_params_match(model, reference, **tol)
    assert all(isinstance(p, offtensor.OffloadedParameter) for p in model.blocks.parameters())
    assert_all_scopes_offloaded(model)


def _assert_evaluates_like(model: nn.Module, reference: nn.Module, tol: dict) -> None:
    """In eval mode both models give the same outputs, and every scope is offloaded after."""
    model.eval()
    reference.eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tol)
    assert_all_scopes_offloaded(model)
