"""A job that resumes from a step its run went past (a rollback, a fork) logs to a continuation run that holds
the earlier run's values up to that step and its own after; the earlier run is left as it was. Against a real
`mlflow server` on loopback (tests/mlflow_server.py); the plan itself without a store."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlflow_server import cfg_for, client, experiment, mlflow_server  # noqa: F401  (fixtures are found by name)
from txl_dist.tracking import ResumePoint, TrackingError, create_tracker
from txl_dist.tracking import mlflow_run
from txl_dist.tracking.continuation import (STAGING_DIR, Continues, finish_switch, plan_opening, stage_switch)
from txl_dist.tracking.journal import TrackingFolder
from txl_dist.tracking.replay import replay

REPO = Path(__file__).resolve().parents[1]


def history(client, run_id, key):  # noqa: F811
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def first_job(cfg, run_dir, steps=10):
    """Steps 1..steps with train/loss = step, valid/loss at every 5th; closed as if preempted."""
    tracker = create_tracker(cfg, 0, run_dir)
    for step in range(1, steps + 1):
        tracker.log_metrics({"train/loss": float(step)}, step=step)
        if step % 5 == 0:
            tracker.log_metrics({"valid/loss": 50.0 + step}, step=step)
    assert tracker.close("KILLED").ok
    return tracker.run_id


def job_with_the_store_failing_after(cfg, run_dir, monkeypatch, last_step):
    """Steps 1..10 with train/loss = step, the store refusing the values after last_step (counted failed);
    the store works again once it returns."""
    real = mlflow_run._send_metrics

    def failing(client_, run_id, batches):
        if any(b.step > last_step for b in batches):
            raise ConnectionError("store away")
        return real(client_, run_id, batches)

    monkeypatch.setattr(mlflow_run, "_send_metrics", failing)
    tracker = create_tracker(cfg, 0, run_dir)
    for step in range(1, 11):
        tracker.log_metrics({"train/loss": float(step)}, step=step)
        tracker.flush(timeout=30)
    assert tracker.close("KILLED").failed == 10 - last_step
    monkeypatch.setattr(mlflow_run, "_send_metrics", real)
    return tracker


# ----------------------------------------------------------------------------------------------------
# The plan (no store)


def write_folder(run_dir: Path, run_id: str, continues: Continues | None = None) -> TrackingFolder:
    folder = TrackingFolder(run_dir)
    folder.dir.mkdir(parents=True, exist_ok=True)
    folder.run_id_file.write_text(run_id + "\n")
    if continues is not None:
        (folder.dir / "continues.json").write_text(continues.to_json())
    return folder


def test_the_plan_reopens_unless_the_run_went_past_the_checkpoint(tmp_path):
    folder = write_folder(tmp_path / "a", "R1")
    assert plan_opening(folder, None).kind == "reopen"
    assert plan_opening(TrackingFolder(tmp_path / "new"), None).kind == "new"
    # A crash after the checkpoint: the same steps again, bitwise equal; the run goes on.
    assert plan_opening(folder, ResumePoint("R1", 4)).run_id == "R1"
    # A rollback: tags of R1 newer than step 4 were set aside.
    rollback = plan_opening(folder, ResumePoint("R1", 4, frozenset({"R1"})))
    assert rollback.kind == "continue" and rollback.history == folder.dir
    assert rollback.continues == Continues("R1", 4, "rollback", ("R1",))
    # A checkpoint of no run of this run dir.
    with pytest.raises(TrackingError, match="run R9 is not the run R1 recorded in .*nor one it continues"):
        plan_opening(folder, ResumePoint("R9", 4))


def test_the_plan_after_a_continuation(tmp_path):
    folder = write_folder(tmp_path / "a", "R2", Continues("R1", 4, "rollback", ("R1",)))
    # R2's first job died before its first checkpoint: the next one resumes R1's tag 4 again; R2 goes on.
    assert plan_opening(folder, ResumePoint("R1", 4, frozenset({"R1"}))).run_id == "R2"
    # R2 saved step 6 and crashed: R1's set-aside step 8 does not concern R2.
    assert plan_opening(folder, ResumePoint("R2", 6, frozenset({"R1"}))).run_id == "R2"
    # A rollback to R1's step 2 (R2's tags set aside): a continuation of R2, whose journal holds R1's history.
    again = plan_opening(folder, ResumePoint("R1", 2, frozenset({"R1", "R2"})))
    assert again.kind == "continue" and again.continues == Continues("R2", 2, "rollback", ("R2", "R1"))


def test_the_plan_of_a_fork(tmp_path):
    source = write_folder(tmp_path / "a", "R1")
    fork = plan_opening(TrackingFolder(tmp_path / "b"), ResumePoint("R1", 6, source_dir=tmp_path / "a"))
    assert fork.kind == "continue" and fork.history == source.dir
    assert fork.continues == Continues("R1", 6, "fork", ("R1",), str(tmp_path / "a"))
    # A source run dir whose journal is another run's: nothing copied.
    assert plan_opening(TrackingFolder(tmp_path / "c"), ResumePoint("R7", 6, source_dir=tmp_path / "a")).history is None
    forked = write_folder(tmp_path / "b", "R3", fork.continues)
    assert plan_opening(forked, ResumePoint("R1", 6, source_dir=tmp_path / "a")).run_id == "R3"
    with pytest.raises(TrackingError, match="belongs to MLflow run R3, and the checkpoint is from another run dir"):
        plan_opening(forked, ResumePoint("R1", 8, source_dir=tmp_path / "a"))


# ----------------------------------------------------------------------------------------------------
# Against a real store


def test_a_rollback_logs_to_a_continuation_that_holds_the_history_once(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    r1 = first_job(cfg, tmp_path)
    # Rolled back to step 4 with another lr: steps 5.. give other values.
    second = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(r1, 4, frozenset({r1})))
    r2 = second.run_id
    assert r2 != r1
    for step in range(5, 9):
        second.log_metrics({"train/loss": 100.0 + step}, step=step)
    delivery = second.close()
    assert delivery.ok and delivery.skipped == 0
    assert delivery.sent == 4 + 4  # the copied history (steps 1-4), then its own
    assert history(client, r2, "train/loss") == [(s, float(s)) for s in range(1, 5)] + [
        (s, 100.0 + s) for s in range(5, 9)]
    assert history(client, r2, "valid/loss") == []  # the first one was at step 5
    # The earlier run is as it was, and each points at the other.
    assert history(client, r1, "train/loss") == [(s, float(s)) for s in range(1, 11)]
    run1, run2 = client.get_run(r1), client.get_run(r2)
    assert run1.data.tags["txl.continued_by"] == r2
    assert run2.data.tags["txl.continues_run"] == r1 and run2.data.tags["txl.continued_at_step"] == "4"
    assert run2.data.tags["txl.continued_because"] == "rollback"
    assert run2.info.run_name == f"{run1.info.run_name} (from step 4)"
    # The folder: the continuation recorded, the earlier run's files set aside whole.
    folder = TrackingFolder(tmp_path)
    assert folder.recorded_run_id() == r2
    aside = TrackingFolder.at(folder.dir / "superseded" / r1)
    assert aside.recorded_run_id() == r1 and len(list(aside.journal_batches())) == 12
    assert json.loads((folder.dir / "continues.json").read_text())["ancestors"] == [r1]

    # A requeue that died before its first checkpoint resumes R1's step 4 again: R2 goes on, nothing twice.
    third = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(r1, 4, frozenset({r1})))
    assert third.run_id == r2
    for step in range(5, 11):
        third.log_metrics({"train/loss": 100.0 + step}, step=step)
    assert third.close().skipped == 4
    assert history(client, r2, "train/loss")[-3:] == [(8, 108.0), (9, 109.0), (10, 110.0)]
    assert len(history(client, r2, "train/loss")) == 10

    # Rolled back again, to R1's step 2 (R2's tags set aside): R3 holds steps 1-2 of R1, then its own.
    fourth = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(r1, 2, frozenset({r1, r2})))
    r3 = fourth.run_id
    fourth.log_metrics({"train/loss": 203.0}, step=3)
    assert fourth.close().ok
    assert history(client, r3, "train/loss") == [(1, 1.0), (2, 2.0), (3, 203.0)]
    assert client.get_run(r3).data.tags["txl.continues_run"] == r2
    assert client.get_run(r3).info.run_name == f"{run1.info.run_name} (from step 2)"
    assert sorted(p.name for p in (folder.dir / "superseded").iterdir()) == sorted([r1, r2])


def test_a_rollback_ends_a_left_run_that_a_killed_job_left_running(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    """The job before the rollback was SIGKILLed (no status set: the run stays RUNNING); nothing re-opens that
    run again, so the rollback marks it KILLED. A fork leaves its source's status alone (it may be training)."""
    cfg = cfg_for(mlflow_server.uri, experiment)
    r1 = first_job(cfg, tmp_path / "a")
    client.update_run(r1, status="RUNNING")  # as a job killed outright leaves it
    fork = create_tracker(cfg, 0, tmp_path / "b", resume=ResumePoint(r1, 6, source_dir=tmp_path / "a"))
    assert fork.close().ok
    assert client.get_run(r1).info.status == "RUNNING"
    rollback = create_tracker(cfg, 0, tmp_path / "a", resume=ResumePoint(r1, 4, frozenset({r1})))
    assert rollback.close().ok
    assert client.get_run(r1).info.status == "KILLED"
    assert client.get_run(r1).data.tags["txl.continued_by"] == rollback.run_id
    # A rollback after a job that ended with a status keeps it.
    r3 = create_tracker(cfg, 0, tmp_path / "a", resume=ResumePoint(r1, 2, frozenset({r1, rollback.run_id})))
    assert r3.close().ok
    assert client.get_run(rollback.run_id).info.status == "FINISHED"


def test_a_fork_continues_the_source_run_in_a_new_run_and_leaves_the_source_alone(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    source_dir = tmp_path / "a"
    r1 = first_job(cfg, source_dir)
    before = sorted(p.name for p in (source_dir / "tracking").iterdir())
    fork = create_tracker(cfg, 0, tmp_path / "b", resume=ResumePoint(r1, 6, source_dir=source_dir))
    fork.log_metrics({"train/loss": 77.0}, step=7)
    assert fork.close().ok
    assert history(client, fork.run_id, "train/loss") == [(s, float(s)) for s in range(1, 7)] + [(7, 77.0)]
    assert history(client, fork.run_id, "valid/loss") == [(5, 55.0)]
    assert client.get_run(fork.run_id).data.tags["txl.continued_because"] == "fork"
    assert sorted(p.name for p in (source_dir / "tracking").iterdir()) == before
    assert TrackingFolder(source_dir).recorded_run_id() == r1


def test_an_interrupted_switch_is_finished_by_the_next_job(mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    r1 = first_job(cfg, tmp_path)
    folder = TrackingFolder(tmp_path)
    # A job created R2, staged the switch and was killed after committing two of its files.
    r2 = client.create_run(client.get_experiment_by_name(experiment).experiment_id).info.run_id
    stage_switch(folder, r2, mlflow_server.uri, Continues(r1, 4, "rollback", (r1,)), folder.dir)
    for name in ("metrics.jsonl", "delivered.jsonl"):
        aside = folder.dir / "superseded" / r1
        aside.mkdir(parents=True, exist_ok=True)
        os.replace(folder.dir / name, aside / name)
        os.replace(folder.dir / STAGING_DIR / name, folder.dir / name)
    assert folder.recorded_run_id() == r1
    # The next job (resuming R1's step 4 again) finds R2 recorded, the history whole, and goes on in R2.
    tracker = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(r1, 4, frozenset({r1})))
    assert tracker.run_id == r2
    tracker.log_metrics({"train/loss": 105.0}, step=5)
    assert tracker.close().ok
    assert history(client, r2, "train/loss") == [(s, float(s)) for s in range(1, 5)] + [(5, 105.0)]
    assert not (folder.dir / STAGING_DIR).exists()
    assert sorted(p.name for p in (folder.dir / "superseded" / r1).iterdir()) == [
        "delivered.jsonl", "metrics.jsonl", "outbox", "run_id", "uri"]
    # A staging that never got its run_id is dropped.
    (folder.dir / STAGING_DIR).mkdir()
    assert finish_switch(folder) is False and not (folder.dir / STAGING_DIR).exists()


def test_what_an_earlier_job_could_not_send_goes_first_in_the_next_job(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    first = job_with_the_store_failing_after(cfg, tmp_path, monkeypatch, 5)
    second = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(first.run_id, 10))
    second.log_metrics({"train/loss": 11.0}, step=11)
    delivery = second.close()
    assert delivery.ok and delivery.sent == 5 + 1
    assert history(client, first.run_id, "train/loss") == [(s, float(s)) for s in range(1, 12)]


def test_replay_sends_what_a_left_run_lacks_to_that_run(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    first = job_with_the_store_failing_after(cfg, tmp_path, monkeypatch, 8)
    second = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(first.run_id, 4, frozenset({first.run_id})))
    assert second.close().ok
    out = subprocess.run([sys.executable, "-m", "txl_dist.tracking", "replay", str(tmp_path), "--uri",
                          mlflow_server.uri], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "sent 2 metric values" in out.stdout
    # Its summary says where they went: to the run left, not to the recorded continuation.
    assert f"2 values and 1 item(s) to run {first.run_id} (a run it continues" in out.stdout  # and its status
    assert second.run_id not in out.stdout.splitlines()[-1]
    assert history(client, first.run_id, "train/loss") == [(s, float(s)) for s in range(1, 11)]


def test_replay_finishes_an_interrupted_switch_before_it_sends(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    real = mlflow_run._send_metrics

    def failing(client_, run_id, batches):
        if any(b.step > 5 for b in batches):
            raise ConnectionError("store away")
        return real(client_, run_id, batches)

    monkeypatch.setattr(mlflow_run, "_send_metrics", failing)
    first = create_tracker(cfg, 0, tmp_path)
    first.log_params({"a": 1})  # an outbox item: the journal's seqs start at 2, a continuation's history at 1
    for step in range(1, 11):
        first.log_metrics({"train/loss": float(step)}, step=step)
        if step % 2 == 0:
            first.log_metrics({"valid/loss": 50.0 + step}, step=step)
        first.flush(timeout=30)
    first.close("KILLED")
    monkeypatch.setattr(mlflow_run, "_send_metrics", real)
    r1, folder = first.run_id, TrackingFolder(tmp_path)
    # A job rolling back to step 8 created R2, staged the switch and was killed after committing the journal.
    r2 = client.create_run(client.get_experiment_by_name(experiment).experiment_id).info.run_id
    stage_switch(folder, r2, mlflow_server.uri, Continues(r1, 8, "rollback", (r1,)), folder.dir)
    (folder.dir / "superseded" / r1).mkdir(parents=True)
    os.replace(folder.dir / "metrics.jsonl", folder.dir / "superseded" / r1 / "metrics.jsonl")
    os.replace(folder.dir / STAGING_DIR / "metrics.jsonl", folder.dir / "metrics.jsonl")
    # Before, replay sent R2's journal to R1 and marked its seqs as delivered in R1's records, where they name
    # other values: R1's step 6 was never sent, by this replay or any later one.
    replay(tmp_path, mlflow_server.uri)
    assert folder.recorded_run_id() == r2 and not (folder.dir / STAGING_DIR).exists()
    resumed = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(r1, 8, frozenset({r1})))
    assert resumed.run_id == r2 and resumed.close().ok
    replay(tmp_path, mlflow_server.uri)
    assert history(client, r1, "train/loss") == [(s, float(s)) for s in range(1, 11)]
    assert history(client, r1, "valid/loss") == [(s, 50.0 + s) for s in range(2, 11, 2)]
    assert history(client, r2, "train/loss") == [(s, float(s)) for s in range(1, 9)]
