"""The benchmark's model: a random-weight Hugging Face Llama (transformers is imported here,
lazily), its decoder layers, and the activation-checkpointing switches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .measure import temporarily
from .scenarios import ModelShape


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    # transformers' own random init of billions of bf16 values takes tens of seconds on the CPU;
    # we skip it and fill the weights from the device's generator instead (_fill_random).
    for path in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(path, fromlist=["no_init_weights"])
            return module.no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def _fill_random(model: nn.Module, device: torch.device, seed: int) -> None:
    """Normal(0, 0.02) matrices, ones for norm weights; generated on `device`, stored in place."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:
                p.fill_(1.0)
                continue
            src = torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=gen)
            p.copy_(src)
            del src


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers (also found inside a peft-injected model)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    for m in lists:
        if type(m[0]).__name__.endswith("DecoderLayer"):
            return m
    if not lists:
        raise RuntimeError("bench: the model has no nn.ModuleList of layers")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


@dataclass
class BuiltModel:
    """A built model and the byte counts the rooflines need."""

    variant: str  # 'base', 'lora' or 'fp32'
    vocab: int
    model: nn.Module
    layers: nn.ModuleList
    trainable: str  # what requires grad, in words
    total_bytes: int  # all parameters
    wrapped_bytes: int  # decoder-layer parameters: what an offloader moves
    wrapped_trainable_bytes: int  # decoder-layer parameters that get a grad
    dtype: torch.dtype = torch.bfloat16  # of the parameters
    # --shape: the parameters are on the meta device and this fills them, as offtensor.load's
    # init (init(module_name, module)); the peers place the model by loading it (shapes.py).
    fill: Callable[[str, nn.Module], None] | None = None


def _empty_weights() -> contextlib.AbstractContextManager[Any]:
    """Parameters created on the meta device, buffers (rotary inv_freq) real: accelerate's
    init_empty_weights (--shape needs accelerate)."""
    try:
        from accelerate import init_empty_weights
    except ImportError as exc:
        raise RuntimeError("bench: --shape builds the model on the meta device with accelerate's "
                           "init_empty_weights; pip install accelerate") from exc
    return init_empty_weights()


def _llama(shape: ModelShape, dtype: torch.dtype, empty: bool = False) -> nn.Module:
    """The Llama of `shape` in `dtype`; with `empty`, its parameters on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # attn_implementation is stored by the base config from **kwargs; typed stubs do not know it.
    config = cast(Any, LlamaConfig)(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    where = _empty_weights() if empty else contextlib.nullcontext()
    with _no_init_weights(), temporarily(torch.get_default_dtype, torch.set_default_dtype, dtype), \
            torch.device("cpu"), where:
        return LlamaForCausalLM(config)


def _make_lora(model: nn.Module) -> str:
    """Freeze the base; train LoRA adapters (peft) or, without peft, the input embeddings (so
    that backward still runs through every decoder layer). Returns what is trainable, in words."""
    model.requires_grad_(False)
    peft: Any
    try:
        import peft
    except ImportError:
        peft = None
    if peft is None:
        cast(Any, model).get_input_embeddings().weight.requires_grad_(True)
        return "input embeddings only (peft not installed); decoder layers frozen"
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft.inject_adapter_in_model(lora, model)
    for name, p in model.named_parameters():
        is_lora = "lora_" in name
        p.requires_grad_(is_lora)
        if is_lora and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)
    return "peft LoRA r=16 on q/k/v/o_proj; base frozen"


def _nbytes(ps: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def build_model(shape: ModelShape, variant: str, device: torch.device, seed: int,
                fill: Callable[[str, nn.Module], None] | None = None) -> BuiltModel:
    """A random-weight bf16 LlamaForCausalLM with SDPA attention, parameters on the CPU; with
    `fill` (--shape), on the meta device, left for `fill` to initialize where each peer places
    them (shapes.py).

    variant 'fp32': the same in fp32 (masters for step32-4x2048, which computes in bf16).

    variant 'lora': every base parameter frozen; LoRA adapters (r=16 on q/k/v/o) trainable when
    peft is installed, otherwise the input embeddings.
    """
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    model = _llama(shape, dtype, empty=fill is not None)
    if fill is None:
        _fill_random(model, device, seed)
    trainable = _make_lora(model) if variant == "lora" else "all parameters"
    layers = decoder_layers(model)
    return BuiltModel(
        variant=variant,
        vocab=shape.vocab,
        model=model,
        layers=layers,
        trainable=trainable,
        total_bytes=_nbytes(model.parameters()),
        wrapped_bytes=_nbytes(layers.parameters()),
        wrapped_trainable_bytes=_nbytes(p for p in layers.parameters() if p.requires_grad),
        dtype=dtype,
        fill=fill,
    )


def materialize(model: nn.Module, device: torch.device, fill: Callable[[str, nn.Module], None]) -> None:
    """The model's meta parameters allocated on `device` and initialized there by `fill`
    (module by module, as offtensor.load calls it: the same values), tied ones kept tied; then
    its buffers to `device`. The resident peer's placement of a --shape model: no host copy."""
    done: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            created = False
            for pname, p in module._parameters.items():
                if p is None or not p.is_meta:
                    continue
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                    created = True
                module._parameters[pname] = done[id(p)]
            if created:
                fill(name, module)
    model.to(device)


def _hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a DistributedDataParallel (the ddp-resident peer), or `model`."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def checkpointing_on(model: nn.Module) -> bool:
    model = _hf_model(model)
    # transformers 5.x renamed the property (the old name warns); older ones only have the old.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (once)."""
    if checkpointing_on(model):
        return
    # transformers 5.2x renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    hf_model: Any = _hf_model(model)
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
