"""The streams and events of one wrapped model (CUDA only; no-ops on the CPU).

# Note [streams and events]
One `Streams` object per wrapped model owns every stream and event (created lazily, CUDA only):
- compute: the current stream when a hook runs (usually the default stream); all ops and all
  device allocations and frees of scope buffers happen on it, so the caching allocator's
  stream-ordered reuse is always safe.
- h2d ("copy stream"): host-to-device copies of weights (and of existing grads when
  accumulating), so the next scope loads while the current one computes.
- d2h: device-to-host copies of gradients, on their own stream so both PCIe directions are used.
- cast: the conversions of loads that change dtype (`Policy(cast="device")`, the dequantization
  of `Policy(frozen_format)`). They are kernels: on the copy stream they would hold back the
  next copy until they finish (the copy stream runs in order), so the PCIe link would idle
  while they run. On a stream of their own, each chunk's conversion waits only for that
  chunk's copy, and the copies go on back to back (Note [progressive loads] in scopes/loading.py).
- step: the copies and kernels of optimizer steps run on the device during backward_and_step
  (Note [device steps] in optim/device_steps.py), issued by the optimizer worker: on a stream of
  their own they neither wait behind the next forward's loads nor hold them back.
- gathered: waits for the all-gathers of sharded loads (`data_parallel(shard_loads=True)`, Note
  [sharded loads] in distributed/sharded_loads.py); a load's `weights_ready` is recorded there, so the copy
  stream goes on with the next scope's slice while NCCL gathers this one.

# Note [ordering across streams]
A device buffer is allocated on compute, then the copy stream waits on an event recorded there
(`alloc_done`): the memory may have just been freed by compute and still be read by queued
kernels. Compute waits on `weights_ready` before the first use, and the release (resize to 0) is
issued on compute after the last use, so it is ordered after every kernel that reads the scope.
Gradients read by a d2h copy are kept alive by holding a reference next to the copy's event
(no `record_stream`) until compute has waited on that event. The host never waits, except once at
the end of backward so that `p.grad` is complete when `backward()` returns, and before the first
write to a master while a copy from it may still be in flight (`sync_master_reads`).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch


class Streams:
    """The compute stream and the side streams (copy-in, copy-out, cast, gathered, step) of one
    wrapped model, and the events of the copies that may still read host masters."""

    # Side streams that lag on the CPU, for the tests (tests/lazy_streams.py); never in use.
    lagging = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            _cuda_calls()  # CUDA initialized once (Note [stream calls without Python wrappers])
        self._side: dict[str, Any] = {}  # the side streams by name, created on first use
        self._h2d: Any = None  # _side["h2d"] once made: asked at each load and each copy of experts
        self._unsynced_h2d: list[Any] = []  # events of copies that may still read host masters
        # The current stream before `on()` made a side stream current; None when none is
        # (Note [interrupts]).
        self.switched_from: Any = None
        # Set while side-stream copies are enqueued whose event compute does not wait for yet;
        # still set after an interrupt there (Note [copies an interrupt left]).
        self.copies_unwaited = False

    def compute(self) -> Any:
        return self.current() if self.is_cuda else None

    def current(self) -> Any:
        """The current stream of the model's CUDA device (torch.cuda.current_stream)."""
        cuda = _cuda_calls()
        index = self.device.index
        stream_id, index, kind = cuda.get_current(torch.cuda.current_device() if index is None else index)
        return cuda.new_stream(cuda.stream_type, stream_id=stream_id, device_index=index, device_type=kind)

    def h2d(self) -> Any:
        stream = self._h2d
        if stream is None and self.is_cuda:
            stream = self._h2d = self._side_stream("h2d")
        return stream

    def d2h(self) -> Any:
        return self._side_stream("d2h")

    def cast(self) -> Any:
        return self._side_stream("cast")

    def gathered(self) -> Any:
        return self._side_stream("gathered")

    def step(self) -> Any:
        return self._side_stream("step")

    def _side_stream(self, name: str) -> Any:
        """The side stream `name` (see the Note), created on first use; None on the CPU."""
        stream = self._side.get(name)
        if stream is None and self.is_cuda:
            stream = self._side[name] = torch.cuda.Stream(self.device)
        return stream

    @staticmethod
    def record(stream: Any) -> Any:
        if stream is None:
            return None
        cuda = _cuda_calls()
        # blocking: a host that does wait on it (end of backward, the optimizer worker) sleeps
        # instead of spinning on a core the CPU optimizer could use.
        event = cuda.new_event(cuda.event_type, enable_timing=False, blocking=True, interprocess=False)
        cuda.record(event, stream)  # torch.cuda.Event(blocking=True).record(stream)
        return event

    @staticmethod
    def wait(stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            cuda = _cuda_calls()
            cuda.wait(event, stream)  # stream.wait_event(event)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        """`with streams.on(stream):` enqueues the block's work on `stream` (nothing on the CPU)."""
        return _OnStream(self, stream) if stream is not None else _NO_SWITCH

    def restore(self) -> None:
        """Make the stream that was current before `on()` switched current again, if an
        interrupt skipped `_OnStream.__exit__` (Note [interrupts]); called at the entry points."""
        previous = self.switched_from
        if previous is not None:
            _set_current(previous)
            self.switched_from = None

    def enqueuing(self) -> contextlib.AbstractContextManager:
        """`with streams.enqueuing():` around side-stream copies up to where compute will wait for
        their events (Note [copies an interrupt left])."""
        return _Enqueuing(self)

    def wait_for_left_copies(self) -> None:
        """Before a scope's buffer is freed: compute waits for every copy and conversion so far
        if an interrupt left some it would not wait for (Note [copies an interrupt left])."""
        if self.copies_unwaited:
            compute = self.compute()
            self.wait(compute, self.record(self.h2d()))
            self.wait(compute, self.record(self.cast()))
            self.copies_unwaited = False

    def reads_masters(self, event: Any) -> None:
        """`event` follows a copy that reads host masters (sync_master_reads waits for it)."""
        if event is not None:
            self._unsynced_h2d.append(event)
            if len(self._unsynced_h2d) > 64:
                self._unsynced_h2d = [e for e in self._unsynced_h2d if not e.query()]

    def sync_master_reads(self) -> None:
        """Before a master is written: wait (host side) for every copy that may still read one."""
        if self._unsynced_h2d:
            for event in self._unsynced_h2d:
                event.synchronize()
            self._unsynced_h2d.clear()

    def memory(self) -> str:
        """For debug logs: the device memory allocated now."""
        if not self.is_cuda:
            return ""
        return f"; device memory allocated {torch.cuda.memory_allocated(self.device) / 2**20:.1f} MiB"


class _Enqueuing:
    """What `Streams.enqueuing()` returns: sets `copies_unwaited` in the block and puts back what
    it found when the block ends without an exception (Note [copies an interrupt left])."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.found = False

    def __enter__(self) -> None:
        self.found = self.streams.copies_unwaited
        self.streams.copies_unwaited = True

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.streams.copies_unwaited = self.found


# Note [copies an interrupt left]
# A load's chunks and the routed experts' rows are copied on the copy stream (converted on the
# cast stream) into the scope's device buffer, and compute waits for their event before the
# release frees that buffer on compute. A KeyboardInterrupt after a copy is enqueued and before
# its event is kept (LoadProgress.copy_more, mark_chunk) or waited for (ExpertRows._copy) leaves a
# copy nothing orders the free after: the caching allocator could hand the memory on while the
# copy still writes it. So those paths run in `streams.enqueuing()` (a copy of experts, at every
# layer of a decode step, does the same inline), which sets `copies_unwaited` and puts back what
# it found only when they end normally (one an earlier interrupt left stays set); a release that
# finds it set makes compute wait for both side streams first, which covers every copy and
# conversion enqueued so far (each stream runs in order).

_NO_SWITCH = contextlib.nullcontext()  # reusable, and reentrant: nothing to switch on the CPU


class _OnStream:
    """What `Streams.on(stream)` returns on CUDA: makes `stream` current in the block. It
    records the stream to go back to before switching, so that the next entry point switches
    back if an interrupt skipped `__exit__` (Note [interrupts])."""

    def __init__(self, streams: Streams, stream: Any) -> None:
        self.streams = streams
        self.stream = stream
        self.previous: Any = None

    def __enter__(self) -> None:
        streams = self.streams
        self.previous = streams.current()
        if streams.switched_from is None:  # the outermost switch: what to go back to
            streams.switched_from = self.previous
        _set_current(self.stream)

    def __exit__(self, *exc: object) -> None:
        _set_current(self.previous)
        if self.previous is self.streams.switched_from:
            self.streams.switched_from = None


# Note [stream calls without Python wrappers]
# A routed decode step switches streams, records events and waits on them several times per
# layer, and every streamed scope does at each load. torch.cuda's Python wrappers of those calls
# (current_stream, set_stream, Event, Event.record, Stream.wait_event) each add frames of argument
# handling (the device's index resolved, CUDA's lazy initialization checked) around the one C
# function they end in. Streams calls those C functions itself, with the arguments the wrappers
# would pass: the same streams and events, in the same order, on the device. CUDA is initialized
# once, when the first CUDA Streams is made.


class _CudaCalls(NamedTuple):
    """The C functions torch.cuda's stream and event wrappers call (Note [stream calls without Python wrappers])."""

    get_current: Any  # device index -> (stream id, device index, device type)
    set_current: Any  # (stream_id=, device_index=, device_type=)
    new_stream: Any  # _CudaStreamBase.__new__
    stream_type: type
    new_event: Any  # _CudaEventBase.__new__
    event_type: type
    record: Any  # (event, stream)
    wait: Any  # (event, stream): the stream waits for the event


_CUDA: list[_CudaCalls | None] = [None]


def _cuda_calls() -> _CudaCalls:
    """The C functions, found (and CUDA initialized) on the first call."""
    calls = _CUDA[0]
    if calls is None:
        torch.cuda.init()
        C = torch._C
        calls = _CUDA[0] = _CudaCalls(C._cuda_getCurrentStream, C._cuda_setStream, C._CudaStreamBase.__new__,
                                      torch.cuda.Stream, C._CudaEventBase.__new__, torch.cuda.Event,
                                      C._CudaEventBase.record, C._CudaEventBase.wait)
    return calls


def _set_current(stream: Any) -> None:
    """torch.cuda.set_stream(stream), for a stream that is not None."""
    _cuda_calls().set_current(stream_id=stream.stream_id, device_index=stream.device_index,
                              device_type=stream.device_type)
