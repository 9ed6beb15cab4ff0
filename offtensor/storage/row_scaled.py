"""The row-scaled frozen formats: 1-byte values and one scale per output row (a FrozenFormat,
offtensor/formats.py). storage/fp8.py and storage/int8.py make and register the two.

# Note [row-scaled formats]
Each row (dim 0) of a compressed master gets one scale, its largest absolute value over the
format's largest value (448 for fp8 e4m3, 127 for int8), rounded to the parameter's dtype, in
which it is stored; the values are the row divided by the scale, clamped to the format's range and
cast to its 1-byte dtype (int8 rounds to nearest first). A row of zeros gets the scale 1. The host
bytes are the values (rows x cols), then the scales at the next multiple of SCALE_ALIGN bytes. The
parameter's values are `values.to(dtype) * scale[:, None]`, computed in the parameter's dtype
(exact conversion of the 1-byte values, one rounding of the product), the very operation the
device runs when it restores a load (`unpack_into`), one kernel or two (or, for fp8 on the CPU,
the same bits through float16: Note [fp8 on the CPU] in storage/fp8.py). Each row is restored
alone, so the rows of one routed expert give the bytes the whole master gives them (a 3-D expert
weight has one scale per expert). Quantizing runs in float32 on blocks of rows, on the value's
device when it is a tensor on an accelerator: IEEE division and round-to-nearest casts give the
same bytes there as on the CPU.

# Note [float16 scales]
The scales are stored in the parameter's dtype. bfloat16 and float32 hold any row's scale; a
float16 row whose largest value is below float16's smallest normal number times the format's
maximum gets a subnormal scale with few bits, or none (it underflows to zero and is replaced by
the smallest normal number, which rounds the row's values to zero under int8). Packing a float16
parameter therefore measures each row's error and warns, naming the parameter and the fix, when
rows lose over `COARSE_ROW_ERROR` of their values; small rows a subnormal scale still holds
(largest values about 1e-4) do not warn.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..formats import Conversion, FusedConversions, RowReader
from .compress import CHUNK_NUMEL, row_reader, rows_cols

# A float16 row compressed with more relative error than this warns (RowScaled.pack): e4m3
# keeps about 3% of a row, int8 0.5%; a scale float16 cannot hold loses much more.
COARSE_ROW_ERROR = 0.1
SCALE_ALIGN = 64  # bytes: the scales follow the values at this alignment
_DEVICE_CHUNK_NUMEL = 2**24  # CHUNK_NUMEL on an accelerator, where each block costs a launch or two


def scale_offset(shape: torch.Size) -> int:
    """Where a master's scales start in its host bytes."""
    return -(-math.prod(shape) // SCALE_ALIGN) * SCALE_ALIGN


class RowScaled:
    """A row-scaled frozen format (Note [row-scaled formats]): the family's layout, packing and
    restoring; a format of it says how a float becomes a value (`round`) and how values become
    the master's dtype on the device (`dequantize`)."""

    def __init__(self, name: str, dtype: torch.dtype, largest: float) -> None:
        self.name = name
        self.dtype = dtype  # of the values: 1 byte
        self.max = largest  # the largest value: a row's largest absolute value becomes it

    def nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        rows, _ = rows_cols(shape)
        return scale_offset(shape) + rows * dtype.itemsize

    def parts(self, host: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a master's host bytes: its values (rows, cols) and its scales (rows,) of `dtype`."""
        rows, cols = rows_cols(shape)
        values = host[: rows * cols].view(self.dtype).view(rows, cols)
        start = scale_offset(shape)
        return values, host[start : start + rows * dtype.itemsize].view(dtype)

    def pack(self, host: torch.Tensor, value: torch.Tensor | RowReader, dtype: torch.dtype, shape: torch.Size,
             name: str) -> None:
        """Quantize `value` into the values and scales, in row blocks (Note [row-scaled formats])."""
        values, scales = self.parts(host, dtype, shape)
        rows, cols = rows_cols(shape)
        read = row_reader(value)
        device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
        numel = CHUNK_NUMEL if device.type == "cpu" else _DEVICE_CHUNK_NUMEL
        step = max(1, numel // max(cols, 1))
        coarse = 0
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            block = read(start, stop).reshape(stop - start, cols).to(device=device, dtype=torch.float32, copy=True)
            scale = self._row_scale(block, dtype)
            exact = block.clone() if dtype == torch.float16 else None
            q = self.round(block.div_(scale.float()[:, None]).clamp_(-self.max, self.max)).to(self.dtype)
            if exact is not None:
                coarse += _coarse_rows(exact, q, scale)
            scales[start : start + step].copy_(scale)
            values[start : start + step].copy_(q)
        if coarse:
            warnings.warn(
                f"offtensor: {coarse} of {rows} rows of compressed parameter {name!r} lost over "
                f"{COARSE_ROW_ERROR:.0%} of their values in {self.name}: their largest values are too "
                f"small for a float16 scale (below float16's normal range, {torch.finfo(dtype).tiny:.2g}, "
                f"times {self.max:.0f}). Load the model in torch.bfloat16 (the same bytes, float32's "
                f"range), or keep this parameter on the device with Policy(param_filter=...).", stacklevel=3)

    def round(self, q: torch.Tensor) -> torch.Tensor:
        """Quantized floats (in range) as the values will hold them: the cast rounds."""
        return q

    def unpack(self, host: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        values, scale = self.parts(host, dtype, shape)
        return self._restored(values, scale).view(shape)

    def unpack_into(self, out: torch.Tensor, host: torch.Tensor, dtype: torch.dtype) -> None:
        values, scale = self.parts(host, dtype, out.shape)
        self._rows_into(values, scale, out.view(values.shape))

    def rows(self, host: torch.Tensor, dtype: torch.dtype, shape: torch.Size, run: slice) -> tuple[torch.Tensor, ...]:
        values, scale = self.parts(host, dtype, shape)
        return values[run], scale[run]

    def unpack_rows_into(self, out: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> None:
        values, scale = rows
        n = out.shape[0]
        self._rows_into(values.view(n, -1), scale.view(n), out.view(n, -1))

    def fuse(self, chunks: list[list[Conversion]], device: torch.device) -> FusedConversions | None:
        return None  # each master restored alone (a format with a fused kernel overrides it)

    def _rows_into(self, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
        """Restore rows on `target`'s device: `values` (rows, cols) of the format's dtype and
        `scale` (rows,) of the master's dtype, on that device; `target` (rows, cols) of the
        compute dtype."""
        if target.dtype == scale.dtype:
            self.dequantize(values, scale, target)
        else:
            target.copy_(self._restored(values, scale))

    def _restored(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The rows' values in the master's dtype (`scale`'s): a new tensor on values' device."""
        out = values.to(scale.dtype)
        return out.mul_(scale[:, None])

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
        """_rows_into where the compute dtype is the master's: two kernels, as PyTorch does not
        promote every 1-byte dtype in arithmetic."""
        target.copy_(values)  # exact: 1-byte values fit every float dtype of 2 bytes or more
        target.mul_(scale[:, None])

    def _row_scale(self, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One scale per row, rounded to `dtype` (what is stored and what restoring uses)."""
        amax = block.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / self.max, torch.ones_like(amax)).to(dtype)
        # A scale rounded down would put the row's largest value beyond the format's range (it is
        # clamped: a small error), one rounded to zero would divide by zero: use the smallest
        # normal number of the dtype there.
        return torch.where(scale > 0, scale, torch.tensor(torch.finfo(dtype).tiny, dtype=dtype))


def _coarse_rows(exact: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> int:
    """Rows whose compressed values lost over COARSE_ROW_ERROR of the row (relative error of its
    norm, Note [float16 scales])."""
    error = (q.float() * scale.float()[:, None] - exact).norm(dim=1)
    return int((error > COARSE_ROW_ERROR * exact.norm(dim=1)).sum())
