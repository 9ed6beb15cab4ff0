"""Architecture matrix: tiny random-weight models of many families, wrapped with the DEFAULT
predicate, must behave exactly like an unwrapped deep copy.

Every builder in ``ARCHS`` returns an :class:`Arch`: the model (random weights, dropout off, in
training mode), ``make_inputs(device)`` (the same inputs on every call), ``loss_fn(output)``
(a scalar) and ``out_fn(output)`` (the tensor whose parity is checked, e.g. logits). Each
(architecture, mode) pair is one test; every forward and backward of the wrapped model runs
under :class:`master_guard.MasterGuard`, so an op that computes on a host master fails even on
the CPU (where it would otherwise be invisible).

Modes (training modes step both models side by side, ``train_in_lockstep``: outputs and losses
compared at every step, gradients after every backward, parameters and buffers at the end, and
every scope offloaded):
- ``fwd_bwd``: one forward and backward: output, loss and gradient parity.
- ``adamw3``: three AdamW steps, ``zero_grad`` first.
- ``ckpt_reentrant`` / ``ckpt_non_reentrant``: one AdamW step with activation checkpointing
  (transformers' ``activation_checkpointing_enable``/``gradient_checkpointing_enable``;
  diffusers' ``enable_gradient_checkpointing`` with a ``checkpoint`` of the chosen kind).
- ``backward_and_step``: two ``offtensor.backward_and_step(loss, opt, zero_grad=True)`` steps
  against ``backward(); step(); zero_grad()``.
- ``split_scopes``: ``Policy(max_scope_bytes=<half the largest block>)``, two AdamW steps
  written ``loss = f(); opt.zero_grad(...); loss.backward(); opt.step()`` (``zero_grad``
  between forward and backward, a legitimate order; ``set_to_none`` True, then False).
- ``split_ckpt_reentrant``: the same, three steps (``set_to_none`` True, False, True), with
  reentrant activation checkpointing: backward starts
  with the recompute of the last block, in forward order, so the end of the forward prefetches
  a scope other than the last one, with the previous step's gradients for accumulation, before
  ``zero_grad`` runs.
- ``unwrap``: one AdamW step, ``offtensor.unwrap``, then parameters, gradients and a forward
  match and no parameter is offloaded any more.
- ``generate``: greedy ``generate()`` of a few tokens in eval mode (decoder LMs, T5, BART,
  Whisper), tokens equal.

Device is a parameter (conftest ``devices``): the same matrix runs on CUDA where present. The
full tier (``OFFTENSOR_TESTS=full``) runs every (architecture, mode) pair; the quick default runs
each architecture family (``FAMILIES``) and each mode at least once, a rotating sample.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import offtensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # also under --import-mode=importlib
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    host,
    mlp_of_blocks,
    tolerances,
    unwrapped_reference,
)
from master_guard import MasterGuard, master_guard  # noqa: F401  (a fixture)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*[Cc]heckpoint.*:UserWarning"),
]

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread_deterministic_cudnn():
    """Tiny models: intra-op threads only add synchronisation (and, on a busy 2-core machine,
    oversubscription that makes each op 20x slower). Both models run the same kernels. On CUDA,
    deterministic cuDNN convolutions: a nondeterministic weight gradient differs in its last
    bits between the two models, which Adam amplifies for near-zero gradients."""
    n = torch.get_num_threads()
    deterministic = torch.backends.cudnn.deterministic
    torch.set_num_threads(1)
    torch.backends.cudnn.deterministic = True
    yield
    torch.set_num_threads(n)
    torch.backends.cudnn.deterministic = deterministic


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Arch:
    model: nn.Module
    make_inputs: Callable[[str], dict[str, Any]]
    loss_fn: Callable[[Any], torch.Tensor]
    out_fn: Callable[[Any], torch.Tensor]
    family: str  # "transformers" or "diffusers"
    generate: Callable[[nn.Module, str], torch.Tensor] | None = None  # greedy tokens, or None


def _gen_inputs(seed: int, fn: Callable[[torch.Generator], dict[str, Any]]
                ) -> Callable[[str], dict[str, Any]]:
    """``make_inputs(device)``: the same tensors on every call (own generator, CPU then moved)."""

    def make(device: str) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fn(g).items()}

    return make


def _tokens(g: torch.Generator, batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def _loss_attr(out: Any) -> torch.Tensor:
    return out.loss


def _logits(out: Any) -> torch.Tensor:
    return out.logits


def _greedy_lm(model: nn.Module, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    prompt = _tokens(g, batch=1, length=4).to(device)
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                          min_new_tokens=4, do_sample=False, pad_token_id=0)


def _greedy_seq2seq(model: nn.Module, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    src = _tokens(g, batch=1, length=6).to(device)
    return model.generate(src, attention_mask=torch.ones_like(src), max_new_tokens=4,
                          min_new_tokens=4, do_sample=False)


def _transformers():
    return pytest.importorskip("transformers")


def _diffusers():
    return pytest.importorskip("diffusers")


def _causal_lm(model: nn.Module) -> Arch:
    def inputs(g: torch.Generator) -> dict[str, Any]:
        ids = _tokens(g)
        return {"input_ids": ids, "labels": ids}

    return Arch(model, _gen_inputs(0, inputs), _loss_attr, _logits, "transformers", _greedy_lm)


_LM_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def build_llama() -> Arch:
    t = _transformers()
    return _causal_lm(t.LlamaForCausalLM(t.LlamaConfig(**_LM_COMMON)))


def build_llama_tied() -> Arch:
    t = _transformers()
    return _causal_lm(t.LlamaForCausalLM(t.LlamaConfig(**_LM_COMMON, tie_word_embeddings=True)))


def build_mistral() -> Arch:
    t = _transformers()
    return _causal_lm(t.MistralForCausalLM(t.MistralConfig(**_LM_COMMON, sliding_window=None)))


def build_qwen2() -> Arch:
    t = _transformers()
    return _causal_lm(t.Qwen2ForCausalLM(t.Qwen2Config(**_LM_COMMON)))


def build_qwen3() -> Arch:
    t = _transformers()
    return _causal_lm(t.Qwen3ForCausalLM(t.Qwen3Config(**_LM_COMMON, head_dim=8)))


def build_gemma() -> Arch:
    t = _transformers()
    return _causal_lm(t.GemmaForCausalLM(t.GemmaConfig(**_LM_COMMON, head_dim=8)))


def build_phi3() -> Arch:
    t = _transformers()
    cfg = t.Phi3Config(**_LM_COMMON, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return _causal_lm(t.Phi3ForCausalLM(cfg))


def build_gpt2() -> Arch:
    t = _transformers()
    cfg = t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       bos_token_id=1, eos_token_id=2)
    return _causal_lm(t.GPT2LMHeadModel(cfg))


def build_gpt_neox() -> Arch:
    t = _transformers()
    cfg = t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                          hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return _causal_lm(t.GPTNeoXForCausalLM(cfg))


def build_falcon() -> Arch:
    t = _transformers()
    cfg = t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                         bos_token_id=1, eos_token_id=2)
    return _causal_lm(t.FalconForCausalLM(cfg))


def build_mixtral() -> Arch:
    t = _transformers()
    cfg = t.MixtralConfig(**_LM_COMMON, num_local_experts=4, num_experts_per_tok=2,
                          router_jitter_noise=0.0, sliding_window=None)
    return _causal_lm(t.MixtralForCausalLM(cfg))


def build_qwen2_moe() -> Arch:
    t = _transformers()
    common = {k: v for k, v in _LM_COMMON.items() if k != "intermediate_size"}
    cfg = t.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=16,
                           shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2, decoder_sparse_step=1)
    return _causal_lm(t.Qwen2MoeForCausalLM(cfg))


def build_mamba() -> Arch:
    t = _transformers()
    cfg = t.MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2,
                        expand=2, conv_kernel=4, use_mambapy=False, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    return _causal_lm(t.MambaForCausalLM(cfg))


def build_mamba2() -> Arch:
    t = _transformers()
    cfg = t.Mamba2Config(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2,
                         expand=2, num_heads=4, head_dim=8, n_groups=1, conv_kernel=4,
                         chunk_size=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal_lm(t.Mamba2ForCausalLM(cfg))


def _freeze_key_biases(model: nn.Module, suffixes: tuple[str, ...] = (".k_proj.bias", ".key.bias")
                       ) -> nn.Module:
    """Freeze the key-projection biases of attention without rotary embeddings: their gradient
    is zero in exact arithmetic (q.b_k is the same for every key, and softmax ignores it), so it
    is rounding noise, which Adam turns into full lr-sized steps that differ between the CPU
    (where the offloaded masters step) and CUDA (where the reference steps). Frozen, they also
    cover frozen offloaded parameters. (Fused qkv biases, GPT-2's and GPT-NeoX's, cannot be
    frozen in part: their key slice is the same noise, small enough at lr=1e-3.)"""
    for name, p in model.named_parameters():
        if name.endswith(suffixes):
            p.requires_grad_(False)
    return model


def _seq2seq(model: nn.Module) -> Arch:
    def inputs(g: torch.Generator) -> dict[str, Any]:
        return {"input_ids": _tokens(g, length=6), "labels": _tokens(g, length=5)}

    return Arch(model, _gen_inputs(0, inputs), _loss_attr, _logits, "transformers", _greedy_seq2seq)


def build_t5() -> Arch:
    t = _transformers()
    cfg = t.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                     num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                     relative_attention_max_distance=16, dropout_rate=0.0,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return _seq2seq(t.T5ForConditionalGeneration(cfg))


#: BART and Whisper: sizes, no dropout, special tokens.
_ENCODER_DECODER_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "d_model": 16, "encoder_layers": 2, "decoder_layers": 2,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def build_bart() -> Arch:
    t = _transformers()
    cfg = t.BartConfig(**_ENCODER_DECODER_COMMON, max_position_embeddings=64, decoder_start_token_id=2,
                       forced_bos_token_id=None, forced_eos_token_id=None)
    return _seq2seq(_freeze_key_biases(t.BartForConditionalGeneration(cfg)))


def build_bert() -> Arch:
    t = _transformers()
    cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def inputs(g: torch.Generator) -> dict[str, Any]:
        ids = _tokens(g)
        return {"input_ids": ids, "labels": ids}

    return Arch(_freeze_key_biases(t.BertForMaskedLM(cfg)), _gen_inputs(0, inputs), _loss_attr,
                _logits, "transformers")


def build_vit() -> Arch:
    t = _transformers()
    cfg = t.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                      num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)

    def inputs(g: torch.Generator) -> dict[str, Any]:
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)}

    return Arch(_freeze_key_biases(t.ViTForImageClassification(cfg)), _gen_inputs(0, inputs),
                _loss_attr, _logits, "transformers")


def build_clip() -> Arch:
    t = _transformers()
    text = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 16,
            "projection_dim": 16, "attention_dropout": 0.0, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 8, "patch_size": 4, "projection_dim": 16,
              "attention_dropout": 0.0}
    cfg = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)

    def inputs(g: torch.Generator) -> dict[str, Any]:
        return {"input_ids": _tokens(g, length=6),
                "pixel_values": torch.randn(2, 3, 8, 8, generator=g),
                "return_loss": True}

    return Arch(_freeze_key_biases(t.CLIPModel(cfg)), _gen_inputs(0, inputs), _loss_attr,
                lambda out: out.logits_per_image, "transformers")


def build_whisper() -> Arch:
    t = _transformers()
    cfg = t.WhisperConfig(**_ENCODER_DECODER_COMMON, num_mel_bins=8, max_source_positions=8,
                          max_target_positions=16, decoder_start_token_id=1, suppress_tokens=[],
                          begin_suppress_tokens=[])
    model = t.WhisperForConditionalGeneration(cfg)

    def inputs(g: torch.Generator) -> dict[str, Any]:
        return {"input_features": torch.randn(2, 8, 16, generator=g),
                "labels": torch.randint(3, VOCAB, (2, 5), generator=g)}

    def greedy(m: nn.Module, device: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(1, 8, 16, generator=g).to(device)
        return m.generate(input_features=feats, max_new_tokens=4, min_new_tokens=4, do_sample=False)

    return Arch(model, _gen_inputs(0, inputs), _loss_attr, _logits, "transformers", greedy)


def _sample(out: Any) -> torch.Tensor:
    return out.sample if hasattr(out, "sample") else out[0]


def _mse_loss(out: Any) -> torch.Tensor:
    return _sample(out).float().pow(2).mean()


def _diffusion(model: nn.Module, fn: Callable[[torch.Generator], dict[str, Any]]) -> Arch:
    return Arch(model, _gen_inputs(0, fn), _mse_loss, _sample, "diffusers")


def build_unet2d_condition() -> Arch:
    d = _diffusers()
    model = d.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        attention_head_dim=4, norm_num_groups=4, mid_block_type=None)
    return _diffusion(model, lambda g: {
        "sample": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 3, 16, generator=g)})


def build_flux() -> Arch:
    d = _diffusers()
    model = d.FluxTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))
    return _diffusion(model, lambda g: {
        "hidden_states": torch.randn(1, 16, 4, generator=g),
        "encoder_hidden_states": torch.randn(1, 3, 16, generator=g),
        "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([0.5]),
        "img_ids": torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                              indexing="ij"), -1).reshape(16, 3),
        "txt_ids": torch.zeros(3, 3)})


def build_sd3() -> Arch:
    d = _diffusers()
    model = d.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8)
    return _diffusion(model, lambda g: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, 3, 16, generator=g),
        "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([10])})


def build_autoencoder_kl() -> Arch:
    d = _diffusers()
    model = d.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16)
    _freeze_key_biases(model, (".to_k.bias",))  # the mid blocks' self-attention
    return _diffusion(model, lambda g: {"sample": torch.randn(1, 3, 16, 16, generator=g)})


def build_wan() -> Arch:
    d = _diffusers()
    model = d.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    return _diffusion(model, lambda g: {
        "hidden_states": torch.randn(1, 4, 1, 8, 8, generator=g), "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 3, 16, generator=g)})


ARCHS: dict[str, Callable[[], Arch]] = {
    "llama": build_llama,
    "llama_tied": build_llama_tied,
    "mistral": build_mistral,
    "qwen2": build_qwen2,
    "qwen3": build_qwen3,
    "gemma": build_gemma,
    "phi3": build_phi3,
    "gpt2": build_gpt2,
    "gpt_neox": build_gpt_neox,
    "falcon": build_falcon,
    "mixtral": build_mixtral,
    "qwen2_moe": build_qwen2_moe,
    "t5": build_t5,
    "bart": build_bart,
    "bert": build_bert,
    "vit": build_vit,
    "clip": build_clip,
    "whisper": build_whisper,
    "mamba": build_mamba,
    "mamba2": build_mamba2,
    "unet2d_condition": build_unet2d_condition,
    "flux": build_flux,
    "sd3": build_sd3,
    "autoencoder_kl": build_autoencoder_kl,
    "wan": build_wan,
}

#: What the quick tier covers (conftest, Note [quick tier covers every parameter value]): each
#: family and each mode at least once, in a combination that rotates with the sample seed.
FAMILIES = {
    "decoder": ("llama", "llama_tied", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2",
                "gpt_neox", "falcon"),
    "mixture_of_experts": ("mixtral", "qwen2_moe"),
    "state_space": ("mamba", "mamba2"),
    "encoder_decoder": ("t5", "bart", "whisper"),
    "encoder": ("bert", "vit", "clip"),
    "diffusion_conv": ("unet2d_condition", "autoencoder_kl"),
    "diffusion_transformer": ("flux", "sd3", "wan"),
}
FAMILY_OF = {name: family for family, names in FAMILIES.items() for name in names}

GENERATES = {"llama", "llama_tied", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2",
             "gpt_neox", "falcon", "mixtral", "qwen2_moe", "t5", "bart", "whisper", "mamba",
             "mamba2"}

MODES = ["fwd_bwd", "adamw3", "ckpt_reentrant", "ckpt_non_reentrant", "backward_and_step",
         "split_scopes", "split_ckpt_reentrant", "unwrap", "generate"]


# --------------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------------


def build(name: str) -> Arch:
    torch.manual_seed(0)
    arch = ARCHS[name]()
    arch.model.float().train()
    return arch


def enable_checkpointing(arch: Arch, reentrant: bool) -> None:
    model = arch.model
    if arch.family == "transformers":
        if not getattr(model, "supports_gradient_checkpointing", False):
            pytest.skip(f"{type(model).__name__} does not support gradient checkpointing")
        kwargs = {"use_reentrant": reentrant}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        if not getattr(model, "_supports_gradient_checkpointing", False):
            pytest.skip(f"{type(model).__name__} does not support gradient checkpointing")

        def ckpt(module, *args):
            return torch.utils.checkpoint.checkpoint(module.__call__, *args,
                                                     use_reentrant=reentrant)

        model.enable_gradient_checkpointing(ckpt)


def largest_block_bytes(model: nn.Module) -> int:
    """Parameter bytes of the largest element of an outermost ``nn.ModuleList`` (what the
    default predicate selects), for ``Policy(max_scope_bytes=...)``."""
    largest, inside = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(p) for p in inside):
            continue
        inside.append(name + ".")
        for child in module:
            largest = max(largest, sum(p.numel() * p.element_size() for p in child.parameters()))
    return largest


def wrap_pair(arch: Arch, device: str, **kwargs) -> nn.Module:
    """The unwrapped reference (made first), then wrap the model with the default predicate."""
    reference = unwrapped_reference(arch.model, device)
    offtensor.wrap(arch.model, device=device, **kwargs)  # default predicate
    arch.model.to(device)
    return reference


def run_guarded(model: nn.Module, arch: Arch, inputs: dict[str, Any], *, backward: bool = True,
                zero_grad_between: torch.optim.Optimizer | None = None) -> tuple[Any, torch.Tensor]:
    """Forward (and backward) of the wrapped model under MasterGuard."""
    with MasterGuard(model):
        out = model(**inputs)
        loss = arch.loss_fn(out)
    if zero_grad_between is not None:
        zero_grad_between.zero_grad()  # acts on masters' grads: outside the guard
    if backward:
        with MasterGuard(model):
            loss.backward()
    return out, loss


def run_ref(reference: nn.Module, arch: Arch, inputs: dict[str, Any], *, backward: bool = True):
    out = reference(**inputs)
    loss = arch.loss_fn(out)
    if backward:
        loss.backward()
    return out, loss


def assert_outputs_match(arch: Arch, out: Any, ref_out: Any, loss: torch.Tensor,
                         ref_loss: torch.Tensor, tol: dict) -> None:
    torch.testing.assert_close(host(arch.out_fn(out)), host(arch.out_fn(ref_out)), **tol)
    torch.testing.assert_close(host(loss), host(ref_loss), **tol)


def stepped_tolerances(tol: dict) -> dict:
    """Tolerances once an optimizer step has run. On the CPU still exact. On CUDA the masters
    step on the CPU and the reference on the GPU: their last-bit differences grow through a
    deep conv net (the UNet: 5e-5 on outputs after one step), ten times conftest's fp32
    tolerances; a wrong update (a stale or missing gradient) is a whole lr=1e-3 step."""
    if tol["atol"] == 0 and tol["rtol"] == 0:
        return tol
    return {"rtol": max(tol["rtol"], 1e-3), "atol": max(tol["atol"], 1e-4)}


def train_in_lockstep(model: nn.Module, reference: nn.Module, arch: Arch, inputs: dict[str, Any],
                      steps: int, tol: dict, order: str = "zero_first") -> None:
    """``steps`` AdamW steps of the wrapped model (forward and backward under MasterGuard) and of
    the reference, side by side: outputs and losses match at every step, gradients after every
    backward (before the step), parameters and buffers at the end. ``order``: ``zero_first``
    (zero_grad, fwd, bwd, step), ``zero_between`` (fwd, zero_grad, bwd, step; ``set_to_none``
    True, False, True, ...) or ``backward_and_step`` (``offtensor.backward_and_step(loss, opt,
    zero_grad=True)`` against ``backward(); step(); zero_grad()``; parameters are compared only
    at the end, so the deferred steps overlap the next forward as they would)."""
    # lr as in test_hf_llama: on CUDA the masters step on the CPU and the reference on the GPU,
    # and Adam turns last-bit gradient differences of near-zero gradients into differences
    # proportional to lr (conftest.tolerances)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    stepped = stepped_tolerances(tol)
    for i in range(steps):
        step_tol = tol if i == 0 else stepped
        if order == "zero_first":
            opt.zero_grad()
            ref_opt.zero_grad()
        with MasterGuard(model):
            out = model(**inputs)
            loss = arch.loss_fn(out)
        ref_out = reference(**inputs)
        ref_loss = arch.loss_fn(ref_out)
        assert_outputs_match(arch, out, ref_out, loss, ref_loss, step_tol)
        if order == "zero_between":
            opt.zero_grad(set_to_none=i % 2 == 0)
            ref_opt.zero_grad(set_to_none=i % 2 == 0)
        if order == "backward_and_step":
            with MasterGuard(model):
                offtensor.backward_and_step(loss, opt, zero_grad=True)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            continue
        with MasterGuard(model):
            loss.backward()
        ref_loss.backward()
        assert_grads_match(model, reference, **step_tol)
        opt.step()
        ref_opt.step()
    offtensor.wait_for_steps()
    assert_params_match(model, reference, **stepped)
    assert_grads_match(model, reference, **stepped)
    assert_all_scopes_offloaded(model)


# --------------------------------------------------------------------------------------------
# The MasterGuard itself
# --------------------------------------------------------------------------------------------


class _DataTransposeLinear(nn.Module):
    """``x @ self.weight.data.T``: ``.data`` is the host master by design (a property of the
    master), so the op computes on the master: the guard must flag it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.data.T


class _TransposeLinear(_DataTransposeLinear):
    """``input @ self.weight.T`` as Falcon's linear does: must run on the device copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class _Stack(nn.Module):
    def __init__(self, cls: type, n: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(cls(n) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_master_guard_flags_an_op_on_a_master_view():
    model = offtensor.wrap(_Stack(_DataTransposeLinear), device="cpu")
    with pytest.raises(AssertionError, match=r"aten\.(permute|t|mm).*'blocks\.0\.weight'"), \
            MasterGuard(model):
        model(torch.randn(2, 8))


def test_master_guard_flags_mm_on_a_master_by_name():
    model = offtensor.wrap(mlp_of_blocks(), device="cpu")
    master = model.blocks[1].fc2.weight
    with torch._C.DisableTorchFunctionSubclass():
        plain = master.detach()  # the master itself, as an op that escaped materialisation sees it
    with pytest.raises(AssertionError, match=r"aten\.mm.*'blocks\.1\.fc2\.weight'"), \
            MasterGuard(model):
        torch.mm(torch.randn(3, 16), plain)
    guard = MasterGuard(model, raise_on_violation=False)
    with guard:
        torch.mm(torch.randn(3, 32), plain.t())
        torch.empty(16, 32).copy_(plain)  # a copy out of a master (offtensor's loads): allowed
        plain.detach()
    assert [op for op, _ in guard.violations] == ["aten.t.default", "aten.mm.default"]
    assert {name for _, name in guard.violations} == {"blocks.1.fc2.weight"}
    bias = model.blocks[0].fc1.bias
    with pytest.raises(AssertionError, match=r"aten\.copy_.*writes into.*'blocks\.0\.fc1\.bias'"), \
            MasterGuard(model), torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        bias.copy_(torch.zeros(32))


def test_master_guard_accepts_transposed_weight_on_device_copy():
    """Falcon's ``input @ self.weight.T`` must run on the device copy (a core regression)."""
    model = _Stack(_TransposeLinear)
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu")
    x = torch.randn(2, 8)
    with MasterGuard(model):
        out = model(x)
        out.square().sum().backward()
    ref = reference(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert_grads_match(model, reference, rtol=0, atol=0)


def test_master_guard_passes_a_plain_wrapped_model(master_guard):  # noqa: F811
    model = mlp_of_blocks()
    reference = unwrapped_reference(model, "cpu")
    offtensor.wrap(model, device="cpu")
    x = torch.randn(4, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        with master_guard(model) as guard:
            model(x).square().mean().backward()
        assert guard.violations == []
        opt.step()  # outside the guard: steps act on the masters
        opt.zero_grad()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(2):
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_match(model, reference, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# The matrix
# --------------------------------------------------------------------------------------------


def _cases():
    for name in ARCHS:
        for mode in MODES:
            if mode == "generate" and name not in GENERATES:
                continue
            yield pytest.param(name, mode, id=f"{name}-{mode}")


def _family_and_mode(params: dict[str, Any]) -> set[tuple[str, str]]:
    return {("family", FAMILY_OF[params["name"]]), ("mode", params["mode"])}


def test_every_architecture_has_a_family():
    assert FAMILY_OF.keys() == ARCHS.keys()


@pytest.mark.cover.with_args(_family_and_mode)  # with_args: the argument is a function
@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("name,mode", list(_cases()))
def test_architecture(name: str, mode: str, device: str) -> None:
    arch = build(name)
    tol = tolerances(device)
    model = arch.model
    inputs = arch.make_inputs(device)

    if mode in ("ckpt_reentrant", "ckpt_non_reentrant", "split_ckpt_reentrant"):
        enable_checkpointing(arch, reentrant=mode != "ckpt_non_reentrant")

    if mode == "generate":
        model.eval()
        reference = wrap_pair(arch, device)
        reference.eval()
        assert arch.generate is not None
        expected = arch.generate(reference, device)
        with MasterGuard(model):
            got = arch.generate(model, device)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert_all_scopes_offloaded(model)
        return

    if mode in ("split_scopes", "split_ckpt_reentrant"):
        half = max(1, largest_block_bytes(model) // 2)
        reference = wrap_pair(arch, device, policy=offtensor.Policy(max_scope_bytes=half))
        blocks = {s.block for s in model._offtensor_engine.scopes}
        assert len(model._offtensor_engine.scopes) > len(blocks), "nothing was split"
    else:
        reference = wrap_pair(arch, device)

    if mode == "fwd_bwd":
        out, loss = run_guarded(model, arch, inputs)
        ref_out, ref_loss = run_ref(reference, arch, inputs)
        assert_outputs_match(arch, out, ref_out, loss, ref_loss, tol)
        assert_grads_match(model, reference, **tol)
        assert_all_scopes_offloaded(model)
    elif mode == "adamw3":
        train_in_lockstep(model, reference, arch, inputs, 3, tol)
    elif mode in ("ckpt_reentrant", "ckpt_non_reentrant"):
        train_in_lockstep(model, reference, arch, inputs, 1, tol)
    elif mode == "split_scopes":
        train_in_lockstep(model, reference, arch, inputs, 2, tol, order="zero_between")
    elif mode == "split_ckpt_reentrant":
        train_in_lockstep(model, reference, arch, inputs, 3, tol, order="zero_between")
    elif mode == "backward_and_step":
        train_in_lockstep(model, reference, arch, inputs, 2, tol, order="backward_and_step")
    elif mode == "unwrap":
        train_in_lockstep(model, reference, arch, inputs, 1, tol)
        offtensor.unwrap(model)
        assert not offtensor.is_wrapped(model)
        assert not any(isinstance(p, offtensor.OffloadedParameter) for p in model.parameters())
        model.to(device)
        stepped = stepped_tolerances(tol)
        assert_params_match(model, reference, **stepped)
        assert_grads_match(model, reference, **stepped)
        with torch.no_grad():
            out, loss = run_ref(model, arch, inputs, backward=False)
            ref_out, ref_loss = run_ref(reference, arch, inputs, backward=False)
        assert_outputs_match(arch, out, ref_out, loss, ref_loss, stepped)
    else:
        raise AssertionError(mode)


# --------------------------------------------------------------------------------------------
# Other granularities
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices)
def test_leaf_linear_scopes_of_a_seq2seq_model_train_with_backward_and_step(device):
    """Every nn.Linear a scope (BART's head among them, tied to the embedding that stays
    resident): backward_and_step steps the head, used outside its scope, on the calling thread
    after backward, which the guard must not take for an op of the backward."""
    arch = build("bart")
    reference = unwrapped_reference(arch.model, device)
    offtensor.wrap(arch.model, lambda name, m: isinstance(m, nn.Linear), device=device)
    arch.model.to(device)
    assert any(s.name == "lm_head" for s in offtensor.summary(arch.model).scopes)
    train_in_lockstep(arch.model, reference, arch, arch.make_inputs(device), 2, tolerances(device),
                      order="backward_and_step")
