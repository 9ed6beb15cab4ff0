"""Side streams that lag, on the CPU: the stream and event protocol of CUDA, checked without a GPU.

# Note [lazy streams]
On the CPU every offtensor stream is None and every copy is done when it is issued, so a missing
wait (the compute stream reading a device copy before waiting for its load's event, the host
writing a master while a copy may still read it) cannot show there: the CUDA suite alone could
find one. `lazy_streams()` makes the side streams of `Streams` (h2d, d2h, cast, step, gathered)
real objects whose work lags as far as the protocol allows: a mutating op (a copy, an `out=`
kernel) issued inside `streams.on(side)` is queued, not run, and runs only when something waits
for an event recorded after it (`Streams.wait` by another stream, `Event.synchronize`), or when
the context ends. The compute stream stays immediate. New device buffers are filled with 0xFF
bytes (NaN in every float dtype), so a read before its load's wait computes with NaN, and a
master written before the copies reading it ran is copied with its new values: either way the
parity tests against the plain model fail, on the CPU. Paths that branch on `tensor.is_cuda`
(the gradients' device-to-host copies) keep their CPU behaviour: only work issued through
`Streams` lags.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    _pop_mode,
)

from offtensor.scopes import device_buffer, streams

# The optimizer worker waits for gradient copies (Event.synchronize) while the main thread queues
# more: the queues are shared between threads.
_LOCK = threading.RLock()


class LazyStream:
    """A side stream: its work, queued in order, runs when an event after it is waited for."""

    def __init__(self, name: str) -> None:
        self.name = name
        # (the work, the storages it touches), in order; those before `done` have run
        self.queue: list[tuple[Callable[[], object], set[int]]] = []
        self.issued = 0  # work items ever queued
        self.done = 0  # of which have run
        self.errors: list[str] = []  # queued work that found its memory freed (_run)

    def run_until(self, position: int) -> None:
        with _LOCK, _disable_current_modes():  # work may be run from inside another stream's `on`
            self._run_until(position)

    def _run_until(self, position: int) -> None:
        while self.done < position:
            work, _ = self.queue[self.done - (self.issued - len(self.queue))]
            self.done += 1
            work()
        drop = self.issued - len(self.queue)
        del self.queue[: self.done - drop]

    def pending_on(self, storage: int) -> bool:
        """Queued work that has not run touches the storage (by its `_cdata`)."""
        with _LOCK:
            return any(storage in touched for _, touched in self.queue[self.done - (self.issued - len(self.queue)):])

    def __repr__(self) -> str:
        return f"LazyStream({self.name}, {self.issued - self.done} queued)"


class LazyEvent:
    """An event recorded on a lazy stream: complete once the work queued before it has run."""

    def __init__(self, stream: LazyStream | None) -> None:
        self.stream, self.position = stream, stream.issued if stream is not None else 0

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)

    def query(self) -> bool:
        with _LOCK:
            return self.stream is None or self.stream.done >= self.position


class _Queue(TorchDispatchMode):
    """Inside `streams.on(side)`: mutating ops are queued on the side stream; others (views,
    allocations) run now."""

    def __init__(self, stream: LazyStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not func._schema.is_mutable:
            return func(*args, **kwargs)
        target = kwargs["out"] if "out" in kwargs else args[0]
        touched = {t.untyped_storage()._cdata for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)}
        # A version counter moves when an op is issued, as on a GPU, not when it runs (`_run`).
        if not target.is_inference():  # inference tensors have no version counter
            torch._C._autograd._unsafe_set_version_counter((target,), (target._version + 1,))
        with _LOCK:
            self.stream.queue.append((lambda: _run(func, args, kwargs, self.stream), touched))
            self.stream.issued += 1
        return target


def _run(func: Any, args: tuple, kwargs: dict, stream: LazyStream) -> None:
    """Run queued work, unless a tensor it touches was freed since (a release that did not wait
    for the work: on a GPU the work would write or read freed memory); that is noted instead."""
    for t in [*args, *kwargs.values()]:
        if isinstance(t, torch.Tensor) and t.numel() and (
                t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()):
            stream.errors.append(f"{func} on the {stream.name} stream ran after its memory was freed")
            return
    target = kwargs["out"] if "out" in kwargs else args[0]
    if target.is_inference():
        func(*args, **kwargs)
        return
    with torch.autograd._unsafe_preserve_version_counter(target):
        func(*args, **kwargs)


_COMPUTE = object()  # the compute stream: immediate


def _drop_left_queues() -> None:
    """`Streams.restore` at offtensor's entry points: on CUDA it makes the stream that an
    interrupt left current (one that skipped `on()`'s exit) the compute stream again; here the
    queueing mode such an interrupt left pushed goes."""
    while (stack := _get_current_dispatch_mode_stack()) and isinstance(stack[-1], _Queue):
        _pop_mode()


@contextlib.contextmanager
def lazy_streams() -> Iterator[list[LazyStream]]:
    """Patch `Streams` so that side streams lag (Note [lazy streams]); yields the streams made.
    At the end every queue is drained."""
    made: list[LazyStream] = []
    # Raw class attributes, so that `record` and `wait` go back as the staticmethods they are.
    saved = {name: vars(streams.Streams)[name] for name in
             ("compute", "h2d", "_side_stream", "record", "wait", "on", "restore", "lagging")}
    saved_allocate = device_buffer.DeviceBuffer.allocate
    saved_free = device_buffer.DeviceBuffer.free
    own_record_stream = vars(torch.Tensor).get("record_stream")  # else torch._C.TensorBase's

    def side(self: streams.Streams, name: str) -> LazyStream:
        stream = self._side.get(name)
        if stream is None:
            stream = self._side[name] = LazyStream(name)
            made.append(stream)
        return stream

    def record(stream: Any) -> LazyEvent | None:
        if stream is None:
            return None
        return LazyEvent(stream if isinstance(stream, LazyStream) else None)

    def wait(stream: Any, event: Any) -> None:
        if stream is not None and isinstance(event, LazyEvent) and event.stream is not stream:
            event.synchronize()

    def on(self: streams.Streams, stream: Any) -> contextlib.AbstractContextManager:
        return _Queue(stream) if isinstance(stream, LazyStream) else contextlib.nullcontext()

    def allocate(self: device_buffer.DeviceBuffer, s: streams.Streams) -> None:
        saved_allocate(self, s)
        self.flat.fill_(255)  # NaN in every float dtype: a read before its load's wait shows

    def free(self: device_buffer.DeviceBuffer, slots: list) -> bool:
        # On a GPU, the allocator may hand the memory to the next tensor at once: work still
        # queued on a side stream would write into that tensor.
        storage = self.flat.untyped_storage()._cdata
        for stream in made:
            if stream.pending_on(storage):
                stream.errors.append(f"a device buffer was freed while work queued on the {stream.name} "
                                     "stream still touches it")
        return saved_free(self, slots)  # whether it retired (Scope.release asks)

    streams.Streams.compute = lambda self: _COMPUTE  # type: ignore[method-assign]
    streams.Streams.lagging = True  # the gradients' copies go through the d2h stream too
    streams.Streams.h2d = lambda self: side(self, "h2d")  # type: ignore[method-assign]
    streams.Streams._side_stream = side  # type: ignore[method-assign]
    streams.Streams.record = staticmethod(record)  # type: ignore[method-assign, assignment]
    streams.Streams.wait = staticmethod(wait)  # type: ignore[method-assign, assignment]
    streams.Streams.on = on  # type: ignore[method-assign, assignment]
    streams.Streams.restore = lambda self: _drop_left_queues()  # type: ignore[method-assign]
    device_buffer.DeviceBuffer.allocate = allocate  # type: ignore[method-assign]
    device_buffer.DeviceBuffer.free = free  # type: ignore[method-assign]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign, assignment]
    try:
        yield made
    finally:
        for name, value in saved.items():
            setattr(streams.Streams, name, value)
        device_buffer.DeviceBuffer.allocate = saved_allocate  # type: ignore[method-assign]
        device_buffer.DeviceBuffer.free = saved_free  # type: ignore[method-assign]
        if own_record_stream is None:
            del torch.Tensor.record_stream
        else:
            torch.Tensor.record_stream = own_record_stream  # type: ignore[method-assign]
        for stream in made:
            stream.run_until(stream.issued)
        errors = [e for stream in made for e in stream.errors]
        assert not errors, "side-stream work and freed memory: " + "; ".join(errors[:3])
