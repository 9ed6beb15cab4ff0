"""A wrapped model driven by the usual tooling around a training loop: data loading with worker
processes, Hugging Face's Trainer, accelerate, PEFT and generate(), checked against the same
tooling driving the unwrapped model (all on the CPU, tiny random models, nothing downloaded).
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import (
    assert_params_match,
    host,
    mlp_and_reference,
    mlp_of_blocks,
    offload,
    random_batch,
    step_both,
    unwrapped_reference,
)

import offtensor


class _ReadsAWeight(torch.utils.data.Dataset):
    """Each item is the sum of a wrapped parameter as the worker process sees it."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        self.weight = weight

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.weight.detach().sum()


def test_data_loader_forked_while_deferred_steps_run_sees_the_stepped_weights():
    # DataLoader workers fork at iter(); the optimizer worker thread of backward_and_step does
    # not exist in the child, so a child waiting for its pending steps would wait forever.
    model, _ = mlp_and_reference("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.3))  # still stepping at the fork
    x, y = random_batch("cpu")
    loss = torch.nn.functional.mse_loss(model(x), y)
    offtensor.backward_and_step(loss, optimizer, zero_grad=True)
    weight = model.blocks[0].fc1.weight
    loader = torch.utils.data.DataLoader(_ReadsAWeight(weight), batch_size=1, num_workers=1,
                                         multiprocessing_context="fork", timeout=20)

    seen = torch.cat(list(loader))

    offtensor.wait_for_steps()
    torch.testing.assert_close(seen, host(weight).sum().expand(2), rtol=0, atol=0)


def test_backward_and_step_refuses_an_accelerate_optimizer_wrapper_naming_the_fix():
    # A view of the wrapper wrote its piece's groups into the wrapped optimizer: later steps
    # stepped only that piece. The message says what to pass instead.
    accelerate = pytest.importorskip("accelerate")
    model, _ = mlp_and_reference("cpu")
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = random_batch("cpu")
    loss = torch.nn.functional.mse_loss(model(x), y)

    with pytest.raises(TypeError, match=r"AcceleratedOptimizer, a wrapper around AdamW.*optimizer\.optimizer"):
        offtensor.backward_and_step(loss, optimizer)

    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_accelerate_accumulation_with_backward_and_step_on_the_wrapped_optimizer_matches_unwrapped():
    accelerate = pytest.importorskip("accelerate")
    model, reference = mlp_and_reference("cpu")
    batches = [random_batch("cpu") for _ in range(4)]

    def train(m: torch.nn.Module, overlap: bool) -> None:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        m, optimizer = accelerator.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
        for x, y in batches:
            with accelerator.accumulate(m):
                loss = torch.nn.functional.mse_loss(m(x), y)
                if overlap and accelerator.sync_gradients:
                    offtensor.backward_and_step(loss / 2, optimizer.optimizer, zero_grad=True)
                else:
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()

    train(reference, overlap=False)
    train(model, overlap=True)

    offtensor.wait_for_steps()
    assert_params_match(model, reference, rtol=0, atol=0)


def _cast_by_hand(reference: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What Policy(compute_dtype=torch.bfloat16) computes: each fp32 weight cast for the op."""
    params = {n: p.to(torch.bfloat16) for n, p in reference.named_parameters()}
    return torch.func.functional_call(reference, params, (x,))


@pytest.mark.parametrize("sent", ["model", "state_dict"])
def test_sent_to_another_process_a_wrapped_model_keeps_training_on_its_stepped_masters(sent):
    # Spawned DataLoader workers get the dataset (here holding the model), and a
    # torch.multiprocessing queue its items (a state dict for a saving process), through
    # ForkingPickler, which moves each tensor's storage into shared memory. A master moved so
    # left the scope's host buffer, which converting loads copy from: every load after the next
    # step computed with the weights as they were when sent.
    from multiprocessing.reduction import ForkingPickler

    model = mlp_of_blocks()
    reference = unwrapped_reference(model, "cpu")
    offload(model, "cpu", lambda name, m: name in ("input", "head", "blocks.0", "blocks.1", "blocks.2"),
            policy=offtensor.Policy(compute_dtype=torch.bfloat16))
    copied = ForkingPickler.loads(ForkingPickler.dumps(model if sent == "model" else model.state_dict()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in [random_batch("cpu") for _ in range(3)]:
        x = x.to(torch.bfloat16)
        out, ref_out = model(x), _cast_by_hand(reference, x)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        torch.nn.functional.mse_loss(ref_out.float(), y).backward()
        step_both(model, reference, opt, ref_opt, {"rtol": 0, "atol": 0})

    assert_params_match(model, reference, rtol=0, atol=0)
    if sent == "model":  # the other process's copy is a plain model
        assert all(type(p) is torch.nn.Parameter for p in copied.parameters())
        assert not offtensor.is_wrapped(copied)
