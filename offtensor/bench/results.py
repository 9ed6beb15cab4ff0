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
    median_ms: float | None = None
    peak_vram_bytes: int | None = None
    vram_before_bytes: int | None = None  # allocated when the scenario starts (weights at rest)
    host_growth_bytes: int | None = None  # RSS now minus RSS before this peer's model was built
    grads_kept: float | None = None  # fraction of trainable layer params with a .grad after backward
    grad_devices: list[str] | None = None
    optimizer: str | None = None  # step scenarios: the optimizer(s) and how they were stepped
    fwd_bwd_ms: float | None = None  # resident, step scenarios: forward+backward alone, no step
    fwd_ms: float | None = None  # resident, step scenarios: the forward (and loss) alone
    overlap: dict | None = None  # offtensor-overlap: the last step's OverlapReport, in ms
    same_time: dict | None = None  # offtensor-overlap: measure_same_time
    roofline_ms: float | None = None  # None where it means nothing (see compute_rooflines)
    ratio: float | None = None
    target: float | None = None  # the ratio this peer should stay within (rooflines.TARGETS)
    verdict: str | None = None  # PASS | FAIL against `target`

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
