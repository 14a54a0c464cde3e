"""The calls to the MLflow store shared by rank 0's writer thread and replay: metric chunks, outbox items
(params, artifacts, the final run status), the bounded retries of the opening calls, the check of a run
to re-open. ``mlflow`` is imported inside the functions that call it, never at import time.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import TrackingError
from .journal import TrackingFolder, _Batch, _OutboxItem

# MLflow's own limits (mlflow.utils.validation); a batch over them is refused as a whole.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250

LOCAL_ARTIFACTS = "mlartifacts"
"""Artifact folder of an experiment created in a local sqlite store, beside the database file."""

OPENING_HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 1,
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
    "MLFLOW_HTTP_REQUEST_TIMEOUT": 15,
}
"""Upper bounds for the opening calls: a silent host costs ~2 x 15 s, a refused port ~1 s (MLflow's
defaults, 7 retries doubling from 2 s with a 120 s timeout, take minutes)."""
RUNNING_HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 2,
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
    "MLFLOW_HTTP_REQUEST_TIMEOUT": 20,
}
"""Upper bounds while a run logs (the writer thread, system metrics, the close): a store that went away is
noticed in seconds (a refused port ~3 s, a silent host ~1 min), not after minutes of MLflow's retries that
would also hold the job's exit; what fails stays in the journal for replay."""


def _undelivered(folder: TrackingFolder, through_seq: float = float("inf"), start: int = 0) -> Iterator[list[_Batch]]:
    """The journal's batches the store lacks (seqs <= through_seq), streamed in runs of about one log_batch
    of values (replay, and a job sending what earlier jobs could not); start: a byte offset of the journal
    before which every line is delivered."""
    delivered = folder.delivered_seqs()
    pending: list[_Batch] = []
    size = 0
    for batch in folder.journal_batches(start):
        if batch.seq > through_seq:
            break
        if batch.seq in delivered:
            continue
        pending.append(batch)
        size += len(batch.metrics)
        if size >= MAX_METRICS_PER_BATCH:
            yield pending
            pending, size = [], 0
    if pending:
        yield pending


def _chunks(batches: list[_Batch]) -> Iterator[list[_Batch]]:
    """Whole batches in groups of at most MAX_METRICS_PER_BATCH values (a larger batch goes alone)."""
    chunk: list[_Batch] = []
    size = 0
    for batch in batches:
        if chunk and size + len(batch.metrics) > MAX_METRICS_PER_BATCH:
            yield chunk
            chunk, size = [], 0
        chunk.append(batch)
        size += len(batch.metrics)
    if chunk:
        yield chunk


def _send_metrics(client, run_id: str, chunk: list[_Batch]) -> int:
    """log_batch the chunk's values (split at MLflow's limit); returns how many."""
    from mlflow.entities import Metric

    metrics = [Metric(key, value, b.time, b.step) for b in chunk for key, value in b.metrics.items()]
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        # synchronous: MLFLOW_ENABLE_ASYNC_LOGGING must not move errors out of our sight.
        client.log_batch(run_id, metrics=metrics[i: i + MAX_METRICS_PER_BATCH], synchronous=True)
    return len(metrics)


ENDED_TAG = "txl.ended"
"""How the last job of the run ended ("stopped after step N (SIGTERM on rank 0); ..."); removed when a job
re-opens the run."""
MAX_TAG_CHARS = 5000  # MLflow's limit on a tag value (older servers)


def _deliver_item(client, run_id: str, item: _OutboxItem) -> None:
    """Send one outbox item to the store."""
    meta = item.meta
    kind = meta["kind"]
    if kind == "params":
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in meta["params"].items()]
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i: i + MAX_PARAMS_PER_BATCH], synchronous=True)
    elif kind == "artifact":
        source = str(item.content / meta["name"])
        if meta["is_dir"]:
            client.log_artifacts(run_id, source, meta["artifact_path"])
        else:
            client.log_artifact(run_id, source, meta["artifact_path"])
    elif kind == "status":
        if meta.get("ended"):
            client.set_tag(run_id, ENDED_TAG, meta["ended"][:MAX_TAG_CHARS], synchronous=True)
        _mark_terminated(client, run_id, meta["status"], meta["end_time"])
    else:
        raise ValueError(f"outbox item {item.content.name}.json: unknown kind {kind!r}")


def _mark_terminated(client, run_id: str, status: str, end_time: int) -> None:
    """What MlflowClient.set_terminated does, without its print of the run URL (credentials included)."""
    from mlflow.entities import RunStatus

    client._tracking_client.store.update_run_info(
        run_id, run_status=RunStatus.from_string(status), end_time=end_time, run_name=None)


@contextlib.contextmanager
def _quick_http_failures(limits: dict[str, int] = OPENING_HTTP_LIMITS) -> Iterator[None]:
    """Lower MLflow's HTTP retries and timeout (`limits`) inside the block, never raise them.

    MLflow reads these variables at each request, so the limits bind exactly the calls made in the block.
    They are process-wide while it runs: the opening happens before this tracker's writer thread starts.
    """
    saved = {name: os.environ.get(name) for name in limits}
    try:
        for name, limit in limits.items():
            try:
                current = int(saved[name]) if saved[name] is not None else limit
            except ValueError:
                current = limit
            os.environ[name] = str(min(current, limit))
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _check_reopenable(client, run_id: str, shown: str, described: str, unknown_fix: str, deleted_fix: str):
    """The run, or TrackingError (one line, naming the fix) when the store lacks it or it is deleted.

    described names the run in the message, e.g. "the checkpoint's MLflow run <id>".
    """
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise TrackingError(f"tracking: {described} is not in {shown}; {unknown_fix}") from None
        raise
    if run.info.lifecycle_stage != "active":
        raise TrackingError(f"tracking: {described} is deleted in {shown}; restore it "
                            f"(mlflow runs restore --run-id {run_id}) or {deleted_fix}")
    return run


def sqlite_database(uri: str) -> Path | None:
    """The database file of a sqlite URI (sqlite:///path), else None (a server, sqlite's :memory:)."""
    if uri.startswith("sqlite:///") and not uri.endswith(":memory:"):
        return Path(uri[len("sqlite:///"):])
    return None


def _refuse_empty_store(database: Path, refused: str, described: str, fix: str) -> None:
    """TrackingError (one line: `<refused>: <database> is empty ...`) where the sqlite file of a store that must
    hold `described` has 0 bytes (a copy cut short, a disk that filled). Opened, MLflow would make it an empty
    store, and the refusal that follows would blame the run; the file is left as it is."""
    try:
        empty = database.stat().st_size == 0
    except OSError:  # missing: the callers say so in their own words
        return
    if empty:
        raise TrackingError(f"{refused}: {database} is empty (0 bytes: a copy cut short, or a disk that filled), so "
                            f"it does not hold {described}; put the store back (copy the whole mlflow.db), or {fix}")


def _relocate_local_artifacts(database: Path, old_database: Path, new_location: str) -> int:
    """A run dir moved or copied (another machine, another path) with its local sqlite store: the store's
    experiment and runs still name the old run dir's artifact folder (an absolute file:// URI, fixed when the
    experiment was made), so uploads would go there: outside this run dir, into the original's folder where it
    still exists (a copy's curves.png over the original's), or fail. Point the rows that name the old folder,
    <old_database's folder>/mlartifacts, at new_location; returns how many. MLflow has no call that moves
    artifact locations: two UPDATEs of its tables (experiments.artifact_location, runs.artifact_uri)."""
    import sqlite3

    old_location = (old_database.parent / LOCAL_ARTIFACTS).as_uri()
    if old_location == new_location:
        return 0
    with contextlib.closing(sqlite3.connect(database, timeout=30)) as db, db:
        moved = db.execute("UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?",
                           (new_location, old_location)).rowcount
        moved += db.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE artifact_uri = ? OR "
                            "substr(artifact_uri, 1, ?) = ?", (new_location, len(old_location) + 1, old_location,
                                                                len(old_location) + 1, old_location + "/")).rowcount
    return moved
