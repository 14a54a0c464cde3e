"""prepare, finalize and prepare --source refuse up front, in one line, when the output's disk cannot hold what
they will write (data_prep/space.py): the estimate, 1 token per input byte of the corpus dtype, written twice
(token stream and layout) by prepare; the shards' token bytes for finalize. --no-space-check skips it.

The free space is faked (shutil.disk_usage) so that the check meets exactly the estimate.
"""
from __future__ import annotations

import shutil
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from corpus_helpers import tricky_text
from data_prep.cli import main
from data_prep.sources import resolve_sources
from data_prep.tokenizer import TrainerOptions, train_tokenizer, training_sentences


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("space-tok") / "tok.model"
    sentences = training_sentences([tricky_text(2000, seed) for seed in range(2)])
    return train_tokenizer(sentences, path, TrainerOptions(vocab_size=400, model_type="bpe"))


@pytest.fixture
def inputs(tmp_path) -> list[Path]:
    paths = []
    for k in range(2):
        paths.append(tmp_path / "raw" / f"{k}.txt")
        paths[-1].parent.mkdir(exist_ok=True)
        paths[-1].write_text(tricky_text(400, seed=k), encoding="utf-8")
    return paths


def with_free_space(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=free, used=0, free=free))


def refusal(capsys, argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: not enough free space"), err
    return err[0]


def test_prepare_refuses_when_the_disk_cannot_hold_stream_and_layout(model, inputs, tmp_path, monkeypatch, capsys):
    n_input = sum(p.stat().st_size for p in inputs)
    need = 2 * n_input * 2  # stream and layout, each 1 token per byte x 2 bytes (uint16: 400 pieces)
    args = ["prepare", "--out", tmp_path / "out", "--train", *inputs, "--tokenizer-model", model, "--num-proc", 1,
            "--quiet"]
    with_free_space(monkeypatch, need - 1)
    line = refusal(capsys, args)
    assert f"for prepare in {tmp_path}:" in line and "--no-space-check" in line
    assert "x 1 token per byte x 2 bytes per uint16 token" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # nothing written, no scratch folder
    assert main([str(a) for a in [*args, "--no-space-check"]]) == 0
    with_free_space(monkeypatch, need)
    assert main([str(a) for a in [*args, "--overwrite"]]) == 0


def test_a_shard_needs_its_share_and_finalize_the_shards_bytes(model, inputs, tmp_path, monkeypatch, capsys):
    n_input = sum(p.stat().st_size for p in inputs)
    parts = tmp_path / "parts"
    for i in range(2):
        args = ["prepare", "--out", parts, "--shard", f"{i}/2", "--train", *inputs, "--tokenizer-model", model,
                "--num-proc", 1, "--quiet"]
        share = n_input * 2 // 2  # its half of the stream (1 token per byte, uint16), no layout
        with_free_space(monkeypatch, share - 1)
        assert f"shard {i}/2's share of the tokens" in refusal(capsys, args)
        with_free_space(monkeypatch, share)
        assert main([str(a) for a in args]) == 0
    shard_bytes = sum(f.stat().st_size for f in parts.glob("shard-*/*.arrow"))
    args = ["finalize", parts, "--out", tmp_path / "corpus", "--quiet"]
    with_free_space(monkeypatch, shard_bytes - 1)
    assert f"for finalize in {tmp_path}:" in refusal(capsys, args)
    with_free_space(monkeypatch, shard_bytes)
    assert main([str(a) for a in args]) == 0


def test_prepare_source_checks_the_whole_job(model, inputs, tmp_path, monkeypatch, capsys):
    with_free_space(monkeypatch, 1000)
    line = refusal(capsys, ["prepare", "--out", tmp_path / "mix", "--source", f"a={inputs[0]}:1", "--source",
                            f"b={inputs[1]}:1", "--tokenizer-model", model, "--quiet"])
    assert "for prepare --source in" in line and "the sources' corpora" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_parquet_text_counts_uncompressed(tmp_path):
    from data_prep.space import input_text_bytes

    texts = [f"document {k}: " + "to be or not to be " * 20000 for k in range(5)]
    pq.write_table(pa.table({"text": texts, "id": list(range(5))}), tmp_path / "t.parquet", compression="zstd")
    n_text = sum(len(t) for t in texts)
    assert (tmp_path / "t.parquet").stat().st_size < n_text / 100
    assert n_text <= input_text_bytes(resolve_sources([str(tmp_path / "t.parquet")], "--train"), "text") < 1.01 * n_text
