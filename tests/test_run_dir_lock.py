"""The run folder's lock (txl_dist/run_dir.py): a second job is refused, naming the holder; a Slurm job that Slurm
requeued takes over a lock its own earlier start still seems to hold (a network file system can keep the lock of
a dead node), after waiting for it. The holder is a real other process holding a real flock."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from txl_dist.run_dir import LOCK_FILE, RunDirBusy, acquire_lock

REPO = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from pathlib import Path
from txl_dist.run_dir import acquire_lock
lock = acquire_lock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path, monkeypatch):
    """Start a process that holds tmp_path/run's lock as restart `restart` of Slurm job `job`."""
    procs = []

    def start(job: str | None, restart: int) -> Path:
        run = tmp_path / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        if job is not None:
            env |= {"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restart)}
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True,
                                env=env, cwd=REPO)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return run

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    yield start
    for p in procs:
        p.kill()
        p.wait(30)


def test_another_job_is_refused_at_once_naming_the_holder(holder, monkeypatch):
    run = holder("41", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    start = time.monotonic()
    with pytest.raises(RunDirBusy, match=r"in use by another job \(training on host .*, Slurm job 41\)"):
        acquire_lock(run, stale_after_s=30)
    assert time.monotonic() - start < 5  # not the takeover's wait: another job's lock is never taken over


def test_the_same_start_of_the_same_job_is_refused(holder, monkeypatch):
    """Two job steps of one allocation (the same restart count) are two live jobs, not a requeue."""
    run = holder("42", 1)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirBusy, match="Slurm job 42 restart 1"):
        acquire_lock(run, stale_after_s=30)


def test_a_requeued_job_takes_over_its_earlier_starts_lock_after_the_wait(holder, monkeypatch, caplog):
    run = holder("42", 0)  # the earlier start, as a dead node's lock on NFS: still held
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    start = time.monotonic()
    lock = acquire_lock(run, stale_after_s=3)
    try:
        assert lock.held and time.monotonic() - start >= 3
        record = json.loads((run / LOCK_FILE).read_text())
        assert (record["slurm_job_id"], record["slurm_restart_count"]) == ("42", 1)
        assert "earlier start of this Slurm job" in caplog.text and "took over the lock" in caplog.text
        # A third job is refused: the lock now held is the new one.
        monkeypatch.setenv("SLURM_JOB_ID", "43")
        with pytest.raises(RunDirBusy, match="Slurm job 42 restart 1"):
            acquire_lock(run, stale_after_s=3)
    finally:
        lock.release()


def test_without_a_wait_a_requeued_job_is_refused(holder, monkeypatch):
    run = holder("42", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirBusy):
        acquire_lock(run)
