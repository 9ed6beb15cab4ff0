"""Steering a wrapped model while it runs: no_offload (keep what loads resident for a while)
and set_prefetch (say what to load next instead of the learned order)."""

from __future__ import annotations

import contextlib
import weakref

from torch import nn

from ..dispatch.slot import in_backward
from ..engine import engine as _engine
from ..engine.engine import Engine, engine_of
from ..scopes.scope import Scope


def set_prefetch(model: nn.Module, module: nn.Module, *, forward: list[nn.Module] | None = None,
                 backward: list[nn.Module] | None = None) -> None:
    """Say which modules to load when `module`'s forward (backward) starts, instead of the
    next ones of the order offtensor learned (the order of the first forward, and of the first
    backward once one has run).

    The learned order is right for a model that runs its blocks in the same order every step;
    when it does not (a block chosen at run time, a mixture of experts, a loop whose length
    changes), the caller knows better. Prefetching is explicit then: exactly the listed
    modules are loaded, without the `Policy.prefetch` budget, so list only what fits on the
    device next to what is computing.

    Args:
        model: the wrapped model.
        module: a module the predicate selected (with `Policy.max_scope_bytes`, the override
            applies to each of its scopes); any other module stands for the scopes holding
            its offloaded parameters.
        forward: the modules to load when `module`'s forward starts; `[]` loads none; `None`
            (the default) goes back to the learned order.
        backward: the same, when `module`'s backward is about to run (their existing
            gradients are fetched too, for accumulation).

    Example::

        blocks = model.model.layers
        for i, block in enumerate(blocks):
            offtensor.set_prefetch(model, block, forward=list(blocks[i + 1 : i + 3]),
                                   backward=list(blocks[max(i - 2, 0) : i])[::-1])
    """
    engine = engine_of(model, "set_prefetch")
    triggers = _scopes_of(engine, model, module, "module")
    for override, targets in ((engine.schedule.forward_override, forward),
                              (engine.schedule.backward_override, backward)):
        chosen = None if targets is None else [
            s for i, m in enumerate(targets) for s in _scopes_of(engine, model, m, f"forward/backward[{i}]")]
        for scope in triggers:
            if chosen is None:
                override.pop(scope, None)
            else:
                override[scope] = [s for s in chosen if s is not scope]


def _scopes_of(engine: Engine, model: nn.Module, module: nn.Module, what: str) -> list[Scope]:
    """The scopes that hold `module`'s offloaded parameters (a block split in several: all)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"offtensor.set_prefetch: {what} must be an nn.Module, got {type(module).__name__}")
    ids = {id(p) for p in module.parameters()}
    scopes = [s for s in engine.scopes if s.module is module or any(id(slot.param) in ids for slot in s.slots)]
    if not scopes:
        names = {id(m): n for n, m in model.named_modules()}
        where = f"{names[id(module)]!r}" if id(module) in names else "not part of the model"
        raise ValueError(
            f"offtensor.set_prefetch: {what} ({type(module).__name__}, {where}) holds no "
            f"offloaded parameter; name modules the predicate selected "
            f"(offtensor.summary(model) lists the scopes, e.g. {engine.scopes[0].name!r})"
        )
    return scopes


class no_offload(contextlib.ContextDecorator):
    """Turn offloading off temporarily: scopes loaded inside stay resident until the outermost
    `no_offload()` exits, which releases them.

    Useful when the model fits the device for a while (evaluation, generation of many tokens)
    and streaming every forward would only cost time. With `model`, only that wrapped model's
    scopes are held (other wrapped models keep streaming); without, every wrapped model's.

    Example::

        with offtensor.no_offload(model):
            model.generate(input_ids, max_new_tokens=64)  # weights stream once, then stay
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._depth = 0  # the same object may be entered again (a decorated recursive function)
        self._model = weakref.ref(model) if model is not None else None
        if model is not None:
            engine_of(model, "no_offload")  # wrapped now: refuse early otherwise
        self._holds: weakref.WeakSet | None = None  # where this object is registered while held

    def __enter__(self) -> no_offload:
        self._depth += 1
        if self._depth == 1:
            model = self._model() if self._model is not None else None
            if self._model is not None and model is None:
                raise RuntimeError("offtensor.no_offload: the model it was given no longer exists")
            self._holds = engine_of(model, "no_offload").holds if model is not None else _engine.holds_for_all
        assert self._holds is not None
        self._holds.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth > 0 or self._holds is None:
            return
        self._holds.discard(self)
        if in_backward():
            return
        # Note [no_offload in several threads]
        # The exit releases what the holds kept, but only of models whose latest forward ran on
        # this thread. Another thread may be inside its own model's forward (one wrapped model
        # per thread): releasing those scopes freed the device copies its ops were reading
        # ("out of bounds for storage of size 0"), even when this no_offload named another
        # model. What such a model kept under a hold of every model is released by its own
        # thread's next pass, which releases what an earlier pass left resident.
        for engine in list(_engine.engines):
            if not engine.hold() and not engine.thread.run_by_another():
                engine.live.release_all()
