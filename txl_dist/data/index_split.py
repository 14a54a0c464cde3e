"""Index splits: a mixture's train stream read through its documents file from its sources, and the one
factory that picks a split's reader.

`python -m data_prep mix --index` writes no train tokens. The mixture's documents file
(`mixture/train-documents.arrow`, INDEX_SCHEMA) lists per document in stream order where it ends in the
mixture's stream (`stop`), its source and where it starts in that source's train stream (`source_start`);
the manifest's `splits.train.index.sources` names each source's corpus folder and the mixture record its
manifest digest. IndexReader gives that stream the interface of TokenReader (read, chunks, open_range,
files_opened, release, check_unchanged, close, n_tokens, dtype), so the loader, verify, inspect and the
unigram baseline read an index split as they read files. Everything stays memory-mapped: the documents file
(a rank's reads touch the pages of the documents in its block and a binary search's few others) and the
sources' token files; a gathered read unmaps the sources' pages as it goes (gather_unmapped), release()
what the reads since the last one mapped besides, so that a rank's resident set does not fill up with the
sources.

Why the documents file is the index: it is already written (its stops and sources are what verify and
inspect check), and one more column is all it needs; the stop column answers "which documents does the
window [a, b) overlap" by binary search, so no per-document table is built in memory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from .arrow_io import (MAPPED_AROUND_BYTES, StreamReader, TokenReader, check_not_shrunk, drop_pages, file_identity,
                       mapped_region, mapped_span)
from .manifest import CorpusError, Manifest, read_manifest
from .mixture import document_batches

READ_CHUNK_TOKENS = 1 << 20
"""Tokens per piece of chunks() (and of open_range's walk over the documents): bounded memory."""
GATHER_MAPPED_BYTES = 1 << 25
"""How much of a source gather_unmapped lets one group of its ranges map (MAPPED_AROUND_BYTES either side of
each range, or the gap to the range before) before it unmaps the group's span: a process's resident set holds
at most this (+ 2 x MAPPED_AROUND_BYTES) of the sources however many documents a read gathers. Measured on two
115 MB sources of 11-token documents, reading 32 K-token pieces (the loader's): 4.4 M tokens per CPU second as
when a read unmapped the sources only at its end, peak RSS 34 MiB above the start, from 214 (8 MiB: 3.3-3.6 M,
11 MiB; 16 MiB: 4.0 M, 19 MiB; more groups, each a gather call)."""


def split_reader(corpus_dir: str | os.PathLike, manifest: Manifest, split: str, *, verify: bool = True,
                 documents: DocumentIndex | None = None) -> TokenReader | IndexReader:
    """The reader of a corpus split: IndexReader for an index split (`mix --index`), else TokenReader.
    `documents`: the mixture's documents file already opened (and checked) by the caller, for an index split.

    Every reader of a corpus split is made here, so a new kind of split is one branch, not one per caller.
    """
    entry = manifest.splits.get(split)
    if entry is not None and entry.index is not None:
        return IndexReader(corpus_dir, manifest, split, verify=verify, documents=documents)
    return TokenReader(corpus_dir, manifest, split, verify=verify)  # names an unknown split


def split_files(corpus_dir: str | os.PathLike, manifest: Manifest, split: str) -> list[Path]:
    """Every file a reader of `split` may open: the split's token files; for an index split, the mixture's
    documents file and its sources' train files (their manifests are read, not checked: the reader checks)."""
    corpus_dir = Path(corpus_dir)
    entry = manifest.splits[split]
    if entry.index is None:
        return [corpus_dir / f.path for f in entry.files]
    files = [corpus_dir / manifest.mixture.documents_file]
    for ref in entry.index.sources:
        folder = source_folder(corpus_dir, ref)
        files += split_files(folder, read_manifest(folder), "train")
    return files


def source_folder(corpus_dir: str | os.PathLike, ref: str) -> Path:
    """Where an index source lives: `ref` as written in splits.train.index.sources, relative to the corpus."""
    return Path(ref) if Path(ref).is_absolute() else Path(corpus_dir) / ref


def source_reference(corpus_dir: str | os.PathLike, source_dir: str | os.PathLike) -> str:
    """How a mixture at corpus_dir names a source folder: relative when the two share a folder below the
    filesystem root (moving that common folder, or the whole tree, keeps the mixture working), absolute
    otherwise (the mixture can then move on its own while the source stays where it is)."""
    out, src = Path(corpus_dir).resolve(), Path(source_dir).resolve()
    common = Path(os.path.commonpath([out, src]))
    if common == Path(common.anchor):
        return str(src)
    return Path(os.path.relpath(src, out)).as_posix()


def gather_unmapped(source: TokenReader, starts: np.ndarray, stops: np.ndarray, out: np.ndarray | None = None,
                    out_at: np.ndarray | None = None) -> np.ndarray:
    """source.gather of the ranges [starts[i], stops[i]) (same arguments and result), in the order of their
    starts, in groups of GATHER_MAPPED_BYTES of the source, each group's pages unmapped before the next.

    Why: a page fault maps up to MAPPED_AROUND_BYTES around the token it reads, so ranges shuffled across a
    source (an index split's documents) map most of it: one 1 M-token read of 11-token documents mapped both
    of its 115 MB sources, and verify's peak resident set grew to the sources' size. In the order of their
    starts, what a group maps lies within MAPPED_AROUND_BYTES of its first and last range (one madvise for
    the group) and every page is faulted in at most once per call; a group's budget counts per range its
    tokens and the gap to the range before, up to 2 x MAPPED_AROUND_BYTES (what it may map anew), so that
    ranges far apart make groups of a few ranges and dense ones groups of thousands."""
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)  # [n], [n]
    if out is None:
        lengths = stops - starts  # [n]
        out = np.empty(max(0, int(lengths.sum())), dtype=source.dtype)  # [sum of lengths]
        out_at = np.cumsum(lengths) - lengths  # [n]
    if not len(starts):
        return out
    order = np.argsort(starts, kind="stable")  # [n]
    starts, stops, out_at = starts[order], stops[order], np.asarray(out_at)[order]
    itemsize = np.dtype(source.dtype).itemsize
    around = MAPPED_AROUND_BYTES // itemsize  # tokens a fault may map on either side
    gap = starts - np.concatenate([[starts[0] - 2 * around], stops[:-1]])  # [n]: from the range before
    new = np.clip(gap, 0, 2 * around) + (stops - starts)  # [n]: tokens a range may map that the one before did not
    group = np.cumsum(new) // (GATHER_MAPPED_BYTES // itemsize)  # [n], ascending
    bounds = [0, *(np.flatnonzero(np.diff(group)) + 1).tolist(), len(starts)]
    for a, b in zip(bounds, bounds[1:]):
        source.gather(starts[a:b], stops[a:b], out=out, out_at=out_at[a:b])  # IndexError for a bad range
        source.release(max(0, int(starts[a]) - around), min(source.n_tokens, int(stops[a:b].max()) + around))
    return out


class DocumentIndex:
    """The documents file of a mixture, memory-mapped: per record batch, views of its columns (source_starts:
    None per batch for a copied mixture, whose file has no such column; documents() needs them).

    mix writes one record batch per round of its schedule, so the lookup is two binary searches: the batch
    (by its last stop, one small array in memory), then the documents inside it. The file is opened and
    checked by mixture.document_batches (sha256 with `verify`, schema, stops, source ids), whose views stay
    valid after its generator ends (they keep the mapping alive). verify opens one for all its checks and
    hands it to the IndexReader, so that the file is read once.
    """

    def __init__(self, corpus_dir: Path, manifest: Manifest, verify: bool):
        self.path = corpus_dir / manifest.mixture.documents_file
        self.stops, self.sources, self.source_starts = [], [], []  # [n_batches][docs of the batch] each
        self._region = (0, 0)  # the file's mapping (document_batches made it): what drop_pages may drop
        for stops, sources, source_starts in document_batches(corpus_dir, manifest, verify=verify):
            self.stops.append(stops)
            self.sources.append(sources)
            self.source_starts.append(source_starts)
            if self._region == (0, 0):
                self._region = mapped_region(self.path, stops.ctypes.data)
            # Checked (every stop read): unmapped, or opening would hold the whole file resident (17 bytes
            # per document: GBs at 100B tokens of short documents) until the first read-ahead piece.
            drop_pages(*mapped_span([v for v in (stops, sources, source_starts) if v is not None]), self._region)
        self.batch_ends = np.array([s[-1] for s in self.stops], dtype=np.int64)  # [n_batches]
        self._identity = file_identity(self.path, os.path.getsize(self.path))
        self.release()  # what the sha256 (with `verify`) read, and the framing between the batches

    def release(self) -> None:
        """Unmap this process's pages of the whole file (drop_pages; a lookup faults in the few it reads
        again): one call however many documents were read, and no page left mapped around them."""
        drop_pages(*self._region, self._region)

    def check_unchanged(self) -> None:
        """CorpusFault when the file was cut shorter in place since it was opened (a lookup past its new end
        would be SIGBUS)."""
        check_not_shrunk(self._identity)

    def documents(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The documents overlapping stream tokens [start, stop) (start < stop), in order: where each starts
        and ends in the stream, its source and where it starts in the source (int64/uint8 arrays [d])."""
        first_batch = int(np.searchsorted(self.batch_ends, start, side="right"))
        last_batch = int(np.searchsorted(self.batch_ends, stop - 1, side="right"))
        parts = []
        for b in range(first_batch, last_batch + 1):
            stops = self.stops[b]  # [docs of batch b]
            lo = int(np.searchsorted(stops, start, side="right"))
            hi = int(np.searchsorted(stops, stop - 1, side="right")) + 1
            hi = min(hi, len(stops))
            before = int(stops[lo - 1]) if lo else (int(self.batch_ends[b - 1]) if b else 0)
            doc_stops = stops[lo:hi]  # [d_b]
            doc_starts = np.concatenate([[before], doc_stops[:-1]]).astype(np.int64)  # [d_b]
            parts.append((doc_starts, doc_stops, self.sources[b][lo:hi], self.source_starts[b][lo:hi]))
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))

    def close(self) -> None:
        """Drop the views: the mapping goes with the last of them."""
        self.stops = self.sources = self.source_starts = []
        self._region = (0, 0)  # the addresses may be mapped again, to anything


class IndexReader(StreamReader):
    """TokenReader's interface over an index split: the mixture's stream gathered from its sources.

    Opening checks every source: its folder holds a corpus whose manifest digest is the one recorded at mix
    time (CorpusError, one line naming the source, its path and the fix, when it is missing or changed).
    With `verify` the documents file's sha256 is checked on opening (by the caller, who then hands it in as
    `documents`) and each source file's when first touched, as TokenReader does for its own files.

    read(start, stop) is a zero-copy view when the range lies inside one document (and one record batch of
    its source); otherwise one array gathered per source with TokenReader.gather (vectorized: no Python step
    per document or token).
    """

    def __init__(self, corpus_dir: str | os.PathLike, manifest: Manifest, split: str, *, verify: bool = True,
                 documents: DocumentIndex | None = None):
        super().__init__(corpus_dir, manifest, split, verify)
        mixture = manifest.mixture  # read_manifest guarantees an index split is a mixture's train split
        self.source_refs = list(self.entry.index.sources)
        self.sources: list[TokenReader] = []
        where = self.corpus_dir / "manifest.json"
        for i, (ref, recorded) in enumerate(zip(self.source_refs, mixture.sources)):
            folder = source_folder(self.corpus_dir, ref)
            fix = ("put that corpus back there (or move the mixture and its sources together), or re-run "
                   "`python -m data_prep mix --index`")
            if not os.path.lexists(folder):  # read_manifest's fix (prepare a corpus there) would not be this one
                raise CorpusError(f"{where}: index source '{recorded.name}' (splits.train.index.sources[{i}] "
                                  f"'{ref}') is not at {folder} (nothing there); {fix}")
            try:
                source_manifest = read_manifest(folder)
            except CorpusError as e:
                raise CorpusError(f"{where}: index source '{recorded.name}' (splits.train.index.sources[{i}] "
                                  f"'{ref}') cannot be opened at {folder}: {e}; {fix}") from None
            if (got := source_manifest.digest()) != recorded.manifest_digest:
                raise CorpusError(f"{where}: index source '{recorded.name}' at {folder} has manifest digest "
                                  f"{got[:12]}..., the mixture was made from {recorded.manifest_digest[:12]}...: the "
                                  f"source changed since; {fix}")
            self.sources.append(TokenReader(folder, source_manifest, "train", verify=verify))
        # A documents file handed in was opened and checked by the caller, who also closes it.
        self._owns_documents = documents is None
        self.documents = DocumentIndex(self.corpus_dir, manifest, verify) if documents is None else documents
        self._documents_file = mixture.documents_file
        self._read_since_release: set[int] = set()  # sources read() returned a view of since release()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream, in the file dtype (a view when possible)."""
        self._check_range(start, stop)
        if start == stop:
            return np.empty(0, dtype=self.dtype)
        doc_starts, _, sources, from_, to, at = self._ranges(start, stop)
        try:
            if len(doc_starts) == 1:
                k = int(sources[0])
                self._read_since_release.add(k)
                out = self.sources[k].read(int(from_[0]), int(to[0]))
            else:
                out = np.empty(stop - start, dtype=self.dtype)  # [stop - start]
                for k in np.unique(sources).tolist():
                    sel = np.flatnonzero(sources == k)
                    # `out` is a copy: what the gathers map (pages around thousands of documents, most of the
                    # sources) goes as they go, not at release(), which a caller of many reads may call once
                    # after them (the start-up sample), nor after the whole read (verify's 1 M-token chunks).
                    gather_unmapped(self.sources[k], from_[sel], to[sel], out=out, out_at=at[sel])
        except IndexError:
            raise CorpusError(f"{self.documents.path}: a document of tokens [{start}, {stop}) lies outside its "
                              "source's train stream: the index does not fit its sources; re-run "
                              "`python -m data_prep mix --index`") from None
        return out

    def chunks(self, start: int, stop: int) -> Iterator[np.ndarray]:
        """Tokens [start, stop) as consecutive arrays of at most READ_CHUNK_TOKENS (bounded memory)."""
        self._check_range(start, stop)
        for a in range(start, stop, READ_CHUNK_TOKENS):
            yield self.read(a, min(stop, a + READ_CHUNK_TOKENS))

    def open_range(self, start: int, stop: int) -> list[str]:
        """Open (and verify) every source file the documents of [start, stop) read from; returns them as
        '<source folder>/<path>'. A walk over the range's documents in bounded pieces."""
        self._check_range(start, stop)
        touched = [np.zeros(len(r.entry.files) + 1, dtype=np.int64) for r in self.sources]  # [files + 1] each
        file_starts = [np.array([f.first_token for f in r.entry.files], dtype=np.int64) for r in self.sources]
        for a in range(start, stop, 4 * READ_CHUNK_TOKENS):
            _, _, sources, from_, to, _ = self._ranges(a, min(stop, a + 4 * READ_CHUNK_TOKENS))
            for k in np.unique(sources):
                sel = sources == k
                first = np.searchsorted(file_starts[k], from_[sel], side="right") - 1  # [d_k]
                last = np.searchsorted(file_starts[k], to[sel] - 1, side="right") - 1  # [d_k]
                # a document's files are first..last: mark the interval (+1 at first, -1 after last)
                np.add.at(touched[k], first, 1)
                np.add.at(touched[k], last + 1, -1)
            self.documents.release()  # the walk reads the block's documents: not held after it
        opened = []
        for k, reader in enumerate(self.sources):
            for i in np.flatnonzero(np.cumsum(touched[k][:-1]) > 0):
                f = reader.entry.files[i]
                reader.open_range(f.first_token, f.first_token + 1)
                opened.append(f"{self.source_refs[k]}/{f.path}")
        return opened

    def release(self, start: int, stop: int) -> None:
        """Unmap this process's pages of the documents file and of every source file read since the last
        release, whole (see TokenReader.release for why): more than the pages of tokens [start, stop), which
        are among them. Whole files: a source's documents are shuffled across it, so a piece of the stream
        reads a few tokens at hundreds of places of each source, and a fault maps the pages around each
        (fault-around: one piece of 3,000 11-token documents mapped 285 MiB of 385 MB of sources); unmapping
        the documents' own pages left most of that, at one call per document. A page that another stream
        reads next only faults in again. read() unmaps what a gathered read maps as it copies (gather_unmapped)."""
        self._check_range(start, stop)
        self.documents.release()
        for k in self._read_since_release:  # the sources of one-document reads: a gathered read unmapped its own
            self.sources[k].release(0, self.sources[k].n_tokens)  # one call per open file
        self._read_since_release.clear()

    def check_unchanged(self, start: int, stop: int) -> None:
        """CorpusFault (one line) when the documents file, or a source file open in this process, was cut
        shorter in place since it was opened (TokenReader.check_unchanged; a file opened later is checked then).
        Every open source file, not only those the documents of [start, stop) lie in: a piece's documents are
        shuffled across each source (it reads most of its files), and finding them would look the documents up
        a second time per piece, beside read()'s own lookup."""
        self._check_range(start, stop)
        self.documents.check_unchanged()
        for reader in self.sources:
            reader.check_unchanged(0, reader.n_tokens)

    @property
    def files_opened(self) -> list[str]:
        """The documents file, then each source's files opened so far as '<source folder>/<its path>'."""
        return [self._documents_file] + [f"{ref}/{path}" for ref, r in zip(self.source_refs, self.sources)
                                         for path in r.files_opened]

    def close(self) -> None:
        """Unmap the documents file and every source file (arrays returned by read() must not be used after)."""
        for r in self.sources:
            r.close()
        if self._owns_documents:
            self.documents.close()

    def _ranges(self, start: int, stop: int):
        """The documents of [start, stop) clipped to it: (doc starts, doc stops, sources, from, to, at), where
        [from, to) is the piece in the source's stream and `at` its offset in the window."""
        doc_starts, doc_stops, sources, source_starts = self.documents.documents(start, stop)
        lo = np.maximum(doc_starts, start)  # [d]
        hi = np.minimum(doc_stops, stop)  # [d]
        from_ = source_starts + (lo - doc_starts)  # [d]; source ids were checked when the index was opened
        return doc_starts, doc_stops, sources, from_, from_ + (hi - lo), lo - start
