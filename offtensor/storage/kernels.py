"""Triton kernels for loads on CUDA. Imported only when a CUDA load needs one (`storage/fp8.py`),
so neither the CPU path nor `import offtensor` needs Triton; PyTorch's CUDA builds ship it.

# Note [fused fp8 dequantization]
PyTorch does not promote float8 in arithmetic, so dequantizing fp8 values with a row scale in
PyTorch takes two kernels: a conversion into the output (1 byte read, 2 written per value) and
an in-place multiply (2 read, 2 written), 7 bytes of device memory traffic per value. These run
on the cast stream beside the compute (Note [streams and events]), and during a compute-bound
backward every byte they move is taken from the kernels of the step. One kernel reads each value
once and writes the result once: 3 bytes per value. It computes what the two kernels do, bit for
bit: the 1-byte value and the scale converted exactly to fp32, one fp32 product, one rounding
(to nearest even) into the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program dequantizes a tile of _ROWS rows by _COLS columns: each value's row is the tile's row,
# not a division of its offset by the row length (a 64-bit integer division per value is tens of
# instructions, emulated). A chunk's launch has as many programs per matrix as its largest matrix
# has tiles: those past a smaller matrix's tiles return at once.
_ROWS = 8
_COLS = 256


@triton.jit
def _dequantize_tile(values, scale, out, program, rows, cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    # tile `program` of a (rows, cols) matrix, the tiles row-major: its rows' scales are read once
    col_tiles = tl.cdiv(cols, COLS)
    row = (program // col_tiles).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = (program % col_tiles).to(tl.int64) * COLS + tl.arange(0, COLS)
    in_rows = row < rows
    mask = in_rows[:, None] & (col < cols)[None, :]
    offsets = row[:, None] * cols + col[None, :]
    v = tl.load(values + offsets, mask=mask).to(tl.float32)
    s = tl.load(scale + row, mask=in_rows).to(tl.float32)
    tl.store(out + offsets, (v * s[:, None]).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_rows_kernel(values, scale, out, rows, cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    _dequantize_tile(values, scale, out, tl.program_id(0), rows, cols, ROWS, COLS)


def _tiles(rows: int, cols: int) -> int:
    return triton.cdiv(rows, _ROWS) * triton.cdiv(cols, _COLS)


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """`out = values.to(out.dtype) * scale[:, None]` in one kernel on out's device's current
    stream, where `values` is (rows, cols) of a 1-byte float dtype, `scale` (rows,) of out's
    dtype, all three contiguous on one CUDA device (Note [fused fp8 dequantization])."""
    if values.numel():
        cols = values.shape[-1]
        rows = values.numel() // cols
        # Triton launches on the current device's current stream: out's device is made current
        # here, so that the launch never depends on which device the caller left current (a
        # model wrapped for cuda:1 while cuda:0 is current). Its current stream is then the one
        # the caller made current there (the cast stream, LoadProgress.mark_chunk).
        with torch.cuda.device(out.device):
            _dequantize_rows_kernel[(_tiles(rows, cols),)](values, scale, out, rows, cols, ROWS=_ROWS, COLS=_COLS)


@triton.jit(do_not_specialize=["first"])
def _dequantize_segments_kernel(values, scales, out, table, first, ROWS: tl.constexpr, COLS: tl.constexpr):
    # program (i, j): tile i of the j-th matrix from row `first` of the table (Note [load plans])
    row = table + (first + tl.program_id(1)).to(tl.int64) * 5
    value_at, scale_at, out_at = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    n, cols = tl.load(row + 3), tl.load(row + 4)
    rows = n // tl.maximum(cols, 1)  # an empty matrix may have no columns
    if tl.program_id(0) < tl.cdiv(rows, ROWS) * tl.cdiv(cols, COLS):
        _dequantize_tile(values + value_at, scales + scale_at, out + out_at, tl.program_id(0), rows, cols, ROWS, COLS)


def dequantize_segments(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                        first: int, count: int, tiles: int) -> None:
    """dequantize_rows for `count` matrices in one kernel, on out's device's current stream:
    matrix j is row `first + j` of `table` (int64, on the device: the offset of its values in
    `values`, of its scales in `scales`, of its output in `out`, in elements of each, its numel
    and its columns), `tiles` the most tiles of any (`tiles_of`). `values` (1-byte float), `scales`
    and `out` (of one dtype) are flat views of whole buffers; the same arithmetic as dequantize_rows,
    bit for bit."""
    grid = (tiles, count)
    if torch.cuda.current_device() == out.device.index:  # see dequantize_rows
        _dequantize_segments_kernel[grid](values, scales, out, table, first, ROWS=_ROWS, COLS=_COLS)
        return
    with torch.cuda.device(out.device):
        _dequantize_segments_kernel[grid](values, scales, out, table, first, ROWS=_ROWS, COLS=_COLS)


def tiles_of(numel: int, cols: int) -> int:
    """The programs a (numel // cols, cols) matrix takes in dequantize_segments."""
    return _tiles(numel // cols, cols)
