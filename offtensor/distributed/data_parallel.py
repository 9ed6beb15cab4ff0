"""Data-parallel training of a wrapped model over torch.distributed. `data_parallel` sets the mode
up: the checks of distributed/agreement.py, the broadcast of the first rank's weights, the
GradReducer of distributed/reducer.py and, as asked, shared masters and sharded loads;
`sync_masters` waits for the shared masters' steps.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch import nn

from ..dispatch.slot import weakly
from ..engine.engine import Engine
from ..optim.overlap import wait_for_steps
from .agreement import agree, check_arguments, check_backend, check_engines, engines_in, group_ranks, resident, supports
from .reducer import GradReducer
from .sharded_loads import ShardedLoads
from .shared_masters import Sharding, plan_owners, row_bytes, sharding_of, share_masters

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def data_parallel(model: nn.Module, process_group: Any = None, *, broadcast_weights: bool = True,
                  shard_optimizer: bool = False, shard_loads: bool = False,
                  timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> nn.Module:
    """Train a wrapped model data-parallel: one process per device, each on its slice of the
    batch, gradients averaged over the ranks in every backward (offtensor's replacement for
    DistributedDataParallel, which cannot see offloaded gradients).

    Call it on every rank after `offtensor.wrap(model, ...)` and `model.to(device)`, with the
    process group initialised (`torchrun`, `init_process_group`: NCCL for CUDA, gloo for the
    CPU). It checks that the ranks wrapped the same model on the same kind of device, one GPU
    each (the same error on every rank, within `timeout`), and copies rank 0's parameters and
    buffers to the others. The training loop stays standard (no wrapper module); wrap the
    backward of micro-batches that only accumulate in `offtensor.no_sync(model)`. Every rank
    must give gradients to the same parameters in the same order (as DDP without
    `find_unused_parameters`). `offtensor.unwrap(model)` ends the mode.

    With `shard_optimizer=True` the ranks of a node share one host copy of the offloaded masters
    (in /dev/shm) and split the CPU optimizer work: each trainable offloaded
    parameter's averaged gradient goes to its owner rank's `p.grad` only (None elsewhere), so your
    optimizer, built over all parameters on every rank, steps and keeps state for that rank's
    share. The ranks pass a fence after every `optimizer.step()` and before the forward after a
    `backward_and_step` (`offtensor.sync_masters(model)` by hand, e.g. before a checkpoint). Every
    rank must run the same optimizer steps; all ranks on one node; `clip_grad_norm_` sees only the
    rank's own gradients.

    With `shard_loads=True` each rank copies only its 1/N slice of a scope from the host and the
    ranks all-gather the rest (over NVLink between GPUs), so each moves N times fewer bytes over
    PCIe. The loads become collective: every rank must run the same passes;
    one on some ranks only (evaluation on rank 0) goes inside `offtensor.local_loads(model)`.
    Scopes whose load casts are loaded as before.

    Args:
        model: a model that `offtensor.wrap` wrapped (or that contains one); its parameters that
            are not offloaded are averaged too.
        process_group: the group to average over; default the default (world) group.
        broadcast_weights: copy the group's first rank's parameters and buffers to every rank
            first, as DDP's constructor does. False keeps each rank's own values (with
            `shard_optimizer` the masters are the first rank's anyway: there is one copy).
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
    timeout = check_arguments(broadcast_weights, shard_optimizer, shard_loads, timeout)
    engines = engines_in(model)
    check_engines(engines)
    group, ranks = group_ranks(process_group)
    check_backend(model, engines, group)
    entries = agree(model, engines, ranks, shard_optimizer, shard_loads, timeout)
    if broadcast_weights:
        # With shard_optimizer the first rank's masters reach the others through shared memory.
        _broadcast_weights(model, engines, group, src=ranks[0], with_masters=not shard_optimizer)
    reducer = GradReducer(group, len(ranks), engines, [(p, n) for n, p in model.named_parameters()])
    if shard_optimizer:
        reducer.sharding = _share(model, engines, group, ranks, entries, timeout)
    if shard_loads:
        reducer.loads = _shard_loads(engines, group, ranks, entries[0]["job"])
    for p in resident(model):
        reducer.handles.append(_hook_resident(p, reducer))
    for engine in engines:
        engine.grads.reducer = reducer
    return model


def sync_masters(model: nn.Module) -> None:
    """Wait until the optimizer steps of every rank are in the shared masters of a model in
    `data_parallel(model, shard_optimizer=True)` mode: this rank's deferred steps
    (`backward_and_step`), then a barrier of all ranks.
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
        engine.live.release_all(force=True)
    loads = ShardedLoads(engines, ranks, group, job, store, store.timeout)
    loads.install()
    return loads


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
    for t in [*resident(model), *model.buffers()]:
        data = t.detach()
        supported = supports(str(dist.get_backend(group)), data.device.type)
        staged = data if supported and data.is_contiguous() else data.to(device).contiguous()
        dist.broadcast(staged, src=src, group=group)
        if receiving and staged is not data:
            data.copy_(staged)
