"""What a run records: one Row per scenario and peer, the byte counts of each model variant, and
the measurements shared by the peers of one run (Extras). Plain data; docs/benchmarks.md defines
every field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    """One scenario on one peer."""

    scenario: str
    peer: str
    status: str  # ok | error | skipped
    note: str = ""
    batch: int = 0
    seq: int = 0
    times_ms: list[float] = field(default_factory=list)  # per iteration (per micro-batch in training)
    first_call_ms: float | None = None  # the first warm-up iteration, whole (with --compile: it compiles)
    per_iteration: int = 1  # micro-batches per iteration (times_ms and median_ms are per micro-batch)
    median_ms: float | None = None
    peak_vram_bytes: int | None = None
    vram_before_bytes: int | None = None  # allocated when the scenario starts (weights at rest)
    host_growth_bytes: int | None = None  # RSS now minus RSS before this peer's model was built
    grads_kept: float | None = None  # fraction of trainable layer params with a .grad after backward
    grad_devices: list[str] | None = None
    optimizer: str | None = None  # step scenarios: the optimizer(s) and how they were stepped
    fwd_bwd_ms: float | None = None  # resident, step scenarios: forward+backward alone, no step
    fwd_ms: float | None = None  # resident, step scenarios: the forward (and loss) alone
    # standard offtensor steps: plain fused AdamW, one step after each timed iteration (ms)
    optimizer_in_turn_ms: list[float] | None = None
    overlap: dict | None = None  # offtensor-overlap: the last step's OverlapReport, in ms
    same_time: dict | None = None  # offtensor-overlap: measure_same_time
    phases_ms: dict[str, float] | None = None  # median ms per phase: forward, backward, step
    moved_bytes: int | None = None  # offtensor peers: the scopes' host bytes (what a pass loads)
    moved_grad_bytes: int | None = None  # of which trainable (gradients sent home in backward)
    vram_cap_bytes: int | None = None  # offtensor-capped: the cap; its target is peak VRAM below it
    # Counted over the timed iterations, per iteration (streamed.StreamCounter): the bytes copied
    # to the device, how they were counted, and the fp8 elements dequantized there.
    streamed_bytes: int | None = None
    streamed_source: str | None = None
    dequant_elements: int | None = None
    dequant_ms: float | None = None  # those elements at the measured dequantization rate (--shape flux)
    profile_ms: dict[str, float] | None = None  # --profile: where one iteration's time went (--shape flux)
    host_calls_ms: dict[str, float] | None = None  # --profile: the CUDA runtime calls the host spent longest in
    host_profile: dict[str, Any] | None = None  # --host-profile: one iteration under cProfile (host_profile.py)
    predicted_ms: float | None = None  # a timed layout's predicted step, from offtensor.summary() (--shape flux)
    # --shape flux: the first iteration's output against the reference's: bit for bit (exact),
    # else the largest absolute difference; the reference ('resident', or 'fp8 reference': the
    # resident model with its weights rounded as Policy(frozen_format="fp8") documents).
    exact: bool | None = None
    exact_ref: str | None = None
    max_abs_diff: float | None = None
    diff_vs_resident: float | None = None  # fp8 rows: the largest difference from the bf16 output
    ratio_source: str | None = None  # 'in turn': the ratio is measure_same_time's, not median/roofline
    roofline_ms: float | None = None  # None where it means nothing (see compute_rooflines)
    ratio: float | None = None
    target: float | None = None  # the ratio this peer should stay within (rooflines.TARGETS)
    verdict: str | None = None  # PASS | FAIL against `target`
    vs_resident: float | None = None  # --shape rows: median / the resident row's median
    resident_target: float | None = None  # the largest vs_resident that meets its target (--shape flux)
    resident_verdict: str | None = None

    @property
    def valid_training(self) -> bool:
        """False when backward left some trainable layer parameter without a .grad."""
        return self.grads_kept is None or self.grads_kept >= 1.0


@dataclass
class VariantBytes:
    """Byte counts of one model variant (BuiltModel's), kept after the model is freed."""

    total_bytes: int
    wrapped_bytes: int
    wrapped_trainable_bytes: int
    trainable: str
    dtype: str = "bfloat16"


@dataclass
class Extras:
    """Measurements beside the rows, shared by the peers of one run."""

    plain_adamw: dict[str, dict[str, Any]] = field(default_factory=dict)  # dtype -> measure_plain_adamw
    optimizer_speed: dict[str, Any] | None = None  # bf16, measured in the offtensor peer
    optimizer_speed_fp32: dict[str, Any] | None = None  # fp32 masters, in offtensor-castdev
    skipped_variants: dict[str, str] = field(default_factory=dict)  # variant -> why (too slow to build)
    compiled: bool = False  # --compile: the first calls compile, and their times are compared


@dataclass
class RankResult:
    """One rank's measurement of one scenario on one peer of the several-GPU benchmark,
    gathered on rank 0."""

    rank: int
    node: str  # host name
    status: str = "ok"  # ok | error | skipped
    note: str = ""
    how: str = ""  # the peer's setup, in words
    times_ms: list[float] = field(default_factory=list)  # per timed step
    peak_vram_bytes: int | None = None
    host_growth_bytes: int | None = None  # PSS (else RSS) at the end minus before the build
    host_measure: str | None = None  # 'pss' | 'rss'
    node_used_growth_bytes: int | None = None  # the node's used memory, the same way (local rank 0 only)
    grads_kept: float | None = None
    wrapped_bytes: int = 0  # the decoder layers' bytes (what an offloader moves)


@dataclass
class MultiRow:
    """One scenario on one peer over all the ranks (docs/benchmarks.md, Several GPUs)."""

    scenario: str
    peer: str
    status: str
    note: str = ""
    batch: int = 0  # per rank
    seq: int = 0
    world: int = 1
    how: str = ""
    rank_median_ms: list[float | None] = field(default_factory=list)
    step_ms: float | None = None  # the slowest rank's median step time
    tokens_per_s: float | None = None  # all ranks: world * batch * seq / step_ms
    speedup: float | None = None  # tokens_per_s / one GPU's with offtensor (same per-rank shape)
    floor_ratio: float | None = None  # inference: step_ms / the single-GPU PCIe floor
    target: str | None = None  # e.g. 'x 1 GPU >= 1.90'
    verdict: str | None = None  # PASS | FAIL
    host_growth_bytes: dict[str, int] = field(default_factory=dict)  # node -> its ranks' sum
    host_measure: str | None = None
    node_used_growth_bytes: dict[str, int] = field(default_factory=dict)  # node -> growth
    peak_vram_bytes: list[int | None] = field(default_factory=list)  # per rank
    grads_kept: float | None = None  # the least over the ranks
    ranks: list[dict] = field(default_factory=list)  # each rank's RankResult
