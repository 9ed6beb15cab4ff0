"""Which calls of a module failed, and which an interrupt left: FailureCheck, for the forward
hooks of scopes and models (engine/hooks.py, model/quantized.py)."""

from __future__ import annotations

import sys
import threading
from types import CodeType, FrameType


class FailureCheck:
    """Tells a forward hook registered with `always_call=True` whether the forward raised, and
    a forward pre-hook whether earlier calls never ended.

    PyTorch runs such a hook inside its `except` block when the forward raises, but
    `sys.exc_info()` alone cannot tell: a module called while its caller handles an exception
    (a retry after an out-of-memory error, inside `except`) sees that exception there too. So
    the forward pre-hook records the exception being handled when the call starts (`enter`),
    and the call failed if another one is being handled when it ends (`failed`).

    PyTorch catches only `Exception` there: a call left by a `KeyboardInterrupt` (Ctrl-C in a
    notebook) or `SystemExit` runs no hook, and its record stays. So each record also holds the
    frame of the module call running the hooks (the first frame outside offtensor: PyTorch's
    `_call_impl`), which lives exactly as long as the call; `enter` drops the records of this
    thread whose frame is not on the stack any more, and says how many. (A record kept this way
    keeps that frame, and the tensors it refers to, until the module's next call; the
    interrupt's own traceback holds them as well.)"""

    def __init__(self) -> None:
        # One per call in progress: (thread, frame of the call, exception handled at entry); read
        # directly, empty or not, by the steady path (Note [steady calls] in engine/engine.py).
        self.records: list[tuple[int, FrameType | None, BaseException | None]] = []

    def enter(self, ours: int = 0) -> int:
        """Record a call; return how many earlier calls were found to have been interrupted.
        `ours`: how many frames, the caller's first and then outwards, are surely offtensor's:
        the walk starts past them (Note [the module call's frame])."""
        frame = _outside_offtensor(sys._getframe(1 + ours))
        interrupted = self.drop_interrupted(frame) if self.records else 0  # none recorded: none to drop
        self.records.append((threading.get_ident(), frame, sys.exc_info()[1]))
        return interrupted

    def drop_interrupted(self, frame: FrameType | None = None) -> int:
        """Forget this thread's calls whose frame is no longer on the stack (seen from `frame`,
        default the caller's); return how many. Dropping a record lets its frame go, and with
        it whatever that frame still holds: torch.utils.checkpoint's suspended generator keeps
        its saved-tensor hooks pushed until it is collected, and collected inside the next
        checkpointed call it would pop that call's hooks instead (the model's forward therefore
        drops every scope's interrupted calls before anything else runs)."""
        thread = threading.get_ident()
        for c in self.records:  # a loop, not any(): asked at each call of a scope
            if c[0] == thread:
                break
        else:
            return 0  # nothing to check: no stack walk
        if frame is None:
            frame = _outside_offtensor(sys._getframe(1))
        on_stack, f = set(), frame
        while f is not None:
            on_stack.add(id(f))
            f = f.f_back
        live = [c for c in self.records if c[0] != thread or id(c[1]) in on_stack]
        interrupted = len(self.records) - len(live)
        self.records = live
        return interrupted


    def failed(self) -> bool:
        thread = threading.get_ident()
        at_entry = None
        for i in range(len(self.records) - 1, -1, -1):
            if self.records[i][0] == thread:
                at_entry = self.records.pop(i)[2]
                break
        current = sys.exc_info()[1]
        return current is not None and current is not at_entry


# Note [the module call's frame]
# Each call's record holds the frame of the module call, found by walking out from the hook's
# frame. Each frame the walk passes becomes a frame object, which its function's return then
# has to tear down: for the few frames of offtensor's own hook path that costs several times the
# rest of the record, at every call of a scope. So a caller that knows its own frame and the
# next ones out to be offtensor's (ScopeHooks' forward pre-hook: itself, its caller and the `Hook`
# that torch calls) says how many, and the walk starts past them: `sys._getframe(n)` makes a
# frame object of that frame only. Too small a count costs only the walk; one past an outside
# frame would record a frame that outlives the call, so each caller counts only frames that
# every path to it has.


def _outside_offtensor(frame: FrameType | None) -> FrameType | None:
    """The first frame, from `frame` outwards, that is not offtensor's: the module call's."""
    while frame is not None:
        code = frame.f_code  # told apart by its code, each code asked once: at each call of a scope
        key = id(code)  # not the code: hashing one hashes its constants, nested code included
        if key in _THEIRS:
            return frame
        if key not in _OURS:
            if not frame.f_globals.get("__name__", "").startswith("offtensor."):
                _remember(_THEIRS, code)
                return frame
            _remember(_OURS, code)
        frame = frame.f_back
    return frame


# The code objects _outside_offtensor found to be offtensor's, and not, by id (each kept
# alive by its entry, so that its id names it): a few each (the hooks' own, PyTorch's module
# call); bounded for code compiled while the program runs (exec).
_OURS: dict[int, CodeType] = {}
_THEIRS: dict[int, CodeType] = {}


def _remember(codes: dict[int, CodeType], code: CodeType) -> None:
    if len(codes) >= 1024:
        codes.clear()
    codes[id(code)] = code
