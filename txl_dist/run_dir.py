"""The run folder (run.dir): where everything a run writes lives, and the lock that keeps a second job out.

```
RUN/checkpoints/          tags and `latest` (txl_dist.checkpoint)
RUN/config.resolved.json  the configuration as the run resolved it (secrets masked)
RUN/curves.png            the loss curves, redrawn by rank 0 after each evaluation (txl_dist.curves)
RUN/logs/train.log        rank 0's log, appended by every job of the run (rank-NNNNN.log with --log-all-ranks)
RUN/tracking/             the local metrics journal and the MLflow run id (txl_dist.tracking)
RUN/mlflow.db, mlartifacts/  the default MLflow store when no tracking URI is set
RUN/.lock                 held by rank 0 of the job that trains in this folder
RUN/.shared-check-*       for a moment at start-up: the file every rank reads back (one folder for all ranks)
```
The lock is an advisory flock on RUN/.lock: the kernel drops it when the holder's process ends, however it
ends, so a dead job never keeps it. The file also says who holds it, for the refusal message. On file
systems without flock support the job warns and goes on unlocked.

Standard library only.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import Refused, one_line

LOCK_FILE = ".lock"
RESOLVED_CONFIG = "config.resolved.json"


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
    def resolved_config(self) -> Path:
        return self.path / RESOLVED_CONFIG

    def log_file(self, rank: int) -> Path:
        return self.logs / ("train.log" if rank == 0 else f"rank-{rank:05d}.log")


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
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def acquire_lock(run_dir: Path, *, purpose: str = "training") -> RunLock:
    """Lock run_dir/.lock, or RunDirBusy naming the job that holds it."""
    import fcntl

    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirUnusable(f"run.dir {run_dir}: cannot be made or written ({e.strerror or one_line(e)}"
                             f"{': ' + str(e.filename) if e.filename else ''}); choose another run.dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirBusy(f"run.dir {run_dir} is in use by another job ({_holder(path)}); wait for it to end "
                             "or choose another run.dir") from None
        logging.getLogger("txl_dist").warning(
            "run.dir %s: this file system does not support locks (%s); nothing keeps a second job out",
            run_dir, one_line(e))
        return RunLock(None, path)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose,
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return RunLock(fd, path)


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        job = f", Slurm job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
        return f"{h.get('purpose', 'a job')} on host {h['host']}, pid {h['pid']}, since {h['since']}{job}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


_log_file: logging.FileHandler | None = None


def attach_log_file(logger: logging.Logger, path: Path) -> None:
    """Append the logger's records to `path` too (same format as the console), until detach_log_file();
    one file per process: attaching another detaches the previous one. The entry point detaches it after
    it has logged how the job ended, so the run's log says why a job stopped."""
    global _log_file
    detach_log_file(logger)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
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
