"""The tracking interface every rank holds.

``Tracker``: the methods, doing nothing (ranks other than 0, tracking disabled); rank 0's
``MlflowTracker`` (mlflow_run.py) implements them. ``Delivery``: what ``close()`` reports.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

CLOSE_STATUSES = ("FINISHED", "FAILED", "KILLED")


@dataclasses.dataclass
class Delivery:
    """What became of what was handed to the tracker (returned by ``close``)."""

    sent: int = 0
    """Metric values the tracking store accepted."""
    dropped: int = 0
    """Values (and params/artifact items) not queued because the queue was full; left for replay."""
    failed: int = 0
    """Values (and items) whose logging raised, or that were still queued at the close timeout; left for
    replay."""
    skipped: int = 0
    """Values at steps the journal already held for their key (a resumed job repeating steps): not sent."""
    first_error: str | None = None
    """The first error, one line."""

    @property
    def ok(self) -> bool:
        """Nothing dropped and no error (including ones that lose no values, e.g. the final run status)."""
        return self.dropped == 0 and self.failed == 0 and self.first_error is None


class Tracker:
    """The tracking interface; this base class does nothing (ranks other than 0, tracking disabled).

    Use it as a context manager: leaving the block closes the run as FINISHED, or FAILED on an exception
    (KILLED on KeyboardInterrupt).
    """

    @property
    def run_id(self) -> str | None:
        """The MLflow run id; None where no run is open (other ranks share rank 0's id by a collective)."""
        return None

    @property
    def active(self) -> bool:
        """True where calls really log (rank 0 with tracking enabled)."""
        return False

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log a (nested) mapping such as the resolved config as flat dotted-key params."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue metric values at a global optimizer step; None values are skipped.

        Never blocks, and the store's errors never raise here (they are counted and reported by close()).
        """

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file, or a folder's contents, under artifact_path of the run.

        A local path that does not exist raises FileNotFoundError (the caller's mistake, not the store's).
        """

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """Store a dict as a JSON (or .yaml) artifact file, e.g. the final evaluation."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store a text artifact file."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is sent (or failed); False if the timeout passed first."""
        return True

    def flush_journal(self) -> None:
        """Make sure every journaled line is in <run_dir>/tracking/metrics.jsonl (for readers such as
        txl_dist/curves.py; each line is written out as it is logged); never waits for the store."""

    def ui_hint(self) -> str | None:
        """How to look at this run: the `mlflow ui` command for a local store, or the run's page on a
        server (secrets masked); None where nothing is logged."""
        return None

    def close(self, status: str = "FINISHED", timeout: float | None = 120.0, ended: str | None = None) -> Delivery:
        """Flush, stop system metrics and mark the run terminated with status FINISHED, FAILED or KILLED;
        `ended`, one line saying how the job ended (the run's tag txl.ended), where the status alone does not."""
        _check_status(status)
        return Delivery()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        self.close(status)


def _check_status(status: str) -> None:
    if status not in CLOSE_STATUSES:
        raise ValueError(f"close(status={status!r}): use one of {', '.join(CLOSE_STATUSES)}")
