"""Parallel tokenizing: documents -> token ids (each document followed by eod_id), in input order.

The main process reads documents and hands batches of about `task_bytes` of text to `num_proc` worker
processes (each loads the SentencePiece model once). At most 2 * num_proc batches are in flight and
results are written in submission order, so memory stays bounded and the output order is the input order
whatever the number of workers. Workers are spawned, not forked: the reading side runs threads
(pyarrow, datasets) that a fork could copy mid-lock.
"""
from __future__ import annotations

import array
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sentencepiece as spm

from data_prep.errors import PrepError

_worker: dict = {}


@dataclass
class Encoded:
    """The tokens of one batch of documents and what they count."""

    tokens: np.ndarray
    """1-D, the file dtype: each document's ids followed by eod_id."""
    n_documents: int
    n_bytes: int
    """UTF-8 bytes of the documents' text."""
    n_chars: int


def _init_worker(model_path: str, eod_id: int, dtype: str) -> None:
    sp = spm.SentencePieceProcessor()
    sp.load(model_path)
    _worker.update(sp=sp, eod_id=eod_id, dtype=np.dtype(dtype), typecode=_TYPECODES[dtype])


# array.array converts a list of Python ints to machine integers faster than numpy does
_TYPECODES = {"uint16": "H", "int32": "i"}


def _encode(texts: pa.Array) -> Encoded:
    sp, eod_id = _worker["sp"], _worker["eod_id"]
    out = array.array(_worker["typecode"])
    # One document at a time: SentencePiece's list API is slower here, and its threads would compete
    # with the other worker processes.
    for text in texts.to_pylist():
        out.extend(sp.encode(text))
        out.append(eod_id)
    tokens = np.frombuffer(out, dtype=_worker["dtype"])  # [n_tokens], no copy
    return Encoded(tokens, len(texts), int(pc.sum(pc.binary_length(texts)).as_py() or 0),
                   int(pc.sum(pc.utf8_length(texts)).as_py() or 0))


class Encoder:
    """Tokenize batches of documents with `num_proc` processes (1: in this process), results in order."""

    def __init__(self, model_path: str, eod_id: int, dtype: str, num_proc: int = 1, task_bytes: int = 1 << 18):
        if num_proc < 1:
            raise PrepError(f"--num-proc must be >= 1, got {num_proc}")
        self.num_proc, self.task_bytes = num_proc, task_bytes
        self._init = (model_path, eod_id, dtype)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Encoder:
        if self.num_proc > 1:
            self._pool = ProcessPoolExecutor(self.num_proc, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=self._init)
        else:
            _init_worker(*self._init)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=exc_type is not None)
            self._pool = None

    def run(self, batches: Iterable[tuple[str, pa.Array]], sink: Callable[[str, Encoded], None]) -> None:
        """Tokenize (key, documents) batches; sink(key, Encoded) is called in input order per key.

        Consecutive batches of one key are merged up to task_bytes so that tiny batches (short lines) do
        not pay the hand-over cost one by one; a key change flushes, so keys never mix within a task.
        """
        pending: deque[tuple[str, Future]] = deque()
        buf_key, buf, buf_bytes = None, [], 0

        def submit(key: str, docs: list[pa.Array]) -> None:
            if len({d.type for d in docs}) > 1:  # string and large_string from different input formats
                docs = [d.cast(pa.large_string()) for d in docs]
            texts = docs[0] if len(docs) == 1 else pa.concat_arrays(docs)
            if self._pool is None:
                sink(key, _encode(texts))
                return
            pending.append((key, self._pool.submit(_encode, texts)))
            while len(pending) > 2 * self.num_proc:
                drain()

        def drain() -> None:
            key, fut = pending.popleft()
            try:
                sink(key, fut.result())
            except BrokenProcessPool:
                raise PrepError("a tokenizer worker process died unexpectedly (killed, out of memory?); "
                                "retry with a smaller --num-proc") from None

        for key, docs in batches:
            if key != buf_key and buf:
                submit(buf_key, buf)
                buf, buf_bytes = [], 0
            buf_key = key
            buf.append(_compact(docs))
            buf_bytes += docs.nbytes
            if buf_bytes >= self.task_bytes:
                submit(buf_key, buf)
                buf, buf_bytes = [], 0
        if buf:
            submit(buf_key, buf)
        while pending:
            drain()


def _compact(docs: pa.Array) -> pa.Array:
    """A slice of a larger array as an array of its own, so that handing it to a worker copies only it."""
    if docs.get_total_buffer_size() <= 2 * docs.nbytes:
        return docs
    return pa.concat_arrays([docs])
