"""Atomic folder outputs: work happens in a hidden temporary folder renamed over the target at the end.

Each hidden folder (`.<out>.tmp-*`, `.<out>.scan-*`) is owned by its job through an exclusive flock on a file
inside it, held for the job's lifetime (and by any worker it forks). A job killed without a chance to clean
up (SIGKILL, the OOM killer, a lost node) leaves its folder behind, possibly gigabytes; the next job for the
same output removes such folders, and only those: a folder whose lock another process holds is in use, and
one without a lock file (being made, or from an older version) is left alone.

An output is built in `<scratch>/output` and swapped with the previous one, which thereby lands inside the
still-owned scratch folder: a kill at any moment leaves the old output to the next job's cleanup, never in a
folder nobody owns. The lock file is removed last, so a kill during a removal leaves a folder still owned.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data_prep.errors import PrepError


OWNER_LOCK = ".owner.lock"
OUTPUT = "output"
"""atomic_dir's output inside its scratch folder (beside the lock file, which never becomes part of it)."""
SCRATCH_KINDS = ("tmp", "scan")
_OWNED: set[Path] = set()
"""This process's own folders: skipped by name, because where flock is emulated by POSIX locks (NFS) a second
lock by the same process would succeed and the folder would look abandoned."""


def remove_abandoned(out: Path) -> list[Path]:
    """Remove the hidden scratch folders of `out` whose owning job is gone; returns them."""
    removed = []
    for kind in SCRATCH_KINDS:
        for folder in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
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
            print(f"removed {folder}: left by a job for {out.name} that was killed", file=sys.stderr)
            removed.append(folder)
    return removed


@contextmanager
def owned_scratch(out: Path, kind: str) -> Iterator[Path]:
    """A new hidden folder `.<out name>.<kind>-*` beside `out`, owned by this job while the block runs and
    removed after it unless the block moved it away (atomic_dir renames it to `out`). Abandoned folders of
    `out` are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-", dir=out.parent))
    lock = os.open(folder / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    key = folder.resolve()
    _OWNED.add(key)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock here: the folder then just has no owner others can see as gone
        yield folder
    finally:
        remove_scratch(folder)
        os.close(lock)
        _OWNED.discard(key)


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


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing output unless overwrite is set (checked before any work starts)."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise PrepError(f"{out} already exists; pass --overwrite to replace it")
        if not out.is_dir():
            raise PrepError(f"{out} exists and is not a folder; remove it or choose another output")


@contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; when the block succeeds it becomes `out`.

    On any error the temporary folder is removed and `out` is left as it was, so a reader never sees a
    half-written output. The temporary folder is a sibling so that the final rename stays on one file system.
    """
    out = Path(out)
    check_output(out, overwrite)
    with owned_scratch(out, "tmp") as scratch:
        tmp = scratch / OUTPUT
        tmp.mkdir()  # the umask's permissions (the scratch folder itself is mkdtemp's private 0700)
        yield tmp
        check_output(out, overwrite)  # someone may have created it meanwhile
        replace_dir(tmp, out)
    # Leaving owned_scratch deleted the previous output, which the swap had put inside it.


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder src (inside an owned scratch folder) to dst, replacing an existing dst: swapped in one step
    where the kernel and file system can (so that no signal or crash finds dst missing), else renamed aside
    first. Either way the previous dst ends up inside src's scratch folder, to be deleted with it."""
    if dst.exists() and not exchange(src, dst):
        os.rename(dst, src.parent / f"previous-{dst.name}")
        os.rename(src, dst)
    elif not dst.exists():
        os.rename(src, dst)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the C library, kernel or
    file system has no such call (the caller then renames in two steps)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))
