"""One host copy of the offloaded masters per node, and the CPU optimizer split across the ranks:
`data_parallel(model, shard_optimizer=True)` (distributed/data_parallel.py, a layer above).

# Note [one host copy per node]
Plain data parallel (Note [data parallel] in distributed/reducer.py) gives every rank its own host
copy of the masters and its own full optimizer step. With `shard_optimizer=True` the ranks of the
node share one copy and each parameter is stepped by one rank:
- *One copy.* After the agreement check the node's first rank copies its masters into a file in
  /dev/shm, every rank maps it (Note [shared host memory] in storage/shm.py) and re-points
  each scope's masters at the mapping (`Scope.move_masters_into`): the parameter objects stay. On
  CUDA each process page-locks the mapping, so every GPU copies from the same pinned pages.
- *Owners.* Every trainable offloaded parameter gets an owner rank, computed by every rank from
  the agreed description: largest first, each to the rank with the fewest bytes so far
  (`plan_owners`). Frozen masters get none; they never change.
- *Gradients to the owner.* In a synchronised backward `GradOffload` sends each contribution to
  its owner with `dist.reduce(dst=owner)` in place of the all-reduce. Only the owner's `p.grad`
  gets the average; the others' stay None, so a torch.optim optimizer built over all parameters
  on every rank steps, and keeps state for, only the rank's own: 1/N of the CPU step and state.
- *What is sent.* Each rank sends its own part divided by N (the contribution plus what it
  accumulated under `no_sync`); the owner adds, undivided, an average its `p.grad` already holds
  from an earlier synchronised contribution, which it knows by the tensor and version counter
  recorded after the copy (`Sharding.written`). A `no_sync` backward adding to such an averaged
  gradient would leave a sum that cannot be split later, and raises.

# Note [barrier across ranks]
A rank must not copy a master to its device while its owner, in another process, steps it, and
every rank must see the stepped values from the next forward on. The owner's step cannot start
before every rank's copy of the weights for that backward is done (it needs the reduced gradient,
which needs every rank's backward). The other direction is ordered by a fence, a bounded barrier
through the process group's store (keys `fence/<n>/<rank>`, waiting at most the store's timeout
and naming the ranks that did not arrive):
- after each `optimizer.step()` of an optimizer holding the model's trainable offloaded
  parameters (a global step post-hook), so every rank then reads the stepped masters;
- before the next forward, when a synchronised backward has run since the last fence
  (`MastersState.MAY_CHANGE`): `backward_and_step` returns before its steps are done (Note
  [deferred steps] in optim/overlap.py), so the forward first waits for this rank's steps, then
  for the fence. `offtensor.sync_masters(model)` is the same wait, e.g. before a checkpoint.
After the fence each master another rank owns counts as written (`before_master_write`): a kept
device copy is released, a `cast="host"` shadow recast. Between a synchronised backward and the
next fence, reading the values of a master another rank owns (`state_dict()`, `p.detach()`)
raises, naming `sync_masters`, since its owner may be stepping it: the fence cannot be taken
there, as it is a barrier of every rank and such a read often runs on one. What a parameter is
(its shape, `.grad`, `requires_grad`) stays readable: optimizers, clipping and zero_grad read
only that of the parameters they do not step.
"""

from __future__ import annotations

import enum
import math
import uuid
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..dispatch.param import OffloadedParameter
from ..dispatch.slot import ParamSlot, holding_masters, in_backward, on_optimizer_worker, weakly
from ..engine.engine import Engine, owning_engine
from ..optim.overlap import wait_for_steps
from ..storage import shm as _shm
from ..storage.memory import _PAGE, HostBuffer, register_pinned
from .matching import wait_for_ranks

_STORE_PREFIX = "offtensor/shard_optimizer"


class MastersState(enum.Enum):
    """Whether another rank may have stepped a shared master since the last fence."""

    AGREED = "agreed"  # no step since the last fence: every rank reads the same, final values
    MAY_CHANGE = "may change"  # owners got gradients: one may step; the next forward fences first


def new_job_id() -> str:
    """A name for this job's shared memory; the node's first rank's is used."""
    return uuid.uuid4().hex[:16]


def plan_owners(rows: list[tuple[str, int, bool]], ranks: list[int]) -> dict[str, int]:
    """Owner rank of each trainable offloaded parameter, from (name, bytes, requires_grad) rows in
    the agreed order: largest first (ties: earlier first), each to the rank with the fewest
    bytes so far (ties: the lower rank). Deterministic, so every rank computes the same."""
    load = dict.fromkeys(ranks, 0)
    owners: dict[str, int] = {}
    trainable = [(i, name, n) for i, (name, n, trains) in enumerate(rows) if trains]
    for _, name, nbytes in sorted(trainable, key=lambda t: (-t[2], t[0])):
        rank = min(ranks, key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += nbytes
    return owners


def row_bytes(shape: list[int], dtype: str) -> int:
    """Bytes of a parameter described as (shape, 'torch.float32')."""
    return math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize


def wait_on_d2h(engine: Engine, work: Any, device: torch.device) -> None:
    """Make the gradient's device-to-host copy wait for a collective: on CUDA only the d2h stream
    waits (Note [data parallel] in distributed/reducer.py); on the CPU the host does."""
    if device.type == "cuda":
        with engine.streams.on(engine.streams.d2h()):
            work.wait()
    else:
        work.wait()


# ---- one copy per node -------------------------------------------------------------------------


def share_masters(engines: list[Engine], ranks: list[int], rank: int, job: str, store: Any,
                  timeout: Any) -> None:
    """Move every scope's masters into one shared-memory file of the node: the first rank
    creates it with its values, the others map it; unlinked once all have (Note [one host copy
    per node], Note [shared host memory] in storage/shm.py)."""
    scopes = [scope for engine in engines for scope in engine.scopes]
    offsets, total = [], 0
    for scope in scopes:
        offsets.append(total)
        total += -(-scope.masters.nbytes // _PAGE) * _PAGE
    name = f"offtensor-{job}"
    prefix = f"{_STORE_PREFIX}/{job}/"
    leader = ranks[0]
    wait_for_steps()  # a deferred optimizer step may still write the masters
    for engine in engines:
        engine.live.release_all(force=True)  # device copies (kept by a VRAM budget too) come from the masters
    try:
        if rank == leader:
            array = _create_filled(name, total, scopes, offsets, store, prefix)
        else:
            array = _attach_when_ready(name, total, leader, store, prefix, timeout)
        if any(scope.pinned for scope in scopes):
            register_pinned(array, owner=array)
        for scope, offset in zip(scopes, offsets, strict=True):
            scope.move_masters_into(HostBuffer.over(array[offset : offset + scope.masters.nbytes]))
    finally:
        store.set(f"{prefix}mapped/{rank}", "1")
        if rank == leader:
            try:
                _wait(store, [f"{prefix}mapped/{r}" for r in ranks], timeout, ranks,
                      "to map the shared masters")
            finally:
                _shm.unlink(name)  # the mappings keep the memory; nothing is left if one dies


def _create_filled(name: str, total: int, scopes: list[Any], offsets: list[int], store: Any,
                   prefix: str) -> Any:
    try:
        array = _shm.create(name, total)
        for scope, offset in zip(scopes, offsets, strict=True):
            scope.take_back_masters()  # host_flat must hold them (Note [masters moved out of the host buffer])
            torch.from_numpy(array[offset : offset + scope.masters.nbytes]).copy_(scope.masters.flat)
    except BaseException as e:
        _shm.unlink(name)
        store.set(f"{prefix}ready", f"error: {e}")
        raise
    store.set(f"{prefix}ready", "ok")
    return array


def _attach_when_ready(name: str, total: int, leader: int, store: Any, prefix: str, timeout: Any) -> Any:
    _wait(store, [f"{prefix}ready"], timeout, [leader], "to create the shared masters")
    status = store.get(f"{prefix}ready").decode()
    if status != "ok":
        raise RuntimeError(
            f"offtensor.data_parallel(shard_optimizer=True): rank {leader} could not share the masters "
            f"({status.removeprefix('error: ')})"
        )
    return _shm.attach(name, total)


def _wait(store: Any, keys: list[str], timeout: Any, ranks: list[int], what: str) -> None:
    """store.wait(keys, timeout), or an error naming the ranks whose keys are missing."""
    missing = wait_for_ranks(store, keys, timeout, ranks)
    if missing is not None:
        raise RuntimeError(
            f"offtensor.data_parallel(shard_optimizer=True): rank(s) {missing or '?'} did not "
            f"arrive within {timeout.total_seconds():g} s {what}; every rank must do the same "
            "steps (see the other ranks' errors)"
        )


# ---- owners and the fence ----------------------------------------------------------------------


class Sharding:
    """Who steps which offloaded parameter of one data-parallel model, and the fence after the
    steps (Note [one host copy per node], Note [barrier across ranks])."""

    def __init__(self, engines: list[Engine], group: Any, ranks: list[int], owners: dict[str, int],
                 job: str, store: Any) -> None:
        self.engines = engines
        self.group = group
        self.ranks = ranks
        self.rank = torch.distributed.get_rank()
        self.world = len(ranks)
        self.owner: dict[ParamSlot, int] = {}
        for engine in engines:
            for scope in engine.scopes:
                for slot in scope.slots:
                    if slot.name in owners:
                        self.owner[slot] = owners[slot.name]
        self._trainable = {id(slot.param) for slot in self.owner}
        self.state = MastersState.AGREED
        self.fences = 0  # fences passed (tests, debugging)
        # Per slot this rank owns: its host gradient after a synchronised reduce, and that
        # tensor's version then (what is sent: Note [one host copy per node]).
        self._reduced: dict[ParamSlot, tuple[weakref.ref, int]] = {}
        self._store = store
        self.job = job  # names its shared memory (tests, debugging)
        self._prefix = f"{_STORE_PREFIX}/{job}/fence/"
        self.handles: list[Any] = []

    # ---- the gradient path (GradReducer hands these to GradOffload) ---------------------------

    def owns(self, slot: ParamSlot) -> bool:
        return self.owner.get(slot) == self.rank

    def reduce(self, slot: ParamSlot, grad: torch.Tensor, old: torch.Tensor | None,
               syncing: bool) -> torch.Tensor | None:
        """This rank's contribution `grad` plus the old host gradient `old` (on the device):
        under no_sync their sum, else the average sent to the owner, which gets it back (None on
        the other ranks)."""
        if not syncing:
            if old is not None and self._holds_reduced(slot):
                raise RuntimeError(
                    f"offtensor.no_sync: parameter {slot.name!r} already holds the averaged gradient "
                    "of an earlier synchronised backward (this rank owns it under "
                    "data_parallel(shard_optimizer=True); the other ranks dropped theirs), and a "
                    "backward under no_sync would add this rank's own part to it, a sum that cannot "
                    "be averaged later. Zero the gradients (optimizer.zero_grad()) after each "
                    "optimizer step, before the micro-batches that accumulate under no_sync"
                )
            return grad if old is None else grad + old
        owner = self.owner.get(slot)
        if owner is None:
            raise RuntimeError(
                f"offtensor.data_parallel(shard_optimizer=True): offloaded parameter {slot.name!r} "
                "got a gradient, but it was frozen when data_parallel assigned each trainable "
                "parameter its owner rank, so no rank steps it. Unfreeze parameters before "
                "offtensor.data_parallel(model, shard_optimizer=True)"
            )
        if self.state is not MastersState.MAY_CHANGE:
            holding_masters()
            for other, other_owner in self.owner.items():
                if other_owner != self.rank:
                    other.stepped_elsewhere = self  # until the fence (refuse_read)
        self.state = MastersState.MAY_CHANGE
        part = grad / self.world  # a tensor of our own: `grad` may be autograd's or a hook's
        if old is not None:
            part = part + (old if owner == self.rank and self._holds_reduced(slot) else old / self.world)
        part = part.contiguous()
        work = torch.distributed.reduce(part, dst=owner, group=self.group, async_op=True)
        if owner != self.rank:
            if part.device.type != "cuda":
                work.wait()  # gloo: the tensor must outlive the collective; NCCL records it
            return None
        wait_on_d2h(owning_engine(slot), work, part.device)
        return part

    def written(self, slot: ParamSlot, buf: torch.Tensor, syncing: bool) -> None:
        """The host gradient `buf` was written (its copy enqueued): remember whether it now
        holds an average, until it is zeroed or replaced."""
        if syncing and self.owns(slot):
            self._reduced[slot] = (weakref.ref(buf), buf._version)
        else:
            self._reduced.pop(slot, None)

    def _holds_reduced(self, slot: ParamSlot) -> bool:
        record = self._reduced.get(slot)
        if record is None:
            return False
        tensor = record[0]()
        return tensor is not None and tensor._version == record[1] and tensor is slot.host_grad

    # ---- the fence (Note [barrier across ranks]) ------------------------------------------------

    def install(self, model: nn.Module) -> None:
        """The fence after optimizer steps and before the forward that follows a synchronised
        backward; nothing when no offloaded parameter is trainable (the masters never change)."""
        if not self.owner:
            return
        # Global to torch.optim: weakly, and removed with this object, or it would keep the
        # engines and the model alive (Note [hooks that keep a model alive] in dispatch/slot.py).
        handle = register_optimizer_step_post_hook(weakly(self._after_step))
        self.handles.append(handle)
        weakref.finalize(self, handle.remove)
        modules = [model, *(scope.module for engine in self.engines for scope in engine.scopes)]
        for module in dict.fromkeys(modules):  # prepended: before the engine's hooks load anything
            self.handles.append(module.register_forward_pre_hook(self._before_forward, prepend=True))

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        # Not for offtensor's own steps on views of the optimizer (backward_and_step): the next
        # forward fences for those.
        if getattr(optimizer, "_offtensor_view", False) or on_optimizer_worker():
            return
        if any(id(p) in self._trainable for g in optimizer.param_groups for p in g["params"]):
            self.fence("after optimizer.step()")

    def _before_forward(self, *_: Any) -> None:
        if self.state is MastersState.MAY_CHANGE and not in_backward():
            self.sync("before the forward that follows a synchronised backward")

    def sync(self, why: str) -> None:
        """Wait for this rank's deferred steps, then for every rank's (the fence)."""
        wait_for_steps()
        self.fence(why)

    def fence(self, why: str) -> None:
        """A bounded barrier of the group's ranks through the store; then the masters other
        ranks own count as written on this rank (device copies from before are stale)."""
        store, n = self._store, self.fences + 1
        store.set(f"{self._prefix}{n}/{self.rank}", "1")
        keys = [f"{self._prefix}{n}/{r}" for r in self.ranks]
        try:
            store.wait(keys, store.timeout)
        except RuntimeError as e:
            missing = [r for r, k in zip(self.ranks, keys, strict=True) if not store.check([k])]
            raise RuntimeError(
                f"offtensor.data_parallel(shard_optimizer=True): rank {self.rank} waited "
                f"{store.timeout.total_seconds():g} s at its step fence #{n} ({why}) for rank(s) "
                f"{missing or '?'}. Every rank must run the same optimizer steps and the same "
                "forward passes after synchronised backward calls (the shared masters are fenced "
                "there); a rank that failed shows its own error. The wait is the process group's "
                "timeout (init_process_group(timeout=...))"
            ) from e
        self.fences = n
        if n > 2:  # every rank passed fence n - 2 before arriving at fence n - 1
            try:
                store.delete_key(f"{self._prefix}{n - 2}/{self.rank}")
            except (RuntimeError, NotImplementedError):  # a store without delete: keys stay
                pass
        self.state = MastersState.AGREED
        for slot, owner in self.owner.items():
            if owner != self.rank:
                slot.stepped_elsewhere = None
                slot.scope.before_master_write(slot)

    def refuse_read(self, slot: ParamSlot) -> None:
        """A read of a master another rank owns, after a synchronised backward and before the
        fence: its owner may be stepping it, or may have stepped it, so the values would be one
        step behind, or half stepped."""
        raise RuntimeError(
            f"offtensor.data_parallel(shard_optimizer=True): parameter {slot.name!r} is stepped by "
            f"rank {self.owner.get(slot)}, whose step may not be in the shared master yet: a "
            "synchronised backward has run since the ranks last agreed on the masters. Call "
            "offtensor.sync_masters(model) on every rank before reading them (a checkpoint after "
            "backward_and_step: sync_masters, then state_dict() on one rank); optimizer.step() "
            "and the next forward agree by themselves"
        )

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def sharding_of(model: nn.Module) -> Sharding | None:
    """The Sharding of the data-parallel model holding `model`'s offloaded parameters, if any."""
    for p in model.parameters():
        slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
        if slot is not None:
            reducer = owning_engine(slot).grads.reducer
            return getattr(reducer, "sharding", None)
    return None
