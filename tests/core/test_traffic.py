"""Host-to-device bytes per scope since wrap (ScopeSummary.bytes_to_device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import mlp_of_blocks, offload, param_bytes

import offtensor


def test_bytes_to_device_are_the_scopes_bytes_times_its_loads():
    """Each load moves the scope's weights once (parameters of whole 256-byte multiples, so no
    padding crosses), whether the whole scope at once (the first) or progressively (the next)."""
    model = offload(mlp_of_blocks(n_blocks=3, hidden=64), "cpu")
    x = torch.randn(4, 8)
    for _ in range(3):
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model(x)
    summary = offtensor.summary(model)
    for s, block in zip(summary.scopes, model.blocks, strict=True):
        assert s.loads >= 4
        assert s.bytes_to_device == s.loads * param_bytes(block), s
    assert summary.bytes_to_device == sum(s.bytes_to_device for s in summary.scopes)
    assert "to device" in str(summary)


def test_bytes_to_device_count_old_gradients_and_temporary_copies():
    model = offload(mlp_of_blocks(n_blocks=2, hidden=64), "cpu")
    x = torch.randn(4, 8)
    model(x).sum().backward()  # no .grad to fetch yet
    first = offtensor.summary(model).scopes
    model(x).sum().backward()  # accumulates: each trainable .grad is fetched once
    second = offtensor.summary(model).scopes
    for s, before, block in zip(second, first, model.blocks, strict=True):
        loads = s.loads - before.loads
        assert s.bytes_to_device - before.bytes_to_device == (loads + 1) * param_bytes(block)
    weight = model.blocks[0].fc1.weight
    before = offtensor.summary(model).scopes[0].bytes_to_device
    F.linear(torch.randn(2, 64), weight).sum().backward()  # outside its scope: a temporary copy
    assert offtensor.summary(model).scopes[0].bytes_to_device - before == weight.numel() * 4
