"""offtensor in one minute: offload a Llama-shaped model's layers to CPU, run it, train it.

The decoder layers live in CPU memory and are copied to the compute device one at a time,
just before they run; embeddings, final norm and head stay on the device. The script runs
inference, then a few AdamW steps with gradient checkpointing, and checks that the loss went
down. Uses CUDA when there is a GPU, the CPU otherwise (offtensor runs its full mechanism there
too, so the demo exercises the same code paths).

    python examples/demo.py
    python examples/demo.py --device cpu --layers 4 --hidden 256
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offtensor


def build_model(layers: int, hidden: int, vocab: int) -> nn.Module:
    """A randomly initialised Llama from a config (nothing is downloaded)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("transformers is not installed; using a plain torch model instead")
        return TinyLM(layers, hidden, vocab)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        use_cache=False,  # the demo never decodes token by token; see generate.py for that
    )
    return LlamaForCausalLM(config)


def enable_checkpointing(model: nn.Module) -> None:
    # transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Stand-in with the same outline as LlamaForCausalLM, for machines without transformers."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.checkpointing = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.embed(input_ids)
        for layer in self.layers:
            if self.checkpointing and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            )
        return _Output(loss, logits)


class _Output:
    def __init__(self, loss: torch.Tensor | None, logits: torch.Tensor) -> None:
        self.loss = loss
        self.logits = logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, help="default: 16 on CUDA, 4 on the CPU")
    parser.add_argument("--hidden", type=int, help="default: 1024 on CUDA, 256 on the CPU")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    # Big enough on a GPU for the memory saving to show, small enough for a CPU to finish
    # in well under a minute.
    args.layers = args.layers or (16 if on_cuda else 4)
    args.hidden = args.hidden or (1024 if on_cuda else 256)
    torch.manual_seed(0)

    model = build_model(args.layers, args.hidden, args.vocab)
    # Default predicate: every element of every nn.ModuleList, i.e. the decoder layers.
    offtensor.wrap(model, device=device)
    # Moves what was not offloaded (embeddings, norm, head, buffers); layers stay on the CPU.
    model.to(device)
    print(f"wrapped {type(model).__name__}: {args.layers} layers, hidden {args.hidden}, "
          f"compute device {device}")

    # A short repeating pattern: learnable, so a handful of steps must lower the loss.
    pattern = torch.randint(0, args.vocab, (args.batch, 16))
    input_ids = pattern.repeat(1, args.seq // 16).to(device)

    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)

    model.eval()
    with torch.no_grad():
        logits = model(input_ids).logits
    print(f"inference: logits {tuple(logits.shape)}, finite: {bool(logits.isfinite().all())}")

    model.train()
    enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - start:.2f} s)")

    print()
    print(offtensor.summary(model))
    print()
    # The table's total size: the scopes, the parameters left on the device and the buffers.
    tensors = [*model.parameters(), *model.buffers()]
    model_mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    print(f"model parameters and buffers: {model_mib:.1f} MiB")
    if on_cuda:
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        print(f"peak VRAM: {peak:.1f} MiB (weights, grads, AdamW state and activations)")
    decreased = losses[-1] < losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: "
          f"{'decreased' if decreased else 'DID NOT DECREASE'}")
    if not decreased:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
