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

_BLOCK = 2048  # values per program: a memory-bound kernel, any size that fills the SMs will do


@triton.jit
def _dequantize_rows_kernel(values, scale, out, n, cols, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    v = tl.load(values + offsets, mask=mask).to(tl.float32)
    s = tl.load(scale + offsets // cols, mask=mask).to(tl.float32)
    tl.store(out + offsets, (v * s).to(out.dtype.element_ty), mask=mask)


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """`out = values.to(out.dtype) * scale[:, None]` in one kernel on out's device's current
    stream, where `values` is (rows, cols) of a 1-byte float dtype, `scale` (rows,) of out's
    dtype, all three contiguous on one CUDA device (Note [fused fp8 dequantization])."""
    n = values.numel()
    if n:
        # Triton launches on the current device's current stream: out's device is made current
        # here, so that the launch never depends on which device the caller left current (a
        # model wrapped for cuda:1 while cuda:0 is current). Its current stream is then the one
        # the caller made current there (the cast stream, LoadProgress.mark_chunk).
        with torch.cuda.device(out.device):
            _dequantize_rows_kernel[(triton.cdiv(n, _BLOCK),)](values, scale, out, n, values.shape[-1],
                                                               BLOCK=_BLOCK)


@triton.jit(do_not_specialize=["first"])
def _dequantize_segments_kernel(values, scales, out, table, first, BLOCK: tl.constexpr):
    # program (i, j): block i of the j-th matrix from row `first` of the table (Note [load plans])
    row = table + (first + tl.program_id(1)).to(tl.int64) * 5
    value_at, scale_at, out_at = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    n, cols = tl.load(row + 3), tl.load(row + 4)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    v = tl.load(values + value_at + offsets, mask=mask).to(tl.float32)
    s = tl.load(scales + scale_at + offsets // cols, mask=mask).to(tl.float32)
    tl.store(out + out_at + offsets, (v * s).to(out.dtype.element_ty), mask=mask)


def dequantize_segments(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                        first: int, count: int, numel: int) -> None:
    """dequantize_rows for `count` matrices in one kernel, on out's device's current stream:
    matrix j is row `first + j` of `table` (int64, on the device: the offset of its values in
    `values`, of its scales in `scales`, of its output in `out`, in elements of each, its numel
    and its columns), `numel` the largest. `values` (1-byte float), `scales` and `out` (of one
    dtype) are flat views of whole buffers; the same arithmetic as dequantize_rows, bit for bit."""
    grid = (triton.cdiv(numel, _BLOCK), count)
    if torch.cuda.current_device() == out.device.index:  # see dequantize_rows
        _dequantize_segments_kernel[grid](values, scales, out, table, first, BLOCK=_BLOCK)
        return
    with torch.cuda.device(out.device):
        _dequantize_segments_kernel[grid](values, scales, out, table, first, BLOCK=_BLOCK)
