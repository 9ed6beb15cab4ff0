"""A wrapped model driven by the usual tooling around a training loop: data loading with worker
processes, Hugging Face's Trainer, accelerate, PEFT and generate(), checked against the same
tooling driving the unwrapped model (all on the CPU, tiny random models, nothing downloaded).
"""

from __future__ import annotations

import time

import torch
from conftest import host, mlp_and_reference, random_batch

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
