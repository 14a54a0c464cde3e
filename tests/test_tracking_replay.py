"""`python -m txl_dist.tracking replay RUN_DIR` on a run dir that was copied or moved with its default local
store (RUN/mlflow.db), on one whose tracking.uri was the user's own choice, and on one whose store is gone.
Local sqlite stores only: no server is needed (a recorded http URI is never followed elsewhere)."""
import contextlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from txl_dist.config import TrackingConfig
from txl_dist.tracking import create_tracker, mlflow_run
from txl_dist.tracking.errors import TrackingError
from txl_dist.tracking.journal import TrackingFolder

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_tracking_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def replay_cli(run_dir, *args) -> subprocess.CompletedProcess:
    """The documented command line, in a fresh interpreter (MLflow caches a run's artifact folder per process)."""
    return subprocess.run([sys.executable, "-m", "txl_dist.tracking", "replay", str(run_dir), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def steps_in(database: Path, run_id: str) -> list[int]:
    """The steps of the run's train/loss in the store, read with sqlite3: an MlflowClient of this process would
    keep reading a database file the test has since replaced (its engine is cached per URI)."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        return [step for (step,) in db.execute("SELECT step FROM metrics WHERE run_uuid = ? AND key = 'train/loss' "
                                               "ORDER BY step", (run_id,))]


def run_the_store_partly_missed(run_dir: Path, monkeypatch, uri: str | None = None) -> str:
    """Steps 1..5 of train/loss and an artifact; the store took step 1 only (the values of steps 2..5 taken out
    of it and of delivered.jsonl, as after a store that failed) and not the artifact (it waits in the outbox)."""
    real = mlflow_run._deliver_item

    def artifacts_fail(client, run_id, item):
        if item.meta["kind"] == "artifact":
            raise ConnectionError("store away")
        return real(client, run_id, item)

    with monkeypatch.context() as m:
        m.setattr(mlflow_run, "_deliver_item", artifacts_fail)
        m.setattr(mlflow_run, "STORE_PAUSE_S", 0.0)
        tracker = create_tracker(TrackingConfig(uri=uri, system_metrics=False), 0, run_dir)
        for step in range(1, 6):
            tracker.log_metrics({"train/loss": float(step)}, step=step)
            assert tracker.flush(timeout=60)
        tracker.log_text("curves", "curves.txt")
        assert tracker.close().failed == 1
    database = Path(uri[len("sqlite:///"):]) if uri else run_dir / "mlflow.db"
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        db.execute("DELETE FROM metrics WHERE step > 1")
    delivered = run_dir / "tracking" / "delivered.jsonl"
    delivered.write_text(delivered.read_text().splitlines()[0] + "\n")
    assert steps_in(database, tracker.run_id) == [1]
    return tracker.run_id


def artifacts_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("curves.txt") if "outbox" not in p.parts)


@pytest.mark.parametrize("how", ["copy", "move", "move, --uri of its store"])
def test_replay_in_a_copied_or_moved_run_dir_sends_to_its_own_store(tmp_path, monkeypatch, how):
    """The recorded URI names the database at the old path: replay sent the copy's missing values and artifact
    into the original's store and artifact folder (the copy's store never got them, and its journal said they
    were sent), refused after a move, and with --uri of the moved store put the artifact at the old path,
    making that folder again. Now it sends to the run dir's own store, its artifact locations pointed at the
    run dir's mlartifacts/, as a job there would."""
    original, copy = tmp_path / "a" / "run", tmp_path / "b" / "run"
    run_id = run_the_store_partly_missed(original, monkeypatch)
    if how == "copy":
        shutil.copytree(original, copy)
    else:
        copy.parent.mkdir()
        shutil.move(original, copy)
    own = (copy / "mlflow.db").resolve()
    out = replay_cli(copy, *(["--uri", f"sqlite:///{own}"] if "--uri" in how else []))
    assert out.returncode == 0, out.stdout + out.stderr
    assert steps_in(copy / "mlflow.db", run_id) == [1, 2, 3, 4, 5]
    assert artifacts_under(copy) == [f"mlartifacts/{run_id}/artifacts/curves.txt"]
    if how == "copy":  # the original is as it was
        assert steps_in(original / "mlflow.db", run_id) == [1]
        assert artifacts_under(original) == []
    else:
        assert not original.exists()
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"replay: sending to run {run_id} at sqlite:///{own} ("), lines
    assert lines[0].endswith(f"; 2 artifact location(s) now point at {own.parent / 'mlartifacts'})"), lines
    assert "sent 4 metric values (4 log_metrics calls) and 1 params/artifact/status items" in lines[1], lines
    # Recorded: a second replay, and the next job, find the store where the run dir is; nothing is sent twice.
    assert TrackingFolder(copy).recorded_uri() == f"sqlite:///{own}"
    again = replay_cli(copy)
    assert again.returncode == 0 and "sent 0 metric values (0 log_metrics calls) and 0 " in again.stdout, \
        again.stdout + again.stderr
    assert "(the store the run was logged to" in again.stdout
    assert steps_in(copy / "mlflow.db", run_id) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("where", ["outside the run dir", "the run dir's own path"])
def test_replay_in_a_copied_run_dir_keeps_an_explicit_sqlite_store(tmp_path, monkeypatch, where):
    """tracking.uri named a sqlite store: the user's choice, not the folder's, so a copy's replay sends there,
    also when it named the run dir's own mlflow.db (config.resolved.json says it was set)."""
    original, copy = tmp_path / "a" / "run", tmp_path / "b" / "run"
    store = tmp_path / "shared" / "mlflow.db" if where == "outside the run dir" else original / "mlflow.db"
    uri = f"sqlite:///{store}"
    run_id = run_the_store_partly_missed(original, monkeypatch, uri)
    (original / "config.resolved.json").write_text(json.dumps({"tracking": {"uri": uri}}))
    shutil.copytree(original, copy)
    out = replay_cli(copy)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"replay: sending to run {run_id} at {uri} (the store the run was logged to, "
                                 f"{copy / 'tracking' / 'uri'})\n"), out.stdout
    assert "sent 4 metric values" in out.stdout
    assert steps_in(store, run_id) == [1, 2, 3, 4, 5]
    assert TrackingFolder(copy).recorded_uri() == uri
    if where == "the run dir's own path":
        assert steps_in(copy / "mlflow.db", run_id) == [1]


def test_a_recorded_server_is_never_swapped_for_a_store_in_the_run_dir(tmp_path):
    from txl_dist.tracking.replay import _choose_store

    folder = TrackingFolder(tmp_path)
    folder.dir.mkdir()
    folder.record("R1", "http://mlflow.example.com:5000")
    (tmp_path / "mlflow.db").write_bytes(b"")
    store = _choose_store(tmp_path, folder, "R1", None)
    assert (store.uri, store.moved_from) == ("http://mlflow.example.com:5000", None)


@pytest.mark.parametrize("how", ["in place", "moved", "copied"])
def test_replay_with_its_store_missing_refuses_in_one_line_and_creates_none(tmp_path, monkeypatch, how):
    """mlflow.db deleted, a run dir moved without it, or copied without it (the original, which holds the same
    run, still there: replay sent the copy's values into the original's store and marked them sent in the
    copy): one line, exit 2, no new empty store, nothing marked as sent; the same replay sends each missing step
    once when the store is back."""
    run_dir = tmp_path / "run"
    run_id = run_the_store_partly_missed(run_dir, monkeypatch)
    recorded = run_dir / "mlflow.db"
    kept = tmp_path / "kept.db"
    shutil.copy(recorded, kept)
    if how == "copied":
        copy = tmp_path / "elsewhere" / "run"
        shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("mlflow.db"))
        run_dir = copy
    elif how == "moved":
        recorded.unlink()
        moved = tmp_path / "elsewhere" / "run"
        moved.parent.mkdir()
        shutil.move(run_dir, moved)
        run_dir = moved
    else:
        recorded.unlink()
    delivered = (run_dir / "tracking" / "delivered.jsonl").read_text()
    out = replay_cli(run_dir)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    if how == "copied":
        assert out.stderr.splitlines() == [
            f"error: replay: {(run_dir / 'mlflow.db').resolve()} does not exist: the run dir was copied from "
            f"{recorded.parent} without its store; copy {recorded} here, or replay there"]
        assert steps_in(recorded, run_id) == [1]  # the original's store is as it was
    else:
        assert out.stderr.splitlines() == [
            f"error: replay: {recorded} does not exist (tracking URI sqlite:///{recorded}); pass the --uri of "
            "the store that holds the run"]
        assert not recorded.exists()
    assert not (run_dir / "mlflow.db").exists()
    assert (run_dir / "tracking" / "delivered.jsonl").read_text() == delivered
    shutil.copy(kept, run_dir / "mlflow.db")
    out = replay_cli(run_dir)
    assert out.returncode == 0 and "sent 4 metric values" in out.stdout, out.stdout + out.stderr
    assert steps_in(run_dir / "mlflow.db", run_id) == [1, 2, 3, 4, 5]


def test_replay_on_a_store_that_is_no_database_is_one_line_exit_2(tmp_path):
    """It was a traceback of ~60 lines from MlflowClient's constructor."""
    folder = TrackingFolder(tmp_path)
    folder.dir.mkdir()
    database = tmp_path / "mlflow.db"
    folder.record("R1", f"sqlite:///{database}")
    database.write_bytes(b"not a database, " * 256)
    out = replay_cli(tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines() == [
        f"error: replay: MLflow cannot use sqlite:///{database} (DatabaseError: (sqlite3.DatabaseError) file is not a "
        "database); pass the --uri of the store that holds the run"]


def test_replay_with_stdout_on_a_full_disk_is_one_line_exit_1_without_importing_torch(tmp_path, monkeypatch):
    """`replay RUN > log` on a full disk ended in an OSError traceback at its summary. It is the one line of the
    other entry points now (write_faults.print_result), and replay still does not import torch (~1.6 s)."""
    run_dir = tmp_path / "run"
    run_the_store_partly_missed(run_dir, monkeypatch)
    probe = ("import runpy, sys\n"
             f"sys.argv = ['txl_dist.tracking', 'replay', {str(run_dir)!r}]\n"
             "try:\n"
             "    runpy.run_module('txl_dist.tracking', run_name='__main__')\n"
             "finally:\n"
             "    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n")
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines() == [
        "error: the standard output cannot be written ([Errno 28] No space left on device): the file it is "
        "redirected to is on a full or read-only file system; free space there, or redirect it elsewhere, and run "
        "again", "torch imported: False"]
    # The values were sent before the summary failed: they are in the store, and recorded as sent.
    out = replay_cli(run_dir)
    assert out.returncode == 0 and "sent 0 metric values" in out.stdout, out.stdout + out.stderr


def test_a_0_byte_store_is_refused_in_one_line_by_replay_and_training_and_left_as_it_is(tmp_path, monkeypatch):
    """RUN/mlflow.db of 0 bytes (a copy cut short, a disk that filled): replay and a training job's tracker let
    MLflow make it an empty store (~1 MB of tables) before refusing "the run is not in" it. Both refuse in one
    line naming the file now, and leave it empty; the same replay sends the missing steps once it is back."""
    run_dir = tmp_path / "run"
    run_id = run_the_store_partly_missed(run_dir, monkeypatch)
    database = run_dir / "mlflow.db"
    kept = tmp_path / "kept.db"
    shutil.move(database, kept)
    database.write_bytes(b"")
    delivered = (run_dir / "tracking" / "delivered.jsonl").read_text()
    out = replay_cli(run_dir)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        f"error: replay: {database} is empty (0 bytes: a copy cut short, or a disk that filled), so it does not "
        f"hold the MLflow run {run_id} recorded in {run_dir / 'tracking' / 'run_id'}; put the store back (copy the "
        "whole mlflow.db), or pass the --uri of the store that holds the run"]
    assert database.stat().st_size == 0
    with pytest.raises(TrackingError) as refused:
        create_tracker(TrackingConfig(system_metrics=False), 0, run_dir)  # the next training job's start
    assert str(refused.value) == (
        f"tracking: {database.resolve()} is empty (0 bytes: a copy cut short, or a disk that filled), so it does "
        f"not hold the MLflow run {run_id}; put the store back (copy the whole mlflow.db), or point tracking.uri at "
        "the store that holds it")
    assert database.stat().st_size == 0
    assert (run_dir / "tracking" / "delivered.jsonl").read_text() == delivered
    shutil.copy(kept, database)
    out = replay_cli(run_dir)
    assert out.returncode == 0 and "sent 4 metric values" in out.stdout, out.stdout + out.stderr
    assert steps_in(database, run_id) == [1, 2, 3, 4, 5]
