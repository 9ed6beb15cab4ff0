"""A piece: parameters of one scope that the optimizer worker steps together (Note [deferred steps])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dispatch.slot import ParamSlot


@dataclass(eq=False)
class Piece:
    """Parameters of one scope stepped together, in the order the next forward uses them."""

    scope: str
    slots: list[ParamSlot]
    landed: Any  # event after the device-to-host copies of its gradients (None on the CPU)
    deadline: tuple[int, int]  # (scope's position in the forward order, first slot's position)
    nbytes: int  # its parameters' bytes


def slot_bytes(slot: ParamSlot) -> int:
    return slot.param.numel() * slot.param.element_size()


def cut(slots: list[ParamSlot], piece_bytes: int) -> list[tuple[list[ParamSlot], int]]:
    """`slots` in order, cut into runs of about `piece_bytes` (each: its slots, their bytes)."""
    pieces: list[tuple[list[ParamSlot], int]] = []
    current: list[ParamSlot] = []
    nbytes = 0
    for i, slot in enumerate(slots):
        current.append(slot)
        nbytes += slot_bytes(slot)
        if nbytes >= piece_bytes or i == len(slots) - 1:
            pieces.append((current, nbytes))
            current, nbytes = [], 0
    return pieces
