"""Progress lines of long work that is not a training step (an evaluation, a long prompt's reading): one line
every PROGRESS_INTERVAL_S seconds through the project's logger (so on stderr, never stdout), none for work that
ends sooner. Standard library only."""
from __future__ import annotations

import logging
import time

from .errors import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

PROGRESS_INTERVAL_S = 30.0
"""Seconds between the progress lines of a long evaluation (or prompt read): none for a shorter one."""
_clock = time.monotonic  # tests put a fake clock here


class Progress:
    """A progress line every PROGRESS_INTERVAL_S seconds of a long loop (through the project's logger, so on
    stderr, never stdout): `what: done/total unit | tokens/s | ETA`, the ETA at the mean rate so far."""

    def __init__(self, what: str, total: int, unit: str, *, quiet: bool = False):
        self.what, self.total, self.unit, self.quiet = what, total, unit, quiet
        self.start = self.last = _clock()

    def update(self, done: int, tokens: int) -> None:
        """`done` of `total` units (and `tokens` tokens) finished; logs if the interval has passed."""
        if self.quiet:
            return
        now = _clock()
        if now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        eta = elapsed / max(done, 1) * (self.total - done)
        log.info("%s: %d/%d %s | %.0f tok/s | ETA %s", self.what, done, self.total, self.unit, tokens / elapsed,
                 hms(eta))


def hms(seconds: float) -> str:
    """H:MM:SS (hours past 24 as hours: an ETA of days stays readable), for every progress line."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
