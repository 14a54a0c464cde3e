"""Long documents are tokenized in pieces and large batches in bounded tasks (data_prep/encode.py), plain-text
documents are read without a size limit (data_prep/sources.py): the ids are SentencePiece's encoding of each
whole document (exactly, but for a unigram model's ties: unigram_ids_agree), with real models trained here on
text full of newlines, blank lines, runs of spaces, tabs, CRLF, leading and trailing whitespace and
characters NFKC rewrites.

Expected ids come from SentencePiece directly (each document encoded in one call, then the eod id).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm

import data_prep.encode
from corpus_helpers import tricky_text
from data_prep.cli import main
from data_prep.encode import Encoder
from data_prep.tokenizer import TrainerOptions, train_tokenizer, training_sentences

NORMALIZATIONS = ("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity")
MODELS = [("unigram", True), ("unigram", False), ("bpe", True), ("bpe", False), ("char", None), ("word", None)]
VOCAB = {"unigram": 400, "bpe": 400, "char": 60, "word": 60}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str, bool | None], Path]:
    """A model per (normalization, model type, byte fallback), trained with data_prep's own trainer; a
    character coverage below 1 leaves rare characters unknown (byte pieces, or unk ids without fallback)."""
    root = tmp_path_factory.mktemp("piece-models")
    sentences = list(training_sentences([tricky_text(3000, seed) for seed in range(3)]))
    out = {}
    for norm in NORMALIZATIONS:
        for kind, fallback in MODELS:
            path = root / f"{norm}-{kind}-{fallback}.model"
            train_tokenizer(sentences, path, TrainerOptions(vocab_size=VOCAB[kind], model_type=kind,
                                                            byte_fallback=fallback, normalization=norm,
                                                            character_coverage=0.995))
            out[norm, kind, fallback] = path
    return out


def whole_document_ids(model: Path, docs: list[str]) -> np.ndarray:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    return np.array([i for d in docs for i in sp.encode(d) + [sp.eos_id()]], dtype=np.int64)


def record_encoded_rows(monkeypatch) -> list[int]:
    """The byte length of every row a worker call encodes in this process, from now on (a list that grows)."""
    rows: list[int] = []
    real = data_prep.encode._encode

    def recording(texts, *ends):
        rows.extend(len(t.encode()) for t in texts.to_pylist())
        return real(texts, *ends)

    monkeypatch.setattr(data_prep.encode, "_encode", recording)
    return rows


def encode_with(model: Path, docs: pa.Array, monkeypatch, **encoder) -> tuple[np.ndarray, list[int], int]:
    """Encode through Encoder in this process; returns (tokens, the byte length of every row a worker call
    encoded, the documents counted)."""
    rows = record_encoded_rows(monkeypatch)
    out, n_docs = [], 0

    def sink(key, enc):
        nonlocal n_docs
        out.append(enc.tokens.astype(np.int64))
        n_docs += enc.n_documents

    sp = spm.SentencePieceProcessor(model_file=str(model))
    with Encoder(str(model), sp.eos_id(), "uint16", **encoder) as e:
        e.run([("train", "test input", docs)], sink)
    return np.concatenate(out), rows, n_docs


def _encoded_in_pieces_as_whole(model, kind: str, monkeypatch) -> tuple[list[str], list[int]]:
    """Documents of ~300 bytes (and a few odd ones) encoded in pieces of ~24 bytes: checks that the ids are the
    whole documents' (a unigram model's where its choice is well defined); the documents and piece lengths."""
    docs = [tricky_text(40, seed) for seed in range(10, 50)] + ["", " \n ", "one", "\n\n\t two  \r\n"]
    tokens, rows, n_docs = encode_with(model, pa.array(docs), monkeypatch, piece_bytes=24, task_bytes=256)
    if kind == "unigram":
        unigram_ids_agree(model, tokens, docs)
    else:
        np.testing.assert_array_equal(tokens, whole_document_ids(model, docs))
    assert n_docs == len(docs)
    return docs, rows


@pytest.mark.parametrize("norm", NORMALIZATIONS)
@pytest.mark.parametrize("kind,fallback", MODELS)
def test_pieces_give_the_ids_of_the_whole_document(models, norm, kind, fallback, monkeypatch):
    """Documents of ~300 bytes cut into pieces of ~24 bytes (a cut every few words): the ids of bpe, char and
    word models are exactly the whole documents'; a unigram model's are where SentencePiece's own choice is
    well defined (see unigram_ids_agree), exactly the same in all but a few documents here."""
    from data_prep.tokenizer import document_cuts

    model = models[norm, kind, fallback]
    docs, rows = _encoded_in_pieces_as_whole(model, kind, monkeypatch)
    longest = max(len(d.encode()) for d in docs)
    cuts = document_cuts(model).chars
    if kind == "word":  # merges unknown words into one id: a cut between two would give two
        assert cuts == () and max(rows) == longest
    else:  # a newline is whitespace to the nmt_* rules only; a space to all
        assert cuts == ((b"\n", b" ") if norm.startswith("nmt_") else (b" ",))
        assert len(rows) > 4 * len(docs) and max(rows) < longest  # (a piece runs on to the next cut character)


NEWLINE_KEEPING = [  # (normalization, model type, byte fallback, whitespace kept: no removal, no dummy prefix)
    ("identity", "unigram", True, True), ("identity", "bpe", True, True), ("identity", "char", True, True),
    ("identity", "char", False, True), ("nmt_nfkc", "bpe", True, True),
    ("nmt_nfkc", "unigram", True, False), ("identity", "char", False, False)]
"""Tokenizers with a newline piece (--newline-piece), most also keeping every space and adding no dummy
prefix (--no-remove-extra-whitespaces --no-add-dummy-prefix: the enwik8 recipe's)."""


@pytest.fixture(scope="module")
def newline_models(tmp_path_factory) -> dict[tuple[str, str, bool, bool], Path]:
    root = tmp_path_factory.mktemp("newline-models")
    sentences = list(training_sentences([tricky_text(3000, seed) for seed in range(3)]))
    out = {}
    for norm, kind, fallback, kept in NEWLINE_KEEPING:
        options = TrainerOptions(vocab_size=VOCAB[kind] + (256 if fallback else 0), model_type=kind,
                                 byte_fallback=fallback, normalization=norm, character_coverage=0.995,
                                 newline_piece=True, remove_extra_whitespaces=not kept, add_dummy_prefix=not kept)
        out[norm, kind, fallback, kept] = train_tokenizer(sentences, root / f"{norm}-{kind}-{fallback}-{kept}.model",
                                                          options)
    return out


@pytest.mark.parametrize("norm,kind,fallback,kept", NEWLINE_KEEPING)
def test_tokenizers_with_a_newline_piece_cut_exactly(newline_models, norm, kind, fallback, kept, monkeypatch):
    """A newline piece: pieces give the whole documents' ids, cut after newlines where the whitespace is kept
    too (so the 90 MB split of the enwik8 recipe is not encoded in one call), else after spaces."""
    from data_prep.tokenizer import document_cuts

    model = newline_models[norm, kind, fallback, kept]
    docs, rows = _encoded_in_pieces_as_whole(model, kind, monkeypatch)
    assert document_cuts(model).chars == ((b"\n",) if kept else (b" ",))
    assert len(rows) > 4 * len(docs) and max(rows) < max(len(d.encode()) for d in docs)


def unigram_ids_agree(model: Path, tokens: np.ndarray, docs: list[str]) -> None:
    """Per document: the same pieces' text, and a segmentation scoring the same as the whole document's.

    SentencePiece's unigram search sums its path score in float32 along the text it is given, so where two
    segmentations tie (the same pieces in another order: "aa"+"a" and "a"+"aa") or nearly tie, the sum so far
    decides: a document and its pieces may then choose differently, both best up to the rounding
    (docs/corpus_format.md, Long documents). Anything else (a cut changing the text, a piece spanning a cut)
    changes the text or the score."""
    sp = spm.SentencePieceProcessor(model_file=str(model))
    eod = sp.eos_id()
    cuts = np.flatnonzero(tokens == eod) + 1
    got = np.split(tokens, cuts)[:-1]
    assert len(got) == len(docs)
    n_differ = 0
    for ids, doc in zip(got, docs):
        ids, whole = ids[:-1].tolist(), sp.encode(doc)
        if ids == whole:
            continue
        n_differ += 1
        assert "".join(sp.id_to_piece(ids)) == "".join(sp.id_to_piece(whole))
        assert sum(sp.get_score(i) for i in ids) == pytest.approx(sum(sp.get_score(i) for i in whole), abs=1e-2)
    assert n_differ <= len(docs) // 4


def test_piece_stops_prefer_a_newline_late_in_the_piece():
    from data_prep.encode import piece_stops

    text = b"aaaa bbbb\ncccc dddd eeee\nffffffffffffffffffff gg"
    stops = piece_stops(text, (b"\n", b" "), 16)
    assert stops[-1] == len(text) and all(text[s - 1:s] in (b"\n", b" ") for s in stops[:-1])
    assert stops[0] == 10  # the newline in the piece's second half, not the later space
    assert piece_stops(b"x" * 40 + b" y", (b" ",), 16) == [41, 42]  # no cut character: runs on to the next one
    assert piece_stops(b"", (b" ",), 16) == [0]


def test_tokenizer_training_reads_the_same_lines_from_pieces():
    """A long document reaches the tokenizer trainer as pieces cut after newlines: the same sentences."""
    from data_prep.encode import document_texts

    docs = pa.array([tricky_text(400, seed) for seed in range(3)] + ["short\nlines"])
    pieces = list(document_texts(docs, piece_bytes=100))
    assert len(pieces) > 20
    assert list(training_sentences(pieces)) == list(training_sentences(docs.to_pylist()))


def write_long_document(path: Path, n_words: int) -> str:
    """A plain-text file of tricky text (CRLF and all); returns the document as reading it gives it."""
    path.write_bytes(tricky_text(n_words, seed=7).encode())
    with open(path, encoding="utf-8") as f:  # universal newlines, as the product reads plain text
        return f.read()


def corpus_ids(corpus: Path) -> np.ndarray:
    manifest = json.loads((corpus / "manifest.json").read_text())
    return np.concatenate([pa.ipc.open_file(pa.OSFile(str(corpus / f["path"]))).read_all().column(0).to_numpy()
                           for f in manifest["splits"]["train"]["files"]]).astype(np.int64)


def test_prepare_encodes_a_long_document_in_pieces_in_parallel(models, tmp_path, monkeypatch):
    """One-document-per-file text, a document 40 times the piece size: the corpus holds its whole-document ids
    and one eod, no worker call saw more than a piece, and two workers give the same corpus."""
    monkeypatch.setattr(data_prep.encode, "PIECE_BYTES", 2048, raising=False)
    model = models["nmt_nfkc", "bpe", True]
    doc = write_long_document(tmp_path / "book.txt", 14000)
    assert len(doc.encode()) > 40 * 2048 and "\r" not in doc
    real = data_prep.encode._encode
    rows = record_encoded_rows(monkeypatch)
    common = ["--train", tmp_path / "book.txt", "--tokenizer-model", model, "--quiet"]
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "one", "--num-proc", 1, *common]]) == 0
    np.testing.assert_array_equal(corpus_ids(tmp_path / "one"), whole_document_ids(model, [doc]))
    assert max(rows) <= 2 * 2048 and len(rows) > 40
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["splits"]["train"]["n_documents"] == 1
    monkeypatch.setattr(data_prep.encode, "_encode", real)  # the workers are other processes
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "two", "--num-proc", 2, *common]]) == 0
    assert (json.loads((tmp_path / "two" / "manifest.json").read_text())["splits"]["train"]["tokens_sha256"]
            == json.loads((tmp_path / "one" / "manifest.json").read_text())["splits"]["train"]["tokens_sha256"])


def test_a_document_that_cannot_be_cut_is_encoded_whole_with_a_warning(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data_prep.encode, "PIECE_BYTES", 2048, raising=False)
    monkeypatch.setattr(data_prep.encode, "WHOLE_DOCUMENT_WARNING_BYTES", 10_000, raising=False)
    model = models["nmt_nfkc", "word", None]
    doc = write_long_document(tmp_path / "book.txt", 6000)
    capsys.readouterr()
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "c", "--train", tmp_path / "book.txt",
                                  "--tokenizer-model", model, "--num-proc", 1, "--quiet"]]) == 0
    np.testing.assert_array_equal(corpus_ids(tmp_path / "c"), whole_document_ids(model, [doc]))
    [warning] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert f"input {tmp_path / 'book.txt'}: a document of" in warning
    assert "its model type is word" in warning and "--line-docs" in warning


def test_large_batches_are_split_between_documents_and_small_ones_merged(models, tmp_path, monkeypatch):
    """JSON Lines of 600 documents of ~1.5 KB come in one batch of 1,024 rows: tasks stay near task_bytes
    (here 16 KB), the corpus is the same; 3,000 short lines (three batches) still share one task."""
    model = models["nmt_nfkc", "unigram", True]
    docs = [tricky_text(200, seed) for seed in range(600)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    lines = [tricky_text(3, seed).replace("\r", " ").replace("\n", " ") for seed in range(3000)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")  # ~60 KB
    tasks: list[int] = []
    real = data_prep.encode._encode

    def recording(texts, *ends):
        tasks.append(sum(len(t.encode()) for t in texts.to_pylist()))
        return real(texts, *ends)

    monkeypatch.setattr(data_prep.encode, "_encode", recording)
    real_init = data_prep.encode.Encoder.__init__
    monkeypatch.setattr(data_prep.encode.Encoder, "__init__",
                        lambda self, *a, **k: real_init(self, *a, **{**k, "task_bytes": 1 << 14}))
    common = ["--tokenizer-model", model, "--num-proc", 1, "--quiet"]
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "c", "--train", tmp_path / "docs.jsonl",
                                  *common]]) == 0
    np.testing.assert_array_equal(corpus_ids(tmp_path / "c"), whole_document_ids(model, docs))
    assert len(tasks) > 40 and max(tasks) <= (1 << 14) + max(len(d.encode()) for d in docs)
    tasks.clear()
    monkeypatch.setattr(data_prep.encode.Encoder, "__init__", real_init)  # the default: 256 KB
    assert main([str(a) for a in ["prepare", "--out", tmp_path / "l", "--train", tmp_path / "lines.txt",
                                  "--line-docs", *common]]) == 0
    assert len(tasks) == 1


def test_plain_text_is_read_in_chunks_exactly_as_python_reads_it(tmp_path, monkeypatch):
    """The reader decodes a few characters at a time here (a huge file: many chunks), into a large_string
    (64-bit offsets: no 2 GiB limit): CRLF and lone CR split across chunks, multi-byte characters, a BOM and,
    with --errors replace, invalid bytes come out as `open(..., encoding="utf-8-sig", newline="").read()` gives
    them (the line breaks as they are, the BOM dropped, as JSON Lines readers drop it)."""
    import data_prep.sources as sources

    monkeypatch.setattr(sources, "_READ_CHARS", 3, raising=False)
    raw = ("\ufeffab\r\ncd\r\r\n\u00e9\u65e5\r" + "x" * 5 + "\r\n\r\n😀 end\r").encode() + b"\xff\xfe tail\n"
    (tmp_path / "a.txt").write_bytes(raw)
    (tmp_path / "b.txt").write_bytes(b"second\r\ndocument")
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    opts = sources.ReadOptions(errors="replace")
    batches = list(sources.iter_documents(sources.resolve_sources([str(p) for p in paths], "--train"), opts))
    texts = [t for _, column in batches for t in column.to_pylist()]
    assert texts == [open(p, encoding="utf-8-sig", errors="replace", newline="").read() for p in paths]
    assert not texts[0].startswith("\ufeff")
    assert all(column.type == pa.large_string() for _, column in batches)
