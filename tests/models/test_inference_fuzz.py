"""A seeded fuzzer of inference loops, writes between calls and mixture-of-experts models,
checked bit for bit against the plain model on the CPU: what tests/optim/test_loop_fuzz.py does
not reach (the carry under a VRAM budget, KV-cache decoding and `generate()`, inference_mode,
eval/train switches, every way a parameter is written between calls, `p.data` aliases kept and
written later, routed experts with and without an expert cache, MoE LoRA over fp8/int8 experts).

Each seed builds a tiny model (by `seed % 10`: a BlockStack MLP, user stacked-expert layers, an
HF Llama, an HF MoE), deep-copies its reference before `wrap`, draws a configuration (scopes,
prefetch, budget, layout, experts, cache, pinning, frozen formats, checkpointing, optimizer) and
10-22 operations, applied to both models in turn with the same RNG state. After each: outputs,
raises, parameters, buffers, gradients equal; streamed scopes hold nothing; kept and carried
copies equal their masters; weights within the budget; no stale expert-cache row. A compressed
model's reference holds the quantize-dequantized values (Note [compressed masters]).
Tolerated (docs/design.md, Limits): a graph dropped without its backward, a backward that raised
early, and a no_grad forward whose inputs require grad (transformers' checkpointing hook) leave
the scopes kept for a backward resident until the next forward.

Rerun one seed: `OFFTENSOR_INFER_FUZZ_SEEDS=7:8 python -m pytest -q tests/models/test_inference_fuzz.py`
(`OFFTENSOR_FUZZ_TRACEBACK=1`: the original traceback). Seeds 0-39 run in the full tier, one per
model family in the quick tier."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import random

import pytest
import tiers
import torch
import torch.nn.functional as F
from conftest import (
    BatchNormBlock,
    BlockStack,
    FuzzError,
    ResidualBlock,
    Trap,
    device_layout_bytes,
    fuzz_optimizer,
    host,
    param_bytes,
)
from torch import nn

import offtensor
from offtensor.engine.engine import find_engine
from offtensor.scopes.expert_cache import _mark
from offtensor.storage.compress import quantize_dequantize

DEVICE = "cpu"
EXACT = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}  # a diverged run: NaN where the reference has NaN
VOCAB = 64
N_SEEDS = 40


def _family(seed: int) -> str:
    return {0: "mlp", 1: "mlp", 2: "mlp", 3: "stacked", 4: "stacked", 5: "llama",
            6: "moe", 7: "moe", 8: "moe", 9: "moe"}[seed % 10]


def _seeds() -> list[int]:
    """Seeds 0..39 in the full tier, one of each family in the quick tier (tiers.py);
    OFFTENSOR_INFER_FUZZ_SEEDS=start:stop runs exactly those, in either tier."""
    if "OFFTENSOR_INFER_FUZZ_SEEDS" in os.environ:
        start, stop = (int(v) for v in os.environ["OFFTENSOR_INFER_FUZZ_SEEDS"].split(":"))
        return list(range(start, stop))
    chosen: list[int] = []
    for family in ("mlp", "stacked", "llama", "moe"):
        chosen += tiers.sample([s for s in range(N_SEEDS) if _family(s) == family], 1, f"inference fuzz {family}")
    return sorted(chosen)


SEEDS = _seeds()

LAZY = os.environ.get("OFFTENSOR_LAZY_STREAMS") == "1"



# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class DropoutBlock(nn.Module):
    """``x + dropout(gelu(fc(x)))``: random in training mode (both models draw the same RNG)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(x)))


class StackedExperts(nn.Module):
    """A user's MoE layer, one stacked weight [E, H, H]: `index` reads `stacked[e]` per chosen
    expert, `gather` indexes it with the router's choice per token, `dense` reads it whole."""

    def __init__(self, kind: str, experts: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(hidden, experts, bias=False)
        self.stacked = nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        choice = logits.argmax(-1)
        if self.kind == "index":
            out = torch.zeros_like(x)
            for e in choice.unique().tolist():
                rows = choice == e
                out[rows] = x[rows] @ self.stacked[e].T
        elif self.kind == "gather":
            out = torch.einsum("th,toh->to", x, self.stacked[choice])
        else:
            weights = logits.softmax(-1)
            out = torch.einsum("th,eoh,te->to", x, self.stacked, weights)
        return self.norm(x + out)


class StackedModel(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([StackedExperts(k) for k in kinds])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class LoraLinear(nn.Module):
    """``base(x) + B(A(x))``: a LoRA adapter around a (frozen) Linear."""

    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.05)  # not zero: the adapters change the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def _hf_config(cfg: dict):
    import transformers

    hidden = cfg["hidden"]
    base = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=cfg["layers"],
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                eos_token_id=None, bos_token_id=None)
    if cfg["model"] == "llama":
        return transformers.LlamaConfig(**base)
    experts, moe = 8, hidden // 2
    arch = cfg["arch"]
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**base, moe_intermediate_size=moe, num_experts=experts,
                                           num_experts_per_tok=2, head_dim=hidden // 4)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**base, moe_intermediate_size=moe, shared_expert_intermediate_size=moe,
                                           num_experts=experts, num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(**base, num_local_experts=experts, num_experts_per_tok=2,
                                          head_dim=hidden // 4)
    return transformers.OlmoeConfig(**base, num_experts=experts, num_experts_per_tok=2)


def _build_model(cfg: dict) -> nn.Module:
    return _build_model_fp32(cfg).to(cfg["dtype"])


def _build_model_fp32(cfg: dict) -> nn.Module:
    kind = cfg["model"]
    if kind == "mlp":
        hidden = cfg["hidden"]
        make = {"residual": ResidualBlock, "batchnorm": BatchNormBlock, "dropout": DropoutBlock}
        model = BlockStack([make[b](hidden) for b in cfg["blocks"]], 8, hidden, 4)
        model.checkpoint = cfg["checkpoint"]
        return model
    if kind == "stacked":
        return StackedModel(cfg["blocks"])
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg))
    if kind == "moe":
        model.config._experts_implementation = cfg["implementation"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "experts" in name or "gate" in name or "router" in name:
                    p.normal_(0, 0.2)  # routers initialised to zero would pick the same experts
    if cfg["lora"]:
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj = LoraLinear(attn.q_proj)
            attn.v_proj = LoraLinear(attn.v_proj)
    if cfg["checkpoint"]:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def _scope_candidates(cfg: dict) -> list[str]:
    if cfg["model"] in ("mlp", "stacked"):
        return [f"blocks.{i}" for i in range(len(cfg["blocks"]))]
    return [f"model.layers.{i}" for i in range(cfg["layers"])]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _draw_config(seed: int) -> tuple[random.Random, dict]:
    rng = random.Random(seed)
    cfg: dict = {"seed": seed, "model": _family(seed)}
    kind = cfg["model"]
    cfg["lora"] = False
    cfg["frozen_format"] = None
    if kind == "mlp":
        cfg["blocks"] = [rng.choice(["residual", "residual", "batchnorm", "dropout"]) for _ in range(rng.randint(5, 9))]
        cfg["checkpoint"] = rng.choice([None, None, "non_reentrant", "reentrant"])
        cfg["freeze"] = rng.choice(["none", "none", "blocks", "some"])
    elif kind == "stacked":
        cfg["blocks"] = [rng.choice(["index", "index", "gather", "dense"]) for _ in range(rng.randint(4, 7))]
        cfg["checkpoint"] = None
        cfg["freeze"] = rng.choice(["none", "none", "experts"])
    else:
        cfg["layers"] = rng.randint(3, 6)
        cfg["checkpoint"] = rng.random() < 0.2
        if kind == "moe":
            cfg["arch"] = rng.choice(["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
            cfg["implementation"] = rng.choice(["eager", "grouped_mm"])
            cfg["freeze"] = rng.choice(["none", "experts", "lora", "lora"])
            cfg["lora"] = cfg["freeze"] == "lora"
        else:
            cfg["freeze"] = rng.choice(["none", "none", "lora"])
            cfg["lora"] = cfg["freeze"] == "lora"
    # Matrices compress from 4096 elements (storage/compress.py MIN_NUMEL): wider models for it.
    if cfg["freeze"] != "none" and rng.random() < 0.4:
        cfg["frozen_format"] = rng.choice(["fp8", "int8"])
    cfg["dtype"] = torch.bfloat16 if (kind != "llama" and rng.random() < 0.2) else torch.float32
    cfg["hidden"] = 64 if (cfg["frozen_format"] and kind in ("mlp", "llama")) else (32 if kind != "mlp" else 16)
    cfg["frozen_only"] = cfg["freeze"] in ("blocks", "experts", "lora") and rng.random() < 0.6
    candidates = _scope_candidates(cfg)
    selected = sorted(rng.sample(candidates, rng.randint(1, len(candidates)))) if rng.random() < 0.3 else candidates
    if kind == "mlp" and rng.random() < 0.3:
        selected = selected + [n for n in ("input", "head") if rng.random() < 0.5]
    if kind in ("llama", "moe") and rng.random() < 0.25:
        selected = selected + [n for n in ("model.embed_tokens", "model.norm", "lm_head") if rng.random() < 0.5]
    cfg["selected"] = selected
    cfg["keep_for_backward"] = rng.choice(selected) if rng.random() < 0.25 else None
    cfg["split"] = kind in ("mlp", "llama", "moe") and rng.random() < 0.3
    cfg["prefetch"] = rng.choice([0, 0, 1, 1, 2])
    cfg["budget"] = rng.choice([None, None, "auto", "bytes", "bytes", "bytes", "bytes", "bytes"])
    cfg["budget_kept"] = rng.choice([0, 0, 0, 1, 1, 2, 9])  # blocks beside streaming's room
    cfg["budget_slack"] = rng.choice([0, 64, "half"])
    cfg["layout"] = rng.choice(["auto", "auto", "spread", "timed"])
    routed = kind in ("stacked", "moe")
    cfg["experts"] = ("auto" if rng.random() < 0.85 else None) if routed else "auto"
    cfg["expert_cache"] = (rng.choice([None, 1 / 16, 1 / 4, 1 / 2]) if routed and cfg["experts"] is not None
                           and cfg["budget"] != "auto" else None)
    cfg["pin_memory"] = rng.choice([None, None, False, "ring"])
    cfg["optimizer"] = rng.choice(["sgd", "adamw", "adagrad"])
    cfg["foreach"] = rng.choice([False, True])
    cfg["opt_over"] = rng.choice(["all", "trainable"])
    cfg["deep_check"] = rng.random() < 0.5  # assert_all_scopes_offloaded (waits for loads) or the light check
    cfg["unwrap_at_end"] = rng.random() < 0.3
    return rng, cfg


def _freeze(model: nn.Module, cfg: dict, rng: random.Random) -> list[str]:
    """Freeze as drawn (before wrap); the names frozen."""
    frozen = []
    for name, p in model.named_parameters():
        f = cfg["freeze"]
        if f == "blocks":
            freeze = name.startswith("blocks.")
        elif f == "some":
            freeze = name.startswith("blocks.") and rng.random() < 0.4
        elif f == "experts":
            freeze = "experts" in name or name.endswith("stacked")
        elif f == "lora":
            freeze = "lora_" not in name and not name.startswith("lm_head")
        else:
            freeze = False
        if freeze:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def _policy(model: nn.Module, cfg: dict) -> offtensor.Policy:
    kwargs: dict = {"prefetch": cfg["prefetch"], "layout": cfg["layout"], "pin_memory": cfg["pin_memory"]}
    if cfg["split"]:
        kwargs["max_scope_bytes"] = param_bytes(model.get_submodule(cfg["selected"][0])) // 2
    if cfg["frozen_only"]:
        kwargs["param_filter"] = offtensor.frozen_only
    if cfg["frozen_format"]:
        kwargs["frozen_format"] = cfg["frozen_format"]
    if cfg["model"] == "stacked":
        kwargs["experts"] = (lambda name, p: name.endswith("stacked")) if cfg["experts"] else None
    else:
        kwargs["experts"] = cfg["experts"]
    cache = 0
    if cfg["expert_cache"] is not None:
        routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if (".experts." in f".{n}" and p.dim() >= 2) or n.endswith("stacked"))
        cache = max(1024, int(routed * cfg["expert_cache"]))
        kwargs["expert_cache"] = cache
    if cfg["budget"] == "auto":
        kwargs["vram_budget"] = "auto"
    elif cfg["budget"] == "bytes":
        largest = max(device_layout_bytes(model.get_submodule(n)) for n in cfg["selected"])
        slack = largest // 2 if cfg["budget_slack"] == "half" else cfg["budget_slack"]
        kwargs["vram_budget"] = (2 + cfg["prefetch"] + cfg["budget_kept"]) * largest + slack + cache
    cfg["policy"] = {k: v for k, v in kwargs.items() if k not in ("param_filter", "experts")}
    return offtensor.Policy(**kwargs)


def _predicate(cfg: dict):
    selected, kfb = set(cfg["selected"]), cfg["keep_for_backward"]

    def predicate(name, module):
        if name not in selected:
            return False
        return offtensor.Policy(keep_for_backward=True) if name == kfb else True

    return predicate



# --------------------------------------------------------------------------------------------
# Operations: drawn once, applied to both models
# --------------------------------------------------------------------------------------------

WRITE_FORMS = ["mul_", "copy_", "data_copy_", "data_assign", "data_add", "detach_mul", "view_fill", "setitem", "init"]
# Operations that run the model's forward (and end what a forward with no backward left resident)
FORWARDS = {"infer", "infer_loop", "train", "raise", "no_offload", "decode", "generate", "input_grad"}
PACKED_FORMS = ["mul_", "copy_", "data_assign", "setitem", "init"]  # through the parameter (compressed masters)


def _inputs(cfg: dict, gen: torch.Generator, kind: str) -> dict:
    if cfg["model"] == "mlp":
        return {"x": torch.randn(4, 8, generator=gen), "y": torch.randn(4, 4, generator=gen)}
    if cfg["model"] == "stacked":
        return {"x": torch.randn(int(torch.randint(1, 6, (1,), generator=gen)), 32, generator=gen)}
    batch = 1 if kind in ("decode", "generate") else int(torch.randint(1, 3, (1,), generator=gen))
    length = int(torch.randint(3, 7, (1,), generator=gen))
    return {"ids": torch.randint(1, VOCAB, (batch, length), generator=gen)}


def _draw_op(rng: random.Random, cfg: dict, gen: torch.Generator, names: dict, state: dict) -> dict:
    """One operation; `state`: the model's mode and whether a forward ran through yet."""
    hf = cfg["model"] in ("llama", "moe")
    kinds = {"infer": 22, "infer_loop": 12, "train": 18, "forward_only": 3, "step": 5, "zero_grad": 4,
             "mode": 7, "write": 16, "alias_take": 3, "alias_write": 4, "toggle_grad": 5,
             "load_state_dict": 4, "raise": 5, "no_offload": 3, "snapshot": 3, "deepcopy": 2, "toggle_block": 3,
             "grad_write": 4, "input_grad": 4}
    if hf:
        kinds.update({"decode": 14, "generate": 3})
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    op: dict = {"kind": kind, "rng_seed": rng.randrange(2**31)}
    op["grad_ctx"] = rng.choice(["no_grad", "no_grad", "no_grad", "inference_mode"])
    if op["grad_ctx"] == "inference_mode" and cfg["frozen_format"] and LAZY:
        # tests/lazy_streams.py runs queued work outside the inference mode it was issued in: a
        # conversion temporary made in it (an inference tensor) then refuses its in-place writes
        # there (on a GPU they run as issued, in inference mode)
        op["grad_ctx"] = "no_grad"
    if kind in ("infer", "forward_only", "raise", "snapshot", "deepcopy", "generate", "decode"):
        op["inputs"] = [_inputs(cfg, gen, kind)]
    if kind == "infer_loop":
        same = rng.random() < 0.5
        first = _inputs(cfg, gen, kind)
        op["inputs"] = [first if same else _inputs(cfg, gen, kind) for _ in range(rng.randint(2, 4))]
    if kind == "decode":
        op["tokens"] = rng.randint(1, 4)
        if rng.random() < 0.4:  # a write between two tokens (the KV cache goes on)
            op["write_after"] = rng.randrange(op["tokens"])
            op["write"] = _draw_write(rng, gen, names)
    if kind == "train":
        op["inputs"] = [_inputs(cfg, gen, kind)]
        op["then"] = rng.choice(["nothing", "nothing", "step", "step", "bas"])
        op["zero_grad"] = rng.choice([None, "model", "optimizer"])
        op["set_to_none"] = rng.random() < 0.5
    if kind == "zero_grad":
        op["set_to_none"] = rng.random() < 0.5
    if kind == "raise":
        op["at"] = rng.choice(cfg["selected"])
        op["grad"] = rng.random() < 0.4
    if kind == "no_offload":
        op["inner"] = rng.choice(["infer", "infer_loop", "train"])
        op["inputs"] = [_inputs(cfg, gen, "infer") for _ in range(2)]
        op["then"] = rng.choice(["nothing", "step"])
    if kind in ("write", "alias_take", "alias_write"):
        op.update(_draw_write(rng, gen, names))
        if kind == "alias_take":
            op["alias"] = rng.choice(["data", "detach"])
            if op["name"] in names["packed"]:
                op["kind"] = "write"  # an alias of a compressed parameter is a copy (documented)
    if kind == "input_grad" and cfg["checkpoint"] == "reentrant":
        kind = op["kind"] = "infer"  # PyTorch refuses autograd.grad through reentrant checkpointing
        op["inputs"] = [_inputs(cfg, gen, kind)]
    if kind == "input_grad":
        op["inputs"] = [_inputs(cfg, gen, kind)]
    if kind == "grad_write":
        op["name"] = rng.choice(names["all"])
        op["form"] = rng.choice(["mul_", "none", "assign", "zero_"])
        op["value"] = torch.randn(names["shapes"][op["name"]], generator=gen) * 0.01
    if kind == "toggle_block":
        blocks = [n for n in cfg["selected"] if not any(p.startswith(n + ".") for p in names["packed"])]
        if blocks:
            op["block"] = rng.choice(blocks)
            op["flag"] = rng.random() < 0.5
        else:
            op["kind"] = "mode"
    if kind == "toggle_grad":
        pool = [n for n in names["all"] if n not in names["packed"]]
        op["name"] = rng.choice(pool)
    if kind == "load_state_dict":
        op["strict"] = rng.random() < 0.5
        op["fraction"] = rng.choice([0.3, 1.0])
        op["noise_seed"] = rng.randrange(2**31)
    return op


def _draw_write(rng: random.Random, gen: torch.Generator, names: dict) -> dict:
    """A parameter, mostly offloaded (often routed experts), and a way to write it."""
    pool = names["offloaded"] if (names["offloaded"] and rng.random() < 0.75) else names["all"]
    if names["routed"] and rng.random() < 0.35:
        pool = names["routed"]
    name = rng.choice(pool)
    shape = names["shapes"][name]
    return {"name": name, "form": rng.choice(PACKED_FORMS if name in names["packed"] else WRITE_FORMS),
            "scale": rng.choice([0.5, -1.0, 1.5, 2.0]), "value": torch.randn(shape, generator=gen) * 0.1,
            "row": int(torch.randint(0, shape[0], (1,), generator=gen))}


def _describe(op: dict) -> str:
    skip = {"inputs", "value", "rng_seed"}
    return "{" + ", ".join(f"{k}={_describe(v) if isinstance(v, dict) else v}" for k, v in op.items()
                           if k not in skip) + "}"



def _cache_key(fn) -> str:
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


class _Side:
    """One model, its optimizer, traps and kept aliases; applies operations."""

    def __init__(self, model: nn.Module, opt, cfg: dict, wrapped: bool, packed: set[str]) -> None:
        self.model, self.opt, self.cfg, self.wrapped, self.packed = model, opt, cfg, wrapped, packed
        self.aliases: dict[str, torch.Tensor] = {}
        self.traps: dict[str, Trap] = {}
        for name in cfg["selected"]:
            trap = Trap()
            model.get_submodule(name).register_forward_hook(trap)
            self.traps[name] = trap

    # ---- forwards ----

    def _forward(self, inp: dict, *, labels: bool = False):
        m = self.model
        if self.cfg["model"] in ("llama", "moe"):
            ids = inp["ids"]
            out = m(input_ids=ids, labels=ids if labels else None)
            return out.logits, out.loss
        out = m(inp["x"].to(self.cfg["dtype"]))
        if not labels:
            return out, None
        loss = F.mse_loss(out, inp["y"].to(out.dtype)) if self.cfg["model"] == "mlp" else out.square().mean()
        return out, loss

    def _ctx(self, op: dict):
        return torch.inference_mode() if op["grad_ctx"] == "inference_mode" else torch.no_grad()

    def _infer(self, op: dict, inputs: list, out: list) -> None:
        with self._ctx(op):
            for inp in inputs:
                logits, _ = self._forward(inp)
                out.append(host(logits).clone())

    def _decode(self, op: dict, out: list) -> None:
        m, ids = self.model, op["inputs"][0]["ids"]
        key = _cache_key(m.forward)
        with self._ctx(op):
            res = m(input_ids=ids, use_cache=True)
        out.append(host(res.logits).clone())
        for token in range(op["tokens"]):
            if op.get("write_after") == token:
                self._write(op["write"])  # outside inference_mode: what it writes is no inference tensor
            with self._ctx(op):
                cache = res.get("cache") if "cache" in res else res.past_key_values
                res = m(input_ids=res.logits[:, -1:].argmax(-1), **{key: cache}, use_cache=True)
            out.append(host(res.logits).clone())

    def _input_grad(self, inp: dict) -> list:
        m = self.model
        with torch.enable_grad():
            if self.cfg["model"] in ("llama", "moe"):
                embeds = m.get_input_embeddings()(inp["ids"]).detach().requires_grad_(True)
                out = m(inputs_embeds=embeds).logits
                (g,) = torch.autograd.grad(out.float().square().mean(), embeds)
            else:
                embeds = inp["x"].to(self.cfg["dtype"]).requires_grad_(True)
                out = m(embeds)
                (g,) = torch.autograd.grad(out.float().square().mean(), embeds)
        return [host(out).clone(), host(g).clone()]

    def _generate(self, op: dict, out: list) -> None:
        ids = op["inputs"][0]["ids"]
        res = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                                  do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        out.append(res.sequences.clone())
        out.extend(host(t).clone() for t in res.logits)

    def _train(self, op: dict, out: list) -> None:
        logits, loss = self._forward(op["inputs"][0], labels=True)
        out.append(host(logits).clone())
        out.append(host(loss).clone())
        if op["then"] == "bas":
            if self.wrapped:
                offtensor.backward_and_step(loss, self.opt, zero_grad=op["zero_grad"] is not None)
            else:
                loss.backward()
                self.opt.step()
                if op["zero_grad"] is not None:
                    self.opt.zero_grad(set_to_none=True)
            return
        loss.backward()
        if op["then"] == "step":
            self.opt.step()
        if op["zero_grad"] is not None:
            owner = self.opt if op["zero_grad"] == "optimizer" else self.model
            owner.zero_grad(set_to_none=op["set_to_none"])

    # ---- writes ----

    def _requantize(self, name: str) -> None:
        """The reference follows a write to a compressed parameter: it holds what compressing
        the written values gives."""
        if not self.wrapped and name in self.packed:
            p = self.model.get_parameter(name)
            with torch.no_grad():
                p.copy_(quantize_dequantize(p, self.cfg["frozen_format"]))

    def _write(self, op: dict, target: torch.Tensor | None = None) -> None:
        name, form, c = op["name"], op["form"], op["scale"]
        p = self.model.get_parameter(name) if target is None else target
        value = op["value"].to(p.dtype)
        row = op["row"]
        with torch.no_grad():
            if form == "mul_":
                p.mul_(c)
            elif form == "copy_":
                p.copy_(value)
            elif form == "data_copy_":
                p.data.copy_(value)
            elif form == "data_assign":
                if target is None:
                    p.data = value.clone()
                    self.aliases.pop(name, None)  # the plain parameter rebinds: an old alias is no longer its
                else:
                    p.copy_(value)
            elif form == "data_add":
                p.data.add_(c)
            elif form == "detach_mul":
                p.detach().mul_(c)
            elif form == "view_fill":
                p[row].fill_(c)
            elif form == "setitem":
                p[row] = value[row]
            elif form == "init":
                nn.init.uniform_(p, -0.1, 0.1)  # the op's seeded RNG: the same values on both
        self._requantize(name)

    def _toggle(self, op: dict) -> None:
        p = self.model.get_parameter(op["name"])
        p.requires_grad_(not p.requires_grad)

    def _load_state_dict(self, op: dict, state: dict) -> None:
        self.model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=op["strict"])
        for name in state:
            if name in self.packed:
                self._requantize(name)

    # ---- the dispatcher ----

    def run(self, op: dict, state: dict | None = None) -> dict:
        result: dict = {"out": [], "raised": None}
        torch.manual_seed(op["rng_seed"])
        kind = op["kind"]
        try:
            if kind == "infer":
                self._infer(op, op["inputs"], result["out"])
            elif kind == "infer_loop":
                self._infer(op, op["inputs"], result["out"])
            elif kind == "decode":
                self._decode(op, result["out"])
            elif kind == "generate":
                self._generate(op, result["out"])
            elif kind == "train":
                self._train(op, result["out"])
            elif kind == "forward_only":  # a forward with grad whose graph is dropped (no backward)
                logits, _ = self._forward(op["inputs"][0])
                result["out"].append(host(logits).clone())
                del logits
            elif kind == "step":
                self.opt.step()
            elif kind == "grad_write":
                p = self.model.get_parameter(op["name"])
                if p.grad is not None:
                    if op["form"] == "mul_":
                        p.grad.mul_(0.5)
                    elif op["form"] == "zero_":
                        p.grad.zero_()
                    elif op["form"] == "none":
                        p.grad = None
                    else:
                        p.grad = op["value"].to(p.dtype, copy=True)  # a tensor of its own on each side
            elif kind == "input_grad":  # a gradient with respect to the input only (saliency)
                result["out"].extend(self._input_grad(op["inputs"][0]))
            elif kind == "zero_grad":
                self.opt.zero_grad(set_to_none=op["set_to_none"])
            elif kind == "mode":
                self.model.train(not self.model.training)
            elif kind == "write":
                self._write(op)
            elif kind == "alias_take":
                p = self.model.get_parameter(op["name"])
                self.aliases[op["name"]] = p.data if op["alias"] == "data" else p.detach()
            elif kind == "alias_write":
                alias = self.aliases.get(op["name"])
                if alias is not None:
                    # Not through the alias's own `.data`: a tensor with a version counter of its
                    # own, whose writes no copy can see (docs/design.md, Limits)
                    form = "mul_" if op["form"] in ("data_assign", "data_copy_", "data_add") else op["form"]
                    self._write(dict(op, form=form), target=alias)
            elif kind == "toggle_grad":
                self._toggle(op)
            elif kind == "toggle_block":
                self.model.get_submodule(op["block"]).requires_grad_(op["flag"])
            elif kind == "load_state_dict":
                self._load_state_dict(op, state)
            elif kind == "raise":
                self.traps[op["at"]].armed = True
                try:
                    with contextlib.nullcontext() if op["grad"] else self._ctx(op):
                        logits, _ = self._forward(op["inputs"][0])
                        result["out"].append(host(logits).clone())
                finally:
                    self.traps[op["at"]].armed = False
            elif kind == "no_offload":
                ctx = offtensor.no_offload(self.model) if self.wrapped else contextlib.nullcontext()
                with ctx:
                    if op["inner"] == "train":
                        self._train({**op, "then": op["then"], "zero_grad": None, "inputs": op["inputs"]},
                                    result["out"])
                    else:
                        n = 1 if op["inner"] == "infer" else 2
                        self._infer(op, op["inputs"][:n], result["out"])
            elif kind == "snapshot":
                result["out"].extend(host(v).clone() for v in self.model.state_dict().values())
            elif kind == "deepcopy":
                clone = copy.deepcopy(self.model)  # a plain model (the wrapped one's) on both sides
                with torch.no_grad():
                    logits, _ = _Side._forward(_Shim(clone, self.cfg), op["inputs"][0])
                result["out"].append(host(logits).clone())
                del clone
        except Exception as e:  # noqa: BLE001 - both models must raise alike
            result["raised"] = e
        return result


class _Shim:
    """Enough of a _Side for `_Side._forward` on another model (a deep copy)."""

    def __init__(self, model, cfg) -> None:
        self.model, self.cfg = model, cfg


def _state_for_load(reference: nn.Module, op: dict) -> dict:
    """A state dict to load into both: the reference's values, some perturbed."""
    gen = torch.Generator().manual_seed(op["noise_seed"])
    state = {}
    keys = list(reference.state_dict().keys())
    picked = random.Random(op["noise_seed"]).sample(keys, max(1, int(len(keys) * op["fraction"])))
    for k, v in reference.state_dict().items():
        if op["strict"] or k in picked:
            v = host(v).clone()
            if v.is_floating_point() and k in picked:
                v = v + 0.01 * torch.randn(v.shape, generator=gen)
            state[k] = v
    return state


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _compare(got: dict, expected: dict) -> None:
    a, b = got["raised"], expected["raised"]
    if (a is None) != (b is None) or (a is not None and type(a) is not type(b)):
        raise AssertionError(f"raised {type(a).__name__ if a else None}: {a!s:.300} | reference raised "
                             f"{type(b).__name__ if b else None}: {b!s:.300}")
    assert len(got["out"]) == len(expected["out"]), (len(got["out"]), len(expected["out"]))
    for i, (x, y) in enumerate(zip(got["out"], expected["out"], strict=True)):
        torch.testing.assert_close(x, y, **EXACT, msg=lambda m, i=i: f"output {i}: {m}")


def _compare_state(model: nn.Module, reference: nn.Module, grads: bool = True) -> None:
    params, ref_params = dict(model.named_parameters()), dict(reference.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        q = ref_params[name]
        torch.testing.assert_close(host(p), host(q), **EXACT, msg=lambda m, name=name: f"param {name}: {m}")
        assert p.requires_grad == q.requires_grad, f"{name}: requires_grad {p.requires_grad} vs {q.requires_grad}"
        if grads:
            if q.grad is None:
                assert p.grad is None, f"{name}: has a grad, the reference has none"
            else:
                assert p.grad is not None, f"{name}: has no grad, the reference has one"
                torch.testing.assert_close(host(p.grad), host(q.grad), **EXACT,
                                           msg=lambda m, name=name: f"grad {name}: {m}")
    buffers, ref_buffers = dict(model.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == ref_buffers.keys()
    for name, b in buffers.items():
        torch.testing.assert_close(host(b), host(ref_buffers[name]), **EXACT,
                                   msg=lambda m, name=name: f"buffer {name}: {m}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where the other has NaN (a diverged run)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _known_written(scope, slot) -> bool:
    """The scope knows its copy of `slot` may be stale (a write no op on the parameter saw, or a
    `p.data` alias written): its next call or backward reloads it (Note [VRAM budget] in
    budget/vram.py, Note [p.data aliases] in dispatch/slot.py). Reads nothing it would update."""
    if scope.writes.written_in_this_call(slot) or slot.data_alias_written:
        return True
    return any(ref() is None or ref()._version != version for ref, version in slot.data_aliases)


def _scope_check(model: nn.Module, wait: bool, lingering: bool = False) -> None:
    """Streamed scopes hold nothing between calls; kept and carried ones hold exactly their
    weights, equal to their masters (assert_all_scopes_offloaded) unless the scope knows a write
    made them stale. `wait`: a carried scope still LOADING is waited for first (which changes its
    state: as assert_all_scopes_offloaded does); else its copy is not read. `lingering`: since the
    last forward with grad no backward ran (or one raised): what it left resident or loading for
    the backward it expected is held until the next forward (the module docstring), checked as
    kept ones."""
    engine = find_engine(model)
    for s in offtensor.summary(model).scopes:
        scope = next(x for x in engine.scopes if x.name == s.name)
        held = s.kept or s.carried or lingering
        if held and s.state is not offtensor.ScopeState.OFFLOADED:
            assert s.device_bytes == scope.device.nbytes, f"{s.name} holds {s.device_bytes} device bytes"
            if s.state is offtensor.ScopeState.LOADING:
                if not wait:
                    continue
                scope.make_resident()
            for slot in scope.slots:
                if slot.experts is not None or _known_written(scope, slot):
                    continue  # routed: only the experts copied so far are there
                values = slot.packed.unpack() if slot.packed is not None else slot.master
                assert _same(slot.device_view.cpu(), values.to(slot.device_view.dtype)), \
                    f"{slot.name}: device copy of {s.name} ({'kept' if s.kept else 'carried'}) is stale"
            continue
        assert s.state == offtensor.ScopeState.OFFLOADED, f"{s.name} is {s.state} between calls"
        assert s.device_bytes == 0, f"{s.name} still holds {s.device_bytes} device bytes"


def _cache_check(model: nn.Module) -> None:
    """The expert cache within its size; every row it would use equals its master's row."""
    cache = find_engine(model).expert_cache
    if cache is None:
        return
    assert cache.used <= cache.capacity, (cache.used, cache.capacity)
    for (slot, e), row in cache.rows.items():
        if row.mark != _mark(slot):
            continue  # dropped at its next use
        values = slot.packed.unpack() if slot.packed is not None else slot.master
        assert _same(row.rows.cpu(), values[e].to(row.rows.dtype)), f"{slot.name}[{e}]: cached row is stale"


# --------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fuzz_seed", [pytest.param(s, id=f"seed{s}") for s in SEEDS])
def test_inference_fuzz(fuzz_seed, most_device_bytes, one_thread):
    rng, cfg = _draw_config(fuzz_seed)
    torch.manual_seed(fuzz_seed)
    model = _build_model(cfg)
    cfg["frozen"] = _freeze(model, cfg, rng)
    if cfg["frozen_only"] and not any(any(n.startswith(s + ".") for s in cfg["selected"]) for n in cfg["frozen"]):
        cfg["frozen_only"] = False  # frozen_only needs a frozen parameter in a selected module
    if cfg["frozen_format"] and not cfg["frozen"]:
        cfg["frozen_format"] = None
    log: list[str] = []

    def fail(e: BaseException) -> None:
        if os.environ.get("OFFTENSOR_FUZZ_TRACEBACK"):
            print("\n".join(log))
            raise e
        pytest.fail("\n".join(log) + f"\n{type(e).__name__}: {e}", pytrace=False)

    policy = _policy(model, cfg)
    log.append(f"config: {cfg}")
    reference = copy.deepcopy(model)
    offtensor.wrap(model, _predicate(cfg), device=DEVICE, policy=policy)
    model.to(DEVICE)
    packed = {n for n, p in model.named_parameters()
              if isinstance(p, offtensor.OffloadedParameter) and p._ot.packed is not None}
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for n in packed:
            ref_params[n].copy_(quantize_dequantize(ref_params[n], cfg["frozen_format"]))
    names = {
        "all": [n for n, _ in model.named_parameters()],
        "offloaded": [n for n, p in model.named_parameters() if isinstance(p, offtensor.OffloadedParameter)],
        "routed": [n for n, p in model.named_parameters()
                   if isinstance(p, offtensor.OffloadedParameter) and p._ot.experts is not None],
        "packed": packed,
        "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
    }
    log.append(f"routed: {names['routed']}, packed: {sorted(packed)}")
    engine = find_engine(model)
    budget = engine.policy.vram_budget
    cache = engine.policy.expert_cache or 0

    side = _Side(model, fuzz_optimizer(cfg, model), cfg, True, packed)
    ref_side = _Side(reference, fuzz_optimizer(cfg, reference), cfg, False, packed)
    gen = torch.Generator().manual_seed(1000 + fuzz_seed)
    n_ops = rng.randint(10, 22)
    lingering = False
    forward_done = False  # a forward of the model ran through
    try:
        for i in range(n_ops):
            op = _draw_op(rng, cfg, gen, names, {"training": model.training, "forward_done": forward_done})
            log.append(f"op {i}: training={model.training} {_describe(op)}")
            state = _state_for_load(reference, op) if op["kind"] == "load_state_dict" else None
            got = side.run(op, state)
            expected = ref_side.run(op, state)
            _compare(got, expected)
            if rng.random() < 0.6:
                if rng.random() < 0.5:
                    offtensor.wait_for_steps()
                _compare_state(model, reference)
            if op["kind"] == "forward_only":
                lingering = True
            elif op["kind"] in FORWARDS:
                # a no_grad forward with transformers' input-grad hook (the module docstring)
                lingering = (cfg["model"] in ("llama", "moe") and bool(cfg["checkpoint"])
                             and model.training and op["kind"] != "train")
            if got["raised"] is not None and not isinstance(got["raised"], FuzzError):
                # a backward that raised before a scope's backward started leaves the scope kept
                # for it resident until the next forward (docs/design.md, Limits)
                lingering = True
            if op["kind"] in FORWARDS - {"raise"} and got["raised"] is None:
                forward_done = True
            _scope_check(model, wait=cfg["deep_check"], lingering=lingering)
            _cache_check(model)
            if op["kind"] == "no_offload":
                most_device_bytes[0] = 0  # no_offload keeps what loads resident, beyond the budget
            if isinstance(budget, int):
                took = most_device_bytes[0]
                assert took <= budget - cache, f"weights took {took} > {budget} - {cache}"
        offtensor.wait_for_steps()
        _compare_state(model, reference)
        _scope_check(model, wait=True, lingering=lingering)
        if cfg["unwrap_at_end"]:
            log.append("unwrap, then infer and train on both")
            scopes = engine.scopes
            offtensor.unwrap(model)
            assert all(s.device.storage.nbytes() == 0 for s in scopes)
            model.to(DEVICE)
            for op in ({"kind": "infer", "grad_ctx": "no_grad", "rng_seed": 1, "inputs": [_inputs(cfg, gen, "infer")]},
                       {"kind": "train", "grad_ctx": "no_grad", "rng_seed": 2, "inputs": [_inputs(cfg, gen, "train")],
                        "then": "step", "zero_grad": None, "set_to_none": True}):
                _compare(side.run(op), ref_side.run(op))
            _compare_state(model, reference)
    except (AssertionError, RuntimeError, ValueError, TypeError, IndexError, KeyError) as e:
        fail(e)
