"""A backward that raises leaves nothing on the device and the gradients plain autograd leaves.

Issue 41, items 3 and 4: when `loss.backward()` raised (a tensor hook at the 3rd of 5 scopes, an
error inside a checkpoint's recompute), one or two scopes stayed RESIDENT and the prefetched one
LOADING (every scope with keep_for_backward=True), surviving gc.collect() until the next forward;
and the fresh gradients of the blocks whose backward had run were lost (`.grad` None where plain
autograd had set it). Now the autograd engine's drop of the failed graph task releases them,
before the exception reaches the caller, and publishes those gradients (Note [a backward that
raised], Note [gradients of a backward that raised] in engine/grads.py).

Each test runs the unwrapped model (a copy made before wrap) under the same failure and
compares exactly (rtol=atol=0, on the CPU).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    mlp_of_blocks,
)

import offtensor

N_BLOCKS = 5
FAILING = 2  # the 3rd of the 5 scopes' backward raises
EXACT = dict(rtol=0, atol=0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one intra-op thread is fastest, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class InjectedFailure(RuntimeError):
    pass


def _fail(*args: object) -> None:
    raise InjectedFailure("injected failure in backward")


def _fail_in_recompute(module: torch.nn.Module, inputs: tuple, output: object) -> None:
    if torch._C._current_graph_task_id() != -1:  # the checkpoint's recompute, inside backward
        raise InjectedFailure("injected failure in a recompute")


def _policy(policy: str, model: torch.nn.Module) -> offtensor.Policy:
    if policy == "keep_for_backward":
        return offtensor.Policy(keep_for_backward=True)
    if policy == "kept":  # a VRAM budget keeping two of the five blocks, streaming the rest
        block = device_layout_bytes(model.blocks[0])
        return offtensor.Policy(layout="spread", vram_budget=(2 + 1 + 2) * block)
    return offtensor.Policy()


def _model_and_reference(policy: str, checkpoint: str | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = mlp_of_blocks(n_blocks=N_BLOCKS, checkpoint=checkpoint)
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu", policy=_policy(policy, model))
    return model, reference


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _failing_backward(model: torch.nn.Module, batch, where: str) -> None:
    """A forward, then a backward that raises at the 3rd scope's backward (`where`: a gradient
    hook on one of its weights, or its recompute under checkpointing), or after every scope's
    (`after_the_scopes`: a hook on the input Linear, whose backward comes last)."""
    block = model.blocks[FAILING]
    if where == "recompute":
        handle = block.fc1.register_forward_hook(_fail_in_recompute)
    elif where == "after_the_scopes":
        handle = model.input.weight.register_hook(_fail)
    else:
        handle = block.fc1.weight.register_hook(_fail)
    try:
        loss = _loss(model, batch)
        with pytest.raises(InjectedFailure):
            loss.backward()
    finally:
        handle.remove()


def _assert_nothing_left_on_the_device(model: torch.nn.Module, policy: str) -> None:
    """Every scope OFFLOADED with 0 device bytes, but those the budget keeps (their normal
    state): resident with exactly their weights. Nothing carried into the next forward."""
    for s in offtensor.summary(model).scopes:
        assert not s.carried, f"{s.name} is carried after a backward that raised"
        if policy == "kept" and s.kept:
            continue
        assert s.state == offtensor.ScopeState.OFFLOADED, f"{s.name} is {s.state} after a backward that raised"
        assert s.device_bytes == 0, f"{s.name} still holds {s.device_bytes} device bytes"


def _assert_trains_like_reference(model, reference, batch) -> None:
    """The model stays usable: a further step (forward, backward, AdamW) equals the unwrapped one."""
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(2):
        loss, ref_loss = _loss(model, batch), _loss(reference, batch)
        torch.testing.assert_close(loss, ref_loss, **EXACT)
        loss.backward()
        ref_loss.backward()
        assert_grads_match(model, reference, **EXACT)
        opt.step()
        ref_opt.step()
        assert_params_match(model, reference, **EXACT)
        opt.zero_grad()
        ref_opt.zero_grad()


CASES = [
    pytest.param("hook", None, id="hook"),
    pytest.param("hook", "reentrant", id="hook-reentrant"),
    pytest.param("hook", "non_reentrant", id="hook-non_reentrant"),
    pytest.param("recompute", "reentrant", id="recompute-reentrant"),
    pytest.param("recompute", "non_reentrant", id="recompute-non_reentrant"),
]


@pytest.mark.parametrize("policy", ["streamed", "keep_for_backward", "kept"])
@pytest.mark.parametrize(("where", "checkpoint"), CASES)
def test_a_backward_that_raised_leaves_nothing_on_the_device_and_the_gradients_autograd_leaves(
        where, checkpoint, policy):
    model, reference = _model_and_reference(policy, checkpoint)
    batch = torch.randn(4, 8), torch.randn(4, 4)
    for m in (model, reference):  # learn the orders: the failing backward prefetches
        _loss(m, batch).backward()
        m.zero_grad(set_to_none=True)

    gc.disable()  # released as the exception leaves backward(), not by a later collection
    try:
        for m in (reference, model):
            _failing_backward(m, batch, where)
        _assert_nothing_left_on_the_device(model, policy)
    finally:
        gc.enable()
    assert sum(p.grad is not None for p in reference.parameters()) > 2  # later blocks got theirs
    assert_grads_match(model, reference, **EXACT)
    _assert_trains_like_reference(model, reference, batch)


@pytest.mark.parametrize("policy", ["streamed", "kept"])
def test_a_backward_that_raised_after_every_scope_releases_what_it_carried(policy):
    """Under a budget, a backward leaves the scopes the next forward starts with resident
    (carried); one that raised after their backward must not."""
    model, reference = _model_and_reference(policy, None)
    batch = torch.randn(4, 8), torch.randn(4, 4)
    for m in (model, reference):
        _loss(m, batch).backward()
        m.zero_grad(set_to_none=True)
    for m in (reference, model):
        _failing_backward(m, batch, "after_the_scopes")
    _assert_nothing_left_on_the_device(model, policy)
    assert_grads_match(model, reference, **EXACT)
    _assert_trains_like_reference(model, reference, batch)


@pytest.mark.parametrize(("where", "checkpoint"), CASES)
def test_a_backward_that_raised_while_accumulating_leaves_the_gradients_autograd_leaves(where, checkpoint):
    """With `.grad` already set (gradient accumulation), the blocks whose backward ran before the
    failure hold old + new, the others the old gradient, as plain autograd leaves them."""
    model, reference = _model_and_reference("streamed", checkpoint)
    batch = torch.randn(4, 8), torch.randn(4, 4)
    for m in (model, reference):
        _loss(m, batch).backward()  # the first micro-batch
    for m in (reference, model):
        _failing_backward(m, batch, where)
    _assert_nothing_left_on_the_device(model, "streamed")
    assert_grads_match(model, reference, **EXACT)
    _assert_trains_like_reference(model, reference, batch)


def test_a_retained_graph_differentiated_again_after_a_failure_gives_every_gradient():
    """The failed backward is finalized as it raises: differentiating its retained graph again
    gives the plain model's gradients and leaves nothing on the device."""
    model, reference = _model_and_reference("streamed", None)
    batch = torch.randn(4, 8), torch.randn(4, 4)
    for m in (model, reference):
        _loss(m, batch).backward()
        m.zero_grad(set_to_none=True)
    for m in (reference, model):
        loss = _loss(m, batch)
        handle = m.blocks[FAILING].fc1.weight.register_hook(_fail)
        with pytest.raises(InjectedFailure):
            loss.backward(retain_graph=True)
        handle.remove()
        loss.backward()
    _assert_nothing_left_on_the_device(model, "streamed")
    assert_grads_match(model, reference, **EXACT)
    _assert_trains_like_reference(model, reference, batch)


def _fail_on_output_grad(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    if output.requires_grad:
        output.register_hook(_fail)


# Reentrant checkpointing refuses torch.autograd.grad.
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_a_torch_autograd_grad_that_raised_leaves_nothing_on_the_device(checkpoint):
    """Not only `loss.backward()`: any call into the autograd engine that raises (here
    `torch.autograd.grad`, failing in the 3rd scope's backward or recompute) releases what it
    loaded."""
    model, reference = _model_and_reference("streamed", checkpoint)
    batch = torch.randn(4, 8), torch.randn(4, 4)
    for m in (model, reference):
        _loss(m, batch).backward()
        m.zero_grad(set_to_none=True)
    fail = _fail_on_output_grad if checkpoint is None else _fail_in_recompute
    handle = model.blocks[FAILING].fc1.register_forward_hook(fail)
    loss = _loss(model, batch)
    with pytest.raises(InjectedFailure):
        torch.autograd.grad(loss, [model.input.weight])
    handle.remove()
    _assert_nothing_left_on_the_device(model, "streamed")
    assert all(p.grad is None for p in model.parameters())
    _assert_trains_like_reference(model, reference, batch)


def test_a_backward_interrupted_while_adding_a_scopes_gradients_publishes_none_it_did_not_copy(monkeypatch):
    """A scope's gradients are added at the end of its backward, as one batch (Note [one pass
    per scope's gradients] in engine/grads.py). An exception there (an interrupt, an
    out-of-memory error) must leave `.grad` unset on a parameter whose gradient was not copied
    yet, not pointing at its reused buffer, which still holds the last step's gradient."""
    from offtensor.engine import host_grads

    model, reference = _model_and_reference("streamed", None)
    first, second = (torch.randn(4, 8), torch.randn(4, 4)), (torch.randn(4, 8), torch.randn(4, 4))
    _loss(model, first).backward()
    model.zero_grad(set_to_none=True)  # the buffers stay, for the next backward to reuse
    real, batches = host_grads.CopiesHome.copy, []

    def failing(self, batch):
        batches.append([slot for slot, _, _ in batch])
        if len(batches) == 2:  # the second scope's batch, its destinations all taken
            raise InjectedFailure("injected failure while adding a scope's gradients")
        return real(self, batch)

    monkeypatch.setattr(host_grads.CopiesHome, "copy", failing)
    with pytest.raises(InjectedFailure):
        _loss(model, second).backward()
    monkeypatch.undo()
    _loss(reference, second).backward()
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:  # published: this backward's gradient, whole
            torch.testing.assert_close(p.grad, ref[name].grad, **EXACT)
    assert all(slot.param.grad is None for slot in batches[1])  # in the batch that raised: never copied
    assert all(slot.param.grad is not None for slot in batches[0])  # the scope before: published
    _assert_nothing_left_on_the_device(model, "streamed")
    _assert_trains_like_reference(model, reference, first)
