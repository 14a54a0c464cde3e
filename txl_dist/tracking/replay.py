"""Sending what the store missed, from the journal and the outbox of a run dir.

Replay: ``python -m txl_dist.tracking replay RUN_DIR [--uri URI]`` sends what is missing to the recorded
run, and to the runs the run dir's continuations left (tracking/superseded/, continuation.py), and records
it, so a second replay sends nothing (the next training job in the run dir sends its own run's gaps too).
The URI is --uri, else the recorded one, else MLFLOW_TRACKING_URI (a recorded URI whose secret was redacted
needs one of them). It refuses (exit 2) while a job
holds the lock.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .continuation import superseded_folders
from .errors import ReplayError, TrackingError
from .journal import TrackingFolder, _Batch, _DeliveryLog, _summarize
from .secrets import _one_line, _quiet_store_tracebacks, _remember_secrets, _scrub_library_logs, shown_uri
from .store import _check_reopenable, _chunks, _deliver_item, _quick_http_failures, _send_metrics, _undelivered
from ..write_faults import is_write_fault, write_fault_line


@dataclasses.dataclass
class ReplayReport:
    """What one replay sent."""

    run_id: str
    uri: str
    """Shown form (redacted)."""
    values: int = 0
    batches: int = 0
    items: int = 0

    def summary(self) -> str:
        return (f"replay: sent {self.values} metric values ({self.batches} log_metrics calls) and {self.items} "
                f"params/artifact/status items to run {self.run_id} at {self.uri}")


def replay(run_dir: str | os.PathLike, uri: str | None = None) -> ReplayReport:
    """Send to the recorded run what its journal and outbox say the store lacks, and record it as sent.

    uri: --uri, else the recorded one, else MLFLOW_TRACKING_URI (a recorded one whose secret was redacted needs one).
    TrackingError for a refusal (nothing recorded, a redacted URI, a job holding the run dir, an unknown
    run); ReplayError when the store fails midway (what was sent stays recorded; run it again).
    """
    folder = TrackingFolder(run_dir)
    run_id = folder.recorded_run_id()
    if run_id is None:
        raise TrackingError(f"replay: {folder.run_id_file} not found; this run dir has no MLflow run (tracking "
                            "was off, or it is not a run dir)")
    uri = _replay_uri(folder, uri)
    if _remember_secrets(uri):
        _scrub_library_logs()
    _quiet_store_tracebacks()
    report = ReplayReport(run_id, shown_uri(uri))
    try:
        _replay_locked(folder, run_id, uri, report)
    except OSError as e:
        # The run dir's disk is full or read-only: the lock, delivered.jsonl or the outbox cannot be written. One
        # line, a fault (exit 1), as for a store that fails, instead of a traceback.
        if not is_write_fault(e):
            raise
        line = write_fault_line(e, folder.dir, "move the run dir to another file system")
        raise ReplayError(f"replay stopped after {report.values} metric values: {line}; what was sent is recorded "
                          "(a chunk the store took but this could not record is sent again), run replay again "
                          "then") from None
    return report


def _replay_locked(folder: TrackingFolder, run_id: str, uri: str, report: ReplayReport) -> None:
    """replay's sending, under the run dir's tracking lock."""
    from mlflow import MlflowClient

    folder.lock("replay")
    try:
        client = MlflowClient(tracking_uri=uri)
        _check_replay_target(client, folder, run_id, report.uri)
        for each in [folder, *superseded_folders(folder)]:
            each.repair()
            if each is not folder:
                summary = _summarize(each)
                if not (summary.missing_values or summary.missing_items):
                    continue
                _check_replay_target(client, each, each.recorded_run_id(), report.uri)
            _replay_metrics(client, each, report, each.recorded_run_id())
            _replay_outbox(client, each, report, each.recorded_run_id())
    finally:
        folder.unlock()


def _check_replay_target(client, folder: TrackingFolder, run_id: str, shown: str) -> None:
    """TrackingError unless the store answers (within the opening's bounded retries) and holds the run."""
    with _quick_http_failures():
        try:
            _check_reopenable(client, run_id, shown, f"the MLflow run {run_id} recorded in {folder.run_id_file}",
                              unknown_fix="pass the --uri of the store that holds it",
                              deleted_fix=f"remove {folder.dir} if it is meant to stay deleted")
        except TrackingError:
            raise
        except Exception as e:
            raise TrackingError(f"replay: cannot reach {shown} ({_one_line(e)}); start the server or pass the "
                                "right --uri") from None


def _replay_uri(folder: TrackingFolder, uri: str | None) -> str:
    """--uri, else the URI the run was logged to (recorded; the job's tracking.uri may differ from the
    environment's MLFLOW_TRACKING_URI), else MLFLOW_TRACKING_URI where the recorded one is missing or hides
    its secret. A sqlite file that does not exist is refused: opening it would create an empty store."""
    recorded = folder.recorded_uri()
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        chosen = uri
    elif recorded is not None and "***" not in recorded:
        chosen = recorded
    elif env:
        chosen = env
    elif recorded is None:
        raise TrackingError(f"replay: {folder.uri_file} not found; pass the tracking URI with --uri")
    else:
        raise TrackingError(f"replay: the recorded tracking URI {recorded} hides its password or token; pass the "
                            "full URI with --uri (or MLFLOW_TRACKING_URI)")
    if chosen.startswith("sqlite:///") and not chosen.endswith(":memory:"):
        database = Path(chosen[len("sqlite:///"):])
        if not database.is_file():
            raise TrackingError(f"replay: {database} does not exist (tracking URI {shown_uri(chosen)}); pass the "
                                "--uri of the store that holds the run")
    return chosen


def _replay_metrics(client, folder: TrackingFolder, report: ReplayReport, run_id: str) -> None:
    """Stream the journal; send the undelivered batches in chunks, each recorded once the store has it."""
    log = _DeliveryLog(folder.delivered)
    try:
        for batches in _undelivered(folder):
            _replay_chunks(client, batches, log, report, run_id)
    finally:
        log.close()


def _replay_chunks(client, batches: list[_Batch], log: _DeliveryLog, report: ReplayReport, run_id: str) -> None:
    for chunk in _chunks(batches):
        try:
            n = _send_metrics(client, run_id, chunk)
        except Exception as e:
            raise ReplayError(f"replay stopped after {report.values} metric values: {_one_line(e)}; what was sent "
                              "is recorded, run replay again when the store answers") from None
        try:
            log.record(b.seq for b in chunk)
        except OSError as e:  # os.write names no file: name it for the one line replay ends with
            e.filename = e.filename or str(log.path)
            raise
        report.values += n
        report.batches += len(chunk)


def _replay_outbox(client, folder: TrackingFolder, report: ReplayReport, run_id: str) -> None:
    for item in folder.outbox_items():
        if folder.copies_of(item)[1]:  # a newer copy of this artifact waits: the old one is stale
            folder.remove(item)
            continue
        try:
            _deliver_item(client, run_id, item)
        except Exception as e:
            raise ReplayError(f"replay stopped at {item.what}: {_one_line(e)}; what was sent is recorded, run "
                              "replay again when the store answers") from None
        folder.remove(item)
        report.items += 1
