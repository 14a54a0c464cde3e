"""What every entry point does with an error: one line, and the exit status that says which kind it was.

    refused (errors.Refused): bad input, nothing written            -> "error: ..." and exit status 2
    failed  (errors.RunFailed): a fault while the job ran           -> "error: ..." and exit status 1
    a collective that broke because a peer was lost                 -> "error: rank N ... was lost" and 1
Anything else is a bug: its traceback is printed, the exit status is 1, and the other ranks are told at
once (distributed.destroy_process_group) instead of waiting for this one in a collective.
"""
from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from typing import NoReturn

from . import distributed
from .errors import EXIT_FAILED, EXIT_REFUSED, RankFault, Refused, RunFailed, one_line
from .run_dir import detach_log_file


def guarded(job: Callable[[], int], log: logging.Logger) -> int:
    """Run an entry point's job on this rank, turn its errors into one line and an exit status, and leave
    the process group (if the job joined one)."""
    alone: BaseException | None = None  # a failure the other ranks do not know of
    try:
        return job()
    except Refused as e:  # raised on every rank together (startup agrees)
        _report(log, e)
        return EXIT_REFUSED
    except RunFailed as e:  # raised on every rank together (the save and the non-finite guard agree)
        _report(log, e)
        if isinstance(e, RankFault):  # found by this rank alone: the others are told (destroy_process_group)
            alone = e
        return EXIT_FAILED
    except Exception as e:
        lost = distributed.explain_failure(e)  # also tells the other ranks
        if lost is None:
            alone = e
            raise
        log.error("error: %s", lost)
        return EXIT_FAILED
    finally:
        detach_log_file(log)
        distributed.destroy_process_group(alone)


def _report(log: logging.Logger, e: BaseException) -> None:
    """The error's one line, unless rank 0 prints it (distributed.together): one line per failure."""
    if not distributed.reported_on_rank_zero(e):
        log.error("error: %s", one_line(e, limit=2000))


def exit_process(status: int) -> NoReturn:
    """End an entry point's process with `status`, without the interpreter's collection of every object at exit.

    A rank that imported torch, DeepSpeed and the compiler holds millions of objects; the garbage collections
    of the interpreter's teardown took 1.3-1.5 s per process after a tiny run (AMD Zen 3, measured with and
    without, 3 runs each), and a launcher waits for its slowest rank. Freezing them first (gc.freeze) leaves
    that to the operating system: 0.16-0.17 s. Exit handlers (atexit, MLflow's end of run) still run, and
    the job closes what it writes itself (atomic.py; guarded detaches the log file): no file waits on a finalizer.
    Only for a process's last step: a process that goes on after gc.freeze keeps those objects forever.
    """
    gc.freeze()
    sys.exit(status)
