"""A scope's gradients taken in one loop (Note [a scope's gradients in one loop] in
engine/grads.py): the common parameters of a scope go home in one loop, and the first one that
needs more (a hook, a gradient to add to, a frozen parameter, several leaves) hands it and the
rest of the scope to the general path. Each case is trained for several steps against the plain
model, bit for bit, with the post-accumulate-grad hooks' order compared too, and checked to have
taken both ways where it should."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import devices, host, tolerances
from torch import nn

import offtensor
from offtensor.engine import grads as grads_module

CASES = ("common", "grad_hook", "post_hooks", "frozen_after_forward", "grad_to_add", "used_outside")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        # fc2.bias of the middle block, also used outside its scope in "used_outside"
        return self.head(x) + self.extra * self.blocks[1].fc2.bias.sum()


class Spy:
    """Counts what _take_common took and where it stopped; `off` makes it take nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken = 0  # slots the loop took a gradient of
        self.stopped = 0  # calls that left slots to the general path
        self.off = False
        real = grads_module._take_common

        def spy(offload, slots):
            if self.off:
                return 0
            n = real(offload, slots)
            self.stopped += n < len(slots)
            self.taken += sum(1 for s in slots[:n] if s.grads_in_backward == 1 and s in offload._written)
            return n

        monkeypatch.setattr(grads_module, "_take_common", spy)


def _setup(case: str, model: Model, order: list[str]) -> None:
    """What the case adds to one model (both get the same), before wrap (Note [gradient hooks
    registered before wrap] in dispatch/autograd.py)."""
    model.extra = 1.0 if case == "used_outside" else 0.0
    middle = model.blocks[1]
    if case == "grad_hook":
        middle.fc2.weight.register_hook(lambda g: g * 0.5)
    if case == "post_hooks":
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))


def _train(case: str, device: str, spy: Spy | None) -> list[list[str]]:
    """Train the wrapped and the plain model side by side, checked after every step; returns the
    wrapped model's order of post-accumulate-grad hooks at each step."""
    torch.manual_seed(0)
    plain = Model().to(device)
    wrapped = copy.deepcopy(plain)
    orders: tuple[list[str], list[str]] = ([], [])
    for model, order in zip((wrapped, plain), orders, strict=True):
        _setup(case, model, order)
    offtensor.wrap(wrapped, device=device, predicate=lambda name, m: isinstance(m, Block),
                   policy=offtensor.Policy(vram_budget=1 << 30))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, plain)]
    tol = tolerances(device)
    steps = []
    for step in range(4):
        x = torch.randn(4, 8, device=device)
        for opt in opts:
            opt.zero_grad(set_to_none=step != 2)
        losses = []
        for model in (wrapped, plain):
            y = model(x)
            if case == "frozen_after_forward":
                model.blocks[1].fc2.weight.requires_grad_(step % 2 == 1)
            if case == "grad_to_add" and step >= 1:
                weight = model.blocks[1].fc1.weight  # the wrapped one's master is on the host
                weight.grad = torch.ones(16, 8, device=weight.device)
            losses.append(y.square().mean())
        for loss in losses:
            loss.backward()
        for (name, p), q in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name}'s grad"
            if p.grad is not None:
                torch.testing.assert_close(host(p.grad), host(q.grad), **tol, msg=f"step {step}: {name}'s grad")
        # Every hook once, at the end of backward (Note [user gradient hooks] in dispatch/autograd.py)
        assert sorted(orders[0]) == sorted(orders[1])
        steps.append(list(orders[0]))
        orders[0].clear(), orders[1].clear()
        for opt in opts:
            opt.step()
        if case == "frozen_after_forward":
            for model in (wrapped, plain):
                model.blocks[1].fc2.weight.requires_grad_(True)
    for p, q in zip(wrapped.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(host(p.detach().clone()), host(q.detach()), **tol)
    return steps


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("case", CASES)
def test_a_scopes_gradients_match_plain_whichever_way_each_goes(device, case, monkeypatch):
    spy = Spy(monkeypatch)
    orders = _train(case, device, spy)
    assert spy.taken > 0  # the loop took the common ones
    if case in ("grad_hook", "frozen_after_forward", "grad_to_add", "used_outside"):
        assert spy.stopped > 0  # and left the middle block's rest to the general path
    spy.off = True
    assert orders == _train(case, device, spy)  # the hooks' order is the general path's
