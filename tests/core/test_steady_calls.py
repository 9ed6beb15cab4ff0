"""Steady calls of kept scopes (Note [steady calls] in engine/engine.py): most calls of a kept
scope take a short path through the hooks, and any call where something changed takes the full
one. A seeded sequence of what a user does between and inside calls, checked bit for bit against
the plain model after every operation (NaN equal to NaN in the same place: the writing forms can
make both models diverge alike), and checked to have taken both paths."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import FuzzError, Trap, WritingBlock
from tiers import FULL
from torch import nn

import offtensor
from offtensor.engine import hooks as hooks_module
from offtensor.engine import model_hooks

FORMS = ("none", "add_", "data", "data=", "copy_", "setitem")


class Block(nn.Module):
    """A residual MLP, a WritingBlock beside it (writing its weight only while `form` says so)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.writer = WritingBlock("none")
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(torch.tanh(self.fc1(x)))
        return h + self.proj(self.writer(h[..., :4]))


class Model(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Pair:
    """The wrapped model and its plain twin, with their optimizers and traps."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.plain = Model(4)
        self.wrapped = copy.deepcopy(self.plain)
        offtensor.wrap(self.wrapped, policy=offtensor.Policy(vram_budget=1 << 30), device="cpu",
                       predicate=lambda name, m: isinstance(m, Block))
        self.models = (self.wrapped, self.plain)
        self.opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in self.models]
        self.traps = [[Trap() for _ in m.blocks] for m in self.models]
        for model, traps in zip(self.models, self.traps, strict=True):
            for block, trap in zip(model.blocks, traps, strict=True):
                block.register_forward_hook(trap)

    def both(self, fn) -> list:
        return [fn(m, i) for i, m in enumerate(self.models)]

    def check(self, outs: list, what: str) -> None:
        if outs[0] is not None:
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True, msg=what)
        for (name, p), q in zip(self.wrapped.named_parameters(), self.plain.parameters(), strict=True):
            torch.testing.assert_close(p.detach().clone(), q.detach(), rtol=0, atol=0, equal_nan=True,
                                       msg=f"{what}: {name}")
            assert (p.grad is None) == (q.grad is None), f"{what}: {name}'s grad"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True, msg=f"{what}: {name}'s grad")


def _forward(pair: Pair, x: torch.Tensor, mode: str) -> list:
    def run(model: nn.Module, i: int):
        if mode == "no_grad":
            with torch.no_grad():
                return model(x)
        if mode == "inference_mode":
            with torch.inference_mode():
                return model(x).clone()
        out = model(x)
        if mode == "train":
            out.square().sum().backward()
        return out.detach()
    return pair.both(run)


def _operation(pair: Pair, rng: random.Random, x: torch.Tensor) -> tuple[str, list]:
    """One thing a user does: a forward of some kind, a step, a write, a freeze, a failing call."""
    kind = rng.choice(["no_grad", "no_grad", "grad", "train", "train", "inference_mode", "step", "zero_grad",
                       "write_between", "form", "freeze", "raise", "eval_train", "overlapped_step"])
    b = rng.randrange(4)
    if kind == "step":
        for opt in pair.opts:
            opt.step()
        return kind, [None]
    if kind == "overlapped_step":  # steps deferred into the next forward (Note [masters held from ops])
        zero = rng.random() < 0.5
        loss = pair.wrapped(x).square().sum()
        offtensor.backward_and_step(loss, pair.opts[0], zero_grad=zero)
        pair.plain(x).square().sum().backward()
        pair.opts[1].step()
        if zero:
            pair.opts[1].zero_grad()
        return f"backward_and_step(zero_grad={zero})", [None]
    if kind == "zero_grad":
        none = rng.random() < 0.5
        for opt in pair.opts:
            opt.zero_grad(set_to_none=none)
        return kind, [None]
    if kind == "write_between":
        how = rng.choice(["data", "detach", "no_grad", "copy"])

        def write(model: nn.Module, i: int) -> None:
            p = model.blocks[b].fc1.weight
            if how == "data":
                p.data.mul_(0.9)
            elif how == "detach":
                p.detach().add_(0.01)
            elif how == "copy":
                with torch.no_grad():
                    p.copy_(p * 1.1)
            else:
                with torch.no_grad():
                    p.sub_(0.02)
        pair.both(write)
        return f"write_between {how} block {b}", [None]
    if kind == "form":
        form = rng.choice(FORMS)
        for model in pair.models:
            model.blocks[b].writer.form = form
        return f"form {form} block {b}", [None]
    if kind == "freeze":
        flag = rng.random() < 0.5
        for model in pair.models:
            model.blocks[b].fc2.requires_grad_(flag)
        return f"fc2 of block {b} requires_grad={flag}", [None]
    if kind == "eval_train":
        training = rng.random() < 0.5
        for model in pair.models:
            model.train(training)
        return f"train({training})", [None]
    if kind == "raise":
        for traps in pair.traps:
            traps[b].armed = True
        mode = rng.choice(["no_grad", "grad"])
        for model in pair.models:
            with pytest.raises(FuzzError):
                with torch.set_grad_enabled(mode == "grad"):
                    model(x)
        return f"block {b} raised ({mode})", [None]
    if kind == "inference_mode" and any(block.writer.form != "none" for block in pair.plain.blocks):
        kind = "no_grad"  # a write in inference mode makes an inference tensor of the plain parameter
    return kind, _forward(pair, x, kind)


@pytest.mark.parametrize("seed", range(12) if FULL else range(2))
@pytest.mark.parametrize("path", ["steady", "exposed"])
def test_kept_scopes_with_steady_calls_match_the_unwrapped_model_through_a_seeded_sequence(seed, path, monkeypatch):
    # "steady": exposed passes off, so that the calls take the steady path; "exposed": on
    # (Note [exposed passes] in engine/model_hooks.py), and the calls a pass cannot take steady.
    steady, ended, exposed = [0], [0], [0]
    start, end, begin = hooks_module.start_kept_call, hooks_module.end_kept_call, model_hooks.ExposedPass.begin

    def counting_start(*args):
        steady[0] += 1
        start(*args)

    def counting_end(*args):
        done = end(*args)
        ended[0] += done
        return done

    def counting_begin(self, args, kwargs):
        began = path == "exposed" and begin(self, args, kwargs)
        exposed[0] += began
        return began

    monkeypatch.setattr(hooks_module, "start_kept_call", counting_start)
    monkeypatch.setattr(hooks_module, "end_kept_call", counting_end)
    monkeypatch.setattr(model_hooks.ExposedPass, "begin", counting_begin)
    backwards = {True: 0, False: 0}  # Note [steady backward of a kept scope]: taken or not
    start_backward = hooks_module.start_kept_backward

    def counting_backward(*args):
        steady_backward = start_backward(*args)
        backwards[steady_backward] += 1
        return steady_backward

    monkeypatch.setattr(hooks_module, "start_kept_backward", counting_backward)
    rng = random.Random(seed)
    pair = Pair(seed)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
    calls = 0
    for i in range(60):
        what, outs = _operation(pair, rng, x)
        pair.check(outs, f"operation {i}: {what}")
        calls += outs[0] is not None
    # Then backward without any `p.grad` (steady past the first scope), and with (accumulation:
    # the old gradients fetched by the full path).
    for accumulate in (False, True):
        if not accumulate:
            for opt in pair.opts:
                opt.zero_grad(set_to_none=True)
        before = dict(backwards)
        pair.check(_forward(pair, x, "train"), f"train, accumulating={accumulate}")
        assert backwards[True] - before[True] == (0 if accumulate else 3), backwards
        assert backwards[False] - before[False] == (4 if accumulate else 1), backwards
    if path == "steady":
        assert calls == 0 or steady[0] > 0, "no call took the steady path"
        assert steady[0] == 0 or ended[0] > 0, "no steady call ended steady"
    else:
        assert calls == 0 or exposed[0] > 0, "no forward was an exposed pass"
    for scope in offtensor.summary(pair.wrapped).scopes:
        assert scope.kept, scope
