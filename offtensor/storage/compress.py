"""Frozen masters kept compressed on the host (`Policy(frozen_format="fp8" | "int8")`).

# Note [compressed masters]
A frozen offloaded parameter (requires_grad False when `wrap` runs: a LoRA base, every weight of
a model wrapped for inference) is only ever read. With `Policy.frozen_format` its master is kept
on the host as 1-byte values (fp8 e4m3 or int8) and one scale per output row (row-wise absmax,
the scale stored in the parameter's dtype), about half the bytes of bf16. A load moves those
bytes into a staging buffer and dequantizes them on the cast stream into the scope's device
buffer (`unpack_into`, from `LoadProgress.mark_chunk` in scopes/loading.py), chunk by chunk as
they land, so ops see an ordinary tensor of the compute dtype, and the PCIe bytes halve too.

The compressed values ARE the parameter's values from then on. What the parameter reports is
`unpack()`: `values.to(dtype) * scale[:, None]`, computed in the parameter's dtype (exact
conversion of the 1-byte values, one rounding of the product), the very operation the device
runs, so `p`, `state_dict()`, a temporary copy outside the scope and the scope's device copy are
bit-identical (then cast to `compute_dtype` where it differs, as for any master). The
parameter's own tensor holds no values (a NaN scalar expanded to its shape, so a read that
bypassed offtensor would be visibly wrong rather than silently plausible); every read through
the parameter gets the unpacked values (`packed_torch_function`). Writes through the parameter
(`p.copy_`, `load_state_dict`, `nn.init`, `p.data = t`) compute on the unpacked values and
requantize: afterwards `p` reports the requantized values, which is what the forward computes.
Writes to a tensor taken from it (`p.data.add_()`, `p.detach().copy_()`) change a copy and are
lost, as both `p` and the forward keep the stored values. A compressed parameter cannot be
trained (the optimizer would step values that a requantization then rounds away): setting
`requires_grad` on it raises, naming the parameter and the fix.

Only matrices are compressed (2-D or more: rows are dim 0); 1-D parameters (norms, biases) and
tensors below `MIN_NUMEL` elements stay in their dtype, costing little and often mattering most.

The scales are stored in the parameter's dtype. bfloat16 and float32 hold any row's scale; a
float16 row whose largest value is below float16's smallest normal number times the format's
maximum gets a subnormal scale with few bits, or none (it underflows to zero and is replaced by
the smallest normal number, which rounds the row's values to zero under int8). Packing a float16
parameter therefore measures each row's error and warns, naming the parameter and the fix, when
rows lose over `COARSE_ROW_ERROR` of their values; small rows a subnormal scale still holds
(largest values about 1e-4) do not warn.
"""

from __future__ import annotations

import enum
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch

MIN_NUMEL = 4096  # smaller tensors stay uncompressed (Note [compressed masters])
# A float16 row compressed with more relative error than this warns (PackedMaster.pack): e4m3
# keeps about 3% of a row, int8 0.5%; a scale float16 cannot hold loses much more.
COARSE_ROW_ERROR = 0.1
_SCALE_ALIGN = 64  # bytes: the scales follow the values at this alignment
_CHUNK_NUMEL = 2**18  # quantize this many elements at a time: the fp32 temporaries stay small
_DEVICE_CHUNK_NUMEL = 2**24  # the same on an accelerator, where each block costs a launch or two


class FrozenFormat(enum.Enum):
    """How frozen masters are stored on the host (Policy.frozen_format)."""

    FP8 = "fp8"  # torch.float8_e4m3fn, per-row scale = absmax / 448
    INT8 = "int8"  # torch.int8, per-row scale = absmax / 127, rounded to nearest

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FrozenFormat.FP8 else torch.int8

    @property
    def max(self) -> float:
        return 448.0 if self is FrozenFormat.FP8 else 127.0


def compresses(fmt: FrozenFormat | None, p: torch.Tensor) -> bool:
    """Whether a parameter is stored compressed under `fmt` (Note [compressed masters])."""
    return (fmt is not None and not p.requires_grad and p.is_floating_point() and p.dim() >= 2
            and p.element_size() >= 2 and p.numel() >= MIN_NUMEL)


def _rows_cols(shape: torch.Size) -> tuple[int, int]:
    rows = shape[0]
    return rows, math.prod(shape) // max(rows, 1)


def packed_nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    """Host bytes of a compressed master: the 1-byte values, then one scale per row."""
    rows, _ = _rows_cols(shape)
    return _scale_offset(shape) + rows * dtype.itemsize


def _scale_offset(shape: torch.Size) -> int:
    return -(-math.prod(shape) // _SCALE_ALIGN) * _SCALE_ALIGN


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
    """A frozen parameter's master, compressed on the host (Note [compressed masters])."""

    name: str  # qualified name, for errors
    format: FrozenFormat
    dtype: torch.dtype  # the parameter's dtype: what it reports, and the scales' dtype
    shape: torch.Size
    values: torch.Tensor  # host, format.dtype, (rows, cols)
    scale: torch.Tensor  # host, dtype, (rows,)

    @classmethod
    def on(cls, carve: Callable[[int, torch.dtype, torch.Size], torch.Tensor], offset: int, name: str,
           fmt: FrozenFormat, dtype: torch.dtype, shape: torch.Size) -> PackedMaster:
        """Lay one out at `offset` bytes of a host buffer (`carve(offset, dtype, shape)` gives a
        tensor there, as HostBuffer.tensor); its values are unset until `pack`."""
        rows, cols = _rows_cols(shape)
        return cls(name, fmt, dtype, torch.Size(shape), carve(offset, fmt.dtype, torch.Size((rows, cols))),
                   carve(offset + _scale_offset(shape), dtype, torch.Size((rows,))))

    def pack(self, value: torch.Tensor | RowReader) -> None:
        """Quantize `value` (any float dtype; or a RowReader) into the values and scales, in
        row blocks: on the value's device when it is a tensor on an accelerator (then only the
        1-byte values and the scales cross to the host), else on the CPU. Both give the same
        bytes (IEEE division and round-to-nearest casts on either)."""
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"offtensor: cannot store a tensor of shape {tuple(value.shape)} in compressed "
                             f"parameter {self.name!r} of shape {tuple(self.shape)}")
        rows, cols = _rows_cols(self.shape)
        read = _reader(value)
        device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
        numel = _CHUNK_NUMEL if device.type == "cpu" else _DEVICE_CHUNK_NUMEL
        step = max(1, numel // max(cols, 1))
        coarse = 0
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            block = read(start, stop).reshape(stop - start, cols).to(device=device, dtype=torch.float32, copy=True)
            scale = _row_scale(block, self.format, self.dtype)
            exact = block.clone() if self.dtype == torch.float16 else None
            q = block.div_(scale.float()[:, None]).clamp_(-self.format.max, self.format.max)
            if self.format is FrozenFormat.INT8:
                q.round_()
            q = q.to(self.format.dtype)
            if exact is not None:
                coarse += _coarse_rows(exact, q, scale)
            self.scale[start : start + step].copy_(scale)
            self.values[start : start + step].copy_(q)
        if coarse:
            warnings.warn(
                f"offtensor: {coarse} of {rows} rows of compressed parameter {self.name!r} lost over "
                f"{COARSE_ROW_ERROR:.0%} of their values in {self.format.value}: their largest values are too "
                f"small for a float16 scale (below float16's normal range, {torch.finfo(self.dtype).tiny:.2g}, "
                f"times {self.format.max:.0f}). Load the model in torch.bfloat16 (the same bytes, float32's "
                f"range), or keep this parameter on the device with Policy(param_filter=...).", stacklevel=2)

    @property
    def nbytes(self) -> int:
        """Bytes in the host buffer: the values, then the scales."""
        return packed_nbytes(self.shape, self.dtype)

    def unpack(self) -> torch.Tensor:
        """The parameter's values: a new host tensor of its dtype and shape."""
        out = self.values.to(self.dtype)
        out.mul_(self.scale[:, None])
        return out.view(self.shape)

    def unpack_into(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        """Dequantize on `out`'s device: `packed` holds this master's host bytes (uint8, on the
        device), `out` is the device copy (contiguous, of the compute dtype). Bit-identical to
        `unpack()` cast to out's dtype."""
        unpack_bytes_into(self.format, self.dtype, self.shape, out, packed)

    def placeholder(self) -> torch.Tensor:
        """The parameter's own tensor: no values (Note [compressed masters])."""
        return torch.full((), float("nan"), dtype=self.dtype).expand(self.shape)

    def kept_as(self) -> str:
        return f"stored compressed on the host (Policy(frozen_format={self.format.value!r}))"

    def check_write(self) -> None:
        pass  # writes requantize

    def refuse_training(self) -> NoReturn:
        raise RuntimeError(
            f"offtensor: parameter {self.name!r} is stored compressed on the host "
            f"(Policy(frozen_format={self.format.value!r})) and cannot be trained: an optimizer "
            "step would be rounded away when it is requantized. Unfreeze it before offtensor.wrap, "
            "or keep it uncompressed (offtensor.unwrap(model), then wrap without frozen_format, or "
            "with a predicate returning a Policy without frozen_format for its module)"
        )


def unpack_bytes_into(fmt: FrozenFormat, dtype: torch.dtype, shape: torch.Size, out: torch.Tensor,
                      packed: torch.Tensor) -> None:
    """PackedMaster.unpack_into for a master of `fmt`, `dtype` and `shape` whose host bytes
    (values, then scales) `packed` holds."""
    rows, cols = _rows_cols(shape)
    values = packed[: rows * cols].view(fmt.dtype).view(rows, cols)
    start = _scale_offset(shape)
    scale = packed[start : start + rows * dtype.itemsize].view(dtype)
    unpack_rows_into(fmt, values, scale, out.view(rows, cols))


def unpack_rows_into(fmt: FrozenFormat, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
    """Dequantize rows of a compressed master on `target`'s device: `values` (rows, cols) of
    `fmt`'s dtype and `scale` (rows,) of the master's dtype, on that device; `target` (rows,
    cols) of the compute dtype. Each row alone: the rows of one expert give the bytes the whole
    master's unpacking gives them (Note [routed experts] in scopes/experts.py)."""
    dtype, out, rows = scale.dtype, target, values.shape[0]
    scale = scale[:, None]
    if out.dtype == dtype and fmt is FrozenFormat.INT8:
        torch.mul(values, scale, out=target)  # one kernel: int8 promotes to the scale's dtype
    elif out.dtype == dtype and out.is_cuda and (fused := _fused_dequantize()) is not None:
        fused(values, scale.view(rows), target)  # one kernel (Note [fused fp8 dequantization])
    elif out.dtype == dtype:
        # Two kernels: PyTorch does not promote float8 in arithmetic.
        target.copy_(values)  # exact: 1-byte values fit every float dtype of 2 bytes or more
        target.mul_(scale)
    else:
        target.copy_(values.to(dtype).mul_(scale))


@functools.cache
def _fused_dequantize() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """The one-kernel fp8 dequantization (Note [fused fp8 dequantization] in storage/kernels.py), or
    None where Triton is not installed: then two PyTorch kernels do it."""
    try:
        from .kernels import dequantize_rows
    except ImportError:
        return None
    return dequantize_rows


class FusedDequantization:
    """The fp8 dequantizations of a scope's progressive load, one kernel per chunk (Note [load
    plans] in scopes/loading.py): a table on the device of each matrix's offsets (its values and
    scales in staging, its device copy in the scope's device buffer), rows' length and size, in
    chunk order; each chunk's kernel reads its rows of the table."""

    COLUMNS = 5  # values offset (bytes), scale offset and output offset (elements), numel, columns

    def __init__(self, rows: list[list[int]], chunks: list[tuple[int, int, int]], dtype: torch.dtype) -> None:
        self._host = torch.tensor(rows, dtype=torch.int64).reshape(-1, self.COLUMNS).pin_memory()
        self._table: torch.Tensor | None = None  # on the device, copied at the first launch
        self.chunks = chunks  # per chunk: (first row, rows, the largest numel)
        self.dtype = dtype

    @classmethod
    def plan(cls, chunks: list[list[tuple[StoredMaster | None, int, int, torch.Tensor]]],
             device: torch.device) -> FusedDequantization | None:
        """For a load whose chunks convert (master, its offset in staging, its device copy's
        offset in the device buffer in bytes, the device copy):
        one kernel per chunk, or None where not every conversion is an fp8 dequantization
        into the master's own dtype on a CUDA device with Triton (each is then its own,
        `unpack_into`)."""
        if device.type != "cuda" or _fused_dequantize() is None:
            return None
        entries = [e for chunk in chunks for e in chunk]
        if not entries:
            return None
        dtype = entries[0][3].dtype
        size = dtype.itemsize
        rows: list[list[int]] = []
        spans: list[tuple[int, int, int]] = []
        for chunk in chunks:
            spans.append((len(rows), len(chunk), max((out.numel() for *_, out in chunk), default=0)))
            for master, offset, device_offset, out in chunk:
                if (not isinstance(master, PackedMaster) or master.format is not FrozenFormat.FP8
                        or master.dtype != dtype or out.dtype != dtype or not out.is_contiguous()):
                    return None
                scale = offset + _scale_offset(master.shape)
                if scale % size or device_offset % size:
                    return None
                rows.append([offset, scale // size, device_offset // size, out.numel(), _rows_cols(master.shape)[1]])
        return cls(rows, spans, dtype)

    def launch(self, chunk: int, staging: torch.Tensor, out_flat: torch.Tensor) -> None:
        """Dequantize the chunk's matrices from `staging` (the load's uint8 staging buffer, host
        layout) into `out_flat` (the scope's uint8 device buffer), on the current stream."""
        from .kernels import dequantize_segments

        first, count, numel = self.chunks[chunk]
        if not count or not numel:
            return
        table = self._table
        if table is None:  # ordered before every launch: the same (current) stream
            table = self._table = self._host.to(out_flat.device, non_blocking=True)
        dequantize_segments(staging.view(torch.float8_e4m3fn), staging.view(self.dtype), out_flat.view(self.dtype),
                            table, first, count, numel)


# Reads rows [start, stop) of a tensor (dim 0), in increasing order, each once: a tensor not in
# memory, read a block at a time (offtensor.load, Note [loading scope by scope] in model/load.py).
RowReader = Callable[[int, int], torch.Tensor]


def _reader(value: torch.Tensor | RowReader) -> RowReader:
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
    rows, cols = _rows_cols(dest.shape)
    step = max(1, _CHUNK_NUMEL // max(cols, 1))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        dest[start:stop].copy_(value(start, stop))


def _coarse_rows(exact: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> int:
    """Rows whose compressed values lost over COARSE_ROW_ERROR of the row (relative error of its
    norm): a float16 scale below float16's normal range keeps few bits, and one that underflows
    to zero is replaced by the smallest normal number, which rounds the row's values to zero."""
    error = (q.float() * scale.float()[:, None] - exact).norm(dim=1)
    return int((error > COARSE_ROW_ERROR * exact.norm(dim=1)).sum())


def _row_scale(block: torch.Tensor, fmt: FrozenFormat, dtype: torch.dtype) -> torch.Tensor:
    """One scale per row, rounded to `dtype` (what is stored and what dequantization uses)."""
    amax = block.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax)).to(dtype)
    # A scale rounded down would put the row's largest value beyond the format's range (it is
    # clamped: a small error), one rounded to zero would divide by zero: use the smallest
    # normal number of the dtype there.
    return torch.where(scale > 0, scale, torch.tensor(torch.finfo(dtype).tiny, dtype=dtype))


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


def quantize_dequantize(t: torch.Tensor, fmt: FrozenFormat | str) -> torch.Tensor:
    """The values `t` would have as a compressed master: what a model computes with under
    `Policy(frozen_format=fmt)` (references for tests, the benchmark's error report)."""
    fmt = FrozenFormat(fmt)
    rows, cols = _rows_cols(t.shape)
    packed = PackedMaster(
        "tensor", fmt, t.dtype, t.shape, torch.empty(rows, cols, dtype=fmt.dtype),
        torch.empty(rows, dtype=t.dtype))
    packed.pack(t.detach().cpu())
    return packed.unpack().to(t.device)
