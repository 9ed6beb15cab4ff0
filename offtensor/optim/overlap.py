"""Optimizer overlap: step each scope's parameters on a host thread, during backward and after.

# Note [optimizer overlap]
With offloading, the optimizer steps on the host after backward: a step costs forward+backward
plus the CPU optimizer. But a scope's gradients are final as soon as its backward is done
(post_backward) and their device-to-host copies have landed, while backward goes on for the
scopes before it. `backward_and_step` hands each finished scope to one worker thread, which
waits (host side, off the main thread) for the scope's `grads_offloaded` event, publishes its
`.grad`s, runs user post-accumulate-grad hooks and calls the user's own optimizer's `step` on a
view of the optimizer restricted to those parameters (same state, same hooks, the param groups'
hyperparameters as they were when `backward_and_step` was called). Per-parameter optimizers
(SGD, Adam, AdamW, Adagrad, ... in any of their single-tensor, foreach or fused forms) give
exactly the same update as one `optimizer.step()` after backward. The rest (parameters on the
device, scopes used more than once per forward, parameters also used outside their scope) is
stepped on the calling thread once backward has returned.

# Note [deferred steps]
Even so the step cannot end before backward plus the optimizer time of the scope whose
gradients come last, and that is the model's first block, which the next forward needs first.
So `backward_and_step` returns as soon as backward has, and the worker finishes in the
background while the next forward begins. Every parameter handed to the worker carries a
fence, `ParamSlot.pending_step` (Note [step fences] in core/slot.py), until its step is done, and
whatever needs its master waits on it, host side: the scope's copy to the device (parameter by
parameter, so the next forward's first matrices go as soon as they are stepped, see
`Scope.copy_more`), any op or property
access on the parameter (`p.grad`, `p.data`, `state_dict()`), and the optimizer's own `step`,
`state_dict` and `load_state_dict` (hooks registered once per optimizer). The worker steps the
parameters whose gradients have landed in the order the next forward needs them (earliest
deadline first), in pieces of about STEP_PIECE_BYTES so that a piece needed soon never waits
long behind one needed later.

# Note [partial steps]
The worker steps parameters while backward is still running, so an exception in backward (an
out-of-memory error, a user hook, Ctrl-C) or in the optimizer itself can leave some parameters
stepped and others not, and which ones depends on timing. This cannot be rolled back (the
optimizer state changed too), so it is made visible: the exception is re-raised with a note
naming the parameters stepped (Python 3.10: a RuntimeError from it), and `last_stepped()` lists
them all. A parameter counts as stepped once its optimizer update is done, before the step
post-hooks run: a post-hook that raises follows an update (step_subset's `updated`).

# Note [early handover]
The step of the last block, which the next forward needs last, is the worker's last piece of
work; after it the worker idles until the next backward's first gradients land: the rest of the
forward, the loss, and the last block's recompute and backward. Handing parameters over as
their own gradients land, not when their scope's backward ends, shortens that idle time by the
block's backward (its last matrix, the first to get its gradient, is the last the forward
needs). A gradient is final when it is the parameter's only contribution to this backward, which
is known from the last backward (`ParamSlot.single_grad`): autograd accumulates all uses of a
device copy in one graph task before its post-accumulate-grad hook fires, so only a parameter
used outside its scope, a scope called more than once since the last backward (checked:
`Scope.grad_calls_since_backward`, which also covers several forwards before one backward), or
reentrant checkpointing of parts of one scope gives several, and these do not change between
steps of a training loop. Should a second contribution arrive anyway, the worker may already
have stepped the parameter on the first: backward raises, saying so, rather than let the late
part go missing silently, and the parameter is no longer handed over early (a parameter that
was handed over at its scope's end, whose scope's calls were then miscounted, makes the model's
scopes wait for the end of backward: `Engine.late_gradients`).

"Used outside its scope" (`ParamSlot.used_outside`, checked at every handover, early or at the
scope's end) means: a temporary copy made for an op outside the scope with grad on is still
alive, so a graph holds it and its gradient may come after the scope's backward (a tied
embedding read by the head). A copy is dead once its graph is: a loop that logs
`parameters_to_vector(model.parameters()).norm().item()` with grad on made such copies, and
when the flag was set for good every later step of those parameters ran after backward, on the
calling thread, with nothing overlapped.

# Note [worker threads]
The CPU optimizer's step is bound by the cores it runs on: fused bf16 AdamW over the benchmark's
8 layers took 1102, 589, 329 and 307 ms on 4, 8, 15 and 16 threads of the H200's host. But a
parallel region is as slow as its slowest thread, and with as many OpenMP threads as cores one
busy thread beside them makes a straggler of one of them: the same step took 885 ms on 16
threads beside one busy Python thread, 377 ms on 15. So the worker leaves `spare_threads` cores
to the thread that launches the device's kernels (autograd's, during backward; the caller's, in
the next forward) while that thread may run, and takes every core for a piece that starts while
a thread is blocked waiting for one of its steps (`_OverlappedStep._waiting`): the next forward
waiting for the deferred steps of the layer it needs, `optimizer.zero_grad()`,
`wait_for_steps()`. In the benchmark's step, bound by the optimizer, about half the pieces
(21 of 40) start so; measured in turn in one H200 run against one spare thread throughout, the
step took 438.3 against 444.8 ms (faster in 6 of 7 rounds), the worker busy 399.0 against
407.6 ms. The count is chosen per piece, so a thread that starts waiting mid-piece gets its
core back at the next piece.

`torch.set_num_threads` also sets the count that threads started later begin with (PyTorch keeps
one default for the process, read by a thread at its first parallel op). The worker is such a
new thread, so it takes its count from the calling thread (`_OverlappedStep.threads`) and sets
that back when it stops: restoring what it found on itself, a worker starting while another
model's worker stepped with its spare cores left found one thread fewer and made that the
default of every thread started afterwards. While a worker steps, a thread making its first
parallel op still starts with the worker's count: a thread that trains a model of its own
should call `torch.set_num_threads` first (as the tests do) for the same numerics as the main
thread.

# Note [worker steps without subclass dispatch]
Each op of the worker's step on an offloaded parameter went through `__torch_function__`, which
on the worker only passes it on to the master (`_dispatch`, "masters only") after marking an
in-place write (`Engine.master_written`). That Python ran per op: AdamW's
`_init_group` alone makes four per parameter (`p.grad` three times, `torch.is_complex`), and a
single-tensor optimizer one per in-place update. For torch.optim's own optimizers, which do
nothing to a parameter but read its metadata and `.grad` and update it in place, the worker
marks the piece's parameters as written first and then runs the step with subclass dispatch
off: the same ops on the same masters, without the Python per op. On the CPU, per piece of two
small parameters: fused AdamW 107 -> 40 us, single-tensor AdamW 198 -> 77 us, SGD with momentum
75 -> 28 us. On the H200's host the worker's time outside the fused kernel is then 0.5 ms per
piece (20 ms of a 400 ms step; the kernel itself is the rest of its busy time). Other optimizers
(and compressed masters, whose writes need their own dispatch) keep it: their code or their
state tensors may rely on a subclass's `__torch_function__`. The step's hooks run with dispatch
off too; on the worker dispatch only passed their ops on to the masters.

# Note [calls in several threads]
Two threads may each train a wrapped model of their own with `backward_and_step` (the engines
refuse only a second thread on one model). Each call first waits for the earlier calls' steps,
but two calls can get past that wait together, so the calls whose steps may still be pending
are a list (`_calls`), not one latest call: `wait_for_steps()`, the optimizer's entry points,
the whole-state waits and the waits before a fork and at exit wait for each. With one latest
call, the first of two such calls was forgotten: waits returned while its worker still stepped,
and the process aborted at exit one run in a few. A call leaves the list when its steps are
done, or when its error has been raised. That error is raised on the thread that made the call
(while it runs: once it has ended, by whichever thread waits next): a wait for every call (the
next `backward_and_step` of another thread's model, its optimizer's `step`) raised the failure
of the other thread's optimizer, which that thread then never saw.

# Note [param groups as of the call]
A deferred step is part of the `optimizer.step()` that backward_and_step stands for, so it
steps each parameter with its group as the group was when the call was made, whatever the
caller does to `param_groups` before the worker gets to it: an LR scheduler writing `lr` (a
tensor lr in place), a group popped or its `params` list cut to freeze layers. The call copies
each group's entries (tensors by value) and its list of parameters; the views the worker steps
are built from those copies. Looked up in the groups as they are at the step, a popped group
gave its hyperparameters to the next one, and parameters taken out of their group were never
stepped.

# Note [attributes the optimizer's step sets]
The worker steps views of the optimizer, so an attribute that the optimizer's own `step` sets on
`self` (a user's class counting steps in `self.t += 1`) was set on a view and dropped: `t` stayed
0, and the updates that read it differed from `optimizer.step()`'s. Running the parts on the
optimizer itself would not do either: `t` would count parts, not steps. So, as with the param
groups, each view starts from the optimizer's attributes as of the call (`_Attributes`), and
what its step rebinds, adds or deletes is written back to the optimizer: every part computes
the same `t + 1`, as the one `step()` would. A value that depends on the parameters stepped (a
gradient norm of them) differs between parts, and no part's value is the step's: the second
part to differ raises, naming the class and the attribute (a partial step, Note [partial
steps]), rather than keep one of them. A class of the user's makes the call return only once a
part has written back, so the attribute reads as after `step()` right after the call (the first
part is usually done during backward). What a step changes in place (a list it appends to, a
tensor counter it adds to) is not an attribute set: that runs once per part, as its step hooks do.

# Note [optimizer state of deferred steps]
The optimizer's `state` is where deferred steps write (`exp_avg`, `step`, created at a
parameter's first step), so reading or changing it while they run raced them: a state tensor
read for logging was a step behind or missing (a KeyError), `optimizer.state.clear()` (resetting
the moments) was followed by the steps still deferred, which started their parameters' state
afresh, and deepcopy or pickling of the optimizer missed their entries. backward_and_step
therefore replaces a plain `defaultdict` state by a `_FencedState`, a subclass holding the same
entries: a parameter's entry (`state[p]`, `p in state`, `del state[p]`) first waits for that
parameter's step, and what reads or changes the whole dict (iteration, `len`, `clear`,
deepcopy, pickling: a plain `defaultdict`) waits for every step; the optimizer worker, which
is the one writing, never waits, and neither does a gradient hook of the backward that hands
the steps over (it would wait for its own backward's end). The steps go into the state dict the optimizer had when the
call was made (`_OverlappedStep._state`): one the caller puts there afterwards
(`optimizer.state = defaultdict(dict)`) starts empty, as after `optimizer.step()`. Not covered: a
state tensor taken before the call and read after it (a plain tensor, as `p.detach()` is), and
a state of another type than `defaultdict` (a custom optimizer's), which is left as it is.

# Note [exit while steps are deferred]
A script whose last call is `backward_and_step` ends while the worker, a daemon thread, is still
stepping; the interpreter's shutdown then tore it down inside PyTorch's C++ code, and the
process died with "terminate called without an active exception" (SIGABRT, exit status 134)
about one run in six. An atexit handler waits for the deferred steps (`settle`: a worker error
is not raised there) before the interpreter shuts down.

# Note [fork while steps are deferred]
A forked process has only the thread that forked: the optimizer worker is not there. A
DataLoader's worker processes fork at `iter(loader)`, typically right after a
`backward_and_step` returned with steps still deferred; a worker that then read an offloaded
parameter (a dataset or collate holding the model) waited for a fence nothing would ever clear,
and the loader hung. Its masters would also have been half stepped. So the process waits for the
deferred steps just before any fork (`os.register_at_fork`), and the child starts from the
stepped weights with no fence set. A fork from inside a backward (a hook) cannot wait for the
steps of that backward, which are still being handed over: it forks as it is. The wait leaves a
worker error in place, for the parent's next wait to raise.
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NoReturn

import torch

from .. import patches
from ..core.engine import Engine
from ..core.grads import publish, set_grads
from ..core.scope import Scope
from ..core.slot import ParamSlot, on_optimizer_worker, worker_state
from ..dispatch.compile import in_compiled_region, not_compiling, run_outside_dynamo
from ..dispatch.masters import without_subclass_dispatch
from ..dispatch.param import OffloadedParameter
from .device_steps import (
    DEVICE_MIN_READY,
    DEVICE_PIECE_FACTOR,
    DEVICE_PIECES_IN_FLIGHT,
    DeviceStep,
    can_take,
    ineligible,
    step_on_device,
)

STEP_PIECE_BYTES = 64 * 2**20  # backward_and_step(piece_bytes=) default; see Note [deferred steps]
# Cores the worker leaves to the thread that launches the device's kernels while that thread may
# need them (Note [worker threads]); backward_and_step(spare_threads=) default.
SPARE_THREADS = 1
# The most of the optimizer's offloaded bytes stepped on the device per call (Note [device
# steps] in optim/device_steps.py); backward_and_step(device_share=) default: none.
DEVICE_SHARE = 0.0

# The backward_and_step calls whose steps may be pending: one per thread training a model of its
# own (Note [calls in several threads]); guarded by _calls_lock.
_calls: list[_OverlappedStep] = []
_calls_lock = threading.Lock()
_last_stepped: list[str] = []  # what the last failed backward_and_step had stepped
_hooked_optimizers: weakref.WeakSet = weakref.WeakSet()


@dataclass
class OverlapReport:
    """What `backward_and_step` did when, in seconds since it was called: for tuning and for
    the benchmark's timeline. `backward_and_step` returns it before the deferred steps are done
    (Note [deferred steps]); `wait()` returns it complete."""

    backward_s: float = 0.0  # loss.backward() returned (all gradients on the host)
    total_s: float = 0.0  # every parameter stepped (0.0 until then)
    # (scope, handed to the worker, its first piece started (its gradients had landed), its
    # last piece stepped)
    scopes: list[tuple[str, float, float, float]] = field(default_factory=list)
    rest_params: int = 0  # parameters stepped after backward, on the calling thread
    pieces: int = 0  # optimizer steps the worker ran (each on part of a scope)
    early_pieces: int = 0  # pieces handed over as their gradients were copied, not at their scope's
    # end of backward (Note [early handover])
    worker_busy_s: float = 0.0  # time the worker spent stepping (compare: the plain CPU step)
    all_thread_pieces: int = 0  # pieces stepped on every thread, a thread waiting (Note [worker threads])
    device_pieces: int = 0  # pieces stepped on the device (Note [device steps] in optim/device_steps.py)
    device_steps_off: str = ""  # why device_share was given but every piece stepped on the host
    _stepper: Any = field(default=None, repr=False, compare=False)

    def wait(self) -> OverlapReport:
        """Block until every step of this call is done; raise the optimizer's error if it failed."""
        if self._stepper is not None:
            self._stepper.wait()
        return self


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, *, zero_grad: bool = False,
                      spare_threads: int | None = None, piece_bytes: int | None = None,
                      device_share: float | None = None, **backward_kwargs: Any) -> OverlapReport:
    """`loss.backward(); optimizer.step()`, with the optimizer overlapped with backward and with
    the next forward.

    Each offloaded scope's parameters are stepped on a host thread as soon as their gradients
    reach the host, while the device continues backward through the earlier scopes, and the
    call returns as soon as backward has: the last scopes' steps finish in the background while
    the next forward begins, each before its weights are loaded. A training step then costs
    about max(forward+backward, CPU optimizer step) instead of their sum. Reading or changing a
    parameter, its `.grad` or the optimizer (`step`, `zero_grad`, `state_dict`) waits for the
    steps it depends on, so results are the same as with `optimizer.step()` after backward for
    per-parameter optimizers (SGD, Adam, AdamW, Adagrad and the like; not LBFGS). Learning-rate
    changes after the call apply from the next step, as they would.

    `optimizer.zero_grad()` right after the call waits for the whole step; pass
    `zero_grad=True` instead, and each parameter's `.grad` is set to None right after its step,
    without waiting. With gradient accumulation, call `loss.backward()` for the first
    micro-batches and `backward_and_step` for the last one. Global-norm gradient clipping needs
    every gradient before the first update, so it cannot be combined with this; clip per
    parameter in a post-accumulate-grad hook, or use `loss.backward()`, `clip_grad_norm_`,
    `optimizer.step()`. For the same reason a loss scaled by a `torch.amp.GradScaler` raises:
    use `scaler.scale(loss).backward()` and `scaler.step(optimizer)`. If backward raises, the
    scopes already stepped stay stepped and the others are not.

    Args:
        loss: the scalar to differentiate.
        optimizer: a `torch.optim.Optimizer` over the model's parameters (offloaded or not).
        zero_grad: set each parameter's `.grad` to None once it is stepped (what
            `optimizer.zero_grad()` does by default), so no wait is needed to zero them.
        spare_threads: CPU threads the optimizer worker leaves to the thread that launches the
            device's kernels: the worker steps with `torch.get_num_threads() - spare_threads`
            intra-op threads (at least 1), and with all of them while a thread is blocked
            waiting for its steps (the next forward waiting for a layer's weights). Default
            (None): `SPARE_THREADS`, 1. A tuning knob; the benchmark's
            `--overlap-spare-threads` sets it.
        piece_bytes: parameter bytes per optimizer step the worker runs: a scope's parameters
            are stepped in pieces of about this size, so that a piece the next forward needs
            soon never waits behind a whole scope (Note [deferred steps]). Default (None):
            `STEP_PIECE_BYTES`, 64 MiB. A tuning knob; `--overlap-piece-mib` in the benchmark.
        device_share: for a host whose CPU optimizer is slower than forward+backward: up to
            this fraction of the optimizer's offloaded bytes may be stepped on the device, their
            masters, gradients and optimizer state copied there and back, while the host thread
            steps the others: whenever two or more pieces are ready, the device takes the one
            the next forward needs last (Note [device steps] in optim/device_steps.py). SGD, Adam and
            AdamW without step hooks of the user's; other optimizers step every piece on the
            host (`report.device_steps_off` says why). Uses device memory for the pieces queued
            there, so not with a VRAM budget. Default (None): `DEVICE_SHARE`, 0.0 (off);
            `--overlap-device-share` in the benchmark.
        **backward_kwargs: passed to `loss.backward` (e.g. `retain_graph`).

    Returns:
        An `OverlapReport`, completed by the worker; `report.wait()` waits for the whole step.

    Example::

        for i, batch in enumerate(micro_batches):
            loss = model(**batch).loss / len(micro_batches)
            if i < len(micro_batches) - 1:
                loss.backward()
            else:
                offtensor.backward_and_step(loss, optimizer, zero_grad=True)
    """
    if in_compiled_region():  # called from a compiled training step: Note [torch.compile]
        return run_outside_dynamo(functools.partial(
            backward_and_step, loss, optimizer, zero_grad=zero_grad, spare_threads=spare_threads,
            piece_bytes=piece_bytes, device_share=device_share, **backward_kwargs), ())
    spare_threads = SPARE_THREADS if spare_threads is None else spare_threads
    piece_bytes = STEP_PIECE_BYTES if piece_bytes is None else piece_bytes
    if isinstance(spare_threads, bool) or not isinstance(spare_threads, int) or spare_threads < 0:
        raise ValueError(f"offtensor.backward_and_step: spare_threads must be an int >= 0, got {spare_threads!r}")
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 1:
        raise ValueError(f"offtensor.backward_and_step: piece_bytes must be an int >= 1, got {piece_bytes!r}")
    device_share = DEVICE_SHARE if device_share is None else device_share
    if isinstance(device_share, bool) or not isinstance(device_share, (int, float)) or not 0 <= device_share <= 1:
        raise ValueError(
            f"offtensor.backward_and_step: device_share must be a number from 0 to 1, got {device_share!r}")
    if _scaled_by_grad_scaler(loss):
        raise RuntimeError(
            "offtensor.backward_and_step: the loss was scaled by a torch.amp.GradScaler "
            "(scaler.scale(loss)), whose step must see every gradient before any parameter is "
            "updated (it unscales them and skips the step when one is inf or NaN), while "
            "backward_and_step updates parameters during backward: it would step on scaled "
            "gradients. Use scaler.scale(loss).backward(); scaler.unscale_(optimizer) (to clip); "
            "scaler.step(optimizer); scaler.update(). bfloat16 autocast needs no GradScaler"
        )
    _check_optimizer(optimizer)
    wait_for_steps()
    engines = _engines_of(optimizer)
    budgeted = [e for e in engines if e.policy.vram_budget is not None]
    if device_share and budgeted:
        raise ValueError(
            f"offtensor.backward_and_step: device_share={device_share} steps parts of the model on the "
            f"device, which takes device memory outside the VRAM budget ({budgeted[0].policy.vram_budget} "
            "bytes) of the model's Policy; leave device_share at 0 with a VRAM budget")
    for engine in engines:
        if engine.grads.stepper is not None and not engine.grads.stepper.closed:
            raise RuntimeError("offtensor.backward_and_step: already inside a backward_and_step on this model")
    _install_optimizer_hooks(optimizer)
    _fence_state(optimizer)
    device_off = ineligible(optimizer, any(e.grads.reducer for e in engines)) if device_share else None
    stepper = _OverlappedStep(optimizer, zero_grad, spare_threads, piece_bytes, float(device_share), device_off)
    # Everything that changes module state happens inside the try, so that an interrupt at any
    # point is undone (Note [interrupts]): an engine left pointing at a stepper would refuse
    # every later call, a worker never closed would be waited for forever.
    try:
        stepper.start()
        with _calls_lock: _calls.append(stepper)  # noqa: E701  (one line: Note [interrupts])
        for engine in engines:
            engine.grads.stepper = stepper
        loss.backward(**backward_kwargs)
    except BaseException as e:  # noqa: BLE001 - re-raised by _raise_partial, with a note
        stepper.cancel()
        for engine in engines:
            engine.backward_failed()
        _raise_partial(e, stepper, "backward")
    finally:
        # The worker waits for pieces until it is closed, and wait_for_steps() waits for the
        # worker: close() must run whatever line an interrupt lands on here, once more if it
        # landed inside the first close() itself.
        try:
            for engine in engines:
                engine.grads.stepper = None
        finally:
            try:
                stepper.close()
            except BaseException:
                stepper.close()
                raise
    stepper.report.backward_s = stepper.elapsed()
    try:
        stepper.step_rest()
    except BaseException as e:  # noqa: BLE001 - re-raised by _raise_partial, with a note
        stepper.cancel()
        _raise_partial(e, stepper, "the optimizer step")
    if not stepper.plain_steps and not stepper.report.rest_params:
        stepper.wait_for_a_part()  # Note [attributes the optimizer's step sets]
    held = [engine for engine in engines if engine.hold()]
    if held:
        # no_offload() keeps device copies that the worker's steps make stale, and the worker
        # cannot release them (Threads): wait for the steps here, then let the next forward
        # load the new weights. No deferred steps inside no_offload().
        stepper.wait()
        for engine in held:
            engine.release_all(force=True)
    return stepper.report


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


def _raise_partial(error: BaseException, stepper: _OverlappedStep, where: str) -> NoReturn:
    """Re-raise `error`, saying which parameters the optimizer had already stepped: a failed
    backward_and_step is a partial step (Note [partial steps])."""
    note = stepper.partial_note(where)
    if hasattr(error, "add_note"):
        error.add_note(note)
        raise error
    raise RuntimeError(f"{note} The error: {error!r}") from error  # Python 3.10


def last_stepped() -> list[str]:
    """Names of the parameters that the last failed `backward_and_step` had stepped before it
    raised (Note [partial steps]); empty if it raised before any step."""
    return list(_last_stepped)


def wait_for_steps() -> None:
    """Block until the latest `backward_and_step` has stepped every parameter."""
    if in_compiled_region():  # Note [torch.compile] in dispatch/compile.py
        return run_outside_dynamo(wait_for_steps, ())
    for stepper in _pending_calls():
        stepper.close_if_abandoned()
        if not stepper.closed and torch._C._current_graph_task_id() != -1:
            # A gradient hook of the call's own backward: its steps end after that backward.
            raise RuntimeError(
                "offtensor.backward_and_step: optimizer.step(), optimizer.state_dict(), "
                "load_state_dict() or offtensor.wait_for_steps() inside the backward of "
                "backward_and_step (in a gradient hook) would wait for steps that end only "
                "after this backward: it waited forever. Call it after backward_and_step returns"
            )
        stepper.wait(from_any_thread=False)


def _pending_calls() -> list[_OverlappedStep]:
    """The backward_and_step calls whose steps may be pending (Note [calls in several threads])."""
    with _calls_lock: return list(_calls)  # noqa: E701


def _forget(stepper: _OverlappedStep) -> None:
    """`stepper` has nothing left to wait for: no step pending, no error to raise."""
    with _calls_lock: _calls[:] = [s for s in _calls if s is not stepper]  # noqa: E701  (Note [interrupts])


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


def _settle_before_fork() -> None:
    """os.register_at_fork's `before`: Note [fork while steps are deferred]."""
    if not on_optimizer_worker():
        for stepper in _pending_calls():
            stepper.settle()


def _settle_at_exit() -> None:
    """atexit: Note [exit while steps are deferred]."""
    for stepper in _pending_calls():
        stepper.settle()


patches.before_fork_and_at_exit(_settle_before_fork, _settle_at_exit)


def _engines_of(optimizer: torch.optim.Optimizer) -> list[Engine]:
    """The engines of the wrapped models whose offloaded parameters the optimizer holds."""
    found: dict[int, Engine] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if isinstance(p, OffloadedParameter) and hasattr(p, "_ot"):
                engine = p._ot.scope.engine
                found[id(engine)] = engine
    return list(found.values())


def _install_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
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


def _fence_state(optimizer: torch.optim.Optimizer) -> None:
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
    for stepper in _pending_calls():
        stepper.close_if_abandoned()
        if stepper.closed:
            stepper.wait(from_any_thread=False)


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


@dataclass(eq=False)
class _Piece:
    """Parameters of one scope stepped together, in the order the next forward uses them."""

    scope: str
    slots: list[ParamSlot]
    landed: Any  # event after the device-to-host copies of its gradients (None on the CPU)
    deadline: tuple[int, int]  # (scope's position in the forward order, first slot's position)
    nbytes: int  # its parameters' bytes
    on_device: bool = False  # stepped on the device (Note [device steps] in optim/device_steps.py)


class _OverlappedStep:
    """One backward_and_step call: the worker thread, its queue and what is still pending."""

    def __init__(self, optimizer: torch.optim.Optimizer, zero_grad: bool, spare_threads: int,
                 piece_bytes: int, device_share: float = 0.0, device_off: str | None = None) -> None:
        self.optimizer = optimizer
        self.zero_grad = zero_grad
        self.spare_threads = spare_threads  # left to the launching thread (backward_and_step)
        self.piece_bytes = piece_bytes  # parameter bytes per worker step (Note [deferred steps])
        # The calling thread's intra-op thread count, which the worker starts from and leaves as
        # the default of new threads (Note [worker threads]).
        self.threads = torch.get_num_threads()
        self._ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        # Names of the offloaded parameters; the others are named by their position.
        self._names = {id(p): p._ot.name if hasattr(p, "_ot") else f"param_groups[{i}][{j}]"
                       for i, g in enumerate(optimizer.param_groups) for j, p in enumerate(g["params"])}
        # The param groups as of this call (Note [param groups as of the call]).
        self._groups = [(g, {**{k: _by_value(v) for k, v in g.items() if k != "params"}, "params": list(g["params"])})
                        for g in optimizer.param_groups]
        # The state it steps into: the caller may put a new dict there before the worker is done
        # (Note [optimizer state of deferred steps]).
        self._state = optimizer.state
        self._attributes = _Attributes(optimizer)  # Note [attributes the optimizer's step sets]
        # Note [worker steps without subclass dispatch]
        self.plain_steps = type(optimizer).__module__.startswith("torch.optim.")
        # Note [device steps] in optim/device_steps.py: the bytes the device may still step in this
        # call, the parameters whose step counts live on the device, the pieces queued there
        # whose copies back may not have landed yet.
        self._device_bytes = 0.0
        self._counts_on_device: set[int] = set()
        if device_share and device_off is None:
            self._device_bytes = device_share * sum(_nbytes(p._ot) for g in optimizer.param_groups for p in g["params"]
                                                    if isinstance(p, OffloadedParameter) and hasattr(p, "_ot"))
            self._counts_on_device = {id(p) for g in optimizer.param_groups if g.get("fused") or g.get("capturable")
                                      for p in g["params"]}
        self._in_flight: list[tuple[_Piece, DeviceStep]] = []
        # A C lock: `with` on it has no Python __enter__ for an interrupt to land in.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pieces: list[_Piece] = []  # handed over, not yet started
        self._handed: set[int] = set()  # ids of the parameters handed to the worker
        self._queued: set[int] = set()  # scopes whose backward ended (post_backward can repeat)
        # Per scope: final gradients not yet a whole piece, and their bytes.
        self._early: dict[Scope, tuple[list[ParamSlot], int]] = {}
        self._closed = False  # no more pieces come
        self._done = False  # the worker has stopped
        self._error: BaseException | None = None
        self._waiting = 0  # threads blocked in wait() (Note [worker threads])
        self._pieces_stepped = 0  # by the worker, failed ones included
        self._times: dict[str, list[float]] = {}  # scope -> [queued, landed, stepped]
        self._rest_done = 0.0
        self._stepped: list[str] = []  # names of the parameters stepped, in order
        self._start = time.perf_counter()
        # The backward_and_step call's frame and thread, until closed (close_if_abandoned).
        self._call: FrameType | None = sys._getframe(1)
        self._caller = threading.get_ident()
        self.report = OverlapReport(_stepper=self)
        if device_off is not None:
            self.report.device_steps_off = device_off
        self._thread = threading.Thread(target=self._run, name="offtensor-optimizer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _locked(self, fn: Any, *args: Any) -> Any:
        """fn(*args) under the lock, on the calling thread. One line: a KeyboardInterrupt can
        land before or after, never between taking and releasing the lock (Note [interrupts])."""
        with self._lock: return fn(*args)  # noqa: E701

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    # ---- the calling thread ------------------------------------------------------------------

    def grad_final(self, slot: ParamSlot, landed: Any) -> None:
        """Called right after a parameter's gradient copy was enqueued, when that gradient is
        its only one in this backward (Note [early handover]); `landed`: the copy's event."""
        scope = slot.scope
        if (scope.grad_calls_since_backward > 1 or scope.engine.late_gradients or slot.used_outside
                or id(slot.param) not in self._ids):
            return
        batch, nbytes = self._early.get(scope, ([], 0))
        batch.append(slot)
        nbytes += _nbytes(slot)
        if nbytes >= self.piece_bytes:
            self._early.pop(scope, None)
            self._hand(scope, [(batch, nbytes)], landed, early=True)
        else:
            self._early[scope] = (batch, nbytes)

    def scope_done(self, scope: Scope, grads_offloaded: Any) -> None:
        """Called at a scope's post_backward, after its d2h copies were enqueued: hand over its
        parameters not handed yet."""
        self._early.pop(scope, None)
        if scope.grad_calls_since_backward > 1 or scope.engine.late_gradients or id(scope) in self._queued:
            return  # another call's backward may still add to these grads; or queued already
        self._queued.add(id(scope))
        order = scope.copy_order or scope.slots
        slots = [s for s in order if s.grad_written and id(s.param) in self._ids and not s.used_outside
                 and id(s.param) not in self._handed]
        pieces: list[tuple[list[ParamSlot], int]] = []
        current: list[ParamSlot] = []
        nbytes = 0
        for i, slot in enumerate(slots):
            current.append(slot)
            nbytes += _nbytes(slot)
            if nbytes >= self.piece_bytes or i == len(slots) - 1:
                pieces.append((current, nbytes))
                current, nbytes = [], 0
        self._hand(scope, pieces, grads_offloaded, early=False)

    def _hand(self, scope: Scope, pieces: list[tuple[list[ParamSlot], int]], landed: Any, *, early: bool) -> None:
        """Queue pieces of one scope (each: its slots, their bytes) for the worker, each stepped
        once `landed` has passed."""
        if not pieces:
            return
        self._locked(self._queue, scope, pieces, landed, early)

    def _queue(self, scope: Scope, pieces: list[tuple[list[ParamSlot], int]], landed: Any, early: bool) -> None:
        if self._done:
            return  # the worker failed: the error is raised on the calling thread
        rank = scope.engine.forward_position(scope)
        self._times.setdefault(scope.name, [self.elapsed(), 0.0, 0.0])
        for slots, nbytes in pieces:
            first = min(slot.copy_index for slot in slots)
            # Queued before marked pending: the worker clears the marks of what it was given,
            # so an interrupt between the two leaves no mark that nothing would clear.
            self._pieces.append(_Piece(scope.name, slots, landed, (rank, first), nbytes))
            for slot in slots:
                slot.pending_step = self  # its fence (Note [step fences] in core/slot.py)
                self._handed.add(id(slot.param))
        if early:
            self.report.early_pieces += len(pieces)
        self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """No more pieces come: its backward is over (or an interrupt skipped the end of it)."""
        return self._closed

    def handed(self, slot: ParamSlot) -> bool:
        """True when the worker publishes and steps this slot (finalize leaves it alone)."""
        return id(slot.param) in self._handed

    def close(self) -> None:
        self._locked(self._close)

    def _close(self) -> None:
        self._closed = True
        self._call = None
        self._cond.notify_all()

    def close_if_abandoned(self) -> None:
        """Close a stepper whose backward_and_step call has ended without closing it: an
        interrupt can land on a line of its cleanup before `close()` runs (the `try:` of its
        `finally`), and the worker would wait for pieces, and every wait for it, forever."""
        call = self._call
        if call is None or self._closed:
            return
        # The calling thread's stack, from whichever thread waits (None: that thread has ended).
        frame = sys._getframe() if threading.get_ident() == self._caller else sys._current_frames().get(self._caller)
        while frame is not None:
            if frame is call:
                return  # the call is still running (a wait from inside it)
            frame = frame.f_back  # type: ignore[assignment]
        self.close()

    def cancel(self) -> None:
        """Backward or the rest's step raised: drop what has not started, wait for the rest.
        The exception in flight is the one the caller sees; a worker error is dropped."""
        self._locked(self._drop_pending)
        if self._thread.is_alive():  # else not started, or starting: it finds nothing to do
            self._thread.join()
        self._error = None
        _forget(self)

    def _drop_pending(self) -> None:
        self._closed = True
        self._call = None
        self._clear_pending(self._pieces)
        self._pieces.clear()
        self._cond.notify_all()

    def partial_note(self, where: str) -> str:
        """What a failure at `where` left stepped (Note [partial steps]); kept for last_stepped()."""
        global _last_stepped
        stepped = _last_stepped = self._locked(list, self._stepped)
        if not stepped:
            return (f"offtensor.backward_and_step: {where} raised before the optimizer stepped any "
                    "parameter; no weight changed.")
        shown = ", ".join(repr(n) for n in stepped[:8]) + (", ..." if len(stepped) > 8 else "")
        return (f"offtensor.backward_and_step: {where} raised after the optimizer had stepped "
                f"{len(stepped)} of its {len(self._ids)} parameters ({shown}); the others were "
                "not stepped. The model now mixes updated and old weights: reload a checkpoint, "
                "or accept the partial step. offtensor.last_stepped() lists them all.")

    def step_rest(self) -> None:
        """Step what the worker does not, on the calling thread (no more pieces come)."""
        error = self._error
        if error is not None:
            raise error  # the worker failed during backward: stop here
        rest = self._ids - self._handed
        self.report.rest_params = len(rest)
        if rest:
            names = [self._names.get(i, "?") for i in rest]
            step_subset(self.optimizer, rest, self._groups, self._state,
                        updated=lambda: self._locked(self._stepped.extend, names), attributes=self._attributes)
            if self.zero_grad:
                for g in self.optimizer.param_groups:
                    for p in g["params"]:
                        if id(p) in rest:
                            p.grad = None
        self._locked(self._rest_stepped)

    def _rest_stepped(self) -> None:
        self._rest_done = self.elapsed()
        self._finish_report()

    def wait(self, slot: ParamSlot | None = None, *, from_any_thread: bool = True) -> None:
        """Until `slot`'s step is done (every step, when None); raises a worker error once.
        `from_any_thread=False`: the error of a call made on another thread that still runs is
        left for that thread (Note [calls in several threads])."""
        while True:
            error, on_device = self._locked(self._wait_locked, slot, from_any_thread)
            if on_device is None:
                break
            on_device.synchronize()  # its piece steps on the device: clear the fence now
            self._finish_device_steps()
        if error is not None:
            _forget(self)  # the worker has stopped; its error is raised once, here
            # Once the call has returned, the error comes out of whatever waits next (the next
            # forward, `p.grad`, a later call): say which step it was.
            _raise_partial(error, self, "the optimizer step deferred past its backward_and_step call "
                                        "(which had returned)" if self._rest_done else "the optimizer step")

    def wait_for_a_part(self) -> None:
        """Until the worker has stepped a piece (or stopped): what the optimizer's step sets on
        itself is then written back (Note [attributes the optimizer's step sets])."""
        self._locked(self._wait_for_a_part_locked)

    def _wait_for_a_part_locked(self) -> None:
        while not self._pieces_stepped and not self._done:
            self._cond.wait()

    def settle(self) -> None:
        """Until the worker has stopped, if no more pieces come; its error stays to be raised
        by the next wait (Note [fork while steps are deferred])."""
        self._locked(self._settle_locked)

    def _settle_locked(self) -> None:
        while self._closed and not self._done:
            self._cond.wait()

    def _wait_locked(self, slot: ParamSlot | None,
                     from_any_thread: bool = True) -> tuple[BaseException | None, DeviceStep | None]:
        """Under the lock: wait until `slot`'s step is done (every step, when None), or until its
        piece is queued on the device (returned: the caller waits for that outside the lock)."""
        self._waiting += 1
        try:
            if slot is None:
                while not self._done:
                    self._cond.wait()
            else:
                while slot.step_pending:
                    on_device = next((step for piece, step in self._in_flight
                                      if any(s is slot for s in piece.slots)), None)
                    if on_device is not None:
                        return None, on_device
                    self._cond.wait()
        finally:
            self._waiting -= 1
        if (self._error is not None and not from_any_thread and threading.get_ident() != self._caller
                and self._caller in sys._current_frames()):
            return None, None
        error, self._error = self._error, None
        return error, None

    # ---- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        threads = self.threads
        try:
            worker_state.active = True
            # OpenMP thread counts are per calling thread: this sets the worker's alone.
            spared = max(1, threads - self.spare_threads)
            current = None
            while True:
                piece, waited_for = self._next_piece()
                if piece is None:
                    return
                # Every core while a thread waits for a step, else leave the launching thread
                # its spare ones (Note [worker threads]); a piece stepped on the device runs no
                # host kernel to thread.
                wanted = threads if waited_for else spared
                if wanted != current and not piece.on_device:
                    torch.set_num_threads(wanted)
                    current = wanted
                self.report.all_thread_pieces += waited_for and spared < threads
                began = time.perf_counter()
                queued = None
                try:
                    with not_compiling():  # Note [compiling beside the optimizer worker] (dispatch/compile.py)
                        queued = self._step_piece(piece)
                finally:
                    self.report.pieces += 1
                    self.report.worker_busy_s += time.perf_counter() - began
                    with self._cond:
                        self._pieces_stepped += 1
                        if queued is None:
                            self._clear_pending([piece])
                        else:  # its fence stays until its copies back land (_finish_device_steps)
                            self._in_flight.append((piece, queued))
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread by wait()
            with self._cond:
                self._error = e
                self._clear_pending(self._pieces)
                self._pieces.clear()
        finally:
            try:
                self._finish_device_steps(block=True)
            finally:
                torch.set_num_threads(threads)
                worker_state.active = False
            with self._cond:
                self._done = True
                self._finish_report()
                self._cond.notify_all()

    def _next_piece(self) -> tuple[_Piece | None, bool]:
        """The landed piece that the next forward needs first (None once all are done), and
        whether a thread is waiting for a step as it is taken; or, while DEVICE_MIN_READY are
        ready and the device has room, the one it needs last, to step on the device (Note
        [device steps] in optim/device_steps.py)."""
        while True:
            self._finish_device_steps()
            with self._cond:
                while not self._pieces and not self._closed and not self._in_flight:
                    self._cond.wait()
                if not self._pieces and not self._in_flight:
                    return None, False
                ready = [p for p in self._pieces if p.landed is None or p.landed.query()]
                if (self._device_bytes > 0 and len(ready) >= DEVICE_MIN_READY
                        and len(self._in_flight) < DEVICE_PIECES_IN_FLIGHT):
                    # The host keeps the DEVICE_MIN_READY - 1 needed first; the device takes the
                    # one needed last of the others that it may take.
                    limit = min(self._device_bytes, DEVICE_PIECE_FACTOR * self.piece_bytes)
                    others = sorted(ready, key=lambda p: p.deadline)[max(0, DEVICE_MIN_READY - 1):]
                    last = next((p for p in reversed(others)
                                 if p.nbytes <= limit and can_take(p.slots, self._state)), None)
                    if last is not None:
                        self._device_bytes -= last.nbytes
                        last.on_device = True
                        self._pieces.remove(last)
                        return last, False
                if ready:
                    piece = min(ready, key=lambda p: p.deadline)
                    self._pieces.remove(piece)
                    return piece, self._waiting > 0
                # Nothing to start: wait for the oldest device step, else for the first piece
                # handed over (its copies land first).
                wait_for = self._in_flight[0][1] if self._in_flight else self._pieces[0].landed
            wait_for.synchronize()

    def _finish_device_steps(self, block: bool = False) -> None:
        """Clear the fences of the pieces stepped on the device whose copies back have landed
        (`block`: wait for all of them first). Any thread; not under the lock."""
        with self._cond:
            in_flight = list(self._in_flight)
        if not in_flight:
            return
        if block:
            for _, step in in_flight:
                step.synchronize()
        finished = [piece for piece, step in in_flight if step.done()]
        if finished:
            with self._cond:
                self._in_flight = [(p, step) for p, step in self._in_flight if all(p is not f for f in finished)]
                self._clear_pending(finished)
                self._cond.notify_all()

    def _step_piece(self, piece: _Piece) -> DeviceStep | None:
        """Step one piece; for one stepped on the device, return its queued step."""
        times = self._times[piece.scope]
        if not times[1]:
            times[1] = self.elapsed()
        publish(piece.slots)
        names = [s.name for s in piece.slots]
        ids = {id(s.param) for s in piece.slots}
        updated = lambda: self._stepped.extend(names)  # noqa: E731
        step = functools.partial(step_subset, self.optimizer, ids, self._groups, self._state, updated,
                                 attributes=self._attributes)
        queued = None
        if piece.on_device:  # Note [device steps] in optim/device_steps.py
            for slot in piece.slots:
                slot.scope.engine.master_written(slot)

            def run(copies: dict[int, torch.Tensor], state: Any) -> None:
                step_subset(self.optimizer, ids, self._groups, state, updated, substitute=copies,
                            attributes=self._attributes)

            queued = without_subclass_dispatch(step_on_device, piece.slots, self._state,
                                               piece.slots[0].scope.engine.streams, self._counts_on_device, run)
            self.report.device_pieces += 1
        elif self.plain_steps and all(slot.packed is None for slot in piece.slots):
            # Note [worker steps without subclass dispatch]
            for slot in piece.slots:
                slot.scope.engine.master_written(slot)
            without_subclass_dispatch(step)
        else:
            step()
        if self.zero_grad:
            without_subclass_dispatch(set_grads, piece.slots, [None] * len(piece.slots))
        times[2] = self.elapsed()  # for a piece on the device: queued there
        return queued

    @staticmethod
    def _clear_pending(pieces: list[_Piece]) -> None:
        for piece in pieces:
            for slot in piece.slots:
                slot.pending_step = None

    def _finish_report(self) -> None:
        """Called under the lock when the worker or the rest finishes; fills in the report and,
        when all went well, lets go of the optimizer (a kept report must not keep its state)."""
        if not (self._done and self._rest_done):
            return
        self.report.scopes = [(name, *t) for name, t in self._times.items()]  # type: ignore[misc]
        self.report.total_s = max(self._rest_done, max((t[2] for t in self._times.values()), default=0.0))
        if self._error is None:
            self.report._stepper = None
            _forget(self)


def step_subset(optimizer: torch.optim.Optimizer, ids: set[int], as_of: list[tuple[dict, dict]] | None = None,
                state: Any = None, updated: Any = None, substitute: dict[int, torch.Tensor] | None = None,
                attributes: _Attributes | None = None) -> None:
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
    attributes = _Attributes(optimizer) if attributes is None else attributes
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


_UNSET = object()  # an attribute the optimizer does not have


class _Attributes:
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


def _nbytes(slot: ParamSlot) -> int:
    return slot.param.numel() * slot.param.element_size()
