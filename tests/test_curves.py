"""Seeing a run: <run.dir>/curves.png drawn from the metrics journal after each evaluation and at the end
(the data it is drawn from checked against what the MLflow store holds, across a resume), logged to MLflow,
and the end-of-run line with the `mlflow ui` command."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pandas as pd
import pytest

from dist_helpers import learnable_stream, run_ranks, tiny_config, write_corpus
from txl_dist import curves
from txl_dist.curves import CURVES_FILE, LossHistory, draw, ema_debiased, smoothing_span
from txl_dist.tracking.mlflow_run import ui_hint
from txl_dist.tracking.secrets import shown_uri

VOCAB = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("span", [1, 3, 10, 40])
def test_smoothing_is_pandas_debiased_ewm(span):
    values = np.random.default_rng(span).normal(3.0, 0.5, size=200).tolist()
    reference = pd.Series(values).ewm(span=span, adjust=True).mean().tolist()
    assert np.allclose(ema_debiased(values, span), reference, rtol=1e-12, atol=1e-12)
    assert smoothing_span(10) == 1 and smoothing_span(1000) == 40 and smoothing_span(10**7) == 1000


def _line(seq, step, metrics):
    return json.dumps({"seq": seq, "step": step, "time": 0, "metrics": metrics}) + "\n"


@pytest.mark.parametrize("block", [128, None])  # blocks shorter than the journal, and the default
def test_history_reads_the_journal_as_it_grows_and_skips_what_it_cannot_draw(tmp_path, monkeypatch, block):
    if block:
        monkeypatch.setattr(curves, "READ_BLOCK_BYTES", block)
    journal = tmp_path / "metrics.jsonl"
    journal.write_text(_line(1, 1, {"train/loss": 4.0, "train/tokens_seen": 32.0})
                       + _line(2, 2, {"train/loss": float("nan"), "train/tokens_seen": 64.0})  # a skipped step
                       + '{"seq": 3, "step": 3, "metr')  # the writer is in the middle of a line
    history = LossHistory(journal)
    history.update()
    assert history.points().train_loss == [4.0]
    with open(journal, "a") as f:  # the line completed, then more steps and an evaluation
        f.write('ics": {"train/loss": 3.0, "train/tokens_seen": 96.0}}\n'
                + _line(4, 3, {"valid/loss": 3.5, "valid/perplexity": math.exp(3.5)})
                + _line(5, 4, {"train/loss": 2.0, "train/tokens_seen": 128.0}))
    history.update()
    points = history.points()
    assert (points.train_tokens, points.train_loss) == ([32.0, 96.0, 128.0], [4.0, 3.0, 2.0])
    assert (points.valid_tokens, points.valid_loss) == ([96.0], [3.5])
    assert points.test_loss == []
    out = draw(points, tmp_path / "c.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_a_line_longer_than_a_read_block_is_skipped_and_the_lines_after_it_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(curves, "READ_BLOCK_BYTES", 128)
    journal = tmp_path / "metrics.jsonl"
    journal.write_text(_line(1, 1, {"train/loss": 4.0, "train/tokens_seen": 32.0})
                       + "x" * 300 + "\n"
                       + _line(2, 2, {"train/loss": 3.0, "train/tokens_seen": 64.0}))
    history = LossHistory(journal)
    history.update()
    assert history.points().train_loss == [4.0, 3.0]


def test_evaluations_between_the_logged_training_steps_are_drawn(tmp_path):
    # tracking.metrics_interval 100 logs train/tokens_seen at steps 100, 200, ...; eval.interval 50 validates
    # at 50, 150, ... too: those evaluations were left out of the picture for want of a token count.
    journal = tmp_path / "metrics.jsonl"
    lines, seq = [], 0
    for step in range(50, 401, 50):
        if step % 100 == 0:
            seq += 1
            lines.append(_line(seq, step, {"train/loss": 3.0, "train/tokens_seen": 32.0 * step}))
        seq += 1
        lines.append(_line(seq, step, {"valid/loss": 2.0 + step / 1000}))
    seq += 1
    lines.append(_line(seq, 400, {"test/loss": 2.1}))
    journal.write_text("".join(lines))
    history = LossHistory(journal)
    history.update()
    points = history.points()
    assert points.valid_tokens == [32.0 * step for step in range(50, 401, 50)]
    assert points.valid_loss == [2.0 + step / 1000 for step in range(50, 401, 50)]
    assert (points.test_tokens, points.test_loss) == ([32.0 * 400], [2.1])


@pytest.mark.parametrize("steps", [1, 2, 60])
def test_every_series_of_the_picture_shows_however_few_steps_were_logged(steps):
    # A line through one point draws nothing: the picture of a one-step run was empty axes and a legend.
    from txl_dist.curves import CurvePoints

    tokens = [32.0 * s for s in range(1, steps + 1)]
    loss = [4.0 - 0.01 * s for s in range(steps)]
    points = CurvePoints(tokens, loss, ema_debiased(loss, smoothing_span(steps)), [], [], tokens[-1:], [3.9])
    lines = curves.figure(points).axes[0].get_lines()
    for line in lines:
        as_line = len(line.get_xdata()) >= 2 and line.get_linestyle() not in ("None", "none", "")
        assert as_line or line.get_marker() not in ("None", "none", "", None), line.get_label()
    # Under 50 steps the smoothing span is 1: the one train line is not drawn twice under two names.
    assert [line.get_label() for line in lines] == (
        ["train", "test"] if steps < 50 else ["train (raw)", "train (EMA, span 2 logged steps)", "test"])


def test_a_failure_to_draw_is_warned_once_and_never_raised(tmp_path, caplog):
    from txl_dist.curves import RunCurves
    from txl_dist.tracking import Tracker

    class Uploads(Tracker):
        def __init__(self):
            self.uploaded = []

        def log_artifact(self, path, artifact_path=None):
            self.uploaded.append(path)

    (tmp_path / "tracking").mkdir()
    (tmp_path / "tracking" / "metrics.jsonl").write_text(_line(1, 1, {"train/loss": 4.0, "train/tokens_seen": 8.0}))
    (tmp_path / CURVES_FILE).mkdir()  # the picture's path is taken: every drawing fails
    curves, tracker = RunCurves(tmp_path), Uploads()
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert curves.draw(tracker) is None and curves.draw(tracker) is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"curves: cannot draw {tmp_path / CURVES_FILE}"]
    assert tracker.uploaded == []
    (tmp_path / CURVES_FILE).rmdir()  # the path is free again: the next drawing works and is uploaded
    assert curves.draw(tracker) == tmp_path / CURVES_FILE and tracker.uploaded == [tmp_path / CURVES_FILE]


def test_ui_hint_for_a_local_store_and_for_a_server():
    assert ui_hint(shown_uri("sqlite:////runs/a b/mlflow.db"), "1", "abc") == (
        "mlflow ui --backend-store-uri 'sqlite:////runs/a b/mlflow.db', then open "
        "http://127.0.0.1:5000/#/experiments/1/runs/abc")
    hint = ui_hint(shown_uri("https://me:hunter22@mlflow.example.com/"), "7", "abc")
    assert hint == "open https://me:***@mlflow.example.com/#/experiments/7/runs/abc"


# ----------------------------------------------------------------------------------------------------
# A real run on 2 ranks, resumed once, with the default MLflow store (sqlite in the run folder)


def _train_runs(raws: list[dict]) -> list[int]:
    from txl_dist import distributed, trainer
    from txl_dist.config import config_from_dict
    from txl_dist.run_dir import detach_log_file

    env = distributed.discover()
    log = distributed.setup_logging(env)
    codes = []
    try:
        for raw in raws:
            codes.append(trainer.run(config_from_dict(raw), env))
            detach_log_file(log)
    finally:
        distributed.destroy_process_group()
    return codes


def test_a_resumed_run_draws_its_whole_history_and_logs_it_to_mlflow(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 49, VOCAB, 0),
                                                "valid": learnable_stream(80, VOCAB, 1),
                                                "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)
    run = tmp_path / "run"
    common = dict(eval={"interval": 2}, tracking={"enabled": True, "uri": None, "system_metrics": False})
    first = tiny_config(corpus, run, train={"max_steps": 6, "exit_step": 3}, **common)
    second = tiny_config(corpus, run, train={"max_steps": 6}, **common)
    assert run_ranks(_train_runs, 2, [first, second], timeout=600) == [[0, 0], [0, 0]]

    png = run / CURVES_FILE
    assert png.read_bytes().startswith(PNG_MAGIC)
    history = LossHistory(run / "tracking" / "metrics.jsonl")
    history.update()
    points = history.points()

    # What the picture is drawn from is what the store holds, read back through MLflow's own client.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")
    run_id = (run / "tracking" / "run_id").read_text().strip()

    def history_of(key):
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    loss, tokens = history_of("train/loss"), history_of("train/tokens_seen")
    assert sorted(loss) == list(range(1, 7))  # both jobs, each step once
    assert points.train_loss == [loss[s] for s in range(1, 7)]
    assert points.train_tokens == [tokens[s] for s in range(1, 7)] == [32.0 * s for s in range(1, 7)]
    valid = history_of("valid/loss")
    assert sorted(valid) == [2, 4, 6]  # eval.interval 2, across the resume
    assert points.valid_loss == [valid[s] for s in (2, 4, 6)]
    assert points.valid_tokens == [32.0 * s for s in (2, 4, 6)]
    assert points.test_loss == list(history_of("test/loss").values()) and points.test_tokens == [192.0]
    assert points.train_smoothed == ema_debiased(points.train_loss, smoothing_span(6))

    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert CURVES_FILE in artifacts
    log = (run / "logs" / "train.log").read_text()
    assert f"curves {png.resolve()}" in log
    assert (f"MLflow UI: mlflow ui --backend-store-uri sqlite:///{run.resolve() / 'mlflow.db'}, then open "
            f"http://127.0.0.1:5000/#/experiments/") in log
    assert f"/runs/{run_id}" in log
