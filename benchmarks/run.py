"""Running the scenarios: one peer's pass over its scenarios (a fresh model per variant), and
the timing and memory of one scenario on a placed model."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .measure import GiB, free_memory, host_rss, short_error, sync, timed
from .model import BuiltModel, build_model
from .optimizer import (
    WorkerSettings,
    format_optimizer_speed,
    measure_optimizer_speed,
    measure_plain_adamw,
    measure_same_time,
    plain_adamw_step,
)
from .peers import PEER_SETUP, STEP_PEERS, PeerOptions, compile_layers, offloaded_bytes, step_pcie_bytes
from .results import Extras, Row, VariantBytes
from .scenarios import ModelShape, Scenario
from .shapes import RandomFill, fit_problem, vram_cap
from .streamed import LoadCounter
from .workload import Workload, make_workload, timed_iterations

DEFAULT_WORKER = WorkerSettings()
FP32_BUILD_LIMIT_S = 60.0  # step32-4x2048 is skipped when building the fp32 model takes longer


@dataclass
class Run:
    """Everything one benchmark run collects, shared by its peers."""

    rows: list[Row] = field(default_factory=list)
    variant_bytes: dict[str, VariantBytes] = field(default_factory=dict)
    setups: dict[str, Any] = field(default_factory=dict)  # "peer/variant" -> how it was placed
    extras: Extras = field(default_factory=Extras)


def overlap_record(report: Any, worker: WorkerSettings) -> dict[str, Any]:
    """An OverlapReport in ms, with the worker settings it ran with."""
    return {
        "backward_ms": report.backward_s * 1e3, "total_ms": report.total_s * 1e3,
        "rest_params": report.rest_params, "pieces": report.pieces, "early_pieces": report.early_pieces,
        "worker_busy_ms": report.worker_busy_s * 1e3, "all_thread_pieces": report.all_thread_pieces,
        "spare_threads": worker.spare_threads, "piece_bytes": worker.piece_bytes,
        "device_share": worker.device_share, "max_grad_norm": worker.max_grad_norm,
        "device_pieces": report.device_pieces,
        "scopes": [{"scope": n, "queued_ms": q * 1e3, "started_ms": g * 1e3, "stepped_ms": d * 1e3}
                   for n, q, g, d in report.scopes],
    }


def _resident_compute_terms(work: Workload, model: torch.nn.Module, device: torch.device, row: Row,
                            iters: int) -> None:
    """The compute term of the step rooflines when train-4x2048 has no resident time (and of
    step32-4x2048, whose forward runs under autocast): forward+backward, and forward, alone."""
    assert work.forward_loss is not None
    forward_loss = work.forward_loss

    def fwd_bwd() -> None:
        forward_loss().backward()
        model.zero_grad(set_to_none=True)

    row.fwd_bwd_ms = statistics.median(timed(device, fwd_bwd) * 1e3 for _ in range(max(iters, 1)))
    def fwd() -> None:
        forward_loss()

    row.fwd_ms = statistics.median(timed(device, fwd) * 1e3 for _ in range(max(iters, 1)))


def run_scenario(built: BuiltModel, scenario: Scenario, device: torch.device, *, warmup: int, iters: int,
                 max_seconds: float, seed: int, row: Row, peer: str = "", worker: WorkerSettings = DEFAULT_WORKER,
                 overlap_variants: Sequence[WorkerSettings] = (), overlap_rounds: int = 3) -> None:
    """Fill `row` with the timings and memory of `scenario` on the placed model `built`; for
    offtensor-overlap also `row.overlap` (the last step's timeline) and `row.same_time`
    (measure_same_time over `overlap_variants`, default: `worker`)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    ids = torch.randint(0, built.vocab, (scenario.batch, scenario.seq), device=device, generator=gen)
    work = make_workload(built, scenario, device, ids, row, peer, worker)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        row.vram_before_bytes = torch.cuda.memory_allocated(device)
    between = _plain_optimizer_in_turn(built, scenario, peer, row)
    counter = _load_counter(built, peer)
    row.times_ms = [t * 1e3 for t in timed_iterations(work, device, warmup, iters, max_seconds, row, between,
                                                       counter=counter)]
    row.median_ms = statistics.median(row.times_ms)
    row.phases_ms = work.clock.medians() if work.clock is not None else None
    if device.type == "cuda":
        row.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
    # The same-time measurement copies the trainable masters as plain tensors: not at --shape
    # sizes (a full fine-tune's 8B masters and AdamW state would need twice the host memory).
    if work.overlap_reports and work.step_with is not None and scenario.kind in STEP_PEERS:
        row.overlap = overlap_record(work.overlap_reports[-1], worker)
        params = [p for p in built.layers.parameters() if p.requires_grad and p.device.type == "cpu"]
        try:
            row.same_time = measure_same_time(work.step_with, work.drain, params, seed, device,
                                              step_pcie_bytes(built, scenario), overlap_variants or [worker],
                                              rounds=overlap_rounds, reports=work.overlap_reports)
        except Exception as exc:  # noqa: BLE001 - reported; the main timing stands
            row.same_time = {"error": short_error(exc)}
        free_memory(device)
    if scenario.has_optimizer and peer == "resident":
        _resident_compute_terms(work, built.model, device, row, iters)
    work.optimizers.clear()  # frees the optimizer state
    if scenario.kind != "infer":
        built.model.zero_grad(set_to_none=True)


def _load_counter(built: BuiltModel, peer: str) -> LoadCounter | None:
    """An offtensor model's loads in the timed iterations, counted (row.streamed_bytes)."""
    import offtensor

    if not offtensor.is_wrapped(built.model):
        return None
    return LoadCounter(built.model, compressed=peer.endswith(("-fp8", "-int8")))


def _plain_optimizer_in_turn(built: BuiltModel, scenario: Scenario, peer: str, row: Row) -> Callable[[], None] | None:
    """For a standard (not overlapped) offtensor step: one plain fused AdamW step after each
    timed iteration, timed into `row.optimizer_in_turn_ms`, so that the roofline's optimizer
    term is measured in the same minutes as the step it bounds (Note [optimizer term in turn]
    in rooflines.py). Not at --shape sizes: plain copies of a full fine-tune's masters and
    AdamW state would not fit in host memory beside them."""
    if STEP_PEERS.get(scenario.kind, {}).get(peer, (0, True))[1] or built.fill is not None:
        return None
    params = [p for p in built.layers.parameters() if p.requires_grad and p.device.type == "cpu"]
    if not params:
        return None
    step = plain_adamw_step(params, seed=0)
    row.optimizer_in_turn_ms = []

    def between() -> None:
        assert row.optimizer_in_turn_ms is not None
        row.optimizer_in_turn_ms.append(step())

    return between


def iterations(args: argparse.Namespace, scenario: Scenario) -> tuple[int, int]:
    """(warm-up, timed) iterations: a few per scenario keeps the full 8-layer run to minutes."""
    if scenario.has_optimizer:  # a full step takes about a second; the CPU optimizer is noisy
        return args.warmup or 2, args.iters or (2 if args.quick else 5)
    warmup = args.warmup or (1 if args.quick else 2)
    iters = args.iters or (2 if args.quick else 5 if scenario.kind == "infer" else 3)
    return warmup, iters


def _print_plain_adamw(dtype: str, m: dict[str, Any]) -> None:
    beside = m.get("beside_copies") or {}
    print(f"  plain CPU fused AdamW ({dtype}, {m['params'] / 1e6:,.1f} M params): "
          f"{m['median_ms']:.1f} ms, {m['gparams_per_s']:.3g} G params/s"
          + (f"; {beside['median_ms']:.1f} ms with {beside['threads']} threads beside a step's "
             f"PCIe copies" if "median_ms" in beside else
             f"; beside a step's PCIe copies: {beside['error']}" if "error" in beside else ""),
          flush=True)


def measure_extras(peer: str, scenario: Scenario, built: BuiltModel, device: torch.device, seed: int,
                   extras: Extras, worker: WorkerSettings) -> None:
    """Before a step scenario: the plain-CPU AdamW time for its roofline (once per dtype), and
    in the offtensor peers the wrapped-vs-plain optimizer microbenchmark. Not for the LoRA
    step (its optimizer is on the device) nor the full fine-tune of a --shape model (plain
    copies of its masters would not fit in host memory beside them)."""
    if scenario.kind not in STEP_PEERS:
        return
    dtype = str(built.dtype).removeprefix("torch.")
    if dtype not in extras.plain_adamw:
        params = [p for p in built.layers.parameters() if p.requires_grad]
        try:
            extras.plain_adamw[dtype] = measure_plain_adamw(params, seed, device=device, worker=worker,
                                                            pcie_bytes=step_pcie_bytes(built, scenario))
            _print_plain_adamw(dtype, extras.plain_adamw[dtype])
        except Exception as exc:  # noqa: BLE001 - reported, the rooflines go without it
            extras.plain_adamw[dtype] = {"dtype": dtype, "error": short_error(exc)}
            print(f"  plain CPU fused AdamW ({dtype}): {short_error(exc)}", flush=True)
    attr = {("offtensor", "step"): "optimizer_speed",
            ("offtensor-castdev", "step32"): "optimizer_speed_fp32"}.get((peer, scenario.kind))
    if attr is None or getattr(extras, attr) is not None:
        return
    try:
        result = measure_optimizer_speed(built.layers, seed)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON and the log
        result = {"dtype": dtype, "error": short_error(exc)}
    print(f"  {format_optimizer_speed(attr, result)}", flush=True)
    setattr(extras, attr, result)


class _SkipVariant(Exception):
    pass


class _DoesNotFit(Exception):
    """This peer cannot run this scenario here (shapes.fit_problem): a skipped row."""


def _build_and_place(peer: str, scenario: Scenario, shape: ModelShape, device: torch.device, seed: int,
                     opts: PeerOptions, run: Run) -> BuiltModel:
    variant = scenario.variant
    t0 = time.perf_counter()
    # --shape: built on the meta device; the peer's setup fills it where it goes (shapes.py).
    fill = RandomFill(device, seed) if shape.name else None
    built = build_model(shape, variant, device, seed, fill=fill)
    t1 = time.perf_counter()
    if variant == "fp32" and t1 - t0 > FP32_BUILD_LIMIT_S:
        raise _SkipVariant(f"building the fp32 model took {t1 - t0:.0f} s (limit {FP32_BUILD_LIMIT_S:.0f} s)")
    run.variant_bytes.setdefault(variant, VariantBytes(
        built.total_bytes, built.wrapped_bytes, built.wrapped_trainable_bytes, built.trainable,
        str(built.dtype).removeprefix("torch.")))
    why = fit_problem(peer, built, shape, scenario, device) if shape.name else None
    if why is not None:
        raise _DoesNotFit(why)
    how = PEER_SETUP[peer](built, device, opts)
    if opts.compile:
        how += "; " + compile_layers(built, peer)
    sync(device)
    info: dict[str, Any] = {"how": how, "build_s": t1 - t0, "setup_s": time.perf_counter() - t1,
                            "trainable": built.trainable}
    if peer.startswith("offtensor"):
        with contextlib.suppress(Exception):
            import offtensor

            info["summary"] = str(offtensor.summary(built.model))
    run.setups[f"{peer}/{variant}"] = info
    return built


def _print_row(row: Row) -> None:
    print(f"  {row.peer}/{row.scenario}: median {row.median_ms:.2f} ms"
          + (f", peak VRAM {row.peak_vram_bytes / GiB:.2f} GiB" if row.peak_vram_bytes else "")
          + (f", host {row.host_growth_bytes / GiB:+.2f} GiB" if row.host_growth_bytes is not None else "")
          + (f", grads kept {row.grads_kept:.0%} {row.grad_devices}" if row.grads_kept is not None else "")
          + ("".join(f", {p} {ms:.1f}" for p, ms in row.phases_ms.items()) + " ms"
             if row.phases_ms and len(row.phases_ms) > 1 else "")
          + (f" ({row.note})" if row.note else ""),
          flush=True)


def _host_bytes_held(peer: str, built: BuiltModel) -> int:
    """The host bytes an offtensor peer's placed model holds already (its masters)."""
    if not peer.startswith("offtensor"):
        return 0
    import offtensor

    return offtensor.summary(built.model).host_bytes


class _PeerPass:
    """One peer's pass over its scenarios: the model it built last, and the variants whose
    setup failed (not retried)."""

    def __init__(self, peer: str, shape: ModelShape, device: torch.device, args: argparse.Namespace,
                 run: Run) -> None:
        self.peer, self.shape, self.device, self.args, self.run = peer, shape, device, args, run
        self.opts = PeerOptions(offtensor_prefetch=args.offtensor_prefetch,
                                offtensor_max_scope_mib=args.offtensor_max_scope_mib,
                                offtensor_vram_budget_gib=getattr(args, "offtensor_vram_budget_gib", None),
                                compile=getattr(args, "compile", False),
                                vram_cap_gib=getattr(args, "vram_cap_gib", 8.0),
                                vram_full_shape=getattr(args, "vram_full_shape", None))
        self.built: BuiltModel | None = None
        self.rss0: int | None = None
        self.setup_failed: dict[str, str] = {}  # variant -> note
        self.did_not_fit = False  # the last model asked for does not fit here (shapes.fit_problem)

    def _drop_model(self) -> None:
        self.built = None
        free_memory(self.device)

    def _model_for(self, scenario: Scenario, row: Row) -> BuiltModel | None:
        """The placed model of the scenario's variant, built when needed; None (and `row`
        filled in) when it cannot be had."""
        extras = self.run.extras
        if self.built is not None and self.built.variant != scenario.variant:
            self._drop_model()
        if scenario.variant in extras.skipped_variants:
            row.status, row.note = "skipped", extras.skipped_variants[scenario.variant]
            print(f"  {self.peer}/{scenario.name}: skipped, {row.note}", flush=True)
            return None
        if scenario.variant in self.setup_failed:
            row.status, row.note = "error", self.setup_failed[scenario.variant]
            return None
        if self.built is not None:
            why = (fit_problem(self.peer, self.built, self.shape, scenario, self.device,
                               held=_host_bytes_held(self.peer, self.built)) if self.shape.name else None)
            if why is not None:
                row.status, row.note = "skipped", why
                print(f"  {self.peer}/{scenario.name}: skipped, {why}", flush=True)
                return None
            return self.built
        free_memory(self.device)
        self.rss0 = host_rss()
        self.did_not_fit = False
        error: str | None = None
        try:
            self.built = _build_and_place(self.peer, scenario, self.shape, self.device, self.args.seed,
                                          self.opts, self.run)
        except _DoesNotFit as exc:
            row.status, row.note = "skipped", str(exc)
            self.did_not_fit = True
            print(f"  {self.peer}/{scenario.name}: skipped, {exc}", flush=True)
        except _SkipVariant as exc:
            extras.skipped_variants[scenario.variant] = str(exc)
            row.status, row.note = "skipped", str(exc)
            print(f"  {self.peer}/{scenario.name}: skipped, {exc}", flush=True)
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
            error = f"setup failed: {short_error(exc)}"
        if error is not None:  # outside the except block, so the traceback no longer holds the model
            row.status, row.note = "error", error
            self.setup_failed[scenario.variant] = error
            print(f"  {self.peer}/{scenario.name}: {error}", flush=True)
        if self.built is None:
            self._drop_model()
        return self.built

    def scenario(self, scenario: Scenario) -> None:
        row = Row(scenario.name, self.peer, "ok", batch=scenario.batch, seq=scenario.seq)
        self.run.rows.append(row)
        built = self._model_for(scenario, row)
        if built is None:
            if (self.peer == "resident" and self.did_not_fit and self.shape.layers > max(EXTRAPOLATED_FROM)
                    and scenario.kind not in STEP_PEERS):  # (a host optimizer's measurements are per model)
                self._extrapolate(scenario, row)
            return
        args, error = self.args, None
        worker = args.worker
        if scenario.has_optimizer:
            measure_extras(self.peer, scenario, built, self.device, args.seed, self.run.extras, worker)
        try:
            warmup, iters = iterations(args, scenario)
            run_scenario(built, scenario, self.device, warmup=warmup, iters=iters,
                         max_seconds=args.max_scenario_s, seed=args.seed, row=row, peer=self.peer,
                         worker=worker, overlap_variants=args.overlap_variants,
                         overlap_rounds=args.overlap_rounds)
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
            error = short_error(exc)
        if error is not None:  # a fresh model next: this one's state may be half-updated
            row.status, row.note = "error", f"{row.note} {error}".strip()
            row.times_ms, row.median_ms, row.peak_vram_bytes = [], None, None
            print(f"  {self.peer}/{scenario.name}: {row.note}", flush=True)
            self._drop_model()
            return
        rss = host_rss()
        if rss is not None and self.rss0 is not None:
            row.host_growth_bytes = rss - self.rss0
        if self.peer.startswith("offtensor"):
            row.moved_bytes, row.moved_grad_bytes = offloaded_bytes(built.model)
        if self.peer == "offtensor-capped":
            row.vram_cap_bytes = int(self.opts.vram_cap_gib * GiB)
        _print_row(row)


    def _extrapolate(self, scenario: Scenario, row: Row) -> None:
        """The resident model does not fit at this shape: its time, per phase, is a + b x layers
        (every decoder layer has the same shape and work), with a and b from the resident model
        at EXTRAPOLATED_FROM layers of the same shape, run here. `row` gets those times and a
        note saying so; the truncated runs' own rows are not kept."""
        why, measured = row.note, []
        setup_key = f"{self.peer}/{scenario.variant}"
        setup = self.run.setups.get(setup_key)
        for layers in EXTRAPOLATED_FROM:
            shape = dataclasses.replace(self.shape, layers=layers)
            part = _PeerPass(self.peer, shape, self.device, self.args, self.run)
            try:
                part.scenario(scenario)
            finally:
                part._drop_model()
            measured.append(self.run.rows.pop())
        self.run.setups.pop(setup_key, None)
        if setup is not None:
            self.run.setups[setup_key] = setup
        if any(m.status != "ok" or not m.phases_ms or m.median_ms is None for m in measured):
            row.note = f"{why}; extrapolation failed: " + "; ".join(m.note for m in measured if m.note)
            return
        (k1, r1), (k2, r2) = zip(EXTRAPOLATED_FROM, measured, strict=True)
        n = self.shape.layers

        def at_n(t1: float, t2: float) -> float:
            return t1 + (t2 - t1) / (k2 - k1) * (n - k1)

        assert r1.phases_ms is not None and r2.phases_ms is not None and r1.median_ms is not None
        assert r2.median_ms is not None
        phases = {p: at_n(r1.phases_ms[p], r2.phases_ms[p]) for p in r2.phases_ms if p in r1.phases_ms}
        if r2.median_ms <= r1.median_ms or min(phases.values()) <= 0:  # noise larger than 4 layers' work
            row.note = (f"{why}; extrapolation failed: {r1.median_ms:.1f} ms at {k1} layers, "
                        f"{r2.median_ms:.1f} ms at {k2}")
            return
        row.status, row.median_ms = "ok", at_n(r1.median_ms, r2.median_ms)
        row.times_ms, row.phases_ms = [row.median_ms], phases
        row.grads_kept, row.grad_devices, row.optimizer = r2.grads_kept, r2.grad_devices, r2.optimizer
        row.note = (f"extrapolated: {why}; measured at {k1} and {k2} layers of this shape "
                    f"({r1.median_ms:.1f} and {r2.median_ms:.1f} ms), a + b x layers")
        _print_row(row)


# The resident model at a shape that does not fit is measured at these layer counts and
# extrapolated (_PeerPass._extrapolate).
EXTRAPOLATED_FROM = (4, 8)


def run_peer(peer: str, scenarios: list[Scenario], shape: ModelShape, device: torch.device,
             args: argparse.Namespace, run: Run) -> None:
    """Every scenario for one peer, appended to `run.rows`: one fresh model per variant, and a
    fresh one again after a failed scenario (the peer's state may be half-updated)."""
    peer_pass = _PeerPass(peer, shape, device, args, run)
    capped = peer == "offtensor-capped"
    with vram_cap(device, int(peer_pass.opts.vram_cap_gib * GiB)) if capped else contextlib.nullcontext():
        try:
            for scenario in scenarios:
                peer_pass.scenario(scenario)
        finally:
            peer_pass._drop_model()  # under the cap: what it held is freed before the cap goes
