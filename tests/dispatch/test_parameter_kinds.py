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
import torch.nn.functional as F
import torch.nn.utils.prune
from conftest import (
    BlocksOf,
    BlockStack,
    ResidualBlock,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    mlp_of_blocks,
    mse_loss,
    offload,
    random_batch,
    reference_then_offload,
    step_both,
    tolerances,
    train_step,
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
    model = BlocksOf(KindsBlock, 2)
    reference = reference_then_offload(model, device)
    _train_both(model, reference, device)
    # state_dict round trips, both ways
    plain = BlocksOf(KindsBlock, 2).to(device)
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
        elif self.write == "inplace_functional":  # `inplace=True` of torch.nn.functional
            self.count.add_(1)
            with torch.no_grad():
                self.codebook.mul_(2.0)
                F.hardtanh(self.codebook, -1.0, 1.0, inplace=True)
        elif self.write == "aten_overload":  # named `add_.Tensor`, `copy_.default`
            torch.ops.aten.add_.Tensor(self.count, 1)
            with torch.no_grad():
                torch.ops.aten.copy_.default(self.codebook, self.codebook * 0.5 + x.mean(0))
        elif self.write == "out":
            torch.add(self.count, 1, out=self.count)
            with torch.no_grad():
                torch.mul(self.codebook, 2.0, out=self.codebook)
                torch.clamp(self.codebook, -1.0, 1.0, out=self.codebook)
        return torch.tanh(h * self.count + self.codebook)


# Writes that compute on the master, a CPU tensor, with the block's device activations: on CUDA
# they raise PyTorch's device-mismatch error (seen on the H200), where the unwrapped model's
# parameter is on the device. `p.copy_(expr)` and `p[i] = v` copy across devices and work, and
# so do the in-place writes of "inplace_functional" and "out", which use no activation.
_WRITES_ON_THE_MASTER = ("in_place", "detached", "data", "data_assign")


@pytest.mark.parametrize("write", ["in_place", "copy_", "setitem", "detached", "data", "data_assign",
                                   "inplace_functional", "aten_overload", "out"])
@pytest.mark.parametrize("device", devices)
def test_frozen_parameters_written_during_their_scopes_forward_are_read_back_like_unwrapped(device, write):
    """The writes reach the masters and, for the rest of that forward, the scope's device copy:
    an in-place write went to the master while later reads in the same forward got the copy
    loaded before it, and `p[i] = v`, `F.hardtanh(p, inplace=True)`, `torch.add(p, 1, out=p)`
    and `torch.ops.aten.add_.Tensor(p, 1)` wrote the device copy only (lost at the next load)."""
    model = BlocksOf(lambda: StatefulBlock(write), 2)
    reference = reference_then_offload(model, device)
    if device == "cuda" and write in _WRITES_ON_THE_MASTER:
        with pytest.raises(RuntimeError, match="same device"):
            model(torch.randn(3, HIDDEN, device=device))
        return
    _train_both(model, reference, device)
    assert model.blocks[0].count.item() == 3


def test_torch_save_of_a_wrapped_model_with_a_zero_size_parameter_among_other_dtypes(tmp_path):
    """A zero-size master's storage sat at its scope's first address, where the first master
    (complex64 here) lives: torch.save took them for one storage seen as two dtypes, and
    refused. Copies are plain models equal to the unwrapped one."""
    model = BlocksOf(KindsBlock, 2)
    reference = reference_then_offload(model, "cpu")
    torch.save(model, tmp_path / "model.pt")
    x = torch.randn(3, HIDDEN)
    for copied in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)):
        assert not offtensor.is_wrapped(copied)
        torch.testing.assert_close(copied(x), reference(x), rtol=0, atol=0)
        assert_params_match(copied, reference, rtol=0, atol=0)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    plain = BlocksOf(KindsBlock, 2)
    plain.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert_params_match(plain, reference, rtol=0, atol=0)


@pytest.mark.parametrize("cast", ["device", "host"])
def test_compute_dtype_casts_only_the_floating_masters_of_a_mixed_scope(cast):
    """Policy(compute_dtype=bfloat16): float64, float32 and float16 masters compute in bfloat16,
    complex, integer and bool ones as they are; gradients come back in each master's dtype, also
    after the masters are written (the cast="host" copy is cast again)."""
    model = BlocksOf(KindsBlock, 2)
    reference = copy.deepcopy(model)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(compute_dtype=torch.bfloat16, cast=cast))
    for _ in range(2):
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.data = p.detach().to(torch.bfloat16 if p.is_floating_point() else p.dtype).clone()
        x = torch.randn(3, HIDDEN)
        out, expected = model(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, name
                continue
            assert p.grad.dtype == p.dtype, name
            torch.testing.assert_close(p.grad, q.grad.to(p.dtype), rtol=0, atol=0, msg=name)
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
        model.zero_grad()
        reference.zero_grad()
    assert_all_scopes_offloaded(model)


def _prune(m: nn.Module) -> None:
    torch.nn.utils.prune.l1_unstructured(m.blocks[1].fc1, "weight", amount=0.5)


def _weight_norm(m: nn.Module) -> None:
    torch.nn.utils.weight_norm(m.blocks[1].fc1)


def _spectral_norm(m: nn.Module) -> None:
    torch.manual_seed(1)  # its power iteration's start
    torch.nn.utils.spectral_norm(m.blocks[1].fc1)


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
@pytest.mark.parametrize("apply", [_prune, _weight_norm, _spectral_norm], ids=["prune", "weight_norm", "spectral_norm"])
def test_hook_based_reparametrizations_train_and_copy_like_unwrapped(apply, when):
    """prune, weight_norm and spectral_norm replace `weight` by `weight_orig` (or `_g`, `_v`) and
    a forward pre-hook that recomputes it: before wrap the hook runs before the scope loads
    (its ops get temporary copies), after wrap it registers offloaded or new plain parameters."""
    torch.manual_seed(0)
    model = mlp_of_blocks()
    torch.manual_seed(0)
    reference = mlp_of_blocks()
    if when == "before_wrap":
        apply(model)
        apply(reference)
    offload(model, "cpu")
    if when == "after_wrap":
        apply(model)
        apply(reference)
    tol = {"rtol": 1e-6, "atol": 1e-6}
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
    for _ in range(3):
        batch = random_batch("cpu")
        loss, expected = mse_loss(model, batch), mse_loss(reference, batch)
        torch.testing.assert_close(loss, expected, **tol)
        loss.backward()
        expected.backward()
        step_both(model, reference, opt, ref_opt, tol)
    assert_params_match(model, reference, **tol)
    model.eval()
    reference.eval()
    with torch.no_grad():
        x = random_batch("cpu")[0]
        torch.testing.assert_close(model(x), reference(x), **tol)
        # After a no-grad forward: the recomputed `weight` is a leaf again, which deepcopy needs.
        torch.testing.assert_close(copy.deepcopy(model)(x), reference(x), **tol)
    assert_all_scopes_offloaded(model)


class LayoutBlock(nn.Module):
    """A transposed (non-contiguous) weight, a strided slice, an expanded frozen tensor, a
    channels_last conv weight and 300 one-element parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.transposed = nn.Parameter(torch.randn(HIDDEN, 8).t())
        self.sliced = nn.Parameter(torch.randn(2 * 8, HIDDEN)[::2])
        self.expanded = nn.Parameter(torch.randn(HIDDEN, 1).expand(HIDDEN, HIDDEN), requires_grad=False)
        self.conv = nn.Conv2d(1, 2, 3, padding=1).to(memory_format=torch.channels_last)
        self.tiny = nn.ParameterList([nn.Parameter(torch.randn(1)) for _ in range(300)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.transposed.t() + F.linear(x, self.sliced)
        h = torch.cat([h, h], -1) @ self.expanded / HIDDEN
        image = self.conv(h.reshape(-1, 1, 4, 4)).mean(1).reshape(h.shape)
        return torch.tanh(h + image + torch.stack(list(self.tiny)).sum())


def test_strided_expanded_channels_last_and_many_tiny_parameters_train_like_unwrapped():
    """Masters are contiguous whatever the parameter's strides (kernels may then sum in another
    order: a few ulps)."""
    model = BlocksOf(LayoutBlock, 2)
    reference = reference_then_offload(model, "cpu")
    _train_both(model, reference, "cpu", tol={"rtol": 1e-5, "atol": 1e-6})


class MaxNormBlock(nn.Module):
    """An Embedding and an EmbeddingBag with `max_norm`: their forward renormalizes the rows it
    looks up in place, under no_grad, before reading them."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, HIDDEN, max_norm=1.0, sparse=sparse)
        self.bag = nn.EmbeddingBag(20, HIDDEN, max_norm=0.5, norm_type=1.0, mode="sum", sparse=sparse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices = (x.abs() * 7).long() % 20
        return torch.tanh(x + self.embedding(indices).sum(1) + self.bag(indices))


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_embeddings_with_max_norm_renormalize_the_masters_like_unwrapped(sparse, overlapped):
    """The renormalization wrote only the scope's device copy: the output of each forward
    matched, but the masters kept their old norms, and the steps that followed diverged."""
    model = BlocksOf(lambda: MaxNormBlock(sparse), 2)
    reference = reference_then_offload(model, "cpu")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
    for _ in range(3):
        x = torch.randn(3, HIDDEN)
        expected, out = reference(x), model(x)
        torch.testing.assert_close(out, expected)
        expected.square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        train_step(out.square().sum(), opt, overlap=overlapped)
    offtensor.wait_for_steps()
    assert_params_match(model, reference)
    assert_all_scopes_offloaded(model)


class AliasedBlock(nn.Module):
    """Parameters or buffers whose memory overlaps: `alias` says which."""

    def __init__(self, alias: str) -> None:
        super().__init__()
        base = torch.randn(HIDDEN, 2 * HIDDEN)
        self.whole = nn.Parameter(base)
        if alias == "view_of_parameter":
            self.left = nn.Parameter(base[:, :HIDDEN])
        elif alias == "strided_view":
            self.left = nn.Parameter(base[:, 2::2])
        elif alias == "buffer":
            self.register_buffer("left", base[:, :HIDDEN])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.whole[:, :HIDDEN] + x @ self.left[:, :HIDDEN // 2].repeat(1, 2))


@pytest.mark.parametrize("alias", ["view_of_parameter", "strided_view", "buffer"])
def test_error_if_offloaded_parameters_share_memory_with_another_tensor_of_the_model(alias):
    """Each master is a tensor of its own: wrap split the shared memory silently, and the
    optimizer's updates of one no longer reached the other (the plain model's do)."""
    model = BlocksOf(lambda: AliasedBlock(alias), 2)
    with pytest.raises(ValueError, match=r"'blocks\.0\.whole' and 'blocks\.0\.left' share memory.*clone\(\)"):
        offtensor.wrap(model, device="cpu")
    assert not offtensor.is_wrapped(model)
    assert not any(isinstance(p, offtensor.OffloadedParameter) for p in model.parameters())


class SlicedBlock(nn.Module):
    """Two linears whose weights are interleaved rows of one tensor: their byte ranges overlap,
    their elements do not, so separate masters train as the plain model does."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(2 * HIDDEN, HIDDEN)
        self.a, self.b = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.a.weight, self.b.weight = nn.Parameter(base[0::2]), nn.Parameter(base[1::2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x))))


def test_weights_slicing_one_tensor_without_overlap_train_like_unwrapped():
    torch.manual_seed(0)
    model = BlocksOf(SlicedBlock, 2)
    torch.manual_seed(0)
    reference = BlocksOf(SlicedBlock, 2)  # not a deep copy, which would keep no sharing to test
    offtensor.wrap(model, device="cpu")
    _train_both(model, reference, "cpu")
