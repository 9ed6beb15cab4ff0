"""Sharded loads: each rank copies 1/N of a scope over its own host-to-device link and the ranks
all-gather the rest: `data_parallel(model, shard_loads=True)` (distributed/data_parallel.py, a layer above).

# Note [sharded loads]
Every rank of a data-parallel model loads every scope for every pass over its own PCIe link.
When the ranks' masters hold the same values (after data_parallel's broadcast, and after every
step: each rank steps the same averaged gradients, or reads one shared copy behind the step
fence), rank r copies only the r-th 1/N slice of the scope's flat host buffer into the same bytes
of its device buffer, and an all-gather fills the other slices from the other ranks over NVLink,
much faster than PCIe: PCIe bytes per rank drop N-fold.
- *Where.* The scope's source becomes a `ShardedSource` around the one wrap chose (Note [master
  sources] in scopes/sources.py), whose load is `ShardedLoads.copy` on the copy stream in place
  of the whole-scope copy; never progressive (Note [progressive loads] in scopes/loading.py), so
  the scope first waits for its deferred steps. The slice is `slice_bytes(nbytes, N)`, an
  alignment multiple; every rank copies the tail after N slices. On CUDA the all-gather is in
  place and NCCL's stream waits for the copy stream; the `gathered` stream waits for NCCL and
  records the load's `weights_ready`, which so follows the whole scope:
  make_resident, release and the master-read fence work unchanged. The copy stream does not wait
  for the all-gather (the next scope's slice crosses PCIe while this one's cross NVLink), and the
  host never waits. On the CPU (gloo) the call returns when the slices are there.
- *Which scopes.* Those whose load is a plain byte copy (`shardable`): not one that casts or holds
  compressed masters, nor one too small for an aligned slice per rank.
Which loads the ranks issue, and what a failure does: Note [sharded load order].

# Note [sharded load order]
Collectives are matched by the order the ranks issue them, so every rank must issue the same
sharded loads in the same order. The forward and backward hooks issue them (on-demand loads, the
learned prefetch, backward reloads) from the passes, the policy and the wrapped model, all agreed,
and from what the engine learned from the passes before (the orders that drive the prefetch,
whether a backward is expected): ranks that ran the same passes learned the same, and
data_parallel starts every rank from nothing learned. A pass on some ranks only goes inside
`local_loads`: whole-scope copies, no collective, and on exit the engine's learned state as it
was (containers copied, the scopes in them kept: a copied Scope is not one the loader knows). The
loads have a process group of their own, so their order is independent of the gradients'.
Mismatches are errors, not hangs or mixed buffers. Each load has a tag (the scope's index, its
count of sharded loads); where checking is cheap (not CUDA, or OFFTENSOR_CHECK_SHARDED_LOADS=1: a
host sync per load) the ranks all-gather the tags first, and ranks loading different scopes raise
the same error naming both. Every collective has the process group's timeout. A rank that raised
in a forward (the engine's abort) or a sharded load is DESYNCED (a timed-out gloo collective
leaves the pair one message out of step) and forgets what it learned; its next load first meets
the other ranks through the store, within the same timeout, then all load through a new process
group with fresh counts: once the other ranks have raised too, the model works again.
"""

from __future__ import annotations

import copy
import datetime
import enum
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..api import MasterHome
from ..engine.engine import Engine, TrainingState, engine_of, owning_engine
from ..scopes.loading import LoadProgress
from ..scopes.scope import ALIGN, Scope
from ..scopes.sources import BufferSource, MasterSource, SourcedScope
from .matching import all_gather, check_tag, ordinal, wait_for_ranks

_STORE_PREFIX = "offtensor/shard_loads"
CHECK_ENV = "OFFTENSOR_CHECK_SHARDED_LOADS"


class LoadsState(enum.Enum):
    """Whether this rank's sharded loads are matched one to one with the other ranks'."""

    IN_STEP = "in step"  # every collective so far was issued by every rank in the same order
    DESYNCED = "desynced"  # a pass or a load failed here: the next load first meets the others


def slice_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank copies of a scope of `nbytes` (an ALIGN multiple; 0: not sharded). The
    last `nbytes - world * slice` bytes are copied by every rank."""
    return nbytes // world // ALIGN * ALIGN


def shardable(scope: Scope) -> bool:
    """Whether the scope's load is a plain byte copy (Note [sharded loads]); a scope that does
    not cast has no host-cast shadow (ShadowSource in scopes/sources.py)."""
    return (not scope.casts and scope.masters.nbytes == scope.device.nbytes
            and not any(s.packed is not None for s in scope.slots))


@dataclass(frozen=True)
class _Plan:
    """Where one sharded scope's slices are."""

    index: int  # of the scope among all the model's scopes: its tag
    slice: int  # bytes per rank
    lo: int  # this rank's first byte


class ShardedLoads:
    """The sharded loads of every shardable scope of one data-parallel model (each scope's
    `ShardedSource`)."""

    def __init__(self, engines: list[Engine], ranks: list[int], group: Any, job: str, store: Any,
                 timeout: datetime.timedelta) -> None:
        dist = torch.distributed
        self.engines = engines
        self.ranks = ranks
        self.world = len(ranks)
        self.rank = dist.get_rank()
        self.position = ranks.index(self.rank)  # in the group: which slice is this rank's
        self.backend = str(dist.get_backend(group))
        self.timeout = timeout  # every collective's, and the resynchronisation's
        self._store = store
        self._prefix = f"{_STORE_PREFIX}/{job}/"
        self.group = self._new_group()
        scopes = [scope for engine in engines for scope in engine.scopes]
        self.names = [scope.name for scope in scopes]
        self.plans: dict[Scope, _Plan] = {}
        for i, scope in enumerate(scopes):
            size = slice_bytes(scope.masters.nbytes, self.world)
            if shardable(scope) and size > 0:
                self.plans[scope] = _Plan(i, size, self.position * size)
        self.counts = [0] * len(scopes)  # sharded loads per scope since the last (re)start
        device = engines[0].device
        self.checked = device.type != "cuda" or os.environ.get(CHECK_ENV) == "1"
        self.state = LoadsState.IN_STEP
        self.resyncs = 0
        # local_loads() contexts entered on this rank and not left; weak, as no_sync's holds.
        self.holds: weakref.WeakSet[local_loads] = weakref.WeakSet()
        # What this rank did (tests, the benchmark): bytes read from host masters by loads of
        # the sharded scopes, and the all-gathers launched.
        self.host_bytes = 0
        self.gathers = 0

    def install(self) -> None:
        for engine in self.engines:
            _forget_learned(engine)
        for scope in self.plans:
            scope.source = ShardedSource(self, scope.source)
        for engine in self.engines:
            engine.on_abort.append(self.desync)

    def close(self) -> None:
        """Back to plain loads (unwrap; data-parallel mode ends)."""
        for scope in self.plans:
            source = scope.source
            if isinstance(source, ShardedSource) and source.loads is self:
                scope.source = source.inner
        for engine in self.engines:
            if self.desync in engine.on_abort:
                engine.on_abort.remove(self.desync)

    def desync(self) -> None:
        """A forward failed on this rank (Engine.abort): the other ranks may be waiting in, or
        past, loads this rank will never issue; and its learned orders may now differ from
        theirs (Note [sharded load order])."""
        self.state = LoadsState.DESYNCED
        for engine in self.engines:
            _forget_learned(engine)

    # ---- the load (ShardedSource.enqueue calls it on the copy stream) --------------------------

    def copy(self, scope: Scope) -> Any:
        """Fill the scope's device buffer from its masters: this rank's slice over its own link,
        the others from the other ranks (Note [sharded loads]). Returns, on CUDA, the event
        after it all (None: the copy stream's next event follows it)."""
        plan = self.plans[scope]
        if self.holds:  # local_loads(): a pass of this rank alone
            scope.device.flat.copy_(scope.masters.flat, non_blocking=True)
            self.host_bytes += scope.masters.nbytes
            return None
        try:
            if self.state is LoadsState.DESYNCED:
                self._resync(scope)
            return self._gather(scope, plan)
        except BaseException:
            self.desync()
            _undo_load(scope)
            raise

    def _gather(self, scope: Scope, plan: _Plan) -> Any:
        self.counts[plan.index] += 1
        count = self.counts[plan.index]
        if self.checked:
            self._check_tag(scope, plan, count)
        dst, src = scope.device.flat, scope.masters.flat
        lo, hi, gathered = plan.lo, plan.lo + plan.slice, plan.slice * self.world
        dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
        if gathered < scope.masters.nbytes:  # the tail: every rank copies it
            dst[gathered:].copy_(src[gathered:], non_blocking=True)
        self.host_bytes += plan.slice + scope.masters.nbytes - gathered
        # In place: the input is this rank's slice of the output (NCCL's in-place all-gather).
        try:
            work = all_gather(dst[:gathered], dst[lo:hi], self.group)  # after the copy stream's work
            self.gathers += 1
            streams = scope.streams
            gathered = streams.gathered()
            if gathered is None:
                work.wait()  # gloo: the host waits
                return None
            with streams.on(gathered):
                work.wait()  # this stream waits for NCCL's; the copy stream goes on
                return streams.record(gathered)
        except RuntimeError as e:
            raise RuntimeError(
                f"{self._where(scope, count)} failed: {e}. The other ranks did not join it within "
                f"the process group's timeout ({self.timeout.total_seconds():g} s), or joined with "
                f"other loads. {self._fix}"
            ) from e

    def _check_tag(self, scope: Scope, plan: _Plan, count: int) -> None:
        """All-gather (scope index, count) first and compare: different loads raise the same
        error on every rank instead of mixing buffers."""
        check_tag((plan.index, count), self.group, self.world, scope.device.flat.device, self.ranks,
                  where=lambda: self._where(scope, count), theirs=self._load_of, differs="passes", fix=self._fix,
                  timeout=f" ({self.timeout.total_seconds():g} s)")

    def _load_of(self, tag: list[int]) -> str:
        index, n = tag
        return (f"load of scope {self.names[index]!r} for the {ordinal(n)} time" if 0 <= index < len(self.names)
                else f"load of an unknown scope (tag {tag})")

    def _where(self, scope: Scope, count: int) -> str:
        return (f"offtensor.data_parallel(shard_loads=True): rank {self.rank}'s load of scope "
                f"{scope.name!r} (its {ordinal(count)} sharded load)")

    _fix = ("Every rank must run the same forward and backward passes (their loads are collective); "
            "wrap a pass that runs on some ranks only (evaluation on rank 0) in "
            "offtensor.local_loads(model). A rank that raised first shows its own error; the next "
            "load resynchronises the ranks")

    def _resync(self, scope: Scope) -> None:
        """After a failure: meet every rank through the store (bounded), then load through a
        new process group with fresh counts (Note [sharded load order])."""
        n = self.resyncs + 1
        keys = [f"{self._prefix}resync/{n}/{r}" for r in self.ranks]
        self._store.set(keys[self.position], "1")
        # Twice the timeout: a rank whose pass failed arrives here first, the others only once
        # their next collective has timed out and they call the model again.
        missing = wait_for_ranks(self._store, keys, 2 * self.timeout, self.ranks)
        if missing is not None:
            raise RuntimeError(
                f"offtensor.data_parallel(shard_loads=True): rank {self.rank} loads scope "
                f"{scope.name!r} after a forward or a load failed on it, and waited "
                f"{2 * self.timeout.total_seconds():g} s for rank(s) {missing or '?'} to resynchronise "
                "the sharded loads. The other ranks arrive here at their next load once their own "
                "pass has failed (at the latest after the process group's timeout); call the "
                "model again on every rank"
            )
        self.group = self._new_group()
        self.counts = [0] * len(self.counts)
        self.resyncs = n
        self.state = LoadsState.IN_STEP

    def _new_group(self) -> Any:
        return torch.distributed.new_group(self.ranks, timeout=self.timeout, backend=self.backend,
                                           use_local_synchronization=True)


class ShardedSource(BufferSource):
    """A shardable scope's source while its loads are sharded: copied from the host buffer as
    `loads.copy` does; for the rest (the prefetch, the timed layout, the staging ring, host RAM)
    as the source it replaces, which unwrap puts back (Note [sharded loads])."""

    progressive = False
    gathers = True

    def __init__(self, loads: ShardedLoads, inner: MasterSource) -> None:
        self.loads = loads
        self.inner = inner  # the source wrap chose: BufferSource or StagedSource

    @property
    def home(self) -> MasterHome:
        return self.inner.home  # the masters stay where they were

    def enqueue(self, scope: SourcedScope, loading: LoadProgress, host: torch.Tensor, h2d: Any,
                whole: bool) -> None:
        assert isinstance(scope, Scope)
        ready = self.loads.copy(scope)  # an event after its copy (CUDA), else None
        loading.chunk_ready = [ready if ready is not None else scope.streams.record(h2d)]

    def ready(self, scope: SourcedScope) -> bool:
        return self.inner.ready(scope)

    def host_bytes(self, scope: SourcedScope) -> int:
        return self.inner.host_bytes(scope)

    def write_mark(self, scope: SourcedScope) -> tuple[Any, ...]:
        return self.inner.write_mark(scope)

    def sample(self, scope: SourcedScope) -> torch.Tensor:
        return self.inner.sample(scope)

    def load_ms(self, scope: SourcedScope, copy_ms_per_byte: float, read_ms_per_byte: float) -> float:
        return self.inner.load_ms(scope, copy_ms_per_byte, read_ms_per_byte)


def _forget_learned(engine: Engine) -> None:
    """The engine's learned orders and training state back to a new model's (Note [sharded
    load order])."""
    schedule = engine.schedule
    schedule.forget_order()
    schedule.forget_backward()
    schedule._bwd_order.clear()
    schedule._next_begin.clear()
    schedule.last_begin = None
    engine.training = TrainingState.INFERENCE


def _learned(engine: Engine) -> dict[str, Any]:
    """What the engine learned from the passes so far, to put back after a local pass. The
    containers are copied (the local pass changes them in place), the scopes they and the other
    attributes name are not: a copy of a Scope (`last_begin`) is not the model's scope."""
    saved = {name: copy.copy(value) if isinstance(value, (list, dict, set)) else value
             for name, value in vars(engine.schedule).items()}
    saved["training"] = engine.training
    return saved


def _put_back(engine: Engine, saved: dict[str, Any]) -> None:
    saved = dict(saved)
    engine.training = saved.pop("training")
    vars(engine.schedule).update(saved)


def _undo_load(scope: Scope) -> None:
    """A sharded load raised inside its scope's load (before the scope became LOADING): free
    the device buffer it allocated, after the copies queued into it."""
    streams = scope.streams
    streams.wait(streams.compute(), streams.record(streams.h2d()))
    scope.device.storage.resize_(0)


def sharded_loads_of(model: nn.Module) -> ShardedLoads | None:
    """The ShardedLoads of the data-parallel model holding `model`'s offloaded parameters."""
    for p in model.parameters():
        slot = getattr(p, "_ot", None)
        if slot is not None:
            reducer = owning_engine(slot).grads.reducer
            return getattr(reducer, "loads", None)
    return None


class local_loads:
    """Load the scopes of a `data_parallel(model, shard_loads=True)` model on this rank alone,
    each whole over its own link, with no collective: for passes that run on some ranks only,
    such as an evaluation or generation on rank 0 (Note [sharded load order]). Outside it, every
    rank must run the same passes. Other data-parallel models: nothing to do.

    Example::

        if rank == 0:
            with torch.no_grad(), offtensor.local_loads(model):
                evaluate(model)
    """

    def __init__(self, model: nn.Module) -> None:
        engine_of(model, "local_loads")  # raises if not wrapped
        self._loads = sharded_loads_of(model)
        self._depth = 0
        self._saved: list[tuple[Engine, dict[str, Any]]] = []

    def __enter__(self) -> local_loads:
        self._depth += 1
        loads = self._loads
        if loads is not None and self._depth == 1:
            # What the local pass teaches the engine, the other ranks do not learn.
            self._saved = [(engine, _learned(engine)) for engine in loads.engines]
            loads.holds.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._loads is not None:
            self._loads.holds.discard(self)
            for engine, saved in self._saved:
                _put_back(engine, saved)
            self._saved = []
