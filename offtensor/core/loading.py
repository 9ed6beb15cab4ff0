"""A scope's load in flight: its host-to-device copies on the copy stream, the conversions of a
converting load on the cast stream, and the events the compute stream waits on.

# Note [progressive loads]
A scope's first forward records the order in which its parameters are first used. From then on
its host-to-device copy goes parameter by parameter in that order, with an event every
CHUNK_BYTES, and each op makes compute wait only for the chunk that holds its weights. The first
matmul of a block starts when its own weights have landed, not the whole block: for the first
scope of a pass, which nothing can hide, this turns a whole-block stall into a one-matrix stall.
Backward needs the whole scope before its first op (autograd reads the saved device copies
directly), so pre_backward waits for every chunk.
A load that converts (`Policy(cast="device")`, `Policy(frozen_format)`) is progressive too: the
master bytes of each chunk that need converting cross into a staging buffer on the copy stream
(the others straight into their device copies), and the cast stream converts them into the
device copies once the chunk's copy has landed; the chunk's event is
recorded after its conversion. The conversions thus overlap the next chunks' copies instead of
delaying them, and the first op waits for its own matrix's copy and conversion only (see Note
[streams and events] in core/streams.py). The staging buffer (host layout, the scope's `nbytes`)
lives until the last conversion is enqueued; the allocator holds its memory until the cast
stream is past it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .slot import ParamSlot
from .streams import Streams

CHUNK_BYTES = 32 * 2**20  # see Note [progressive loads]


class LoadProgress:
    """What a load has enqueued and what compute has waited for; exists only while LOADING."""

    def __init__(self, streams: Streams, copied: Callable[[Iterable[ParamSlot]], None]) -> None:
        self.streams = streams
        self.copied = copied  # told of the masters about to be copied (WriteTracker.note_copied)
        self.chunk_ready: list[Any] = []  # copy-stream events, one per chunk
        self.chunks_waited = 0  # of which the compute stream has waited for
        # A progressive load (Note [progressive loads]): the scope's copy_order, the host buffer
        # it copies from, and how many of copy_order's entries are enqueued.
        self.order: list[ParamSlot] = []
        self.host: torch.Tensor | None = None
        self.cursor = 0
        self.end = 0  # len(order) for a progressive load, else 0
        self.unmarked = 0  # bytes enqueued since the last chunk event
        # A converting load: the masters' bytes on the device (host layout) until the last chunk's
        # conversion is enqueued, and the parameters copied there since the last chunk event.
        self.staging: torch.Tensor | None = None
        self.to_convert: list[ParamSlot] = []

    @property
    def held_back(self) -> bool:
        """Copies wait for deferred optimizer steps (Note [deferred steps] in optim/overlap.py)."""
        return self.cursor < self.end

    @property
    def weights_ready(self) -> Any:
        """The event after the whole weights' copy (the copy stream runs in order), or None when
        no copy is enqueued yet."""
        return self.chunk_ready[-1] if self.chunk_ready else None

    def stage(self, nbytes: int, device: torch.device) -> None:
        """A converting load: the device buffer the masters' bytes are copied into (allocated on
        the copy stream, which writes it first). The cast stream reads it: recorded as a use of
        that stream, its memory is not reused before the last conversion is done."""
        staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        cast = self.streams.cast()
        if cast is not None:
            staging.record_stream(cast)
        self.staging = staging

    def follow(self, order: list[ParamSlot], host: torch.Tensor) -> None:
        """Make this a progressive load of the parameters in `order`, from the host buffer `host`."""
        self.order, self.host, self.end = order, host, len(order)

    def copy_more(self, need: int) -> None:
        """Enqueue the next copies of a progressive load, in `order`, with an event every
        CHUNK_BYTES (Note [progressive loads]). A parameter whose deferred optimizer step is
        pending (Note [step fences] in core/slot.py) stops the copies there, unless its position
        is at most `need`: then the host waits for its step."""
        order, host, streams = self.order, self.host, self.streams
        h2d = streams.h2d()
        staging = self.staging
        i = start = self.cursor
        with streams.on(h2d):
            while i < self.end:
                slot = order[i]
                if slot.step_pending:
                    if i > need:
                        break
                    slot.wait_for_step()
                self.copied((slot,))
                if staging is None or not _converts(slot):  # a bias beside fp8 matrices: no staging
                    slot.device_view.copy_(slot.master, non_blocking=True)
                    self.unmarked += slot.device_view.nbytes
                else:  # converted on the cast stream once its chunk has landed
                    assert host is not None
                    n = slot.host_nbytes
                    staging[slot.offset : slot.offset + n].copy_(
                        host[slot.offset : slot.offset + n], non_blocking=True)
                    self.to_convert.append(slot)
                    self.unmarked += n
                slot.chunk = len(self.chunk_ready)
                i += 1
                if self.unmarked >= CHUNK_BYTES or i == self.end:
                    self.mark_chunk(h2d)
            if self.unmarked:
                self.mark_chunk(h2d)
        if i > start:  # the copy stream runs in order: its last event covers the rest
            streams.reads_masters(self.chunk_ready[-1])
        self.cursor = i
        if i == self.end:
            self.staging = None  # every conversion is enqueued

    def copy_all(self, source: torch.Tensor, device_flat: torch.Tensor, slots: list[ParamSlot]) -> None:
        """Enqueue the whole scope at once (on the current stream): `source` into the device
        buffer, or, for a converting load, into staging, converted at the next mark_chunk."""
        if self.staging is not None:
            self.staging.copy_(source, non_blocking=True)
            self.to_convert.extend(slots)
        else:
            device_flat.copy_(source, non_blocking=True)

    def mark_chunk(self, h2d: Any) -> None:
        """Record the event compute waits on for the copies enqueued since the last one: after
        their conversion, for a converting load (on the cast stream)."""
        streams = self.streams
        event = streams.record(h2d)
        if self.to_convert:
            assert self.staging is not None
            cast = streams.cast()
            streams.wait(cast, event)
            with streams.on(cast):
                for slot in self.to_convert:
                    _convert(slot, self.staging)
            self.to_convert.clear()
            event = streams.record(cast)
        self.chunk_ready.append(event)
        self.unmarked = 0

    def compute_waits(self, chunk: int | None) -> bool:
        """The compute stream waits (device side) for the chunks up to `chunk` (None: every
        chunk enqueued). True once it has waited for the whole load."""
        last = len(self.chunk_ready) - 1
        target = last if chunk is None else min(chunk, last)
        streams = self.streams
        compute = streams.compute()
        for i in range(self.chunks_waited, target + 1):
            streams.wait(compute, self.chunk_ready[i])
        self.chunks_waited = max(self.chunks_waited, target + 1)
        return self.chunks_waited > last and not self.held_back


def _converts(slot: ParamSlot) -> bool:
    """The parameter's device copy is not its master's bytes: dequantized or cast (`_convert`)."""
    return slot.packed is not None or slot.device_view.dtype != slot.master.dtype


def _convert(slot: ParamSlot, staging: torch.Tensor) -> None:
    """Write a parameter's device copy from its master's bytes in `staging` (host layout):
    dequantized (Policy(frozen_format), Note [compressed masters] in weights/compress.py) or cast
    to the compute dtype (Policy(cast="device"))."""
    if slot.packed is not None:
        slot.packed.unpack_into(slot.device_view, staging[slot.offset :])
        return
    master = slot.master
    n = master.numel() * master.element_size()
    slot.device_view.copy_(staging[slot.offset : slot.offset + n].view(master.dtype).view(master.shape))
