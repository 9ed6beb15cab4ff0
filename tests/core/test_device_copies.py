"""Inside a forward or backward, every op on an offloaded parameter computes with a device copy.

Regressions: on CUDA, Falcon's `input @ self.weight.T` got the host master (tensor properties
bypassed materialisation), and Mamba's mixer, reading `self.conv1d.weight` of a child scope whose
forward never runs (split scopes), got the host master too. On the CPU both went unnoticed, since
master and copy live on the same device; these tests look at storages instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BlockStack,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    offload,
    param_bytes,
    reference_then_offload,
    tolerances,
)
from torch import nn

import offtensor


def _is_master(t: torch.Tensor, model: nn.Module) -> bool:
    ptr = t.untyped_storage().data_ptr()
    for p in model.parameters():
        if isinstance(p, offtensor.OffloadedParameter):
            with torch._C.DisableTorchFunctionSubclass():
                start = p.untyped_storage().data_ptr()
                if start <= ptr < start + p.untyped_storage().nbytes():
                    return True
    return False


class UsesProperties(nn.Module):
    """`x @ w.T` (Falcon), and the other tensor properties computed from a weight."""

    def __init__(self, prop: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)
        self.prop = prop
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = getattr(self.weight, self.prop)
        self.seen.append(w)
        return x @ w


class PropertyStack(nn.Module):
    def __init__(self, prop: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([UsesProperties(prop), UsesProperties(prop)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("prop", ["T", "mT", "H", "mH", "real"])
def test_tensor_properties_of_an_offloaded_parameter_are_device_copies(device, prop):
    model = PropertyStack(prop)
    reference = reference_then_offload(model, device)
    x = torch.randn(4, 8, device=device)
    out = model(x)
    for block in model.blocks:
        (w,) = block.seen
        assert w.device.type == device
        assert not _is_master(w, model), f"{prop} of {block} computed on the host master"
    out.sum().backward()
    reference(x).sum().backward()
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


class Conv(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, 3) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, padding=1, groups=x.shape[1])


class Mixer(nn.Module):
    """Mamba's pattern: the parent's forward uses its child's weight directly; the child's own
    forward never runs."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(channels, channels)
        self.conv1d = Conv(channels)
        self.out_proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x).transpose(1, 2)
        w = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        h = F.conv1d(h, w.unsqueeze(1), padding=1, groups=h.shape[1])
        return x + self.out_proj(torch.tanh(h.transpose(1, 2)))


class MixerStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Mixer(), Mixer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_a_parameter_read_by_another_scopes_forward_is_a_device_copy(device, grad):
    model = MixerStack()
    policy = offtensor.Policy(max_scope_bytes=param_bytes(model.layers[0]) // 2)  # conv1d: a scope
    reference = reference_then_offload(model, device, policy=policy)
    assert "layers.0.conv1d" in [s.name for s in offtensor.summary(model).scopes]
    seen = []
    real_view = torch.Tensor.view

    def spy(self, *shape):
        out = real_view(self, *shape)
        seen.append(out)
        return out

    x = torch.randn(2, 5, 8, device=device)
    with torch.set_grad_enabled(grad):
        torch.Tensor.view = spy  # type: ignore[method-assign]
        try:
            out = model(x)
        finally:
            torch.Tensor.view = real_view  # type: ignore[method-assign]
        ref_out = reference(x)
    assert seen and not any(_is_master(t, model) for t in seen)
    torch.testing.assert_close(out, ref_out, **tolerances(device))
    if grad:
        out.sum().backward()
        ref_out.sum().backward()
        assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_out = nn.ModuleList([nn.Linear(8, 8), nn.Dropout(0.0)])  # diffusers' Attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.to_out:
            x = m(x)
        return x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Inner(), Inner()])  # T5's block.N.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layer:
            x = x + m(x)
        return x


class NestedLists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleList([Block(), Block()])
        self.mid = nn.ModuleDict({"resnets": nn.ModuleList([nn.Linear(8, 8)])})  # not in a list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.block:
            x = b(x)
        return self.mid["resnets"][0](x)


@pytest.mark.parametrize("device", devices)
def test_default_predicate_selects_the_outermost_list_elements_only(device):
    """T5 and every diffusers model raised 'selected both ... and its submodule' before."""
    model = NestedLists()
    reference = reference_then_offload(model, device)
    assert [s.name for s in offtensor.summary(model).scopes] == ["block.0", "block.1", "mid.resnets.0"]
    x = torch.randn(3, 8, device=device)
    out = model(x)
    ref_out = reference(x)
    torch.testing.assert_close(out, ref_out, **tolerances(device))
    out.sum().backward()
    ref_out.sum().backward()
    assert_grads_match(model, reference, **tolerances(device))


class AddsItsBiasInPlace(nn.Module):
    """`h.add_(self.bias)`: an in-place op that only reads the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.bias = nn.Parameter(torch.randn(8) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.add_(self.bias)
        h.mul_(self.bias.sigmoid())
        return torch.tanh(h)


@pytest.mark.parametrize("device", devices)
def test_an_in_place_op_that_reads_a_parameter_gets_its_device_copy(device):
    """Regression: every offloaded argument of an in-place op was taken as written, so
    `h.add_(self.bias)` computed with the host master (a device mismatch on CUDA)."""
    from master_guard import MasterGuard

    model = PropertyStack("T")
    model.blocks = nn.ModuleList([AddsItsBiasInPlace(), AddsItsBiasInPlace()])
    reference = reference_then_offload(model, device)
    x = torch.randn(4, 8, device=device)
    with MasterGuard(model):
        out = model(x)
        out.sum().backward()
    ref_out = reference(x)
    ref_out.sum().backward()
    torch.testing.assert_close(out, ref_out, **tolerances(device))
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


class ReadsOtherScopes(nn.Module):
    """A block that also reads the previous block's weights (`F.linear`, `.T`) and a parameter
    of the model that holds it, neither of which it calls: weights of other scopes and of the
    unwrapped parent, used in its forward and in its checkpoint's recompute."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.__dict__["previous"] = None  # not submodules: their scopes stay their own
        self.__dict__["shared"] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) + self.__dict__["shared"][0]
        previous = self.__dict__["previous"]
        if previous is not None:
            y = y + F.linear(x, previous.fc.weight, previous.fc.bias) + previous.fc.weight.T[0]
        return x + torch.tanh(y)


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_a_block_reading_other_scopes_and_parent_weights_trains_like_unwrapped(checkpoint):
    """Parity: weights of another scope and of the parent read in a block's forward and in its
    recompute get device copies (never the master), and their gradients reach `p.grad`."""
    from master_guard import MasterGuard

    model = BlockStack([ReadsOtherScopes() for _ in range(3)], 8, 16, 4)
    model.checkpoint = checkpoint
    model.shared = nn.Parameter(torch.randn(2, 16))
    reference = copy.deepcopy(model)
    for m in (model, reference):
        for i, block in enumerate(m.blocks):
            block.__dict__["shared"] = m.shared
            block.__dict__["previous"] = m.blocks[i - 1] if i else None
    offload(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        x, y = torch.randn(4, 8, requires_grad=step == 1), torch.randn(4, 4)
        F.mse_loss(reference(x), y).backward()
        with MasterGuard(model):
            F.mse_loss(model(x), y).backward()
        assert_grads_match(model, reference, rtol=0, atol=0)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        assert_params_match(model, reference, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)
