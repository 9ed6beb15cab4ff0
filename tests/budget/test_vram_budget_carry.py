"""Policy(layout="spread", vram_budget=...): a backward leaves the scopes the next forward computes first resident
(Note [carried into the next forward] in budget/vram.py).

The carried copies must never be used stale: every way the masters can change between a
backward and the next forward (an optimizer step, a write that bypasses the parameter) is
checked against the unwrapped model, with the loads counted and the weights' device bytes
bounded by the budget at every load.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    BlockStack,
    assert_all_scopes_offloaded,
    assert_grads_match,
    assert_params_match,
    device_layout_bytes,
    devices,
    mlp_of_blocks,
    offload,
    random_batch,
    reference_then_offload,
    step_both,
    tolerances,
)

import offtensor

N_BLOCKS = 8


def _budget(model, kept: int, prefetch: int = 1) -> int:
    """Room for `kept` kept blocks beside streaming's 2 + prefetch."""
    return (2 + prefetch + kept) * device_layout_bytes(model.blocks[0])


def _rows(model) -> dict[str, offtensor.ScopeSummary]:
    return {s.name: s for s in offtensor.summary(model).scopes}


def _loads(model) -> dict[str, int]:
    return {name: row.loads for name, row in _rows(model).items()}


def _backward_both(model, reference, device: str, batch=None) -> None:
    """An MSE loss on both models (a new random batch unless given): equal losses, then both
    backward."""
    x, y = batch if batch is not None else random_batch(device)
    loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
    torch.testing.assert_close(loss, ref_loss, **tolerances(device))
    loss.backward()
    ref_loss.backward()


def _carried(model) -> list[str]:
    return [name for name, row in _rows(model).items() if row.carried]


def _wrapped_with_one_kept(device: str, *, frozen_blocks: bool = False):
    """8 blocks, block 0 kept, the room of 3 blocks streaming the rest: a backward carries
    blocks 1 and 2 (the room less one block)."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    if frozen_blocks:
        for block in model.blocks:
            block.requires_grad_(False)
    budget = _budget(model, kept=1)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert [r.kept for r in offtensor.summary(model).scopes] == [True] + [False] * (N_BLOCKS - 1)
    return model, reference, budget


@pytest.mark.parametrize("device", devices)
def test_accumulation_reuses_the_scopes_the_backward_carried(device, most_device_bytes):
    """Micro-batches with no step between them: the next forward starts on blocks 1 and 2 as the
    last backward left them, so they load once per micro-batch (for backward), and the others
    twice (forward and backward; the last block once, kept from its forward for backward)."""
    model, reference, budget = _wrapped_with_one_kept(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        for micro in range(3):
            before = _loads(model)
            _backward_both(model, reference, device)
            assert_all_scopes_offloaded(model)  # carried copies equal their masters
            loads = {n: c - before[n] for n, c in _loads(model).items()}
            if step or micro:  # the first pass learns the order; its backward carries nothing
                assert _carried(model) == ["blocks.1", "blocks.2"]
                assert loads["blocks.0"] == (0 if micro else 1), loads  # kept; a step's write reloads it
                if micro and (step or micro > 1):  # the last backward carried them, no step since
                    assert [loads["blocks.1"], loads["blocks.2"]] == [1, 1], loads
                assert [loads[f"blocks.{i}"] for i in range(3, N_BLOCKS - 1)] == [2] * 4, loads
                assert loads[f"blocks.{N_BLOCKS - 1}"] == 1, loads
        assert_grads_match(model, reference, **tolerances(device))
        opt.step(), ref_opt.step()
        assert _carried(model) == []  # the step wrote their masters: released, not stale
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_match(model, reference, **tolerances(device))
    assert most_device_bytes[0] <= budget


@pytest.mark.parametrize("device", devices)
def test_a_frozen_base_stays_carried_across_optimizer_steps(device, most_device_bytes):
    """LoRA-style: the step writes only the trainable head, so the frozen blocks the backward
    carried serve the next step's forward."""
    model, reference, budget = _wrapped_with_one_kept(device, frozen_blocks=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for step in range(4):
        before = _loads(model)
        _backward_both(model, reference, device)
        step_both(model, reference, opt, ref_opt, tolerances(device))
        assert _carried(model) == (["blocks.1", "blocks.2"] if step else [])  # once the order is learned
        if step >= 2:
            loads = _loads(model)
            assert [loads[f"blocks.{i}"] - before[f"blocks.{i}"] for i in (1, 2)] == [1, 1]
    assert_params_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)
    assert most_device_bytes[0] <= budget


WRITES_BYPASSING_THE_PARAMETER = {
    "data_add": lambda p: p.data.add_(1.0),
    "view_fill": lambda p: p[0].fill_(3.0),
    "detach_mul": lambda p: p.detach().mul_(-2.0),
    "in_place": lambda p: p.mul_(0.5),  # an op the parameter sees (under no_grad)
}


@pytest.mark.parametrize("write", list(WRITES_BYPASSING_THE_PARAMETER))
@pytest.mark.parametrize("device", devices)
def test_a_write_between_backward_and_forward_reaches_the_carried_scope(device, write):
    """A carried copy stays resident from a backward to the next forward, as a kept one does
    between passes: a write to its master in between, seen by an op or not, must reach the next
    forward (a stale copy would be a silent wrong answer that streaming hides)."""
    model, reference, _ = _wrapped_with_one_kept(device)
    for _ in range(2):
        _backward_both(model, reference, device)
    assert "blocks.1" in _carried(model)
    with torch.no_grad():
        for m in (model, reference):
            WRITES_BYPASSING_THE_PARAMETER[write](m.blocks[1].fc1.weight)
    _backward_both(model, reference, device)
    assert_grads_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_carried_scopes_go_when_the_next_forward_fails_or_does_not_use_them(device):
    """An exception before the carried scopes compute releases them, as it releases every
    streamed scope; an evaluation without grad uses them and, no backward following it, carries
    them again into the next forward; the model trains on like the unwrapped one."""
    model, reference, _ = _wrapped_with_one_kept(device)
    x, y = random_batch(device)
    _backward_both(model, reference, device, (x, y))
    _backward_both(model, reference, device, (x, y))
    assert _carried(model) == ["blocks.1", "blocks.2"]

    def boom(module, args):
        raise RuntimeError("boom")

    handle = model.blocks[0].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    handle.remove()
    assert _carried(model) == []
    assert _rows(model)["blocks.1"].state is offtensor.ScopeState.OFFLOADED
    assert_all_scopes_offloaded(model)

    _backward_both(model, reference, device, (x, y))
    assert _carried(model) == ["blocks.1", "blocks.2"]
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **tolerances(device))
    assert _carried(model) == ["blocks.1", "blocks.2"]  # used by the evaluation, loaded again at its end
    assert_all_scopes_offloaded(model)
    model.train(), reference.train()
    _backward_both(model, reference, device, (x, y))
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.parametrize("device", devices)
def test_backward_and_step_carries_frozen_scopes_but_not_trained_ones(device):
    """The optimizer worker writes trainable masters where no hook sees it, so backward_and_step
    leaves none of their scopes resident; frozen ones it may carry."""
    model = mlp_of_blocks(n_blocks=N_BLOCKS)
    model.blocks[1].requires_grad_(False)
    budget = _budget(model, kept=1)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for step in range(4):
        x, y = random_batch(device)
        offtensor.backward_and_step(F.mse_loss(model(x), y), opt, zero_grad=True)
        F.mse_loss(reference(x), y).backward()
        ref_opt.step(), ref_opt.zero_grad()
        offtensor.wait_for_steps()
        if step:  # once the order is learned
            assert _carried(model) == ["blocks.1"]
    assert_params_match(model, reference, **tolerances(device))
    assert_all_scopes_offloaded(model)


@pytest.mark.parametrize("device", devices)
def test_no_carry_without_a_budget(device):
    """Without Policy(vram_budget) the promise is that a scope's copy goes when its use ends:
    nothing is left on the device after backward."""
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, device)
    for _ in range(2):
        _backward_both(model, reference, device)
        assert _carried(model) == []
        assert offtensor.summary(model).device_bytes == 0
    assert_grads_match(model, reference, **tolerances(device))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_device_memory_with_carried_scopes_stays_within_the_budget(most_device_bytes):
    """Device memory of training passes with carried scopes: the weights (kept, carried and
    streamed) stay within the budget at every load, exactly (`most_device_bytes`). The peak of
    all CUDA memory adds the gradients on their way to the host: the scope finishing and the one
    before it until compute has waited for their copies, and frees ordered after a copy on
    another stream that the allocator cannot reuse at once (a block more or less, with timing;
    this bound once failed at 2 blocks on the H200). Between passes the same scopes stay, and
    nothing else."""
    import gc

    model = mlp_of_blocks(n_blocks=N_BLOCKS, hidden=512)
    block = device_layout_bytes(model.blocks[0])
    budget = _budget(model, kept=1)
    offtensor.wrap(model, device="cuda", policy=offtensor.Policy(layout="spread", vram_budget=budget))
    model.input.to("cuda")
    model.head.to("cuda")
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 4, device="cuda")
    for _ in range(2):  # the first pass learns the order; the second backward carries
        F.mse_loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    gc.collect()  # what earlier tests left for the collector must not be freed while measuring
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    held = offtensor.summary(model).device_bytes
    assert held == 3 * block, offtensor.summary(model)  # block 0 kept, 1 and 2 carried
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        F.mse_loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    assert most_device_bytes[0] <= budget
    above = torch.cuda.max_memory_allocated() - base
    assert above <= (budget - held) + 4 * block + 2**20, (above / block, offtensor.summary(model))
    assert offtensor.summary(model).device_bytes == held  # the same scopes carried again
    grown = torch.cuda.memory_allocated() - base
    assert grown <= 2**20, (grown, offtensor.summary(model))  # nothing else stays (no leak)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("device", devices)
def test_one_backward_through_two_forwards_stays_within_the_budget(device, checkpoint, most_device_bytes):
    """A loss over two forwards (DPO's chosen and rejected, a contrastive pair): one backward
    runs through both graphs, the second forward's first. Its end carries blocks 1 and 2, then
    the first forward's backward still has every block to go: the carried copies are done
    with, but took the streaming room it loads into (a block over the budget before the fix)."""
    model, reference, budget = _wrapped_with_one_kept(device)
    model.checkpoint = reference.checkpoint = checkpoint
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        (x1, y), (x2, _) = random_batch(device), random_batch(device)
        loss = F.mse_loss(model(x1) - model(x2), y)
        ref_loss = F.mse_loss(reference(x1) - reference(x2), y)
        torch.testing.assert_close(loss, ref_loss, **tolerances(device))
        loss.backward()
        ref_loss.backward()
        assert_grads_match(model, reference, **tolerances(device))
        assert_all_scopes_offloaded(model)
        if step:  # once the order is learned
            assert _carried(model) == ["blocks.1", "blocks.2"]
        if step % 2:  # accumulation across the other steps: carried scopes serve the next pair
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    assert_params_match(model, reference, **tolerances(device))
    assert most_device_bytes[0] <= budget


@pytest.mark.parametrize("device", devices)
def test_a_step_over_some_blocks_releases_only_their_carried_scopes(device, most_device_bytes):
    """Two optimizers after clipping: one over blocks 0 and 1 steps every other step, the other
    accumulates over the rest until the last. A step writes block 1's masters (released, the
    next forward reloads it), not block 2's (still carried: its next forward loads nothing). A
    carried copy kept across its own step would be a silent wrong answer; one released by any
    step would load twice."""
    model, reference, budget = _wrapped_with_one_kept(device)

    def optimizers(m):
        first = [p for n, p in m.named_parameters() if n.startswith(("blocks.0.", "blocks.1."))]
        rest = [p for n, p in m.named_parameters() if not n.startswith(("blocks.0.", "blocks.1."))]
        return torch.optim.SGD(first, lr=0.1), torch.optim.AdamW(rest, lr=1e-2)

    (first, rest), (ref_first, ref_rest) = optimizers(model), optimizers(reference)
    for step in range(5):
        before = _loads(model)
        _backward_both(model, reference, device)
        loads = {n: c - before[n] for n, c in _loads(model).items()}
        if step >= 2:  # block 2 was carried into this forward: it loaded for backward only
            assert loads["blocks.2"] == 1, loads
            assert loads["blocks.1"] == (2 if step % 2 == 0 else 1), loads  # reloaded after a step
        assert_grads_match(model, reference, **tolerances(device))
        for m in (model, reference):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        if step % 2:
            first.step(), ref_first.step()
            first.zero_grad(), ref_first.zero_grad()
        if step == 4:
            rest.step(), ref_rest.step()
        if step:  # once the order is learned
            expected = {1: ["blocks.2"], 2: ["blocks.1", "blocks.2"], 3: ["blocks.2"], 4: ["blocks.1"]}[step]
            assert _carried(model) == expected
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tolerances(device))
    assert most_device_bytes[0] <= budget


# ---- Hugging Face models ---------------------------------------------------------------------

VOCAB = 128

HF_CHECKPOINTING = [
    pytest.param(None, id="no_checkpointing"),
    pytest.param({}, id="checkpointing_non_reentrant"),
    pytest.param({"use_reentrant": True}, id="checkpointing_reentrant"),
]


def _tiny_llama(layers: int = 6) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _hf_budget(blocks, kept: int) -> int:
    """Room for streaming (3 of the largest block) and `kept` more, with a little slack."""
    largest = max(device_layout_bytes(b) for b in blocks)
    return (3 + kept) * largest + 64


def _tokens(device: str, n: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, length)).to(device)


def _rollout(model, prompt: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                             min_new_tokens=4, do_sample=False, pad_token_id=0)
    model.train()
    return out


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
@pytest.mark.parametrize("checkpointing", HF_CHECKPOINTING)
@pytest.mark.parametrize("device", devices)
def test_llama_rollouts_and_accumulated_steps_match_the_unwrapped_model(device, checkpointing,
                                                                         most_device_bytes):
    """RL-style: a greedy rollout, then two accumulated micro-batches on its tokens and a step,
    three times. Layer 0 and 5 kept (spread), the backward carries layers 1 and 2 into the next
    micro-batch (and into the rollout after a step that wrote them: released there). Any
    stale carried copy, any copy left behind by a generate() between, shows in the tokens, the
    loss, the grads or the params; any extra copy in the budget."""
    model = _tiny_llama()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing or None)
    model.train()
    layers = list(model.model.layers)
    budget = _hf_budget(layers, kept=2)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert [r.kept for r in offtensor.summary(model).scopes] == [True, False, False, False, False, True]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device)
    prompt = _tokens(device, length=4)
    for step in range(3):
        tokens, ref_tokens = _rollout(model, prompt), _rollout(reference, prompt)
        torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0)
        assert_all_scopes_offloaded(model)
        for micro in range(2):
            batch = torch.cat([ref_tokens, _tokens(device, length=ref_tokens.shape[1])])
            loss = model(input_ids=batch, labels=batch).loss
            ref_loss = reference(input_ids=batch, labels=batch).loss
            torch.testing.assert_close(loss, ref_loss, **tol)
            loss.backward()
            ref_loss.backward()
            assert_all_scopes_offloaded(model)
            if step or micro:  # once the order is learned
                assert _carried(model) == ["model.layers.1", "model.layers.2"]
        step_both(model, reference, opt, ref_opt, tol)
        assert _carried(model) == []
    assert_params_match(model, reference, **tol)
    assert_all_scopes_offloaded(model)
    assert most_device_bytes[0] <= budget


@pytest.mark.parametrize("adapters", [[0, 3, 4], None], ids=["frozen_layers_1_2", "every_layer"])
@pytest.mark.parametrize("overlap", [False, True], ids=["step", "backward_and_step"])
@pytest.mark.parametrize("device", devices)
def test_peft_lora_llama_carries_layers_across_micro_batches_and_frozen_ones_across_steps(
        device, overlap, adapters, most_device_bytes):
    """PEFT LoRA, two micro-batches a step: the backward carries layers 1 and 2 into the next
    micro-batch. Without adapters there (the backward still runs through them, for layer 0's)
    they serve the next step's forward as they are; with adapters in them (every layer) the
    step writes their masters and releases them, and backward_and_step, whose worker writes them
    unseen, does not carry them at all. A carried copy used after its adapters' step would be a
    silent wrong answer (stale adapter weights)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=adapters,
        init_lora_weights=False))
    model.train()
    layers = list(model.base_model.model.model.layers)
    budget = _hf_budget(layers, kept=2)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    names = [s.name for s in offtensor.summary(model).scopes]
    assert [r.kept for r in offtensor.summary(model).scopes] == [True, False, False, False, False, True]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    tol = tolerances(device)
    frozen = adapters is not None
    for step in range(3):
        for micro in range(2):
            before = _loads(model)
            tokens = _tokens(device)
            loss = model(input_ids=tokens, labels=tokens).loss
            ref_loss = reference(input_ids=tokens, labels=tokens).loss
            torch.testing.assert_close(loss, ref_loss, **tol)
            ref_loss.backward()
            if micro and overlap:
                offtensor.backward_and_step(loss, opt, zero_grad=True)
                offtensor.wait_for_steps()
                ref_opt.step(), ref_opt.zero_grad()
                assert _carried(model) == (names[1:3] if frozen else [])
            else:
                loss.backward()
                assert_grads_match(model, reference, **tol)
                if step or micro:  # once the order is learned
                    assert _carried(model) == names[1:3]
            if micro and not overlap:
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
                assert _carried(model) == (names[1:3] if frozen else [])
            if step and (micro or frozen):  # the last backward carried them into this forward (and no
                # step released them): loaded for backward only
                loads = _loads(model)
                assert [loads[n] - before[n] for n in names[1:3]] == [1, 1], (step, micro)
            assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)
    assert most_device_bytes[0] <= budget


def _tiny_t5() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


@pytest.mark.parametrize("device", devices)
def test_t5_generation_between_training_steps_matches_the_unwrapped_model(device, most_device_bytes):
    """Encoder-decoder: training passes start in the encoder, so the backward (ending in the
    encoder) carries encoder blocks; generate() runs the encoder outside the model's forward,
    then decodes from cached encoder outputs, whose passes start in the decoder. The carried
    encoder blocks must serve generate()'s encoder (or go), never outlive a step that wrote
    them, never push the decoding passes over the budget."""
    model = _tiny_t5()
    model.train()
    blocks = list(model.encoder.block) + list(model.decoder.block)
    budget = _hf_budget(blocks, kept=1)
    reference = reference_then_offload(model, device, policy=offtensor.Policy(layout="spread", vram_budget=budget))
    assert sum(r.kept for r in offtensor.summary(model).scopes) >= 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device)
    prompt = _tokens(device, length=5)
    for step in range(3):
        for _micro in range(2):
            src, tgt = _tokens(device), _tokens(device, length=6)
            loss = model(input_ids=src, labels=tgt).loss
            ref_loss = reference(input_ids=src, labels=tgt).loss
            torch.testing.assert_close(loss, ref_loss, **tol)
            loss.backward()
            ref_loss.backward()
            assert_all_scopes_offloaded(model)
        if step:
            assert _carried(model), offtensor.summary(model)
        if step == 1:  # generation right after a backward, before the step: carried blocks serve it
            torch.testing.assert_close(_rollout(model, prompt), _rollout(reference, prompt), rtol=0, atol=0)
            assert_all_scopes_offloaded(model)
        step_both(model, reference, opt, ref_opt, tol)
        assert _carried(model) == []  # the step wrote every block: none outlives it
        torch.testing.assert_close(_rollout(model, prompt), _rollout(reference, prompt), rtol=0, atol=0)
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)
    assert most_device_bytes[0] <= budget


# ---- compressed frozen masters ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("device", devices)
def test_carried_compressed_scopes_hold_dequantized_copies_across_steps(device, fmt, most_device_bytes):
    """Policy(frozen_format) and a budget: block matrices frozen and compressed; block 2's norm
    trains (an adapter inside a compressed scope), as do the input layer and head. Two micro-
    batches a step: the backward carries blocks 1 and 2 as dequantized copies; the step writes
    block 2's norm (released, reloaded and dequantized afresh), not block 1 (carried on). The
    reference is the resident model with the same compressed weights: a carried copy packed,
    stale or dequantized from the wrong rows is a wrong loss."""
    from offtensor.storage.compress import MIN_NUMEL, quantize_dequantize

    model = mlp_of_blocks(n_blocks=N_BLOCKS, hidden=64)
    model.blocks.requires_grad_(False)
    model.blocks[2].norm.requires_grad_(True)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.startswith("blocks.") and p.dim() >= 2 and p.numel() >= MIN_NUMEL:
                p.copy_(quantize_dequantize(p, fmt))
    reference.to(device)
    budget = _budget(model, kept=1)
    offload(model, device, policy=offtensor.Policy(frozen_format=fmt, layout="spread", vram_budget=budget))
    assert [r.kept for r in offtensor.summary(model).scopes] == [True] + [False] * (N_BLOCKS - 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    tol = tolerances(device)
    for step in range(3):
        for micro in range(2):
            before = _loads(model)
            _backward_both(model, reference, device)
            assert_all_scopes_offloaded(model)  # carried copies equal their dequantized masters
            if step or micro:
                assert _carried(model) == ["blocks.1", "blocks.2"]
            if step:  # carried into this forward (block 2 only within a step)
                loads = _loads(model)
                assert loads["blocks.1"] - before["blocks.1"] == 1
                assert loads["blocks.2"] - before["blocks.2"] == (1 if micro else 2)
        step_both(model, reference, opt, ref_opt, tol)
        assert _carried(model) == ["blocks.1"]  # the frozen one outlives the step
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)
    assert most_device_bytes[0] <= budget


# ---- interrupts ------------------------------------------------------------------------------


def _interrupt(*_):
    raise KeyboardInterrupt("injected")


#: where a KeyboardInterrupt lands, with blocks 1 and 2 carried from the last backward
INTERRUPTS = {
    # the next forward, before the carried block 1 computes
    "forward_before_carried": lambda m: m.blocks[1].register_forward_pre_hook(_interrupt),
    # inside the carried block 2's forward (block 1 used and released)
    "forward_inside_carried": lambda m: m.blocks[2].fc1.register_forward_pre_hook(_interrupt),
    # after the carried blocks computed, streamed ones ahead in the room
    "forward_after_carried": lambda m: m.blocks[4].register_forward_hook(_interrupt),
    # the backward, midway: nothing carried yet, streamed prefetches resident
    "backward_midway": lambda m: m.blocks[4].register_full_backward_hook(_interrupt),
    # the backward, with block 2 carried already and block 1's backward to come
    "backward_while_carrying": lambda m: m.blocks[1].register_full_backward_hook(_interrupt),
}


@pytest.mark.parametrize("where", list(INTERRUPTS))
@pytest.mark.parametrize("device", devices)
def test_an_interrupt_with_carried_scopes_leaks_nothing_and_training_goes_on(device, where, most_device_bytes):
    """Ctrl-C in a training loop whose last backward carried blocks 1 and 2: in the next forward
    (before, inside, after the carried blocks) or in a backward choosing what to carry. Then
    training goes on like the unwrapped model (same grads and steps), the weights' device bytes
    stay within the budget at every load, and a step leaves nothing on the device beyond the
    kept and (fresh) carried copies: a carried copy the interrupt orphaned would outlive its
    master's step (stale) or take room the next pass loads into."""
    model, reference, budget = _wrapped_with_one_kept(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    tol = tolerances(device)

    def train_step():
        x, y = random_batch(device)
        loss, ref_loss = F.mse_loss(model(x), y), F.mse_loss(reference(x), y)
        torch.testing.assert_close(loss, ref_loss, **tol)
        ref_loss.backward()
        loss.backward()
        step_both(model, reference, opt, ref_opt, tol)

    for _ in range(2):
        _backward_both(model, reference, device)
    assert _carried(model) == ["blocks.1", "blocks.2"]
    handle = INTERRUPTS[where](model)
    x, y = random_batch(device)
    with pytest.raises(KeyboardInterrupt, match="injected"):
        F.mse_loss(model(x), y).backward()
    handle.remove()
    # A KeyboardInterrupt runs no hook (FailureCheck in engine/failures.py): what the pass held stays
    # until the model's next call (its weights within the budget: most_device_bytes below).
    if where.startswith("forward"):
        # Step on the gradients of the backward before, equal on both sides: it writes the
        # masters of the block whose call the interrupt left (block 1 or 2) and of a carried
        # one, whose copies must not serve the next forward.
        assert_grads_match(model, reference, **tol)
        opt.step(), ref_opt.step()
    # The interrupted pass's gradients (a backward cut midway) are thrown away on both sides.
    opt.zero_grad(), ref_opt.zero_grad()
    for _ in range(3):
        train_step()
        assert_all_scopes_offloaded(model)
    assert_params_match(model, reference, **tol)
    assert most_device_bytes[0] <= budget


class _SkippableBranch(torch.nn.Module):
    """`x + a(x) + b(x)`, or without `b` while `use_b` is off (a layer the forward skips)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.a = torch.nn.Linear(hidden, hidden)
        self.b = torch.nn.Linear(hidden, hidden)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a(x) + (self.b(x) if self.use_b else 0)


@pytest.mark.parametrize("device", devices)
def test_old_gradients_no_gradient_takes_leave_the_kept_and_carried_scopes(device):
    """Accumulating into zeroed gradients (zero_grad(set_to_none=False)) fetches each one to
    the device with its scope; a parameter the forward did not use gets no gradient to add it
    to, and the kept scope (and the carried ones) held its copy past the backward, beyond the
    budget, until a write to their masters released them."""
    model = BlockStack([_SkippableBranch() for _ in range(6)], 8, 16, 4)
    reference = reference_then_offload(
        model, device, policy=offtensor.Policy(layout="spread", vram_budget=_budget(model, kept=1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        for m in (model, reference):
            for block in m.blocks:
                block.use_b = step != 1
        for _ in range(2):
            _backward_both(model, reference, device)
            assert_grads_match(model, reference, **tolerances(device))
            assert_all_scopes_offloaded(model)  # kept and carried scopes hold their weights only
        assert _carried(model) == ["blocks.1", "blocks.2"]
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=False), ref_opt.zero_grad(set_to_none=False)
    assert_params_match(model, reference, **tolerances(device))


# ---- inference loops -------------------------------------------------------------------------


def _infer_both(model, reference, x: torch.Tensor, **tolerance: float) -> torch.Tensor:
    """One inference call of each model (no grad), their outputs bit-identical (or within
    `tolerance`: after optimizer steps on CUDA, `tolerances`); the output."""
    with torch.no_grad():
        out = model(x)
        ref_out = reference(x)
    torch.testing.assert_close(out, ref_out, **(tolerance or {"rtol": 0, "atol": 0}))
    return out


def _carrying_in_eval(device: str, calls: int) -> tuple:
    """`_wrapped_with_one_kept`'s model and reference in eval mode after `calls` inference calls,
    the first learning the order, the others carrying blocks 1 and 2; and their input."""
    model, reference, budget = _wrapped_with_one_kept(device)
    model.eval(), reference.eval()
    x = random_batch(device)[0]
    for _ in range(calls):
        _infer_both(model, reference, x)
    assert _carried(model) == ["blocks.1", "blocks.2"]
    return model, reference, budget, x


def _head_loads(model) -> list[dict[str, int]]:
    """A list that gets, at each call of block 3, every scope's loads so far (from the engine,
    as summary() does): what the call loaded before it left the carried head."""
    from offtensor.engine.engine import find_engine

    seen: list[dict[str, int]] = []
    scopes = find_engine(model).scopes
    model.blocks[3].register_forward_pre_hook(lambda *_: seen.append({s.name: s.loads for s in scopes}))
    return seen


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("device", devices)
def test_an_inference_loop_carries_the_next_forwards_first_scopes_between_calls(device, mode, most_device_bytes):
    """Denoising steps, decoding: forwards without grad and no backward between. Once the order
    is learned, each call's last blocks load blocks 1 and 2 for the next call (carried, the room
    less one block), so between calls they are resident beside kept block 0, and the next call
    starts on them without loading (it loads them again at its end): before block 3 computes,
    the call has loaded nothing of them, where the first learned call loaded both. The model's
    mode does not matter: without grad no backward can follow."""
    model, reference, budget = _wrapped_with_one_kept(device)
    getattr(model, mode)(), getattr(reference, mode)()
    block = device_layout_bytes(model.blocks[0])
    at_block_3 = _head_loads(model)
    x = random_batch(device)[0]
    for call in range(5):
        before, on_demand = _loads(model), {n: r.loads_on_demand for n, r in _rows(model).items()}
        _infer_both(model, reference, x)
        head = {n: at_block_3[-1][n] - before[n] for n in ("blocks.1", "blocks.2")}
        loads = {n: c - before[n] for n, c in _loads(model).items()}
        if call == 0:  # learns the order: carries nothing
            assert _carried(model) == []
            continue
        assert _carried(model) == ["blocks.1", "blocks.2"]
        assert all(_rows(model)[n].state is not offtensor.ScopeState.OFFLOADED for n in ("blocks.1", "blocks.2"))
        assert offtensor.summary(model).device_bytes == 3 * block  # kept block 0, carried 1 and 2; nothing else
        assert head == ({"blocks.1": 1, "blocks.2": 1} if call == 1 else {"blocks.1": 0, "blocks.2": 0}), (call, head)
        assert loads["blocks.0"] == 0  # kept
        assert [loads[f"blocks.{i}"] for i in range(1, 3)] == ([2, 2] if call == 1 else [1, 1]), loads
        assert [loads[f"blocks.{i}"] for i in range(3, N_BLOCKS)] == [1] * (N_BLOCKS - 3), loads
        assert all(r.loads_on_demand == on_demand[n] for n, r in _rows(model).items())  # all prefetched
        assert_all_scopes_offloaded(model)  # carried copies equal their masters
    assert most_device_bytes[0] <= budget


def _sgd_step(m) -> None:
    for p in m.parameters():
        if p.grad is not None:
            with torch.no_grad():
                p.sub_(0.1 * p.grad)


WRITES_BETWEEN_INFERENCE_CALLS = {
    **WRITES_BYPASSING_THE_PARAMETER,
    # an optimizer step on gradients kept from one backward before the loop
    "optimizer_step": None,
}


@pytest.mark.parametrize("write", list(WRITES_BETWEEN_INFERENCE_CALLS))
@pytest.mark.parametrize("device", devices)
def test_a_write_between_inference_calls_reaches_the_carried_scope(device, write, most_device_bytes):
    """A carried copy waits between calls of an inference loop: a write to its masters in
    between (seen by an op or not, an optimizer step) must reach the next call's output, which
    equals the unwrapped model's bit for bit and differs from the call before."""
    model, reference, budget = _wrapped_with_one_kept(device)
    x = random_batch(device)[0]
    opts = None
    if write == "optimizer_step":
        _backward_both(model, reference, device)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    model.eval(), reference.eval()
    last = None
    for call in range(6):
        out = _infer_both(model, reference, x)
        if call == 0:  # learns the order: carries nothing, no write after it
            continue
        if call == 2:  # (later writes may repeat the same values: view_fill)
            assert not torch.equal(out, last)  # the write before it reached this call
        assert _carried(model) == ["blocks.1", "blocks.2"]
        assert_all_scopes_offloaded(model)
        last = out
        if opts is not None:
            for opt in opts:
                opt.step()
        else:
            with torch.no_grad():
                for m in (model, reference):
                    WRITES_BETWEEN_INFERENCE_CALLS[write](m.blocks[1].fc1.weight)
                    WRITES_BETWEEN_INFERENCE_CALLS[write](m.blocks[2].fc2.weight)
        if write in ("in_place", "optimizer_step"):  # ops on the parameter: released at once
            assert _carried(model) == []
    assert_params_match(model, reference, rtol=0, atol=0)
    assert most_device_bytes[0] <= budget


@pytest.mark.parametrize("device", devices)
def test_no_budget_holds_nothing_between_inference_calls(device):
    """Without Policy(vram_budget) an inference loop keeps the promise of minimal device memory:
    nothing is carried, nothing resident between calls."""
    model = mlp_of_blocks(n_blocks=4)
    reference = reference_then_offload(model, device)
    model.eval(), reference.eval()
    x = random_batch(device)[0]
    for _ in range(3):
        _infer_both(model, reference, x)
        assert _carried(model) == []
        assert offtensor.summary(model).device_bytes == 0
        assert_all_scopes_offloaded(model)


#: where an inference call raises, with blocks 1 and 2 carried by the call before
RAISES_IN_INFERENCE = {
    # before the carried blocks compute
    "before_carried": lambda m: m.blocks[1].register_forward_pre_hook(_raise),
    # in the last block, after its prefetch loaded blocks 1 and 2 for the next call
    "after_carrying": lambda m: m.blocks[N_BLOCKS - 1].register_forward_hook(_raise),
    # after every block, in the model's head (not wrapped), inside the model's forward
    "after_the_blocks": lambda m: m.head.register_forward_hook(_raise),
}


def _raise(*_):
    raise RuntimeError("boom")


@pytest.mark.parametrize("where", list(RAISES_IN_INFERENCE))
@pytest.mark.parametrize("device", devices)
def test_an_inference_call_that_raises_leaves_nothing_carried(device, where, most_device_bytes):
    """A forward that raises releases every streamed scope, those it carried for the next call
    too; the next calls carry again and match the unwrapped model."""
    model, reference, budget, x = _carrying_in_eval(device, calls=2)
    handle = RAISES_IN_INFERENCE[where](model)
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(x)
    handle.remove()
    assert _carried(model) == []
    assert [r.state for r in offtensor.summary(model).scopes][1:] == [offtensor.ScopeState.OFFLOADED] * (N_BLOCKS - 1)
    assert_all_scopes_offloaded(model)
    for _ in range(2):
        _infer_both(model, reference, x)
    assert _carried(model) == ["blocks.1", "blocks.2"]
    assert most_device_bytes[0] <= budget


@pytest.mark.parametrize("device", devices)
def test_unwrap_after_an_inference_call_that_carried_leaves_no_device_copies(device):
    """unwrap frees the carried copies with the kept one: no scope holds device memory, and the
    plain model computes what the reference does."""
    from offtensor.engine.engine import find_engine

    model, reference, _, x = _carrying_in_eval(device, calls=3)
    scopes = find_engine(model).scopes
    offtensor.unwrap(model)
    assert all(s.device.storage.nbytes() == 0 for s in scopes), [(s.name, s.device.storage.nbytes()) for s in scopes]
    assert not offtensor.is_wrapped(model)
    model.to(device)
    _infer_both(model, reference, x)


@pytest.mark.parametrize("checkpoint", [None, "reentrant"])
@pytest.mark.parametrize("device", devices)
def test_training_after_inference_calls_matches_the_unwrapped_model(device, checkpoint, most_device_bytes):
    """Rollouts, then training, then rollouts again: the training forward after inference calls
    starts on the blocks they carried, its backward and step match the unwrapped model's, and the
    step releases what it wrote; the inference after it sees the stepped weights. A training
    forward carries nothing ahead, reentrant checkpointing (a forward without grad) included."""
    model, reference, budget = _wrapped_with_one_kept(device)
    model.checkpoint = reference.checkpoint = checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    tol = tolerances(device)
    x = random_batch(device)[0]
    for _ in range(3):
        model.eval(), reference.eval()
        for _ in range(3):
            _infer_both(model, reference, x, **tol)  # (stepped on the CPU and on CUDA: tolerances)
        assert _carried(model) == ["blocks.1", "blocks.2"]
        model.train(), reference.train()
        for micro in range(2):
            carried_before = _carried(model)
            x_train, y = random_batch(device)
            out = model(x_train)
            if micro:  # a training forward carries nothing for the next one: its backward does
                assert _carried(model) == [] and carried_before == ["blocks.1", "blocks.2"]
            F.mse_loss(out, y).backward()
            F.mse_loss(reference(x_train), y).backward()
            assert_grads_match(model, reference, **tol)
            assert_all_scopes_offloaded(model)
        step_both(model, reference, opt, ref_opt, tol)
        assert _carried(model) == []  # the step wrote them
    assert_params_match(model, reference, **tol)
    assert most_device_bytes[0] <= budget
