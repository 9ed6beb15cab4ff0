"""The several-GPU benchmark's results on rank 0: each scenario's row over all the ranks, the
targets of issue 13 with what they compare against, the one-GPU baseline (measured or read
from a single-GPU `--json` file), the table and the JSON (docs/benchmarks.md, Several GPUs)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from typing import Any

from .measure import GiB
from .results import MultiRow, RankResult
from .scenarios import ModelShape, Scenario

# scenario kind -> (the row's field, comparison, bound, what it compares against). Judged for
# the peers whose MultiPeer.offtensor is set; every other row shows the same ratios, unjudged.
MULTI_TARGETS: dict[str, tuple[str, str, float, str]] = {
    "infer": ("floor_ratio", "<=", 0.60,
              "step time / the single-GPU PCIe floor (wrapped bytes / one link's host-to-device "
              "bandwidth, measured on rank 0 alone); reaching it needs sharded loading"),
    "step": ("speedup", ">=", 1.90, "tokens/s of all ranks / tokens/s of one GPU with offtensor "
             "(the same per-rank shape)"),
}
_COLUMN = {"speedup": "x 1 GPU", "floor_ratio": "/ floor"}  # the table's name of each judged field


def tokens_per_s(batch: int, seq: int, ms: float) -> float:
    return batch * seq / (ms / 1e3)


def load_baseline(path: str, scenarios: list[Scenario], shape: ModelShape) -> dict[str, dict[str, Any]]:
    """The `offtensor` rows of a single-GPU benchmark's --json file, for the scenarios of this
    run; SystemExit naming the mismatch when that file ran another model or shape."""
    try:
        with open(path) as f:
            data = json.load(f)
        model, rows = data["model"], data["results"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"bench: --baseline {path}: not a single-GPU benchmark --json file ({exc})") from exc
    theirs = {k: model.get(k) for k in asdict(shape)}
    if theirs != asdict(shape):
        raise SystemExit(f"bench: --baseline {path} ran the model {theirs}, this run {asdict(shape)}; run the "
                         "single-GPU benchmark with the same --layers (and --quick) or use --baseline measure")
    out: dict[str, dict[str, Any]] = {}
    for s in scenarios:
        row = next((r for r in rows if r.get("scenario") == s.name and r.get("peer") == "offtensor"), None)
        if row is None or row.get("status") != "ok" or not row.get("median_ms"):
            out[s.name] = {"error": f"no ok offtensor/{s.name} row in {path}"}
        elif (row["batch"], row["seq"]) != (s.batch, s.seq):
            raise SystemExit(f"bench: --baseline {path}: offtensor/{s.name} ran {row['batch']}x{row['seq']}, this "
                             f"run {s.batch}x{s.seq} per rank; use the same --quick setting")
        else:
            out[s.name] = {"median_ms": row["median_ms"], "peak_vram_bytes": row.get("peak_vram_bytes"),
                           "tokens_per_s": tokens_per_s(s.batch, s.seq, row["median_ms"]), "source": path}
    return out


def _sum_by_node(results: list[RankResult], field: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        value = getattr(r, field)
        if value is not None:
            out[r.node] = out.get(r.node, 0) + value
    return out


def _judge(row: MultiRow, kind: str, judged: bool) -> None:
    if kind not in MULTI_TARGETS or not judged:
        return
    field, op, bound, _ = MULTI_TARGETS[kind]
    value = getattr(row, field)
    if value is None:
        return
    row.target = f"{_COLUMN[field]} {op} {bound:.2f}"
    row.verdict = "PASS" if (value <= bound if op == "<=" else value >= bound) else "FAIL"


def make_row(peer: str, s: Scenario, results: list[RankResult], *, baseline: dict[str, Any] | None,
             floor_ms: float | None, judged: bool, grads_sharded: bool = False) -> MultiRow:
    """The row of `peer` in `s` from every rank's result (rank order)."""
    bad = [r for r in results if r.status != "ok"]
    row = MultiRow(s.name, peer, bad[0].status if bad else "ok", batch=s.batch, seq=s.seq, world=len(results),
                   how=results[0].how, ranks=[asdict(r) for r in results])
    row.note = "; ".join(dict.fromkeys(f"rank {r.rank}: {r.note}" if len(results) > 1 else r.note
                                       for r in results if r.note))
    row.host_growth_bytes = _sum_by_node(results, "host_growth_bytes")
    row.host_measure = results[0].host_measure
    row.node_used_growth_bytes = _sum_by_node(results, "node_used_growth_bytes")
    row.peak_vram_bytes = [r.peak_vram_bytes for r in results]
    kept = [r.grads_kept for r in results if r.grads_kept is not None]
    # Sharded: each trainable parameter's .grad lives on its one owner rank, so the ranks' shares add up.
    row.grads_kept = (sum(kept) if grads_sharded else min(kept)) if kept else None
    if bad:
        return row
    row.rank_median_ms = [statistics.median(r.times_ms) if r.times_ms else None for r in results]
    medians = [m for m in row.rank_median_ms if m is not None]
    if not medians:
        return row
    row.step_ms = max(medians)
    row.tokens_per_s = row.world * tokens_per_s(s.batch, s.seq, row.step_ms)
    if baseline and baseline.get("tokens_per_s"):
        row.speedup = row.tokens_per_s / baseline["tokens_per_s"]
    if s.kind == "infer" and floor_ms:
        row.floor_ratio = row.step_ms / floor_ms
    if row.grads_kept is None or row.grads_kept >= 1.0:
        _judge(row, s.kind, judged)
    return row


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _table_row(r: MultiRow, wrapped_bytes: int) -> tuple[str, ...]:
    host = max(r.host_growth_bytes.values()) if r.host_growth_bytes else None
    used = max(r.node_used_growth_bytes.values()) if r.node_used_growth_bytes else None
    vram = [v for v in r.peak_vram_bytes if v is not None]
    return (r.scenario, f"{r.batch}x{r.seq}", r.peer, _fmt(r.step_ms, ".1f") if r.status == "ok" else r.status,
            _fmt(r.tokens_per_s, ",.0f"), _fmt(r.speedup, ".2f"), _fmt(r.floor_ratio, ".2f"),
            f"{r.target} {r.verdict}" if r.verdict else "-", _gib(host),
            _fmt(host / wrapped_bytes if host is not None and wrapped_bytes else None, ".2f"), _gib(used),
            _gib(max(vram) if vram else None))


def format_multi_table(rows: list[MultiRow], wrapped_bytes: int) -> str:
    """One line per scenario and peer; footnotes say what each ratio compares against."""
    head: list[tuple[str, ...]] = [("scenario", "per rank", "peer", "step ms", "tokens/s", "x 1 GPU", "/ floor",
                                    "target", "host GiB/node", "host/W", "node used GiB", "peak VRAM GiB/rank")]
    table = head + [_table_row(r, wrapped_bytes) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines = [" | ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths, strict=True)))
             for t in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    measure = next((r.host_measure for r in rows if r.host_measure), "pss")
    foot = [
        "step ms: the slowest rank's median; tokens/s: all ranks together.",
        "x 1 GPU: tokens/s / one GPU's with offtensor at the same per-rank shape (the baseline line above).",
        "/ floor: step ms / the single-GPU PCIe floor (wrapped bytes W / rank 0's H2D bandwidth alone), inference.",
        f"host GiB/node: the sum over the node's ranks of each one's {measure.upper()} growth from before its model "
        "was built to the end of the scenario; host/W: that over W; node used GiB: MemTotal - MemAvailable growth "
        "(counts pinned driver buffers too, and every other process).",
    ]
    foot += [f"target of the offtensor peers, {_COLUMN[field]} {op} {bound:.2f}: {what}"
             for field, op, bound, what in MULTI_TARGETS.values()]
    return "\n".join([*lines, *foot])


def format_head(info: dict[str, Any]) -> str:
    """The lines above the table: ranks, model, bandwidth, the baseline and the floor."""
    shape, bw = info["model"], info["bandwidth"]
    at_once = bw.get("at_once_h2d") or []
    lines = [f"{info['world']} ranks on {len(info['nodes'])} node(s), {info['backend']}, {info['threads_per_rank']} "
             f"CPU threads per rank; {shape['layers']} layers, hidden {shape['hidden']}, bf16, on "
             f"{info['environment'].get('gpu', info['environment']['device'])}, torch {info['environment']['torch']}"]
    if bw.get("alone"):
        lines.append(f"H2D {bw['alone']['h2d'] / 1e9:.1f} GB/s on rank 0 alone ({bw['alone']['method']}); every "
                     f"rank at once: {', '.join(f'{x / 1e9:.1f}' for x in at_once)} GB/s "
                     f"(sum {sum(at_once) / 1e9:.1f})")
    if info.get("floor_ms"):
        lines.append(f"single-GPU PCIe floor of a forward: W = {info['wrapped_bytes'] / 2**20:,.1f} MiB / H2D alone = "
                     f"{info['floor_ms']:.1f} ms")
    lines.append(f"1-GPU baseline (offtensor, same per-rank shape): {info['baseline_source']}: " + (", ".join(
        f"{s} {_fmt(b.get('median_ms'), '.1f')} ms, {_fmt(b.get('tokens_per_s'), ',.0f')} tokens/s"
        if "error" not in b else f"{s} {b['error']}" for s, b in info["baseline"].items()) or "none"))
    return "\n".join(lines)


def multi_json(info: dict[str, Any], rows: list[MultiRow]) -> dict[str, Any]:
    result = {**info, "targets": {k: {"field": f, "op": op, "bound": b, "compared_to": what}
                                  for k, (f, op, b, what) in MULTI_TARGETS.items()},
              "results": [asdict(r) for r in rows]}
    return json.loads(json.dumps(result, default=str))


def print_multi(info: dict[str, Any], rows: list[MultiRow], quick: bool) -> None:
    notes = [f"  {r.peer}/{r.scenario}: {r.note}" for r in rows if r.note]
    if notes:
        print("notes:\n" + "\n".join(notes))
    if quick or info["backend"] != "nccl":
        print("(a --quick or CPU run: nothing crosses PCIe and the model is tiny, so the ratios and verdicts "
              "exercise the benchmark, they say nothing of offtensor's speed)")
    print()
    print(format_head(info))
    print(format_multi_table(rows, info.get("wrapped_bytes") or 0), flush=True)
