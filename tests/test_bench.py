"""The benchmark runs end to end (tiny model, CPU): every row it prints has its numbers.

Timings are not asserted (a benchmark measures them; CI machines are noisy): what is checked is
that each peer ran, that the offloaded training step kept every gradient, that the rooflines,
verdicts and the optimizer-overlap measurements are filled in and consistent, and that the
report leaves out what means nothing.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import offtensor
from offtensor import _overlap

pytest.importorskip("transformers")

from offtensor import bench
from offtensor.bench import cli, report, rooflines
from offtensor.bench.optimizer import WorkerSettings
from offtensor.bench.results import Extras, Row, VariantBytes
from offtensor.bench.scenarios import SCENARIOS, quick

BENCH_DIR = Path(bench.__file__).parent


def test_quick_benchmark_fills_every_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--scenarios", "infer-1x512", "step-4x2048",
                     "--peers", "resident", "offtensor", "offtensor-overlap", "--warmup", "1", "--iters", "1",
                     "--overlap-variants", "1:64", "0:16", "--overlap-rounds", "1", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["scenario"], r["peer"]): r for r in result["results"]}
    assert set(rows) == {("infer-1x512", "resident"), ("infer-1x512", "offtensor"),
                         ("step-4x2048", "resident"), ("step-4x2048", "offtensor"),
                         ("step-4x2048", "offtensor-overlap")}
    for key, r in rows.items():
        assert r["status"] == "ok", (key, r["note"])
        assert r["median_ms"] > 0
        assert (r["batch"], r["seq"]) == ((1, 8) if key[0] == "infer-1x512" else (2, 16))
        if r["peer"] != "resident":
            assert r["roofline_ms"] > 0 and r["ratio"] > 0, key
            assert r["verdict"] == ("PASS" if r["ratio"] <= r["target"] else "FAIL"), key
    for peer in ("offtensor", "offtensor-overlap"):
        assert rows[("step-4x2048", peer)]["grads_kept"] == 1.0

    overlap = rows[("step-4x2048", "offtensor-overlap")]
    assert overlap["overlap"]["pieces"] > 0
    assert (overlap["overlap"]["spare_threads"], overlap["overlap"]["piece_bytes"]) == (1, 64 * 2**20)
    same = overlap["same_time"]
    assert [(v["spare_threads"], v["piece_mib"]) for v in same["variants"]] == [(1, 64), (0, 16)]
    for v in same["variants"]:
        assert len(v["times_ms"]) == same["rounds"] == 1 and v["median_ms"] > 0
    assert len(same["alone_ms"]) == same["rounds"] and same["beside_ms"] == []  # no copies on the CPU

    step = result["scenarios"]["step-4x2048"]
    assert step["optimizer_ms"] > 0
    peers = step["peers"]
    # The standard step adds the optimizer to fwd+bwd; the overlapped one takes their max.
    assert peers["offtensor"]["roofline_ms"] == pytest.approx(
        peers["offtensor"]["fwd_bwd_roofline_ms"] + step["optimizer_ms"])
    assert peers["offtensor-overlap"]["roofline_ms"] == pytest.approx(
        max(peers["offtensor-overlap"]["fwd_bwd_roofline_ms"], step["optimizer_ms"]))
    speed = result["optimizer_speed"]
    assert speed["ratio"] > 0 and speed["meets_target"] == (speed["ratio"] >= 0.95)

    # What a reader sees: the shapes that ran, verdicts, the timeline in words.
    assert "infer-1x512 | 1x8 " in printed and "step-4x2048 | 2x16 " in printed
    assert "target >= 0.95: " + ("PASS" if speed["meets_target"] else "FAIL") in printed
    assert "targets: (a --quick or CPU run" in printed
    assert "measured in turn with the plain step" in printed
    scope = overlap["overlap"]["scopes"][0]
    assert (f"scope {scope['scope']}: handed to the optimizer at {scope['queued_ms']:.0f} ms, grads landed "
            f"{scope['started_ms']:.0f} ms, stepped by {scope['stepped_ms']:.0f} ms") in printed


def test_a_row_that_kept_no_gradients_gets_no_ratio():
    """accelerate's cpu_offload keeps no .grad on its offloaded parameters: its time is not a
    training step's, so no roofline, ratio or verdict."""
    rows = [Row("train-4x2048", "resident", "ok", median_ms=100.0, grads_kept=1.0),
            Row("train-4x2048", "offtensor", "ok", median_ms=105.0, grads_kept=1.0),
            Row("train-4x2048", "accelerate", "ok", median_ms=90.0, grads_kept=0.0, note="only 0% ...")]
    bw = {"h2d": 1e9, "d2h": 1e9, "method": "test"}
    vb = {"base": VariantBytes(10**6, 10**6, 10**6, "all parameters")}
    rooflines.compute_rooflines(rows, [SCENARIOS["train-4x2048"]], bw, vb, Extras())
    resident, ours, theirs = rows
    assert resident.ratio == 1.0 and resident.verdict is None  # the resident peer has no target
    assert ours.ratio == pytest.approx(1.05) and (ours.target, ours.verdict) == (1.10, "PASS")
    assert (theirs.roofline_ms, theirs.ratio, theirs.verdict) == (None, None, None)
    env = {"device": "cpu", "torch": torch.__version__}
    table = report.format_table(rows, bw, env, bench.scenarios.QUICK_SHAPE, [quick(SCENARIOS["train-4x2048"])])
    assert "| 2x16 x2 " in table and "<= 1.10 PASS" in table
    assert "no roofline or ratio for a training row that kept only part of its gradients" in table


def test_worker_settings_default_to_backward_and_step_defaults():
    assert WorkerSettings() == WorkerSettings(_overlap.SPARE_THREADS, _overlap.STEP_PIECE_BYTES)
    args = bench.parse_args(["--overlap-spare-threads", "0", "--overlap-piece-mib", "16"])
    assert args.worker == WorkerSettings(0, 16 * 2**20)


def test_overlap_variants_are_checked():
    for bad in ("64", "1:inf", "x:64"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--overlap-variants", bad])
    assert bench.parse_args(["--overlap-variants", "0:16"]).overlap_variants == [WorkerSettings(0, 16 * 2**20)]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([command, "--help"])
    assert exc.value.code == 0
    assert f"python -m offtensor.bench {command}" in capsys.readouterr().out


def test_bench_uses_only_public_offtensor_api_and_imports_third_parties_lazily():
    lazy = {"transformers", "accelerate", "diffusers", "peft", "psutil"}
    for path in BENCH_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("offtensor"):
                assert all(not part.startswith("_") for part in node.module.split(".")), (path.name, node.module)
                assert all(not a.name.startswith("_") for a in node.names), (path.name, node.module)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "offtensor":
                assert node.attr in offtensor.__all__, (path.name, node.attr)
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name.split(".")[0] for n in top for a in n.names} | {
            n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & lazy, (path.name, names & lazy)


def test_no_bench_function_is_longer_than_80_lines():
    for path in BENCH_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, (path.name, node.name)
