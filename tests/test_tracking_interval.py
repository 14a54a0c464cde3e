"""tracking.metrics_interval: the training metrics logged every n steps, each value covering the steps since
the previous one (txl_dist/tracking/thinning.py). Real training jobs (2 plain processes on gloo, faults from
tests/fault_job.py) against the run folder's sqlite store: a run stopped, crashed, rolled back or relaunched
with another interval logs what the per-step values of an uninterrupted run say it must, each step once."""
from __future__ import annotations

import json
import math
import re

import pytest

from dist_helpers import Launch, launch_ranks, learnable_corpus, tiny_config
from txl_dist.tracking.thinning import MetricsWindow, how_summarized

VOCAB = 64
STEPS = 8
EXACT = ("train/loss", "train/grad_norm", "train/lr", "train/tokens_seen", "train/nonfinite_steps")
"""The keys a resumed run reproduces bit for bit (the rest are timings)."""
TIMINGS = ("train/step_time_s", "train/tokens_per_s", "train/model_flops_per_s", "train/memory_peak_mib")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return learnable_corpus(tmp_path_factory.mktemp("interval") / "corpus", 4 * 97, VOCAB)


def _config(corpus, run_dir, interval: int, **sections) -> str:
    raw = tiny_config(corpus, run_dir, **{
        "train": {"max_steps": STEPS, "collective_timeout_s": 20, "max_nonfinite": 3, **sections.pop("train", {})},
        "tracking": {"enabled": True, "experiment": "interval", "system_metrics": False,
                     "metrics_interval": interval},
        # ZeRO-1: every rank writes a rank file of its own (stage 0: rank 0 alone).
        "deepspeed": {"zero_optimization": {"stage": 1}}, **sections})
    path = run_dir.parent / f"{run_dir.name}-{interval}.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _train(config: str, *faults: str, resume: str = "auto", world: int = 2) -> list[Launch]:
    return launch_ranks("train", ["--config", config, "--resume", resume], faults, world)


def _codes(procs: list[Launch]) -> list[int]:
    return [p.wait(300) for p in procs]


def _histories(run_dir, run_id: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """Every train/* metric of the run: its (step, value) points in step order, repeats kept."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = run_id or (run_dir / "tracking" / "run_id").read_text().strip()
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("train/")]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


@pytest.fixture(scope="module")
def per_step(corpus, tmp_path_factory):
    """{key: {step: value}} of an uninterrupted run logging every step (metrics_interval 1)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    procs = _train(_config(corpus, run_dir, 1))
    assert _codes(procs) == [0, 0], procs[0].output[-3000:]
    histories = _histories(run_dir)
    assert [s for s, _ in histories["train/loss"]] == list(range(1, STEPS + 1))
    return {k: dict(points) for k, points in histories.items()}


def _expected(per_step, windows: list[tuple[int, int]]) -> dict[str, list[tuple[int, float]]]:
    """The exact keys' points of a run that logs windows [(first, last), ...] (each at its last step)."""
    out = {}
    for key in EXACT:
        points = []
        for first, last in windows:
            values = [per_step[key][s] for s in range(first, last + 1)]
            points.append((last, sum(values) / len(values) if how_summarized(key) == "mean" else values[-1]))
        out[key] = points
    return out


def _assert_logs(histories, per_step, windows) -> None:
    assert {k: histories[k] for k in EXACT} == _expected(per_step, windows)
    for key in TIMINGS:  # each window once; the values are timings (not reproducible)
        assert [s for s, _ in histories[key]] == [last for _, last in windows], key


def test_an_uninterrupted_run_logs_each_window_once_at_its_end(corpus, tmp_path, per_step):
    run_dir = tmp_path / "run"
    procs = _train(_config(corpus, run_dir, 3, train={"log_interval": 3}))
    assert _codes(procs) == [0, 0], procs[0].output[-3000:]
    # Multiples of 3, and train.max_steps (its window: steps 7 and 8).
    _assert_logs(_histories(run_dir), per_step, [(1, 3), (4, 6), (7, 8)])
    # A mean, not a sample of the step: the two differ here.
    assert per_step["train/loss"][3] != sum(per_step["train/loss"][s] for s in (1, 2, 3)) / 3
    # The progress line's loss and grad norm are the same means (it showed the step's own values).
    lines = re.findall(r"step (\d+)/8 \| loss (\S+) \| lr \S+ \| grad norm (\S+) \|", procs[0].output)
    expected = _expected(per_step, [(1, 3), (4, 6), (7, 8)])
    assert lines == [(str(step), f"{loss:.4f}", f"{norm:.3f}") for (step, loss), (_, norm)
                     in zip(expected["train/loss"], expected["train/grad_norm"])]


def test_a_run_stopped_and_crashed_off_the_interval_logs_what_an_uninterrupted_run_logs(corpus, tmp_path, per_step):
    """A stop request saves step 4 (its window holds step 4 alone); the next job is SIGKILLed in step 7, after
    logging step 6; the third resumes from step 4 again: step 6 is in the journal (not logged again), step 8's
    window is 7..8. Without the window in the checkpoint, step 6 would be the mean of steps 5..6."""
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, 3)
    stopped = _train(config, "sigterm-at-step:0:3")  # seen by the ranks in step 4
    assert _codes(stopped) == [0, 0], stopped[0].output[-3000:]
    assert "stopping after step 4" in stopped[0].output
    killed = _train(config, "kill-at-step:0:7", "kill-at-step:1:7")
    assert _codes(killed) == [-9, -9], killed[0].output[-3000:]
    resumed = _train(config)
    assert _codes(resumed) == [0, 0], resumed[0].output[-3000:]
    assert "resumed from" in resumed[0].output and "step_00000004 at step 4" in resumed[0].output
    _assert_logs(_histories(run_dir), per_step, [(1, 3), (4, 6), (7, 8)])
    # The journal holds each logged step once (step 6: job 2's if it reached the journal before the kill, else
    # job 3's), and nothing is left for replay.
    journal = [json.loads(line) for line in (run_dir / "tracking" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in journal if "train/loss" in r["metrics"]] == [3, 6, 8]
    from txl_dist.tracking.replay import replay

    report = replay(run_dir)
    assert (report.values, report.items) == (0, 0)


def test_a_rollback_relaunched_with_another_interval_carries_the_saved_window(corpus, tmp_path, per_step):
    """Interval 3 to step 6 (checkpoints at 2, 4, 6), then back to step 4 with interval 5: the continuation
    run starts with step 3 (copied), logs steps 4..5 at 5 (the saved window, step 4, goes on) and 6..8 at 8.
    tracking is volatile: the changed interval is no refusal."""
    run_dir = tmp_path / "run"
    first = _train(_config(corpus, run_dir, 3, train={"exit_step": 6}, checkpoint={"interval": 2, "keep": 3}))
    assert _codes(first) == [0, 0], first[0].output[-3000:]
    r1 = (run_dir / "tracking" / "run_id").read_text().strip()
    rollback = _train(_config(corpus, run_dir, 5, checkpoint={"interval": 2, "keep": 3}),
                      resume=str(run_dir / "checkpoints" / "step_00000004"))
    assert _codes(rollback) == [0, 0], rollback[0].output[-3000:]
    r2 = (run_dir / "tracking" / "run_id").read_text().strip()
    assert r2 != r1 and f"MLflow run {r1} went past step 4" in rollback[0].output
    _assert_logs(_histories(run_dir, r1), per_step, [(1, 3), (4, 6)])
    _assert_logs(_histories(run_dir, r2), per_step, [(1, 3), (4, 5), (6, 8)])


def test_a_diverged_job_logs_the_steps_since_the_last_logged_one(corpus, tmp_path):
    """Steps 3, 4, 5 are non-finite (train.max_nonfinite 3): the job fails at step 5, off the interval of 4,
    and still logs its window (step 5) at that step: the values that made it fail."""
    run_dir = tmp_path / "run"
    procs = _train(_config(corpus, run_dir, 4), "nan-from-step:0:3")
    assert _codes(procs) == [1, 1], procs[0].output[-3000:]
    histories = _histories(run_dir)
    assert histories["train/nonfinite_steps"] == [(4, 2.0), (5, 3.0)]
    assert [s for s, _ in histories["train/loss"]] == [4, 5] and math.isnan(histories["train/loss"][1][1])


# ----------------------------------------------------------------------------------------------------
# The window alone


def test_an_interval_of_1_logs_every_value_as_it_came():
    window = MetricsWindow(1, 10)
    # 847433.8895034958: 1 / (1 / x) != x, so a rate summarized over one step must not go through its reciprocal.
    for step, x in enumerate([1 / 3, 7e-5, 0.1 + 0.2, 847433.8895034958, 2.0 ** -30], start=1):
        metrics = {"train/loss": x, "train/tokens_per_s": x, "train/memory_peak_mib": x, "train/lr": x,
                   "train/grad_norm": None}
        assert window.add(step, metrics) == {k: v for k, v in metrics.items() if v is not None}


def test_the_window_summarizes_each_kind_of_metric_and_survives_a_save():
    window = MetricsWindow(4, 6)
    steps = [{"train/loss": 2.0, "train/tokens_per_s": 100.0, "train/memory_peak_mib": 9.0, "train/lr": 0.1,
              "train/grad_norm": None},
             {"train/loss": 4.0, "train/tokens_per_s": 50.0, "train/memory_peak_mib": 7.0, "train/lr": 0.2,
              "train/grad_norm": 1.0, "train/profiled": 1.0}]
    assert window.add(1, steps[0]) is None
    saved = json.loads(json.dumps(window.state_dict()))  # plain numbers only
    resumed = MetricsWindow(2, 6)  # another interval: the window goes on, logged at the next multiple of 2
    resumed.load_state_dict(saved)
    assert resumed.add(2, steps[1]) == {"train/loss": 3.0, "train/tokens_per_s": 2 / (1 / 100 + 1 / 50),
                                        "train/memory_peak_mib": 9.0, "train/lr": 0.2, "train/grad_norm": 1.0,
                                        "train/profiled": 1.0}
    assert resumed.add(3, {"train/loss": 1.0}) is None
    assert resumed.add(6, {"train/loss": 5.0}) == {"train/loss": 3.0}  # train.max_steps ends a window too
    empty = MetricsWindow(4, 6)
    empty.load_state_dict(None)  # a checkpoint from before windows were saved
    assert empty.take() is None
