"""The one line for a write that failed for a reason of the machine, not of the program: a full disk or quota,
a read-only file system, an I/O error. Every entry point that writes files ends such a fault with this line
(`error: <file>: [Errno 28] No space left on device; free space on <mount> or <elsewhere>`) and exit status 1,
instead of a traceback; any other OSError is a bug and keeps its traceback.

Standard library only at import (safetensors_write imports safetensors when used): data_prep, the interop CLI,
launch/export.py and the tracking replay share it. print_result (a standard output that cannot be written is
one line too) is here, not in entry.py, which imports torch: the tracking replay, which does not, shares it.
"""
from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import RunFailed

WRITE_FAULTS = {
    errno.ENOSPC: "free space on {mount} or {elsewhere}",
    errno.EDQUOT: "free space within your quota on {mount} (or raise it) or {elsewhere}",
    errno.EFBIG: "the file system of {mount} limits the file size; {elsewhere}",
    errno.EROFS: "{mount} is mounted read-only; {elsewhere}",
    errno.EIO: "the disk of {mount} reported an I/O error: check it (dmesg) or {elsewhere}",
}
"""The errors of writing the output that end a job as a fault in one line (errno -> what to do)."""


def is_write_fault(error: BaseException) -> bool:
    """An OSError of WRITE_FAULTS: the machine's fault, told in one line."""
    return isinstance(error, OSError) and error.errno in WRITE_FAULTS


def write_fault_line(error: OSError, output: str | os.PathLike, elsewhere: str) -> str | None:
    """`<path>: [Errno 28] No space left on device; free space on <mount> or <elsewhere>` for an OSError that
    writing met (the path it names, else `output`), None for any other error. `elsewhere` is the command's way
    to put the output on another file system (e.g. "choose another --out").

    An error with two paths (shutil.copyfile, os.replace: source, destination) failed on its destination, the
    file being written: the source may be on another file system, and naming it sent the user to free space
    on the wrong disk."""
    fix = WRITE_FAULTS.get(getattr(error, "errno", None))
    if fix is None:
        return None
    named = error.filename2 if error.filename2 is not None else error.filename
    path = Path(os.fsdecode(named)) if named is not None else Path(output)
    reason = f"[Errno {error.errno}] {error.strerror or os.strerror(error.errno)}"
    return f"{path}: {reason}; {fix.format(mount=mount_point(path), elsewhere=elsewhere)}"


def print_result(*parts: str, sep: str = "\n") -> None:
    """Print an entry point's result on stdout. Redirected to a file on a full or read-only disk (`generate
    --json > out.json`), stdout fails: that is a fault of one line (exit status 1, guarded), not a traceback."""
    try:
        print(*parts, sep=sep, flush=True)
    except OSError as e:
        if not is_write_fault(e):  # a reader gone (EPIPE) and others keep Python's own handling
            raise
        raise RunFailed(f"the standard output cannot be written ([Errno {e.errno}] {e.strerror}): the file it is "
                        "redirected to is on a full or read-only file system; free space there, or redirect it "
                        "elsewhere, and run again") from None


def mount_point(path: Path) -> Path:
    """The mount point of the file system `path` is (or would be) on: the path may be gone already (a temporary
    folder removed on the way out), so the nearest existing parent decides."""
    folder = Path(os.path.abspath(path))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    while not os.path.ismount(folder) and folder.parent != folder:
        folder = folder.parent
    return folder


_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


@contextmanager
def safetensors_write(path: str | os.PathLike) -> Iterator[None]:
    """Turn a failed write inside safetensors into the OSError it was, naming `path` (the file being written).

    safetensors writes in Rust and reports a full disk as SafetensorError("Error while serializing: I/O error:
    No space left on device (os error 28)"), which no `except OSError` catches: the export and the interop CLI
    ended in a traceback on a full disk. Other SafetensorErrors (a tensor it cannot store) stay as they are."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        code = _OS_ERROR_CODE.search(str(e))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), os.fspath(path)) from e
