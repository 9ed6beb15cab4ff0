"""--shape flux without diffusers: a diffusion transformer of Flux's block structure, built in.

Double-stream blocks keep separate weights for the image and the text tokens (modulation,
q/k/v, output projection, MLP) and attend jointly over both; single-stream blocks run on the
joined sequence with one fused linear for q, k, v and the MLP's input and one for the attention
output and the MLP's output, as Flux's. The parameter names follow diffusers'
FluxTransformer2DModel where the structure is the same (`transformer_blocks.N.attn.to_q`,
`single_transformer_blocks.N`), so the peers, the LoRA targets (to_q/to_k/to_v; the single
blocks' fused `to_qkv_mlp`) and the report read the same. Left out: rotary position embeddings
(`img_ids`/`txt_ids` are accepted and ignored) and the diffusers model's extras (ControlNet,
IP-Adapter inputs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

TIME_DIM = 256  # the sinusoidal embedding of the timestep and the guidance scale, as Flux's


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, tokens, heads * head_dim) -> (batch, heads, tokens, head_dim)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class _Mlp(nn.Module):
    """linear_2(silu(linear_1(x))): the timestep, guidance and pooled-text embedders."""

    def __init__(self, dim_in: int, dim: int) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(dim_in, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class _JointAttention(nn.Module):
    """The double-stream block's attention weights: q/k/v and output of the image tokens
    (`to_q` ...), of the text tokens (`add_q_proj` ...), RMS norms of q and k for each."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.add_q_proj, self.add_k_proj, self.add_v_proj, self.to_add_out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (
            nn.RMSNorm(dim // heads, eps=1e-6) for _ in range(4))

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.heads
        q = torch.cat([self.norm_added_q(_heads(self.add_q_proj(txt), h)), self.norm_q(_heads(self.to_q(img), h))], 2)
        k = torch.cat([self.norm_added_k(_heads(self.add_k_proj(txt), h)), self.norm_k(_heads(self.to_k(img), h))], 2)
        v = torch.cat([_heads(self.add_v_proj(txt), h), _heads(self.to_v(img), h)], 2)
        out = _attend(q, k, v)
        n_txt = txt.shape[1]
        return self.to_out(out[:, n_txt:]), self.to_add_out(out[:, :n_txt])


class DoubleBlock(nn.Module):
    """Flux's double-stream block: image and text tokens with weights of their own
    (modulation, attention projections, MLP), one attention over both together."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm1_context = nn.Linear(dim, 6 * dim), nn.Linear(dim, 6 * dim)
        self.attn = _JointAttention(dim, heads)
        self.ff, self.ff_context = _FeedForward(dim, 4 * dim), _FeedForward(dim, 4 * dim)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mi = self.norm1(F.silu(temb)).chunk(6, dim=-1)  # shift, scale, gate of attention, then of the MLP
        mt = self.norm1_context(F.silu(temb)).chunk(6, dim=-1)
        img, txt = self.attn(_modulate(hidden_states, mi[0], mi[1]), _modulate(encoder_hidden_states, mt[0], mt[1]))
        hidden_states = hidden_states + mi[2][:, None] * img
        encoder_hidden_states = encoder_hidden_states + mt[2][:, None] * txt
        hidden_states = hidden_states + mi[5][:, None] * self.ff(_modulate(hidden_states, mi[3], mi[4]))
        encoder_hidden_states = encoder_hidden_states + mt[5][:, None] * self.ff_context(
            _modulate(encoder_hidden_states, mt[3], mt[4]))
        return encoder_hidden_states, hidden_states


class SingleBlock(nn.Module):
    """Flux's single-stream block on the joined text and image tokens: q, k, v and the MLP's
    input from one fused linear (`to_qkv_mlp`), attention and MLP outputs through another."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.norm = nn.Linear(dim, 3 * dim)
        self.to_qkv_mlp = nn.Linear(dim, 3 * dim + 4 * dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim // heads, eps=1e-6), nn.RMSNorm(dim // heads, eps=1e-6)
        self.proj_out = nn.Linear(dim + 4 * dim, dim)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_txt = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        shift, scale, gate = self.norm(F.silu(temb)).chunk(3, dim=-1)
        q, k, v, mlp = self.to_qkv_mlp(_modulate(x, shift, scale)).split([self.dim] * 3 + [4 * self.dim], dim=-1)
        out = _attend(self.norm_q(_heads(q, self.heads)), self.norm_k(_heads(k, self.heads)), _heads(v, self.heads))
        x = x + gate[:, None] * self.proj_out(torch.cat([out, F.gelu(mlp, approximate="tanh")], dim=-1))
        return x[:, :n_txt], x[:, n_txt:]


def timestep_embedding(t: torch.Tensor, dim: int = TIME_DIM) -> torch.Tensor:
    """Sinusoidal embedding of `t * 1000` (Flux's timesteps are in [0, 1]), cos then sin."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class BuiltinFlux(nn.Module):
    """The built-in DiT: Flux's embedders, `double` double-stream and `single` single-stream
    blocks, the modulated output norm and projection; `forward` takes FluxTransformer2DModel's
    arguments (see the module docstring)."""

    def __init__(self, *, in_channels: int, dim: int, heads: int, double: int, single: int, joint_attention_dim: int,
                 pooled_projection_dim: int) -> None:
        super().__init__()
        self.x_embedder = nn.Linear(in_channels, dim)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.timestep_embedder, self.guidance_embedder = _Mlp(TIME_DIM, dim), _Mlp(TIME_DIM, dim)
        self.text_embedder = _Mlp(pooled_projection_dim, dim)
        self.transformer_blocks = nn.ModuleList(DoubleBlock(dim, heads) for _ in range(double))
        self.single_transformer_blocks = nn.ModuleList(SingleBlock(dim, heads) for _ in range(single))
        self.norm_out = nn.Linear(dim, 2 * dim)
        self.proj_out = nn.Linear(dim, in_channels)
        self.gradient_checkpointing = False

    def enable_gradient_checkpointing(self) -> None:
        """Non-reentrant activation checkpointing of every block, as diffusers' model has."""
        self.gradient_checkpointing = True

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: Any = None, txt_ids: Any = None,
                guidance: torch.Tensor | None = None, return_dict: bool = True) -> Any:
        dtype = hidden_states.dtype
        temb = self.timestep_embedder(timestep_embedding(timestep).to(dtype)) + self.text_embedder(pooled_projections)
        if guidance is not None:
            temb = temb + self.guidance_embedder(timestep_embedding(guidance).to(dtype))
        img, txt = self.x_embedder(hidden_states), self.context_embedder(encoder_hidden_states)
        for block in (*self.transformer_blocks, *self.single_transformer_blocks):
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                txt, img = checkpoint(block, img, txt, temb, use_reentrant=False)
            else:
                txt, img = block(img, txt, temb)
        shift, scale = self.norm_out(F.silu(temb)).chunk(2, dim=-1)
        out = self.proj_out(_modulate(img, shift, scale))
        return {"sample": out} if return_dict else (out,)
