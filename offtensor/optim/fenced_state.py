"""What of the optimizer waits for the deferred steps: its own entry points (`step`,
`state_dict`, `load_state_dict`) and its `state` (`_FencedState`).

# Note [optimizer state of deferred steps]
The optimizer's `state` is where deferred steps write (`exp_avg`, `step`, created at a
parameter's first step), so reading or changing it while they run would race them: a state
tensor read for logging a step behind or missing (a KeyError), `optimizer.state.clear()` followed
by the steps still deferred, which would start their parameters' state afresh, a deepcopy or
pickle of the optimizer missing their entries. backward_and_step therefore replaces a plain
`defaultdict` state by a `_FencedState`, a subclass holding the same entries: a parameter's
entry (`state[p]`, `p in state`, `del state[p]`) first waits for that parameter's step, and
what reads or changes the whole dict (iteration, `len`, `clear`, deepcopy, pickling: a plain
`defaultdict`) waits for every step; the optimizer worker, which is the one writing, never
waits, and neither does a gradient hook of the backward that hands the steps over (it would
wait for its own backward's end). The steps go into the state dict the optimizer had when the
call was made (`OptimizerAsOfCall.state`): one the caller puts there afterwards
(`optimizer.state = defaultdict(dict)`) starts empty, as after `optimizer.step()`. Not covered: a
state tensor taken before the call and read after it (a plain tensor, as `p.detach()` is), and a
state of another type than `defaultdict` (a custom optimizer's), which is left as it is.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any

import torch

from ..dispatch.param import OffloadedParameter
from ..dispatch.slot import on_optimizer_worker
from .calls import pending, wait_for_steps

_hooked_optimizers: weakref.WeakSet = weakref.WeakSet()


def install_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's own entry points wait for the deferred steps (once per optimizer)."""
    if optimizer in _hooked_optimizers:
        return

    def sync(opt: torch.optim.Optimizer, *_: Any) -> None:
        # Not for offtensor's own steps, which run on views of the optimizer (step_subset).
        # (A view, not a thread-local flag around the step, which an interrupt could leave set.)
        if not getattr(opt, "_offtensor_view", False):
            wait_for_steps()

    optimizer.register_step_pre_hook(sync)
    optimizer.register_state_dict_pre_hook(sync)
    optimizer.register_load_state_dict_pre_hook(sync)
    _hooked_optimizers.add(optimizer)  # last: an interrupt before here registers them again


def fence_state(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer.state` wait for the deferred steps (Note [optimizer state of deferred
    steps]); again after `load_state_dict` or the caller put a new dict there."""
    state = optimizer.state
    if type(state) is collections.defaultdict:
        optimizer.state = _FencedState(state.default_factory, state)


def _await_param(key: Any) -> None:
    if isinstance(key, OffloadedParameter) and hasattr(key, "_ot"):
        key._ot.wait_for_step()


def _await_all() -> None:
    """Wait for every deferred step, unless called inside the backward that hands them over
    (a gradient hook): that backward's steps cannot all end before it does."""
    if on_optimizer_worker():
        return
    for call in pending():
        call.close_if_abandoned()
        if call.closed:
            call.wait(from_any_thread=False)


def _fenced(name: str, *, per_key: bool) -> Any:
    """defaultdict's method `name`, run once the steps it reads or changes are done: the step of
    the parameter it is given (`per_key`), or every step."""
    method = getattr(collections.defaultdict, name)

    @functools.wraps(method)
    def fenced(self: Any, *args: Any, **kwargs: Any) -> Any:
        if per_key:
            _await_param(args[0])
        else:
            _await_all()
        return method(self, *args, **kwargs)

    return fenced


class _FencedState(collections.defaultdict):
    """An optimizer's `state` that waits for the deferred steps: Note [optimizer state of
    deferred steps]. A parameter's entry waits for that parameter's step, the whole dict for
    every step; the optimizer worker never waits."""

    def __ior__(self, other: Any) -> _FencedState:
        self.update(other)
        return self

    def __or__(self, other: Any) -> Any:
        result = self.copy()
        result.update(other)
        return result

    def copy(self) -> Any:
        _await_all()
        return collections.defaultdict(self.default_factory, dict.items(self))

    __copy__ = copy
    __hash__ = None  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # deepcopy, pickle (torch.save of the optimizer): a plain defaultdict, once stepped.
        _await_all()
        return collections.defaultdict, (self.default_factory,), None, None, iter(dict.items(self))


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "get", "pop", "setdefault"):
    setattr(_FencedState, _name, _fenced(_name, per_key=True))
for _name in ("__iter__", "__len__", "keys", "values", "items", "clear", "popitem", "update", "__eq__", "__repr__"):
    setattr(_FencedState, _name, _fenced(_name, per_key=False))
