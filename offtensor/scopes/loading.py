"""A scope's load in flight: its host-to-device copies on the copy stream, the conversions of a
converting load on the cast stream, and the events the compute stream waits on.

# Note [progressive loads]
A scope's first forward records the order in which its parameters are first used. From then on
its host-to-device copy goes in that order, in chunks of CHUNK_BYTES with an event each (Note
[load plans]), and each op makes compute wait only for the chunk that holds its weights. The first
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
[streams and events] in scopes/streams.py). The staging buffer (host layout, the scope's `nbytes`)
lives until the last conversion is enqueued; the allocator holds its memory until the cast
stream is past it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..dispatch.slot import ParamSlot
from ..storage.compress import fused_conversions
from .streams import Streams

CHUNK_BYTES = 32 * 2**20  # see Note [progressive loads]
# Staged masters this close in the host buffer are copied as one run (Note [load plans]): the
# bytes between them (a bias, alignment) cross too, into staging, where nothing reads them.
MERGE_GAP = 256 * 2**10

# Note [load plans]
# A progressive load enqueues, for each chunk, its copies, an event, and for a converting load
# its conversions and a second event: a few hundred host-side calls per scope of a DiT, each a
# few microseconds of Python and of the CUDA runtime, which the host pays again at every load.
# When compute per scope is as short as its copies, that host time is what the step waits for.
# So the scope works its load out once, when its copy_order is learned (`LoadPlan`): the chunks
# (positions in copy_order, cut every CHUNK_BYTES), and in each the fewest copies that
# move its bytes: parameters next to each other in both buffers' layouts copy as one run; the
# staged masters of a converting load copy as runs of the host buffer (over the small parameters
# between them, MERGE_GAP); and the conversions of a chunk run as one kernel where the frozen
# format has one (`fused_conversions` in storage/compress.py: fp8's table of the chunk's
# matrices, FusedDequantization in storage/fp8.py, on CUDA), else one conversion per parameter.
# Each chunk is enqueued whole, so a parameter's chunk is fixed by the plan; copies held back by
# a deferred step stop at the first chunk that holds a parameter waiting for one, unless the load
# needs that chunk now (then the host waits for its steps).


# Note [a release after a load's last event]
# A load's chunks have one event each, recorded on the copy stream for a chunk that converts
# nothing and on the cast stream for one that does; each stream runs in order, but the two do not
# wait for each other's later work. So the last chunk's event is not the end of the load: when it
# is a copy-stream event, conversions of earlier chunks may still be running on the cast stream,
# writing into the device buffer. Ops wait for every chunk they need, one by one; a release of a
# load nobody finished using (a prefetch left unused, a call that raised) waits for every chunk
# compute has not waited for (`compute_waits(None)`), so that freeing the buffer on the compute
# stream follows every write into it. The last event alone would free the buffer under running
# conversions: on CUDA the allocator may hand the memory to the next tensor while one still writes.
# tests/lazy_streams.py checks this on the CPU.


class _Chunk:
    """One chunk of a progressive load: the parameters at positions [lo, hi) of copy_order and
    the copies that bring them onto the device (Note [load plans])."""

    __slots__ = ("lo", "hi", "slots", "direct", "staged", "converts")

    def __init__(self, lo: int, slots: list[ParamSlot]) -> None:
        self.lo, self.hi, self.slots = lo, lo + len(slots), slots
        self.direct: list[tuple[int, int, int]] = []  # (host offset, device offset, bytes): straight in
        self.staged: list[tuple[int, int]] = []  # (host offset, bytes): into staging, host layout
        self.converts: list[ParamSlot] = []  # from staging into their device copies, once landed


class LoadPlan:
    """A scope's progressive load, worked out once from its copy_order (Note [load plans]).
    `staged`: the scope converts (a converting load's masters cross into staging)."""

    def __init__(self, order: list[ParamSlot], staged: bool, device: torch.device, routed: int = 0) -> None:
        """`routed`: how many routed expert parameters end copy_order (Note [routed experts] in
        scopes/experts.py); a chunk ends before them, so that a load can leave them out."""
        self.order = order
        self.chunk_bytes = CHUNK_BYTES
        layout = sorted(order, key=lambda s: s.offset)
        rank = {slot: i for i, slot in enumerate(layout)}
        converting = [staged and s.converts() for s in layout]  # converted by `_convert`
        self.chunks: list[_Chunk] = []
        self.routed_from = len(order) - routed  # position of the first routed parameter
        lo, nbytes = 0, 0
        for i, slot in enumerate(order):
            nbytes += slot.host_nbytes if converting[rank[slot]] else slot.device_view.nbytes
            if nbytes >= CHUNK_BYTES or i == len(order) - 1 or i == self.routed_from - 1:
                self.chunks.append(_chunk(lo, order[lo : i + 1], rank, converting))
                lo, nbytes = i + 1, 0
        self.unrouted_chunks = sum(chunk.hi <= self.routed_from for chunk in self.chunks)
        for c, chunk in enumerate(self.chunks):
            for slot in chunk.slots:
                slot.chunk = c
        self.fused = fused_conversions(
            [[(s.packed, s.offset, s.device_offset, s.device_view) for s in chunk.converts] for chunk in self.chunks],
            device)

    def current(self, order: list[ParamSlot]) -> bool:
        """Still the plan of this copy_order and chunk size."""
        return self.order is order and self.chunk_bytes == CHUNK_BYTES


def _chunk(lo: int, slots: list[ParamSlot], rank: dict[ParamSlot, int], converting: list[bool]) -> _Chunk:
    chunk = _Chunk(lo, slots)
    last_direct: ParamSlot | None = None
    last_staged: ParamSlot | None = None
    for slot in sorted(slots, key=lambda s: s.offset):
        r = rank[slot]
        if converting[r]:
            chunk.converts.append(slot)
            n = slot.host_nbytes
            if (last_staged is not None and not any(converting[rank[last_staged] + 1 : r])
                    and slot.offset - (chunk.staged[-1][0] + chunk.staged[-1][1]) <= MERGE_GAP):
                start = chunk.staged[-1][0]
                chunk.staged[-1] = (start, slot.offset + n - start)
            else:
                chunk.staged.append((slot.offset, n))
            last_staged = slot
            continue
        n = slot.device_view.nbytes
        # Neighbours in both layouts, the same bytes apart: one copy (the padding between them too).
        if (last_direct is not None and r == rank[last_direct] + 1
                and slot.offset - last_direct.offset == slot.device_offset - last_direct.device_offset):
            host, dev, _ = chunk.direct[-1]
            chunk.direct[-1] = (host, dev, slot.offset + n - host)
        else:
            chunk.direct.append((slot.offset, slot.device_offset, n))
        last_direct = slot
    return chunk


class Traffic:
    """What one scope moved to the device since wrap, and how often its routed experts were
    already there (Note [routed experts] in scopes/experts.py): `summary()` reports them."""

    __slots__ = ("bytes_to_device", "expert_hits", "expert_misses")

    def __init__(self) -> None:
        self.bytes_to_device = 0  # loads, expert rows, temporary copies, old gradients
        self.expert_hits = 0  # expert rows an op needed that were on the device already
        self.expert_misses = 0  # expert rows copied for an op


class LoadProgress:
    """What a load has enqueued and what compute has waited for; exists only while LOADING."""

    def __init__(self, streams: Streams, copied: Callable[[Sequence[ParamSlot]], None], traffic: Traffic) -> None:
        self.streams = streams
        self.copied = copied  # told of the masters about to be copied (WriteTracker.note_copied)
        self.traffic = traffic  # the scope's counters
        self.chunk_ready: list[Any] = []  # events compute waits on, one per chunk
        self.chunks_waited = 0  # of which the compute stream has waited for
        # A progressive load (Note [progressive loads]): its plan, the host buffer it copies from
        # and the device buffer it fills, and how many of copy_order's entries are enqueued.
        self.plan: LoadPlan | None = None
        self.host: torch.Tensor | None = None
        self.device_flat: torch.Tensor | None = None
        self.cursor = 0
        self.end = 0  # len(copy_order) for a progressive load (without routed experts), else 0
        self.chunk_count = 0  # the plan's chunks this load copies (Note [routed experts])
        # A converting load: the masters' bytes on the device (host layout) until the last chunk's
        # conversion is enqueued; for a whole-scope load, the parameters to convert.
        self.staging: torch.Tensor | None = None
        self.to_convert: list[ParamSlot] = []

    @property
    def held_back(self) -> bool:
        """Copies wait for deferred optimizer steps (Note [deferred steps] in optim/overlap.py)."""
        return self.cursor < self.end

    def not_copied(self, slot: ParamSlot) -> bool:
        """The slot's copy is not enqueued yet: it waits for its deferred step (`held_back`)."""
        return slot.chunk >= len(self.chunk_ready)

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

    def follow(self, plan: LoadPlan, host: torch.Tensor, device_flat: torch.Tensor, routed: bool) -> None:
        """Make this a progressive load by `plan`, from the host buffer `host` into `device_flat`;
        without `routed`, not the routed experts (Note [routed experts] in scopes/experts.py)."""
        self.plan, self.host, self.device_flat = plan, host, device_flat
        self.end = len(plan.order) if routed else plan.routed_from
        self.chunk_count = len(plan.chunks) if routed else plan.unrouted_chunks

    def copy_more(self, need: int) -> None:
        """Enqueue the next chunks of a progressive load, each with its event (Note [load plans]).
        A chunk holding a parameter whose deferred optimizer step is pending (Note [deferred step fences]
        in dispatch/slot.py) stops the copies there, unless it starts at or before position `need`:
        then the host waits for its steps."""
        plan, host, device_flat, streams = self.plan, self.host, self.device_flat, self.streams
        assert plan is not None and host is not None and device_flat is not None
        chunks = plan.chunks
        h2d = streams.h2d()
        staging = self.staging
        c = first = len(self.chunk_ready)
        with streams.on(h2d):
            while c < self.chunk_count:
                chunk = chunks[c]
                pending = None  # a loop, not a list of step_pending: asked per chunk of each load
                for slot in chunk.slots:
                    if slot.pending_step is not None:
                        pending = slot
                        break
                if pending is not None:
                    if chunk.lo > need:
                        break
                    for slot in chunk.slots:
                        slot.wait_for_step()
                self.copied(chunk.slots)
                for start, dev, n in chunk.direct:
                    device_flat[dev : dev + n].copy_(host[start : start + n], non_blocking=True)
                    self.traffic.bytes_to_device += n
                if chunk.staged:
                    assert staging is not None
                    for start, n in chunk.staged:
                        staging[start : start + n].copy_(host[start : start + n], non_blocking=True)
                        self.traffic.bytes_to_device += n
                event = streams.record(h2d)
                if chunk.converts:
                    event = self._convert_chunk(c, chunk, event)
                self.chunk_ready.append(event)
                c += 1
        if c > first:  # the copy stream runs in order: its last event covers the rest
            streams.reads_masters(self.chunk_ready[-1])
        self.cursor = chunks[c - 1].hi if c else 0
        if c == self.chunk_count:
            self.staging = None  # every conversion is enqueued

    def _convert_chunk(self, c: int, chunk: _Chunk, copied: Any) -> Any:
        """Enqueue the chunk's conversions on the cast stream after `copied` (the event of its
        copy); the event after them."""
        streams, staging, plan = self.streams, self.staging, self.plan
        assert staging is not None and plan is not None and self.device_flat is not None
        cast = streams.cast()
        streams.wait(cast, copied)
        with streams.on(cast):
            if plan.fused is not None:
                plan.fused.launch(c, staging, self.device_flat)
            else:
                for slot in chunk.converts:
                    _convert(slot, staging)
        return streams.record(cast)

    def copy_all(self, source: torch.Tensor, device_flat: torch.Tensor, slots: list[ParamSlot],
                 only: list[ParamSlot] | None = None) -> None:
        """Enqueue the whole scope at once (on the current stream): `source` into the device
        buffer, or, for a converting load, into staging, converted at the next mark_chunk;
        `only`: just those parameters (a load that converts nothing)."""
        if only is not None:  # not the routed experts (Note [routed experts] in scopes/experts.py)
            for slot in only:
                n = slot.device_view.nbytes
                device_flat[slot.device_offset : slot.device_offset + n].copy_(
                    source[slot.offset : slot.offset + n], non_blocking=True)
                self.traffic.bytes_to_device += n
            return
        if self.staging is not None:
            self.staging.copy_(source, non_blocking=True)
            self.to_convert.extend(slots)
        else:
            device_flat.copy_(source, non_blocking=True)
        self.traffic.bytes_to_device += source.nbytes

    def mark_chunk(self, h2d: Any) -> None:
        """A whole-scope load: record the event compute waits on for the copy enqueued, after
        its conversion, for a converting load (on the cast stream)."""
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

    def landed(self) -> bool:
        """Every chunk is enqueued and every copy and conversion of the load has run: waiting
        for all of them costs compute nothing (Note [a load that landed before its call] in
        engine/hooks.py). Asks each chunk's event that compute has not waited for (None on the
        CPU, where copies are done when issued)."""
        if self.held_back:
            return False
        for event in self.chunk_ready[self.chunks_waited:]:  # a loop: asked at each call of a loaded scope
            if event is not None and not event.query():
                return False
        return True

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


def _convert(slot: ParamSlot, staging: torch.Tensor) -> None:
    """Write a parameter's device copy from its master's bytes in `staging` (host layout):
    dequantized (Policy(frozen_format), Note [compressed masters] in storage/compress.py) or cast
    to the compute dtype (Policy(cast="device"))."""
    if slot.packed is not None:
        slot.packed.unpack_into(slot.device_view, staging[slot.offset :])
        return
    master = slot.master
    n = master.numel() * master.element_size()
    slot.device_view.copy_(staging[slot.offset : slot.offset + n].view(master.dtype).view(master.shape))
