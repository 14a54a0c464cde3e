"""Distributed evaluation: 1 and 2 ranks give the same numbers, which equal a plain one-process computation
with the exported fp32 weights; every token of each eval stream but its first is predicted once."""
from __future__ import annotations

import json
import logging
import math
import re

import numpy as np
import pytest
import torch

from dist_helpers import REPO, learnable_stream, run_ranks, tiny_config, train_jobs, write_corpus
from txl_dist.config import EvalConfig

VOCAB = 64
VALID_TOKENS = 2 * 40  # 2 eval streams of 40 tokens: 4 full windows of 8 and a last one of 7


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank ZeRO-1 fp32 checkpoint after 3 steps (so eval on 1 rank needs the universal conversion)."""
    root = tmp_path_factory.mktemp("evaluate")
    corpus = write_corpus(root / "corpus", {"train": learnable_stream(4 * 49, VOCAB, 0),
                                            "valid": learnable_stream(VALID_TOKENS, VOCAB, 1),
                                            "test": learnable_stream(VALID_TOKENS, VOCAB, 2)}, vocab_size=VOCAB)
    raw = tiny_config(corpus, root / "ckpt", train={"max_steps": 5, "exit_step": 3},
                      deepspeed={"zero_optimization": {"stage": 1}})
    run_ranks(train_jobs, 2, [(raw, "none")])
    return corpus, root / "ckpt" / "checkpoints"


def _eval_main(argv):
    from launch.eval import main

    return main(argv)


def _reference(model, tokens: np.ndarray, n_streams: int, cfg: EvalConfig) -> tuple[float, int]:
    """Sum of NLL and count, stream by stream, window by window (incl. the partial last one), in one process."""
    L = len(tokens) // n_streams
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in range(n_streams):
            stream = torch.from_numpy(tokens[s * L:(s + 1) * L]).view(1, -1)  # [1, L]
            mems = None
            starts = list(range(0, L - 1, cfg.tgt_len))
            if cfg.max_segments is not None:
                starts = starts[:cfg.max_segments]
            for a in starts:
                b = min(a + cfg.tgt_len, L - 1)
                out = model(stream[:, a:b], labels=stream[:, a + 1:b + 1], mems=mems, memory=cfg.memory())
                mems = out.mems
                nll += out.nll.double().sum().item()
                count += out.nll.numel()
    return nll, count


def test_one_and_two_ranks_agree_with_a_plain_computation(trained, tmp_path):
    from launch.export import export

    corpus, ckpt = trained
    sets = ["--set", "eval.max_segments=null", "--set", "eval.mem_len=12"]
    out1, out2 = tmp_path / "w1.json", tmp_path / "w2.json"
    assert run_ranks(_eval_main, 1, ["--checkpoint", str(ckpt), "--split", "valid", "--output", str(out1), *sets]) == [0]
    assert run_ranks(_eval_main, 2, ["--checkpoint", str(ckpt), "--split", "valid", "--output", str(out2), *sets]) == [0, 0]
    one, two = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert (one["world_size"], two["world_size"], one["eval_streams"], two["eval_streams"]) == (1, 2, 2, 2)
    assert one["tokens"] == two["tokens"]
    for key in ("loss", "perplexity", "bits_per_byte", "bits_per_char"):
        np.testing.assert_allclose(one[key], two[key], rtol=1e-6, err_msg=key)
    assert (ckpt / "step_00000003_universal").is_dir()  # 1 rank read the 2-rank ZeRO-1 checkpoint

    # Independently: the exported fp32 weights, one stream at a time, no DeepSpeed, no all-reduce.
    model = export(str(ckpt), str(tmp_path / "native"))
    cfg = EvalConfig(tgt_len=8, mem_len=12, clamp_len=-1, same_length=True, n_streams=2, max_segments=None)
    nll, count = _reference(model, _valid_tokens(corpus), 2, cfg)
    assert one["tokens"] == count == 2 * (VALID_TOKENS // 2 - 1)  # every token but each stream's first
    _assert_numbers(one, nll, count)


def test_any_world_size_dividing_the_eval_streams_evaluates(trained, tmp_path):
    # 3 ranks cannot hold the 4 training streams of the checkpoint, but they can evaluate 3 streams (this was
    # refused: the training batch's rule was applied to an evaluation).
    corpus, ckpt = trained
    sets = ["--set", "eval.max_segments=null", "--set", "eval.n_streams=3"]
    out1, out3 = tmp_path / "w1.json", tmp_path / "w3.json"
    assert run_ranks(_eval_main, 1, ["--checkpoint", str(ckpt), "--split", "valid", "--output", str(out1), *sets]) == [0]
    assert run_ranks(_eval_main, 3, ["--checkpoint", str(ckpt), "--split", "valid", "--output", str(out3),
                                     *sets]) == [0, 0, 0]
    one, three = json.loads(out1.read_text()), json.loads(out3.read_text())
    assert (three["world_size"], three["eval_streams"]) == (3, 3)
    assert one["tokens"] == three["tokens"] == 3 * (VALID_TOKENS // 3 - 1)
    np.testing.assert_allclose(one["loss"], three["loss"], rtol=1e-6)


def test_null_eval_streams_are_the_checkpoints_world_size_on_any_world_size(trained, tmp_path):
    # eval.n_streams null (the GPU presets) means one stream per rank. The 2-rank checkpoint's run evaluated 2
    # streams: 1 rank evaluated 1 stream, another number than 2 ranks (and than the run's own test result).
    _, ckpt = trained
    out1, out2 = tmp_path / "w1.json", tmp_path / "w2.json"

    def argv(out):
        return ["--checkpoint", str(ckpt), "--split", "valid", "--output", str(out),
                "--set", "eval.max_segments=null", "--set", "eval.n_streams=null"]

    assert run_ranks(_eval_main, 1, argv(out1)) == [0]
    assert run_ranks(_eval_main, 2, argv(out2)) == [0, 0]
    one, two = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert (one["world_size"], two["world_size"], one["eval_streams"], two["eval_streams"]) == (1, 2, 2, 2)
    assert one["tokens"] == two["tokens"] == 2 * (VALID_TOKENS // 2 - 1)
    np.testing.assert_allclose(one["loss"], two["loss"], rtol=1e-6)


def _eval_main_of_this_rank(argvs):
    import os

    return _eval_main(argvs[int(os.environ["RANK"])])


def test_ranks_that_resolved_different_tags_evaluate_rank_zeros(trained, tmp_path):
    # --checkpoint RUN names the run's newest tag, read by each rank before the process group exists: a save
    # landing between two ranks' reads gives them different tags. Played here by naming step 2 on rank 0 and
    # step 4 on rank 1: both must evaluate step 2 (rank 0's), with the numbers of a run where both named it.
    corpus, _ = trained
    raw = tiny_config(corpus, tmp_path / "run", train={"max_steps": 4}, checkpoint={"interval": 2, "keep": 2},
                      deepspeed={"zero_optimization": {"stage": 1}})
    run_ranks(train_jobs, 2, [(raw, "none")])
    ckpt = tmp_path / "run" / "checkpoints"

    def argv(tag: str, out: str) -> list[str]:
        return ["--checkpoint", str(ckpt / tag), "--split", "valid", "--output", str(tmp_path / out)]

    results = {}
    for name, tags in (("mixed", ("step_00000002", "step_00000004")), ("step2", ("step_00000002",) * 2),
                       ("step4", ("step_00000004",) * 2)):
        assert run_ranks(_eval_main_of_this_rank, 2, [argv(tag, f"{name}.json") for tag in tags]) == [0, 0]
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    mixed, step2, step4 = results["mixed"], results["step2"], results["step4"]
    assert step4["loss"] != step2["loss"]  # the two tags are told apart by their numbers
    assert (mixed["step"], mixed["checkpoint"]) == (2, str(ckpt / "step_00000002"))
    for key in ("loss", "tokens", "perplexity"):
        assert mixed[key] == step2[key], key


PRUNE = """
import sys
from txl_dist import checkpoint
print(checkpoint.prune(sys.argv[1], keep=1))
"""


def _save_and_prune(ckpt) -> None:
    """What a training run still running in the folder does: a save (the newest tag copied to the next step)
    and its retention (checkpoint.keep=1), in a process of its own."""
    import shutil
    import subprocess
    import sys

    from txl_dist import checkpoint

    newest = checkpoint.inventory(ckpt).complete[-1]
    shutil.copytree(ckpt / newest, ckpt / checkpoint.tag_for(checkpoint.step_of(newest) + 1))
    subprocess.run([sys.executable, "-c", PRUNE, str(ckpt)], check=True)


def _eval_with_a_save_and_prune(argv, ckpt, moment):
    """launch/eval.py on this rank; rank 0 has a training run save and prune at `moment`: "choice" (the tag is
    chosen, the process group not made yet: where the QA sweep's evaluations failed) or "load" (DeepSpeed's
    load of the weights)."""
    import os

    from txl_dist import checkpoint, distributed

    target, name = {"choice": (distributed, "init_process_group"), "load": (checkpoint, "load_engine")}[moment]
    original = getattr(target, name)

    def meanwhile(*args, **kwargs):
        if os.environ["RANK"] == "0":
            _save_and_prune(ckpt)
        return original(*args, **kwargs)

    setattr(target, name, meanwhile)
    return _eval_main(argv)


@pytest.mark.parametrize("moment", ["choice", "load"])
def test_a_run_that_saves_and_prunes_while_it_is_evaluated_keeps_the_tag_until_the_next_save(trained, tmp_path,
                                                                                             moment):
    import shutil

    from txl_dist import checkpoint

    _, trained_ckpt = trained
    ckpt = tmp_path / "run" / "checkpoints"
    shutil.copytree(trained_ckpt / "step_00000003", ckpt / "step_00000003")
    out = tmp_path / "result.json"
    argv = ["--checkpoint", str(tmp_path / "run"), "--split", "valid", "--json-out", str(out)]
    assert run_ranks(_eval_with_a_save_and_prune, 2, argv, ckpt, moment) == [0, 0]
    result = json.loads(out.read_text())
    assert (result["checkpoint"], result["step"]) == (str(ckpt / "step_00000003"), 3)
    assert checkpoint.inventory(ckpt).complete == ["step_00000003", "step_00000004"]  # kept while it was read
    assert checkpoint.prune(ckpt, keep=1) == ["step_00000003"]  # and removed by the next save's retention


def test_an_unknown_split_is_refused_before_the_engine_is_built_or_a_universal_copy_written(trained, tmp_path):
    import shutil

    _, trained_ckpt = trained
    ckpt = tmp_path / "run" / "checkpoints"
    shutil.copytree(trained_ckpt / "step_00000003", ckpt / "step_00000003")
    # 1 rank reads the 2-rank ZeRO-1 checkpoint through a universal copy, which a late refusal had written.
    assert run_ranks(_eval_main, 1, ["--checkpoint", str(ckpt), "--split", "tset"]) == [2]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003"]


def test_max_segments_stops_each_stream_early(trained, tmp_path):
    from launch.export import export
    from txl_dist.evaluate import Evaluator

    corpus, ckpt = trained
    model = export(str(ckpt), str(tmp_path / "native"))
    cfg = EvalConfig(tgt_len=8, mem_len=12, clamp_len=-1, same_length=True, n_streams=2, max_segments=3)
    evaluator = Evaluator(corpus, cfg, rank=0, world_size=1, n_streams=2)
    first = evaluator.evaluate(model, "valid")
    again = evaluator.evaluate(model, "valid")  # each evaluation starts at the split's beginning
    evaluator.close()
    assert model.memory.mem_len == 8 and model.memory.same_length is False  # the evaluation did not touch them
    nll, count = _reference(model, _valid_tokens(corpus), 2, cfg)
    assert first["tokens"] == count == 2 * 3 * 8
    _assert_numbers(first, nll, count)
    assert again == first
    grouped = Evaluator(corpus, cfg, rank=0, world_size=1, n_streams=2, micro_batch=1)  # each stream stops early
    one_at_a_time = grouped.evaluate(model, "valid")
    grouped.close()
    assert one_at_a_time["tokens"] == count
    _assert_numbers(one_at_a_time, nll, count)


def _assert_numbers(result: dict, nll: float, count: int) -> None:
    np.testing.assert_allclose(result["loss"], nll / count, rtol=1e-5)
    np.testing.assert_allclose(result["perplexity"], math.exp(nll / count), rtol=1e-5)
    # The test corpus declares 6 bytes and 5 characters per token.
    np.testing.assert_allclose(result["bits_per_byte"], nll / count / math.log(2) / 6, rtol=1e-5)
    np.testing.assert_allclose(result["bits_per_char"], nll / count / math.log(2) / 5, rtol=1e-5)


def _valid_tokens(corpus) -> np.ndarray:
    from txl_dist.data import StreamLoader

    with StreamLoader(corpus, "valid", rank=0, world_size=1, n_streams=1, micro_batch=1, tgt_len=8) as loader:
        return np.asarray(loader.reader.read(0, VALID_TOKENS), dtype=np.int64)


def test_eval_mode_is_restored_after_evaluation():
    from txl_dist.evaluate import eval_mode

    model = torch.nn.Module()
    for was_training in (True, False):
        model.train(was_training)
        with eval_mode(model):
            assert not model.training
        assert model.training is was_training


def test_summarize_converts_nats_to_bits_per_token_byte_and_char():
    from txl_dist.evaluate import summarize

    r = summarize(nll_sum=2 * math.log(2) * 10, tokens=10, n_tokens=100, n_bytes=400, n_chars=200)
    assert r["bits_per_token"] == pytest.approx(2.0)
    assert r["bits_per_byte"] == pytest.approx(0.5) and r["bits_per_char"] == pytest.approx(1.0)
    assert r["perplexity"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="predicted no token"):
        summarize(0.0, 0, n_tokens=1, n_bytes=1, n_chars=1)


def _eval_printing(argv, stdout_file):
    """launch/eval.py on this rank with its standard output going to stdout_file."""
    import contextlib

    from launch.eval import main

    with open(stdout_file, "w") as f, contextlib.redirect_stdout(f):
        return main(argv)


def test_eval_stdout_is_the_table_and_the_json_whatever_the_environment(trained, tmp_path):
    """DeepSpeed logs to stdout when it is imported (without DS_ACCELERATOR: "Setting accelerator to CPU"):
    that goes to stderr, so that a program can read the result from stdout. A fresh process, as users run it."""
    import os
    import subprocess
    import sys

    _, ckpt = trained
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), "--checkpoint", str(ckpt), "--split",
                           "valid"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, _, text = proc.stdout.partition("\n\n")
    assert table.splitlines()[0].startswith("checkpoint "), proc.stdout[:500]
    assert json.loads(text)["split"] == "valid"


def test_eval_prints_a_table_and_the_json_and_writes_the_json_out_file(trained, tmp_path):
    from txl_dist.data import read_manifest

    corpus, ckpt = trained
    printed, written = tmp_path / "stdout.txt", tmp_path / "result.json"
    assert run_ranks(_eval_printing, 1, ["--checkpoint", str(ckpt), "--split", "valid", "--set", "eval.mem_len=12",
                                         "--json-out", str(written)], printed) == [0]
    table, _, text = printed.read_text().partition("\n\n")
    result = json.loads(text)
    assert json.loads(written.read_text()) == result
    assert result["eval"] == {"tgt_len": 8, "mem_len": 12, "clamp_len": -1, "same_length": True, "max_segments": 3}
    assert (result["precision"], result["attn_impl"]) == ("fp32", "matmul")  # what the numbers were computed in
    assert result["split_tokens_sha256"] == read_manifest(corpus).splits["valid"].tokens_sha256  # which text
    rows = dict(line.split(None, 1) for line in table.splitlines())
    assert list(rows) == ["checkpoint", "split", "precision", "memory", "loss", "perplexity", "bits/token", "bits/byte",
                          "bits/char"]
    assert rows["precision"] == "fp32 | attention matmul"
    assert rows["loss"] == f"{result['loss']:.4f} nats/token"
    assert rows["perplexity"] == f"{result['perplexity']:.3f}"
    for key in ("token", "byte", "char"):
        assert float(rows[f"bits/{key}"]) == pytest.approx(result[f"bits_per_{key}"], abs=5e-5)
    assert rows["split"].startswith(f"valid: {int(result['tokens']):,} tokens predicted over 2 streams on 1 rank")
    assert rows["memory"] == "tgt_len 8 | mem_len 12 | clamp_len -1 | same_length true | max_segments 3"
    assert rows["checkpoint"] == f"{result['checkpoint']} (step 3)"


# ----------------------------------------------------------------------------------------------------
# Progress: a line every PROGRESS_INTERVAL_S on rank 0, none for a short evaluation; the numbers unchanged.


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A corpus whose valid split gives 2 streams of 40 tokens (5 segments of tgt_len 8) and a random model."""
    from txl_dist.config import ModelConfig
    from txl_dist.model import TransformerXL

    splits = {"train": learnable_stream(4 * 49, VOCAB, 0), "valid": learnable_stream(VALID_TOKENS, VOCAB, 1)}
    corpus = write_corpus(tmp_path_factory.mktemp("progress") / "corpus", splits, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64,
                                      cutoffs=[32], div_val=2, tgt_len=8, mem_len=8, attn_impl="matmul")).eval()
    return corpus, model


def _progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluating ")]


def _evaluate(corpus, model, *, rank=0, world_size=1, on_segment=None):
    from txl_dist.evaluate import Evaluator

    cfg = EvalConfig(tgt_len=8, mem_len=12, n_streams=2)
    evaluator = Evaluator(corpus, cfg, rank=rank, world_size=world_size, n_streams=2)
    try:
        return evaluator.evaluate(model, "valid", on_segment=on_segment)
    finally:
        evaluator.close()


def test_a_long_evaluation_logs_progress_at_the_interval_and_the_same_numbers(small, monkeypatch, caplog):
    import txl_dist.progress as progress

    corpus, model = small
    with caplog.at_level(logging.INFO, logger="txl_dist"):
        quick = _evaluate(corpus, model)
    assert _progress_lines(caplog) == []  # it ends before the first interval

    seconds = iter(range(0, 1000, 10))  # 10 s pass between two looks at the clock
    monkeypatch.setattr(progress, "_clock", lambda: float(next(seconds)))
    segments = []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="txl_dist"):
        timed = _evaluate(corpus, model, on_segment=segments.append)
    assert timed == quick
    assert segments == [0, 1, 2, 3, 4]  # the watchdog's hook still sees every segment
    # Looks after segments 1..4 at 10, 20, 30, 40 s: one line at 30 s (48 tokens, 2 segments to go at 10 s
    # each), the next would be due at 60 s; none after the last segment.
    assert _progress_lines(caplog) == ["evaluating valid: 3/5 segments | 2 tok/s | ETA 0:00:20"]


@pytest.mark.parametrize("rank", [0, 1])
def test_progress_is_logged_on_rank_zero_only(small, monkeypatch, caplog, rank):
    import txl_dist.progress as progress

    corpus, model = small
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="txl_dist"):
        _evaluate(corpus, model, rank=rank, world_size=2)  # no process group: the all-reduce is skipped
    lines = _progress_lines(caplog)
    if rank:
        assert lines == []
    else:
        assert [line.split(" | ")[0] for line in lines] == [f"evaluating valid: {i}/5 segments" for i in (1, 2, 3, 4)]
        assert all(re.fullmatch(r".* \| \d+ tok/s \| ETA \d+:\d\d:\d\d", line) for line in lines), lines


class _BatchSpy(torch.nn.Module):
    """The model, recording each forward pass's streams and the streams its memory holds."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []
        self.train(model.training)  # the evaluation restores the spy's mode, and with it the model's

    def forward(self, input_ids, **kwargs):
        mems = kwargs["mems"]
        self.calls.append((input_ids.shape[0], None if mems is None else mems[0].shape[0]))
        return self.model(input_ids, **kwargs)


@pytest.mark.parametrize("micro_batch, group", [(None, 4), (3, 2), (2, 2), (1, 1)])
def test_a_rank_evaluates_its_streams_in_groups_each_through_the_split(small, micro_batch, group):
    """One rank evaluating many streams (a run trained on many GPUs, evaluated on one) ran them all in one
    batch: memory grew with the stream count. It runs them in equal groups of at most eval.micro_batch, each
    through the whole split before the next, with the numbers of the one batch and of a stream at a time."""
    from txl_dist.evaluate import Evaluator

    corpus, model = small
    cfg = EvalConfig(tgt_len=8, mem_len=12, n_streams=4)  # 4 streams of 20 tokens: 2 windows of 8, one of 3
    spy = _BatchSpy(model)
    segments = []
    evaluator = Evaluator(corpus, cfg, rank=0, world_size=1, n_streams=4, micro_batch=micro_batch)
    try:
        assert (evaluator.group, evaluator.segments("valid")) == (group, 3 * (4 // group))
        result = evaluator.evaluate(spy, "valid", on_segment=segments.append)
    finally:
        evaluator.close()
    assert segments == list(range(3 * (4 // group)))
    assert spy.calls == [(group, None), (group, group), (group, group)] * (4 // group)  # one group's mems at a time
    nll, count = _reference(model, _valid_tokens(corpus), 4, cfg)
    assert result["tokens"] == count == 4 * (VALID_TOKENS // 4 - 1)
    np.testing.assert_allclose(result["loss"], nll / count, rtol=1e-6)


def test_each_rank_groups_its_own_streams(small):
    """Rank 1 of 2 (no process group: the all-reduce is skipped) evaluates streams 2 and 3, one at a time."""
    from txl_dist.evaluate import Evaluator

    corpus, model = small
    cfg = EvalConfig(tgt_len=8, mem_len=12, n_streams=4)
    evaluator = Evaluator(corpus, cfg, rank=1, world_size=2, n_streams=4, micro_batch=1)
    try:
        result = evaluator.evaluate(model, "valid")
    finally:
        evaluator.close()
    tokens = _valid_tokens(corpus)
    nll, count = _reference(model, tokens[2 * len(tokens) // 4:], 2, cfg)
    assert result["tokens"] == count
    np.testing.assert_allclose(result["loss"], nll / count, rtol=1e-6)


def test_the_evaluations_group_bound_is_the_training_micro_batch_unless_set():
    from txl_dist.config import ConfigError, config_from_dict
    from txl_dist.streams import group_size

    raw = tiny_config("corpus", "run")
    cfg = config_from_dict(raw)
    assert cfg.eval_micro_batch() == cfg.micro_batch()
    raw["eval"]["micro_batch"] = 3
    assert config_from_dict(raw).eval_micro_batch() == 3
    raw["eval"]["micro_batch"] = 0
    with pytest.raises(ConfigError, match="eval.micro_batch"):
        config_from_dict(raw)
    assert [group_size(12, k) for k in (1, 5, 6, 12, 100)] == [1, 4, 6, 12, 12]
    assert group_size(7, 4) == 1  # a prime count: one stream at a time, never an unequal group


def test_groups_hash_each_corpus_file_once(small, monkeypatch):
    """Each group's loader verified the files of its block: a split in one file, evaluated in 4 groups, was
    hashed 4 times (launch/eval.py has no record of earlier starts' digests to answer from)."""
    import hashlib

    from txl_dist.evaluate import Evaluator

    corpus, _ = small
    cfg = EvalConfig(tgt_len=8, mem_len=12, n_streams=4)
    real = hashlib.sha256

    def hashings(micro_batch):
        calls = []
        # A file's hashing starts with an empty sha256 (manifest.sha256_file); naming a record entry does not.
        monkeypatch.setattr(hashlib, "sha256", lambda *a, **k: (calls.append(1) if not a else None) or real(*a, **k))
        Evaluator(corpus, cfg, rank=0, world_size=1, n_streams=4, micro_batch=micro_batch, splits=["valid"]).close()
        monkeypatch.setattr(hashlib, "sha256", real)
        return len(calls)

    assert hashings(1) == hashings(None) > 0
