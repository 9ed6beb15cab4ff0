"""--shape qwen3-30b-a3b | gpt-oss-20b: one placed model per peer (moe.py) through decode at
batch 1 and 8, a 1x2048 prefill and a LoRA step, in that order (the LoRA step changes the
adapters); each row's outputs against the resident model's, bit for bit, and the decode rows'
bytes copied per step against the active bytes (Note [active bytes])."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import offtensor

from .dit_profile import where_time_goes
from .host_profile import describe_python, python_profile
from .measure import GiB, free_memory, measure_bandwidth, setup_failed, short_error, sync, timed
from .model import BuiltModel, enable_checkpointing
from .moe import MOE_SHAPES, QUICK_MOE_SHAPES, ActiveBytes, MoeShape, build_moe, setup_moe_peer, with_cache
from .optimizer import make_adamw
from .peers import skipped_unavailable
from .report import environment, write_json
from .scenarios import SHAPE_SCENARIOS, Scenario

PROMPT = 32  # tokens of the prompt a decode row's cache starts from (8 with --quick)


@dataclass
class MoeRow:
    """One scenario on one peer."""

    scenario: str
    peer: str
    status: str  # ok | error | skipped
    note: str = ""
    batch: int = 0
    seq: int = 0
    times_ms: list[float] = field(default_factory=list)
    median_ms: float | None = None
    tokens_per_s: float | None = None  # decode: batch / step; prefill: its tokens / time
    bytes_per_step: int | None = None  # offtensor peers: host-to-device bytes per timed iteration
    active_bytes: int | None = None  # decode: Note [active bytes] per step
    expert_hit_rate: float | None = None  # offtensor peers: of the expert rows ops needed, the share found
    peak_vram_bytes: int | None = None
    exact: bool | None = None  # outputs equal the resident model's, bit for bit
    max_abs_diff: float | None = None
    host_calls_per_step: int | None = None  # decode: Note [host work per step]
    host_reads_per_step: int | None = None
    host_copies_per_step: int | None = None
    compute_busy_ms: float | None = None  # decode-1 on CUDA: one profiled step's kernels (Note [a decode step's floor])
    link_busy_ms: float | None = None
    host_profile: dict[str, Any] | None = None  # --host-profile: one decode step under cProfile (host_profile.py)

    @property
    def x_active(self) -> float | None:
        if self.bytes_per_step is None or not self.active_bytes:
            return None
        return self.bytes_per_step / self.active_bytes


def _counters(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """An offtensor model's (bytes to the device, expert hits, expert misses) since wrap."""
    if not offtensor.is_wrapped(model):
        return None
    scopes = offtensor.summary(model).scopes
    return (sum(s.bytes_to_device for s in scopes), sum(s.expert_hits for s in scopes),
            sum(s.expert_misses for s in scopes))


def _count_since(model: torch.nn.Module, before: tuple[int, int, int] | None, row: MoeRow) -> None:
    """The row's bytes per timed iteration and expert hit rate, from the counters `before` them."""
    after = _counters(model)
    if before is None or after is None:
        return
    moved, hits, misses = (a - b for a, b in zip(after, before, strict=True))
    row.bytes_per_step = moved // len(row.times_ms)
    row.expert_hit_rate = hits / (hits + misses) if hits + misses else None


def _decode(built: BuiltModel, s: Scenario, device: torch.device, args: argparse.Namespace, row: MoeRow,
            active: ActiveBytes) -> list[torch.Tensor]:
    """Greedy decode from a random prompt: one untimed prefill, warm-up steps, timed steps; the
    logits of every step (on the host)."""
    model: Any = built.model.eval()
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, built.vocab, (s.batch, 8 if args.quick else PROMPT), generator=gen).to(device)
    out: list[torch.Tensor] = []
    with torch.no_grad():
        result = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, step = with_cache(model, result), result.logits[:, -1:].argmax(-1)

        def one() -> None:
            nonlocal cache, step
            r = model(input_ids=step, **cache, use_cache=True)
            cache, step = with_cache(model, r), r.logits[:, -1:].argmax(-1)
            out.append(r.logits.float().cpu())

        for _ in range(args.warmup or 2):
            one()
        before = _counters(model)
        for _ in range(args.iters or (3 if args.quick else 16)):
            with active.step():
                row.times_ms.append(timed(device, one) * 1e3)
        _count_since(model, before, row)
        row.host_calls_per_step, row.host_reads_per_step, row.host_copies_per_step = _host_work(one)
        if s.batch == 1:
            timeline = where_time_goes(one, device)  # None off CUDA
            if timeline is not None:
                row.compute_busy_ms, row.link_busy_ms = timeline["compute_busy_ms"], timeline["link_busy_ms"]
        if getattr(args, "host_profile", 0):  # Note [a row's host profile]
            row.host_profile = python_profile(one, device, args.host_profile)
    row.active_bytes = active.per_step()
    active.steps = active.total = 0
    return out


# Note [host work per step]
# A decode step of a routed model is short on the device, so its host work decides its time: the
# Python calls, the reads of device values (each waits for the device to reach that value) and the
# copies issued from Python. Counted with a profile hook over one untimed step, after the timed
# ones, they are the same on the CPU as on CUDA, so a CPU run shows what a change saves there.
# READS and COPIES name the builtins counted.

READS = frozenset({"item", "tolist", "nonzero", "_unique2", "unique_dim"})  # torch.unique calls the latter two
COPIES = frozenset({"copy_", "_foreach_copy_", "index_copy_"})


def _host_work(one: Callable[[], None]) -> tuple[int, int, int]:
    """(Python and builtin calls, reads of device values, copies) of one call of `one` on this
    thread (Note [host work per step])."""
    counts = [0, 0, 0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[0] += 1
        elif event == "c_call":
            counts[0] += 1
            name = getattr(arg, "__name__", "")
            counts[1] += name in READS
            counts[2] += name in COPIES

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        one()
    finally:
        sys.setprofile(previous)
    return counts[0], counts[1], counts[2]


def _prefill(built: BuiltModel, s: Scenario, device: torch.device, args: argparse.Namespace,
             row: MoeRow) -> list[torch.Tensor]:
    model: Any = built.model.eval()
    ids = torch.randint(1, built.vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(device)
    out: list[torch.Tensor] = []

    def one() -> None:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        if not out:
            out.append(logits.float().cpu())

    _timed_iterations(built, one, device, args, row)
    return out


def _lora_step(built: BuiltModel, s: Scenario, device: torch.device, args: argparse.Namespace,
               row: MoeRow) -> list[torch.Tensor]:
    """Forward (checkpointed layers), the LM loss, backward, fused AdamW on the adapters."""
    model: Any = built.model.train()
    enable_checkpointing(model)
    optimizers, _ = make_adamw([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(1, built.vocab, (s.batch, s.seq), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(device)
    losses: list[torch.Tensor] = []

    def one() -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float().cpu().reshape(1))

    _timed_iterations(built, one, device, args, row)
    return losses[:1]


def _timed_iterations(built: BuiltModel, one: Callable[[], None], device: torch.device, args: argparse.Namespace,
                      row: MoeRow) -> None:
    for _ in range(args.warmup or 1):
        one()
    before = _counters(built.model)
    for _ in range(args.iters or (1 if args.quick else 3)):
        row.times_ms.append(timed(device, one) * 1e3)
    _count_since(built.model, before, row)


def _check(row: MoeRow, out: list[torch.Tensor], refs: dict[str, list[torch.Tensor]]) -> None:
    if row.peer == "resident":
        refs[row.scenario] = out
        row.exact = True
        return
    ref = refs.get(row.scenario)
    if ref is None or len(ref) != len(out):
        return
    row.exact = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    row.max_abs_diff = max(float((a - b).abs().max()) for a, b in zip(out, ref, strict=True))


WORKLOADS = {"decode": _decode, "infer": _prefill, "frozen-step": _lora_step}


# Note [attention kernels of the MoE rows]
# Every peer's rows run with cuDNN's attention left out of scaled_dot_product_attention's choice.
# Where PyTorch picks it (CUDA builds on Hopper), cuDNN builds an execution graph for each new
# key length, and a decode step's cache is one token longer than the last step's: every layer's
# attention then spends milliseconds of host time building one, in every peer alike. That cost
# is the attention library's, not the model's compute nor the link's: it would make the resident
# model slower than routed streaming (whose copies run while the host builds) and the floor
# below meaningless. Flash, memory-efficient and math kernels remain, as on the CPU.
_ATTENTION_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _scenario(built: BuiltModel, s: Scenario, device: torch.device, args: argparse.Namespace, row: MoeRow,
              refs: dict[str, list[torch.Tensor]], active: ActiveBytes) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    with sdpa_kernel(_ATTENTION_KERNELS):  # Note [attention kernels of the MoE rows]
        if s.kind == "decode":
            out = _decode(built, s, device, args, row, active)
        else:
            out = WORKLOADS[s.kind](built, s, device, args, row)  # type: ignore[operator]
    row.median_ms = statistics.median(row.times_ms)
    tokens = s.batch if s.kind == "decode" else s.batch * s.seq
    row.tokens_per_s = tokens / (row.median_ms / 1e3)
    if device.type == "cuda":
        row.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
    _check(row, out, refs)
    print(f"  {row.peer}/{row.scenario}: median {row.median_ms:.1f} ms, {row.tokens_per_s:.1f} tokens/s"
          + (f", {row.bytes_per_step / 1e6:.3g} MB copied per step" if row.bytes_per_step is not None else "")
          + (f" ({row.x_active:.2f}x the active bytes)" if row.x_active is not None else "")
          + (f", output {'equal to' if row.exact else 'differs from'} resident" if row.exact is not None else "")
          + (f"; host per step: {row.host_calls_per_step} Python calls, {row.host_reads_per_step} device reads, "
             f"{row.host_copies_per_step} copies" if row.host_calls_per_step is not None else "")
          + (f"; one profiled step: kernels busy {row.compute_busy_ms:.1f} ms, link busy {row.link_busy_ms:.1f} ms"
             if row.compute_busy_ms is not None and row.link_busy_ms is not None else ""),
          flush=True)
    if row.host_profile is not None:
        print("\n".join(f"    {line}" for line in describe_python(row.host_profile)), flush=True)


def run_moe_peer(peer: str, shape: MoeShape, scenarios: list[Scenario], device: torch.device,
                 args: argparse.Namespace, rows: list[MoeRow], setups: dict[str, Any],
                 refs: dict[str, list[torch.Tensor]]) -> None:
    """Every scenario on one freshly built and placed model; a row each."""
    mine = [MoeRow(s.name, peer, "ok", batch=s.batch, seq=s.seq) for s in scenarios]
    rows += mine
    if skipped_unavailable(peer, "accelerate" if peer == "accelerate" else "offtensor" if peer != "resident" else peer,
                           mine):
        return
    print(f"bench: {peer}", flush=True)
    built = build_moe(shape, device, args.seed)
    try:
        setups[peer] = setup_moe_peer(peer, built, device, args.offtensor_vram_budget_gib)
        print(f"  {setups[peer]}", flush=True)
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result
        setup_failed(mine, peer, exc)
        del built
        free_memory(device)
        return
    active = ActiveBytes(built)
    for s, row in zip(scenarios, mine, strict=True):
        try:
            _scenario(built, s, device, args, row, refs, active)
        except Exception as exc:  # noqa: BLE001 - reported; the next scenario still runs
            row.status, row.note = "error", short_error(exc)
            print(f"  {peer}/{s.name}: {row.note}", flush=True)
    active.remove()
    del built, active
    free_memory(device)


# Note [a decode step's floor]
# A routed layer's experts are known only once its router ran, so its copies cannot start before
# that layer's compute does: decode-1's floor is the row's copied bytes at the link's speed plus
# the resident model's compute. On CUDA that compute is the kernels' busy time in one profiled
# resident step (the resident step's own time is mostly host time at batch 1, which a streamed
# row's copies may hide); elsewhere the resident step's time, which is all compute.


def decode_floor(rows: list[MoeRow], row: MoeRow, h2d: float) -> tuple[float, float] | None:
    """(decode-1's floor in ms, the row's time over it): Note [a decode step's floor]."""
    resident = next((r for r in rows if r.peer == "resident" and r.scenario == row.scenario), None)
    if resident is None or resident.median_ms is None or row.median_ms is None or row.bytes_per_step is None:
        return None
    compute = resident.compute_busy_ms if resident.compute_busy_ms is not None else resident.median_ms
    floor = compute + row.bytes_per_step / h2d * 1e3
    return floor, row.median_ms / floor


def format_moe_table(rows: list[MoeRow], head: str, h2d: float) -> str:
    """One line per peer: each scenario's tokens/s (the LoRA step's ms), decode bytes per step
    against the active bytes, the expert hit rate, decode-1 against its floor (`decode_floor`)
    and against whole-layer streaming, decode-1's host work (Note [host work per step]) and
    whether the outputs equal resident's."""
    names = list(dict.fromkeys(r.scenario for r in rows))
    whole = next((r for r in rows if r.peer == "offtensor-whole" and r.scenario == "decode-1"), None)
    lines = [head, "", "| peer | " + " | ".join(names) + " | decode-1 GB/step | x active | hit rate "
             "| decode-1 floor ms | x floor | x whole | decode-1 calls / reads / copies | = resident |",
             "| --- | " + " | ".join("---:" for _ in names) + " | ---:" * 7 + " | --- |"]
    for peer in dict.fromkeys(r.peer for r in rows):
        mine = {r.scenario: r for r in rows if r.peer == peer}
        cells = []
        for n in names:
            r = mine.get(n)
            if r is None or r.median_ms is None:
                cells.append(r.status if r is not None else "-")
            else:
                cells.append(f"{r.median_ms:.0f} ms" if n.startswith("lora") else f"{r.tokens_per_s:.1f} tok/s")
        b1 = next((r for r in mine.values() if r.scenario == "decode-1"), None)
        moved = f"{b1.bytes_per_step / 1e9:.3g}" if b1 and b1.bytes_per_step is not None else "-"
        ratio = f"{b1.x_active:.2f}" if b1 and b1.x_active is not None else "-"
        hits = [b1.expert_hit_rate] if b1 and b1.expert_hit_rate is not None else []
        exact = [r.exact for r in mine.values() if r.exact is not None]
        host = (f"{b1.host_calls_per_step} / {b1.host_reads_per_step} / {b1.host_copies_per_step}"
                if b1 and b1.host_calls_per_step is not None else "-")
        floor = decode_floor(rows, b1, h2d) if b1 else None
        floors = f"{floor[0]:.1f} | {floor[1]:.2f}" if floor else "- | -"
        faster = (f"{whole.median_ms / b1.median_ms:.1f}" if b1 and b1.median_ms and whole and whole.median_ms
                  and peer.startswith("offtensor-routed") else "-")
        lines.append(f"| {peer} | " + " | ".join(cells) + f" | {moved} | {ratio} | "
                     + (f"{hits[-1]:.2f}" if hits else "-") + f" | {floors} | {faster} | {host} | "
                     + (("yes" if all(exact) else "no") if exact else "-") + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace, device: torch.device, json_args: dict[str, Any]) -> int:
    """The MoE benchmark: each peer of `args.peers` (resident first) over `args.scenarios`,
    then the table (and --json, rewritten after each peer)."""
    base = (QUICK_MOE_SHAPES if args.quick else MOE_SHAPES)[args.shape]
    shape = dataclasses.replace(base, layers=args.layers or base.layers)
    known = SHAPE_SCENARIOS[args.shape]
    scenarios = [known[n] for n in known if n in args.scenarios]  # canonical order
    if args.quick:
        scenarios = [dataclasses.replace(s, seq=min(s.seq, 32)) for s in scenarios]
    env = environment(device)
    probe = build_moe(shape, device, args.seed)
    active = ActiveBytes(probe)
    model = {"shape": dataclasses.asdict(shape), "total_bytes": probe.total_bytes, "layer_bytes": probe.wrapped_bytes,
             "expert_bytes": active.expert_bytes, "non_expert_layer_bytes": active.fixed}
    print(f"bench: --shape {shape}; {probe.total_bytes / GiB:.1f} GiB bf16, experts {active.expert_bytes / GiB:.1f} "
          f"GiB; on {env.get('gpu', device)}; torch {env['torch']}", flush=True)
    del probe, active
    bw = measure_bandwidth(device, (256 if args.quick else 1024) * 2**20)
    rows: list[MoeRow] = []
    setups: dict[str, Any] = {}
    refs: dict[str, list[torch.Tensor]] = {}
    interrupted = False

    def write() -> None:
        if args.json:
            result = {"environment": env, "interrupted": interrupted, "args": json_args, "model": model,
                      "bandwidth": bw, "setups": setups,
                      "results": [{**dataclasses.asdict(r), "x_active": r.x_active} for r in rows]}
            write_json(args.json, json.loads(json.dumps(result, default=str)))

    try:
        for peer in sorted(args.peers, key=lambda n: n != "resident"):
            run_moe_peer(peer, shape, scenarios, device, args, rows, setups, refs)
            write()
    except KeyboardInterrupt:
        interrupted = True
        print("bench: interrupted; reporting the results so far", flush=True)
    write()
    print()
    print(format_moe_table(rows, f"--shape {shape}, bf16, on {env.get('gpu', env['device'])} | "
                                 f"H2D {bw['h2d'] / 1e9:.1f} GB/s", bw["h2d"]), flush=True)
    return 0
