"""Part of an optimizer's step: `step_subset` steps some of its parameters through a view of it,
starting from the optimizer as a backward_and_step call found it (`OptimizerAsOfCall`).

# Note [param groups as of the call]
A deferred step is part of the `optimizer.step()` that backward_and_step stands for, so it
steps each parameter with its group as the group was when the call was made, whatever the
caller does to `param_groups` before the worker gets to it: an LR scheduler writing `lr` (a
tensor lr in place), a group popped or its `params` list cut to freeze layers. The call copies
each group's entries (tensors by value) and its list of parameters; the views the worker steps
are built from those copies. Looked up in the groups as they are at the step, a popped group
would give its hyperparameters to the next one, and parameters taken out of their group would
never be stepped.

# Note [attributes the optimizer's step sets]
An attribute that the optimizer's own `step` sets on `self` (a user's class counting steps in
`self.t += 1`) would be set on a view and dropped, and running the parts on the optimizer itself
would count parts, not steps. So each view starts from the optimizer's attributes as of the call
(`Attributes`), and what its step rebinds, adds or deletes is written back: every part computes
the same `t + 1`, as the one `step()` would. A value that depends on the parameters stepped (a
gradient norm of them) differs between parts and is no part's to keep: the second part to differ
raises, naming the class and the attribute (a partial step, Note [partial steps]). For a class
of the user's the call returns once a part has written back, so the attribute reads as after
`step()`. What a step changes in place (a list, a tensor counter) runs once per part, as its
step hooks do.

# Note [groups stepped whole]
torch's SGD with momentum, foreach or fused, picks its kernel for a whole param group (per
device and dtype) from the parameters it steps: foreach updates the momentum buffers with one
`_foreach_mul_` when every one of them has a buffer and per tensor otherwise (the two differ in
the last bit in bf16), and fused treats the step as the first when none has one. After a layer
is unfrozen, or at an expert's first routed step, some have a buffer and some not, and a part
of the group stepped on its own would take the other kernel. Such a group (buffers on some of
its parameters that may have a gradient, and not all of them, as of the call) is stepped whole,
in one view with the rest after backward; the worker steps it from the next call on. Other
torch.optim update rules treat each parameter alone.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class OptimizerAsOfCall:
    """The optimizer as a backward_and_step call found it, which every part's step starts from:
    its param groups (Note [param groups as of the call]), its state dict (Note [optimizer state
    of deferred steps] in optim/fenced_state.py) and its attributes."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups = [(g, {**{k: _by_value(v) for k, v in g.items() if k != "params"}, "params": list(g["params"])})
                       for g in optimizer.param_groups]
        self.state = optimizer.state  # the caller may put a new dict there before the parts are done
        self.attributes = Attributes(optimizer)
        # One of torch.optim's own classes (Note [worker steps without subclass dispatch] in optim/worker.py)
        self.is_torch_optim = type(optimizer).__module__.startswith("torch.optim.")
        # Parameters of groups stepped in one view after backward (Note [groups stepped whole]).
        self.stepped_whole = {id(p) for g in optimizer.param_groups if _kernel_depends_on_group(optimizer, g)
                              for p in g["params"]}

    def step(self, ids: set[int], updated: Any = None, *, substitute: dict[int, torch.Tensor] | None = None,
             state: Any = None) -> None:
        """`step_subset` of the parameters in `ids` (`state`: default the state as of the call)."""
        step_subset(self.optimizer, ids, self.groups, self.state if state is None else state, updated,
                    substitute=substitute, attributes=self.attributes)


def step_subset(optimizer: torch.optim.Optimizer, ids: set[int], as_of: list[tuple[dict, dict]] | None = None,
                state: Any = None, updated: Any = None, substitute: dict[int, torch.Tensor] | None = None,
                attributes: Attributes | None = None) -> None:
    """`optimizer.step()` over only the parameters whose ids are in `ids`, through a view of the
    optimizer (same state and hooks, its own param groups), so that the optimizer object itself
    is never modified while another thread uses it. `as_of` pairs each param group with what it
    held when backward_and_step was called (default: what it holds now; Note [param groups as
    of the call]), and `state` the state dict it steps (default: the optimizer's). Group entries
    that the step changes are written back to the group.
    `updated()` is called once the update is done, before the step post-hooks (Note [partial
    steps]: a post-hook that raises follows an update). `substitute` maps a parameter's id to
    the tensor stepped in its place (its device copy: Note [device steps] in optim/device_steps.py).
    `attributes`: the optimizer's attributes the view starts from, and where what its step sets
    is written back (default: as they are now; Note [attributes the optimizer's step sets])."""
    groups = []
    for g, then in as_of if as_of is not None else [(g, g) for g in optimizer.param_groups]:
        params = [p if substitute is None else substitute[id(p)] for p in then["params"] if id(p) in ids]
        if params:
            groups.append((g, {**then, "params": params}))
    if not groups:
        return
    attributes = Attributes(optimizer) if attributes is None else attributes
    view = object.__new__(type(optimizer))
    view.__dict__.update(attributes.then)
    view.__dict__.pop("step", None)  # an instance-level wrapper (LR schedulers) calls the original
    if state is not None:
        view.state = state
    view.param_groups = [sub for _, sub in groups]
    view._offtensor_view = True  # type: ignore[attr-defined]  # its step pre-hook must not wait for the steps it is part of
    if updated is not None:  # the view's own post-hooks: `updated` first, then the optimizer's
        hooks = optimizer._optimizer_step_post_hooks
        view._optimizer_step_post_hooks = {-1: lambda *_: updated(), **hooks}  # type: ignore[assignment]
    before = [dict(sub) for _, sub in groups]
    start = dict(view.__dict__)
    view.step()
    optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers look for
    attributes.write_back(start, view.__dict__)
    for (g, sub), old in zip(groups, before, strict=True):
        for k, v in sub.items():
            if k != "params" and (k not in old or v is not old[k]):
                g[k] = v


def _kernel_depends_on_group(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Note [groups stepped whole]: SGD with momentum, foreach or fused, and momentum buffers
    on some of the group's parameters that may have a gradient, not all."""
    if not isinstance(optimizer, torch.optim.SGD) or not group.get("momentum"):
        return False
    if not (group.get("foreach") or group.get("fused")):
        return False
    state = optimizer.state
    has_buffer = {p in state and state[p].get("momentum_buffer") is not None
                  for p in group["params"] if p.requires_grad or p.grad is not None}
    return len(has_buffer) > 1


_UNSET = object()  # an attribute the optimizer does not have


class Attributes:
    """The optimizer's attributes as of a backward_and_step call, which each view starts from,
    and what the views' steps set on themselves, written back to the optimizer once: Note
    [attributes the optimizer's step sets]. Written by the worker and the calling thread."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self.then = dict(optimizer.__dict__)
        self._set: dict[str, Any] = {}  # name -> what a part's step set it to (_UNSET: deleted)
        self._lock = threading.Lock()

    def write_back(self, start: dict[str, Any], end: dict[str, Any]) -> None:
        """A view's step has run: its `__dict__` was `start` and is `end`."""
        changed = {k: end.get(k, _UNSET) for k in start.keys() | end.keys()
                   if end.get(k, _UNSET) is not start.get(k, _UNSET)}
        if changed:
            self._locked(self._write_back, changed)

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock: return fn(*args)  # noqa: E701  (one line: Note [interrupts])

    def _write_back(self, changed: dict[str, Any]) -> None:
        cls = type(self._optimizer).__name__
        for name, value in changed.items():
            if name in self._set and not _same(self._set[name], value):
                raise RuntimeError(
                    f"offtensor.backward_and_step: {cls}.step set its attribute {name!r} to different "
                    "values in the parts of the optimizer that backward_and_step steps one by one (each "
                    "through a view of it, starting from the attributes as of the call, its attributes "
                    "set written back): a value computed from the parameters stepped is no part's to "
                    "keep. Keep per-parameter values in optimizer.state, or use loss.backward(); "
                    "optimizer.step()"
                )
        self._set.update(changed)
        attrs = self._optimizer.__dict__
        for name, value in changed.items():
            if value is _UNSET:
                attrs.pop(name, None)
            else:
                attrs[name] = value


def _same(a: Any, b: Any) -> bool:
    """Two parts' steps set an attribute to the same value: equal numbers or tensors (NaN equal
    to NaN), or objects that compare equal."""
    if a is b:
        return True
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        return True
    except AssertionError:
        return False
    except Exception:  # noqa: BLE001 - not a kind assert_close compares: try ==
        pass
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - no comparison: not the same
        return False


def _by_value(v: Any) -> Any:
    """A hyperparameter as it is now: tensors (a tensor lr, tensor betas) copied, so that an
    in-place write after backward_and_step returns reaches only later steps."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v):
        return tuple(_by_value(x) for x in v)
    return v
