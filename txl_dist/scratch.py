"""Owned scratch folders: hidden work folders beside an output that a killed job's successor may remove, and
nobody else.

Each hidden folder (`.<out>.<kind>-*`) is owned by its job through an exclusive flock on a file inside it,
held for the job's lifetime (and by any worker it forks or hands the lock to: owner_lock). A job killed
without a chance to clean up (SIGKILL, the OOM killer, a lost node) leaves its folder behind, possibly
gigabytes; the next job for the same output removes such folders, and only those: a folder whose lock
another process holds is in use (on any node, where the file system's locks are shared, as NFS's are), and
one without a lock file (being made, or from an older version) is left alone. The lock file is removed
last, so a kill during a removal leaves a folder still owned.

Used by data_prep's outputs and by the universal checkpoint conversion. Standard library only.
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

OWNER_LOCK = ".owner.lock"
_OWNED: dict[Path, int] = {}
"""This process's own folders and their lock's descriptor: skipped by name, because where flock is emulated by
POSIX locks (NFS) a second lock by the same process would succeed and the folder would look abandoned."""


def scratch_glob(out: Path, kind: str) -> str:
    """The pattern of `out`'s scratch folders of `kind`, relative to out.parent."""
    return f".{glob.escape(out.name)}.{kind}-*"


def remove_abandoned(out: Path, kinds: tuple[str, ...]) -> list[Path]:
    """Remove the hidden scratch folders of `out` (of the given kinds) whose owning job is gone; returns them."""
    removed = []
    for kind in kinds:
        for folder in sorted(out.parent.glob(scratch_glob(out, kind))):
            if folder.resolve() in _OWNED:
                continue
            try:
                fd = os.open(folder / OWNER_LOCK, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its job runs (or this file system has no flock: never guess)
                os.close(fd)
                continue
            try:
                remove_scratch(folder)
            finally:
                os.close(fd)
            removed.append(folder)
    return removed


@contextmanager
def owned_scratch(out: Path, kind: str, *, kinds: tuple[str, ...] | None = None,
                  on_removed: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A new hidden folder `.<out name>.<kind>-*` beside `out`, owned by this job while the block runs and
    removed after it unless the block moved its content away. Abandoned folders of `out` (of `kinds`, default
    `kind` alone) are removed first, each reported to `on_removed`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for folder in remove_abandoned(out, kinds or (kind,)):
        if on_removed is not None:
            on_removed(folder)
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-", dir=out.parent))
    lock = os.open(folder / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    key = folder.resolve()
    _OWNED[key] = lock
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock here: the folder then just has no owner others can see as gone
        yield folder
    finally:
        remove_scratch(folder)
        os.close(lock)
        _OWNED.pop(key, None)


def owner_lock(folder: Path) -> int:
    """The lock descriptor of a scratch folder this process owns, for a subprocess that works in it to inherit
    (`subprocess.run(..., pass_fds=(owner_lock(folder),))`): a flock belongs to the open file, so the folder
    stays owned while that process runs, even when this one is killed (its successor must not remove a folder
    a still-running worker writes into)."""
    return _OWNED[folder.resolve()]


def remove_scratch(folder: Path) -> None:
    """Delete a scratch folder, its lock file last: killed midway, it is still a folder its next job removes."""
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.name == OWNER_LOCK:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
