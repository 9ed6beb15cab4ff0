"""Greedy `model.generate()` with a KV cache on an offloaded LlamaForCausalLM.

Builds a randomly initialised Llama from a config (nothing is downloaded), decodes a few tokens
with the plain model, then wraps the same weights with offtensor and checks that the generated
ids are identical. Uses CUDA when there is a GPU, the CPU otherwise.

    python examples/generate.py
    python examples/generate.py --device cpu --new-tokens 16
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import offtensor


def greedy(model: LlamaForCausalLM, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval()
    reference = copy.deepcopy(model)  # before wrap: wrap changes the parameters in place
    input_ids = torch.randint(1, config.vocab_size, (2, args.prompt_len), device=device)

    # The reference runs first and is freed before the offloaded model runs, so each model's
    # result comes from its own work only.
    expected = greedy(reference.to(device), input_ids, args.new_tokens)
    del reference

    offtensor.wrap(model, device=device)
    model.to(device)
    generated = greedy(model, input_ids, args.new_tokens)

    print("prompt:   ", input_ids[0].tolist())
    print("generated:", generated[0, args.prompt_len:].tolist())
    print(offtensor.summary(model))
    if not torch.equal(generated, expected):
        print("expected: ", expected[0, args.prompt_len:].tolist())
        raise SystemExit("generated ids differ from the unwrapped model's")
    print(f"OK: {args.new_tokens} greedy tokens x {input_ids.shape[0]} sequences match the "
          f"unwrapped model on {device}")


if __name__ == "__main__":
    main()
