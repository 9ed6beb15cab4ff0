"""Data-parallel wrappers offtensor does not support are refused, with what to do instead.

DistributedDataParallel never sees the gradients of offloaded parameters (offtensor writes the
host `p.grad` itself), and FSDP2's `fully_shard` replaces the parameters offtensor offloads
(Note [data-parallel wrappers] in dispatch/wrapper_guards.py). Each combination raises, pointing
to `offtensor.data_parallel` (tests/test_data_parallel.py); averaging `p.grad` across ranks by
hand also works, and is checked against a single process training on the whole batch.
Everything runs on the CPU with gloo: a one-process group for the errors, two spawned processes
for averaging by hand. Every process group is destroyed and every wait has a timeout, so a
failing test cannot hang the suite.
"""

from __future__ import annotations

import datetime
import inspect
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import mlp_of_blocks, only_blocks, unwrapped_reference
from torch import nn

import offtensor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TIMEOUT = datetime.timedelta(seconds=60)
DDP = nn.parallel.DistributedDataParallel
# DDP(init_sync=False) skips the constructor's broadcast, where offtensor's first check runs.
needs_init_sync = pytest.mark.skipif("init_sync" not in inspect.signature(DDP.__init__).parameters,
                                     reason="DistributedDataParallel(init_sync=) is new in torch 2.7")


def _init(init_file: Path, rank: int = 0, world_size: int = 1) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"file://{init_file}", timeout=TIMEOUT)


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group, destroyed even when the test fails."""
    _init(tmp_path / "pg")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fully_shard():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch.distributed.fsdp.fully_shard needs torch >= 2.6")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    return lambda module: fsdp.fully_shard(module, mesh=mesh)


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


# ---- DistributedDataParallel ----------------------------------------------------------------


def test_error_if_ddp_wraps_a_wrapped_model(process_group):
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")

    with pytest.raises(RuntimeError, match="DistributedDataParallel was given a model with offloaded") as e:
        DDP(model)

    msg = str(e.value)
    assert "offtensor does not support torch.nn.parallel.DistributedDataParallel" in msg
    assert "'blocks.0." in msg, "names an offloaded parameter"
    assert "offtensor.data_parallel(model)" in msg, "points to offtensor's own data-parallel mode"


def test_error_if_ddp_wraps_a_parent_of_a_wrapped_submodule(process_group):
    model = mlp_of_blocks()
    offtensor.wrap(model.blocks[1], lambda name, m: name == "fc1", device="cpu")

    with pytest.raises(RuntimeError, match=r"DistributedDataParallel was given .*'fc1\.weight'"):
        DDP(model)


@pytest.mark.parametrize("options", [{}, {"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["plain", "find_unused_parameters", "static_graph"])
@needs_init_sync
def test_error_at_first_forward_if_ddp_skipped_its_init_sync(process_group, options):
    # Without init_sync, DDP's constructor never reads the parameters: the forward notices it.
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")
    ddp = DDP(model, init_sync=False, **options)
    x, _ = _batch()

    with pytest.raises(RuntimeError,
                       match="the model given to offtensor.wrap is run by a DistributedDataParallel") as e:
        ddp(x)

    assert f"find_unused_parameters={options.get('find_unused_parameters', False)}" in str(e.value)
    assert "offtensor.data_parallel(model)" in str(e.value)
    # the failed forward left every scope offloaded
    assert all(row.state is offtensor.ScopeState.OFFLOADED for row in offtensor.summary(model).scopes)


@needs_init_sync
def test_error_at_first_forward_if_ddp_runs_a_wrapped_module_list(process_group):
    # A wrapped ModuleList has no forward, so no model hook: the scope's own call checks.
    model = mlp_of_blocks()
    offtensor.wrap(model.blocks, device="cpu")
    ddp = DDP(model, init_sync=False)

    with pytest.raises(RuntimeError, match="scope '0' is run by a DistributedDataParallel"):
        ddp(_batch()[0])


def test_error_if_wrap_is_given_a_ddp_model(process_group):
    ddp = DDP(mlp_of_blocks())

    with pytest.raises(TypeError, match="the model is a DistributedDataParallel") as e:
        offtensor.wrap(ddp, device="cpu")

    assert "ddp.module" in str(e.value)
    assert not offtensor.is_wrapped(ddp)
    assert all(type(p) is nn.Parameter for p in ddp.parameters()), "a refused wrap changes nothing"


# ---- FSDP2 (fully_shard) --------------------------------------------------------------------


@pytest.mark.parametrize("target", ["model", "blocks.1"])
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7),
                    reason="FSDP2's forward on the CPU needs torch 2.7 (2.6 calls Stream.record_event, "
                           "which CPU streams lack, before offtensor's check can run)")
def test_error_at_first_forward_if_fully_shard_follows_wrap(process_group, target):
    fully_shard = _fully_shard()
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")
    fully_shard(model.get_submodule(target) if target != "model" else model)

    with pytest.raises(RuntimeError, match=r"offloaded parameter 'blocks\.\d\.\S+' of scope 'blocks\.\d' "
                                           r"is no longer registered") as e:
        model(_batch()[0])

    msg = str(e.value)
    assert "torch.distributed.fsdp.fully_shard does when applied after offtensor.wrap" in msg
    assert "CPUOffloadPolicy" in msg, "says what to do instead"


@pytest.mark.parametrize("target", ["model", "blocks.1"])
def test_error_if_wrap_follows_fully_shard(process_group, target):
    fully_shard = _fully_shard()
    model = mlp_of_blocks()
    fully_shard(model.get_submodule(target) if target != "model" else model)
    where = "the model" if target == "model" else f"module {target!r}"

    with pytest.raises(TypeError, match=f"offtensor.wrap: {where} is sharded by fully_shard") as e:
        offtensor.wrap(model, device="cpu")

    assert "CPUOffloadPolicy" in str(e.value)
    assert not offtensor.is_wrapped(model)


def test_error_if_wrap_is_given_dtensor_parameters(process_group):
    _fully_shard()  # skips without DTensor support
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = mlp_of_blocks()
    mesh = init_device_mesh("cpu", (1,))
    replicated = distribute_tensor(model.blocks[2].fc1.weight.detach(), mesh, [Replicate()])
    model.blocks[2].fc1.weight = nn.Parameter(replicated)

    with pytest.raises(TypeError, match=r"parameter 'blocks\.2\.fc1\.weight' is a DTensor"):
        offtensor.wrap(model, device="cpu")


# ---- no false positives ---------------------------------------------------------------------


def test_wrapped_model_trains_under_a_process_group_without_ddp(process_group):
    model = mlp_of_blocks()
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, only_blocks(0, 2), device="cpu")
    x, y = _batch()
    for m in (reference, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(2):
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()

    torch.testing.assert_close(dict(model.state_dict()), dict(reference.state_dict()))  # detach is fine outside DDP
    for p in model.parameters():  # and so is a broadcast of the masters (rank 0's weights)
        dist.broadcast(p.detach(), src=0)


# ---- averaging by hand, on two ranks ---------------------------------------------------------

WORLD = 2


def _train_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        nn.functional.mse_loss(model(x), y).backward()
        if world_size > 1:  # by hand, as offtensor.data_parallel does for you
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
        opt.step()
        opt.zero_grad()


def _rank(rank: int, init_file: str, out: str) -> None:
    _init(Path(init_file), rank, WORLD)
    try:
        torch.manual_seed(0)
        model = offtensor.wrap(mlp_of_blocks(), device="cpu")
        try:  # DDP is refused on every rank alike: no rank is left waiting in a collective
            DDP(model)
            raise AssertionError("DDP accepted a wrapped model")
        except RuntimeError as e:
            assert "offtensor does not support" in str(e), e
        x, y = _batch()
        _train_steps(model, x.chunk(WORLD)[rank], y.chunk(WORLD)[rank], WORLD)
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.full_tier  # two spawned interpreters: ~7 s of CPU (conftest)
def test_manual_all_reduce_on_two_ranks_matches_one_process_on_the_whole_batch(tmp_path):
    mp = pytest.importorskip("torch.multiprocessing")
    out = str(tmp_path / "params")
    context = mp.start_processes(_rank, args=(str(tmp_path / "pg"), out), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail("the two ranks did not finish within 120 s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    torch.manual_seed(0)
    reference = mlp_of_blocks()
    x, y = _batch()
    _train_steps(reference, x, y, world_size=1)

    expected = dict(reference.named_parameters())
    for rank in range(WORLD):
        got = torch.load(f"{out}.{rank}")
        torch.testing.assert_close(got, {n: p.detach() for n, p in expected.items()})


def test_the_guards_see_a_process_group_exactly_while_it_exists(tmp_path):
    # Asked at each call of a scope from what torch.distributed.is_initialized() reads.
    from offtensor.dispatch import wrapper_guards

    assert not dist.is_initialized() and not wrapper_guards.active()
    _init(tmp_path / "init")
    try:
        assert wrapper_guards.active()
    finally:
        dist.destroy_process_group()
    assert not wrapper_guards.active()
