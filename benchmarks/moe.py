"""--shape qwen3-30b-a3b | gpt-oss-20b: mixture-of-experts models at their real sizes, built from
configs on the meta device with random weights (docs/benchmarks.md, Mixture of experts), the
peers that place them, and the bytes a decode token needs.

Each peer's model gets rank-16 LoRA adapters on q/k/v/o (B zero: the outputs are the base
model's until the LoRA step, which runs last) and is placed as --shape 8b's are: the resident
model allocated and filled on the device, the offtensor peers loaded scope by scope with
`RandomFill` (the same values: seeded by module name), accelerate materialized on the host and
dispatched with a device_map that puts the decoder layers on the CPU.

# Note [active bytes]
A decode step needs each decoder layer's parameters but its routed experts, plus the rows of the
experts its router picked for the step's tokens: the *active bytes*. They are counted from the
routers themselves (a forward hook on each MoE block's router reading its top-k indices), not
from offtensor, so a row's bytes copied per step (offtensor.summary's bytes_to_device over the
timed steps) are checked against an independent count: the routed peers should copy at most
1.10x the active bytes (the rest is the buffers' 256-byte padding), the whole-layer peer copies
every expert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .measure import GiB
from .model import BuiltModel, _empty_weights, _no_init_weights, decoder_layers, materialize
from .shapes import RandomFill

MOE_PEER_NAMES = ("resident", "offtensor-whole", "offtensor-routed", "offtensor-routed-vram", "offtensor-routed-cache",
                  "accelerate")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class MoeShape:
    """A transformers MoE decoder: Qwen3-MoE ('qwen3_moe') or gpt-oss ('gpt_oss')."""

    name: str
    arch: str
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_intermediate: int  # moe_intermediate_size (Qwen3) / intermediate_size (gpt-oss)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def __str__(self) -> str:
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, {self.experts} experts top-{self.top_k} "
                f"(intermediate {self.expert_intermediate}), {self.heads}/{self.kv_heads} heads x {self.head_dim}, "
                f"vocab {self.vocab}")

    def config(self) -> Any:
        """The transformers config (untied head)."""
        import transformers

        common: dict[str, Any] = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            num_experts_per_tok=self.top_k, tie_word_embeddings=False,
            # gpt-oss's attention sinks have no sdpa path in transformers: eager attention
            attn_implementation="sdpa" if self.arch == "qwen3_moe" else "eager",
            pad_token_id=0, bos_token_id=None, eos_token_id=None)
        if self.arch == "qwen3_moe":  # Qwen/Qwen3-30B-A3B's config.json
            return cast(Any, transformers.Qwen3MoeConfig)(
                **common, num_experts=self.experts, moe_intermediate_size=self.expert_intermediate,
                intermediate_size=6144 if self.hidden == 2048 else 4 * self.hidden, norm_topk_prob=True,
                max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)]
        return cast(Any, transformers.GptOssConfig)(  # openai/gpt-oss-20b's config.json
            **common, num_local_experts=self.experts, intermediate_size=self.expert_intermediate,
            layer_types=layer_types, sliding_window=128 if self.hidden == 2880 else 8)


MOE_SHAPES = {
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", "qwen3_moe", hidden=2048, layers=48, experts=128, top_k=8,
                              expert_intermediate=768, heads=32, kv_heads=4, head_dim=128, vocab=151936),
    "gpt-oss-20b": MoeShape("gpt-oss-20b", "gpt_oss", hidden=2880, layers=24, experts=32, top_k=4,
                            expert_intermediate=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088),
}
# --quick: the same code paths in seconds on the CPU; the same share of experts per token.
QUICK_MOE_SHAPES = {
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", "qwen3_moe", hidden=64, layers=2, experts=32, top_k=2,
                              expert_intermediate=32, heads=4, kv_heads=2, head_dim=16, vocab=512),
    "gpt-oss-20b": MoeShape("gpt-oss-20b", "gpt_oss", hidden=64, layers=2, experts=16, top_k=2,
                            expert_intermediate=64, heads=4, kv_heads=2, head_dim=16, vocab=512),
}


class MoeFill(RandomFill):
    """RandomFill with zero biases: gpt-oss's attention and router biases filled with ones would
    add the same vector to every token's hidden state, and every token would pick the same
    experts."""

    def __call__(self, name: str, module: nn.Module) -> None:
        super().__call__(name, module)
        with torch.no_grad():
            for pname, p in module.named_parameters(recurse=False):
                if p.dim() == 1 and pname.endswith("bias"):
                    p.zero_()


def _nbytes(ps: Any) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def build_moe(shape: MoeShape, device: torch.device, seed: int) -> BuiltModel:
    """The model of `shape` on the meta device in bf16, with LoRA adapters (peft) on q/k/v/o
    and the base frozen; `fill` initializes it where a peer places it."""
    import peft

    from .measure import temporarily

    with _no_init_weights(), temporarily(torch.get_default_dtype, torch.set_default_dtype, torch.bfloat16), \
            torch.device("cpu"), _empty_weights():
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(shape.config())
    model.requires_grad_(False)
    peft.inject_adapter_in_model(peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    layers = decoder_layers(model)
    return BuiltModel(variant="lora", vocab=shape.vocab, model=model, layers=layers,
                      trainable="peft LoRA r=16 on q/k/v/o_proj; base (experts included) frozen",
                      total_bytes=_nbytes(model.parameters()), wrapped_bytes=_nbytes(layers.parameters()),
                      wrapped_trainable_bytes=_nbytes(p for p in layers.parameters() if p.requires_grad),
                      fill=MoeFill(device, seed))


def with_cache(model: nn.Module, output: Any) -> dict[str, Any]:
    """The keyword that passes `output`'s KV cache to the model's next call: `cache` (transformers
    >= 5.2x) or `past_key_values`."""
    import inspect

    cache = output.get("cache") if "cache" in output else output.past_key_values
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def moe_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    """(block, router, experts) of each MoE block: a module holding `experts` and a `gate`
    (Qwen3-MoE) or `router` (gpt-oss) whose output's third element is the top-k indices."""
    found = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, "gate", None) or getattr(module, "router", None)
        if isinstance(experts, nn.Module) and isinstance(router, nn.Module):
            found.append((module, router, experts))
    return found


class ActiveBytes:
    """Note [active bytes]: per decode step, each layer's bytes outside its routed experts plus
    the bytes of the experts its router picked (counted from the router's output)."""

    def __init__(self, built: BuiltModel) -> None:
        self.fixed = 0  # the decoder layers' parameters outside the routed experts
        self.per_expert: dict[int, int] = {}  # id(router) -> bytes of one expert's rows
        self.chosen: list[tuple[int, torch.Tensor]] = []  # (id(router), its top-k indices) in this step
        self.counting = False
        self.steps = self.total = 0
        self.handles = []
        routed = 0
        for _, router, experts in moe_blocks(built.layers):
            stacked = [p for p in experts.parameters(recurse=False) if p.dim() >= 2]
            self.per_expert[id(router)] = _nbytes(p[0] for p in stacked)
            routed += _nbytes(stacked)
            self.handles.append(router.register_forward_hook(self._hook))
        self.fixed = _nbytes(p for p in built.layers.parameters() if not p.requires_grad) - routed
        self.expert_bytes = routed

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.counting:  # read after the step: a read here would wait for the device mid-step
            self.chosen.append((id(module), output[2].detach()))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Count one decode step's experts (after it: the step's timing has no read of its own)."""
        self.chosen, self.counting = [], True
        try:
            yield
        finally:
            self.counting = False
        picked: dict[int, set[int]] = {}
        for router, index in self.chosen:
            picked.setdefault(router, set()).update(int(e) for e in index.unique().tolist())
        self.chosen = []
        self.steps += 1
        self.total += self.fixed + sum(self.per_expert[r] * len(e) for r, e in picked.items())

    def per_step(self) -> int | None:
        return self.total // self.steps if self.steps else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def routed_budget(built: BuiltModel, gib: float | None) -> tuple[int, int]:
    """(offtensor-routed-vram's and -cache's Policy.vram_budget, -cache's Policy.expert_cache):
    `gib`, else the streaming room (3 layers) and a quarter of the layers' bytes beside it, so
    that it keeps some layers and streams the rest at any size; the cache takes half of what the
    budget leaves beside the streaming room."""
    sizes = [sum(-(-_nbytes([p]) // 256) * 256 for p in layer.parameters() if not p.requires_grad)
             for layer in built.layers]  # as wrap lays them out
    budget = int(gib * GiB) if gib is not None else 3 * max(sizes) + sum(sizes) // 4
    return budget, max(1, (budget - 3 * max(sizes)) // 2)


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps one digit before the point."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def setup_moe_peer(peer: str, built: BuiltModel, device: torch.device, budget_gib: float | None) -> str:
    """Place `built` for `peer`; the call, in words."""
    import offtensor

    assert isinstance(built.fill, RandomFill)
    if peer == "resident":
        materialize(built.model, device, built.fill)
        return "whole model on the device (built on the meta device, filled there)"
    if peer == "accelerate":
        from accelerate import dispatch_model

        materialize(built.model, torch.device("cpu"), built.fill)
        names = [n for n, m in built.model.named_modules() if m is built.layers]
        device_map = {"": device.type if device.index is None else f"{device.type}:{device.index}",
                      names[0]: "cpu"}
        dispatch_model(built.model, device_map=device_map, main_device=device)
        return f"accelerate.dispatch_model(device_map={{'': device, {names[0]!r}: 'cpu'}})"
    options: dict[str, Any] = {"param_filter": offtensor.frozen_only}
    if peer == "offtensor-whole":
        options["experts"] = None
    if peer in ("offtensor-routed-vram", "offtensor-routed-cache"):
        options["vram_budget"], cache = routed_budget(built, budget_gib)
        if peer == "offtensor-routed-cache":
            options["expert_cache"] = cache
    policy = offtensor.Policy(**options)
    offtensor.load(built.model, init=built.fill, device=device, policy=policy, init_device=built.fill.device)
    built.model.to(device)  # embeddings, head, norms, adapters; the masters stay on the host
    shown = ", ".join(f"{k}={format_bytes(v)}" if isinstance(v, int) else f"{k}={getattr(v, '__name__', v)!r}"
                      for k, v in options.items())
    return f"offtensor.load(model, init=RandomFill, policy=Policy({shown}))"
