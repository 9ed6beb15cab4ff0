"""A test mode that fails any aten op that computes on an offloaded parameter's host master.

# Why
On CUDA, an op of a scope's forward or backward must see the scope's device copy
(``slot.device_leaf``) or a temporary device copy, never the host master: an op that gets the
master (Falcon's ``input @ self.weight.T`` while tensor properties bypassed materialisation;
Mamba's mixer reading ``self.conv1d.weight`` of a child scope whose forward never runs) either
fails with a device mismatch or silently computes on the CPU. With ``device="cpu"`` (how CI
runs) the master and the copies are on the same device, so those bugs are invisible.
``MasterGuard`` makes them visible on the CPU: while it is active, an aten op that receives a
tensor whose memory lies in a master's storage raises ``AssertionError`` naming the op and the
parameter.

# Use
Only around forward and backward::

    with MasterGuard(model):
        out = model(x)
        loss_fn(out).backward()

Optimizer steps, ``zero_grad``, ``state_dict``, ``unwrap``, ``copy.deepcopy`` legitimately act
on masters: keep them outside. (Ops run by offtensor's own optimizer steps, on its worker thread
or on this one, are not checked either: dispatch modes are thread-local, and the guard skips ops
while offtensor's ``worker_state.active`` flag is set or an optimizer view of its
``step_subset`` is stepping on this thread.) On CUDA the autograd engine
runs backward on a device thread; the mode follows it there through autograd's thread-local
state on recent PyTorch, and if it does not, backward is simply unchecked.

# What counts as master storage
For each wrapped model's engine: every scope's flat host buffer ``scope.masters.flat`` (address
range ``[data_ptr, data_ptr + nbytes)``) and each ``slot.param``'s own storage (in case masters
get storages of their own). A tensor argument is "on a master" when its ``data_ptr()`` falls in
one of those ranges; the message maps the address to the slot's qualified name.

# What is allowed on master storage
- ``aten.copy_`` with the master as the *source* (``args[1]``): offtensor's loads
  (``device.flat.copy_(masters.flat)``, ``device_view.copy_(param)``) and its CUDA temporary
  copies. A master as the *destination* (a write) inside forward/backward is flagged.
- ``aten.slice`` of a scope's ``masters.flat`` itself (the tensor object, not a parameter): a run
  of the host buffer that a load copies from (Note [load plans] in offtensor/scopes/loading.py);
  ``aten.select``, ``aten.unbind`` and ``aten.slice`` of a slot's ``master`` (offtensor's plain
  tensor over the master's bytes, not the parameter): the rows of a routed expert a load copies
  (Note [routed experts] in offtensor/scopes/experts.py).
- ``aten._to_copy``: offtensor's CPU temporary copy (``master.detach().to(copy=True)``). When the
  guarded engine computes on CUDA, a ``_to_copy`` whose result stays on the CPU is flagged (that
  is a user's ``w.T.float()``; offtensor copies to the device with ``copy_``).
- ``aten.detach``, ``aten.alias``, ``aten.lift_fresh``: aliases without computation (whatever
  then computes on the alias is checked).
- metadata queries and copies out that offtensor itself does (``is_pinned``, ``_pin_memory``,
  ``sym_size`` and the like, ``_local_scalar_dense`` for ``p.item()``, which offtensor answers
  from the master on purpose).
- ``aten.clone`` is NOT allowed: offtensor never clones a master inside forward/backward (its
  clones are in ``unwrap``/``__deepcopy__``/pickling), and a user's clone of a master (``w.T
  .contiguous()``, ``w.data.clone()``) gives a host tensor, which on CUDA computes on the wrong
  device. Every view op (``view``, ``t``, ``permute``, ``transpose``, ``slice``, ``expand``,
  ``as_strided`` ...) is flagged too: a view of a master inside forward is exactly how the
  Falcon ``.T`` bug looks.

Known gap: on a CPU engine a user's ``w.data.float()`` (a ``_to_copy`` of the whole master, as
offtensor's own CPU temporary copy is) passes; ``.data`` itself runs no aten op.

# Scope of the check
The guard checks every op while it is active, whoever runs it. Inside the wrapped model's forward
or backward offtensor never hands an op the master (in its scope: the device copy; outside it:
a temporary copy, ``OpAccess.materialize``). Outside them, with no operand on an
accelerator and no gradient needed (a user's functional call after the forward, an optimizer
step, ``state_dict``), offtensor acts on the master by design: do not guard those.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Self

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offtensor import OffloadedParameter

aten = torch.ops.aten

# Op packets allowed to receive master storage anywhere among their tensor arguments.
_ALLOWED = {
    aten.detach,
    aten.alias,
    aten.lift_fresh,
    aten.is_pinned,
    aten._pin_memory,
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
    aten.is_same_size,
    aten._local_scalar_dense,
    aten._has_compatible_shallow_copy_type,
}
_CHECK, _ALLOW, _COPY, _TO_COPY, _SLICE = 0, 1, 2, 3, 4


def _kind_of(func) -> int:
    packet = getattr(func, "overloadpacket", None)
    if packet in _ALLOWED:
        return _ALLOW
    if packet is aten.copy_:
        return _COPY
    if packet is aten._to_copy:
        return _TO_COPY
    if packet is aten.slice or packet is aten.select or packet is aten.unbind:
        return _SLICE
    return _CHECK


def _worker_state() -> Any:
    try:
        from offtensor.dispatch.slot import worker_state
    except ImportError:  # the core moved it: then optimizer steps on this thread are checked too
        return None
    return worker_state


def _in_own_step() -> bool:
    """An optimizer view of offtensor's `step_subset` is stepping on this thread: what
    `backward_and_step` steps after backward, on the calling thread (parameters used outside
    their scope). Looked up only for a violation, so its cost is off the hot path."""
    frame = sys._getframe(1)
    while frame is not None:
        if getattr(frame.f_locals.get("self"), "_offtensor_view", False):
            return True
        frame = frame.f_back
    return False


class MasterGuard(TorchDispatchMode):
    """Raise ``AssertionError`` for any aten op that computes on the host master of an
    offloaded parameter of ``models`` (see the module docstring for what is allowed).

    ``MasterGuard(model_a, model_b)``; a model that is not wrapped contributes nothing. The
    ranges are collected when the mode is entered. ``violations`` lists the ``(op, name)`` pairs
    seen (with ``raise_on_violation=False`` the guard only records them).
    """

    def __init__(self, *models: nn.Module, raise_on_violation: bool = True) -> None:
        super().__init__()
        self.models = models
        self.raise_on_violation = raise_on_violation
        self.violations: list[tuple[str, str]] = []
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._names: list[list[tuple[int, int, str]]] = []  # per range: (start, end, slot name)
        self._cuda = False
        self._ws = _worker_state()
        self._kinds: dict[Any, int] = {}  # op overload -> _CHECK, _ALLOW, _COPY or _TO_COPY
        self._flats: set[int] = set()  # ids of the scopes' masters.flat tensors and slots' masters

    # ---- master ranges --------------------------------------------------------------------

    def _collect(self) -> None:
        ranges: list[tuple[int, int, list[tuple[int, int, str]]]] = []
        self._cuda = False
        self._flats.clear()
        with torch._C.DisableTorchFunctionSubclass():
            for model in self.models:
                engine = getattr(model, "_offtensor_engine", None)
                if engine is None:
                    continue
                self._cuda = self._cuda or torch.device(engine.device).type == "cuda"
                for scope in engine.scopes:
                    slots = []
                    for slot in scope.slots:
                        p = slot.param
                        self._flats.add(id(slot.master))  # a routed expert's rows are read from it
                        n = p.numel() * p.element_size()
                        if n:
                            slots.append((p.data_ptr(), p.data_ptr() + n, slot.name))
                        st = p.untyped_storage()
                        if st.nbytes():
                            ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes(),
                                           [(p.data_ptr(), p.data_ptr() + max(n, 1), slot.name)]))
                    flat = scope.masters.flat
                    if flat is not None and flat.numel():
                        self._flats.add(id(flat))
                        start = flat.data_ptr()
                        ranges.append((start, start + flat.numel() * flat.element_size(), slots))
        # Merge overlapping ranges (a master's own storage inside host_flat) into sorted,
        # disjoint intervals, keeping every slot name for the message.
        ranges.sort(key=lambda r: r[0])
        starts: list[int] = []
        ends: list[int] = []
        names: list[list[tuple[int, int, str]]] = []
        for s, e, slots in ranges:
            if starts and s < ends[-1]:
                ends[-1] = max(ends[-1], e)
                names[-1].extend(slots)
            else:
                starts.append(s)
                ends.append(e)
                names.append(list(slots))
        self._starts, self._ends, self._names = starts, ends, names

    def _hit(self, t: torch.Tensor) -> int:
        """Index of the master range holding ``t``'s memory, or -1."""
        if isinstance(t, OffloadedParameter):  # ask the master itself, not its __torch_function__
            with torch._C.DisableTorchFunctionSubclass():
                return self._hit_plain(t)
        return self._hit_plain(t)

    def _hit_plain(self, t: torch.Tensor) -> int:
        if not t.is_cpu:
            return -1
        try:
            ptr = t.data_ptr()
        except RuntimeError:  # sparse, or no storage
            return -1
        if ptr == 0:
            return -1
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._ends[i]:
            return i
        return -1

    def name_of(self, t: torch.Tensor) -> str:
        """The qualified name of the parameter whose master ``t``'s memory belongs to."""
        with torch._C.DisableTorchFunctionSubclass():
            i = self._hit(t)
            if i < 0:
                return "<not a master>"
            ptr = t.data_ptr()
            for s, e, name in self._names[i]:
                if s <= ptr < e:
                    return name
        return "<master storage, between parameters>"

    # ---- the mode -----------------------------------------------------------------------

    def __enter__(self) -> Self:
        self._collect()
        self.violations.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind_of(func)
        if kind != _ALLOW and self._starts:
            self._check(kind, func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    # The hot path: every aten op of the guarded forward/backward comes here. Plain tensors
    # are checked by address (no torch-function dispatch); an OffloadedParameter argument is
    # checked the same way, with its __torch_function__ disabled.

    def _check(self, kind: int, func, args: tuple, kwargs: dict) -> None:
        if kind == _COPY:
            # copies out of a master are offtensor's loads; a write into one is not allowed
            dest = args[0] if args else kwargs.get("self")
            if isinstance(dest, torch.Tensor) and self._hit(dest) >= 0:
                self._violation(func, dest, "writes into")
            return
        if kind == _TO_COPY:
            if self._cuda:
                target = kwargs.get("device")
                if target is None or torch.device(target).type == "cpu":
                    src = args[0] if args else kwargs.get("self")
                    if isinstance(src, torch.Tensor) and self._hit(src) >= 0:
                        self._violation(func, src, "copies to the host")
            return
        if kind == _SLICE and args and id(args[0]) in self._flats:
            return  # a load's run of the host buffer, the source of its copy (Note [load plans])
        for a in args:
            if isinstance(a, torch.Tensor):
                if self._hit(a) >= 0:
                    self._violation(func, a, "reads")
            elif type(a) is list or type(a) is tuple:
                for x in a:
                    if isinstance(x, torch.Tensor) and self._hit(x) >= 0:
                        self._violation(func, x, "reads")
        for a in kwargs.values():
            if isinstance(a, torch.Tensor) and self._hit(a) >= 0:
                self._violation(func, a, "reads")

    def _violation(self, func, t: torch.Tensor, what: str) -> None:
        ws = self._ws
        if ws is not None and getattr(ws, "active", False):
            return  # offtensor's own optimizer step, on its worker thread
        if _in_own_step():
            return  # backward_and_step stepping the rest on this thread (step_subset's view)
        name = self.name_of(t)
        self.violations.append((str(func), name))
        if self.raise_on_violation:
            raise AssertionError(
                f"MasterGuard: {func} {what} the host master of offloaded parameter {name!r} "
                f"(tensor {tuple(t.shape)} {t.dtype}, stride {tuple(t.stride())}) inside "
                "forward/backward; ops must see the scope's device copy or a temporary copy"
            )


@contextlib.contextmanager
def master_guard_ctx(*models: nn.Module, **kwargs: Any) -> Iterator[MasterGuard]:
    with MasterGuard(*models, **kwargs) as guard:
        yield guard


@pytest.fixture
def master_guard():
    """``with master_guard(model): out = model(x); loss.backward()``: a factory of guards."""
    return master_guard_ctx
