"""`python -m benchmarks host-overhead --quick` runs on the CPU: every row, peer and section is
filled in and every peer computes what the plain model does, the LoRA row's adapter grads included
and the first step of the row with optimizer steps.
Timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

import benchmarks as bench
from benchmarks.host_overhead import NO_GRADS

LORA = "LoRA train, checkpointed"
ROWS = [f"{model} {mode}" for model in ("Flux", "Llama")
        for mode in ("forward", "train", "forward, no_grad", "forward, inference_mode", "train + AdamW step", LORA)]


def test_quick_host_overhead_fills_every_row_and_every_peer_matches_the_plain_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    out = tmp_path / "host.json"
    assert bench.main(["host-overhead", "--quick", "--json", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the benchmark's one thread is given back
    printed = capsys.readouterr().out
    table = printed[printed.rindex("| x plain |"):].strip().splitlines()  # the table is printed last
    assert [line.split(" | ")[0].lstrip("| ") for line in table[2:]] == ROWS
    assert "checks: every output and grad equals the plain model's" in printed, printed
    for section in ("| kept training step, Llama |", "| per op (kept scope) |", "| Python calls per step |",
                    "| page faults per step |"):
        assert section in printed
    record = json.loads(out.read_text())
    accelerate = "accelerate" in record["rows"][0]["cells"]
    for row in record["rows"]:
        cells = row["cells"]
        expected = {"plain", "kept", "streamed", "memcpy"} | ({"fp8"} if "no_grad" in row["mode"]
                                                            or "inference" in row["mode"] else set())
        assert expected <= set(cells), (row["mode"], set(cells))
        for name, cell in cells.items():
            assert cell["error"] is None, (row["mode"], name, cell["error"])
            assert len(cell["ratios"]) == 3 and all(r > 0 for r in cell["ratios"]), (row["mode"], name)
            assert len(cell["faults"]) == 3 and all(f >= 0 for f in cell["faults"]), (row["mode"], name)
            if name != "memcpy":
                assert cell["calls"] > 0
                ok = ("=", NO_GRADS) if name == "accelerate" and row["mode"].startswith("train") else ("=",)
                assert cell["check"] in ok, (row["workload"], row["mode"], name, cell["check"])
        if accelerate and row["mode"].startswith("train"):
            assert cells["accelerate"]["check"] == NO_GRADS  # it keeps no grads: marked, not hidden
        if row["mode"] == LORA:  # fp8 and accelerate cannot take it, and say so
            assert not {"fp8", "accelerate"} & set(cells), set(cells)
            assert "diffusers" in cells or "diffusers" not in record["rows"][0]["cells"]
        assert cells["kept"]["calls"] > cells["plain"]["calls"]
    notes = record["notes"]
    assert "frozen fp8 copy" in notes["fp8, LoRA row"]
    assert notes["kept, LoRA row"] == "Policy(vram_budget=2**40, param_filter=frozen_only)"
    assert notes["streamed, LoRA row"] == "Policy(param_filter=frozen_only)"
    if accelerate:
        assert "keeps no grads" in notes["accelerate, LoRA row"]
    assert [s["scopes"] for s in record["scaling"]] == [2, 4]
    assert all(s["check"] == "=" and s["ratio"] > 0 for s in record["scaling"])
    ops = {o["what"]: o for o in record["per_op"]}
    assert {"p.shape", "p.dtype", "p.device", "p.numel()", "p.requires_grad", "p.grad (set)",
            "p.grad = None"} <= set(ops)
    assert ops["the scope's call, one op"]["calls_offtensor"] > 0
    calls = [ops[f"a call of 20 parameters, {how}"] for how in ("warm", "cold")]
    assert all(c["plain_us"] > 0 and c["offtensor_us"] > 0 for c in calls), calls




_ROUNDS = """
import contextlib, ctypes, resource, sys, torch
from benchmarks.measure import freed_memory_kept
kept = sys.argv[1] == "kept"
if not kept:  # glibc's first threshold, held: each block mmap'd (its default moves with the history)
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)
with freed_memory_kept() if kept else contextlib.nullcontext("mmap'd") as how:
    faults = []
    for _ in range(6):  # twelve blocks of about 1.4 MiB: a streamed scope's copy at the benchmark's shapes
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones((1400 + 4 * i) * 1024, dtype=torch.uint8) for i in range(12)]
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(how, *faults)
"""


def _faults_per_round(how: str) -> tuple[str, list[int]]:
    """In a fresh process (a heap with no history): minor page faults of each round of
    allocating, writing and freeing twelve blocks; the allocator's setting, in words."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ROUNDS, how], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    words = done.stdout.split()
    return " ".join(words[:-6]), [int(f) for f in words[-6:]]


def test_freed_memory_is_kept_for_reuse_within_the_benchmark():
    # Note [page faults] (benchmarks/host_overhead.py): with freed_memory_kept, blocks freed are
    # given again without faulting their pages in, as CUDA's caching allocator gives device
    # memory back; mmap'd (as glibc's default does at times), each round faults them in again.
    pytest.importorskip("resource")
    pages = sum((1400 + 4 * i) * 1024 for i in range(12)) // 4096
    how, kept = _faults_per_round("kept")
    if "kept for reuse" not in how:
        pytest.skip(how)
    _, mapped = _faults_per_round("mmap")
    assert max(kept[3:]) < pages // 20, kept  # the first rounds grow the heap
    assert min(mapped[3:]) > pages // 2, mapped  # the rounds do fault where memory is not kept


def test_weights_after_steps_on_another_device_may_differ_by_rounding_only():
    """The training-loop row compares weights bit for bit on the CPU; where the plain model steps
    on a GPU, within rounding, and anything more is a failure either way."""
    from torch import nn

    from benchmarks.host_overhead_checks import CLOSE, compare_weights

    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert compare_weights(a, b, exact=True) == "="
    with torch.no_grad():
        b.weight.add_(b.weight.abs() * 4e-7)  # a few units in the last place
    assert compare_weights(a, b, exact=True).startswith("FAIL")
    assert compare_weights(a, b, exact=False) == CLOSE
    with torch.no_grad():
        b.weight.add_(1e-3)
    assert compare_weights(a, b, exact=False).startswith("FAIL")
