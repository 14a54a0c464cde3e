"""eval.n_streams null across elastic resumes: a run keeps the evaluation streams it resolved at its first start
(one per rank then), recorded in each checkpoint's run.json, so that its valid and test numbers keep one
definition and launch/eval.py reproduces them; a world size that cannot split them warns once and switches.
The rule: RunConfig.eval_streams with checkpoint.recorded_eval_streams (2 real gloo ranks for the runs)."""
from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import pytest

from dist_helpers import Recorder, learnable_stream, run_ranks, tiny_config, train_job, write_corpus
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

    env, lines = _logging_captured()
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
        "eval.n_streams is null: this run has evaluated 1 stream(s) so far (its checkpoint of step 2 records them), "
        "which these 2 ranks cannot split; it evaluates 2 from now on, so its valid and test numbers from here on "
        "are not comparable with the earlier ones; set eval.n_streams to choose the count"]
    assert _switch_lines(rank1["lines"]) == []  # printed once, by rank 0
    job = rank0["results"][0]
    assert job["code"] == 0 and sorted(job["losses"]) == [3, 4]
    assert [job["metrics"][s]["valid/tokens"] for s in (3, 4)] == [TOKENS_OF[2]] * 2
    assert read_run_info(run / "checkpoints" / "step_00000004")["eval_streams"] == 2


def _named(corpus, run_dir, n_streams, **train) -> dict:
    raw = _config(corpus, run_dir, **train)
    raw["eval"]["n_streams"] = n_streams
    return raw


def test_naming_the_recorded_count_on_a_resume_is_no_changed_setting(corpus, tmp_path):
    # A null run on 2 ranks records 2 streams; its resume on 1 rank naming eval.n_streams=2 evaluates the same
    # streams: no "resuming ... with changed settings: eval.n_streams" (there was). Nor the reverse: a run that
    # named 2, resumed with null on 1 rank (the record keeps 2). Naming another count is still a change.
    null, named, other = tmp_path / "null", tmp_path / "named", tmp_path / "other"
    first = run_ranks(_jobs_and_printed_lines, 2, [(_config(corpus, null, exit_step=2), "none"),
                                                   (_named(corpus, named, 2, exit_step=2), "none")])[0]
    assert [job["code"] for job in first["results"]] == [0, 0]
    shutil.copytree(null, other)

    (out,) = run_ranks(_jobs_and_printed_lines, 1, [(_named(corpus, null, 2), "auto"), (_config(corpus, named), "auto"),
                                                    (_named(corpus, other, 1), "auto")])
    assert [job["code"] for job in out["results"]] == [0, 0, 0]
    assert [job["metrics"][4]["valid/tokens"] for job in out["results"]] == [TOKENS_OF[2], TOKENS_OF[2], TOKENS_OF[1]]
    changed = [line for line in out["lines"] if "with changed settings" in line]
    assert changed == [f"resuming {other / 'checkpoints' / 'step_00000002'} with changed settings: eval.n_streams"]


class _FinalEvalRecorder(Recorder):
    def __init__(self):
        super().__init__()
        self.dicts: dict[str, dict] = {}

    def log_dict(self, dictionary, artifact_file):
        self.dicts[artifact_file] = dict(dictionary)


def _job_stopped_in_its_last_step_or_resumed(raw: dict, resume: str) -> dict:
    """One training job on this rank; with resume "none", a SIGUSR1 of its own before its last step (the stop
    saves that step and owes its evaluations). Its final_eval.json and the lines its log printed."""
    from txl_dist import distributed, trainer

    env, lines = _logging_captured()
    distributed.init_process_group(env)
    try:
        t = trainer.build(config_from_dict(raw), env, resume=resume)
        t.tracker.close()
        t.tracker = _FinalEvalRecorder()
        if resume == "none":
            step = t.train_step

            def stopping():
                if t.step == raw["train"]["max_steps"] - 1:
                    os.kill(os.getpid(), signal.SIGUSR1)
                return step()
            t.train_step = stopping
        try:
            code = t.train()
        finally:
            t.close()
        return {"code": code, "final": t.tracker.dicts.get("final_eval.json"), "lines": lines}
    finally:
        distributed.destroy_process_group()


def test_a_switched_job_that_only_ran_the_owed_final_evaluation_says_how_to_reproduce_it(corpus, tmp_path):
    # 1 rank, 1 stream, stopped in its last step: step 4 owes valid and test. Resumed on 2 ranks (they cannot
    # split 1 stream: switched to 2), the job runs them and saves nothing: final_eval.json names step_4, whose
    # run.json records 1 stream (immutable), so launch/eval.py with null would evaluate 1 (or refuse on 2
    # ranks). The job says so in one line with the count to pass, and that count reproduces it.
    run = tmp_path / "run"
    raw = _config(corpus, run)
    raw["eval"]["at_end"] = True
    (stopped,) = run_ranks(_job_stopped_in_its_last_step_or_resumed, 1, raw, "none")
    assert stopped["code"] == 0 and stopped["final"] is None
    tag = run / "checkpoints" / "step_00000004"
    assert read_run_info(tag)["evals_owed"] and read_run_info(tag)["eval_streams"] == 1

    rank0, rank1 = run_ranks(_job_stopped_in_its_last_step_or_resumed, 2, raw, "auto")
    assert rank0["code"] == 0 and len(_switch_lines(rank0["lines"])) == 1
    final = rank0["final"]
    assert (final["checkpoint"], final["eval_streams"], final["tokens"]) == (str(tag), 2, TOKENS_OF[2])
    assert max((run / "checkpoints").glob("step_*")) == tag  # nothing saved after step 4
    told = [line for line in rank0["lines"] if line.startswith("final_eval.json:")]
    assert told == [f"final_eval.json: step 4 was evaluated over 2 streams, its checkpoint step_00000004 records 1 "
                    f"(what launch/eval.py evaluates by default); reproduce it with launch/eval.py --checkpoint {tag} "
                    f"--set eval.n_streams=2"]
    assert not [line for line in rank1["lines"] if line.startswith("final_eval.json:")]

    result = tmp_path / "test.json"
    assert run_ranks(_eval_main, 2, ["--checkpoint", str(tag), "--split", "test", "--output", str(result),
                                     "--set", "eval.n_streams=2"]) == [0, 0]
    again = json.loads(result.read_text())
    assert (again["eval_streams"], again["tokens"]) == (2, final["tokens"])
    np.testing.assert_allclose(final["loss"], again["loss"], rtol=1e-6)
    # Without the count named: the tag's record, 1 stream, other numbers than final_eval.json's.
    assert run_ranks(_eval_main, 1, ["--checkpoint", str(tag), "--split", "test", "--output", str(result)]) == [0]
    default = json.loads(result.read_text())
    assert (default["eval_streams"], default["tokens"]) == (1, TOKENS_OF[1])


# ----------------------------------------------------------------------------------------------------
# The rule itself


def _cfg(n_streams):
    return config_from_dict(tiny_config("corpus", "run", eval={"n_streams": n_streams}))


def test_the_rule_explicit_then_recorded_then_one_per_rank():
    assert _cfg(None).eval_streams(4) == 4  # a new run: one stream per rank
    assert _cfg(None).eval_streams(1, recorded=2) == 2  # a resume keeps the run's count
    assert _cfg(None).eval_streams(2, recorded=4) == 4
    assert _cfg(6).eval_streams(2, recorded=4) == 6  # an explicit count wins
    assert (_cfg(None).kept_eval_streams(2), _cfg(2).kept_eval_streams(2), _cfg(6).kept_eval_streams(2)) == (2, 2, 6)
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


def _logging_captured():
    """This rank's environment, its logging set up, and the list every line it prints is added to (captured in
    the handler setup_logging made: emit runs past its rank-0-only filter)."""
    from txl_dist import distributed

    env = distributed.discover()
    lines: list[str] = []
    for handler in distributed.setup_logging(env).handlers:
        def printed(record, emit=handler.emit):
            lines.append(record.getMessage())
            emit(record)
        handler.emit = printed
    return env, lines
