"""Which thread a wrapped model's forward belongs to: one forward at a time per wrapped model."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..dispatch.slot import in_backward


class ThreadOwner:
    """The thread of a wrapped model's latest forward, which owns its engine while a forward or
    backward runs: the scopes' device copies, call counts and learned order are shared, so a
    second thread's forward would corrupt the first's."""

    def __init__(self, busy: Callable[[], bool]) -> None:
        self._busy = busy  # a forward or backward of the model is in progress
        # The thread of the latest forward; read directly by the steady path (Note [steady calls] in
        # engine/engine.py)
        self.owner: int | None = None

    def check(self, where: str, name: str | None = None) -> None:
        """Take the engine for this thread; refuse, before any state changes, while another
        thread's forward or backward is in progress (its post-forward hooks then do nothing:
        `foreign`). The error names `where`, followed by `name` quoted (formatted only then)."""
        thread = threading.get_ident()
        if self.owner == thread:
            return
        if name is not None:
            where = f"{where} {name!r}"
        if self.owner is not None and self._busy():
            raise RuntimeError(
                f"offtensor: {where} was called from thread {thread} while thread {self.owner} "
                "is in a forward or backward of the same wrapped model. A wrapped model runs one forward (and "
                "backward) at a time: use one wrapped model per thread, or serialize the calls "
                "with a lock"
            )
        self.owner = thread

    def run_by_another(self) -> bool:
        """The model's latest forward ran on another thread than the caller's, which owns what
        it left on the device (Note [no_offload in several threads] in model/controls.py)."""
        return self.owner is not None and self.owner != threading.get_ident()

    def foreign(self) -> bool:
        """A forward hook runs on another thread than the forward in progress (`check` refused
        its call). Backward runs on autograd's threads: never foreign."""
        return self.owner is not None and threading.get_ident() != self.owner and not in_backward()
