"""What backward_and_step refuses before it changes anything, each error saying the fix: bad
arguments, a loss scaled by a GradScaler not passed as scaler=, an optimizer it cannot step in parts, a model it
cannot hand the steps of."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from ..dispatch.param import OffloadedParameter
from ..engine.engine import Engine, owning_engine


def check_call(loss: torch.Tensor, optimizer: Any, spare_threads: Any, piece_bytes: Any, device_share: Any, *,
               scaler_given: bool = False) -> None:
    """The arguments of a backward_and_step call, its defaults filled in; `scaler_given`: a
    GradScaler was passed as `scaler=`."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"offtensor.backward_and_step: loss must be the loss tensor, got a {type(loss).__name__}: "
            "pass the tensor itself (not loss.item() or a float), whose backward the call "
            "runs; nothing was stepped")
    if isinstance(spare_threads, bool) or not isinstance(spare_threads, int) or spare_threads < 0:
        raise ValueError(f"offtensor.backward_and_step: spare_threads must be an int >= 0, got {spare_threads!r}")
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 1:
        raise ValueError(f"offtensor.backward_and_step: piece_bytes must be an int >= 1, got {piece_bytes!r}")
    if isinstance(device_share, bool) or not isinstance(device_share, (int, float)) or not 0 <= device_share <= 1:
        raise ValueError(
            f"offtensor.backward_and_step: device_share must be a number from 0 to 1, got {device_share!r}")
    if not scaler_given and _scaled_by_grad_scaler(loss):
        raise RuntimeError(
            "offtensor.backward_and_step: the loss was scaled by a torch.amp.GradScaler "
            "(scaler.scale(loss)), but no scaler= was passed: the optimizer would step on the "
            "scaled gradients, an inf one too. Pass the scaler: backward_and_step(scaler.scale(loss), "
            "optimizer, scaler=scaler) unscales, skips the step on inf or NaN as scaler.step does, "
            "and clips after unscaling with max_grad_norm=; then call scaler.update()"
        )
    _check_optimizer(optimizer)


def engines_of(optimizer: torch.optim.Optimizer) -> list[Engine]:
    """The engines of the wrapped models whose offloaded parameters the optimizer holds."""
    found: dict[int, Engine] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if isinstance(p, OffloadedParameter) and hasattr(p, "_ot"):
                engine = owning_engine(p._ot)
                found[id(engine)] = engine
    return list(found.values())


def check_engines(engines: list[Engine], device_share: float) -> None:
    """The models the optimizer steps can take this call's steps."""
    budgeted = [e for e in engines if e.policy.vram_budget is not None]
    if device_share and budgeted:
        raise ValueError(
            f"offtensor.backward_and_step: device_share={device_share} steps parts of the model on the "
            f"device, which takes device memory outside the VRAM budget ({budgeted[0].policy.vram_budget} "
            "bytes) of the model's Policy; leave device_share at 0 with a VRAM budget")
    for engine in engines:
        if engine.grads.stepper is not None and not engine.grads.stepper.closed:
            raise RuntimeError("offtensor.backward_and_step: already inside a backward_and_step on this model")


# 0-dim tensors a loss was multiplied by, known to be (not to be) a GradScaler's scale: a
# scaler's `_scale` is updated in place, so one search per scaler (_scaled_by_grad_scaler).
_scales: weakref.WeakSet = weakref.WeakSet()
_not_scales: weakref.WeakSet = weakref.WeakSet()


def _scaled_by_grad_scaler(loss: torch.Tensor) -> bool:
    """`loss` is `scaler.scale(l)`, which is `l * scaler._scale` (a 0-dim float32 tensor the
    GradScaler holds). Only a loss of that form costs a search of the objects referring to the
    factor (tens of ms in a large process), once per factor tensor."""
    fn = loss.grad_fn if isinstance(loss, torch.Tensor) else None
    if fn is None or type(fn).__name__ != "MulBackward0":
        return False
    try:
        factor = fn._saved_other  # type: ignore[attr-defined]
    except RuntimeError:  # freed by an earlier backward: backward raises its own error
        return False
    if (not isinstance(factor, torch.Tensor) or factor.dim() != 0 or factor.dtype != torch.float32
            or factor.requires_grad):
        return False
    if factor in _scales:
        return True
    if factor in _not_scales:
        return False
    found = any(isinstance(r, torch.amp.GradScaler)  # an instance, or its __dict__ (Python 3.10)
                or (isinstance(r, dict) and r.get("_scale") is factor and "_growth_tracker" in r)
                for r in gc.get_referrers(factor))
    (_scales if found else _not_scales).add(factor)
    return found


def _check_optimizer(optimizer: Any) -> None:
    """The worker steps views of `optimizer` (step_subset): objects of its class sharing its
    state, each with param groups of its own. A wrapper whose `param_groups` is a property over
    another optimizer's (accelerate's AcceleratedOptimizer) would have each view overwrite the
    wrapped optimizer's groups with one piece, and every later step would step that piece only."""
    groups_are_its_own = (isinstance(optimizer, torch.optim.Optimizer)
                          and "param_groups" in getattr(optimizer, "__dict__", {})
                          and not isinstance(getattr(type(optimizer), "param_groups", None), property))
    if groups_are_its_own:
        _check_step_not_replaced(optimizer)
        return
    inner = getattr(optimizer, "optimizer", None)
    wraps = f", a wrapper around {type(inner).__name__}" if isinstance(inner, torch.optim.Optimizer) else ""
    raise TypeError(
        f"offtensor.backward_and_step: optimizer is a {type(optimizer).__name__}{wraps}, not a "
        "torch.optim.Optimizer holding its own param_groups; backward_and_step steps parts of the "
        "optimizer through views of it, which a wrapper's groups do not allow. Pass the "
        "torch.optim optimizer itself (accelerate: optimizer.optimizer), and with gradient "
        "accumulation call backward_and_step only on the micro-batch that steps "
        "(accelerator.sync_gradients, the loss divided by the accumulation steps), "
        "accelerator.backward(loss) on the others"
    )


def _check_step_not_replaced(optimizer: torch.optim.Optimizer) -> None:
    """The worker's views call the class's `step` (step_subset), so a `step` set on the optimizer
    object would be skipped without a word: `optimizer.step = torch.compile(optimizer.step)`, or a
    wrapper adding work around the step. An LR scheduler's wrapper (it only marks the optimizer as
    stepped, which step_subset does too) is the one allowed."""
    step = optimizer.__dict__.get("step")
    if step is None:
        return
    if getattr(step, "_wrapped_by_lr_sched", False) and getattr(step, "__wrapped__", None) is type(optimizer).step:
        return
    what = "torch.compile(optimizer.step)" if hasattr(step, "_torchdynamo_orig_callable") else "a wrapper"
    cls = type(optimizer).__name__
    raise TypeError(
        f"offtensor.backward_and_step: optimizer.step was replaced on the {cls} object ({what}), "
        f"which backward_and_step would bypass: it steps parts of the optimizer through {cls}.step "
        "itself. Remove the replacement (on the CPU, fused=True is the fast step), put extra work "
        "in step hooks or a subclass's step (each runs once per part), or use loss.backward(); "
        "optimizer.step()"
    )
