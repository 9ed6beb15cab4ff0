"""The engine of one wrapped model: where its forward and backward passes are, and what each
scope's hooks do.

It composes the layers below: the scopes and their transitions (scopes/scope.py), the streams
(scopes/streams.py), the learned orders and the prefetch (engine/schedule.py), the VRAM budget
(budget/vram.py), the gradient path (engine/grads.py), the calls that can add to gradients
(scopes/grad_calls.py), what an op on an offloaded parameter gets (engine/access.py), writes to
masters (engine/writes.py) and the owning thread (engine/threads.py). Module and tensor hooks
(engine/hooks.py) call its entry points.

# Note [training state]
Whether a backward will follow a forward is not announced: the engine infers it from the loop
so far and keeps it in one `TrainingState`. A pass that ran a backward is TRAINING for the
rest of it; the next pass starts as EXPECTING_BACKWARD (the loop trains: the last scope of the
forward stays resident for the backward that starts with it, even under reentrant
checkpointing, where the forward runs without grad), otherwise as INFERENCE (release each scope
after its forward). The wrapped model's own forward is tracked separately (`ModelForward`),
since its hooks may be missing (a wrapped ModuleList).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ..api import Policy, Residency, ScopeState
from ..budget.shared import ModelCalls, SharedBudget
from ..budget.vram import NoBudget, budget_for
from ..dispatch import compile as _compile
from ..dispatch import wrapper_guards as _distributed
from ..dispatch.optimizer_step import watch_optimizer_steps
from ..dispatch.param import OffloadedParameter
from ..dispatch.slot import ParamSlot, in_backward
from ..scopes.expert_cache import ExpertCache
from ..scopes.grad_calls import GradCalls, trainable
from ..scopes.scope import LiveScopes, Scope, scope_of
from ..scopes.streams import Streams
from ..storage.memory import PinningFallback
from ..storage.staging import StagingRing
from .access import OpAccess
from .grads import GradOffload
from .schedule import Schedule
from .threads import ThreadOwner
from .transforms import outside_transforms
from .writes import MasterWrites

# The no_offload() objects entered and not exited for every wrapped model (those for one model
# are in its engine's `holds`). Weak: one whose __exit__ an interrupt skipped stops holding once
# it is collected (Note [interrupts]).
holds_for_all: weakref.WeakSet[Any] = weakref.WeakSet()
engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class ModelForward(enum.Enum):
    """Where the wrapped model's own forward is; its hooks delimit passes (Note [passes of the
    model's forward] in engine/schedule.py)."""

    OUTSIDE = "outside"  # not in the model's forward (or no hook: a ModuleList was wrapped)
    STARTING = "starting"  # in it, before any scope: the next scope's forward starts a pass
    IN_PASS = "in pass"  # in it, the pass started
    EXPOSED = "exposed"  # in it, every scope exposed at once (Note [exposed passes] in engine/model_hooks.py)


class TrainingState(enum.Enum):
    """Whether a backward follows the forward passes (Note [training state])."""

    INFERENCE = "inference"  # no backward in this pass, nor after the previous one
    EXPECTING_BACKWARD = "expecting backward"  # none yet in this pass; one followed the previous
    TRAINING = "training"  # a backward ran in this pass


# The attribute of a wrapped model that holds its engine (set by wrap).
ENGINE_ATTR = "_offtensor_engine"


def find_engine(model: nn.Module) -> Engine | None:
    """The engine of a wrapped model (or of a module inside one), None if it holds no offloaded
    parameter."""
    engine = getattr(model, ENGINE_ATTR, None)
    if engine is not None:
        return engine
    for p in model.parameters():
        slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
        if slot is not None:
            return owning_engine(slot)
    return None


def engine_of(model: nn.Module, caller: str) -> Engine:
    """The engine of a wrapped model; `caller`, the public function that needs it, names the
    error when the model is not wrapped."""
    engine = find_engine(model)
    if engine is None:
        raise ValueError(
            f"offtensor.{caller}: this {type(model).__name__} is not wrapped (it holds no "
            "offloaded parameter); call offtensor.wrap(model) first"
        )
    return engine


def owning_engine(owner: Scope | ParamSlot) -> Engine:
    """The Engine of a scope or of a parameter's slot, for the layers above the engine; below
    it, a slot's scope is a SlotScope (dispatch/slot.py) and a scope's engine a ScopeEngine
    (scopes/scope.py), which name what those layers may ask."""
    scope = owner if isinstance(owner, Scope) else scope_of(owner)
    return cast(Engine, scope.engine)


def _no_engine() -> None:
    """What a pickled wrapped model's engine attribute loads as (Note [copies of a wrapped model])."""


def _budget(engine: Engine, shared: SharedBudget | None) -> NoBudget:
    """The engine's VRAM budget: its own, or a member of `shared` (Note [one budget across
    models] in budget/shared.py)."""
    if shared is None:
        return budget_for(engine.policy, engine.device, engine.scopes, engine.streams, engine.live,
                          idle=engine._idle, lockstep=engine._lockstep)
    return shared.member(engine.scopes, engine.streams, engine.live, ModelCalls(
        idle=engine._idle, lockstep=engine._lockstep,
        expects_backward=lambda: engine.training is not TrainingState.INFERENCE,
        order=lambda: engine.schedule.order, backward_order=lambda: engine.schedule.backward_order(),
        needed_in_backward=lambda s: engine.schedule.needed_in_backward(s), ring=lambda: engine.ring))


class Engine:
    """The passes of one wrapped model: drives its scopes' states from the hooks' calls."""

    def __init__(self, device: torch.device, policy: Policy, shared: SharedBudget | None = None) -> None:
        """`shared`: the VRAM budget this model shares with others (Note [one budget across
        models] in budget/shared.py); None: its own, from `policy`."""
        self.device = device
        self.policy = policy
        self.scopes: list[Scope] = []
        self.streams = Streams(device)
        self.live = LiveScopes()
        self.grads = GradOffload(self.streams, self.scopes, self.end_backward, lambda: not self.thread.run_by_another())
        self.calls = GradCalls(self.scopes)
        self.budget = _budget(self, shared)
        # Routed expert rows kept across loads (Note [expert cache] in scopes/expert_cache.py)
        self.expert_cache = ExpertCache(policy.expert_cache) if isinstance(policy.expert_cache, int) else None
        self.schedule = Schedule(self.scopes, policy, self.budget, self.hold)
        self.thread = ThreadOwner(lambda: self._computing() or self.grads.in_backward())
        # What an op on an offloaded parameter gets, and what a write to a master does: asked
        # through each scope (SlotScope in dispatch/slot.py), by dispatch, weights and the optimizer.
        self.access = OpAccess(device, self._computing)
        self.writes = MasterWrites(self.streams, self.hold, self.grads.in_backward)
        self.holds: weakref.WeakSet[Any] = weakref.WeakSet()  # no_offload(model) for this model
        self.model_forward = ModelForward.OUTSIDE
        self.training = TrainingState.INFERENCE
        self._preloaded: Scope | None = None  # loaded by begin_forward in the current model forward
        self._carried_fresh = False  # scopes were carried since the last pass started
        self.handles: list[torch.utils.hooks.RemovableHandle] = []  # hooks on the wrapped model
        self.scope_hooks: list[Any] = []  # each scope's _hooks.ScopeHooks, set by wrap
        # Set by wrap: the module it wrapped (weak: the model holds the engine) and the
        # load_state_dict pre-hooks of Note [loading with assign=True] (model/guards.py).
        self.root: Callable[[], nn.Module | None] = lambda: None
        self.guard_handles: list[torch.utils.hooks.RemovableHandle] = []
        # Called by abort: loads collective with other ranks are out of step (Note [sharded loads]).
        self.on_abort: list[Callable[[], None]] = []
        # Set by wrap: the staging ring (Note [staged loads] in storage/staging.py), or None.
        self.ring: StagingRing | None = None
        self.pinning = PinningFallback()  # to the ring, when page-locking fails
        engines.add(self)
        watch_optimizer_steps()  # Notes [a compiled optimizer step], [an eager optimizer step]

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the model is not wrapped (Note [copies of a wrapped model])

    def __reduce__(self) -> tuple:
        return (_no_engine, ())

    def scopes_ready(self) -> None:
        """Called by wrap once every scope is built."""
        self.schedule.ready()
        self.budget.ready(self.schedule.largest_block)

    def live_calls(self) -> bool:
        return any(s.calls.running for s in self.scopes)

    def _idle(self) -> bool:  # for the timed layout: what the budget keeps may change
        return not (self.hold() or self.live_calls())

    def _lockstep(self) -> bool:  # ranks load together (data parallel)
        return self.grads.reducer is not None  # its sharded loads too (distributed/reducer.py)

    def _computing(self) -> bool:  # in a forward of the model or of a scope (a recompute included)
        return self.model_forward is not ModelForward.OUTSIDE or self.live_calls()

    def hold(self) -> bool:
        """no_offload() is in effect for this model: nothing is released."""
        # The sets' own members, not len(): a WeakSet's __len__ is a Python call, and this is asked
        # at each call of a scope. A dead member leaves `.data` at once (its weakref's callback),
        # unless the set is being iterated, which the holds never are here.
        return bool(self.holds.data) or bool(holds_for_all.data)  # type: ignore[attr-defined]

    def upcoming_loads(self, scope: Scope) -> list[Scope]:
        """The scopes expected to load after `scope`, nearest first, for the staging ring's
        read-ahead (Note [staged loads] in storage/staging.py)."""
        return self.schedule.expected_after(
            scope, in_backward=in_backward(), backward_next=self.training is not TrainingState.INFERENCE)

    # ---- forward (called by the hooks, engine/hooks.py) ----------------------------------------

    @outside_transforms
    def pre_forward(self, scope: Scope, inputs: list[torch.Tensor]) -> bool:
        """`inputs`: the tensors among the forward's arguments. True if the scope's device copies
        were found current (MasterWrites.forward_starts): no master written since they were made."""
        self.streams.restore()
        if in_backward():
            scope.calls.started()
            self.pre_backward(scope)
            return False
        scope.calls.started()
        self._advance(scope)
        scope.calls.counted_in_pass()
        self.calls.count(scope, inputs)
        self.live.pump()
        current = self.writes.forward_starts(scope)
        if scope.residency is Residency.CARRIED:
            scope.set_residency(Residency.STREAMED)  # used: released as its forward ends, like any streamed scope
        if scope.state is ScopeState.OFFLOADED:
            scope.loads_on_demand += 1
            scope.load(with_grads=False)  # (without gradients, a load of a loaded scope does nothing)
        self._carried_fresh |= self.schedule.prefetch_forward(scope, carry=self._carries_ahead)
        self.budget.started(scope, "forward")
        # No wait here: each op waits for the chunk holding its weights (materialize).
        return current

    def _carries_ahead(self, scope: Scope) -> bool:
        """No backward follows this pass (Note [carried into the next forward] in budget/vram.py)."""
        return self.model_forward is ModelForward.IN_PASS and self.grads.reducer is None and not self.hold() and (
            not self.calls.pass_counted or (self.training is TrainingState.INFERENCE and not scope.module.training))

    def _advance(self, scope: Scope) -> None:
        """The scope's forward starts: move along the learned order; a new pass starts here
        when the order says so (Note [prefetch order] in engine/schedule.py)."""
        begins = self.model_forward is ModelForward.STARTING
        if begins:
            self.model_forward = ModelForward.IN_PASS
        new_pass = self.schedule.advance(scope, begins=begins, bounded=not self.handles,
                                         outside_model=self.model_forward is ModelForward.OUTSIDE)
        if new_pass:
            self._start_pass(scope)

    def _start_pass(self, first: Scope) -> None:
        start_grad_pass(self)
        for scope in self.scopes:
            scope.calls.new_pass()
            if scope is not first:
                scope.calls.forget_running()
        fresh, self._carried_fresh = self._carried_fresh, False  # only the first pass after
        self._release_earlier_passes(first, keep_carried=fresh)

    def _release_earlier_passes(self, first: Scope, *, keep_carried: bool) -> None:
        """A pass starts at `first`: release what earlier passes left, but scopes in a call and,
        in the first pass after a backward carried them, the carried ones (Note [carried into
        the next forward] in budget/vram.py)."""
        if self.hold():
            return
        for scope in self.live:
            residency = scope.residency
            if (residency is Residency.KEPT or scope is first or scope.calls.running
                    or (keep_carried and residency is Residency.CARRIED)):
                continue  # (a kept scope stays: release() would return at once)
            scope.release()

    @outside_transforms
    def begin_forward(self) -> None:
        """The wrapped model's forward starts a pass: load its likely first scope now, after
        releasing what an earlier pass left (Note [passes of the model's forward] in engine/schedule.py)."""
        self.streams.restore()
        if in_backward():
            return
        if _distributed.active():
            _distributed.check_ddp_forward("the model given to offtensor.wrap")
        self.model_forward = ModelForward.STARTING
        self.budget.between_passes(self.schedule.order, self.schedule.backward_order, self.ring)
        first = self.schedule.first_of_next_pass()
        if first is None or self.schedule.prefetch_bytes == 0:
            return
        self._release_earlier_passes(first, keep_carried=self._carried_fresh)
        if self.hold():
            return
        if first.state is ScopeState.OFFLOADED:
            first.load(with_grads=False)
            self._preloaded = first

    @outside_transforms
    def end_forward(self, *, failed: bool) -> None:
        """The wrapped model's forward ends. After an exception (also one outside every scope),
        nothing it loaded stays. Otherwise the order is cut where this pass ended, and what the
        pass loaded without using (the scope begin_forward loaded, a prefetch along the cut tail)
        is released, but not what it carries into the next pass."""
        if in_backward():
            return
        in_pass = self.model_forward is ModelForward.IN_PASS
        self.model_forward = ModelForward.OUTSIDE
        preloaded, self._preloaded = self._preloaded, None
        if failed:
            self.abort()
            return
        if in_pass:
            self.schedule.cut()
            unused = [s for s in self.live if s.calls.this_pass == 0 and s not in self.budget.carrying()]
        else:  # no scope ran in this forward
            unused = [preloaded] if preloaded is not None else []
        if not self.hold():
            for scope in unused:
                if scope.calls.running == 0:
                    scope.release()

    @outside_transforms
    def post_forward(self, scope: Scope, *, failed: bool, backward_expected: bool) -> None:
        scope.calls.ended(failed=failed)
        if in_backward():
            return  # a recompute: the scope's backward follows, post_backward releases it
        if failed:
            self.abort()
            return
        self.budget.ended(scope, "forward")
        self.writes.call_ended(scope)
        if scope.copy_order is None:
            scope.learn_copy_order()
        if self.hold():
            return
        # Under reentrant checkpointing the forward runs without grad: only the training state
        # (Note [training state]) and a counted call of this pass say a backward follows. With
        # grad on, the call's outputs say it: outputs that require no grad are in no graph, and
        # no backward reaches the scope (its parameters frozen, the model training others).
        expected = (not torch.is_grad_enabled() and self.training is not TrainingState.INFERENCE
                    and scope.module.training and self.calls.pass_counted)
        if self.schedule.is_last(scope) and (backward_expected or expected):
            # Backward starts with this scope, kept resident, or (a split block recomputed under
            # checkpointing) with another one: prefetch that, weights only (the user may still
            # write `p.grad`: Note [stale gradient fetches] in scopes/old_grads.py).
            self.schedule.prefetch(self.schedule.backward_starts_elsewhere(scope), scope, with_grads=False)
            return  # needed early in backward: no release and reload
        if backward_expected and scope.policy.keep_for_backward:
            return
        scope.release()

    # ---- backward ------------------------------------------------------------------------

    @outside_transforms
    def pre_backward(self, scope: Scope, *, create_graph: bool = False) -> None:
        """The scope's backward is about to run; `create_graph`: the backward builds a graph of
        its own (Note [higher-order gradients] in scopes/device_buffer.py)."""
        self.streams.restore()
        self.grads.enter_backward()
        self.calls.backward_starts(scope, create_graph)
        self.access.backward_scope = scope
        self.training = TrainingState.TRAINING
        stepper = self.grads.stepper
        self.writes.backward_starts(scope, stepper.handed if stepper is not None else None)
        if scope.state is ScopeState.OFFLOADED:
            scope.loads_on_demand += 1
            self.budget.make_room(scope, self.schedule.needed_in_backward)
        scope.load(with_grads=True)
        self.schedule.prefetch_backward(scope)
        scope.resident_for_backward()
        self.budget.started(scope, "backward")

    @outside_transforms
    def post_backward(self, scope: Scope) -> None:
        if self.access.backward_scope is scope:
            self.access.backward_scope = None
        self.grads.scope_done(scope)
        self.budget.ended(scope, "backward")
        if self.hold() or scope.calls.this_pass > 1:
            return  # a module called several times: later calls' backward still needs it
        if scope.state is not ScopeState.OFFLOADED and scope.calls.running == 0:
            if self._carries(scope):
                scope.set_residency(Residency.CARRIED)  # Note [carried into the next forward] in budget/vram.py
                self._carried_fresh = True
                return
            scope.release()

    def _carries(self, scope: Scope) -> bool:
        """Leave the scope resident for the next forward (Note [carried into the next forward] in budget/vram.py)."""
        if self.calls.create_graph or self.grads.reducer is not None or scope not in self.schedule.carry():
            return False
        return self.grads.stepper is None or not trainable(scope)

    @outside_transforms
    def end_backward(self, *, failed: bool = False) -> None:
        """End of the outermost backward: nothing stays resident (unless no_offload holds, or
        the backward built a graph that may be differentiated again); after one that raised
        (`failed`, Note [a backward that raised] in engine/grads.py), not even what it carried."""
        self.forget_backward()
        for scope in self.scopes:
            scope.calls.forget_running()
        self.calls.backward_ended()
        if failed:
            self.budget.pass_failed()  # a timed pass measured nothing
        if not self.hold():
            self.live.release_all(keep_carried=not failed)
            if self.grads.stepper is not None:  # its worker's steps release nothing
                self.budget.release_stepped()
        # Old gradients fetched and not taken (Note [stale gradient fetches] in scopes/old_grads.py).
        for scope in self.scopes:
            if scope.state is not ScopeState.OFFLOADED:
                scope.old_grads.drop()

    def forget_backward(self) -> None:
        """No scope's backward runs now, and the schedule's backward starts over."""
        self.access.backward_scope = None
        self.schedule.forget_backward()

    def abort(self) -> None:
        """An exception in the forward: drop every device copy and in-flight prefetch; the next
        pass starts afresh."""
        self.forget_backward()
        for scope in self.scopes:
            scope.calls.forget_running()
            scope.calls.new_pass()
        self.calls.pass_failed()
        self.schedule.abandon_pass()
        self.model_forward = ModelForward.OUTSIDE
        self.budget.pass_failed()
        if not self.hold():
            self.live.release_all()
        for callback in self.on_abort:
            callback()


def start_grad_pass(engine: Engine) -> None:
    """What a pass's start does for the gradient path and the training state (also for an exposed
    pass with grad: Note [exposed passes] in engine/model_hooks.py)."""
    engine.grads.reset_if_stale()
    engine.calls.pass_started()
    engine.forget_backward()
    trained = engine.training is TrainingState.TRAINING
    engine.training = TrainingState.EXPECTING_BACKWARD if trained else TrainingState.INFERENCE


# Note [steady calls]
# Most calls of a kept scope find nothing to decide: the scope RESIDENT and kept, no other call of
# it running, the pass on its learned order with this scope next (or, as the model's forward
# starts, at the order's head: a new pass), no master written since its copy, nothing held back
# for an optimizer step. Engine.pre_forward and post_forward handle such a
# call through a dozen entry points that each ask again what the others asked, a cost per call
# that a host-bound model pays at each of its blocks. So the hooks ask `kept_call_is_steady`
# first, which only reads; if it holds, `start_kept_call` makes exactly the changes pre_forward
# would make in that case (the call counted, the order stepped, the prefetch and the budget told),
# and the call ends by `end_kept_call` if that finds the same at its end and it is not the
# order's last scope (whose end prefetches for backward). Any other call takes the full
# path, before anything changed. The hooks' side: ScopeHooks._steady_pre and _steady_end.


def kept_call_is_steady(engine: Engine, scope: Scope) -> bool:
    """A forward call of `scope` starting now, inside the model's forward on this thread and
    outside backward, is steady (Note [steady calls]); reads only."""
    if not (scope.state is ScopeState.RESIDENT and scope.residency is Residency.KEPT and scope.calls.running == 0
            and engine.streams.switched_from is None and not engine.live.holds_back):
        return False
    forward, schedule = engine.model_forward, engine.schedule
    if forward is ModelForward.IN_PASS:
        if not schedule.next_in_order(scope):
            return False
    elif forward is not ModelForward.STARTING or not schedule.order or schedule.order[0] is not scope:
        return False
    return not scope.writes.written_since_copied()


def start_kept_call(engine: Engine, scope: Scope, inputs: list[torch.Tensor]) -> None:
    """What Engine.pre_forward does for a steady call (Note [steady calls]); its copies are current."""
    schedule = engine.schedule
    if engine.model_forward is ModelForward.STARTING:  # the pass starts here, at the order's head
        scope.calls.started()
        engine._advance(scope)
        scope.calls.counted_in_pass()  # after a new pass's start, which counts the pass afresh
        engine.calls.count(scope, inputs)
    else:
        schedule.advance(scope, begins=False, outside_model=False, bounded=False)
        scope.calls.started_in_pass(grad=engine.calls.counts(inputs))
    engine._carried_fresh |= schedule.prefetch_forward(scope, carry=engine._carries_ahead)
    if engine.budget.timed is not None:
        engine.budget.started(scope, "forward")


def end_kept_call(engine: Engine, scope: Scope) -> bool:
    """If the only call of `scope` running, which did not raise, can end steady (Note [steady
    calls]): what Engine.post_forward does at its end, and True; else False, nothing changed."""
    if not (scope.state is ScopeState.RESIDENT and scope.residency is Residency.KEPT and scope.calls.running == 1
            and not scope.writes.in_call and not engine.schedule.is_last(scope)):
        return False
    scope.calls.ended()
    if engine.budget.timed is not None:
        engine.budget.ended(scope, "forward")
    return True


# Note [steady backward of a kept scope]
# A kept scope's backward usually finds nothing to do but note itself: its copies resident and
# unwritten since made, its graph task already this backward's (not the first scope, which sets
# the backward up), no create_graph, optimizer worker, reducer or prefetch override, and no
# `p.grad` anywhere in the model as the backward began (`GradOffload.grads_absent`), so no old
# gradient to fetch for it or for the scopes after it. Engine.pre_backward reaches that outcome
# through a dozen entry points that each ask again, a cost per scope that a host-bound training
# step pays at each block. So the output-gradient hook asks `start_kept_backward` first, which
# asks once and then makes only the changes pre_backward makes in that case: the scope noted as
# backward's, the backward order stepped and the scopes ahead prefetched (weights only), the
# budget told. A `p.grad` a hook sets during the backward is still added to: the gradient path
# reads `p.grad` as it adds (`_home` in engine/grads.py); only its fetch ahead is left out.
# A kept scope's backward ends with its gradients and the budget only (`end_kept_backward`):
# what Engine.post_backward does after them (a carry, a release) never applies to a kept scope.


def start_kept_backward(engine: Engine, scope: Scope) -> bool:
    """If the backward of `scope`, not building a graph, is steady (Note [steady backward of a
    kept scope]): what Engine.pre_backward does then, and True; else False, nothing changed."""
    grads = engine.grads
    if not (scope.state is ScopeState.RESIDENT and scope.residency is Residency.KEPT and grads.grads_absent
            and grads.stepper is None and grads.reducer is None and not engine.calls.create_graph
            and engine.streams.switched_from is None and not engine.schedule.backward_override
            and grads.task_known() and not _compile.tracing()
            and torch._C._functorch.peek_interpreter_stack() is None
            and not scope.writes.written_since_copied()):
        return False
    engine.access.backward_scope = scope
    engine.training = TrainingState.TRAINING
    schedule = engine.schedule
    ahead = schedule.backward_needs(scope)
    if len(engine.live) < len(engine.scopes):  # else every scope is loaded: a weights' prefetch loads nothing
        schedule.prefetch(ahead, scope, with_grads=False)
    scope.resident_for_backward()
    engine.budget.started(scope, "backward")
    return True


def end_kept_backward(engine: Engine, scope: Scope) -> bool:
    """If `scope` is kept: what Engine.post_backward does at the end of its backward, and True
    (Note [steady backward of a kept scope]); else False, nothing changed."""
    if not (scope.residency is Residency.KEPT and scope.state is not ScopeState.OFFLOADED
            and not _compile.tracing() and torch._C._functorch.peek_interpreter_stack() is None):
        return False
    if engine.access.backward_scope is scope:
        engine.access.backward_scope = None
    engine.grads.scope_done(scope)
    engine.budget.ended(scope, "backward")
    return True
