"""Pictures of the benchmark (`--plot DIR`, and the subcommand `plot FILE... --out DIR`): the
results of a run (each peer's median time against its roofline, and its peak device memory,
per scenario), the optimizer worker's timeline of the overlapped step, and one training step's
timeline from `profile-step --plot DIR`. docs/benchmarks.md, Pictures, shows them.

Drawn from the same data the report writes (a `--json` file's dict, or the `step_timeline.json`
that `profile-step --plot` writes beside its picture), so an old run can be drawn again.
matplotlib is optional (`pip install 'offtensor[plot]'`) and imported only when a picture is
drawn.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .peers import PEER_NAMES

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RESULTS_PNG = "bench_results.png"
OVERLAP_PNG = "bench_overlap.png"
TIMELINE_PNG = "step_timeline.png"
TIMELINE_JSON = "step_timeline.json"

GiB = 2**30


def missing_matplotlib() -> str | None:
    """None when matplotlib imports; otherwise what to install, for an argument error."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed: pip install 'offtensor[plot]'"
    return None


# Note [figures without pyplot]
# Figures are made with matplotlib.figure.Figure and drawn by the Agg canvas directly, not through
# pyplot: no global backend is switched (the benchmark may run inside a notebook or beside a GUI
# backend), no figure is left registered in pyplot's list, and no display is needed.
def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out_dir: str | os.PathLike[str], name: str) -> Path:
    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / name
    fig.savefig(path, dpi=110)
    return path


def _peer_color(peer: str) -> str:
    """The same color for a peer in every panel (matplotlib's default cycle)."""
    return f"C{PEER_NAMES.index(peer) % 10}" if peer in PEER_NAMES else "grey"


def _short(note: str, width: int = 60) -> str:
    note = " ".join(note.split())
    return note if len(note) <= width else note[: width - 3] + "..."


# ---- the results of a run ------------------------------------------------------------------------


def _bar_label(r: dict[str, Any]) -> str:
    """Time, ratio and verdict, as the table has them (`*`: an offloader below its roofline)."""
    label = f" {r['median_ms']:.1f} ms"
    if r.get("ratio") is not None:
        below = r["ratio"] < 1.0 and r["peer"] != "resident"
        label += f", {r['ratio']:.2f}x roofline" + ("* (below it: timing noise)" if below else "")
    elif r.get("grads_kept") is not None and r["grads_kept"] < 1.0:
        label += " (kept no .grad: not a training step)"
    if r.get("verdict"):
        label += f" ({r['verdict']} <= {r['target']:.2f})"
    return label


def _time_panel(ax: Axes, scenario: str, shape: str, rows: list[dict[str, Any]]) -> None:
    """One bar per peer: its median time; a black tick at its roofline; the ratio written
    after the bar. Rows without a time say why in place of the bar."""
    times = [r["median_ms"] for r in rows if r["status"] == "ok" and r.get("median_ms") is not None]
    lines = [r["roofline_ms"] for r in rows if r.get("roofline_ms") is not None]
    right = max(times + lines, default=1.0)
    for y, r in enumerate(rows):
        if r["status"] != "ok" or r.get("median_ms") is None:
            ax.text(0, y, f" {r['status']}: {_short(r.get('note', ''))}", va="center", fontsize=8, color="dimgrey")
            continue
        ax.barh(y, r["median_ms"], height=0.6, color=_peer_color(r["peer"]))
        if r.get("roofline_ms") is not None:
            ax.plot([r["roofline_ms"]] * 2, [y - 0.4, y + 0.4], color="black", lw=2.5)
        ax.text(max(r["median_ms"], r.get("roofline_ms") or 0.0), y, _bar_label(r), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["peer"] for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first peer (resident) on top
    ax.set_xlim(0, right * 1.6)  # room for the labels after the bars
    ax.set_title(f"{scenario} ({shape})", loc="left", fontsize=10)
    ax.set_xlabel("median ms" + (" per micro-batch" if len(shape.split()) > 1 else ""), fontsize=8)


def _vram_panel(ax: Axes, rows: list[dict[str, Any]]) -> None:
    """Each peer's peak device memory (GiB)."""
    peaks = [r.get("peak_vram_bytes") for r in rows]
    for y, (r, p) in enumerate(zip(rows, peaks, strict=True)):
        if p is not None:
            ax.barh(y, p / GiB, height=0.6, color=_peer_color(r["peer"]), alpha=0.6)
            ax.text(p / GiB, y, f" {p / GiB:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [""] * len(rows))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max((p for p in peaks if p is not None), default=GiB) / GiB * 1.35)
    ax.set_xlabel("peak VRAM GiB", fontsize=8)


def _title(result: dict[str, Any]) -> str:
    env, model, args = result["environment"], result.get("model", {}), result.get("args", {})
    where = env.get("gpu") or env.get("device", "?")
    title = (f"offtensor benchmark: {model.get('layers', '?')} layers, hidden {model.get('hidden', '?')}, "
             f"on {where}, torch {env.get('torch', '?')}, {env.get('date', '')}")
    if args.get("quick") or env.get("device", "cpu").startswith("cpu"):
        title += "\na --quick or CPU run: nothing crosses PCIe, the numbers only show that the benchmark runs"
    if result.get("interrupted"):
        title += "\ninterrupted: the peers measured so far"
    if not _has_vram(result):
        title += f"\nno peak VRAM panels: device memory is measured on CUDA only (this run: {env.get('device')})"
    return title + "\nbar: median time; black tick: roofline; label: ratio to the roofline"


def _has_vram(result: dict[str, Any]) -> bool:
    return any(r.get("peak_vram_bytes") is not None for r in result["results"])


def results_figure(result: dict[str, Any]) -> Figure:
    """A row of two panels per scenario: times against rooflines, and peak device memory
    (CUDA runs only: a CPU run has none)."""
    rows = result["results"]
    names = [s for s in result["scenarios"] if any(r["scenario"] == s for r in rows)]
    if not names:
        raise ValueError("plot: the results hold no rows to draw")
    heights = [max(2, sum(r["scenario"] == s for r in rows)) for s in names]
    vram = _has_vram(result)
    fig = _figure(13 if vram else 11, 1.4 + 0.42 * sum(heights) + 0.6 * len(names))
    grid = fig.add_gridspec(len(names), 2 if vram else 1, width_ratios=(4, 1) if vram else (1,),
                            height_ratios=heights)
    for i, name in enumerate(names):
        s = result["scenarios"][name]
        mine = [r for r in rows if r["scenario"] == name]
        shape = f"{s['batch']}x{s['seq']}" + (f" x{s['micro_batches']}" if s.get("micro_batches", 1) > 1 else "")
        _time_panel(fig.add_subplot(grid[i, 0]), name, shape, mine)
        if vram:
            _vram_panel(fig.add_subplot(grid[i, 1]), mine)
    fig.suptitle(_title(result), fontsize=9, x=0.01, ha="left")
    return fig


def overlap_figure(result: dict[str, Any]) -> Figure | None:
    """The optimizer worker's timeline of the last overlapped step (the OverlapReport the run
    keeps): for each scope, from handover to its grads landing, then to its last step. None
    when the run has no overlapped step."""
    rows = [r for r in result["results"] if r.get("overlap")]
    if not rows:
        return None
    fig = _figure(11, 1.2 + sum(0.9 + 0.3 * len(r["overlap"]["scopes"]) for r in rows))
    axes = fig.subplots(len(rows), 1, squeeze=False)[:, 0]
    for ax, r in zip(axes, rows, strict=True):
        o = r["overlap"]
        for y, s in enumerate(o["scopes"]):
            ax.barh(y, s["started_ms"] - s["queued_ms"], left=s["queued_ms"], height=0.6, color="C7", alpha=0.5)
            ax.barh(y, s["stepped_ms"] - s["started_ms"], left=s["started_ms"], height=0.6, color="C2")
        ax.axvline(o["backward_ms"], color="black", ls="--", lw=1)
        ax.text(o["backward_ms"], -0.6, "backward returned ", fontsize=8, va="bottom", ha="right")
        ax.set_yticks(range(len(o["scopes"])), [s["scope"] for s in o["scopes"]], fontsize=8)
        ax.set_ylim(len(o["scopes"]) - 0.5, -1.2)
        ax.set_xlim(0, max(o["total_ms"], o["backward_ms"]) * 1.05)
        ax.set_xlabel("ms since backward_and_step was called", fontsize=8)
        ax.set_title(f"{r['peer']} / {r['scenario']}: the last timed step's optimizer worker "
                     f"(grey: handed over, waiting for its grads; green: stepping); busy "
                     f"{o['worker_busy_ms']:.0f} ms in {o['pieces']} pieces", loc="left", fontsize=9)
    return fig


def plot_results(result: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write bench_results.png (and bench_overlap.png when the run has an overlapped step)
    for a run's result dict (what --json writes) into out_dir; the paths written."""
    paths = [_save(results_figure(result), out_dir, RESULTS_PNG)]
    overlap = overlap_figure(result)
    if overlap is not None:
        paths.append(_save(overlap, out_dir, OVERLAP_PNG))
    return paths


# ---- one training step's timeline (profile-step) -------------------------------------------------


def _lane_rows(timeline: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(lane["row"] for lane in timeline["lanes"]))


def _draw_lane(ax: Axes, y: int, lane: dict[str, Any], color: str, least: float) -> None:
    """One lane's spans; a span's label only where it is wider than `least` ms."""
    spans = lane["spans"]
    if not spans:
        if lane.get("note"):
            ax.text(0.01, y, lane["note"], va="center", fontsize=8, color="dimgrey",
                    transform=ax.get_yaxis_transform())
        return
    ax.broken_barh([(a, b - a) for a, b in spans], (y - 0.3, 0.6), color=color, label=lane["what"] or None)
    for (a, b), text in zip(spans, lane.get("labels") or [], strict=False):
        if text and b - a > least:
            ax.text((a + b) / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True)


def timeline_figure(timeline: dict[str, Any]) -> Figure:
    """Lanes (main thread, copies in, kernels, copies out, optimizer worker) over one step."""
    rows = _lane_rows(timeline)
    fig = _figure(13, 1.6 + 0.55 * len(rows))
    ax = fig.add_subplot()
    end = timeline["step_ms"]
    for i, lane in enumerate(timeline["lanes"]):
        _draw_lane(ax, rows.index(lane["row"]), lane, f"C{i % 10}", least=0.03 * end)
    for m in timeline["markers"]:
        ax.axvline(m["at_ms"], color="black", ls="--", lw=0.8)
        left = m["at_ms"] > 0.8 * end  # near the end: the label to the left of its line
        ax.text(m["at_ms"], -0.55, f" {m['label']} " if left else f" {m['label']}", fontsize=7,
                va="bottom", ha="right" if left else "left")
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.9)
    ax.set_xlim(0, end)
    ax.set_xlabel("ms since the step began", fontsize=8)
    if any(lane["what"] and lane["spans"] for lane in timeline["lanes"]):
        fig.legend(loc="outside lower center", ncol=4, fontsize=7)
    ax.set_title(timeline["title"], loc="left", fontsize=9)
    return fig


def plot_timeline(timeline: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write step_timeline.png and the data it was drawn from (step_timeline.json)."""
    path = _save(timeline_figure(timeline), out_dir, TIMELINE_PNG)
    with open(Path(out_dir) / TIMELINE_JSON, "w") as f:
        json.dump(timeline, f, indent=1)
    return [path, Path(out_dir) / TIMELINE_JSON]


# ---- the `plot` subcommand -----------------------------------------------------------------------


def plot_file(path: str, out_dir: str | os.PathLike[str]) -> list[Path]:
    """The pictures of a --json file of the benchmark or of a step_timeline.json."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "results" in data and "scenarios" in data:
        return plot_results(data, out_dir)
    if isinstance(data, dict) and data.get("kind") == "step_timeline":
        return [_save(timeline_figure(data), out_dir, TIMELINE_PNG)]
    raise SystemExit(f"plot: {path} is neither a benchmark --json file nor a {TIMELINE_JSON} "
                     "(written by `python -m benchmarks profile-step --plot DIR`)")


def main(name: str, argv: list[str]) -> int:
    """Draw the pictures of a benchmark --json file (or of a step timeline) again."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=(
        f"Draw {RESULTS_PNG} and {OVERLAP_PNG} from a benchmark --json file, or {TIMELINE_PNG} "
        f"from a {TIMELINE_JSON} (profile-step --plot)."))
    ap.add_argument("file", help="a bench.json (--json) or a step_timeline.json")
    ap.add_argument("--out", required=True, help="directory for the PNG files")
    args = ap.parse_args(argv)
    why = missing_matplotlib()
    if why is not None:
        ap.error(why)
    for written in plot_file(args.file, args.out):
        print(f"plot: wrote {written}")
    return 0
