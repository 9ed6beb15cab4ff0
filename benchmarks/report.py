"""What the run prints and writes: the environment, the table, the step rooflines, the overlap
timeline in words, the targets with their verdicts, and the JSON file."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
from dataclasses import asdict
from typing import Any

import torch

from .measure import GiB, version
from .optimizer import format_optimizer_speed
from .results import Extras, Row
from .rooflines import COMPRESSED_PEERS, RELATIVE_TO, beside_copies_ms, compile_times
from .run import Run
from .scenarios import ModelShape, Scenario


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
    }
    for name in ("offtensor", "transformers", "accelerate", "diffusers", "peft", "psutil"):
        env[name] = version(name)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["driver"] = None
        with contextlib.suppress(Exception):
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False, capture_output=True, text=True, timeout=20).stdout.strip() or None
    return env


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _below_roofline(r: Row) -> bool:
    return (r.ratio is not None and r.ratio < 1.0 and r.peer != "resident" and r.peer not in RELATIVE_TO
            and r.peer not in COMPRESSED_PEERS)


def _table_row(r: Row, shapes: dict[str, str]) -> tuple[str, ...]:
    median = _fmt(r.median_ms, ".1f") if r.status == "ok" else r.status
    ratio = (_fmt(r.ratio, ".2f") + ("*" if _below_roofline(r) else "") + ("^" if r.peer in RELATIVE_TO else "")
             + ("+" if r.ratio_source == "in turn" else ""))
    target = f"<= {r.target:.2f} {r.verdict}" if r.target is not None and r.verdict else "-"
    if r.vram_cap_bytes is not None and r.verdict:
        target = f"VRAM < {r.vram_cap_bytes / GiB:.0f} GiB {r.verdict}"
    return (r.scenario, shapes.get(r.scenario, f"{r.batch}x{r.seq}"), r.peer, median, _fmt(r.roofline_ms, ".1f"),
            ratio, target, _fmt(None if r.peak_vram_bytes is None else r.peak_vram_bytes / GiB, ".2f"),
            _fmt(None if r.host_growth_bytes is None else r.host_growth_bytes / GiB, ".2f"),
            _fmt(None if r.streamed_bytes is None else r.streamed_bytes / 1e9, ".2f"), _fmt(r.vs_resident, ".2f"))


def format_table(rows: list[Row], bw: dict[str, Any], env: dict[str, Any], shape: ModelShape,
                 scenarios: list[Scenario]) -> str:
    """The results table: one line per row, with the batch x seq that ran (the scenario's name
    says the full-size one) and footnotes for what a cell leaves out."""
    head = ((f"--shape {shape.name}: " if shape.name else "")
            + f"{shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, bf16, "
            f"on {env.get('gpu', env['device'])}, "
            f"torch {env['torch']} | H2D {bw['h2d'] / 1e9:.1f} GB/s, D2H {bw['d2h'] / 1e9:.1f} GB/s "
            f"({bw['method']})")
    shapes = {s.name: s.shape for s in scenarios}
    table: list[tuple[str, ...]] = [("scenario", "batch x seq", "peer", "median ms", "roofline ms", "ratio", "target",
              "peak VRAM GiB", "host GiB", "streamed GB", "x resident")]
    table += [_table_row(r, shapes) for r in rows]
    # The counted bytes and the ratio to the resident time: only where some row has them (--shape).
    keep = [i for i in range(len(table[0])) if i < 9 or any(t[i] != "-" for t in table[1:])]
    table = [tuple(t[i] for i in keep) for t in table]
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines = [" | ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths, strict=True)))
             for t in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    foot = ["batch x seq: what ran (xN: micro-batches per timed iteration; the median is per micro-batch)."]
    if len(keep) > 9:
        foot.append("streamed GB: host-to-device bytes per micro-batch of the timed iterations, counted (offtensor."
                    "summary loads x each scope's host bytes); x resident: the median over the resident row's. "
                    "An offtensor-vram* row's roofline is max(resident, those bytes / H2D, its gradients / D2H).")
    if any(not r.valid_training for r in rows):
        foot.append("no roofline or ratio for a training row that kept only part of its gradients: "
                    "its time is not a training step's (see the notes).")
    for peer, other in RELATIVE_TO.items():
        if any(r.peer == peer and r.ratio is not None for r in rows):
            foot.append(f"^ {peer}: its ratio is to the {other} row's time in the same scenario (the "
                        "'roofline ms' column shows that time), not to the roofline.")
    if any(r.ratio_source == "in turn" for r in rows):
        foot.append("+ its ratio is the overlapped step measured in turn with AdamW beside the step's copies, "
                    "to max(fwd+bwd, that AdamW time) (the 'roofline ms' column): see 'measured in turn' above.")
    if any(_below_roofline(r) for r in rows):
        foot.append("* below 1: faster than the resident model, which bounds every peer; that is timing "
                    "noise (few iterations, a busy host), so the other ratios of this run are that noisy too.")
    return "\n".join([head, *lines, *foot])


def format_step_breakdown(name: str, e: dict[str, Any]) -> str:
    """One line: the terms of a step scenario's roofline and each peer's roofline."""
    peers = e["peers"]
    parts = [f"compute {_fmt(e['compute_ms'], '.1f')} ms"]
    h2ds = {p: v.get("h2d_ms") for p, v in peers.items()}
    if len(set(h2ds.values())) == 1:
        parts.append(f"h2d {_fmt(next(iter(h2ds.values())), '.1f')} ms")
    else:
        parts += [f"h2d {_fmt(v, '.1f')} ms ({p})" for p, v in h2ds.items()]
    parts.append(f"d2h {_fmt(e.get('d2h_ms'), '.1f')} ms")
    parts.append(f"optimizer {_fmt(e['optimizer_ms'], '.1f')} ms")
    parts += [f"optimizer in turn with {p}'s steps {v['optimizer_ms']:.1f} ms" for p, v in peers.items()
              if v.get("optimizer_ms") is not None]
    if e.get("optimizer_beside_copies_ms") is not None:
        parts.append(f"optimizer beside the step's copies {e['optimizer_beside_copies_ms']:.1f} ms")
    rl = ", ".join(f"{p} {_fmt(v['roofline_ms'], '.1f')} ms ({v['formula']})" for p, v in peers.items())
    phases = ", ".join(f"{p} {v['phase_roofline_ms']:.1f} ms" for p, v in peers.items() if v.get("phase_roofline_ms"))
    return f"  {name}: {', '.join(parts)} -> roofline {rl}" + (
        f"; forward and backward bounded each on its own: {phases}" if phases else "")


def format_phases(name: str, e: dict[str, Any]) -> list[str]:
    """Each offtensor row's phases: measured, and bounded on its own (Note [shape rooflines])."""
    lines = []
    for peer, f in e.get("rows", {}).items():
        measured = f.get("measured_phases_ms") or {}
        if not f["phases"] or not measured:
            continue
        parts = []
        for phase, b in f["phases"].items():
            copies = ", ".join(f"{what} {b[what + '_ms']:.1f}" for what in ("h2d", "d2h") if b[what + "_bytes"])
            parts.append(f"{phase} {_fmt(measured.get(phase), '.1f')} ms (bound {b['bound_ms']:.1f}: resident "
                         f"{_fmt(b['resident_ms'], '.1f')}" + (f", {copies}" if copies else "") + ")")
        total = f.get("phase_roofline_ms")
        got = sum(measured.get(p, 0.0) for p in f["phases"])
        lines.append(f"  {name}/{peer}: " + "; ".join(parts)
                     + (f" -> phase-aware roofline {total:.1f} ms, measured {got:.1f} ms = {got / total:.2f}x"
                        if total else "")
                     + f"; floor max(resident, copies {f['copies_ms']:.1f}) = {f['floor_ms']:.1f} ms")
    return lines


def format_same_time(r: Row, fwd_bwd_ms: float | None) -> str:
    """The overlapped step against the plain optimizer step measured in turn with it."""
    st = r.same_time or {}
    if "error" in st:
        return f"  {r.peer}/{r.scenario} measured in turn with the plain step: {st['error']}"
    fb = fwd_bwd_ms or 0.0
    alone, spared, every = st["alone_median_ms"], st["beside_median_ms"], st.get("beside_all_median_ms")
    beside = beside_copies_ms(st)

    def listed(ts: list[float]) -> str:
        return ", ".join(f"{t:.0f}" for t in ts)

    lines = [f"  {r.peer}/{r.scenario} measured in turn with the plain step ({st['rounds']} rounds of "
             f"{st['steps']} steps after {st.get('warmup_steps', 0)} untimed; medians): "
             f"AdamW alone {alone:.1f} ms ({listed(st['alone_ms'])})"
             + (f", beside the step's copies {spared:.1f} ms ({listed(st['beside_ms'])}; "
                f"{st['beside_threads']} threads)" if spared else "")
             + (f" and {every:.1f} ms ({listed(st['beside_all_ms'])}; {st['beside_all_threads']} threads)"
                if every else "")]
    for v in st["variants"]:
        m = v["median_ms"]
        lines.append(f"    {v['spare_threads']} spare threads, {v['piece_mib']:.0f} MiB pieces"
                     + (f", device share {v['device_share']:g}" if v.get("device_share") else "")
                     + (f", clipped to norm {v['max_grad_norm']:g}" if v.get("max_grad_norm") else "")
                     + f": {m:.1f} ms "
                     f"({listed(v['times_ms'])}) = {m / max(fb, alone):.2f}x max(fwd+bwd, AdamW alone)"
                     + (f", {m / max(fb, beside):.2f}x max(fwd+bwd, AdamW beside copies)" if beside else "")
                     + (f"; worker busy {v['worker_busy_median_ms']:.1f} ms of it"
                        if v.get("worker_busy_median_ms") is not None else ""))
    return "\n".join(lines)


def format_timeline(r: Row) -> str:
    """The last timed step's OverlapReport in words: when each scope was handed to the
    optimizer worker, when its gradients had landed on the host, when it was stepped."""
    o = r.overlap or {}
    lines = [(f"overlap timeline of {r.peer}/{r.scenario} (the last timed step; ms since backward_and_step "
              "was called):"),
             (f"  backward returned at {o['backward_ms']:.0f} ms; every parameter was stepped by "
              f"{o['total_ms']:.0f} ms"),
             (f"  the optimizer worker (leaving {o['spare_threads']} thread(s) spare, pieces of <= "
              f"{o['piece_bytes'] / 2**20:.0f} MiB) was busy {o['worker_busy_ms']:.0f} ms in {o['pieces']} "
              f"pieces ({o.get('all_thread_pieces', 0)} on every thread, a thread waiting for them; "
              f"{o.get('device_pieces', 0)} stepped on the device, device share {o.get('device_share', 0):g}); "
              f"{o['early_pieces']} pieces were handed over before their scope's backward ended; "
              f"{o['rest_params']} parameters (outside the worker's scopes) were stepped after backward")]
    lines += [f"  scope {s['scope']}: handed to the optimizer at {s['queued_ms']:.0f} ms, grads landed "
              f"{s['started_ms']:.0f} ms, stepped by {s['stepped_ms']:.0f} ms" for s in o["scopes"]]
    if not o["scopes"]:
        lines.append("  no scope was stepped during backward")
    return "\n".join(lines)


def format_targets(rows: list[Row], extras: Extras, device: torch.device, quick: bool) -> str:
    """Every target of docs/benchmarks.md this run measured, with its verdict."""
    lines = [f"  {r.peer}/{r.scenario}: ratio {r.ratio:.2f}"
             + (" (measured in turn with AdamW beside the step's copies)" if r.ratio_source == "in turn" else "")
             + f", target <= {r.target:.2f}: {r.verdict}"
             for r in rows if r.verdict is not None and r.ratio is not None and r.target is not None]
    lines += [f"  {r.peer}/{r.scenario}: peak VRAM {r.peak_vram_bytes / GiB:.2f} GiB, target < "
              f"{r.vram_cap_bytes / GiB:.0f} GiB (the cap): {r.verdict}"
              for r in rows if r.vram_cap_bytes is not None and r.verdict and r.peak_vram_bytes is not None]
    for name, speed in (("optimizer_speed", extras.optimizer_speed),
                        ("optimizer_speed_fp32", extras.optimizer_speed_fp32)):
        if speed is not None:
            lines.append("  " + format_optimizer_speed(name, speed))
    if extras.compiled:
        for c in compile_times(rows):
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
            lines.append(f"  compile time, offtensor/{c['scenario']}: {c['offtensor_ms'] / 1e3:.1f} s vs resident "
                         f"{c['resident_ms'] / 1e3:.1f} s (first call less a steady one): ratio {ratio}, "
                         f"target <= {c['target']}: {c['verdict']}")
    if not lines:
        return ""
    head = "targets:"
    if quick or device.type != "cuda":
        head += (" (a --quick or CPU run: nothing crosses PCIe and the model is tiny, so these verdicts "
                 "exercise the benchmark, they say nothing of offtensor's speed)")
    return "\n".join([head, *lines])


def json_result(run: Run, *, env: dict[str, Any], interrupted: bool, args: dict[str, Any], shape: ModelShape,
                bw: dict[str, Any], scenarios: list[Scenario], rooflines: dict[str, Any],
                table: list[Row]) -> dict[str, Any]:
    """Every number of the run as plain data: what --json writes and --plot draws."""
    extras = run.extras
    result = {
        "environment": env,
        "interrupted": interrupted,
        "args": args,
        "model": {**asdict(shape), "dtype": "bfloat16", "attn_implementation": "sdpa",
                  "variants": {k: asdict(v) for k, v in run.variant_bytes.items()}},
        "bandwidth": bw,
        "optimizer_speed": extras.optimizer_speed,
        "optimizer_speed_fp32": extras.optimizer_speed_fp32,
        "plain_optimizer": extras.plain_adamw,
        "scenarios": {s.name: {**asdict(s), **rooflines[s.name]} for s in scenarios},
        "setups": run.setups,
        "results": [asdict(r) for r in table],
    }
    # Through JSON and back: --plot then draws exactly what a --json file holds.
    return json.loads(json.dumps(result, default=str))


def write_json(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


def print_summary(table: list[Row], rooflines: dict[str, dict[str, Any]], run: Run, *, bw: dict[str, Any],
                  env: dict[str, Any], shape: ModelShape, scenarios: list[Scenario], device: torch.device,
                  quick: bool) -> None:
    """Everything after the runs: notes, step rooflines, overlap timelines, targets, the table."""
    notes = [f"  {r.peer}/{r.scenario}: {r.note}" for r in table if r.note]
    notes += [f"  {s}: {e['note']}" for s, e in rooflines.items() if e.get("note")]
    if notes:
        print("notes:\n" + "\n".join(notes))
    steps = [format_step_breakdown(s, e) for s, e in rooflines.items() if "peers" in e]
    if steps:
        print("step rooflines:\n" + "\n".join(steps))
    phases = [line for s, e in rooflines.items() for line in format_phases(s, e)]
    if phases:
        print("per-phase rooflines (ms per micro-batch; bound = max(resident phase, its copies / bandwidth)):\n"
              + "\n".join(phases))
    for r in table:
        if not r.overlap:
            continue
        print(format_timeline(r))
        entry = rooflines.get(r.scenario, {}).get("peers", {}).get(r.peer, {})
        host = entry.get("host_roofline_ms")
        if host and r.median_ms is not None:
            print(f"  {r.peer}/{r.scenario}: {r.median_ms:.1f} ms = {r.median_ms / host:.2f}x "
                  f"max(fwd+bwd, optimizer beside the step's copies) = {host:.1f} ms")
        if r.same_time:
            print(format_same_time(r, entry.get("fwd_bwd_roofline_ms")))
    targets = format_targets(table, run.extras, device, quick)
    if targets:
        print(targets)
    print()
    print(format_table(table, bw, env, shape, scenarios), flush=True)
