"""Atomic folder outputs: work happens in a hidden temporary folder renamed over the target at the end.

The hidden folders (`.<out>.tmp-*`, `.<out>.scan-*`, `.<out>.sources-*`) are owned scratch folders
(txl_dist/scratch.py): a killed job's are removed by the next job for the same output, never a live job's.

An output is built in `<scratch>/output` and swapped with the previous one, which thereby lands inside the
still-owned scratch folder: a kill at any moment leaves the old output to the next job's cleanup, never in a
folder nobody owns.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data_prep.errors import PrepError
from data_prep.paths import cannot_read, check_not_current_dir, check_writable_parent
from txl_dist import scratch
from txl_dist.scratch import OWNER_LOCK, remove_scratch

__all__ = ["OWNER_LOCK", "OUTPUT", "atomic_dir", "check_output", "exchange", "owned_scratch", "owned_work_folder",
           "remove_abandoned", "remove_scratch", "replace_dir"]

OUTPUT = "output"
"""atomic_dir's output inside its scratch folder (beside the lock file, which never becomes part of it)."""
SCRATCH_KINDS = ("tmp", "scan", "sources", "work")
"""atomic_dir's output, mix's document ends, `prepare --source`'s per-source corpora, `prepare --work-dir`'s
token streams (in the work folder: `owned_work_folder`)."""


def _say_removed(out: Path, folder: Path) -> None:
    print(f"removed {folder}: left by a job for {out.name} that was killed", file=sys.stderr)


def remove_abandoned(out: Path) -> list[Path]:
    """Remove the hidden scratch folders of `out` whose owning job is gone; returns them (each said on stderr)."""
    removed = scratch.remove_abandoned(out, SCRATCH_KINDS)
    for folder in removed:
        _say_removed(out, folder)
    return removed


def owned_scratch(out: Path, kind: str):
    """A new owned scratch folder of `out` (txl_dist.scratch.owned_scratch); abandoned ones of every kind of
    data_prep are removed first, each said on stderr."""
    return scratch.owned_scratch(out, kind, kinds=SCRATCH_KINDS, on_removed=lambda folder: _say_removed(out, folder))


def owned_work_folder(work_dir: Path, out: Path):
    """A new owned scratch folder in `work_dir` for the job writing `out` (`.<out name>.work-*`): a killed job's
    token stream there (as large as the corpus) is removed by the next job for `out` with that work folder,
    as its hidden folder beside `out` is."""
    return owned_scratch(work_dir / out.name, "work")


REPLACEABLE = {"manifest.json": "corpus", "shard.json": "shard folder", "README.txt": "fetched corpus"}
"""The file that marks a folder --overwrite may replace, and what such a folder is (see check_output)."""
FETCHED_SIGNATURE = "Written by `python -m data_prep fetch-corpus "
"""The line fetch-corpus ends its README.txt with: a README.txt is a common name for a user's notes, so only
one holding this line marks a fetched corpus (folders fetched before the mark existed carry it too)."""
SIGNED = {"README.txt": (FETCHED_SIGNATURE, "README.txt written by fetch-corpus")}
"""Markers that mark only when their text holds a line (marker -> (line, how a refusal names the marker))."""
_SIGNED_MAX_BYTES = 1 << 16
"""A signed marker longer than this is someone else's file (fetch-corpus writes well under 1 KiB)."""


def check_output(out: Path, overwrite: bool, marker: str | None = None) -> None:
    """Refuse an existing output unless overwrite is set, and an output this user cannot create (checked
    before any work starts). With `marker` (a key of REPLACEABLE) --overwrite replaces only a folder holding
    that file, or an empty one: anything else may be someone's data."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():  # said with or without --overwrite: it would not replace one
            raise PrepError(f"{out} exists and is not a folder; remove it or choose another output")
        if not overwrite:
            raise PrepError(f"{out} already exists; pass --overwrite to replace it")
        check_not_current_dir(out)
        if marker is not None:
            _check_replaceable(out, marker)
    check_writable_parent(out)


def _check_replaceable(out: Path, marker: str) -> None:
    """An existing folder --overwrite may replace: one holding `marker` (with its line, for a SIGNED one), or an
    empty one."""
    if _marked(out / marker, marker):
        return
    try:
        names = sorted(p.name for p in out.iterdir())
    except OSError as e:
        raise cannot_read(out, e) from None
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        what = REPLACEABLE[marker]
        named = SIGNED[marker][1] if marker in SIGNED else marker
        raise PrepError(f"{out} is not a {what} (no {named}) and holds {shown}; --overwrite replaces only a "
                        f"{what} or an empty folder: move those files away or choose another output")


def _marked(path: Path, marker: str) -> bool:
    """Whether `path` is the marker file (holding its line, for a SIGNED marker)."""
    if not path.is_file():
        return False
    if marker not in SIGNED:
        return True
    try:
        with open(path, "rb") as f:
            data = f.read(_SIGNED_MAX_BYTES + 1)
    except OSError as e:
        raise cannot_read(path, e) from None
    if len(data) > _SIGNED_MAX_BYTES:
        return False
    line = SIGNED[marker][0]
    return any(text.startswith(line) for text in data.decode("utf-8", errors="replace").splitlines())


@contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False, marker: str | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; when the block succeeds it becomes `out`.

    On any error the temporary folder is removed and `out` is left as it was, so a reader never sees a
    half-written output. The temporary folder is a sibling so that the final rename stays on one file system.
    """
    out = Path(out)
    check_output(out, overwrite, marker)
    with owned_scratch(out, "tmp") as scratch:
        tmp = scratch / OUTPUT
        tmp.mkdir()  # the umask's permissions (the scratch folder itself is mkdtemp's private 0700)
        yield tmp
        check_output(out, overwrite, marker)  # someone may have created it meanwhile
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
