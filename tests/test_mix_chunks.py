"""`mix` copies the train tokens in chunks of at most CHUNK_TOKENS whatever the documents' lengths (a document
longer than a chunk is cut across chunks), so its memory does not grow with the longest document, and the
files it writes are byte for byte those of copying every document whole."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import data_prep.mix as mix_module
from corpus_helpers import EOD, make_corpus, synthetic_stream
from data_prep.cli import main
from txl_dist.data.format import Layout, read_manifest, verify_corpus
from txl_dist.data.mixture import read_documents

SMALL_CHUNK = 64
LONG_DOCUMENT = 3000
"""Tokens of the long document: many chunks, and several of the sources' record batches."""


def corpus_with_a_long_document(root: Path, seed: int) -> Path:
    tokens = synthetic_stream(6000, seed=seed, mean_doc=30)
    at = 1000
    tokens[at:at + LONG_DOCUMENT][tokens[at:at + LONG_DOCUMENT] == EOD] = 5  # one document of LONG_DOCUMENT + tokens
    return make_corpus(root, {"train": tokens}, Layout(2, 4), batch_tokens=500)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("chunk-sources")
    return [corpus_with_a_long_document(root / name, seed) for seed, name in enumerate(("a", "b"))]


def mixed(sources: list[Path], out: Path, monkeypatch) -> list[int]:
    """Mix the sources into `out`; returns the length of every chunk handed to the train split's writer."""
    handed: list[int] = []

    class RecordingWriter(mix_module.SplitWriter):
        def write(self, tokens, source):
            handed.append(len(tokens))
            return super().write(tokens, source)

    monkeypatch.setattr(mix_module, "SplitWriter", RecordingWriter)
    assert main(["mix", "--out", str(out), "--source", f"a={sources[0]}:2", "--source", f"b={sources[1]}:1",
                 "--world-size", "2", "--n-streams", "4", "--train-tokens", "15000", "--quiet"]) == 0
    return handed


def written_files(corpus: Path) -> dict[str, bytes]:
    """Every file of the corpus but the manifest (whose provenance has the time it was made)."""
    return {str(p.relative_to(corpus)): p.read_bytes() for p in sorted(corpus.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def test_a_document_longer_than_a_chunk_is_cut_across_chunks_with_the_same_bytes(sources, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    mixed(sources, whole, monkeypatch)  # CHUNK_TOKENS = 2^20: every document fits one chunk, copied whole
    monkeypatch.setattr(mix_module, "CHUNK_TOKENS", SMALL_CHUNK)
    cut = tmp_path / "cut"
    handed = mixed(sources, cut, monkeypatch)
    assert max(handed) <= SMALL_CHUNK, max(handed)  # the long documents went through in bounded chunks
    assert sum(handed) == read_manifest(cut).splits["train"].n_tokens
    assert read_manifest(cut).digest() == read_manifest(whole).digest()
    assert written_files(cut) == written_files(whole)
    stops, _ = read_documents(cut, read_manifest(cut))
    assert np.diff(stops, prepend=0).max() > LONG_DOCUMENT  # the long documents are in the mixture
    verify_corpus(cut)
