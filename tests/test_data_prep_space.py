"""prepare, finalize, prepare --source, mix and relayout refuse up front, in one line, when the output's disk
cannot hold what they will write (data_prep/space.py): the estimate, 1 token per input byte of the corpus dtype,
written twice (token stream and layout) by prepare; the shards' token bytes for finalize; for mix, from the
sources' manifests, the train tokens asked for, the documents file, the held-out copies and the scan's document
ends; for relayout, what the re-cut files take now. --no-space-check skips it.

The free space is faked (shutil.disk_usage) so that the check meets exactly the estimate.
"""
from __future__ import annotations

import shutil
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from corpus_helpers import make_corpus, small_bpe_tokenizer, synthetic_stream, tricky_text
from data_prep.cli import main
from data_prep.sources import resolve_sources
from txl_dist.data.format import Layout, read_manifest


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_bpe_tokenizer(tmp_path_factory.mktemp("space-tok"))


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


# ----------------------------------------------------------------------------------------------------
# mix and relayout: what they write is known from the manifests


MIX_WEIGHTS = {"short": 1.0, "long": 3.0}


@pytest.fixture
def sources(tmp_path) -> dict[str, Path]:
    """Two corpora of uint16 tokens (vocabulary 1,000), documents of about 5 and 50 tokens, each with a valid
    split."""
    return {name: make_corpus(tmp_path / name, {"train": synthetic_stream(20_000, seed=k, mean_doc=mean_doc),
                                                 "valid": synthetic_stream(1_000, seed=10 + k)}, layout=Layout(1, 1))
            for k, (name, mean_doc) in enumerate((("short", 5), ("long", 50)))}


def mix_args(sources: dict[str, Path], out: Path, *extra) -> list:
    return ["mix", "--out", out, *[a for n, w in MIX_WEIGHTS.items() for a in ("--source", f"{n}={sources[n]}:{w}")],
            "--train-tokens", 30_000, "--world-size", 1, "--n-streams", 1, "--quiet", *extra]


def mix_need(sources: dict[str, Path], train_tokens: int, index: bool) -> int:
    """The documented estimate (docs/corpus_format.md, Disk space), from the manifests."""
    trains = [read_manifest(sources[n]).splits["train"] for n in MIX_WEIGHTS]
    shares = [w / sum(MIX_WEIGHTS.values()) for w in MIX_WEIGHTS.values()]
    n_docs = -(-sum(share * train_tokens * t.n_documents / t.n_tokens for share, t in zip(shares, trains)) // 1)
    valid = sum(read_manifest(c).splits["valid"].n_tokens for c in sources.values())
    return ((0 if index else 2 * train_tokens) + int(n_docs) * (17 if index else 9) + 2 * 2 * valid
            + 8 * sum(t.n_documents for t in trains))


def corpus_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*.arrow"))


def test_mix_refuses_when_the_disk_cannot_hold_the_mixture(sources, tmp_path, monkeypatch, capsys):
    need = mix_need(sources, 30_000, index=False)
    with_free_space(monkeypatch, need - 1)
    line = refusal(capsys, mix_args(sources, tmp_path / "mix"))
    assert f"for mix in {tmp_path}:" in line and "the train split: 30,000 tokens x 2 bytes per uint16 token" in line
    assert "documents x 9 bytes" in line and "held-out splits" in line and "document ends" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long", "short"]  # nothing written, no scratch folder
    assert main([str(a) for a in mix_args(sources, tmp_path / "mix", "--no-space-check")]) == 0
    # the estimate is what mix wrote (the scan's document ends are gone by now), within the Arrow framing, the
    # last document's overshoot and the documents' count at mean lengths
    scan = 8 * sum(read_manifest(c).splits["train"].n_documents for c in sources.values())
    assert 0.95 * need <= corpus_bytes(tmp_path / "mix") + scan <= 1.05 * need
    with_free_space(monkeypatch, need)
    assert main([str(a) for a in mix_args(sources, tmp_path / "mix", "--overwrite")]) == 0


def test_mix_index_needs_no_room_for_the_train_tokens(sources, tmp_path, monkeypatch, capsys):
    need = mix_need(sources, 30_000, index=True)
    with_free_space(monkeypatch, need - 1)
    line = refusal(capsys, mix_args(sources, tmp_path / "index", "--index"))
    assert f"for mix --index in {tmp_path}:" in line and "documents x 17 bytes" in line and "train split" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long", "short"]
    with_free_space(monkeypatch, need)
    assert "for mix in" in refusal(capsys, mix_args(sources, tmp_path / "copy"))  # the copy needs its tokens too
    assert main([str(a) for a in mix_args(sources, tmp_path / "index", "--index")]) == 0


def test_relayout_needs_the_new_files_beside_the_old(sources, tmp_path, monkeypatch, capsys):
    """The old files stay until the swap, so relayout needs what the re-cut files take now, on top; a
    mixture's documents file is copied too."""
    assert main([str(a) for a in mix_args(sources, tmp_path / "mix", "--no-space-check")]) == 0
    corpus = tmp_path / "mix"
    before = {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()}
    need = sum(f.stat().st_size for f in corpus.rglob("*") if f.is_file() and f.name != "manifest.json")
    args = ["relayout", corpus, "--world-size", 2, "--n-streams", 8, "--quiet"]
    with_free_space(monkeypatch, need - 1)
    line = refusal(capsys, args)
    assert f"for relayout in {tmp_path}:" in line and "the tokenizer and documents file copied" in line
    assert {p: p.read_bytes() for p in corpus.rglob("*") if p.is_file()} == before  # untouched, no scratch left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long", "mix", "short"]
    old_bytes = corpus_bytes(corpus)
    with_free_space(monkeypatch, need)
    assert main([str(a) for a in args]) == 0
    assert abs(corpus_bytes(corpus) - old_bytes) < 0.05 * old_bytes  # more files: only their framing differs
    with_free_space(monkeypatch, 0)
    assert main([str(a) for a in [*args, "--no-space-check"]]) == 0
