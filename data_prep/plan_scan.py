"""The planning pass of `prepare --plan` (data_prep/plan_file.py): each input read once, to hash it, check it as
scan_sources does (not empty; UTF-8 for JSON Lines and, unless --errors replace, plain text), count its
documents and find its seek points (data_prep/seek.py says what they are). Inputs that the fast readers of
seek.py do not read exactly as `datasets` does are counted by `datasets` after the read (seek "start").
"""
from __future__ import annotations

import codecs
import hashlib
import os
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

import data_prep.seek as seek
from data_prep.errors import PrepError
from data_prep.seek import BYTES, ROW_GROUPS, ROWS, START, InputRecord, count_lines, parse_json_chunk
from data_prep.sources import (
    ARROW,
    JSON,
    PARQUET,
    TEXT,
    ReadOptions,
    Source,
    Utf8Checker,
    checks_utf8,
    count_documents,
    hash_and_check,
    is_text_type,
    read_text_batch,
    source_files,
    utf8_hint,
)


_DATASETS = threading.Lock()


def scan_input(source: Source, opts: ReadOptions, progress=None) -> InputRecord:
    """Hash, check, count and find seek points of one input, reading each of its files once (a `datasets` count
    follows for inputs read from their start). `progress(n_bytes)` is called as bytes are read."""
    record = InputRecord(str(source.path.resolve()), source.kind, [], 0, START, [[0, 0]])
    if source.kind in (TEXT, JSON) and (source.kind == JSON or opts.line_docs):
        _scan_lines(source, opts, record, progress)
    elif source.kind == TEXT:
        record.files.append(_scan_text_document(source.path, opts, progress))
        record.documents = 1
    else:
        for path in source_files(source):
            record.files.append(_hash_file(path, source, opts, progress))
        if source.kind == PARQUET:
            _plan_parquet(source, opts, record)
        else:
            _plan_arrow(source, opts, record)
    if record.seek == START and record.documents == 0:
        with _DATASETS:  # one `datasets` load at a time: its cache folder is shared
            record.documents = count_documents([source], opts)  # datasets' reading, exactly as without a plan
    if record.documents == 0:
        raise PrepError(f"input {source.path}: holds no documents; remove it or give it text")
    return record


def _identity(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:
        raise PrepError(f"input {path}: cannot be read ({e.strerror})") from None


def _file_entry(path: Path, before: os.stat_result, digest: str) -> dict:
    after = _identity(path)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise PrepError(f"input {path}: changed while it was being read; plan again once it is complete")
    return {"path": str(path.resolve()), "bytes": before.st_size, "mtime_ns": before.st_mtime_ns, "sha256": digest}


def _hash_file(path: Path, source: Source, opts: ReadOptions, progress) -> dict:
    before = _identity(path)
    size, digest = hash_and_check(path, checks_utf8(source.kind, opts), utf8_hint(source.kind), progress)
    if size == 0 and source.kind != ARROW:
        raise PrepError(f"input {path} is empty; remove it or give it text")
    return _file_entry(path, before, digest)


def _scan_text_document(path: Path, opts: ReadOptions, progress) -> dict:
    """A file that is one document: hash, check, and its text's length as read_text_documents will read it
    (valid UTF-8 keeps its bytes, "\\r\\n" included, but for a leading byte order mark; anything else is
    decoded to tell)."""
    before = _identity(path)
    h = hashlib.sha256()
    checker = Utf8Checker(path, utf8_hint(TEXT)) if checks_utf8(TEXT, opts) else None
    valid = codecs.getincrementaldecoder("utf-8")("strict")  # --errors replace: is there anything to replace?
    size, bom = 0, 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(seek.CHUNK_BYTES):
                h.update(chunk)
                if checker is not None:
                    checker.feed(chunk, size)
                elif valid is not None:
                    try:
                        valid.decode(chunk)
                    except UnicodeDecodeError:
                        valid = None
                if size == 0 and chunk.startswith(codecs.BOM_UTF8):
                    bom = len(codecs.BOM_UTF8)  # read_text_documents drops it
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except OSError as e:
        raise PrepError(f"input {path}: cannot be read ({e.strerror})") from None
    _end_of_input(path, checker, size)
    if checker is None and (valid is None or valid.getstate()[0]):
        text_bytes = pc.binary_length(read_text_batch([path], opts.errors))[0].as_py()  # replacements change it
    else:
        text_bytes = size - bom
    return {**_file_entry(path, before, h.hexdigest()), "text_bytes": text_bytes}


def _end_of_input(path: Path, checker: Utf8Checker | None, size: int) -> None:
    """After reading an input whole: the end of its UTF-8 check (a sequence cut off at the end), and an empty
    input refused."""
    if checker is not None:
        checker.finish(size)
    if size == 0:
        raise PrepError(f"input {path} is empty; remove it or give it text")


def _scan_lines(source: Source, opts: ReadOptions, record: InputRecord, progress) -> None:
    """Text lines or JSON Lines: hash, check UTF-8, count documents per chunk, a seek point per SEEK_BYTES."""
    path, json_lines = source.path, source.kind == JSON
    before = _identity(path)
    h = hashlib.sha256()
    checker = Utf8Checker(path, utf8_hint(source.kind)) if checks_utf8(source.kind, opts) else None
    record.seek, end, last_point = BYTES, 0, 0
    try:
        with open(path, "rb") as f:
            for offset, chunk in seek.read_chunks(f, 0):
                if offset - last_point >= seek.SEEK_BYTES:
                    record.points.append([record.documents, offset])
                    last_point = offset
                h.update(chunk)
                if checker is not None:
                    checker.feed(chunk, offset)
                if not json_lines:
                    record.documents += count_lines(chunk)
                elif record.seek == BYTES:
                    docs = parse_json_chunk(chunk, opts.text_field, offset == 0)
                    if docs is None:  # not what the fast reader parses as datasets does: datasets reads it
                        record.seek, record.points, record.documents = START, [[0, 0]], 0
                    else:
                        record.documents += len(docs)
                end = offset + len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except OSError as e:
        raise PrepError(f"input {path}: cannot be read ({e.strerror})") from None
    _end_of_input(path, checker, end)
    record.files.append(_file_entry(path, before, h.hexdigest()))


def _plan_parquet(source: Source, opts: ReadOptions, record: InputRecord) -> None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(source.path).metadata
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException):
        return  # datasets' count names the problem
    if opts.text_field not in schema.names or not is_text_type(schema.field(opts.text_field).type):
        return
    record.seek, record.points = ROW_GROUPS, []
    for g in range(meta.num_row_groups):
        record.points.append([record.documents, g])
        record.documents += meta.row_group(g).num_rows
    record.points = record.points or [[0, 0]]


def _plan_arrow(source: Source, opts: ReadOptions, record: InputRecord) -> None:
    import datasets

    try:
        ds = datasets.load_from_disk(str(source.path))
    except Exception:  # noqa: BLE001 - datasets' count names the problem
        return
    if not isinstance(ds, datasets.Dataset) or opts.text_field not in ds.column_names:
        return
    if not is_text_type(ds.data.schema.field(opts.text_field).type):
        return
    record.seek, record.documents = ROWS, len(ds)
