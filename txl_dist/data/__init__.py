"""Prepared corpora: the on-disk format (format.py) and the StreamLoader. numpy + pyarrow only."""
from .format import (
    ArrowTokenWriter,
    CorpusError,
    FileEntry,
    Layout,
    Manifest,
    SplitEntry,
    TokenizerEntry,
    TokenReader,
    file_boundaries,
    split_reader,
    rank_token_range,
    read_manifest,
    stream_length,
    token_dtype,
    verify_corpus,
    write_manifest,
)
from .loader import MicroBatch, SplitTooShort, StreamLoader

__all__ = [
    "ArrowTokenWriter", "CorpusError", "FileEntry", "Layout", "Manifest", "SplitEntry", "TokenizerEntry",
    "TokenReader", "file_boundaries", "rank_token_range", "read_manifest", "split_reader", "stream_length",
    "token_dtype", "verify_corpus", "write_manifest", "MicroBatch", "SplitTooShort", "StreamLoader",
]
