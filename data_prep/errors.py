"""The error types of the data_prep jobs, and the one line for a write that failed."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from txl_dist.errors import Refused


class PrepError(Refused):
    """Bad input or a failed step; the message is one line that names the thing and says what to do."""


WRITE_FAULTS = {
    errno.ENOSPC: "free space on {mount} or {elsewhere}",
    errno.EDQUOT: "free space within your quota on {mount} (or raise it) or {elsewhere}",
    errno.EFBIG: "the file system of {mount} limits the file size; {elsewhere}",
    errno.EROFS: "{mount} is mounted read-only; {elsewhere}",
    errno.EIO: "the disk of {mount} reported an I/O error: check it (dmesg) or {elsewhere}",
}
"""The errors of writing the output that end a job as a fault in one line (errno -> what to do)."""

ACCESS_FAULTS = {
    errno.EACCES: "check the permissions of it and of the folders above it",
    errno.EPERM: "check the permissions of it and of the folders above it",
    errno.EBUSY: "it is in use (a mount point, or the current directory): choose another path",
}
"""The errors of reading an input or writing an output that this user may not (errno -> what to do). Inputs
and outputs are checked before any work, each refusal one line with exit status 2 (data_prep/paths.py,
sources.py, tokenizer.py); one met during the work (a file or folder made unreadable meanwhile, or one the
checks do not reach, such as a corpus' token files) is one line too (os_error_line), a fault with exit
status 1 (2 in `verify` and `inspect`, which only read). Any other OSError (EBADF, ENOENT of a scratch
file) is a bug, which keeps its traceback."""


def write_fault_line(error: OSError, output: str | os.PathLike, elsewhere: str) -> str | None:
    """`<path>: [Errno 28] No space left on device; free space on <mount> or <elsewhere>` for an OSError that
    writing met (the path it names, else `output`), None for any other error. `elsewhere` is the command's way
    to put the output on another file system (e.g. "choose another --out")."""
    fix = WRITE_FAULTS.get(getattr(error, "errno", None))
    if fix is None:
        return None
    path = Path(os.fsdecode(error.filename)) if error.filename is not None else Path(output)
    reason = f"[Errno {error.errno}] {error.strerror or os.strerror(error.errno)}"
    return f"{path}: {reason}; {fix.format(mount=mount_point(path), elsewhere=elsewhere)}"


def mount_point(path: Path) -> Path:
    """The mount point of the file system `path` is (or would be) on: the path may be gone already (a temporary
    folder removed on the way out), so the nearest existing parent decides."""
    folder = Path(os.path.abspath(path))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    while not os.path.ismount(folder) and folder.parent != folder:
        folder = folder.parent
    return folder


def access_fault_line(error: OSError, fallback: str) -> str | None:
    """`<path>: [Errno 13] Permission denied; <what to do>` for an OSError of ACCESS_FAULTS (the path it
    names, else `fallback`: what the command works on), None for any other error."""
    fix = ACCESS_FAULTS.get(getattr(error, "errno", None))
    if fix is None:
        return None
    path = os.fsdecode(error.filename) if error.filename is not None else fallback
    return f"{path}: [Errno {error.errno}] {error.strerror or os.strerror(error.errno)}; {fix}"
