"""What a backward_and_step call did when: `OverlapReport`, and the `Timeline` that fills it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OverlapReport:
    """What `backward_and_step` did when, in seconds since it was called: for tuning and for
    the benchmark's timeline. `backward_and_step` returns it before the deferred steps are done
    (Note [deferred steps]); `wait()` returns it complete."""

    backward_s: float = 0.0  # loss.backward() returned (all gradients on the host)
    total_s: float = 0.0  # every parameter stepped (0.0 until then)
    # (scope, handed to the worker, its first piece started (its gradients had landed), its
    # last piece stepped)
    scopes: list[tuple[str, float, float, float]] = field(default_factory=list)
    rest_params: int = 0  # parameters stepped after backward, on the calling thread
    pieces: int = 0  # optimizer steps the worker ran (each on part of a scope)
    early_pieces: int = 0  # pieces handed over as their gradients were copied, not at their scope's
    # end of backward (Note [early handover])
    worker_busy_s: float = 0.0  # time the worker spent stepping (compare: the plain CPU step)
    all_thread_pieces: int = 0  # pieces stepped on every thread, a thread waiting (Note [worker threads])
    device_pieces: int = 0  # pieces stepped on the device (Note [device steps] in optim/device_steps.py)
    device_steps_off: str = ""  # why device_share was given but every piece stepped on the host
    # With max_grad_norm=: the total norm of the gradients before clipping, as clip_grad_norm_
    # returns it (Note [clipping in the overlapped step] in optim/clipping.py); else None
    grad_norm: Any = None
    step_skipped: bool = False  # with scaler=: inf or NaN found, no parameter stepped (scaler.step's skip)
    _stepper: Any = field(default=None, repr=False, compare=False)

    def wait(self) -> OverlapReport:
        """Block until every step of this call is done; raise the optimizer's error if it failed."""
        if self._stepper is not None:
            self._stepper.wait()
        return self


class Timeline:
    """When each scope was handed to the worker, its first piece began and its last was stepped,
    in seconds since the call; `OverlapReport.scopes` once the call is done."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._scopes: dict[str, list[float]] = {}  # scope -> [handed, began, stepped]

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def handed(self, scope: str) -> None:
        self._scopes.setdefault(scope, [self.elapsed(), 0.0, 0.0])

    def began(self, scope: str) -> None:
        times = self._scopes[scope]
        if not times[1]:
            times[1] = self.elapsed()

    def stepped(self, scope: str) -> None:
        """Its latest piece was stepped (for a piece on the device: queued there)."""
        self._scopes[scope][2] = self.elapsed()

    def fill(self, report: OverlapReport, rest_done: float) -> None:
        """The report's scopes and total, the rest having been stepped at `rest_done`."""
        report.scopes = [(name, *t) for name, t in self._scopes.items()]  # type: ignore[misc]
        report.total_s = max(rest_done, max((t[2] for t in self._scopes.values()), default=0.0))
