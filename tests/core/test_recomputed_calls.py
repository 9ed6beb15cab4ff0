"""A checkpoint's recompute of a scope, inside backward, with its device copies in the modules'
attributes, as a kept scope's forward call has them (Note [calls of a loaded scope] in
engine/hooks.py): backward loads the scope whole before the recompute's first op, so its ops pay
no `__torch_function__`. Each case against the plain, unwrapped model, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CHECKPOINTING,
    WritingBlock,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    mlp_of_blocks,
    random_batch,
    small_llama,
    train_adamw,
)
from torch import nn

import offtensor
from offtensor.dispatch import param as param_module

POLICIES = {
    "kept": lambda model: offtensor.Policy(vram_budget=1 << 30),
    "streamed": lambda model: offtensor.Policy(),
    # Of six blocks, two kept (the first and the last), the others streamed.
    "budget": lambda model: offtensor.Policy(vram_budget=device_layout_bytes(model.blocks[0]) * 5),
}


@pytest.fixture
def torch_function_calls(monkeypatch):
    """The functions that reach OffloadedParameter.__torch_function__ from the test on."""
    calls: list[object] = []
    real = param_module.OffloadedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(param_module.OffloadedParameter, "__torch_function__", classmethod(counting))
    return calls


@pytest.mark.parametrize("policy", ["kept", "streamed"])
@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_a_checkpointed_backward_takes_no_torch_function(checkpoint, policy, torch_function_calls):
    # Before, a recompute in backward kept the per-op path: every op of every recompute went
    # through __torch_function__ (1360 calls per 10 steps of a small Flux LoRA step).
    model = mlp_of_blocks(n_blocks=3, checkpoint=checkpoint)
    offtensor.wrap(model, policy=POLICIES[policy](model), device="cpu")
    x, y = random_batch("cpu")
    F.mse_loss(model(x), y).backward()  # the first pass learns the copy order
    loss = F.mse_loss(model(x), y)
    torch_function_calls.clear()
    loss.backward()
    assert not torch_function_calls, torch_function_calls
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
def test_checkpointed_training_matches_unwrapped_model(checkpoint, policy, overlap):
    torch.manual_seed(0)
    model = mlp_of_blocks(n_blocks=6, checkpoint=checkpoint)
    reference = copy.deepcopy(model)
    offtensor.wrap(model, policy=POLICIES[policy](model), device="cpu")
    batches = [random_batch("cpu") for _ in range(4)]
    results = []
    for m in (reference, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        outputs, grads = [], []
        for x, y in batches:
            out = m(x)
            loss = F.mse_loss(out, y)
            if overlap and m is model:
                offtensor.backward_and_step(loss, opt).wait()
            else:
                loss.backward()
                opt.step()
            outputs.append(out.detach())
            grads += [p.grad.clone() for p in m.parameters()]
            opt.zero_grad()
        results.append((outputs, grads, [p.detach().clone() for p in m.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    assert_all_scopes_offloaded(model)
    kept = [s.kept for s in offtensor.summary(model).scopes]
    assert all(kept) if policy == "kept" else any(kept) if policy == "budget" else not any(kept), kept


@pytest.mark.parametrize("policy", ["kept", "streamed"])
def test_hugging_face_checkpointed_training_matches_unwrapped_model(policy):
    # Transformers checkpoints a decoder layer's `__call__` or, from 5.x, only its `forward`:
    # that recompute runs no module hook, and its ops keep the per-op path.
    torch.manual_seed(0)
    model = small_llama(checkpointing=True)
    reference = copy.deepcopy(model)
    budget = 1 << 30 if policy == "kept" else None
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=budget))
    batches = [torch.randint(0, 64, (2, 12)) for _ in range(3)]

    def train(m: nn.Module) -> torch.Tensor:
        return train_adamw(m, batches, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                           loss_fn=lambda m, tokens: m(input_ids=tokens, labels=tokens).loss)

    torch.testing.assert_close(train(model), train(reference), rtol=0, atol=0)
    assert_params_match(model, reference, rtol=0, atol=0)
    assert_grads_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("policy", ["kept", "streamed"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_recompute_that_runs_no_hook_takes_the_short_path_of_ops(reentrant, policy, monkeypatch):
    # Newer transformers checkpoint a decoder layer's `forward` with its hooks outside: no call
    # of the scope runs in the recompute, and each op took the general path (OpAccess.materialize,
    # finding the scope as the one whose backward runs) where the scope's copies are ready.
    from offtensor.engine import access

    torch.manual_seed(0)
    model = small_llama(checkpointing=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    budget = 1 << 30 if policy == "kept" else None
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(vram_budget=budget))
    tokens = torch.randint(0, 64, (2, 12))
    model(input_ids=tokens, labels=tokens).loss.backward()  # the first pass learns the copy order
    loss = model(input_ids=tokens, labels=tokens).loss
    general: list[str] = []
    real = access.OpAccess.materialize

    def spy(self, slot, op_device):
        general.append(slot.name)
        return real(self, slot, op_device)

    monkeypatch.setattr(access.OpAccess, "materialize", spy)
    loss.backward()
    assert not general, general
    assert_all_scopes_offloaded(model)


class CheckpointedWritingBlocks(nn.Module):
    """Three WritingBlocks, each under `checkpoint`: each write runs again in the recompute."""

    def __init__(self, form: str, checkpoint: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([WritingBlock(form) for _ in range(3)])
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpoint is None:
                x = torch.tanh(block(x))
            else:
                reentrant = self.checkpoint == "reentrant"
                x = torch.tanh(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant))
        return x


@pytest.mark.parametrize("policy", ["kept", "streamed"])
@pytest.mark.parametrize("checkpoint", CHECKPOINTING)
@pytest.mark.parametrize("form", ["data", "data=", "copy_", "setitem"])
def test_writes_in_a_recomputed_forward_reach_the_masters_like_unwrapped(form, checkpoint, policy):
    # A recompute writes the parameter again, as the plain model's does; in an exposed recompute
    # the write is made to the device copy and copied into the master at the call's end.
    torch.manual_seed(0)
    model = CheckpointedWritingBlocks(form, checkpoint)
    reference = copy.deepcopy(model)
    budget = 1 << 30 if policy == "kept" else None
    offtensor.wrap(model, lambda name, m: isinstance(m, WritingBlock), device="cpu",
                   policy=offtensor.Policy(vram_budget=budget))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    x = torch.randn(2, 4, requires_grad=True)  # reentrant checkpointing differentiates only then
    for _ in range(3):
        out, ref = model(x), reference(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        out.square().sum().backward()
        ref.square().sum().backward()
        assert_grads_match(model, reference, rtol=0, atol=0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)


class AssignsDataAfterUse(nn.Module):
    """Reads its weight, then assigns `weight.data` and reads it again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        with torch.no_grad():
            self.fc.weight.data = self.fc.weight.detach() * 0.5 + 0.125
        return self.fc(y)


@pytest.mark.parametrize("policy", ["kept", "streamed"])
def test_data_assigned_in_a_recompute_after_a_read_raises_as_a_write_to_the_master(policy):
    # `p.data = t` after an op saved the copy cannot be made as for a plain parameter (which
    # takes new storage, leaving the saved weight's view on the old): it writes the copy in place.
    # Copied into an exposed copy without bumping its version, the recompute's backward used the
    # new values silently; as a write to the master it raises (Note [writes under a saved graph]).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), AssignsDataAfterUse(), AssignsDataAfterUse())
    budget = 1 << 30 if policy == "kept" else None
    offtensor.wrap(model, lambda name, m: isinstance(m, AssignsDataAfterUse), device="cpu",
                   policy=offtensor.Policy(vram_budget=budget))
    x = torch.randn(2, 4)

    def loss() -> torch.Tensor:
        h = model[0](x)
        for block in model[1:]:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return h.square().sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss().backward()
