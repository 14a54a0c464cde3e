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
"""The errors of writing the output that end a job as a fault in one line (errno -> what to do). Any other
OSError is a bug or bad input, which keeps its traceback or its own refusal."""


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
