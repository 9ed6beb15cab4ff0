"""The host's work in a call of a scope with routed experts: its other parameters' copies stand in
for them in the modules (Note [calls of a loaded scope] in engine/hooks.py), an op on a routed
parameter after the router's choice is copied takes the short path of ops, and indexing still
copies the experts it reads (Note [ops in a resident scope] in dispatch/ops.py). Each case against
the plain, unwrapped model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import tiny_qwen3_moe
from torch import nn

import offtensor
from offtensor.dispatch import param as param_module

transformers = pytest.importorskip("transformers")

EXPERTS, HIDDEN = 8, 16


def _routed(p: torch.Tensor) -> bool:
    slot = getattr(p, "_ot", None)
    return slot is not None and slot.experts is not None


def _decode_step(model: nn.Module, reference: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt and two decode steps on both models; the last step's logits of each."""
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (model, reference):
        with torch.no_grad():
            out = m(ids, use_cache=True)
            for _ in range(2):
                cache = out.get("cache") if "cache" in out else out.past_key_values  # transformers >= 5.2x: `cache`
                key = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
                out = m(out.logits[:, -1:].argmax(-1), **{key: cache}, use_cache=True)
        outs.append(out.logits)
    return outs[0], outs[1]


def test_a_routed_scopes_other_parameters_take_no_torch_function_after_its_first_op(monkeypatch):
    model = tiny_qwen3_moe()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    _decode_step(model, reference)  # learns the copy orders
    ops: list[tuple[object, bool]] = []  # (function, on a routed parameter)
    real = param_module.OffloadedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        params = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, offtensor.OffloadedParameter)]
        ops.append((func, any(_routed(p) for p in params)))
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(param_module.OffloadedParameter, "__torch_function__", classmethod(counting))
    got, expected = _decode_step(model, reference)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    layers = len(model.model.layers)
    others = [func for func, routed in ops if not routed]
    # Per layer and call: the first op, which waits for the load and makes the scope resident
    # (its copies are exposed from there on); then the routed parameters' own ops
    assert len(others) <= 3 * layers, others  # the prompt and two decode steps
    assert any(routed for _, routed in ops)


def test_an_op_on_a_routed_parameter_after_the_routers_choice_is_copied_takes_the_short_path(monkeypatch):
    model = tiny_qwen3_moe()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    _decode_step(model, reference)
    general: list[object] = []  # ops on routed parameters that took the general path (OpAccess.materialize)
    real = param_module.dispatch

    def counting(func, args, kwargs, params):
        if any(_routed(p) for p in params):
            general.append(func)
        return real(func, args, kwargs, params)

    monkeypatch.setattr(param_module, "dispatch", counting)
    before = offtensor.summary(model)
    got, expected = _decode_step(model, reference)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not general, general  # grouped_mm's `w.transpose(-2, -1)`: the copy the hook filled
    after = offtensor.summary(model)
    assert sum(s.expert_misses for s in after.scopes) > sum(s.expert_misses for s in before.scopes)


class HintedExperts(nn.Module):
    """An experts module as transformers 5 writes them (its forward takes `top_k_index`), whose
    forward reads the stacked weight whole first (an op that does not index it), then indexes an
    expert the router did not choose."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        chosen = self.weight.transpose(-2, -1)[top_k_index[:, 0]]  # the router's expert per token
        other = self.weight[(int(top_k_index[0, 0]) + 1) % EXPERTS]  # one it did not choose (one token)
        return torch.einsum("th,thk->tk", x, chosen) + x @ other


class HintedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = HintedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.experts(x, self.router(x).argmax(-1, keepdim=True)))


class HintedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([HintedBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _wrapped_and_plain(model_class: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """A model wrapped on the CPU, and its unwrapped copy made before."""
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu")
    return model, reference


def _input(step: int) -> torch.Tensor:
    return torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(step))


def test_indexing_a_routed_parameter_beyond_the_routers_choice_copies_that_expert():
    model, reference = _wrapped_and_plain(HintedModel)
    with torch.no_grad():
        for step in range(6):
            x = _input(step)
            before = offtensor.summary(model).scopes
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
            after = offtensor.summary(model).scopes
            # Each block's call copies two experts: the router's, at the call's start, and the
            # one indexed after it
            assert [a.expert_misses - b.expert_misses for a, b in zip(after, before, strict=True)] == [2, 2]


class WritingBlock(HintedBlock):
    """Writes in its forward, under no_grad, once its first op made the call's copies exposed:
    its router's weight (exposed) and its routed experts' weight (not exposed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1, keepdim=True)
        with torch.no_grad():
            self.router.weight.mul_(0.9)
            self.experts.weight.add_(0.01)
        return torch.tanh(x + self.experts(x, choice))


class WritingModel(HintedModel):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([WritingBlock() for _ in range(2)])


def test_writes_in_a_routed_scopes_forward_reach_the_masters_like_unwrapped():
    model, reference = _wrapped_and_plain(WritingModel)
    with torch.no_grad():
        for step in range(4):
            x = _input(step)
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    for (name, p), q in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
