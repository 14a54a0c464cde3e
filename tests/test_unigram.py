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
