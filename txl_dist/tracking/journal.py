"""The run dir's tracking/ folder: the recorded run id and URI, the metrics journal, the delivery records,
the outbox and the lock. Nothing here imports mlflow.

The journal, ``<run_dir>/tracking/`` (written by rank 0 alone):

    run_id           the MLflow run id
    uri              the tracking URI, redacted (a password or token shows as ***)
    metrics.jsonl    every batch handed to log_metrics, one line {"seq", "step", "time", "metrics"},
                     appended (written out at once) before it is queued, whether or not the store ever takes it
    delivered.jsonl  the seqs the store accepted, one unbuffered line {"seqs": [[first, last], ...]}
                     written right after each accepted log_batch
    summary.json     what a job's opening read of the journal found, up to the journal's first line the
                     store lacked (its byte offset): the next job reads only the lines after it
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
re-logged), so a crash between delivering and removing one duplicates nothing. An artifact upload that
lands removes the outbox's older copies of the same file (they failed earlier), and a copy with a newer
one waiting is not sent: replay never puts back a stale version.
Artifacts are copied into the outbox at call time: the upload happens later, the file may be rewritten
meanwhile (config.resolved.json is, by every job), and the copy is what replay uploads after a crash.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from txl_dist.atomic import atomic_write

from .errors import TrackingError
from .secrets import shown_uri

logger = logging.getLogger("txl_dist.tracking")  # one logger for the whole package

TRACKING_DIR = "tracking"
"""The journal folder inside the run dir."""
SUMMARY_FILE = "summary.json"
"""The opening's summary of the journal (_summarize), inside the tracking folder."""
JOURNAL_BUFFER_BYTES = 64 * 1024


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
    def destination(self) -> tuple | None:
        """Where an artifact lands in the run (a later upload there replaces it); None for other kinds."""
        meta = self.meta
        return (meta["artifact_path"], meta["name"], meta["is_dir"]) if meta["kind"] == "artifact" else None

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
        self._use(Path(run_dir) / TRACKING_DIR)

    @classmethod
    def at(cls, tracking_dir: Path) -> TrackingFolder:
        """A folder of that layout elsewhere: tracking/superseded/<run id>/ (continuation.py)."""
        folder = cls.__new__(cls)
        folder._use(tracking_dir)
        return folder

    def _use(self, tracking_dir: Path) -> None:
        self.dir = tracking_dir
        self.run_id_file = self.dir / "run_id"
        self.uri_file = self.dir / "uri"
        self.journal = self.dir / "metrics.jsonl"
        self.delivered = self.dir / "delivered.jsonl"
        self.summary_file = self.dir / SUMMARY_FILE
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
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: the run dir given is a file
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise TrackingError(f"tracking: cannot read {path} ({type(e).__name__}: {getattr(e, 'strerror', None) or e}"
                                "); it should hold one line written by the training job: fix or remove it") from None

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

    def journal_batches(self, start: int = 0) -> Iterator[_Batch]:
        """The journal's batches from byte offset start (a line's beginning) on."""
        for batch, _, _ in self._journal_lines(start):
            yield batch

    def _journal_lines(self, start: int = 0) -> Iterator[tuple[_Batch, int, bytes]]:
        """(batch, the byte offset of its line, the line) from offset start on; torn or foreign lines skipped."""
        if not self.journal.is_file():
            return
        with open(self.journal, "rb") as f:
            f.seek(start)
            offset = start
            for line in f:
                at, offset = offset, offset + len(line)
                try:
                    r = json.loads(line)
                    yield _Batch(int(r["seq"]), int(r["step"]), int(r["time"]), dict(r["metrics"])), at, line
                except (KeyError, TypeError, ValueError, AttributeError):
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

    def copies_of(self, item: _OutboxItem) -> tuple[list[_OutboxItem], bool]:
        """The outbox's older items for item's artifact destination, and whether a newer one waits too.
        Older copies are stale once a newer upload is in: sending one after it (a replay of an upload that had
        failed) would put back an old curves.png or evaluation."""
        if item.destination is None:
            return [], False
        same = [other for other in self.outbox_items() if other.destination == item.destination]
        return [o for o in same if o.seq < item.seq], any(o.seq > item.seq for o in same)

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
    first_missing_offset: int = 0
    """The byte offset of the journal's first line the store lacks (its end when none): every line before it
    is delivered, so what sends the missing values starts reading there."""


def _summarize(folder: TrackingFolder, keep: bool = False) -> _JournalSummary:
    """One pass over the journal, tracking's only read of it at a job's start: from the offset that the
    recorded summary.json covers (keep: the opening of a job, which records a new one) to the end.

    A long run's journal grows by ~430 MB per million steps, a read of ~5-15 s; with the summary each job
    reads what the jobs since the last opening wrote (and what the store still lacks). summary.json holds
    next_seq and logged_through of the lines before first_missing_offset (all of them delivered) and that
    offset's preceding line: it is used only for the same run id and a journal that still has that line
    there (the journal is appended to and cut back only after its last newline, so the lines before a
    recorded offset never change; a continuation replaces the journal and the run id together)."""
    delivered_bytes = _size(folder.delivered)
    delivered = folder.delivered_seqs()
    summary = _JournalSummary(next_seq=delivered.max + 1)
    known = _read_summary(folder, delivered_bytes) if keep else None
    start, tail = 0, b""
    if known is not None:
        start, tail = known["offset"], known["tail"].encode("utf-8")
        summary.next_seq = max(summary.next_seq, known["next_seq"])
        summary.logged_through.update(known["logged_through"])
    through = summary.logged_through
    # Past the first undelivered line, next_seq/logged_through of the lines before it are what a new summary keeps.
    kept: tuple[int, dict[str, int]] | None = None
    offset = start
    for batch, at, line in folder._journal_lines(start):
        if kept is None and batch.seq not in delivered:
            summary.first_missing_offset = at
            kept = (summary.next_seq, dict(through))
        summary.next_seq = max(summary.next_seq, batch.seq + 1)
        for key in batch.metrics:
            if batch.step > through.get(key, -1):
                through[key] = batch.step
        if batch.seq not in delivered:
            summary.missing_values += len(batch.metrics)
        offset, tail = at + len(line), line
    if kept is None:
        summary.first_missing_offset = offset
    if keep:
        next_seq, logged = kept if kept is not None else (summary.next_seq, through)
        _record_summary(folder, summary.first_missing_offset, tail if kept is None else
                        _line_before(folder, summary.first_missing_offset), next_seq, logged, delivered_bytes)
    items = folder.outbox_items()
    summary.missing_items = len(items)
    if items:
        summary.next_seq = max(summary.next_seq, items[-1].seq + 1)
    return summary


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_summary(folder: TrackingFolder, delivered_bytes: int) -> dict | None:
    """summary.json if it describes this journal of this run (_summarize), else None (read it all). The
    delivery records only grow too: shorter ones (removed to have everything sent again) void it."""
    try:
        known = json.loads(folder.summary_file.read_text(encoding="utf-8"))
        offset, tail = int(known["offset"]), str(known["tail"]).encode("utf-8")
        if (known["run_id"] != folder.recorded_run_id() or not 0 <= len(tail) <= offset
                or int(known["delivered_bytes"]) > delivered_bytes):
            return None
        known["next_seq"] = int(known["next_seq"])
        known["logged_through"] = {str(k): int(v) for k, v in dict(known["logged_through"]).items()}
        with open(folder.journal, "rb") as f:
            f.seek(offset - len(tail))
            if f.read(len(tail)) != tail or (offset and not tail.endswith(b"\n")):
                return None
        return known
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeError, TrackingError):
        return None  # none yet (an older version's folder), damaged, or another journal: the full read


def _line_before(folder: TrackingFolder, offset: int) -> bytes:
    """The journal's line that ends at offset (b"" at 0)."""
    if offset == 0:
        return b""
    with open(folder.journal, "rb") as f:
        back = min(offset, 1 << 16)
        f.seek(offset - back)
        block = f.read(back)
    return block[block.rfind(b"\n", 0, len(block) - 1) + 1:]


def _record_summary(folder: TrackingFolder, offset: int, tail: bytes, next_seq: int, through: dict[str, int],
                    delivered_bytes: int) -> None:
    """Write summary.json; a failure costs the next job a full read, nothing else."""
    try:
        atomic_write(folder.summary_file, json.dumps(
            {"run_id": folder.recorded_run_id(), "offset": offset, "tail": tail.decode("utf-8"),
             "next_seq": next_seq, "logged_through": through, "delivered_bytes": delivered_bytes},
            separators=(",", ":")) + "\n")
    except (OSError, UnicodeError) as e:
        logger.warning("tracking: cannot write %s (%s); the next job reads the whole journal", folder.summary_file, e)


class _Journal:
    """metrics.jsonl: appended by the training thread, each line written out at once (a process killed after a
    checkpoint keeps every step before it), never waiting for the store.

    A write that fails (a full disk) never reaches the caller: tracking does not stop training, and close()
    often runs while training's own exception is on its way out. The journal is then closed for the rest of
    the job (a torn last line is cut by the next job's repair) and one warning says what that costs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Each line reaches the file as it is appended (one write call, up to the buffer's size): left in the
        # buffer until the writer's next send, it was lost to a SIGKILL while the writer sat in a slow request,
        # though a checkpoint saved meanwhile had gone past its step (the resumed job does not log it again).
        self._file = open(path, "a", encoding="utf-8", buffering=JOURNAL_BUFFER_BYTES)
        self._file.reconfigure(line_buffering=True)
        self._lock = threading.Lock()
        self.error: OSError | None = None

    def append(self, batch: _Batch) -> None:
        line = batch.to_line()
        with self._lock:
            if not self._file.closed:
                self._guarded(self._file.write, line)

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._guarded(self._file.flush)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._guarded(self._file.close)

    def _guarded(self, call: Callable[..., object], *args: object) -> None:
        try:
            call(*args)
        except OSError as e:
            self.error = e
            with contextlib.suppress(OSError):
                self._file.close()  # closed even when its last flush fails
            logger.warning("tracking: cannot write the metrics journal %s (%s); from now on this job's metrics go to "
                           "the store only, and what it does not take cannot be replayed", self.path,
                           e.strerror or e)


class _DeliveryLog:
    """delivered.jsonl: one unbuffered append per accepted chunk, so a crash loses at most the one in flight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def record(self, seqs: Iterable[int]) -> None:
        os.write(self._fd, (json.dumps({"seqs": _as_ranges(seqs)}, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)
