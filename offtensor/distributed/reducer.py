"""The gradient averaging of a data-parallel model (`GradReducer`, which the gradient path calls)
and `no_sync`.

# Note [data parallel]
DistributedDataParallel cannot reduce offloaded gradients (Note [data-parallel wrappers] in
dispatch/wrapper_guards.py), so offtensor has a data-parallel mode of its own on torch.distributed:
every rank holds the whole wrapped model and runs it on its slice of the batch, and each backward
averages the gradients over the ranks, so every rank steps the same and the weights stay equal.
- Offloaded parameters: in the gradient path (Note [gradient path] in engine/grads.py), on the
  device, after the contribution is added to the old gradient and before the device-to-host copy
  (`GradReducer.reduce`, called by `GradOffload.accumulate`). The host `p.grad` only ever holds
  averaged values (outside `no_sync`), and so does what backward_and_step's worker steps; nothing
  crosses PCIe twice. On CUDA only the d2h stream waits for NCCL's all-reduce (`wait_on_d2h`), so
  backward's compute goes on; GradOffload keeps the device gradient referenced until compute has
  waited for the copy.
- Parameters that are not offloaded: a post-accumulate-grad hook averages `p.grad` in place. On
  CUDA the current stream waits for the collective at once: a later contribution to the same
  `p.grad` (reentrant checkpointing) must not add to it while NCCL writes it.
What is reduced is the whole gradient so far, as under DDP: after `no_sync()` micro-batches the
first synchronised backward averages this rank's own sum; a part already averaged is the same on
every rank, so averaging it again leaves it unchanged. Each rank divides by the world size before
a sum all-reduce, as DDP does. Collectives are matched by order, so every rank must give gradients
to the same parameters in the same order (Note [matching the averagings]).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn

from ..dispatch.slot import ParamSlot
from ..engine.engine import Engine, engine_of, owning_engine
from .matching import check_tag, ordinal
from .sharded_loads import ShardedLoads
from .shared_masters import Sharding, wait_on_d2h

# On CUDA the check of Note [matching the averagings] costs a host sync per averaging: opt-in.
CHECK_ENV = "OFFTENSOR_CHECK_DATA_PARALLEL"


class GradReducer:
    """Averages the gradients of one data-parallel model over a process group."""

    def __init__(self, group: Any, world: int, engines: list[Engine], names: list[tuple[nn.Parameter, str]]) -> None:
        self.group = group
        self.world = world
        self.ranks = torch.distributed.get_process_group_ranks(group)  # by position in the group
        self.engines = engines
        for engine in engines:  # averaged as they land, in autograd's order on every rank
            engine.grads.hand_over_at_once()
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
        wait_on_d2h(owning_engine(slot), work, grad.device)
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
        reducer = engine_of(model, "no_sync").grads.reducer
        if not isinstance(reducer, GradReducer):
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
