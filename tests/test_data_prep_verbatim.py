"""Tokenizers that keep the text (--newline-piece, --no-remove-extra-whitespaces, --no-add-dummy-prefix,
--byte-fallback for char models), what the default does with whitespace, and the vocabulary size of char
models. The enwik8 recipe's options on a prepared corpus: tests/test_recipes.py; exact cuts of long documents
for these tokenizers: tests/test_data_prep_pieces.py."""
from __future__ import annotations

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from corpus_helpers import tricky_text
from data_prep.errors import PrepError
from data_prep.tokenizer import TrainerOptions, check_trainer_options, train_tokenizer, training_sentences

KEEP_TEXT = dict(normalization="identity", byte_fallback=True, newline_piece=True, remove_extra_whitespaces=False,
                 add_dummy_prefix=False)
"""The options that keep every byte of the text (the enwik8 recipe's)."""
VISIBLE_SPACE = "\u2581"
"""SentencePiece's visible space "▁", which spaces become: a "▁" in the text decodes as a space, whatever the
options (SentencePiece has none to escape it; docs/corpus_format.md)."""


def keepable(text: str) -> str:
    """The text without the one character no SentencePiece model gives back."""
    return text.replace(VISIBLE_SPACE, "_")


def train(tmp_path, name: str, **options) -> spm.SentencePieceProcessor:
    sentences = training_sentences([tricky_text(2000, seed) for seed in range(2)])
    path = train_tokenizer(sentences, tmp_path / f"{name}.model", TrainerOptions(**options))
    return spm.SentencePieceProcessor(model_file=str(path))


def normalizer(sp: spm.SentencePieceProcessor):
    proto = pb.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    return proto.normalizer_spec


@pytest.mark.parametrize("kind, vocab", [("char", 6000), ("unigram", 500), ("bpe", 500)])
def test_keeping_the_text_round_trips_every_byte(tmp_path, kind, vocab):
    sp = train(tmp_path, kind, model_type=kind, vocab_size=vocab, character_coverage=1.0, **KEEP_TEXT)
    for text in ("a\n\n\nb", "a\tb", "a   b", "  lead\n\n trail  ", "\n", "ünï 日本 😀 \x01 Ω\u0301",
                 keepable(tricky_text(300, 9))):
        ids = sp.encode(text)
        assert sp.unk_id() not in ids and sp.decode(ids) == text, text
    assert sp.encode("a\n\n\nt", out_type=str) == ["a", "\n", "\n", "\n", "t"]  # no "▁" before the text
    assert sp.decode(sp.encode(f"x{VISIBLE_SPACE}y")) == "x y"


def test_the_default_tokenizer_makes_newlines_and_runs_of_spaces_single_spaces(tmp_path):
    """What the quickstart's tokenizer (nmt_nfkc, SentencePiece's whitespace handling) does, as documented:
    text decodes without its line breaks, tabs and runs of spaces. --newline-piece alone keeps the newlines."""
    default = train(tmp_path, "default", vocab_size=500)
    assert default.decode(default.encode("ROMEO.\nBut soft!\n\n\tWhat  light")) == "ROMEO. But soft! What light"
    assert not any(normalizer(default).HasField(f) for f in ("add_dummy_prefix", "remove_extra_whitespaces"))
    newlines = train(tmp_path, "newlines", vocab_size=500, newline_piece=True)
    assert newlines.decode(newlines.encode("ROMEO.\nBut soft!\n\n\tWhat  light")) == "ROMEO.\nBut soft!\n\n What light"


def test_a_char_models_vocab_size_is_a_maximum(tmp_path):
    """A char model holds its training characters (and the special and byte pieces), at most --vocab-size:
    a larger value is not refused, a smaller one leaves the rarest characters to byte pieces."""
    sentences = list(training_sentences([tricky_text(2000, seed) for seed in range(2)]))
    characters = {c for s in sentences for c in s.replace(" ", VISIBLE_SPACE)}
    all_of_them = train(tmp_path, "big", model_type="char", vocab_size=6000, character_coverage=1.0, **KEEP_TEXT)
    assert all_of_them.get_piece_size() == 2 + 1 + 256 + len(characters)  # <unk> <eod>, "\n", bytes
    capped = train(tmp_path, "small", model_type="char", vocab_size=2 + 1 + 256 + 10, character_coverage=1.0,
                   **KEEP_TEXT)
    assert capped.get_piece_size() == 2 + 1 + 256 + 10
    text = keepable(tricky_text(200, 5))
    assert capped.decode(capped.encode(text)) == text  # the left-out characters as bytes


def test_text_keeping_options_are_checked():
    check_trainer_options(TrainerOptions(model_type="char", vocab_size=260, **KEEP_TEXT))  # byte fallback: char too
    with pytest.raises(PrepError, match="the special pieces and 256 byte pieces and the newline piece need 259; "
                                        "use at least 260"):
        check_trainer_options(TrainerOptions(model_type="char", vocab_size=259, **KEEP_TEXT))
    with pytest.raises(PrepError, match="--byte-fallback works with unigram, bpe, char models, not word"):
        check_trainer_options(TrainerOptions(model_type="word", byte_fallback=True))
