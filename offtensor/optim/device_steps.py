"""Optimizer steps of part of a model on the compute device, during backward_and_step.

# Note [device steps]
The overlapped step is bound by the CPU optimizer when the host's AdamW over the model takes
longer than forward+backward (the benchmark's 8 layers: about 280-315 ms beside the copies
against about 240 ms), and then the period is that optimizer time plus the span in which the
worker has nothing to step (Note [early handover] in optim/overlap.py). Meanwhile the device idles
for part of each step and the PCIe link carries about a third of what it could. So with
`backward_and_step(device_share=f)` the worker also steps pieces on the device: it copies a
piece's masters, their gradients and their optimizer state there, runs the user's optimizer on
those copies (the same class, param group and state entries) and copies the masters and the
state back, all on one stream of its own (`Streams.step`), without waiting for any of it. The
piece's fence stays until that stream's event has passed; the worker, or a thread that waits
for one of those parameters, clears it (`_OverlappedStep._finish_device_steps`).

Which pieces: the worker takes the landed piece the next forward needs first for itself, as
before; while two or more are ready and fewer than DEVICE_PIECES_IN_FLIGHT are queued on the
device, it first hands the device, of the others, the one the next forward needs last (among
those it may take: see below), until `f` of the optimizer's offloaded bytes went there in this
call. So the two eat the same queue from its two
ends: the host never waits for a device step it needs soon (one piece's copies take about 9 ms
at 55 GB/s, as long as its step on 15 cores), and the device takes only what the host would
have reached last. Nothing is assigned ahead: a host whose queue never holds DEVICE_MIN_READY
ready pieces leaves the device nothing.

What it costs: per parameter byte stepped there, its master, gradient and state go to the
device (8 bytes per bf16 parameter with bf16 AdamW state) and its master and state come back
(6), while the link also carries the step's own copies; and device memory for the copies of
the pieces queued there. Those copies are allocated on the step stream and dropped once their
work is queued: the caching allocator hands their blocks to the next piece's copies in that
stream's order, so this is about one piece's copies (4 x its bytes for AdamW), not one per
piece. The device takes no piece larger than DEVICE_PIECE_FACTOR x piece_bytes (a piece of one
large parameter, an embedding or a head, stays on the host), which bounds that to about
8 x piece_bytes, 512 MiB by default; a VRAM budget does not count it, so the two are not
combined. The state lives on the
host throughout, page-locked (a state tensor the optimizer made on the host moves to
page-locked memory at its first device step, and one the step made on the device gets a
page-locked home), so the copies run at full speed and `optimizer.state` reads as after any
step. The host tensors the copies read or write are held next to the stream's event.

Numerics: the device's kernels for the same update (the fused CUDA AdamW for a fused CPU one,
foreach for single-tensor) may round the same fp32 math differently in the last bit. Only SGD,
Adam and AdamW (whose state is per-parameter tensors and a step count) step there, and only
without step hooks of the user's (a hook would see device copies instead of the parameters),
tensor hyperparameters (a CPU tensor lr beside device parameters) or `differentiable=True`;
otherwise every piece steps on the host, as `ineligible` says. Nor does a piece whose tensors the
dense copies cannot hold (`can_take`): a compressed master, a sparse gradient
(`nn.Embedding(sparse=True)`) or a sparse state entry (SGD's momentum of one). The worker checks
when it chooses the piece, before any of it is copied: a piece that failed in its copies after
the pieces before it were stepped left a partial step.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as optim_module

from ..core.memory import HostBuffer
from ..core.slot import ParamSlot
from ..core.streams import Streams
from ..dispatch.masters import master_grad

# Pieces queued on the device at once: more would keep pieces there that the host could have
# stepped sooner (Note [device steps]).
DEVICE_PIECES_IN_FLIGHT = 2
# Ready pieces the worker must have before it hands one to the device: the host keeps the one
# the next forward needs first (Note [device steps]).
DEVICE_MIN_READY = 2
# The largest piece the device takes, in piece_bytes: a piece holding one large parameter (an
# embedding, 1 GB in Llama-3-8B) would take four times that on the device (Note [device steps]).
DEVICE_PIECE_FACTOR = 2

_ELIGIBLE_CLASSES = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


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
    (Engine.master_written)."""
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
