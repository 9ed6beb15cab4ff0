"""`offtensor.summary()` adds up: its rows cover every parameter and buffer of the model (the
scopes, the parameters left out of them, the buffers), the total is the model's bytes, a kept
scope shows what it takes on the device also after an optimizer step freed its copy, and sizes
print in the unit they reach (B, KiB, MiB, GiB), never as 0.0 MiB."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import devices, mlp_of_blocks, offload, random_batch, requires_cuda

import offtensor
from offtensor.api import format_bytes


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _total_row(summary: offtensor.Summary) -> list[str]:
    return str(summary).splitlines()[-1].split()


def _batchnorm_mlp() -> torch.nn.Module:
    """mlp_of_blocks with a buffer outside the scopes (BatchNorm's running stats)."""
    model = mlp_of_blocks(n_blocks=3)
    model.norm = torch.nn.BatchNorm1d(16)
    return model


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("policy", [
    offtensor.Policy(),
    offtensor.Policy(param_filter=lambda name, p: "norm" not in name),  # some block parameters stay
], ids=["whole_blocks", "filtered"])
def test_totals_add_up_to_the_model_parameters_and_buffers(device, policy):
    model = _batchnorm_mlp()
    expected_bytes = _model_bytes(model)
    offload(model, device, policy=policy)
    summary = offtensor.summary(model)

    assert summary.model_bytes == expected_bytes
    offloaded = sum(s.num_params for s in summary.scopes)
    assert offloaded + summary.not_offloaded.numel == sum(p.numel() for p in model.parameters())
    assert summary.buffers.nbytes == sum(b.numel() * b.element_size() for b in model.buffers()) > 0
    # What is not offloaded was placed on the compute device by model.to(device).
    assert summary.not_offloaded.device_bytes == summary.not_offloaded.nbytes > 0
    assert summary.not_offloaded.host_bytes == 0
    total = _total_row(summary)
    assert total[0] == "total" and total[1] == f"{sum(p.numel() for p in model.parameters()):,}"
    assert " ".join(total[2:4]) == format_bytes(expected_bytes)
    assert "not offloaded" in str(summary) and "buffers" in str(summary)


@pytest.mark.cuda
@requires_cuda
def test_parameters_left_on_the_host_are_in_the_host_column():
    model = mlp_of_blocks(n_blocks=2)
    offtensor.wrap(model, device="cuda")  # no model.to("cuda"): the input and head stay on the CPU
    summary = offtensor.summary(model)
    assert summary.not_offloaded.host_bytes == summary.not_offloaded.nbytes > 0
    assert summary.not_offloaded.device_bytes == 0


@pytest.mark.parametrize("device", devices)
def test_kept_scope_shows_its_device_bytes_after_an_optimizer_step(device):
    model = mlp_of_blocks(n_blocks=3)
    offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget="1GiB"))  # every scope kept
    optimizer = torch.optim.AdamW(model.parameters())
    batch = random_batch(device)

    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    resident = offtensor.summary(model).scopes
    assert all(s.kept and s.residency is offtensor.Residency.KEPT for s in resident)
    assert all(s.device_bytes == s.loaded_bytes > 0 for s in resident)

    optimizer.step()  # changes the masters: the kept copies are stale and freed until the next forward
    stepped = offtensor.summary(model)
    for s, before in zip(stepped.scopes, resident, strict=True):
        assert s.kept and s.state is offtensor.ScopeState.OFFLOADED
        assert s.device_bytes == 0 and s.loaded_bytes == before.loaded_bytes > 0
    row = next(line for line in str(stepped).splitlines() if line.startswith("blocks.0"))
    assert "offloaded (kept)" in row and format_bytes(resident[0].loaded_bytes) in row
    assert f"kept {format_bytes(sum(s.loaded_bytes for s in resident))}" in str(stepped)

    model(batch[0])
    assert all(s.device_bytes == s.loaded_bytes for s in offtensor.summary(model).scopes)


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"),
    (512, "512 B"),
    (1024, "1.0 KiB"),
    (16_640, "16.2 KiB"),
    (3 * 2**20, "3.0 MiB"),
    (3 * 2**29, "1.5 GiB"),
])
def test_sizes_print_in_the_unit_they_reach(nbytes, text):
    assert format_bytes(nbytes) == text


def test_a_small_model_prints_kib_not_zero_mib():
    model = mlp_of_blocks(n_blocks=2)  # blocks of a few KiB
    offload(model, "cpu")
    model(random_batch("cpu")[0])
    text = str(offtensor.summary(model))
    assert "KiB" in text and "0.0 MiB" not in text and "0.0" not in text.splitlines()[1]


def test_wrap_on_the_cpu_says_it_copies_rather_than_pins(caplog):
    with caplog.at_level(logging.DEBUG, logger="offtensor"):
        offtensor.wrap(mlp_of_blocks(n_blocks=2), device="cpu")
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("copying masters to host memory") for m in messages), messages
    assert not any("pinning" in m for m in messages), messages
