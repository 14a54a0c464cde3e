"""An owned scratch folder stays owned while a subprocess it was handed to runs, even after its job is killed
(txl_dist/scratch.py: owner_lock). The universal conversion's converter is such a subprocess; on Linux it ends
with its rank (tests/test_universal_copy.py), elsewhere it may finish its conversion first."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from txl_dist.scratch import remove_abandoned

# Makes an owned folder, starts a worker holding its lock (or not), prints the worker's pid, then waits.
JOB = """
import subprocess, sys, time
from pathlib import Path
from txl_dist.scratch import owned_scratch, owner_lock
out, share = Path(sys.argv[1]), sys.argv[2] == "share"
with owned_scratch(out, "work") as folder:
    fds = (owner_lock(folder),) if share else ()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=fds)
    print(worker.pid, flush=True)
    time.sleep(600)
"""


def _killed_job_with_a_worker(out: Path, share: bool) -> int:
    job = subprocess.Popen([sys.executable, "-c", JOB, str(out), "share" if share else "alone"],
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    worker = int(job.stdout.readline())
    job.kill()  # SIGKILL: no clean-up; the worker goes on
    job.wait()
    return worker


def test_a_folder_stays_owned_while_a_worker_that_inherited_its_lock_runs(tmp_path):
    out = tmp_path / "out"
    worker = _killed_job_with_a_worker(out, share=True)
    try:
        assert remove_abandoned(out, ("work",)) == []  # the worker still writes there
        assert len(list(tmp_path.glob(".out.work-*"))) == 1
    finally:
        os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not remove_abandoned(out, ("work",)):  # the lock goes with the worker's exit
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert list(tmp_path.glob(".out.work-*")) == []


def test_without_the_lock_a_killed_jobs_folder_is_removed_under_its_worker(tmp_path):
    out = tmp_path / "out"
    worker = _killed_job_with_a_worker(out, share=False)
    try:
        assert len(remove_abandoned(out, ("work",))) == 1
    finally:
        os.kill(worker, signal.SIGKILL)
