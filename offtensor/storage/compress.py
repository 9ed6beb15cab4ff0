"""Frozen masters kept compressed on the host (`Policy(frozen_format=...)`): the packed master a
slot holds, whatever its format (offtensor/formats.py, Note [frozen formats]), and what an op on
its parameter gets.

# Note [compressed masters]
A frozen offloaded parameter (requires_grad False when `wrap` runs: a LoRA base, every weight of
a model wrapped for inference) is only ever read. With `Policy.frozen_format` its master is kept
on the host compressed by that format (fp8 and int8 built in: 1-byte values and one scale per
output row, Note [row-scaled formats] in storage/row_scaled.py), about half the bytes of bf16. A
load moves those bytes into a staging buffer and restores them on the cast stream into the
scope's device buffer (`unpack_into`, from `LoadProgress.mark_chunk` in scopes/loading.py), chunk
by chunk as they land, so ops see an ordinary tensor of the compute dtype, and the PCIe bytes
shrink as the host's do.

The compressed values ARE the parameter's values from then on. What the parameter reports is
`unpack()`, which the format computes as its device restore does, bit for bit, so `p`,
`state_dict()`, a temporary copy outside the scope and the scope's device copy are identical
(then cast to `compute_dtype` where it differs, as for any master). The parameter's own tensor
holds no values (a NaN scalar expanded to its shape, so a read that bypassed offtensor would be
visibly wrong rather than silently plausible); every read through the parameter gets the unpacked
values (`packed_torch_function`). Writes through the parameter (`p.copy_`, `load_state_dict`,
`nn.init`, `p.data = t`) compute on the unpacked values and compress them again: afterwards `p`
reports the new compressed values, which is what the forward computes. Not inside its scope's
forward, which computes with the device copy: there a write raises, naming it, and changes
nothing (through the parameter at the op, through the copy a loaded scope's modules see at the
call's end). Writes to a tensor taken from it (`p.data.add_()`, `p.detach().copy_()`) change a
copy and are lost, as both `p` and the forward keep the stored values. A compressed parameter
cannot be trained (the optimizer would step values that compressing again rounds away): setting
`requires_grad` on it raises, naming the parameter and the fix.

Only matrices are compressed (2-D or more: rows are dim 0), of a float dtype of 2 bytes or more;
1-D parameters (norms, biases) and tensors below `MIN_NUMEL` elements stay in their dtype, costing
little and often mattering most.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

from ..formats import Conversion, FrozenFormat, FusedConversions, RowReader, frozen_format

MIN_NUMEL = 4096  # smaller tensors stay uncompressed (Note [compressed masters])
CHUNK_NUMEL = 2**18  # read (and compress) this many elements at a time: the fp32 temporaries stay small


def compresses(fmt: FrozenFormat | None, p: torch.Tensor) -> bool:
    """Whether a parameter is stored compressed under `fmt` (Note [compressed masters])."""
    return (fmt is not None and not p.requires_grad and p.is_floating_point() and p.dim() >= 2
            and p.element_size() >= 2 and p.numel() >= MIN_NUMEL)


class StoredMaster(Protocol):
    """A master kept apart from its parameter's own tensor, which is a placeholder: compressed
    on the host (PackedMaster) or in a file (storage/file_masters.py, FileMaster).

    This protocol is the one seam through which compression plugs into the core: a slot holds a
    `StoredMaster | None` (`ParamSlot.packed`), and the core (the scope's loads, the dispatch of
    ops on the parameter through packed_torch_function and packed_property) calls only these
    methods, never a format's code. Every read through the parameter gets `unpack()`, every
    write goes through `check_write()` then `pack()` (Note [compressed masters]); a load converts
    its host bytes with `unpack_into`. A new way of keeping masters implements this protocol."""

    name: str

    @property
    def nbytes(self) -> int: ...

    def unpack(self) -> torch.Tensor: ...

    def unpack_into(self, out: torch.Tensor, packed: torch.Tensor) -> None: ...

    def pack(self, value: torch.Tensor | RowReader) -> None: ...

    def placeholder(self) -> torch.Tensor: ...

    def kept_as(self) -> str: ...

    def check_write(self) -> None: ...

    def refuse_training(self) -> NoReturn: ...


@dataclass(eq=False)
class PackedMaster:
    """A frozen parameter's master, compressed on the host by its format (Note [compressed masters])."""

    name: str  # qualified name, for errors
    format: FrozenFormat
    dtype: torch.dtype  # the parameter's dtype: what it reports
    shape: torch.Size
    host: torch.Tensor  # uint8, format.nbytes(shape, dtype): its bytes, in the scope's host buffer

    @classmethod
    def on(cls, carve: Callable[[int, torch.dtype, torch.Size], torch.Tensor], offset: int, name: str,
           fmt: FrozenFormat, dtype: torch.dtype, shape: torch.Size) -> PackedMaster:
        """Lay one out at `offset` bytes of a host buffer (`carve(offset, dtype, shape)` gives a
        tensor there, as HostBuffer.tensor); its values are unset until `pack`."""
        shape = torch.Size(shape)
        return cls(name, fmt, dtype, shape, carve(offset, torch.uint8, torch.Size((fmt.nbytes(shape, dtype),))))

    def pack(self, value: torch.Tensor | RowReader) -> None:
        """Compress `value` (any float dtype; or a RowReader) into the host bytes, as the format
        does (on the value's device when it is a tensor on an accelerator, then only the
        compressed bytes cross to the host; else on the CPU: the same bytes)."""
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"offtensor: cannot store a tensor of shape {tuple(value.shape)} in compressed "
                             f"parameter {self.name!r} of shape {tuple(self.shape)}")
        self.format.pack(self.host, value, self.dtype, self.shape, self.name)

    @property
    def nbytes(self) -> int:
        """Bytes in the host buffer."""
        return self.host.numel()

    def unpack(self) -> torch.Tensor:
        """The parameter's values: a new host tensor of its dtype and shape."""
        return self.format.unpack(self.host, self.dtype, self.shape)

    def unpack_into(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        """Restore on `out`'s device: `packed` holds this master's host bytes (uint8, on the
        device), `out` is the device copy (contiguous, of the compute dtype). Bit-identical to
        `unpack()` cast to out's dtype."""
        self.format.unpack_into(out, packed, self.dtype)

    def rows(self, run: slice) -> tuple[torch.Tensor, ...]:
        """The host tensors holding rows `run` (one expert's, Note [routed experts] in scopes/experts.py)."""
        return self.format.rows(self.host, self.dtype, self.shape, run)

    def unpack_rows_into(self, out: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        """Restore rows of the device copy (`out`) from `rows()`'s tensors, copied to out's device."""
        self.format.unpack_rows_into(out, rows)

    def placeholder(self) -> torch.Tensor:
        """The parameter's own tensor: no values (Note [compressed masters])."""
        return torch.full((), float("nan"), dtype=self.dtype).expand(self.shape)

    def kept_as(self) -> str:
        return f"stored compressed on the host (Policy(frozen_format={self.format.name!r}))"

    def check_write(self) -> None:
        pass  # writes compress again

    def refuse_training(self) -> NoReturn:
        raise RuntimeError(
            f"offtensor: parameter {self.name!r} is stored compressed on the host "
            f"(Policy(frozen_format={self.format.name!r})) and cannot be trained: an optimizer "
            "step would be rounded away when it is requantized. Unfreeze it before offtensor.wrap, "
            "or keep it uncompressed (offtensor.unwrap(model), then wrap without frozen_format, or "
            "with a predicate returning a Policy without frozen_format for its module)"
        )


def fused_conversions(chunks: list[list[tuple[StoredMaster | None, int, int, torch.Tensor]]],
                      device: torch.device) -> FusedConversions | None:
    """For a load whose chunks convert (master, its offset in staging, its device copy's offset
    in the device buffer in bytes, the device copy): one kernel per chunk where every conversion
    is a compressed master of one format that has such a kernel (`FrozenFormat.fuse`), else None
    (each is its own, `unpack_into`)."""
    fmt: FrozenFormat | None = None
    fused: list[list[Conversion]] = []
    for chunk in chunks:
        fused.append([])
        for master, offset, device_offset, out in chunk:
            if not isinstance(master, PackedMaster) or (fmt is not None and master.format is not fmt):
                return None
            fmt = master.format
            fused[-1].append((master.dtype, offset, device_offset, out))
    return fmt.fuse(fused, device) if fmt is not None else None


def rows_cols(shape: torch.Size) -> tuple[int, int]:
    """A tensor of `shape` as a matrix: (dim 0, the rest)."""
    rows = shape[0]
    return rows, math.prod(shape) // max(rows, 1)


def row_reader(value: torch.Tensor | RowReader) -> RowReader:
    """`value` read a block of rows at a time."""
    if not isinstance(value, torch.Tensor):
        return value
    return lambda start, stop: value.detach()[start:stop]


def copy_rows(dest: torch.Tensor, value: torch.Tensor | RowReader) -> None:
    """`dest.copy_(value)`, a block of rows at a time when `value` is a RowReader (small
    temporaries); a reader with `read_into(dest)` (a checkpoint's tensor) may read into `dest`
    whole instead, returning True (Note [loading at the disk's speed] in model/load.py)."""
    read_into = None if isinstance(value, torch.Tensor) else getattr(value, "read_into", None)
    if read_into is not None and read_into(dest):
        return
    if isinstance(value, torch.Tensor) or dest.dim() == 0:
        dest.copy_(value if isinstance(value, torch.Tensor) else value(0, 1))
        return
    rows, cols = rows_cols(dest.shape)
    step = max(1, CHUNK_NUMEL // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        dest[start:stop].copy_(value(start, stop))


# ---- what an op on a compressed parameter gets (Note [compressed masters]) -----------------

# Queries about the parameter object and its storage, not its values: on the parameter.
_ON_PARAMETER = {
    torch.Tensor.data_ptr, torch.Tensor.untyped_storage, torch.Tensor.storage_offset,
    torch.Tensor.is_pinned, torch.Tensor.is_shared, torch.Tensor.get_device, torch.Tensor.__hash__,
    torch.Tensor.retain_grad, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.size,
    torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.element_size, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_signed,
}
# Layout queries: the parameter's own tensor is an expanded scalar; answer for a dense one.
_ON_LAYOUT = {torch.Tensor.stride, torch.Tensor.is_contiguous}


def compressed_special(func: Any) -> bool:
    """packed_torch_function treats `func` otherwise than as an op on the values."""
    return (func in _ON_PARAMETER or func in _ON_LAYOUT or func is torch.Tensor.requires_grad_
            or func is torch.Tensor.detach)


def packed_of(p: Any) -> StoredMaster | None:
    slot = getattr(p, "_ot", None)
    return getattr(slot, "packed", None) if slot is not None else None


def _refuse_training(p: Any) -> None:
    packed = packed_of(p)
    assert packed is not None
    packed.refuse_training()


# What packed_property returns for an access that is the same as on a plain parameter.
AS_PLAIN = object()


def packed_property(name: str, prop: str, args: tuple) -> Any:
    """A property access (`name`: `__get__` or `__set__`) on compressed parameter `args[0]` where
    it differs from a plain parameter's: `p.data` gives the unpacked values, and setting it
    requantizes; `requires_grad = True` is refused. Anything else, AS_PLAIN: `p.grad`, `p.shape`
    read the parameter itself (unpacking the values for them would cost a host dequantization
    of the whole matrix at every `p.grad` read, which the backward's accumulation check makes
    for each parameter), and `w.T` is an op, whose dispatch unpacks."""
    if prop == "data" and name == "__get__":
        return _unpacked(args[0])
    if prop == "data" and name == "__set__":
        _write(args[0], lambda v: v.copy_(args[1]))
        return None
    if prop == "requires_grad" and name == "__set__" and args[1]:
        _refuse_training(args[0])
    return AS_PLAIN


def packed_torch_function(func: Any, args: tuple, kwargs: dict, params: list[Any], written: set[int],
                          master_only: set[Any], dispatch: Callable[[], Any]) -> Any:
    """`__torch_function__` of an op with compressed parameters among `params` (subclass
    dispatch off; property accesses are packed_property's). `written`: the ids of the parameters
    an in-place `func` writes; `master_only`: the ops dispatch/param.py runs on the master; `dispatch()`:
    the usual path (whose materialize gives unpacked values where it would give the master)."""
    packed = [p for p in params if packed_of(p) is not None]
    if func is torch.Tensor.requires_grad_ and (args[1] if len(args) > 1 else kwargs.get("requires_grad", True)):
        _refuse_training(args[0])
    if func is torch.Tensor.detach:
        return _unpacked(args[0])
    if func in _ON_PARAMETER or func is torch.Tensor.requires_grad_:
        return func(*args, **kwargs)
    if func in _ON_LAYOUT:
        return func(*_swap(args, packed, _dense_meta), **kwargs)
    if func in master_only:  # value reads (`tolist`, `item`, `numpy`, `__bool__`): the values
        return func(*_swap(args, packed, _unpacked), **kwargs)
    targets = [p for p in packed if id(p) in written]
    if targets:
        return _write_op(func, args, kwargs, packed, targets)
    return dispatch()


def _unpacked(p: Any) -> torch.Tensor:
    packed = packed_of(p)
    assert packed is not None
    return packed.unpack()


def _dense_meta(p: Any) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def _swap(args: tuple, params: list[Any], make: Callable[[Any], torch.Tensor]) -> tuple:
    subs = {id(p): make(p) for p in params}

    def one(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(subs.get(id(x), x) for x in a)
        return subs.get(id(a), a)

    return tuple(one(a) for a in args)


def _write(p: Any, write: Callable[[torch.Tensor], Any]) -> None:
    """Apply `write` to the unpacked values of `p` and requantize them."""
    packed = packed_of(p)
    assert packed is not None
    packed.check_write()
    p._ot.scope.before_master_write(p._ot)  # no copy reads it; stale device copies go
    values = packed.unpack()
    write(values)
    packed.pack(values)
    torch.autograd.graph.increment_version(p)  # as an in-place write to a plain parameter


def _write_op(func: Any, args: tuple, kwargs: dict, packed: list[Any], targets: list[Any]) -> Any:
    """An in-place op writing compressed parameters (`targets`): it runs on the unpacked values
    of every compressed parameter it names, and those it writes are requantized after (Note
    [compressed masters])."""
    for p in targets:
        p._ot.packed.check_write()
        _refuse_in_call(p._ot)
    for p in targets:
        p._ot.scope.before_master_write(p._ot)
    subs = {id(p): p._ot.packed.unpack() for p in packed}

    def one(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(subs.get(id(x), x) for x in a)
        return subs.get(id(a), a)

    result = func(*(one(a) for a in args), **{k: one(v) for k, v in kwargs.items()})
    back = {}  # id(unpacked values) -> the parameter: an in-place op returns what it wrote
    for p in targets:
        p._ot.packed.pack(subs[id(p)])
        torch.autograd.graph.increment_version(p)
        back[id(subs[id(p)])] = p
    if isinstance(result, (list, tuple)):
        return type(result)(back.get(id(r), r) for r in result)
    return back.get(id(result), result)


def _refuse_in_call(slot: Any) -> None:
    """A compressed master is not written inside its scope's forward (Note [compressed masters])."""
    if slot.scope.calls.running > 0:
        raise RuntimeError(
            f"offtensor: parameter {slot.name!r} is written in place inside the forward of its scope "
            f"{slot.scope.name!r}, where its compressed master (Policy(frozen_format=...)) cannot take "
            "the write as the forward would see it. Write it outside the forward (before or after it), "
            "or call offtensor.unwrap(model) first. Nothing was changed")


def quantize_dequantize(t: torch.Tensor, fmt: FrozenFormat | str) -> torch.Tensor:
    """The values `t` would have as a compressed master: what a model computes with under
    `Policy(frozen_format=fmt)` (references for tests, the benchmark's error report)."""
    fmt = frozen_format(fmt) if isinstance(fmt, str) else fmt
    packed = PackedMaster("tensor", fmt, t.dtype, t.shape, torch.empty(fmt.nbytes(t.shape, t.dtype), dtype=torch.uint8))
    packed.pack(t.detach().cpu())
    return packed.unpack().to(t.device)
