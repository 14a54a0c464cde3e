"""MLflow tracking against a real `mlflow server` on loopback (and the server-less local store).

One server is shared by the session (tests/mlflow_server.py); each test uses its own experiment, so
tests do not see each other's runs. Everything logged is read back through a separate MlflowClient.
"""
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlflow_server import (LoopbackProxy, cfg_for, client, experiment, free_port, mlflow_server,  # noqa: F401
                           no_mlflow_env)  # (fixtures are found by name)
from txl_dist.config import RunConfig, TrackingConfig
from txl_dist.tracking import (
    MAX_PARAM_VALUE_LENGTH,
    MlflowTracker,
    ResumePoint,
    Tracker,
    TrackingError,
    create_tracker,
    flatten_params,
)
from txl_dist.tracking.journal import TrackingFolder

REPO = Path(__file__).resolve().parents[1]


def runs_of(mlflow_client, experiment_name):
    exp = mlflow_client.get_experiment_by_name(experiment_name)
    return [] if exp is None else mlflow_client.search_runs([exp.experiment_id])


def history(mlflow_client, run_id, key):
    return [(m.step, m.value) for m in mlflow_client.get_metric_history(run_id, key)]


def leaves(obj, prefix=""):
    """Independent of flatten_params: walk the JSON text of the config and collect leaf paths."""
    out = {}
    for k, v in obj.items():
        if isinstance(v, dict) and v:
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_import_is_lazy_and_other_ranks_open_no_run(mlflow_server):  # noqa: F811
    # A fresh interpreter: rank 1 gets the no-op tracker and mlflow is never imported there.
    code = (
        "import sys\n"
        "from txl_dist.config import TrackingConfig\n"
        "from txl_dist.tracking import create_tracker\n"
        f"t = create_tracker(TrackingConfig(uri={mlflow_server.uri!r}, experiment='lazy'), rank=1, run_dir='unused')\n"
        "with t:\n"
        "    t.log_params({'a': {'b': 1}}); t.log_metrics({'train/loss': 1.0}, step=1)\n"
        "    t.log_text('x', 'x.txt'); t.log_dict({'a': 1}, 'a.json')\n"
        "assert t.run_id is None and not t.active\n"
        "assert 'mlflow' not in sys.modules, 'rank 1 imported mlflow'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert not (REPO / "unused").exists()


def test_only_rank_zero_creates_a_run(mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment, run_name="only-rank-0")
    trackers = [create_tracker(cfg, rank, tmp_path) for rank in (0, 1)]
    assert isinstance(trackers[0], MlflowTracker) and type(trackers[1]) is Tracker
    for rank, t in enumerate(trackers):
        t.log_metrics({"train/loss": float(rank)}, step=1)
        t.close()
    (run,) = runs_of(client, experiment)
    assert run.info.run_id == trackers[0].run_id
    assert run.info.run_name == "only-rank-0"
    assert run.info.status == "FINISHED"
    assert history(client, run.info.run_id, "train/loss") == [(1, 0.0)]
    # Disabled tracking: no run on rank 0 either.
    off = create_tracker(cfg_for(mlflow_server.uri, experiment, enabled=False), 0, tmp_path)
    assert type(off) is Tracker
    assert len(runs_of(client, experiment)) == 1


def test_params_are_the_flattened_resolved_config(mlflow_server, client, experiment, tmp_path):  # noqa: F811
    cfg = RunConfig(deepspeed={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                               "zero_optimization": {"stage": 2}, "bf16": {}})
    resolved = cfg.to_dict()
    resolved["data"]["path"] = "p" * (MAX_PARAM_VALUE_LENGTH + 500)  # over MLflow's limit
    resolved["deepspeed"]["extra"] = {f"knob_{i}": i for i in range(120)}  # past one batch of 100 params
    with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path) as t:
        t.log_params(resolved)
        run_id = t.run_id
    params = client.get_run(run_id).data.params
    expected = leaves(json.loads(json.dumps(resolved)))
    assert len(expected) > 100  # more than one log_batch of params
    assert set(params) == set(expected)
    for key, value in expected.items():
        if key == "data.path":
            continue
        assert params[key] == (value if isinstance(value, str) else json.dumps(value)), key
    assert params["deepspeed.zero_optimization.stage"] == "2"
    assert params["model.cutoffs"] == json.dumps(cfg.model.cutoffs)
    assert params["deepspeed.bf16"] == "{}"
    assert len(params["data.path"]) == MAX_PARAM_VALUE_LENGTH
    assert params["data.path"].startswith("ppp") and params["data.path"].endswith("[truncated]")


def test_metrics_at_each_step_read_back_equal(mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    rng = random.Random(0)
    n = 40
    logged = {"train/loss": [], "train/lr": [], "valid/loss": []}
    with create_tracker(cfg_for(mlflow_server.uri, experiment, system_metrics=True), 0, tmp_path) as t:
        for step in range(1, n + 1):
            loss, lr = rng.uniform(2, 8), rng.uniform(0, 1e-3)
            t.log_metrics({"train/loss": loss, "train/lr": lr, "train/grad_norm": None}, step=step)
            logged["train/loss"].append((step, loss))
            logged["train/lr"].append((step, lr))
            if step % 10 == 0:
                t.log_metrics({"valid/loss": loss + 0.5}, step=step)
                logged["valid/loss"].append((step, loss + 0.5))
        assert t.flush(timeout=60)
        # System metrics are sampled every 0.1 s here; give the sampler time for a few samples.
        time.sleep(1.5)
        run_id = t.run_id
    delivery = t.close()  # a second close changes nothing
    assert delivery.ok and delivery.sent == 2 * n + n // 10
    for key, values in logged.items():
        got = sorted(history(client, run_id, key))
        assert [s for s, _ in got] == [s for s, _ in values], key
        assert all(math.isclose(a, b, rel_tol=1e-12) for (_, a), (_, b) in zip(got, values)), key
    run = client.get_run(run_id)
    assert "train/grad_norm" not in run.data.metrics  # None values are skipped
    assert any(k.startswith("system/cpu") for k in run.data.metrics), sorted(run.data.metrics)


def test_artifacts_are_uploaded_and_listed(mlflow_server, client, experiment, tmp_path):  # noqa: F811
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(bytes(range(256)) * 4)
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "manifest.json").write_text('{"format": "txl-stream"}')
    (data / "train" / "x.txt").write_text("shard")
    with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path) as t:
        t.log_artifact(tok)
        t.log_artifact(data / "manifest.json", artifact_path="data")
        t.log_artifact(data / "train", artifact_path="data/train")
        t.log_dict({"test/loss": 3.25, "test/ppl": math.exp(3.25)}, "eval/final.json")
        t.log_text("resolved config", "config.txt")
        with pytest.raises(FileNotFoundError, match="missing.bin"):
            t.log_artifact(tmp_path / "missing.bin")
        run_id = t.run_id
    top = {f.path for f in client.list_artifacts(run_id)}
    assert top == {"tokenizer.model", "data", "eval", "config.txt"}
    assert {f.path for f in client.list_artifacts(run_id, "data")} == {"data/manifest.json", "data/train"}
    out = Path(client.download_artifacts(run_id, "", str(tmp_path / "down")))
    assert (out / "tokenizer.model").read_bytes() == tok.read_bytes()
    assert (out / "data" / "train" / "x.txt").read_text() == "shard"
    assert json.loads((out / "eval" / "final.json").read_text()) == {"test/loss": 3.25, "test/ppl": math.exp(3.25)}
    assert (out / "config.txt").read_text() == "resolved config"


def test_resume_continues_the_same_run(mlflow_server, client, experiment, tmp_path, caplog):  # noqa: F811
    cfg = cfg_for(mlflow_server.uri, experiment)
    first = create_tracker(cfg, 0, tmp_path)
    first.log_params({"train": {"max_steps": 10, "exit_step": 5}})
    for step in range(1, 6):
        first.log_metrics({"train/loss": 10.0 - step}, step=step)
    ended = "stopped after step 5 (SIGTERM); the next job resumes from step_00000005"
    first.close("KILLED", ended=ended)  # e.g. the job was preempted after its step-5 checkpoint
    run_id = first.run_id
    assert client.get_run(run_id).info.status == "KILLED"
    assert client.get_run(run_id).data.tags["txl.ended"] == ended

    with caplog.at_level(logging.WARNING, logger="txl_dist.tracking"):
        second = create_tracker(cfg, 0, tmp_path, resume=ResumePoint(run_id, 5))
        assert second.run_id == run_id
        assert client.get_run(run_id).info.status == "RUNNING"
        assert "txl.ended" not in client.get_run(run_id).data.tags  # the run has not ended now
        # exit_step changed on the restart: MLflow params cannot change, the earlier value stays.
        second.log_params({"train": {"max_steps": 10, "exit_step": None}, "eval": {"interval": 3}})
        for step in range(6, 11):
            second.log_metrics({"train/loss": 10.0 - step}, step=step)
        second.close()
    assert "train.exit_step" in caplog.text
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.max_steps": "10", "train.exit_step": "5", "eval.interval": "3"}
    assert sorted(history(client, run_id, "train/loss")) == [(s, 10.0 - s) for s in range(1, 11)]
    assert [r.info.run_id for r in runs_of(client, experiment)] == [run_id]


def test_resume_of_an_unknown_run_is_a_clear_error(mlflow_server, experiment, tmp_path):  # noqa: F811
    with pytest.raises(TrackingError, match="run 0123456789abcdef is not in .*point tracking.uri"):
        create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path,
                       resume=ResumePoint("0123456789abcdef", 5))


def test_unreachable_store_at_start_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingError, match=f"tracking.uri {uri}: cannot open an MLflow run.*tracking.enabled=false"):
        create_tracker(cfg_for(uri, "nowhere"), 0, tmp_path)


def test_an_error_of_our_own_code_while_opening_is_a_failure_not_advice_about_the_store(tmp_path, monkeypatch):
    # Found by the fault sweep (an error raised at a random call): a bug while opening the run was refused as
    # "cannot open an MLflow run (...); start the server, fix tracking.uri", advice for a store that was fine.
    from txl_dist.tracking import mlflow_run

    monkeypatch.setattr(mlflow_run.MlflowTracker, "_experiment_id", lambda self: flatten_params(None))
    run_dir = tmp_path / "run"
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'items'"):
        create_tracker(TrackingConfig(system_metrics=False), 0, run_dir)
    assert not (run_dir / "mlflow.db").exists()  # the store it began goes with it, as after a refusal

    def out_of_memory(self):
        raise MemoryError()

    monkeypatch.setattr(mlflow_run.MlflowTracker, "_experiment_id", out_of_memory)
    with pytest.raises(MemoryError):
        create_tracker(TrackingConfig(system_metrics=False), 0, run_dir)
    assert not (run_dir / "mlflow.db").exists()


def test_whose_error_it_is_follows_the_innermost_frame():
    from mlflow import MlflowClient

    from txl_dist.errors import failure_of_the_process

    with pytest.raises(AttributeError) as ours:
        flatten_params(None)
    assert failure_of_the_process(ours.value)
    with pytest.raises(Exception) as mlflows:
        MlflowClient(tracking_uri="nosuchscheme://host/x").search_experiments()
    assert not failure_of_the_process(mlflows.value)
    assert not failure_of_the_process(RuntimeError("never raised: no traceback"))
    assert failure_of_the_process(MemoryError())


def test_server_going_away_warns_once_and_training_goes_on(mlflow_server, client, experiment, tmp_path,  # noqa: F811
                                                           monkeypatch, caplog):
    # With MLflow's own HTTP settings (7 retries doubling from 2 s, 120 s timeouts), which used to hold the
    # first failure for minutes: no warning while training, and the job's exit waited 120 s in close().
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    proxy = LoopbackProxy(int(mlflow_server.uri.rsplit(":", 1)[1]))
    tracker = create_tracker(cfg_for(f"http://127.0.0.1:{proxy.port}", experiment), 0, tmp_path)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    assert tracker.flush(timeout=60)
    proxy.cut()
    with caplog.at_level(logging.WARNING, logger="txl_dist.tracking"):
        for step in range(2, 12):
            tracker.log_metrics({"train/loss": float(step)}, step=step)  # must not raise
            assert tracker.flush(timeout=60)  # each step's batch goes out alone and fails; no writer stuck
        tracker.log_text("final", "eval.txt")  # nor must an artifact upload
        warned_while_training = [r for r in caplog.records
                                 if r.name == "txl_dist.tracking" and r.levelno >= logging.WARNING]
        start = time.monotonic()
        delivery = tracker.close()
        closing_s = time.monotonic() - start
    assert len(warned_while_training) == 1 and "could not log" in warned_while_training[0].getMessage()
    assert "training goes on" in warned_while_training[0].getMessage()
    assert closing_s < 60, closing_s  # not close()'s 120 s bound: the store is known to be gone
    assert os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") is None  # the run's HTTP limits end with it
    assert delivery.sent == 1 and delivery.failed == 10 + 1 and delivery.first_error
    assert "11 values or items failed" in caplog.text  # close() reports the total
    # What reached the server before it went away is there; the run was never terminated by us.
    assert history(client, tracker.run_id, "train/loss") == [(1, 1.0)]
    assert client.get_run(tracker.run_id).info.status == "RUNNING"


def test_a_full_queue_drops_values_and_says_so(mlflow_server, client, experiment, tmp_path, caplog):  # noqa: F811
    # One pending step at most: training (a tight loop here) outruns the HTTP round trips of the writer.
    tracker = MlflowTracker(cfg_for(mlflow_server.uri, experiment), tmp_path, max_pending=1)
    with caplog.at_level(logging.WARNING, logger="txl_dist.tracking"):
        for step in range(1, 201):
            tracker.log_metrics({"train/loss": float(step)}, step=step)
        delivery = tracker.close()
    assert delivery.dropped > 0 and delivery.failed == 0
    assert delivery.sent + delivery.dropped == 200
    assert "queue is full" in caplog.text and f"{delivery.dropped} dropped" in caplog.text
    got = history(client, tracker.run_id, "train/loss")
    assert len(got) == delivery.sent and all(value == step for step, value in got)


def test_default_local_store_needs_no_server(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run_dir = tmp_path / "runs" / "tiny"
    with create_tracker(TrackingConfig(system_metrics=False), 0, run_dir) as t:
        t.log_params({"model": {"d_model": 64}})
        for step in (1, 2, 3):
            t.log_metrics({"train/loss": 1.0 / step}, step=step)
        t.log_text("done", "eval/final.txt")
        run_id = t.run_id
    assert (run_dir / "mlflow.db").is_file()
    assert list(cwd.iterdir()) == []  # nothing lands in the working directory (MLflow's own default)
    from txl_dist.run_dir import OWN_FILES, OWN_FOLDERS

    assert {p.name for p in run_dir.iterdir()} <= {*OWN_FILES, *OWN_FOLDERS}  # what eval --json-out may not replace
    from mlflow import MlflowClient

    local = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = local.get_run(run_id)
    assert local.get_experiment(run.info.experiment_id).name == "txl-dist"
    assert run.info.status == "FINISHED" and run.data.params == {"model.d_model": "64"}
    assert history(local, run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    # Artifacts lie beside the database.
    files = [p.relative_to(run_dir).parts for p in run_dir.rglob("final.txt")]
    assert len(files) == 1 and files[0][0] == "mlartifacts"


def test_a_copied_run_dir_keeps_its_artifacts_in_its_own_store(tmp_path, monkeypatch):
    """The local store names its artifact folder by absolute path: a run dir copied (or moved) elsewhere would
    upload its artifacts into the original's folder (or a path that no longer exists). Its next job points
    them at the copy's own mlartifacts/; the original is untouched."""
    import shutil

    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    original, copy = tmp_path / "a" / "run", tmp_path / "b" / "run"
    with create_tracker(TrackingConfig(system_metrics=False), 0, original) as t:
        t.log_text("first", "eval/final.txt")
        run_id = t.run_id
    shutil.copytree(original, copy)
    # The next job, a process of its own as every job is (MLflow caches a run's artifact folder per process).
    code = ("from txl_dist.config import TrackingConfig\n"
            "from txl_dist.tracking import create_tracker\n"
            f"with create_tracker(TrackingConfig(system_metrics=False), 0, {str(copy)!r}) as t:\n"
            f"    assert t.run_id == {run_id!r}\n"
            "    t.log_text('second', 'eval/final.txt')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [p.read_text() for p in original.rglob("final.txt")] == ["first"]
    assert [p.read_text() for p in copy.rglob("final.txt")] == ["second"]
    local = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    assert local.get_run(run_id).info.artifact_uri.startswith((copy / "mlartifacts").resolve().as_uri() + "/")
    assert MlflowClient(f"sqlite:///{original / 'mlflow.db'}").get_run(run_id).info.artifact_uri.startswith(
        (original / "mlartifacts").resolve().as_uri() + "/")
    # A later job has nothing to move: the recorded URI is the copy's now.
    assert TrackingFolder(copy).recorded_uri() == f"sqlite:///{(copy / 'mlflow.db').resolve()}"


def test_env_vars_choose_store_and_experiment(mlflow_server, client, experiment, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    with create_tracker(TrackingConfig(system_metrics=False), 0, tmp_path) as t:
        run_id = t.run_id
    assert [r.info.run_id for r in runs_of(client, experiment)] == [run_id]
    assert not (tmp_path / "mlflow.db").exists()


def test_context_manager_marks_failed_runs(mlflow_server, client, experiment, tmp_path):  # noqa: F811
    with pytest.raises(ZeroDivisionError):
        with create_tracker(cfg_for(mlflow_server.uri, experiment), 0, tmp_path) as t:
            1 / 0
    assert client.get_run(t.run_id).info.status == "FAILED"
    with pytest.raises(ValueError, match="close.status='DONE'.*FINISHED, FAILED, KILLED"):
        Tracker().close("DONE")


def test_flatten_params_keeps_empty_sections_and_json_values():
    flat = flatten_params({"a": {"b": [1, 2], "c": None, "d": True, "e": {}}, "f": "text"})
    assert flat == {"a.b": "[1, 2]", "a.c": "null", "a.d": "true", "a.e": "{}", "f": "text"}
