"""A mixture's documents file: which source each train document came from, and the shares it implies.

`python -m data_prep mix` writes `mixture/train-documents.arrow` beside the tokens: one row per document of
the train split in stream order, `stop` (int64, where the document ends in the stream, its eod included)
and `source` (uint8, the index of its source in manifest.mixture.sources). A copied mixture's loader never
reads it (the mixture is read like any corpus); verify checks the mixture record against it and inspect
shows the sources' shares per rank block from it. It costs 9 bytes per document.

A mixture made with `mix --index` stores no train tokens: its documents file has a third column,
`source_start` (int64, where the document starts in its source's train stream; 17 bytes per document),
and IS the train split (index_split.IndexReader reads it memory-mapped).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..errors import one_line
from .manifest import CorpusError, Manifest, sha256_file

DOCUMENTS_FILE = "mixture/train-documents.arrow"
DOCUMENTS_SCHEMA = pa.schema([("stop", pa.int64()), ("source", pa.uint8())])
INDEX_SCHEMA = pa.schema([("stop", pa.int64()), ("source", pa.uint8()), ("source_start", pa.int64())])
"""The documents file of an index mixture (`mix --index`): also where each document starts in its source."""


def documents_schema(manifest: Manifest) -> pa.Schema:
    """The documents file's schema for this manifest: INDEX_SCHEMA when the train split is an index."""
    train = manifest.splits.get("train")
    return INDEX_SCHEMA if train is not None and train.index is not None else DOCUMENTS_SCHEMA


class DocumentsWriter:
    """Writes the documents file a block of documents at a time; `close()` returns its sha256. With `index`
    it also writes each document's start in its source (INDEX_SCHEMA)."""

    def __init__(self, path: str | os.PathLike, index: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.schema = INDEX_SCHEMA if index else DOCUMENTS_SCHEMA
        self._file = pa.OSFile(str(self.path), "wb")
        self._writer = pa.ipc.new_file(self._file, self.schema)

    def write(self, stops: np.ndarray, sources: np.ndarray, source_starts: np.ndarray | None = None) -> None:
        """Append documents: where each ends in the stream, its source id (and, for an index, where it
        starts in its source's train stream)."""
        columns = [pa.array(np.asarray(stops, dtype=np.int64)), pa.array(np.asarray(sources, dtype=np.uint8))]
        if (source_starts is not None) != (self.schema is INDEX_SCHEMA):
            raise ValueError(f"{self.path}: source_starts are written exactly when the file is an index")
        if source_starts is not None:
            columns.append(pa.array(np.asarray(source_starts, dtype=np.int64)))
        self._writer.write_batch(pa.record_batch(columns, schema=self.schema))

    def close(self) -> str:
        self._writer.close()
        self._file.close()
        return sha256_file(self.path)


def read_documents(corpus_dir: str | os.PathLike, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """(stops int64 [n_docs], sources uint8 [n_docs]) of a mixture, checked against the manifest's sha256."""
    return read_documents_table(corpus_dir, manifest)[:2]


def read_documents_table(corpus_dir: str | os.PathLike, manifest: Manifest) -> tuple[np.ndarray, ...]:
    """read_documents, plus source_start int64 [n_docs] for an index mixture (whole file in memory: for
    verify and inspect; the loader maps it instead, index_split.DocumentIndex)."""
    mix = manifest.mixture
    if mix is None:
        raise CorpusError(f"{corpus_dir}: not a mixture (its manifest has no 'mixture' record)")
    path = Path(corpus_dir) / mix.documents_file
    if not path.is_file():
        raise CorpusError(f"{path}: the mixture's documents file is missing; re-run `python -m data_prep mix`")
    if (got := sha256_file(path)) != mix.documents_sha256:
        raise CorpusError(f"{path}: sha256 {got[:12]}... differs from the manifest's {mix.documents_sha256[:12]}...: "
                          "the file is corrupt or replaced; re-run `python -m data_prep mix`")
    try:
        with pa.OSFile(str(path), "rb") as f:
            table = pa.ipc.open_file(f).read_all()
    except pa.ArrowException as e:
        raise CorpusError(f"{path}: not a readable Arrow IPC file ({one_line(e)})") from None
    schema = documents_schema(manifest)
    if table.schema != schema:
        raise CorpusError(f"{path}: columns are {table.schema.names}, expected {', '.join(schema.names)} "
                          "(int64, uint8[, int64]); re-run `python -m data_prep mix`")
    stops = table.column("stop").to_numpy()  # [n_docs]
    sources = table.column("source").to_numpy()  # [n_docs]
    n_tokens = manifest.splits["train"].n_tokens
    if len(stops) == 0 or stops[-1] != n_tokens or np.any(np.diff(stops, prepend=0) <= 0):
        raise CorpusError(f"{path}: document stops must increase and end at the train split's {n_tokens} tokens")
    if np.any(sources >= len(mix.sources)):
        raise CorpusError(f"{path}: a source id is not below the mixture's {len(mix.sources)} sources")
    if schema is INDEX_SCHEMA:
        source_starts = table.column("source_start").to_numpy()  # [n_docs]
        if np.any(source_starts < 0):
            raise CorpusError(f"{path}: a document starts before its source's stream; re-run `python -m data_prep mix`")
        return stops, sources, source_starts
    return stops, sources


def source_tokens_before(stops: np.ndarray, sources: np.ndarray, n_sources: int, position: int) -> np.ndarray:
    """int64 [n_sources]: tokens of each source in the stream's [0, position) (one pass; for a few positions)."""
    doc = int(np.searchsorted(stops, position, side="right"))  # the document holding `position` (or n_docs)
    lengths = np.diff(stops[:doc], prepend=0)  # [doc]
    out = np.bincount(sources[:doc], weights=lengths, minlength=n_sources).astype(np.int64)  # [K]
    if doc < len(stops):
        out[sources[doc]] += position - (int(stops[doc - 1]) if doc else 0)
    return out


class DeviationSpread:
    """Per source, max - min over positions t of (its tokens in [0, t) - weight * t), fed in document blocks.

    The deviation is linear inside a document, so its extremes lie at document boundaries (and t = 0): the
    exact bound on how far any window's share can stray from the weight, times the window's length. `mix`
    (while writing) and verify (deviation_spread) both use this class, so they agree to the token.
    """

    def __init__(self, weights: list[float]):
        self.weights = np.asarray(weights, dtype=np.float64)  # [K]
        self.total = np.zeros(len(weights), dtype=np.int64)  # [K] tokens of each source so far
        self.lo, self.hi = np.zeros(len(weights)), np.zeros(len(weights))  # t = 0: deviation 0
        self.prev = 0

    def add(self, stops: np.ndarray, sources: np.ndarray) -> None:
        """The next documents: where each ends in the stream ([c], increasing) and its source ([c])."""
        if not len(stops):
            return
        lengths = np.diff(stops, prepend=self.prev)  # [c]
        for k, w in enumerate(self.weights):
            cum = self.total[k] + np.cumsum(np.where(sources == k, lengths, 0))  # [c] tokens of k up to each stop
            dev = cum - w * stops  # [c]
            self.lo[k], self.hi[k] = min(self.lo[k], dev.min()), max(self.hi[k], dev.max())
            self.total[k] = cum[-1]
        self.prev = int(stops[-1])

    def result(self) -> list[int]:
        """The spreads, rounded up to whole tokens."""
        return [int(np.ceil(x - 1e-9)) for x in self.hi - self.lo]


def deviation_spread(stops: np.ndarray, sources: np.ndarray, weights: list[float],
                     chunk_docs: int = 1 << 20) -> list[int]:
    """DeviationSpread over all documents at once (in chunks: flat memory)."""
    spread = DeviationSpread(weights)
    for a in range(0, len(stops), chunk_docs):
        spread.add(stops[a:a + chunk_docs], sources[a:a + chunk_docs])
    return spread.result()
