"""MLflow tracking on rank 0: one run per run dir, continued across restarts, with a local journal.

Every rank builds a tracker with ``create_tracker(cfg.tracking, rank, run_dir, resume_run_id)``. Rank 0
gets an ``MlflowTracker``; every other rank, and every rank when tracking is disabled, gets a ``Tracker``:
the same methods doing nothing. ``mlflow`` is imported only by rank 0 (it costs ~1.7 s and ~170 MB per
process).

Opening. The run is the checkpoint's (``resume_run_id``), else the one recorded in
``<run_dir>/tracking/run_id`` (a job that crashed before its first checkpoint left it RUNNING), else a new
one, whose id is written to that file (atomically) as soon as it exists: a later job in the run dir
re-opens it instead of leaving an orphan. A recorded or resumed run that the store does not hold (unknown,
deleted), or a checkpoint whose run differs from the recorded one, is a TrackingError naming the fix,
never a silent new run: the journal in the run dir belongs to the recorded run. The opening calls run with
MLflow's HTTP retries bounded (MLflow reads MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT / _BACKOFF_FACTOR
at each request, so they are lowered around these calls alone): an unreachable store is refused in
seconds, not after minutes of retries, and a refused start writes nothing in the run dir.

Logging goes through an explicit ``MlflowClient`` and run id, never MLflow's fluent API, whose global
"active run" would be hidden state. The training thread never waits on the store: log_params, log_metrics,
log_artifact, log_dict and log_text put an item on a bounded queue that ONE writer thread sends in call
order. A full queue drops the item (counted), a failure is logged once as a warning and training goes
on, and ``close()`` (bounded by its timeout, never raising for the store's errors) reports what was lost.
Params go in batches of 100, values over 6000 characters truncated. MLflow's system metrics
(``system/*``) have their own sampler thread.

The journal, ``<run_dir>/tracking/`` (written by rank 0 alone):

    run_id           the MLflow run id
    uri              the tracking URI, redacted (a password or token shows as ***)
    metrics.jsonl    every batch handed to log_metrics, one line {"seq", "step", "time", "metrics"},
                     appended (buffered) before it is queued, whether or not the store ever takes it
    delivered.jsonl  the seqs the store accepted, one unbuffered line {"seqs": [[first, last], ...]}
                     written right after each accepted log_batch
    outbox/          params, artifacts and the final run status not delivered yet: <seq>.json, and
                     <seq>/ with the file; removed once delivered
    lock             held by the open tracker and by replay: one writer of these files at a time

Delivery bookkeeping. What the store lacks is the journal lines whose seq is not in delivered.jsonl,
plus the outbox. Nothing has to be written at the moment of a failure, a queue overflow or a close
timeout, so a process that dies loses no record of what is missing. The writer flushes the journal
before each send (so everything the store holds is journaled) and records the acceptance right after:
a crash between the two makes replay send that one chunk again, at most max(1000 values, one
log_metrics batch) duplicates. They are exact copies (the journal keeps each value's timestamp), which
MLflow's SQL stores keep once (their metrics key is key, step, timestamp, value); a file store would
show them twice. Outbox deliveries are idempotent (an artifact is overwritten, an identical param
re-logged), so a crash between delivering and removing one duplicates nothing.
Artifacts are copied into the outbox at call time: the upload happens later, the file may be rewritten
meanwhile (config.resolved.json is, by every job), and the copy is what replay uploads after a crash.

Replay: ``python -m txl_dist.tracking replay RUN_DIR [--uri URI]`` sends what is missing to the recorded
run and records it, so a second replay sends nothing. The URI is --uri, else MLFLOW_TRACKING_URI, else
the recorded one; a recorded URI whose secret was redacted needs --uri. It refuses (exit 2) while a job
holds the lock.

Resume rule: at open, the journal gives each metric key's highest logged step j. A job resumed from a
checkpoint at step k < j re-runs steps k+1..j; log_metrics drops values at steps <= j of that key
(counted in Delivery.skipped), because MLflow cannot delete a value once logged. The journal is read
once at open (~5 s for a million steps of 9 keys, a 370 MB file); the store's metric history is never
downloaded.

Secrets: the tracking URI is shown through ``txl_dist.config.redact_uri`` in every message and file;
URLs in exception texts and in params are redacted, and when the URI holds a secret, MLflow's and
urllib3's log records are filtered too. MLflow's set_terminated is not used: it prints the run's URL,
credentials included, to stdout.

Metric names used by the trainer (step = global optimizer step): ``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/tokens_seen``, ``train/step_time_s``,
``train/nonfinite_steps``, ``train/memory_*``, and ``valid/*`` / ``test/*`` from evaluation; any other key
passes through unchanged.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import posixpath
import queue
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from txl_dist.atomic import atomic_write
from txl_dist.config import TrackingConfig, redact_uri
from txl_dist.errors import EXIT_FAILED, EXIT_REFUSED, Refused, RunFailed

logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "txl-dist"
"""Experiment used when neither tracking.experiment nor MLFLOW_EXPERIMENT_NAME is set."""
LOCAL_DB = "mlflow.db"
"""File name of the default local store, inside the run dir."""
LOCAL_ARTIFACTS = "mlartifacts"
"""Artifact folder of an experiment created in a local sqlite store, beside the database file."""
TRACKING_DIR = "tracking"
"""The journal folder inside the run dir."""
CLOSE_STATUSES = ("FINISHED", "FAILED", "KILLED")

# MLflow's own limits (mlflow.utils.validation); a batch over them is refused as a whole.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
TRUNCATED = "...[truncated]"

OPENING_HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 1,
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 1,
    "MLFLOW_HTTP_REQUEST_TIMEOUT": 15,
}
"""Upper bounds for the opening calls: a silent host costs ~2 x 15 s, a refused port ~1 s (MLflow's
defaults, 7 retries doubling from 2 s with a 120 s timeout, take minutes)."""
JOURNAL_BUFFER_BYTES = 64 * 1024


class TrackingError(Refused, RuntimeError):
    """Tracking could not start (unreachable store, unknown run to resume); the message names the fix."""


class ReplayError(RunFailed):
    """The store failed in the middle of a replay; what was sent is recorded, running it again goes on."""


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


def resolve_uri(cfg: TrackingConfig, run_dir: str | os.PathLike) -> str:
    """tracking.uri, else MLFLOW_TRACKING_URI, else a sqlite store at <run_dir>/mlflow.db (no server)."""
    if cfg.uri:
        return cfg.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    # MLflow's own default is sqlite:///<cwd>/mlflow.db: it moves with the working directory of each job.
    return f"sqlite:///{Path(run_dir).resolve() / LOCAL_DB}"


def resolve_experiment(cfg: TrackingConfig) -> str:
    """tracking.experiment, else MLFLOW_EXPERIMENT_NAME, else 'txl-dist'."""
    return cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> {dotted.key: text}; non-strings as JSON (true, null, [2000, 6000]) like the config.

    An empty mapping stays one entry ("{}") so that its key is still visible. Values longer than MLflow's
    6000-character limit are cut and end in '...[truncated]'.
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            text = text[: MAX_PARAM_VALUE_LENGTH - len(TRUNCATED)] + TRUNCATED
        flat[name] = text
    return flat


# -------------------------------------------------------------------------------------------------
# Secrets


def shown_uri(uri: str) -> str:
    """The URI as it may be shown or written: redacted when it holds a password or token, else unchanged."""
    redacted = redact_uri(uri)
    # redact_uri re-assembles every URI; take its result only where it masked something (it would turn
    # sqlite:////abs/path into sqlite://abs/path).
    return redacted if "***" in redacted else uri


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_known_secrets: set[str] = set()
MIN_SECRET_LENGTH = 4
"""A shorter password is not searched for in free text (it would mask ordinary words)."""


def scrub_secrets(text: str) -> str:
    """text with every URL redacted and every known secret (from a tracking URI seen here) masked."""
    text = _URL.sub(lambda m: shown_uri(m.group(0)), text)
    for secret in _known_secrets:
        text = text.replace(secret, "***")
    return text


def _remember_secrets(uri: str) -> bool:
    """Note the password / token values of uri for scrub_secrets; True if it holds any."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return False
    secrets = []
    if parts.password:
        secrets.append(parts.password)
    elif parts.username and "***@" in redact_uri(uri):  # https://TOKEN@host/
        secrets.append(parts.username)
    redacted_query = parse_qsl(urlsplit(redact_uri(uri)).query, keep_blank_values=True)
    original_query = parse_qsl(parts.query, keep_blank_values=True)
    secrets += [value for (_, value), (_, shown) in zip(original_query, redacted_query) if shown == "***"]
    _known_secrets.update(s for s in secrets if len(s) >= MIN_SECRET_LENGTH)
    return bool(secrets)


class _SecretScrubber(logging.Filter):
    """Rewrites a log record's text (and its traceback) through scrub_secrets; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's business, not ours
            return True
        scrubbed = scrub_secrets(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub_secrets(logging.Formatter().formatException(record.exc_info))
        return True


_SCRUBBER = _SecretScrubber()


def _scrub_library_logs() -> None:
    """Attach the scrubber to MLflow's and urllib3's loggers and handlers: their exceptions quote the
    request URL, credentials included (e.g. the system metrics sampler's "Failed to get mlflow run")."""
    names = {"mlflow", "urllib3", "requests"}
    names.update(n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in names)
    for name in sorted(names):
        lib_logger = logging.getLogger(name)
        for target in (lib_logger, *lib_logger.handlers):
            if _SCRUBBER not in target.filters:
                target.addFilter(_SCRUBBER)


def _one_line(exc: BaseException) -> str:
    """MLflow errors can carry whole HTML pages and the request URL; a warning gets the first line,
    bounded, with secrets masked."""
    lines = scrub_secrets(str(exc)).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}"


# -------------------------------------------------------------------------------------------------
# The tracker interface


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

    def close(self, status: str = "FINISHED", timeout: float | None = 120.0) -> Delivery:
        """Flush, stop system metrics and mark the run terminated with status FINISHED, FAILED or KILLED."""
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


def create_tracker(
    cfg: TrackingConfig,
    rank: int,
    run_dir: str | os.PathLike,
    resume_run_id: str | None = None,
) -> Tracker:
    """The tracker of this rank: an open MLflow run on rank 0, else a no-op.

    The run is resume_run_id (the checkpoint's), else the one recorded in <run_dir>/tracking/run_id, else a
    new one. run_dir also holds the journal (<run_dir>/tracking/) and the default local store
    (``<run_dir>/mlflow.db`` and ``<run_dir>/mlartifacts``) when neither tracking.uri nor
    MLFLOW_TRACKING_URI names one.
    """
    if rank != 0 or not cfg.enabled:
        return Tracker()
    return MlflowTracker(cfg, run_dir, resume_run_id=resume_run_id)


# -------------------------------------------------------------------------------------------------
# The journal folder


@dataclasses.dataclass(slots=True)
class _Batch:
    """One log_metrics call: a journal line and a queue item."""

    seq: int
    step: int
    time: int
    metrics: dict[str, float]

    def to_line(self) -> str:
        return json.dumps({"seq": self.seq, "step": self.step, "time": self.time, "metrics": self.metrics},
                          separators=(",", ":")) + "\n"


@dataclasses.dataclass
class _OutboxItem:
    """Params, an artifact or the run status waiting in the outbox: <seq>.json, and <seq>/ for a file."""

    seq: int
    meta: dict[str, Any]
    content: Path

    @property
    def what(self) -> str:
        """For messages: 'params', 'artifact eval/final.json', 'run status'."""
        kind = self.meta["kind"]
        if kind == "artifact":
            return f"artifact {posixpath.join(self.meta['artifact_path'] or '', self.meta['name'])}"
        return "run status" if kind == "status" else kind


class _SeqRanges:
    """A set of journal seqs as sorted, merged [first, last] ranges (the writer acknowledges runs of them)."""

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        merged: list[list[int]] = []
        for first, last in sorted(tuple(r) for r in ranges):
            if merged and first <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        self._firsts = [r[0] for r in merged]
        self._lasts = [r[1] for r in merged]

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._firsts, seq) - 1
        return i >= 0 and seq <= self._lasts[i]

    @property
    def max(self) -> int:
        return self._lasts[-1] if self._lasts else 0


def _as_ranges(seqs: Iterable[int]) -> list[list[int]]:
    """Ascending seqs -> [[first, last], ...] runs of consecutive numbers."""
    ranges: list[list[int]] = []
    for seq in seqs:
        if ranges and seq == ranges[-1][1] + 1:
            ranges[-1][1] = seq
        else:
            ranges.append([seq, seq])
    return ranges


def _json_lines(path: Path) -> Iterator[dict]:
    """The objects of a .jsonl file; a torn line (a crash in the middle of a write) is skipped."""
    if not path.is_file():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def _cut_torn_tail(path: Path) -> None:
    """Truncate a file after its last newline: appending after a torn line would spoil the next one too."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        cut = end
        while cut > 0:  # backwards, a block at a time, to the last newline
            start = max(0, cut - (1 << 16))
            f.seek(start)
            newline = f.read(cut - start).rfind(b"\n")
            if newline >= 0:
                cut = start + newline + 1
                break
            cut = start
        if cut != end:
            f.truncate(cut)


class TrackingFolder:
    """<run_dir>/tracking: the recorded run id and URI, the journal, the delivery records, the outbox, the
    lock. Reading it creates nothing; claim() (after the run is open) creates it."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.dir = Path(run_dir) / TRACKING_DIR
        self.run_id_file = self.dir / "run_id"
        self.uri_file = self.dir / "uri"
        self.journal = self.dir / "metrics.jsonl"
        self.delivered = self.dir / "delivered.jsonl"
        self.outbox = self.dir / "outbox"
        self.lock_file = self.dir / "lock"
        self._lock_fd: int | None = None

    def recorded_run_id(self) -> str | None:
        return self._read(self.run_id_file)

    def recorded_uri(self) -> str | None:
        return self._read(self.uri_file)

    @staticmethod
    def _read(path: Path) -> str | None:
        try:
            return path.read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    def lock(self, holder: str) -> None:
        """Take the folder's lock (created if needed), or TrackingError if another process holds it."""
        import fcntl

        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TrackingError(
                f"tracking: {self.dir} is in use by another process (a training job or a replay); wait for it "
                f"to end before starting {holder}, or give this job its own run.dir") from None
        except OSError as e:  # a file system without flock (some NFS mounts): go on, as run_dir's lock does
            logger.warning("tracking: cannot lock %s (%s); nothing keeps a replay out while this runs",
                           self.lock_file, e)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def record(self, run_id: str, uri: str) -> None:
        """Write the run id and the (redacted) URI, each atomically."""
        if self.recorded_run_id() != run_id:
            atomic_write(self.run_id_file, run_id + "\n")
        if self.recorded_uri() != shown_uri(uri):
            atomic_write(self.uri_file, shown_uri(uri) + "\n")

    def repair(self) -> None:
        """After a crash: cut torn journal lines, remove outbox copies whose item file was never written."""
        _cut_torn_tail(self.journal)
        _cut_torn_tail(self.delivered)
        if self.outbox.is_dir():
            for content in self.outbox.iterdir():
                if content.is_dir() and not content.with_suffix(".json").is_file():
                    shutil.rmtree(content, ignore_errors=True)
                elif content.name.startswith("."):  # an atomic_write temporary left by a crash
                    content.unlink(missing_ok=True)

    def delivered_seqs(self) -> _SeqRanges:
        return _SeqRanges(r for record in _json_lines(self.delivered) for r in record.get("seqs", ()))

    def journal_batches(self) -> Iterator[_Batch]:
        for r in _json_lines(self.journal):
            try:
                yield _Batch(int(r["seq"]), int(r["step"]), int(r["time"]), dict(r["metrics"]))
            except (KeyError, TypeError, ValueError):
                continue

    def outbox_items(self) -> list[_OutboxItem]:
        """The items waiting, in call order."""
        items = []
        for meta_file in sorted(self.outbox.glob("*.json")) if self.outbox.is_dir() else ():
            try:
                meta = json.loads(meta_file.read_text(encoding="utf-8"))
                items.append(_OutboxItem(int(meta_file.stem), meta, meta_file.with_suffix("")))
            except (OSError, ValueError):
                continue
        return items

    def put(self, seq: int, meta: dict[str, Any], fill: Callable[[Path], None] | None = None) -> _OutboxItem:
        """Add an outbox item: its content first (fill writes into <seq>/), then <seq>.json, which commits it."""
        self.outbox.mkdir(parents=True, exist_ok=True)
        item = _OutboxItem(seq, meta, self.outbox / f"{seq:012d}")
        try:
            if fill is not None:
                item.content.mkdir()
                fill(item.content)
            atomic_write(item.content.with_suffix(".json"), json.dumps(meta))
        except BaseException:
            shutil.rmtree(item.content, ignore_errors=True)
            raise
        return item

    def remove(self, item: _OutboxItem) -> None:
        """Delivered: the item file goes first, so a crash in between leaves an orphan copy, not a redo."""
        item.content.with_suffix(".json").unlink(missing_ok=True)
        shutil.rmtree(item.content, ignore_errors=True)


@dataclasses.dataclass
class _JournalSummary:
    """What the journal folder says at open: where seqs go on, which steps are logged, what is missing."""

    next_seq: int = 1
    logged_through: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per metric key, the highest step journaled."""
    missing_values: int = 0
    missing_items: int = 0


def _summarize(folder: TrackingFolder) -> _JournalSummary:
    """One pass over the journal (the only full read of it a job makes)."""
    delivered = folder.delivered_seqs()
    summary = _JournalSummary(next_seq=delivered.max + 1)
    through = summary.logged_through
    for batch in folder.journal_batches():
        summary.next_seq = max(summary.next_seq, batch.seq + 1)
        for key in batch.metrics:
            if batch.step > through.get(key, -1):
                through[key] = batch.step
        if batch.seq not in delivered:
            summary.missing_values += len(batch.metrics)
    items = folder.outbox_items()
    summary.missing_items = len(items)
    if items:
        summary.next_seq = max(summary.next_seq, items[-1].seq + 1)
    return summary


class _Journal:
    """metrics.jsonl: appended by the training thread (buffered), flushed by the writer before it sends."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", encoding="utf-8", buffering=JOURNAL_BUFFER_BYTES)
        self._lock = threading.Lock()

    def append(self, batch: _Batch) -> None:
        line = batch.to_line()
        with self._lock:
            if not self._file.closed:
                self._file.write(line)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _DeliveryLog:
    """delivered.jsonl: one unbuffered append per accepted chunk, so a crash loses at most the one in flight."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def record(self, seqs: Iterable[int]) -> None:
        os.write(self._fd, (json.dumps({"seqs": _as_ranges(seqs)}, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


# -------------------------------------------------------------------------------------------------
# Sending (shared by the writer thread and replay)


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
        _mark_terminated(client, run_id, meta["status"], meta["end_time"])
    else:
        raise ValueError(f"outbox item {item.content.name}.json: unknown kind {kind!r}")


def _mark_terminated(client, run_id: str, status: str, end_time: int) -> None:
    """What MlflowClient.set_terminated does, without its print of the run URL (credentials included)."""
    from mlflow.entities import RunStatus

    client._tracking_client.store.update_run_info(
        run_id, run_status=RunStatus.from_string(status), end_time=end_time, run_name=None)


@contextlib.contextmanager
def _quick_http_failures() -> Iterator[None]:
    """Lower MLflow's HTTP retries and timeout (OPENING_HTTP_LIMITS) inside the block, never raise them.

    MLflow reads these variables at each request, so the limits bind exactly the calls made in the block.
    They are process-wide while it runs: the opening happens before this tracker's writer thread starts.
    """
    saved = {name: os.environ.get(name) for name in OPENING_HTTP_LIMITS}
    try:
        for name, limit in OPENING_HTTP_LIMITS.items():
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


# -------------------------------------------------------------------------------------------------
# Rank 0's tracker


class _Flush:
    """A marker in the queue: set once everything queued before it has been handled."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class MlflowTracker(Tracker):
    """Rank 0's tracker: one MLflow run, everything sent by one background thread, journaled locally."""

    def __init__(
        self,
        cfg: TrackingConfig,
        run_dir: str | os.PathLike,
        resume_run_id: str | None = None,
        max_pending: int = 10_000,
    ) -> None:
        """Open the run. max_pending bounds the queue in calls (steps, params, artifacts) not yet sent."""
        # Imported here, on rank 0 only, and only when tracking is on.
        from mlflow import MlflowClient

        self.uri = resolve_uri(cfg, run_dir)
        self.shown_uri = shown_uri(self.uri)
        self.experiment = resolve_experiment(cfg)
        self.run_dir = Path(run_dir)
        self.folder = TrackingFolder(self.run_dir)
        holds_secret = _remember_secrets(self.uri)
        recorded = self.folder.recorded_run_id()
        if resume_run_id is not None and recorded is not None and resume_run_id != recorded:
            raise TrackingError(
                f"tracking: the checkpoint's MLflow run {resume_run_id} is not the run {recorded} recorded in "
                f"{self.folder.run_id_file}; resume from a checkpoint of this run dir, or remove {self.folder.dir}")
        self.reopened = resume_run_id is not None or recorded is not None
        self.delivery = Delivery()
        self._warned = False
        self._closed = False
        self._lock = threading.Lock()  # guards delivery and _warned: the writer thread updates them too
        if self.uri.startswith("sqlite:///"):
            Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.uri)
        if holds_secret:
            _scrub_library_logs()
        with _quick_http_failures():
            run = self._open_run(cfg, resume_run_id, recorded)
            self._run_id: str = run.info.run_id
            summary = self._claim_folder()
            self._system_monitor = self._start_system_metrics() if cfg.system_metrics else None
        if holds_secret:
            _scrub_library_logs()  # again: the system metrics sampler's logger exists only now
        self._params: dict[str, str] = dict(run.data.params)
        for item in self.folder.outbox_items():  # params an earlier job could not send still count as held
            if item.meta["kind"] == "params":
                self._params.update(item.meta["params"])
        self._logged_through = summary.logged_through
        self._seqs = itertools.count(summary.next_seq)
        self._journal = _Journal(self.folder.journal)
        self._delivered = _DeliveryLog(self.folder.delivered)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._writer = threading.Thread(target=self._send_loop, name="txl-mlflow-writer", daemon=True)
        self._writer.start()
        logger.info("MLflow run %s (%s) at %s", self._run_id, "re-opened" if self.reopened else "new",
                    self.shown_uri)
        self._report_earlier_gaps(summary)

    # ---------------------------------------------------------------------------------------------
    # Opening

    def _open_run(self, cfg: TrackingConfig, resume_run_id: str | None, recorded: str | None):
        try:
            if resume_run_id is not None:
                return self._reopen(resume_run_id, f"the checkpoint's MLflow run {resume_run_id}",
                                    "set tracking.enabled=false")
            if recorded is not None:
                return self._reopen(recorded, f"the MLflow run {recorded} recorded in {self.folder.run_id_file}",
                                    f"remove {self.folder.dir} to start a new run")
            return self._client.create_run(self._experiment_id(), run_name=cfg.run_name, tags=_context_tags())
        except TrackingError:
            raise
        except Exception as e:
            # from None: the cause's text quotes the request URL, credentials included; its first line,
            # scrubbed, is in the message.
            raise TrackingError(
                f"tracking.uri {self.shown_uri}: cannot open an MLflow run ({_one_line(e)}); start the server, "
                f"fix tracking.uri / MLFLOW_TRACKING_URI, or set tracking.enabled=false") from None

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return self._client.create_experiment(self.experiment, artifact_location=self._artifact_location())
            except Exception:
                # Another job may have created it between our two calls.
                experiment = self._client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise TrackingError(
                f"tracking.experiment '{self.experiment}' is deleted in {self.shown_uri}; restore it "
                f"(mlflow experiments restore) or choose another tracking.experiment")
        return experiment.experiment_id

    def _artifact_location(self) -> str | None:
        """Beside a sqlite database file; elsewhere (a server) the store picks the place."""
        if self.uri.startswith("sqlite:///") and not self.uri.endswith(":memory:"):
            db = Path(self.uri[len("sqlite:///"):])
            return (db.parent / LOCAL_ARTIFACTS).resolve().as_uri()
        return None

    def _reopen(self, run_id: str, described: str, other_fix: str):
        """Set a known, active run RUNNING again; described and other_fix word the refusal when it is not."""
        run = _check_reopenable(
            self._client, run_id, self.shown_uri, described,
            unknown_fix=f"point tracking.uri at the store that holds it, or {other_fix}", deleted_fix=other_fix)
        self._client.update_run(run_id, status="RUNNING")
        return run

    def _claim_folder(self) -> _JournalSummary:
        """Lock <run_dir>/tracking, record the run there at once, and read what earlier jobs left."""
        self.folder.lock("this job")
        self.folder.record(self._run_id, self.uri)
        self.folder.repair()
        for item in self.folder.outbox_items():
            if item.meta["kind"] == "status":  # an earlier job's final status: this job sets its own
                self.folder.remove(item)
        return _summarize(self.folder)

    def _report_earlier_gaps(self, summary: _JournalSummary) -> None:
        if summary.logged_through:
            logger.info("tracking: the journal holds steps up to %d; values at steps a key already has are not "
                        "logged again", max(summary.logged_through.values()))
        if summary.missing_values or summary.missing_items:
            logger.warning(
                "tracking: %d metric values and %d params/artifact items of earlier jobs are not in run %s; "
                "`python -m txl_dist.tracking replay %s` sends them", summary.missing_values,
                summary.missing_items, self._run_id, self.run_dir)

    def _start_system_metrics(self):
        """MLflow's CPU/memory/disk/network (and GPU) sampler, bound to this run id and store."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # resume_logging: the system/* steps continue after the ones already in the run.
            monitor = SystemMetricsMonitor(self._run_id, resume_logging=self.reopened, tracking_uri=self.uri)
            monitor.start()
            return monitor
        except Exception as e:
            self._failed("system metrics", 0, e)
            return None

    # ---------------------------------------------------------------------------------------------
    # Logging: the training thread's side (journal, outbox, queue; never the store)

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def active(self) -> bool:
        return not self._closed

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Queue new params (sent in batches of 100); a param the run already holds with another value (a
        resumed run whose config changed) cannot be changed in MLflow: it is kept and named in a warning.
        URLs in values are redacted (a tracking URI with a password)."""
        self._check_open("log_params")
        flat = {key[:MAX_KEY_LENGTH]: scrub_secrets(value) for key, value in flatten_params(params).items()}
        changed = sorted(k for k, v in flat.items() if k in self._params and self._params[k] != v)
        if changed:
            logger.warning(
                "tracking: run %s keeps its earlier values of %d changed param(s): %s", self._run_id,
                len(changed), ", ".join(changed[:20]) + (" ..." if len(changed) > 20 else ""))
        new = {k: v for k, v in flat.items() if k not in self._params}
        if not new:
            return
        self._params.update(new)
        self._put_outbox({"kind": "params", "params": new}, None)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Journal the batch and queue it; values at a step the journal already holds for their key are
        skipped (the resume rule in the module docstring)."""
        self._check_open("log_metrics")
        step = int(step)
        values = {key: float(value) for key, value in metrics.items() if value is not None}
        logged = {key for key in values if step <= self._logged_through.get(key, -1)}
        if logged:  # a resumed job repeating a step the journal already holds
            self.delivery.skipped += len(logged)
            values = {key: value for key, value in values.items() if key not in logged}
        if not values:
            return
        batch = _Batch(next(self._seqs), step, int(time.time() * 1000), values)
        self._journal.append(batch)
        self._enqueue(batch, len(values))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy the file (or folder) into the outbox now and queue its upload."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tracking: artifact {path} does not exist")
        self._check_open("log_artifact")
        is_dir = path.is_dir()

        def copy(content: Path) -> None:
            if is_dir:
                shutil.copytree(path, content / path.name)
            else:
                shutil.copy2(path, content / path.name)

        meta = {"kind": "artifact", "name": path.name, "artifact_path": artifact_path, "is_dir": is_dir}
        self._put_outbox(meta, copy)

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """Serialized now, as MLflow would: YAML for .yml/.yaml, else JSON (indented, str() for the rest)."""
        if posixpath.splitext(artifact_file)[1] in (".yml", ".yaml"):
            import yaml

            text = yaml.dump(dict(dictionary), indent=2, default_flow_style=False)
        else:
            text = json.dumps(dict(dictionary), indent=2, default=str)
        self.log_text(text, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Write the text into the outbox now and queue its upload as artifact_file."""
        self._check_open("log_text")
        folder, name = posixpath.split(artifact_file)

        def write(content: Path) -> None:
            (content / name).write_text(text, encoding="utf-8")

        self._put_outbox({"kind": "artifact", "name": name, "artifact_path": folder or None, "is_dir": False},
                         write)

    def flush(self, timeout: float | None = None) -> bool:
        """Write the journal out, then wait until everything queued is sent or failed."""
        if self._closed:
            return True
        self._journal.flush()
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"tracking: {call} after close() (run {self._run_id})")

    def _put_outbox(self, meta: dict[str, Any], fill: Callable[[Path], None] | None) -> None:
        seq = next(self._seqs)
        try:
            item = self.folder.put(seq, meta, fill)
        except OSError as e:  # the run dir's disk, not the store: still no reason to stop training
            self._failed(f"{meta['kind']} (writing the outbox)", 1, e)
            return
        self._enqueue(item, 1)

    def _enqueue(self, item: _Batch | _OutboxItem, n: int) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self.delivery.dropped += n
            self._warn_once(f"the queue is full ({self._queue.maxsize} calls waiting for {self.shown_uri}); "
                            "what does not fit stays in the journal for replay")

    # ---------------------------------------------------------------------------------------------
    # Closing

    def close(self, status: str = "FINISHED", timeout: float | None = 120.0) -> Delivery:
        """Stop system metrics, send what is queued (at most timeout seconds), terminate the run.

        Returns the delivery counts and logs one warning if anything was dropped or failed (it stays in the
        journal for replay). Never raises for the store's errors: this often runs while an exception from
        training is on its way out.
        """
        _check_status(status)
        if self._closed:
            return self.delivery
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each store call below may sit in MLflow's HTTP retries for minutes when the server is gone; run
        # them in helper threads so that the timeout bounds close() as a whole.
        if self._system_monitor is not None:
            # Before the run is terminated: the monitor's last samples need a RUNNING run.
            if not _finish_by(deadline, self._system_monitor.finish):
                self._failed("system metrics", 0, TimeoutError("close timed out stopping system metrics"))
        self._journal.flush()
        writer_done = self._stop_writer(deadline)
        self._terminate(status, deadline)
        self._journal.close()
        if writer_done:  # a writer still in a request may yet record its chunk as delivered
            self._delivered.close()
        self.folder.unlock()
        self._report(status)
        return self.delivery

    def _stop_writer(self, deadline: float | None) -> bool:
        try:
            self._queue.put(_STOP, timeout=_left(deadline))
        except queue.Full:
            pass
        self._writer.join(_left(deadline))
        if self._writer.is_alive():
            self._count_unsent()
            return False
        return True

    def _terminate(self, status: str, deadline: float | None) -> None:
        """Mark the run terminated; the status waits in the outbox until the store has it (replay sends it)."""
        try:
            item = self.folder.put(next(self._seqs), {"kind": "status", "status": status,
                                                      "end_time": int(time.time() * 1000)})
        except OSError as e:
            self._failed("run status (writing the outbox)", 0, e)
            return
        errors: list[BaseException] = []

        def terminate() -> None:
            try:
                _deliver_item(self._client, self._run_id, item)
                self.folder.remove(item)
            except Exception as e:
                errors.append(e)

        if not _finish_by(deadline, terminate):
            errors.append(TimeoutError(f"close timed out marking the run {status}"))
        if errors:
            self._failed("run status", 0, errors[0])

    def _report(self, status: str) -> None:
        d = self.delivery
        if d.ok:
            return
        logger.warning(
            "tracking: run %s (closing as %s): %d metric values sent, %d dropped because the queue was full, "
            "%d values or items failed%s; the journal keeps them: `python -m txl_dist.tracking replay %s` sends "
            "what is missing", self._run_id, status, d.sent, d.dropped, d.failed,
            f"; first error: {d.first_error}" if d.first_error else "", self.run_dir)

    # ---------------------------------------------------------------------------------------------
    # The writer thread and error policy

    def _send_loop(self) -> None:
        """Handle queue items in call order: runs of metric batches as one log_batch, items one by one."""
        carry = None
        while True:
            item = carry if carry is not None else self._queue.get()
            carry = None
            try:
                if isinstance(item, _Batch):
                    batches, carry = self._gather(item)
                    self._deliver_metrics(batches)
                elif isinstance(item, _OutboxItem):
                    self._deliver(item)
                elif isinstance(item, _Flush):
                    item.done.set()
                elif item is _STOP:
                    return
            except Exception as e:  # a writer that died would leave every later flush() waiting forever
                self._failed("the delivery records", 0, e)

    def _gather(self, first: _Batch) -> tuple[list[_Batch], Any]:
        """first and the metric batches queued right after it, up to one log_batch; and the next other item."""
        batches, size = [first], len(first.metrics)
        while size < MAX_METRICS_PER_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batches, None
            if not isinstance(item, _Batch):
                return batches, item
            batches.append(item)
            size += len(item.metrics)
        return batches, None

    def _deliver_metrics(self, batches: list[_Batch]) -> None:
        # The journal first: whatever the store holds is journaled, so a restart never logs it again.
        self._journal.flush()
        for chunk in _chunks(batches):
            n = sum(len(b.metrics) for b in chunk)
            try:
                _send_metrics(self._client, self._run_id, chunk)
            except Exception as e:
                self._failed("metrics", n, e)
                continue
            self._delivered.record(b.seq for b in chunk)
            with self._lock:
                self.delivery.sent += n

    def _deliver(self, item: _OutboxItem) -> None:
        try:
            _deliver_item(self._client, self._run_id, item)
        except Exception as e:
            self._failed(item.what, 1, e)
            return
        self.folder.remove(item)

    def _count_unsent(self) -> None:
        """At the close timeout: what is still queued will not be sent now; count it as failed."""
        n = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Batch):
                n += len(item.metrics)
            elif isinstance(item, _OutboxItem):
                n += 1
        with self._lock:
            self.delivery.failed += n
            self.delivery.first_error = self.delivery.first_error or f"close timed out with {n} values unsent"

    def _failed(self, what: str, n: int, exc: BaseException) -> None:
        with self._lock:
            self.delivery.failed += n
            if self.delivery.first_error is None:
                self.delivery.first_error = _one_line(exc)
        self._warn_once(f"could not log {what} to {self.shown_uri} ({_one_line(exc)})")

    def _warn_once(self, message: str) -> None:
        # One warning per run: a server that is down would otherwise warn at every step.
        with self._lock:
            if self._warned:
                return
            self._warned = True
        logger.warning("tracking: %s; training goes on, further failures are counted and reported by close()",
                       message)


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


def _left(deadline: float | None) -> float | None:
    """Seconds until deadline (None: no limit), never negative."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _finish_by(deadline: float | None, fn) -> bool:
    """Run fn in a daemon thread and wait for it until deadline; False if it is still running then."""
    thread = threading.Thread(target=fn, name="txl-mlflow-close", daemon=True)
    thread.start()
    thread.join(_left(deadline))
    return not thread.is_alive()


def _context_tags() -> dict[str, str]:
    """MLflow's usual run tags (user, source script, git commit), as its fluent start_run would set them."""
    try:
        from mlflow.tracking.context.registry import resolve_tags

        return resolve_tags()
    except Exception:  # tags are a convenience; never a reason to stop a job
        return {}


# -------------------------------------------------------------------------------------------------
# Replay


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

    uri: --uri, else MLFLOW_TRACKING_URI, else the recorded one (refused when its secret was redacted).
    TrackingError for a refusal (nothing recorded, a redacted URI, a job holding the run dir, an unknown
    run); ReplayError when the store fails midway (what was sent stays recorded; run it again).
    """
    from mlflow import MlflowClient

    folder = TrackingFolder(run_dir)
    run_id = folder.recorded_run_id()
    if run_id is None:
        raise TrackingError(f"replay: {folder.run_id_file} not found; this run dir has no MLflow run (tracking "
                            "was off, or it is not a run dir)")
    uri = _replay_uri(folder, uri)
    if _remember_secrets(uri):
        _scrub_library_logs()
    report = ReplayReport(run_id, shown_uri(uri))
    folder.lock("replay")
    try:
        client = MlflowClient(tracking_uri=uri)
        _check_replay_target(client, folder, run_id, report.uri)
        folder.repair()
        _replay_metrics(client, folder, report)
        _replay_outbox(client, folder, report)
    finally:
        folder.unlock()
    return report


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
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    recorded = folder.recorded_uri()
    if recorded is None:
        raise TrackingError(f"replay: {folder.uri_file} not found; pass the tracking URI with --uri")
    if "***" in recorded:
        raise TrackingError(f"replay: the recorded tracking URI {recorded} hides its password or token; pass the "
                            "full URI with --uri (or MLFLOW_TRACKING_URI)")
    return recorded


def _replay_metrics(client, folder: TrackingFolder, report: ReplayReport) -> None:
    """Stream the journal; send the undelivered batches in chunks, each recorded once the store has it."""
    delivered = folder.delivered_seqs()
    log = _DeliveryLog(folder.delivered)
    try:
        pending: list[_Batch] = []
        size = 0
        for batch in folder.journal_batches():
            if batch.seq in delivered:
                continue
            pending.append(batch)
            size += len(batch.metrics)
            if size >= MAX_METRICS_PER_BATCH:
                _replay_chunks(client, pending, log, report)
                pending, size = [], 0
        _replay_chunks(client, pending, log, report)
    finally:
        log.close()


def _replay_chunks(client, batches: list[_Batch], log: _DeliveryLog, report: ReplayReport) -> None:
    for chunk in _chunks(batches):
        try:
            n = _send_metrics(client, report.run_id, chunk)
        except Exception as e:
            raise ReplayError(f"replay stopped after {report.values} metric values: {_one_line(e)}; what was sent "
                              "is recorded, run replay again when the store answers") from None
        log.record(b.seq for b in chunk)
        report.values += n
        report.batches += len(chunk)


def _replay_outbox(client, folder: TrackingFolder, report: ReplayReport) -> None:
    for item in folder.outbox_items():
        try:
            _deliver_item(client, report.run_id, item)
        except Exception as e:
            raise ReplayError(f"replay stopped at {item.what}: {_one_line(e)}; what was sent is recorded, run "
                              "replay again when the store answers") from None
        folder.remove(item)
        report.items += 1


def main(argv: list[str] | None = None) -> int:
    """``python -m txl_dist.tracking replay RUN_DIR [--uri URI]``; the exit status (0, 1 store failure, 2 refused)."""
    parser = argparse.ArgumentParser(prog="python -m txl_dist.tracking",
                                     description="MLflow tracking tools for a txl-dist run dir.")
    commands = parser.add_subparsers(dest="command", required=True)
    replay_cmd = commands.add_parser(
        "replay", help="send to the run's MLflow run what its journal says the store lacks",
        description="Send the metrics, params, artifacts and final status that the training job could not "
                    "deliver (server down, queue full, close timeout, crash) to the run recorded in "
                    "RUN_DIR/tracking/run_id. Safe to repeat: a second replay sends nothing.")
    replay_cmd.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of the training job")
    replay_cmd.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else the recorded one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = replay(args.run_dir, args.uri)
    except Refused as e:
        print(scrub_secrets(str(e)), file=sys.stderr)
        return EXIT_REFUSED
    except RunFailed as e:
        print(scrub_secrets(str(e)), file=sys.stderr)
        return EXIT_FAILED
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
