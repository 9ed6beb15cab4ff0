"""--shape flux: the peers of the DiT benchmark, its two workloads, and one pass per peer (one
placed model for both scenarios), each row's first output checked against the reference.

Each peer builds the model on the meta device and places it once: the resident model filled on
the device, the offtensor peers loaded scope by scope (`offtensor.load`, as for --shape 8b), the
diffusers peers materialized on the host and then group-offloaded. Inference runs first: it
changes nothing, so the LoRA step that follows starts from the same adapters in every peer, and
both scenarios' first outputs compare across peers (`Row.exact`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import offtensor

from .dit import (
    FLUX_DEV,
    QUICK_FLUX,
    DitShape,
    attention_backends,
    build_dit,
    dit_inputs,
    measure_dequant_rate,
    round_blocks_to_fp8_,
)
from .dit_profile import describe, describe_host, host_calls, where_time_goes
from .dit_report import format_dit_table, judge_dit_rows
from .host_profile import describe_python, python_profile
from .measure import GiB, PhaseClock, free_memory, measure_bandwidth, setup_failed, short_error, sync
from .model import BuiltModel, materialize
from .optimizer import make_adamw
from .peers import PEER_SETUP, VRAM_PEERS, PeerOptions, skipped_unavailable
from .report import environment, write_json
from .results import Row
from .scenarios import SHAPE_SCENARIOS, Scenario
from .streamed import LoadCounter, StreamCounter
from .workload import Workload, record_grads, timed_iterations

FP8_PEERS = ("offtensor-fp8", *(p for p in VRAM_PEERS if p.endswith("-fp8")))
DIT_PEER_NAMES = ("resident", "offtensor", "offtensor-fp8", *VRAM_PEERS, "diffusers", "diffusers-fp8")
# diffusers' apply_layerwise_casting default skip patterns, and the adapters (they train in bf16).
LAYERWISE_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$", "lora_")


@dataclass
class DitRun:
    """What the DiT run collects: rows, each peer's setup, the reference outputs."""

    rows: list[Row] = field(default_factory=list)
    setups: dict[str, Any] = field(default_factory=dict)
    refs: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (scenario, bf16|fp8) -> output


class BlockCallCounter(StreamCounter):
    """diffusers' group offloading, one block per group: it copies a block to the device at each
    call (the recompute in backward too), so the bytes are its calls times its bytes, counted by
    a forward pre-hook; the fp8 elements of a layerwise-cast block are upcast at each call. The
    rest of the model (embedders, output norm and projection: under 1 %) is not counted."""

    source = "counted: block calls x block bytes (diffusers)"

    def __init__(self, blocks: nn.ModuleList) -> None:
        self.bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
        self.fp8 = [sum(p.numel() for p in b.parameters() if p.dtype == torch.float8_e4m3fn) for b in blocks]
        self.calls = [0] * len(blocks)
        self._at_start = list(self.calls)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int) -> Callable[..., None]:
        def called(module: nn.Module, args: Any) -> None:
            self.calls[i] += 1

        return called

    def start(self) -> None:
        self._at_start = list(self.calls)

    def per_iteration(self, iterations: int) -> tuple[int, int]:
        calls = [c - s for c, s in zip(self.calls, self._at_start, strict=True)]
        n = max(iterations, 1)
        return (sum(c * b for c, b in zip(calls, self.bytes, strict=True)) // n,
                sum(c * e for c, e in zip(calls, self.fp8, strict=True)) // n)


def _setup_diffusers(built: BuiltModel, device: torch.device, fp8: bool) -> str:
    """The model materialized on the host (values generated on the device), optionally
    layerwise-cast to float8 e4m3 storage with bf16 compute, then diffusers' group offloading,
    one block per group, on a copy stream (CUDA; diffusers refuses streams on the CPU)."""
    from diffusers.hooks import apply_group_offloading, apply_layerwise_casting

    assert built.fill is not None
    materialize(built.model, torch.device("cpu"), built.fill)
    how = ""
    if fp8:
        apply_layerwise_casting(built.model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                                skip_modules_pattern=LAYERWISE_SKIP)
        how = f"apply_layerwise_casting(float8_e4m3fn storage, bf16 compute, skipping {LAYERWISE_SKIP}); "
    use_stream = device.type == "cuda"
    apply_group_offloading(built.model, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream,
                           non_blocking=use_stream)
    return how + f"apply_group_offloading(block_level, num_blocks_per_group=1, use_stream={use_stream})"


DIT_SETUP: dict[str, Callable[[BuiltModel, torch.device, PeerOptions], str]] = {
    **{p: PEER_SETUP[p] for p in ("resident", "offtensor", "offtensor-fp8", *VRAM_PEERS)},
    "diffusers": lambda b, d, o: _setup_diffusers(b, d, fp8=False),
    "diffusers-fp8": lambda b, d, o: _setup_diffusers(b, d, fp8=True),
}


def dit_workload(built: BuiltModel, scenario: Scenario, inputs: dict[str, torch.Tensor], device: torch.device,
                 row: Row, captured: list[torch.Tensor]) -> Workload:
    """One denoising step (no_grad) or one LoRA step: forward with per-block checkpointing, the
    flow-matching MSE loss, backward, fused AdamW on the adapters, zero_grad. The first
    iteration appends its output (on the host) to `captured`."""
    model: Any = built.model
    kwargs = {k: v for k, v in inputs.items() if k != "target"}
    clock = PhaseClock(device)

    def forward() -> torch.Tensor:
        """The model's forward, its host time (until the call returns) kept beside the phases."""
        t0 = time.perf_counter()
        out = model(**kwargs, return_dict=False)[0]
        clock.host("forward host", time.perf_counter() - t0)
        return out

    if scenario.kind == "infer":
        model.eval()

        def infer(capture: bool = False) -> None:
            clock.start()
            with torch.no_grad(), attention_backends(device):
                out = forward()
            clock.mark("forward")
            if capture:
                captured.append(out.detach().to("cpu", copy=True))

        return Workload(step=infer, first_step=lambda: infer(True), clock=clock)
    model.train()
    model.enable_gradient_checkpointing()
    optimizers, row.optimizer = make_adamw([p for p in model.parameters() if p.requires_grad])

    def lora_step(capture: bool = False) -> None:
        clock.start()
        with attention_backends(device):  # the recompute in backward runs attention again
            out = forward()
            loss = F.mse_loss(out.float(), inputs["target"].float())
            clock.mark("forward")
            if capture:
                captured.append(out.detach().to("cpu", copy=True))
            del out
            loss.backward()
        clock.mark("backward")
        if capture:
            record_grads(row, built.layers, "after backward")
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        clock.mark("step")

    return Workload(step=lora_step, first_step=lambda: lora_step(True), optimizers=optimizers, clock=clock)


def _check_output(row: Row, out: torch.Tensor, run: DitRun) -> None:
    """The first output against the resident model's (bit for bit), the fp8 peers' against the
    fp8 reference; the largest absolute difference where they differ."""
    if row.peer == "resident":
        run.refs[(row.scenario, "bf16")] = out
        row.exact, row.exact_ref, row.max_abs_diff = True, "itself", 0.0
        if not bool(out.float().isfinite().all()):
            row.note = (row.note + " the reference output is not finite").strip()
        return
    fp8 = row.peer in FP8_PEERS
    ref = run.refs.get((row.scenario, "fp8" if fp8 else "bf16"))
    bf16 = run.refs.get((row.scenario, "bf16"))
    if ref is None:
        row.exact_ref = "none (the resident peer did not run)"
        return
    row.exact_ref = "fp8 reference" if fp8 else "resident"
    row.exact = torch.equal(out, ref)
    row.max_abs_diff = float((out.float() - ref.float()).abs().max())
    if fp8 and bf16 is not None:
        row.diff_vs_resident = float((out.float() - bf16.float()).abs().max())


def _predicted_ms(model: nn.Module, s: Scenario) -> float | None:
    """The step time a timed layout predicted for its kept set (offtensor.summary().layout), or
    None: not wrapped, no budget, or a layout by bytes."""
    if not offtensor.is_wrapped(model):
        return None
    layout = offtensor.summary(model).layout
    if layout is None or not layout.timed or layout.predicted_forward_ms is None:
        return None
    if s.kind == "infer":
        return layout.predicted_forward_ms
    if not layout.predicted_backward_ms:
        return None  # chosen on a pass without backward (every scope fit): it predicted no training step
    return layout.predicted_forward_ms + layout.predicted_backward_ms


def _counter(peer: str, built: BuiltModel) -> StreamCounter | None:
    if peer.startswith("offtensor"):
        return LoadCounter(built.model, compressed=peer in FP8_PEERS)
    if peer.startswith("diffusers"):
        return BlockCallCounter(built.layers)
    return None


def _scenario(built: BuiltModel, s: Scenario, row: Row, peer: str, inputs: dict[str, torch.Tensor],
              device: torch.device, args: argparse.Namespace, run: DitRun, counter: StreamCounter | None) -> None:
    captured: list[torch.Tensor] = []
    work = dit_workload(built, s, inputs, device, row, captured)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        row.vram_before_bytes = torch.cuda.memory_allocated(device)
    # Three warm-up passes: the first pays cold kernels, a VRAM budget's timed layout measures
    # the second and loads what it keeps during the third (Note [a timed layout]); the timed
    # iterations are the steady state a long run lives in.
    warmup = args.warmup or (1 if args.quick else 3)
    iters = args.iters or (2 if args.quick else 5)
    times = timed_iterations(work, device, warmup, iters, args.max_scenario_s, row, counter=counter)
    row.times_ms = [t * 1e3 for t in times]
    row.median_ms = statistics.median(row.times_ms)
    row.phases_ms = work.clock.medians() if work.clock is not None else None
    if device.type == "cuda":
        row.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
    row.predicted_ms = _predicted_ms(built.model, s)
    if getattr(args, "profile", False):  # Note [where a row's time goes]
        dump = os.path.join(args.profile_dump, f"{peer}_{s.name}.jsonl.gz") if args.profile_dump else None
        row.profile_ms = where_time_goes(work.step, device, dump)
        row.host_calls_ms = host_calls(work.step, device, dump=dump and dump.replace(".jsonl.gz", ".gaps.jsonl.gz"))
        work.drain()
    if getattr(args, "host_profile", 0):  # Note [a row's host profile]
        row.host_profile = python_profile(work.step, device, args.host_profile)
        work.drain()
    work.optimizers.clear()
    _check_output(row, captured[0], run)
    print(f"  {peer}/{s.name}: median {row.median_ms:.1f} ms"
          + (f", peak VRAM {row.peak_vram_bytes / GiB:.2f} GiB" if row.peak_vram_bytes else "")
          + (f", streamed {row.streamed_bytes / 1e9:.3g} GB/iter" if row.streamed_bytes is not None else "")
          + (f", output {'equal to' if row.exact else 'differs from'} {row.exact_ref}" if row.exact is not None else "")
          + (f" ({row.note})" if row.note else ""), flush=True)
    if row.profile_ms is not None:
        print(f"    {describe(row.profile_ms)}", flush=True)
    if row.host_calls_ms is not None:
        print(f"    {describe_host(row.host_calls_ms)}", flush=True)
    if row.host_profile is not None:
        print("\n".join(f"    {line}" for line in describe_python(row.host_profile)), flush=True)


def _fp8_references(built: BuiltModel, scenarios: list[Scenario], inputs: dict[str, torch.Tensor],
                    adapters: list[tuple[nn.Parameter, torch.Tensor]], device: torch.device, run: DitRun) -> None:
    """After the resident peer's timings: its adapters back to their first values, its block
    matrices rounded as Policy(frozen_format="fp8") stores them (dit.fp8_round_trip_), and each
    scenario's first output again: what the fp8 peers must compute."""
    with torch.no_grad():
        for p, first in adapters:
            p.copy_(first)
    n = round_blocks_to_fp8_(built)
    for s in scenarios:
        captured: list[torch.Tensor] = []
        dit_workload(built, s, inputs, device, Row(s.name, "resident", "ok"), captured).first_step()
        run.refs[(s.name, "fp8")] = captured[0]
    print(f"  resident: fp8 reference outputs computed ({n} block matrices rounded to fp8 in place)", flush=True)


def run_dit_peer(peer: str, scenarios: list[Scenario], shape: DitShape, device: torch.device,
                 args: argparse.Namespace, opts: PeerOptions, run: DitRun) -> None:
    """Both scenarios on one freshly built and placed model; a row per scenario, skipped or
    an error with the reason when the peer is not installed or fails."""
    rows = [Row(s.name, peer, "ok", batch=1, seq=shape.image_tokens) for s in scenarios]
    run.rows += rows
    if skipped_unavailable(peer, "diffusers" if peer.startswith("diffusers") else peer, rows):
        return
    print(f"bench: {peer}", flush=True)
    built = build_dit(shape, device, args.seed, args.dit_model)
    t0 = time.perf_counter()
    try:
        how = DIT_SETUP[peer](built, device, opts)
        sync(device)
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
        setup_failed(rows, peer, exc)
        del built
        free_memory(device)
        return
    run.setups[peer] = {"how": how, "setup_s": time.perf_counter() - t0, "trainable": built.trainable}
    print(f"  {how} ({time.perf_counter() - t0:.1f} s)", flush=True)
    adapters = [(p, p.detach().clone()) for p in built.model.parameters() if p.requires_grad]
    inputs = dit_inputs(shape, device, args.seed)
    counter = _counter(peer, built)
    for s, row in zip(scenarios, rows, strict=True):
        try:
            _scenario(built, s, row, peer, inputs, device, args, run, counter)
        except Exception as exc:  # noqa: BLE001 - reported; the next scenario still runs
            row.status, row.note = "error", f"{row.note} {short_error(exc)}".strip()
            row.times_ms, row.median_ms = [], None
            print(f"  {peer}/{s.name}: {row.note}", flush=True)
    if peer == "resident" and any(p in args.peers for p in FP8_PEERS):
        try:
            _fp8_references(built, scenarios, inputs, adapters, device, run)
        except Exception as exc:  # noqa: BLE001 - the fp8 rows then say there is no reference
            print(f"  resident: fp8 references failed: {short_error(exc)}", flush=True)
    del built, adapters, counter
    free_memory(device)


def _result(run: DitRun, *, env: dict[str, Any], args: dict[str, Any], shape: DitShape, model: dict[str, Any],
            bw: dict[str, Any], dequant: float, interrupted: bool) -> dict[str, Any]:
    result = {"environment": env, "interrupted": interrupted, "args": args,
              "model": {**dataclasses.asdict(shape), **model}, "bandwidth": bw, "dequant_s_per_element": dequant,
              "setups": run.setups, "results": [dataclasses.asdict(r) for r in run.rows]}
    return json.loads(json.dumps(result, default=str))


def main(args: argparse.Namespace, device: torch.device, json_args: dict[str, Any]) -> int:
    """The DiT benchmark: every peer of `args.peers` (resident first) over `args.scenarios`, then
    the table (and --json, rewritten after each peer)."""
    shape = QUICK_FLUX if args.quick else FLUX_DEV
    known = SHAPE_SCENARIOS["flux"]
    scenarios = [dataclasses.replace(known[n], seq=shape.image_tokens) for n in known if n in args.scenarios]
    kinds = {s.name: s.kind for s in scenarios}
    peers = sorted(args.peers, key=lambda n: n != "resident")
    env = environment(device)
    probe = build_dit(shape, device, args.seed, args.dit_model)
    model: dict[str, Any] = {"source": probe.trainable, "total_bytes": probe.total_bytes,
             "block_bytes": probe.wrapped_bytes - probe.wrapped_trainable_bytes,
             "adapter_bytes": probe.wrapped_trainable_bytes}
    print(f"bench: --shape flux: {shape}; {probe.trainable}; blocks {model['block_bytes'] / 1e9:.3g} GB bf16; on "
          f"{env.get('gpu', device)}; torch {env['torch']}", flush=True)
    del probe
    opts = PeerOptions(offtensor_prefetch=args.offtensor_prefetch, offtensor_max_scope_mib=args.offtensor_max_scope_mib,
                       vram_full_shape=getattr(args, "vram_full_shape", None))
    bw = measure_bandwidth(device, (256 if args.quick else 1024) * 2**20)
    dequant = measure_dequant_rate(device, 2**20 if args.quick else 2**26)
    print(f"bench: bandwidth H2D {bw['h2d'] / 1e9:.1f} GB/s ({bw['method']}); fp8 dequantization "
          f"{dequant * 1e12:.1f} ps per element", flush=True)
    run, interrupted = DitRun(), False

    def write() -> None:
        judge_dit_rows(run.rows, kinds, bw, dequant)
        if args.json:
            write_json(args.json, _result(run, env=env, args=json_args, shape=shape, model=model, bw=bw,
                                          dequant=dequant, interrupted=interrupted))

    try:
        for peer in peers:
            run_dit_peer(peer, scenarios, shape, device, args, opts, run)
            write()
    except KeyboardInterrupt:
        interrupted = True
        print("bench: interrupted; reporting the results so far", flush=True)
    write()
    notes = [f"  {r.peer}/{r.scenario}: {r.note}" for r in run.rows if r.note]
    if notes:
        print("notes:\n" + "\n".join(notes))
    head = (f"--shape flux: {shape}, bf16, LoRA r=16, on {env.get('gpu', env['device'])}, torch {env['torch']} | "
            f"H2D {bw['h2d'] / 1e9:.1f} GB/s ({bw['method']})")
    print()
    print(format_dit_table(run.rows, head, bw, dequant, cpu=args.quick or device.type != "cuda"), flush=True)
    return 0
