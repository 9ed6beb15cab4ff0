"""Test tiers: a quick default sample of the big matrices, or every case of them.

``OFFTENSOR_TESTS`` picks the tier:

- ``quick`` (the default): every test module runs, but the combinatorial suites (the
  architecture x mode matrix, the interrupt fuzzer, the training-loop fuzzer, the zero_grad
  matrix) run a sample that still reaches each mechanism: every architecture in one mode, every
  mode on some architectures, every interrupt variant at a few points, a few fuzz seeds. A few
  minutes on an idle 2-core machine (README.md, "Two commands").
- ``full``: every case of every matrix. CI (``.ci/run``) and the GPU check
  (``.ci/gpu_check.sh``) run this tier.

Which cases the quick tier samples is keyed on ``OFFTENSOR_TEST_SEED`` (an integer). Unset, it is
the day number (UTC), so that successive days cover different cases, and pytest prints it (in the
header, or after collection under ``-q``): ``OFFTENSOR_TEST_SEED=<n> python -m pytest -q tests``
draws the same sample again.

# Note [sampling is per decision]
Each sampled suite draws from its own generator, keyed on the seed *and* the suite's name
(:func:`rng`), so adding a case to one suite does not reshuffle the others' samples.
"""

from __future__ import annotations

import datetime
import enum
import os
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


class Tier(enum.Enum):
    QUICK = "quick"
    FULL = "full"


def _tier_from_env() -> Tier:
    value = os.environ.get("OFFTENSOR_TESTS", Tier.QUICK.value).strip().lower() or Tier.QUICK.value
    try:
        return Tier(value)
    except ValueError:
        choices = ", ".join(repr(t.value) for t in Tier)
        raise ValueError(f"OFFTENSOR_TESTS={value!r}: expected one of {choices} "
                         f"(unset means {Tier.QUICK.value!r})") from None


def _seed_from_env() -> int:
    value = os.environ.get("OFFTENSOR_TEST_SEED", "").strip()
    if not value:
        return datetime.datetime.now(datetime.timezone.utc).date().toordinal()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"OFFTENSOR_TEST_SEED={value!r}: expected an integer") from None


TIER = _tier_from_env()
FULL = TIER is Tier.FULL
SAMPLE_SEED = _seed_from_env()


def rng(key: str) -> random.Random:
    """The generator of one sampling decision (Note [sampling is per decision])."""
    return random.Random(f"{SAMPLE_SEED}:{key}")


def sample(items: Sequence[T], k: int, key: str) -> list[T]:
    """All of ``items`` in the full tier; else ``k`` of them drawn by ``rng(key)``, in their
    original order (so test ids keep their order)."""
    if FULL or k >= len(items):
        return list(items)
    chosen = set(rng(key).sample(range(len(items)), k))
    return [item for i, item in enumerate(items) if i in chosen]


def cover(items: Sequence[T], keys: Callable[[T], Iterable[Hashable]], key: str) -> list[T]:
    """All of ``items`` in the full tier; else a few of them that together have every key any
    item has (greedy set cover: each pick has the most keys not yet covered, ties broken by
    ``rng(key)``). Kept in their original order."""
    if FULL:
        return list(items)
    key_sets = [set(keys(item)) for item in items]
    order = list(range(len(items)))
    rng(key).shuffle(order)
    uncovered = set().union(*key_sets)
    kept: set[int] = set()
    while uncovered:
        best = max(order, key=lambda i: len(key_sets[i] & uncovered))  # the first of equals
        kept.add(best)
        uncovered -= key_sets[best]
    return [item for i, item in enumerate(items) if i in kept]


def header() -> str:
    """The line pytest prints at the top of a run."""
    if FULL:
        return "offtensor tests: full tier (OFFTENSOR_TESTS=full): every case"
    return (f"offtensor tests: quick tier, sample seed {SAMPLE_SEED} "
            f"(OFFTENSOR_TEST_SEED={SAMPLE_SEED} draws it again; OFFTENSOR_TESTS=full runs every case)")
