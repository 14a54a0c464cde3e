"""Laying a split's global token stream out as Arrow files cut at the rank blocks of a layout.

Tokens are copied in bounded chunks (at most CHUNK_TOKENS per record batch, plain reads, no memory map),
so laying out or re-laying out a corpus needs little memory whatever its size.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.errors import PrepError
from txl_dist.streams import streams_per_rank
from txl_dist.data.format import (
    ArrowTokenWriter,
    FileEntry,
    Layout,
    file_boundaries,
    sha256_file,
    stream_length,
    token_schema,
)

CHUNK_TOKENS = 1 << 20
"""Tokens per record batch written (and the most held in memory at once while copying)."""


def split_layouts(splits: Iterable[str], world_size: int, n_streams: int, eval_streams: int | None = None
                  ) -> dict[str, Layout]:
    """The layout hint of each split: train is cut for (W, S), the evaluation splits for (W, eval_streams)."""
    eval_streams = world_size if eval_streams is None else eval_streams
    for name, streams in (("--n-streams", n_streams), ("--eval-streams", eval_streams)):
        streams_per_rank(streams, world_size, streams=name, ranks="ranks (--world-size)", error=PrepError)
    return {s: Layout(world_size, n_streams if s == "train" else eval_streams) for s in splits}


def check_fits(split: str, n_tokens: int, layout: Layout, where: str) -> None:
    """A split must give every stream of its layout at least one token."""
    if stream_length(n_tokens, layout.n_streams) < 1:
        raise PrepError(f"{where}: split {split} has {n_tokens} tokens, fewer than its {layout.n_streams} streams; "
                        "give it more text or use fewer streams")


def iter_token_file(path: str | os.PathLike, expected_sha256: str | None = None) -> Iterator[np.ndarray]:
    """The tokens of one Arrow token file in order, in chunks of at most CHUNK_TOKENS.

    With `expected_sha256` the file is hashed first, so a damaged file is refused before any token is used.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: token file is missing")
    if expected_sha256 is not None and (got := sha256_file(path)) != expected_sha256:
        raise PrepError(f"{path}: sha256 {got[:12]}... differs from the recorded {expected_sha256[:12]}...: "
                        "the file is corrupt or was replaced")
    try:
        with pa.OSFile(str(path), "rb") as f:
            reader = pa.ipc.open_file(f)
            if reader.schema not in (token_schema("uint16"), token_schema("int32")):
                raise PrepError(f"{path}: not a token file (schema {reader.schema.types})")
            for i in range(reader.num_record_batches):
                tokens = reader.get_batch(i).column(0).to_numpy(zero_copy_only=False)  # [batch rows]
                for s in range(0, len(tokens), CHUNK_TOKENS):
                    yield tokens[s:s + CHUNK_TOKENS]
    except pa.ArrowException as e:
        raise PrepError(f"{path}: not a readable Arrow IPC file ({str(e).splitlines()[0]})") from None


class SplitWriter:
    """Writes one split's global stream as files `<split>/NNNNN.arrow` cut at the boundaries of a layout.

    `write(tokens, source)` appends tokens in stream order (source names where they came from, for errors);
    `close()` checks the total and returns the manifest's file entries and the split's tokens_sha256, hashed
    while writing (the stream is read once, whatever the number of files).
    """

    def __init__(self, corpus_dir: Path, split: str, n_tokens: int, layout: Layout, dtype: str, vocab_size: int):
        self.corpus_dir, self.split, self.n_tokens = Path(corpus_dir), split, n_tokens
        self.dtype, self.vocab_size = dtype, vocab_size
        self.bounds = file_boundaries(n_tokens, layout)
        (self.corpus_dir / split).mkdir(parents=True, exist_ok=True)
        self.files: list[FileEntry] = []
        self.pos = 0
        self._writer: ArrowTokenWriter | None = None
        self._tokens_hash = hashlib.sha256()
        self._buf: list[np.ndarray] = []
        self._buf_len = 0

    def write(self, tokens: np.ndarray, source: str) -> None:
        """Append tokens (any integer dtype); ids outside [0, vocab_size) are refused."""
        if len(tokens) == 0:
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            at = self.pos + self._buf_len + int(np.argmax(tokens == bad))
            raise PrepError(f"{source}: token id {bad} (split {self.split}, stream position {at}) is outside "
                            f"[0, {self.vocab_size}) of the tokenizer; the tokens do not belong to this tokenizer")
        if self.pos + self._buf_len + len(tokens) > self.n_tokens:
            raise PrepError(f"{source}: split {self.split} holds more tokens than the {self.n_tokens} recorded")
        while len(tokens):
            # Record batches hold exactly CHUNK_TOKENS tokens (the last of a file fewer), whatever the sizes of
            # the pieces written: the same stream always gives byte-identical files and checksums.
            at = self.pos + self._buf_len
            to_file_end = self.bounds[len(self.files) + 1] - at
            room = min(to_file_end, CHUNK_TOKENS - self._buf_len)
            piece, tokens = tokens[:room], tokens[room:]
            self._buf.append(piece)
            self._buf_len += len(piece)
            if len(piece) == room:
                self._flush(end_of_file=len(piece) == to_file_end)

    def _flush(self, end_of_file: bool) -> None:
        if self._buf_len:
            if self._writer is None:
                self._writer = ArrowTokenWriter(self.corpus_dir / self._path(), self.dtype, self._tokens_hash)
            self._writer.write(np.concatenate(self._buf) if len(self._buf) > 1 else self._buf[0])
            self.pos += self._buf_len
            self._buf, self._buf_len = [], 0
        if end_of_file and self._writer is not None:
            n, sha = self._writer.close()
            self.files.append(FileEntry(self._path(), self.pos - n, n, sha))
            self._writer = None

    def _path(self) -> str:
        return f"{self.split}/{len(self.files):05d}.arrow"

    def close(self) -> tuple[list[FileEntry], str]:
        """Finish the last file; the stream must hold exactly n_tokens. Returns (files, tokens_sha256)."""
        self._flush(end_of_file=True)
        if self.pos != self.n_tokens:
            raise PrepError(f"split {self.split}: got {self.pos} tokens, expected {self.n_tokens}")
        return self.files, self._tokens_hash.hexdigest()

    def abort(self) -> None:
        """Drop the file being written."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
