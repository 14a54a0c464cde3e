"""Token files: the Arrow IPC writer used by data_prep and the memory-mapped reader used by the loader.

A token file is an Arrow IPC *file* (random access, footer at the end) with one column "tokens" of
uint16 or int32 and any number of record batches. Reading memory-maps the file, so a slice that lies
inside one record batch is a numpy view of the page cache: no copy, no read of the rest of the file.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import hashlib
import io
import mmap
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from ..errors import one_line
from .manifest import DTYPES, CorpusError, CorpusFault, FileEntry, Manifest, is_readable_file, sha256_file

MAPPED_AROUND_BYTES = 1 << 21
"""How far from a token it reads a page fault may map the file's pages: fault-around maps 64 KiB, and a large
folio of the page cache (ext4 and XFS on recent kernels) up to its 2 MiB, also pages a reader has passed or
skipped. So a release covers this much around what was read. Measured on Linux 6.18, ext4: a stream unmapped
from 64 KiB back left 4% of the bytes read resident (runs of 0.2-0.7 MiB), from 2 MiB none; an index
mixture's gather with a 64 KiB margin left 57 MiB of a 191 MB source mapped, with 2 MiB none."""

COLUMN = "tokens"
SLICE_COPY_TOKENS = 64
"""gather() copies a range at least this long with one slice copy (memcpy speed, ~0.6 us of Python per range);
shorter ones go through one vectorized index computation per record batch (10-25 ns per token, no Python step
per range). Random ranges of 100 / 300 / 1,000 tokens: 5.7 / 2.1 / 1.0 ns per token against 11.6 / 10.0 / 8.4
indexed."""
_ARROW_TYPES = {"uint16": pa.uint16(), "int32": pa.int32()}


def token_schema(dtype: str) -> pa.Schema:
    """The one-column schema of a token file."""
    if dtype not in _ARROW_TYPES:
        raise ValueError(f"token dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return pa.schema([(COLUMN, _ARROW_TYPES[dtype])])


def update_tokens_sha256(h: Any, tokens: np.ndarray, dtype: str) -> None:
    """Feed tokens to a running split tokens_sha256 (hashlib object): raw little-endian bytes in `dtype`.

    Hashing the values, not the file bytes, makes the result independent of files and record batches.
    The caller guarantees the values fit `dtype` (the cast is unchecked).
    """
    h.update(np.ascontiguousarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).data)


class _HashingSink(io.RawIOBase):
    """A write-only file that hashes what passes through, so the writer needs no second read pass."""

    def __init__(self, f: Any):
        super().__init__()
        self._f = f
        self.sha256 = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sha256.update(b)
        return self._f.write(b)


class ArrowTokenWriter:
    """Write one token file: `.write(tokens)` appends a record batch; `.close()` -> (n_tokens, sha256).

    The data goes to `path + '.tmp'`, fsynced and renamed to `path` on close, so a crash never leaves a
    file that looks complete. Leaving the `with` block on an exception removes the temporary file.
    `tokens_hash` (a hashlib object, optional) is fed every token written (update_tokens_sha256), so a
    caller can hash a split's stream across all its files while writing them.
    """

    def __init__(self, path: str | os.PathLike, dtype: str, tokens_hash: Any = None):
        self.path = Path(path)
        self.tmp_path = Path(f"{self.path}.tmp")
        self.dtype = dtype
        self.schema = token_schema(dtype)
        self._np_dtype = np.dtype(dtype)
        self._info = np.iinfo(self._np_dtype)
        self.n_tokens = 0
        self._tokens_hash = tokens_hash
        self._file = open(self.tmp_path, "wb")
        self._sink = _HashingSink(self._file)
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self._result: tuple[int, str] | None = None

    def write(self, tokens: np.ndarray) -> None:
        """Append `tokens` (1-D integer array, values must fit the dtype) as one record batch."""
        if self._result is not None:
            raise ValueError(f"{self.path}: write() after close()")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{self.path}: tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size == 0:
            return
        if tokens.dtype != self._np_dtype:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < self._info.min or hi > self._info.max:
                raise ValueError(f"{self.path}: token ids {lo}..{hi} do not fit {self.dtype}")
            tokens = tokens.astype(self._np_dtype)
        if self._tokens_hash is not None:
            update_tokens_sha256(self._tokens_hash, tokens, self.dtype)
        batch = pa.record_batch([pa.array(tokens)], schema=self.schema)
        with self._naming_the_file():
            self._writer.write_batch(batch)
        self.n_tokens += tokens.size

    def close(self) -> tuple[int, str]:
        """Finish the file, rename it into place, return (n_tokens, sha256 of the file). Idempotent."""
        if self._result is None:
            with self._naming_the_file():
                self._writer.close()
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            os.replace(self.tmp_path, self.path)
            self._result = (self.n_tokens, self._sink.sha256.hexdigest())
        return self._result

    @contextlib.contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        """An OSError of the file write (a full disk, a quota, an I/O error) names the file: Python's file
        object raises ENOSPC without a filename, so the caller could not tell which file system is full."""
        try:
            yield
        except OSError as e:
            if e.filename is not None or e.errno is None:
                raise
            raise OSError(e.errno, e.strerror, str(self.tmp_path)) from e

    def abort(self) -> None:
        """Drop the partial file (nothing is renamed into place); never raises for the file's own write error
        (a full disk fails again when closing flushes the buffer), which the caller is already handling."""
        if self._result is None:
            try:
                self._file.close()
            except OSError:
                pass  # the buffered bytes cannot be written either: the file goes anyway
            self.tmp_path.unlink(missing_ok=True)
            self._result = (0, "")

    def __enter__(self) -> ArrowTokenWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _OpenFile:
    """One memory-mapped token file and the global-stream offsets of its record batches."""

    def __init__(self, entry: FileEntry, path: Path, dtype: str, verify: bool):
        _check_file(entry, path, verify)
        self.path = path
        self._mmap = _map(path)
        try:
            self.arrays = _token_arrays(self._mmap, path, dtype)
            self.starts = _batch_starts(self.arrays, entry, path)
            identity = file_identity(path, self._mmap.size())
            self._mmap.seek(0)
            whole = self._mmap.read_buffer()  # zero-copy: the mapping itself, whose bounds drop_pages keeps to
            self._region = (whole.address, whole.address + whole.size)
            del whole
        except BaseException:
            self._mmap.close()
            raise
        self._identity = identity

    def check_not_truncated(self) -> None:
        """CorpusFault when the file was cut shorter in place since it was mapped (check_not_shrunk)."""
        check_not_shrunk(self._identity)

    def release(self, start: int, stop: int) -> None:
        """Unmap this process's pages of the file's tokens [start, stop) (global stream positions): one madvise,
        as the record batches lie in file order in the one mapping (the framing between them goes too, and
        faults in again if read), however many batches the range crosses (an index split's reader drops the
        span of hundreds of documents shuffled across a source, or whole source files)."""
        start, stop = max(start, self.starts[0]), min(stop, self.starts[-1])
        if start >= stop or not self.arrays:
            return
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_right(self.starts, stop - 1) - 1
        drop_pages(*mapped_span([self.arrays[first][start - self.starts[first]:],
                                 self.arrays[last][:stop - self.starts[last]]]), self._region)

    def close(self) -> None:
        self.arrays = []
        self._region = (0, 0)  # the addresses may be mapped again, to anything
        self._mmap.close()


def _madvise() -> Any:
    """libc's madvise, or None where it cannot be had (then nothing is unmapped early)."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise() if hasattr(mmap, "MADV_DONTNEED") else None


def file_identity(path: Path, mapped_size: int) -> tuple[Path, int, int]:
    """What check_not_shrunk compares: the path, its inode now and the size of the mapping made of it."""
    return path, os.stat(path).st_ino, mapped_size


def check_not_shrunk(identity: tuple[Path, int, int]) -> None:
    """CorpusFault when the file (file_identity at mapping time) was cut shorter in place since: a read of the
    pages past its new end would kill the process with SIGBUS, no line said. A file replaced under its name
    (another inode) is not this one: the mapping still reads the file as it was."""
    path, ino, size = identity
    try:
        st = os.stat(path)
    except OSError:
        return  # removed or unreachable by name: the mapping holds the file as it was
    if st.st_ino == ino and st.st_size < size:
        raise CorpusFault(f"{path}: the file shrank from {size} to {st.st_size} bytes while this run read "
                          "it (truncated, or rewritten in place); put the prepared file back (`python -m "
                          "data_prep verify` checks the corpus) and resume from the last checkpoint")


def mapped_span(views: list[np.ndarray]) -> tuple[int, int]:
    """The addresses [lo, hi) from the first byte of the lowest of `views` to the end of the highest."""
    return (min(v.ctypes.data for v in views), max(v.ctypes.data + v.nbytes for v in views))


def mapped_region(path: Path, address: int) -> tuple[int, int]:
    """The addresses [lo, hi) of this process's mapping of the file `path` that holds `address` (from
    /proc/self/maps: the line whose range holds it and whose inode is the file's), or (0, 0) when none is
    found (then drop_pages drops nothing)."""
    try:
        ino = os.stat(path).st_ino
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                if lo <= address < hi and len(fields) >= 5 and int(fields[4]) == ino:
                    return lo, hi
    except (OSError, ValueError):
        pass
    return 0, 0


def drop_pages(lo: int, hi: int, region: tuple[int, int]) -> None:
    """MADV_DONTNEED on the whole pages of the addresses [lo, hi) inside `region`, a read-only mapping of a
    file (its bounds: [lo, hi) is clipped to them, as a view that pyarrow copied out of the mapping lies
    elsewhere, and an anonymous page dropped would read back as zeros). The pages leave the resident set and
    fault back in from the page cache (or the file) if read again, so what the mapping reads never changes."""
    lo, hi = max(lo, region[0]), min(hi, region[1])
    if _MADVISE is None or hi <= lo:
        return
    lo -= lo % mmap.PAGESIZE  # the partial first page too (the mapping starts at a page): it only faults in again
    hi -= hi % mmap.PAGESIZE  # not the partial last page: it is still read
    if hi > lo:
        _MADVISE(lo, hi - lo, mmap.MADV_DONTNEED)


def _check_file(entry: FileEntry, path: Path, verify: bool) -> None:
    if not is_readable_file(path):
        if path.is_dir():
            raise CorpusError(f"{path}: is a folder, not a file (the manifest lists an Arrow file there); re-run "
                              "prepare")
        if os.path.lexists(path):  # a FIFO, a device, a link to nothing
            raise CorpusError(f"{path}: is not a regular file (the manifest lists an Arrow file there); re-run "
                              "prepare")
        raise CorpusError(f"{path}: corpus file is missing (listed in the manifest); re-run prepare")
    if not verify:
        return
    try:
        got = sha256_file(path)
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or one_line(e)}); check the file and its "
                          "permissions") from None
    if got != entry.sha256:
        raise CorpusError(f"{path}: sha256 {got[:12]}... differs from the manifest's {entry.sha256[:12]}...: "
                          "the file is corrupt, truncated or replaced; re-run prepare")


def _map(path: Path) -> pa.MemoryMappedFile:
    try:
        return pa.memory_map(str(path), "r")
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or one_line(e)}); check the file and its "
                          "permissions") from None


def _token_arrays(mapped: pa.MemoryMappedFile, path: Path, dtype: str) -> list[np.ndarray]:
    """The token column of each non-empty record batch, as views into the mapped file."""
    # Unverified (verify=False) bytes reach pyarrow here: every pyarrow error is the file's fault.
    try:
        reader = pa.ipc.open_file(mapped)
        if reader.schema != token_schema(dtype):
            raise CorpusError(f"{path}: schema is ({reader.schema.to_string(show_schema_metadata=False)}"
                              f"), expected one column '{COLUMN}' of {dtype}".replace("\n", ", "))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        for b in batches:
            b.validate()  # lengths and buffer sizes agree (cheap; the values are verify's business)
        # to_numpy of a null-free primitive column never copies; a corrupt null count makes it refuse.
        return [b.column(0).to_numpy(zero_copy_only=True) for b in batches if b.num_rows]
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable Arrow IPC file (truncated or corrupt): {one_line(e)}; "
                          "re-run prepare") from None


def _batch_starts(arrays: list[np.ndarray], entry: FileEntry, path: Path) -> list[int]:
    """starts[i] = global index of arrays[i][0]; starts[-1] = end of the file (checked against the manifest)."""
    starts = [entry.first_token]
    for a in arrays:
        starts.append(starts[-1] + len(a))
    if starts[-1] - entry.first_token != entry.n_tokens:
        raise CorpusError(f"{path}: holds {starts[-1] - entry.first_token} tokens, the manifest says "
                          f"{entry.n_tokens}; re-run prepare")
    return starts


class StreamReader:
    """What every reader of a split's global stream shares (TokenReader here, IndexReader in index_split.py):
    n_tokens, the range check, and use as a context manager that closes it."""

    def __init__(self, corpus_dir: str | os.PathLike, manifest: Manifest, split: str, verify: bool):
        if split not in manifest.splits:
            raise CorpusError(f"{Path(corpus_dir) / 'manifest.json'}: no split '{split}'; "
                              f"the corpus has {', '.join(sorted(manifest.splits))}")
        self.corpus_dir = Path(corpus_dir)
        self.split = split
        self.entry = manifest.splits[split]
        self.n_tokens = self.entry.n_tokens
        self.dtype = manifest.dtype
        self.verify = verify

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def release(self, start: int, stop: int) -> None:
        """Tokens [start, stop) will not be read again soon: drop what this process holds of them (a reader
        whose reads are copies holds nothing; TokenReader unmaps their pages)."""

    def check_unchanged(self, start: int, stop: int) -> None:
        """CorpusFault (one line) when a file holding tokens [start, stop) changed since it was opened in a way
        that reading it would crash the process (TokenReader: cut shorter in place)."""

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"split '{self.split}': token range [{start}, {stop}) is outside [0, {self.n_tokens})")


class TokenReader(StreamReader):
    """Random access to a split's global stream; opens (and verifies) a file only when first touched.

    `read(start, stop)` returns the tokens [start, stop) in the file dtype: a zero-copy view when the
    range lies inside one record batch, else one concatenated copy. With `verify` (default) a file's
    sha256 is checked when it is opened, which reads the file once; data_prep's inspect may turn it off.
    """

    def __init__(self, corpus_dir: str | os.PathLike, manifest: Manifest, split: str, *, verify: bool = True):
        super().__init__(corpus_dir, manifest, split, verify)
        self._file_starts = [f.first_token for f in self.entry.files]
        self._open: dict[int, _OpenFile] = {}
        self.files_opened: list[str] = []
        """Manifest paths of the files opened so far, in opening order."""

    def file_indices(self, start: int, stop: int) -> range:
        """Indices (into the split's file list) of the files overlapping tokens [start, stop)."""
        self._check_range(start, stop)
        if start == stop:
            return range(0)
        first = bisect.bisect_right(self._file_starts, start) - 1
        last = bisect.bisect_right(self._file_starts, stop - 1) - 1
        return range(first, last + 1)

    def open_range(self, start: int, stop: int) -> list[str]:
        """Open (and verify) every file overlapping [start, stop) now; returns their manifest paths."""
        indices = self.file_indices(start, stop)
        for i in indices:
            self._file(i)
        return [self.entry.files[i].path for i in indices]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream, in the file dtype (a view when possible)."""
        pieces = list(self.chunks(start, stop))
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.dtype)

    def chunks(self, start: int, stop: int) -> Iterator[np.ndarray]:
        """Tokens [start, stop) as consecutive zero-copy views, one per record batch touched.

        Streaming a large range this way (relayout, verify) needs no memory beyond the page cache.
        """
        self._check_range(start, stop)
        pos = start
        while pos < stop:
            f = self._file(bisect.bisect_right(self._file_starts, pos) - 1)
            b = bisect.bisect_right(f.starts, pos) - 1
            base = f.starts[b]
            end = min(stop, f.starts[b + 1])
            yield f.arrays[b][pos - base:end - base]
            pos = end

    def gather(self, starts: np.ndarray, stops: np.ndarray, out: np.ndarray | None = None,
               out_at: np.ndarray | None = None) -> np.ndarray:
        """Copy the ranges [starts[i], stops[i]) to out[out_at[i]:...] (default: one after another in a new
        array); returns `out`. Vectorized per record batch: `mix` copies millions of short documents this way
        without a Python step per document. Only the files holding the ranges are opened (and verified), as
        read() does: an index mixture's loader gathers from a few files of a large source."""
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)  # [n], [n]
        lengths = stops - starts  # [n]
        if len(lengths) and (lengths.min() < 1 or starts.min() < 0 or stops.max() > self.n_tokens):
            raise IndexError(f"split '{self.split}': gather ranges must be non-empty and inside [0, {self.n_tokens})")
        if out is None:
            out = np.empty(int(lengths.sum()), dtype=self.dtype)  # [sum of lengths]
            out_at = np.cumsum(lengths) - lengths  # [n]: where each range goes in `out`
        file_starts = np.asarray(self._file_starts, dtype=np.int64)  # [n_files]
        first = np.searchsorted(file_starts, starts, side="right") - 1  # [n]: file of each range's first token
        last = np.searchsorted(file_starts, stops - 1, side="right") - 1  # [n]: ... and of its last one
        for i in np.flatnonzero(first != last):  # a range across files: rare, copied piece by piece
            out[out_at[i]:out_at[i] + lengths[i]] = self.read(int(starts[i]), int(stops[i]))
        inside = np.flatnonzero(first == last)
        for i in np.unique(first[inside]):
            f = self._file(int(i))
            in_file = inside[first[inside] == i] if len(file_starts) > 1 else inside
            self._gather_in_file(f, starts, lengths, in_file, out, out_at)
        return out

    def _gather_in_file(self, f: _OpenFile, starts: np.ndarray, lengths: np.ndarray, ranges: np.ndarray,
                        out: np.ndarray, out_at: np.ndarray) -> None:
        """gather() of the ranges (indices into starts/lengths) that lie inside file f."""
        batch_starts = np.asarray(f.starts[:-1], dtype=np.int64)  # [n_batches]
        first = np.searchsorted(batch_starts, starts[ranges], side="right") - 1  # [r]: batch of each range's start
        last = np.searchsorted(batch_starts, starts[ranges] + lengths[ranges] - 1, side="right") - 1  # [r]
        for j in np.flatnonzero(first != last):  # a range across record batches: rare, copied piece by piece
            i = ranges[j]
            out[out_at[i]:out_at[i] + lengths[i]] = self.read(int(starts[i]), int(starts[i] + lengths[i]))
        inside = np.flatnonzero(first == last)
        order = inside[np.argsort(first[inside], kind="stable")]
        bounds = np.flatnonzero(np.diff(first[order])) + 1
        for group in np.split(order, bounds) if len(order) else []:
            b = int(first[group[0]])
            group = ranges[group]
            array, base = f.arrays[b], batch_starts[b]
            long = lengths[group] >= SLICE_COPY_TOKENS  # [g]
            big = group[long]
            # a slice copy each (memcpy speed, one Python step per range, on Python ints: numpy scalars cost more)
            for at, src, n in zip(out_at[big].tolist(), (starts[big] - base).tolist(), lengths[big].tolist()):
                out[at:at + n] = array[src:src + n]
            group = group[~long]
            n = lengths[group]  # [g]
            offset = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # [tokens]: position inside its range
            out[np.repeat(out_at[group], n) + offset] = array[np.repeat(starts[group] - base, n) + offset]

    def release(self, start: int, stop: int) -> None:
        """Unmap this process's pages of tokens [start, stop) (in files already open; the page cache keeps them,
        and a later read maps them again). Why: a mapped page stays in the process's resident set until the
        file is closed, so a loader streaming through its block would show the bytes it has read as resident
        memory (2 bytes per uint16 token: a rank's whole block by the end of an epoch, tens of GB on a large
        corpus), which memory limits and monitors that count RSS take for a leak. Best effort: a failed madvise
        is ignored."""
        for f in self._opened(start, stop):
            f.release(start, stop)

    def check_unchanged(self, start: int, stop: int) -> None:
        """CorpusFault when an open file holding tokens [start, stop) was cut shorter in place since it was
        mapped (see _OpenFile.check_not_truncated); files not open yet are checked when they are opened."""
        for f in self._opened(start, stop):
            f.check_not_truncated()

    def _opened(self, start: int, stop: int) -> Iterator[_OpenFile]:
        """The files holding tokens [start, stop) that are open (mapped) in this process."""
        for i in self.file_indices(start, stop):
            f = self._open.get(i)
            if f is not None:
                yield f

    def close(self) -> None:
        """Unmap every open file (views returned by read() must not be used afterwards)."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _file(self, i: int) -> _OpenFile:
        f = self._open.get(i)
        if f is None:
            entry = self.entry.files[i]
            f = _OpenFile(entry, self.corpus_dir / entry.path, self.dtype, self.verify)
            self._open[i] = f
            self.files_opened.append(entry.path)
        return f
