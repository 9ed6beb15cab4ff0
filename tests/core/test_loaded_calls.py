"""Eager calls of a scope whose copy is loaded before the call (a kept scope): its device copies
stand in for its parameters in the modules for the call, so its ops take no
`__torch_function__`, and writes to them in the forward reach the masters (Note [calls of a
loaded scope] in engine/hooks.py). Each case against the plain, unwrapped model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import WritingBlock
from torch import nn

import offtensor
from offtensor.dispatch import param as param_module

KEPT = offtensor.Policy(vram_budget=1 << 30)


class CheckingBlock(WritingBlock):
    """A WritingBlock that checks what its weight is, as module code does, and ends in tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fc.weight
        assert isinstance(w, nn.Parameter) and w.dtype == x.dtype and w.shape == (4, 4)
        return torch.tanh(super().forward(x))


class Blocks(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CheckingBlock(form) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("form", ["none", "add_", "data", "data=", "copy_", "setitem"])
def test_writes_in_a_kept_scopes_forward_reach_the_masters_like_unwrapped(form):
    torch.manual_seed(0)
    model = Blocks(form)
    reference = copy.deepcopy(model)
    offtensor.wrap(model, policy=KEPT, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for scope in offtensor.summary(model).scopes:
        assert scope.kept, scope


def test_ops_in_a_kept_scope_take_no_torch_function_after_the_first_pass(monkeypatch):
    torch.manual_seed(0)
    model = Blocks("none")
    reference = copy.deepcopy(model)
    offtensor.wrap(model, policy=KEPT, device="cpu")
    x = torch.randn(2, 4)
    model(x).sum().backward()  # the first pass learns the copy order
    calls: list[object] = []
    real = OffloadedTorchFunction = param_module.OffloadedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return OffloadedTorchFunction(cls, func, types, args, kwargs)

    monkeypatch.setattr(param_module.OffloadedParameter, "__torch_function__", classmethod(counting))
    with torch.no_grad():
        out = model(x)
    assert not calls, calls
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert real is OffloadedTorchFunction


def test_a_forward_that_raises_in_a_kept_scope_puts_the_parameters_back():
    torch.manual_seed(0)
    model = Blocks("add_")
    reference = copy.deepcopy(model)
    offtensor.wrap(model, policy=KEPT, device="cpu")
    x = torch.randn(2, 4)
    model(x)
    reference(x)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))
    with pytest.raises(RuntimeError):
        reference(torch.randn(2, 5))
    for m in model.modules():
        for p in m._parameters.values():
            assert isinstance(p, offtensor.OffloadedParameter)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
