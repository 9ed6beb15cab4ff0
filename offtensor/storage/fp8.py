"""`Policy(frozen_format="fp8")`: row-scaled float8 e4m3 (Note [row-scaled formats] in
storage/row_scaled.py), restored on CUDA by one Triton kernel per matrix, or per chunk of a load
(Note [fused fp8 dequantization] in storage/kernels.py), where Triton is installed."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..formats import Conversion, register_frozen_format
from .compress import rows_cols
from .row_scaled import RowScaled, scale_offset


class Float8Rows(RowScaled):
    """fp8: torch.float8_e4m3fn values, per-row scale = absmax / 448."""

    def __init__(self) -> None:
        super().__init__("fp8", torch.float8_e4m3fn, 448.0)

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
        if target.is_cuda and (fused := _fused_dequantize()) is not None:
            fused(values, scale, target)  # one kernel (Note [fused fp8 dequantization])
        else:
            super().dequantize(values, scale, target)

    def fuse(self, chunks: list[list[Conversion]], device: torch.device) -> FusedDequantization | None:
        return FusedDequantization.plan(chunks, device)


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
    def plan(cls, chunks: list[list[Conversion]], device: torch.device) -> FusedDequantization | None:
        """For a load whose chunks convert fp8 masters only (Float8Rows.fuse): one kernel per
        chunk, or None where not every conversion is into the master's own dtype on a CUDA device
        with Triton (each is then its own, `unpack_into`)."""
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
            for master_dtype, offset, device_offset, out in chunk:
                if master_dtype != dtype or out.dtype != dtype or not out.is_contiguous():
                    return None
                scale = offset + scale_offset(out.shape)
                if scale % size or device_offset % size:
                    return None
                rows.append([offset, scale // size, device_offset // size, out.numel(), rows_cols(out.shape)[1]])
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


FP8 = Float8Rows()
register_frozen_format(FP8)
