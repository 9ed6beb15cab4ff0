"""What an offloaded parameter is (shape, dtype, device, numel, requires_grad, `.grad`) reads as
for the plain parameter, without `__torch_function__` (Note [metadata without dispatch] in
dispatch/metadata.py), and `.grad` still waits for a pending optimizer step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor
from offtensor.dispatch import param as param_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.ModuleList([nn.Linear(8, 6), nn.Linear(6, 4).to(torch.float64)]))


def test_metadata_reads_as_the_plain_parameters_without_torch_function(monkeypatch):
    model = _model()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    calls = []
    real = param_module.OffloadedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(param_module.OffloadedParameter, "__torch_function__", classmethod(counting))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert isinstance(p, offtensor.OffloadedParameter)
        assert (p.shape, p.dtype, p.device, p.ndim, p.numel(), p.element_size(), p.requires_grad, p.grad) == (
            q.shape, q.dtype, q.device, q.ndim, q.numel(), q.element_size(), q.requires_grad, q.grad)
    assert not calls, calls


def test_grad_set_read_and_deleted_like_the_plain_parameter():
    model = _model()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        g = torch.randn_like(q)
        p.grad, q.grad = g.clone(), g.clone()
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        assert type(p.grad) is torch.Tensor
        del p.grad
        assert p.grad is None
        p.requires_grad = False
        assert not p.requires_grad
        p.requires_grad_(True)
        assert p.requires_grad


def _flag(p: torch.Tensor) -> bool:
    """The requires_grad flag the tensor itself holds (read in C, no subclass dispatch)."""
    return torch._C._disabled_torch_function_impl(torch._C.TensorBase.requires_grad.__get__, (), (p,))


@pytest.mark.parametrize("budget", [None, 2**30], ids=["streamed", "kept"])
def test_requires_grad_reads_the_flag_each_way_of_setting_it_left(budget):
    """`p.requires_grad` answers from the slot's copy of the master's flag: every way of setting
    the flag, inside the scope's call or outside it, a refused one included, leaves the two
    equal, and the training that follows matches the plain model's."""
    model = _model()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=budget))
    x = torch.randn(3, 8)

    def setter(p, value):
        p.requires_grad = value

    ways = [setter, lambda p, v: p.requires_grad_(v), lambda p, v: torch.Tensor.requires_grad_(p, v),
            lambda p, v: torch._C.TensorBase.requires_grad.__set__(p, v),
            lambda p, v: p.detach_() if not v else p.requires_grad_(True)]
    for way in ways:
        for value in (False, True):
            for m in (model, reference):
                way(m[0][0].weight, value)
            p = model[0][0].weight
            assert p.requires_grad is _flag(p) is value
            with torch.no_grad():
                way(p, not value)
            assert p.requires_grad is _flag(p) is (not value)
            way(p, value)
    for m in (model, reference):
        m.requires_grad_(False)
        m[0][1].requires_grad_(True)
        m[0][0].bias.requires_grad = True
    inside = []
    hook = model[0][1].register_forward_pre_hook(lambda module, args: inside.append(module.weight.requires_grad))
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad()
            m[0][1](m[0][0](x).double()).sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.requires_grad is _flag(p) is q.requires_grad
            assert (p.grad is None) is (q.grad is None)
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    hook.remove()
    assert inside == [True, True]
    with pytest.raises(RuntimeError, match="must be a bool"):
        model[0][0].weight.requires_grad = "yes"  # refused by the flag's own setter
    assert all(p.requires_grad is _flag(p) for p in model.parameters())


def test_metadata_of_an_unwrapped_parameter_is_its_own():
    model = _model()
    params = list(model.parameters())
    offtensor.wrap(model, device="cpu")
    offtensor.unwrap(model)
    for p in params:
        assert type(p) is nn.Parameter and p.device.type == "cpu" and p.numel() == p.shape.numel()


def test_grad_read_waits_for_the_deferred_step():
    """After backward_and_step, reading `.grad` or `.shape` of a parameter stepped on the worker
    gives what the plain run gives once its step is done."""
    model = _model().to(torch.float64)
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    x = torch.randn(3, 8, dtype=torch.float64)
    for _ in range(3):
        offtensor.backward_and_step(model[0][1](model[0][0](x)).square().sum(), opt)
        grads = [p.grad.clone() for p in model.parameters()]
        reference[0][1](reference[0][0](x)).square().sum().backward()
        ref_opt.step()
        for g, q in zip(grads, reference.parameters(), strict=True):
            torch.testing.assert_close(g, q.grad, rtol=0, atol=0)
        opt.zero_grad()
        ref_opt.zero_grad()
    offtensor.wait_for_steps()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
