"""Eager calls of a scope whose copy is loaded before the call (a kept scope): its device copies
stand in for its parameters in the modules for the call, so its ops take no
`__torch_function__`, and writes to them in the forward reach the masters (Note [calls of a
loaded scope] in engine/hooks.py). Each case against the plain, unwrapped model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import BlocksOf, WritingBlock, copy_of
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


def _wrapped_and_plain(build, policy=KEPT, predicate=None):
    """The model `build` gives (seed 0), wrapped on the CPU with `policy`, and its plain copy."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    offtensor.wrap(model, predicate, policy=policy, device="cpu")
    return model, reference


FREEZES = {
    "requires_grad_": lambda m, flag: m.blocks[1].fc.weight.requires_grad_(flag),
    "property": lambda m, flag: setattr(m.blocks[1].fc.bias, "requires_grad", flag),
    "module": lambda m, flag: m.blocks[2].requires_grad_(flag),
}


@pytest.mark.parametrize("how", list(FREEZES))
def test_freezing_and_unfreezing_between_calls_of_a_kept_scope_gives_the_unwrapped_grads(how):
    # A kept scope's call matches its copies' requires_grad to the parameters' only after a
    # change (Note [requires_grad changes] in dispatch/ops.py): each change must be seen.
    model, reference = _wrapped_and_plain(lambda: Blocks("none"))
    x = torch.randn(2, 4)
    for flag in (True, False, False, True, False, True):
        FREEZES[how](model, flag)
        FREEZES[how](reference, flag)
        model.zero_grad()
        reference.zero_grad()
        out, ref = model(x), reference(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        out.square().sum().backward()
        ref.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert p.requires_grad == q.requires_grad, name
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


WRITES = {
    "detached": lambda p: p.detach().mul_(2),
    "data": lambda p: p.data.add_(1),
    "view": lambda p: p[0].fill_(3),
}


@pytest.mark.parametrize("how", list(WRITES))
def test_writes_between_calls_of_a_kept_scope_that_bypass_the_parameter_are_seen(how):
    # Seen by the masters' versions, read once per scope (Note [one version read per scope] in
    # scopes/write_tracking.py), or through the `.data` aliases noted.
    model, reference = _wrapped_and_plain(lambda: Blocks("none"))
    x = torch.randn(2, 4)
    for i in range(4):
        with torch.no_grad():
            if i:
                WRITES[how](model.blocks[i % 3].fc.weight)
                WRITES[how](reference.blocks[i % 3].fc.weight)
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)  # unwritten since


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.a(x) + self.b(y)), self.b(x) * self.a(y)


class TwoOutputBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TwoOutputs() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.flip(0)
        for block in self.blocks:
            x, y = block(x, y)
        return x, y


@pytest.mark.parametrize("policy", [KEPT, offtensor.Policy()], ids=["kept", "streamed"])
def test_a_scope_with_two_outputs_differentiated_in_separate_backwards_gives_the_unwrapped_grads(policy):
    # The first output gradient of each backward (graph task) starts the scope's backward; the
    # other output's hook in the same backward finds it started (hooks.py, _FirstOutputGrad).
    model, reference = _wrapped_and_plain(TwoOutputBlocks, policy)
    x = torch.randn(2, 4)
    for _ in range(2):
        (a, b), (ra, rb) = model(x), reference(x)
        a.sum().backward(retain_graph=True)
        ra.sum().backward(retain_graph=True)
        b.square().sum().backward()
        rb.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        (a2, b2), (ra2, rb2) = model(x), reference(x)
        (a2 * b2).sum().backward()
        (ra2 * rb2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    assert all(s.device_bytes == 0 for s in offtensor.summary(model).scopes if not s.kept)


class Interrupting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.stop = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        if self.stop:
            raise KeyboardInterrupt("test: Ctrl-C in a block's forward")
        return self.fc(y)



@pytest.mark.parametrize("policy", [KEPT, offtensor.Policy()], ids=["kept", "streamed"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_model_whose_call_an_interrupt_ended_trains_like_the_unwrapped_model(policy, how):
    # Ctrl-C in a call leaves its copies in the modules' attributes until the next call; a
    # copy made before that must not keep them beside the parameters (Note [copies of an
    # exposed call] in dispatch/device_copies.py): the copy's forward would read one and step the other.
    model, reference = _wrapped_and_plain(lambda: BlocksOf(Interrupting), policy)
    x = torch.randn(2, 4)
    model(x).sum().backward()  # learns the copy order: the next calls expose their copies
    model.zero_grad()
    model.blocks[1].stop = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    model.blocks[1].stop = reference.blocks[1].stop = False
    copied = copy_of(model, how)
    _trains_like(copied, reference, x)
    torch.testing.assert_close(model(x), BlocksOf.forward(copy.deepcopy(model), x), rtol=0, atol=0)


@pytest.mark.parametrize("policy", [KEPT, offtensor.Policy()], ids=["kept", "streamed"])
def test_unwrap_after_a_call_an_interrupt_ended_leaves_plain_parameters(policy):
    # Ctrl-C in a call leaves its copies in the modules' attributes until offtensor next looks
    # (Note [writes after an interrupt] in engine/hooks.py). Regression: unwrap left them there,
    # so the unwrapped modules computed with device copies whose memory was freed.
    model, reference = _wrapped_and_plain(lambda: BlocksOf(Interrupting), policy)
    x = torch.randn(2, 4)
    model(x).sum().backward()  # learns the copy order: the next calls expose their copies
    model.zero_grad()
    model.blocks[1].stop = True
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(x)
    model.blocks[1].stop = reference.blocks[1].stop = False
    offtensor.unwrap(model)
    _trains_like(model, reference, x)


def _trains_like(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """`model`'s blocks hold plain parameters, and two SGD steps leave it computing as `reference`."""
    for block in model.blocks:
        assert block.fc.weight is block.fc._parameters["weight"] and type(block.fc.weight) is nn.Parameter
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    for _ in range(2):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


class ParameterWriting(nn.Module):
    """Writes its parameters in its forward through `self.parameters()`, not its attributes."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))  # a streamed scope's copies are exposed from its first op on
        with torch.no_grad():
            for p in self.parameters():
                if self.form == "mul_":
                    p.mul_(0.5)
                elif self.form == "data":
                    p.data.mul_(0.5)
                elif self.form == "detach":
                    p.detach().mul_(0.5)
                else:  # "data="
                    p.data = p.detach() * 0.5 + 0.125
        return self.fc(y)


@pytest.mark.parametrize("policy", [KEPT, offtensor.Policy()], ids=["kept", "streamed"])
@pytest.mark.parametrize("form", ["mul_", "data", "detach", "data="])
def test_writes_through_the_parameters_in_their_scopes_forward_give_the_unwrapped_outputs(policy, form):
    # Regression: with the copies exposed, such a write went to the master only, and the
    # rest of the call read the stale copy (a wrong output for `detach`, a crash or a refusal
    # for the others): Note [writes through the parameter in an exposed call] (engine/hooks.py).
    model, reference = _wrapped_and_plain(lambda: nn.Sequential(*(ParameterWriting(form) for _ in range(3))),
                                          policy, lambda name, m: isinstance(m, ParameterWriting))
    x = torch.randn(2, 4)
    for _ in range(3):  # without grad: the plain model's backward would refuse the write too
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)


class Keeping(nn.Module):
    """Keeps what its forward reads as `self.fc.weight` (a kept scope's exposed copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.fc.weight)
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_kept_from_an_exposed_call_copies_as_its_values_after_the_call(how):
    # Outside its scope's calls an exposed copy kept by module code is a tensor of the values
    # it had (docs/design.md, Limits): it copies and pickles as an nn.Parameter of them, without
    # offtensor's marks (a weak reference among them would not pickle), and not as the parameter
    # (Note [copies of an exposed call] in dispatch/device_copies.py).
    model, _ = _wrapped_and_plain(lambda: BlocksOf(Keeping), KEPT)
    x = torch.randn(2, 4)
    for _ in range(3):  # the first calls learn the copy order; later ones expose the copies
        model(x).sum().backward()
    kept = model.blocks[1].seen[-1]
    param = model.blocks[1].fc._parameters["weight"]
    assert kept is not param and type(param) is param_module.OffloadedParameter
    copied = copy_of(kept, how)
    assert isinstance(copied, nn.Parameter) and copied is not param
    assert not any(k.startswith("_ot_") for k in copied.__dict__)
    torch.testing.assert_close(copied.detach(), param.detach(), rtol=0, atol=0)
