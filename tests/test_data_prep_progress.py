"""What the progress output says: a `prepare --shard i/n` following plan.json gives its tokenize bar the shard's
bytes as total (and prints no counting bar: the plan has the counts); train-tokenizer's sampling counts bytes,
not documents (a single 500 MB document moved it once), and SentencePiece's training shows a ticking elapsed
time until it returns. Bars are recorded by wrapping tqdm where data_prep uses it."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tqdm import tqdm

import data_prep.encode as encode
import data_prep.prepare as prepare_module
import data_prep.progress as progress_module
from corpus_helpers import small_bpe_tokenizer, tricky_text
from data_prep.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_bpe_tokenizer(tmp_path_factory.mktemp("progress-tok"))


@pytest.fixture
def bars(monkeypatch) -> list[tqdm]:
    """Every bar data_prep.prepare makes, kept after it closes."""
    made: list[tqdm] = []

    class RecordingTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.updates = 0
            made.append(self)

        def update(self, n=1):
            self.updates += 1
            return super().update(n)

    monkeypatch.setattr(prepare_module, "tqdm", RecordingTqdm)
    return made


def test_a_planned_shard_bar_has_the_shard_bytes_as_total_and_no_counting_bar(model, tmp_path, bars, capsys):
    # one document per file, the first two much larger: shard 0 of 2 holds them, far more than half the bytes
    inputs = []
    for k, n_words in enumerate([20_000, 20_000, 500, 500]):
        inputs.append(tmp_path / "raw" / f"{k}.txt")
        inputs[-1].parent.mkdir(exist_ok=True)
        inputs[-1].write_text(tricky_text(n_words, seed=k).replace("\r", ""), encoding="utf-8")
    common = ["--out", str(tmp_path / "parts"), "--train", *map(str, inputs), "--tokenizer-model", str(model),
              "--num-proc", "1"]
    assert main(["prepare", "--plan", *common, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["prepare", *common, "--shard", "0/2"]) == 0
    err = capsys.readouterr().err
    assert "count documents" not in err, err
    (tokenize,) = [b for b in bars if getattr(b, "desc", None) == "tokenize"]
    assert tokenize.total == tokenize.n == sum(len(p.read_bytes()) for p in inputs[:2])


def test_sampling_for_the_tokenizer_counts_bytes_of_a_long_document(tmp_path, bars, monkeypatch, capsys):
    monkeypatch.setattr(encode, "PIECE_BYTES", 4096)  # the document is read in pieces of this size
    text = tricky_text(30_000, seed=1).replace("\r", "")  # one document of ~150 KB (~40 pieces) read as it is
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    out = tmp_path / "tok.model"
    assert main(["train-tokenizer", "--out", str(out), "--train", str(path), "--vocab-size", "400",
                 "--model-type", "bpe"]) == 0
    (sampling,) = [b for b in bars if getattr(b, "desc", None) == "tokenizer: read training text"]
    assert sampling.n == sampling.total == len(path.read_bytes())
    assert sampling.updates > 10  # it moved along the document, not once at its end
    assert "tokenizer: training bpe sentencepiece, vocab 400: 00:0" in capsys.readouterr().err  # the elapsed time


def test_the_heartbeat_ticks_while_a_blocking_call_runs_and_stops_after(monkeypatch, capsys):
    ticks = threading.Semaphore(0)
    refresh = tqdm.refresh

    def counting_refresh(self, *args, **kwargs):
        ticks.release()
        return refresh(self, *args, **kwargs)

    monkeypatch.setattr(progress_module, "HEARTBEAT_S", 0.01)
    monkeypatch.setattr(tqdm, "refresh", counting_refresh)
    beat = progress_module.Heartbeat("training something", enabled=True)
    beat.start()
    for _ in range(3):  # a blocking call that returns once the heartbeat ticked three times
        assert ticks.acquire(timeout=60)
    beat.stop()
    assert not beat.thread.is_alive()
    assert "training something" in capsys.readouterr().err
    quiet = progress_module.Heartbeat("not shown", enabled=False)
    quiet.start()
    quiet.stop()
    assert quiet.thread is None and "not shown" not in capsys.readouterr().err


def test_bars_of_json_lines_end_complete(model, tmp_path, bars):
    """Their totals are the files' sizes and the text counted is less (quotes, keys, escapes): the bars of a
    finished tokenizing and tokenizer sampling stayed at 80-99%, as if the stage had stopped early."""
    import json

    raw = tmp_path / "raw.jsonl"
    with open(raw, "w", encoding="utf-8") as f:
        for k in range(60):
            f.write(json.dumps({"text": tricky_text(40, seed=k), "id": k}) + "\n")
    common = ["--train", str(raw), "--num-proc", "1"]
    assert main(["prepare", "--out", str(tmp_path / "corpus"), "--tokenizer-model", str(model), *common]) == 0
    assert main(["train-tokenizer", "--out", str(tmp_path / "tok.model"), "--vocab-size", "400",
                 "--model-type", "bpe", *common]) == 0
    finished = {b.desc: b for b in bars if getattr(b, "desc", None) in ("tokenize", "tokenizer: read training text")}
    assert len(finished) == 2
    for bar in finished.values():
        assert bar.n == bar.total < raw.stat().st_size, bar.desc
