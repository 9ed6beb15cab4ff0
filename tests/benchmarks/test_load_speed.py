"""`python -m benchmarks load-speed --quick` runs on the CPU: every measurement is made in fresh
processes and every loaded and wrapped parameter equals the checkpoint's tensor. Timings are not
asserted."""

from __future__ import annotations

import json

import benchmarks as bench
from benchmarks.load_speed import KINDS, RATIOS


def test_quick_load_speed_measures_every_kind_and_loads_the_checkpoint_exactly(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert bench.main(["load-speed", "--quick", "--runs", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "checks: every loaded and wrapped parameter equals the checkpoint's tensor" in printed, printed
    record = json.loads(out.read_text())
    assert set(record["rows"]) == set(KINDS)
    for kind, row in record["rows"].items():
        assert len(row["seconds"]) == 1 and row["median_s"] > 0, kind
        assert row["equal"] is (True if kind in ("offtensor-cold", "offtensor-warm", "wrap") else None), kind
    assert set(record["ratios"]) == set(RATIOS) and all(r > 0 for r in record["ratios"].values())
    assert not list(tmp_path.glob("*.safetensors"))  # the checkpoint is deleted
