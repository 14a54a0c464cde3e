"""eval.n_streams null across elastic resumes: a run keeps the evaluation streams it resolved at its first start
(one per rank then), recorded in each checkpoint's run.json, so that its valid and test numbers keep one
definition and launch/eval.py reproduces them; a world size that cannot split them warns once and switches.
The rule: RunConfig.eval_streams with checkpoint.recorded_eval_streams (2 real gloo ranks for the runs)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dist_helpers import learnable_stream, run_ranks, tiny_config, train_job, write_corpus
from txl_dist.checkpoint import read_run_info, recorded_eval_streams
from txl_dist.config import ConfigError, config_from_dict

VOCAB = 64
# 80 tokens of valid and test; max_segments 3 of tgt_len 8: 24 tokens predicted per stream.
TOKENS_OF = {1: 24, 2: 48}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_streams") / "corpus"
    return write_corpus(root, {"train": learnable_stream(4 * 49, VOCAB, 0), "valid": learnable_stream(80, VOCAB, 1),
                               "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)


def _config(corpus, run_dir, **train) -> dict:
    """4 steps (ZeRO 0: any world size loads it directly), a validation after every step, eval.n_streams null."""
    return tiny_config(corpus, run_dir, train={"max_steps": 4, **train}, model={"dropout": 0.0},
                       eval={"interval": 1, "n_streams": None}, checkpoint={"keep": 0})


def _jobs_and_printed_lines(jobs: list[tuple[dict, str]]) -> dict:
    """Training jobs in a row on this rank (dist_helpers.train_job), and the lines this rank's log printed."""
    from txl_dist import distributed

    env = distributed.discover()
    logger = distributed.setup_logging(env)
    lines: list[str] = []
    for handler in logger.handlers:  # the handler setup_logging made: emit runs past its rank-0-only filter
        def printed(record, emit=handler.emit):
            lines.append(record.getMessage())
            emit(record)
        handler.emit = printed
    distributed.init_process_group(env)
    try:
        return {"results": [train_job(raw, resume) for raw, resume in jobs], "lines": lines}
    finally:
        distributed.destroy_process_group()


def _eval_main(argv):
    from launch.eval import main

    return main(argv)


def _switch_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "cannot split" in line]


def test_a_resume_on_fewer_ranks_evaluates_the_streams_its_run_evaluated(corpus, tmp_path):
    # 2 ranks, eval.n_streams null: 2 streams. Resumed on 1 rank, the run goes on evaluating 2 streams (not 1),
    # and its numbers are those of a 2-rank evaluation of the same weights. A checkpoint saved before the count
    # was recorded (no "eval_streams" in its run.json) counts as its world size's.
    run, old = tmp_path / "run", tmp_path / "old"
    first = run_ranks(_jobs_and_printed_lines, 2, [(_config(corpus, run, exit_step=2), "none")])[0]
    assert first["results"][0]["code"] == 0
    assert read_run_info(run / "checkpoints" / "step_00000002")["eval_streams"] == 2
    shutil.copytree(run, old)
    record = old / "checkpoints" / "step_00000002" / "txl_state" / "run.json"
    info = json.loads(record.read_text())
    del info["eval_streams"]
    record.write_text(json.dumps(info))

    (out,) = run_ranks(_jobs_and_printed_lines, 1, [(_config(corpus, run), "auto"), (_config(corpus, old), "auto")])
    assert not _switch_lines(out["lines"]), out["lines"]
    for folder, job in zip((run, old), out["results"]):
        assert job["code"] == 0, folder
        assert sorted(job["losses"]) == [3, 4], folder  # resumed, on 1 rank
        metrics = job["metrics"]
        assert [metrics[s]["valid/tokens"] for s in (3, 4)] == [TOKENS_OF[2]] * 2, folder
        assert metrics[4]["test/tokens"] == TOKENS_OF[2], folder
        assert read_run_info(folder / "checkpoints" / "step_00000004")["eval_streams"] == 2, folder

    # The same weights evaluated by 2 ranks, 2 streams named explicitly: the numbers the resumed run logged.
    resumed = out["results"][0]["metrics"][4]
    tag = run / "checkpoints" / "step_00000004"
    for split in ("valid", "test"):
        result = tmp_path / f"{split}.json"
        assert run_ranks(_eval_main, 2, ["--checkpoint", str(tag), "--split", split, "--output", str(result),
                                         "--set", "eval.n_streams=2"]) == [0, 0]
        two = json.loads(result.read_text())
        assert (two["world_size"], two["eval_streams"], two["tokens"]) == (2, 2, resumed[f"{split}/tokens"])
        np.testing.assert_allclose(resumed[f"{split}/loss"], two["loss"], rtol=1e-6, err_msg=split)
    # launch/eval.py with the run's own eval.n_streams null: the 2 streams it recorded, not the 1 rank that saved it.
    result = tmp_path / "own.json"
    assert run_ranks(_eval_main, 1, ["--checkpoint", str(tag), "--split", "test", "--output", str(result)]) == [0]
    own = json.loads(result.read_text())
    assert (own["world_size"], own["eval_streams"], own["tokens"]) == (1, 2, resumed["test/tokens"])
    np.testing.assert_allclose(resumed["test/loss"], own["loss"], rtol=1e-6)


def test_a_resume_on_ranks_that_cannot_split_the_streams_warns_once_and_switches(corpus, tmp_path):
    # 1 rank evaluated 1 stream; 2 ranks cannot split it. The resume is not refused (a requeue on more nodes
    # goes on): one line says so, and the run evaluates 2 streams from then on, recorded as such.
    run = tmp_path / "run"
    (first,) = run_ranks(_jobs_and_printed_lines, 1, [(_config(corpus, run, exit_step=2), "none")])
    assert first["results"][0]["code"] == 0
    assert read_run_info(run / "checkpoints" / "step_00000002")["eval_streams"] == 1
    assert first["results"][0]["metrics"][2]["valid/tokens"] == TOKENS_OF[1]

    rank0, rank1 = run_ranks(_jobs_and_printed_lines, 2, [(_config(corpus, run), "auto")])
    assert _switch_lines(rank0["lines"]) == [
        "eval.n_streams is null: this run evaluated 1 stream(s) up to step 2, which these 2 ranks cannot split; it "
        "evaluates 2 from now on, so its valid and test numbers are not comparable across step 2; set "
        "eval.n_streams to choose the count"]
    assert _switch_lines(rank1["lines"]) == []  # printed once, by rank 0
    job = rank0["results"][0]
    assert job["code"] == 0 and sorted(job["losses"]) == [3, 4]
    assert [job["metrics"][s]["valid/tokens"] for s in (3, 4)] == [TOKENS_OF[2]] * 2
    assert read_run_info(run / "checkpoints" / "step_00000004")["eval_streams"] == 2


# ----------------------------------------------------------------------------------------------------
# The rule itself


def _cfg(n_streams):
    return config_from_dict(tiny_config("corpus", "run", eval={"n_streams": n_streams}))


def test_the_rule_explicit_then_recorded_then_one_per_rank():
    assert _cfg(None).eval_streams(4) == 4  # a new run: one stream per rank
    assert _cfg(None).eval_streams(1, recorded=2) == 2  # a resume keeps the run's count
    assert _cfg(None).eval_streams(2, recorded=4) == 4
    assert _cfg(6).eval_streams(2, recorded=4) == 6  # an explicit count wins
    assert _cfg(None).eval_streams(4, recorded=2, resize=True) == 4  # training: switch (the caller warns)
    with pytest.raises(ConfigError, match=r"^eval.n_streams is null: the evaluation uses the 2 stream\(s\) the "
                                          r"checkpoint's run evaluated, which 4 ranks cannot split; "):
        _cfg(None).eval_streams(4, recorded=2)  # launch/eval.py refuses
    with pytest.raises(ConfigError, match=r"^eval.n_streams: 3 streams cannot be split over 2 ranks"):
        _cfg(3).eval_streams(2, recorded=2, resize=True)  # an explicit count is never replaced


def test_the_recorded_count_of_a_checkpoint_and_of_one_saved_before_it_was_recorded():
    def info(**fields):
        return {"tag": "step_00000002", "world_size": 2, "config": {"eval": {"n_streams": None}}, **fields}

    assert recorded_eval_streams(info(eval_streams=4)) == 4
    assert recorded_eval_streams(info()) == 2  # older: null meant one stream per rank of its world size
    assert recorded_eval_streams(info(config={"eval": {"n_streams": 6}})) == 6  # older, a count named

