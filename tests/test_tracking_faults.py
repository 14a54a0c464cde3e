"""Tracking under faults, against real `mlflow server` processes: a store that stalls, one that dies and
comes back, jobs that crash or resume, an unreachable store, a URI with a password; and the journal's
`python -m txl_dist.tracking replay RUN_DIR` that fills what the store missed.

Tests that stop a server start their own (tests/mlflow_server.py); the others share the session's one.
"""
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

from mlflow_server import (LoopbackProxy, cfg_for, client, experiment, free_port, mlflow_server,  # noqa: F401
                           no_mlflow_env, start_mlflow_server)  # (fixtures are found by name)
from txl_dist.config import TrackingConfig
from txl_dist.tracking import MlflowTracker, ResumePoint, TrackingError, create_tracker
from txl_dist.tracking.journal import TrackingFolder

REPO = Path(__file__).resolve().parents[1]
BLOCKING_BOUND_S = 0.5
"""A log_* call may take this long at most: a bound on blocking, far above a normal call (~0.1 ms)."""


def history(mlflow_client, run_id, key):
    return sorted((m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key))


def runs_of(mlflow_client, experiment_name):
    exp = mlflow_client.get_experiment_by_name(experiment_name)
    return [] if exp is None else mlflow_client.search_runs([exp.experiment_id])


def replay_cli(run_dir, *args) -> subprocess.CompletedProcess:
    """The documented command line, in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "txl_dist.tracking", "replay", str(run_dir), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def timed(fn, *args, **kw) -> float:
    start = time.monotonic()
    fn(*args, **kw)
    return time.monotonic() - start


def port_of(uri: str) -> int:
    return int(uri.rsplit(":", 1)[1])


def test_a_stalled_store_never_blocks_logging_and_calls_keep_their_order(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    proxy = LoopbackProxy(port_of(mlflow_server.uri))
    run_dir = tmp_path / "run"
    tracker = MlflowTracker(cfg_for(f"http://127.0.0.1:{proxy.port}", experiment), run_dir, max_pending=10)
    note = tmp_path / "note.txt"
    note.write_text("at call time")
    proxy.stall()
    # A call that waits on the store would wait for the stall to end: end it after a while, so that such a
    # call fails the bound below instead of hanging the test.
    valve = threading.Timer(30, proxy.flow)
    valve.start()
    try:
        slowest = max(
            timed(tracker.log_params, {"model": {"d_model": 64}}),
            timed(tracker.log_artifact, note),
            timed(note.write_text, "rewritten after the call"),  # the upload must carry the call-time copy
            timed(tracker.log_text, "first", "order.txt"),
            timed(tracker.log_text, "second", "order.txt"),  # same file: the later call must win
            timed(tracker.log_dict, {"test/loss": 3.5}, "eval/final.json"),
            *(timed(tracker.log_metrics, {"train/loss": float(s), "train/nonfinite_steps": 0.0}, step=s)
              for s in range(1, 51)),
        )
        assert not tracker.flush(timeout=0.5), "the store answered: the proxy did not stall it"
        assert slowest < BLOCKING_BOUND_S
    finally:
        valve.cancel()
        proxy.flow()
    delivery = tracker.close(timeout=120)
    proxy.cut()
    assert delivery.dropped > 0 and delivery.failed == 0  # more calls than the queue holds, none failed
    assert delivery.sent + delivery.dropped == 100  # the 5 items fitted: they came first
    run_id = tracker.run_id
    assert client.get_run(run_id).data.params == {"model.d_model": "64"}
    down = Path(client.download_artifacts(run_id, "", str(tmp_path / "down")))
    assert (down / "note.txt").read_text() == "at call time"
    assert (down / "order.txt").read_text() == "second"
    assert json.loads((down / "eval" / "final.json").read_text()) == {"test/loss": 3.5}
    sent_steps = [s for s, _ in history(client, run_id, "train/loss")]
    assert len(sent_steps) == delivery.sent // 2 < 50

    # The dropped steps are in the journal; replay sends exactly those, a second replay nothing.
    out = replay_cli(run_dir, "--uri", mlflow_server.uri)  # the recorded URI is the proxy's, gone now
    assert out.returncode == 0, out.stderr
    assert f"sent {delivery.dropped} metric values" in out.stdout
    for key in ("train/loss", "train/nonfinite_steps"):
        expected = [(s, float(s) if key == "train/loss" else 0.0) for s in range(1, 51)]
        assert history(client, run_id, key) == expected, key
    again = replay_cli(run_dir, "--uri", mlflow_server.uri)
    assert again.returncode == 0 and "sent 0 metric values" in again.stdout and "and 0 " in again.stdout
    assert len(history(client, run_id, "train/loss")) == 50


def test_server_gone_mid_run_warns_once_and_replay_fills_every_step(
        experiment, tmp_path, monkeypatch, caplog):  # noqa: F811 (the imported fixture, by name)
    # Fail each request at once instead of retrying for minutes, so that the failure (and its warning)
    # happens while the test is still "training".
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    store = tmp_path / "store"
    run_dir = tmp_path / "run"
    server = start_mlflow_server(store)
    try:
        tracker = create_tracker(cfg_for(server.uri, experiment), 0, run_dir)
        slowest = 0.0
        with caplog.at_level(logging.WARNING, logger="txl_dist.tracking"):
            for step in range(1, 121):
                if step == 41:
                    assert tracker.flush(timeout=60)  # steps 1-40 are in; no request in flight
                    server.stop()
                metrics = {"train/loss": 10.0 / step, "train/nonfinite_steps": float(step // 50)}
                slowest = max(slowest, timed(tracker.log_metrics, metrics, step=step))
                time.sleep(0.01)
            tracker.flush(timeout=60)
            warned = [r.getMessage() for r in caplog.records
                      if r.name == "txl_dist.tracking" and r.levelno >= logging.WARNING]
        delivery = tracker.close(timeout=30)
    finally:
        server.stop()
    assert slowest < BLOCKING_BOUND_S
    assert len(warned) == 1 and "could not log metrics" in warned[0], warned
    assert delivery.sent == 2 * 40 and delivery.failed == 2 * 80
    assert "replay" in caplog.text  # close() says how to send the rest

    # The server comes back on the same store and artifact folder (at another port).
    server = start_mlflow_server(store)
    try:
        from mlflow import MlflowClient

        client = MlflowClient(server.uri)
        run_id = tracker.run_id
        assert client.get_run(run_id).info.status == "RUNNING"  # close() could not mark it
        out = replay_cli(run_dir, "--uri", server.uri)
        assert out.returncode == 0, out.stderr
        assert "sent 160 metric values" in out.stdout
        for key in ("train/loss", "train/nonfinite_steps"):
            fn = (lambda s: 10.0 / s) if key == "train/loss" else (lambda s: float(s // 50))
            assert history(client, run_id, key) == [(s, fn(s)) for s in range(1, 121)], key
        assert client.get_run(run_id).info.status == "FINISHED"  # the final status was waiting too
        again = replay_cli(run_dir, "--uri", server.uri)
        assert again.returncode == 0 and "sent 0 metric values" in again.stdout and "and 0 " in again.stdout
        assert len(history(client, run_id, "train/loss")) == 120
    finally:
        server.stop()


def test_a_resumed_job_does_not_log_the_journaled_steps_again(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    first = create_tracker(cfg, 0, tmp_path)
    for step in range(1, 11):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.log_metrics({"valid/loss": 50.0}, step=5)
    first.close("KILLED")  # it died at step 10; its newest checkpoint is at step 5

    second = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(first.run_id, 5))
    for step in range(6, 16):  # steps 6-10 again, from the checkpoint: other values
        second.log_metrics({"train/loss": 100.0 + step}, step=step)
    second.log_metrics({"valid/loss": 60.0}, step=10)  # valid/loss has no step 10 yet: it goes
    delivery = second.close()
    assert delivery.skipped == 5 and delivery.ok
    run_id = first.run_id
    assert history(client, run_id, "train/loss") == (
        [(s, float(s)) for s in range(1, 11)] + [(s, 100.0 + s) for s in range(11, 16)])
    assert history(client, run_id, "valid/loss") == [(5, 50.0), (10, 60.0)]


def test_each_opening_reads_only_the_journal_lines_since_the_last_opening(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    """A long run's journal is ~430 MB per million steps: a job's opening reads what the jobs since the last
    opening wrote, and from the first line the store lacks (tracking/summary.json), not the whole journal."""
    import types

    from txl_dist.tracking import journal, mlflow_run

    parsed = []

    def loads(text, *args, **kw):
        if '"metrics"' in (text.decode() if isinstance(text, bytes) else text):
            parsed.append(json.loads(text)["step"])
        return json.loads(text, *args, **kw)

    monkeypatch.setattr(journal, "json", types.SimpleNamespace(loads=loads, dumps=json.dumps))
    cfg = cfg_for(mlflow_server.uri, experiment)

    def job(steps, store_fails_from=None):
        real = mlflow_run._send_metrics

        def send(client_, run_id, batches):
            if store_fails_from is not None and any(b.step >= store_fails_from for b in batches):
                raise ConnectionError("store away")
            return real(client_, run_id, batches)

        monkeypatch.setattr(mlflow_run, "_send_metrics", send)
        parsed.clear()
        tracker = create_tracker(cfg, 0, tmp_path)
        tracker.flush(timeout=60)  # what earlier jobs left is sent first
        opening = sorted(parsed)
        for step in steps:
            tracker.log_metrics({"train/loss": float(step)}, step=step)
            tracker.flush(timeout=60)
        delivery = tracker.close("KILLED")
        monkeypatch.setattr(mlflow_run, "_send_metrics", real)
        return opening, delivery, tracker.run_id

    assert job(range(1, 11))[0] == []
    opening, delivery, run_id = job(range(11, 21), store_fails_from=16)
    assert opening == list(range(1, 11)) and delivery.failed == 5  # no summary yet (an older version's folder)
    # The lines since the last opening, and the missing steps 16-20 again to send them; nothing before.
    opening, delivery, _ = job([21, 22])
    assert opening == sorted([*range(11, 21), *range(16, 21)]) and delivery.sent == 5 + 2 and delivery.ok
    assert job([23])[0] == list(range(16, 23))  # the last opening's summary ends where the store lacked 16
    assert job([24])[0] == [23]
    assert history(client, run_id, "train/loss") == [(s, float(s)) for s in range(1, 25)]
    # A journal changed under the summary (here: its first line gone) is read whole again.
    lines = (tmp_path / "tracking" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "tracking" / "metrics.jsonl").write_text("".join(lines[1:]))
    opening, delivery, _ = job([24, 25])
    assert opening == list(range(2, 25)) and delivery.sent == 1 and delivery.skipped == 1
    # Delivery records removed (to have everything sent again): the whole journal is read and sent.
    (tmp_path / "tracking" / "delivered.jsonl").unlink()
    opening, delivery, _ = job([])
    assert opening == sorted(2 * [*range(2, 26)]) and delivery.sent == 24


def test_a_crash_before_the_first_checkpoint_reopens_the_recorded_run(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    crash = (
        "import os\n"
        "from txl_dist.config import TrackingConfig\n"
        "from txl_dist.tracking import create_tracker\n"
        f"t = create_tracker(TrackingConfig(uri={mlflow_server.uri!r}, experiment={experiment!r}, "
        f"system_metrics=False), 0, {str(run_dir)!r})\n"
        "for step in range(1, 6):\n"
        "    t.log_metrics({'train/loss': float(step)}, step=step)\n"
        "assert t.flush(60)\n"
        "print(t.run_id, flush=True)\n"
        "os._exit(3)  # no close(), no checkpoint\n"
    )
    out = subprocess.run([sys.executable, "-c", crash], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stderr
    crashed_run = out.stdout.strip()
    assert (run_dir / "tracking" / "run_id").read_text().strip() == crashed_run
    assert client.get_run(crashed_run).info.status == "RUNNING"
    with open(run_dir / "tracking" / "metrics.jsonl", "a") as f:
        f.write('{"seq": 99, "step": 6, "metr')  # a line torn by the crash

    # The next job has no checkpoint, so no resume id: it starts at step 1 again, in the same run.
    tracker = create_tracker(cfg_for(mlflow_server.uri, experiment), 0, run_dir)
    assert tracker.run_id == crashed_run
    for step in range(1, 9):
        tracker.log_metrics({"train/loss": 10.0 + step}, step=step)
    delivery = tracker.close()
    assert delivery.skipped == 5 and delivery.ok
    assert [r.info.run_id for r in runs_of(client, experiment)] == [crashed_run]
    assert client.get_run(crashed_run).info.status == "FINISHED"
    assert history(client, crashed_run, "train/loss") == (
        [(s, float(s)) for s in range(1, 6)] + [(s, 10.0 + s) for s in range(6, 9)])
    lines = (run_dir / "tracking" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))  # the torn line is gone


def test_a_recorded_run_that_is_deleted_or_differs_is_refused(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    with create_tracker(cfg, 0, tmp_path) as t:
        run_id = t.run_id
    with pytest.raises(TrackingError, match=f"run 0123456789abcdef is not the run {run_id} recorded in .*remove "):
        create_tracker(cfg, 0, tmp_path, resume=ResumePoint("0123456789abcdef", 5))
    client.delete_run(run_id)
    with pytest.raises(TrackingError, match=f"run {run_id} recorded in .*run_id is deleted in .*remove .*tracking "
                                            "to start a new run"):
        create_tracker(cfg, 0, tmp_path)
    assert runs_of(client, experiment) == []  # no second run was created instead


def test_a_tracking_uri_changed_between_jobs_names_the_store_the_run_is_in(
        mlflow_server, experiment, tmp_path):  # noqa: F811
    """A relaunch with another tracking.uri: the run is in the store it was logged to, and the job resumes from a
    checkpoint of that run, so removing the tracking folder would only lead to the checkpoint's run refusal."""
    with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path / "run") as t:
        run_id = t.run_id
    other = TrackingConfig(uri=f"sqlite:///{tmp_path / 'other.db'}", experiment=experiment, system_metrics=False)
    with pytest.raises(TrackingError) as refused:
        create_tracker(other, 0, tmp_path / "run", resume=ResumePoint(run_id, 5))
    assert str(refused.value) == (
        f"tracking: the MLflow run {run_id} recorded in {tmp_path / 'run' / 'tracking' / 'run_id'} (logged to "
        f"{mlflow_server.uri}) is not in {other.uri}; point tracking.uri at the store that holds it, or set "
        "tracking.enabled=false")
    assert not (tmp_path / "other.db").exists()


def test_reopening_in_the_default_local_store_a_run_it_lacks_leaves_no_store_behind(
        mlflow_server, experiment, tmp_path, monkeypatch):  # noqa: F811
    # A server-tracked run resumed without its tracking.uri: refused, and the refusal writes nothing (it
    # used to leave a fresh ~1 MB mlflow.db in the run folder).
    with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path):
        pass
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(TrackingError):
        create_tracker(cfg_for(None, experiment), 0, tmp_path)
    assert not (tmp_path / "mlflow.db").exists()


def test_an_unreachable_store_is_refused_in_seconds_and_nothing_is_written(tmp_path):
    # No MLFLOW_HTTP_REQUEST_MAX_RETRIES here: MLflow's defaults would retry a refused port for minutes.
    secret = "t0k3n-value"
    uri = f"http://127.0.0.1:{free_port()}/?token={secret}"
    run_dir = tmp_path / "run"
    start = time.monotonic()
    with pytest.raises(TrackingError) as refused:
        create_tracker(cfg_for(uri, "nowhere"), 0, run_dir)
    assert time.monotonic() - start < 60  # a bound, not a benchmark: unbounded retries take ~4 minutes
    message = str(refused.value)
    assert "\n" not in message
    assert "cannot open an MLflow run" in message and "token=***" in message
    assert secret not in "".join(traceback.format_exception(refused.value))
    assert not run_dir.exists()
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the bound was for the opening alone


def test_a_run_dir_that_refuses_the_journal_leaves_no_run_open(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tracking").write_text("a file where the journal folder goes\n")
    with pytest.raises(TrackingError,
                       match=r"tracking: .*/run/tracking: exists and is not a folder; choose .* \(it lies in run.dir\)"):
        create_tracker(cfg, 0, run_dir)
    assert runs_of(client, experiment) == []  # checked before the store is touched
    # A failure the check cannot foresee (here: the lock), after the store opened the run: no run left RUNNING.
    (run_dir / "tracking").unlink()
    real_lock = TrackingFolder.lock

    def failing_lock(self, holder):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(TrackingFolder, "lock", failing_lock)
    with pytest.raises(TrackingError, match="tracking: .*/run/tracking: Permission denied; fix the folder"):
        create_tracker(cfg, 0, run_dir)
    assert [r.info.lifecycle_stage for r in runs_of(client, experiment)] in ([], ["deleted"])
    assert client.search_runs([client.get_experiment_by_name(experiment).experiment_id]) == []
    # A re-opened run gets its earlier status back.
    monkeypatch.setattr(TrackingFolder, "lock", real_lock)
    with create_tracker(cfg, 0, run_dir) as t:
        run_id = t.run_id
    monkeypatch.setattr(TrackingFolder, "lock", failing_lock)
    with pytest.raises(TrackingError, match="Permission denied"):
        create_tracker(cfg, 0, run_dir)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_journal_on_a_full_disk_warns_once_and_never_raises(  # noqa: F811
        mlflow_server, client, experiment, tmp_path, caplog):  # noqa: F811
    from txl_dist.tracking.journal import _Journal

    # /dev/full: every write that reaches it fails with ENOSPC, as on a full run dir.
    tracker = create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path / "run")
    tracker._journal.close()
    tracker._journal = _Journal(Path("/dev/full"))
    with caplog.at_level(logging.WARNING, logger="txl_dist.tracking"):
        for step in range(1, 4):
            tracker.log_metrics({"train/loss": float(step)}, step=step)
            tracker.flush_journal()  # what the trainer does at a checkpoint
        assert tracker.flush(timeout=60)
        delivery = tracker.close()  # what runs while a failed save is on its way out
    warnings = [r.getMessage() for r in caplog.records if "metrics journal" in r.getMessage()]
    assert warnings == ["tracking: cannot write the metrics journal /dev/full (No space left on device); from now "
                        "on this job's metrics go to the store only, and what it does not take cannot be replayed"]
    assert delivery.ok and delivery.sent == 3  # the store still has every value
    assert history(client, tracker.run_id, "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_job_killed_while_the_writer_waits_on_the_store_keeps_every_step_in_its_journal(tmp_path):
    # The writer sat in a request to a silent server (up to a minute per call) while training went on and saved a
    # checkpoint; then the node was lost. The journal's lines were left in its buffer until the writer's next
    # send: steps 2..20 were lost, and the job resuming from the checkpoint at step 20 does not log them again.
    code = (
        "import os, signal, sys, threading\n"
        "from txl_dist.config import TrackingConfig\n"
        "from txl_dist.tracking import create_tracker, mlflow_run\n"
        "silent = threading.Event()\n"
        "mlflow_run._send_metrics = lambda *args: silent.wait()\n"
        "uri = 'sqlite:///' + os.path.join(sys.argv[1], 'mlflow.db')\n"
        "tracker = create_tracker(TrackingConfig(uri=uri, system_metrics=False), 0, sys.argv[1])\n"
        "for step in range(1, 21):\n"
        "    tracker.log_metrics({'train/loss': float(step)}, step=step)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # after the checkpoint of step 20\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == -9, out.stderr
    journal = TrackingFolder(tmp_path).journal.read_text().splitlines()
    assert [json.loads(line)["step"] for line in journal] == list(range(1, 21))


def test_an_artifact_replaced_later_is_never_put_back_by_replay(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    from txl_dist.tracking import mlflow_run

    real = mlflow_run._deliver_item
    failures = {"n": 1}

    def first_upload_fails(client_, run_id, item):
        if item.meta["kind"] == "artifact" and failures["n"]:
            failures["n"] -= 1
            raise ConnectionError("store away")
        return real(client_, run_id, item)

    monkeypatch.setattr(mlflow_run, "_deliver_item", first_upload_fails)
    monkeypatch.setattr(mlflow_run, "STORE_PAUSE_S", 0.0)
    tracker = create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path)
    tracker.log_text("step 10 curves", "curves.txt")
    assert tracker.flush(timeout=60)
    tracker.log_text("step 20 curves", "curves.txt")
    assert tracker.close().failed == 1
    assert TrackingFolder(tmp_path).outbox_items() == []  # the newer upload removed the stale copy
    out = replay_cli(tmp_path)
    assert out.returncode == 0 and "and 0 params/artifact/status items" in out.stdout, out.stdout + out.stderr
    client.download_artifacts(tracker.run_id, "curves.txt", str(tmp_path / "down"))
    assert (tmp_path / "down" / "curves.txt").read_text() == "step 20 curves"
    # Both copies waiting (both uploads failed): replay sends the newer one alone.
    failures["n"] = 2
    second = create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path)
    second.log_text("step 30 curves", "curves.txt")
    assert second.flush(timeout=60)
    second.log_text("step 40 curves", "curves.txt")
    assert second.close().failed == 2
    assert len(TrackingFolder(tmp_path).outbox_items()) == 2
    out = replay_cli(tmp_path)
    assert out.returncode == 0 and "and 1 params/artifact/status items" in out.stdout, out.stdout + out.stderr
    assert TrackingFolder(tmp_path).outbox_items() == []
    client.download_artifacts(tracker.run_id, "curves.txt", str(tmp_path / "down2"))
    assert (tmp_path / "down2" / "curves.txt").read_text() == "step 40 curves"


def test_a_uri_password_is_never_logged_written_or_sent(
        mlflow_server, client, experiment, tmp_path, monkeypatch, caplog, capfd):  # noqa: F811
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    caplog.set_level(logging.DEBUG)
    secret = "s3cr3t-Pa55"
    port = port_of(mlflow_server.uri)
    run_dir = tmp_path / "run"
    direct = f"http://trainer:{secret}@127.0.0.1:{port}"
    # A whole run: the URI is even among the params (the trainer logs its config).
    with create_tracker(cfg_for(direct, experiment), 0, run_dir) as t:
        t.log_params({"tracking": {"uri": direct}})
        t.log_metrics({"train/loss": 1.0}, step=1)
        t.log_text("hello", "a.txt")
    run_id = t.run_id
    # The same run re-opened through a hop that is then cut: every failure quotes the request URL.
    proxy = LoopbackProxy(port)
    via_proxy = f"http://trainer:{secret}@127.0.0.1:{proxy.port}"
    t2 = create_tracker(cfg_for(via_proxy, experiment, system_metrics=True), 0, run_dir)
    t2.log_metrics({"train/loss": 2.0}, step=2)
    assert t2.flush(timeout=60)
    proxy.cut()
    t2.log_metrics({"train/loss": 3.0}, step=3)
    t2.log_text("lost", "b.txt")
    t2.flush(timeout=60)
    # MLflow's system metrics sampler finds the store gone and logs the request URL, in one of two lines: the
    # cut lands before its next get_run or before its next log_batch (which of them is a race with the cut).
    sampler_lines = ("Failed to get mlflow run", "Failed to log system metrics")
    printed = ""
    deadline = time.monotonic() + 120
    while not any(line in printed for line in sampler_lines) and time.monotonic() < deadline:
        time.sleep(0.2)
        out, err = capfd.readouterr()
        printed += out + err
    delivery = t2.close(timeout=30)
    out, err = capfd.readouterr()
    printed += out + err
    replayed = replay_cli(run_dir)

    monitor_line = next(line for line in printed.splitlines() if any(m in line for m in sampler_lines))
    assert f"trainer:***@127.0.0.1:{proxy.port}" in monitor_line  # MLflow's own line, scrubbed
    assert replayed.returncode == 2 and "--uri" in replayed.stderr  # the recorded URI lost its password
    assert client.get_run(run_id).data.params["tracking.uri"] == f"http://trainer:***@127.0.0.1:{port}"
    files = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert f"trainer:***@127.0.0.1:{proxy.port}".encode() in files  # the recorded URI, redacted
    seen = caplog.text + printed + replayed.stdout + replayed.stderr + str(delivery.first_error)
    assert secret not in seen
    assert secret.encode() not in files


def test_replay_waits_for_the_live_job_and_needs_a_recorded_run(mlflow_server, experiment, tmp_path):  # noqa: F811
    nothing = replay_cli(tmp_path / "empty")
    assert nothing.returncode == 2 and "run_id not found" in nothing.stderr
    tracker = create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    busy = replay_cli(tmp_path)
    assert busy.returncode == 2 and "in use by another process" in busy.stderr
    assert tracker.close().ok
    done = replay_cli(tmp_path)
    assert done.returncode == 0 and "sent 0 metric values" in done.stdout, done.stderr


def test_a_lost_delivery_record_resends_one_chunk_that_the_store_takes_once(
        mlflow_server, client, experiment, tmp_path):  # noqa: F811
    # A crash between the store's acceptance and its record in delivered.jsonl, made by hand. Replay sends
    # that chunk again with its journaled timestamps: an exact copy, which MLflow's SQL store keeps once.
    with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path) as t:
        for step in range(1, 6):
            t.log_metrics({"train/loss": float(step)}, step=step)
            assert t.flush(timeout=60)  # one chunk per step
    delivered = tmp_path / "tracking" / "delivered.jsonl"
    lines = delivered.read_text().splitlines()
    assert len(lines) == 5
    delivered.write_text("\n".join(lines[:-1]) + "\n")
    out = replay_cli(tmp_path)
    assert out.returncode == 0 and "sent 1 metric values" in out.stdout, out.stderr
    assert history(client, t.run_id, "train/loss") == [(s, float(s)) for s in range(1, 6)]


def test_replay_goes_to_the_store_the_run_was_logged_to_and_creates_none(
        mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    # The job took tracking.uri; the environment names another store (a user's default): replay follows the run.
    with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path) as t:
        t.log_metrics({"train/loss": 1.0}, step=1)
    (tmp_path / "tracking" / "delivered.jsonl").write_text("")  # as if the store had missed it
    other = tmp_path / "elsewhere.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{other}")
    out = replay_cli(tmp_path)
    assert out.returncode == 0 and "sent 1 metric values" in out.stdout, out.stderr
    assert not other.exists()
    # A sqlite store that does not exist is refused, not created empty.
    refused = replay_cli(tmp_path, "--uri", f"sqlite:///{other}")
    assert refused.returncode == 2 and f"{other} does not exist" in refused.stderr, refused.stderr
    assert not other.exists()


@pytest.mark.parametrize("what", ["missing", "file", "run_id-folder"])
def test_replay_of_something_that_is_no_run_dir_is_one_line_exit_2(tmp_path, capsys, what):
    from txl_dist.tracking.__main__ import main

    run_dir = tmp_path / "run"
    if what == "file":  # a log or config file named by mistake: reading below it was a NotADirectoryError traceback
        run_dir.write_text("not a run dir\n")
    elif what == "run_id-folder":
        (run_dir / "tracking" / "run_id").mkdir(parents=True)
    assert main(["replay", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = {"missing": f"error: replay: {run_dir}/tracking/run_id not found; this run dir has no MLflow run",
                "file": f"error: replay: {run_dir}/tracking/run_id not found; this run dir has no MLflow run",
                "run_id-folder": f"error: tracking: cannot read {run_dir}/tracking/run_id (IsADirectoryError"}[what]
    assert len(err) == 1 and err[0].startswith(expected), err
