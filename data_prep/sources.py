"""Input documents: resolve --train/--valid/--test patterns, check and hash the files, read through `datasets`.

Formats (chosen per file from its name, or forced with --format):
  text     one document per file, or one per line with --line-docs (PTB, WikiText). A file that is one
           document keeps its bytes ("\\r\\n" and "\\r" too; only a leading byte order mark is dropped), so
           a tokenizer that keeps the text gives the file back; --line-docs splits at "\\n", "\\r\\n" and
           "\\r" (Python's universal newlines, as `datasets` does). A file that is one document is read
           here, into one UTF-8 buffer about its size (a `large_string`: no 2 GiB limit);
           the tokenizer cuts a long one into pieces (data_prep/encode.py)
  json     JSON Lines (.jsonl/.json/.ndjson) with a text field (--text-field, default "text")
  parquet  (.parquet/.pq) with a text field
  arrow    a folder written by `datasets.Dataset.save_to_disk` with a text field

Documents are streamed (`load_dataset(..., streaming=True)`, `load_from_disk` is memory-mapped) in Arrow
batches, so no whole corpus is ever held in memory (the longest document is, once, as UTF-8). `datasets`
runs offline with its cache under the job's temporary folder unless HF_DATASETS_CACHE is set.
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data_prep.errors import PrepError
from data_prep.paths import identity

TEXT, JSON, PARQUET, ARROW = "text", "json", "parquet", "arrow"
FORMATS = ("auto", TEXT, JSON, PARQUET, ARROW)
_SUFFIX_KIND = {".jsonl": JSON, ".json": JSON, ".ndjson": JSON, ".parquet": PARQUET, ".pq": PARQUET}
_CHUNK = 1 << 22
_READ_CHARS = 1 << 22
"""Characters decoded at a time when reading a plain-text document."""
_TEXT_BATCH_BYTES = 1 << 22
"""Plain-text documents (one per file) are handed on in batches of up to this many bytes; a larger file alone."""
BATCH_ROWS = 1024
"""Documents per batch read (datasets re-cuts its rows into batches of exactly this many, across files)."""


@dataclass(frozen=True)
class Source:
    """One input: a file, or a save_to_disk folder (kind 'arrow')."""

    path: Path
    kind: str
    size: int | None = None
    """A file's size in bytes when it was resolved (None for a folder): inputs are read more than once, and a
    file whose size changed in between is refused rather than read as different text."""


@dataclass(frozen=True)
class ReadOptions:
    """How input files become documents."""

    line_docs: bool = False
    """Plain text: every line is a document (else every file is one)."""
    text_field: str = "text"
    """The field holding the text in JSON Lines, Parquet and save_to_disk inputs."""
    errors: str = "strict"
    """Undecodable bytes in plain text: 'strict' refuses the file, 'replace' substitutes U+FFFD."""
    cache_dir: Path | None = None
    """datasets' cache folder; None: datasets' own default (HF_DATASETS_CACHE)."""


def resolve_sources(patterns: Sequence[str], option: str, fmt: str = "auto") -> list[Source]:
    """Expand files and globs (sorted, in the order given) into Sources; errors name the option and pattern."""
    sources: list[Source] = []
    for pattern in patterns:
        path = Path(pattern)
        if _exists(path, option):
            paths = [path]
        elif glob.has_magic(pattern):
            paths = [Path(p) for p in sorted(glob.glob(pattern, recursive=True))]
            if not paths:
                raise PrepError(f"{option} {pattern!r}: no file matches this pattern")
        else:
            raise PrepError(f"{option} {pattern}: no such file or folder")
        for p in paths:
            sources.append(_source(p, option, fmt))
    check_disjoint({option: sources})
    return sources


def _exists(path: Path, option: str) -> bool:
    """Whether the input `path` exists; one that cannot be looked up (a folder on its way that this user may
    not search) is refused, naming it."""
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise PrepError(f"{option} {path}: cannot be read ({e.strerror}); check the permissions of it and of "
                        "the folders above it") from None
    return True


def _twice(option: str, path: Path, first: Path, first_option: str) -> PrepError:
    """The refusal of an input given twice: both names when they differ (a link, a hard link, another spelling)."""
    if first_option == option:
        if str(first) == str(path):
            return PrepError(f"{option}: {path} is given twice; each input may appear once")
        return PrepError(f"{option}: {path} and {first} are the same file; each input may appear once")
    also = path if str(first) == str(path) else f"{path} (the same file as {first})"
    return PrepError(f"{option}: {also} is also given to {first_option}; each input may appear once")


def check_disjoint(sources: dict[str, list[Source]]) -> None:
    """No input may appear twice, within one option or across options (keys: the option names, e.g. --train,
    --source web): by real path and by (st_dev, st_ino), so also not through a symlink or a hard link.
    Across splits evaluation text would leak into training."""
    by_path: dict[Path, tuple[str, Path]] = {}
    by_inode: dict[tuple[int, int], tuple[str, Path]] = {}
    for option, option_sources in sources.items():
        for s in option_sources:
            key, inode = s.path.resolve(), identity(s.path)
            first = by_path.get(key) or (by_inode.get(inode) if inode is not None else None)
            if first is not None:
                raise _twice(option, s.path, first[1], first[0])
            by_path[key] = (option, s.path)
            if inode is not None:
                by_inode[inode] = (option, s.path)


def check_disjoint_splits(sources: dict[str, list[Source]]) -> None:
    """check_disjoint over the splits (split -> sources)."""
    check_disjoint({f"--{split}": split_sources for split, split_sources in sources.items()})


def check_no_copies_across_splits(sources: dict[str, list[Source]], scanned: dict[str, list[dict]]) -> None:
    """Two files of the same bytes (a copy) in two splits put evaluation text into training as surely as one
    file would (or one text into both evaluation splits): refused by the sha256 the scan took. (save_to_disk
    folders are left out: the metadata files of two splits of one dataset can be byte-identical while their
    data differ.)"""
    files = {str(s.path) for split_sources in sources.values() for s in split_sources if s.kind != ARROW}
    owner: dict[str, tuple[str, str]] = {}
    for split, entries in scanned.items():
        for entry in entries:
            if entry["path"] not in files:
                continue
            first = owner.setdefault(entry["sha256"], (split, entry["path"]))
            if first[0] != split:
                harm = ("evaluation text would be trained on" if "train" in (split, first[0])
                        else f"{first[0]} and {split} would measure the same text")
                raise PrepError(f"--{split}: {entry['path']} has the same bytes as {first[1]} (--{first[0]}); "
                                f"{harm}: give each text to one split")


_SAVED_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
"""Files `save_to_disk` writes at the top of a Dataset (the first two) or a DatasetDict (the last) folder."""

_NOT_REGULAR = ((stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"))

_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
_BZIP2_BLOCK_MAGICS = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")
"""bzip2: "BZh", a level digit, then a block or end-of-stream magic (so no text starting "BZh" matches)."""


def _source(path: Path, option: str, fmt: str) -> Source:
    try:
        st = path.stat()
    except OSError as e:
        raise PrepError(f"{option} {path}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        if fmt not in ("auto", ARROW) or not any((path / m).is_file() for m in _SAVED_MARKERS):
            raise PrepError(f"{option} {path}: is a folder but not a `save_to_disk` dataset; "
                            "give files or a glob such as DIR/*.txt")
        return Source(path, ARROW)
    for is_kind, what in _NOT_REGULAR:
        # every input is read at least twice (checked and hashed, then tokenized): a stream would be empty the
        # second time, and a FIFO with no writer would block forever
        if is_kind(st.st_mode):
            raise PrepError(f"{option} {path}: is {what}, not a regular file; inputs are read more than once, "
                            "so write it to a file first")
    if fmt == ARROW:
        raise PrepError(f"{option} {path}: --format arrow expects a `save_to_disk` folder, got a file")
    if st.st_size == 0 and _has_content(path, option):
        raise PrepError(f"{option} {path}: is not a regular file of text: it reports 0 bytes but has content "
                        "(a /proc or /sys file, made as it is read); copy it to a file first")
    kind = fmt if fmt != "auto" else _SUFFIX_KIND.get(path.suffix.lower(), TEXT)
    if kind in (TEXT, JSON):
        _refuse_compressed(path, option)
    return Source(path, kind, st.st_size)


def _has_content(path: Path, option: str) -> bool:
    """Whether a file that stat says is empty gives bytes when read (procfs and sysfs files do)."""
    try:
        with open(path, "rb") as f:
            return bool(f.read(1))
    except OSError as e:
        raise PrepError(f"{option} {path}: cannot be read ({e.strerror})") from None


def _refuse_compressed(path: Path, option: str) -> None:
    """Compressed bytes are not text: with --errors replace they would become a corpus of U+FFFD."""
    try:
        with open(path, "rb") as f:
            head = f.read(10)
    except OSError as e:
        raise PrepError(f"{option} {path}: cannot be read ({e.strerror})") from None
    kind = next((name for magic, name in _COMPRESSED if head.startswith(magic)), None)
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in _BZIP2_BLOCK_MAGICS:
        kind = "bzip2"
    if kind is not None:
        raise PrepError(f"{option} {path}: is {kind}-compressed; decompress it first "
                        "(data_prep reads plain text, JSON Lines, Parquet and save_to_disk folders)")


def source_files(source: Source) -> list[Path]:
    """The files that make up a source (one, or every file of a save_to_disk folder)."""
    if source.kind != ARROW:
        return [source.path]
    return sorted(p for p in source.path.rglob("*") if p.is_file())


def scan_sources(sources: Sequence[Source], opts: ReadOptions, progress=None) -> list[dict]:
    """Hash every input file and check it before any work: not empty, valid UTF-8 for text and JSON Lines.

    Returns the provenance entries [{path, bytes, sha256}]. `progress(n_bytes)` is called as bytes are read.
    An invalid byte is reported with the file and its byte offset (plain text with errors='replace' is
    exempt: the bytes are replaced when read).
    """
    entries = []
    for source in sources:
        for path in source_files(source):
            size, digest = hash_and_check(path, checks_utf8(source.kind, opts), utf8_hint(source.kind), progress)
            if size == 0 and source.kind != ARROW:
                raise PrepError(f"input {path} is empty; remove it or give it text")
            if source.size is not None and size != source.size:
                raise_changed(path, source.size, size)
            entries.append({"path": str(path), "bytes": size, "sha256": digest})
    return entries


def checks_utf8(kind: str, opts: ReadOptions) -> bool:
    """Whether an input of this kind must be valid UTF-8: JSON Lines always, plain text unless --errors replace."""
    return kind == JSON or (kind == TEXT and opts.errors == "strict")


def utf8_hint(kind: str) -> str:
    """What an invalid-UTF-8 refusal of an input of this kind adds."""
    return "; pass --errors replace to substitute U+FFFD" if kind == TEXT else ""


def hash_and_check(path: Path, check_utf8: bool, hint: str, progress=None) -> tuple[int, str]:
    h = hashlib.sha256()
    checker = Utf8Checker(path, hint) if check_utf8 else None
    offset = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                if checker is not None:
                    checker.feed(chunk, offset)
                offset += len(chunk)
                if progress is not None:
                    progress(len(chunk))
    except OSError as e:
        raise PrepError(f"input {path}: cannot be read ({e.strerror})") from None
    if checker is not None:
        checker.finish(offset)
    return offset, h.hexdigest()


def raise_changed(path: Path, expected: int, found: int) -> None:
    raise PrepError(f"input {path}: changed while the job ran ({expected:,} bytes when found, {found:,} now); "
                    "run again once it is complete")


class Utf8Checker:
    """Checks consecutive chunks of one file for UTF-8 and names the file and byte offset of the first bad byte."""

    def __init__(self, path: Path, hint: str):
        self.path, self.hint = path, hint
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def feed(self, chunk: bytes, offset: int) -> None:
        """Check the chunk that starts at byte `offset` (where the previous one ended, or at a character start)."""
        pending = len(self.decoder.getstate()[0])  # bytes of a character split across the previous chunk boundary
        try:
            self.decoder.decode(chunk)
        except UnicodeDecodeError as e:
            raise PrepError(f"input {self.path}: invalid UTF-8 at byte offset {offset - pending + e.start}"
                            f"{self.hint}") from None

    def finish(self, end: int) -> None:
        """The chunks ended at byte `end`: they must not end inside a character."""
        tail = len(self.decoder.getstate()[0])  # bytes of an unfinished character at the end
        try:
            self.decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise PrepError(f"input {self.path}: invalid UTF-8 at byte offset {end - tail} "
                            f"(the file ends inside a character){self.hint}") from None


# ----------------------------------------------------------------------------------------------------
# Reading documents


def iter_documents(sources: Sequence[Source], opts: ReadOptions, batch_rows: int | None = None
                   ) -> Iterator[tuple[str, pa.Array]]:
    """Yield (label, string array) batches of documents, in input order; label names the batch's file(s).

    Consecutive plain-text files are read as one group (one `load_dataset` call with --line-docs: per-call
    overhead matters for many small files); every other input is read on its own so that an error can name it.
    """
    batch_rows = batch_rows or BATCH_ROWS
    i = 0
    while i < len(sources):
        j = i + 1
        if sources[i].kind == TEXT:
            while j < len(sources) and sources[j].kind == TEXT:
                j += 1
        group = sources[i:j]
        group_label = files_label([s.path for s in group])
        n_rows = 0
        for label, column in _read_group(group, opts, batch_rows, group_label):
            check_no_nulls(label, column, opts.text_field)
            n_rows += len(column)
            yield label, column
        if n_rows == 0:
            raise PrepError(f"input {group_label}: holds no documents; remove it or give it text")
        i = j


def count_documents(sources: Sequence[Source], opts: ReadOptions, progress=None) -> int:
    """Number of documents the sources hold (a cheap pass: no tokenizing, no Python strings).

    `progress(n)` is called as documents are counted.
    """
    if all(s.kind == TEXT for s in sources) and not opts.line_docs:
        return len(sources)
    n = 0
    for _, column in iter_documents(sources, opts, batch_rows=8192):
        n += len(column)
        if progress is not None:
            progress(len(column))
    return n


def _read_group(group: Sequence[Source], opts: ReadOptions, batch_rows: int, label: str
                ) -> Iterator[tuple[str, pa.Array]]:
    """(label, documents) batches of one group of inputs; the label names the batch's file(s)."""
    import datasets  # heavy import, only in the commands that read inputs

    kind = group[0].kind
    cache = str(opts.cache_dir) if opts.cache_dir else None
    logging.getLogger(_DATASETS_JSON_LOGGER).addFilter(_DROP_LOAD_FAILURE)  # a no-op once it is there
    try:
        if kind == TEXT and not opts.line_docs:
            yield from read_text_documents(group, opts.errors, batch_rows)
            return
        if kind == ARROW:
            if saved_dataset_is_empty(group[0].path):
                raise PrepError(f"input {label}: holds no documents; remove it or give it text")
            ds = datasets.load_from_disk(str(group[0].path))
            if isinstance(ds, datasets.DatasetDict):
                raise PrepError(f"input {label}: is a DatasetDict ({', '.join(ds)}); "
                                f"give the folder of one split, e.g. {label}/{next(iter(ds), 'train')}")
            check_field(ds.column_names, opts.text_field, label)
            ds = ds.select_columns([opts.text_field])
        else:
            # glob.escape: datasets treats data_files as patterns; a '[' in a file name would match nothing.
            files = [glob.escape(str(s.path.resolve())) for s in group]
            kwargs = {}
            if kind == TEXT:
                # utf-8-sig: a file's leading byte order mark is no text, as _read_text_file reads it
                kwargs = {"sample_by": "line" if opts.line_docs else "document", "encoding": "utf-8-sig",
                          "encoding_errors": opts.errors}
            elif kind == PARQUET:
                kwargs = {"columns": [opts.text_field]}
            ds = datasets.load_dataset(kind, data_files=files, split="train", streaming=True, cache_dir=cache,
                                       **kwargs)
        for table in ds.with_format("arrow").iter(batch_size=batch_rows):
            if kind == TEXT:
                column = table.column("text")
            else:
                check_field(table.column_names, opts.text_field, label)
                column = table.column(opts.text_field)
            check_text_type(label, column.type, opts.text_field)
            yield label, column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    except PrepError:
        raise
    except StopIteration:
        # datasets 5.2's JSON reader, on a file without one line of JSON (0 bytes): raised out of this generator
        # it would become "RuntimeError: generator raised StopIteration".
        raise PrepError(f"input {label}: holds no documents; remove it or give it text") from None
    except UnicodeDecodeError as e:
        raise PrepError(f"input {label}: invalid UTF-8 ({e.reason}); pass --errors replace") from None
    except (ValueError, OSError, pa.ArrowException, datasets.exceptions.DatasetsError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if kind == JSON:
            first = json_fault(group[0].path) or _ARROW_ROW.sub("", first)
        raise PrepError(f"input {label}: cannot be read as {kind} ({first})") from None


_DATASETS_JSON_LOGGER = "datasets.packaged_modules.json.json"
_ARROW_ROW = re.compile(r" in row \d+")
"""Arrow's "in row N" counts rows from 0 and from the start of the block `datasets` handed it, not lines of
the file: no number the user could look up."""


class _DropLoadFailure(logging.Filter):
    """`datasets` logs "Failed to load JSON from file ..." (a second line, with Arrow's row number) just before
    it raises the error that becomes the input's one-line refusal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Failed to load JSON from file",
                                               "Failed to convert pandas DataFrame to Arrow Table"))


_DROP_LOAD_FAILURE = _DropLoadFailure()
JSON_SCAN_BYTES = 1 << 30
"""json_fault looks this far into a file for its first bad line: reading on would hold a refusal up for
minutes, for a line number only."""
_JSON_VALUE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
                     type(None): "null"}
_NOT_SPACE = re.compile(r"[^ \t\r\n]")


def json_fault(path: Path) -> str | None:
    """`line N, column C: what` (1-based) of the first line of JSON Lines input `path` that holds anything but
    JSON objects, or None when its first JSON_SCAN_BYTES hold none (Arrow refused something else, or later)."""
    decoder = json.JSONDecoder()  # NaN and Infinity included: Arrow reads them as numbers too
    seen = 0
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                seen += len(raw)
                if seen > JSON_SCAN_BYTES:
                    return None
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    return None  # refused by its own check, which names the byte
                if number == 1:
                    line = line.removeprefix("\ufeff")
                found = _NOT_SPACE.search(line)
                while found:  # Arrow also takes several objects on one line
                    try:
                        value, end = decoder.raw_decode(line, found.start())
                    except json.JSONDecodeError as e:
                        return f"line {number}, column {e.colno}: {e.msg}"
                    if not isinstance(value, dict):
                        return f"line {number}, column {found.start() + 1}: {_JSON_VALUE_NAMES[type(value)]}, " \
                               "not an object"
                    found = _NOT_SPACE.search(line, end)
    except OSError:
        return None
    return None


def saved_dataset_is_empty(folder: Path) -> bool:
    """Whether a save_to_disk Dataset folder holds no data file (datasets' load_from_disk fails on one with an
    IndexError)."""
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return False  # not a Dataset's state (a DatasetDict, or damaged): load_from_disk says what it is
    return isinstance(state, dict) and state.get("_data_files") == []


def read_text_documents(group: Sequence[Source], errors: str, batch_rows: int) -> Iterator[tuple[str, pa.Array]]:
    """One document per plain-text file, in batches of up to batch_rows files and _TEXT_BATCH_BYTES (a larger
    file alone), each labelled with its file(s).

    Read here, not by `datasets`: it holds a file as one Python string (up to 4 bytes per character) and then
    copies it into an Arrow `string`, which cannot hold 2 GiB; here a file becomes UTF-8 in one buffer about
    its size, in a `large_string` (64-bit offsets).
    """
    parts: list[bytearray] = []
    paths: list[Path] = []
    n_bytes = 0
    for source in group:
        if text_batch_full(len(parts), n_bytes, source.path.stat().st_size, batch_rows):
            yield files_label(paths), _large_strings(parts)
            parts, paths, n_bytes = [], [], 0
        parts.append(_read_text_file(source.path, errors, source.size))
        paths.append(source.path)
        n_bytes += len(parts[-1])
    if parts:
        yield files_label(paths), _large_strings(parts)


def text_batch_full(n_files: int, n_text_bytes: int, next_file_size: int, batch_rows: int) -> bool:
    """Whether a batch of one-document-per-file texts (n_files of them, n_text_bytes of UTF-8) is handed on
    before the next file (of next_file_size bytes on disk) is read."""
    return n_files > 0 and (n_files == batch_rows or n_text_bytes + next_file_size > _TEXT_BATCH_BYTES)


def read_text_batch(paths: Sequence[Path], errors: str, sizes: Sequence[int | None] | None = None) -> pa.Array:
    """One-document-per-file texts, one batch (see read_text_documents); `sizes`: the files' sizes in bytes
    when they were found (a file of another size now is refused)."""
    sizes = sizes or [None] * len(paths)
    return _large_strings([_read_text_file(p, errors, n) for p, n in zip(paths, sizes)])


def _read_text_file(path: Path, errors: str, expected_size: int | None = None) -> bytearray:
    """The file's text as UTF-8, exactly what `open(path, encoding="utf-8-sig", errors=errors, newline="").read()`
    gives (newlines kept as they are, "\\r\\n" and "\\r" too, so that a tokenizer that keeps the text gives
    the file back; a leading byte order mark dropped, as JSON Lines readers drop it), decoded _READ_CHARS at a
    time into one buffer. A file whose bytes read differ from
    `expected_size` (it changed since it was scanned) is refused."""
    out = bytearray(path.stat().st_size)  # the text's size, unless errors="replace" makes it longer
    n = 0
    with open(path, encoding="utf-8-sig", errors=errors, newline="") as f:
        while chunk := f.read(_READ_CHARS):
            data = chunk.encode("utf-8")
            out[n:n + len(data)] = data  # grows the buffer where the slice runs past its end
            n += len(data)
        n_read = f.buffer.tell()
    if expected_size is not None and n_read != expected_size:
        raise_changed(path, expected_size, n_read)
    del out[n:]
    return out


def _large_strings(parts: list[bytearray]) -> pa.Array:
    """A large_string array of the UTF-8 texts; one text is wrapped without a copy."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)  # [n + 1]
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    return pa.LargeStringArray.from_buffers(len(parts), pa.py_buffer(offsets), pa.py_buffer(data))


def is_text_type(type_: pa.DataType) -> bool:
    return pa.types.is_string(type_) or pa.types.is_large_string(type_)


def check_text_type(label: str, type_: pa.DataType, field: str) -> None:
    """The text field must hold strings."""
    if not is_text_type(type_):
        raise PrepError(f"input {label}: field {field!r} holds {type_}, not text; "
                        "pass --text-field NAME of a string field")


def check_no_nulls(label: str, column: pa.Array, field: str) -> None:
    """Every document must have text."""
    if column.null_count:
        raise PrepError(f"input {label}: {column.null_count} document(s) have no text "
                        f"(null {field!r}); drop them or fill them in")


def files_label(paths: Sequence[Path]) -> str:
    return str(paths[0]) if len(paths) == 1 else f"{paths[0]} .. {paths[-1]} ({len(paths)} files)"


def check_field(names: Sequence[str], field: str, label: str) -> None:
    if field not in names:
        raise PrepError(f"input {label}: no field {field!r} (fields: {', '.join(names)}); "
                        "pass --text-field NAME")
