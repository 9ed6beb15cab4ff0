"""The calls of a scope's module, counted: `CallCounts` (Note [call counts])."""

from __future__ import annotations

# Note [call counts]
# A scope counts the calls of its module's forward four ways, in one object that only its own
# methods change: those in progress now (`running`, a recompute in backward included), those of
# the current forward pass (`this_pass`: a shared module, several), and of the calls that can add
# to a gradient (grad mode on, or an input requiring grad), those since the last backward ended
# (`grad_since_backward`, Note [early handover] in optim/step.py) and those of the current pass
# (`grad_this_pass`, Note [calls inside a checkpointed region] in scopes/grad_calls.py). The engine
# forgets the running calls when a pass starts, a backward ends or a forward raised, while a call
# may still be on the stack: that call's end then finds nothing to take from `running`. The
# forgotten calls are counted (`_forgotten`), so that the end of a call that returned is checked
# against a start: it asserts instead of hiding behind a clamp at zero. A call that failed may
# never have started: its pre-forward hook refused it (an input on another device) before the
# engine counted it, and the forward hook (`always_call`) or the next call's FailureCheck (an
# interrupt) ends it all the same; such an end takes what it finds in `running` and checks
# nothing.


class CallCounts:
    """The calls of one scope's module's forward (Note [call counts])."""

    __slots__ = ("running", "this_pass", "grad_since_backward", "grad_this_pass", "_forgotten")

    def __init__(self) -> None:
        self.running = 0  # in progress now (a recompute in backward included)
        self.this_pass = 0  # in the current forward pass (a shared module: several)
        # That can add to a gradient, since the last backward ended: above 1, a backward may see
        # several contributions per parameter (shared modules; several forwards before one backward).
        self.grad_since_backward = 0
        self.grad_this_pass = 0  # of those, the ones in the current pass
        self._forgotten = 0  # running calls forgotten by `forget_running` that have not ended

    def started(self) -> None:
        self.running += 1

    def counted_in_pass(self) -> None:
        """The call that started is one of the forward pass (not a recompute in backward)."""
        self.this_pass += 1

    def started_in_pass(self, *, grad: bool) -> None:
        """A call of the forward pass starts, with the pass already under way (`started`,
        `counted_in_pass` and, if `grad`, `grad_call` in one: Note [steady calls] in
        engine/engine.py)."""
        self.running += 1
        self.this_pass += 1
        if grad:
            self.grad_since_backward += 1
            self.grad_this_pass += 1

    def ended(self, n: int = 1, *, failed: bool = False) -> None:
        """`n` calls ended; `failed`: they raised or an interrupt abandoned them, maybe before
        they started (Note [call counts])."""
        counted = min(n, self.running)
        self.running -= counted
        if not failed:
            self._forgotten -= n - counted  # forgotten while running
            assert self._forgotten >= 0, "a call of a scope returned that never started"

    def forget_running(self) -> None:
        """No call is running any more as far as the engine is concerned."""
        self._forgotten += self.running
        self.running = 0

    def new_pass(self) -> None:
        self.this_pass = 0

    def grad_call(self) -> None:
        """The call starting now can add to a gradient."""
        self.grad_since_backward += 1
        self.grad_this_pass += 1

    def grad_pass_started(self) -> None:
        self.grad_this_pass = 0

    def backward_ended(self, *, keep_since: bool) -> None:
        """The outermost backward ended; `keep_since`: a graph it built still holds the calls
        (Note [calls a built graph still holds] in scopes/grad_calls.py)."""
        if not keep_since:
            self.grad_since_backward = 0
        self.grad_this_pass = 0

    def grad_pass_failed(self) -> None:
        """The pass raised: its graph is gone, and with it what its calls counted."""
        self.grad_since_backward -= self.grad_this_pass
        assert self.grad_since_backward >= 0, "grad calls of a pass counted twice"
        self.grad_this_pass = 0
