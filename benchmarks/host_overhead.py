"""`python -m benchmarks host-overhead`: the host's share of a step, offtensor against the
plain model and the other offloaders, at shapes small enough that the host (Python) dominates.

On the CPU (the default) the compute device is the host itself, so what an offloader adds to the
plain model's step is its host cost (plus, for streamed scopes, a memcpy of their bytes).

Rows: a DiT (diffusers' FluxTransformer2DModel) and an LLM (transformers' LlamaForCausalLM),
random weights built from config objects (nothing downloaded), each in a forward with autograd
on, a training step (grads set to None, forward, loss, backward), a forward under
torch.no_grad() and under torch.inference_mode(), the training step followed by an AdamW step (a
training loop: each step writes every master, and a kept scope's next forward reloads what it
wrote; on a GPU the plain model steps there, offtensor on the host: that row counts the host's
AdamW), and a LoRA training step with gradient checkpointing (the model frozen, rank-4 peft
adapters on the attention's q/k/v, checkpointing per block: host_overhead_lora.py). Peers:
`plain`, offtensor `kept` (every scope resident: Policy(vram_budget=2**40)), `streamed`
(Policy()), both with param_filter=frozen_only in the LoRA row, `fp8` (Policy(frozen_format=
"fp8") on a frozen copy: the no-grad and inference rows), diffusers' block-level group offloading
and accelerate's cpu_offload on each block (not in the LoRA row: it keeps no grads), when
installed; `memcpy`: one copy of the scopes' bytes.

Method: one thread (torch.set_num_threads(1)); each peer's step timed with time.thread_time();
in each round every peer runs its steps in turn (the order rotated each round), and a peer's
figure is the median over rounds of its time over the plain model's in the same round. Python
calls per step are counted (sys.setprofile 'call' events) in an untimed step; each peer's output
(and grads, training) is compared with the plain model's, bit for bit (fp8 with the plain model
whose matrices are rounded as fp8 stores them), and in training the plain model's grads must
all be non-zero (else equal grads prove little). Then: the kept training step's ratio as the
number of scopes grows (scaling), and single ops and metadata reads on an offloaded parameter
(host_overhead_ops.py). On the CPU, glibc keeps freed memory for reuse for the whole run, for
every peer (Note [page faults]).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

try:
    import resource
except ImportError:  # not on Windows: no page faults are counted there
    resource = None  # type: ignore[assignment]

import offtensor

from .dit import fp8_round_trip_
from .host_overhead_checks import CLOSE, CLOSE_MEANS, NO_GRADS, compare, compare_weights, counted, grads
from .host_overhead_lora import NOT_APPLICABLE, diffusers_checkpointing, lora_base, transformers_checkpointing
from .measure import freed_memory_kept, short_error, sync, version
from .streamed import fp8_compressed

PEERS = ("plain", "kept", "streamed", "fp8", "diffusers", "accelerate", "memcpy")
HEADERS = {"plain": "plain ms", "kept": "offtensor kept", "streamed": "offtensor streamed",
           "fp8": "offtensor fp8 streamed", "diffusers": "diffusers (block, hooks)",
           "accelerate": "accelerate cpu_offload", "memcpy": "memcpy of the scopes"}
KEEP_ALL = 2**40  # a VRAM budget every scope fits in: each is kept


@dataclass(frozen=True)
class Workload:
    """A model at a host-bound shape: how to build it, its inputs, its forward, its blocks."""

    name: str
    what: str
    build: Callable[[], nn.Module]
    inputs: dict[str, torch.Tensor]
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]  # offtensor's scopes (its default predicate's)
    group_root: Callable[[nn.Module], nn.Module]  # where diffusers' block-level offloading applies
    lora_targets: tuple[str, ...]  # the modules the LoRA row's adapters go on
    checkpointing: Callable[[nn.Module], None]  # turns on the LoRA row's checkpointing per block


@dataclass(frozen=True)
class Mode:
    """How a row runs a step."""

    name: str
    train: bool = False
    context: Callable[[], Any] = torch.enable_grad
    frozen: bool = False  # no autograd: a frozen (fp8) copy computes the same thing
    lora: bool = False  # on the LoRA base (host_overhead_lora.py): adapters trained, checkpointed
    step: bool = False  # an optimizer step (AdamW, torch's defaults) after backward: a training loop


MODES = (Mode("forward"), Mode("train", train=True), Mode("forward, no_grad", context=torch.no_grad, frozen=True),
         Mode("forward, inference_mode", context=torch.inference_mode, frozen=True),
         # Last of the rows on the shared copies: its steps change the weights (alike for every peer)
         Mode("train + AdamW step", train=True, step=True),
         Mode("LoRA train, checkpointed", train=True, lora=True))


@dataclass
class Cell:
    """One peer in one row."""

    ratios: list[float] = field(default_factory=list)  # per round, over the plain model's time
    seconds: list[float] = field(default_factory=list)  # per step, per round
    calls: int | None = None  # Python calls per step
    faults: list[float] = field(default_factory=list)  # minor page faults per step, per round (Note [page faults])
    check: str = ""  # '=' (bit for bit), 'no grads', or what differs
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None


# ---- the models ---------------------------------------------------------------------------------


def flux(double: int, single: int, heads: int, head_dim: int, image: int, text: int) -> Workload:
    """diffusers' FluxTransformer2DModel (patch 1, 16 latent channels), fp32, batch 1."""
    from diffusers import FluxTransformer2DModel

    third = head_dim // 4 * 2
    axes = (head_dim - 2 * third, third, third)
    joint, pooled = 2 * heads * head_dim, heads * head_dim

    def build() -> nn.Module:
        torch.manual_seed(0)
        return cast(nn.Module, FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=joint,
            pooled_projection_dim=pooled, guidance_embeds=True, axes_dims_rope=axes))

    gen = torch.Generator().manual_seed(1)
    side = int(image**0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(image // side), indexing="ij")
    inputs = {"hidden_states": torch.randn(1, image, 16, generator=gen),
              "encoder_hidden_states": torch.randn(1, text, joint, generator=gen),
              "pooled_projections": torch.randn(1, pooled, generator=gen),
              "timestep": torch.full((1,), 0.5), "guidance": torch.full((1,), 3.5),
              "img_ids": torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).flatten(0, 1).float(),
              "txt_ids": torch.zeros(text, 3)}

    def forward(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(torch.Tensor, model(**x, return_dict=False)[0])

    def blocks(model: nn.Module) -> list[nn.Module]:
        return [*model.transformer_blocks, *model.single_transformer_blocks]  # type: ignore[misc]

    return Workload("Flux", f"FluxTransformer2DModel, {double} double + {single} single blocks, hidden "
                    f"{heads * head_dim}, {image} image + {text} text tokens, fp32",
                    build, inputs, forward, blocks, lambda m: m, ("to_q", "to_k", "to_v"), diffusers_checkpointing)


def llama(layers: int, hidden: int, tokens: int, name: str = "Llama") -> Workload:
    """transformers' LlamaForCausalLM (MLP 2x hidden, 64-wide heads, 2 KV heads), fp32, batch 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,  # type: ignore[call-arg]
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 128), vocab_size=512, max_position_embeddings=256,
                         attn_implementation="sdpa")

    def build() -> nn.Module:
        torch.manual_seed(0)
        return cast(nn.Module, LlamaForCausalLM(config))

    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))

    def forward(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(torch.Tensor, model(input_ids=x["input_ids"], use_cache=False).logits)

    def inner(model: nn.Module) -> nn.Module:
        return cast(nn.Module, model.model)

    return Workload(name, f"LlamaForCausalLM, {layers} layers, hidden {hidden}, {tokens} tokens, fp32",
                    build, {"input_ids": ids}, forward, lambda m: list(cast(nn.ModuleList, inner(m).layers)), inner,
                    ("q_proj", "k_proj", "v_proj"), transformers_checkpointing)


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [flux(1, 2, 2, 16, 16, 4), llama(2, 64, 8)]
    return [flux(4, 8, 4, 32, 64, 16), llama(8, 256, 16)]


# ---- the peers ----------------------------------------------------------------------------------


def _offtensor(model: nn.Module, device: torch.device, policy: offtensor.Policy, lora: bool) -> nn.Module:
    if lora:
        policy = dataclasses.replace(policy, param_filter=offtensor.frozen_only)
    offtensor.wrap(model, device=device, policy=policy)
    return model.to(device)


def setup(peer: str, base: nn.Module, w: Workload, device: torch.device, lora: bool = False) -> tuple[nn.Module, str]:
    """A copy of `base` placed as `peer` does it, and how, in words; `lora`: offtensor offloads
    the frozen parameters only (the LoRA base's)."""
    model = copy.deepcopy(base)
    frozen_only = ", param_filter=frozen_only" if lora else ""
    if peer == "plain":
        return model.to(device), "the model on the device"
    if peer == "kept":
        return (_offtensor(model, device, offtensor.Policy(vram_budget=KEEP_ALL), lora),
                f"Policy(vram_budget=2**40{frozen_only})")
    if peer == "streamed":
        return (_offtensor(model, device, offtensor.Policy(), lora),
                "Policy(param_filter=frozen_only)" if lora else "Policy()")
    if peer == "fp8":
        model.requires_grad_(False)
        return _offtensor(model, device, offtensor.Policy(frozen_format="fp8"), lora), \
            "Policy(frozen_format='fp8'), the model frozen"
    if peer == "diffusers":
        from diffusers.hooks import apply_group_offloading

        model.to(device)
        apply_group_offloading(w.group_root(model), onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)
        return model, "apply_group_offloading(block_level, num_blocks_per_group=1), hooks, no stream"
    if peer == "accelerate":
        from accelerate import cpu_offload

        model.to(device)
        for block in w.blocks(model):
            cpu_offload(block, execution_device=device)
        return model, "cpu_offload(block, execution_device) on each block"
    raise AssertionError(peer)


def unavailable(peer: str) -> str | None:
    module = {"diffusers": "diffusers", "accelerate": "accelerate"}.get(peer)
    return f"{module} not installed" if module is not None and version(module) is None else None


def fp8_reference(base: nn.Module, w: Workload, device: torch.device) -> nn.Module:
    """The plain model with the block matrices Policy(frozen_format="fp8") compresses rounded as
    it stores them: what the fp8 peer must compute."""
    model = copy.deepcopy(base).requires_grad_(False)
    for block in w.blocks(model):
        for p in block.parameters():
            if fp8_compressed(p):
                fp8_round_trip_(p)
    return model.to(device)


class Memcpy:
    """One copy of every scope's bytes, scope by scope, host to device: the copies' own cost."""

    def __init__(self, w: Workload, base: nn.Module, device: torch.device) -> None:
        sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in w.blocks(base)]
        pin = device.type == "cuda"
        self.pairs = [(torch.empty(n, dtype=torch.uint8, pin_memory=pin), torch.empty(n, dtype=torch.uint8,
                                                                                      device=device))
                      for n in sizes]
        self.bytes = sum(sizes)

    def __call__(self) -> None:
        for src, dst in self.pairs:
            dst.copy_(src, non_blocking=True)


# ---- one step, its check, its calls ---------------------------------------------------------------


def step_fn(w: Workload, model: nn.Module, mode: Mode, device: torch.device) -> Callable[[], torch.Tensor]:
    inputs = {k: v.to(device) for k, v in w.inputs.items()}
    # A tiny learning rate: the weights move (each step writes every master) and stay well scaled
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9) if mode.step else None

    def step() -> torch.Tensor:
        if mode.train:
            model.zero_grad(set_to_none=True)
        with mode.context():
            out = w.forward(model, inputs)
            if mode.train:
                out.float().square().mean().backward()
        if opt is not None:
            opt.step()  # the gradients stay for the check
        sync(device)
        return out

    return step


def python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls (sys.setprofile 'call' events) in one call of `fn`, on this thread."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn itself


# ---- timing -------------------------------------------------------------------------------------


def _seconds(fn: Callable[[], Any], iters: int) -> float:
    start = time.thread_time()
    for _ in range(iters):
        fn()
    return (time.thread_time() - start) / iters


# Note [page faults]
# On the CPU a streamed scope's device copy is a fresh allocation at every load, as on CUDA, but
# where CUDA's caching allocator hands back memory it keeps, glibc gives large freed blocks back to
# the kernel (a block it mmap'd, or the heap's top, trimmed) depending on the sizes freed before,
# and the next allocation faults its pages in again, zeroed. That cost came and went with the
# heap's history, between processes of the same benchmark, and a GPU has no such cost. So on the
# CPU the benchmark runs with glibc keeping freed blocks under 32 MiB for reuse, for every peer
# alike (`freed_memory_kept`, measure.py), and counts each peer's minor page faults per step in
# its timed turns, shown beside its ratios.


def _minor_faults() -> int:
    """This thread's minor page faults so far (the process's where the OS counts no thread's)."""
    if resource is None:
        return 0
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def time_in_turn(steps: dict[str, Callable[[], Any]], cells: dict[str, Cell], rounds: int,
                 target_s: float) -> None:
    """Each step timed in turn, `rounds` times (the order rotated each round), enough iterations
    that the plain model's take `target_s`; ratios to the plain model's time of the same round.
    What lives before is frozen out of the collector (a full collection over the libraries'
    objects takes longer than a step)."""
    gc.collect()
    gc.freeze()
    try:
        _rounds(steps, cells, rounds, target_s)
    finally:
        gc.unfreeze()


def _rounds(steps: dict[str, Callable[[], Any]], cells: dict[str, Cell], rounds: int, target_s: float) -> None:
    names = list(steps)
    iters = max(1, round(target_s / max(_seconds(steps["plain"], 1), 1e-6)))
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times: dict[str, float] = {}
        for name in order:
            try:
                faults = _minor_faults()
                times[name] = _seconds(steps[name], iters)
                cells[name].faults.append((_minor_faults() - faults) / iters)  # Note [page faults]
            except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, the rest go on
                cells[name].error = short_error(exc)
        for name in list(steps):
            if cells[name].error is not None:
                steps.pop(name)
                continue
            cells[name].seconds.append(times[name])
            cells[name].ratios.append(times[name] / times["plain"])


@dataclass
class Row:
    workload: str
    mode: str
    cells: dict[str, Cell]


def run_row(w: Workload, mode: Mode, models: dict[str, nn.Module], reference: nn.Module | None,
            memcpy: Memcpy, device: torch.device, args: argparse.Namespace) -> Row:
    """One row: every peer's first step checked against the plain model's, its Python calls
    counted, warm-up steps, then the rounds."""
    cells = {name: Cell() for name in [*models, "memcpy"]}
    steps = {name: step_fn(w, m, mode, device) for name, m in models.items()}
    taken = dict.fromkeys(steps, 0)  # steps each peer took (the plain model's calibrate the rounds too)
    steps = {name: counted(step, taken, name) for name, step in steps.items()}
    # With optimizer steps, a copy's first step is the reference: the plain model's would step it
    first = copy.deepcopy(models["plain"]) if mode.step else models["plain"]
    ref_out = step_fn(w, first, mode, device)() if mode.step else steps["plain"]()
    ref_grads = grads(first) if mode.train else None
    silent = [n for n, p in models["plain"].named_parameters() if p.requires_grad and ref_grads is not None
              and (n not in ref_grads or not ref_grads[n].any())]  # equal grads of these prove nothing
    ids = {id(p) for b in w.blocks(models["plain"]) for p in b.parameters()}
    blocks = {n for n, p in models["plain"].named_parameters() if id(p) in ids}
    fp8_out = step_fn(w, reference, mode, device)() if reference is not None and "fp8" in steps else None
    for name, step in list(steps.items()):
        try:
            out = step()
            if name == "fp8":
                assert fp8_out is not None
                cells[name].check = compare(out, None, fp8_out, None, blocks)
            else:
                got = grads(models[name]) if mode.train else None
                cells[name].check = compare(out, got, ref_out, ref_grads, blocks)
            for _ in range(args.warmup):
                step()
            cells[name].calls = python_calls(step)
        except Exception as exc:  # noqa: BLE001
            cells[name].error = short_error(exc)
            steps.pop(name)
    if silent:
        cells["plain"].check = f"FAIL no grad or all zero: {silent[:3]}"
    cells["memcpy"].check = "-"
    timed: dict[str, Callable[[], Any]] = {**steps, "memcpy": memcpy}
    time_in_turn(timed, cells, args.rounds, args.target_ms / 1e3)
    if mode.step:  # once each peer has taken as many steps as the plain model, its weights are the plain model's
        for name, step in steps.items():
            while taken[name] < taken["plain"] and cells[name].error is None:
                step()
            if name != "plain" and cells[name].check == "=":
                cells[name].check = compare_weights(models[name], models["plain"], exact=device.type == "cpu")
    return Row(w.name, mode.name, cells)


def peers_of(args: argparse.Namespace) -> list[str]:
    return [p for p in PEERS if p != "memcpy" and p in args.peers]


def place(base: nn.Module, w: Workload, device: torch.device, args: argparse.Namespace, notes: dict[str, str],
          lora: bool = False) -> dict[str, nn.Module]:
    """Each peer's copy of `base`; how it is placed, or why it is not, goes to `notes` (the LoRA
    row's under 'PEER, LoRA row' where it differs)."""
    models: dict[str, nn.Module] = {}
    hows: dict[str, str] = {}
    for peer in peers_of(args):
        why = unavailable(peer) or (NOT_APPLICABLE.get(peer) if lora else None)
        if why is not None:
            hows[peer] = why
            continue
        try:
            models[peer], hows[peer] = setup(peer, base, w, device, lora)
        except Exception as exc:  # noqa: BLE001
            hows[peer] = f"error: {short_error(exc)}"
    if "kept" in models:
        step_fn(w, models["kept"], MODES[0], device)()
        kept = [s.kept for s in offtensor.summary(models["kept"]).scopes]
        if not all(kept):
            hows["kept"] += f" (FAIL: {kept.count(False)} of {len(kept)} scopes not kept)"
    for peer, how in hows.items():
        if not lora:
            notes[peer] = how
        elif how != notes.get(peer):
            notes[f"{peer}, LoRA row"] = how
    return models


def run_workload(w: Workload, device: torch.device, args: argparse.Namespace,
                 notes: dict[str, str]) -> Iterator[Row]:
    base = w.build().eval()
    memcpy = Memcpy(w, base, device)
    models = place(base, w, device, args, notes)
    reference = fp8_reference(base, w, device) if "fp8" in models else None
    print(f"{w.name}: {w.what}; {len(w.blocks(base))} scopes, {memcpy.bytes / 2**20:.1f} MiB", flush=True)
    for mode in MODES:
        if mode.lora:  # its own copies, of one LoRA base; the rows above are done with theirs
            models = place(lora_base(base, w.lora_targets, w.checkpointing), w, device, args, notes, lora=True)
        row_models = {k: m for k, m in models.items() if k != "fp8" or mode.frozen}
        row = run_row(w, mode, row_models, reference, memcpy, device, args)
        print(f"  {mode.name}: " + ", ".join(f"{k} {_cell(c)}" for k, c in row.cells.items()), flush=True)
        yield row


# ---- report -------------------------------------------------------------------------------------


def _cell(c: Cell, plain: bool = False) -> str:
    if c.error is not None:
        return f"error: {c.error}"
    if plain:
        return f"{statistics.median(c.seconds) * 1e3:.2f}"
    if c.ratio is None:
        return "-"
    mark = "" if c.check in ("=", "-") else f" ({c.check})"
    return f"{c.ratio:.2f}{mark}"


def _calls(c: Cell | None) -> str:
    if c is None or c.calls is None:
        return "-"
    return f"{c.calls / 1e3:.1f}k" if c.calls >= 1000 else str(c.calls)


def table(rows: list[Row]) -> list[str]:
    """The markdown table: plain ms per step, then each peer's median ratio to it."""
    peers = [p for p in PEERS if any(p in r.cells for r in rows)]
    lines = ["| x plain | " + " | ".join(HEADERS[p] for p in peers) + " |",
             "| --- |" + " ---: |" * len(peers)]
    for r in rows:
        cells = [_cell(r.cells[p], plain=p == "plain") if p in r.cells else "-" for p in peers]
        lines.append(f"| {r.workload} {r.mode} | " + " | ".join(cells) + " |")
    return lines


def calls_table(rows: list[Row]) -> list[str]:
    peers = [p for p in PEERS if p != "memcpy" and any(p in r.cells for r in rows)]
    lines = ["| Python calls per step | " + " | ".join(peers) + " |", "| --- |" + " ---: |" * len(peers)]
    lines += [f"| {r.workload} {r.mode} | " + " | ".join(_calls(r.cells.get(p)) for p in peers) + " |"
              for r in rows]
    return lines


def faults_table(rows: list[Row]) -> list[str]:
    """Each peer's minor page faults per step, the median over its timed turns (Note [page faults])."""
    peers = [p for p in PEERS if p != "memcpy" and any(p in r.cells for r in rows)]
    lines = ["| page faults per step | " + " | ".join(peers) + " |", "| --- |" + " ---: |" * len(peers)]
    for r in rows:
        faults = [c.faults if (c := r.cells.get(p)) is not None else [] for p in peers]
        lines.append(f"| {r.workload} {r.mode} | "
                     + " | ".join(f"{statistics.median(f):.0f}" if f else "-" for f in faults) + " |")
    return lines


def checks(rows: list[Row]) -> str:
    bad = [f"{r.workload} {r.mode} {p}: {c.check}" for r in rows for p, c in r.cells.items()
           if c.error is None and c.check not in ("=", "-", CLOSE) and not (p == "accelerate" and c.check == NO_GRADS)]
    close = any(c.check == CLOSE for r in rows for c in r.cells.values())
    if bad:
        return "checks: FAIL " + "; ".join(bad)
    return "checks: every output and grad equals the plain model's" + (f" ({CLOSE}: {CLOSE_MEANS})" if close else "")


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="the compute device (default cpu: the host's share alone)")
    p.add_argument("--rounds", type=int, default=15, help="rounds of every peer in turn (default 15)")
    p.add_argument("--target-ms", type=float, default=60.0,
                   help="thread time of the plain model's steps in one peer's turn (default 60)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per peer and row (default 3)")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--scaling", type=int, nargs="+", default=[12, 24, 48],
                   help="scope counts of the scaling section (Llama layers; default 12 24 48)")
    p.add_argument("--no-ops", action="store_true", help="skip the per-op and metadata section")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds: seconds (the numbers mean little)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.target_ms, args.warmup, args.scaling = 3, 2.0, 1, [2, 4]
    return args


def main(name: str, argv: list[str]) -> int:
    args = parse(name, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    with freed_memory_kept() if device.type == "cpu" else contextlib.nullcontext("") as memory:
        return _measure(args, device, memory)


def _measure(args: argparse.Namespace, device: torch.device, memory: str) -> int:
    from . import host_overhead_ops as ops

    print(f"host overhead on {device}: torch {torch.__version__}, diffusers {version('diffusers')}, "
          f"transformers {version('transformers')}, accelerate {version('accelerate')}; one thread, thread "
          f"time, {args.rounds} rounds, medians of per-round ratios to the plain model"
          + (f"; {memory}" if memory else ""), flush=True)
    notes: dict[str, str] = {}
    rows = [row for w in workloads(args.quick) for row in run_workload(w, device, args, notes)]
    scaling = ops.scaling(args, device)
    per_op = [] if args.no_ops else ops.per_op(args, device)
    print()
    for peer, note in notes.items():
        print(f"{peer}: {note}")
    print(checks(rows))
    print()
    print("\n".join(ops.scaling_table(scaling)))
    if per_op:
        print()
        print("\n".join(ops.per_op_table(per_op)))
    print()
    print("\n".join(calls_table(rows)))
    print()
    print("\n".join(faults_table(rows)))
    print()
    print("\n".join(table(rows)))
    if args.json is not None:
        record = {"args": vars(args), "notes": notes, "rows": [dataclasses.asdict(r) for r in rows],
                  "scaling": [dataclasses.asdict(s) for s in scaling],
                  "per_op": [dataclasses.asdict(o) for o in per_op]}
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    return 0
