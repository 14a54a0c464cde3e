"""The corpus format: the one contract between data_prep/ (writer) and the loader (reader).

Import everything about the on-disk format from here. A corpus folder OUT holds

    OUT/manifest.json         written last, atomically (write_manifest)
    OUT/tokenizer.model       the SentencePiece model, its sha256 in the manifest
    OUT/<split>/NNNNN.arrow   Arrow IPC files, one column "tokens" (token_dtype(vocab_size)); file k holds
                              the split's global-stream tokens [first_token, first_token + n_tokens)

A split's global stream is its documents in input order, each followed by eod_id. A run cuts it into S
streams of L = n_tokens // S tokens; rank r of W owns streams [r*S/W, (r+1)*S/W), one contiguous block
(rank_token_range). Files are cut at the rank blocks of the layout hint (file_boundaries), so in the
planned run each rank opens only its own files; any W dividing S can still read them. A block of more than
MAX_FILE_TOKENS is cut into several files (the ranks of a run then share its hashing).

The definitions live in manifest.py (schema, layout arithmetic), arrow_io.py (writer, reader),
mixture.py (a mixture's documents file), index_split.py (a split stored as an index into other corpora,
and split_reader, the factory every reader of a corpus split goes through) and verify.py; this module is
the single import point.
"""
from __future__ import annotations

from .arrow_io import COLUMN, ArrowTokenWriter, TokenReader, token_schema, update_tokens_sha256
from .index_split import IndexReader, split_reader
from .manifest import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    CorpusError,
    FileEntry,
    IndexEntry,
    Layout,
    Manifest,
    MixtureEntry,
    MixtureSource,
    SplitEntry,
    TokenizerEntry,
    check_relative_path,
    check_source_name,
    file_boundaries,
    index_tokens_sha256,
    rank_token_range,
    read_manifest,
    sha256_file,
    split_parts,
    stream_length,
    token_dtype,
    write_manifest,
)
from .verify import verify_corpus

__all__ = [
    "COLUMN", "DTYPES", "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_FILE",
    "ArrowTokenWriter", "CorpusError", "FileEntry", "IndexEntry", "IndexReader", "Layout", "Manifest",
    "MixtureEntry", "MixtureSource", "SplitEntry", "TokenReader", "TokenizerEntry", "check_relative_path",
    "check_source_name", "file_boundaries", "index_tokens_sha256", "rank_token_range", "read_manifest",
    "sha256_file", "split_parts", "split_reader", "stream_length", "token_dtype", "token_schema",
    "update_tokens_sha256", "verify_corpus", "write_manifest",
]
