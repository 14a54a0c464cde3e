"""The run folder (run.dir): where everything a run writes lives, and the lock that keeps a second job out.

```
RUN/checkpoints/          tags and `latest` (txl_dist.checkpoint)
RUN/config.resolved.json  the configuration as the run resolved it (secrets masked)
RUN/curves.png            the loss curves, redrawn by rank 0 after each evaluation (txl_dist.curves)
RUN/logs/train.log        rank 0's log, appended by every job of the run (rank-NNNNN.log with --log-all-ranks)
RUN/tracking/             the local metrics journal and the MLflow run id (txl_dist.tracking)
RUN/mlflow.db, mlartifacts/  the default MLflow store when no tracking URI is set
RUN/.lock                 held by rank 0 of the job that trains in this folder
RUN/.corpus-hashes/       the sha256 of corpus files as hashed at an earlier start (txl_dist.data.hash_record)
RUN/.shared-check-*       for a moment at start-up: the file every rank reads back (one folder for all ranks)
```
The lock is an advisory flock on RUN/.lock: the kernel drops it when the holder's process ends, however it
ends, so a dead job never keeps it (except on a network file system whose lock outlives a dead node: a
requeued Slurm job then takes over its own earlier start's lock, see acquire_lock). The file also says who
holds it, for the refusal message, and for one more check: on a file system whose locks are local to each node
(Lustre -o localflock, NFS local_lock=flock) a job on another node gets the lock while its holder runs, so a
lock granted over the record of another Slurm job on another host that scontrol says is running is refused
(a holder that releases the lock clears its record: only one that holds it, or died, leaves one).
On file systems without flock support the job warns and goes on unlocked.

Standard library only (and txl_dist's errors and output_paths, which are too).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import Refused, one_line
from .output_paths import is_corpus

LOCK_FILE = ".lock"
RESOLVED_CONFIG = "config.resolved.json"
OWN_FILES = (RESOLVED_CONFIG, "curves.png", "mlflow.db", LOCK_FILE)
"""The files a run writes at the top of its folder (the layout above): another program's output must not replace
them (output_paths.check_output_file)."""
OWN_FOLDERS = ("checkpoints", "logs", "tracking", "mlartifacts", ".corpus-hashes")
"""The folders a run writes into (the layout above): no other program's output file belongs in them."""


class RunDirBusy(Refused):
    """Another job holds the run folder."""


class RunDirUnusable(Refused):
    """The run folder cannot be made or written."""


@dataclass(frozen=True)
class RunDir:
    """The paths of one run folder."""

    path: Path

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def tracking(self) -> Path:
        return self.path / "tracking"

    @property
    def corpus_hashes(self) -> Path:
        return self.path / ".corpus-hashes"

    @property
    def resolved_config(self) -> Path:
        return self.path / RESOLVED_CONFIG

    def log_file(self, rank: int) -> Path:
        return self.logs / ("train.log" if rank == 0 else f"rank-{rank:05d}.log")


def check_run_dir_place(run_dir: str | os.PathLike, corpus: str | os.PathLike) -> None:
    """Refuse (RunDirUnusable, naming run.dir) a run folder that is the corpus folder `corpus` (data.path) or
    lies in it, or in any other prepared corpus: the lock, logs, checkpoints and tracking store would be
    written among the corpus' files. Paths only (and the markers of a corpus): nothing is made or read, so
    start-up refuses it before the corpus is verified or the lock taken."""
    run, data = Path(run_dir).resolve(), Path(corpus).resolve()
    inside = data if run.is_relative_to(data) else next((f for f in (run, *run.parents) if is_corpus(f)), None)
    if inside is not None:
        where = ("is the corpus folder (data.path)" if run == data else f"lies in the corpus {corpus} (data.path)"
                 if inside == data else f"is the corpus {inside}" if run == inside else f"lies in the corpus {inside}")
        raise RunDirUnusable(f"run.dir {run_dir} {where}; the run's lock, logs and checkpoints would be written "
                             "among its files: choose a run.dir outside it")


SHARED_CHECK_PREFIX = ".shared-check-"
"""A file rank 0 writes into the run folder at start-up and every rank reads back (startup.check_run_dir_shared)."""


def write_shared_check(run_dir: Path) -> str:
    """Write a new check file into run_dir; its name (which is also its content)."""
    name = f"{SHARED_CHECK_PREFIX}{os.urandom(8).hex()}"
    (run_dir / name).write_text(name)
    return name


def sees_shared_check(run_dir: Path, name: str, wait_s: float = 5.0) -> bool:
    """Whether run_dir holds the check file `name` as written; a file written on another node may reach this one's
    view of a network file system a moment later, so a missing file is looked for again until wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return (run_dir / name).read_text() == name
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)
        except OSError:
            return False


class RunLock:
    """An exclusive hold on a run folder for the lifetime of this process (or until release())."""

    def __init__(self, fd: int | None, path: Path) -> None:
        self._fd, self.path = fd, path

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            try:
                # The record names a holder no more: left there, a job on another node would be refused while
                # this Slurm job goes on with other work (_running_elsewhere). One that dies keeps its record.
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def acquire_lock(run_dir: Path, *, purpose: str = "training", stale_after_s: float = 0.0) -> RunLock:
    """Lock run_dir/.lock, or RunDirBusy naming the job that holds it.

    stale_after_s: when the holder is an earlier start of this very Slurm job (the same SLURM_JOB_ID, a lower
    SLURM_RESTART_COUNT: Slurm requeued the job, so that start has ended), wait this long for the lock to be
    released, then take it over. A network file system can keep a lock after its holder's node died (NFSv3's
    lock manager until the node reboots, NFSv4 until its lease runs out); the wait lets the old start's
    surviving ranks end (train.collective_timeout_s), so two jobs never write here at once.
    """
    path = run_dir / LOCK_FILE
    fd = _open_lock_file(run_dir, path)
    locked = _try_flock(fd, run_dir)
    if locked is None:
        os.close(fd)
        return RunLock(None, path)
    if locked:
        holder = _read_holder(path)
        if _running_elsewhere(holder):
            os.close(fd)
            raise RunDirBusy(f"run.dir {run_dir} is in use by another job ({_describe(holder)}, still running "
                             "by scontrol), although this node got its lock: the file system's locks are local "
                             "to each node (Lustre -o localflock, NFS local_lock); wait for that job to end or "
                             "choose another run.dir, and ask for cluster-wide locks (Lustre -o flock)")
        return _held(fd, path, purpose)
    os.close(fd)
    holder = _read_holder(path)
    if stale_after_s > 0 and _earlier_start_of_this_job(holder):
        return _take_over(run_dir, path, holder, purpose, stale_after_s)
    raise _busy(run_dir, holder)


def _open_lock_file(run_dir: Path, path: Path) -> int:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirUnusable(f"run.dir {run_dir}: cannot be made or written ({e.strerror or one_line(e)}"
                             f"{': ' + str(e.filename) if e.filename else ''}); choose another run.dir") from None


def _try_flock(fd: int, run_dir: Path) -> bool | None:
    """True when this process now holds the lock, False when another does, None (and a warning) when the file
    system has no locks."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        logging.getLogger("txl_dist").warning(
            "run.dir %s: this file system does not support locks (%s); nothing keeps a second job out",
            run_dir, one_line(e))
        return None


def _held(fd: int, path: Path, purpose: str) -> RunLock:
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
              "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    except OSError as e:  # a full disk: the errno alone names no file
        os.close(fd)
        raise RunDirUnusable(f"run.dir {path.parent}: cannot write its lock file {path.name} "
                             f"({e.strerror or one_line(e)}); free space there or choose another run.dir") from None
    return RunLock(fd, path)


SLURM_LIVE_STATES = ("RUNNING", "SUSPENDED", "COMPLETING", "STOPPED", "CONFIGURING", "SIGNALING", "STAGE_OUT")
"""Job states in which a job's processes may still write its run folder."""


def _running_elsewhere(holder: dict | None) -> bool:
    """Whether the lock file names another Slurm job, on another host, that Slurm says is still running: then
    this node was given a lock that job holds, a file system whose locks are node-local. On one host flock
    is exact (the holder ended), and outside Slurm there is no one to ask."""
    job = str((holder or {}).get("slurm_job_id") or "")
    if not job.isdigit() or job == os.environ.get("SLURM_JOB_ID") or holder.get("host") == socket.gethostname():
        return False
    import subprocess

    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    state = next((w.split("=", 1)[1] for w in shown.stdout.split() if w.startswith("JobState=")), "")
    return shown.returncode == 0 and state in SLURM_LIVE_STATES


def _earlier_start_of_this_job(holder: dict | None) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not holder or str(holder.get("slurm_job_id")) != job:
        return False
    try:
        return int(holder.get("slurm_restart_count", -1)) < int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except (TypeError, ValueError):
        return False


def _take_over(run_dir: Path, path: Path, holder: dict, purpose: str, wait_s: float) -> RunLock:
    """Wait up to wait_s for an ended start's lock; then replace the lock file (a lock lives on the old file's
    inode, so a new file is free) and take the new one."""
    log = logging.getLogger("txl_dist")
    log.warning("run.dir %s: the lock is still held by an earlier start of this Slurm job (%s), which Slurm "
                "requeued; waiting up to %.0f s for it to be released, then taking it over",
                run_dir, _describe(holder), wait_s)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        fd = _open_lock_file(run_dir, path)
        if _try_flock(fd, run_dir):
            return _held(fd, path, purpose)
        os.close(fd)
        _refuse_unless_earlier_start(run_dir, path)
    _refuse_unless_earlier_start(run_dir, path)  # the last look before the lock file is replaced
    path.unlink(missing_ok=True)
    fd = _open_lock_file(run_dir, path)
    if not _try_flock(fd, run_dir):
        os.close(fd)
        raise _busy(run_dir, _read_holder(path))
    log.warning("run.dir %s: took over the lock of %s", run_dir, _describe(holder))
    return _held(fd, path, purpose)


def _refuse_unless_earlier_start(run_dir: Path, path: Path) -> None:
    """RunDirBusy when the lock, still held, is no longer an earlier start's of this job: the earlier start
    released it during the wait and another job took it, whose lock must not be replaced. A record that names no
    holder is the moment between a release (which clears it) and the close, or between a new holder's lock and
    its record: the next try tells."""
    holder = _read_holder(path)
    if holder is not None and not _earlier_start_of_this_job(holder):
        raise _busy(run_dir, holder)


def _busy(run_dir: Path, holder: dict | None) -> RunDirBusy:
    return RunDirBusy(f"run.dir {run_dir} is in use by another job ({_describe(holder)}); wait for it to end or "
                      "choose another run.dir")


def _read_holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict | None) -> str:
    try:
        job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
        restart = f" restart {holder['slurm_restart_count']}" if job and holder.get("slurm_restart_count") else ""
        return (f"{holder.get('purpose', 'a job')} on host {holder['host']}, pid {holder['pid']}, "
                f"since {holder['since']}{job}{restart}")
    except (AttributeError, KeyError, TypeError):
        return "holder unknown"


class RunLogFile(logging.FileHandler):
    """The run's log file, which a full (or failing) disk must not turn into a flood: logging's own handleError
    prints a traceback and the record for every line it cannot write (thousands on a full run folder). The
    first failed write says so in one line on stderr, and the file takes no more records; close never raises."""

    def __init__(self, path: Path):
        super().__init__(path, mode="a", encoding="utf-8")
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def flush(self) -> None:
        if self.failed:
            return
        try:
            super().flush()
        except (OSError, ValueError):
            self.handleError(None)  # type: ignore[arg-type]

    def handleError(self, record: logging.LogRecord) -> None:
        reason = sys.exc_info()[1]
        if record is not None and not isinstance(reason, OSError):
            super().handleError(record)  # a record that cannot be formatted: a bug to show, not the disk
            return
        if self.failed:
            return
        self.failed = True
        try:
            sys.stderr.write(f"warning: the run's log file {self.baseFilename} cannot be written "
                             f"({one_line(reason) if reason else 'unknown error'}); this job's log goes to the "
                             "console only from now on\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        try:
            super().close()
        except (OSError, ValueError):  # the buffered tail could not be flushed: handleError has said so, or now
            self.handleError(None)  # type: ignore[arg-type]


_log_file: RunLogFile | None = None


def attach_log_file(logger: logging.Logger, path: Path) -> None:
    """Append the logger's records to `path` too (same format as the console), until detach_log_file();
    one file per process: attaching another detaches the previous one. The entry point detaches it after
    it has logged how the job ended, so the run's log says why a job stopped. RunDirUnusable when the file
    cannot be opened (logs/ a file, the log file a folder, either of them not writable)."""
    global _log_file
    detach_log_file(logger)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = RunLogFile(path)
    except OSError as e:
        what = f": {e.filename}" if e.filename and os.path.abspath(e.filename) != os.path.abspath(path) else ""
        raise RunDirUnusable(f"{path}: the run's log file cannot be opened ({e.strerror or one_line(e)}{what}); "
                             "move what is there aside or choose another run.dir") from None
    console = next((h for h in logger.handlers if h.formatter is not None), None)
    handler.setFormatter(console.formatter if console else logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    _log_file = handler


def detach_log_file(logger: logging.Logger) -> None:
    """Stop appending to the run's log file (a no-op when none is attached)."""
    global _log_file
    if _log_file is not None:
        logger.removeHandler(_log_file)
        _log_file.close()
        _log_file = None
