"""The unigram baseline against a plain computation with Counter and math.log, and its command line."""
from __future__ import annotations

import json
import logging
import math
from collections import Counter

import pytest

from corpus_helpers import make_corpus, synthetic_stream
from txl_dist.data import Layout
from txl_dist.errors import EXIT_REFUSED
from txl_dist.unigram import main, unigram_perplexity

VOCAB = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # Train ids in [4, 120) only: test ids above never occur in training and need the smoothing.
    train = synthetic_stream(3000, 120, seed=0)
    test = synthetic_stream(500, VOCAB, seed=1)
    return make_corpus(tmp_path_factory.mktemp("unigram") / "corpus", {"train": train, "test": test},
                       Layout(1, 2), vocab_size=VOCAB, batch_tokens=128), train.tolist(), test.tolist()


@pytest.mark.parametrize("smoothing", [1.0, 0.5])
def test_perplexity_is_the_smoothed_unigram_of_train_counts(corpus, smoothing):
    folder, train, test = corpus
    counts = Counter(train)
    nll = -sum(math.log((counts[t] + smoothing) / (len(train) + smoothing * VOCAB)) for t in test) / len(test)
    result = unigram_perplexity(folder, "test", "train", smoothing)
    assert result["tokens"] == len(test)
    assert result["loss"] == pytest.approx(nll, rel=1e-12)
    assert result["perplexity"] == pytest.approx(math.exp(nll), rel=1e-12)


def test_cli_prints_the_model_beside_the_baseline(corpus, tmp_path, capsys, caplog):
    folder, _, _ = corpus
    (tmp_path / "eval.json").write_text(json.dumps({"split": "test", "step": 600, "perplexity": 42.1234}))
    assert main([str(folder), "--model-result", str(tmp_path / "eval.json")]) == 0
    baseline = unigram_perplexity(folder)["perplexity"]
    assert capsys.readouterr().out.strip() == (
        f"test perplexity: model 42.12 (step 600), unigram {baseline:.2f} (add-1 smoothed counts of train, "
        "500 tokens)")
    (tmp_path / "valid.json").write_text(json.dumps({"split": "valid", "step": 600, "perplexity": 42.0}))
    with caplog.at_level(logging.ERROR, logger="txl_dist"):
        assert main([str(folder), "--model-result", str(tmp_path / "valid.json")]) == EXIT_REFUSED
        assert main([str(folder), "--split", "valid"]) == EXIT_REFUSED
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["error", "error"]
    assert "not a launch/eval.py result for split 'test'" in caplog.records[0].getMessage()
    assert "no split 'valid'" in caplog.records[1].getMessage()


def _refusal(caplog, argv) -> str:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="txl_dist"):
        assert main(argv) == EXIT_REFUSED
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "\n" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("content, words", [
    (b"\xff\xfe{}", "not UTF-8 text (byte 0); a JSON file is text"),
    (b'{"split": "test", "perplexity": ', "invalid JSON at line 1"),
    (b"[1, 2]", "the top level must be a JSON object; pass the file launch/eval.py --json-out wrote"),
    (b'{"split": "test", "perplexity": "x"}', 'perplexity "x" is not a number > 0; the file is damaged'),
    (b'{"split": "test", "perplexity": null}', "perplexity null is not a number > 0"),
    (b'{"split": "test", "perplexity": true}', "perplexity true is not a number > 0"),
    (b'{"split": "test", "perplexity": 9, "tokens": 498, "eval_streams": "2", "eval": {"tgt_len": 8}}',
     "tokens, eval_streams or eval.tgt_len / eval.max_segments are not the numbers launch/eval.py writes"),
])
def test_a_model_result_that_is_no_eval_result_is_a_one_line_refusal(corpus, tmp_path, caplog, content, words):
    folder, _, _ = corpus
    (tmp_path / "eval.json").write_bytes(content)
    message = _refusal(caplog, [str(folder), "--model-result", str(tmp_path / "eval.json")])
    assert message.startswith(f"error: --model-result {tmp_path / 'eval.json'}: ") and words in message, message


def eval_result(tokens, streams=2, tgt_len=8, max_segments=None) -> dict:
    """What launch/eval.py --json-out writes (the keys the check reads)."""
    return {"checkpoint": "runs/x/checkpoints/step_00000600", "step": 600, "split": "test", "eval_streams": streams,
            "world_size": 1, "eval": {"tgt_len": tgt_len, "mem_len": 8, "clamp_len": -1, "same_length": True,
                                      "max_segments": max_segments},
            "loss": 3.7, "perplexity": 40.4, "tokens": float(tokens)}


def test_a_model_result_of_another_corpus_is_refused_by_its_token_count(corpus, tmp_path, capsys, caplog):
    folder, _, _ = corpus
    path = tmp_path / "eval.json"
    # 500 test tokens: 2 streams of 250, every token of each but its first; 3 streams of 166; 10 windows of 8.
    for result in (eval_result(498), eval_result(3 * 165, streams=3), eval_result(160, max_segments=10),
                   eval_result(498, max_segments=100)):
        path.write_text(json.dumps(result))
        assert main([str(folder), "--model-result", str(path)]) == 0
        assert capsys.readouterr().out.startswith("test perplexity: model 40.40 (step 600), unigram ")
    path.write_text(json.dumps(eval_result(2 * (3000 // 2 - 1))))  # the count of another corpus' split
    message = _refusal(caplog, [str(folder), "--model-result", str(path)])
    assert message == (f"error: --model-result {path}: the evaluation predicted 2998 tokens of split 'test' over 2 "
                       f"streams, but the split of {folder} has 500 tokens, which give 498: the result is of another "
                       "corpus (or another preparation of it), and would be compared with the wrong baseline; pass "
                       "the result of an evaluation of this corpus")
    path.write_text(json.dumps(eval_result(498, streams=3)))
    assert "predicted 498 tokens" in _refusal(caplog, [str(folder), "--model-result", str(path), "--json"])
    assert capsys.readouterr().out == ""


def test_a_model_result_of_another_text_is_refused_by_its_split_digest(corpus, tmp_path, capsys, caplog):
    from txl_dist.data import read_manifest

    folder, _, _ = corpus
    path = tmp_path / "eval.json"
    digest = read_manifest(folder).splits["test"].tokens_sha256
    path.write_text(json.dumps(eval_result(498) | {"split_tokens_sha256": digest}))
    assert main([str(folder), "--model-result", str(path)]) == 0
    assert capsys.readouterr().out.startswith("test perplexity: model 40.40 (step 600), unigram ")
    # The same count, another text (a corpus prepared again with another tokenizer can give the same count):
    other = "0" * 64
    for result in (eval_result(498) | {"split_tokens_sha256": other}, {"split": "test", "perplexity": 9.0,
                                                                       "split_tokens_sha256": other}):
        path.write_text(json.dumps(result))
        message = _refusal(caplog, [str(folder), "--model-result", str(path)])
        assert message == (f"error: --model-result {path}: the evaluation scored split 'test' with tokens_sha256 "
                           f"000000000000..., but the split of {folder} has {digest[:12]}...: the result is of "
                           "another corpus (or another preparation of it), and would be compared with the wrong "
                           "baseline; pass the result of an evaluation of this corpus")


@pytest.mark.parametrize("n_streams, tgt_len, max_segments", [(2, 8, None), (3, 7, None), (2, 8, 5), (4, 16, 3)])
def test_predicted_tokens_is_what_the_evaluator_predicts(corpus, n_streams, tgt_len, max_segments):
    import torch

    from txl_dist.config import EvalConfig, ModelConfig
    from txl_dist.evaluate import Evaluator
    from txl_dist.model import TransformerXL
    from txl_dist.unigram import predicted_tokens

    folder, _, test = corpus
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig(vocab_size=VOCAB, n_layer=1, d_model=8, n_head=1, d_head=8, d_inner=16,
                                      tgt_len=tgt_len, mem_len=4))
    cfg = EvalConfig(tgt_len=tgt_len, mem_len=4, n_streams=n_streams, max_segments=max_segments)
    evaluator = Evaluator(folder, cfg, rank=0, world_size=1, n_streams=n_streams)
    try:
        tokens = evaluator.evaluate(model, "test")["tokens"]
    finally:
        evaluator.close()
    assert tokens == predicted_tokens(len(test), n_streams, tgt_len, max_segments)


def test_the_baseline_beside_a_model_is_over_the_tokens_the_model_predicted(corpus, tmp_path, capsys):
    folder, train, test = corpus
    counts = Counter(train)

    def plain(tokens):
        nll = -sum(math.log((counts[t] + 1) / (len(train) + VOCAB)) for t in tokens) / len(tokens)
        return math.exp(nll)

    path = tmp_path / "eval.json"
    # 2 streams of 250 test tokens; 10 windows of 8 scored per stream: tokens 1-80 and 251-330.
    path.write_text(json.dumps(eval_result(160, max_segments=10)))
    assert main([str(folder), "--model-result", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == 160
    assert printed["perplexity"] == pytest.approx(plain(test[1:81] + test[251:331]), rel=1e-12)
    path.write_text(json.dumps(eval_result(498)))  # every token but each stream's first
    assert main([str(folder), "--model-result", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(plain(test[1:250] + test[251:500]),
                                                                              rel=1e-12)


@pytest.mark.parametrize("smoothing", ["inf", "0", "-1", "nan"])
def test_a_smoothing_that_is_no_positive_finite_number_is_refused(corpus, caplog, smoothing):
    folder, _, _ = corpus
    assert "--smoothing must be a finite number > 0" in _refusal(caplog, [str(folder), "--smoothing", smoothing])
