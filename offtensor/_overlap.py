"""Optimizer overlap: step each scope's parameters on a host thread during backward.

# Note [optimizer overlap]
With offloading, the optimizer steps on the host after backward: a step costs forward+backward
plus the CPU optimizer. But a scope's gradients are final as soon as its backward is done
(post_backward) and their device-to-host copies have landed, while backward goes on for the
scopes before it. `backward_and_step` hands each finished scope to one worker thread, which
waits (host side, off the main thread) for the scope's `grads_offloaded` event, publishes its
`.grad`s, runs user post-accumulate-grad hooks and calls the user's own `optimizer.step()` on a
view of the optimizer restricted to those parameters. Per-parameter optimizers (SGD, Adam,
AdamW, Adagrad, ... in any of their single-tensor, foreach or fused forms) give exactly the same
update as one `optimizer.step()` after backward. The rest (parameters on the device, scopes
used more than once per forward, parameters also used outside their scope) is stepped on the
calling thread once backward has returned. The masters a worker writes are never read again in
that backward: the scope was released, and the next forward starts after `backward_and_step`
returns.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._grads import publish
from ._param import OffloadedParameter

if TYPE_CHECKING:
    from ._scope import ParamSlot, Scope
    from ._transfer import TransferEngine

# Set on the worker thread: master writes there need no engine bookkeeping (see the Note).
worker_state = threading.local()


@dataclass
class OverlapReport:
    """What `backward_and_step` did when, in seconds since it was called: for tuning and for
    the benchmark's timeline."""

    backward_s: float = 0.0  # loss.backward() returned (all gradients on the host)
    total_s: float = 0.0  # the rest stepped too
    # (scope, handed to the worker, its gradients on the host, its step done)
    scopes: list[tuple[str, float, float, float]] = field(default_factory=list)
    rest_params: int = 0  # parameters stepped after backward, on the calling thread


def backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, **backward_kwargs: Any) -> OverlapReport:
    """`loss.backward(); optimizer.step()`, with the optimizer overlapped with backward.

    Each offloaded scope's parameters are stepped on a host thread as soon as their gradients
    reach the host, while the device continues backward through the earlier scopes: a training
    step costs about max(forward+backward, CPU optimizer step) instead of their sum. The update
    is the same as `optimizer.step()` after backward for per-parameter optimizers (SGD, Adam,
    AdamW, Adagrad and the like; not LBFGS). `backward_and_step` returns when backward and the
    whole step are done. With gradient accumulation, call `loss.backward()` for the first
    micro-batches and `backward_and_step` for the last one. Global-norm gradient clipping needs
    every gradient before the first update, so it cannot be combined with this; clip per
    parameter in a post-accumulate-grad hook, or use `loss.backward()`, `clip_grad_norm_`,
    `optimizer.step()`.

    Args:
        loss: the scalar to differentiate.
        optimizer: a `torch.optim.Optimizer` over the model's parameters (offloaded or not).
        **backward_kwargs: passed to `loss.backward` (e.g. `retain_graph`).

    Returns:
        An `OverlapReport`: when each scope was stepped, relative to backward's end.

    Example::

        for i, batch in enumerate(micro_batches):
            loss = model(**batch).loss / len(micro_batches)
            if i < len(micro_batches) - 1:
                loss.backward()
            else:
                offtensor.backward_and_step(loss, optimizer)
        optimizer.zero_grad()
    """
    stepper = _OverlappedStep(optimizer)
    report = stepper.report
    engines = stepper.engines()
    for engine in engines:
        if engine.grads.stepper is not None:
            raise RuntimeError("offtensor.backward_and_step: already inside a backward_and_step on this model")
        engine.grads.stepper = stepper
    try:
        loss.backward(**backward_kwargs)
    finally:
        for engine in engines:
            engine.grads.stepper = None
        stepper.close()
    report.backward_s = stepper.elapsed()
    stepper.step_rest()
    report.total_s = stepper.elapsed()
    return report


class _OverlappedStep:
    """One backward_and_step call: the worker thread and what it has stepped."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self._stepped: set[int] = set()
        self._queued: set[int] = set()  # scopes handed to the worker (post_backward can repeat)
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._start = time.perf_counter()
        self.report = OverlapReport()
        self._thread = threading.Thread(target=self._run, name="offtensor-optimizer", daemon=True)
        self._thread.start()

    def engines(self) -> list[TransferEngine]:
        found: dict[int, TransferEngine] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if isinstance(p, OffloadedParameter) and hasattr(p, "_ot"):
                    engine = p._ot.scope.engine
                    found[id(engine)] = engine
        return list(found.values())

    def scope_done(self, scope: Scope, grads_offloaded: Any) -> None:
        """Called at a scope's post_backward, after its d2h copies were enqueued."""
        if scope.calls_in_pass > 1 or id(scope) in self._queued:
            return  # a later call's backward may still add to these grads; or queued already
        self._queued.add(id(scope))
        slots = [s for s in scope.slots if s.grad_written and id(s.param) in self._ids and not s.used_outside]
        if slots:
            self._jobs.put((scope.name, self.elapsed(), slots, grads_offloaded))

    def drain(self) -> None:
        """Wait until every queued scope is stepped (called by finalize, before it publishes
        the remaining grads)."""
        self._jobs.join()
        if self._error is not None:
            raise self._error

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def published(self, slot: ParamSlot) -> bool:
        return id(slot.param) in self._stepped

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def step_rest(self) -> None:
        rest = {i for i in self._ids if i not in self._stepped}
        self.report.rest_params = len(rest)
        if rest:
            _step_subset(self.optimizer, rest)

    def _run(self) -> None:
        worker_state.active = True
        # The thread that launches backward's kernels must keep a core: a CPU optimizer on every
        # core starves it and the GPU idles. OpenMP thread counts are per calling thread here;
        # the global default is restored on exit.
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads - 2))
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    torch.set_num_threads(threads)
                    return
                if self._error is None:
                    name, queued, slots, event = job
                    if event is not None:
                        event.synchronize()
                    landed = self.elapsed()
                    publish(slots)
                    ids = {id(slot.param) for slot in slots}
                    _step_subset(self.optimizer, ids)
                    self._stepped.update(ids)
                    self.report.scopes.append((name, queued, landed, self.elapsed()))
            except BaseException as e:  # reported on the calling thread
                self._error = e
            finally:
                self._jobs.task_done()


def _step_subset(optimizer: torch.optim.Optimizer, ids: set[int]) -> None:
    """`optimizer.step()` over only the parameters whose ids are in `ids` (state is keyed by
    parameter, so it is the same update as the full step for those parameters)."""
    groups = optimizer.param_groups
    pairs = []
    for g in groups:
        params = [p for p in g["params"] if id(p) in ids]
        if params:
            pairs.append((g, {**g, "params": params}))
    if not pairs:
        return
    optimizer.param_groups = [sub for _, sub in pairs]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups
        for g, sub in pairs:
            for k, v in sub.items():
                if k != "params":
                    g[k] = v
