"""Gradient clipping and a GradScaler in `offtensor.backward_and_step` (Note [clipping in the
overlapped step]) train exactly as the plain recipe on the unwrapped model:
`loss.backward(); clip_grad_norm_(...); optimizer.step()`, and
`scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt);
scaler.update()`, bit for bit (rtol=0, atol=0) over several AdamW steps, on models mixing
offloaded blocks and resident parameters (the input and head Linears). A clip after a
backward_and_step, which would change nothing that matters, raises (Note [a clip after the step]).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_params_match,
    devices,
    mlp_and_reference,
    reference_then_offload,
    tolerances,
)
from torch import nn

import offtensor

EXACT = {"rtol": 0.0, "atol": 0.0}


def _batches(n: int, micro: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [[(torch.randn(4, 8), torch.randn(4, 4) * 3) for _ in range(micro)] for _ in range(n)]


def _groups(model: nn.Module) -> list[dict]:
    """Two param groups, as HF Trainer makes them (weights decayed, the rest not): the
    optimizer's order of parameters is not the model's."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("max_norm", [0.05, 1e3, float("inf")], ids=["clips", "below", "inf"])
@pytest.mark.parametrize("zero_grad", [False, True], ids=["keep_grads", "zero_grad"])
@pytest.mark.parametrize("micro", [1, 3], ids=["one_batch", "accumulated"])
def test_clipped_steps_equal_backward_clip_step(max_norm, zero_grad, micro):
    model, reference = mlp_and_reference("cpu", split=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in _batches(4, micro):
        for x, y in batch:
            (F.mse_loss(reference(x), y) / micro).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        for i, (x, y) in enumerate(batch):
            loss = F.mse_loss(model(x), y) / micro
            if i < micro - 1:
                loss.backward()
            else:
                report = offtensor.backward_and_step(loss, opt, zero_grad=zero_grad, max_grad_norm=max_norm)
        torch.testing.assert_close(report.grad_norm, ref_norm, **EXACT)
        if not zero_grad:
            opt.zero_grad()
        assert_params_match(model, reference, **EXACT)
    assert report.wait().pieces > 0  # the offloaded blocks were stepped by the worker
    assert_all_scopes_offloaded(model)


def test_clip_parameters_set_the_order_of_the_norm_as_clip_grad_norm_s_argument():
    """HF Trainer clips model.parameters() while its optimizer holds two groups in another order;
    the norm of norms depends on the order, so clip_parameters= gives clip_grad_norm_'s."""
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(_groups(reference), lr=1e-2)
    for batch in _batches(4):
        x, y = batch[0]
        F.mse_loss(reference(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True, max_grad_norm=0.05,
                                             clip_parameters=model.parameters())
        torch.testing.assert_close(report.grad_norm, ref_norm, **EXACT)
        assert_params_match(model, reference, **EXACT)


def _inf_hook(armed: list[bool]):
    def hook(p: torch.Tensor) -> None:
        if armed[0]:
            p.grad[0, 0] = float("inf")
    return hook


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("max_norm", [None, 0.05], ids=["no_clip", "clip"])
def test_grad_scaler_steps_equal_the_plain_recipe_and_skip_inf_steps(fused, max_norm):
    """The third step gets an inf gradient in an offloaded parameter: skipped (weights and
    optimizer state unchanged), the scale halved by update(), as with scaler.step."""
    model, reference = mlp_and_reference("cpu")
    armed = [False]
    for m in (model, reference):
        m.blocks[1].fc1.weight.register_post_accumulate_grad_hook(_inf_hook(armed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=fused)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for i, batch in enumerate(_batches(5)):
        x, y = batch[0]
        armed[0] = i == 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = F.mse_loss(reference(x).float(), y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(ref_opt)
        if max_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()

        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        report = offtensor.backward_and_step(scaler.scale(loss), opt, zero_grad=True, max_grad_norm=max_norm,
                                             scaler=scaler)
        scaler.update()
        assert report.step_skipped == (i == 2)
        if max_norm is not None:
            torch.testing.assert_close(report.grad_norm, ref_norm, **EXACT, equal_nan=True)
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert_params_match(model, reference, **EXACT)
        if i == 2:
            assert scaler.get_scale() == 2.0**7
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for k in state:
        for name, value in state[k].items():
            torch.testing.assert_close(value, ref_state[k][name], **EXACT)
    assert_all_scopes_offloaded(model)


def test_a_disabled_grad_scaler_steps_as_without_one():
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for batch in _batches(3):
        x, y = batch[0]
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        offtensor.backward_and_step(scaler.scale(F.mse_loss(model(x), y)), opt, zero_grad=True, scaler=scaler)
        scaler.update()
        assert_params_match(model, reference, **EXACT)


# ---- Note [a clip after the step] -------------------------------------------------------------


@pytest.mark.parametrize("zero_grad", [False, True], ids=["keep_grads", "zero_grad"])
@pytest.mark.parametrize("clip", [
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
    lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(ps, 1.0),
    lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.1),
], ids=["clip_grad_norm_", "clip_grad.clip_grad_norm_", "clip_grad_value_"])
def test_error_if_gradients_are_clipped_after_backward_and_step_used_them(clip, zero_grad):
    """Regression (issue 41): clip_grad_norm_ after backward_and_step changed gradients the step
    had already used, silently (the weights were 2.6e-2 off a clipped run after 3 steps)."""
    model, _ = mlp_and_reference("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batches(1)[0][0]
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=zero_grad)
    with pytest.raises(RuntimeError, match=r"after offtensor.backward_and_step: the optimizer step already used "
                                           r"these gradients unclipped.*Pass max_grad_norm= to backward_and_step"):
        clip(model.parameters())


def test_clips_before_a_step_and_norms_measured_after_one_are_not_refused():
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    (x, y), (x2, y2) = _batches(2)[0][0], _batches(1)[0][0]
    offtensor.backward_and_step(F.mse_loss(model(x), y), opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # a norm for logging: passes
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    # plain steps after backward_and_step, with and without zeroing in between
    for set_to_none in (False, True):
        for m, o in ((reference, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=set_to_none)
            F.mse_loss(m(x2), y2).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
        assert_params_match(model, reference, **EXACT)


# ---- errors ---------------------------------------------------------------------------------


def test_error_if_a_grad_scaler_scaled_loss_comes_without_the_scaler():
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batches(1)[0][0]
    with pytest.raises(RuntimeError, match=r"scaled by a torch.amp.GradScaler.*but no scaler= was passed.*"
                                           r"backward_and_step\(scaler.scale\(loss\), optimizer, scaler=scaler\)"):
        offtensor.backward_and_step(scaler.scale(F.mse_loss(model(x), y)), opt)
    assert_params_match(model, reference, **EXACT)


def test_error_if_the_scaler_already_unscaled_the_optimizer():
    model, _ = mlp_and_reference("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batches(1)[0][0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"scaler.unscale_\(optimizer\) was already called since the last "
                                           r"scaler.update\(\)"):
        offtensor.backward_and_step(scaler.scale(F.mse_loss(model(x), y)), opt, scaler=scaler)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler, got float"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, scaler=2.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_grad_norm": -1.0}, r"max_grad_norm must be a number >= 0.*got -1.0"),
    ({"max_grad_norm": float("nan")}, r"max_grad_norm must be a number >= 0.*got nan"),
    ({"max_grad_norm": True}, r"max_grad_norm must be a number >= 0.*got True"),
    ({"clip_parameters": []}, r"clip_parameters= is what max_grad_norm= clips; pass max_grad_norm too"),
])
def test_error_if_clipping_arguments_are_wrong(kwargs, message):
    model, reference = mlp_and_reference("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0][0]
    with pytest.raises(ValueError, match=message):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, **kwargs)
    assert_params_match(model, reference, **EXACT)


def test_error_if_a_gradient_hook_waits_for_the_steps_while_the_call_clips():
    """A post-accumulate-grad hook runs when the held gradients are published, before any step
    begins: a wait for the steps there would wait forever."""
    model, _ = mlp_and_reference("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.blocks[1].fc1.weight.register_post_accumulate_grad_hook(lambda p: offtensor.wait_for_steps())
    x, y = _batches(1)[0][0]
    with pytest.raises(RuntimeError, match=r"while the call clips or unscales the gradients.*Call it after "
                                           r"backward_and_step returns"):
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, max_grad_norm=1.0)
    assert offtensor.last_stepped() == []


class _TwoDtypes(nn.Module):
    """fp32 and bf16 blocks between resident Linears: the norm of norms groups the gradients by
    device and dtype, and its order is torch's grouping's."""

    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(8, 16)
        self.wide = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.narrow = nn.Sequential(nn.Linear(16, 16), nn.GELU()).to(torch.bfloat16)
        self.unused = nn.Linear(16, 16)  # a gradient only in some micro-batches
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use: bool = True) -> torch.Tensor:
        h = self.wide(self.input(x))
        if use:
            h = h + self.unused(h)
        return self.head(self.narrow(h.to(torch.bfloat16)).float())


def _two_dtypes(device: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = _TwoDtypes()
    reference = reference_then_offload(model, device, lambda name, m: name in ("wide", "narrow", "unused"))
    model.input.to(device)
    model.head.to(device)
    return model, reference


def _halve(p: torch.Tensor) -> None:
    p.grad.mul_(0.5)


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "hook_writes_grad"])
@pytest.mark.parametrize("device", devices)
def test_norms_taken_in_backward_give_clip_grad_norm_s_norm_of_the_unwrapped_model(device, hooked, monkeypatch):
    """Each offloaded gradient's norm is taken on the device from the sum backward copies to the
    host (Note [norms taken in backward]): the total equals clip_grad_norm_'s on the
    unwrapped model bit for bit, with two dtypes, resident parameters, a parameter whose last
    micro-batch gave no gradient, and a post-accumulate-grad hook that writes a gradient (its
    norm is taken again); the steps equal the plain recipe's."""
    from offtensor.optim.clipping import BeforeStep

    model, reference = _two_dtypes(device)
    if hooked:
        for m in (model, reference):
            m.wide[0].weight.register_post_accumulate_grad_hook(_halve)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    taken: dict[str, int] = {}
    phase = ["off"]
    plain_norm, plain_prepare = torch._foreach_norm, BeforeStep.prepare

    def spy(tensors, *args, **kwargs):
        taken[phase[0]] = taken.get(phase[0], 0) + len(tensors)
        return plain_norm(tensors, *args, **kwargs)

    def prepare(self):
        phase[0] = "after backward"
        return plain_prepare(self)

    monkeypatch.setattr(torch, "_foreach_norm", spy)
    monkeypatch.setattr(BeforeStep, "prepare", prepare)
    for step in range(3):
        batch = [(torch.randn(4, 8, device=device), torch.randn(4, 4, device=device) * 3) for _ in range(2)]
        for i, (x, y) in enumerate(batch):
            F.mse_loss(reference(x, use=i == 0).float(), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        x, y = batch[0]
        F.mse_loss(model(x, use=True).float(), y).backward()
        taken.clear()
        phase[0] = "backward"
        x, y = batch[1]
        report = offtensor.backward_and_step(F.mse_loss(model(x, use=False).float(), y), opt, zero_grad=True,
                                             max_grad_norm=0.05)
        phase[0] = "off"
        if step == 0 or device == "cpu":  # on CUDA the steps differ in the last bits (tolerances)
            torch.testing.assert_close(report.grad_norm, ref_norm, **EXACT)
        assert_params_match(model, reference, **tolerances(device, torch.bfloat16))  # bf16 in the model
        # In backward: the 6 offloaded parameters with a gradient in it. After: the 4 resident
        # ones, the unused Linear's 2 (no gradient in this backward) and the hooked one.
        assert taken == {"backward": 6, "after backward": 6 + hooked}, taken
    assert_all_scopes_offloaded(model)
