"""A trained tokenizer numbers its pieces by their frequency in its training sample (data_prep/tokenizer.py:
_renumber_by_frequency), so that the adaptive input and softmax find the frequent pieces below the cutoffs.
The unknown and control pieces keep their ids, every piece keeps its string, score and type, and every text
is segmented into the same pieces as by the model SentencePiece wrote; a --tokenizer-model is used as given.

The model SentencePiece wrote and the sample are caught on their way into _renumber_by_frequency."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

import data_prep.tokenizer as tokenizer
from corpus_helpers import tricky_text
from data_prep.cli import main
from data_prep.errors import PrepError
from data_prep.tokenizer import (EOD_PIECE, TrainerOptions, check_trained_with, describe_tokenizer, train_tokenizer,
                                 training_sentences)

KEEP_TEXT = dict(normalization="identity", newline_piece=True, remove_extra_whitespaces=False,
                 add_dummy_prefix=False)
CASES = {  # name: TrainerOptions fields
    "unigram": dict(model_type="unigram", vocab_size=500),
    "unigram-no-bytes": dict(model_type="unigram", vocab_size=500, byte_fallback=False),
    "unigram-keep-text": dict(model_type="unigram", vocab_size=500, byte_fallback=True, **KEEP_TEXT),
    "bpe": dict(model_type="bpe", vocab_size=500),
    "bpe-no-bytes": dict(model_type="bpe", vocab_size=500, byte_fallback=False),
    "char": dict(model_type="char", vocab_size=100),
    "char-bytes": dict(model_type="char", vocab_size=400, byte_fallback=True),
    "word": dict(model_type="word", vocab_size=100),
}
FIXED = (pb.ModelProto.SentencePiece.UNKNOWN, pb.ModelProto.SentencePiece.CONTROL)


def training_text() -> list[str]:
    return list(training_sentences([tricky_text(2000, seed) for seed in range(2)]))


def other_text() -> list[str]:
    """Text the tokenizer did not train on: other words and spacing, and characters outside every vocabulary
    here (byte pieces with byte fallback, else unknown ids)."""
    rare = "Ωμέγα 中文字符 ﷺ 🦜🦩 ǅ Ꙭ ⅷ\u0301 ᚠᚢᚦ ğüş"
    return [tricky_text(300, seed) for seed in (11, 12, 13)] + [rare, f"ROMEO.\n{rare}  But soft!\t\n\n{rare}"]


def train_caught(tmp_path: Path, name: str, options: dict, monkeypatch) -> tuple[Path, bytes, list[str]]:
    """Train with data_prep's trainer: the model file, the model SentencePiece wrote and the counted sample."""
    caught = {}
    real = tokenizer._renumber_by_frequency

    def catching(model, sample):
        caught.update(model=model, sample=list(sample))
        return real(model, sample)

    monkeypatch.setattr(tokenizer, "_renumber_by_frequency", catching)
    path = train_tokenizer(training_text(), tmp_path / f"{name}.model",
                           TrainerOptions(character_coverage=0.995, **options))
    return path, caught["model"], caught["sample"]


def proto_of(model: bytes):
    proto = pb.ModelProto()
    proto.ParseFromString(model)
    return proto


@pytest.mark.parametrize("name", CASES)
def test_renumbering_keeps_every_segmentation_and_orders_ids_by_count(tmp_path, monkeypatch, name):
    path, original_bytes, sample = train_caught(tmp_path, name, CASES[name], monkeypatch)
    new_bytes = path.read_bytes()
    original = spm.SentencePieceProcessor(model_proto=original_bytes)
    new = spm.SentencePieceProcessor(model_file=str(path))
    assert new.get_piece_size() == original.get_piece_size()

    # The same pieces, scores and types; unknown and control pieces where they were (unk 0, eod 1).
    old_proto, new_proto = proto_of(original_bytes), proto_of(new_bytes)
    as_set = lambda proto: sorted((p.piece, p.score, p.type) for p in proto.pieces)  # noqa: E731
    assert as_set(old_proto) == as_set(new_proto)
    assert old_proto.trainer_spec == new_proto.trainer_spec and old_proto.normalizer_spec == new_proto.normalizer_spec
    for i, piece in enumerate(old_proto.pieces):
        if piece.type in FIXED:
            assert new_proto.pieces[i] == piece
    assert (new.unk_id(), new.eos_id(), new.id_to_piece(1)) == (0, 1, EOD_PIECE)

    # Every text: the same pieces (as strings), the same text back from the new ids.
    texts = other_text() + sample[:200]
    for text in texts:
        pieces = original.encode(text, out_type=str)
        assert new.encode(text, out_type=str) == pieces
        ids, original_ids = new.encode(text), original.encode(text)
        assert [new.id_to_piece(i) for i in ids] == [original.id_to_piece(i) for i in original_ids]
        assert new.decode(ids) == original.decode(original_ids)
    used = {p for text in texts for p in new.encode(text, out_type=str)}
    has_bytes = any(p.type == pb.ModelProto.SentencePiece.BYTE for p in new_proto.pieces)
    assert has_bytes == any(p.startswith("<0x") for p in used)  # byte pieces were exercised where they exist

    # Ids in order of their count on the sample (the fixed pieces aside), which the old order was not.
    def counts(sp):
        return np.bincount(np.fromiter(itertools.chain.from_iterable(sp.encode(sample)), dtype=np.int64),
                           minlength=sp.get_piece_size())

    movable = [i for i, p in enumerate(new_proto.pieces) if p.type not in FIXED]
    new_counts = counts(new)[movable]
    if CASES[name].get("newline_piece"):
        assert new.piece_to_id("\n") == movable[0]  # counted once per sentence (a line): the most frequent
        new_counts = new_counts[1:]
    assert (np.diff(new_counts) <= 0).all()
    if CASES[name]["model_type"] in ("unigram", "bpe") or has_bytes:
        # SentencePiece's own order was not by count (char and word models list pieces by frequency already,
        # after the byte pieces): the model changed
        assert (np.diff(counts(original)[movable]) > 0).any() and new_bytes != original_bytes


def test_describe_and_check_trained_with_read_a_renumbered_model(tmp_path, monkeypatch):
    path, _, _ = train_caught(tmp_path, "unigram", CASES["unigram"], monkeypatch)
    entry = describe_tokenizer(path)
    assert (entry.vocab_size, entry.model_type, entry.unk_id, entry.eod_id, entry.bos_id, entry.pad_id) == \
        (500, "unigram", 0, 1, -1, -1)
    assert describe_tokenizer(path, EOD_PIECE).eod_id == 1
    check_trained_with(path, {"vocab_size": 500, "model_type": "unigram", "byte_fallback": True,
                              "character_coverage": 0.995, "normalization": "nmt_nfkc", "newline_piece": False})
    with pytest.raises(PrepError, match="--vocab-size 600"):
        check_trained_with(path, {"vocab_size": 600})


def test_the_same_input_and_seed_give_the_same_model(tmp_path):
    first, second = (train_tokenizer(training_text(), tmp_path / f"{name}.model", TrainerOptions(vocab_size=500))
                     for name in ("a", "b"))
    assert first.read_bytes() == second.read_bytes()


def test_the_sample_is_bounded_and_seeded():
    sentences = [f"sentence {i}" for i in range(1000)]
    feeds = [tokenizer._RecordingFeed(sentences, 100, seed) for seed in (0, 0, 1)]
    for feed in feeds:
        assert list(feed) == sentences
    assert len(feeds[0].sample) == 100 and len(set(feeds[0].sample)) == 100
    assert feeds[0].sample == feeds[1].sample != feeds[2].sample
    assert max(int(s.split()[1]) for s in feeds[0].sample) > 500  # drawn from the whole feed, not its start
    short = tokenizer._RecordingFeed(sentences[:10], 100, 0)
    assert list(short) == short.sample == sentences[:10]


def test_prepare_renumbers_the_model_it_trains_and_keeps_a_given_one(tmp_path, monkeypatch):
    (tmp_path / "train.txt").write_text(tricky_text(3000, 5), encoding="utf-8")
    common = ["--train", tmp_path / "train.txt", "--quiet", "--num-proc", 1]
    options = ["--vocab-size", 400, "--model-type", "bpe"]
    original = {}
    real = tokenizer._renumber_by_frequency

    def catching(model, sample):
        original["model"] = model
        return real(model, sample)

    monkeypatch.setattr(tokenizer, "_renumber_by_frequency", catching)
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "trained", *common, *options]]) == 0
    trained = (tmp_path / "trained" / "tokenizer.model").read_bytes()
    assert trained != original["model"]

    # The model SentencePiece wrote (ids not by frequency), given: used byte for byte, never renumbered.
    given = tmp_path / "given.model"
    given.write_bytes(original["model"])
    original.clear()
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "reused", "--tokenizer-model", given, *common]]) == 0
    assert (tmp_path / "reused" / "tokenizer.model").read_bytes() == given.read_bytes()
    assert not original  # nothing was renumbered


SAME_MODEL_ELSEWHERE = """
import hashlib, sys
sys.path.insert(0, sys.argv[1])
from data_prep.tokenizer import TrainerOptions, train_tokenizer
import random
rng = random.Random(0)
words = ["".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 8))) for _ in range(800)]
lines = [" ".join(rng.choices(words, k=10)) for _ in range(6000)]
path = train_tokenizer(iter(lines), sys.argv[2], TrainerOptions(vocab_size=400, sample_sentences=1000, seed=3))
print(hashlib.sha256(path.read_bytes()).hexdigest())
"""


def test_a_sampled_training_gives_the_same_tokenizer_in_every_process(tmp_path):
    """SentencePiece's own sampling (input_sentence_size) ignored its seed: each run of prepare on a split of more
    sentences than --tokenizer-sample trained another tokenizer, so another corpus."""
    import subprocess
    import sys

    digests = {subprocess.run([sys.executable, "-c", SAME_MODEL_ELSEWHERE, str(Path(__file__).resolve().parents[1]),
                               str(tmp_path / f"{i}.model")], check=True, capture_output=True, text=True).stdout
               for i in range(3)}
    assert len(digests) == 1, digests


def test_the_training_sample_is_uniform_and_in_the_order_read():
    import random

    n, size, runs = 40, 8, 4000
    taken = np.zeros(n)
    for seed in range(runs):
        reservoir = tokenizer._SkippingReservoir(size, random.Random(seed))
        for i in range(n):
            reservoir.offer(f"{i:03d}")
        sample = reservoir.in_order()
        assert len(sample) == size and sample == sorted(sample) and len(set(sample)) == size
        taken[[int(s) for s in sample]] += 1
    share = taken / runs  # each item: size / n = 0.2, binomial standard deviation 0.0063
    assert np.abs(share - size / n).max() < 0.03, share
    reservoir = tokenizer._SkippingReservoir(size, random.Random(0))
    for i in range(5):
        reservoir.offer(str(i))
    assert reservoir.in_order() == ["0", "1", "2", "3", "4"]  # fewer than size: all of them, as read
