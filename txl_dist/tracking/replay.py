"""Sending what the store missed, from the journal and the outbox of a run dir.

Replay: ``python -m txl_dist.tracking replay RUN_DIR [--uri URI]`` sends what is missing to the recorded
run, and to the runs the run dir's continuations left (tracking/superseded/, continuation.py), and records
it, so a second replay sends nothing (the next training job in the run dir sends its own run's gaps too).
The URI is --uri, else the recorded one, else MLFLOW_TRACKING_URI (a recorded URI whose secret was redacted
needs one of them). A run dir moved or copied with its default local store (RUN/mlflow.db) sends to that
store, not to the recorded one at the old path, and points its artifact locations at RUN/mlartifacts, as a
job there does (store.py's _relocate_local_artifacts); an explicit tracking.uri stays. It refuses (exit 2)
while a job holds the lock. A switch to a continuation run that a killed job left half done is finished first,
as the next job would; the summary line says how much went to each run.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

from txl_dist.errors import failure_of_the_process

from .continuation import STAGING_DIR, finish_switch, superseded_folders
from .errors import ReplayError, TrackingError
from .journal import TrackingFolder, _Batch, _DeliveryLog, _summarize
from .mlflow_run import LOCAL_DB
from .secrets import _one_line, _quiet_store_tracebacks, _remember_secrets, _scrub_library_logs, shown_uri
from .store import (LOCAL_ARTIFACTS, _check_reopenable, _chunks, _deliver_item, _quick_http_failures,
                    _refuse_empty_store, _relocate_local_artifacts, _send_metrics, _undelivered, sqlite_database)
from ..run_dir import RESOLVED_CONFIG
from ..write_faults import is_write_fault, write_fault_line


@dataclasses.dataclass
class ReplayReport:
    """What one replay sent."""

    run_id: str
    uri: str
    """Shown form (redacted)."""
    batches: int = 0
    sent_to: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per run that got anything, [metric values, items]: the recorded run, and the runs its continuations
    left (tracking/superseded/)."""

    @property
    def values(self) -> int:
        return sum(values for values, _ in self.sent_to.values())

    @property
    def items(self) -> int:
        return sum(items for _, items in self.sent_to.values())

    def count(self, run_id: str, values: int = 0, batches: int = 0, items: int = 0) -> None:
        self.batches += batches
        sent = self.sent_to.setdefault(run_id, [0, 0])
        sent[0], sent[1] = sent[0] + values, sent[1] + items

    def summary(self) -> str:
        sent = (f"replay: sent {self.values} metric values ({self.batches} log_metrics calls) and {self.items} "
                "params/artifact/status items")
        if set(self.sent_to) <= {self.run_id}:
            return f"{sent} to run {self.run_id} at {self.uri}"
        # Some went to runs the recorded one continues: name where each part went, not all to the recorded run.
        parts = [f"{values} values and {items} item(s) to run {run_id}"
                 + ("" if run_id == self.run_id else " (a run it continues, tracking/superseded/)")
                 for run_id, (values, items) in self.sent_to.items()]
        return f"{sent} at {self.uri}: {', '.join(parts)}"


@dataclasses.dataclass
class _Store:
    """The store replay sends to, and why."""

    uri: str
    why: str
    """How it was chosen, for the line that names it."""
    moved_from: Path | None = None
    """The database the run dir's own store was recorded at (the run dir was moved or copied): its artifact
    locations are pointed at RUN/mlartifacts before anything is sent."""


def replay(run_dir: str | os.PathLike, uri: str | None = None,
           announce: Callable[[str], None] | None = None) -> ReplayReport:
    """Send to the recorded run what its journal and outbox say the store lacks, and record it as sent.

    uri: --uri, else the recorded one, else MLFLOW_TRACKING_URI (a recorded one whose secret was redacted needs one).
    A run dir moved or copied with its default local store sends to RUN/mlflow.db (_choose_store).
    announce: called with one line naming the store and why, before anything is sent.
    TrackingError for a refusal (nothing recorded, a redacted URI, a job holding the run dir, an unknown
    run); ReplayError when the store fails midway (what was sent stays recorded; run it again).
    """
    folder = TrackingFolder(run_dir)
    report = None
    try:
        _finish_interrupted_switch(folder)
        run_id = folder.recorded_run_id()
        if run_id is None:
            raise TrackingError(f"replay: {folder.run_id_file} not found; this run dir has no MLflow run (tracking "
                                "was off, or it is not a run dir)")
        store = _choose_store(Path(run_dir), folder, run_id, uri)
        if _remember_secrets(store.uri):
            _scrub_library_logs()
        _quiet_store_tracebacks()
        report = ReplayReport(run_id, shown_uri(store.uri))
        _replay_locked(folder, run_id, store, report, announce)
    except OSError as e:
        # The run dir's disk is full or read-only: the lock, delivered.jsonl or the outbox cannot be written. One
        # line, a fault (exit 1), as for a store that fails, instead of a traceback.
        if not is_write_fault(e):
            raise
        line = write_fault_line(e, folder.dir, "move the run dir to another file system")
        sent = report.values if report is not None else 0
        raise ReplayError(f"replay stopped after {sent} metric values: {line}; what was sent is recorded (a chunk "
                          "the store took but this could not record is sent again), run replay again then") from None
    return report


def _finish_interrupted_switch(folder: TrackingFolder) -> None:
    """A job killed while switching the folder to a continuation run (continuation.py): finish the switch, as the
    next job would, before anything is read. Half switched, the folder holds the continuation's journal beside
    the left run's id and delivery records: replay sent that journal to the left run and marked its seqs as
    delivered in the left run's records, where they name other values, which no replay would send then."""
    if not (folder.dir / STAGING_DIR).is_dir():
        return
    folder.lock("replay")
    try:
        finish_switch(folder)
    finally:
        folder.unlock()


def _replay_locked(folder: TrackingFolder, run_id: str, store: _Store, report: ReplayReport,
                   announce: Callable[[str], None] | None) -> None:
    """replay's sending, under the run dir's tracking lock."""
    from mlflow import MlflowClient

    folder.lock("replay")
    try:
        why = store.why
        if store.moved_from is not None:
            why += _follow_moved_store(store)
        if announce is not None:
            announce(f"replay: sending to run {run_id} at {report.uri} ({why})")
        try:
            client = MlflowClient(tracking_uri=store.uri)
        except Exception as e:  # noqa: BLE001 - a file that is no sqlite database, a URI MLflow has no store for
            if failure_of_the_process(e):
                raise
            raise TrackingError(f"replay: MLflow cannot use {report.uri} ({_one_line(e)}); pass the --uri of the "
                                "store that holds the run") from None
        _check_replay_target(client, folder, run_id, report.uri)
        if store.moved_from is not None:
            folder.record(run_id, store.uri)  # the next job or replay finds the store where the run dir is
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


def _follow_moved_store(store: _Store) -> str:
    """Point the moved store's artifact locations at the run dir's own mlartifacts/ (before any client caches
    them); what was done, worded to end the announced line."""
    database = sqlite_database(store.uri).resolve()
    location = (database.parent / LOCAL_ARTIFACTS).as_uri()
    try:
        moved = _relocate_local_artifacts(database, store.moved_from, location)
    except Exception as e:  # noqa: BLE001 - sqlite3's errors, an older schema: uploads go where they went
        return f"; its artifact locations still name {store.moved_from.parent}: {_one_line(e)}"
    return f"; {moved} artifact location(s) now point at {database.parent / LOCAL_ARTIFACTS}" if moved else ""


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
            if failure_of_the_process(e):
                raise
            raise TrackingError(f"replay: cannot reach {shown} ({_one_line(e)}); start the server or pass the "
                                "right --uri") from None


def _choose_store(run_dir: Path, folder: TrackingFolder, run_id: str, uri: str | None) -> _Store:
    """--uri, else the URI the run was logged to (recorded; the job's tracking.uri may differ from the
    environment's MLFLOW_TRACKING_URI), else MLFLOW_TRACKING_URI where the recorded one is missing or hides
    its secret. A sqlite file that does not exist, or is empty, is refused: opening it would create an empty store.

    The run dir moved or copied with its default local store: the recorded URI names the database at the old
    path (the original's store, or none after a move), as a job's would if it took it; the job takes
    RUN/mlflow.db, and so does replay. That is the case when the recorded URI is an absolute sqlite:///P/mlflow.db
    with P not this run dir, RUN/config.resolved.json names no tracking.uri (a store the user chose stays chosen;
    without the file, the store in the run dir decides), and RUN/mlflow.db exists, or P holds the same run (a
    copy made without its store: refused, as a job there would be, rather than sent to P's)."""
    recorded = folder.recorded_uri()
    env = os.environ.get("MLFLOW_TRACKING_URI")
    own = run_dir.resolve() / LOCAL_DB
    moved_from = _moved_from(recorded, own)
    if uri:
        chosen = _Store(uri, "--uri")
        if moved_from is not None and (database := sqlite_database(uri)) is not None and database.resolve() == own:
            chosen.moved_from = moved_from
    elif moved_from is not None and not _chose_a_uri(run_dir) and (own.is_file() or _copied_from(moved_from, run_id)):
        if not own.is_file():
            raise TrackingError(f"replay: {own} does not exist: the run dir was copied from {moved_from.parent} "
                                f"without its store; copy {moved_from} here, or replay there")
        chosen = _Store(f"sqlite:///{own}", f"the run dir's own store; {folder.uri_file} names {moved_from}, "
                                            "from before the run dir was moved or copied", moved_from)
    elif recorded is not None and "***" not in recorded:
        chosen = _Store(recorded, f"the store the run was logged to, {folder.uri_file}")
    elif env:
        chosen = _Store(env, "MLFLOW_TRACKING_URI; " + (f"{folder.uri_file} not found" if recorded is None else
                                                        f"{folder.uri_file} hides its password or token"))
    elif recorded is None:
        raise TrackingError(f"replay: {folder.uri_file} not found; pass the tracking URI with --uri")
    else:
        raise TrackingError(f"replay: the recorded tracking URI {recorded} hides its password or token; pass the "
                            "full URI with --uri (or MLFLOW_TRACKING_URI)")
    database = sqlite_database(chosen.uri)
    if database is not None and not database.is_file():
        raise TrackingError(f"replay: {database} does not exist (tracking URI {shown_uri(chosen.uri)}); pass the "
                            "--uri of the store that holds the run")
    if database is not None:
        _refuse_empty_store(database, "replay", f"the MLflow run {run_id} recorded in {folder.run_id_file}",
                            "pass the --uri of the store that holds the run")
    return chosen


def _moved_from(recorded: str | None, own: Path) -> Path | None:
    """The recorded database, where it is an absolute sqlite path to a default store (LOCAL_DB) other than
    this run dir's own `own`; else None."""
    old = None if recorded is None else sqlite_database(recorded)
    if old is None or not old.is_absolute() or old.name != LOCAL_DB or old == own or old.resolve() == own:
        return None
    return old


def _copied_from(old: Path, run_id: str) -> bool:
    """Whether the run dir of the recorded database `old` still holds the run: this one is a copy of it."""
    try:
        return TrackingFolder(old.parent).recorded_run_id() == run_id
    except TrackingError:
        return False


def _chose_a_uri(run_dir: Path) -> bool:
    """Whether the last job's resolved config (RUN/config.resolved.json) names a tracking.uri; False where
    the file is missing or unreadable."""
    try:
        resolved = json.loads((run_dir / RESOLVED_CONFIG).read_text(encoding="utf-8"))
        return bool(resolved["tracking"]["uri"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


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
        report.count(run_id, values=n, batches=len(chunk))


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
        report.count(run_id, items=1)
