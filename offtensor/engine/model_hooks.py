"""The hooks on the wrapped model's own forward (ModelHooks), and its exposed passes (ExposedPass):
passes whose scopes' copies are put in place once for the whole forward."""

from __future__ import annotations

import torch
from torch import nn

from ..dispatch import compile as _compile
from ..dispatch import wrapper_guards as _distributed
from ..dispatch.function_apply import recorded_functions
from .call_args import call_tensors
from .engine import Engine, ModelForward, start_grad_pass
from .failures import FailureCheck
from .hooks import Hook, ScopeHooks

# Note [exposed passes]
# A kept scope's steady call still runs its hooks' checks and bookkeeping (Note [steady calls] in
# engine/engine.py), and between kernels, out of cache, that path is what a host-bound forward
# pays above the plain model. So when the model's forward starts outside backward, transforms,
# tracing, compiled code, custom Functions and data parallelism, with no optimizer worker, nothing
# held back, no timed layout still to choose, and every scope kept, resident, current and idle
# (`ScopeHooks.exposable`), its pre-hook exposes every scope's copies at once (an eager call's
# plan, Note [calls of a loaded scope] in engine/hooks.py); the post-hook takes them out and copies
# what the forward wrote into the masters, also when it raised. The scopes' hooks return at their
# first check; in a pass begun with grad on they still count a call that can add to a gradient
# and place the backward's triggers on its inputs and outputs (Note [backward triggers]), so the
# backward runs per scope as after steady calls, and the pass starts as a pass does for gradients
# (`start_grad_pass`); with grad off an input may not require grad. The schedule is not moved: the
# pass is not one of the learned order's. A call that cannot skip (grad turned on in a pass begun
# without, a transform, its parameters registered anew) ends the pass for every scope, writes
# kept, and the forward goes on as a plain pass; a call on another thread is refused (the engine
# counts as busy). An interrupt is found by the model's call record, at its next forward or a
# write through a parameter (`live`): the copies go, their writes not copied back (Note [writes
# after an interrupt] in engine/hooks.py). A forward of the model inside its own pass ends it.

_graph_task = torch._C._current_graph_task_id
_transforms = torch._C._functorch.peek_interpreter_stack


# Note [a pass that reloads what a step wrote]
# An optimizer step writes the masters of kept scopes, which releases their copies (Note [VRAM
# budget] in budget/vram.py): in a training loop every forward follows a step, and it would never
# be an exposed pass. So a kept scope that a write released (`reloadable`: idle, its copy order
# learned, no deferred step on its masters) does not stop the pass: the pass's start loads it,
# as the scope's own call would (copies on the copy stream, its versions noted), and its first
# call in the pass makes compute wait for the load and exposes its copies (`expose_landed`).
# Until then its modules hold the parameters themselves, so code that reads one before the
# scope's call (a tied weight) takes the general path, which copies what it needs and never reads
# a copy still in flight. A scope the pass does not call stays loading, and the next pass
# exposes it likewise (or its next call outside a pass takes the load from there).


class ExposedPass:
    """The model's current exposed pass, if any (Note [exposed passes])."""

    def __init__(self, engine: Engine, scope_hooks: list[ScopeHooks], model_calls: FailureCheck) -> None:
        self.engine = engine
        self.scope_hooks = scope_hooks
        self._model_calls = model_calls  # the record of the model call that began the pass
        self.grad = False  # the pass began with grad enabled
        for hooks in scope_hooks:
            hooks.exposed_pass = self

    @property
    def active(self) -> bool:
        """A pass is exposed (or an interrupt left one): the engine's state says so."""
        return self.engine.model_forward is ModelForward.EXPOSED

    def begin(self, args: tuple, kwargs: dict) -> bool:
        """If the model's forward starting now can be an exposed pass: every scope exposed,
        and True; else False, nothing changed. (A backward in progress: ThreadOwner.check refused
        the forward already.)"""
        engine, grads = self.engine, self.engine.grads
        grad = torch.is_grad_enabled()
        if (recorded_functions.depth or engine.model_forward is not ModelForward.OUTSIDE
                or _graph_task() != -1 or _transforms() is not None or _compile.tracing() or _distributed.active()
                or engine.streams.switched_from is not None or engine.live.holds_back
                or not (engine.budget.timed is None or engine.budget.timed.chosen)
                or grads.stepper is not None or grads.reducer is not None
                or (not grad and any(t.requires_grad for t in call_tensors(args, kwargs)))):
            return False
        reloads = [hooks for hooks in self.scope_hooks if not hooks.exposable()]
        if not all(hooks.reloadable() for hooks in reloads):
            return False
        for hooks in reloads:  # Note [a pass that reloads what a step wrote]
            hooks.scope.load(with_grads=False)  # (one still loading: nothing to do)
        if grad:
            start_grad_pass(engine)
        self.grad = grad
        engine.model_forward = ModelForward.EXPOSED  # first: an interrupt in the loop leaves what `drop` takes back
        for hooks in self.scope_hooks:
            hooks.expose_for_pass()
        return True

    def end(self, *, failed: bool = False) -> None:
        """The pass ends: every scope's copies out, what the forward wrote into them copied into
        the masters (each scope's, also when one of them raises: the first error is raised);
        `failed`: the forward raised, and the graph of a pass with grad went with it."""
        if failed and self.grad:
            self.engine.calls.pass_failed()
        error: RuntimeError | None = None
        for hooks in self.scope_hooks:
            if hooks.in_pass:
                try:
                    hooks.leave_pass(copy_back=True)
                except RuntimeError as e:  # a written copy that cannot be copied back (MasterWrites)
                    error = error or e
        self.engine.model_forward = ModelForward.OUTSIDE
        if error is not None:
            raise error

    def end_for_calls(self) -> None:
        """A scope's call cannot skip its hooks: the pass ends, and the forward goes on as a
        plain pass from this call on."""
        self.end()
        self.engine.begin_forward()

    def live(self) -> bool:
        """The pass runs: its model call was not left by an interrupt (a stack walk: asked for
        a write through a parameter whose copies are exposed); an interrupted one is dropped."""
        if self.active and self._model_calls.drop_interrupted():
            self.drop()
        return self.active

    def drop(self) -> None:
        """An interrupt left the pass: the copies out, their writes not copied back."""
        for hooks in self.scope_hooks:
            if hooks.in_pass:
                hooks.leave_pass(copy_back=False)
        self.engine.model_forward = ModelForward.OUTSIDE


class ModelHooks:
    """The hooks on the wrapped model's own forward: it starts the first scope's load
    (Engine.begin_forward) or an exposed pass, and, if it raises, releases every scope."""

    def __init__(self, engine: Engine, scope_hooks: list[ScopeHooks]) -> None:
        self.engine = engine
        self.scope_hooks = scope_hooks
        self.calls = FailureCheck()
        self.exposed = ExposedPass(engine, scope_hooks, self.calls)

    def install(self, model: nn.Module) -> None:
        pre = Hook(self._pre, self._compiled_pre)
        self.engine.handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
        self.engine.handles.append(model.register_forward_hook(Hook(self._post), always_call=True))

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._begin(args, kwargs, exposable=True)

    def _compiled_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._begin(args, kwargs, exposable=False)

    def _begin(self, args: tuple, kwargs: dict, *, exposable: bool) -> None:
        engine = self.engine
        engine.thread.check("the model's forward")
        interrupted = self.calls.enter()
        if self.exposed.active:  # left by an interrupt, or this forward runs inside it
            if interrupted:
                self.exposed.drop()
            else:
                self.exposed.end()
        if interrupted:
            engine.abort()  # an earlier forward was interrupted (KeyboardInterrupt): as if it raised
        for hooks in self.scope_hooks:  # before anything else runs: FailureCheck.drop_interrupted
            hooks.drop_interrupted()
        if exposable and self.exposed.begin(args, kwargs):
            return
        engine.begin_forward()

    def _post(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.engine.thread.foreign():  # a call refused by ThreadOwner.check: nothing to undo
            return
        failed = self.calls.failed()  # (pops the call's record in either case)
        if self.exposed.active:
            self.exposed.end(failed=failed)
            return
        self.engine.end_forward(failed=failed)
