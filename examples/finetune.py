"""Fine-tune a Llama-shaped model whose training state does not fit in the GPU's memory.

Weights, gradients and AdamW state (16 bytes per float32 parameter) stay in CPU memory; the
GPU holds a layer or two at a time plus activations. The optimizer is a plain
`torch.optim.AdamW` stepping on the CPU. `--vram-cap-gib` limits the memory this process may
use on the GPU, so a large GPU can stand in for a small one.

The data is synthetic but learnable (a pool of token patterns, each repeated to fill the
sequence), so the loss must fall; the script checks that it did.

    python examples/finetune.py --tiny                  # CPU, under two minutes
    python examples/finetune.py --vram-cap-gib 4        # ~1B parameters (~15 GiB of state)
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import offtensor

GiB = 2**30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vram-cap-gib", type=float, default=4.0,
                        help="most GPU memory this process may use (CUDA only)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=5, help="steps of linear lr warmup")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--overlap", action="store_true",
                        help="step AdamW on the CPU while backward runs (offtensor.backward_and_step)")
    parser.add_argument("--tiny", action="store_true",
                        help="small preset that trains on a CPU in under two minutes")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.vocab = 4, 128, 512
        args.seq, args.batch, args.accum, args.steps, args.lr = 64, 4, 2, 30, 5e-3
    return args


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=max(args.seq, 128),
        use_cache=False,  # training only; generate.py shows decoding with a KV cache
    )
    return LlamaForCausalLM(config).to(getattr(torch, args.dtype))


def select(name: str, module: torch.nn.Module) -> bool | offtensor.Policy:
    """Offload every decoder layer and the two vocabulary-sized matrices.

    The head's backward comes right after its forward (the loss is all that runs in between),
    so it stays resident from forward to backward instead of being copied in twice.
    """
    if name == "lm_head":
        return offtensor.Policy(keep_for_backward=True)
    return isinstance(module, LlamaDecoderLayer) or name == "model.embed_tokens"


class PatternData:
    """Sequences made of one of `num_patterns` fixed token patterns, repeated."""

    def __init__(self, vocab: int, seq: int, num_patterns: int = 16, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seq = seq
        self.lengths = torch.randint(4, 17, (num_patterns,), generator=gen)
        # A corner of the vocabulary, so even the unigram statistics are worth learning.
        self.patterns = torch.randint(0, min(vocab, 64), (num_patterns, 16), generator=gen)
        self.gen = gen

    def batch(self, size: int) -> torch.Tensor:
        rows = []
        for i in torch.randint(0, len(self.patterns), (size,), generator=self.gen).tolist():
            pattern = self.patterns[i, : self.lengths[i]]
            repeats = -(-self.seq // len(pattern))
            rows.append(pattern.repeat(repeats)[: self.seq])
        return torch.stack(rows)


def enable_checkpointing(model: LlamaForCausalLM) -> None:
    # transformers 5 renamed gradient_checkpointing_enable to activation_checkpointing_enable.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)

    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    # weights + grads + AdamW's exp_avg and exp_avg_sq, all in the parameter dtype
    state_bytes = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model: {num_params / 1e6:.1f} M parameters, {args.layers} layers, "
          f"hidden {args.hidden}, {args.dtype}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        cap = min(args.vram_cap_gib * GiB, total)
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        fits = "fits" if state_bytes <= cap else "does NOT fit"
        print(f"model state (weights + grads + AdamW): {state_bytes / GiB:.2f} GiB; "
              f"VRAM cap {cap / GiB:.2f} GiB of {total / GiB:.1f} GiB: the state {fits}")
    else:
        print(f"model state (weights + grads + AdamW): {state_bytes / GiB:.2f} GiB; "
              f"device {device}: no VRAM cap")

    offtensor.wrap(model, select, device=device)
    model.to(device)  # only the final norm and buffers: everything else was offloaded
    enable_checkpointing(model)
    model.train()
    # The offloaded parameters and their grads are CPU tensors, so AdamW steps on the CPU.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    # From random init, full-size Adam steps at once overshoot; ramp the lr up instead.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, args.warmup))
    )

    data = PatternData(args.vocab, args.seq)
    tokens_per_step = args.batch * args.seq * args.accum
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        step_start = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        for micro in range(args.accum):
            input_ids = data.batch(args.batch).to(device, non_blocking=True)
            loss = model(input_ids=input_ids, labels=input_ids).loss / args.accum
            step_loss += loss.detach()  # .item() here would sync every micro-batch
            if args.overlap and micro == args.accum - 1:
                # Each scope's AdamW update runs on a host thread as soon as its last grad
                # lands, while backward goes on through the earlier layers; the first layers'
                # updates finish during the next forward, each before its weights are loaded.
                # zero_grad=True zeroes each grad right after its update (no waiting here).
                offtensor.backward_and_step(loss, optimizer, zero_grad=True)
            else:
                loss.backward()  # grads accumulate in the offloaded .grad across micro-batches
        if not args.overlap:
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()  # applies from the next step, also to updates still running
        losses.append(step_loss.item())

        elapsed = time.perf_counter() - step_start
        line = (f"step {step:>4}/{args.steps}  loss {losses[-1]:.4f}  "
                f"{tokens_per_step / elapsed:,.0f} tok/s")
        if device.type == "cuda":
            line += (f"  VRAM {torch.cuda.memory_allocated(device) / GiB:.2f} GiB"
                     f" (peak {torch.cuda.max_memory_allocated(device) / GiB:.2f} GiB)")
        print(line, flush=True)

    print(f"\n{args.steps} steps in {time.perf_counter() - start:.1f} s")
    print(offtensor.summary(model))
    window = max(1, min(3, len(losses) // 3))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last {window} steps)")
    if not last < first:
        raise SystemExit("loss did not fall")
    print("OK: loss fell")


if __name__ == "__main__":
    main()
