"""What is run: the model's dimensions and the six workloads (scenarios)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the Llama that is built (random weights, bf16)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int


FULL_SHAPE = ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=8)
QUICK_SHAPE = ModelShape(hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=1024, layers=2)


@dataclass(frozen=True)
class Scenario:
    """One workload. kind: 'infer' (no_grad forward), 'train' (all params trainable),
    'frozen' (decoder layers frozen, a small trainable part), 'step' (a full training step:
    forward, backward, fused AdamW step, zero_grad) or 'step32' (the same with fp32 masters and
    bf16 compute). The name says the full-size shape; batch and seq are what runs (smaller
    with --quick)."""

    name: str
    kind: str
    batch: int
    seq: int
    micro_batches: int = 1  # forward+backward passes per timed iteration (grad accumulation)

    @property
    def variant(self) -> str:
        # Scenarios of the same variant share one freshly built model per peer.
        return {"frozen": "lora", "step32": "fp32"}.get(self.kind, "base")

    @property
    def has_optimizer(self) -> bool:
        return self.kind in ("step", "step32")

    @property
    def shape(self) -> str:
        """What runs, for the table: batch x seq, and the micro-batches per timed iteration."""
        return f"{self.batch}x{self.seq}" + (f" x{self.micro_batches}" if self.micro_batches > 1 else "")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("infer-1x512", "infer", 1, 512),  # transfer-bound
        Scenario("infer-8x2048", "infer", 8, 2048),  # compute-bound
        Scenario("train-4x2048", "train", 4, 2048, micro_batches=2),
        # Right after train-4x2048: same variant, so each peer reuses the model it built.
        Scenario("step-4x2048", "step", 4, 2048),
        Scenario("lora-4x2048", "frozen", 4, 2048, micro_batches=2),
        Scenario("step32-4x2048", "step32", 4, 2048),
    )
}


def quick(s: Scenario) -> Scenario:
    """The --quick shape of `s`: at most 2 sequences of 1/128 the length (at least 8 tokens)."""
    return Scenario(s.name, s.kind, min(s.batch, 2), max(8, s.seq // 128), s.micro_batches)


# The several-GPU benchmark (--nproc N): the same shapes, per rank (issue 13's two targets).
MULTI_SCENARIOS: dict[str, Scenario] = {n: SCENARIOS[n] for n in ("infer-1x512", "step-4x2048")}
