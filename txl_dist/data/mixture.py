"""A mixture's documents file: which source each train document came from, and the shares it implies.

`python -m data_prep mix` writes `mixture/train-documents.arrow` beside the tokens: one row per document of
the train split in stream order, `stop` (int64, where the document ends in the stream, its eod included)
and `source` (uint8, the index of its source in manifest.mixture.sources). A copied mixture's loader never
reads it (the mixture is read like any corpus); verify checks the mixture record against it and inspect
shows the sources' shares per rank block from it, both through document_batches: memory-mapped record
batches (flat memory for any number of documents; verify maps and hashes it once for all its checks,
index_split.DocumentIndex). It costs 9 bytes per document.

A mixture made with `mix --index` stores no train tokens: its documents file has a third column,
`source_start` (int64, where the document starts in its source's train stream; 17 bytes per document),
and IS the train split (index_split.IndexReader reads it memory-mapped).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from ..errors import one_line
from .arrow_io import drop_pages
from .manifest import CorpusError, Manifest, is_readable_file, sha256_file

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
    """(stops int64 [n_docs], sources uint8 [n_docs]) of a mixture, checked against the manifest's sha256
    (whole columns in memory: for tests and small mixtures; verify and inspect read document_batches)."""
    return read_documents_table(corpus_dir, manifest)[:2]


def read_documents_table(corpus_dir: str | os.PathLike, manifest: Manifest) -> tuple[np.ndarray, ...]:
    """read_documents, plus source_start int64 [n_docs] for an index mixture."""
    batches = [[c for c in batch if c is not None] for batch in document_batches(corpus_dir, manifest)]
    return tuple(np.concatenate(column) for column in zip(*batches))


def document_batches(corpus_dir: str | os.PathLike, manifest: Manifest, *, verify: bool = True
                     ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """The mixture's documents file record batch by record batch, memory-mapped (flat memory for any number
    of documents): (stops int64 [c], sources uint8 [c], source_starts int64 [c] for an index, else None).

    Checked on the way: the file's sha256 against the manifest (first, with `verify`), its schema, stops that
    increase across batches and end at the train split's n_tokens, source ids below the number of sources,
    source starts >= 0. A failed check raises CorpusError when it is met, so a consumer may have seen the
    batches before it."""
    mix = manifest.mixture
    if mix is None:
        raise CorpusError(f"{corpus_dir}: not a mixture (its manifest has no 'mixture' record)")
    path = Path(corpus_dir) / mix.documents_file
    schema = documents_schema(manifest)
    rerun = "re-run `python -m data_prep mix" + (" --index`" if schema is INDEX_SCHEMA else "`")
    if not is_readable_file(path):
        raise CorpusError(f"{path}: the mixture's documents file is missing; {rerun}")
    n_tokens = manifest.splits["train"].n_tokens
    try:
        mapped = pa.memory_map(str(path), "r")
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable Arrow IPC file ({one_line(e)}); {rerun}") from None
    with mapped:  # closing it leaves the yielded views valid: they keep the mapping alive
        # Hashed from the mapping the batches are then read from: the file (GBs at 100B tokens) is read once.
        # Each hashed chunk's pages are unmapped at once: the hash read the whole file, which stayed resident
        # (a 46 MiB file of a 400 MB index mixture: verify's resident set grew by all of it before any check).
        if verify and (got := sha256_file(path, mapped=(whole := mapped.read_buffer()),
                                          release=_unmapping(whole))) != mix.documents_sha256:
            raise CorpusError(f"{path}: sha256 {got[:12]}... differs from the manifest's "
                              f"{mix.documents_sha256[:12]}...: the file is corrupt or replaced; {rerun}")
        try:
            reader = pa.ipc.open_file(mapped)
        except (pa.ArrowException, OSError) as e:
            raise CorpusError(f"{path}: not a readable Arrow IPC file ({one_line(e)}); {rerun}") from None
        if reader.schema != schema:
            raise CorpusError(f"{path}: columns are {reader.schema.names}, expected {', '.join(schema.names)} "
                              f"(int64, uint8[, int64]); {rerun}")
        last = 0
        for i in range(reader.num_record_batches):
            try:
                batch = reader.get_batch(i)
                batch.validate()
                columns = [batch.column(j).to_numpy(zero_copy_only=True) for j in range(len(schema))]
            except (pa.ArrowException, OSError) as e:
                raise CorpusError(f"{path}: not a readable Arrow IPC file ({one_line(e)}); {rerun}") from None
            stops, sources = columns[0], columns[1]  # [c], [c]
            if not len(stops):
                continue
            if np.any(np.diff(stops, prepend=last) <= 0):
                raise CorpusError(f"{path}: document stops must increase and end at the train split's {n_tokens} "
                                  "tokens")
            if np.any(sources >= len(mix.sources)):
                raise CorpusError(f"{path}: a source id is not below the mixture's {len(mix.sources)} sources")
            source_starts = columns[2] if len(columns) > 2 else None
            if source_starts is not None and np.any(source_starts < 0):
                raise CorpusError(f"{path}: a document starts before its source's stream; {rerun}")
            last = int(stops[-1])
            yield stops, sources, source_starts
        if last != n_tokens:
            raise CorpusError(f"{path}: document stops must increase and end at the train split's {n_tokens} tokens")


def _unmapping(whole: pa.Buffer):
    """release(start, stop) for sha256_file: drop_pages of those bytes of `whole`, a file's whole mapping."""
    region = (whole.address, whole.address + whole.size)
    return lambda start, stop: drop_pages(whole.address + start, whole.address + stop, region)


def source_tokens_at(corpus_dir: str | os.PathLike, manifest: Manifest, positions: list[int]) -> np.ndarray:
    """int64 [len(positions), n_sources]: tokens of each source in the stream's [0, p) for every p in positions
    (one streaming pass over the documents file)."""
    n_sources = len(manifest.mixture.sources)
    order = np.argsort(positions, kind="stable")
    wanted = np.asarray(positions, dtype=np.int64)[order]  # [P] ascending
    out = np.zeros((len(wanted), n_sources), dtype=np.int64)
    totals = np.zeros(n_sources, dtype=np.int64)  # tokens of each source before the batch
    prev, p = 0, 0
    for stops, sources, _ in document_batches(corpus_dir, manifest, verify=False):
        lengths = np.diff(stops, prepend=prev)  # [c]
        hi = int(np.searchsorted(wanted, stops[-1], side="right"))  # positions inside this batch: (prev, last]
        if hi > p:
            at = wanted[p:hi]  # [q]
            doc = np.searchsorted(stops, at, side="right")  # [q]: the document holding each position (or c)
            for k in range(n_sources):
                cum = np.concatenate([[0], np.cumsum(np.where(sources == k, lengths, 0))])  # [c + 1]
                out[p:hi, k] = totals[k] + cum[doc]
            inside = doc < len(stops)  # a position inside a document counts that document's part before it
            starts = stops - lengths  # [c]
            rows = np.flatnonzero(inside)
            out[p + rows, sources[doc[rows]]] += at[rows] - starts[doc[rows]]
            p = hi
        totals += np.bincount(sources, weights=lengths, minlength=n_sources).astype(np.int64)
        prev = int(stops[-1])
    out[p:] = totals  # positions at or past the end
    result = np.empty_like(out)
    result[order] = out
    return result


class DeviationSpread:
    """Per source, max - min over positions t of (its tokens in [0, t) - weight * t), fed in document blocks.

    The deviation is linear inside a document, so its extremes lie at document boundaries (and t = 0): the
    exact bound on how far any window's share can stray from the weight, times the window's length. `mix`
    (while writing) and verify (check_mixture, a batch of the documents file at a time) both use this
    class, so they agree to the token.
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
