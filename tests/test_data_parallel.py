"""offtensor.data_parallel: N ranks, each on 1/N of the batch, train like one process on all of it.

One spawned job of two ranks per device runs every scenario (building a process group costs
seconds, a scenario milliseconds) and saves each rank's parameters after K optimizer steps; the
tests compare them with the plain, unwrapped model trained in this process on the whole batch.
Rank 1 builds its model from another seed: `data_parallel` must copy rank 0's weights to it.
The same job then runs the bad setups, which must raise the same error on every rank (never
hang). CPU runs with gloo; the CUDA variant (NCCL, two GPUs) is skipped on fewer than two GPUs.
Every wait is bounded: the job is killed after JOB_TIMEOUT_S, and data_parallel's own agreement
check waits at most a few seconds here.
"""

from __future__ import annotations

import contextlib
import datetime
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


SCENARIOS = {
    "all_blocks_offloaded": Scenario(),
    "offloaded_and_resident_blocks": Scenario(predicate="blocks:0,2"),
    "accumulation_with_no_sync": Scenario(micro=2),
    "reentrant_checkpointing": Scenario(checkpoint="reentrant"),
    "non_reentrant_checkpointing": Scenario(checkpoint="non_reentrant", predicate="blocks:1,2"),
    "frozen_base_with_lora": Scenario(lora=True),
    "backward_and_step_with_accumulation": Scenario(micro=2, overlap=True),
}


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
           data_parallel: bool, on_no_sync_grads: Any = None) -> None:
    """STEPS AdamW steps; with `data_parallel`, `scenario.micro` micro-batches per step, all but
    the last under no_sync (the whole batch at once otherwise: the reference)."""
    micro = scenario.micro if data_parallel else 1
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        pairs = list(zip(xs[step].chunk(micro), ys[step].chunk(micro), strict=True))
        for i, (x, y) in enumerate(pairs):
            last = i == len(pairs) - 1
            with contextlib.nullcontext() if last else offtensor.no_sync(model):
                loss = F.mse_loss(model(x), y) / micro
                if last and scenario.overlap and data_parallel:
                    offtensor.backward_and_step(loss, opt, zero_grad=True)
                else:
                    loss.backward()
            if not last and step == 0 and on_no_sync_grads is not None:
                on_no_sync_grads({n: host(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None})
        if not (scenario.overlap and data_parallel):
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


def _job(rank: int, device_type: str, init_file: str, out: str) -> None:
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=WORLD,
                            init_method=f"file://{init_file}", timeout=PG_TIMEOUT)
    results: dict[str, Any] = {"params": {}, "no_sync_grads": {}, "errors": {}}
    try:
        xs, ys = _data()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        for name, scenario in SCENARIOS.items():
            model = _build(scenario, seed=0 if rank == 0 else 100 + rank)
            _wrap(model, scenario, device)
            offtensor.data_parallel(model, timeout=30)
            _train(model, scenario, xs[:, shard].to(device), ys[:, shard].to(device), data_parallel=True,
                   on_no_sync_grads=lambda g, name=name: results["no_sync_grads"].__setitem__(name, g))
            results["params"][name] = {n: host(p).clone() for n, p in model.named_parameters()}
            offtensor.unwrap(model)

        # One scope whose masters mix dtypes at offsets a wider dtype cannot view (6 bytes of
        # bf16, then fp32): rank 1 must still receive rank 0's values.
        torch.manual_seed(0 if rank == 0 else 100 + rank)
        mixed = nn.Sequential(nn.ModuleList([MixedDtypes()]))
        offtensor.wrap(mixed, device=device).to(device)
        offtensor.data_parallel(mixed, timeout=30)
        results["mixed_dtypes"] = {n: host(p).clone() for n, p in mixed.named_parameters()}

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
        errors["ddp_around_a_wrapped_model"] = _error(lambda: nn.parallel.DistributedDataParallel(model))
        # Last: rank 1 never calls data_parallel, so rank 0 must give up after its timeout.
        if rank == 0:
            began = time.monotonic()
            errors["a_rank_never_arrives"] = _error(lambda: offtensor.data_parallel(model, timeout=2))
            results["gave_up_after_s"] = time.monotonic() - began
        dist.barrier()
    except BaseException:
        results["crash"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, f"{out}.{rank}")
        dist.destroy_process_group()


# ---- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=devices)
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """Run the two-rank job once per device; each rank's results."""
    mp = pytest.importorskip("torch.multiprocessing")
    device_type = request.param
    tmp = tmp_path_factory.mktemp(f"dp-{device_type}")
    out = str(tmp / "results")
    context = mp.start_processes(_job, args=(device_type, str(tmp / "pg"), out), nprocs=WORLD,
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


BAD_SETUPS = {
    "different_selection": r"ValueError: offtensor.data_parallel: rank 0 wrapped 3 scopes and rank 1 2 "
                           r"\(scope 'blocks.2' only on rank 0\); every rank must call offtensor.wrap",
    "different_shapes": r"ValueError: offtensor.data_parallel: scope 'blocks.1' differs between ranks: "
                        r"parameter 'blocks.1.fc1.weight' is \(32, 16\) torch.float32 on rank 0 and "
                        r"'blocks.1.fc1.weight' \(48, 16\) torch.float32 on rank 1",
    "different_frozen_parameters": r"ValueError: offtensor.data_parallel: parameter 'head.weight', which is "
                                   r"not offloaded, is \(4, 16\) torch.float32, requires_grad=True on rank 0 but "
                                   r"\(4, 16\) torch.float32, requires_grad=False on rank 1",
    "ddp_around_a_wrapped_model": r"RuntimeError: offtensor: DistributedDataParallel was given a model with "
                                  r"offloaded parameters .*offtensor.data_parallel\(model\)",
}


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


def test_one_rank_group_trains_like_the_plain_model(one_rank_group):
    scenario = SCENARIOS["offloaded_and_resident_blocks"]
    reference = _reference(scenario, "cpu")
    model = _build(scenario, seed=0)
    _wrap(model, scenario, "cpu")
    offtensor.data_parallel(model, timeout=5)
    xs, ys = _data()

    _train(model, scenario, xs, ys, data_parallel=True)

    # a world of one divides by one and sums one tensor: bit-identical
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(host(p), host(q), rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
