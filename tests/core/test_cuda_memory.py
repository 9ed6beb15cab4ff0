"""Offloading bounds device memory: only a few blocks' weights are on the GPU at any time.

The model has 8 blocks of 4 ``Linear(2048, 2048)`` in fp32 (about 64 MiB per block, 512 MiB
in all) between a resident input projection and head. Peaks are read with
``torch.cuda.max_memory_allocated`` and counted from the memory in use before the model is put
on the GPU, so they include the resident part.

The budgets say what should be on the device:

- the resident part (input projection and head; in training also their grads),
- at most 3 blocks of weights (the running scope, the one being prefetched, one being released),
- in training, at most 2 blocks of grads: a block's grads are produced on the device and copied
  to the host, and the previous block's copies may still be in flight,
- activations, which are small here (a batch of 128 rows: 1 MiB per hidden state).
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from conftest import (
    BlockStack,
    assert_all_scopes_offloaded,
    requires_cuda,
    unwrapped_reference,
)
from torch import nn

import offtensor

pytestmark = [pytest.mark.cuda, requires_cuda]

MiB = 2**20
HIDDEN = 2048
N_BLOCKS = 8
BATCH = 128
ACTIVATION = BATCH * HIDDEN * 4  # bytes of one fp32 hidden state
ACTIVATION_BUDGET = 64 * ACTIVATION  # generous: the un-checkpointed model saves ~60 of them


class BigBlock(nn.Module):
    """``x + mlp(x)`` with 4 ``Linear(2048, 2048)``: 64 MiB of fp32 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def big_model() -> BlockStack:
    return BlockStack([BigBlock() for _ in range(N_BLOCKS)], HIDDEN, HIDDEN, out_features=16)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


BLOCK_BYTES = nbytes(BigBlock().parameters())


def resident_bytes(model: BlockStack) -> int:
    return nbytes([*model.input.parameters(), *model.head.parameters()])


def settle() -> None:
    gc.collect()
    torch.cuda.synchronize()


@pytest.fixture
def empty_device() -> int:
    """Bytes allocated on the GPU before the test puts anything there.

    A block runs forward and backward once first, so that workspaces the CUDA libraries keep
    for the rest of the process (cuBLAS, cuBLASLt) are not counted against the offloaded model.
    """
    warmup = BigBlock().cuda()
    warmup(torch.randn(BATCH, HIDDEN, device="cuda", requires_grad=True)).sum().backward()
    del warmup
    settle()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def peak_since(empty: int, fn) -> int:
    """Peak bytes allocated while ``fn`` runs, counted from ``empty``."""
    settle()
    torch.cuda.reset_peak_memory_stats()
    fn()
    settle()
    return torch.cuda.max_memory_allocated() - empty


def peak_of_unwrapped(model: nn.Module, empty: int, step, x: torch.Tensor) -> int:
    """Peak of ``step`` (after one warm-up) on a plain copy of ``model``, freed afterwards."""
    reference = unwrapped_reference(model, "cuda")
    step(reference, x)
    peak = peak_since(empty, functools.partial(step, reference, x))
    del reference  # only the offloaded model may be on the device while it is measured
    settle()
    torch.cuda.empty_cache()
    return peak


def offloaded(model: BlockStack) -> BlockStack:
    offtensor.wrap(model, device="cuda")  # default predicate: the blocks
    return model.cuda()


def inference(model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(x)


def training_step(model: nn.Module, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None  # zero_grad(set_to_none=True): no old grads to accumulate into
    model(x).float().pow(2).mean().backward()


def test_inference_peak_is_resident_part_plus_three_blocks(empty_device):
    model = big_model()
    x = torch.randn(BATCH, HIDDEN, device="cuda")
    unwrapped_peak = peak_of_unwrapped(model, empty_device, inference, x)
    offloaded(model)

    inference(model, x)  # a first pass may set up what later passes reuse; that is counted too
    peak = peak_since(empty_device, lambda: inference(model, x))

    budget = resident_bytes(model) + 3 * BLOCK_BYTES + ACTIVATION_BUDGET
    assert peak <= budget, f"peak {peak / MiB:.0f} MiB > budget {budget / MiB:.0f} MiB"
    assert peak < unwrapped_peak / 2, (
        f"offloaded peak {peak / MiB:.0f} MiB vs unwrapped {unwrapped_peak / MiB:.0f} MiB"
    )
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_training_step_peak_is_resident_part_plus_three_blocks_of_weights_and_two_of_grads(
    empty_device, checkpoint
):
    model = big_model()
    model.checkpoint = checkpoint
    x = torch.randn(BATCH, HIDDEN, device="cuda")
    unwrapped_peak = peak_of_unwrapped(model, empty_device, training_step, x)
    offloaded(model)

    training_step(model, x)
    peak = peak_since(empty_device, lambda: training_step(model, x))

    weights_and_grads = 2 * resident_bytes(model) + (3 + 2) * BLOCK_BYTES
    budget = weights_and_grads + ACTIVATION_BUDGET
    assert peak <= budget, f"peak {peak / MiB:.0f} MiB > budget {budget / MiB:.0f} MiB"
    assert peak < unwrapped_peak / 2, (
        f"offloaded peak {peak / MiB:.0f} MiB vs unwrapped {unwrapped_peak / MiB:.0f} MiB"
    )
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_device_memory_returns_to_baseline_after_backward(empty_device, checkpoint):
    model = big_model()
    model.checkpoint = checkpoint
    offloaded(model)
    x = torch.randn(BATCH, HIDDEN, device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    in_use = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=False)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        settle()
        in_use.append(torch.cuda.memory_allocated() - empty_device)

    # Resident weights and their grads, plus the input; nothing of the blocks.
    resident = resident_bytes(model)
    assert in_use[-1] <= 2 * resident + x.numel() * x.element_size() + MiB, (
        f"{in_use[-1] / MiB:.1f} MiB in use after backward, resident part is {2 * resident / MiB:.1f} MiB"
    )
    assert in_use[0] == in_use[1] == in_use[2], f"device memory grows step after step: {in_use}"
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad", "no_grad"])
def test_exception_inside_block_releases_its_device_memory_and_model_stays_usable(
    empty_device, grad_enabled
):
    model, x, before, baseline = _run_once()

    def fail(module, inputs, output):
        raise RuntimeError("injected failure")

    handle = model.blocks[3].mlp[4].register_forward_hook(fail)
    with (
        torch.set_grad_enabled(grad_enabled),
        pytest.raises(RuntimeError, match="injected failure"),
    ):
        model(x)
    handle.remove()
    _nothing_left(model, baseline, x, before, "the failed forward")
    training_step(model, x)
    assert all(p.grad is not None for p in model.blocks.parameters())
    assert_all_scopes_offloaded(model)


def test_a_load_that_raises_after_its_copies_leaves_no_device_memory_and_the_model_usable(empty_device):
    """A load that fails between its allocation and LOADING, after its copies are enqueued (Note
    [scope states] in scopes/scope.py): its buffer is freed, after those copies, and the next
    forward matches the first."""
    model, x, before, baseline = _run_once()
    target = model._offtensor_engine.scopes[3]
    source = type(target.source)
    real = source.after_load

    def failing(self, scope, loading):
        if scope is target:
            raise RuntimeError("injected failure")
        real(self, scope, loading)

    source.after_load = failing
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="injected failure"):
            model(x)
    finally:
        source.after_load = real
    _nothing_left(model, baseline, x, before, "the failed load")


def _run_once() -> tuple[BlockStack, torch.Tensor, torch.Tensor, int]:
    """An offloaded model after one inference call, its input, its output and the device memory
    in use after it."""
    model = offloaded(big_model())
    x = torch.randn(BATCH, HIDDEN, device="cuda")
    with torch.no_grad():
        before = model(x)
    settle()
    return model, x, before, torch.cuda.memory_allocated()


def _nothing_left(model: nn.Module, baseline: int, x: torch.Tensor, before: torch.Tensor, what: str) -> None:
    """After `what` raised: the device holds what it held before, no scope a copy, and the model
    computes `before` again."""
    settle()
    assert torch.cuda.memory_allocated() == baseline, (
        f"{(torch.cuda.memory_allocated() - baseline) / MiB:.1f} MiB left on the device by {what}"
    )
    assert_all_scopes_offloaded(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_a_page_locking_that_failed_leaves_no_error_for_the_next_op():
    """A failed cudaHostRegister (here: the same range twice, error 712) is handled by offtensor
    (PinnedMemoryError, the fallback to pageable memory); the runtime's last error it leaves must
    not reach the next kernel launch, which PyTorch checks (Note [a failed runtime call's error]
    in storage/memory.py)."""
    import numpy as np

    from offtensor.storage.memory import PinnedMemoryError, register_pinned

    raw = np.empty(3 * 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    array = raw[start : start + 4096]
    register_pinned(array, owner=raw)
    with pytest.raises(PinnedMemoryError):
        register_pinned(array, owner=array)  # already registered
    x = torch.randn(64, device="cuda")
    torch.testing.assert_close((x * 2).cpu(), x.cpu() * 2)  # a launch after the failure: no stale error
    del array, raw
    gc.collect()
