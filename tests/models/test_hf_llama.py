"""A Hugging Face Llama model trains and generates the same with its decoder layers offloaded.

The model is built from a small ``LlamaConfig`` (random weights, nothing downloaded). The
default predicate selects the elements of ``model.model.layers``; embeddings, final norm,
rotary embedding and ``lm_head`` stay on the device. Transformers' own gradient checkpointing
is exercised both non-reentrant (its default) and reentrant; depending on the transformers
version it checkpoints a layer's ``__call__`` (module hooks re-run in the recompute) or only its
``forward`` (hooks do not re-run), and offloading must be correct either way.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    devices,
    offload,
    tolerances,
    train_adamw,
    unwrapped_reference,
)

import offtensor

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings(
    # Newer transformers renamed it activation_checkpointing_enable; the old name is what most
    # user code (and the GPU machine's transformers) calls.
    "ignore:.*gradient_checkpointing_enable.*:FutureWarning"
)

VOCAB = 128
NUM_LAYERS = 3

CHECKPOINTING = [
    pytest.param(None, id="no_checkpointing"),
    pytest.param({}, id="checkpointing_default_non_reentrant"),
    pytest.param({"use_reentrant": True}, id="checkpointing_reentrant"),
]


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


def llama_and_reference(device: str, checkpointing: dict | None):
    model = tiny_llama()
    if checkpointing is not None:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable()
    model.train()  # checkpointing only applies in training mode; the config has no dropout
    reference = unwrapped_reference(model, device)
    offtensor.wrap(model, device=device)  # default predicate
    model.to(device)
    return model, reference


def token_batches(n: int, device: str) -> list[torch.Tensor]:
    return [torch.randint(3, VOCAB, (2, 16)).to(device) for _ in range(n)]


def test_default_predicate_selects_the_decoder_layers():
    model = offload(tiny_llama(), "cpu")

    names = [s.name for s in offtensor.summary(model).scopes]

    assert names == [f"model.layers.{i}" for i in range(NUM_LAYERS)]
    for name, p in model.named_parameters():
        assert isinstance(p, offtensor.OffloadedParameter) == name.startswith("model.layers."), name


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_logits_loss_and_grads_match_unwrapped_model(device, checkpointing):
    model, reference = llama_and_reference(device, checkpointing)
    (tokens,) = token_batches(1, device)

    expected = reference(input_ids=tokens, labels=tokens)
    expected.loss.backward()
    out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()

    tol = tolerances(device)
    torch.testing.assert_close(out.logits, expected.logits, **tol)
    torch.testing.assert_close(out.loss, expected.loss, **tol)
    assert_grads_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_three_adamw_steps_match_unwrapped_model(device, checkpointing):
    model, reference = llama_and_reference(device, checkpointing)
    batches = token_batches(3, device)

    def train(m: torch.nn.Module) -> torch.Tensor:
        return train_adamw(m, batches, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                           loss_fn=lambda m, tokens: m(input_ids=tokens, labels=tokens).loss)

    expected = train(reference)
    losses = train(model)

    tol = tolerances(device)
    torch.testing.assert_close(losses, expected, **tol)
    assert_params_match(model, reference, **tol)
    assert_grads_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_greedy_generation_matches_unwrapped_model(device):
    model, reference = llama_and_reference(device, checkpointing=None)
    model.eval()
    reference.eval()
    prompt = torch.randint(3, VOCAB, (1, 5)).to(device)

    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    expected = reference.generate(prompt, **kwargs)
    generated = model.generate(prompt, **kwargs)

    torch.testing.assert_close(generated, expected, rtol=0, atol=0)
    assert_all_scopes_offloaded(model)
