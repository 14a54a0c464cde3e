"""Progress for what tqdm bars alone do not show well.

A ticking elapsed time for a long call that reports no progress of its own (SentencePiece's training, verify's
checks): without it a job sits for minutes after one line, and nobody can tell working from hung. And the end
of a bar whose total was an estimate.
"""
from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm

HEARTBEAT_S = 1.0
"""How often the elapsed time is redrawn."""


def finish(bar: tqdm) -> None:
    """Show a bar whose work is done as complete. Its total was an estimate from file sizes, and the text counted
    is less (JSON's quotes, keys and escapes): the bar would otherwise stay at 99% (a quarter short for a JSON
    Lines file of short escaped documents), as if the stage had stopped early."""
    if bar.total is not None and bar.n < bar.total:
        bar.total = bar.n
        bar.refresh()


class Heartbeat:
    """`start()` shows `<what>: <elapsed>` on stderr, redrawn by a thread every HEARTBEAT_S until `stop()`;
    nothing when not `enabled` (--quiet: shown exactly where data_prep shows its bars). With `delay` the line
    appears only once the call has run that long (a quick one prints nothing), its elapsed time counted from
    `start()`."""

    def __init__(self, what: str, enabled: bool, delay: float = 0.0):
        self.what, self.enabled, self.delay = what, enabled, delay
        self.thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._bar: tqdm | None = None

    def start(self) -> None:
        if not self.enabled or self.thread is not None or self._stopped.is_set():
            return  # a stopped heartbeat stays stopped (an interrupted job's training thread may still start it)
        started = time.time()  # tqdm's clock
        if self.delay <= 0:
            self._show(started)
        self.thread = threading.Thread(target=self._tick, args=(started,), name="heartbeat", daemon=True)
        self.thread.start()

    def _show(self, started: float) -> None:
        self._bar = tqdm(desc=self.what, bar_format="{desc}: {elapsed}", file=sys.stderr)
        self._bar.start_t = started
        self._bar.refresh()

    def _tick(self, started: float) -> None:
        if self._bar is None:
            if self._stopped.wait(self.delay):
                return
            self._show(started)
        while not self._stopped.wait(HEARTBEAT_S):
            self._bar.refresh()

    def stop(self) -> None:
        """Stop the ticks and leave the final elapsed time on its line; safe to call when never started."""
        self._stopped.set()
        if self.thread is not None:
            self.thread.join()
        if self._bar is not None:
            self._bar.close()
