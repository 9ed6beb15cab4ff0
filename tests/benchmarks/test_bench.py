"""The benchmark runs end to end (tiny model, CPU): every row it prints has its numbers.

Timings are not asserted (a benchmark measures them; CI machines are noisy): what is checked is
that each peer ran, that the offloaded training step kept every gradient, that the rooflines,
verdicts and the optimizer-overlap measurements are filled in and consistent, and that the
report leaves out what means nothing.
"""

from __future__ import annotations

import ast
import json
import statistics
import struct
import sys
from pathlib import Path

import pytest
import torch

import offtensor
from offtensor.optim import overlap as _overlap

pytest.importorskip("transformers")

from conftest import requires_cuda

import benchmarks as bench
from benchmarks import cli, plots, profiling, report, rooflines
from benchmarks.optimizer import WorkerSettings
from benchmarks.results import Extras, Row, VariantBytes
from benchmarks.scenarios import SCENARIOS, quick

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
    assert same["warmup_steps"] == 1  # the steady-state period, not a pipeline fill per round
    for v in same["variants"]:
        assert len(v["times_ms"]) == same["rounds"] == 1 and v["median_ms"] > 0
        assert len(v["worker_busy_ms"]) == 1 and 0 < v["worker_busy_median_ms"] < v["median_ms"]
    assert len(same["alone_ms"]) == same["rounds"] and same["beside_ms"] == []  # no copies on the CPU

    step = result["scenarios"]["step-4x2048"]
    assert step["optimizer_ms"] > 0
    peers = step["peers"]
    # The standard step adds the optimizer to fwd+bwd, the plain AdamW timed once after each of
    # its timed iterations (Note [optimizer term in turn]); the overlapped one takes their max.
    in_turn = rows[("step-4x2048", "offtensor")]["optimizer_in_turn_ms"]
    assert len(in_turn) == len(rows[("step-4x2048", "offtensor")]["times_ms"]) and min(in_turn) > 0
    assert peers["offtensor"]["optimizer_ms"] == pytest.approx(statistics.median(in_turn))
    assert peers["offtensor"]["roofline_ms"] == pytest.approx(
        peers["offtensor"]["fwd_bwd_roofline_ms"] + statistics.median(in_turn))
    assert rows[("step-4x2048", "offtensor-overlap")]["optimizer_in_turn_ms"] is None
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
    """WorkerSettings are the library's defaults; the benchmark's single-GPU overlapped peer lets
    the device step pieces (device_share=1.0) unless told otherwise, its several-rank one not."""
    assert WorkerSettings() == WorkerSettings(_overlap.SPARE_THREADS, _overlap.STEP_PIECE_BYTES, _overlap.DEVICE_SHARE)
    args = bench.parse_args(["--overlap-spare-threads", "0", "--overlap-piece-mib", "16"])
    assert args.worker == WorkerSettings(0, 16 * 2**20, 1.0)
    assert bench.parse_args(["--overlap-device-share", "0"]).worker == WorkerSettings(device_share=0.0)
    assert bench.parse_args(["--nproc", "2"]).worker == WorkerSettings()


def test_overlap_variants_are_checked():
    for bad in ("64", "1:inf", "x:64", "1:64:2", "1:64:0.5:1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--overlap-variants", bad])
    assert bench.parse_args(["--overlap-variants", "0:16"]).overlap_variants == [WorkerSettings(0, 16 * 2**20, 1.0)]
    assert bench.parse_args(["--overlap-variants", "0:16:0.25"]).overlap_variants == [
        WorkerSettings(0, 16 * 2**20, 0.25)]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([command, "--help"])
    assert exc.value.code == 0
    assert f"python -m benchmarks {command}" in capsys.readouterr().out


def test_bench_uses_only_public_offtensor_api_and_imports_third_parties_lazily():
    lazy = {"transformers", "accelerate", "diffusers", "peft", "psutil", "matplotlib"}
    for path in BENCH_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "offtensor":
                assert node.module == "offtensor", (path.name, node.module)  # no offtensor.engine, ...
                assert all(a.name in offtensor.__all__ for a in node.names), (path.name, node.module)
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, (path.name, node.module)  # nothing above benchmarks/
            if isinstance(node, ast.Import):
                assert all(a.name == "offtensor" for a in node.names if a.name.split(".")[0] == "offtensor"), path.name
            if isinstance(node, ast.Attribute):
                assert not node.attr.startswith("_offtensor"), (path.name, node.attr)  # the library's own state
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


# ---- pictures (--plot, the plot subcommand, profile-step --plot) ----------------------------------


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG file's header, after checking its signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR", path.name
    width, height = struct.unpack(">II", data[16:24])
    assert len(data) > 10_000, f"{path.name}: {len(data)} bytes, too small for a chart"
    return width, height


def test_plot_draws_a_quick_run_and_the_same_picture_from_its_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--scenarios", "infer-1x512", "--peers", "resident", "offtensor",
                     "--warmup", "1", "--iters", "1", "--json", str(out), "--plot", str(tmp_path / "run")])
    assert rc == 0
    drawn = tmp_path / "run" / plots.RESULTS_PNG
    assert f"bench: wrote {drawn}" in capsys.readouterr().out
    width, height = png_size(drawn)
    assert width > 800 and height > 250
    assert not (tmp_path / "run" / plots.OVERLAP_PNG).exists()  # no offtensor-overlap row

    assert bench.main(["plot", str(out), "--out", str(tmp_path / "again")]) == 0
    # --plot draws the very dict --json writes: the two pictures are the same bytes.
    assert (tmp_path / "again" / plots.RESULTS_PNG).read_bytes() == drawn.read_bytes()


def _result_of_every_kind_of_row() -> dict:
    """A --json result by hand: a CUDA run with ok, skipped and error rows, and an overlap report."""
    overlap = {"backward_ms": 170.0, "total_ms": 320.0, "rest_params": 3, "pieces": 4, "early_pieces": 2,
               "worker_busy_ms": 290.0, "spare_threads": 1, "piece_bytes": 64 * 2**20,
               "scopes": [{"scope": f"model.layers.{i}", "queued_ms": 10.0 + 40 * (1 - i),
                           "started_ms": 30.0 + 40 * (1 - i), "stepped_ms": 160.0 + 150 * i} for i in (1, 0)]}

    def row(scenario, peer, status="ok", median=None, roofline=None, vram=None, **kw):
        return {"scenario": scenario, "peer": peer, "status": status, "note": kw.pop("note", ""),
                "median_ms": median, "roofline_ms": roofline, "ratio": median / roofline if roofline else None,
                "peak_vram_bytes": vram, "target": kw.pop("target", None), "verdict": kw.pop("verdict", None),
                "grads_kept": kw.pop("grads_kept", None), "overlap": kw.pop("overlap", None)}

    return {
        "environment": {"device": "cuda:0", "gpu": "a GPU", "torch": "2.11", "date": "today"},
        "interrupted": True, "args": {"quick": False}, "model": {"layers": 8, "hidden": 4096},
        "scenarios": {"train-4x2048": {"batch": 4, "seq": 2048, "micro_batches": 2},
                      "step-4x2048": {"batch": 4, "seq": 2048, "micro_batches": 1},
                      "lora-4x2048": {"batch": 4, "seq": 2048, "micro_batches": 2}},  # no rows: left out
        "results": [row("train-4x2048", "resident", median=240.0, roofline=240.0, vram=11 * 2**30),
                    row("train-4x2048", "offtensor", median=248.0, roofline=240.0, vram=5 * 2**30,
                        target=1.1, verdict="PASS"),
                    row("train-4x2048", "accelerate", median=1440.0, vram=10 * 2**30, grads_kept=0.0),
                    row("train-4x2048", "diffusers", "error", note="RuntimeError: " + "x" * 200),
                    row("step-4x2048", "resident", median=239.0, vram=16 * 2**30),
                    row("step-4x2048", "offtensor-overlap", median=344.0, roofline=245.0, vram=5 * 2**30,
                        target=1.15, verdict="FAIL", overlap=overlap),
                    row("step-4x2048", "accelerate", "skipped", note="no optimizer integration")],
    }


def test_plot_draws_every_kind_of_row_and_the_overlap_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.plot_results(_result_of_every_kind_of_row(), tmp_path)
    assert [p.name for p in paths] == [plots.RESULTS_PNG, plots.OVERLAP_PNG]
    assert all(min(png_size(p)) > 200 for p in paths)
    fig = plots.results_figure(_result_of_every_kind_of_row())
    assert len(fig.axes) == 4  # two scenarios with rows, each with a time and a VRAM panel
    assert [a.get_title(loc="left") for a in fig.axes[::2]] == ["train-4x2048 (4x2048 x2)", "step-4x2048 (4x2048)"]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert " 248.0 ms, 1.03x roofline (PASS <= 1.10)" in texts
    assert " 1440.0 ms (kept no .grad: not a training step)" in texts
    assert any(t.startswith(" error: RuntimeError: xxx") and t.endswith("...") for t in texts)
    assert "interrupted" in fig.texts[0].get_text()  # the title says the run was cut short


def test_plot_without_matplotlib_fails_at_argument_time_with_the_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    for argv in (["--plot", str(tmp_path)], ["plot", str(tmp_path / "bench.json"), "--out", str(tmp_path)],
                 ["profile-step", "--quick", "--plot", str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2, argv
        assert "--plot needs matplotlib, which is not installed: pip install 'offtensor[plot]'" in (
            capsys.readouterr().err), argv
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_plot_refuses_a_json_file_it_cannot_draw(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "other.json").write_text(json.dumps({"something": "else"}))
    with pytest.raises(SystemExit, match="other.json is neither a benchmark --json file nor a step_timeline.json"):
        bench.main(["plot", str(tmp_path / "other.json"), "--out", str(tmp_path)])


def _check_step_timeline(out: Path, device: str) -> dict:
    timeline = json.loads((out / plots.TIMELINE_JSON).read_text())
    assert timeline["kind"] == "step_timeline" and timeline["device"] == device
    lanes = {(lane["row"], lane["what"]): lane for lane in timeline["lanes"]}
    assert list(dict.fromkeys(row for row, _ in lanes)) == [
        "main thread", "device: host-to-device copies", "device: kernels", "device: device-to-host copies",
        "optimizer worker"]
    end = timeline["step_ms"]
    for lane in timeline["lanes"]:
        assert all(0 <= a <= b <= end for a, b in lane["spans"]), lane["row"]
    forward, backward = lanes[("main thread", "forward")], lanes[("main thread", "backward_and_step")]
    assert len(forward["spans"]) == len(backward["spans"]) == 1
    assert forward["spans"][0][1] <= backward["spans"][0][0]
    worker = [s for (row, _), lane in lanes.items() if row == "optimizer worker" for s in lane["spans"]]
    assert worker, "the optimizer worker stepped nothing in the drawn step"
    markers = {m["label"]: m["at_ms"] for m in timeline["markers"]}
    assert markers["forward returned"] == forward["spans"][0][1]
    assert markers["backward_and_step returned"] == backward["spans"][0][1]
    width, height = png_size(out / plots.TIMELINE_PNG)
    assert width > 800 and height > 200
    return lanes


def test_profile_step_draws_one_step_timeline_on_the_cpu(tmp_path):
    pytest.importorskip("matplotlib")
    assert bench.main(["profile-step", "--quick", "--steps", "1", "--unprofiled", "1", "--plot", str(tmp_path)]) == 0
    lanes = _check_step_timeline(tmp_path, "cpu")
    # No copy engine on the CPU: the device lanes are empty and the picture says why.
    for row in ("device: host-to-device copies", "device: kernels", "device: device-to-host copies"):
        assert lanes[(row, "")]["spans"] == [] and lanes[(row, "")]["note"].startswith("CUDA only"), row
    before = (tmp_path / plots.TIMELINE_PNG).read_bytes()
    assert bench.main(["plot", str(tmp_path / plots.TIMELINE_JSON), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / plots.TIMELINE_PNG).read_bytes() == before


def _cuda_like_timeline() -> dict:
    """The second of two steps of a made-up CUDA profile (ms on the profiler's clock)."""
    trace = profiling._Trace(
        ranges={"step": [(100.0, 500.0), (500.0, 900.0)], "forward": [(100.0, 300.0), (500.0, 700.0)],
                "backward_and_step": [(300.0, 480.0), (700.0, 880.0)]},
        kernels=[(510.0, 520.0), (520.1, 530.0), (600.0, 650.0), (950.0, 960.0)],
        h2d=[(495.0, 505.0)], d2h=[(710.0, 720.0)],
        scopes=[("1", (450.0, 510.0)), ("0", (505.0, 560.0)), ("1", (760.0, 800.0)), ("0", (850.0, 950.0))])
    return profiling.step_timeline(trace, 500.0, 900.0, "cuda")


def test_step_timeline_lanes_from_a_cuda_trace():
    """Device spans clipped to the step and merged where closer than 1/2000 of it; the worker's
    scopes split into the previous step's deferred ones and this step's."""
    timeline = _cuda_like_timeline()
    lanes = {(lane["row"], lane["what"]): lane for lane in timeline["lanes"]}
    assert timeline["step_ms"] == 400.0
    assert lanes[("main thread", "forward")]["spans"] == [[0.0, 200.0]]
    assert lanes[("main thread", "backward_and_step")]["spans"] == [[200.0, 380.0]]
    assert lanes[("device: kernels", "")]["spans"] == [[10.0, 30.0], [100.0, 150.0]]  # 0.1 ms gap closed
    assert lanes[("device: host-to-device copies", "")]["spans"] == [[0.0, 5.0]]
    assert lanes[("device: device-to-host copies", "")]["spans"] == [[210.0, 220.0]]
    assert all(lane["note"] == "" for lane in timeline["lanes"])  # CUDA: no lane is "CUDA only"
    deferred = lanes[("optimizer worker", "the previous step's layers (deferred)")]
    this = lanes[("optimizer worker", "this step's layers")]
    assert (deferred["spans"], deferred["labels"]) == ([[0.0, 10.0], [5.0, 60.0]], ["1", "0"])
    assert (this["spans"], this["labels"]) == ([[260.0, 300.0], [350.0, 400.0]], ["1", "0"])
    assert timeline["markers"] == [{"label": "forward returned", "at_ms": 200.0},
                                   {"label": "backward_and_step returned", "at_ms": 380.0}]


def test_timeline_picture_of_a_cuda_trace(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.plot_timeline(_cuda_like_timeline(), tmp_path)
    assert [p.name for p in paths] == [plots.TIMELINE_PNG, plots.TIMELINE_JSON]
    assert json.loads(paths[1].read_text()) == _cuda_like_timeline()
    width, height = png_size(paths[0])
    assert width > 800 and height > 200


@pytest.mark.cuda
@requires_cuda
def test_profile_step_draws_the_device_lanes_on_cuda(tmp_path):
    pytest.importorskip("matplotlib")
    assert bench.main(["profile-step", "--layers", "2", "--steps", "1", "--unprofiled", "2",
                       "--plot", str(tmp_path)]) == 0
    lanes = _check_step_timeline(tmp_path, "cuda")
    for row in ("device: host-to-device copies", "device: kernels", "device: device-to-host copies"):
        assert lanes[(row, "")]["spans"], f"{row}: nothing recorded by the profiler"
        assert lanes[(row, "")]["note"] == "", row


@pytest.mark.full_tier  # eight layers, two scenarios, three peers: ~10 s on the CPU
def test_the_budget_peer_keeps_half_the_layers_and_is_judged_against_the_streamed_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--layers", "8", "--scenarios", "infer-1x512", "train-4x2048",
                     "--peers", "resident", "offtensor", "offtensor-budget", "--warmup", "1", "--iters", "1",
                     "--json", str(out)])
    assert rc == 0
    rows = {(r["scenario"], r["peer"]): r for r in json.loads(out.read_text())["results"]}
    for scenario in ("infer-1x512", "train-4x2048"):
        budget, streamed = rows[(scenario, "offtensor-budget")], rows[(scenario, "offtensor")]
        assert budget["status"] == "ok"
        assert budget["roofline_ms"] == pytest.approx(streamed["median_ms"])  # relative to offtensor
        assert budget["ratio"] == pytest.approx(budget["median_ms"] / streamed["median_ms"])
    assert rows[("infer-1x512", "offtensor-budget")]["target"] == 0.55
    assert rows[("train-4x2048", "offtensor-budget")]["target"] is None  # a bytes target: infer-1x512 only
    assert "offtensor-budget: its ratio is to the offtensor row's time" in capsys.readouterr().out


def test_the_budget_keeps_half_the_decoder_layers():
    from benchmarks.model import build_model
    from benchmarks.peers import budget_keeping_half
    from benchmarks.scenarios import ModelShape

    built = build_model(ModelShape(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, layers=8), "base",
                        torch.device("cpu"), 0)
    offtensor.wrap(built.model, device="cpu", policy=offtensor.Policy(vram_budget=budget_keeping_half(built, 1)))
    kept = [i for i, s in enumerate(offtensor.summary(built.model).scopes) if s.kept]
    assert kept == [0, 3, 5, 7]  # 4 of 8: the first, then spread over the rest (Note [VRAM budget])


@pytest.mark.full_tier  # two peers, two scenarios: the full tier runs it
def test_the_compressed_peers_run_inference_and_lora_judged_against_the_bf16_roofline(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--scenarios", "infer-1x512", "lora-4x2048",
                     "--peers", "resident", "offtensor", "offtensor-fp8", "offtensor-int8", "--warmup", "1",
                     "--iters", "1", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {(r["scenario"], r["peer"]): r for r in result["results"]}
    for scenario in ("infer-1x512", "lora-4x2048"):
        for peer in ("offtensor-fp8", "offtensor-int8"):
            row = rows[(scenario, peer)]
            assert row["status"] == "ok", row
            # The bf16 roofline, the offtensor row's: fp8 is judged by how far below it goes.
            assert row["roofline_ms"] == pytest.approx(rows[(scenario, "offtensor")]["roofline_ms"])
    assert rows[("infer-1x512", "offtensor-fp8")]["target"] == 0.55
    assert "frozen_format='fp8'" in result["setups"]["offtensor-fp8/base"]["how"]


def test_compression_error_reports_layers_and_logits(capsys):
    assert bench.main(["compression-error", "--quick", "--seq", "16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for fmt in ("fp8", "int8"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{fmt}:"))
        assert "per-layer output error" in line and "final logits" in line and "host bytes 0.5" in line


def test_host_tier_benchmark_quick_runs_on_the_cpu(tmp_path, capsys):
    assert bench.main(["host-tier", "--quick", "--dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for line in ("drive read", "streamed from files", "host RSS", "outputs equal", "pinned-ring mode"):
        assert line in printed, printed
    assert "FAIL" not in printed.split("outputs equal")[1].splitlines()[0]


def test_bytes_targets_judge_only_the_transfer_bound_scenario():
    """fp8 and the VRAM budget move fewer bytes: their targets are the issues' infer-1x512 ones,
    not the compute-bound infer-8x2048 (where fp8's dequantization costs a little)."""
    from benchmarks.results import Row
    from benchmarks.rooflines import _judge

    for scenario, target in (("infer-1x512", 0.55), ("infer-8x2048", None)):
        row = Row(scenario, "offtensor-fp8", "ok", median_ms=130.0)
        _judge(row, "infer", 120.0)
        assert row.target == target and row.verdict == (None if target is None else "FAIL")
    row = Row("infer-8x2048", "offtensor", "ok", median_ms=121.0)
    _judge(row, "infer", 120.0)
    assert row.target == 1.03 and row.verdict == "PASS"


def test_compile_time_is_the_first_call_less_a_steady_iteration():
    from benchmarks.results import Row
    from benchmarks.rooflines import compile_times

    rows = [Row("train-4x2048", "resident", "ok", times_ms=[10.0, 10.0], median_ms=10.0, first_call_ms=1020.0,
                per_iteration=2),
            Row("train-4x2048", "offtensor", "ok", times_ms=[11.0, 11.0], median_ms=11.0, first_call_ms=1322.0,
                per_iteration=2)]
    (c,) = compile_times(rows)
    assert c["resident_ms"] == 1000.0 and c["offtensor_ms"] == 1300.0
    assert c["ratio"] == pytest.approx(1.3) and c["verdict"] == "FAIL"


@pytest.mark.full_tier  # inductor compiles two layers for two peers: ~1 min on the CPU
def test_the_compiled_run_reports_compile_times(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--scenarios", "infer-1x512", "--peers", "resident", "offtensor",
                     "--compile", "--warmup", "2", "--iters", "1", "--json", str(out)])
    assert rc == 0
    rows = {r["peer"]: r for r in json.loads(out.read_text())["results"]}
    for peer in ("resident", "offtensor"):
        assert rows[peer]["status"] == "ok" and rows[peer]["first_call_ms"] > rows[peer]["median_ms"]
    assert "compile time, offtensor/infer-1x512:" in capsys.readouterr().out


# ---- --shape: real models' dimensions, meta build, scope-by-scope load ---------------------------


def test_shape_quick_run_loads_each_peer_and_times_each_phase(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--shape", "8b", "--scenarios", "train-1x4096", "full-step-1x4096",
                     "--peers", "resident", "offtensor", "offtensor-capped", "accelerate", "--warmup", "1",
                     "--iters", "1", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["scenario"], r["peer"]): r for r in result["results"]}
    assert set(rows) == {("train-1x4096", p) for p in ("resident", "offtensor", "accelerate")} | {
        ("full-step-1x4096", p) for p in ("resident", "offtensor", "offtensor-capped", "accelerate")}
    for (scenario, peer), r in rows.items():
        if peer == "accelerate":
            assert r["status"] == "skipped" and "not run at --shape sizes" in r["note"]
            continue
        assert r["status"] == "ok", (scenario, peer, r["note"])
        assert r["grads_kept"] == 1.0
        phases = {"forward", "backward"} | ({"step"} if scenario == "full-step-1x4096" else set())
        assert set(r["phases_ms"]) == phases and all(v > 0 for v in r["phases_ms"].values())
    # The quick 8b shape: 3 layers, hidden 256, Llama-3's vocab-to-hidden kind of head.
    assert (result["model"]["name"], result["model"]["layers"], result["model"]["vocab"]) == ("8b", 3, 2048)
    train = result["scenarios"]["train-1x4096"]["rows"]["offtensor"]
    ours = rows[("train-1x4096", "offtensor")]
    # train-1x4096 is judged against the phase-aware roofline: the sum of the phases' bounds.
    assert train["phase_roofline_ms"] == pytest.approx(sum(p["bound_ms"] for p in train["phases"].values()))
    assert ours["roofline_ms"] == pytest.approx(train["phase_roofline_ms"]) and ours["target"] == 1.10
    resident_phases = rows[("train-1x4096", "resident")]["phases_ms"]
    assert train["phases"]["backward"]["resident_ms"] == pytest.approx(resident_phases["backward"])
    # Backward reloads the weights (recompute) and sends every gradient home.
    assert train["phases"]["backward"]["h2d_bytes"] == train["phases"]["forward"]["h2d_bytes"] == ours["moved_bytes"]
    assert train["phases"]["backward"]["d2h_bytes"] == ours["moved_grad_bytes"] == ours["moved_bytes"]
    capped = rows[("full-step-1x4096", "offtensor-capped")]
    # Embeddings and head are scopes too: more bytes moved than the decoder layers alone.
    assert capped["moved_bytes"] > rows[("full-step-1x4096", "offtensor")]["moved_bytes"]
    assert capped["vram_cap_bytes"] == 8 * 2**30 and capped["verdict"] is None  # no VRAM on the CPU
    assert "layers_embeddings_and_head" in result["setups"]["offtensor-capped/base"]["how"]
    assert "VRAM cap of 8.0 GiB: not applied (no CUDA device)" in printed
    assert "loaded in " in printed and "peak host RSS" in printed and "expected load time" in printed
    assert "per-phase rooflines" in printed and "train-1x4096/offtensor: forward " in printed


@pytest.mark.full_tier  # two shapes, three peers: the full tier runs it
@pytest.mark.parametrize("shape", ["34b", "70b"])
def test_large_shapes_run_inference_and_the_lora_step_on_one_load_per_peer(tmp_path, shape):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--device", "cpu", "--shape", shape, "--peers", "resident", "offtensor",
                       "offtensor-fp8", "--warmup", "1", "--iters", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["scenario"], r["peer"]): r for r in result["results"]}
    assert set(rows) == {(s, p) for s in ("infer-1x512", "lora-step-1x4096")
                         for p in ("resident", "offtensor", "offtensor-fp8")}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert set(result["setups"]) == {"resident/lora", "offtensor/lora", "offtensor-fp8/lora"}  # one load each
    for scenario in ("infer-1x512", "lora-step-1x4096"):
        fp8, bf16 = rows[(scenario, "offtensor-fp8")], rows[(scenario, "offtensor")]
        assert fp8["moved_bytes"] < 0.6 * bf16["moved_bytes"]  # its own floor: the fp8 bytes
        floors = result["scenarios"][scenario]["rows"]["offtensor-fp8"]
        assert fp8["roofline_ms"] == pytest.approx(floors["floor_ms"]) and fp8["target"] == 1.05


def test_resident_and_loaded_shape_models_get_the_same_random_weights():
    """RandomFill seeds each module's generator from its name: the resident model filled in place
    and the one offtensor.load fills scope by scope hold the same values, so they compute the same."""
    from benchmarks.model import build_model
    from benchmarks.peers import PeerOptions, setup_offtensor
    from benchmarks.scenarios import QUICK_NAMED_SHAPES
    from benchmarks.shapes import RandomFill

    cpu = torch.device("cpu")
    models = [build_model(QUICK_NAMED_SHAPES["8b"], "base", cpu, 0, fill=RandomFill(cpu, 0)) for _ in range(2)]
    assert all(p.is_meta for p in models[0].model.parameters())
    from benchmarks.peers import PEER_SETUP

    PEER_SETUP["resident"](models[0], cpu, PeerOptions())
    setup_offtensor(models[1], cpu, PeerOptions())
    assert offtensor.is_wrapped(models[1].model)
    for (name, p), (_, q) in zip(models[0].model.named_parameters(), models[1].model.named_parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), name
    assert models[0].model.model.norm.weight.eq(1).all()
    ids = torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(models[1].model(input_ids=ids).logits, models[0].model(input_ids=ids).logits)


@pytest.mark.filterwarnings("error::UserWarning")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_full_step_with_embeddings_and_head_offloaded_matches_the_plain_model(tied):
    """offtensor-capped's placement and loss: decoder layers, embeddings and head are scopes, the
    loss is computed in checkpointed pieces (chunked_lm_loss, 4 tokens at a time: the head's scope
    is called 2 times per forward and again in the recompute), and one backward_and_step with
    AdamW gives the plain model's loss and weights (Hugging Face's loss, labels=ids)."""
    import copy

    import transformers

    from benchmarks.model import decoder_layers
    from benchmarks.peers import layers_embeddings_and_head
    from benchmarks.workload import chunked_lm_loss

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=96, tie_word_embeddings=tied, use_cache=False)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(plain)
    offtensor.wrap(model, layers_embeddings_and_head(model, decoder_layers(model)), device="cpu")
    scopes = [s.name for s in offtensor.summary(model).scopes]
    assert "model.embed_tokens" in scopes and ("lm_head" in scopes) != tied  # tied: with the embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert isinstance(model.lm_head.weight, offtensor.OffloadedParameter)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    for _ in range(2):
        loss = plain(input_ids=ids, labels=ids).loss
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        chunked = chunked_lm_loss(model, ids, chunk_tokens=4)
        torch.testing.assert_close(chunked, loss)
        offtensor.backward_and_step(chunked, opts[1], zero_grad=True).wait()
    for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), msg=name)


def test_a_resident_model_that_does_not_fit_is_extrapolated_from_4_and_8_layers(tmp_path, monkeypatch):
    """70B's resident LoRA step does not fit the GPU: its time, per phase, comes from the resident
    model at 4 and 8 layers of the same shape (a + b x layers), and the fp8 row is judged against
    max(that, its copies). Here the resident model is made not to fit above 8 layers."""
    from benchmarks import run as bench_run

    real = bench_run.fit_problem

    def fit_problem(peer, built, shape, s, device, held=0):
        if peer == "resident" and shape.layers > 8:
            return "does not fit: made so by the test"
        return real(peer, built, shape, s, device, held)

    real_run = bench_run.run_scenario

    def run_scenario(built, scenario, device, *, row, peer="", **kwargs):
        # The tiny model's 4- and 8-layer times are noise on a busy CPU (8 layers measured
        # faster than 4): the resident runs report a + b x layers instead, exactly.
        real_run(built, scenario, device, row=row, peer=peer, **kwargs)
        if peer == "resident":
            layers = len(built.layers)
            row.phases_ms = {"forward": 1.0 + layers, "backward": 2.0 + 2 * layers, "step": 0.5}
            row.median_ms = sum(row.phases_ms.values())
            row.times_ms = [row.median_ms]

    monkeypatch.setattr(bench_run, "fit_problem", fit_problem)
    monkeypatch.setattr(bench_run, "run_scenario", run_scenario)
    out = tmp_path / "bench.json"
    rc = bench.main(["--quick", "--device", "cpu", "--shape", "70b", "--layers", "12",
                     "--scenarios", "lora-step-1x4096", "--peers", "resident", "offtensor-fp8",
                     "--warmup", "1", "--iters", "1", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {r["peer"]: r for r in result["results"]}
    assert len(result["results"]) == 2  # the 4- and 8-layer runs leave no rows of their own
    resident = rows["resident"]
    assert resident["status"] == "ok" and resident["note"].startswith("extrapolated: does not fit: made so by the test")
    assert "measured at 4 and 8 layers" in resident["note"]
    assert resident["phases_ms"] == pytest.approx({"forward": 13.0, "backward": 26.0, "step": 0.5})
    assert resident["median_ms"] == pytest.approx(39.5) and resident["peak_vram_bytes"] is None
    assert "resident/lora" not in result["setups"]  # the truncated models' setups are not this row's
    floors = result["scenarios"]["lora-step-1x4096"]["rows"]["offtensor-fp8"]
    assert floors["floor_ms"] == pytest.approx(max(floors["copies_ms"], resident["median_ms"]))
    assert floors["phases"]["backward"]["resident_ms"] == pytest.approx(resident["phases_ms"]["backward"])
    assert rows["offtensor-fp8"]["roofline_ms"] == pytest.approx(floors["floor_ms"])


def test_peers_that_do_not_fit_are_skipped_with_the_reason(monkeypatch):
    """70B in bf16 needs more host memory than a 128 GiB host has; in fp8 it fits. The resident
    70B LoRA step does not fit a 139 GiB GPU (checked here against host memory on the CPU)."""
    from benchmarks import shapes
    from benchmarks.model import build_model
    from benchmarks.scenarios import NAMED_SHAPES, SHAPE_SCENARIOS

    cpu = torch.device("cpu")
    built = build_model(NAMED_SHAPES["70b"], "lora", cpu, 0, fill=shapes.RandomFill(cpu, 0))
    assert 137e9 < built.wrapped_bytes < 139e9  # 80 layers of Llama-2-70B, bf16
    monkeypatch.setattr(shapes, "available_host_bytes", lambda: 128 * 2**30)
    infer, lora = SHAPE_SCENARIOS["70b"]["infer-1x512"], SHAPE_SCENARIOS["70b"]["lora-step-1x4096"]
    why = shapes.fit_problem("offtensor", built, NAMED_SHAPES["70b"], infer, cpu)
    assert why is not None and why.startswith("does not fit: needs about 129 GiB of host memory, 115 GiB available")
    assert shapes.fit_problem("offtensor-fp8", built, NAMED_SHAPES["70b"], lora, cpu) is None
    # The same fp8 model once loaded (64 GiB held, 53 GiB left): its next scenario still fits.
    monkeypatch.setattr(shapes, "available_host_bytes", lambda: 53 * 2**30)
    assert shapes.fit_problem("offtensor-fp8", built, NAMED_SHAPES["70b"], lora, cpu, held=64 * 2**30) is None
    assert shapes.fit_problem("offtensor-fp8", built, NAMED_SHAPES["70b"], lora, cpu) is not None
    monkeypatch.setattr(shapes, "available_host_bytes", lambda: 150 * 2**30)  # as a 139 GiB GPU's 0.95
    assert shapes.fit_problem("resident", built, NAMED_SHAPES["70b"], infer, cpu) is None
    why = shapes.fit_problem("resident", built, NAMED_SHAPES["70b"], lora, cpu)
    assert why is not None and "needs about 13" in why


def test_the_overlapped_step_is_judged_in_turn_against_adamw_beside_the_copies():
    """issue 15: backward_and_step <= 1.15x max(fwd+bwd, AdamW beside the step's copies), both
    measured in turn (same_time), not the main timing against AdamW alone."""
    same = {"rounds": 3, "steps": 3, "variants": [{"spare_threads": 1, "piece_mib": 64.0, "times_ms": [500.0],
                                                   "median_ms": 500.0}],
            "alone_ms": [300.0], "alone_median_ms": 300.0, "beside_ms": [460.0], "beside_median_ms": 460.0}
    rows = [Row("step-4x2048", "resident", "ok", median_ms=200.0, fwd_bwd_ms=200.0, fwd_ms=60.0),
            Row("step-4x2048", "offtensor-overlap", "ok", median_ms=520.0, grads_kept=1.0, same_time=same)]
    bw = {"h2d": 1e12, "d2h": 1e12, "method": "test"}
    extras = Extras(plain_adamw={"bfloat16": {"median_ms": 300.0}})
    vb = {"base": VariantBytes(10**6, 10**6, 10**6, "all parameters")}
    rooflines.compute_rooflines(rows, [SCENARIOS["step-4x2048"]], bw, vb, extras)
    overlap = rows[1]
    assert overlap.roofline_ms == pytest.approx(460.0) and overlap.ratio == pytest.approx(500.0 / 460.0)
    assert (overlap.ratio_source, overlap.target, overlap.verdict) == ("in turn", 1.15, "PASS")
    env = {"device": "cuda", "torch": torch.__version__}
    table = report.format_table(rows, {**bw, "method": "test"}, env, bench.scenarios.FULL_SHAPE,
                                [SCENARIOS["step-4x2048"]])
    assert "1.09+" in table and "measured in turn with AdamW beside the step's copies" in table
    without = Row("step-4x2048", "offtensor-overlap", "ok", median_ms=520.0, grads_kept=1.0,
                  same_time={**same, "beside_median_ms": None, "beside_ms": []})
    rooflines.compute_rooflines([rows[0], without], [SCENARIOS["step-4x2048"]], bw, vb, extras)
    assert without.ratio_source is None and without.ratio == pytest.approx(520.0 / 300.0)  # AdamW alone, as before
    # The worker takes every thread while the forward waits for it (Note [worker threads]): the
    # faster of AdamW beside the copies on the spared threads and on every thread is the reference.
    every = Row("step-4x2048", "offtensor-overlap", "ok", median_ms=520.0, grads_kept=1.0,
                same_time={**same, "beside_all_ms": [430.0], "beside_all_median_ms": 430.0, "beside_all_threads": 16,
                           "beside_threads": 15})
    rooflines.compute_rooflines([rows[0], every], [SCENARIOS["step-4x2048"]], bw, vb, extras)
    assert every.roofline_ms == pytest.approx(430.0) and every.verdict == "FAIL"  # 500 / 430 = 1.16
    text = report.format_same_time(every, 200.0)
    assert "beside the step's copies 460.0 ms (460; 15 threads) and 430.0 ms (430; 16 threads)" in text
    assert "1.16x max(fwd+bwd, AdamW beside copies)" in text


def test_vram_target_of_the_capped_full_step():
    from benchmarks.scenarios import SHAPE_SCENARIOS

    full = SHAPE_SCENARIOS["8b"]["full-step-1x4096"]
    rows = [Row(full.name, "offtensor-capped", "ok", median_ms=1500.0, grads_kept=1.0, peak_vram_bytes=7 * 2**30,
                vram_cap_bytes=8 * 2**30, moved_bytes=16 * 10**9, moved_grad_bytes=16 * 10**9),
            Row(full.name, "offtensor-overlap", "ok", median_ms=1300.0, grads_kept=1.0, peak_vram_bytes=15 * 2**30,
                moved_bytes=14 * 10**9, moved_grad_bytes=14 * 10**9)]
    rooflines.compute_rooflines(rows, [full], {"h2d": 5e10, "d2h": 5e10, "method": "test"}, {}, Extras())
    assert rows[0].verdict == "PASS" and rows[0].ratio is None and rows[1].verdict is None
    rows[0].peak_vram_bytes = 8 * 2**30 + 1
    rooflines.compute_rooflines(rows, [full], {"h2d": 5e10, "d2h": 5e10, "method": "test"}, {}, Extras())
    assert rows[0].verdict == "FAIL"
    lines = report.format_targets(rows, Extras(), torch.device("cuda"), quick=False)
    assert "offtensor-capped/full-step-1x4096: peak VRAM 8.00 GiB, target < 8 GiB (the cap): FAIL" in lines


def test_compiled_runs_are_judged_by_the_compile_targets():
    from benchmarks import rooflines
    from benchmarks.results import Row

    row = Row("train-4x2048", "offtensor", "ok", median_ms=108.0, grads_kept=1.0)
    rooflines._judge(row, "train", 100.0, rooflines.COMPILED_TARGETS)
    assert row.target == 1.05 and row.verdict == "FAIL"
    rooflines._judge(row, "train", 100.0)
    assert row.target == 1.10 and row.verdict == "PASS"


# ---- --shape flux: the diffusion transformer (benchmarks/dit*.py) -------------------------------------


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny DiT's ops are too small to share, and on a busy 2-core host
    two threads per op made the quick run several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _flux_run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--device", "cpu", "--shape", "flux", "--warmup", "1", "--iters", "1",
                       "--json", str(out), *extra]) == 0
    result = json.loads(out.read_text())
    return result, {(r["scenario"], r["peer"]): r for r in result["results"]}


def _check_flux_rows(rows, peers):
    from benchmarks.dit_report import RESIDENT_TARGETS, ROOFLINE_PEERS
    from benchmarks.dit_run import FP8_PEERS

    scenarios = ("infer-1024px", "lora-step-1024px")
    assert set(rows) == {(s, p) for s in scenarios for p in peers}
    for (scenario, peer), r in rows.items():
        assert r["status"] == "ok", (scenario, peer, r["note"])
        assert r["median_ms"] > 0 and r["roofline_ms"] > 0 and r["ratio"] > 0
        if scenario == "lora-step-1024px":
            assert r["grads_kept"] == 1.0, peer  # the adapters in every block got a gradient
        if peer == "resident":
            assert r["exact"] and r["roofline_ms"] == r["median_ms"]
            continue
        assert r["streamed_bytes"] is not None and r["streamed_source"].startswith("counted")
        assert r["vs_resident"] == pytest.approx(r["median_ms"] / rows[(scenario, "resident")]["median_ms"])
        # The copies' term counts the H2D bytes and, for fp8, the dequantization of what was loaded.
        fp8 = peer in FP8_PEERS or peer == "diffusers-fp8"
        assert (r["dequant_elements"] > 0) == (fp8 and r["streamed_bytes"] > 0), peer
        if peer.startswith("offtensor"):
            ref = "fp8 reference" if peer in FP8_PEERS else "resident"
            assert (r["exact"], r["exact_ref"], r["max_abs_diff"]) == (True, ref, 0.0), peer  # bit for bit
        if peer in FP8_PEERS:
            assert r["diff_vs_resident"] > 0  # fp8 is lossy: equal to its reference, not to bf16
        assert (r["target"] == 1.05) == (peer in ROOFLINE_PEERS)
        kind = "infer" if scenario == "infer-1024px" else "frozen-step"
        assert r["resident_target"] == RESIDENT_TARGETS.get((kind, peer))
        if r["target"] is not None:
            assert r["verdict"] == ("PASS" if r["ratio"] <= r["target"] else "FAIL")
    for scenario in scenarios:
        assert rows[(scenario, "offtensor-vram-all")]["streamed_bytes"] == 0  # the whole model kept
        if (scenario, "offtensor-vram12-fp8") in rows:  # a budget streams part of the fp8 bytes
            fp8, kept = rows[(scenario, "offtensor-fp8")], rows[(scenario, "offtensor-vram12-fp8")]
            assert 0 < kept["streamed_bytes"] < fp8["streamed_bytes"] < rows[(scenario, "offtensor")]["streamed_bytes"]


def test_flux_quick_run_has_each_peer_row_its_roofline_and_bit_exact_outputs(tmp_path, capsys, one_thread):
    peers = ("resident", "offtensor", "offtensor-fp8", "offtensor-vram12-fp8", "offtensor-vram-all", "diffusers-fp8")
    result, rows = _flux_run(tmp_path, "--peers", *peers)
    _check_flux_rows(rows, peers)
    printed = capsys.readouterr().out
    assert "diffusers FluxTransformer2DModel" in result["model"]["source"]
    for column in ("ms/iter", "peak VRAM GiB", "streamed GB/iter", "H2D ms", "dequant ms", "roofline ms", "ratio",
                   "x resident", "first output", "targets"):
        assert column in printed
    assert "= fp8 reference; vs bf16" in printed and "resident <= 1.15 " in printed
    assert "apply_layerwise_casting(float8_e4m3fn" in result["setups"]["diffusers-fp8"]["how"]
    assert "vram_budget=" in result["setups"]["offtensor-vram12-fp8"]["how"]


def test_host_profile_names_where_a_rows_host_time_went(tmp_path, capsys, one_thread):
    """--host-profile N: one more iteration under cProfile per row; offtensor's hooks are in the
    streamed row's list and not in the resident row's (Note [a row's host profile])."""
    _, rows = _flux_run(tmp_path, "--peers", "resident", "offtensor", "--scenarios", "infer-1024px",
                        "--host-profile", "5")
    printed = capsys.readouterr().out
    for peer in ("resident", "offtensor"):
        profile = rows[("infer-1024px", peer)]["host_profile"]
        assert profile["host_wall_ms"] > 0 and profile["host_thread_ms"] > 0 and profile["profiled_ms"] > 0
        assert len(profile["own"]) == 5
        assert all(e["calls"] > 0 and 0 <= e["own_ms"] <= e["cumulative_ms"] + 1e-9 for e in profile["own"])
        assert bool(profile["offtensor"]) == (peer == "offtensor")
    ours = [e["function"] for e in rows[("infer-1024px", "offtensor")]["host_profile"]["offtensor"]]
    assert any(f.startswith("offtensor/engine/hooks.py:") for f in ours), ours
    assert printed.count("host profile: step") == 2 and "offtensor, by time including what it calls:" in printed


@pytest.mark.full_tier  # every peer: ~40 s on a 2-core host
def test_flux_quick_run_with_every_peer(tmp_path, one_thread):
    from benchmarks.dit_run import DIT_PEER_NAMES

    _, rows = _flux_run(tmp_path)
    _check_flux_rows(rows, DIT_PEER_NAMES)


def test_flux_without_diffusers_or_peft_runs_the_builtin_dit(tmp_path, monkeypatch, one_thread):
    """No diffusers: the built-in DiT of the same blocks, the diffusers peers noted as not
    available; no peft: the built-in LoRA adapters, on the single blocks' fused qkv+mlp too."""
    for name in ("diffusers", "diffusers.hooks", "peft"):
        monkeypatch.setitem(sys.modules, name, None)
    result, rows = _flux_run(tmp_path, "--scenarios", "lora-step-1024px", "--peers", "resident", "offtensor",
                             "diffusers")
    assert result["model"]["source"].startswith("built-in DiT")
    source = result["model"]["source"]
    assert "built-in LoraLinear (peft not installed) LoRA r=16 on to_q/to_k/to_v/to_qkv_mlp" in source
    assert rows[("lora-step-1024px", "diffusers")]["status"] == "skipped"
    assert "not available" in rows[("lora-step-1024px", "diffusers")]["note"]
    ours = rows[("lora-step-1024px", "offtensor")]
    assert ours["status"] == "ok" and ours["exact"] and ours["grads_kept"] == 1.0


def test_the_fp8_reference_rounds_as_the_compressed_parameters_report():
    """dit.fp8_round_trip_ (the bench's reading of Note [compressed masters]) gives exactly the
    values Policy(frozen_format='fp8') parameters report, and streamed.fp8_compressed picks
    exactly the parameters it compresses (the others keep their bf16 values)."""
    from benchmarks.dit import QUICK_FLUX, build_dit, fp8_round_trip_
    from benchmarks.model import materialize
    from benchmarks.peers import PeerOptions, setup_offtensor
    from benchmarks.streamed import fp8_compressed

    cpu = torch.device("cpu")
    plain, loaded = (build_dit(QUICK_FLUX, cpu, 0) for _ in range(2))
    materialize(plain.model, cpu, plain.fill)
    setup_offtensor(loaded, cpu, PeerOptions(), frozen_format="fp8")
    compressed = 0
    for (name, p), (_, q) in zip(plain.layers.named_parameters(), loaded.layers.named_parameters(), strict=True):
        expected = p.detach().clone()
        if fp8_compressed(p):
            fp8_round_trip_(expected)
            compressed += 1
        assert torch.equal(q.detach().clone(), expected), name
    assert compressed > 0


def test_flux_rows_are_judged_against_their_own_roofline_and_the_resident_time():
    from benchmarks.dit_report import judge_dit_rows

    kinds = {"lora-step-1024px": "frozen-step"}
    rows = [Row("lora-step-1024px", "resident", "ok", median_ms=100.0),
            Row("lora-step-1024px", "offtensor-vram12-fp8", "ok", median_ms=112.0, streamed_bytes=10**8,
                dequant_elements=10**8),
            Row("lora-step-1024px", "offtensor", "ok", median_ms=210.0, streamed_bytes=2 * 10**9)]
    judge_dit_rows(rows, kinds, {"h2d": 10**10}, dequant_s_per_element=1e-12)
    _, budget, streamed = rows
    assert budget.dequant_ms == pytest.approx(0.1) and budget.roofline_ms == 100.0  # compute-bound
    assert (budget.ratio, budget.verdict) == (pytest.approx(1.12), "FAIL")
    assert (budget.vs_resident, budget.resident_target, budget.resident_verdict) == (pytest.approx(1.12), 1.15, "PASS")
    assert streamed.roofline_ms == pytest.approx(200.0) and streamed.verdict == "PASS"  # transfer-bound
    assert streamed.resident_target is None


def test_quick_budgets_keep_the_share_of_layers_the_real_shape_keeps():
    from benchmarks.dit import FLUX_DEV, QUICK_FLUX, build_dit
    from benchmarks.peers import PeerOptions, budget_keeping_all, layer_bytes, vram_budget

    cpu = torch.device("cpu")
    full, tiny = build_dit(FLUX_DEV, cpu, 0), build_dit(QUICK_FLUX, cpu, 0)
    total, largest = layer_bytes(full)
    assert 23.5e9 < total < 24.0e9 and largest == pytest.approx(680e6, rel=0.01)  # Flux.1-dev's blocks
    assert vram_budget("offtensor-vram8", full, PeerOptions()) == 8 * 2**30
    opts = PeerOptions(vram_full_shape=(total, largest))
    share = (8 * 2**30 - 3 * largest) / total
    tiny_total, tiny_largest = layer_bytes(tiny)
    expected = 3 * tiny_largest + share * tiny_total
    assert vram_budget("offtensor-vram8-fp8", tiny, opts) == pytest.approx(expected, abs=300)
    assert vram_budget("offtensor-vram-all", tiny, opts) == budget_keeping_all(tiny, 1)


def test_flux_takes_its_own_peers_and_no_layers():
    assert "offtensor-vram16-fp8" in bench.parse_args(["--shape", "flux"]).peers
    for bad in (["--peers", "accelerate"], ["--layers", "4"], ["--scenarios", "infer-1x512"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--shape", "flux", *bad])


def test_8b_train_4x4096_runs_with_the_budget_peers(tmp_path, one_thread):
    """The compute-dominated LLM scenario: the budget rows' floors count the bytes they streamed
    (Note [budget floors]); a budget holding every layer streams nothing and is held to 1.02."""
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--device", "cpu", "--shape", "8b", "--scenarios", "train-4x4096", "--peers",
                       "resident", "offtensor", "offtensor-vram8", "offtensor-vram-all", "--warmup", "1",
                       "--iters", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["peer"]: r for r in result["results"]}
    assert set(rows) == {"resident", "offtensor", "offtensor-vram8", "offtensor-vram-all"}
    assert all(r["status"] == "ok" and r["grads_kept"] == 1.0 for r in rows.values()), rows
    assert (rows["offtensor-vram8"]["target"], rows["offtensor-vram-all"]["target"]) == (1.05, 1.02)
    assert rows["offtensor-vram-all"]["streamed_bytes"] == 0
    # Streamed, every layer loads in forward and again in backward but the last one (still resident).
    streamed = rows["offtensor"]
    assert streamed["moved_bytes"] < streamed["streamed_bytes"] <= 2 * streamed["moved_bytes"]
    floors = result["scenarios"]["train-4x4096"]["rows"]["offtensor-vram-all"]
    assert floors["counted_h2d_bytes"] == 0 and floors["phase_roofline_ms"] is None
    assert rows["offtensor-vram-all"]["roofline_ms"] == pytest.approx(floors["floor_ms"])
    assert rows["offtensor-vram8"]["vs_resident"] == pytest.approx(
        rows["offtensor-vram8"]["median_ms"] / rows["resident"]["median_ms"])


def test_a_profiled_timeline_splits_compute_waits_into_waits_on_copies_and_on_the_host():
    """--shape flux --profile: a gap in the compute kernels while a copy runs is a wait on the
    copy stream; a gap with no copy running is a wait on the host (Note [where a row's time goes])."""
    from types import SimpleNamespace

    from benchmarks.dit_profile import split_timeline

    def evt(name, start, end):
        return SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, name=name,
                               time_range=SimpleNamespace(start=start, end=end))

    # kernels 0-10 and 30-40 and 60-70 (us); a copy 5-35 covers 10-30 of the first gap; nothing
    # runs 40-60 (the host); a CPU event is ignored
    events = [evt("gemm", 0, 10), evt("gemm", 30, 40), evt("gemm", 60, 70),
              evt("Memcpy HtoD (Pinned -> Device)", 5, 35),
              SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, name="aten::mm",
                              time_range=SimpleNamespace(start=0, end=100))]
    p = split_timeline(events)
    assert p is not None
    assert p["span_ms"] == pytest.approx(0.070)
    assert p["compute_busy_ms"] == pytest.approx(0.030)
    assert p["waiting_on_copies_ms"] == pytest.approx(0.020)
    assert p["waiting_on_host_ms"] == pytest.approx(0.020)
    assert p["link_busy_ms"] == pytest.approx(0.030)
    assert split_timeline([evt("Memcpy HtoD (Pinned -> Device)", 0, 5)]) is None  # no compute: nothing to split


def test_the_host_calls_of_a_profiled_step_are_the_cuda_calls_it_spent_longest_in():
    """--shape flux --profile's second iteration: the host's CUDA runtime calls by total time,
    longest first, with their counts; aten ops and device events are not runtime calls."""
    from types import SimpleNamespace

    from benchmarks.dit_profile import describe_host, runtime_calls

    def evt(name, start, end, kind=torch.autograd.DeviceType.CPU):
        return SimpleNamespace(device_type=kind, name=name,
                               time_range=SimpleNamespace(elapsed_us=lambda: end - start))

    events = [evt("cudaLaunchKernel", 0, 5), evt("cudaLaunchKernel", 10, 15), evt("cudaMalloc", 20, 3020),
              evt("cudaEventSynchronize", 0, 1000), evt("aten::mm", 0, 9000),
              evt("gemm", 0, 9000, torch.autograd.DeviceType.CUDA)]
    calls = runtime_calls(events, top=2)
    assert list(calls) == ["cudaMalloc x1", "cudaEventSynchronize x1"]
    assert calls["cudaMalloc x1"] == pytest.approx(3.0)
    assert runtime_calls(events, top=6)["cudaLaunchKernel x2"] == pytest.approx(0.010)
    described = describe_host({"step": 12.0, **calls})
    assert described.startswith("host: step 12.0 ms, in CUDA calls (ms): cudaMalloc x1 3.0")


def test_the_links_idle_time_is_split_by_why_the_next_copy_started_late(tmp_path):
    """--profile's link gaps: a copy whose host call came after the link went idle was late on
    the host; one enqueued before waited on the device, on compute when it starts as a kernel
    ends; gaps shorter than a copy's launch are not idle time."""
    import gzip
    import json

    from benchmarks.dit_profile import describe_host, link_gaps

    def launch(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": ts, "args": {"correlation": corr}}

    def copy(ts, dur, corr):
        return {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
                "args": {"correlation": corr, "bytes": 1000}}

    trace = [launch(0, 1), copy(10, 100, 1),
             launch(150, 2), copy(160, 100, 2),  # idle 110-160: the host enqueued it at 150 (40 late)
             {"cat": "kernel", "name": "gemm", "ts": 200, "dur": 200, "args": {}},
             launch(250, 3), copy(410, 100, 3),  # idle 260-410, enqueued at 250: waited for the gemm's end
             launch(300, 4), copy(515, 10, 4),  # 5 us after the last: a launch's latency, not a gap
             launch(310, 5), copy(700, 10, 5),  # idle 525-700, no kernel ended then: another stream
             {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900, "args": {}}]
    dump = tmp_path / "gaps.jsonl.gz"
    idle = link_gaps(trace, str(dump))
    assert idle["link gaps"] == 3
    assert idle["link idle"] == pytest.approx((50 + 150 + 175) / 1e3)
    assert idle["copy enqueued late"] == pytest.approx(0.040)
    assert idle["copy waited on compute"] == pytest.approx(0.150)
    assert idle["copy waited on another stream"] == pytest.approx((10 + 175) / 1e3)
    rows = [json.loads(line) for line in gzip.open(dump, "rt")]
    assert [r["gap"] for r in rows] == [50, 150, 175]
    assert rows[1]["after_kernel"] == "gemm" and rows[1]["cause"] == "copy waited on compute"
    line = describe_host({"step": 1.0, "cudaMemcpyAsync x5": 0.1, **idle})
    assert "link idle 0.4 ms in 3 gaps: copy enqueued late 0.0, waited on compute 0.1" in line


def test_a_layout_chosen_without_backward_predicts_no_training_step(monkeypatch):
    # Every scope fit the budget on the first (inference) pass: the layout timed no backward, so
    # the LoRA step's row shows no prediction rather than the forward's as the step's.
    from types import SimpleNamespace

    from benchmarks import dit_run
    from benchmarks.scenarios import Scenario

    layout = SimpleNamespace(timed=True, predicted_forward_ms=200.0, predicted_backward_ms=0.0)
    monkeypatch.setattr(offtensor, "is_wrapped", lambda m: True)
    monkeypatch.setattr(offtensor, "summary", lambda m: SimpleNamespace(layout=layout))
    infer = Scenario("infer-1024px", "infer", 1, 1)
    step = Scenario("lora-step-1024px", "frozen-step", 1, 1)
    assert dit_run._predicted_ms(torch.nn.Linear(1, 1), infer) == 200.0
    assert dit_run._predicted_ms(torch.nn.Linear(1, 1), step) is None
    layout.predicted_backward_ms = 500.0
    assert dit_run._predicted_ms(torch.nn.Linear(1, 1), step) == 700.0
