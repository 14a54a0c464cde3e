"""Free-space checks before a job writes anything: refuse at the start what would otherwise fail for lack of
space hours later, throwing the work away.

The tokens' bytes are estimated before any input is read, from the inputs' sizes: at most
TOKENS_PER_INPUT_BYTE token per byte of input text, each of the corpus dtype's size (2 bytes when the
vocabulary has at most 65,536 pieces, else 4). One token per byte is an upper bound on ordinary text for
any tokenizer: every id but a document's end-of-document id and its leading "▁" covers at least one byte of
the text (byte fallback makes one id per byte of an unknown character; a char model one id per character).
It overshoots subword vocabularies, which give 0.2-0.4 tokens per byte of English prose (Shakespeare with
4,096 pieces: 0.28), so the check refuses only where space is short for the worst case: `--no-space-check`
skips it. Documents of one or two characters (line documents of single letters) and the few characters
NFKC expands (U+FDFA becomes 18 characters) are the cases above one token per byte.

Input bytes are the file sizes, except Parquet, whose text column is counted uncompressed (from its
metadata), since the file is compressed; a Parquet writer's dictionary encoding stores repeated texts once,
and they are counted once.

mix and relayout rewrite prepared corpora, whose manifests and files tell what they will write: they use
check_free_space (and files_bytes) with no estimate from text (data_prep/mix.py, data_prep/relayout.py).
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from data_prep.errors import PrepError
from data_prep.sources import PARQUET, Source, source_files
from txl_dist.data.format import token_dtype

TOKENS_PER_INPUT_BYTE = 1
"""The estimate's tokens per byte of input text (see the module docstring)."""


def input_text_bytes(sources: Iterable[Source], text_field: str) -> int:
    """Bytes of text the sources hold, about (files' sizes; Parquet's text column uncompressed)."""
    total = 0
    for source in sources:
        for path in source_files(source):
            total += _parquet_text_bytes(path, text_field) if source.kind == PARQUET else _size(path)
    return total


def files_bytes(paths: Iterable[Path]) -> int:
    """Bytes the files take now (a missing one counts 0: the job itself names it)."""
    return sum(_size(path) for path in paths)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # the scan names the unreadable file


def _parquet_text_bytes(path: Path, text_field: str) -> int:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # not Parquet after all: the reader refuses it with its own message
        return _size(path)
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            if group.column(c).path_in_schema == text_field:
                total += group.column(c).total_uncompressed_size
    return total or _size(path)


def token_bytes(input_bytes: int, vocab_size: int) -> int:
    """The estimated bytes of the tokens of `input_bytes` of text."""
    return input_bytes * TOKENS_PER_INPUT_BYTE * np.dtype(token_dtype(vocab_size)).itemsize


def estimate_note(input_bytes: int, vocab_size: int) -> str:
    """How token_bytes was estimated, for a refusal."""
    dtype = token_dtype(vocab_size)
    return (f"{size_text(input_bytes)} of input x {TOKENS_PER_INPUT_BYTE} token per byte x "
            f"{np.dtype(dtype).itemsize} bytes per {dtype} token")


def check_free_space(needs: Sequence[tuple[Path, int, str]], job: str, fix: str) -> None:
    """Refuse when a file system has less free space than `needs` puts on it: (folder, bytes, what) entries,
    those on one file system added up. The one-line refusal names the folder, its free space, the estimate
    and how it was made, and `fix` (the options that put the output elsewhere)."""
    per_device: dict[int, list[tuple[Path, int, str]]] = {}
    for folder, n_bytes, what in needs:
        existing = _existing(folder)
        per_device.setdefault(os.stat(existing).st_dev, []).append((existing, n_bytes, what))
    for entries in per_device.values():
        need = sum(n for _, n, _ in entries)
        folder = entries[0][0]
        free = shutil.disk_usage(folder).free
        if free < need:
            what = "; ".join(w for _, _, w in entries)
            raise PrepError(f"not enough free space for {job} in {folder}: {size_text(free)} free, about "
                            f"{size_text(need)} needed ({what}); free some space, {fix}, or pass --no-space-check "
                            "if the estimate is too high (docs/corpus_format.md, Disk space)")


def _existing(folder: Path) -> Path:
    """The folder, or its nearest existing parent (an output folder may not exist yet)."""
    folder = Path(os.path.abspath(folder))
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def size_text(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:,.1f} MiB"
