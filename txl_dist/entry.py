"""What every entry point does with an error: one line, and the exit status that says which kind it was.

    refused (errors.Refused): bad input, nothing written            -> "error: ..." and exit status 2
    failed  (errors.RunFailed): a fault while the job ran           -> "error: ..." and exit status 1
    a collective that broke because a peer was lost                 -> "error: rank N ... was lost" and 1
    Ctrl-C that stops at once (training's second): nothing saved    -> "error: interrupted ..." and 130
    SIGTERM, SIGUSR1, its launcher's end, to a job with nothing to save (stop_request.Terminated)
                                                                    -> "error: ... stopped by SIGTERM ..." and 143
Anything else is a bug: its traceback is printed, the exit status is 1, and the other ranks are told at
once (distributed.destroy_process_group) instead of waiting for this one in a collective.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from . import distributed
from .errors import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_REFUSED, EXIT_TERMINATED, INTERRUPTED, RankFault, Refused,
                     RunFailed, one_line)
from .run_dir import detach_log_file
from .stop_request import Terminated, note_job_started
from .write_faults import print_result  # noqa: F401  (torch-free; the entry points import it from here)


def guarded(job: Callable[[], int], log: logging.Logger) -> int:
    """Run an entry point's job on this rank, turn its errors into one line and an exit status, and leave
    the process group (if the job joined one)."""
    alone: BaseException | None = None  # a failure the other ranks do not know of
    note_job_started()  # from now on a KeyboardInterrupt unwinds into the except clauses below
    try:
        return job()
    except Refused as e:  # raised on every rank together (startup agrees), or before the ranks connect
        if not distributed.refused_alike_by_this_nodes_first_rank():
            _report(log, e)
        return EXIT_REFUSED
    except RunFailed as e:  # raised on every rank together (the save and the non-finite guard agree)
        _report(log, e)
        if isinstance(e, RankFault):  # found by this rank alone: the others are told (destroy_process_group)
            alone = e
        return EXIT_FAILED
    except Terminated as e:  # stop_request.stop_at_once: each rank it reached (scancel: all) says where it
        # stopped; the others are told (destroy_process_group)
        alone = e
        log.error("error: %s", one_line(e, limit=2000) if e.args else f"stopped {e.by}")
        return EXIT_TERMINATED
    except KeyboardInterrupt as e:  # training's second Ctrl-C (txl_dist/stop_request.py), other jobs' first
        alone = e
        if os.environ.get("RANK", "0") == "0":  # every rank of a terminal's job has it: one line
            log.error("error: %s", INTERRUPTED)
        return EXIT_INTERRUPTED
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
    """End an entry point's process with `status` as the interpreter would, without its teardown.

    What an interpreter's exit does for the job still happens, in its order: the threads it waits for are
    joined, the exit handlers run (atexit: MLflow's end of run, logging's flush and close), the standard streams
    are flushed. The teardown after that (clearing every module, collecting every object) is left to the
    operating system (os._exit): a rank that imported torch, DeepSpeed and the compiler holds millions of
    objects, and that teardown took 1.3-1.5 s per process after a tiny run (AMD Zen 3, 3 runs each), while a
    launcher waits for its slowest rank. The job closes what it writes itself (atomic.py; guarded detaches the
    log file), so no file waits on a finalizer. (An earlier gc.freeze before sys.exit skipped the collections
    too, but then triton's bindings, imported by torch's optimizers, printed ~30 lines of "nanobind: leaked
    instances" after a refusal's one line.)
    """
    # The interpreter's own first two exit steps, in its order. threading._shutdown is what it calls: it also
    # runs the hooks that end thread pools' workers (concurrent.futures), which a join alone would wait on forever.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a reader that went away
            pass
    os._exit(status)
