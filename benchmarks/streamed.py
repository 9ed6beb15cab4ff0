"""What a peer copies to the device per timed iteration, counted rather than assumed: an
offtensor model's scope loads (offtensor.summary), and which parameters Policy(frozen_format=
"fp8") compresses (so dequantizes at each load)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Policy(frozen_format=...) compresses frozen matrices of at least this many elements ("small
# tensors stay as they are"); the DiT benchmark's fp8 reference and its dequantization count follow
# it, and tests/benchmarks/test_bench.py checks that against the values the parameters report.
FP8_MIN_NUMEL = 4096


def fp8_compressed(p: torch.Tensor) -> bool:
    """Whether Policy(frozen_format="fp8") stores this offloaded (or about to be) parameter
    compressed: a frozen floating-point matrix of 2-byte or larger elements, not too small."""
    return (not p.requires_grad and p.is_floating_point() and p.dim() >= 2 and p.element_size() >= 2
            and p.numel() >= FP8_MIN_NUMEL)


class StreamCounter:
    """What a peer copies to the device in the timed iterations: `start()` before them,
    `per_iteration(n)` after n of them: (bytes, elements dequantized on the device)."""

    source = ""  # how it is counted, in words

    def start(self) -> None:
        raise NotImplementedError

    def per_iteration(self, iterations: int) -> tuple[int, int]:
        raise NotImplementedError


class LoadCounter(StreamCounter):
    """An offtensor model's loads, counted by offtensor: each scope's `ScopeSummary.loads` since
    `start()` times its host bytes (what one load copies: the masters, fp8 values and scales
    for compressed ones); with `compressed`, each load also dequantizes its fp8 matrices."""

    source = "counted: offtensor.summary loads x each scope's host bytes"

    def __init__(self, model: nn.Module, compressed: bool) -> None:
        import offtensor

        self.model = model
        self.dequantized: dict[str, int] = {}  # scope -> elements one load dequantizes
        for s in self._scopes():
            try:
                module = model.get_submodule(s.name)
            except AttributeError:  # a split scope of a module's own parameters: not fp8 here
                continue
            self.dequantized[s.name] = sum(p.numel() for p in module.parameters()
                                           if compressed and isinstance(p, offtensor.OffloadedParameter)
                                           and fp8_compressed(p))
        self._loads: dict[str, int] = {}

    def _scopes(self) -> list[Any]:
        import offtensor

        return offtensor.summary(self.model).scopes

    def start(self) -> None:
        self._loads = {s.name: s.loads for s in self._scopes()}

    def per_iteration(self, iterations: int) -> tuple[int, int]:
        moved = elements = 0
        for s in self._scopes():
            n = s.loads - self._loads.get(s.name, 0)
            moved += n * s.host_bytes
            elements += n * self.dequantized.get(s.name, 0)
        return moved // max(iterations, 1), elements // max(iterations, 1)
