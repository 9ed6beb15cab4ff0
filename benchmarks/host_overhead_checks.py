"""What the host-overhead benchmark checks of each peer against the plain model
(benchmarks/host_overhead.py): outputs and grads at its first step, weights after its steps."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

NO_GRADS = "keeps no grads"  # accelerate's cpu_offload: the blocks' parameters hold none after backward


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare(out: torch.Tensor, got: dict[str, torch.Tensor] | None, ref: torch.Tensor,
            ref_grads: dict[str, torch.Tensor] | None, blocks: set[str]) -> str:
    """'=' when the output (and the grads) equal the reference's bit for bit; 'no grads' when
    the grads outside the blocks do and the blocks' parameters have none (accelerate's hooks
    replace them at each call); else what differs."""
    if not torch.equal(out.detach().cpu(), ref.detach().cpu()):
        return f"FAIL output max|d| {(out.detach().cpu() - ref.detach().cpu()).abs().max().item():.2g}"
    if ref_grads is None or got is None:
        return "="
    bad = [n for n in set(ref_grads) | set(got)
           if n not in got or n not in ref_grads or not torch.equal(got[n].cpu(), ref_grads[n].cpu())]
    if bad and not set(got) & blocks and set(bad) <= blocks:
        return NO_GRADS
    return f"FAIL grads of {sorted(bad)[:3]}" if bad else "="


# Near the plain model's weights after optimizer steps taken on another device: the plain model on
# a GPU steps there (torch's foreach AdamW), offtensor on the host masters, and the two round
# differently. The tolerances are torch.testing's for float32.
CLOSE = "~"
CLOSE_MEANS = "the weights after optimizer steps within rounding of the plain model's, which steps on the device"


def compare_weights(model: nn.Module, reference: nn.Module, *, exact: bool) -> str:
    """'=' when every parameter equals the reference's bit for bit; CLOSE, not `exact`, when
    within torch.testing's tolerances; else a FAIL."""
    pairs = [(p.detach().cpu(), q.detach().cpu())
             for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
    if all(torch.equal(p, q) for p, q in pairs):
        return "="
    if not exact and all(torch.allclose(p, q, rtol=1.3e-6, atol=1e-5) for p, q in pairs):
        return CLOSE
    return "FAIL weights after the steps"


def counted(step: Callable[[], torch.Tensor], taken: dict[str, int], name: str) -> Callable[[], torch.Tensor]:
    """`step`, counting its calls in `taken[name]`."""

    def counted_step() -> torch.Tensor:
        taken[name] += 1
        return step()

    return counted_step
