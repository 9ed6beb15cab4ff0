"""Gradient offload: device gradients to host `.grad`, accumulation, end-of-backward.

# Note [gradient path]
Autograd differentiates the device copies (ParamSlot.device_leaf, or a temporary copy made for
one op), never the host master, so the master's own AccumulateGrad does not run. Each device copy
has a post-accumulate-grad hook that lists it, and the scope's backward end hands the listed
gradients here (Note [gradients on arrival]); a temporary copy's hook hands its own at once
(`on_leaf_grad`). Each gradient then:
1. user `register_hook` hooks run on the device gradient;
2. if the parameter already has a host gradient (accumulation over micro-batches, or a second
   contribution in this backward), it is added on the device: the old host gradient was fetched
   by the copy stream with the scope's weights (Scope.load with_grads), or is copied now;
3. the sum is copied device-to-host on the d2h stream into the parameter's pinned gradient
   buffer (allocated once, reused every step), keeping the device tensor alive next to the
   copy's event until compute has waited on it (`flush`).
Steps 2 and 3 run at the end of the scope's backward for most gradients (Note [one pass per
scope's gradients]).
At the end of the outermost backward (an autograd engine callback) the host waits once for the
last copy, points `p.grad` at the buffer, runs user post-accumulate-grad hooks and releases
whatever is still resident. Reentrant checkpointing runs nested backward calls: callbacks are
queued per graph task and only the outermost one finalizes.

# Note [hooks on the sum]
A plain parameter's `register_hook` hooks run once per graph task, on the sum of every use's
gradient (autograd sums them before the leaf's AccumulateGrad). A parameter used outside its
scope (a tied embedding: the scope's device copy and temporary copies for the other ops), or
with retired copies (Note [higher-order gradients] in scopes/device_buffer.py), has several leaves, whose
gradients arrive here one by one: run on each, a hook that is not linear (`g.clamp()`,
`g.sign()`, a norm it records) would change the result, and run once per leaf. So a hooked parameter
with several leaves has its contributions summed on the device per graph task (`_hold`), and its
hooks run on the sum at the end of that task (`_on_task_end`, before the end of backward),
after which the sum takes the usual path. Such a parameter is never handed to the optimizer
worker early (`used_outside`), so holding it back changes no step. A parameter with one leaf
gets its hooks at once, as a plain parameter does.

# Note [frozen since the forward]
A parameter frozen between the forward that used it and the backward (`requires_grad_(False)`
on a layer in between) still has a device copy in the graph that requires grad: autograd
computes its gradient. A plain parameter's AccumulateGrad then drops it: a parameter that no
longer requires grad gets none (an older `.grad` stays as it is), while its `register_hook` and
post-accumulate-grad hooks still run. `_add` does the same with the master's flag, after the
`register_hook` hooks, and the end of backward runs the post-accumulate-grad hooks of such
parameters. Without it the frozen parameter got the gradient and the optimizer stepped it.

# Note [a backward that raised]
A backward that raises (a user's hook, an out-of-memory error, a failed recompute) never runs
its graph task's end callback, and nothing else of autograd reports the error: a callback
queued with the engine runs only on success, tensor and multi-grad hooks only on gradients. But
the engine drops a failed task's callbacks with the task, as its `backward()` or `grad()` call
unwinds, before the exception reaches the caller. So `_tasks` refers to each queued callback
weakly, with a finalizer (`_task_dropped`): a task dropped while still listed raised. When it
was the outermost, the gradients it completed become `.grad` (Note [gradients of a backward
that raised]) and the engine releases what the backward left on the device, as after a forward
that raised (kept scopes stay, as always). This sees every way into the engine
(`loss.backward()`, `torch.autograd.grad`, a checkpoint's reentrant backward), costs nothing
per op (nor on success: the reference goes with its entry first), and unlike a patch of
`torch.autograd.backward` cannot be bypassed by a reference taken before the patch. The
finalizer acts only on the thread that owns the model: on CUDA an autograd device thread may
drop the task last, while the caller's thread may already run the next forward. There, and if a
finalizer is interrupted, the dead reference stays: the next backward's first hook (and
`in_backward`) forgets it, the next forward releases what is left, and a backward_and_step that
raised does all of it at once. A failed task left listed would otherwise stay the outermost, so
a later backward (through a retained graph) would never end its own.

# Note [gradients of a backward that raised]
Plain autograd accumulates each leaf's gradient as soon as it is computed, so a backward that
raises leaves `.grad` set on the parameters whose gradients came before the failure. Here they
go to the host buffers of `_written`, and `p.grad` points at them only at the end of backward,
which a failed one never reaches: so they are published when it fails, with the
post-accumulate-grad hooks, as at a normal end, or they would be lost. (Accumulating into an
existing `.grad` writes it in place either way.) A parameter with several leaves (Note [hooks on the sum]) may have
had only some of its contributions added; autograd would leave none: a partial gradient is
what accumulation into `.grad` gives as well. Held sums (hooked, several leaves) are dropped:
their hooks run at the task's end, which never came.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.compiler as _compiler
from torch.autograd import Variable

from ..dispatch import compile as _compile
from ..dispatch.autograd import run_grad_hooks
from ..dispatch.slot import ParamSlot
from ..scopes.scope import Scope
from ..scopes.streams import Streams
from .host_grads import CopiesHome, destination, publish
from .rare_grads import accumulate_sparse, graph_grad_error, handed_twice_error, send_to_owner

# Note [one gradient's host work]
# The gradient path runs once per parameter and backward, so its Python cost grows with the
# model and decides a host-bound training step (short kernels). So it reads what it needs of the
# master with TensorBase's own getters under subclass dispatch off (`_disabled(_GRAD_OF, ...)`:
# `master_grad` and the parameter's Python properties would each cost a call or two), reads
# `p.grad` once (after a deferred step, as `master_grad` would wait), and calls the helpers (old
# gradient, compiled region, graph task) only when there is something for them to do. Each
# branch does what it did before; only calls that could not change the result are skipped.
# The pinned buffer is kept in the gradient's shape and each backward hands out a detached alias
# of it: a tensor of its own on the same storage (and version counter), which the storage's use
# count sees while the user holds it (`destination` in engine/host_grads.py), made without a
# view's metadata or the parsing of a shape. Never the buffer itself: the count could not see a
# user holding that tensor.

# Note [one pass per scope's gradients]
# Taking a device copy's gradient (Note [gradients on arrival]) does the least it can: it takes the
# gradient off the copy and holds it back (`_pending`) when nothing needs it at once: no optimizer
# worker waits for it (backward_and_step), no user hook runs on it, no rank averages it. The scope's
# backward end (`scope_done`) or the graph task's end adds the held gradients (`drain`): each one's
# destination and sum as before, then one batch of copies home, with one wait for compute and one
# event (on the CPU one `_foreach_copy_`), instead of a copy, a wait and an event per gradient. The
# copies start at the scope's end rather than as each gradient is made, while compute goes on with
# the next scope. A second contribution to one host gradient within a batch (a parameter also used
# outside its scope) reads the first one's copy, so the batch so far is copied first. A backward
# that raises adds what it held back before publishing (Note [gradients of a backward that raised]);
# a stale one forgets it with the rest.

# Note [gradients on arrival]
# A device copy's post-accumulate-grad hook is its slot's `arrived.append`: called in C, it lists
# the copy and runs no Python, where a Python hook per gradient cost a call from autograd and the
# hook's frames. What that hook did (`on_leaf_grad`) is done when the gradient path looks: the
# scope's backward end takes its slots' arrivals (`take_arrived`), the graph task's end and a
# backward that raised take every slot's, before anything is published. Until then the gradient
# stays on the copy, where autograd adds later contributions. A Python hook that hands each gradient
# over as it is made is added where that is needed: on a parameter with `register_hook` hooks (they
# see each gradient as autograd makes it, and one that raises ends the backward there, as on a plain
# tensor), and on every parameter of a model once backward_and_step (Note [early handover] in
# optim/step.py) or data_parallel (autograd's order on every rank) uses it (`hand_over_at_once`). A
# backward that runs no hook of ours (a tensor a scope stashed outside its outputs, differentiated
# alone) leaves its arrivals listed: the next backward takes them first (`enter_backward`), before
# it adds to the copies; reading or writing such a parameter's `p.grad` (zero_grad, an optimizer),
# or a compiled optimizer step's hook, takes and publishes them (`arrived_outside`), as that
# backward's end would have. Temporary copies (ops outside the scope) keep a Python hook: they are
# per op and short-lived.
_disabled: Any = torch._C._disabled_torch_function_impl  # (fn, types, args), typed loosely
_GRAD_OF = torch._C.TensorBase.grad.__get__  # type: ignore[union-attr]
_REQUIRES_GRAD_OF = torch._C.TensorBase.requires_grad.__get__  # type: ignore[attr-defined]
_STRIDED = torch.strided
_PARAM = operator.attrgetter("param")
_ARRIVED = operator.attrgetter("arrived")


class Stepper(Protocol):
    """The overlapped optimizer step of a backward_and_step call, as the gradient path hands it
    gradients (OverlappedStep in optim/step.py, above: Note [early handover])."""

    @property
    def closed(self) -> bool: ...  # its call has ended

    def handed(self, slot: ParamSlot) -> bool: ...  # the parameter was handed to its worker

    def grad_final(self, slot: ParamSlot, landed: Any) -> None: ...  # landed: the copy's event

    # The call clips: each gradient's norm is taken where it is computed (Note [norms taken in
    # backward] in optim/clipping.py). `grad`: the sum on the device; `host`: its copy.
    measures_norms: bool

    def grad_written(self, slot: ParamSlot, grad: torch.Tensor, host: torch.Tensor) -> None: ...

    def scope_done(self, scope: Scope, grads_offloaded: Any) -> None: ...


class Reducer(Protocol):
    """Averages gradients over the ranks (GradReducer in distributed/reducer.py, above: Note
    [data parallel])."""

    def keeps(self, slot: ParamSlot) -> bool: ...  # this rank steps the parameter

    def reduce(self, slot: ParamSlot, grad: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor | None: ...

    def written(self, slot: ParamSlot, buf: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class GradOffload:
    """Moves gradients of offloaded parameters to their host `.grad` (one per engine)."""

    def __init__(self, streams: Streams, scopes: list[Scope], end_backward: Callable[..., None],
                 owns: Callable[[], bool]) -> None:
        self._streams = streams
        self._scopes = scopes
        # The engine's: releases what is still resident; `failed=True` after a backward that raised.
        self._end_backward = end_backward
        self._owns = owns  # this thread owns the model (Note [a backward that raised])
        # graph tasks with a queued end callback, outermost first -> that callback, weakly
        # (dead: the task raised; Note [a backward that raised])
        self._tasks: dict[int, weakref.ref[Callable[[], None]]] = {}
        self._written: list[ParamSlot] = []  # slots whose host_grad changed in this backward
        self._copies = CopiesHome(streams)  # the copies into the host buffers, in flight
        # gradients held back for their scope's end (Note [one pass per scope's gradients])
        self._pending: list[tuple[ParamSlot, torch.Tensor]] = []
        # graph task -> id(slot) -> (slot, the sum of its contributions in that task so far),
        # for hooked parameters with several leaves (Note [hooks on the sum])
        self._held: dict[int, dict[int, tuple[ParamSlot, torch.Tensor]]] = {}
        # hooked parameters frozen since the forward that reached them (Note [frozen since the forward])
        self._frozen: list[ParamSlot] = []
        # A gradient came after a handover: backward_and_step steps after backward (`accumulate`).
        self.late_gradients = False
        self.stepper: Stepper | None = None  # during backward_and_step
        self.reducer: Reducer | None = None  # in data-parallel mode
        self._at_once = False  # every device copy hands its gradient over as it lands (hand_over_at_once)
        # No parameter had a `p.grad` as the outermost backward began: nothing to fetch (Note
        # [steady backward of a kept scope] in engine/engine.py); taken again at each one's start.
        self.grads_absent = False

    def in_backward(self) -> bool:
        """A backward through the wrapped model is running (from its first hook to its end)."""
        self._forget_failed_tasks()
        return bool(self._tasks)

    def enter_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task == -1 or task in self._tasks:
            return
        self._forget_failed_tasks()
        end = lambda: self._on_task_end(task)  # noqa: E731  (weakly referenced below)
        self._tasks[task] = weakref.ref(end, lambda ref: self._task_dropped(task, ref))
        Variable._execution_engine.queue_callback(end)
        if len(self._tasks) == 1:  # what a backward that ran no hook of ours left, added first
            self.grads_absent = all(scope.old_grads.none_held() for scope in self._scopes)
            self._take_all_arrived()

    def task_known(self) -> bool:
        """The running graph task is one of this backward's (its scopes' hooks ran in it)."""
        return torch._C._current_graph_task_id() in self._tasks

    def _task_dropped(self, task: int, ref: weakref.ref) -> None:
        """The autograd engine dropped a graph task's end callback: after it ran, or because the
        task raised, if it is still listed (Note [a backward that raised])."""
        if self._tasks.get(task) is not ref or not self._owns():
            return
        if any(end() is not None for end in self._tasks.values()):  # an inner task: the outer goes on
            del self._tasks[task]
            self._held.pop(task, None)
            return
        self.backward_raised()  # the outermost task raised (forgets every task listed)

    def _forget_failed_tasks(self) -> None:
        """Drop the graph tasks that raised (Note [a backward that raised]); if the outermost
        one did, forget what it wrote, as the next forward would."""
        failed = [task for task, end in self._tasks.items() if end() is None]
        if not failed:
            return
        for task in failed:
            del self._tasks[task]
            self._held.pop(task, None)
        if not self._tasks:
            self.reset_if_stale()

    def on_leaf_grad(self, slot: ParamSlot, leaf: torch.Tensor) -> None:
        # A backward from compiled code: Note [hooks outside dynamo]. What in_compiled_region
        # reads, read here (Note [one gradient's host work]).
        if _compiler._is_compiling_flag or _compile.eval_frame_callback() is not None:
            return _compile.run_outside_dynamo(self._on_leaf_grad, (slot, leaf))
        return self._on_leaf_grad(slot, leaf)

    def _on_leaf_grad(self, slot: ParamSlot, leaf: torch.Tensor) -> None:
        grad = leaf.grad
        leaf.grad = None  # the device copy keeps no gradient: it lives on the host
        if grad is None:
            return
        if grad.requires_grad:
            raise graph_grad_error(slot)
        if self.stepper is not None or slot.grad_hooks:
            self.accumulate(slot, grad)
            return
        # accumulate's start, without a stepper or gradient hooks: one call less per parameter
        # and backward (Note [one gradient's host work]).
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._tasks:
            self.enter_backward()
        if self.reducer is None and task != -1:
            self._pending.append((slot, grad))  # Note [one pass per scope's gradients]
        else:
            self._add(slot, grad)

    def accumulate(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._tasks:
            self.enter_backward()
        if self.stepper is not None and self.stepper.handed(slot):
            if not slot.single_grad:  # handed at its scope's end: calls were miscounted, maybe in other scopes too
                self.late_gradients = True
            raise handed_twice_error(slot)
        if slot.grad_hooks:
            if slot.used_outside or slot.retired:  # several leaves: Note [hooks on the sum]
                self._hold(slot, grad)
                return
            grad = run_grad_hooks(slot, grad)
        self._add(slot, grad)

    def _hold(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Sum a hooked parameter's contributions within this graph task, for its hooks to
        see the sum at the task's end (Note [hooks on the sum])."""
        held = self._held.setdefault(torch._C._current_graph_task_id(), {})
        entry = held.get(id(slot))
        held[id(slot)] = (slot, grad if entry is None else entry[1] + grad)

    def _add(self, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Add one gradient, after the user's hooks, to the host gradient, now."""
        home = _home(self, slot, grad)
        if home is None:
            return
        buf, grad, written = home
        self._copy([(slot, buf, grad)], [written])
        if self.reducer is not None:
            self.reducer.written(slot, buf)
        stepper = self.stepper
        if stepper is not None:
            if stepper.measures_norms:
                stepper.grad_written(slot, grad, buf)
            if slot.single_grad:
                stepper.grad_final(slot, slot.last_d2h if grad.is_cuda or self._streams.lagging else None)

    def drain(self) -> None:
        """Add the gradients held back for their scope's end (Note [one pass per scope's
        gradients]): their copies home go as one batch, but a second contribution to a host
        gradient waits for the first's copy, which it reads; a batch holds one device's."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        batch: list[tuple[ParamSlot, torch.Tensor, torch.Tensor]] = []  # (slot, host buffer, gradient)
        written: list[bool] = []  # each one's host gradient held this backward's contributions already
        seen: set[int] = set()  # the batch's slots, by id
        for slot, grad in pending:
            if batch and (id(slot) in seen or grad.device != batch[0][2].device):
                self._copy(batch, written)
                batch, written = [], []
                seen.clear()
            home = _home(self, slot, grad)
            if home is not None:
                batch.append((slot, home[0], home[1]))
                written.append(home[2])
                seen.add(id(slot))
        if batch:
            self._copy(batch, written)

    def _copy(self, batch: list[tuple[ParamSlot, torch.Tensor, torch.Tensor]], written: list[bool]) -> None:
        """Copy a batch home, then count each gradient as written: only then, so that a backward
        interrupted before the copy does not publish a buffer the copy never filled."""
        self._copies.copy(batch)
        for (slot, _, _), before in zip(batch, written, strict=True):
            if not before:
                self._written.append(slot)
            slot.grads_in_backward += 1

    def scope_done(self, scope: Scope) -> None:
        """A scope's backward is over: its gradients are final once its copies land."""
        self.take_arrived(scope.slots)
        self.drain()
        self._copies.flush(keep=scope)
        if self.stepper is not None:
            self.stepper.scope_done(scope, scope.grads_offloaded)

    def take_arrived(self, slots: list[ParamSlot]) -> None:
        """Handle the gradients autograd accumulated on these slots' device copies since the last
        look, as their hook once did (Note [gradients on arrival])."""
        if _compiler._is_compiling_flag or _compile.eval_frame_callback() is not None:
            return _compile.run_outside_dynamo(self.take_arrived, (slots,))
        if self.stepper is None and self.reducer is None and not self._pending:
            taken = _take_common(self, slots)
            if taken:
                slots = slots[taken:]
        for slot in slots:
            arrived = slot.arrived
            while arrived:  # off the list first: what it calls may look again (`p.grad`)
                self._on_leaf_grad(slot, arrived.pop(0))

    def hand_over_at_once(self) -> None:
        """From now on each device copy also hands its gradient over as it lands: to
        backward_and_step's worker (Note [early handover] in optim/step.py), or to a
        data-parallel reducer, in autograd's order on every rank."""
        if not self._at_once:
            for scope in self._scopes:
                for slot in scope.slots:
                    slot.hands_at_once = True
                    slot.hook_at_once()
            self._at_once = True  # last: an interrupt in the loop leaves it to the next call

    def _take_all_arrived(self) -> None:
        for scope in self._scopes:
            if any(map(_ARRIVED, scope.slots)):  # asked in C: at each backward's start and end
                self.take_arrived(scope.slots)

    def arrived_outside(self, slot: ParamSlot) -> None:
        """`p.grad` of the slot's parameter is read or written while gradients are listed on
        its device copies (Note [gradients on arrival]): added now, and published unless a
        backward through the model runs (its end publishes them)."""
        if _compile.in_compiled_region():  # `p.grad` in a compiled optimizer step
            return _compile.run_outside_dynamo(self.arrived_outside, (slot,))
        self.take_arrived([slot])
        if torch._C._current_graph_task_id() == -1 and not self.in_backward():
            self._publish_written()

    def _on_task_end(self, task: int) -> None:
        self._take_all_arrived()
        self.drain()
        for slot, grad in self._held.pop(task, {}).values():
            self._add(slot, run_grad_hooks(slot, grad))
        self._tasks.pop(task, None)
        if not self._tasks:
            self.finalize()

    def backward_raised(self) -> None:
        """The outermost backward raised: release what it left on the device, publish what it
        completed and forget the rest (Note [gradients of a backward that raised])."""
        self._take_all_arrived()
        self.drain()
        self._copies.wait()
        stepper = self.stepper  # the slots handed to its worker are published there
        written = [s for s in self._written if stepper is None or not stepper.handed(s)]
        frozen = list(self._frozen)
        self.reset_if_stale()
        self._end_backward(failed=True)
        self.stepper = None  # as in finalize
        publish(written)
        for slot in frozen:
            for hook in slot.post_hooks.values():
                hook(slot.param)

    def finalize(self) -> None:
        """End of the outermost backward: host grads complete, `p.grad` set, hooks fired."""
        self.drain()
        self._publish_written()
        frozen, self._frozen = self._frozen, []
        for slot in frozen:
            for hook in slot.post_hooks.values():
                hook(slot.param)
        self._end_backward()
        # backward_and_step clears this too once loss.backward() returns; an interrupt can land
        # before that (Note [interrupts]), and a later plain backward must not hand its
        # gradients to that call's optimizer worker.
        self.stepper = None

    def _publish_written(self) -> None:
        """Wait for the copies home, then point `p.grad` at each host gradient written."""
        self._copies.wait()
        if self.stepper is not None:  # the worker publishes and steps the slots handed to it
            written = [s for s in self._written if not self.stepper.handed(s)]
        else:
            written = self._written
        for slot in self._written:
            slot.single_grad = slot.grads_in_backward == 1
            slot.grads_in_backward = 0
            slot.scope.grads_offloaded = None
        self._written = []
        self._copies.forget()
        publish(written)

    def reset_if_stale(self) -> None:
        """A new forward pass began while a backward was unfinished (it raised): forget it."""
        if self._tasks or self._written or self._held or self._frozen or self._pending:
            self._copies.wait()
            self._tasks.clear()
            self._pending.clear()
            self._held.clear()
            self._frozen.clear()
            for slot in self._written:
                if slot.grads_in_backward > 1:
                    slot.single_grad = False
                slot.grads_in_backward = 0
            self._written.clear()
            self._copies.forget()
            # A KeyboardInterrupt in on_leaf_grad can leave a gradient on a device copy, which
            # the next backward would add to (Note [interrupts]).
            for scope in self._scopes:
                for slot in scope.slots:
                    slot.device_leaf.grad = None
                    slot.arrived.clear()


def _home(offload: GradOffload, slot: ParamSlot, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """Where one gradient goes on the host, what is copied there (the sum with the old
    gradient, in the master's dtype) and whether the host gradient held this backward's
    contributions already; None when it goes nowhere (frozen) or took another path (sparse,
    another rank's)."""
    param = slot.param
    if not _disabled(_REQUIRES_GRAD_OF, (), (param,)):  # Note [frozen since the forward]
        if slot.post_hooks and slot not in offload._frozen:
            offload._frozen.append(slot)
        return None
    # What the host gradient holds: this backward's earlier contributions, or the `p.grad`
    # of earlier backward calls (accumulation), once a deferred step no longer reads it.
    written = slot.grads_in_backward > 0
    if written:
        current = slot.host_grad
    else:
        if slot.pending_step is not None:
            slot.wait_for_step()
        current = _disabled(_GRAD_OF, (), (param,))
    if grad.layout != torch.strided or (current is not None and current.layout != torch.strided):
        if accumulate_sparse(slot, grad, data_parallel=offload.reducer is not None):
            offload._written.append(slot)
        slot.grads_in_backward += 1
        if offload.stepper is not None and slot.single_grad:
            offload.stepper.grad_final(slot, None)  # already on the host
        return None
    reducer = offload.reducer
    if reducer is not None and not reducer.keeps(slot):
        send_to_owner(reducer, slot, grad)  # another rank steps it (data_parallel, shard_optimizer)
        return None
    if written:
        buf, accumulate, old = current, True, None
    else:
        adopt = reducer is None and not offload._streams.lagging and not slot.grad_hooks
        buf, accumulate = destination(slot, current, grad, adopt)
        slot.host_grad = buf
        old = slot.scope.take_old_grad(slot) if slot.old_grad is not None else None
    assert buf is not None
    if grad.dtype != buf.dtype:
        grad = grad.to(buf.dtype)  # Policy.compute_dtype: cast up on the device
    if old is None and accumulate:
        if written and (grad.is_cuda or offload._streams.lagging):
            offload._streams.wait(offload._streams.compute(), slot.last_d2h)
        old = buf.to(grad.device, non_blocking=True)
    if reducer is not None:  # averaged over the ranks, old included (Note [data parallel])
        reduced = reducer.reduce(slot, grad, old)
        assert reduced is not None  # keeps(slot): this rank steps it
        grad = reduced
    elif old is not None:
        grad = grad + old
    return buf, grad, written


# Note [a scope's gradients in one loop]
# At a scope's backward end most of its parameters have one gradient, on their device copy, that
# needs nothing but the common way home: no optimizer worker or rank waits for it, no hook runs on
# it, no earlier contribution, old `p.grad` or fetched gradient is added to it, no deferred step
# reads `p.grad`, and the parameter still requires grad. Taken through the general path
# (take_arrived, _on_leaf_grad, drain, _home) that is a handful of Python calls per parameter and
# backward, each asking again what the others asked. `_take_common` takes the slots in order in
# one loop while each is such a case, with the general path's outcome (`destination` decides
# where it goes; the copies home go as one batch, counted as written after it), and stops at the
# first slot that is not: it and the slots after it take the general path, so `_written`, whose
# order the post-accumulate-grad hooks run in, keeps the slots' order. Only with nothing held
# back from earlier (`_pending`), whose gradients would otherwise be added after later ones.


def _take_common(offload: GradOffload, slots: list[ParamSlot]) -> int:
    """Take the slots' gradients in order while each is the common case (Note [a scope's
    gradients in one loop]); returns how many slots it went through. Inside a backward only: a
    gradient taken outside one is added at once, by the general path."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        return 0
    if task not in offload._tasks:
        offload.enter_backward()
    adopt = not offload._streams.lagging  # no reducer, no hooks: Note [gradients computed on the host]
    batch: list[tuple[ParamSlot, torch.Tensor, torch.Tensor]] = []  # (slot, host buffer, gradient)
    # The parameters' requires_grad and `p.grad`, read for all at once in C (nothing below sets them)
    params = list(map(_PARAM, slots))
    wanted = _disabled(list, (), (map(_REQUIRES_GRAD_OF, params),))
    held = _disabled(list, (), (map(_GRAD_OF, params),))
    n = 0
    for slot, requires_grad, param_grad in zip(slots, wanted, held, strict=True):
        arrived = slot.arrived
        if arrived:
            leaf = arrived[0]
            grad = leaf.grad
            if (grad is None or len(arrived) > 1 or leaf is not slot.device_leaf or slot.grad_hooks
                    or slot.grads_in_backward or slot.pending_step is not None or slot.old_grad is not None
                    or grad.requires_grad or grad.layout is not _STRIDED or not requires_grad
                    or param_grad is not None):
                break
            arrived.pop()
            leaf.grad = None  # the device copy keeps no gradient: it lives on the host
            buf, _ = destination(slot, None, grad, adopt)
            slot.host_grad = buf
            if grad.dtype != buf.dtype:
                grad = grad.to(buf.dtype)  # Policy.compute_dtype: cast up on the device
            batch.append((slot, buf, grad))  # an adopted one is not copied (CopiesHome.copy)
        n += 1
    if batch:
        offload._copy(batch, [False] * len(batch))  # none held this backward's contributions yet
    return n
