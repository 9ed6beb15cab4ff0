"""A frozen format is one module plus its registration (Note [frozen formats] in offtensor/formats.py).

This file is such a module: `BFloat16RoundTrip` keeps each compressed master as bfloat16 and
restores it by a cast, and the `registered` fixture registers it for one test and unregisters it
after. Nothing in the package knows it, yet `Policy(frozen_format="bf16-round-trip")` runs it
through wrap, the loads (whole, progressive, in chunks), routed experts' rows, reads and writes
through the parameters, and training of the parameters left uncompressed; the reference is the
plain model with those matrices rounded to bfloat16, which the offloaded one matches exactly.
The registry's own rules (a duplicate name, an unknown one) are at the end.
"""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
from conftest import BlockStack, ResidualBlock, devices, host, tolerances
from torch import nn

import offtensor
from offtensor.engine.engine import find_engine
from offtensor.formats import (
    frozen_format,
    frozen_format_names,
    register_frozen_format,
    unregister_frozen_format,
)
from offtensor.scopes import loading as loading_module
from offtensor.storage.compress import MIN_NUMEL

NAME = "bf16-round-trip"
HIDDEN = 64  # fc1 and fc2 are 64 x 128: above MIN_NUMEL, compressed


class BFloat16RoundTrip:
    """A frozen format: a master kept as bfloat16 (2 bytes an element), restored by a cast."""

    name = NAME

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()  # which methods the core called

    def nbytes(self, shape, dtype):
        return math.prod(shape) * torch.bfloat16.itemsize

    def _values(self, host_bytes, shape):
        return host_bytes[: self.nbytes(shape, None)].view(torch.bfloat16).view(shape)

    def pack(self, host_bytes, value, dtype, shape, name):
        self.calls["pack"] += 1
        out = self._values(host_bytes, shape)
        if isinstance(value, torch.Tensor):
            out.copy_(value.detach())
        else:  # a RowReader
            out.copy_(value(0, shape[0]))

    def unpack(self, host_bytes, dtype, shape):
        self.calls["unpack"] += 1
        return self._values(host_bytes, shape).to(dtype)

    def unpack_into(self, out, host_bytes, dtype):
        self.calls["unpack_into"] += 1
        out.copy_(self._values(host_bytes, out.shape).to(dtype))

    def rows(self, host_bytes, dtype, shape, run):
        self.calls["rows"] += 1
        return (self._values(host_bytes, shape)[run],)

    def unpack_rows_into(self, out, rows):
        self.calls["unpack_rows_into"] += 1
        out.copy_(rows[0].view(out.shape))

    def fuse(self, chunks, device):
        self.calls["fuse"] += 1
        return None  # each master restored by its own unpack_into


@pytest.fixture
def registered():
    fmt = BFloat16RoundTrip()
    register_frozen_format(fmt)
    try:
        yield fmt
    finally:
        unregister_frozen_format(NAME)


def _model(n_blocks: int = 3) -> BlockStack:
    torch.manual_seed(0)
    return BlockStack([ResidualBlock(HIDDEN) for _ in range(n_blocks)], 8, HIDDEN, 4)


def _rounded(model: nn.Module, device: str) -> nn.Module:
    """A plain copy of `model` whose frozen block matrices hold bfloat16's values."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.startswith("blocks.") and p.dim() >= 2 and not p.requires_grad and p.numel() >= MIN_NUMEL:
                p.copy_(p.to(torch.bfloat16))
    return reference.to(device)


def _packed(model: nn.Module) -> list:
    return [s for scope in find_engine(model).scopes for s in scope.slots if s.packed is not None]


@pytest.mark.parametrize("chunk_bytes", [4096, 32 * 2**20], ids=["small-chunks", "one-chunk"])
@pytest.mark.parametrize("device", devices)
def test_a_format_registered_by_a_test_runs_inference_like_the_rounded_model(device, chunk_bytes, registered,
                                                                          monkeypatch):
    monkeypatch.setattr(loading_module, "CHUNK_BYTES", chunk_bytes)
    model = _model().requires_grad_(False).eval()
    reference = _rounded(model, device)
    offtensor.wrap(model, device=device, policy=offtensor.Policy(frozen_format=NAME))
    model.to(device)
    packed = _packed(model)
    assert len(packed) == 6 and all(s.packed.format is registered for s in packed)  # fc1, fc2 of each block
    assert all(s.packed.nbytes == s.param.numel() * 2 for s in packed)  # bfloat16 bytes, not float32's
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):  # a whole first load, then progressive ones along the learned order
            x = torch.randn(5, 8, generator=gen).to(device)
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert all(scope.load_plan is not None and scope.load_plan.fused is None for scope in find_engine(model).scopes)
    assert registered.calls["pack"] == 6 and registered.calls["fuse"] == 3  # one plan per scope
    loads = sum(scope.loads for scope in find_engine(model).scopes)
    assert loads >= 9 and registered.calls["unpack_into"] == 2 * loads  # each matrix at each load
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(host(p), host(r), rtol=0, atol=0, msg=name)  # what `p` reports


@pytest.mark.parametrize("device", devices)
def test_a_format_registered_by_a_test_trains_the_rest_like_the_rounded_model(device, registered):
    """The matrices are frozen, so compressed; norms and biases train, as in a LoRA-style setup."""
    model = _model()
    for name, p in model.named_parameters():
        p.requires_grad_(not (name.startswith("blocks.") and name.endswith("weight") and p.dim() == 2))
    reference = _rounded(model, device)
    offtensor.wrap(model, device=device, policy=offtensor.Policy(frozen_format=NAME))
    model.to(device)
    assert len(_packed(model)) == 6
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen).to(device), torch.randn(4, 4, generator=gen).to(device)
        for m, o in ((reference, ref_opt), (model, opt)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(host(p), host(r), msg=name, **tolerances(device))


def test_a_write_through_the_parameter_compresses_again(registered):
    model = _model().requires_grad_(False)
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(frozen_format=NAME))
    w = model.blocks[0].fc1.weight
    value = torch.randn(w.shape)
    with torch.no_grad():
        w.copy_(value)
    assert torch.equal(host(w), value.to(torch.bfloat16).float())
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(model.blocks[0].fc1(x), x @ value.to(torch.bfloat16).float().T
                                   + model.blocks[0].fc1.bias, rtol=0, atol=0)


class _Experts(nn.Module):
    """Eight experts stacked in one weight (8 x 64 x 64: compressed), each row of a batch sent to
    the expert `route` names: `w[e]` per expert, as transformers' eager experts index them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, HIDDEN, HIDDEN) / 8)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        return torch.stack([self.w[e] @ x[i] for i, e in enumerate(route)])


class _MoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        return x + self.experts(x, route)


def test_routed_experts_of_a_registered_format_copy_their_rows_alone(registered):
    """Note [routed experts]: after the first load, an op copies only the experts it reads, and the
    format restores those rows on their own (`rows`, `unpack_rows_into`)."""
    torch.manual_seed(3)
    model = nn.ModuleList([_MoeBlock() for _ in range(2)]).requires_grad_(False)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    offtensor.wrap(model, device="cpu", policy=offtensor.Policy(frozen_format=NAME))
    assert len(_packed(model)) == 2 and all(s.experts is not None for s in _packed(model))
    gen = torch.Generator().manual_seed(4)
    for route in ([0, 3], [5, 5, 1], [7], [2, 6]):
        got = expected = torch.randn(len(route), HIDDEN, generator=gen)
        with torch.no_grad():
            for block, ref in zip(model, reference, strict=True):
                got, expected = block(got, route), ref(expected, route)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert sum(s.traffic.expert_misses for s in find_engine(model).scopes) > 0
    assert registered.calls["rows"] > 0 and registered.calls["unpack_rows_into"] == registered.calls["rows"]


def test_a_duplicate_name_raises_and_keeps_the_first(registered):
    with pytest.raises(ValueError, match=r"a frozen format named 'bf16-round-trip' is registered already "
                                         r"\(BFloat16RoundTrip\)"):
        register_frozen_format(BFloat16RoundTrip())
    with pytest.raises(ValueError, match="a frozen format named 'fp8' is registered already"):
        register_frozen_format(type("Other", (BFloat16RoundTrip,), {"name": "fp8"})())
    assert frozen_format(NAME) is registered and frozen_format_names()[:2] == ("fp8", "int8")


def test_an_unknown_or_unregistered_name_is_refused_listing_the_registered_ones():
    assert NAME not in frozen_format_names()
    with pytest.raises(ValueError, match=r"frozen_format must be 'fp8', 'int8' or None, got 'bf16-round-trip' "
                                         r"\(the formats registered in offtensor.formats\)"):
        offtensor.Policy(frozen_format=NAME)
    with pytest.raises(ValueError, match=r"no frozen format is registered as 'bf16-round-trip'; the registered "
                                         r"ones are 'fp8', 'int8'"):
        frozen_format(NAME)
    with pytest.raises(ValueError, match="no frozen format is registered as 'bf16-round-trip'"):
        unregister_frozen_format(NAME)


def test_a_model_wrapped_with_a_format_keeps_it_once_unregistered():
    fmt = BFloat16RoundTrip()
    register_frozen_format(fmt)
    model = _model().requires_grad_(False).eval()
    reference = _rounded(model, "cpu")
    try:
        offtensor.wrap(model, device="cpu", policy=offtensor.Policy(frozen_format=NAME))
    finally:
        unregister_frozen_format(NAME)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    offtensor.unwrap(model)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, r), name
