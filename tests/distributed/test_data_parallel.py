"""offtensor.data_parallel: N ranks, each on 1/N of the batch, train like one process on all of it.

One spawned job of two ranks per device runs every scenario (building a process group costs
seconds, a scenario milliseconds) and saves each rank's parameters after K optimizer steps; the
tests compare them with the plain, unwrapped model trained in this process on the whole batch.
Rank 1 builds its model from another seed: `data_parallel` must copy rank 0's weights to it.
The same job then runs the bad setups, which must raise the same error on every rank (never
hang). The scenarios run again with `shard_optimizer=True` (one host copy of the masters, each
parameter stepped by its owner rank), and the job measures the host memory of both modes.
CPU runs with gloo; the CUDA variant (NCCL, two GPUs) is skipped on fewer than two GPUs.
Every wait is bounded: the job is killed after JOB_TIMEOUT_S, and data_parallel's own agreement
check waits at most a few seconds here.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import os
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ResidualBlock, host, mlp_of_blocks, only_blocks
from torch import nn

import offtensor
from offtensor.distributed.sharded_loads import ShardedSource
from offtensor.distributed.shared_masters import MastersState, plan_owners
from offtensor.storage import shm as _shm

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.full_tier,  # spawned ranks: seconds of interpreter start-up each (conftest)
]

WORLD = 2
STEPS = 3
BATCH = 8  # the whole batch; each rank gets BATCH // WORLD rows
JOB_TIMEOUT_S = 180
PG_TIMEOUT = datetime.timedelta(seconds=60)

_two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
devices = [
    pytest.param("cpu", id="cpu-gloo"),
    pytest.param("cuda", id="cuda-nccl", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not _two_gpus, reason="needs two CUDA devices")]),
]


# ---- the scenarios ------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update (what peft's LoRA computes)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
        self.fc = nn.Linear(4, 4)


@dataclass(frozen=True)
class Scenario:
    predicate: str = "default"  # "default", or "blocks:0,2" (only_blocks)
    micro: int = 1  # micro-batches per step per rank; all but the last under no_sync
    overlap: bool = False  # the last micro-batch through offtensor.backward_and_step
    checkpoint: str | None = None  # BlockStack.checkpoint
    lora: bool = False  # frozen base weights offloaded (frozen_only), adapters resident
    shard: bool = False  # data_parallel(shard_optimizer=True)
    no_sync: bool = True  # the micro-batches before the last under no_sync (else all synchronised)
    zero_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)
    loads: bool = False  # data_parallel(shard_loads=True)


SCENARIOS = {
    "all_blocks_offloaded": Scenario(),
    "offloaded_and_resident_blocks": Scenario(predicate="blocks:0,2"),
    "accumulation_with_no_sync": Scenario(micro=2),
    "reentrant_checkpointing": Scenario(checkpoint="reentrant"),
    "non_reentrant_checkpointing": Scenario(checkpoint="non_reentrant", predicate="blocks:1,2"),
    "frozen_base_with_lora": Scenario(lora=True),
    "backward_and_step_with_accumulation": Scenario(micro=2, overlap=True),
    "sharded_all_blocks_offloaded": Scenario(shard=True),
    "sharded_offloaded_and_resident_blocks": Scenario(predicate="blocks:0,2", shard=True),
    "sharded_accumulation_with_no_sync": Scenario(micro=2, shard=True),
    "sharded_accumulation_without_no_sync": Scenario(micro=2, no_sync=False, shard=True),
    "sharded_accumulation_zero_grad_to_zeros": Scenario(micro=2, zero_to_none=False, shard=True),
    "sharded_reentrant_checkpointing": Scenario(checkpoint="reentrant", shard=True),
    "sharded_non_reentrant_checkpointing": Scenario(checkpoint="non_reentrant", predicate="blocks:1,2",
                                                    shard=True),
    "sharded_frozen_base_with_lora": Scenario(lora=True, shard=True),
    "sharded_backward_and_step_with_accumulation": Scenario(micro=2, overlap=True, shard=True),
    "sharded_loads_all_blocks_offloaded": Scenario(loads=True),
    "sharded_loads_offloaded_and_resident_blocks": Scenario(predicate="blocks:0,2", loads=True),
    "sharded_loads_accumulation_with_no_sync": Scenario(micro=2, loads=True),
    "sharded_loads_reentrant_checkpointing": Scenario(checkpoint="reentrant", loads=True),
    "sharded_loads_non_reentrant_checkpointing": Scenario(checkpoint="non_reentrant", predicate="blocks:1,2",
                                                          loads=True),
    "sharded_loads_frozen_base_with_lora": Scenario(lora=True, loads=True),
    "sharded_loads_backward_and_step_with_accumulation": Scenario(micro=2, overlap=True, loads=True),
    "sharded_loads_and_optimizer": Scenario(shard=True, loads=True),
    "sharded_loads_and_optimizer_accumulation_with_no_sync": Scenario(micro=2, shard=True, loads=True),
    "sharded_loads_and_optimizer_backward_and_step": Scenario(micro=2, overlap=True, shard=True, loads=True),
}
SHARDED = [name for name, scenario in SCENARIOS.items() if scenario.shard]
LOADS = [name for name, scenario in SCENARIOS.items() if scenario.loads]


def _build(scenario: Scenario, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = mlp_of_blocks()
    model.checkpoint = scenario.checkpoint
    if scenario.lora:
        model.requires_grad_(False)
        for block in model.blocks:
            assert isinstance(block, ResidualBlock)
            block.fc1 = LoRALinear(block.fc1)
            block.fc2 = LoRALinear(block.fc2)
    return model


def _wrap(model: nn.Module, scenario: Scenario, device: str) -> None:
    predicate = None
    if scenario.predicate.startswith("blocks:"):
        predicate = only_blocks(*map(int, scenario.predicate[len("blocks:"):].split(",")))
    policy = offtensor.Policy(param_filter=offtensor.frozen_only) if scenario.lora else None
    offtensor.wrap(model, predicate, device=device, policy=policy)
    model.to(device)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 8, generator=g), torch.randn(STEPS, BATCH, 4, generator=g)


def _train(model: nn.Module, scenario: Scenario, xs: torch.Tensor, ys: torch.Tensor, *,
           data_parallel: bool, on_no_sync_grads: Any = None, on_synced_grads: Any = None) -> torch.optim.Optimizer:
    """STEPS AdamW steps; with `data_parallel`, `scenario.micro` micro-batches per step, all but
    the last under no_sync (the whole batch at once otherwise: the reference)."""
    micro = scenario.micro if data_parallel else 1
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        pairs = list(zip(xs[step].chunk(micro), ys[step].chunk(micro), strict=True))
        for i, (x, y) in enumerate(pairs):
            last = i == len(pairs) - 1
            skip = not last and scenario.no_sync
            with offtensor.no_sync(model) if skip else contextlib.nullcontext():
                loss = F.mse_loss(model(x), y) / micro
                if last and scenario.overlap and data_parallel:
                    offtensor.backward_and_step(loss, opt, zero_grad=True)
                else:
                    loss.backward()
            if not last and step == 0 and on_no_sync_grads is not None:
                on_no_sync_grads({n: host(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        if not (scenario.overlap and data_parallel):
            if on_synced_grads is not None:
                on_synced_grads({n for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=scenario.zero_to_none)
    if data_parallel and scenario.shard and scenario.overlap:
        # The masters other ranks own are stepped by their workers: read them once every rank's
        # steps are in (the results compare them), as a checkpoint after backward_and_step must.
        offtensor.sync_masters(model)
    else:
        offtensor.wait_for_steps()
    return opt


def _frozen_then_unfrozen(model: nn.Module, step: int | None) -> nn.Module:
    """Before the first step (`step` None) the head (resident) and blocks.0 (offloaded) are
    frozen; from step 0 they train; from step 1 the input Linear (resident) is frozen."""
    model.head.requires_grad_(step is not None)
    model.blocks[0].requires_grad_(step is not None)
    model.input.requires_grad_(step is None or step < 1)
    return model


def _train_freezing_between_steps(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        _frozen_then_unfrozen(model, step)
        F.mse_loss(model(xs[step]), ys[step]).backward()
        opt.step()
        opt.zero_grad()
    offtensor.wait_for_steps()


# ---- the job each rank runs ----------------------------------------------------------------


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _shared_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process mapping a /dev/shm file of offtensor's (already unlinked)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/offtensor-" in line:
                start, end = (int(a, 16) for a in line.split()[0].split("-"))
                ranges.append((start, end))
    return ranges


def _in_shared_memory(model: nn.Module) -> dict[str, bool]:
    ranges = _shared_mappings()
    return {n: any(a <= p.data_ptr() < b for a, b in ranges)
            for n, p in model.named_parameters() if isinstance(p, offtensor.OffloadedParameter)}


def _pss_bytes() -> int:
    """This process's proportional set size: shared pages count 1/k in each of k processes."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Pss in /proc/self/smaps_rollup")


class Big(nn.Module):
    """Three 36 MiB blocks: each allocation above glibc's mmap threshold, so freed memory goes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3072, 3072, bias=False) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


BIG_BYTES = 3 * 3072 * 3072 * 4


def _host_memory(shard: bool, device: str) -> int:
    """The growth of this rank's Pss from before building Big to after a forward of it in
    data-parallel mode (measured while every rank holds its model)."""
    gc.collect()
    dist.barrier()
    before = _pss_bytes()
    with torch.device("meta"):
        model = Big()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for block in model.blocks:
        nn.init.normal_(block.weight, std=0.02)
    offtensor.wrap(model, device=device).to(device)
    offtensor.data_parallel(model, shard_optimizer=shard, timeout=30)
    with torch.no_grad():
        model(torch.randn(1, 3072, device=device))
    dist.barrier()
    grown = _pss_bytes() - before
    dist.barrier()  # every rank measured while the others still map the memory
    offtensor.unwrap(model)
    del model
    gc.collect()
    return grown


def _poison_all_but_own_slices(model: nn.Module) -> None:
    """Overwrite, behind offtensor's back, every byte of each sharded scope's host masters that
    this rank's sharded loads should not read (the other ranks' slices) with 0xFF (NaN)."""
    loader = model._offtensor_engine.grads.reducer.loads
    for scope, plan in loader.plans.items():
        own = scope.masters.flat[plan.lo : plan.lo + plan.slice].clone()
        scope.masters.flat[: plan.slice * WORLD].fill_(0xFF)
        scope.masters.flat[plan.lo : plan.lo + plan.slice].copy_(own)


def _sharded_inference(rank: int, device: str) -> dict[str, Any]:
    """Outputs of inference forwards with shard_loads: one on rank 0 alone under local_loads
    (no collective may be issued), then forwards on both ranks, the last one after each rank
    poisoned the parts of its masters that other ranks copy (each rank must read only its own
    slice). Rank 1 starts from other weights: the broadcast must reach the sharded loads."""
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = mlp_of_blocks()
    offtensor.wrap(model, device=device).to(device)
    offtensor.data_parallel(model, timeout=30, shard_loads=True)
    x = _data()[0][0].to(device)
    out: dict[str, Any] = {}
    with torch.no_grad():
        if rank == 0:
            with offtensor.local_loads(model):
                out["local"] = host(model(x)).clone()
        out["first"] = host(model(x)).clone()
        _poison_all_but_own_slices(model)
        out["poisoned"] = host(model(x)).clone()
        out["poisoned_again"] = host(model(x)).clone()  # with the order learned: prefetches too
    loader = model._offtensor_engine.grads.reducer.loads
    out["gathers"] = loader.gathers
    out["sharded"] = sorted(scope.name for scope in loader.plans)
    offtensor.unwrap(model)
    return out


@contextlib.contextmanager
def _rank_results(results: dict[str, Any], out: str, rank: int) -> Any:
    """A spawned rank's job: its results saved when it ends (with the traceback of a crash,
    which the test reports), and its process group destroyed."""
    try:
        yield
    except BaseException:
        results["crash"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, f"{out}.{rank}")
        dist.destroy_process_group()


def _job(rank: int, device_type: str, init_file: str, out: str) -> None:
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=WORLD,
                            init_method=f"file://{init_file}", timeout=PG_TIMEOUT)
    results: dict[str, Any] = {"params": {}, "no_sync_grads": {}, "errors": {}, "stateful": {}, "owners": {},
                               "synced_grads": {}, "in_shm": {}, "shm_left": {}, "loads": {}}
    with _rank_results(results, out, rank):
        xs, ys = _data()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        for name, scenario in SCENARIOS.items():
            model = _build(scenario, seed=0 if rank == 0 else 100 + rank)
            _wrap(model, scenario, device)
            offtensor.data_parallel(model, timeout=30, shard_optimizer=scenario.shard, shard_loads=scenario.loads)
            engine = model._offtensor_engine
            loads_before = {scope.name: scope.loads for scope in engine.scopes}
            if scenario.shard:
                sharding = model._offtensor_engine.grads.reducer.sharding
                results["owners"][name] = {slot.name: owner for slot, owner in sharding.owner.items()}
                results["in_shm"][name] = _in_shared_memory(model)
            opt = _train(model, scenario, xs[:, shard].to(device), ys[:, shard].to(device), data_parallel=True,
                         on_no_sync_grads=lambda g, name=name: results["no_sync_grads"].__setitem__(name, g),
                         on_synced_grads=lambda g, name=name: results["synced_grads"].__setitem__(name, g))
            results["params"][name] = {n: host(p).clone() for n, p in model.named_parameters()}
            results["stateful"][name] = {n for n, p in model.named_parameters() if p in opt.state}
            if scenario.loads:
                loader = engine.grads.reducer.loads
                results["loads"][name] = {
                    "gathers": loader.gathers, "host_bytes": loader.host_bytes,
                    "scopes": {scope.name: (scope.loads - loads_before[scope.name], scope.masters.nbytes, plan.slice)
                               for scope, plan in loader.plans.items()}}
            if scenario.shard:  # the fences of the steps ordered this after the first rank's unlink
                results["shm_left"][name] = os.path.exists(f"/dev/shm/offtensor-{sharding.job}")
            offtensor.unwrap(model)

        # One scope whose masters mix dtypes at offsets a wider dtype cannot view (6 bytes of
        # bf16, then fp32): rank 1 must still receive rank 0's values.
        torch.manual_seed(0 if rank == 0 else 100 + rank)
        mixed = nn.Sequential(nn.ModuleList([MixedDtypes()]))
        offtensor.wrap(mixed, device=device).to(device)
        offtensor.data_parallel(mixed, timeout=30)
        results["mixed_dtypes"] = {n: host(p).clone() for n, p in mixed.named_parameters()}

        # Which parameters train changes after data_parallel, between steps.
        torch.manual_seed(0 if rank == 0 else 100 + rank)
        model = _frozen_then_unfrozen(mlp_of_blocks(), step=None)
        offtensor.wrap(model, device=device).to(device)
        offtensor.data_parallel(model, timeout=30)
        _train_freezing_between_steps(model, xs[:, shard].to(device), ys[:, shard].to(device))
        results["unfrozen_after_data_parallel"] = {n: host(p).clone() for n, p in model.named_parameters()}
        offtensor.unwrap(model)

        results["host_memory"] = {shard: _host_memory(shard, device) for shard in (False, True)}
        results["inference"] = _sharded_inference(rank, device)

        errors = results["errors"]

        def wrapped(predicate: Any = None, frozen_head: bool = False, on: str = device) -> nn.Module:
            model = mlp_of_blocks()
            if frozen_head:
                model.head.requires_grad_(False)
            offtensor.wrap(model, predicate, device=on)
            return model.to(on)

        # Every rank calls data_parallel in each bad setup, as a real job would.
        model = wrapped(only_blocks(0, 1) if rank == 1 else None)
        errors["different_selection"] = _error(lambda: offtensor.data_parallel(model, timeout=10))
        model = wrapped()
        if rank == 1:  # one block of another shape: same scope names, different parameters
            offtensor.unwrap(model)
            model.blocks[1] = ResidualBlock(16, expansion=3)
            offtensor.wrap(model, device=device).to(device)
        errors["different_shapes"] = _error(lambda: offtensor.data_parallel(model, timeout=10))
        model = wrapped(frozen_head=rank == 1)
        errors["different_frozen_parameters"] = _error(lambda: offtensor.data_parallel(model, timeout=10))
        if device_type == "cuda":
            model = wrapped(on="cuda:0")
            errors["two_ranks_on_one_gpu"] = _error(lambda: offtensor.data_parallel(model, timeout=10))
        model = wrapped()
        errors["different_shard_optimizer"] = _error(
            lambda: offtensor.data_parallel(model, timeout=10, shard_optimizer=rank == 0))
        model = wrapped()
        errors["different_shard_loads"] = _error(
            lambda: offtensor.data_parallel(model, timeout=10, shard_loads=rank == 1))
        model = wrapped()
        model.blocks[0].requires_grad_(False)
        offtensor.data_parallel(model, timeout=10, shard_optimizer=True)
        model.blocks[0].requires_grad_(True)
        x = torch.randn(2, 8, device=device)
        errors["unfrozen_after_data_parallel"] = _error(lambda: model(x).sum().backward())
        # An owner's averaged gradient, not zeroed, then a no_sync backward adding to it.
        model = wrapped()
        offtensor.data_parallel(model, timeout=10, shard_optimizer=True)
        model(x).sum().backward()
        with offtensor.no_sync(model):
            errors["no_sync_onto_an_averaged_gradient"] = _error(lambda: model(x).sum().backward())
        # The masters another rank owns, read after backward_and_step before sync_masters.
        model = wrapped()
        offtensor.data_parallel(model, timeout=10, shard_optimizer=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        offtensor.backward_and_step(model(x).sum(), opt)
        errors["read_before_sync_masters"] = _error(lambda: model.state_dict())
        offtensor.sync_masters(model)
        results["read_after_sync_masters"] = _error(lambda: model.state_dict())
        if device_type == "cpu":  # checked on CUDA only with CHECK_ENV=1 (a host sync per averaging)
            # A branch taken on rank 0 only: rank 1's backward skips blocks.2.
            model = wrapped()
            offtensor.data_parallel(model, timeout=10)

            def one_rank_skips_a_block() -> None:
                h = model.input(x)
                for block in model.blocks[: len(model.blocks) - rank]:
                    h = block(h)
                model.head(h).sum().backward()

            errors["a_branch_on_one_rank"] = _error(one_rank_skips_a_block)
            model.zero_grad()
            model(x).sum().backward()
            results["grads_after_a_branch"] = {n: host(p.grad).clone() for n, p in model.named_parameters()}
        model = wrapped()
        errors["ddp_around_a_wrapped_model"] = _error(lambda: nn.parallel.DistributedDataParallel(model))
        # Last: rank 1 never calls data_parallel, so rank 0 must give up after its timeout.
        if rank == 0:
            began = time.monotonic()
            errors["a_rank_never_arrives"] = _error(lambda: offtensor.data_parallel(model, timeout=2))
            results["gave_up_after_s"] = time.monotonic() - began
        dist.barrier()


# ---- the tests -----------------------------------------------------------------------------


def _run_ranks(fn, device_type: str, tmp: Path) -> tuple[str, list[dict]]:
    """Run `fn(rank, device_type, store_file, out)` on WORLD spawned ranks; each rank's results."""
    mp = pytest.importorskip("torch.multiprocessing")
    out = str(tmp / "results")
    context = mp.start_processes(fn, args=(device_type, str(tmp / "pg"), out), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"the two ranks did not finish within {JOB_TIMEOUT_S} s")
    except mp.ProcessRaisedException as e:
        pytest.fail(f"a rank raised:\n{e}")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r} crashed:\n{res['crash']}"
    return device_type, results


@pytest.fixture(scope="module", params=devices)
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """Run the two-rank job once per device; each rank's results."""
    return _run_ranks(_job, request.param, tmp_path_factory.mktemp(f"dp-{request.param}"))


def _tolerances(device_type: str) -> dict[str, float]:
    # Not bit-exact even on the CPU: the ranks sum half-batch gradients, the reference sums the
    # whole batch in another order, and AdamW turns a last-bit difference of a gradient near zero
    # into a visible one (an element per few hundred). A gradient left unaveraged, or averaged
    # twice, changes the weights by about lr=1e-2 per step: far outside these.
    return {"rtol": 1e-4, "atol": 1e-5}


def _reference(scenario: Scenario, device_type: str) -> nn.Module:
    device = "cuda:0" if device_type == "cuda" else "cpu"
    model = _build(scenario, seed=0).to(device)
    xs, ys = _data()
    _train(model, scenario, xs.to(device), ys.to(device), data_parallel=False)
    return model


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_on_half_batches_match_one_process_on_the_whole_batch(job, name):
    device_type, results = job
    reference = {n: host(p) for n, p in _reference(SCENARIOS[name], device_type).named_parameters()}
    initial = {n: host(p) for n, p in _build(SCENARIOS[name], seed=0).named_parameters()}

    for rank, res in enumerate(results):
        got = res["params"][name]
        assert got.keys() == reference.keys()
        for n, value in got.items():
            torch.testing.assert_close(value, reference[n], **_tolerances(device_type),
                                       msg=lambda m, n=n, rank=rank: f"rank {rank}, {n}: {m}")
    trained = [n for n, p in initial.items() if not torch.equal(p, reference[n])]
    assert trained, "the reference did not train"


def test_parameters_unfrozen_and_frozen_after_data_parallel_train_like_one_process(job):
    # A parameter that is not offloaded and was frozen at data_parallel got no averaging hook:
    # unfrozen later, each rank stepped it with its own gradient and the ranks' heads diverged.
    device_type, results = job
    device = "cuda:0" if device_type == "cuda" else "cpu"
    torch.manual_seed(0)
    reference = _frozen_then_unfrozen(mlp_of_blocks(), step=None).to(device)
    xs, ys = _data()
    _train_freezing_between_steps(reference, xs.to(device), ys.to(device))
    for rank, res in enumerate(results):
        for n, p in reference.named_parameters():
            torch.testing.assert_close(res["unfrozen_after_data_parallel"][n], host(p), **_tolerances(device_type),
                                       msg=lambda m, n=n, rank=rank: f"rank {rank}, {n}: {m}")


def test_error_on_every_rank_if_one_ranks_backward_reaches_other_parameters_then_training_goes_on(job):
    # Averagings are matched by order: rank 0's gradient of blocks.2 was averaged with rank 1's
    # of blocks.1 (the same shapes), silently, and the ranks stayed shifted by one collective.
    device_type, results = job
    if device_type != "cpu":
        pytest.skip("checked on CUDA only with OFFTENSOR_CHECK_DATA_PARALLEL=1")
    names = ["'blocks.2.fc2.bias'", "'blocks.1.fc2.bias'"]
    for rank, res in enumerate(results):
        assert res["errors"]["a_branch_on_one_rank"] == (
            f"RuntimeError: offtensor.data_parallel: rank {rank}'s averaging of the gradient of {names[rank]} "
            f"(its 3rd averaging) was matched with rank {1 - rank}'s averaging of {names[1 - rank]} (its 3rd): "
            "the ranks' backward passes differ. Every rank must give gradients to the same parameters in "
            "the same order in each backward outside no_sync (as DistributedDataParallel without "
            "find_unused_parameters): take the same branches on every rank, or make an unused parameter "
            "part of the loss (+ 0 * p.sum()). A rank whose backward raised first shows its own error; "
            "once every rank has raised, the next backward is matched again")
    first, second = (res["grads_after_a_branch"] for res in results)
    for n in first:
        torch.testing.assert_close(first[n], second[n], rtol=0, atol=0, msg=n)


def test_no_sync_leaves_each_rank_its_own_gradients(job):
    # Under no_sync the first micro-batch's gradients are each rank's own (not averaged): they
    # equal the plain model's gradients on that rank's micro-batch.
    device_type, results = job
    scenario = SCENARIOS["accumulation_with_no_sync"]
    device = "cuda:0" if device_type == "cuda" else "cpu"
    xs, ys = _data()
    for rank, res in enumerate(results):
        reference = _build(scenario, seed=0).to(device)
        rows = slice(rank * BATCH // WORLD, rank * BATCH // WORLD + BATCH // WORLD // scenario.micro)
        (F.mse_loss(reference(xs[0, rows].to(device)), ys[0, rows].to(device)) / scenario.micro).backward()
        got = res["no_sync_grads"]["accumulation_with_no_sync"]
        assert got.keys() == {n for n, p in reference.named_parameters() if p.grad is not None}
        for n, p in reference.named_parameters():
            torch.testing.assert_close(got[n], host(p.grad), **_tolerances(device_type),
                                       msg=lambda m, n=n, rank=rank: f"rank {rank}, {n}: {m}")
    assert not torch.equal(results[0]["no_sync_grads"]["accumulation_with_no_sync"]["head.weight"],
                           results[1]["no_sync_grads"]["accumulation_with_no_sync"]["head.weight"])


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_ranks_hold_the_same_masters_in_shared_memory(job, name):
    # After the steps every rank reads the same bytes (each stepped only its own parameters),
    # the masters lie in a mapping of the node's shared-memory file, and the file is unlinked.
    _, results = job
    for n, value in results[0]["params"][name].items():
        assert torch.equal(value, results[1]["params"][name][n]), n
    for rank, res in enumerate(results):
        assert res["in_shm"][name] and all(res["in_shm"][name].values()), f"rank {rank}: {res['in_shm'][name]}"
        assert not res["shm_left"][name], f"rank {rank}: the /dev/shm file was not unlinked"


@pytest.mark.parametrize("name", SHARDED)
def test_each_rank_steps_and_keeps_optimizer_state_only_for_the_parameters_it_owns(job, name):
    _, results = job
    owners = results[0]["owners"][name]
    assert owners == results[1]["owners"][name], "every rank computes the same owners"
    offloaded = set(results[0]["in_shm"][name])
    trainable = {n for n in offloaded if n in results[0]["stateful"][name] | results[1]["stateful"][name]}
    assert set(owners) == trainable, "owners for exactly the trainable offloaded parameters"
    if SCENARIOS[name].lora:
        assert owners == {}, "frozen masters need no owner"
    else:
        assert set(owners.values()) == {0, 1}, "both ranks own a share"
    for rank, res in enumerate(results):
        mine = {n for n, r in owners.items() if r == rank}
        assert res["stateful"][name] & offloaded == mine, f"rank {rank}"
        resident = res["stateful"][name] - offloaded
        assert resident and resident == results[0]["stateful"][name] - offloaded, "the others: every rank"
        if name in res["synced_grads"]:  # after the synchronised backward, before the step
            assert res["synced_grads"][name] & offloaded == mine, f"rank {rank}: p.grad only on the owner"


def test_owners_balance_the_bytes(job):
    _, results = job
    owners = results[0]["owners"]["sharded_all_blocks_offloaded"]
    sizes = {n: v.numel() * v.element_size() for n, v in results[0]["params"]["sharded_all_blocks_offloaded"].items()}
    load = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(WORLD)]
    assert abs(load[0] - load[1]) <= max(sizes[n] for n in owners), load


def test_one_host_copy_of_the_masters_per_node(job):
    # Pss counts a page shared by k processes 1/k in each: the ranks' sum is the node's RAM.
    # Plain data parallel holds a copy per rank; shard_optimizer one for the node.
    _, results = job
    plain = sum(res["host_memory"][False] for res in results)
    shared = sum(res["host_memory"][True] for res in results)
    assert plain > 1.8 * BIG_BYTES, f"plain data parallel: {plain / 2**20:.0f} MiB for 2 ranks"
    assert shared < 1.2 * BIG_BYTES, (f"shard_optimizer: {shared / 2**20:.0f} MiB for 2 ranks, masters "
                                      f"{BIG_BYTES / 2**20:.0f} MiB")


BAD_SETUPS = {
    "different_selection": r"ValueError: offtensor.data_parallel: rank 0 wrapped 3 scopes and rank 1 2 "
                           r"\(scope 'blocks.2' only on rank 0\); every rank must call offtensor.wrap",
    "different_shapes": r"ValueError: offtensor.data_parallel: scope 'blocks.1' differs between ranks: "
                        r"parameter 'blocks.1.fc1.weight' is \(32, 16\) torch.float32 on rank 0 and "
                        r"'blocks.1.fc1.weight' \(48, 16\) torch.float32 on rank 1",
    "different_frozen_parameters": r"ValueError: offtensor.data_parallel: parameter 'head.weight', which is "
                                   r"not offloaded, is \(4, 16\) torch.float32, requires_grad=True on rank 0 but "
                                   r"\(4, 16\) torch.float32, requires_grad=False on rank 1",
    "different_shard_loads": r"ValueError: offtensor.data_parallel: rank 0 passed shard_loads=False but "
                             r"rank 1 shard_loads=True; pass the same on every rank",
    "different_shard_optimizer": r"ValueError: offtensor.data_parallel: rank 0 passed shard_optimizer=True but "
                                 r"rank 1 shard_optimizer=False; pass the same on every rank",
    "unfrozen_after_data_parallel": r"RuntimeError: offtensor.data_parallel\(shard_optimizer=True\): offloaded "
                                    r"parameter 'blocks.0.\S+' got a gradient, but it was frozen when data_parallel "
                                    r"assigned .* Unfreeze parameters before",
    "no_sync_onto_an_averaged_gradient": r"RuntimeError: offtensor.no_sync: parameter 'blocks.\S+' already holds "
                                         r"the averaged gradient of an earlier synchronised backward .*Zero the "
                                         r"gradients \(optimizer.zero_grad\(\)\) after each optimizer step",
    "ddp_around_a_wrapped_model": r"RuntimeError: offtensor: DistributedDataParallel was given a model with "
                                  r"offloaded parameters .*offtensor.data_parallel\(model\)",
    # Regression: silently one step behind on the parameters the other rank steps.
    "read_before_sync_masters": r"RuntimeError: offtensor.data_parallel\(shard_optimizer=True\): parameter "
                                r"'\S+' is stepped by rank [01], whose step may not be in the shared master "
                                r"yet.* Call offtensor.sync_masters\(model\) on every rank before reading them",
}


def test_masters_read_after_sync_masters_give_no_error(job):
    _, results = job
    assert [res["read_after_sync_masters"] for res in results] == ["no error"] * WORLD


def test_rank_0s_weights_reach_every_rank_in_a_scope_of_mixed_dtypes(job):
    _, results = job
    got, expected = results[1]["mixed_dtypes"], results[0]["mixed_dtypes"]
    assert got.keys() == {"0.0.odd", "0.0.fc.weight", "0.0.fc.bias"}
    for n, value in got.items():
        torch.testing.assert_close(value, expected[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


# On CUDA, DDP's own check that every parameter is on one kind of device (offloaded ones report
# `cpu`) refuses the wrapped model before offtensor's guard can (docs/design.md, Data parallel).
DDP_ON_CUDA = (r"ValueError: DistributedDataParallel's input module must be on the same type of devices, "
               r"but input module parameters locate in \{'c")


@pytest.mark.parametrize("setup", list(BAD_SETUPS))
def test_error_on_every_rank_for_a_bad_setup(job, setup):
    device_type, results = job
    expected = DDP_ON_CUDA if setup == "ddp_around_a_wrapped_model" and device_type == "cuda" else BAD_SETUPS[setup]
    for rank, res in enumerate(results):
        assert re.search(expected, res["errors"][setup]), f"rank {rank}: {res['errors'][setup]}"


def test_error_on_every_rank_if_two_ranks_share_a_gpu(job):
    device_type, results = job
    if device_type != "cuda":
        pytest.skip("a CUDA-only setup")
    for res in results:
        assert "ranks 0 and 1 both compute on cuda:0" in res["errors"]["two_ranks_on_one_gpu"]
        assert "torch.cuda.set_device" in res["errors"]["two_ranks_on_one_gpu"]


def test_error_after_the_timeout_if_a_rank_never_calls_data_parallel(job):
    _, results = job
    error = results[0]["errors"]["a_rank_never_arrives"]
    assert error.startswith("RuntimeError: offtensor.data_parallel: rank(s) [1] did not call "
                            "offtensor.data_parallel within 2 s"), error
    assert 2 <= results[0]["gave_up_after_s"] < 10


# ---- one process ---------------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'pg'}",
                            timeout=PG_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_error_if_no_process_group_is_initialised():
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")

    with pytest.raises(RuntimeError, match="offtensor.data_parallel: no process group is initialised") as e:
        offtensor.data_parallel(model)

    assert "torchrun --nproc-per-node N" in str(e.value)


def test_error_if_no_sync_is_given_a_model_not_in_data_parallel_mode():
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")

    with pytest.raises(RuntimeError, match=r"offtensor.no_sync: this BlockStack is not in data-parallel mode.*"
                                           r"offtensor.data_parallel\(model\) first"):
        offtensor.no_sync(model)


def test_error_if_data_parallel_is_given_a_model_that_is_not_wrapped(one_rank_group):
    with pytest.raises(ValueError, match="offtensor.data_parallel: this BlockStack is not wrapped"):
        offtensor.data_parallel(mlp_of_blocks())


def test_error_if_data_parallel_is_called_twice(one_rank_group):
    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5)

    with pytest.raises(RuntimeError, match="already in data-parallel mode"):
        offtensor.data_parallel(model, timeout=5)


def test_unwrap_ends_data_parallel_mode(one_rank_group):
    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5)
    engine = model._offtensor_engine
    reducer = engine.grads.reducer
    x = torch.randn(4, 8)
    model(x).sum().backward()
    launched = reducer.reductions
    assert launched == len(list(model.parameters())), "one all-reduce per parameter gradient"

    offtensor.unwrap(model)
    model(x).sum().backward()

    assert engine.grads.reducer is None
    assert reducer.reductions == launched, "no hook of the data-parallel mode is left"


@pytest.mark.parametrize("shard", [False, True], ids=["plain", "shard_optimizer"])
def test_a_data_parallel_model_that_goes_out_of_scope_is_freed(one_rank_group, shard):
    """Regression: the gradient hook of each resident parameter held the reducer strongly, and
    through it the engines and the model, in C++ autograd metadata the garbage collector cannot
    see into (Note [hooks that keep a model alive]): a dropped model was never freed."""
    import gc
    import weakref

    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5,
                                    shard_optimizer=shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    engine, head = weakref.ref(model._offtensor_engine), weakref.ref(model.head.weight)
    del model, opt
    gc.collect()
    assert engine() is None and head() is None, "the model outlived its last reference"


@pytest.mark.parametrize("shard", [False, True], ids=["plain", "shard_optimizer"])
def test_one_rank_group_trains_like_the_plain_model(one_rank_group, shard):
    scenario = SCENARIOS["offloaded_and_resident_blocks"]
    reference = _reference(scenario, "cpu")
    model = _build(scenario, seed=0)
    _wrap(model, scenario, "cpu")
    offtensor.data_parallel(model, timeout=5, shard_optimizer=shard)
    xs, ys = _data()

    _train(model, scenario, xs, ys, data_parallel=True)

    # a world of one divides by one and sums one tensor: bit-identical
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(host(p), host(q), rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_owners_are_balanced_by_bytes_largest_first_and_frozen_parameters_have_none():
    rows = [("a", 10, True), ("b", 40, True), ("c", 30, True), ("frozen", 100, False), ("d", 20, True)]

    owners = plan_owners(rows, [0, 1])

    # b (40) -> 0, c (30) -> 1, d (20) -> 1 (30 < 40), a (10) -> 0 (40 < 50)
    assert owners == {"b": 0, "c": 1, "d": 1, "a": 0}
    assert plan_owners(rows, [0, 1]) == owners
    assert plan_owners(rows, [3, 5, 7]) == {"b": 3, "c": 5, "d": 7, "a": 7}


def test_shard_optimizer_masters_live_in_unlinked_shared_memory(one_rank_group):
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")
    values = {n: host(p).clone() for n, p in model.named_parameters()}

    offtensor.data_parallel(model, timeout=5, shard_optimizer=True)

    sharding = model._offtensor_engine.grads.reducer.sharding
    assert not os.path.exists(f"/dev/shm/offtensor-{sharding.job}")
    assert all(_in_shared_memory(model).values())
    for n, p in model.named_parameters():  # the same values, each master a storage of its own
        torch.testing.assert_close(host(p), values[n], rtol=0, atol=0)
        if isinstance(p, offtensor.OffloadedParameter):
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
    offtensor.unwrap(model)
    assert not any(_in_shared_memory(model).values()), "unwrap gives private copies"


def test_sync_masters_waits_for_the_deferred_steps_then_fences(one_rank_group):
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")
    offtensor.data_parallel(model, timeout=5, shard_optimizer=True)
    sharding = model._offtensor_engine.grads.reducer.sharding
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)

    offtensor.backward_and_step(model(x).sum(), opt)
    offtensor.sync_masters(model)

    assert sharding.fences == 1 and sharding.state is MastersState.AGREED
    model(x)  # no synchronised backward since the fence: no other
    opt.step()  # a step of an optimizer holding the shared masters fences
    assert sharding.fences == 2


def test_error_if_sync_masters_is_given_a_model_without_shard_optimizer(one_rank_group):
    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5)

    with pytest.raises(RuntimeError, match=r"offtensor.sync_masters: this BlockStack is not in "
                                           r"data_parallel\(model, shard_optimizer=True\) mode"):
        offtensor.sync_masters(model)


def test_error_if_shared_memory_is_too_small(one_rank_group, monkeypatch):
    monkeypatch.setattr(_shm, "_free_bytes", lambda: 1000)
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")

    with pytest.raises(RuntimeError, match=r"shard_optimizer=True\): the masters need \d+\.\d MiB of shared "
                                           r"memory but /dev/shm has 0\.0 MiB free; enlarge it \(in Docker: "
                                           r"--shm-size\)"):
        offtensor.data_parallel(model, timeout=5, shard_optimizer=True)


# ---- sharded loads (Note [sharded loads]) ---------------------------------------------------


@pytest.mark.parametrize("name", LOADS)
def test_every_load_of_a_sharded_scope_copies_one_slice_and_all_gathers_the_rest(job, name):
    _, results = job
    for rank, res in enumerate(results):
        record = res["loads"][name]
        scopes = record["scopes"]
        assert scopes, f"rank {rank}: no scope is sharded"
        loads = sum(n for n, _, _ in scopes.values())
        assert loads > 0 and record["gathers"] == loads, f"rank {rank}: {record}"
        # per load: its slice, plus the tail after WORLD aligned slices (copied by every rank)
        assert record["host_bytes"] == sum(n * (nbytes - (WORLD - 1) * size) for n, nbytes, size in scopes.values())
        assert all(0 < size * WORLD <= nbytes for _, nbytes, size in scopes.values())
    assert results[0]["loads"][name] == results[1]["loads"][name], "the ranks load the same scopes"


def test_sharded_loads_give_the_plain_models_outputs_reading_only_each_ranks_own_slice(job):
    # Each rank overwrote the other ranks' slices of its own masters with NaNs before the last
    # forwards: they still give the plain model's outputs, so no rank read those bytes.
    device_type, results = job
    device = "cuda:0" if device_type == "cuda" else "cpu"
    torch.manual_seed(0)
    reference = mlp_of_blocks().to(device)
    with torch.no_grad():
        expected = host(reference(_data()[0][0].to(device)))

    for rank, res in enumerate(results):
        out = res["inference"]
        assert out["sharded"] == ["blocks.0", "blocks.1", "blocks.2"]
        for key in ("first", "poisoned", "poisoned_again"):
            torch.testing.assert_close(out[key], expected, msg=lambda m, key=key, rank=rank: f"rank {rank}, {key}: {m}")
    # rank 0's pass under local_loads issued no collective (rank 1 ran no such pass)
    torch.testing.assert_close(results[0]["inference"]["local"], expected)
    assert results[0]["inference"]["gathers"] == results[1]["inference"]["gathers"] == 3 * 3


FAILURE_PG_TIMEOUT = datetime.timedelta(seconds=3)


def _failure_job(rank: int, device_type: str, init_file: str, out: str) -> None:
    """Ranks that load different scopes, then (CPU) a forward that raises on rank 0 only; each
    outcome recorded, then the model must work again on both ranks."""
    from offtensor.distributed.sharded_loads import CHECK_ENV

    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        os.environ[CHECK_ENV] = "1"  # the tag check costs a host sync per load on CUDA
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=WORLD,
                            init_method=f"file://{init_file}", timeout=FAILURE_PG_TIMEOUT)
    results: dict[str, Any] = {}
    with _rank_results(results, out, rank):
        torch.manual_seed(0)
        model = mlp_of_blocks()
        offtensor.wrap(model, device=device).to(device)
        offtensor.data_parallel(model, timeout=30, shard_loads=True)
        x = _data()[0][0].to(device)

        def attempt(key: str, fn: Any) -> None:
            began = time.monotonic()
            try:
                with torch.no_grad():
                    results[key] = host(fn()).clone()
            except (ValueError, RuntimeError) as e:
                results[key] = f"{type(e).__name__}: {e}"
            results[f"{key} s"] = time.monotonic() - began

        attempt("learn the order", lambda: model(x))
        h = torch.randn(2, 16, device=device)
        attempt("different scopes", lambda: model.blocks[1 + rank](h))
        attempt("after different scopes", lambda: model(x))
        if device_type == "cpu":  # NCCL's watchdog ends a process whose collective times out
            def boom(*_: Any) -> None:
                raise ValueError("boom on rank 0")

            handle = model.blocks[1].register_forward_pre_hook(boom) if rank == 0 else None
            attempt("rank 0 raises", lambda: model(x))
            if handle is not None:
                handle.remove()
            attempt("after the failure", lambda: model(x))
            if rank == 1:  # its load above timed out: the retry meets rank 0's resynchronisation
                attempt("retry", lambda: model(x))
            attempt("again", lambda: model(x))


@pytest.fixture(scope="module", params=devices)
def failure_job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    return _run_ranks(_failure_job, request.param, tmp_path_factory.mktemp(f"dp-failures-{request.param}"))


def _plain_output(device_type: str) -> torch.Tensor:
    torch.manual_seed(0)
    device = "cuda:0" if device_type == "cuda" else "cpu"
    with torch.no_grad():
        return host(mlp_of_blocks().to(device)(_data()[0][0].to(device)))


def test_error_on_every_rank_if_the_ranks_load_different_scopes_then_the_model_works_again(failure_job):
    device_type, results = failure_job
    for rank, res in enumerate(results):
        other = 1 - rank
        assert re.match(
            rf"RuntimeError: offtensor.data_parallel\(shard_loads=True\): rank {rank}'s load of scope "
            rf"'blocks.{1 + rank}' \(its 2nd sharded load\) was matched with rank {other}'s load of scope "
            rf"'blocks.{1 + other}' for the 2nd time: the ranks' passes differ. Every rank must run the same "
            r"forward and backward passes .*offtensor.local_loads\(model\)", res["different scopes"]), \
            res["different scopes"]
        torch.testing.assert_close(res["after different scopes"], _plain_output(device_type))


def test_a_forward_raising_on_one_rank_gives_the_others_an_error_within_the_timeout_then_the_model_works(failure_job):
    device_type, results = failure_job
    if device_type != "cpu":
        pytest.skip("a collective that times out ends the process under NCCL (its watchdog)")
    expected = _plain_output(device_type)
    first, second = results
    assert first["rank 0 raises"] == "ValueError: boom on rank 0"
    torch.testing.assert_close(second["rank 0 raises"], expected)  # its loads all matched rank 0's
    # rank 1's next load waits for rank 0, which never issues it: an error after the timeout
    assert re.match(r"RuntimeError: offtensor.data_parallel\(shard_loads=True\): rank 1's load of scope "
                    r"'blocks.0' \(its \d+\w\w sharded load\): the other ranks did not join it within the "
                    r"process group's timeout \(3 s\)", second["after the failure"]), second["after the failure"]
    timeout = FAILURE_PG_TIMEOUT.total_seconds()
    assert timeout <= second["after the failure s"] < 3 * timeout
    # rank 0 resynchronised with rank 1's retry: both work again
    torch.testing.assert_close(first["after the failure"], expected)
    torch.testing.assert_close(second["retry"], expected)
    for res in results:
        torch.testing.assert_close(res["again"], expected)


# ---- sharded loads in one process --------------------------------------------------------------


def test_error_if_shard_loads_without_equal_masters(one_rank_group):
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")

    with pytest.raises(ValueError, match=r"shard_loads=True assembles each scope from slices .* pass "
                                         r"broadcast_weights=True \(or shard_optimizer=True"):
        offtensor.data_parallel(model, timeout=5, broadcast_weights=False, shard_loads=True)


def test_scopes_that_cast_are_loaded_whole(one_rank_group):
    # bf16 compute from fp32 masters: the load casts, so it stays a plain load (the same outputs
    # as the model wrapped alike without data_parallel).
    policy = offtensor.Policy(compute_dtype=torch.bfloat16)
    model = mlp_of_blocks()
    reference = mlp_of_blocks()
    reference.load_state_dict(model.state_dict())
    offtensor.wrap(reference, device="cpu", policy=policy)
    offtensor.wrap(model, device="cpu", policy=policy)
    offtensor.data_parallel(model, timeout=5, shard_loads=True)
    loader = model._offtensor_engine.grads.reducer.loads
    x = torch.randn(4, 8)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(x)
        expected = reference(x)

    assert loader.plans == {} and loader.gathers == 0
    assert not any(isinstance(scope.source, ShardedSource) for scope in model._offtensor_engine.scopes)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_unwrap_ends_sharded_loads(one_rank_group):
    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5, shard_loads=True)
    engine = model._offtensor_engine
    loader = engine.grads.reducer.loads
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
    gathers = loader.gathers
    assert gathers == 3 and all(scope.source.loads is loader for scope in engine.scopes)

    offtensor.unwrap(model)
    model(x)

    assert loader.gathers == gathers and engine.on_abort == []
    assert not any(isinstance(scope.source, ShardedSource) for scope in engine.scopes)


def test_local_loads_copy_whole_scopes_without_collectives(one_rank_group):
    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5, shard_loads=True)
    loader = model._offtensor_engine.grads.reducer.loads
    x = torch.randn(4, 8)

    with torch.no_grad(), offtensor.local_loads(model):
        model(x)

    assert loader.gathers == 0
    assert loader.host_bytes == sum(scope.masters.nbytes for scope in model._offtensor_engine.scopes)
    assert not loader.holds


def test_training_goes_on_after_a_local_loads_pass_between_steps(one_rank_group):
    # local_loads put back the engine's learned order with each value copied: the Scope where
    # the last pass began became a copy of it, which the next forward loaded (KeyError: not one
    # of the loader's scopes), and on two ranks the other rank then waited for the load.
    model = offtensor.data_parallel(offtensor.wrap(mlp_of_blocks(), device="cpu"), timeout=5, shard_loads=True)
    engine = model._offtensor_engine
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    opt.step()

    with torch.no_grad(), offtensor.local_loads(model):
        model(x)
    model(x).sum().backward()

    assert engine.schedule.last_begin in engine.scopes


def test_error_if_local_loads_is_given_a_model_that_is_not_wrapped():
    with pytest.raises(ValueError, match="offtensor.local_loads: this BlockStack is not wrapped"):
        offtensor.local_loads(mlp_of_blocks())


@pytest.mark.parametrize("device_type", [
    pytest.param("cpu", id="cpu-gloo"),
    pytest.param("cuda", id="cuda-nccl", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
])
def test_one_rank_sharded_loads_train_like_the_plain_model(device_type, tmp_path):
    """One rank, so one GPU runs it: each load is this rank's slice (the whole scope) plus an
    all-gather (in place, NCCL on CUDA, with weights_ready recorded on the gathered stream),
    and training matches the unwrapped model step for step."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"file://{tmp_path / 'pg'}",
                            timeout=PG_TIMEOUT)
    try:
        model = mlp_of_blocks(n_blocks=3, hidden=64, checkpoint="non_reentrant")
        reference = mlp_of_blocks(n_blocks=3, hidden=64, checkpoint="non_reentrant")
        reference.load_state_dict(model.state_dict())
        reference.to(device_type)
        offtensor.wrap(model, device=device_type)
        model.to(device_type)
        offtensor.data_parallel(model, timeout=30, shard_loads=True)
        loader = model._offtensor_engine.grads.reducer.loads
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        tol = {"rtol": 1e-5, "atol": 1e-5} if device_type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}
        for _ in range(STEPS):
            x = torch.randn(BATCH, 8, generator=gen).to(device_type)
            y = torch.randn(BATCH, 4, generator=gen).to(device_type)
            loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
            torch.testing.assert_close(loss, ref_loss, **tol)
            loss.backward()
            ref_loss.backward()
            for opt_ in (opt, ref_opt):
                opt_.step()
                opt_.zero_grad()
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(host(p.detach()), host(r.detach()), msg=name, **tol)
        engine = model._offtensor_engine
        # Every load of every scope (forward, and backward's reloads) was a sharded one.
        assert loader.gathers == sum(scope.loads for scope in engine.scopes) >= STEPS * len(model.blocks)
        assert all(scope.device.storage.nbytes() == 0 for scope in engine.scopes)
    finally:
        dist.destroy_process_group()


def test_a_data_parallel_model_steps_every_piece_on_the_host_and_says_why(one_rank_group):
    """backward_and_step(device_share=...) on a data_parallel model: no device steps (Note
    [device steps] in optim/device_steps.py), the report says why, and the step is the plain one."""
    model = mlp_of_blocks()
    reference = copy.deepcopy(model)
    offtensor.data_parallel(offtensor.wrap(model, device="cpu"))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    F.mse_loss(reference(x), y).backward()
    ref_opt.step()
    report = offtensor.backward_and_step(F.mse_loss(model(x), y), opt, device_share=1.0).wait()
    assert report.device_pieces == 0 and report.device_steps_off == "the model is data_parallel"
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
