"""One scenario's work on a placed model, as callables the timing loop runs: an inference
forward, accumulating forward+backward passes, or a full training step (backward then
optimizer.step, or offtensor.backward_and_step)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .measure import PhaseClock, timed
from .model import BuiltModel, enable_checkpointing
from .optimizer import WorkerSettings, make_adamw
from .results import Row
from .scenarios import Scenario
from .streamed import StreamCounter


@dataclass
class Workload:
    """The callables of one scenario on one placed model."""

    step: Callable[[], None]  # one timed iteration
    first_step: Callable[[], None]  # the first warm-up iteration; also records the grads kept
    per_step: int = 1  # micro-batches per iteration: a time is divided by it
    forward_loss: Callable[[], torch.Tensor] | None = None  # training: the forward and loss alone
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    overlap_reports: list[Any] = field(default_factory=list)  # offtensor-overlap: each OverlapReport
    step_with: Callable[[WorkerSettings], None] | None = None  # offtensor-overlap: one step, these settings
    clock: PhaseClock | None = None  # the phases (forward, backward, step) of each iteration

    def drain(self) -> None:
        """Wait for the deferred optimizer steps (offtensor-overlap) still running."""
        if self.overlap_reports:
            self.overlap_reports[-1].wait()


def record_grads(row: Row, layers: nn.ModuleList, when: str) -> None:
    """Which trainable layer parameters have a .grad now; a row where some have none is not a
    valid training step, and says so."""
    trainable = [p for p in layers.parameters() if p.requires_grad]
    if not trainable:
        return
    grads = [p.grad for p in trainable if p.grad is not None]
    row.grads_kept = len(grads) / len(trainable)
    # A sharded gradient (FSDP2's DTensor) has no is_pinned of its own: ask its local shard.
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    row.grad_devices = sorted({str(g.device) + (" pinned" if g.is_pinned() else "") for g in local})
    if row.grads_kept < 1.0:
        row.note = (f"only {row.grads_kept:.0%} of the trainable layer parameters had a .grad "
                    f"{when}: not a valid training step")


def _infer(built: BuiltModel, ids: torch.Tensor, clock: PhaseClock) -> Workload:
    built.model.eval()

    def step() -> None:
        clock.start()
        with torch.no_grad():
            built.model(input_ids=ids, use_cache=False)
        clock.mark("forward")

    return Workload(step=step, first_step=step, clock=clock)


def _accumulate(built: BuiltModel, scenario: Scenario, ids: torch.Tensor, row: Row, clock: PhaseClock) -> Workload:
    model = built.model
    model.train()
    enable_checkpointing(model)

    def backward_passes() -> None:
        clock.start()
        for _ in range(scenario.micro_batches):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            clock.mark("forward")
            loss.backward()
            clock.mark("backward")
            del loss

    def step() -> None:
        backward_passes()
        model.zero_grad(set_to_none=True)

    def first_step() -> None:
        backward_passes()
        record_grads(row, built.layers, "after backward")
        model.zero_grad(set_to_none=True)

    return Workload(step=step, first_step=first_step, per_step=scenario.micro_batches, clock=clock)


# offtensor-capped's loss: tokens per piece of the chunked cross entropy (see chunked_lm_loss).
LOSS_CHUNK_TOKENS = 1024


def chunked_lm_loss(model: nn.Module, ids: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """The causal-LM loss of `model(input_ids=ids, labels=ids).loss` (next-token cross entropy,
    mean over the predicted tokens, in fp32), computed `chunk_tokens` positions at a time, each
    piece under non-reentrant checkpointing so that only the hidden states are kept.

    Why: Hugging Face's loss upcasts the whole logits tensor, and at Llama-3-8B's vocabulary
    (128256) one 1x4096 batch's fp32 logits are 1.96 GiB; with the bf16 logits and the log-softmax
    the loss alone holds about 5 GiB, which cannot fit an 8 GiB card beside anything else. This is
    what fine-tuning scripts on such cards do (a chunked or fused linear cross entropy), not an
    offtensor feature: the head is an ordinary module, called once per piece (offtensor loads its
    scope per call)."""
    hf_model: Any = model
    hidden = hf_model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    labels = ids[:, 1:]
    head = hf_model.get_output_embeddings()

    def piece(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float().flatten(0, 1), y.flatten(), reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, labels.shape[1], chunk_tokens):
        total = total + checkpoint(piece, hidden[:, i:i + chunk_tokens], labels[:, i:i + chunk_tokens],
                                   use_reentrant=False)
    return total / labels.numel()


def _how_stepped(overlap: bool, n_optimizers: int, autocast: bool) -> str:
    if overlap:
        how = "; offtensor.backward_and_step(loss, " + (
            "optimizer)" if n_optimizers == 1 else "CPU optimizer), then the other stepped")
    else:
        how = "; loss.backward(), then optimizer.step()"
    return how + ("; forward under torch.autocast(bfloat16)" if autocast else "")


def _training_step(built: BuiltModel, scenario: Scenario, device: torch.device, ids: torch.Tensor, row: Row,
                   overlap: bool, worker: WorkerSettings, clock: PhaseClock, chunked_loss: bool = False) -> Workload:
    import offtensor

    model = built.model
    model.train()
    enable_checkpointing(model)
    optimizers, row.optimizer = make_adamw([p for p in model.parameters() if p.requires_grad])
    # fp32 weights, bf16 compute: autocast on the forward (the recompute in backward
    # restores it). Wrapped layers already hold bf16 device copies; resident casts per op.
    autocast = scenario.kind == "step32"
    row.optimizer += _how_stepped(overlap, len(optimizers), autocast)
    if chunked_loss:
        row.optimizer += f"; the loss computed {LOSS_CHUNK_TOKENS} tokens at a time (chunked_lm_loss)"
    reports: list[Any] = []

    def forward_loss() -> torch.Tensor:
        with (torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()):
            if chunked_loss:
                return chunked_lm_loss(model, ids)
            return model(input_ids=ids, labels=ids, use_cache=False).loss

    def train_step(settings: WorkerSettings = worker, check: bool = False) -> None:
        clock.start()
        loss = forward_loss()
        clock.mark("forward")
        if overlap:
            # The offloaded scopes' steps finish in the background during the next forward
            # (zero_grad=True zeroes each grad after its step: no wait); the timing loop
            # waits for the last one (`drain`), so a step's time is the steady-state period.
            reports.append(offtensor.backward_and_step(
                loss, optimizers[0], zero_grad=not check, spare_threads=settings.spare_threads,
                piece_bytes=settings.piece_bytes, device_share=settings.device_share,
                max_grad_norm=settings.max_grad_norm))
            clock.mark("backward")
            for opt in optimizers[1:]:
                opt.step()
        else:
            loss.backward()
            clock.mark("backward")
            for opt in optimizers:
                opt.step()
        del loss
        if check:  # the first warm-up step also tells whether the grads landed in p.grad
            record_grads(row, built.layers, "at the optimizer step")
        for opt in optimizers[1:] if overlap and not check else optimizers:
            opt.zero_grad(set_to_none=True)
        clock.mark("step")

    return Workload(step=train_step, first_step=lambda: train_step(check=True), forward_loss=forward_loss,
                    optimizers=optimizers, overlap_reports=reports, step_with=train_step if overlap else None,
                    clock=clock)


OVERLAP_PEERS = ("offtensor-overlap", "offtensor-capped")  # their steps are backward_and_step
CHUNKED_LOSS_PEERS = ("offtensor-capped",)  # their loss is chunked_lm_loss (under the VRAM cap)


def make_workload(built: BuiltModel, scenario: Scenario, device: torch.device, ids: torch.Tensor, row: Row,
                  peer: str, worker: WorkerSettings, overlap: bool | None = None) -> Workload:
    """The callables of `scenario` on the placed model `built`, for `peer`; a training step
    is `offtensor.backward_and_step` when `overlap` (default: for the OVERLAP_PEERS). Each
    iteration's phases are timed by the workload's PhaseClock."""
    clock = PhaseClock(device)
    if scenario.has_optimizer:
        overlap = peer in OVERLAP_PEERS if overlap is None else overlap
        return _training_step(built, scenario, device, ids, row, overlap, worker, clock,
                              chunked_loss=peer in CHUNKED_LOSS_PEERS)
    if scenario.kind == "infer":
        return _infer(built, ids, clock)
    return _accumulate(built, scenario, ids, row, clock)


def timed_iterations(work: Workload, device: torch.device, warmup: int, iters: int, max_seconds: float,
                     row: Row, between: Callable[[], None] | None = None,
                     counter: StreamCounter | None = None) -> list[float]:
    """Seconds per micro-batch of each timed iteration, after `warmup` warm-up iterations;
    `between`, when given, runs (untimed here) after each timed iteration. With `counter`,
    `row.streamed_bytes` (and the elements dequantized) per micro-batch of the timed iterations."""
    last = timed(device, work.first_step)
    row.first_call_ms, row.per_iteration = last * 1e3, work.per_step
    for _ in range(warmup - 1):
        last = timed(device, work.step)
    work.drain()
    # A peer much slower than expected gets fewer iterations rather than stalling the run.
    if last * iters > max_seconds:
        iters = max(1, min(iters, int(max_seconds // max(last, 1e-9))))
        row.note = (row.note + f" iterations cut to {iters} (warm-up took {last:.1f} s)").strip()
    if work.clock is not None:
        work.clock.clear()  # the warm-up's phases are not counted
    if counter is not None:
        counter.start()
    times = []
    for _ in range(iters):
        times.append(timed(device, work.step) / work.per_step)
        if work.clock is not None:
            work.clock.collect(work.per_step)  # after timed()'s sync: its events are complete
        if between is not None:
            between()
    # Steps that finish in the background belong to the loop: the last one's rest is added to
    # the last iteration (the earlier ones ran inside the next iteration's time).
    times[-1] += timed(device, work.drain) / work.per_step
    if counter is not None:
        row.streamed_bytes, row.dequant_elements = counter.per_iteration(len(times) * work.per_step)
        row.streamed_source = counter.source
    return times
