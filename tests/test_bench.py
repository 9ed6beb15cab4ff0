"""The benchmark runs end to end (tiny model, CPU): every row it prints has its numbers.

Timings are not asserted (a benchmark measures them; CI machines are noisy): what is checked is
that each peer ran, that the offloaded training step kept every gradient, and that the
rooflines and the optimizer-overlap measurements are filled in and consistent.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from offtensor import _overlap, bench  # noqa: E402


def test_quick_benchmark_fills_every_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    spare, piece = _overlap.SPARE_THREADS, _overlap.STEP_PIECE_BYTES
    rc = bench.main(["--quick", "--device", "cpu", "--scenarios", "infer-1x512", "step-4x2048",
                     "--peers", "resident", "offtensor", "offtensor-overlap", "--warmup", "1", "--iters", "1",
                     "--overlap-variants", "1:64", "0:16", "--json", str(out)])
    assert rc == 0
    assert (_overlap.SPARE_THREADS, _overlap.STEP_PIECE_BYTES) == (spare, piece)  # restored
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {(r["scenario"], r["peer"]): r for r in result["results"]}
    assert set(rows) == {("infer-1x512", "resident"), ("infer-1x512", "offtensor"),
                         ("step-4x2048", "resident"), ("step-4x2048", "offtensor"),
                         ("step-4x2048", "offtensor-overlap")}
    for key, r in rows.items():
        assert r["status"] == "ok", (key, r["note"])
        assert r["median_ms"] > 0
        if r["peer"] != "resident":
            assert r["roofline_ms"] > 0 and r["ratio"] > 0, key
    for peer in ("offtensor", "offtensor-overlap"):
        assert rows[("step-4x2048", peer)]["grads_kept"] == 1.0

    overlap = rows[("step-4x2048", "offtensor-overlap")]
    assert overlap["overlap"]["pieces"] > 0
    same = overlap["same_time"]
    assert [(v["spare_threads"], v["piece_mib"]) for v in same["variants"]] == [(1, 64), (0, 16)]
    for v in same["variants"]:
        assert len(v["times_ms"]) == same["rounds"] and v["median_ms"] > 0
    assert len(same["alone_ms"]) == same["rounds"] and same["beside_ms"] == []  # no copies on the CPU
    assert "measured in turn with the plain step" in printed

    step = result["scenarios"]["step-4x2048"]
    assert step["optimizer_ms"] > 0
    peers = step["peers"]
    # The standard step adds the optimizer to fwd+bwd; the overlapped one takes their max.
    assert peers["offtensor"]["roofline_ms"] == pytest.approx(
        peers["offtensor"]["fwd_bwd_roofline_ms"] + step["optimizer_ms"])
    assert peers["offtensor-overlap"]["roofline_ms"] == pytest.approx(
        max(peers["offtensor-overlap"]["fwd_bwd_roofline_ms"], step["optimizer_ms"]))
    assert result["optimizer_speed"]["ratio"] > 0


def test_overlap_variants_are_checked():
    for bad in ("64", "1:inf", "x:64"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--overlap-variants", bad])
    assert bench.parse_args(["--overlap-variants", "0:16"]).overlap_variants == [(0, 16 * 2**20)]
