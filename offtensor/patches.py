"""Every process-global change offtensor makes, installed here and removable here.

# Note [process-global patches]
Some of what offtensor must see happens outside any wrapped module: a custom
`torch.autograd.Function.apply` (which no `__torch_function__` reaches), any optimizer's step
(a compiled one reads masters without a hook of ours), a parameter assigned to any module, a
gradient clip after the step it was meant for, and a fork or exit while optimizer steps are
deferred. Each is watched by one process-wide patch, made once, the first time a caller needs
it, with the caller's function: this module imports nothing of offtensor, the layers above hand
it what to call. `remove_all` undoes the patches that can be
undone (an at-fork handler cannot), for a process that is done with offtensor or a test.
"""

from __future__ import annotations

import atexit
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils.clip_grad as _clip_grad
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

PLAIN_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"].__func__
# What clip_grad_norm_ (its scaling, after the norm) and clip_grad_value_ call, looked up by name
# at each call: patched there, a clip is seen however its caller imported clip_grad_norm_.
PLAIN_CLIP_GRADS_WITH_NORM = _clip_grad._clip_grads_with_norm_
PLAIN_CLIP_GRAD_VALUE = _clip_grad.clip_grad_value_

_handles: dict[str, RemovableHandle] = {}
_at_exit: list[Callable[[], None]] = []
_forked: list[Callable[[], None]] = []


def function_apply(replacement: Callable[..., Any]) -> None:
    """`torch.autograd.Function.apply` becomes `replacement` (a classmethod's function)."""
    if torch.autograd.Function.__dict__["apply"].__func__ is PLAIN_FUNCTION_APPLY:
        setattr(torch.autograd.Function, "apply", classmethod(replacement))  # noqa: B010


def optimizer_step_hooks(before: Callable[..., Any], after: Callable[..., Any]) -> None:
    """`before(optimizer, args, kwargs)` before every optimizer's step, `after` after it (not
    after a step that raised)."""
    if "optimizer_step" not in _handles:
        _handles["optimizer_step"] = register_optimizer_step_pre_hook(before)
        _handles["optimizer_step_after"] = register_optimizer_step_post_hook(after)


def parameter_registration_hook(hook: Callable[[nn.Module, str, nn.Parameter], Any]) -> None:
    """`hook(module, name, param)` before a parameter is registered on any module."""
    if "parameter_registration" not in _handles:
        _handles["parameter_registration"] = nn.modules.module.register_module_parameter_registration_hook(hook)


def gradient_clips(check: Callable[[list[torch.Tensor], str, float], None]) -> None:
    """`check(parameters, what, bound)` before any `clip_grad_norm_` scales gradients (`bound`:
    its max_norm; `clip_grads_with_norm_` too) and before any `clip_grad_value_` (its clip_value)."""
    if _clip_grad._clip_grads_with_norm_ is not PLAIN_CLIP_GRADS_WITH_NORM:
        return

    @functools.wraps(PLAIN_CLIP_GRADS_WITH_NORM)
    def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                              foreach: bool | None = None) -> None:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        check(parameters, "clip_grad_norm_", max_norm)
        return PLAIN_CLIP_GRADS_WITH_NORM(parameters, max_norm, total_norm, foreach)

    @functools.wraps(PLAIN_CLIP_GRAD_VALUE)
    def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        check(parameters, "clip_grad_value_", clip_value)
        return PLAIN_CLIP_GRAD_VALUE(parameters, clip_value, foreach)

    _set_clips(clip_grads_with_norm_, clip_grad_value_)


def _set_clips(with_norm: Callable[..., Any], value: Callable[..., Any]) -> None:
    # torch.nn.utils re-exports both (the first as clip_grads_with_norm_): a caller may use either
    _clip_grad._clip_grads_with_norm_ = with_norm  # type: ignore[assignment]
    _clip_grad.clip_grad_value_ = value  # type: ignore[assignment]
    torch.nn.utils.clip_grads_with_norm_ = with_norm  # type: ignore[attr-defined]
    torch.nn.utils.clip_grad_value_ = value  # type: ignore[assignment]


def before_fork_and_at_exit(before_fork: Callable[[], None], at_exit: Callable[[], None]) -> None:
    """`before_fork()` before any fork (where the platform forks), `at_exit()` at exit."""
    if not _forked and hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
        _forked.append(before_fork)
        os.register_at_fork(before=lambda: [f() for f in _forked])
    if not _at_exit:
        _at_exit.append(at_exit)
        atexit.register(at_exit)


def remove_all() -> None:
    """Undo the patches: Function.apply, the gradient clips, the hooks and the exit handler (not the fork handler,
    which os cannot unregister: it calls nothing once removed)."""
    setattr(torch.autograd.Function, "apply", classmethod(PLAIN_FUNCTION_APPLY))  # noqa: B010
    _set_clips(PLAIN_CLIP_GRADS_WITH_NORM, PLAIN_CLIP_GRAD_VALUE)
    for handle in _handles.values():
        handle.remove()
    _handles.clear()
    for f in _at_exit:
        atexit.unregister(f)
    _at_exit.clear()
    _forked.clear()
