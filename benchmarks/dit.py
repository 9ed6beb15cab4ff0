"""--shape flux: the diffusion transformer (Flux.1-dev's shape), its LoRA adapters, its inputs,
and the references its rows are checked against (docs/benchmarks.md, Diffusion transformer).

The model is diffusers' FluxTransformer2DModel from a config when diffusers is installed, else
the built-in stack of the same blocks (dit_blocks.py). Either way it is built on the meta device
in bf16 (instant at 12B parameters) with LoRA adapters on the attention projections, and each
peer fills it where it places it with `RandomFill(scaled=True)`: values generated on the compute
device from a generator seeded by the module's name (Note [random weights at real shapes] in
shapes.py), normal matrices of std 1/sqrt(fan_in) and zero biases, so that activations stay finite in bf16
through 57 blocks; every peer gets the same weights.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .dit_blocks import BuiltinFlux
from .measure import temporarily, timed
from .model import BuiltModel
from .profiling import is_kernel
from .shapes import RandomFill
from .streamed import fp8_compressed

LORA_RANK = 16
LORA_TARGETS = ("to_q", "to_k", "to_v")  # both kinds of diffusers' blocks; the built-in's single: to_qkv_mlp
BUILTIN_LORA_TARGETS = (*LORA_TARGETS, "to_qkv_mlp")


@dataclass(frozen=True)
class DitShape:
    """The DiT that is built, and the tokens of its workloads."""

    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    in_channels: int  # latent channels after 2x2 packing (16 x 4)
    joint_attention_dim: int  # the text encoder's (T5) hidden size
    pooled_projection_dim: int  # CLIP's pooled embedding
    axes_dims_rope: tuple[int, int, int]  # diffusers' rotary split of head_dim
    image_tokens: int  # 1024x1024: 128x128 latents in 2x2 patches
    text_tokens: int
    name: str = "flux"

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def layers(self) -> int:
        return self.double_blocks + self.single_blocks

    def __str__(self) -> str:
        return (f"DiT {self.double_blocks} double + {self.single_blocks} single blocks, hidden {self.hidden} "
                f"({self.heads} heads x {self.head_dim}), {self.image_tokens} image + {self.text_tokens} text tokens")


FLUX_DEV = DitShape(19, 38, 24, 128, 64, 4096, 768, (16, 56, 56), image_tokens=64 * 64, text_tokens=512)
# --quick: the same code paths on the CPU in seconds; enough blocks that the scaled budgets keep
# some and stream others.
QUICK_FLUX = DitShape(4, 8, 2, 32, 16, 64, 32, (8, 12, 12), image_tokens=8 * 8, text_tokens=16)


def _diffusers_flux(shape: DitShape) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return cast(nn.Module, FluxTransformer2DModel(
        patch_size=1, in_channels=shape.in_channels, num_layers=shape.double_blocks,
        num_single_layers=shape.single_blocks, attention_head_dim=shape.head_dim,
        num_attention_heads=shape.heads, joint_attention_dim=shape.joint_attention_dim,
        pooled_projection_dim=shape.pooled_projection_dim, guidance_embeds=True,
        axes_dims_rope=shape.axes_dims_rope))


def _builtin_flux(shape: DitShape) -> nn.Module:
    return BuiltinFlux(in_channels=shape.in_channels, dim=shape.hidden, heads=shape.heads,
                       double=shape.double_blocks, single=shape.single_blocks,
                       joint_attention_dim=shape.joint_attention_dim,
                       pooled_projection_dim=shape.pooled_projection_dim)


class LoraLinear(nn.Module):
    """`base(x) + lora_B(lora_A(x)) * alpha / r`: the adapter without peft (peft's names)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        self.scaling = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, targets: tuple[str, ...]) -> str:
    """Freeze the model and add rank-16 LoRA adapters (alpha 16) on the linears named `targets`:
    peft's when installed, else LoraLinear. Returns what is trainable, in words."""
    model.requires_grad_(False)
    peft: Any
    try:
        import peft
    except ImportError:
        peft = None
    if peft is not None:
        config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0, target_modules=list(targets))
        peft.inject_adapter_in_model(config, model)
        how = "peft"
    else:
        for module in list(model.modules()):
            for child_name, child in list(module.named_children()):
                if child_name in targets and isinstance(child, nn.Linear):
                    setattr(module, child_name, LoraLinear(child, LORA_RANK))
        how = "built-in LoraLinear (peft not installed)"
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    return f"{how} LoRA r={LORA_RANK} on {'/'.join(targets)}; base frozen"


def use_diffusers(kind: str) -> bool:
    """Whether to build diffusers' model: --dit-model auto (when installed), diffusers or builtin."""
    if kind == "builtin":
        return False
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        if kind == "diffusers":
            raise RuntimeError("--dit-model diffusers: diffusers is not installed (pip install diffusers)") from exc
        return False
    return True


def build_dit(shape: DitShape, device: torch.device, seed: int, kind: str = "auto") -> BuiltModel:
    """The DiT of `shape` with LoRA adapters, on the meta device in bf16, to be filled where a
    peer places it by its `fill` (RandomFill on `device`). `layers`: its double-stream blocks,
    then its single-stream blocks (what the offloaders move)."""
    diffusers = use_diffusers(kind)
    with temporarily(torch.get_default_dtype, torch.set_default_dtype, torch.bfloat16), torch.device("meta"):
        model = _diffusers_flux(shape) if diffusers else _builtin_flux(shape)
        trainable = add_lora(model, LORA_TARGETS if diffusers else BUILTIN_LORA_TARGETS)
        blocks = nn.ModuleList([*cast(Any, model).transformer_blocks, *cast(Any, model).single_transformer_blocks])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block_params = list(blocks.parameters())
    return BuiltModel(
        variant="lora", vocab=0, model=model, layers=blocks,
        trainable=("diffusers FluxTransformer2DModel" if diffusers else "built-in DiT (dit_blocks.py)")
        + "; " + trainable,
        total_bytes=nbytes, wrapped_bytes=sum(p.numel() * p.element_size() for p in block_params),
        wrapped_trainable_bytes=sum(p.numel() * p.element_size() for p in block_params if p.requires_grad),
        fill=RandomFill(device, seed, scaled=True))


def dit_inputs(shape: DitShape, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """One denoising step's inputs, batch 1 in bf16: packed latents, text-encoder states, the
    pooled embedding, timestep 0.5, guidance 3.5, the image tokens' (0, row, column) ids; and
    `target`, the LoRA step's flow-matching target (random)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    side = math.isqrt(shape.image_tokens)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(shape.image_tokens // side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).flatten(0, 1).to(device, torch.bfloat16)
    return {"hidden_states": randn(1, shape.image_tokens, shape.in_channels),
            "encoder_hidden_states": randn(1, shape.text_tokens, shape.joint_attention_dim),
            "pooled_projections": randn(1, shape.pooled_projection_dim),
            "timestep": torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),
            "img_ids": img_ids,
            "txt_ids": torch.zeros(shape.text_tokens, 3, device=device, dtype=torch.bfloat16),
            "guidance": torch.full((1,), 3.5, device=device, dtype=torch.bfloat16),
            "target": randn(1, shape.image_tokens, shape.in_channels)}


@contextlib.contextmanager
def attention_backends(device: torch.device) -> Iterator[None]:
    """On CUDA, SDPA restricted to flash and memory-efficient attention (torch 2.11's cuDNN
    attention backward faults at this shape); nothing elsewhere."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        yield


# ---- the fp8 reference (Note [compressed masters] in storage/compress.py, as documented) ----

FP8_MAX = 448.0  # float8 e4m3's largest finite value
_ROWS_NUMEL = 2**24  # elements rounded at a time: the fp32 temporaries stay small


@torch.no_grad()
def fp8_round_trip_(w: torch.Tensor) -> None:
    """Replace `w` (a matrix, rows = dim 0) by its values as Policy(frozen_format="fp8") stores
    them: per row, scale = absmax / 448 rounded to w's dtype (1 for an all-zero row, the
    dtype's smallest normal for one that rounds to 0), values = (w / scale) clamped to +-448 in
    float8 e4m3; then values in w's dtype times the scale, in w's dtype."""
    flat = w.view(w.shape[0], -1)
    step = max(1, _ROWS_NUMEL // max(flat.shape[1], 1))
    tiny = torch.tensor(torch.finfo(w.dtype).tiny, dtype=w.dtype, device=w.device)
    for start in range(0, flat.shape[0], step):
        block = flat[start:start + step].float()
        amax = block.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(w.dtype)
        scale = torch.where(scale > 0, scale, tiny)
        q = block.div_(scale.float()[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        flat[start:start + step].copy_(q.to(w.dtype).mul_(scale[:, None]))


def round_blocks_to_fp8_(built: BuiltModel) -> int:
    """fp8_round_trip_ on every block parameter Policy(frozen_format="fp8") compresses, in place
    (the resident model, after its own timings); returns how many."""
    params = [p for p in built.layers.parameters() if fp8_compressed(p)]
    for p in params:
        fp8_round_trip_(p)
    return len(params)


def measure_dequant_rate(device: torch.device, numel: int, reps: int = 5) -> float:
    """Seconds per element that offtensor's own dequantization takes on `device` (its fused kernel
    where it has one): a frozen linear of about `numel` weights wrapped with
    Policy(frozen_format="fp8"), each load profiled, the device time of the kernels beside the
    compute stream (the cast stream's conversions, not its copies) over the elements unpacked.
    Median of `reps` after one warm-up. Off CUDA, the whole forward's time (no device timeline to
    split)."""
    import offtensor

    cols = 4096
    rows = max(1, numel // cols)
    holder = nn.Sequential(nn.Linear(cols, rows, bias=False)).to(device=device, dtype=torch.bfloat16)
    holder.requires_grad_(False)
    offtensor.wrap(holder, lambda name, m: isinstance(m, nn.Linear), device=device,
                   policy=offtensor.Policy(frozen_format="fp8"))
    x = torch.zeros(1, cols, device=device, dtype=torch.bfloat16)

    def forward() -> None:
        with torch.no_grad():
            holder(x)

    forward()
    if device.type != "cuda":
        return statistics.median(timed(device, forward) for _ in range(reps)) / (rows * cols)
    from torch.profiler import ProfilerActivity, profile

    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and is_kernel(e)]
        compute = max(kernels, key=lambda e: e.time_range.end).device_resource_id  # the matmul's, last
        times.append(sum(e.time_range.elapsed_us() for e in kernels if e.device_resource_id != compute) / 1e6)
    return statistics.median(times) / (rows * cols)
