"""Optimizer steps of part of a model on the compute device, during backward_and_step: the
`DeviceSteps` of a call, the one object through which the overlapped step uses the device.

# Note [device steps]
When the host's optimizer over the model takes longer than forward+backward, the overlapped
step is bound by it (Note [early handover] in optim/step.py), while the device idles for part
of each step and the PCIe link has room. With `backward_and_step(device_share=f)` the worker
also steps pieces on the device: it copies a piece's masters, gradients and optimizer state
there, runs the user's optimizer on those copies (the same class, param group and state
entries) and copies the masters and the state back, all on a stream of its own
(`Streams.step`), without waiting for any of it. The piece's fence stays until that stream's
event has passed; the worker, or a thread that waits for one of those parameters, clears it
(`PieceQueue.finish_device_steps`). Which pieces: the worker keeps for itself the landed piece
the next forward needs first; while DEVICE_MIN_READY are ready and fewer than
DEVICE_PIECES_IN_FLIGHT are queued on the device, it first hands the device, of the others, the
one the next forward needs last that it may take, until `f` of the optimizer's offloaded bytes
went there in this call. The two eat one queue from its two ends: the host never waits for a
device step it needs soon, and the device takes only what the host would have reached last.
Nothing is assigned ahead: a host whose queue never holds DEVICE_MIN_READY ready pieces leaves
the device nothing.

# Note [what device steps cost]
Per parameter byte stepped there, its master, gradient and state go to the device (8 bytes per
bf16 parameter with bf16 AdamW state) and its master and state come back (6), beside the step's
own copies. Device memory: the copies are allocated on the step stream and dropped once their
work is queued, so the caching allocator hands their blocks to the next piece's copies in that
stream's order: about one piece's copies (4 x its bytes for AdamW), not one per piece. The
device takes no piece larger than DEVICE_PIECE_FACTOR x piece_bytes (one large parameter, an
embedding or a head, stays on the host), which bounds that to about 8 x piece_bytes; a VRAM
budget does not count it, so the two are not combined. The state lives on the host throughout,
page-locked (a state tensor made on the host moves to page-locked memory at its first device
step, one made on the device gets a page-locked home), so the copies run at full speed and
`optimizer.state` reads as after any step. The host tensors the copies read or write are held
next to the stream's event (`DeviceStep`).

# Note [which pieces step on the device]
The device's kernels for the same update (the fused CUDA AdamW for a fused CPU one, foreach for
single-tensor) may round the same fp32 math differently in the last bit. Only SGD, Adam and
AdamW (whose state is per-parameter tensors and a step count) step there, and only without step
hooks of the user's (a hook would see device copies instead of the parameters), tensor
hyperparameters (a CPU tensor lr beside device parameters) or `differentiable=True`; otherwise
every piece steps on the host, as `ineligible` says. Nor does a piece whose tensors the dense
copies cannot hold (`can_take`): a compressed master, a sparse gradient
(`nn.Embedding(sparse=True)`) or a sparse state entry (SGD's momentum of one). The worker checks
when it chooses the piece, before any of it is copied: a piece that failed in its copies after
the pieces before it were stepped would leave a partial step.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as optim_module

from ..dispatch.masters import master_grad, without_subclass_dispatch
from ..dispatch.param import OffloadedParameter
from ..dispatch.slot import ParamSlot
from ..engine.engine import owning_engine
from ..scopes.streams import Streams
from ..storage.memory import HostBuffer
from .pieces import Piece, slot_bytes
from .views import OptimizerAsOfCall

# Pieces queued on the device at once: more would keep pieces there that the host could have
# stepped sooner (Note [device steps]).
DEVICE_PIECES_IN_FLIGHT = 2
# Ready pieces the worker must have before it hands one to the device: the host keeps the one
# the next forward needs first (Note [device steps]).
DEVICE_MIN_READY = 2
# The largest piece the device takes, in piece_bytes: a piece holding one large parameter (an
# embedding, 1 GB in Llama-3-8B) would take four times that on the device (Note [what device
# steps cost]).
DEVICE_PIECE_FACTOR = 2

_ELIGIBLE_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class DeviceSteps:
    """The device's share of one backward_and_step call (Note [device steps]): which pieces it
    takes, their steps queued there, and which of those have landed. Its methods run under the
    lock of the call's PieceQueue, but `step`, which the worker runs outside it."""

    def __init__(self, as_of: OptimizerAsOfCall, share: float, piece_bytes: int, data_parallel: bool) -> None:
        optimizer = as_of.optimizer
        self._as_of = as_of
        off = ineligible(optimizer, data_parallel) if share else None
        self.off = off or ""  # why `share` was given but every piece steps on the host
        self._largest = DEVICE_PIECE_FACTOR * piece_bytes  # the largest piece it takes
        self._bytes = 0.0  # the bytes it may still step in this call
        self._counts_on_device: set[int] = set()  # parameters whose group keeps its step counts on the device
        if share and off is None:
            self._bytes = share * sum(slot_bytes(p._ot) for g in optimizer.param_groups for p in g["params"]
                                      if isinstance(p, OffloadedParameter) and hasattr(p, "_ot"))
            self._counts_on_device = {id(p) for g in optimizer.param_groups if g.get("fused") or g.get("capturable")
                                      for p in g["params"]}
        self._queued: list[tuple[Piece, DeviceStep]] = []  # their copies back may not have landed yet

    def take(self, ready: list[Piece]) -> Piece | None:
        """Of the landed pieces, the one to step on the device now, or None: while DEVICE_MIN_READY
        are ready and it has room, the one the next forward needs last that it may take (the
        host keeps the DEVICE_MIN_READY - 1 needed first)."""
        if self._bytes <= 0 or len(ready) < DEVICE_MIN_READY or len(self._queued) >= DEVICE_PIECES_IN_FLIGHT:
            return None
        limit = min(self._bytes, self._largest)
        others = sorted(ready, key=lambda p: p.deadline)[max(0, DEVICE_MIN_READY - 1):]
        piece = next((p for p in reversed(others) if p.nbytes <= limit and can_take(p.slots, self._as_of.state)),
                     None)
        if piece is not None:
            self._bytes -= piece.nbytes
        return piece

    def step(self, piece: Piece, updated: Callable[[], None]) -> DeviceStep:
        """Queue the step of a piece it took, on the worker, outside the lock (`updated`: as for
        step_subset); `add` it then. Its fence stays until its copies back have landed."""
        for slot in piece.slots:
            slot.scope.master_written(slot)
        ids = {id(s.param) for s in piece.slots}

        def run(copies: dict[int, torch.Tensor], state: Any) -> None:
            self._as_of.step(ids, updated, substitute=copies, state=state)

        return without_subclass_dispatch(step_on_device, piece.slots, self._as_of.state,
                                         owning_engine(piece.slots[0]).streams, self._counts_on_device, run)

    def add(self, piece: Piece, step: DeviceStep) -> None:
        self._queued.append((piece, step))

    def holding(self, slot: ParamSlot) -> DeviceStep | None:
        """The queued step of the piece of `slot`, if it is queued here."""
        return next((step for piece, step in self._queued if any(s is slot for s in piece.slots)), None)

    def busy(self) -> bool:
        return bool(self._queued)

    def oldest(self) -> DeviceStep | None:
        return self._queued[0][1] if self._queued else None

    def in_flight(self) -> list[tuple[Piece, DeviceStep]]:
        return list(self._queued)

    def landed(self, pieces: list[Piece]) -> None:
        """These pieces' copies back have landed: no longer queued."""
        self._queued = [(p, step) for p, step in self._queued if all(p is not f for f in pieces)]


def ineligible(optimizer: torch.optim.Optimizer, data_parallel: bool) -> str | None:
    """Why `optimizer`'s pieces cannot step on the device (Note [device steps]), or None.
    `data_parallel`: a model it steps is in data-parallel mode (untried there: its steps stay
    on the host)."""
    if data_parallel:
        return "the model is data_parallel"
    if type(optimizer) not in _ELIGIBLE_CLASSES:
        return f"{type(optimizer).__name__} is not SGD, Adam or AdamW"
    hooks = [*optimizer._optimizer_step_pre_hooks.values(), *optimizer._optimizer_step_post_hooks.values(),
             *optim_module._global_optimizer_pre_hooks.values(),
             *optim_module._global_optimizer_post_hooks.values()]
    if any(not (getattr(hook, "__module__", None) or "").startswith("offtensor") for hook in hooks):
        return "it has step hooks of the user's"
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "a param group has differentiable=True"
        for key, value in group.items():
            values = value if isinstance(value, tuple) else (value,)
            if key != "params" and any(isinstance(v, torch.Tensor) for v in values):
                return f"a param group's {key!r} is a tensor"
    return None


def can_take(slots: list[ParamSlot], state: Any) -> bool:
    """The device can step this piece: every master, gradient and state tensor is a dense one
    that its copies can hold (Note [device steps]). On the optimizer worker, which writes `state`."""
    for slot in slots:
        grad = slot.host_grad  # what the worker publishes as `p.grad` before the step
        if slot.packed is not None or (grad is not None and grad.layout != torch.strided):
            return False
        entries = dict.get(state, slot.param, {})  # the worker never waits on a fence (_FencedState)
        if any(isinstance(v, torch.Tensor) and v.layout != torch.strided for v in entries.values()):
            return False
    return True


class DeviceStep:
    """One piece's step queued on the device; holds the host tensors its copies read or write."""

    def __init__(self, event: Any, keep: list[torch.Tensor]) -> None:
        self.event = event  # on the step stream, after the copies back (None on the CPU: done)
        self._keep = keep

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def step_on_device(slots: list[ParamSlot], state: Any, streams: Streams, counts_on_device: set[int],
                   run_step: Callable[[dict[int, torch.Tensor], Any], None]) -> DeviceStep:
    """Queue the step of `slots` (one piece, gradients on the host) on the device: copies in,
    `run_step(device copy of each parameter by id, their state)`, copies back (Note [device
    steps]). `state`: the optimizer's state dict the step writes; `counts_on_device`: ids of the
    parameters whose group keeps its step counts on the parameter's device (fused, capturable).
    Call with subclass dispatch off, on the optimizer worker; the masters must be free to write
    (MasterWrites.master_written)."""
    stream = streams.step()
    device = streams.device
    pin = streams.is_cuda
    keep: list[torch.Tensor] = []  # host tensors the copies read or write
    copies: dict[int, torch.Tensor] = {}
    device_state: collections.defaultdict = collections.defaultdict(dict)
    try:
        # torch.cuda.stream, not Streams.on: the current stream is per thread, and on() records
        # the stream to restore in the Streams object that the calling thread's entry points
        # read (Note [interrupts]); no interrupt reaches this thread.
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for slot in slots:
                p, grad = slot.param, master_grad(slot.param)
                on_device = _to(p, device)
                keep.append(p)
                if grad is not None:
                    on_device.grad = _to(grad, device)
                    keep.append(grad)
                host = dict.get(state, p, {})
                counts = id(p) in counts_on_device
                device_state[on_device] = {k: _to(v, device) if _moves(v, counts) else v for k, v in host.items()}
                keep += [v for v in host.values() if isinstance(v, torch.Tensor)]
                copies[id(p)] = on_device
            run_step(copies, device_state)
            for slot in slots:
                p = slot.param
                on_device = copies[id(p)]
                p.copy_(on_device, non_blocking=True)
                stepped = device_state[on_device]
                host = dict.get(state, p)
                if host is None:
                    if not stepped:
                        continue  # no state (SGD without momentum): none made on the host either
                    host = state[p]  # the worker never waits on a fence (_FencedState)
                for key, value in stepped.items():
                    if not isinstance(value, torch.Tensor) or value is host.get(key):
                        host[key] = value  # a number, or a host tensor stepped in place
                        continue
                    home = host.get(key)
                    if not _fits(home, value, pin):
                        nbytes = value.numel() * value.element_size()  # page-locked on CUDA
                        home = host[key] = HostBuffer(nbytes, pin=pin).tensor(0, value.dtype, value.shape)
                    home.copy_(value, non_blocking=True)
                    keep.append(home)
            return DeviceStep(streams.record(stream), keep)
    except BaseException:
        if stream is not None:
            stream.synchronize()  # nothing queued may still write a master once its fence clears
        raise


def _moves(value: Any, counts: bool) -> bool:
    """A state entry goes to the device: tensors with elements per parameter element, and a
    0-dim step count when the group keeps it on the parameter's device (`counts`: fused or
    capturable); otherwise the optimizer keeps it on the host and steps it there, in place."""
    return isinstance(value, torch.Tensor) and (value.dim() > 0 or counts)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of host tensor `t` (asynchronous from page-locked memory), a new tensor
    even on the CPU, so the step never writes the host tensor itself."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=True)
    return out


def _fits(home: Any, value: torch.Tensor, pin: bool) -> bool:
    return (isinstance(home, torch.Tensor) and home.device.type == "cpu" and home.shape == value.shape
            and home.dtype == value.dtype and home.is_contiguous()
            and (not pin or value.numel() == 0 or home.is_pinned()))  # an empty tensor is never pinned
