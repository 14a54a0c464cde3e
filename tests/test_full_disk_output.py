"""What a user reads when the run folder's disk fills in the middle of training: a few lines that say what
stopped working, not thousands of tracebacks.

Measured before these fixes (a 300-step run on a 30 MiB tmpfs filled at step 20): 8,380 lines, from logging's
"--- Logging error ---" per record the run's log file could not take, MLflow's SQL-store traceback per failed
metrics batch and the system metrics sampler's SQL text; and the job's last line a traceback from closing the
log file. The disk is simulated here by /dev/full (every write fails with ENOSPC) and by a local MLflow store
whose metrics table is gone (the same SQLAlchemy error path as a full disk's "database or disk is full").
"""
import logging
import sqlite3
import time
from pathlib import Path

import pytest

from mlflow_server import cfg_for
from txl_dist.run_dir import attach_log_file, detach_log_file
from txl_dist.tracking import create_tracker
from txl_dist.tracking.journal import _Journal
from txl_dist.tracking.secrets import _one_line, _quiet_store_tracebacks

SAMPLER_LOGGER = "mlflow.system_metrics.system_metrics_monitor"


def test_the_run_log_file_on_a_full_disk_says_so_once_and_detaching_it_never_raises(capfd):
    log = logging.getLogger("txl_dist.test_full_disk")
    log.setLevel(logging.INFO)
    log.propagate = False
    attach_log_file(log, Path("/dev/full"))
    try:
        for step in range(200):
            log.info("step %d", step)
            log.handlers[-1].flush()
    finally:
        detach_log_file(log)  # closing flushes the buffered tail: the last write that fails
    err = capfd.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.splitlines() == ["warning: the run's log file /dev/full cannot be written ([Errno 28] No space left "
                                "on device); this job's log goes to the console only from now on"]
    assert log.handlers == []


def broken_store(tmp_path: Path) -> str:
    """A local MLflow store whose metrics table is gone: every metrics write fails inside SQLAlchemy's flush."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()  # creates the tables
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("DROP TABLE metrics")
    return uri


def test_a_failed_store_write_is_one_line_and_mlflow_prints_no_traceback(tmp_path, capfd):
    from mlflow import MlflowClient
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    uri = broken_store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("full-disk"))
    capfd.readouterr()
    _quiet_store_tracebacks()
    with pytest.raises(MlflowException) as raised:
        client.log_batch(run.info.run_id, metrics=[Metric("train/loss", 1.0, int(time.time() * 1000), 1)])
    assert str(raised.value).startswith("(raised as a result of Query-invoked autoflush")  # SQLAlchemy's note
    assert _one_line(raised.value) == "MlflowException: (sqlite3.OperationalError) no such table: metrics"
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQLAlchemy database error" not in err

    # The system metrics sampler logs the same error's whole text (the SQL and its parameters): one line of it.
    logging.getLogger(SAMPLER_LOGGER).warning("Failed to log system metrics: %s, this is expected if the "
                                              "experiment/run is already terminated.", raised.value)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(
        "Failed to log system metrics: (sqlite3.OperationalError) no such table: metrics"), lines


def test_the_closing_summary_does_not_promise_a_replay_the_failed_journal_cannot_give(tmp_path, caplog):
    tracker = create_tracker(cfg_for(broken_store(tmp_path), "full-disk"), 0, tmp_path / "run")
    tracker._journal.close()
    tracker._journal = _Journal(Path("/dev/full"))  # the journal's disk is full too
    with caplog.at_level(logging.WARNING, logger="txl_dist.tracking"):
        tracker.log_metrics({"train/loss": 1.0}, step=1)
        tracker.flush_journal()
        tracker.flush(timeout=60)
        delivery = tracker.close()
    assert not delivery.ok
    summary = [r.getMessage() for r in caplog.records if "closing as" in r.getMessage()]
    assert len(summary) == 1 and "\n" not in summary[0], summary
    assert "first error: MlflowException: (sqlite3.OperationalError) no such table: metrics" in summary[0]
    assert "the journal keeps them" not in summary[0]
    assert "the journal stopped at a failed write (No space left on device)" in summary[0]


def test_next_save_step_is_the_next_interval_multiple_or_the_jobs_last_step():
    from txl_dist.space_watch import next_save_step

    # A step that saves is its own next save: the trainer looks at the space before that save.
    assert [next_save_step(s, 100, 300) for s in (1, 99, 100, 101, 250, 299)] == [100, 100, 100, 200, 300, 300]
    assert next_save_step(20, 0, 300) == 300  # checkpoint.interval 0: only the last step saves
    assert next_save_step(20, 1000, 300) == 300


def test_rank_zero_warns_once_per_shortage_before_the_save_that_would_fail(tmp_path, monkeypatch, caplog):
    import shutil

    from txl_dist import space_watch

    free = {"bytes": 50 << 20}
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(space_watch.shutil, "disk_usage", lambda path: usage._replace(free=free["bytes"]))
    watch = space_watch.SpaceWatch(tmp_path / "checkpoints")  # not made yet: its run folder's file system counts
    need = 10 << 20
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        watch.check(need, 10, 100, "every step of this job")
        free["bytes"] = need  # under the save's 5% margin
        for step in (20, 30):
            watch.check(need, step, 100, "every step of this job")
        free["bytes"] = 20 << 20  # freed
        watch.check(need, 40, 100, "every step of this job")
        free["bytes"] = 1 << 20  # and full again
        watch.check(need, 150, 200, "the steps since step_00000100")
    assert [r.getMessage() for r in caplog.records] == [
        f"step 20: {tmp_path / 'checkpoints'} has 10.0 MiB free, the next checkpoint (step 100) needs about 10.5 MiB: "
        "free space before then, or that save fails and the job ends, losing every step of this job",
        f"step 150: {tmp_path / 'checkpoints'} has 1.0 MiB free, the next checkpoint (step 200) needs about "
        "10.5 MiB: free space before then, or that save fails and the job ends, losing the steps since step_00000100"]


def test_no_warning_names_a_later_save_at_a_step_whose_own_save_comes_next(tmp_path, monkeypatch, caplog):
    """Before, the progress line of step 20 (checkpoint.interval 20) on a full disk warned `the next checkpoint
    (step 40) ...: free space before then`, and the save of step 20 failed a moment later."""
    import shutil

    from txl_dist import space_watch

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(space_watch.shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    watch = space_watch.SpaceWatch(tmp_path / "checkpoints")
    need = 10 << 20
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        for step in (20, 300):  # a multiple of the interval; the job's last step
            watch.check(need, step, space_watch.next_save_step(step, 20, 300), "the steps since step_00000010")
        assert caplog.records == []  # the save that follows says what it lacks
        watch.check(need, 30, space_watch.next_save_step(30, 20, 300), "the steps since step_00000020")
    assert [r.getMessage() for r in caplog.records] == [
        f"step 30: {tmp_path / 'checkpoints'} has 1.0 MiB free, the next checkpoint (step 40) needs about 10.5 MiB: "
        "free space before then, or that save fails and the job ends, losing the steps since step_00000020"]


def test_a_record_that_cannot_be_formatted_is_shown_and_the_log_file_goes_on(tmp_path, capfd):
    log = logging.getLogger("txl_dist.test_bad_record")
    log.setLevel(logging.INFO)
    log.propagate = False
    attach_log_file(log, tmp_path / "train.log")
    try:
        log.info("step %d of %d", 1)  # a bug in a message, not a full disk
        log.info("step 2")
    finally:
        detach_log_file(log)
    assert "--- Logging error ---" in capfd.readouterr().err
    assert (tmp_path / "train.log").read_text().endswith("step 2\n")


def test_a_local_store_on_a_full_disk_is_refused_as_a_full_disk_and_leaves_no_empty_database(small_file_system,
                                                                                             tmp_path):
    """Found by the fault sweep (seed 1007 case 33: the disk full as a 1-rank job started): SQLite's "database or
    disk is full" was refused as a wrong URI (`MLflow cannot use it ...; use http(s)://host:port ...`), and the
    store file it had begun stayed behind."""
    from txl_dist.tracking.errors import TrackingError
    from txl_dist.write_faults import mount_point

    with open(small_file_system / "filler", "wb", buffering=0) as f:  # every byte left
        with pytest.raises(OSError):
            while True:
                f.write(b"f" * 4096)
    database = small_file_system / "mlflow.db"
    with pytest.raises(TrackingError) as refused:
        create_tracker(cfg_for(f"sqlite:///{database}", "full"), 0, tmp_path / "run")
    line = str(refused.value)
    assert line.startswith(f"tracking.uri sqlite:///{database}: its file system is full (") and "disk is full" in line
    assert line.endswith(f"; free space on {mount_point(database)}, or put the store elsewhere (tracking.uri "
                         "sqlite:///path/to/mlflow.db or http(s)://host:port)")
    assert not database.exists()
