"""Ops inside a scope whose copy is on the device take the short path to the device copy
(Note [ops in a resident scope] in dispatch/ops.py) and compute what the unwrapped model does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor
from offtensor.dispatch import param as param_module
from offtensor.scopes import loading as loading_module


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x) + self.lin.weight.sum(0))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _general_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    calls: list[object] = []
    general = param_module.dispatch

    def counting(func, *args):  # type: ignore[no-untyped-def]
        calls.append(func)
        return general(func, *args)

    monkeypatch.setattr(param_module, "dispatch", counting)
    return calls


@pytest.mark.parametrize("policy", ["kept", "streamed"])
def test_ops_in_a_loaded_scope_skip_the_general_path_and_match_the_unwrapped_model(monkeypatch, policy):
    """After the first forward (which learns the copy order), a streamed scope's ops never take
    the general path (the op that needs a chunk of the load makes compute wait for it on the
    short path), a kept scope's at most once per call after a step rewrote its masters and never
    while they stay as they are. Outputs and gradients equal the unwrapped model's, over
    optimizer steps."""
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", 64)  # a chunk per parameter or two
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    budget = offtensor.Policy(vram_budget=1 << 30) if policy == "kept" else offtensor.Policy()
    offtensor.wrap(model, device="cpu", policy=budget)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    x = torch.randn(4, 8)
    model(x).sum().backward()  # the first forward: copy orders learned
    reference(x).sum().backward()
    calls = _general_calls(monkeypatch)
    for _ in range(3):
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        calls.clear()
        with torch.no_grad():
            out = model(x)
        assert len(calls) <= (len(model.blocks) if policy == "kept" else 0), calls
        torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
        calls.clear()
        with torch.no_grad():
            torch.testing.assert_close(model(x), out, rtol=0, atol=0)
        assert not calls, calls
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_write_through_a_detached_alias_in_the_call_is_seen_by_the_next_op():
    """`p.detach().mul_()` inside a kept scope's forward changes the master behind the short
    path's back: the next op on p must see the new values (its version differs from the
    copy's), as on the unwrapped model."""

    class Writing(Block):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            self.lin.weight.detach().mul_(0.5)
            return self.norm(h + self.lin(x))

    torch.manual_seed(0)
    model = nn.Sequential(Writing(), Writing())
    reference = copy.deepcopy(model)
    offtensor.wrap(model, lambda name, m: isinstance(m, Writing), device="cpu",
                   policy=offtensor.Policy(vram_budget=1 << 30))
    x = torch.randn(4, 8)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_a_second_handler_for_one_function_raises():
    with pytest.raises(RuntimeError, match="offtensor: two handlers for .*detach"):
        param_module.implements(torch.Tensor.detach)(lambda func, args, kwargs, params: None)
    assert param_module._TABLE[torch.Tensor.detach][0] is param_module._detach  # the first stays


@pytest.mark.parametrize("policy", ["kept", "streamed"])
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
], ids=["sgd", "adamw"])
def test_an_optimizer_step_writes_each_master_alone_and_matches_the_unwrapped_model(monkeypatch, policy, make_opt):
    """A per-tensor optimizer step writes, asks about and reads one parameter per op (Note [one
    parameter on the general path's way] in dispatch/ops.py): none of its ops takes the general
    path (weight decay's reads and AdamW's `torch.is_complex(p)` included), and the next forward
    computes with the stepped values, as the unwrapped model does, over several steps."""
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    budget = offtensor.Policy(vram_budget=1 << 30) if policy == "kept" else offtensor.Policy()
    offtensor.wrap(model, device="cpu", policy=budget)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    x = torch.randn(4, 8)
    calls = _general_calls(monkeypatch)
    for _ in range(3):
        for m in (model, reference):
            m(x).square().sum().backward()
        calls.clear()
        opt.step()
        assert not calls, calls
        ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_writes_not_alone_take_the_general_path_and_match_the_unwrapped_model(monkeypatch):
    """A write with another offloaded parameter among its arguments, a list of parameters
    (`_foreach_add_`) or `out=` takes the general path (Note [one parameter on the general path's way]), and a
    kept scope then computes with the written values."""
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=1 << 30))
    x = torch.randn(4, 8)
    for m in (model, reference):
        m(x)  # loaded and kept
    calls = _general_calls(monkeypatch)
    writes = [
        lambda m: m.blocks[0].lin.weight.add_(m.blocks[1].lin.weight, alpha=0.5),
        lambda m: torch._foreach_add_([m.blocks[1].lin.bias, m.blocks[2].norm.weight], 0.25),
        lambda m: torch.mul(m.blocks[2].lin.weight, 2.0, out=m.blocks[2].lin.weight),
        lambda m: m.blocks[0].norm.bias.copy_(m.blocks[0].lin.bias),
    ]
    for write in writes:
        calls.clear()
        with torch.no_grad():
            write(model), write(reference)
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        assert calls, "the write took the short path"
