"""Parallel tokenizing: documents -> token ids (each document followed by eod_id), in input order.

The main process reads documents and hands tasks of about `task_bytes` of text to `num_proc` worker
processes (each loads the SentencePiece model once): consecutive small batches are merged (short lines do
not pay the hand-over cost one by one), large batches are split between documents, and a document longer
than PIECE_BYTES is cut into pieces of about that size, each ending just after a newline (or a space) where
the tokenizer allows it (`tokenizer.document_cuts`): the pieces' ids, in order, are exactly the whole
document's ids, and its end-of-document id follows its last piece (docs/corpus_format.md, Long documents,
has the unigram caveat). SentencePiece needs 20-40 bytes of memory per byte of text it encodes at once, so a
worker needs memory for one piece, not for the longest document, and the pieces of one long document are
encoded in parallel.

At most 2 * num_proc tasks are in flight and results are written in submission order, so memory stays
bounded and the output order is the input order whatever the number of workers. Workers are spawned, not
forked: the reading side runs threads (pyarrow, datasets) that a fork could copy mid-lock. A worker exits
when the process that started it is gone (killed by SIGKILL or the OOM killer, which run no cleanup): it
would otherwise wait forever on the pool's pipe, holding its memory (`_exit_with_parent`).
"""
from __future__ import annotations

import array
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sentencepiece as spm

from data_prep.errors import PrepError
from data_prep.tokenizer import document_cuts

PIECE_BYTES = 1 << 20
"""A document longer than this is encoded in pieces of about this size (where the tokenizer allows cuts)."""
ENCODE_BYTES_PER_BYTE = 25
"""SentencePiece's peak memory per byte of text encoded in one call, about (docs/corpus_format.md)."""
WHOLE_DOCUMENT_WARNING_BYTES = 1 << 26
"""A document longer than this that must be encoded whole (its tokenizer allows no cut) is warned about."""

PARENT_POLL_S = 0.5
"""How often a worker checks that the process that started it is still there."""

_worker: dict = {}


@dataclass
class Encoded:
    """The tokens of one task and what they count."""

    tokens: np.ndarray
    """1-D, the file dtype: each document's ids followed by eod_id."""
    n_documents: int
    """Documents ended in this task (a long document's pieces count once, with its last piece)."""
    n_bytes: int
    """UTF-8 bytes of the text."""
    n_chars: int


def _init_worker(model_path: str, eod_id: int, dtype: str, parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        # Ctrl-C in a terminal signals the whole foreground process group: each worker would print a traceback
        # of its KeyboardInterrupt above the job's one-line message. The job answers it: it cancels the tasks
        # and shuts the pool down, which ends the workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with_parent(parent_pid)
    sp = spm.SentencePieceProcessor()
    sp.load(model_path)
    _worker.update(sp=sp, eod_id=eod_id, dtype=np.dtype(dtype), typecode=_TYPECODES[dtype])


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker process when `parent_pid` is no longer its parent (the parent died and the worker was
    re-parented). A killed parent runs no shutdown, and the worker would wait for work on the pool's pipe
    forever, and so would multiprocessing's resource tracker, which exits when the last process holding its
    pipe does. A polling thread rather than prctl(PR_SET_PDEATHSIG): that signal fires when the *thread* that
    started the worker ends, and a pool may start workers from any thread."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # nothing of the worker's is worth cleaning up: the results have nobody to go to

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# array.array converts a list of Python ints to machine integers faster than numpy does
_TYPECODES = {"uint16": "H", "int32": "i"}


def _encode(texts: pa.Array, ends: np.ndarray | None = None) -> Encoded:
    """Encode rows of text: whole documents (ends None) or pieces, row i ending its document where ends[i]."""
    sp, eod_id = _worker["sp"], _worker["eod_id"]
    out = array.array(_worker["typecode"])
    # One row at a time: SentencePiece's list API is slower here, and its threads would compete with the
    # other worker processes.
    for i, text in enumerate(texts.to_pylist()):
        out.extend(sp.encode(text))
        if ends is None or ends[i]:
            out.append(eod_id)
    tokens = np.frombuffer(out, dtype=_worker["dtype"])  # [n_tokens], no copy
    return Encoded(tokens, len(texts) if ends is None else int(np.count_nonzero(ends)),
                   int(pc.sum(pc.binary_length(texts)).as_py() or 0),
                   int(pc.sum(pc.utf8_length(texts)).as_py() or 0))


@dataclass
class _Task:
    """Segments of text of one key gathered for one worker call: (rows, ends or None for whole documents)."""

    key: str | None = None
    segments: list[tuple[pa.Array, np.ndarray | None]] = field(default_factory=list)
    n_bytes: int = 0

    def arrays(self) -> tuple[pa.Array, np.ndarray | None]:
        """The rows as one array (a copy of just them, so that handing it to a worker sends only them) and
        their ends (None: every row is a whole document)."""
        parts = [rows for rows, _ in self.segments]
        if len({p.type for p in parts}) > 1:  # string and large_string from different input formats
            parts = [p.cast(pa.large_string()) for p in parts]
        texts = _compact(parts[0]) if len(parts) == 1 else pa.concat_arrays(parts)
        if all(ends is None for _, ends in self.segments):
            return texts, None
        return texts, np.concatenate([np.ones(len(rows), dtype=bool) if ends is None else ends
                                      for rows, ends in self.segments])


class Encoder:
    """Tokenize batches of documents with `num_proc` processes (1: in this process), results in order."""

    def __init__(self, model_path: str, eod_id: int, dtype: str, num_proc: int = 1, task_bytes: int = 1 << 18,
                 piece_bytes: int | None = None):
        if num_proc < 1:
            raise PrepError(f"--num-proc must be >= 1, got {num_proc}")
        self.num_proc, self.task_bytes = num_proc, task_bytes
        self.piece_bytes = piece_bytes or PIECE_BYTES
        self.cuts = document_cuts(model_path)
        self._init = (model_path, eod_id, dtype)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Encoder:
        if self.num_proc > 1:
            self._pool = ProcessPoolExecutor(self.num_proc, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(*self._init, os.getpid()))
        else:
            _init_worker(*self._init)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)
            self._pool = None

    def run(self, batches: Iterable[tuple[str, str, pa.Array]], sink: Callable[[str, Encoded], None]) -> None:
        """Tokenize (key, label, documents) batches (label names the input, for warnings); sink(key, Encoded)
        is called in input order. A task holds documents of one key: a key change submits the task so far."""
        pending: deque[tuple[str, Future]] = deque()
        task = _Task()

        def submit() -> None:
            nonlocal task
            key, (texts, ends) = task.key, task.arrays()
            task = _Task(key)
            if self._pool is None:
                sink(key, _encode(texts, ends))
                return
            pending.append((key, self._pool.submit(_encode, texts, ends)))
            while len(pending) > 2 * self.num_proc:
                drain()

        def drain() -> None:
            key, fut = pending.popleft()
            try:
                sink(key, fut.result())
            except BrokenProcessPool:
                raise PrepError("a tokenizer worker process died unexpectedly (killed, out of memory?); "
                                "retry with a smaller --num-proc") from None

        for key, label, docs in batches:
            if key != task.key and task.segments:
                submit()
            task.key = key
            for rows, ends, n_bytes in self._segments(label, docs):
                task.segments.append((rows, ends))
                task.n_bytes += n_bytes
                if task.n_bytes >= self.task_bytes:
                    submit()
        if task.segments:
            submit()
        while pending:
            drain()

    def _segments(self, label: str, docs: pa.Array) -> Iterator[tuple[pa.Array, np.ndarray | None, int]]:
        """The batch as consecutive (rows, ends, bytes) segments: runs of whole documents of about task_bytes,
        and each document longer than piece_bytes as its pieces (where the tokenizer allows cuts)."""
        lengths = pc.binary_length(docs).to_numpy(zero_copy_only=False).astype(np.int64)  # [n]
        if self.cuts.chars:
            long = np.flatnonzero(lengths > self.piece_bytes).tolist()
        else:
            long = []
            self._warn_whole(label, lengths)
        start = 0
        for i in [*long, len(docs)]:
            yield from _runs(docs, lengths, start, i, self.task_bytes)
            if i < len(docs):
                yield from _pieces(_document_bytes(docs, i), self.cuts.chars, self.piece_bytes)
            start = i + 1

    def _warn_whole(self, label: str, lengths: np.ndarray) -> None:
        for n in lengths[lengths > WHOLE_DOCUMENT_WARNING_BYTES].tolist():
            print(f"warning: input {label}: a document of {n / 2**20:,.0f} MiB is tokenized whole, by one process "
                  f"(about {n * ENCODE_BYTES_PER_BYTE / 2**30:,.1f} GiB of memory): this tokenizer cannot be cut "
                  f"into pieces ({self.cuts.why_not}); pass --line-docs if the file holds one document per line",
                  file=sys.stderr)


def _runs(docs: pa.Array, lengths: np.ndarray, lo: int, hi: int, task_bytes: int
          ) -> Iterator[tuple[pa.Array, None, int]]:
    """Whole documents [lo, hi) as consecutive runs, each closing with the document that brings it to
    task_bytes (the last may hold less)."""
    ends = np.cumsum(lengths[lo:hi])  # [hi - lo]: bytes up to and including each document
    first, done = 0, 0
    while first < hi - lo:
        last = min(int(np.searchsorted(ends, done + task_bytes)), hi - lo - 1)
        yield docs.slice(lo + first, last + 1 - first), None, int(ends[last]) - done
        first, done = last + 1, int(ends[last])


def _pieces(data: pa.Buffer, cuts: tuple[bytes, ...], piece_bytes: int
            ) -> Iterator[tuple[pa.Array, np.ndarray, int]]:
    """One document's UTF-8 bytes as (one-row array, ends, bytes) pieces (views of `data`, no copy)."""
    stops = piece_stops(data, cuts, piece_bytes)
    start = 0
    for k, stop in enumerate(stops):
        offsets = pa.py_buffer(np.array([0, stop - start], dtype=np.int64))
        piece = pa.LargeStringArray.from_buffers(1, offsets, data.slice(start, stop - start))
        yield piece, np.array([k == len(stops) - 1]), stop - start
        start = stop


def piece_stops(data, cuts: tuple[bytes, ...], piece_bytes: int) -> list[int]:
    """Where the pieces of a document's UTF-8 bytes end (the last at its end): each piece about piece_bytes
    long, ending just after a cut character, the preferred one in its second half if it has one there.

    A piece ends early only where the text has no cut character in its second half, and late only where it
    has none in the whole piece_bytes (a run of text without whitespace is never cut). The cut characters
    are ASCII, which never occurs inside a multi-byte UTF-8 character: every piece is valid text.
    """
    view = memoryview(data)
    stops, start = [], 0
    while len(view) - start > piece_bytes:
        start = _piece_stop(view, start, cuts, piece_bytes)
        stops.append(start)
    if start < len(view) or not stops:
        stops.append(len(view))
    return stops


def _piece_stop(view: memoryview, start: int, cuts: tuple[bytes, ...], piece_bytes: int) -> int:
    end = start + piece_bytes
    for lo in (start + piece_bytes // 2, start):  # the second half first, then the first
        window = bytes(view[lo:end])
        for c in cuts:
            at = window.rfind(c)
            if at >= 0:
                return lo + at + 1
        end = lo
    at = start + piece_bytes
    while at < len(view):  # none within piece_bytes: the piece runs on to the first cut character
        window = bytes(view[at:at + piece_bytes])
        found = [i for i in (window.find(c) for c in cuts) if i >= 0]
        if found:
            return at + min(found) + 1
        at += piece_bytes
    return len(view)


def document_texts(docs: pa.Array, piece_bytes: int | None = None,
                   progress: Callable[[int], None] | None = None) -> Iterator[str]:
    """The documents as Python strings, one longer than piece_bytes (default PIECE_BYTES) as its pieces cut
    just after newlines: the same lines (what the tokenizer trains on), without a Python string of the whole
    document. `progress(n_bytes)` is called with the UTF-8 bytes of each text as it is handed on, so that a
    long document moves a bar piece by piece."""
    piece_bytes = piece_bytes or PIECE_BYTES
    progress = progress or (lambda n: None)
    lengths = pc.binary_length(docs).to_numpy(zero_copy_only=False)  # [n]
    if len(docs) == 0 or lengths.max() <= piece_bytes:
        yield from docs.to_pylist()
        progress(int(lengths.sum()))
        return
    for i, n in enumerate(lengths.tolist()):
        if n <= piece_bytes:
            yield docs[i].as_py()
            progress(n)
            continue
        data, start = _document_bytes(docs, i), 0
        for stop in piece_stops(data, (b"\n",), piece_bytes):
            yield data.slice(start, stop - start).to_pybytes().decode("utf-8")
            progress(stop - start)
            start = stop


def _document_bytes(docs: pa.Array, i: int) -> pa.Buffer:
    """Document i's UTF-8 bytes, a view of the array's data buffer (a scalar's as_buffer() copies them)."""
    offsets = np.frombuffer(docs.buffers()[1], dtype=np.int64 if pa.types.is_large_string(docs.type) else np.int32)
    start, stop = int(offsets[docs.offset + i]), int(offsets[docs.offset + i + 1])
    return docs.buffers()[2].slice(start, stop - start)


def _compact(docs: pa.Array) -> pa.Array:
    """A slice of a larger array as an array of its own, so that handing it to a worker copies only it."""
    if docs.get_total_buffer_size() <= 2 * docs.nbytes:
        return docs
    return pa.concat_arrays([docs])
