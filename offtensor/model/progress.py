"""The progress bar of wrap and load on a terminal.

# Note [progress of a wrap]
Filling the host masters takes as long as reading or copying the model's bytes: seconds for a
few GiB, minutes for a 70B checkpoint from a cold disk. Once a wrap or load has run for
SHOW_AFTER_S, a bar on stderr shows the bytes done, the rate and the time left, redrawn in place
at most every REDRAW_S; quicker ones print nothing. Only on a terminal (stderr.isatty()): a log
file or CI output gets no carriage returns. `OFFTENSOR_PROGRESS=0` (or false, off, no) turns it
off; the debug log line at the end stays.
"""

from __future__ import annotations

import logging
import os
import sys
import time

logger = logging.getLogger("offtensor")

PROGRESS_ENV = "OFFTENSOR_PROGRESS"
SHOW_AFTER_S = 2.0
REDRAW_S = 0.2
_WIDTH = 24  # characters of the bar


def progress_enabled() -> bool:
    """Whether a bar may be shown: stderr is a terminal and OFFTENSOR_PROGRESS does not turn it off."""
    if os.environ.get(PROGRESS_ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


class Progress:
    """A progress bar over `total_bytes`, on a terminal once it has run for SHOW_AFTER_S
    (Note [progress of a wrap])."""

    def __init__(self, total_bytes: int, label: str) -> None:
        self._total = total_bytes
        self._label = label  # "pinning host memory", or what is done instead
        self._done = 0
        self._start = time.perf_counter()
        self._drawn = 0.0  # when the bar was last drawn; 0: never
        self._enabled = progress_enabled()

    @property
    def shown(self) -> bool:
        return self._drawn > 0

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        if not self._enabled:
            return
        now = time.perf_counter()
        if now - self._start >= SHOW_AFTER_S and now - self._drawn >= REDRAW_S:
            self._draw(now)

    def close(self) -> None:
        elapsed = time.perf_counter() - self._start
        if self.shown:
            self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()
        logger.debug("%s: %.2f GiB in %.1f s", self._label, self._total / 2**30, elapsed)

    def _draw(self, now: float) -> None:
        self._drawn = now
        elapsed = max(now - self._start, 1e-9)
        share = min(self._done / self._total, 1.0) if self._total else 1.0
        filled = round(share * _WIDTH)
        rate = self._done / elapsed
        left = f", {(self._total - self._done) / rate:.0f} s left" if 0 < rate and self._done < self._total else ""
        sys.stderr.write(
            f"\rofftensor: {self._label} [{'#' * filled}{'-' * (_WIDTH - filled)}] {share:4.0%} "
            f"{self._done / 2**30:.1f}/{self._total / 2**30:.1f} GiB, {rate / 2**30:.1f} GiB/s{left}\x1b[K")
        sys.stderr.flush()
