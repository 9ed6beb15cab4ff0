"""The timed layout's measuring and choosing: one pass measured, then the kept scopes chosen from
its times (Note [a timed layout] in budget/layout.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..api import Policy
from ..scopes.grad_calls import trainable
from ..scopes.scope import Scope
from ..scopes.streams import Streams
from ..storage.staging import StagingRing
from .layout import (
    Measuring,
    PassTimer,
    Prediction,
    ScopeCost,
    auto_margin,
    choose,
    copy_ms_per_byte,
    spare_device_bytes,
)


class TimedLayout:
    """Measures the second pass of one wrapped model and, once it is over, chooses the scopes its
    VRAM budget keeps from the measured times (Note [a timed layout] in budget/layout.py)."""

    def __init__(self, scopes: list[Scope], policy: Policy, device: torch.device, streams: Streams, *,
                 idle: Callable[[], bool], lockstep: Callable[[], bool]) -> None:
        """`idle`: no call runs and no_offload() holds nothing, so what is kept may change;
        `lockstep`: ranks load together (data parallel), so every rank must keep the same scopes."""
        self.scopes = scopes
        self.policy = policy
        self.device = device
        self.streams = streams
        self.timer = PassTimer(device)
        self._idle = idle
        self._lockstep = lockstep
        self._reads_before = (0, 0.0)  # the staging ring's read_stats() when the measured pass began

    @property
    def measuring(self) -> bool:
        return self.timer.state is Measuring.MEASURING

    @property
    def chosen(self) -> bool:
        """The kept set is chosen: nothing more is measured, and the passes' starts and the
        scopes' calls have nothing to tell the layout."""
        return self.timer.state is Measuring.DONE

    def pass_failed(self) -> None:
        if self.timer.state is Measuring.MEASURING:
            self.timer.restart()  # a failed pass measures nothing: the next one is measured

    def between_passes(self, order: list[Scope], backward_order: Callable[[], list[Scope]], ring: StagingRing | None,
                       budget: int) -> tuple[set[Scope], int, Prediction] | None:
        """The model's forward starts: start measuring this pass, or, once one was measured,
        return what to keep within what budget, and the step it predicts (None: not now)."""
        timer = self.timer
        if timer.state is Measuring.DONE:
            return None
        self.advance(order, ring)
        if timer.state is not Measuring.MEASURED or not self._idle():
            return None
        timer.state = Measuring.DONE
        if self._lockstep():
            return None
        forward, backward = self.indices(order, backward_order)
        costs = self.costs(ring)
        budget = self.sized(budget)
        kept, prediction = choose(costs, forward, backward, budget, self.policy.prefetch)
        return {self.scopes[i] for i in kept}, budget, prediction

    def advance(self, order: list[Scope], ring: StagingRing | None) -> None:
        """The model's forward starts: measure this pass once one has run (the order is known,
        cold kernels are paid); the pass measured before it (and its backward) is over."""
        timer = self.timer
        if timer.state is Measuring.WAITING:
            if order:
                timer.state = Measuring.MEASURING
                self._reads_before = ring.read_stats() if ring is not None else (0, 0.0)
        elif timer.state is Measuring.MEASURING:
            timer.state = Measuring.MEASURED

    def indices(self, order: list[Scope], backward_order: Callable[[], list[Scope]]) -> tuple[list[int], list[int]]:
        """The measured forward and backward orders as indices into `scopes` (and `costs`)."""
        index = {scope: i for i, scope in enumerate(self.scopes)}
        backward = [index[s] for s in backward_order()] if self.timer.saw_backward else []
        return [index[s] for s in order], backward

    def costs(self, ring: StagingRing | None) -> list[ScopeCost]:
        """What each scope costs a pass, from the measured times and one timed copy."""
        timer = self.timer
        largest = max(self.scopes, key=lambda s: s.masters.nbytes)
        # Host memory of the kind its loads copy from (Note [master sources] in scopes/sources.py).
        per_byte = copy_ms_per_byte(largest.source.sample(largest), self.device, self.streams.h2d())
        read_per_byte = self._read_ms_per_byte(ring)
        return [ScopeCost(timer.total_ms(s, "forward"), timer.total_ms(s, "backward"),
                          s.source.load_ms(s, per_byte, read_per_byte),
                          s.device.nbytes, s.block, copied_when_kept=timer.saw_backward and trainable(s))
                for s in self.scopes]

    def sized(self, budget: int) -> int:
        """The budget, under vram_budget="auto" raised by the memory the measured step left unused."""
        if self.policy.vram_budget == "auto":
            spare = spare_device_bytes(self.device)
            if spare is not None:
                return budget + max(0, spare - auto_margin(self.device))
        return budget

    def _read_ms_per_byte(self, ring: StagingRing | None) -> float:
        """The drive's time per byte read into the staging ring: in the measured pass, else since
        wrap; 0.0 without reads."""
        if ring is None:
            return 0.0
        nbytes, seconds = ring.read_stats()
        before_bytes, before_seconds = self._reads_before
        if nbytes > before_bytes:
            nbytes, seconds = nbytes - before_bytes, seconds - before_seconds
        return seconds * 1e3 / nbytes if nbytes else 0.0
