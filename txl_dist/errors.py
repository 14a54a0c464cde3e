"""The two kinds of errors the program ends with, each printed as one line by every entry point.

``Refused``: input the program will not work with (a configuration, a corpus, a checkpoint, a tracking store,
a launch environment, a run folder another job holds). Raised during start-up, on every rank together,
before anything is written; the entry point prints the message and exits with status 2.

``RunFailed``: a fault while the job runs (a lost rank, a save that could not complete, a diverged loss).
The newest complete checkpoint is intact; the entry point prints the message and exits with status 1.
``RankFault``, a RunFailed one rank finds alone, also makes the other ranks stop at once.

Each package derives its own error from one of these (config.ConfigError, data.CorpusError,
checkpoint.CheckpointError, tracking.TrackingError, distributed.LaunchError), so a caller catches the base.
Standard library only: every package may import this module.
"""
from __future__ import annotations

import os
from pathlib import Path

EXIT_REFUSED = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
"""A second Ctrl-C: stopped at once, without saving (128 + SIGINT, as a shell reports it)."""
INTERRUPTED = "interrupted (Ctrl-C): stopped at once, without saving"
"""What a job stopped by Ctrl-C says (its rank 0; the other ranks name the rank it stopped)."""
EXIT_TERMINATED = 143
"""SIGTERM to a job with nothing to save (evaluation, export, generation): stopped at once (128 + SIGTERM)."""
LOGGER_NAME = "txl_dist"
"""The project's logger, through which those lines (and warnings) are printed."""


class Refused(Exception):
    """Input the program refuses; the message is one line that names the key, file or value and the fix."""


class RunFailed(Exception):
    """A fault during a run; the message is one line that says what happened and what is left on disk."""


class RankFault(RunFailed):
    """A fault one rank finds alone while the job runs (a token id its share of the corpus should not hold):
    the entry point prints it and tells the other ranks, which stop at once with a line naming this rank
    instead of waiting for it in their next collective."""


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one bounded line: its first line, or its type when it has no message."""
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if not text:
        return type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def where_relative(path: str | os.PathLike) -> str:
    """' (looked for /abs/path)' for a relative path that was not found, '' for an absolute one: the folder
    a relative path resolved against is not always the one the user thinks (a batch job's)."""
    return "" if os.path.isabs(path) else f" (looked for {os.path.abspath(path)})"


_PACKAGE = Path(__file__).resolve().parent


def failure_of_the_process(error: BaseException) -> bool:
    """Whether an error met while reading an input (a tracking store, a checkpoint file) is the process's own
    rather than the input's: out of memory, or raised in this package's code (the innermost frame of its
    traceback under txl_dist/), a bug. Those propagate as failures; a refusal would send the user to fix an input
    that is fine (start the server, resume another tag). What the libraries reading the input raise is the
    input's."""
    if isinstance(error, MemoryError):
        return True
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
