"""A ticking elapsed time for a long call that reports no progress of its own (SentencePiece's training): without
it a job sits for a minute after one line, and nobody can tell working from hung."""
from __future__ import annotations

import sys
import threading

from tqdm import tqdm

HEARTBEAT_S = 1.0
"""How often the elapsed time is redrawn."""


class Heartbeat:
    """`start()` shows `<what>: <elapsed>` on stderr, redrawn by a thread every HEARTBEAT_S until `stop()`;
    nothing when not `enabled` (--quiet: shown exactly where data_prep shows its bars)."""

    def __init__(self, what: str, enabled: bool):
        self.what, self.enabled = what, enabled
        self.thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._bar: tqdm | None = None

    def start(self) -> None:
        if not self.enabled or self.thread is not None:
            return
        self._bar = tqdm(desc=self.what, bar_format="{desc}: {elapsed}", file=sys.stderr)
        self.thread = threading.Thread(target=self._tick, name="heartbeat", daemon=True)
        self.thread.start()

    def _tick(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            self._bar.refresh()

    def stop(self) -> None:
        """Stop the ticks and leave the final elapsed time on its line; safe to call when never started."""
        self._stopped.set()
        if self.thread is not None:
            self.thread.join()
            self._bar.close()
