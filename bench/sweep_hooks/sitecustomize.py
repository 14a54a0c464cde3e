"""The fault sweep's raise-rank fault (bench/fault_sweep.py, bench/entry_fault_probe.py), imported by every Python
process of a job started with this folder first on PYTHONPATH and RAISE_AFTER_CALLS_ENV set.

On SIGUSR2 the main thread's RAISE_AFTER_CALLS_ENV-th call into a Python function of txl_dist, launch/, data_prep
or DeepSpeed raises a RuntimeError at the function's first line: what a bug, or torch's out-of-memory error, does
on one rank at a random point. The signal handler only sets the trace; the exception itself comes from a call, never
from between two bytecodes of a `finally` or a lock's acquire (as a Ctrl-C's could)."""
from __future__ import annotations

import os
import signal
import sys

RAISE_AFTER_CALLS_ENV = "TXL_SWEEP_RAISE_AFTER_CALLS"
MARK = "raise-rank: injected"
"""How the raised error's message begins: the sweep looks for it in the job's output."""
ANNOUNCED = "raise-rank: raising"
"""What the hook prints to stderr as it raises: the sweep tells a job that ended before the call came from one
that swallowed the error."""
WATCHED = (f"{os.sep}txl_dist{os.sep}", f"{os.sep}launch{os.sep}", f"{os.sep}deepspeed{os.sep}",
           f"{os.sep}data_prep{os.sep}")


def _arm(calls: int) -> None:
    left = calls

    def trace(frame, event, arg):
        nonlocal left
        if event != "call":
            return None
        where = frame.f_code.co_filename
        if not any(part in where for part in WATCHED):
            return None
        left -= 1
        if left > 0:
            return None
        sys.settrace(None)
        place = f"in {frame.f_code.co_name} ({where}:{frame.f_lineno})"
        print(f"{ANNOUNCED} {place}", file=sys.stderr, flush=True)
        raise RuntimeError(f"{MARK} {place}")

    sys.settrace(trace)


if os.environ.get(RAISE_AFTER_CALLS_ENV):
    signal.signal(signal.SIGUSR2, lambda signum, frame: _arm(int(os.environ[RAISE_AFTER_CALLS_ENV])))
