"""The error types of the data_prep jobs, and the one line for a write that failed."""
from __future__ import annotations

import errno
import os

from txl_dist.errors import Refused


class PrepError(Refused):
    """Bad input or a failed step; the message is one line that names the thing and says what to do."""


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


def access_fault_line(error: OSError, fallback: str) -> str | None:
    """`<path>: [Errno 13] Permission denied; <what to do>` for an OSError of ACCESS_FAULTS (the path it
    names, else `fallback`: what the command works on), None for any other error."""
    fix = ACCESS_FAULTS.get(getattr(error, "errno", None))
    if fix is None:
        return None
    path = os.fsdecode(error.filename) if error.filename is not None else fallback
    return f"{path}: [Errno {error.errno}] {error.strerror or os.strerror(error.errno)}; {fix}"
