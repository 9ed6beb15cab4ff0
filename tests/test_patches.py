"""Every process-global patch goes through offtensor/patches.py: installed once by the first
wrap that needs it, undone by `remove_all`, and installed again by the next wrap."""

from __future__ import annotations

import torch
from conftest import mlp_and_reference
from torch import nn

import offtensor
from offtensor import patches
from offtensor.optim import calls


def _plain_apply() -> bool:
    return torch.autograd.Function.__dict__["apply"].__func__ is patches.PLAIN_FUNCTION_APPLY


def test_remove_all_undoes_the_patches_and_the_next_wrap_installs_them_again():
    model, _ = mlp_and_reference("cpu")  # wrapped
    assert not _plain_apply()
    assert {"optimizer_step", "parameter_registration"} <= set(patches._handles)
    try:
        patches.remove_all()
        assert _plain_apply()
        assert patches._handles == {}
        # a parameter replaced after remove_all is no longer refused (the hook is gone)
        holder = nn.Module()
        holder.weight = nn.Parameter(torch.zeros(1))
        holder.weight = nn.Parameter(torch.ones(1))
        offtensor.unwrap(model)
        model2, _ = mlp_and_reference("cpu")
        assert not _plain_apply()
        assert "parameter_registration" in patches._handles
        offtensor.unwrap(model2)
    finally:
        patches.before_fork_and_at_exit(calls._settle_before_fork, calls._settle_at_exit)


def test_installing_twice_keeps_one_patch():
    model, _ = mlp_and_reference("cpu")  # a wrap installs the optimizer step pre-hook
    assert "optimizer_step" in patches._handles
    calls_seen = []
    patches.optimizer_step_hooks(lambda *a: calls_seen.append(a), lambda *a: calls_seen.append(a))  # installed: ignored
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.step()
    assert calls_seen == []
    offtensor.unwrap(model)


def test_remove_all_restores_the_gradient_clips():
    """The clip check (Note [a clip after the step]) is installed by the first backward_and_step
    and undone by remove_all, like the other patches."""
    import torch.nn.utils.clip_grad as clip_grad

    model, _ = mlp_and_reference("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    offtensor.backward_and_step(model(torch.randn(2, 8)).sum(), opt)
    offtensor.wait_for_steps()
    assert clip_grad._clip_grads_with_norm_ is not patches.PLAIN_CLIP_GRADS_WITH_NORM
    assert torch.nn.utils.clip_grad_value_ is not patches.PLAIN_CLIP_GRAD_VALUE
    try:
        patches.remove_all()
        assert clip_grad._clip_grads_with_norm_ is patches.PLAIN_CLIP_GRADS_WITH_NORM
        assert torch.nn.utils.clip_grads_with_norm_ is patches.PLAIN_CLIP_GRADS_WITH_NORM
        assert torch.nn.utils.clip_grad_value_ is clip_grad.clip_grad_value_ is patches.PLAIN_CLIP_GRAD_VALUE
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # not refused once removed
    finally:
        patches.before_fork_and_at_exit(calls._settle_before_fork, calls._settle_at_exit)
        offtensor.unwrap(model)
