"""`python -m benchmarks compression-error`: the numerical cost of Policy(frozen_format=...)
on the benchmark model: each decoder layer's output and the final logits of the model wrapped
with compressed frozen weights, against the same model in bf16 (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import nn

from .model import build_model, decoder_layers
from .scenarios import FULL_SHAPE, QUICK_SHAPE, ModelShape


def _capture(layers: nn.ModuleList, into: list[torch.Tensor]) -> list[Any]:
    """Forward hooks keeping each decoder layer's output hidden states (fp32, on the host)."""
    def keep(module: nn.Module, args: Any, out: Any) -> None:
        h = out[0] if isinstance(out, tuple) else out
        into.append(h.detach().float().cpu())

    return [layer.register_forward_hook(keep) for layer in layers]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def measure(shape: ModelShape, fmt: str, device: torch.device, batch: int, seq: int, seed: int = 0) -> dict[str, Any]:
    """Relative L2 errors per decoder layer output and of the logits; top-1 agreement."""
    import offtensor

    built = build_model(shape, "base", device, seed)
    reference = built.model.eval().requires_grad_(False)
    compressed = copy.deepcopy(reference)
    offtensor.wrap(compressed, device=device, policy=offtensor.Policy(frozen_format=fmt))
    compressed.to(device)
    ids = torch.randint(0, shape.vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(device)
    outs: dict[str, list[torch.Tensor]] = {"reference": [], "compressed": []}
    logits = {}
    for name, model in (("reference", reference.to(device)), ("compressed", compressed)):
        hooks = _capture(decoder_layers(model), outs[name])
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits.float().cpu()
        for h in hooks:
            h.remove()
        if name == "reference":
            reference.to("cpu")  # make room on the device
    ref, got = logits["reference"], logits["compressed"]
    return {
        "format": fmt,
        "layers": [_rel(g, r) for g, r in zip(outs["compressed"], outs["reference"], strict=True)],
        "logits": _rel(got, ref),
        "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        "host_bytes": offtensor.summary(compressed).host_bytes,
        "bf16_bytes": built.wrapped_bytes,
    }


def main(name: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=__doc__)
    p.add_argument("--quick", action="store_true", help="the --quick model shape (CPU-sized)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--formats", nargs="+", default=["fp8", "int8"], choices=["fp8", "int8"])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    if args.layers is not None:
        shape = ModelShape(shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab, args.layers)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"compression error against bf16: random-weight Llama (hidden {shape.hidden}, ffn "
          f"{shape.intermediate}, {shape.layers} layers, vocab {shape.vocab}), input {args.batch}x{args.seq}, "
          f"on {device}; relative L2 error ||x - x_bf16|| / ||x_bf16||")
    for fmt in args.formats:
        r = measure(shape, fmt, device, args.batch, args.seq)
        layers = "  ".join(f"{e:.2e}" for e in r["layers"])
        print(f"  {fmt}: host bytes {r['host_bytes'] / r['bf16_bytes']:.3f}x of bf16; per-layer output error "
              f"{layers}; final logits {r['logits']:.2e}; top-1 token agreement {r['top1_agreement']:.1%}")
    return 0
