"""The frozen formats: how `Policy(frozen_format=name)` keeps frozen masters compressed on the host,
one object per format behind one protocol (`FrozenFormat`), found by name in a registry.

# Note [frozen formats]
A frozen format says how a compressed master (Note [compressed masters] in storage/compress.py) is
laid out in its scope's host buffer (`nbytes`), how its values are compressed into those bytes on
the host (`pack`) and read back there (`unpack`), how a load restores the device copy from the
bytes it copied (`unpack_into`, on the cast stream), how the rows of one routed expert cross alone
(`rows`, `unpack_rows_into`: Note [routed experts] in scopes/experts.py), and whether it can
restore a load's chunk in one kernel (`fuse`). The core (the packed master in compress.py, the
scope's loads, the experts' copies, masters in files) calls only these methods, so it never
branches on a format's name, and a new format is one module that implements the protocol and
calls `register_frozen_format` when imported; the package's `__init__.py` imports the built-in
ones (storage/fp8.py, storage/int8.py). This registry sits with Policy, at the bottom of the
layers, because Policy checks the name it is given against it. A duplicate name raises, as
torchao's op tables do, so two modules cannot silently replace each other's format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# Reads rows [start, stop) of a tensor (dim 0), in increasing order, each once: a tensor not in
# memory, read a block at a time (offtensor.load, Note [loading scope by scope] in model/load.py).
RowReader = Callable[[int, int], torch.Tensor]

# One conversion of a load (FrozenFormat.fuse): the master's dtype, the offset of its host bytes in
# the load's staging buffer, that of its device copy in the scope's device buffer (both in bytes),
# and the device copy.
Conversion = tuple[torch.dtype, int, int, torch.Tensor]


class FusedConversions(Protocol):
    """The conversions of a load's chunks, one kernel per chunk (FrozenFormat.fuse)."""

    def launch(self, chunk: int, staging: torch.Tensor, out_flat: torch.Tensor) -> None:
        """Restore the chunk's masters from `staging` (the load's uint8 staging buffer, host layout)
        into `out_flat` (the scope's uint8 device buffer), on the current stream."""
        ...


class FrozenFormat(Protocol):
    """One way of keeping frozen masters compressed on the host (Note [frozen formats]). A master
    has at least 2 dimensions (rows are dim 0); `dtype` is its parameter's, `host` its bytes
    (uint8, `nbytes` of them at least)."""

    name: str  # what Policy(frozen_format=...) calls it

    def nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        """Host bytes of a master: its place in the scope's host layout, what a load copies."""
        ...

    def pack(self, host: torch.Tensor, value: torch.Tensor | RowReader, dtype: torch.dtype, shape: torch.Size,
             name: str) -> None:
        """Compress `value` (any float dtype, of `shape`; or a RowReader of its rows) into `host`
        (on the CPU). `name`: the parameter's qualified name, for a warning."""
        ...

    def unpack(self, host: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The master's values: a new tensor of `dtype` and `shape` on host's device."""
        ...

    def unpack_into(self, out: torch.Tensor, host: torch.Tensor, dtype: torch.dtype) -> None:
        """Restore the device copy `out` (contiguous, the master's shape, the compute dtype) from
        `host` (on out's device) on the current stream: bit for bit `unpack()` cast to out's dtype."""
        ...

    def rows(self, host: torch.Tensor, dtype: torch.dtype, shape: torch.Size, run: slice) -> tuple[torch.Tensor, ...]:
        """The host tensors holding rows `run` of the master, which an expert's copy moves."""
        ...

    def unpack_rows_into(self, out: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        """Restore those rows of the device copy (`out`) from `rows()`'s tensors copied to out's
        device, on the current stream: the bytes `unpack_into` of the whole master gives them."""
        ...

    def fuse(self, chunks: list[list[Conversion]], device: torch.device) -> FusedConversions | None:
        """One kernel per chunk for a load whose conversions are all of this format, or None: each
        master is then restored by its own `unpack_into`."""
        ...


_FORMATS: dict[str, FrozenFormat] = {}


def register_frozen_format(fmt: FrozenFormat) -> None:
    """Make `fmt` available as `Policy(frozen_format=fmt.name)` (Note [frozen formats])."""
    if not isinstance(fmt.name, str) or not fmt.name:
        raise ValueError(f"offtensor: a frozen format's name must be a non-empty string, got {fmt.name!r}")
    if fmt.name in _FORMATS:
        raise ValueError(
            f"offtensor: a frozen format named {fmt.name!r} is registered already "
            f"({type(_FORMATS[fmt.name]).__name__}); give the new one another name, or unregister "
            "the old one first (unregister_frozen_format)")
    _FORMATS[fmt.name] = fmt


def unregister_frozen_format(name: str) -> None:
    """Remove a registered format; models wrapped with it keep using it."""
    frozen_format(name)
    del _FORMATS[name]


def frozen_format(name: str) -> FrozenFormat:
    """The registered format called `name`."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"offtensor: no frozen format is registered as {name!r}; the registered ones are "
                         f"{describe_frozen_formats()}")
    return fmt


def frozen_format_names() -> tuple[str, ...]:
    """The registered formats' names, in the order they were registered."""
    return tuple(_FORMATS)


def describe_frozen_formats() -> str:
    """The registered names as Policy's error lists them: `'fp8', 'int8'`."""
    return ", ".join(repr(name) for name in _FORMATS)
