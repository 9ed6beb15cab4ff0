"""Data-parallel training of a wrapped model over torch.distributed: `data_parallel`, `no_sync`.

# Note [data parallel]
DistributedDataParallel cannot reduce offloaded gradients (Note [data-parallel wrappers] in
distributed/wrappers.py), so offtensor has a data-parallel mode of its own, on PyTorch's distributed
stack (torchrun, a process group; NCCL on CUDA, gloo on the CPU). Every rank holds the whole
wrapped model and runs it on its slice of the batch; `data_parallel(model)` makes each
backward average the gradients over the ranks, so every rank's optimizer takes the same step
and the weights stay equal, as under DDP. Where the averaging happens:
- Offloaded parameters: in the gradient path (Note [gradient path] in core/grads.py), on the compute
  device, after the contribution is added to the old gradient and before the device-to-host
  copy (`GradReducer.reduce`, called by `GradOffload.accumulate`). The host `p.grad` therefore
  only ever holds averaged values (outside `no_sync`), the optimizer worker of
  `backward_and_step` steps averaged gradients (its `landed` event follows the copy, which
  follows the collective), and nothing crosses PCIe twice. On CUDA the all-reduce is
  asynchronous: NCCL runs it on its own stream after the compute stream's work so far, and only
  the d2h stream waits for it (`work.wait()` with the d2h stream current), so backward's compute
  goes on meanwhile; the device gradient stays referenced in GradOffload's in-flight list until
  compute has waited for the copy. On the CPU (gloo) the call returns when it is done.
- Parameters that are not offloaded (embeddings, a head, LoRA adapters left on the device by
  `frozen_only`): a post-accumulate-grad hook on each averages `p.grad` in place. On CUDA the
  current stream waits for the collective right away (a stream wait, not a host wait): a later
  contribution to the same `p.grad` (reentrant checkpointing) must not add to it while NCCL
  writes it. These parameters are small next to the offloaded ones; bucketing them into one
  deferred all-reduce is a possible improvement.
What is reduced is the whole gradient so far (old `p.grad` plus this contribution), as DDP
does: after micro-batches run under `no_sync()`, `p.grad` holds this rank's own sum, and the
first synchronised backward averages all of it; a part that is already averaged is the same on
every rank, so averaging it again leaves it unchanged. Each rank divides by the world size
before a sum all-reduce (exact for powers of two; DDP divides the same way).
Every rank must run the same backward: the same parameters must get gradients in the same
order, as with DDP without `find_unused_parameters` (collectives are matched by order). The
collectives use the process group's timeout (`init_process_group(timeout=...)`), which NCCL's
watchdog and gloo enforce.

`data_parallel` first checks that the ranks agree, with a bounded wait: each rank writes what
it wrapped (scopes with each parameter's name, shape and dtype; the other parameters; its
compute device and host) into the process group's store and waits, at most `timeout`, for the
other ranks' entries (`store.wait(keys, timeout)`, not a collective that could hang). Each rank
compares all the entries and so reaches the same verdict: a different selection, a different
device type, or two ranks on one GPU raise the same error on every rank; a rank that never
calls `data_parallel` makes the others raise after `timeout`, naming it. Then, as DDP does,
rank 0's parameters and buffers are broadcast to the other ranks (through the compute device,
so an NCCL-only group can carry them; offloaded masters are written through the parameter, so
scope copies and host casts see the write).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import weakref
from typing import Any

import torch
from torch import nn

from ..core.engine import Engine
from ..core.slot import ParamSlot, weakly
from ..dispatch.param import OffloadedParameter
from ..optim.overlap import wait_for_steps
from ..weights.quantized import weights_of
from ..wrapping import _engine_of
from .sharded_loads import ShardedLoads, check_tag, ordinal, shardable
from .shared_masters import (
    Sharding,
    new_job_id,
    plan_owners,
    row_bytes,
    sharding_of,
    share_masters,
    wait_for_ranks,
    wait_on_d2h,
)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_STORE_PREFIX = "offtensor/data_parallel"
# On CUDA the check of Note [matching the averagings] costs a host sync per averaging: opt-in.
CHECK_ENV = "OFFTENSOR_CHECK_DATA_PARALLEL"
_calls: dict[tuple[int, ...], int] = {}  # data_parallel calls per group (ranks), for store keys


class GradReducer:
    """Averages the gradients of one data-parallel model over a process group."""

    def __init__(self, group: Any, world: int, engines: list[Engine], names: list[tuple[nn.Parameter, str]]) -> None:
        self.group = group
        self.world = world
        self.ranks = torch.distributed.get_process_group_ranks(group)  # by position in the group
        self.engines = engines
        # Every parameter's index in the model (the same on every rank), for the tags of Note
        # [matching the averagings]; checked on the CPU, on CUDA only with CHECK_ENV=1.
        self.names = [name for _, name in names]
        self.index = {id(p): i for i, (p, _) in enumerate(names)}
        self.checked = engines[0].device.type != "cuda" or os.environ.get(CHECK_ENV) == "1"
        self.handles: list[torch.utils.hooks.RemovableHandle] = []  # resident parameters' hooks
        # Active no_sync() contexts; weak, so one whose __exit__ an interrupt skipped stops
        # counting once it is collected (as no_offload's holds, Note [interrupts]).
        self.holds: weakref.WeakSet[no_sync] = weakref.WeakSet()
        self.reductions = 0  # all-reduces (or reduces to owners) launched (tests, debugging)
        # With shard_optimizer: the owners, the reduce to them and the step fence
        # (Note [one host copy per node] in distributed/shared_masters.py).
        self.sharding: Sharding | None = None
        # With shard_loads: the loader of the shardable scopes (Note [sharded loads]).
        self.loads: ShardedLoads | None = None

    def syncing(self) -> bool:
        return len(self.holds) == 0

    def keeps(self, slot: ParamSlot) -> bool:
        """Whether this rank's host `p.grad` receives this gradient: always, except with
        shard_optimizer outside no_sync on the ranks that do not own the parameter."""
        return self.sharding is None or not self.syncing() or self.sharding.owns(slot)

    def reduce(self, slot: ParamSlot, grad: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor | None:
        """An offloaded parameter's device gradient `grad` plus its old host gradient `old` (on
        the device, or None), averaged over the ranks; on CUDA the d2h stream waits for the
        all-reduce (Note [data parallel]). None: another rank owns it (shard_optimizer). Called
        by GradOffload."""
        if self.checked and self.syncing():
            self._check(slot.param, grad.device)
        if self.sharding is not None:
            out = self.sharding.reduce(slot, grad, old, self.syncing())
            self.reductions += self.syncing()
            return out
        if old is not None:
            grad = grad + old
        if not self.syncing():
            return grad
        # A tensor of our own: `grad` may be autograd's or a user hook's result.
        grad = (grad / self.world).contiguous()
        work = torch.distributed.all_reduce(grad, group=self.group, async_op=True)
        self.reductions += 1
        wait_on_d2h(slot.scope.engine, work, grad.device)
        return grad

    def written(self, slot: ParamSlot, buf: torch.Tensor) -> None:
        """GradOffload enqueued the copy of this parameter's gradient into `buf`."""
        if self.sharding is not None:
            self.sharding.written(slot, buf, self.syncing())

    def reduce_resident(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of a parameter that is not offloaded: average `p.grad`."""
        grad = p.grad
        if grad is None or not self.syncing():
            return
        if self.checked:
            self._check(p, grad.device)
        flat = grad if grad.is_contiguous() else grad.contiguous()
        flat.div_(self.world)
        work = torch.distributed.all_reduce(flat, group=self.group, async_op=True)
        self.reductions += 1
        work.wait()  # on CUDA: the current stream waits, the host does not
        if flat is not grad:
            grad.copy_(flat)

    def _check(self, p: torch.Tensor, device: torch.device) -> None:
        """Before averaging `p`'s gradient: every rank is averaging the same parameter's.

        # Note [matching the averagings]
        Collectives are matched by their order, so a rank whose backward reached other parameters
        (a branch taken on some ranks only, a parameter used on one rank) would average its
        gradient with another parameter's: silently wrong where the sizes agree, a gloo abort or
        a hang where they do not. Before each averaging the ranks all-gather (the parameter's
        index, how many averagings this rank launched) and compare, so such backwards raise the
        same error on every rank, naming the parameters, at the collective where they part; the
        ranks stay matched for the next backward. A rank whose backward raised stops issuing
        averagings: the others' gather meets its next backward's, whose tag differs (they raise
        in turn, then all are matched again), or ends at the process group's timeout. Not
        caught: a rank that raised before its first averaging (in the forward) and goes on with
        the next batch, whose averagings match the others' of the batch before, as under DDP.
        """
        index = self.index.get(id(p), -1)
        count = self.reductions + 1
        check_tag((index, count), self.group, self.world, device, self.ranks,
                  where=lambda: self._where(index, count),
                  theirs=lambda tag: f"averaging of {self._name(tag[0])} (its {ordinal(tag[1])})",
                  differs="backward passes", fix=self._fix)

    def _where(self, index: int, count: int) -> str:
        return (f"offtensor.data_parallel: rank {torch.distributed.get_rank()}'s averaging of the "
                f"gradient of {self._name(index)} (its {ordinal(count)} averaging)")

    _fix = ("Every rank must give gradients to the same parameters in the same order in each "
            "backward outside no_sync (as DistributedDataParallel without find_unused_parameters): "
            "take the same branches on every rank, or make an unused parameter part of the loss "
            "(+ 0 * p.sum()). A rank whose backward raised first shows its own error; once every rank "
            "has raised, the next backward is matched again")

    def _name(self, index: int) -> str:
        return f"{self.names[index]!r}" if 0 <= index < len(self.names) else "an unknown parameter"

    def close(self) -> None:
        """Leave data-parallel mode (offtensor.unwrap calls this)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.sharding is not None:
            self.sharding.close()
        if self.loads is not None:
            self.loads.close()
        for engine in self.engines:
            if engine.grads.reducer is self:
                engine.grads.reducer = None


class no_sync:
    """Skip the gradient averaging of a data-parallel model for the backward calls inside:
    each rank accumulates its own gradients, and the first backward outside averages all of
    them (Note [data parallel]). Like DistributedDataParallel.no_sync, for gradient accumulation.

    Example::

        for i, (x, y) in enumerate(micro_batches):
            if i < len(micro_batches) - 1:
                with offtensor.no_sync(model):
                    (loss_fn(model(x), y) / len(micro_batches)).backward()
            else:
                (loss_fn(model(x), y) / len(micro_batches)).backward()  # averages the sum
        optimizer.step()
    """

    def __init__(self, model: nn.Module) -> None:
        reducer = _engine_of(model, "no_sync").grads.reducer
        if reducer is None:
            raise RuntimeError(
                f"offtensor.no_sync: this {type(model).__name__} is not in data-parallel mode, so "
                "there is no gradient averaging to skip; call offtensor.data_parallel(model) "
                "first (after offtensor.wrap and model.to(device))"
            )
        self._reducer = reducer
        self._depth = 0

    def __enter__(self) -> no_sync:
        self._depth += 1
        self._reducer.holds.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._reducer.holds.discard(self)


def data_parallel(model: nn.Module, process_group: Any = None, *, broadcast_weights: bool = True,
                  shard_optimizer: bool = False, shard_loads: bool = False,
                  timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> nn.Module:
    """Train a wrapped model data-parallel: one process per device, each on its slice of the
    batch, gradients averaged over the ranks in every backward (offtensor's replacement for
    DistributedDataParallel, which cannot see offloaded gradients).

    Call it on every rank after `offtensor.wrap(model, ...)` and `model.to(device)`, with the
    process group initialised (`torchrun` and `torch.distributed.init_process_group`; NCCL for
    CUDA, gloo for the CPU). It checks that every rank wrapped the same scopes and parameters on
    the same kind of device and that no two ranks share a GPU (the same error on every rank, after
    at most `timeout` when a rank does not arrive), and copies rank 0's parameters and buffers to
    the others. From then on every backward averages each gradient over the ranks: offloaded ones
    on the device before they are copied to the host `.grad`, the others in place. The training
    loop stays standard: the model is called as before (no wrapper module), with your optimizer,
    your loss, a `DistributedSampler`, `offtensor.backward_and_step` and gradient checkpointing.
    Use `offtensor.no_sync(model)` around the backward of micro-batches that only accumulate.
    Every rank must compute gradients for the same parameters in the same order (as DDP without
    `find_unused_parameters`). `offtensor.unwrap(model)` ends the mode.

    With `shard_optimizer=True` the ranks of the node keep one host copy of the offloaded
    masters, in shared memory, and split the CPU optimizer work: each trainable offloaded
    parameter has one owner rank (balanced by bytes), its averaged gradient goes to the owner's
    `p.grad` only (None on the other ranks), so your optimizer, built over all parameters on
    every rank, steps and keeps state for only the parameters its rank owns. Host RAM is then one
    copy of the masters per node plus each rank's share of gradients and optimizer state. After
    every `optimizer.step()`, and before the forward after a `backward_and_step`, the ranks pass
    a fence so that each reads the masters the others stepped (`offtensor.sync_masters(model)`
    does it by hand: before saving a checkpoint right after `backward_and_step`). Every rank must
    run the same optimizer steps. All ranks must be on one node; global-norm clipping
    (`clip_grad_norm_`) sees only the rank's own gradients.

    With `shard_loads=True` each load of a scope copies only this rank's 1/N slice of it from
    the host, over this rank's own link, and the ranks all-gather the other slices from each
    other (over NVLink between GPUs): N ranks move N times fewer bytes over PCIe each. The
    loads become collective: every rank must run the same forward and backward passes (as for
    the gradients); a pass on some ranks only (evaluation on rank 0) goes inside
    `offtensor.local_loads(model)`. Scopes whose load casts (`Policy(cast=...)` with another
    compute dtype) are loaded as before. A failed forward on one rank makes the others' next
    load raise after the process group's timeout (gloo; NCCL's watchdog ends the processes, as
    for any collective that never completes), and the following loads resynchronise the ranks.

    Args:
        model: a model that `offtensor.wrap` wrapped (or that contains one); its parameters that
            are not offloaded are averaged too.
        process_group: the group to average over; default the default (world) group.
        broadcast_weights: copy the group's first rank's parameters and buffers to every rank
            first, as DDP's constructor does. False keeps each rank's own values (with
            `shard_optimizer`, the offloaded masters are the first rank's in any case: there is
            one copy).
        shard_optimizer: one host copy of the masters per node and each offloaded parameter
            stepped by one rank (above). Default False: each rank has its own copy and steps all.
        shard_loads: each rank copies 1/N of every scope from the host and the ranks all-gather
            the rest (above). Needs the masters to be equal on every rank: `broadcast_weights`
            or `shard_optimizer`. Default False: each rank copies whole scopes.
        timeout: how long to wait for the other ranks at the agreement check (a `timedelta` or
            seconds). Collectives during training use the process group's own timeout.

    Returns:
        `model`.

    Example::

        torch.distributed.init_process_group("nccl")       # under torchrun --nproc-per-node N
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model = offtensor.wrap(build_model())
        model.to("cuda")
        offtensor.data_parallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        for x, y in loader:                                 # with a DistributedSampler
            loss_fn(model(x), y).backward()
            optimizer.step(); optimizer.zero_grad()
    """
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "offtensor.data_parallel: no process group is initialised. Launch one process per "
            "device (torchrun --nproc-per-node N script.py) and call "
            "torch.distributed.init_process_group('nccl') (on CUDA; 'gloo' on the CPU) before "
            "offtensor.data_parallel(model)"
        )
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if shard_loads and not (broadcast_weights or shard_optimizer):
        raise ValueError(
            "offtensor.data_parallel: shard_loads=True assembles each scope from slices that "
            "different ranks copy from their own masters, so the masters must be equal on every "
            "rank, but broadcast_weights=False keeps each rank's own values; pass "
            "broadcast_weights=True (or shard_optimizer=True, one shared copy)"
        )
    engines = _engines_in(model)
    for engine in engines:
        if engine.grads.reducer is not None:
            raise RuntimeError(
                "offtensor.data_parallel: this model is already in data-parallel mode; call it "
                "once per wrapped model (offtensor.unwrap(model) ends the mode)"
            )
        packed = next(((s.name, s.packed) for scope in engine.scopes for s in scope.slots if s.packed is not None),
                      None)
        if packed is not None:  # its broadcast reads and writes uncompressed masters
            raise NotImplementedError(
                f"offtensor.data_parallel: parameter {packed[0]!r} is {packed[1].kept_as()}, "
                "which data-parallel mode does not support yet; wrap without frozen_format (and "
                "load without host_budget)"
            )
        quantized = next((w for scope in engine.scopes for w in weights_of(scope)), None)
        if quantized is not None:  # sharing masters would leave the host weight on the old ones
            raise NotImplementedError(
                f"offtensor.data_parallel: parameter {quantized.name!r} is an already-quantized "
                "weight (Note [quantized weights]), which data-parallel mode does not support yet"
            )
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = list(dist.get_process_group_ranks(group))
    if dist.get_rank() not in ranks:
        raise ValueError(
            f"offtensor.data_parallel: this process (rank {dist.get_rank()}) is not a member of "
            f"the process group given (ranks {ranks}); pass a group this rank belongs to"
        )
    _check_backend(model, engines, group)
    entries = _exchange(ranks, _describe(model, engines, shard_optimizer, shard_loads), timeout)
    _check_agreement(entries)
    if broadcast_weights:
        # With shard_optimizer the first rank's masters reach the others through shared memory.
        _broadcast_weights(model, engines, group, src=ranks[0], with_masters=not shard_optimizer)
    reducer = GradReducer(group, len(ranks), engines, [(p, n) for n, p in model.named_parameters()])
    if shard_optimizer:
        reducer.sharding = _share(model, engines, group, ranks, entries, timeout)
    if shard_loads:
        reducer.loads = _shard_loads(engines, group, ranks, entries[0]["job"])
    for p in _resident(model):
        reducer.handles.append(_hook_resident(p, reducer))
    for engine in engines:
        engine.grads.reducer = reducer
    return model


def sync_masters(model: nn.Module) -> None:
    """Wait until the optimizer steps of every rank are in the shared masters of a model in
    `data_parallel(model, shard_optimizer=True)` mode: this rank's deferred steps
    (`backward_and_step`), then a fence of all ranks (Note [step fence] in distributed/shared_masters.py).
    Needed only to read the masters after `backward_and_step` and before the next forward (which
    waits by itself), e.g. to save a checkpoint; every rank must call it.

    Example::

        offtensor.backward_and_step(loss, optimizer)
        offtensor.sync_masters(model)                 # on every rank
        if rank == 0:
            torch.save(model.state_dict(), "checkpoint.pt")
    """
    sharding = sharding_of(model)
    if sharding is None:
        raise RuntimeError(
            f"offtensor.sync_masters: this {type(model).__name__} is not in "
            "data_parallel(model, shard_optimizer=True) mode; its masters are this rank's own, and "
            "offtensor.wait_for_steps() waits for its deferred steps"
        )
    sharding.sync("offtensor.sync_masters")


def _share(model: nn.Module, engines: list[Engine], group: Any, ranks: list[int],
           entries: list[dict[str, Any]], timeout: datetime.timedelta) -> Sharding:
    """shard_optimizer: the masters into the node's shared memory, and the owners (Note [one
    host copy per node] in distributed/shared_masters.py)."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    job = entries[0]["job"]  # the first rank's: one name for all
    share_masters(engines, ranks, torch.distributed.get_rank(), job, store, timeout)
    rows = [(name, row_bytes(shape, dtype), trains)
            for _, params in entries[0]["scopes"] for name, shape, dtype, trains in params]
    sharding = Sharding(engines, group, ranks, plan_owners(rows, ranks), job, store)
    sharding.install(model)
    return sharding


def _shard_loads(engines: list[Engine], group: Any, ranks: list[int], job: str) -> ShardedLoads:
    """shard_loads: every shardable scope's loads through a ShardedLoads (Note [sharded loads]
    in distributed/sharded_loads.py); its collectives use the process group's timeout."""
    from torch.distributed import distributed_c10d

    store: Any = distributed_c10d._get_default_store()
    # What a rank holds resident (a VRAM budget's kept scopes, loaded before the broadcast) must
    # not differ between the ranks: from here on their loads are collective.
    wait_for_steps()
    for engine in engines:
        engine.release_all(force=True)
    loads = ShardedLoads(engines, ranks, group, job, store, store.timeout)
    loads.install()
    return loads


def _engines_in(model: nn.Module) -> list[Engine]:
    """The engines of the wrapped models inside `model` (offtensor.wrap may have been called on
    several of its parts)."""
    found: dict[int, Engine] = {}
    for p in model.parameters():
        slot = getattr(p, "_ot", None) if isinstance(p, OffloadedParameter) else None
        if slot is not None:
            found.setdefault(id(slot.scope.engine), slot.scope.engine)
    if not found:
        _engine_of(model, "data_parallel")  # raises: not wrapped
        raise RuntimeError(
            "offtensor.data_parallel: the model holds no offloaded parameter; call it on the "
            "model you wrapped"
        )
    return list(found.values())


def _hook_resident(p: nn.Parameter, reducer: GradReducer) -> torch.utils.hooks.RemovableHandle:
    """Average `p.grad` after each accumulation, also once a parameter frozen now is unfrozen.

    # Note [resident parameters frozen at data_parallel]
    A parameter that is not offloaded is averaged by its post-accumulate-grad hook. One frozen
    when data_parallel runs has none to give yet, but may be unfrozen later (a fine-tuning
    schedule unfreezing layers): without a hook each rank would then step it with its own
    gradient and the ranks' weights would silently diverge. Registering a hook needs
    requires_grad, so it is set for the registration only; the hook is kept on the tensor and
    runs whenever the parameter is trainable again (a frozen one gets no gradient: no call).
    """
    frozen = not p.requires_grad
    if frozen:
        p.requires_grad_(True)
    try:
        return p.register_post_accumulate_grad_hook(weakly(reducer.reduce_resident))
    finally:
        if frozen:
            p.requires_grad_(False)


def _resident(model: nn.Module) -> list[nn.Parameter]:
    """The model's parameters that are not offloaded (each once)."""
    return [p for p in model.parameters() if not isinstance(p, OffloadedParameter)]


def _supports(backend: str, device_type: str) -> bool:
    """Whether a group with this backend string ('nccl', 'gloo', 'cpu:gloo,cuda:nccl') can
    reduce tensors of `device_type`. Unknown backends are assumed to."""
    backend = backend.lower()
    if ":" in backend:
        return any(part.split(":")[0].strip() == device_type for part in backend.split(","))
    return not (backend == "nccl" and device_type != "cuda")


def _check_backend(model: nn.Module, engines: list[Engine], group: Any) -> None:
    backend = str(torch.distributed.get_backend(group))
    for engine in engines:
        if not _supports(backend, engine.device.type):
            raise ValueError(
                f"offtensor.data_parallel: the model computes on {engine.device}, but the process "
                f"group's backend {backend!r} cannot reduce {engine.device.type} tensors; use "
                "init_process_group('gloo') for the CPU, 'nccl' for CUDA"
            )
    names = {id(p): n for n, p in model.named_parameters()}
    for p in _resident(model):
        if p.requires_grad and not _supports(backend, p.device.type):
            raise ValueError(
                f"offtensor.data_parallel: parameter {names.get(id(p), '?')!r} is not offloaded and "
                f"is on {p.device}, which the process group's backend {backend!r} cannot reduce; "
                "place the model's other parts on the compute device (model.to(device)) first"
            )


def _describe(model: nn.Module, engines: list[Engine], shard_optimizer: bool,
              shard_loads: bool = False) -> dict[str, Any]:
    """What this rank wrapped and where it computes: what the ranks must agree on."""
    scopes = []
    for engine in engines:
        for scope in engine.scopes:
            scopes.append([scope.name, [[s.name, list(s.master.shape), str(s.master.dtype), s.param.requires_grad]
                                        for s in scope.slots]])
    resident = [[n, list(p.shape), str(p.dtype), p.requires_grad]
                for n, p in model.named_parameters() if not isinstance(p, OffloadedParameter)]
    devices = sorted({str(e.device) for e in engines})
    # The flat buffers' layouts: sharded loads exchange byte ranges of them.
    layouts = [[scope.nbytes, scope.device_nbytes, [s.offset for s in scope.slots], shardable(scope)]
               for engine in engines for scope in engine.scopes]
    return {"rank": torch.distributed.get_rank(), "host": socket.gethostname(), "devices": devices,
            "scopes": scopes, "resident": resident, "shard_optimizer": shard_optimizer,
            "shard_loads": shard_loads, "layouts": layouts,
            "job": new_job_id() if shard_optimizer or shard_loads else None}


def _exchange(ranks: list[int], entry: dict[str, Any], timeout: datetime.timedelta) -> list[dict[str, Any]]:
    """Every rank's `entry`, through the default store, waiting at most `timeout` for the others
    (Note [data parallel]): a rank that never arrives gives an error, not a hang."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    key = tuple(ranks)
    _calls[key] = call = _calls.get(key, 0) + 1
    prefix = f"{_STORE_PREFIX}/{'-'.join(map(str, ranks))}/{call}/"
    store.set(prefix + str(entry["rank"]), json.dumps(entry))
    keys = [prefix + str(r) for r in ranks]
    missing = wait_for_ranks(store, keys, timeout, ranks)
    if missing is not None:
        raise RuntimeError(
            f"offtensor.data_parallel: rank(s) {missing or '?'} did not call "
            f"offtensor.data_parallel within {timeout.total_seconds():g} s (rank "
            f"{entry['rank']} did, for the {_ordinal(call)} time on this group). Every rank must "
            "wrap the model and call offtensor.data_parallel(model); a rank that failed before "
            "shows its own error. Pass timeout= for slow model loading"
        )
    return [json.loads(store.get(k)) for k in keys]


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _check_agreement(entries: list[dict[str, Any]]) -> None:
    """The same verdict on every rank, from every rank's entry."""
    first = entries[0]
    for other in entries[1:]:
        if other["shard_optimizer"] != first["shard_optimizer"]:
            raise ValueError(
                f"offtensor.data_parallel: rank {first['rank']} passed shard_optimizer="
                f"{first['shard_optimizer']} but rank {other['rank']} shard_optimizer="
                f"{other['shard_optimizer']}; pass the same on every rank"
            )
        if first["shard_optimizer"] and other["host"] != first["host"]:
            raise ValueError(
                f"offtensor.data_parallel: shard_optimizer=True shares the masters in one host's "
                f"memory, but rank {first['rank']} runs on {first['host']!r} and rank "
                f"{other['rank']} on {other['host']!r}; several nodes are not supported yet: "
                "call offtensor.data_parallel without shard_optimizer, or pass a process group "
                "of one node's ranks"
            )
        if other["shard_loads"] != first["shard_loads"]:
            raise ValueError(
                f"offtensor.data_parallel: rank {first['rank']} passed shard_loads="
                f"{first['shard_loads']} but rank {other['rank']} shard_loads="
                f"{other['shard_loads']}; pass the same on every rank"
            )
        _compare_scopes(first, other)
        if first["shard_loads"]:
            _compare_layouts(first, other)
        if other["devices"] != first["devices"] and (
            {d.split(":")[0] for d in other["devices"]} != {d.split(":")[0] for d in first["devices"]}
        ):
            raise ValueError(
                f"offtensor.data_parallel: rank {first['rank']} computes on {first['devices']} but "
                f"rank {other['rank']} on {other['devices']}; wrap with the same kind of device on "
                "every rank (device=f'cuda:{local_rank}')"
            )
        _compare_resident(first, other)
    seen: dict[tuple[str, str], int] = {}
    for entry in entries:
        for device in entry["devices"]:
            if not device.startswith("cuda"):
                continue
            where = (entry["host"], device)
            if where in seen:
                raise ValueError(
                    f"offtensor.data_parallel: ranks {seen[where]} and {entry['rank']} both compute "
                    f"on {device} of host {entry['host']!r}; give each rank its own GPU: call "
                    "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before offtensor.wrap, "
                    "or pass device=f'cuda:{local_rank}'"
                )
            seen[where] = entry["rank"]


def _compare_scopes(a: dict[str, Any], b: dict[str, Any]) -> None:
    fix = ("every rank must call offtensor.wrap on the same model with the same predicate and "
           "Policy (the gradients are averaged parameter by parameter)")
    names_a = [s[0] for s in a["scopes"]]
    names_b = [s[0] for s in b["scopes"]]
    if names_a != names_b:
        only_a = [n for n in names_a if n not in names_b]
        only_b = [n for n in names_b if n not in names_a]
        detail = (f"scope {only_a[0]!r} only on rank {a['rank']}" if only_a else
                  f"scope {only_b[0]!r} only on rank {b['rank']}" if only_b else "in another order")
        raise ValueError(
            f"offtensor.data_parallel: rank {a['rank']} wrapped {len(names_a)} scopes and rank "
            f"{b['rank']} {len(names_b)} ({detail}); {fix}"
        )
    for (name, params_a), (_, params_b) in zip(a["scopes"], b["scopes"], strict=True):
        if params_a != params_b:
            diff = next(((x, y) for x, y in zip(params_a, params_b, strict=False) if x != y), None)
            frozen = diff is not None and diff[0][:3] == diff[1][:3]  # only requires_grad differs
            what = (f"parameter {diff[0][0]!r} has requires_grad={diff[0][3]} on rank {a['rank']} and "
                    f"{diff[1][3]} on rank {b['rank']}" if diff is not None and frozen else
                    f"parameter {diff[0][0]!r} is {_shape(diff[0])} on rank {a['rank']} and "
                    f"{diff[1][0]!r} {_shape(diff[1])} on rank {b['rank']}" if diff is not None else
                    f"{len(params_a)} offloaded parameters on rank {a['rank']}, {len(params_b)} on "
                    f"rank {b['rank']}")
            raise ValueError(f"offtensor.data_parallel: scope {name!r} differs between ranks: {what}; {fix}")


def _compare_layouts(a: dict[str, Any], b: dict[str, Any]) -> None:
    """shard_loads: the scopes' flat buffers must be laid out alike (the same Policy)."""
    for (name, _), layout_a, layout_b in zip(a["scopes"], a["layouts"], b["layouts"], strict=True):
        if layout_a != layout_b:
            raise ValueError(
                f"offtensor.data_parallel(shard_loads=True): scope {name!r} is laid out differently "
                f"on rank {a['rank']} ({layout_a[0]} host bytes, {layout_a[1]} device bytes) and rank "
                f"{b['rank']} ({layout_b[0]}, {layout_b[1]}); the ranks exchange byte ranges of it, so "
                "wrap with the same Policy (compute_dtype, cast, frozen_format) on every rank"
            )


def _compare_resident(a: dict[str, Any], b: dict[str, Any]) -> None:
    if a["resident"] == b["resident"]:
        return
    rows_a = {r[0]: r for r in a["resident"]}
    rows_b = {r[0]: r for r in b["resident"]}
    name = next((n for n in [*rows_a, *rows_b] if rows_a.get(n) != rows_b.get(n)), "?")

    def show(rows: dict[str, list], rank: int) -> str:
        row = rows.get(name)
        if row is None:
            return f"absent (or offloaded) on rank {rank}"
        return f"{_shape(row)}, requires_grad={row[3]} on rank {rank}"

    raise ValueError(
        f"offtensor.data_parallel: parameter {name!r}, which is not offloaded, is {show(rows_a, a['rank'])} "
        f"but {show(rows_b, b['rank'])}; every rank must build the same model, offload the same "
        "parameters and freeze the same ones before offtensor.data_parallel"
    )


def _shape(row: list) -> str:
    return f"{tuple(row[1])} {row[2]}"


def _broadcast_weights(model: nn.Module, engines: list[Engine], group: Any, src: int, with_masters: bool) -> None:
    """Copy rank `src`'s parameters and buffers to every rank of the group, through the compute
    device (an NCCL group carries device tensors only), one collective per scope; the offloaded
    masters only if `with_masters`."""
    dist = torch.distributed
    receiving = dist.get_rank() != src
    wait_for_steps()  # a deferred optimizer step may still write the masters
    for engine in engines if with_masters else []:
        for scope in engine.scopes:
            masters = [s.master for s in scope.slots]
            flat = torch.cat([m.reshape(-1).view(torch.uint8) for m in masters]).to(engine.device)
            dist.broadcast(flat, src=src, group=group)
            if not receiving:
                continue
            values = flat.cpu().split([m.numel() * m.element_size() for m in masters])
            for slot, value in zip(scope.slots, values, strict=True):
                # clone: a view as a wider dtype needs an aligned offset, which a scope mixing
                # dtypes (3 bf16 elements, then fp32) does not give
                value = value.clone().view(slot.master.dtype).view(slot.master.shape)
                with torch.no_grad():  # through the parameter: scope copies and host casts see it
                    slot.param.copy_(value)
    device = engines[0].device
    for t in [*_resident(model), *model.buffers()]:
        data = t.detach()
        supported = _supports(str(dist.get_backend(group)), data.device.type)
        staged = data if supported and data.is_contiguous() else data.to(device).contiguous()
        dist.broadcast(staged, src=src, group=group)
        if receiving and staged is not data:
            data.copy_(staged)
