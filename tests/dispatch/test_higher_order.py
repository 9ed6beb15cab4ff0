"""Higher-order autograd through a wrapped model: gradient penalties, hvp/jvp/hessian.

Regression: `torch.autograd.grad(y, x, create_graph=True)` followed by a second backward through
the graph it built crashed the process (exit 139): the first backward released the scopes whose
device copies the new graph had saved.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    devices,
    mlp_and_reference,
    mlp_of_blocks,
    reference_then_offload,
    tolerances,
    train_step,
)

import offtensor
from offtensor.dispatch.slot import ParamSlot


def _penalized_loss(model, x, y):
    """WGAN-GP/R1 style: the loss plus the squared norm of its gradient w.r.t. the input."""
    x = x.detach().requires_grad_(True)
    out = model(x)
    loss = F.mse_loss(out, y)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return loss + grad_x.pow(2).sum()


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gradient_penalty_trains_like_unwrapped_model(device, split, checkpoint, overlapped):
    model, reference = mlp_and_reference(device, split=split, checkpoint=checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device)
    for _ in range(3):
        x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
        loss = _penalized_loss(model, x, y)
        if overlapped:
            offtensor.backward_and_step(loss, opt)
            offtensor.wait_for_steps()
        else:
            loss.backward()
        ref_loss = _penalized_loss(reference, x, y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **tol)
        assert_grads_match(model, reference, **tol)
        if not overlapped:
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)


def _r1_loss(model, real, fake):
    """A GAN discriminator's loss with an R1 penalty built before the second forward."""
    real = real.detach().requires_grad_(True)
    d_real = model(real)
    (g,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
    d_fake = model(fake)
    return d_real.mean() - d_fake.mean() + g.pow(2).sum()


@pytest.mark.every_case
@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("overlapped", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_gradient_penalty_built_before_a_second_forward_trains_like_unwrapped_model(device, checkpoint, overlapped):
    """Regression: the penalty's create_graph backward reset every scope's count of calls that
    may still add to its gradients, though the graph it built still held the first forward's
    call; after the second forward each scope counted one call, backward_and_step stepped it on
    the first of its two contributions, and the second raised autograd's in-place error after
    most parameters were stepped."""
    model, reference = mlp_and_reference(device, checkpoint=checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(4):
        real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        _r1_loss(reference, real, fake).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        train_step(_r1_loss(model, real, fake), opt, overlap=overlapped)
        assert_params_match(model, reference, **tolerances(device))
        assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("policy", ["streamed", "split"])
def test_gradients_of_a_penalty_built_before_a_second_forward_are_bit_for_bit(device, policy, checkpoint):
    """Regression: the second forward differentiated new device copies of each block (the
    penalty's graph held the first ones), so each parameter had two leaves whose sums the host
    added: (a + b) + c where autograd adds (a + c) + b. Before each step, so that no optimizer
    can round the difference away (AdamW often did)."""
    model, reference = mlp_and_reference(device, split=policy == "split", checkpoint=checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    for _ in range(6):
        real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        _r1_loss(reference, real, fake).backward()
        _r1_loss(model, real, fake).backward()
        assert_grads_match(model, reference, **tolerances(device))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_a_parameter_unfrozen_after_its_copy_was_retired_gets_its_gradient(device):
    """Regression: a kept scope released by backward_and_step under no_offload (its copies
    retired under the penalty's graph), its frozen parameter then unfrozen: the next load took
    back the retired copy, frozen, after the scope's call had set its copies' flags, so the first
    micro-batch's gradient of that parameter was lost (Note [requires_grad changes])."""
    model = mlp_of_blocks(n_blocks=3)
    model.blocks[1].fc1.bias.requires_grad_(False)
    policy = offtensor.Policy(vram_budget=2**40, param_filter=offtensor.frozen_only)
    reference = reference_then_offload(model, device, policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    with offtensor.no_offload(model):
        offtensor.backward_and_step(_r1_loss(model, real, fake), opt, zero_grad=True)
    offtensor.wait_for_steps()
    _r1_loss(reference, real, fake).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    for m in (model, reference):
        m.blocks[1].fc1.bias.requires_grad_(True)
    for _ in range(2):
        real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        for m in (model, reference):
            _r1_loss(m, real, fake).backward()
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("at", [0, 1, 3])
def test_an_interrupt_in_a_take_back_leaves_the_next_steps_like_unwrapped(device, at, monkeypatch):
    """A take-back switches the slots' copies one by one. Interrupted after `at` of them, the
    next load gives the switched ones new copies in the scope's storage again (else they kept
    the retired storage, which no later load writes: stale after the step below)."""
    model, reference = mlp_and_reference(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    switched = []
    take_back = ParamSlot.take_back_device_copy

    def interrupted(slot, *args):
        if len(switched) == at:
            raise KeyboardInterrupt
        switched.append(slot)
        return take_back(slot, *args)

    monkeypatch.setattr(ParamSlot, "take_back_device_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _r1_loss(model, torch.randn(4, 8, device=device), torch.randn(4, 8, device=device))
    monkeypatch.undo()
    for step in range(4):  # without a penalty first: no retire to replace the switched copies
        real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        for m in (model, reference):
            loss = _r1_loss(m, real, fake) if step >= 2 else m(real).pow(2).mean()
            loss.backward()
        assert_grads_match(model, reference, **tolerances(device))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert_params_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("write", ["no_grad", "detached alias"])
def test_a_write_between_a_penalty_and_the_next_forward_reaches_that_forward(device, write):
    """The second forward reads the masters as written after the penalty's graph was built
    (its copies of the first are not taken back), as a plain model reads its parameters. The
    alias is taken before the graph: only the master's version tells the write through it."""
    model, reference = mlp_and_reference(device)
    outs = []
    for m in (reference, model):
        weight = m.blocks[1].fc1.weight
        alias = weight.detach()
        real = torch.randn(4, 8, device=device, requires_grad=True)
        (g,) = torch.autograd.grad(m(real).sum(), real, create_graph=True)
        if write == "no_grad":
            with torch.no_grad():
                weight.mul_(1.5)
        else:
            alias.mul_(1.5)
        with torch.no_grad():
            outs.append(m(torch.ones(4, 8, device=device)))
        del g
    torch.testing.assert_close(outs[1], outs[0], **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_gradient_penalty_through_reentrant_checkpointing_raises_as_unwrapped(device):
    """Reentrant checkpointing does not support torch.autograd.grad, with or without offtensor."""
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device)
    model.checkpoint = reference.checkpoint = "reentrant"
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 4, device=device)
    with pytest.raises(RuntimeError, match="[Cc]heckpoint"):
        _penalized_loss(reference, x, y)
    with pytest.raises(RuntimeError, match="[Cc]heckpoint"):
        _penalized_loss(model, x, y)
    model.checkpoint = None
    _penalized_loss(model, x, y).backward()  # still usable
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("fn", ["hvp", "vhp", "jvp", "hessian"])
def test_autograd_functional_matches_unwrapped_model(device, fn):
    model = mlp_of_blocks(n_blocks=2, in_features=3, out_features=2)
    reference = reference_then_offload(model, device)
    x = torch.randn(3, device=device)
    v = torch.randn(3, device=device)
    tol = tolerances(device)

    def run(m):
        scalar = lambda t: m(t.unsqueeze(0)).pow(2).sum()
        vector = lambda t: m(t.unsqueeze(0)).squeeze(0)
        if fn == "hvp":
            return torch.autograd.functional.hvp(scalar, x, v)
        if fn == "vhp":
            return torch.autograd.functional.vhp(scalar, x, v)
        if fn == "jvp":
            return torch.autograd.functional.jvp(vector, x, v)
        return torch.autograd.functional.hessian(scalar, x)

    torch.testing.assert_close(run(model), run(reference), **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_kept_graph_used_after_an_optimizer_step_raises_autograds_inplace_error(device):
    """As without offloading: stepping the weights invalidates a graph that saved them."""
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device)
    for m in (reference, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        (gx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        opt.step()  # no grads yet: SGD skips; write the weights directly instead
        with torch.no_grad():
            for p in m.blocks.parameters():
                p.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            gx.pow(2).sum().backward()
    # The model recovers: a fresh step runs and releases everything.
    F.mse_loss(model(torch.randn(4, 8, device=device)), torch.randn(4, 4, device=device)).backward()
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_backward_with_create_graph_into_offloaded_grads_raises_naming_offtensor(device):
    model = mlp_of_blocks(n_blocks=2)
    offtensor.wrap(model, device=device)
    model.to(device)
    loss = model(torch.randn(4, 8, device=device)).pow(2).sum()
    with pytest.raises(RuntimeError, match=r"offtensor: backward\(create_graph=True\).*'blocks\.\d\."):
        loss.backward(create_graph=True)
    # Still usable afterwards.
    model(torch.randn(4, 8, device=device)).sum().backward()
    assert_all_scopes_offloaded(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("penalty", ["wgan-gp", "r1"])
def test_gradient_penalty_steps_leave_no_device_memory_behind(penalty):
    """Retired device storages go with the graphs that held them: memory does not grow, and
    between steps no more than a block's bytes stay (the R1 penalty's second forward takes the
    retired copies back: Note [retired copies taken back])."""
    model = mlp_of_blocks(n_blocks=3, hidden=256)
    offtensor.wrap(model, device="cuda")
    model.to("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    allocated = []
    for _ in range(4):
        x = torch.randn(4, 8, device="cuda")
        if penalty == "wgan-gp":
            loss = _penalized_loss(model, x, torch.randn(4, 4, device="cuda"))
        else:
            loss = _r1_loss(model, x, torch.randn(4, 8, device="cuda"))  # real, fake
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert_all_scopes_offloaded(model)
    assert allocated[-1] == allocated[1], allocated
    assert allocated[-1] - before < device_layout_bytes(model.blocks[0]), (before, allocated)


@pytest.mark.parametrize("device", devices)
def test_a_gradient_penalty_step_leaves_no_retired_copy_alive(device):
    """Regression: the plan that exposes a scope's copies in its calls kept the copies a release
    retired, and with them their storage, after the graphs let go of them: with the R1 penalty,
    whose second forward takes retired copies back, the whole model's device copies stayed
    between steps."""
    model, _ = mlp_and_reference(device)
    for _ in range(2):
        real, fake = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
        _r1_loss(model, real, fake).backward()
    gc.collect()
    alive = [str(slot) for scope in model._offtensor_engine.scopes for slot in scope.slots
             if any(ref() is not None for ref in slot.retired)]
    assert not alive, alive
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_kept_graph_used_after_backward_and_step_raises_autograds_inplace_error(device):
    """Review finding: the optimizer worker's steps did not invalidate a kept graph, which then
    silently used the old weights (the unwrapped model raises)."""
    model = mlp_of_blocks(n_blocks=2)
    reference = reference_then_offload(model, device)
    for m in (reference, model):
        opt = torch.optim.SGD(m.blocks.parameters(), lr=0.1)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        (gx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        loss = m(torch.randn(4, 8, device=device)).pow(2).sum()
        if m is model:
            offtensor.backward_and_step(loss, opt, zero_grad=True)
            offtensor.wait_for_steps()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            gx.pow(2).sum().backward()
