"""Unusual parameter tensors inside wrapped modules: complex, float64, float16 and bfloat16 in
one scope, integer and bool parameters, zero-size and 0-dim ones, many tiny ones, strided and
channels_last ones, frozen parameters written during their scope's forward, parameters changed
after wrap, and the hook-based utilities (prune, weight_norm, spectral_norm) that rebuild a
parameter each forward. Each is compared with the plain, unwrapped model: outputs, gradients,
optimizer steps, state_dict round trips, copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    mse_loss,
    random_batch,
    reference_then_offload,
    step_both,
    tolerances,
)
from torch import nn

import offtensor

HIDDEN = 16


class KindsBlock(nn.Module):
    """A spectral (FFT) filter with complex64 weights and complex128, float64, float16, bfloat16,
    int64 and bool parameters, an integer buffer, a 0-dim scale and a zero-size parameter, all
    in one scope."""

    def __init__(self) -> None:
        super().__init__()
        self.filter = nn.Parameter(torch.randn(HIDDEN // 2 + 1, dtype=torch.complex64))
        self.mix = nn.Parameter(torch.randn(4, 4, dtype=torch.complex128))
        self.shift = nn.Parameter(torch.randn(HIDDEN, dtype=torch.float64))
        self.fp16 = nn.Parameter(torch.randn(HIDDEN, dtype=torch.float16))
        self.bf16 = nn.Parameter(torch.randn(HIDDEN, dtype=torch.bfloat16))
        self.index = nn.Parameter(torch.randperm(HIDDEN), requires_grad=False)
        self.mask = nn.Parameter(torch.rand(HIDDEN) > 0.3, requires_grad=False)
        self.register_buffer("offsets", torch.arange(HIDDEN))
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.empty = nn.Parameter(torch.randn(0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.fft.irfft(torch.fft.rfft(x) * self.filter, n=x.shape[-1])
        mixed = (self.mix @ self.mix.conj().T).real.sum().float()
        y = y[:, self.index] * self.mask + y * self.scale
        y = y + self.shift.float() + self.fp16.float() + self.bf16.float() + 0.01 * mixed
        return torch.tanh(y + 0.1 * self.offsets.float() + self.empty.sum())


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], n_blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(n_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _train_both(model: nn.Module, reference: nn.Module, device: str, steps: int = 3,
                tol: dict[str, float] | None = None) -> None:
    """Adam steps on both: outputs, gradients and parameters match at every step."""
    tol = tol if tol is not None else tolerances(device)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        x = torch.randn(3, HIDDEN, device=device)
        expected = reference(x)
        out = model(x)
        torch.testing.assert_close(out, expected, **tol)
        expected.square().sum().backward()
        out.square().sum().backward()
        step_both(model, reference, opt, ref_opt, tol)
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_complex_float64_half_integer_bool_and_zero_size_parameters_train_like_unwrapped(device):
    model = Stack(KindsBlock)
    reference = reference_then_offload(model, device)
    _train_both(model, reference, device)
    # state_dict round trips, both ways
    plain = Stack(KindsBlock).to(device)
    plain.load_state_dict(model.state_dict())
    assert_params_match(plain, reference, **tolerances(device))
    model.load_state_dict(copy.deepcopy(reference).state_dict())
    assert_params_match(model, reference, **tolerances(device))


class WithEmpty(ResidualBlock):
    def __init__(self) -> None:
        super().__init__(HIDDEN)
        self.nothing = nn.Parameter(torch.randn(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.nothing.sum()


def test_a_zero_size_parameter_gets_an_empty_gradient_like_unwrapped():
    """Its host gradient buffer holds one byte (host memory is never allocated empty): viewing
    all of it as float32 raised in backward."""
    model = BlockStack([WithEmpty() for _ in range(2)], 8, HIDDEN, 4)
    reference = reference_then_offload(model, "cpu")
    batch = random_batch("cpu")
    mse_loss(reference, batch).backward()
    mse_loss(model, batch).backward()
    assert_grads_match(model, reference, **tolerances("cpu"))
    assert model.blocks[1].nothing.grad.shape == (0, 4)


class StatefulBlock(nn.Module):
    """Frozen parameters used as state, written during the block's own forward before it reads
    them (a step counter, an EMA codebook), in one of several ways."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.write = write
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.count = nn.Parameter(torch.zeros((), dtype=torch.int64), requires_grad=False)
        self.codebook = nn.Parameter(torch.randn(HIDDEN), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # the scope's copy is on the device before the writes
        if self.write == "in_place":
            self.count.add_(1)
            with torch.no_grad():
                self.codebook.mul_(0.5).add_(x.mean(0))
        elif self.write == "copy_":
            with torch.no_grad():
                self.count.copy_(self.count + 1)
                self.codebook.copy_(self.codebook * 0.5 + x.mean(0))
        elif self.write == "setitem":
            self.count[...] = self.count + 1
            with torch.no_grad():
                self.codebook[: HIDDEN // 2] = self.codebook[HIDDEN // 2 :] * 0.5
        elif self.write == "detached":
            self.count.detach().add_(1)
            self.codebook.detach().mul_(0.5).add_(x.mean(0))
        elif self.write == "data":
            self.count.data.add_(1)
            self.codebook.data.mul_(0.5).add_(x.mean(0))
        elif self.write == "data_assign":
            self.count.data = self.count.data + 1
            self.codebook.data = self.codebook.data * 0.5 + x.mean(0)
        return torch.tanh(h * self.count + self.codebook)


@pytest.mark.parametrize("write", ["in_place", "copy_", "setitem", "detached", "data", "data_assign"])
@pytest.mark.parametrize("device", devices)
def test_frozen_parameters_written_during_their_scopes_forward_are_read_back_like_unwrapped(device, write):
    """The writes reach the masters and, for the rest of that forward, the scope's device copy:
    an in-place write went to the master while later reads in the same forward got the copy
    loaded before it, and `p[i] = v` wrote the device copy only (lost at the next load)."""
    model = Stack(lambda: StatefulBlock(write))
    reference = reference_then_offload(model, device)
    _train_both(model, reference, device)
    assert model.blocks[0].count.item() == 3


def test_torch_save_of_a_wrapped_model_with_a_zero_size_parameter_among_other_dtypes(tmp_path):
    """A zero-size master's storage sat at its scope's first address, where the first master
    (complex64 here) lives: torch.save took them for one storage seen as two dtypes, and
    refused. Copies are plain models equal to the unwrapped one."""
    model = Stack(KindsBlock)
    reference = reference_then_offload(model, "cpu")
    torch.save(model, tmp_path / "model.pt")
    x = torch.randn(3, HIDDEN)
    for copied in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)):
        assert not offtensor.is_wrapped(copied)
        torch.testing.assert_close(copied(x), reference(x), rtol=0, atol=0)
        assert_params_match(copied, reference, rtol=0, atol=0)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    plain = Stack(KindsBlock)
    plain.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert_params_match(plain, reference, rtol=0, atol=0)
