"""The engine of one wrapped model: where its forward and backward passes are, what each scope's
hooks do, and what an op on an offloaded parameter gets (`materialize`).

It composes the layers below: the scopes and their transitions (core/scope.py), the streams
(core/streams.py), the learned orders and the prefetch (core/schedule.py) and the gradient path
(core/grads.py). Module and tensor hooks (core/hooks.py) call its entry points.

# Note [training state]
Whether a backward will follow a forward is not announced: the engine infers it from the loop
so far and keeps it in one `TrainingState`. A pass that ran a backward is TRAINING for the
rest of it; the next pass starts as EXPECTING_BACKWARD (the loop trains: the last scope of the
forward stays resident for the backward that starts with it, even under reentrant
checkpointing, where the forward runs without grad), otherwise as INFERENCE (release each scope
after its forward). The wrapped model's own forward is tracked separately (`ModelForward`),
since its hooks may be missing (a wrapped ModuleList).

# Note [calls inside a checkpointed region]
`Scope.grad_calls_since_backward` counts the calls whose backward may add to the scope's
gradients; `backward_and_step` hands a scope's parameters to the optimizer at the end of its
backward only when it counts one (several calls give several contributions, the later ones
after the handover). Reentrant checkpointing runs its region without grad, so a call there is
told apart from a no-grad evaluation by an input that requires grad; but only the region's
first module gets the region's inputs: a scope further in (a block split into a scope per child,
the second block of a `checkpoint_sequential` segment) gets tensors computed without grad. With
two forwards before one backward (a loss over two batches, chosen and rejected halves), such a
scope counted none, was handed over after the first of its two backwards and raised at the
second contribution. So once a call of the pass counted, every later call of the pass counts too:
a no-grad call inside a training forward at worst makes its scope wait for the end of backward.
That still needs one counted call: where no offloaded scope is a region's first module (a block
whose first module, its norm, stays on the device, and whose Linears are the scopes), none was
counted, and the first step raised on a half-stepped model. So a call also counts inside the
forward of a custom autograd Function that autograd records (grad on, an input that requires
grad): reentrant checkpointing's CheckpointFunction, seen through offtensor's Function.apply
(`recorded_functions`, Note [custom autograd Functions] in dispatch/param.py).

# Note [calls a built graph still holds]
A backward that builds a graph (create_graph=True: `torch.autograd.grad(d_real.sum(), real,
create_graph=True)` for an R1 penalty) keeps the graph it differentiated, and the one it built
reads the scopes' device copies of that forward, retired at release (Note [higher-order
gradients] in core/scope.py). The calls of that forward can thus still add to the gradients, through
leaves of their own, so its end leaves `grad_calls_since_backward` as it is. Reset there, a
second forward before the loss's backward (`d_fake = m(fake)`) counted one call per scope, so
backward_and_step handed each scope over at its first contribution, stepped it, and the
penalty's contribution then found its weights changed (autograd's in-place error) after most
of the model was stepped. A graph built and dropped unused at worst makes the next backward
step its scopes after backward; the next backward that builds none resets the counts.

# Note [torch.func transforms]
Under `torch.func.grad`/`vjp`/`jacrev`/`vmap` every op, offtensor's own copies included, goes
through the transform, which refuses in-place writes into tensors captured from outside it (the
device buffers a load writes). The engine's entry points (the hooks and `materialize`) therefore
run with the transforms disabled: loads, releases and gradient fetches are bookkeeping of plain
tensors, invisible to the transform, while the model's ops still run under it on the device
copies, which the transform sees as captured constants. With `functional_call` over the
parameters, the device copies are simply not used.
"""

from __future__ import annotations

import enum
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..api import MasterHome, Policy, Residency, ScopeState
from ..budget.layout import Measuring, PassTimer, ScopeCost, auto_margin, choose, copy_ms_per_byte, spare_device_bytes
from ..dispatch import compile as _compile
from ..dispatch.function_apply import recorded_functions
from ..dispatch.masters import master_requires_grad
from ..dispatch.optimizer_step import watch_compiled_steps
from ..distributed import wrappers as _distributed
from .grads import GradOffload
from .memory import PinningFallback
from .schedule import Schedule
from .scope import LiveScopes, Scope
from .slot import ParamSlot, in_backward, on_optimizer_worker
from .streams import Streams

# The no_offload() objects entered and not exited for every wrapped model (those for one model
# are in its engine's `holds`). Weak: one whose __exit__ an interrupt skipped stops holding once
# it is collected (Note [interrupts]).
holds_for_all: weakref.WeakSet[Any] = weakref.WeakSet()
engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class ModelForward(enum.Enum):
    """Where the wrapped model's own forward is; its hooks delimit passes (Note [prefetch order])."""

    OUTSIDE = "outside"  # not in the model's forward (or no hook: a ModuleList was wrapped)
    STARTING = "starting"  # in it, before any scope: the next scope's forward starts a pass
    IN_PASS = "in pass"  # in it, the pass started


class TrainingState(enum.Enum):
    """Whether a backward follows the forward passes (Note [training state])."""

    INFERENCE = "inference"  # no backward in this pass, nor after the previous one
    EXPECTING_BACKWARD = "expecting backward"  # none yet in this pass; one followed the previous
    TRAINING = "training"  # a backward ran in this pass


def _no_engine() -> None:
    """What a pickled wrapped model's engine attribute loads as (Note [copies of a wrapped model])."""


def _copied_from(scope: Scope) -> torch.Tensor:
    """What a load of `scope` copies to the device, to time a copy (Note [a timed layout] in
    budget/layout.py): a slot of the staging ring for a staged scope (its host buffer is pageable, or
    none for masters in files), else its host buffer, or the host shadow under cast="host"."""
    if scope.ring is not None:
        return scope.ring.sample(scope.nbytes)
    return scope.host_flat if scope.host_shadow is None else scope.host_shadow


def _outside_transforms(method: Any) -> Any:
    """Run an engine entry point outside torch.func transforms (Note [torch.func transforms])
    and untraced by make_fx (Note [tracing with make_fx] in dispatch/compile.py)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _compile.tracing():
            return _compile.untraced(run, *args, **kwargs)
        if torch._C._functorch.peek_interpreter_stack() is None:  # no transform: nothing to do
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return run


class Engine:
    """The passes of one wrapped model: drives its scopes' states from the hooks' calls."""

    def __init__(self, device: torch.device, policy: Policy) -> None:
        self.device = device
        self.policy = policy
        self.scopes: list[Scope] = []
        self.streams = Streams(device)
        self.live = LiveScopes()
        self.grads = GradOffload(self.streams, self.scopes, self.end_backward)
        self.schedule = Schedule(self.scopes, policy)
        self.holds: weakref.WeakSet[Any] = weakref.WeakSet()  # no_offload(model) for this model
        self.model_forward = ModelForward.OUTSIDE
        # A gradient came after backward_and_step had handed its scope over at the end of the
        # scope's backward: the calls that can add to gradients were miscounted, so from then on
        # backward_and_step steps this model's scopes after backward (GradOffload.accumulate).
        self.late_gradients = False
        self.training = TrainingState.INFERENCE
        # The scope whose backward runs now (pre_backward to post_backward). A checkpoint
        # recompute that does not pass through the module's hooks (transformers >= 5.2x
        # checkpoints `forward`, keeping hooks outside) still uses this scope's device copy.
        self.backward_scope: Scope | None = None
        self._preloaded: Scope | None = None  # loaded by begin_forward in the current model forward
        self._thread: int | None = None  # the thread of the latest forward (check_thread)
        self._create_graph = False  # the backward running now builds a graph (create_graph=True)
        self._pass_counted = False  # a call of the current pass can add to a gradient
        self._carried_fresh = False  # scopes were carried since the last pass started
        self.handles: list[torch.utils.hooks.RemovableHandle] = []  # hooks on the wrapped model
        self.scope_hooks: list[Any] = []  # each scope's _hooks.ScopeHooks, set by wrap
        # Set by wrap: the module it wrapped (weak: the model holds the engine) and the
        # load_state_dict pre-hooks of Note [loading with assign=True] (wrapping.py).
        self.root: Callable[[], nn.Module | None] = lambda: None
        self.guard_handles: list[torch.utils.hooks.RemovableHandle] = []
        # Called when a forward fails (abort): loads collective with other ranks are out of
        # step with them (Note [sharded loads] in distributed/sharded_loads.py).
        self.on_abort: list[Callable[[], None]] = []
        self.timer: PassTimer | None = None  # measures a pass for a timed layout (Note [a timed layout])
        self._reads_before = (0, 0.0)  # the staging ring's read_stats() when the measured pass began
        # Set by wrap when scopes load through a staging ring (Note [staged loads] in
        # weights/file_masters.py); `pinning` falls back to it when page-locking fails.
        self.ring: Any = None
        self.pinning = PinningFallback()
        engines.add(self)
        watch_compiled_steps()  # Note [a compiled optimizer step] (dispatch/param.py)

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the model is not wrapped (Note [copies of a wrapped model])

    def __reduce__(self) -> tuple:
        return (_no_engine, ())

    def scopes_ready(self) -> None:
        """Called by wrap once every scope is built."""
        self.schedule.ready()
        policy = self.policy
        if policy.vram_budget is not None and (
                policy.layout == "timed" or policy.vram_budget == "auto"
                or (policy.layout == "auto" and self.device.type == "cuda")):
            self.timer = PassTimer(self.device)

    def _measure_or_lay_out(self) -> None:
        """Between two passes (the model's forward starts): measure this pass, or, once one was
        measured, choose the timed layout (Note [a timed layout] in budget/layout.py)."""
        timer = self.timer
        assert timer is not None
        if timer.state is Measuring.WAITING:
            if self.schedule.order:  # one pass has run: the order is known, cold kernels are paid
                timer.state = Measuring.MEASURING
                self._reads_before = self.ring.read_stats() if self.ring is not None else (0, 0.0)
            return
        if timer.state is Measuring.MEASURING:
            timer.state = Measuring.MEASURED  # the measured pass (and its backward) is over
        if timer.state is not Measuring.MEASURED or self.hold() or self.live_calls():
            return
        timer.state = Measuring.DONE
        if self.grads.reducer is not None or any(s.loader is not None for s in self.scopes):
            return  # data parallel: ranks must keep the same scopes (they load together)
        schedule = self.schedule
        index = {scope: i for i, scope in enumerate(self.scopes)}
        forward = [index[s] for s in schedule.order]
        backward = [index[s] for s in schedule.backward_order()] if timer.saw_backward else []
        largest = max(self.scopes, key=lambda s: s.nbytes)
        per_byte = copy_ms_per_byte(_copied_from(largest), self.device, self.streams.h2d())
        read_per_byte = self._read_ms_per_byte()
        costs = [ScopeCost(timer.total_ms(s, "forward"), timer.total_ms(s, "backward"),
                           (s.nbytes if s.host_shadow is None else s.device_nbytes)
                           * (max(per_byte, read_per_byte) if s.home is MasterHome.FILE else per_byte),
                           s.device_nbytes, s.block, copied_when_kept=timer.saw_backward and self._trainable(s))
                 for s in self.scopes]
        budget = schedule.budget
        assert budget is not None
        if self.policy.vram_budget == "auto":
            spare = spare_device_bytes(self.device)
            if spare is not None:
                budget += max(0, spare - auto_margin(self.device))
        kept, prediction = choose(costs, forward, backward, budget, self.policy.prefetch)
        schedule.apply_layout({self.scopes[i] for i in kept}, budget, prediction)

    def _read_ms_per_byte(self) -> float:
        """The drive's time per byte read into the staging ring: in the measured pass, else since
        wrap; 0.0 without reads (Note [a timed layout] in budget/layout.py)."""
        if self.ring is None:
            return 0.0
        nbytes, seconds = self.ring.read_stats()
        before_bytes, before_seconds = self._reads_before
        if nbytes > before_bytes:
            nbytes, seconds = nbytes - before_bytes, seconds - before_seconds
        return seconds * 1e3 / nbytes if nbytes else 0.0

    def live_calls(self) -> bool:
        return any(s.running_calls for s in self.scopes)

    def hold(self) -> bool:
        """no_offload() is in effect for this model: nothing is released."""
        return len(self.holds) > 0 or len(holds_for_all) > 0

    def outlives_calls(self, scope: Scope) -> bool:
        """The scope's device copy stays from one call to the next: kept by the VRAM budget,
        carried from a backward into the next forward, or held by no_offload(). Writes that
        bypass the parameter (`p.data`, a detached alias) leave such a copy stale; a streamed
        scope loads afresh at its next call."""
        return scope.residency is not Residency.STREAMED or self.hold()

    def release_all(self, *, force: bool = False) -> None:
        """Release every scope on the device; `force`: those the VRAM budget keeps too."""
        self.live.release_all(force=force)

    def forward_position(self, scope: Scope) -> int:
        return self.schedule.forward_position(scope)

    def upcoming_loads(self, scope: Scope) -> list[Scope]:
        """The scopes expected to load after `scope`, nearest first, for the staging ring's
        read-ahead (Note [staged loads] in weights/file_masters.py): the rest of this pass, then a
        backward when the loop trains, else the next forward."""
        return self.schedule.expected_after(
            scope, in_backward=in_backward(), backward_next=self.training is not TrainingState.INFERENCE)

    # ---- what an op gets (Note [dispatch of an offloaded parameter]) ------------------------

    @_outside_transforms
    def materialize(self, slot: ParamSlot, op_device: torch.device | None) -> torch.Tensor | None:
        scope = slot.scope
        if scope.running_calls > 0 or scope is self.backward_scope:
            if scope.state is not ScopeState.RESIDENT:
                scope.make_resident(upto=slot)
            if scope.written_in_this_call(slot):  # Note [writes during a scope's call] (core/scope.py)
                scope.refresh(slot)
            if scope.copy_order is None and not in_backward():
                scope.first_uses.setdefault(slot, None)
            return slot.use_device_copy()
        p = slot.param
        needs_grad = torch.is_grad_enabled() and p.requires_grad
        if op_device is None:
            if self._computing():
                # Read by another module's forward (Mamba's mixer reads `conv1d.weight` of a
                # child whose forward never runs), or with no device tensor among the op's
                # arguments (`w.T`, `w.view(...)`): the device copy, not the host master.
                op_device = self.device
            elif not needs_grad:
                return None  # act on the host master
        return scope.temporary_copy(slot, op_device, needs_grad)

    def _computing(self) -> bool:
        """In a forward of the wrapped model or of a scope (a recompute in backward included),
        where ops compute on the device. Not in the rest of backward: a user's gradient hook
        (an optimizer step in a post-accumulate-grad hook) acts on the host master."""
        return self.model_forward is not ModelForward.OUTSIDE or any(s.running_calls for s in self.scopes)

    def master_written(self, slot: ParamSlot) -> None:
        """Called before a write of the master (an in-place op, `p.data = t`, an optimizer step):
        `before_master_write`, then graphs that saved a copy of it see it modified (Note [writes
        under a saved graph] in core/slot.py)."""
        self.before_master_write(slot)
        slot.device_copies_written()

    def before_master_write(self, slot: ParamSlot, *, written: bool = True) -> None:
        """Called before an in-place op on a master: no copy may still be reading it, and a
        device copy made from the old value is stale. `written`: False for an offloaded argument
        that the op surely only reads (`h.add_(self.bias)`)."""
        scope = slot.scope
        scope.shadow_stale = True
        scope.master_writes += 1  # a staged copy is stale (Note [staged loads] in weights/file_masters.py)
        slot.retired_copies_written()  # also for the worker's steps (atomic version bumps)
        if on_optimizer_worker():
            # The optimizer worker: no copy reads this master (docs/design.md, Threads). A
            # device copy that no_offload() keeps is released by backward_and_step.
            return
        self.streams.sync_master_reads()
        if scope.state is ScopeState.OFFLOADED:
            return
        if scope.running_calls == 0:
            scope.release(force=True)  # stale, also when the budget keeps it
        elif written:  # in the scope's own call: Note [writes during a scope's call] (core/scope.py)
            scope.written_in_call[slot] = None

    def master_handed_out(self, scope: Scope, slot: ParamSlot | None = None) -> None:
        """`p.data` of one of the scope's parameters (`slot`'s) was taken (or, for a kept scope, its masters
        were written through a view): writes through it reach the master unseen, under a version
        counter of its own. A kept (or no_offload-held) scope's device copy would go stale, so it
        goes now; the next forward reloads it (Note [VRAM budget] in core/schedule.py). So does a
        streamed scope resident outside its calls (the last one of a forward, which its backward
        would use: Note [writes under a saved graph] in core/slot.py). Streamed scopes load afresh,
        but under Policy(cast="host") from a shadow cast from the masters: it is re-cast at the
        next load. Writes through the alias after that load: Note [p.data aliases] (core/slot.py)."""
        scope.shadow_stale = True
        scope.master_writes += 1  # so is a staged copy (Note [staged loads] in weights/file_masters.py)
        if scope.state is ScopeState.OFFLOADED or on_optimizer_worker():
            return
        if scope.running_calls and slot is not None:
            # Written through `.data` in the scope's own call, perhaps: Note [writes during a
            # scope's call] (core/scope.py).
            scope.written_in_call[slot] = None
        if not self.outlives_calls(scope) and (scope.running_calls or self.grads.in_backward()):
            # A streamed scope's next call loads afresh; one resident outside its calls (the last
            # scope of a forward, resident into its backward) goes now, unless a backward runs.
            return
        if scope.running_calls > 1 or (scope.running_calls == 1 and not scope.written_since_copied()):
            return  # its own forward reads `.data`: no release under it
        self.streams.sync_master_reads()  # the write may follow at once: no copy may still read
        scope.release(force=True)

    # ---- forward (called by the hooks, core/hooks.py) ----------------------------------------

    @_outside_transforms
    def pre_forward(self, scope: Scope, inputs: list[torch.Tensor]) -> None:
        """`inputs`: the tensors among the forward's arguments."""
        self.streams.restore()
        if in_backward():
            scope.running_calls += 1
            self.pre_backward(scope)
            return
        scope.running_calls += 1
        self._advance(scope)
        scope.calls_this_pass += 1
        # Only a call that can add to a gradient counts: grad enabled or, for the forward that
        # reentrant checkpointing runs without grad, a call inside a Function that autograd
        # records (its CheckpointFunction), an input that requires grad, or an earlier call of
        # this pass that counted (Note [calls inside a checkpointed region]).
        if (torch.is_grad_enabled() or self._pass_counted or recorded_functions.depth
                or any(t.requires_grad for t in inputs)):
            scope.grad_calls_since_backward += 1
            scope.grad_calls_this_pass += 1
            self._pass_counted = True
        self.live.pump()
        if self.outlives_calls(scope) and scope.running_calls == 1 and scope.written_since_copied():
            self.master_handed_out(scope)  # its copy is stale (Note [VRAM budget] in core/schedule.py)
        if scope.residency is Residency.CARRIED:
            scope.residency = Residency.STREAMED  # used: released as its forward ends, like any streamed scope
        if scope.state is ScopeState.OFFLOADED:
            scope.loads_on_demand += 1
        scope.load(with_grads=False)
        self.schedule.prefetch_forward(scope)
        if self.timer is not None and self.timer.state is Measuring.MEASURING:
            scope.make_resident()  # compute alone between the events (Note [a timed layout])
            self.timer.start(scope, "forward")
        # No wait here: each op waits for the chunk holding its weights (materialize).

    def _advance(self, scope: Scope) -> None:
        """The scope's forward starts: move along the learned order; a new pass starts here
        when the order says so (Note [prefetch order])."""
        begins = self.model_forward is ModelForward.STARTING
        if begins:
            self.model_forward = ModelForward.IN_PASS
        new_pass = self.schedule.advance(scope, begins=begins, bounded=not self.handles,
                                         outside_model=self.model_forward is ModelForward.OUTSIDE)
        if new_pass:
            self._start_pass(scope)

    def _start_pass(self, first: Scope) -> None:
        self.grads.reset_if_stale()
        self._create_graph = False  # a create_graph backward that raised never reached its end
        self._pass_counted = False
        self._forget_backward()
        trained = self.training is TrainingState.TRAINING
        self.training = TrainingState.EXPECTING_BACKWARD if trained else TrainingState.INFERENCE
        for scope in self.scopes:
            scope.calls_this_pass = 0
            scope.grad_calls_this_pass = 0
            if scope is not first:
                scope.running_calls = 0
        fresh, self._carried_fresh = self._carried_fresh, False  # only the first pass after
        self._release_earlier_passes(first, keep_carried=fresh)

    def _release_earlier_passes(self, first: Scope, *, keep_carried: bool) -> None:
        """A pass starts at `first`: release what earlier passes left on the device, except
        scopes in a call and, in the first pass after a backward carried them, the carried ones
        (Note [carried into the next forward] in core/schedule.py). Nothing under no_offload()."""
        if self.hold():
            return
        for scope in self.live:
            if scope is first or scope.running_calls or (keep_carried and scope.residency is Residency.CARRIED):
                continue
            scope.release()

    @_outside_transforms
    def begin_forward(self) -> None:
        """The wrapped model's forward starts a pass: load now the scope where the pass after
        the last one's start began last time (where the last one started, the first time; the
        head of the order before any), after releasing what an earlier pass left resident
        (Note [prefetch order])."""
        self.streams.restore()
        if in_backward():
            return
        if _distributed.active():
            _distributed.check_ddp_forward("the model given to offtensor.wrap")
        self.model_forward = ModelForward.STARTING
        if self.timer is not None and self.timer.state is not Measuring.DONE:
            self._measure_or_lay_out()
        first = self.schedule.first_of_next_pass()
        if first is None or self.schedule.prefetch_bytes == 0:
            return
        self._release_earlier_passes(first, keep_carried=self._carried_fresh)
        if self.hold():
            return
        if first.state is ScopeState.OFFLOADED:
            first.load(with_grads=False)
            self._preloaded = first

    @_outside_transforms
    def end_forward(self, *, failed: bool) -> None:
        """The wrapped model's forward ends. After an exception (also one raised outside every
        scope, e.g. in the loss), nothing it loaded stays on the device. Otherwise the order is
        cut where this pass ended, and what the pass loaded without using is released: the
        scope begin_forward loaded (an encoder-decoder decoding from cached encoder outputs), a
        prefetch along the cut tail."""
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
            unused = [s for s in self.live if s.calls_this_pass == 0]
        else:  # no scope ran in this forward
            unused = [preloaded] if preloaded is not None else []
        if not self.hold():
            for scope in unused:
                if scope.running_calls == 0:
                    scope.release()

    @_outside_transforms
    def post_forward(self, scope: Scope, *, failed: bool, backward_expected: bool) -> None:
        scope.running_calls = max(0, scope.running_calls - 1)
        if in_backward():
            return  # a recompute: the scope's backward follows, post_backward releases it
        if failed:
            self.abort()
            return
        if self.timer is not None:
            self.timer.end(scope, "forward")
        if scope.running_calls == 0 and scope.written_in_call:
            # Its copy may outlive the call (kept for backward, kept, held): Note [writes during
            # a scope's call] (core/scope.py).
            for slot in list(scope.written_in_call):
                scope.make_resident(upto=slot)
                scope.refresh(slot)
        scope.learn_copy_order()
        if self.hold():
            return
        # Under reentrant checkpointing the forward runs without grad, so nothing says a backward
        # follows except the training state (Note [training state]), and that a call of this
        # pass could add to a gradient (an input required grad; not so in a no-grad evaluation).
        expected = (self.training is not TrainingState.INFERENCE and scope.module.training
                    and self._pass_counted)
        if self.schedule.is_last(scope) and (backward_expected or expected):
            # The end of the forward: backward starts with this scope, kept resident (its
            # pre_backward prefetches the next ones), or, when checkpointing recomputes a split
            # block, with another scope of that block: prefetch that while the loss is computed.
            # (Not the former: the loss's peak memory plus a prefetch would raise the peak.)
            # Its weights only: the user may still write `p.grad` before backward, unseen
            # (Note [stale gradient fetches] in core/scope.py); its pre_backward fetches them.
            self.schedule.prefetch(self.schedule.backward_starts_elsewhere(scope), scope, with_grads=False)
            return  # needed early in backward: no release and reload
        if backward_expected and scope.policy.keep_for_backward:
            return
        scope.release()

    # ---- backward ------------------------------------------------------------------------

    @_outside_transforms
    def pre_backward(self, scope: Scope, *, create_graph: bool = False) -> None:
        """The scope's backward is about to run; `create_graph`: the backward builds a graph of
        its own (Note [higher-order gradients] in core/scope.py)."""
        self.streams.restore()
        self.grads.enter_backward()
        if create_graph:
            self._create_graph = True
        if self._create_graph:
            scope.graph_saved = True
        self.backward_scope = scope
        self.training = TrainingState.TRAINING
        stepper = self.grads.stepper
        if (scope.state is not ScopeState.OFFLOADED and not on_optimizer_worker()
                and scope.written_since_copied(skip=stepper.handed if stepper is not None else None)):
            # Resident since its forward (the last scope, a kept one) and written since, by a
            # write no op on the parameter saw: reloaded, so that backward differentiates with
            # what the master holds and a graph that saved the old copy raises
            # (Note [writes under a saved graph] in core/slot.py). Not for what backward_and_step's
            # worker steps in this backward (a scope whose hooks fire again after its first
            # gradients were handed over): their backward is done.
            self.streams.sync_master_reads()
            scope.release(force=True)
        if scope.state is ScopeState.OFFLOADED:
            scope.loads_on_demand += 1
            self._make_room(scope)
        scope.load(with_grads=True)
        self.schedule.prefetch_backward(scope)
        scope.make_resident()
        if self.timer is not None:
            self.timer.start(scope, "backward")

    def _make_room(self, scope: Scope) -> None:
        """Under a VRAM budget, before a streamed scope loads on demand in backward: release the
        streamed prefetches this backward has not needed yet, and carried scopes, latest first,
        until its weights fit the streaming room (Note [VRAM budget] in core/schedule.py: a wrong
        guess of the order)."""
        room = self.schedule.free_streaming_room()
        if room is None or scope.residency is Residency.KEPT:
            return
        for other in reversed(list(self.live)):
            if room >= scope.device_nbytes:
                return
            # A carried scope's backward is over, so it can go too: one backward through two
            # forwards (DPO's chosen and rejected) carries at the end of the second forward's
            # graph and then still runs the first's, whose loads would go over the budget.
            if other.residency is Residency.KEPT or other.running_calls or (
                    self.schedule.needed_in_backward(other) and other.residency is not Residency.CARRIED):
                continue
            other.release()
            room += other.device_nbytes

    @_outside_transforms
    def post_backward(self, scope: Scope) -> None:
        if self.backward_scope is scope:
            self.backward_scope = None
        self.grads.scope_done(scope)
        if self.timer is not None:
            self.timer.end(scope, "backward")
        if self.hold() or scope.calls_this_pass > 1:
            return  # a module called several times: later calls' backward still needs it
        if scope.state is not ScopeState.OFFLOADED and scope.running_calls == 0:
            if self._carries(scope):
                scope.residency = Residency.CARRIED  # Note [carried into the next forward] in core/schedule.py
                self._carried_fresh = True
                return
            scope.release()

    def _carries(self, scope: Scope) -> bool:
        """Leave the scope resident for the next forward. Not when the masters may change
        unseen before it (backward_and_step's worker steps trainable ones), nor under data
        parallelism (ranks load together), nor for a backward that built a graph."""
        if self._create_graph or self.grads.reducer is not None or not self.schedule.carries(scope):
            return False
        return self.grads.stepper is None or not self._trainable(scope)

    @staticmethod
    def _trainable(scope: Scope) -> bool:
        """A parameter of the scope requires grad. Read without dispatch: `p.requires_grad`
        through OffloadedParameter waits for the scope's deferred step, which at the end of
        backward_and_step's backward is the wait it exists to avoid."""
        return any(master_requires_grad(slot.param) for slot in scope.slots)

    @_outside_transforms
    def end_backward(self) -> None:
        """End of the outermost backward: nothing stays resident (unless no_offload holds, or
        the backward built a graph that may be differentiated again)."""
        self._forget_backward()
        for scope in self.scopes:
            scope.running_calls = 0
            if not self._create_graph:  # Note [calls a built graph still holds]
                scope.grad_calls_since_backward = 0
            scope.grad_calls_this_pass = 0
        self._create_graph = False
        if not self.hold():
            self.live.release_all(keep_carried=True)
            if self.grads.stepper is not None:
                # backward_and_step: its worker steps these masters and cannot release their
                # kept copies (Note [VRAM budget] in core/schedule.py). A step on this thread
                # releases what it writes (before_master_write).
                for scope in self.scopes:
                    if scope.residency is Residency.KEPT and self._trainable(scope):
                        scope.release(force=True)
        # Fetched old gradients nothing took, on the scopes left resident (a release drops its
        # own): Note [stale gradient fetches] in core/scope.py.
        for scope in self.scopes:
            if scope.state is not ScopeState.OFFLOADED:
                scope.drop_old_grads()

    def _forget_backward(self) -> None:
        self.backward_scope = None
        self.schedule.forget_backward()

    def backward_failed(self) -> None:
        """A backward raised where offtensor sees it (backward_and_step): its end-of-backward
        callback will not run, so forget it and release the scopes now. (After a plain
        `loss.backward()` that raised, the next forward does this.)"""
        self.grads.reset_if_stale()
        self.end_backward()

    # ---- failures ------------------------------------------------------------------------

    def abort(self) -> None:
        """An exception in the forward: drop every device copy and in-flight prefetch. The next
        arrival of the first scope starts a new pass (resetting the per-pass counts)."""
        self._forget_backward()
        for scope in self.scopes:
            scope.running_calls = 0
            scope.calls_this_pass = 0
            scope.grad_calls_since_backward -= scope.grad_calls_this_pass  # the failed pass's graph is gone
            scope.grad_calls_this_pass = 0
        self.schedule.abandon_pass()
        self.model_forward = ModelForward.OUTSIDE
        if self.timer is not None and self.timer.state is Measuring.MEASURING:
            self.timer.restart()  # a failed pass measures nothing: the next one is measured
        if not self.hold():
            self.release_all()
        for callback in self.on_abort:
            callback()

    def forget_calls(self, scope: Scope, n: int) -> None:
        """`n` calls of the scope never ended: a KeyboardInterrupt (or SystemExit) left them,
        which runs no hook (FailureCheck in core/hooks.py). Forget them; the device copy they kept
        resident is released unless another call uses it, also under no_offload(): while the
        scope counted as called, writes to its masters (an optimizer step) did not release it,
        so it may be older than they are. (Its count may have been reset since, by abort() or a
        new pass, without a release under no_offload(); the copy goes all the same.)"""
        scope.running_calls = max(0, scope.running_calls - n)
        if scope.running_calls == 0:
            scope.release(force=True)

    def check_thread(self, where: str) -> None:
        """One forward at a time per wrapped model: its scopes' device copies, call counts and
        learned order are shared, so a second thread's forward would corrupt the first's. The
        thread of the forward in progress owns the engine; another one is refused, before any
        state changes (its post-forward hooks then do nothing: foreign_thread)."""
        thread = threading.get_ident()
        if self._thread == thread:
            return
        busy = (self.model_forward is not ModelForward.OUTSIDE or self.grads.in_backward()
                or any(s.running_calls for s in self.scopes))
        if self._thread is not None and busy:
            raise RuntimeError(
                f"offtensor: {where} was called from thread {thread} while thread {self._thread} "
                "is in a forward or backward of the same wrapped model. A wrapped model runs one forward (and "
                "backward) at a time: use one wrapped model per thread, or serialize the calls "
                "with a lock"
            )
        self._thread = thread

    def run_by_another_thread(self) -> bool:
        """The model's latest forward ran on another thread than the caller's, which owns what
        it left on the device (Note [no_offload in several threads] in wrapping.py)."""
        return self._thread is not None and self._thread != threading.get_ident()

    def foreign_thread(self) -> bool:
        """A forward hook runs on another thread than the forward in progress (check_thread
        refused its call). Backward runs on autograd's threads: never foreign."""
        return self._thread is not None and threading.get_ident() != self._thread and not in_backward()
