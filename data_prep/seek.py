"""Seek points: what the planning pass (`prepare --plan`: data_prep/plan_file.py, data_prep/plan_scan.py) learns
about one input in its one read, and how a `prepare --shard` task then starts reading near its first document.

A seek point is (document index within the input, position) where a document starts. Its granularity per
input kind (`InputRecord.seek`):
- "bytes", plain text with --line-docs and JSON Lines: a byte offset, one per SEEK_BYTES (64 MiB) of input.
  A task then reads at most 64 MiB (plus one chunk) before its first document: under 1% of its share of a
  100 GB job cut into 16 shards. The table stays small: 1,600 points per 100 GB of input.
- "row_groups", Parquet: every row group, the smallest part a Parquet file can be read from; its row count is
  in the file's metadata.
- "rows", `save_to_disk` folders: any row (the Arrow files are memory-mapped, a slice costs nothing).
- "start": the input is read from its start, exactly as without a plan: plain text that is one document per
  file (the file is the unit), and whatever the fast readers here do not parse exactly as `datasets` does
  (JSON that is not one object per line, a text field of mixed or non-string type, nulls): `datasets` counts
  those in the planning pass and reads them in the task.

Line-oriented inputs are read in chunks: CHUNK_BYTES and then the rest of the line the chunk ends in (as
`datasets` reads them), and a seek point is always the start of such a chunk. A task that starts there reads
the very chunks the planning pass read (the cut depends only on where reading starts), so a chunk of JSON
that parsed then parses now. Lines are what `datasets`' text loader makes of the file: split at "\\n", "\\r\\n"
and "\\r" (Python's universal newlines), the final line break starting no document; a line is a document.
"""
from __future__ import annotations

import codecs
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

import data_prep.sources as src
from data_prep.errors import PrepError
from data_prep.sources import (
    TEXT,
    ReadOptions,
    Source,
    Utf8Checker,
    check_field,
    check_no_nulls,
    checks_utf8,
    files_label,
    hash_and_check,
    iter_documents,
    read_text_batch,
    text_batch_full,
    utf8_hint,
)

SEEK_BYTES = 64 << 20
"""A seek point every this many bytes of a line-oriented input (at the next chunk start)."""
CHUNK_BYTES = 8 << 20
"""Line-oriented inputs are read (and JSON parsed) this many bytes at a time, plus the rest of the last line."""

BYTES, ROW_GROUPS, ROWS, START = "bytes", "row_groups", "rows", "start"


@dataclass
class InputRecord:
    """One input as the planning pass saw it."""

    path: str
    """The input's resolved path (a file, or a save_to_disk folder)."""
    kind: str
    files: list[dict]
    """Each file read: {path (resolved), bytes, mtime_ns, sha256}; one, or every file of a save_to_disk folder.
    A one-document text file also has text_bytes: its text's UTF-8 length as read (its bytes less a BOM)."""
    documents: int
    seek: str
    """How `points` are meant: BYTES, ROW_GROUPS, ROWS or START (see the module docstring)."""
    points: list[list[int]] = field(default_factory=list)
    """[document index, byte offset or row group], ascending; the first is [0, 0]."""


# ----------------------------------------------------------------------------------------------------
# Line-oriented inputs


def read_chunks(f: io.BufferedIOBase, start: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) chunks of a binary file from byte `start`: CHUNK_BYTES, then the rest of that line."""
    f.seek(start)
    offset = start
    while chunk := f.read(CHUNK_BYTES):
        chunk += f.readline()
        yield offset, chunk
        offset += len(chunk)


def count_lines(chunk: bytes) -> int:
    """Documents (lines) in a chunk that ends after a line break or at the end of its file: each "\\n", "\\r\\n"
    or lone "\\r" ends one, and text after the last ends one more. (No byte of an invalid UTF-8 sequence is
    ASCII, so the count on bytes is the count on the decoded text, with --errors replace too.)"""
    n = chunk.count(b"\n")
    r = chunk.count(b"\r")
    if r:
        n += r - chunk.count(b"\r\n")
    return n + (1 if chunk and chunk[-1:] not in (b"\n", b"\r") else 0)


def split_lines(chunk: bytes, errors: str, first: bool = False) -> pa.Array:
    """The lines of a chunk (see count_lines) as documents: what `datasets`' text loader makes of them. The
    `first` chunk of a file loses a leading byte order mark, as that loader (utf-8-sig) drops it."""
    # a chunk ends after "\n" or at the file's end: no split character
    text = chunk.decode("utf-8-sig" if first else "utf-8", errors)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final line break starts no document
    return pa.array(lines, pa.large_string())


def parse_json_chunk(chunk: bytes, text_field: str, first: bool) -> pa.Array | None:
    """The text field of each JSON object in the chunk; None where this reader may differ from `datasets`'
    (no object per line, a missing, null or non-string text field): the input is then read by `datasets`."""
    import pyarrow.json as paj

    if first and chunk.startswith(codecs.BOM_UTF8):
        chunk = chunk[len(codecs.BOM_UTF8):]
    if first and chunk.lstrip().startswith(b"["):
        return None  # a JSON array, which datasets converts
    parse = paj.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]),
                             unexpected_field_behavior="ignore")
    block = 1 << 20
    while True:
        try:
            table = paj.read_json(io.BytesIO(chunk), read_options=paj.ReadOptions(block_size=block),
                                  parse_options=parse)
            break
        except pa.ArrowInvalid as e:
            if "straddl" in str(e) and block < len(chunk):
                block *= 4  # an object longer than a block
                continue
            return None
        except (pa.ArrowException, UnicodeDecodeError):
            return None
    column = table.column(text_field).combine_chunks()
    return None if column.null_count else column


# ----------------------------------------------------------------------------------------------------
# Reading from a seek point
#
# The batches handed on are cut exactly where reading from the start cuts them (iter_documents): datasets
# re-cuts the rows of one `load_dataset` call (a run of plain-text inputs, or one other input) into batches of
# sources.BATCH_ROWS, and one-document-per-file texts are batched by read_text_documents' rule. The
# tokenizer's tasks, and with them the record batches of a shard's token files, follow the batches: the same
# batches give the same files.


def documents_from(sources: Sequence[Source], records: Sequence[InputRecord], start: int, opts: ReadOptions,
                   files: tuple[int, int] | None = None) -> tuple[int, Iterator[tuple[str, pa.Array]]]:
    """Read a group of inputs from the nearest seek point at or before its document `start`: (that point's
    document index in the group, (label, documents) batches from there to the group's end).

    `files` = (lo, hi): the group is one-document-per-file text of which only documents [lo, hi) are read,
    batched from lo on (as routed_documents reads such a slice without a plan)."""
    units = _units(sources)
    base = 0
    for u, (i, j) in enumerate(units):
        n = sum(r.documents for r in records[i:j])
        if start < base + n:
            break
        base += n
    else:
        return base, _chain([])
    origin, stop = (files[0], files[1]) if files is not None else (base, base + n)
    first, head = _unit_from(sources[i:j], records[i:j], start - base, opts, origin - base, stop - base)
    rest = [_unit_from(sources[a:b], records[a:b], 0, opts, 0, None)[1] for a, b in units[u + 1:]]
    return base + first, _chain([head, *rest])


def _chain(parts: list[Iterator]) -> Iterator[tuple[str, pa.Array]]:
    for part in parts:  # each opens its files only when reached
        yield from part


def _units(sources: Sequence[Source]) -> list[tuple[int, int]]:
    """[i, j) runs of sources read as one (iter_documents' groups): consecutive plain text, or one other input."""
    units, i = [], 0
    while i < len(sources):
        j = i + 1
        if sources[i].kind == TEXT:
            while j < len(sources) and sources[j].kind == TEXT:
                j += 1
        units.append((i, j))
        i = j
    return units


def _unit_from(sources: Sequence[Source], records: Sequence[InputRecord], start: int, opts: ReadOptions,
               origin: int, stop: int | None) -> tuple[int, Iterator[tuple[str, pa.Array]]]:
    """(first document read, batches) of one unit from its document `start` (counted in the unit)."""
    if sources[0].kind == TEXT and not opts.line_docs:
        return start, _text_files(sources, records, start, origin, stop, opts)
    if records[0].seek == START:  # one input that datasets reads, from its start
        return 0, iter_documents(sources, opts)
    k, before = 0, 0
    while start >= before + records[k].documents:
        before += records[k].documents
        k += 1
    if records[k].seek == ROWS:
        point = [start - before, start - before]
    else:
        point = max((p for p in records[k].points if p[0] <= start - before), key=lambda p: p[0])
    first = before + point[0]
    label = files_label([s.path for s in sources])
    raw = _chain([_input_from(s, r, point[1] if n == k else 0, opts)
                  for n, (s, r) in enumerate(zip(sources, records)) if n >= k])
    return first, _on_grid(raw, first, label)


def _on_grid(arrays: Iterator[pa.Array], first: int, label: str) -> Iterator[tuple[str, pa.Array]]:
    """Re-cut documents (the first is the unit's document `first`) at the unit's multiples of BATCH_ROWS."""
    pieces: list[pa.Array] = []
    rows = src.BATCH_ROWS
    at, end = first, (first // rows + 1) * rows  # the next document's index, the batch's end
    for array in arrays:
        while len(array):
            piece, array = array.slice(0, end - at), array.slice(end - at)
            pieces.append(piece)
            at += len(piece)
            if at == end:
                yield label, _concat(pieces)
                pieces, end = [], end + rows
    if pieces:
        yield label, _concat(pieces)


def _concat(pieces: list[pa.Array]) -> pa.Array:
    return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)


def _input_from(source: Source, record: InputRecord, position: int, opts: ReadOptions) -> Iterator[pa.Array]:
    """One input's documents from a seek point's position, in batches of any size."""
    label = str(source.path)
    if record.seek == BYTES:
        yield from _lines_from(source, position, opts)
    elif record.seek == ROW_GROUPS:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(source.path)
            for batch in pf.iter_batches(src.BATCH_ROWS, row_groups=range(position, pf.num_row_groups),
                                         columns=[opts.text_field]):
                yield _checked(label, batch.column(0), opts)
        except (OSError, pa.ArrowException) as e:
            raise PrepError(f"input {label}: cannot be read as parquet ({str(e).splitlines()[0]})") from None
    else:
        import datasets

        ds = datasets.load_from_disk(str(source.path))
        check_field(ds.column_names, opts.text_field, label)
        ds = ds.select_columns([opts.text_field]).select(range(position, len(ds)))  # a contiguous slice: no copy
        for table in ds.with_format("arrow").iter(batch_size=src.BATCH_ROWS):
            yield _checked(label, table.column(0).combine_chunks(), opts)


def _lines_from(source: Source, offset: int, opts: ReadOptions) -> Iterator[pa.Array]:
    """Text lines or JSON Lines from a seek point; what is read is checked for UTF-8 as the planning pass did."""
    path = source.path
    checker = Utf8Checker(path, utf8_hint(source.kind)) if checks_utf8(source.kind, opts) else None
    end = offset
    with open(path, "rb") as f:
        for at, chunk in read_chunks(f, offset):
            if checker is not None:
                checker.feed(chunk, at)
            end = at + len(chunk)
            if source.kind == TEXT:
                yield split_lines(chunk, opts.errors, at == 0)
                continue
            docs = parse_json_chunk(chunk, opts.text_field, at == 0)
            if docs is None:
                raise PrepError(f"input {path}: the JSON at byte offset {at} does not parse as when it was planned; "
                                "did it change? plan again")
            yield docs
    if checker is not None:
        checker.finish(end)


def _text_files(sources: Sequence[Source], records: Sequence[InputRecord], start: int, origin: int,
                stop: int | None, opts: ReadOptions) -> Iterator[tuple[str, pa.Array]]:
    """One-document-per-file texts [start, stop) in read_text_documents' batches counted from file `origin`
    (their sizes and text lengths are in the plan); each file checked (UTF-8) and hashed against the plan."""
    stop = len(sources) if stop is None else stop
    batch_start, n_text = origin, 0
    for i in range(origin, stop):
        f = records[i].files[0]
        if text_batch_full(i - batch_start, n_text, f["bytes"], src.BATCH_ROWS):
            if i > start:
                yield _verified_text_batch(sources[max(batch_start, start):i], records[max(batch_start, start):i],
                                           opts)
            batch_start, n_text = i, 0
        n_text += f["text_bytes"]
    if stop > max(batch_start, start):
        yield _verified_text_batch(sources[max(batch_start, start):stop], records[max(batch_start, start):stop], opts)


def _verified_text_batch(sources: Sequence[Source], records: Sequence[InputRecord], opts: ReadOptions
                         ) -> tuple[str, pa.Array]:
    for source, record in zip(sources, records):
        _, digest = hash_and_check(source.path, checks_utf8(TEXT, opts), utf8_hint(TEXT))
        if digest != record.files[0]["sha256"]:
            raise PrepError(f"input {source.path}: its sha256 differs from the plan's; it changed since the plan "
                            "was made: plan again")
    texts = read_text_batch([s.path for s in sources], opts.errors, [s.size for s in sources])
    return files_label([s.path for s in sources]), texts


def _checked(label: str, column: pa.Array, opts: ReadOptions) -> pa.Array:
    """Documents with text (a null is refused, as iter_documents refuses it)."""
    check_no_nulls(label, column, opts.text_field)
    return column
