"""The rooflines (the fastest an offloader could be on this machine), each row's ratio to its
roofline, and the targets those ratios are judged against. docs/benchmarks.md defines them:

    roofline = max(time of the same scenario with the whole model resident on the device,
                   bytes that must cross PCIe / measured pinned bandwidth)

plus, for the full training steps, the CPU optimizer step: added for `loss.backward();
optimizer.step()`, overlapped (max) for `offtensor.backward_and_step`.

# Note [shape rooflines]
The --shape scenarios (Scenario.at_shape) judge each offtensor row against the bytes that peer
really moves (`Row.moved_bytes`: its scopes' host bytes, 1-byte values for fp8/int8), so a
compressed row has its own floor, max(resident, its bytes / bandwidth), not the bf16 one. Each
phase is bounded on its own, since no copy moves from the forward into the backward:

    forward  = max(resident forward,  moved / H2D)
    backward = max(resident backward, moved / H2D, trainable moved / D2H)   reloads for the
               recompute (activation checkpointing), gradients home
    step     = the resident's step (a LoRA step's AdamW on the device)

and the phase-aware roofline is their sum (issue 15): the training scenario train-1x4096 is
judged against it; inference and the LoRA step against max(resident, all copies / bandwidth),
the floor the issue's targets name. The full fine-tune step (its CPU AdamW has no measured term
here: a plain copy of 8B masters and their state does not fit beside them) has no roofline; its
target is offtensor-capped's peak VRAM under the cap.

# Note [optimizer term in turn]
The plain CPU AdamW that the standard step's roofline adds is measured once per dtype, before
the first step scenario (`Extras.plain_adamw`, in the first peer that runs one). The benchmark
host's CPU speed drifts by more than the targets' margins within one run (docs/benchmarks.md,
"One run of every issue-15 target"), so a roofline built on that early figure misjudges a step
timed minutes later. So each standard offtensor peer also runs one plain AdamW step after each
of its timed iterations (`Row.optimizer_in_turn_ms`), and its roofline's optimizer term is the
median of those; the early figure stays in the entry (`optimizer_ms`) and is used where a peer
has none (--shape, or the measurement failed). The overlapped peer's verdict is measured in turn
in its own way (measure_same_time).
"""

from __future__ import annotations

import statistics
from typing import Any

from .peers import STEP_PEERS, VRAM_PEERS
from .results import Extras, Row, VariantBytes
from .scenarios import Scenario

# (scenario kind, peer) -> the largest ratio to the roofline that meets the target.
TARGETS: dict[tuple[str, str], float] = {
    ("infer", "offtensor"): 1.03,
    ("train", "offtensor"): 1.10,
    ("frozen", "offtensor"): 1.05,
    ("step", "offtensor"): 1.10,
    ("step", "offtensor-overlap"): 1.15,
    # Against the all-streamed `offtensor` row of the same run, not a roofline (keeping half the
    # layers resident should about halve a transfer-bound pass).
    ("infer", "offtensor-budget"): 0.55,
    # Against the bf16 roofline (the `offtensor` row's: its bytes are bf16): fp8 moves half the
    # bytes, so a transfer-bound forward should take about half (issue 14).
    ("infer", "offtensor-fp8"): 0.55,
}
# Peers that move fewer bytes than the bf16 roofline counts (compressed weights): below 1 is
# their point, not timing noise.
COMPRESSED_PEERS = frozenset({"offtensor-fp8", "offtensor-int8"})
# --compile: the time to compile (the first call less a steady one) of offtensor against the
# resident model's, per scenario (issue 12).
COMPILE_TIME_TARGET = 1.2


def compile_times(rows: list[Row]) -> list[dict[str, Any]]:
    """Per scenario with a resident and an offtensor row: each one's compile time (its first
    call less its median iteration, in ms) and offtensor's ratio to the resident model's."""
    out = []
    for r in rows:
        if r.peer != "offtensor" or r.status != "ok" or r.first_call_ms is None or r.median_ms is None:
            continue
        resident = _ok_row(rows, r.scenario, "resident")
        if resident is None or resident.first_call_ms is None or resident.median_ms is None:
            continue
        ours = r.first_call_ms - r.median_ms * r.per_iteration
        theirs = resident.first_call_ms - resident.median_ms * resident.per_iteration
        ratio = ours / theirs if theirs > 0 else None
        out.append({"scenario": r.scenario, "offtensor_ms": ours, "resident_ms": theirs, "ratio": ratio,
                    "target": COMPILE_TIME_TARGET,
                    "verdict": None if ratio is None else "PASS" if ratio <= COMPILE_TIME_TARGET else "FAIL"})
    return out


# Peers whose ratio is to another peer's time in the same scenario, not to the roofline.
RELATIVE_TO = {"offtensor-budget": "offtensor"}
# --compile: issue 12's targets, against the compiled resident model (training is held closer
# than in eager mode, where the plain target allows for the stalls of uncompiled hooks).
COMPILED_TARGETS = {**TARGETS, ("train", "offtensor"): 1.05}
# Targets that are about moving fewer bytes: they hold for the transfer-bound scenario the
# issues name (infer-1x512). In a compute-bound one these peers are judged by nothing (their
# ratio is still printed: fp8 costs its dequantization kernels there, a budget saves little).
BYTES_TARGETS = {"offtensor-budget": "infer-1x512", "offtensor-fp8": "infer-1x512"}
# --shape scenarios (Note [shape rooflines]): the ratio to the row's own floor.
SHAPE_TARGETS: dict[tuple[str, str], float] = {
    ("infer", "offtensor"): 1.03,
    ("train", "offtensor"): 1.10,  # to the phase-aware roofline (issue 15)
    ("frozen-step", "offtensor"): 1.05,
    ("infer", "offtensor-fp8"): 1.05,  # to the fp8 floor (issue 14)
    ("frozen-step", "offtensor-fp8"): 1.05,  # to max(resident, fp8 floor)
    ("infer", "offtensor-int8"): 1.05,
    ("frozen-step", "offtensor-int8"): 1.05,
    # Policy(vram_budget=N GiB) (issue 31): to max(resident, the bytes it streamed / bandwidth),
    # the bytes counted (Note [budget floors]); a budget holding the whole model streams nothing.
    **{(kind, peer): 1.02 if peer == "offtensor-vram-all" else 1.05
       for kind in ("infer", "train", "frozen-step") for peer in VRAM_PEERS},
}
# Note [budget floors]
# Under Policy(vram_budget=...) the kept scopes load once (inference, a frozen base) or once per
# step (trained ones, after the optimizer), and a backward carries scopes into the next forward:
# how many bytes a pass moves depends on the run. So an offtensor-vram* row's floor is counted, not
# derived from its scopes' bytes: the timed iterations' loads (ScopeSummary.loads) times each
# scope's host bytes, per iteration (Row.streamed_bytes, streamed.LoadCounter), and its gradients
# sent home; floor = max(resident, those copies / bandwidth). No phase-aware roofline: which phase
# the loads land in is the schedule's choice.

# issue 15: backward_and_step <= 1.15x max(forward+backward, AdamW beside the step's copies), both
# measured in turn in one run (measure_same_time).
IN_TURN_TARGET = 1.15
# (h2d, d2h) per phase, as multiples of a row's (moved bytes, trainable moved bytes).
PHASE_COPIES: dict[str, dict[str, tuple[int, int]]] = {
    "infer": {"forward": (1, 0)},
    "train": {"forward": (1, 0), "backward": (1, 1)},
    "frozen": {"forward": (1, 0), "backward": (1, 1)},
    "frozen-step": {"forward": (1, 0), "backward": (1, 1), "step": (0, 0)},
    "full": {"forward": (1, 0), "backward": (1, 1), "step": (0, 0)},
    "step": {"forward": (1, 0), "backward": (1, 1), "step": (0, 0)},
}


def _ok_row(rows: list[Row], scenario: str, peer: str) -> Row | None:
    return next((r for r in rows if r.scenario == scenario and r.peer == peer and r.status == "ok"), None)


def _step_compute_term(s: Scenario, rows: list[Row]) -> tuple[float | None, str | None]:
    """The fwd+bwd compute term of a step roofline and where it comes from."""
    resident_train = _ok_row(rows, "train-4x2048", "resident")
    resident_own = _ok_row(rows, s.name, "resident")
    own = resident_own.fwd_bwd_ms if resident_own else None
    # step32 runs its forward under autocast: its own resident fwd+bwd is the closer compute.
    if s.kind == "step32" and own is not None:
        return own, f"resident {s.name} forward+backward (autocast), measured alone"
    if resident_train is not None:
        return resident_train.median_ms, "resident train-4x2048 (per micro-batch)"
    if own is not None:
        return own, f"resident {s.name} forward+backward, measured alone"
    return None, None


def _peer_step_roofline(entry: dict[str, Any], vb: VariantBytes | None, bw: dict[str, Any], h2d_per_byte: float,
                        overlapped: bool, fwd: float | None, in_turn: list[float] | None) -> dict[str, Any]:
    """One offtensor peer's step roofline from the scenario's compute and optimizer terms; the
    optimizer term is the one measured in turn with the peer's steps, when it has one (Note
    [optimizer term in turn])."""
    compute, o, beside = entry["compute_ms"], entry["optimizer_ms"], entry["optimizer_beside_copies_ms"]
    p: dict[str, Any] = {}
    if in_turn:
        o = p["optimizer_ms"] = statistics.median(in_turn)
        p["optimizer_source"] = (f"the same plain AdamW, one step after each of this peer's {len(in_turn)} timed "
                                 "iterations (median)")
    if vb is not None:
        h2d, d2h = int(2 * vb.wrapped_bytes * h2d_per_byte), vb.wrapped_trainable_bytes
        p.update(h2d_bytes=h2d, d2h_bytes=d2h, h2d_ms=h2d / bw["h2d"] * 1e3, d2h_ms=d2h / bw["d2h"] * 1e3)
    terms = [t for t in (compute, p.get("h2d_ms"), p.get("d2h_ms")) if t is not None]
    fb = max(terms) if terms else None
    p["fwd_bwd_roofline_ms"] = fb
    if fb is None or o is None:
        p["roofline_ms"] = fb
    else:
        p["roofline_ms"] = max(fb, o) if overlapped else fb + o
    if overlapped and fb is not None and beside is not None:
        # The same with the optimizer as fast as it runs beside the step's own copies.
        p["host_roofline_ms"] = max(fb, beside)
    if not overlapped and o is not None and compute is not None and fwd is not None and "h2d_ms" in p:
        half = p["h2d_ms"] / 2  # each pass loads every weight once
        p["phase_roofline_ms"] = max(fwd, half) + max(compute - fwd, half, p["d2h_ms"]) + o
    p["formula"] = "max(fwd+bwd, optimizer)" if overlapped else "fwd+bwd + optimizer"
    return p


def step_roofline(s: Scenario, rows: list[Row], bw: dict[str, Any], vb: VariantBytes | None,
                  extras: Extras) -> dict[str, Any]:
    """The roofline of a full training step, per offtensor peer (they move different bytes and
    overlap the optimizer or not):

        fwd+bwd  = max(compute, h2d_ms, d2h_ms)     as train-4x2048, 1 micro-batch
        standard = fwd+bwd + optimizer_ms           loss.backward(); optimizer.step()
        overlap  = max(fwd+bwd, optimizer_ms)       offtensor.backward_and_step

    Beside these, for reading the results: `phase_roofline_ms` of the standard peers bounds
    forward and backward each on its own, max(fwd, h2d/2) + max(bwd, h2d/2, d2h) + optimizer,
    since no copy can move from the forward into the backward; `host_roofline_ms` of the
    overlapped peer takes the optimizer as fast as it runs beside the step's own copies (host
    memory bandwidth).
    """
    compute, source = _step_compute_term(s, rows)
    dtype = vb.dtype if vb else ("float32" if s.kind == "step32" else "bfloat16")
    opt = extras.plain_adamw.get(dtype, {})
    entry: dict[str, Any] = {"compute_ms": compute, "compute_source": source,
                             "optimizer_ms": opt.get("median_ms"),
                             "optimizer_source": f"fused torch.optim.AdamW on plain CPU {dtype} tensors "
                                                 "shaped as the wrapped parameters (median of 5, before the "
                                                 "first step scenario)",
                             "optimizer_beside_copies_ms": opt.get("beside_copies", {}).get("median_ms"),
                             "peers": {}}
    notes = []
    if compute is None:
        notes.append("no resident time: the fwd+bwd term is the transfer term only")
    if entry["optimizer_ms"] is None:
        notes.append("no optimizer time: " + opt.get("error", "not measured"))
    resident_own = _ok_row(rows, s.name, "resident")
    fwd = resident_own.fwd_ms if resident_own else None
    for peer, (h2d_per_byte, overlapped) in STEP_PEERS[s.kind].items():
        own = _ok_row(rows, s.name, peer)
        entry["peers"][peer] = _peer_step_roofline(entry, vb, bw, h2d_per_byte, overlapped, fwd,
                                                   own.optimizer_in_turn_ms if own else None)
    first = next(iter(entry["peers"].values()))
    for k in ("h2d_bytes", "d2h_bytes", "h2d_ms", "d2h_ms", "roofline_ms"):
        entry[k] = first.get(k)  # the scenario's headline: the first (standard) peer's
    entry["roofline_peer"] = next(iter(entry["peers"]))
    if notes:
        entry["note"] = "; ".join(notes)
    return entry


def _layer_roofline(s: Scenario, rows: list[Row], bw: dict[str, Any], vb: VariantBytes | None) -> dict[str, Any]:
    """An inference or accumulating-training scenario: max(resident time, transfer time)."""
    resident = _ok_row(rows, s.name, "resident")
    entry: dict[str, Any] = {"compute_ms": resident.median_ms if resident else None}
    if vb is not None:
        # Training re-loads every layer for the recompute in backward (checkpointing). A
        # frozen base needs only its frozen weights moved: the adapters can stay on the device.
        if s.kind == "infer":
            h2d, d2h = vb.wrapped_bytes, 0
        elif s.kind == "train":
            h2d, d2h = 2 * vb.wrapped_bytes, vb.wrapped_trainable_bytes
        else:
            h2d, d2h = 2 * (vb.wrapped_bytes - vb.wrapped_trainable_bytes), 0
        entry.update(h2d_bytes=h2d, d2h_bytes=d2h, h2d_ms=h2d / bw["h2d"] * 1e3, d2h_ms=d2h / bw["d2h"] * 1e3)
        entry["transfer_ms"] = max(entry["h2d_ms"], entry["d2h_ms"])
    terms = [t for t in (entry["compute_ms"], entry.get("transfer_ms")) if t is not None]
    entry["roofline_ms"] = max(terms) if terms else None
    entry["bound"] = (None if not terms else "transfer" if entry["roofline_ms"] == entry.get("transfer_ms")
                      else "compute")
    if entry["compute_ms"] is None:
        entry["note"] = "no resident time: roofline is the transfer term only"
    return entry


def _judge(r: Row, kind: str, roofline_ms: float | None, targets: dict[tuple[str, str], float] = TARGETS) -> None:
    """The row's roofline, ratio and verdict; none for a row that did not run or did not keep
    its gradients (its time is not a training step's)."""
    r.roofline_ms = r.ratio = r.target = r.verdict = r.ratio_source = None
    if r.status != "ok" or r.median_ms is None or not r.valid_training or not roofline_ms:
        return
    r.roofline_ms, r.ratio = roofline_ms, r.median_ms / roofline_ms
    r.target = targets.get((kind, r.peer))
    if targets is not SHAPE_TARGETS and BYTES_TARGETS.get(r.peer, r.scenario) != r.scenario:
        r.target = None
    if r.target is not None:
        r.verdict = "PASS" if r.ratio <= r.target else "FAIL"


def phase_bounds(kind: str, resident: dict[str, float] | None, moved: int, moved_grad: int,
                 bw: dict[str, Any]) -> dict[str, Any]:
    """Each phase's bound, max(the resident's time of that phase, its copies / bandwidth), and
    their sum: the phase-aware roofline (Note [shape rooflines])."""
    phases: dict[str, Any] = {}
    for phase, (h2d_x, d2h_x) in PHASE_COPIES.get(kind, {}).items():
        h2d_ms, d2h_ms = h2d_x * moved / bw["h2d"] * 1e3, d2h_x * moved_grad / bw["d2h"] * 1e3
        res = (resident or {}).get(phase)
        phases[phase] = {"resident_ms": res, "h2d_bytes": h2d_x * moved, "d2h_bytes": d2h_x * moved_grad,
                         "h2d_ms": h2d_ms, "d2h_ms": d2h_ms,
                         "bound_ms": max(t for t in (res, h2d_ms, d2h_ms) if t is not None)}
    known = bool(phases) and resident is not None and all(p in resident for p in phases)
    return {"phases": phases, "roofline_ms": sum(p["bound_ms"] for p in phases.values()) if known else None}


def _row_floors(s: Scenario, r: Row, resident: Row | None, bw: dict[str, Any]) -> dict[str, Any]:
    """An offtensor row's floors from the bytes it moves: max(resident, copies / bandwidth)
    and the phase-aware roofline, beside the phases it measured."""
    assert r.moved_bytes is not None
    moved, grads = r.moved_bytes, r.moved_grad_bytes or 0
    out = phase_bounds(s.kind, resident.phases_ms if resident else None, moved, grads, bw)
    out["phase_roofline_ms"] = out.pop("roofline_ms")
    h2d = sum(p["h2d_bytes"] for p in out["phases"].values())
    d2h = sum(p["d2h_bytes"] for p in out["phases"].values())
    if r.peer in VRAM_PEERS and r.streamed_bytes is not None:  # Note [budget floors]
        h2d, out["phase_roofline_ms"] = r.streamed_bytes, None
        out["counted_h2d_bytes"] = h2d
    copies = max(h2d / bw["h2d"], d2h / bw["d2h"]) * 1e3
    out.update(moved_bytes=moved, moved_grad_bytes=grads, copies_ms=copies,
               floor_ms=max(copies, resident.median_ms) if resident and resident.median_ms else copies,
               measured_phases_ms=r.phases_ms)
    return out


def _shape_roofline(s: Scenario, rows: list[Row], bw: dict[str, Any]) -> dict[str, Any]:
    """A --shape scenario: the resident time and each offtensor row's floors (Note [shape
    rooflines])."""
    resident = _ok_row(rows, s.name, "resident")
    entry: dict[str, Any] = {"compute_ms": resident.median_ms if resident else None, "rows": {}}
    for r in rows:
        if r.scenario == s.name and r.status == "ok" and r.moved_bytes is not None:
            floors = entry["rows"][r.peer] = _row_floors(s, r, resident, bw)
            floors["roofline_ms"] = (None if s.kind == "full" else floors["phase_roofline_ms"]
                                     if s.kind == "train" and r.peer not in VRAM_PEERS else floors["floor_ms"])
    if resident is None:
        entry["note"] = "no resident time: the floors are the copies alone"
    return entry


def _judge_vram(r: Row) -> None:
    """offtensor-capped: its target is a peak VRAM below the cap."""
    if r.vram_cap_bytes is None or r.status != "ok" or r.peak_vram_bytes is None:
        return
    r.verdict = "PASS" if r.peak_vram_bytes < r.vram_cap_bytes else "FAIL"


def beside_copies_ms(same_time: dict[str, Any]) -> float | None:
    """AdamW beside the step's copies as measured in turn (Row.same_time): the faster of the
    worker's spared thread count and every thread, since the worker takes every thread while the
    forward waits for it (Note [worker threads]); None when not measured."""
    return min((t for t in (same_time.get("beside_median_ms"), same_time.get("beside_all_median_ms"))
                if t is not None), default=None)


def _judge_in_turn(r: Row, entry: dict[str, Any]) -> None:
    """The overlapped step against max(fwd+bwd, AdamW beside the step's copies), both measured
    in turn (Row.same_time); the run's own main timing is not, so it is not the ratio here."""
    st = r.same_time or {}
    variants = st.get("variants") or []
    beside = beside_copies_ms(st)
    fb = entry["peers"].get(r.peer, {}).get("fwd_bwd_roofline_ms")
    if r.status != "ok" or not r.valid_training or beside is None or fb is None or not variants:
        return
    r.roofline_ms = max(fb, beside)
    r.ratio, r.ratio_source = variants[0]["median_ms"] / r.roofline_ms, "in turn"
    r.target = IN_TURN_TARGET
    r.verdict = "PASS" if r.ratio <= r.target else "FAIL"


def compute_rooflines(rows: list[Row], scenarios: list[Scenario], bw: dict[str, Any],
                      variant_bytes: dict[str, VariantBytes],
                      extras: Extras | None = None) -> dict[str, dict[str, Any]]:
    """Per scenario: the compute term (resident time), the transfer terms, and their max; for
    the step scenarios also the optimizer term, and a roofline per offtensor peer. Fills in
    each row's roofline, ratio and verdict."""
    extras = extras if extras is not None else Extras()
    out: dict[str, dict[str, Any]] = {}
    for s in scenarios:
        vb = variant_bytes.get(s.variant)
        if s.at_shape:
            entry = out[s.name] = _shape_roofline(s, rows, bw)
            for r in (r for r in rows if r.scenario == s.name):
                rl = entry["compute_ms"] if r.peer == "resident" else entry["rows"].get(r.peer, {}).get("roofline_ms")
                _judge(r, s.kind, rl, SHAPE_TARGETS)
                _judge_vram(r)
                if r.peer != "resident" and r.median_ms is not None and entry["compute_ms"]:
                    r.vs_resident = r.median_ms / entry["compute_ms"]
            continue
        if s.has_optimizer:
            entry = out[s.name] = step_roofline(s, rows, bw, vb, extras)
        else:
            entry = out[s.name] = _layer_roofline(s, rows, bw, vb)
        resident = _ok_row(rows, s.name, "resident")
        entry["rows"] = {r.peer: _row_floors(s, r, resident, bw) for r in rows  # per phase, to read
                         if r.scenario == s.name and r.status == "ok" and r.moved_bytes is not None}
        for r in rows:
            if r.scenario == s.name:
                # A step's resident peer steps on the device and moves nothing: no roofline of its own.
                rl = entry["peers"].get(r.peer, {}).get("roofline_ms") if s.has_optimizer else entry["roofline_ms"]
                if r.peer in RELATIVE_TO:
                    other = _ok_row(rows, s.name, RELATIVE_TO[r.peer])
                    rl = other.median_ms if other is not None else None
                _judge(r, s.kind, rl, COMPILED_TARGETS if extras.compiled else TARGETS)
                if s.kind == "step" and r.peer == "offtensor-overlap":
                    _judge_in_turn(r, entry)
    return out
