"""`Policy(frozen_format="fp8")`: row-scaled float8 e4m3 (Note [row-scaled formats] in
storage/row_scaled.py), restored on CUDA by one Triton kernel per matrix, or per chunk of a load
(Note [fused fp8 dequantization] in storage/kernels.py), where Triton is installed, and on the CPU
through float16 bits (Note [fp8 on the CPU]).

# Note [fp8 on the CPU]
PyTorch converts float8_e4m3fn to a wider float one value at a time on the CPU; the bits make a
float16 at integer speed instead. The byte read as int8, widened to int16 (sign-extended),
shifted left 7 and masked with 0xBF80 keeps the sign in bit 15 and puts e4m3's 4 exponent and
3 mantissa bits under a float16 exponent field whose top bit is 0. Both formats keep
subnormals at exponent field 0 and their biases differ by 8, so the float16 is the e4m3 value
times 2**-8 exactly. It converts exactly to every master dtype (2 bytes or more), and
`scale * 256` is exact while |scale| <= max / 256, so the one multiplication rounds the exact
product `value * scale` as `RowScaled.dequantize` does: the same bits (checked for every code,
float dtype and a wide range of scales by tests/weights/test_compress.py). Two cases take the
two kernels instead, each checked on the data:
- the NaN codes (0x7F, 0xFF), which read as +-480 * 2**-8: packing stores them for a row
  holding NaN or inf, and a block whose float16 reaches beyond 448 * 2**-8 holds one;
- a scale beyond max / 256, NaN or infinite, where `scale * 256` would not be exact.
A float16 target is its own scratch; other targets take one of at most `_SCRATCH_NUMEL` values,
in blocks of rows, which stays in cache between its passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..formats import Conversion, register_frozen_format
from .compress import rows_cols
from .row_scaled import RowScaled, scale_offset

_SCRATCH_NUMEL = 2**18  # values per block on the CPU: a 512 KiB int16 scratch (Note [fp8 on the CPU])
_FLOAT16_BITS = -16512  # 0xBF80 as int16: keeps bit 15 (the sign) and 13-7 (e4m3's other bits), clears 14
_LARGEST_FLOAT16 = 448 / 256  # the largest e4m3 value in the float16; the NaN codes read beyond it


class Float8Rows(RowScaled):
    """fp8: torch.float8_e4m3fn values, per-row scale = absmax / 448."""

    def __init__(self) -> None:
        super().__init__("fp8", torch.float8_e4m3fn, 448.0)

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
        if target.is_cuda and (fused := _fused_dequantize()) is not None:
            fused(values, scale, target)  # one kernel (Note [fused fp8 dequantization])
        elif target.device.type == "cpu":
            self._dequantize_on_cpu(values, scale, target)
        else:
            super().dequantize(values, scale, target)

    def _restored(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if values.device.type != "cpu":
            return super()._restored(values, scale)
        out = torch.empty(values.shape, dtype=scale.dtype)
        self._dequantize_on_cpu(values, scale, out)
        return out

    def _dequantize_on_cpu(self, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
        """`dequantize` on the CPU, bit for bit, through float16 bits (Note [fp8 on the CPU])."""
        if not values.numel() or not _doubles_exactly(scale):
            super().dequantize(values, scale, target)
            return
        scaled = scale * 256  # exact: the values come 2**-8 too small
        if target.dtype == torch.float16:
            self._dequantize_block(values, scale, scaled, target, target.view(torch.int16))
            return
        rows, cols = values.shape
        step = max(1, _SCRATCH_NUMEL // cols)
        if rows <= step:  # one block: slicing costs more than the work of a small matrix
            self._dequantize_block(values, scale, scaled, target, torch.empty(values.shape, dtype=torch.int16))
            return
        scratch = torch.empty(step * cols, dtype=torch.int16)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            bits = scratch[: (stop - start) * cols].view(stop - start, cols)
            self._dequantize_block(values[start:stop], scale[start:stop], scaled[start:stop], target[start:stop], bits)

    def _dequantize_block(self, values: torch.Tensor, scale: torch.Tensor, scaled: torch.Tensor,
                          target: torch.Tensor, bits: torch.Tensor) -> None:
        """Rows of `_dequantize_on_cpu`: `bits` (int16, the rows' shape) is the scratch, or the
        float16 target's own bytes; `scaled` is `scale * 256`."""
        bits.copy_(values.view(torch.int8))  # sign-extended
        bits.bitwise_left_shift_(7).bitwise_and_(_FLOAT16_BITS)
        half = bits.view(torch.float16)  # the values times 2**-8
        low, high = torch.aminmax(half)
        if float(low) < -_LARGEST_FLOAT16 or float(high) > _LARGEST_FLOAT16:  # a NaN code
            super().dequantize(values, scale, target)
            return
        if target.dtype != torch.float16:
            target.copy_(half)  # exact
        target.mul_(scaled[:, None])

    def fuse(self, chunks: list[list[Conversion]], device: torch.device) -> FusedDequantization | None:
        return FusedDequantization.plan(chunks, device)


def _doubles_exactly(scale: torch.Tensor) -> bool:
    """Whether `scale * 256` is exact: every scale within max / 256 of its dtype (NaN is not)."""
    low, high = torch.aminmax(scale)
    limit = torch.finfo(scale.dtype).max / 256
    return -limit <= float(low) and float(high) <= limit


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
        self.chunks = chunks  # per chunk: (first row, rows, the most programs of any matrix)
        self.dtype = dtype

    @classmethod
    def plan(cls, chunks: list[list[Conversion]], device: torch.device) -> FusedDequantization | None:
        """For a load whose chunks convert fp8 masters only (Float8Rows.fuse): one kernel per
        chunk, or None where not every conversion is into the master's own dtype on a CUDA device
        with Triton (each is then its own, `unpack_into`)."""
        if device.type != "cuda" or _fused_dequantize() is None:
            return None
        from .kernels import tiles_of

        entries = [e for chunk in chunks for e in chunk]
        if not entries:
            return None
        dtype = entries[0][3].dtype
        size = dtype.itemsize
        rows: list[list[int]] = []
        spans: list[tuple[int, int, int]] = []
        for chunk in chunks:
            first, tiles = len(rows), 0
            for master_dtype, offset, device_offset, out in chunk:
                if master_dtype != dtype or out.dtype != dtype or not out.is_contiguous():
                    return None
                scale = offset + scale_offset(out.shape)
                if scale % size or device_offset % size:
                    return None
                cols = rows_cols(out.shape)[1]
                rows.append([offset, scale // size, device_offset // size, out.numel(), cols])
                if out.numel():
                    tiles = max(tiles, tiles_of(out.numel(), cols))
            spans.append((first, len(chunk), tiles))
        return cls(rows, spans, dtype)

    def launch(self, chunk: int, staging: torch.Tensor, out_flat: torch.Tensor) -> None:
        """Dequantize the chunk's matrices from `staging` (the load's uint8 staging buffer, host
        layout) into `out_flat` (the scope's uint8 device buffer), on the current stream."""
        from .kernels import dequantize_segments

        first, count, tiles = self.chunks[chunk]
        if not count or not tiles:
            return
        table = self._table
        if table is None:  # ordered before every launch: the same (current) stream
            table = self._table = self._host.to(out_flat.device, non_blocking=True)
        dequantize_segments(staging.view(torch.float8_e4m3fn), staging.view(self.dtype), out_flat.view(self.dtype),
                            table, first, count, tiles)


FP8 = Float8Rows()
register_frozen_format(FP8)
