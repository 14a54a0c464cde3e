"""verify_corpus: re-check a prepared corpus end to end (checksums, counts, token ids)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from .arrow_io import update_tokens_sha256
from .index_split import DocumentIndex, IndexReader, gather_unmapped, split_reader
from .manifest import CorpusError, Manifest, read_manifest, tokenizer_file_sha256
from .mixture import DeviationSpread


def verify_corpus(corpus_dir: str | os.PathLike, check_tokens: bool = True) -> dict[str, Any]:
    """Re-check a corpus folder; CorpusError naming the file on the first problem, else statistics.

    Checks: the manifest's schema and paths, the tokenizer file's sha256, every Arrow file's sha256,
    schema and token count. With `check_tokens` it also scans the tokens: every id is in [0, vocab_size),
    each split's stream hashes to its tokens_sha256 (what digest() stands for), and a split of n documents
    holds at least n eod ids and ends with one, and a split of tokens has a document (each document is followed
    by eod_id; the text itself may contain the eod piece, so more are allowed). A mixture's record is checked
    against its documents file (check_mixture).

    An index split (`mix --index`) is read through its sources: opening it checks each source's manifest
    digest and the index's sha256, and every source file's sha256 as it is touched; its tokens_sha256 is
    the index's hash (checked when the manifest is read), so the scan instead checks that every document
    starts where a source document starts and ends with eod_id. Every split's stream hash is returned as
    `stream_sha256` (for an index split: what the same mixture copied would record as tokens_sha256).

    A mixture's documents file (GBs at 100B tokens) is read once: mapped, hashed and checked as one
    DocumentIndex, whose views every check of it then reads (the record, the eods where documents end, the
    index split's reader).
    """
    corpus_dir = Path(corpus_dir)
    manifest = read_manifest(corpus_dir)
    tok = manifest.tokenizer
    tok_path = corpus_dir / tok.file
    if (got := tokenizer_file_sha256(corpus_dir, tok)) != tok.sha256:
        raise CorpusError(f"{tok_path}: sha256 {got[:12]}... differs from the manifest's {tok.sha256[:12]}...: "
                          "this is not the tokenizer the corpus was made with")
    stats: dict[str, Any] = {"digest": manifest.digest(), "vocab_size": tok.vocab_size, "dtype": manifest.dtype,
                             "splits": {}}
    # Opened once for every check of it; unmapped with its last view when verify returns.
    documents = DocumentIndex(corpus_dir, manifest, verify=True) if manifest.mixture is not None else None
    if documents is not None:
        check_mixture(corpus_dir, manifest, documents)
    for name, split in manifest.splits.items():
        s: dict[str, Any] = {"n_tokens": split.n_tokens, "n_documents": split.n_documents,
                             "n_bytes": split.n_bytes, "n_chars": split.n_chars, "n_files": len(split.files)}
        # A mixture's train documents must each end with eod_id where the documents file says they end.
        doc_ends = _DocumentEnds(documents) if (documents is not None and name == "train" and check_tokens) else None
        with split_reader(corpus_dir, manifest, name, verify=True,
                          documents=documents if name == "train" else None) as reader:
            counts = np.zeros(tok.vocab_size, dtype=np.int64) if check_tokens else None
            tokens_hash = hashlib.sha256()
            last = None
            reader_pos = 0
            if isinstance(reader, IndexReader):
                pieces = [(corpus_dir / manifest.mixture.documents_file, 0, split.n_tokens)]
                if counts is None:
                    reader.open_range(0, split.n_tokens)  # every source file it reads from, verified
                else:
                    _check_index_documents(reader, tok.eod_id)
            else:
                pieces = [(corpus_dir / e.path, e.first_token, e.first_token + e.n_tokens) for e in split.files]
            for path, first, stop in pieces:
                # One record batch (index: one gathered chunk) at a time: memory stays flat for any size.
                for tokens in reader.chunks(first, stop):
                    if counts is None:
                        break  # opening the file (first chunk) verified its checksum, schema and count
                    lo, hi = int(tokens.min()), int(tokens.max())
                    if lo < 0 or hi >= tok.vocab_size:
                        bad = lo if lo < 0 else hi
                        raise CorpusError(f"{path}: token id {bad} is outside [0, {tok.vocab_size}) of the tokenizer")
                    counts += np.bincount(tokens, minlength=tok.vocab_size)
                    if doc_ends is not None:
                        inside = doc_ends.until(reader_pos + len(tokens)) - 1 - reader_pos  # the chunk's eods
                        if len(inside) and np.any(tokens[inside] != tok.eod_id):
                            at = reader_pos + int(inside[np.argmax(tokens[inside] != tok.eod_id)])
                            raise CorpusError(f"{corpus_dir / manifest.mixture.documents_file}: a document ends at "
                                              f"train token {at + 1}, but token {at} is not eod_id {tok.eod_id}")
                    reader_pos += len(tokens)
                    update_tokens_sha256(tokens_hash, tokens, manifest.dtype)
                    last = int(tokens[-1])
                    # Its pages leave the resident set: mapped, a split of 100 GB would show as 100 GB of RSS.
                    reader.release(reader_pos - len(tokens), reader_pos)
        if counts is not None:
            s["stream_sha256"] = got = tokens_hash.hexdigest()
            if split.index is None and got != split.tokens_sha256:
                raise CorpusError(f"{corpus_dir / 'manifest.json'}: split '{name}': its tokens hash to {got[:12]}... "
                                  f"but tokens_sha256 is {split.tokens_sha256[:12]}...: the manifest does not describe "
                                  "these tokens; re-run prepare")
            n_eod = int(counts[tok.eod_id])
            if split.n_tokens and not split.n_documents:  # the end check below counts on documents to check it
                raise CorpusError(f"{corpus_dir / 'manifest.json'}: split '{name}' holds {split.n_tokens} tokens but "
                                  "n_documents is 0: every token belongs to a document, which ends with eod_id; the "
                                  "manifest does not describe these tokens, re-run prepare")
            if n_eod < split.n_documents or (split.n_documents and last != tok.eod_id):
                where = corpus_dir / split.files[-1].path if split.files else corpus_dir / "manifest.json"
                raise CorpusError(f"{where}: split '{name}' has {split.n_documents} documents but {n_eod} eod ids "
                                  f"(id {tok.eod_id}) and ends with {last}: every document must end with eod_id")
            s.update(n_eod=n_eod, n_distinct=int(np.count_nonzero(counts)))
        stats["splits"][name] = s
    return stats


class _DocumentEnds:
    """A mixture's document stops handed out in stream order, batch by batch: until(end) gives the stops
    <= end not handed out yet. Views of the documents file's mapping, checked when it was opened."""

    def __init__(self, documents: DocumentIndex):
        self._batches = iter(documents.stops)
        self._pending = np.empty(0, dtype=np.int64)

    def until(self, end: int) -> np.ndarray:
        pieces = []
        while True:
            n = int(np.searchsorted(self._pending, end, side="right"))
            pieces.append(self._pending[:n])
            if n < len(self._pending):
                self._pending = self._pending[n:]
                break
            self._pending = next(self._batches, None)
            if self._pending is None:
                self._pending = np.empty(0, dtype=np.int64)
                break
        return np.concatenate(pieces)


def _check_index_documents(reader: IndexReader, eod_id: int) -> None:
    """Every document of an index split starts where a document of its source starts (at 0 or right after
    an eod of the source); with the scan's check that it ends with eod_id, each is a whole source document.
    Vectorized gathers of one token per document that unmap what they map as they go (gather_unmapped): a token
    before every document reads every page of the sources, and all of them stayed resident (382 MiB of a 400 MB
    mixture's sources), with the documents file's (unmapped after each of its batches)."""
    for sources, source_starts in zip(reader.documents.sources, reader.documents.source_starts):
        for k, source in enumerate(reader.sources):
            starts = np.sort(source_starts[(sources == k) & (source_starts > 0)])  # [d_k]
            if not len(starts):
                continue
            if starts[-1] > source.n_tokens:
                raise CorpusError(f"{reader.documents.path}: a document of source {k} starts past its source's "
                                  f"{source.n_tokens} tokens; re-run `python -m data_prep mix --index`")
            before = gather_unmapped(source, starts - 1, starts)  # [d_k]: the source token before each document
            if np.any(before != eod_id):
                at = int(starts[np.argmax(before != eod_id)])
                raise CorpusError(f"{reader.documents.path}: a document starts at token {at} of source "
                                  f"'{reader.source_refs[k]}', which is not the start of one of its documents")
        reader.documents.release()  # the batch's own pages (17 bytes per document), read


def check_mixture(corpus_dir: Path, manifest: Manifest, documents: DocumentIndex | None = None) -> None:
    """The mixture record against its documents file: per source its tokens, documents, share, epochs and
    deviation spread; the weights sum to 1; every source's held-out parts are splits. One pass over the
    documents file, opened here (its sha256, schema and stops checked) unless the caller opened it."""
    mix = manifest.mixture
    where = corpus_dir / "manifest.json"
    n_tokens = manifest.splits["train"].n_tokens
    tokens = np.zeros(len(mix.sources), dtype=np.int64)  # [K]
    docs = np.zeros(len(mix.sources), dtype=np.int64)  # [K]
    spread = DeviationSpread([s.weight for s in mix.sources])
    prev = 0
    if documents is None:
        documents = DocumentIndex(corpus_dir, manifest, verify=True)
    for stops, sources in zip(documents.stops, documents.sources):
        lengths = np.diff(stops, prepend=prev)  # [c]
        tokens += np.bincount(sources, weights=lengths, minlength=len(mix.sources)).astype(np.int64)
        docs += np.bincount(sources, minlength=len(mix.sources))
        spread.add(stops, sources)
        prev = int(stops[-1])
        documents.release()  # the batch's pages, read: not held for the rest of verify
    spreads = spread.result()
    if abs(sum(s.weight for s in mix.sources) - 1.0) > 1e-9:
        raise CorpusError(f"{where}: mixture weights sum to {sum(s.weight for s in mix.sources)}, not 1")
    if int(docs.sum()) != manifest.splits["train"].n_documents:
        raise CorpusError(f"{where}: the documents file lists {int(docs.sum())} documents, splits.train.n_documents "
                          f"is {manifest.splits['train'].n_documents}")
    for k, s in enumerate(mix.sources):
        got = {"tokens": int(tokens[k]), "documents": int(docs[k]), "deviation_spread": spreads[k]}
        for key, value in got.items():
            if getattr(s, key) != value:
                raise CorpusError(f"{where}: mixture source '{s.name}' records {key} {getattr(s, key)}, its "
                                  f"documents file gives {value}; re-run `python -m data_prep mix`")
        for key, value in (("share", tokens[k] / n_tokens), ("epochs", tokens[k] / s.source_tokens)):
            if not np.isclose(getattr(s, key), value, rtol=1e-9, atol=0):
                raise CorpusError(f"{where}: mixture source '{s.name}' records {key} {getattr(s, key)}, its "
                                  f"tokens give {value}; re-run `python -m data_prep mix`")
    names = {s.name for s in mix.sources}
    for split in manifest.splits:
        if "/" in split and split.split("/", 1)[1] not in names:
            raise CorpusError(f"{where}: split '{split}' names no source of the mixture ({', '.join(sorted(names))})")
