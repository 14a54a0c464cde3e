"""The run folder's lock (txl_dist/run_dir.py): a second job is refused, naming the holder; a Slurm job that Slurm
requeued takes over a lock its own earlier start still seems to hold (a network file system can keep the lock of
a dead node), after waiting for it. The holder is a real other process holding a real flock."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


WAITING_HOLDER = """
import sys, time
from pathlib import Path
from txl_dist.run_dir import RunDirBusy, acquire_lock
print("waiting", flush=True)
while True:
    try:
        lock = acquire_lock(Path(sys.argv[1]))
        break
    except RunDirBusy:
        time.sleep(0.01)
print("held", flush=True)
time.sleep(600)
"""


def test_a_requeued_job_does_not_take_over_a_lock_another_job_took_during_its_wait(holder, tmp_path, monkeypatch):
    """The earlier start releases its lock while the requeued job waits for it, and another job takes it at
    once: that job's lock is refused, not replaced (two jobs would write the run folder)."""
    run = holder("42", 0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SLURM_JOB_ID": "43"}
    other = subprocess.Popen([sys.executable, "-c", WAITING_HOLDER, str(run)], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=REPO)
    try:
        assert other.stdout.readline().strip() == "waiting"
        monkeypatch.setenv("SLURM_JOB_ID", "42")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        # The earlier start ends while this job waits (its first look comes 2 s in): job 43 takes the lock first.
        earlier_start = json.loads((run / LOCK_FILE).read_text())["pid"]
        threading.Timer(0.5, os.kill, (earlier_start, signal.SIGKILL)).start()
        with pytest.raises(RunDirBusy, match=r"in use by another job \(training on host .*, Slurm job 43\)"):
            acquire_lock(run, stale_after_s=4)
        assert other.stdout.readline().strip() == "held"  # job 43 holds it, under its own lock file
        assert json.loads((run / LOCK_FILE).read_text())["slurm_job_id"] == "43"
    finally:
        other.kill()
        other.wait(30)

def test_without_a_wait_a_requeued_job_is_refused(holder, monkeypatch):
    run = holder("42", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirBusy):
        acquire_lock(run)


def lock_record(run: Path, job: str, host: str) -> None:
    """The lock file as a job's rank 0 wrote it (the holder's flock itself invisible here: node-local locks)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / LOCK_FILE).write_text(json.dumps({"host": host, "pid": 4242, "purpose": "training",
                                             "since": "2026-12-03 10:00:00", "slurm_job_id": job,
                                             "slurm_restart_count": 0}) + "\n")


def fake_scontrol(tmp_path: Path, monkeypatch, state: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"JobId=$4 JobName=txl-train JobState={state} Reason=None\"\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_lock_granted_over_a_running_job_on_another_node_is_refused(tmp_path, monkeypatch):
    # Lustre -o localflock / NFS local_lock=flock: this node's lock service grants the lock although job 1001
    # on gpu7 holds it there; its record in the lock file and scontrol tell.
    run = tmp_path / "run"
    lock_record(run, "1001", "gpu7")
    fake_scontrol(tmp_path, monkeypatch, "RUNNING")
    monkeypatch.setenv("SLURM_JOB_ID", "1002")
    with pytest.raises(RunDirBusy, match=r"in use by another job \(training on host gpu7, pid 4242, since .*Slurm job "
                                         r"1001, still running by scontrol\).*local to each node"):
        acquire_lock(run)
    assert json.loads((run / LOCK_FILE).read_text())["slurm_job_id"] == "1001"  # the record is left as it was
    fake_scontrol(tmp_path, monkeypatch, "COMPLETED")  # that job has ended: its record is only history
    lock = acquire_lock(run)
    assert lock.held and json.loads((run / LOCK_FILE).read_text())["slurm_job_id"] == "1002"
    lock.release()


def test_a_lock_released_by_a_job_that_still_runs_elsewhere_is_taken(tmp_path, monkeypatch):
    """A job on another host that released the lock (its training ended; its Slurm job goes on with other work)
    leaves no record behind: only a holder that did not release its lock (it holds it, or died) is asked about."""
    run = tmp_path / "run"
    release_on_gpu7 = ("import socket, sys; from pathlib import Path; socket.gethostname = lambda: 'gpu7'; "
                       "from txl_dist.run_dir import acquire_lock; acquire_lock(Path(sys.argv[1])).release()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SLURM_JOB_ID": "1001"}
    subprocess.run([sys.executable, "-c", release_on_gpu7, str(run)], env=env, cwd=REPO, check=True)
    fake_scontrol(tmp_path, monkeypatch, "RUNNING")  # job 1001 still runs
    monkeypatch.setenv("SLURM_JOB_ID", "1002")
    lock = acquire_lock(run)
    assert lock.held and json.loads((run / LOCK_FILE).read_text())["slurm_job_id"] == "1002"
    lock.release()

def test_the_record_of_a_job_on_this_host_or_outside_slurm_asks_nobody(tmp_path, monkeypatch):
    import socket

    fake_scontrol(tmp_path, monkeypatch, "RUNNING")  # would refuse if asked
    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "1002")
    lock_record(run, "1001", socket.gethostname())  # flock on one host is exact: the holder has ended
    acquire_lock(run).release()
    lock_record(run, "", "gpu7")  # not a Slurm job: nothing to ask
    acquire_lock(run).release()


def test_a_lock_file_that_cannot_be_written_names_the_run_dir_and_frees_the_lock(tmp_path, monkeypatch):
    import errno

    import txl_dist.run_dir as run_dir_module
    from txl_dist.run_dir import RunDirUnusable

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what a full disk gives: no file name

    monkeypatch.setattr(run_dir_module.os, "pwrite", full)
    run = tmp_path / "run"
    with pytest.raises(RunDirUnusable) as refused:
        acquire_lock(run)
    assert str(refused.value) == (f"run.dir {run}: cannot write its lock file {LOCK_FILE} (No space left on device); "
                                  "free space there or choose another run.dir")
    monkeypatch.undo()
    acquire_lock(run).release()  # the refused attempt did not keep the lock
