"""What is run: the model's dimensions and the six workloads (scenarios); with `--shape`, the
real models' dimensions and their own workloads."""

from __future__ import annotations

import dataclasses
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
    name: str = ""  # the --shape it is ('8b', '34b', '70b'); "" for the default 8-layer model


FULL_SHAPE = ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, layers=8)
QUICK_SHAPE = ModelShape(hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=1024, layers=2)


@dataclass(frozen=True)
class Scenario:
    """One workload. kind: 'infer' (no_grad forward), 'train' (all params trainable),
    'frozen' (decoder layers frozen, a small trainable part), 'step' (a full training step:
    forward, backward, fused AdamW step, zero_grad), 'step32' (the same with fp32 masters and
    bf16 compute), 'frozen-step' (a LoRA step: the frozen base, AdamW on the adapters) or
    'full' (a full fine-tune step, every parameter trainable; --shape 8b). The name says the
    full-size shape; batch and seq are what runs (smaller with --quick)."""

    name: str
    kind: str
    batch: int
    seq: int
    micro_batches: int = 1  # forward+backward passes per timed iteration (grad accumulation)
    on_variant: str | None = None  # run on this variant's model instead of the kind's own
    at_shape: bool = False  # a --shape scenario: judged by Note [shape rooflines] (rooflines.py)

    @property
    def variant(self) -> str:
        # Scenarios of the same variant share one freshly built model per peer.
        if self.on_variant is not None:
            return self.on_variant
        return {"frozen": "lora", "frozen-step": "lora", "step32": "fp32"}.get(self.kind, "base")

    @property
    def has_optimizer(self) -> bool:
        return self.kind in ("step", "step32", "frozen-step", "full")

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
    return dataclasses.replace(s, batch=min(s.batch, 2), seq=max(8, s.seq // 128))


# ---- --shape: real models' dimensions, random weights (docs/benchmarks.md, Real shapes) ----------

NAMED_SHAPES: dict[str, ModelShape] = {
    # Llama-3-8B (untied embeddings and head)
    "8b": ModelShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, layers=32, name="8b"),
    # CodeLlama-34B
    "34b": ModelShape(hidden=8192, intermediate=22016, heads=64, kv_heads=8, vocab=32000, layers=48, name="34b"),
    # Llama-2-70B
    "70b": ModelShape(hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=32000, layers=80, name="70b"),
}
# --quick --shape: tiny, but the same code path (meta build, scope-by-scope load, the same
# scenarios and rooflines); the ratios of ffn to hidden and of heads to KV heads are kept.
QUICK_NAMED_SHAPES: dict[str, ModelShape] = {
    "8b": ModelShape(hidden=256, intermediate=896, heads=8, kv_heads=2, vocab=2048, layers=3, name="8b"),
    "34b": ModelShape(hidden=256, intermediate=688, heads=8, kv_heads=1, vocab=1024, layers=3, name="34b"),
    "70b": ModelShape(hidden=256, intermediate=896, heads=8, kv_heads=1, vocab=1024, layers=4, name="70b"),
}

_INFER_512 = Scenario("infer-1x512", "infer", 1, 512, at_shape=True)
# The 34B and 70B rows of one peer share one load (a 70B fp8 load takes about a minute): their
# forward runs on the LoRA model, whose r=16 adapters (on the device) add under 1 % of the
# forward's FLOPs and nothing to its copies.
_INFER_512_ON_LORA = dataclasses.replace(_INFER_512, on_variant="lora")
_LORA_STEP = Scenario("lora-step-1x4096", "frozen-step", 1, 4096, at_shape=True)
SHAPE_SCENARIOS: dict[str, dict[str, Scenario]] = {
    "8b": {s.name: s for s in (
        _INFER_512,
        Scenario("train-1x4096", "train", 1, 4096, at_shape=True),  # issue 15's phase balance
        # Compute-dominated (issue 31): 4x the tokens per byte streamed; with the budget peers.
        Scenario("train-4x4096", "train", 4, 4096, at_shape=True),
        _LORA_STEP,
        # A full fine-tune step, AdamW: offtensor-capped offloads embeddings and head too.
        Scenario("full-step-1x4096", "full", 1, 4096, at_shape=True),
    )},
    "34b": {s.name: s for s in (_INFER_512_ON_LORA, _LORA_STEP)},
    "70b": {s.name: s for s in (_INFER_512_ON_LORA, _LORA_STEP)},
    # --shape flux (benchmarks/dit.py): one denoising step at 1024x1024 (4096 image tokens, 512 text
    # tokens) and a LoRA step, on one LoRA model per peer (the adapters' B is zero at first).
    "flux": {s.name: s for s in (Scenario("infer-1024px", "infer", 1, 4096, on_variant="lora", at_shape=True),
                                 Scenario("lora-step-1024px", "frozen-step", 1, 4096, at_shape=True))},
}
# --shape qwen3-30b-a3b | gpt-oss-20b (benchmarks/moe*.py): greedy decode steps at batch 1 and 8
# (seq: the tokens a step adds), a prefill and a LoRA step, on one LoRA model per peer.
_MOE = {s.name: s for s in (Scenario("decode-1", "decode", 1, 1, at_shape=True),
                            Scenario("decode-8", "decode", 8, 1, at_shape=True),
                            Scenario("prefill-1x2048", "infer", 1, 2048, at_shape=True),
                            Scenario("lora-step-1x2048", "frozen-step", 1, 2048, at_shape=True))}
MOE_SHAPE_NAMES = ("qwen3-30b-a3b", "gpt-oss-20b")
SHAPE_SCENARIOS.update(dict.fromkeys(MOE_SHAPE_NAMES, _MOE))


# The several-GPU benchmark (--nproc N): the same shapes, per rank (issue 13's two targets).
MULTI_SCENARIOS: dict[str, Scenario] = {n: SCENARIOS[n] for n in ("infer-1x512", "step-4x2048")}
