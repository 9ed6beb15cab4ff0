"""`Policy(frozen_format="int8")`: row-scaled int8 (Note [row-scaled formats] in storage/row_scaled.py)."""

from __future__ import annotations

import torch

from ..formats import register_frozen_format
from .row_scaled import RowScaled


class Int8Rows(RowScaled):
    """int8: torch.int8 values, per-row scale = absmax / 127, rounded to nearest."""

    def __init__(self) -> None:
        super().__init__("int8", torch.int8, 127.0)

    def round(self, q: torch.Tensor) -> torch.Tensor:
        return q.round_()

    def dequantize(self, values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor) -> None:
        torch.mul(values, scale[:, None], out=target)  # one kernel: int8 promotes to the scale's dtype


INT8 = Int8Rows()
register_frozen_format(INT8)
