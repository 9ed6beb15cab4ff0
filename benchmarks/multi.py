"""The several-GPU benchmark (`--nproc N`, or under `torchrun`), as each rank runs it: the
bandwidth (rank 0 alone, then every rank at once), the one-GPU baseline on rank 0 alone, then
every peer and scenario on all the ranks at once, each result gathered on rank 0, which prints
one table and writes the JSON. docs/benchmarks.md, Several GPUs, defines every number.

Every rank builds its own model from the same seed (the peers see equal weights, as after
DDP's broadcast) and feeds its own random tokens. A fresh model per peer and scenario keeps
the host-memory numbers of one scenario free of another's."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import torch

from .launch import RankEnv, init_groups, launched_by_torchrun, rank_env, spawn
from .measure import (
    free_memory,
    host_pss,
    measure_bandwidth,
    node_used_bytes,
    short_error,
    sync,
    temporarily,
    timed,
)
from .model import BuiltModel, build_model
from .multi_peers import MULTI_PEERS, MultiOptions, multi_peer_unavailable
from .multi_report import load_baseline, make_row, multi_json, print_multi, tokens_per_s
from .peers import PeerOptions, setup_offtensor
from .report import environment, write_json
from .results import MultiRow, RankResult, Row
from .run import iterations, run_scenario
from .scenarios import MULTI_SCENARIOS, QUICK_SHAPE, ModelShape, Scenario, quick
from .workload import make_workload


def cpu_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _rank_device(env: RankEnv, name: str | None) -> torch.device:
    kind = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu")).type
    if kind != "cuda":
        return torch.device(kind)
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)  # before any CUDA work: NCCL and the peers use the current device
    return device


class _Rank:
    """One rank's part of the run; rank 0 also collects the rows."""

    def __init__(self, env: RankEnv, device: torch.device, group: Any, args: argparse.Namespace,
                 shape: ModelShape, threads: int) -> None:
        self.env, self.device, self.group, self.args, self.shape = env, device, group, args, shape
        self.threads = threads
        self.opts = MultiOptions(PeerOptions(args.offtensor_prefetch, args.offtensor_max_scope_mib),
                                 fsdp2_offload_root=args.fsdp2_offload_root)
        self.wrapped_bytes = 0
        self.nodes: list[str] = []  # every rank's host name

    # ---- bookkeeping over the gloo group (Note [two process groups] in launch.py) ----

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.group)

    def gather(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order, on rank 0 (an empty list elsewhere)."""
        out: list[Any] | None = [None] * self.env.world if self.env.rank == 0 else None
        torch.distributed.gather_object(obj, out, dst=0, group=self.group)
        return out or []

    def everyone(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.env.world
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out

    def from_rank0(self, obj: Any) -> Any:
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def say(self, text: str) -> None:
        if self.env.rank == 0:
            print(text, flush=True)

    # ---- measurements ----

    def bandwidth(self) -> dict[str, Any]:
        """Host-to-device bandwidth of rank 0 alone (the single-GPU floor's), then of every
        rank at once (do the links slow each other down?)."""
        nbytes = (64 if self.args.quick else 1024) * 2**20
        alone = measure_bandwidth(self.device, nbytes) if self.env.rank == 0 else None
        self.barrier()
        at_once = self.gather(measure_bandwidth(self.device, nbytes)["h2d"])
        return {"alone": alone, "at_once_h2d": at_once}

    def baseline(self, scenarios: list[Scenario]) -> tuple[dict[str, dict[str, Any]], str]:
        """One GPU with offtensor at the same per-rank shape: (per scenario, where it came from)."""
        source = self.args.baseline
        if source == "skip":
            return {}, "not measured (--baseline skip)"
        if source != "measure":
            return self.args.baseline_data, f"from {source}"
        out: dict[str, dict[str, Any]] = {}
        threads = self.threads * self.env.local_world
        if self.env.rank == 0:
            self.say(f"bench: 1-GPU baseline: offtensor on rank 0 alone, {threads} threads")
            with temporarily(torch.get_num_threads, torch.set_num_threads, threads):
                for s in scenarios:
                    out[s.name] = self._one_gpu(s)
        self.barrier()
        return out, f"measured on rank 0 alone with {threads} CPU threads while the other ranks waited"

    def _one_gpu(self, s: Scenario) -> dict[str, Any]:
        free_memory(self.device)
        row = Row(s.name, "offtensor", "ok", batch=s.batch, seq=s.seq)
        built: BuiltModel | None = None
        try:
            built = build_model(self.shape, s.variant, self.device, self.args.seed)
            setup_offtensor(built, self.device, self.opts.peer)
            warmup, iters = iterations(self.args, s)
            run_scenario(built, s, self.device, warmup=warmup, iters=iters, max_seconds=self.args.max_scenario_s,
                         seed=self.args.seed, row=row, peer="offtensor", worker=self.args.worker)
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on without it
            return {"error": f"failed: {short_error(exc)}"}
        finally:
            built = None  # the model is freed before the next one
            free_memory(self.device)
        assert row.median_ms is not None
        self.say(f"  offtensor/{s.name} on one GPU: {row.median_ms:.1f} ms")
        return {"median_ms": row.median_ms, "tokens_per_s": tokens_per_s(s.batch, s.seq, row.median_ms),
                "peak_vram_bytes": row.peak_vram_bytes, "times_ms": row.times_ms, "note": row.note}

    def warm_up(self) -> None:
        """A forward of a one-layer quick model on every rank: the one-time host allocations
        (transformers' model code, kernels' first use) then count in no peer's host memory."""
        built = build_model(dataclasses.replace(QUICK_SHAPE, layers=1), "base", self.device, self.args.seed)
        built.model.to(self.device)
        with torch.no_grad():
            built.model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=self.device), use_cache=False)
        del built
        free_memory(self.device)

    def measure(self, peer: str, s: Scenario) -> RankResult:
        """`peer` in `s` on this rank, while every other rank does the same."""
        result = RankResult(self.env.rank, self.env.node)
        free_memory(self.device)
        self.barrier()
        host0, used0 = host_pss(), node_used_bytes() if self.env.local_rank == 0 else None
        built: BuiltModel | None = None
        try:
            built = build_model(self.shape, s.variant, self.device, self.args.seed)
            result.wrapped_bytes = built.wrapped_bytes
            result.how = MULTI_PEERS[peer].setup(built, self.device, self.opts)
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
            result.status, result.note = "error", f"setup failed: {short_error(exc)}"
        failed = [f"rank {r}: {note}" for r, (status, note) in enumerate(self.everyone((result.status, result.note)))
                  if status != "ok"]
        if built is not None and not failed:
            try:
                self._time(built, peer, s, result)
            except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
                result.status, result.note = "error", f"{result.note} {short_error(exc)}".strip()
        elif result.status == "ok":
            result.status, result.note = "error", f"not run: {'; '.join(failed)}"
        self.barrier()
        host1, used1 = host_pss(), node_used_bytes() if self.env.local_rank == 0 else None
        if host0 is not None and host1 is not None:
            result.host_growth_bytes, result.host_measure = host1[0] - host0[0], host1[1]
        if used0 is not None and used1 is not None:
            result.node_used_growth_bytes = used1 - used0
        built = None
        free_memory(self.device)
        return result

    def _time(self, built: BuiltModel, peer: str, s: Scenario, result: RankResult) -> None:
        """Warm-up steps, then the timed ones, started together on every rank (each rank's own
        tokens); the steps an overlapped optimizer finishes in the background count in the last."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.args.seed + 1000 * (self.env.rank + 1))
        ids = torch.randint(0, built.vocab, (s.batch, s.seq), device=self.device, generator=gen)
        row = Row(s.name, peer, "ok", batch=s.batch, seq=s.seq)
        work = make_workload(built, s, self.device, ids, row, peer, self.args.worker,
                             overlap=MULTI_PEERS[peer].overlap)
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        warmup, iters = iterations(self.args, s)
        timed(self.device, work.first_step)
        for _ in range(warmup - 1):
            timed(self.device, work.step)
        work.drain()
        self.barrier()
        times = [timed(self.device, work.step) / work.per_step for _ in range(iters)]
        times[-1] += timed(self.device, work.drain) / work.per_step
        result.times_ms = [t * 1e3 for t in times]
        if self.device.type == "cuda":
            result.peak_vram_bytes = torch.cuda.max_memory_allocated(self.device)
        result.grads_kept, result.note = row.grads_kept, row.note
        work.optimizers.clear()


def _scenarios(args: argparse.Namespace) -> list[Scenario]:
    chosen = [MULTI_SCENARIOS[n] for n in MULTI_SCENARIOS if n in args.scenarios]
    return [quick(s) for s in chosen] if args.quick else chosen


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return dataclasses.asdict(v)
    return [_plain(x) for x in v] if isinstance(v, list) else v


class _Table:
    """Rank 0's rows, and what the JSON and the head of the table say about the run; the JSON
    is rewritten after every row, so a run stopped part-way leaves what it measured."""

    def __init__(self, rank: _Rank, bw: dict[str, Any], baseline: dict[str, Any], source: str) -> None:
        self.rows: list[MultiRow] = []
        self.json_path: str | None = rank.args.json
        self.has_infer = any(s.kind == "infer" for s in _scenarios(rank.args))
        self.info: dict[str, Any] = {
            "environment": environment(rank.device),
            "args": {k: _plain(v) for k, v in vars(rank.args).items() if k != "baseline_data"},
            "world": rank.env.world, "nodes": sorted(set(rank.nodes)), "backend": str(torch.distributed.get_backend()),
            "threads_per_rank": rank.threads, "model": dataclasses.asdict(rank.shape), "wrapped_bytes": 0,
            "bandwidth": bw, "floor_ms": None, "baseline": baseline, "baseline_source": source}

    def add(self, peer: str, s: Scenario, results: list[RankResult]) -> None:
        info = self.info
        if not info["wrapped_bytes"] and any(r.wrapped_bytes for r in results):
            info["wrapped_bytes"] = max(r.wrapped_bytes for r in results)
            alone = info["bandwidth"].get("alone")
            if self.has_infer and alone:
                info["floor_ms"] = info["wrapped_bytes"] / alone["h2d"] * 1e3
        self.rows.append(make_row(peer, s, results, baseline=info["baseline"].get(s.name),
                                  floor_ms=info["floor_ms"], judged=MULTI_PEERS[peer].offtensor,
                                  grads_sharded=MULTI_PEERS[peer].grads_sharded))
        self.write()

    def write(self) -> None:
        if self.json_path:
            write_json(self.json_path, multi_json(self.info, self.rows))


def _run(rank: _Rank) -> None:
    args, scenarios = rank.args, _scenarios(rank.args)
    rank.nodes = rank.everyone(rank.env.node)
    rank.say(f"bench: {rank.env.world} ranks, {rank.shape}, peers {args.peers}, scenarios "
             f"{[s.name for s in scenarios]} (per rank)")
    rank.warm_up()
    bw = rank.bandwidth()
    baseline, source = rank.baseline(scenarios)  # every rank: the others wait while rank 0 measures
    table = _Table(rank, bw, baseline, source) if rank.env.rank == 0 else None
    for peer in args.peers:
        why = rank.from_rank0(multi_peer_unavailable(peer, rank.device))
        for s in scenarios:
            if why is not None:
                if table is not None:
                    table.rows.append(MultiRow(s.name, peer, "skipped", why, batch=s.batch, seq=s.seq,
                                               world=rank.env.world))
                continue
            rank.say(f"bench: {peer}/{s.name}")
            results: list[RankResult] = rank.gather(rank.measure(peer, s))
            if table is not None:
                table.add(peer, s, results)
    if table is not None:
        table.write()
        if args.json:
            print(f"bench: wrote {args.json}", flush=True)
        print_multi(table.info, table.rows, args.quick)


def rank_main(args: argparse.Namespace) -> None:
    """One rank of the several-GPU benchmark (torchrun's environment variables set)."""
    env = rank_env()
    device = _rank_device(env, args.device)
    threads = args.threads_per_rank or max(1, cpu_threads() // env.local_world)
    torch.set_num_threads(threads)  # torchrun sets OMP_NUM_THREADS=1: too few for a CPU optimizer
    group = init_groups(device, args.collective_timeout_s)
    try:
        _run(_Rank(env, device, group, args, args.shape, threads))
    finally:
        torch.distributed.destroy_process_group()


def main(args: argparse.Namespace, shape: ModelShape) -> int:
    """The several-GPU benchmark: spawn `--nproc` ranks, or be one under torchrun."""
    if not torch.distributed.is_available():
        raise SystemExit("bench: --nproc needs torch.distributed, which this torch build lacks")
    args.shape = shape
    args.baseline_data = {}
    if args.baseline not in ("measure", "skip"):
        args.baseline_data = load_baseline(args.baseline, _scenarios(args), shape)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            raise SystemExit(f"bench: --nproc {args.nproc}, but torchrun started {world} ranks; leave --nproc out "
                             "under torchrun")
        rank_main(args)
        return 0
    cuda = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    if cuda and args.nproc > torch.cuda.device_count():
        raise SystemExit(f"bench: --nproc {args.nproc}, but torch sees {torch.cuda.device_count()} CUDA device(s): "
                         "one rank per GPU; --device cpu runs the ranks on the CPU with gloo")
    return spawn(args.nproc, rank_main, args)
