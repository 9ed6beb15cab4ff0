"""How the ranks of a data-parallel model meet: bounded waits through the process group's store,
and the tags that check matched collectives are the same collective on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def wait_for_ranks(store: Any, keys: list[str], timeout: Any, ranks: list[int]) -> list[int] | None:
    """store.wait(keys, timeout); None once every key is there, else the ranks whose keys are
    missing at the timeout (a bounded wait: never a hang)."""
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # DistStoreError is a RuntimeError
        return [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
    return None


def all_gather(out: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
    """`out` (N equal slices) from each rank's `part`, asynchronous; torch < 2.8 names it
    all_gather_into_tensor."""
    dist = torch.distributed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, part, group=group, async_op=True)


def odd_tag(tag: tuple[int, int], group: Any, world: int, device: torch.device) -> tuple[int, list[int]] | None:
    """All-gather every rank's (what, how many times) `tag` and compare: the position in the
    group of the first rank whose tag differs, with that tag, or None when all agree. A rank that
    does not join raises the collective's RuntimeError after the process group's timeout."""
    mine = torch.tensor(tag, dtype=torch.int64, device=device)
    tags = torch.empty(2 * world, dtype=torch.int64, device=device)
    all_gather(tags, mine, group).wait()
    rows = tags.view(world, 2).tolist()
    return next(((i, row) for i, row in enumerate(rows) if row != list(tag)), None)


def check_tag(tag: tuple[int, int], group: Any, world: int, device: torch.device, ranks: list[int], *,
              where: Callable[[], str], theirs: Callable[[list[int]], str], differs: str, fix: str,
              timeout: str = "") -> None:
    """Raise on every rank unless all ranks gave `tag` (odd_tag): `where()` names this rank's
    collective, `theirs` the odd rank's from its tag, `differs` what then differs; `timeout`
    (" (30 s)") follows the words "the process group's timeout". The words are made only for an
    error: the check runs for every averaging."""
    try:
        odd = odd_tag(tag, group, world, device)
    except RuntimeError as e:
        raise RuntimeError(f"{where()}: the other ranks did not join it within the process group's "
                           f"timeout{timeout} ({e}). {fix}") from e
    if odd is not None:
        at, other = odd
        raise RuntimeError(f"{where()} was matched with rank {ranks[at]}'s {theirs(other)}: the ranks' "
                           f"{differs} differ. {fix}")


def ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
