"""`python -m benchmarks`: the command line. The benchmark itself by default; the
investigations behind docs/benchmarks.md as subcommands (`python -m benchmarks
profile-step --help`)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from typing import Any

import torch

from . import dit_run, moe_run, multi
from .dit import FLUX_DEV, build_dit
from .dit_run import DIT_PEER_NAMES
from .launch import launched_by_torchrun
from .measure import measure_bandwidth
from .model import build_model
from .moe import MOE_PEER_NAMES
from .multi_peers import MULTI_PEER_NAMES
from .optimizer import WorkerSettings
from .peers import PEER_NAMES, SHAPE_PEER_NAMES, VRAM_PEERS, layer_bytes, peer_plan, peer_unavailable
from .plots import OVERLAP_PNG, RESULTS_PNG, missing_matplotlib, plot_results
from .report import environment, json_result, print_summary, write_json
from .results import Row
from .rooflines import compute_rooflines
from .run import Run, run_peer
from .scenarios import (
    FULL_SHAPE,
    MOE_SHAPE_NAMES,
    MULTI_SCENARIOS,
    NAMED_SHAPES,
    QUICK_NAMED_SHAPES,
    QUICK_SHAPE,
    SCENARIOS,
    SHAPE_SCENARIOS,
    ModelShape,
    Scenario,
    quick,
)
from .shapes import RandomFill

DESCRIPTION = ("Benchmark offtensor against the whole model on the device and against other "
               "offloading libraries (docs/benchmarks.md).")

# subcommand -> (module, what it measures); each module has main(argv) -> int.
COMMANDS = {
    "profile-step": ("profiling", "where an overlapped training step's time goes (CUDA)"),
    "profile-infer": ("profiling", "where an offloaded forward's time and peak memory go (CUDA)"),
    "host-contention": ("host_memory", "the CPU AdamW step beside PCIe copies: host memory bandwidth"),
    "pinned-bandwidth": ("host_memory", "host-to-device bandwidth from three kinds of page-locked memory (CUDA)"),
    "adamw-memory-kinds": ("host_memory", "the CPU AdamW step on three kinds of host memory"),
    "compression-error": ("compression", "the output and logit error of Policy(frozen_format=fp8|int8) against bf16"),
    "host-tier": ("host_tier", "a model over its Policy(host_budget) streamed from its files against the drive's "
                  "bandwidth; Policy(pin_memory='ring') against pinned"),
    "host-overhead": ("host_overhead", "the host's share: offtensor's step against the plain model's and other "
                      "offloaders' at host-bound shapes (thread time; the CPU by default)"),
    "load-speed": ("load_speed", "offtensor.load of a checkpoint and wrap of a model in RAM against the disk's and "
                   "memory's own speed, in fresh processes"),
    "plot": ("plots", "draw the pictures of a --json file (or a step timeline) again (matplotlib)"),
}

EPILOG = "subcommands (each takes --help):\n" + "\n".join(
    f"  python -m benchmarks {name:20} {what}" for name, (_, what) in COMMANDS.items())


def _names(values: list[str], known: tuple[str, ...] | list[str], what: str) -> list[str]:
    names = [n for v in values for n in v.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"bench: unknown {what} {unknown}; choose from {list(known)}")
    return list(dict.fromkeys(names))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; 2 with --quick; "
                   "with --shape, the shape's)")
    p.add_argument("--shape", choices=[*NAMED_SHAPES, "flux", *MOE_SHAPE_NAMES], default=None,
                   help="a real model's dimensions (8b: Llama-3-8B, 34b: CodeLlama-34B, 70b: Llama-2-70B; flux: the "
                        "Flux.1-dev diffusion transformer, its own peers: " + ", ".join(DIT_PEER_NAMES) + "; "
                        + ", ".join(MOE_SHAPE_NAMES) + ": mixture-of-experts models, their own peers: "
                        + ", ".join(MOE_PEER_NAMES) + "; --layers N for fewer layers), built "
                        "on the meta device and loaded scope by scope with random weights, with its own "
                        "scenarios: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in SHAPE_SCENARIOS.items()))
    p.add_argument("--dit-model", choices=["auto", "diffusers", "builtin"], default="auto",
                   help="--shape flux: diffusers' FluxTransformer2DModel (auto: when diffusers is installed) or "
                        "the built-in DiT of the same blocks (benchmarks/dit_blocks.py)")
    p.add_argument("--profile", action="store_true",
                   help="--shape flux: after each row's timed iterations, one more under torch.profiler (CUDA): "
                        "compute busy, compute waiting on copies, compute waiting on the host, link busy")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="--shape flux and the MoE shapes: after each row's timed iterations, one more under "
                        "cProfile: the N functions with the most time of their own and offtensor's N by time "
                        "including what they call (benchmarks/host_profile.py)")
    p.add_argument("--profile-dump", default=None, metavar="DIR",
                   help="with --profile: each row's device events as DIR/PEER_SCENARIO.jsonl.gz, the link's "
                        "idle gaps as DIR/PEER_SCENARIO.gaps.jsonl.gz")
    p.add_argument("--scenarios", nargs="+", default=None,
                   help=f"any of {list(SCENARIOS)} (space or comma separated; default all); with --nproc "
                        f"any of {list(MULTI_SCENARIOS)}; with --shape, that shape's")
    p.add_argument("--peers", nargs="+", default=None,
                   help=f"any of {list(PEER_NAMES)} (default all; resident always runs first); with --nproc "
                        f"any of {list(MULTI_PEER_NAMES)}; with --shape, default {list(SHAPE_PEER_NAMES)}")
    p.add_argument("--vram-cap-gib", type=float, default=8.0,
                   help="offtensor-capped (--shape 8b full-step-1x4096): the VRAM cap, applied with "
                        "torch.cuda.set_per_process_memory_fraction (default 8)")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help=f"draw the results into DIR/{RESULTS_PNG} (and {OVERLAP_PNG} when offtensor-overlap "
                        "ran); needs matplotlib: pip install 'offtensor[plot]'")
    p.add_argument("--quick", action="store_true",
                   help="tiny model (hidden 256, 2 layers) and short sequences: a smoke test")
    p.add_argument("--device", default=None, help="compute device (default cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 2; 1 with --quick)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default 5 for inference, 3 for training; 2 with --quick)")
    p.add_argument("--max-scenario-s", type=float, default=25.0,
                   help="cut iterations when one peer/scenario would take longer than this")
    p.add_argument("--offtensor-prefetch", type=int, default=None,
                   help="pass offtensor.Policy(prefetch=N) to wrap (default: the library's default)")
    p.add_argument("--offtensor-max-scope-mib", type=float, default=None,
                   help="pass offtensor.Policy(max_scope_bytes=N MiB) to wrap: split decoder layers "
                        "larger than that into per-child scopes (default: one scope per layer)")
    p.add_argument("--offtensor-vram-budget-gib", type=float, default=None,
                   help="pass offtensor.Policy(vram_budget=N GiB) to wrap for every offtensor peer (the first "
                        "scopes that fit stay resident; offtensor-budget keeps its own, half the layers)")
    p.add_argument("--overlap-piece-mib", type=float, default=None,
                   help="offtensor-overlap: backward_and_step(piece_bytes=N MiB) (default 64)")
    p.add_argument("--overlap-spare-threads", type=int, default=None,
                   help="offtensor-overlap: backward_and_step(spare_threads=N) (default 1)")
    p.add_argument("--overlap-device-share", type=float, default=None,
                   help="offtensor-overlap: backward_and_step(device_share=F): up to this fraction of the "
                        "offloaded bytes may be stepped on the device when the CPU optimizer falls behind "
                        "(default 1.0 here, the fastest measured, and 0 with several ranks, where data_parallel "
                        "models step on the host; the library's default is 0, off)")
    p.add_argument("--overlap-max-grad-norm", type=float, default=None,
                   help="offtensor-overlap: backward_and_step(max_grad_norm=X), clipping the step's "
                        "gradients to that total norm as Trainer does by default (default: no clipping)")
    p.add_argument("--overlap-variants", nargs="+", default=[], metavar="SPARE:PIECE_MIB[:SHARE]",
                   help="offtensor-overlap: worker settings (spare threads:piece MiB[:device share, default "
                        "--overlap-device-share's]) to time in turn beside the plain optimizer step "
                        "(measure_same_time; default: the current one)")
    p.add_argument("--overlap-rounds", type=int, default=3,
                   help="offtensor-overlap: rounds of measure_same_time (default 3)")
    p.add_argument("--compile", action="store_true",
                   help="compile each decoder layer (layer.compile(), inductor) for the resident model and the "
                        "offtensor peers alike; ratios are then against the compiled resident model, and the "
                        "warm-up iterations compile")
    p.add_argument("--seed", type=int, default=0)
    _multi_arguments(p.add_argument_group("several GPUs (docs/benchmarks.md, Several GPUs)"))
    return p


def _multi_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="run N ranks, one per GPU (NCCL; gloo with --device cpu), data-parallel peers; "
                        "under torchrun --nproc-per-node N the ranks are torchrun's")
    g.add_argument("--baseline", default="measure", metavar="measure|skip|FILE",
                   help="the 1-GPU offtensor numbers the --nproc rows compare with: measured on rank 0 alone "
                        "first (default), or the offtensor rows of a single-GPU --json FILE")
    g.add_argument("--threads-per-rank", type=int, default=None,
                   help="CPU threads per rank (default: this machine's CPUs / ranks per node)")
    g.add_argument("--fsdp2-offload-root", action="store_true",
                   help="fsdp2-cpu-offload: offload the embeddings, final norm and head too (default: "
                        "sharded on the device, where the offtensor peers keep them)")
    g.add_argument("--collective-timeout-s", type=float, default=600.0,
                   help="timeout of the peers' collectives (a rank that fails cannot hang the others)")


def _worker_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.worker and args.overlap_variants as WorkerSettings."""
    default = WorkerSettings()
    args.worker = WorkerSettings(
        default.spare_threads if args.overlap_spare_threads is None else args.overlap_spare_threads,
        default.piece_bytes if args.overlap_piece_mib is None else int(args.overlap_piece_mib * 2**20),
        (0.0 if args.multi else 1.0) if args.overlap_device_share is None else args.overlap_device_share,
        args.overlap_max_grad_norm)
    if args.worker.spare_threads < 0 or args.worker.piece_bytes < 1 or not 0 <= args.worker.device_share <= 1:
        p.error("--overlap-spare-threads must be >= 0, --overlap-piece-mib > 0 and --overlap-device-share "
                "from 0 to 1")
    variants = []
    for v in args.overlap_variants:
        try:
            spare, mib, *share = v.split(":")
            variants.append(WorkerSettings(int(spare), int(float(mib) * 2**20),
                                           float(share[0]) if share else args.worker.device_share,
                                           args.worker.max_grad_norm))
            if len(share) > 1 or not 0 <= variants[-1].device_share <= 1:
                raise ValueError(v)
        except (ValueError, OverflowError):
            p.error(f"--overlap-variants: {v!r} is not SPARE:PIECE_MIB[:SHARE] (e.g. 1:64 or 1:64:0.25)")
    args.overlap_variants = variants


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    args.multi = args.nproc is not None or launched_by_torchrun()
    if args.multi and args.shape is not None:
        p.error("--shape runs on one GPU; it does not take --nproc")
    scenarios, peers = (MULTI_SCENARIOS, MULTI_PEER_NAMES) if args.multi else (SCENARIOS, PEER_NAMES)
    if args.shape is not None:
        scenarios = SHAPE_SCENARIOS[args.shape]
    args.scenarios = _names(args.scenarios or list(scenarios), list(scenarios), "scenario")
    default_peers = SHAPE_PEER_NAMES if args.shape is not None else peers
    if args.shape == "flux":
        peers = default_peers = DIT_PEER_NAMES
        if args.layers is not None or args.compile or args.plot is not None:
            p.error("--shape flux has its own blocks (19 double, 38 single) and table; it takes none of --layers, "
                    "--compile, --plot")
    if args.shape in MOE_SHAPE_NAMES:
        peers = default_peers = MOE_PEER_NAMES
        if args.compile or args.plot is not None:
            p.error(f"--shape {args.shape} has its own table; it takes neither --compile nor --plot")
    args.peers = _names(args.peers or list(default_peers), peers, "peer")
    if args.vram_cap_gib <= 0:
        p.error("--vram-cap-gib must be > 0")
    if args.nproc is not None and args.nproc < 1:
        p.error("--nproc must be >= 1")
    if args.multi and args.plot is not None:
        p.error("--plot draws the single-GPU results; it does not take --nproc")
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        p.error("--threads-per-rank must be >= 1")
    if args.warmup is not None and args.warmup < 1:
        p.error("--warmup must be >= 1")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be >= 1")
    if args.overlap_rounds < 1:
        p.error("--overlap-rounds must be >= 1")
    if args.plot is not None and (why := missing_matplotlib()) is not None:
        p.error(why)
    _worker_settings(p, args)
    return args


def _device(name: str | None) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but torch sees no CUDA device")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # events and streams below use the current device
    return device


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return dataclasses.asdict(v)
        return [plain(x) for x in v] if isinstance(v, list) else v

    return {k: plain(v) for k, v in vars(args).items()}


def _run_peers(peers: list[str], scenarios: list[Scenario], shape: ModelShape, device: torch.device,
               args: argparse.Namespace, run: Run, report: Any) -> None:
    """Each peer's scenarios in turn (resident first); `report()` after each peer."""
    for peer in peers:
        plan = [(s, p) for s in scenarios if (p := peer_plan(peer, s)) is not None]
        if not plan:
            continue  # an offtensor variant whose scenarios were not selected
        why = peer_unavailable(peer)
        if why is not None:
            print(f"bench: {peer}: skipped, {why}", flush=True)
            run.rows += [Row(s.name, peer, "skipped", why, batch=s.batch, seq=s.seq) for s, _ in plan]
            continue
        run.rows += [Row(s.name, peer, "skipped", p, batch=s.batch, seq=s.seq) for s, p in plan if p != "run"]
        to_run = [s for s, p in plan if p == "run"]
        if to_run:
            print(f"bench: {peer}", flush=True)
            run_peer(peer, to_run, shape, device, args, run)
            report(interrupted=False)


def _full_shape_layers(args: argparse.Namespace, device: torch.device) -> tuple[int, int] | None:
    """--quick --shape with offtensor-vram* peers: the real shape's layer bytes (all, the
    largest; built on the meta device), so that each budget keeps the same share of the tiny
    model's layers (peers.vram_budget)."""
    if not (args.quick and args.shape is not None and set(args.peers) & set(VRAM_PEERS)):
        return None
    if args.shape == "flux":
        return layer_bytes(build_dit(FLUX_DEV, device, args.seed, args.dit_model))
    return layer_bytes(build_model(NAMED_SHAPES[args.shape], "base", device, args.seed,
                                   fill=RandomFill(device, args.seed)))


def _bench(args: argparse.Namespace) -> int:
    if args.shape == "flux":
        device = _device(args.device)
        args.vram_full_shape = _full_shape_layers(args, device)
        return dit_run.main(args, device, _json_args(args))
    if args.shape in MOE_SHAPE_NAMES:
        return moe_run.main(args, _device(args.device), _json_args(args))
    if args.shape is not None:
        base = (QUICK_NAMED_SHAPES if args.quick else NAMED_SHAPES)[args.shape]
    else:
        base = QUICK_SHAPE if args.quick else FULL_SHAPE
    shape = dataclasses.replace(base, layers=args.layers or base.layers)
    if args.multi:
        return multi.main(args, shape)
    device = _device(args.device)
    args.vram_full_shape = _full_shape_layers(args, device)
    known = SHAPE_SCENARIOS[args.shape] if args.shape is not None else SCENARIOS
    scenarios = [known[n] for n in known if n in args.scenarios]  # canonical order
    if args.quick:
        scenarios = [quick(s) for s in scenarios]
    peers = sorted(args.peers, key=lambda n: n != "resident")  # resident first: it is the roofline
    env = environment(device)
    print(f"bench: {shape} on {env.get('gpu', device)}; torch {env['torch']}", flush=True)
    bw = measure_bandwidth(device, (256 if args.quick else 1024) * 2**20)
    print(f"bench: bandwidth H2D {bw['h2d'] / 1e9:.1f} GB/s, D2H {bw['d2h'] / 1e9:.1f} GB/s"
          + (f", both at once {bw['bidirectional_total'] / 1e9:.1f} GB/s total"
             if bw.get("bidirectional_total") else "") + f" ({bw['method']})", flush=True)
    run = Run()
    run.extras.compiled = bool(getattr(args, "compile", False))
    order = {s.name: i for i, s in enumerate(scenarios)}, {n: i for i, n in enumerate(peers)}

    def report(interrupted: bool) -> tuple[list[Row], dict[str, dict[str, Any]], dict[str, Any]]:
        """Sorted rows with rooflines filled in, and the JSON result; also (re)writes --json,
        so a run killed part-way still leaves every peer finished so far on disk."""
        table = sorted(run.rows, key=lambda r: (order[0][r.scenario], order[1][r.peer]))
        rooflines = compute_rooflines(table, scenarios, bw, run.variant_bytes, run.extras)
        result = json_result(run, env=env, interrupted=interrupted, args=_json_args(args), shape=shape,
                             bw=bw, scenarios=scenarios, rooflines=rooflines, table=table)
        if args.json:
            write_json(args.json, result)
        return table, rooflines, result

    interrupted = False
    try:
        _run_peers(peers, scenarios, shape, device, args, run, report)
    except KeyboardInterrupt:
        # `timeout --signal=INT` in .ci/gpu_check.sh lands here: report what was measured.
        interrupted = True
        print("bench: interrupted; reporting the results so far", flush=True)
        if run.rows and run.rows[-1].status == "ok" and run.rows[-1].median_ms is None:
            run.rows[-1].status, run.rows[-1].note = "error", "interrupted"
    table, rooflines, result = report(interrupted)
    if args.json:
        print(f"bench: wrote {args.json}", flush=True)
    print_summary(table, rooflines, run, bw=bw, env=env, shape=shape, scenarios=scenarios, device=device,
                  quick=args.quick)
    if args.plot is not None and table:
        for path in plot_results(result, args.plot):
            print(f"bench: wrote {path}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The benchmark with `argv` (default: sys.argv[1:]), or the subcommand argv[0] names."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(f"{__package__}.{COMMANDS[argv[0]][0]}")
        return int(module.main(argv[0], argv[1:]))
    return _bench(parse_args(argv))
