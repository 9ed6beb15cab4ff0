"""The model of tests/test_host_tier.py, and the run whose host memory it measures in a fresh
process: `python host_tier_child.py CHECKPOINT N H BUDGET STEPS OUT` loads the model from
CHECKPOINT with Policy(host_budget=BUDGET), trains its adapters and head for STEPS steps, saves
each step's output and gradients to OUT and prints its peak RSS growth as JSON."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import offtensor


class Block(nn.Module):
    """A frozen MLP block (offloaded) with a small trainable adapter beside it (not offloaded)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)
        self.adapter_a = nn.Linear(h, 4, bias=False)
        self.adapter_b = nn.Linear(4, h, bias=False)
        nn.init.normal_(self.adapter_b.weight, std=1e-3)  # small, as LoRA starts near the base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.02 * self.down(torch.relu(self.up(self.norm(x)))) + self.adapter_b(self.adapter_a(x))


class Net(nn.Module):
    def __init__(self, n: int, h: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def freeze_base(model: Net) -> Net:
    for block in model.blocks:
        for module in (block.norm, block.up, block.down):
            module.requires_grad_(False)
    return model


def train(model: nn.Module, steps: int, h: int) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Each step's output and the trainable parameters' gradients, stepping them with SGD."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in trainable], lr=1e-2)
    results = []
    for step in range(steps):
        x = torch.randn(4, h, generator=torch.Generator().manual_seed(step))
        out = model(x)
        out.square().mean().backward()
        results.append((out.detach().clone(), {n: p.grad.clone() for n, p in trainable}))
        optimizer.step()
        optimizer.zero_grad()
    return results


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(path: str, n: int, h: int, budget: int, steps: int, out: str) -> None:
    with torch.device("meta"):
        model = freeze_base(Net(n, h))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current RSS
    before = _kib("VmRSS:")
    offtensor.load(model, path, device="cpu",
                   policy=offtensor.Policy(host_budget=budget, param_filter=offtensor.frozen_only))
    results = train(model, steps, h)
    peak = _kib("VmHWM:")
    summary = offtensor.summary(model)
    engine = offtensor.engine.engine.find_engine(model)
    torch.save(results, out)
    print(json.dumps({
        "growth": peak - before, "host": summary.host_bytes, "staging": summary.staging_bytes,
        "in_files": sum(s.file_bytes for s in summary.scopes), "read": summary.file_bytes_read,
        "device_scope": max(s.device.nbytes for s in engine.scopes), "prefetch": engine.policy.prefetch}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
