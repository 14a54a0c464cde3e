"""manifest.json: the schema of a prepared corpus, its validation, and the rank-block arithmetic.

A corpus folder holds `manifest.json`, `tokenizer.model` and `<split>/NNNNN.arrow` files. Each split is
ONE global token stream (documents in input order, each followed by eod_id) stored as consecutive Arrow
files. A run cuts the stream into S streams of L = n_tokens // S tokens; rank r of W owns the contiguous
block of streams [r*S/W, (r+1)*S/W). Everything here is plain Python (no pyarrow) so that reading a
manifest is cheap.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from txl_dist.atomic import atomic_write
from txl_dist.errors import RankFault, Refused, one_line
from txl_dist.streams import streams_per_rank

from . import hash_record

FORMAT_NAME = "txl-dist-corpus"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DTYPES = ("uint16", "int32")


class CorpusError(Refused, ValueError):
    """A problem with a prepared corpus; the message is one line naming the file and what is wrong."""


class CorpusFault(RankFault):
    """Damage in a prepared corpus found while reading it during a run (the start verifies checksums, not
    every token id): one line naming the split, the position and what to run."""


@dataclass
class FileEntry:
    """One Arrow file: the split's global-stream tokens [first_token, first_token + n_tokens)."""

    path: str
    """Relative POSIX path inside the corpus folder, e.g. 'train/00000.arrow'."""
    first_token: int
    """Index in the split's global stream of the file's first token."""
    n_tokens: int
    """Number of tokens in the file."""
    sha256: str
    """sha256 of the file's bytes."""


@dataclass
class Layout:
    """The run layout the files were cut for (a hint: any world size dividing n_streams can read them)."""

    world_size: int
    n_streams: int


@dataclass
class SplitEntry:
    """One split (train/valid/test): counts, the layout hint, and its files in stream order."""

    n_tokens: int
    """Tokens in the split's global stream (eod ids included)."""
    n_documents: int
    """Documents; each is followed by one eod id in the stream."""
    n_bytes: int
    """UTF-8 bytes of the documents' text (for bits per byte)."""
    n_chars: int
    """Characters of the documents' text (for bits per character)."""
    tokens_sha256: str
    """sha256 of the whole global stream as raw little-endian bytes in the manifest dtype, in stream order.

    It does not depend on how the stream is cut into files or record batches, so digest() can identify the
    tokens while `relayout` re-cuts the files (see update_tokens_sha256 in arrow_io.py)."""
    layout: Layout
    files: list[FileEntry] = field(default_factory=list)
    """The Arrow files holding the stream, in stream order; empty for an index split (see `index`)."""
    index: IndexEntry | None = None
    """Only in an index split (`python -m data_prep mix --index`): the stream is not stored here but read
    through the mixture's documents file from its sources' train splits. None (no key): the files hold it."""


INDEX_TOKENS_SHA256 = "index"
"""IndexEntry.tokens_sha256_covers: tokens_sha256 is index_tokens_sha256(), not the stream's hash."""


@dataclass
class IndexEntry:
    """A split stored as an index of document ranges into other corpora (a mixture made with `mix --index`).

    The documents file of the mixture record lists, per document in stream order, where it ends in this
    stream, its source and where it starts in that source's train stream. Hashing the stream itself would
    mean gathering every token, which index mode exists to avoid; so tokens_sha256 is the hash of what
    determines the tokens exactly (the documents file and each source's digest, see index_tokens_sha256),
    and `tokens_sha256_covers` says so. A copy and an index mixture of the same sources hence have different
    digests (checkpoints do not move between them); `verify` still gathers and checks every token.
    """

    sources: list[str]
    """Per mixture source (in mixture.sources order): its corpus folder, relative to this corpus folder when
    the two share a folder below the filesystem root (so a moved tree of folders keeps working), else
    absolute. Each source's manifest digest is mixture.sources[i].manifest_digest, checked on opening."""
    tokens_sha256_covers: str = INDEX_TOKENS_SHA256
    """What the split's tokens_sha256 hashes: 'index' (the documents file's sha256 and the sources' manifest
    digests), the only value written today."""


def index_tokens_sha256(documents_sha256: str, source_digests: list[str]) -> str:
    """An index split's tokens_sha256: sha256 over the documents file's sha256 and each source's manifest
    digest, in source order. Together they fix every token of the stream (which ranges of which tokens)."""
    return hashlib.sha256(_canonical_json({"index": documents_sha256, "sources": source_digests})).hexdigest()


@dataclass
class TokenizerEntry:
    """The SentencePiece model the tokens were made with."""

    file: str
    """Relative path of the model inside the corpus folder (normally 'tokenizer.model')."""
    sha256: str
    vocab_size: int
    model_type: str
    """SentencePiece model type: unigram, bpe, char or word."""
    eod_id: int
    """End-of-document id, appended after every document."""
    unk_id: int
    bos_id: int
    """-1 when the tokenizer has none (the same convention as SentencePiece)."""
    pad_id: int
    """-1 when the tokenizer has none."""


@dataclass
class MixtureSource:
    """One source of a mixture (`python -m data_prep mix`): what was asked of it and what it gave."""

    name: str
    """The source's name; its held-out splits are kept as `<split>/<name>` (e.g. 'valid/web')."""
    manifest_digest: str
    """digest() of the source corpus' manifest: which tokens the mixture was drawn from."""
    weight: float
    """Normalized weight (the weights sum to 1): the share of the mixture's train tokens asked of it."""
    source_tokens: int
    """Tokens of the source's train split (one epoch of it)."""
    tokens: int
    """Tokens of the source in the mixture's train split."""
    documents: int
    """Documents of the source in the mixture's train split (a repeated document counts each time)."""
    share: float
    """Realized share: tokens / the mixture's train tokens."""
    epochs: float
    """tokens / source_tokens: above 1 the source repeats (whole epochs, then a partial one), below 1 it is
    subsampled by whole documents."""
    deviation_spread: int
    """max - min over every stream position t of (this source's tokens in [0, t) - weight * t): over ANY
    window of n tokens the source's share is within deviation_spread / n of its weight."""


@dataclass
class MixtureEntry:
    """How a mixture's train split was drawn from its sources (absent from the manifest of other corpora)."""

    seed: int
    """Seed of the document order of every epoch of every source and of the tie-breaks."""
    sources: list[MixtureSource]
    """In the order given to `mix`; a source's index in this list is its id in the documents file."""
    documents_file: str
    """Relative path of the Arrow file listing, per train document in stream order, where it ends in the
    stream ('stop', int64) and which source it came from ('source', uint8): what verify and inspect read."""
    documents_sha256: str
    """sha256 of that file's bytes."""


@dataclass
class Manifest:
    """Everything a reader needs to trust and locate the tokens of a corpus folder."""

    tokenizer: TokenizerEntry
    dtype: str
    """'uint16' when vocab_size <= 65536, else 'int32' (see token_dtype)."""
    splits: dict[str, SplitEntry]
    provenance: dict[str, Any]
    """How the corpus was made (created, tool, command, args, inputs); not part of digest()."""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    mixture: MixtureEntry | None = None
    """Only in a mixture (`python -m data_prep mix`): its sources, weights, realized shares, epochs, seed.
    An optional key, so manifests without it (every other corpus) read and digest as before."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to manifest.json (format and version first; no 'mixture' key when None)."""
        d = dataclasses.asdict(self)
        if d["mixture"] is None:
            del d["mixture"]
        for split in d["splits"].values():
            if split["index"] is None:  # other splits read and write exactly as before index splits existed
                del split["index"]
        return {"format": d.pop("format"), "version": d.pop("version"), **d}

    @classmethod
    def from_dict(cls, d: Any, source: str = MANIFEST_FILE) -> Manifest:
        """Validate a parsed manifest.json; `source` names the file in error messages."""
        return _parse_manifest(d, source)

    def digest(self) -> str:
        """sha256 identifying the TOKENS: format, version, tokenizer, dtype, and per split its counts and
        tokens_sha256 (canonical JSON).

        Not the files, the layout hint nor provenance: `relayout` re-cuts the files for another world size
        without changing a token, and a checkpoint (run.json, loader state) must still resume on the result.
        """
        d = {"format": self.format, "version": self.version, "tokenizer": dataclasses.asdict(self.tokenizer),
             "dtype": self.dtype,
             "splits": {name: {k: getattr(s, k) for k in _DIGEST_SPLIT_KEYS} for name, s in self.splits.items()}}
        return hashlib.sha256(_canonical_json(d)).hexdigest()


_DIGEST_SPLIT_KEYS = ("n_tokens", "n_documents", "n_bytes", "n_chars", "tokens_sha256")


# ----------------------------------------------------------------------------------------------------
# Reading and writing manifest.json


def read_manifest(corpus_dir: str | os.PathLike) -> Manifest:
    """Read and validate `corpus_dir/manifest.json`; CorpusError names the file on anything wrong."""
    corpus_dir = Path(corpus_dir)
    path = corpus_dir / MANIFEST_FILE
    try:
        is_dir = corpus_dir.is_dir()  # raises for a folder on the way that this user may not search
    except OSError as e:
        raise CorpusError(f"{corpus_dir}: cannot be read ({e.strerror or one_line(e)}); check the permissions of "
                          "the folders above it") from None
    if not is_dir:
        if os.path.lexists(corpus_dir):  # a file (train.txt, the manifest itself), a device, a broken link
            folder = "name the folder `python -m data_prep prepare --out DIR` wrote (it holds manifest.json)"
            if not corpus_dir.is_file():
                raise CorpusError(f"{corpus_dir}: is not a folder (a device, a FIFO, a link to nothing), not a corpus "
                                  f"folder; {folder}")
            hint = (f"name its folder {corpus_dir.parent}" if corpus_dir.name == MANIFEST_FILE else
                    f"{folder}, e.g. one prepared from it with --train {corpus_dir}")
            raise CorpusError(f"{corpus_dir}: is a file, not a corpus folder; {hint}")
        raise CorpusError(
            f"{corpus_dir}: corpus folder does not exist; run `python -m data_prep prepare --out {corpus_dir}`")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CorpusError(
            f"{path} is missing: {corpus_dir} is not a prepared corpus (or preparation did not finish); "
            "run `python -m data_prep prepare`") from None
    except IsADirectoryError:
        raise CorpusError(f"{path}: is a folder, not the manifest file; {corpus_dir} is not a prepared corpus, "
                          "re-run prepare") from None
    except UnicodeDecodeError:
        raise CorpusError(f"{path}: not UTF-8 text; the manifest is corrupt, re-run prepare") from None
    except OSError as e:  # a corpus this user may not read: one line naming the file, as for its Arrow files
        raise CorpusError(f"{path}: cannot be read ({e.strerror or one_line(e)}); check the permissions of the "
                          "file and of the folders above it") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}: invalid JSON at line {e.lineno} col {e.colno}: {e.msg}") from None
    manifest = Manifest.from_dict(raw, str(path))
    # Lexical checks in from_dict cannot see symlinks; resolve every path against the folder itself.
    root = corpus_dir.resolve()
    paths = [manifest.tokenizer.file] + [f.path for s in manifest.splits.values() for f in s.files]
    if manifest.mixture is not None:
        paths.append(manifest.mixture.documents_file)
    for rel in paths:
        if not (corpus_dir / rel).resolve().is_relative_to(root):
            raise CorpusError(f"{path}: '{rel}' resolves outside the corpus folder {corpus_dir} (a symlink?); "
                              "every file must live inside it")
    return manifest


def write_manifest(corpus_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Validate and write `corpus_dir/manifest.json` atomically."""
    corpus_dir = Path(corpus_dir)
    path = corpus_dir / MANIFEST_FILE
    d = manifest.to_dict()
    Manifest.from_dict(d, str(path))  # never write a manifest that read_manifest would refuse
    atomic_write(path, json.dumps(d, indent=2) + "\n")
    return path


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# ----------------------------------------------------------------------------------------------------
# Small helpers shared by the writer (data_prep) and the reader


UINT16_VOCAB = 2**16
"""The largest vocabulary whose ids fit uint16. Corpora written before 65536 itself was counted in
(2026-12) store a 65536-piece vocabulary as int32; they stay readable (_dtype_fits)."""


def token_dtype(vocab_size: int) -> str:
    """The on-disk token dtype for a vocabulary: 'uint16' when vocab_size <= 65536 (ids 0..65535), else 'int32'."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return "uint16" if vocab_size <= UINT16_VOCAB else "int32"


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22, mapped: Any = None,
                release: Callable[[int, int], None] | None = None) -> str:
    """Hex sha256 of a file's bytes, read in chunks (constant memory); from the HashRecord in use, if any, when
    the file is unchanged since it was hashed (txl_dist/data/hash_record.py). `mapped`: the file's bytes as a
    caller already memory-mapped them (any buffer), hashed from there so that the file is not read twice;
    `release(start, stop)`: called with each chunk's byte offsets once it is hashed, for the caller to unmap its
    pages (arrow_io.drop_pages), which would otherwise stay resident: the whole file at once."""
    def compute() -> str:
        h = hashlib.sha256()
        if mapped is not None:
            view = memoryview(mapped)  # page by page from the mapping: no copy, no second read
            for start in range(0, len(view), chunk_bytes):
                stop = min(len(view), start + chunk_bytes)
                h.update(view[start:stop])
                if release is not None:
                    release(start, stop)
            return h.hexdigest()
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
        return h.hexdigest()

    record = hash_record.active()
    return compute() if record is None else record.sha256(path, compute)


def is_readable_file(path: Path) -> bool:
    """path.is_file(), with the error it raises for a folder on the way that this user may not search turned into
    a CorpusError naming the file (a training start ended in a PermissionError traceback)."""
    try:
        return path.is_file()
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or one_line(e)}); check the permissions of the "
                          "file and of the folders above it") from None


def tokenizer_file_sha256(corpus_dir: str | os.PathLike, tokenizer: TokenizerEntry) -> str:
    """sha256 of the corpus' tokenizer model file (what tokenizer.sha256 must be); CorpusError (one line naming
    the file) when it is missing or this user may not read it."""
    path = Path(corpus_dir) / tokenizer.file
    try:
        if not path.is_file():
            raise CorpusError(f"{path}: tokenizer model is missing; re-run prepare or copy the model back")
        return sha256_file(path)
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror or one_line(e)}); check the permissions of the "
                          "file and of the folders above it") from None


def stream_length(n_tokens: int, n_streams: int) -> int:
    """L: tokens per stream when a split of n_tokens is cut into n_streams equal streams (rest unused)."""
    if n_streams < 1:
        raise ValueError(f"n_streams must be >= 1, got {n_streams}")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return n_tokens // n_streams


def rank_token_range(n_tokens: int, n_streams: int, world_size: int, rank: int) -> tuple[int, int]:
    """Global-stream tokens [start, stop) of rank's block: streams [rank*S/W, (rank+1)*S/W) of length L."""
    streams_per_rank(n_streams, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    block = n_streams // world_size * stream_length(n_tokens, n_streams)
    return rank * block, (rank + 1) * block


def split_parts(splits: Any, split: str) -> list[str]:
    """The per-source parts of a split, `<split>/<name>` (a mixture keeps each source's valid and test
    splits beside its own), in manifest order; empty for other corpora."""
    return [name for name in splits if name.startswith(f"{split}/")]


MAX_FILE_TOKENS = 1 << 29
"""Tokens in one corpus file at most (1 GiB of uint16): a larger rank block is cut into near-equal files, so
the ranks of a run share the hashing of a corpus laid out for fewer ranks (txl_dist/startup.py,
share_corpus_hashing): sha256 reads a file from start to end, so one file is hashed by one rank."""


def file_boundaries(n_tokens: int, layout: Layout) -> list[int]:
    """Cut points 0 = b0 < b1 < ... < bk = n_tokens: one file per rank block of `layout`, or several near-equal
    ones when the block holds more than MAX_FILE_TOKENS.

    The tokens past S*L (never trained on) get a file of their own, so no rank of the planned run opens
    a file it does not need. Empty pieces are dropped (e.g. when n_tokens < n_streams).
    """
    cuts = [rank_token_range(n_tokens, layout.n_streams, layout.world_size, r)[1]
            for r in range(layout.world_size)]
    out = [0]
    for b in cuts + [n_tokens]:
        start = out[-1]
        if b > start:
            pieces = -(-(b - start) // MAX_FILE_TOKENS)
            out += [start + (b - start) * i // pieces for i in range(1, pieces + 1)]
    return out


# ----------------------------------------------------------------------------------------------------
# Validation of a parsed manifest.json (one line per problem, naming the file and the key)


def check_relative_path(rel: Any, source: str, key: str) -> str:
    """A manifest path must be a relative POSIX path that stays inside the corpus folder.

    Refused: anything but a non-empty string; NUL or any other control character; absolute paths (POSIX,
    Windows drive 'C:\\x' or 'C:x', UNC '\\\\server\\share'); backslashes; '..' segments; and empty or '.'
    segments ('a//b', './a', 'a/'), so that every path names one file by one spelling.
    """
    if not isinstance(rel, str) or not rel:
        raise CorpusError(f"{source}: {key} must be a non-empty relative path, got {json.dumps(rel)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in rel):
        raise CorpusError(f"{source}: {key} {json.dumps(rel)} contains a control character (NUL, newline, ...); "
                          "paths must be plain relative names")
    if PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).is_absolute() or PureWindowsPath(rel).drive:
        raise CorpusError(f"{source}: {key} '{rel}' is an absolute path; paths must be relative to the corpus folder")
    segments = rel.split("/")
    if "\\" in rel or ".." in segments:
        raise CorpusError(f"{source}: {key} '{rel}' points outside the corpus folder; "
                          "paths must be relative POSIX paths without '..'")
    if any(seg in ("", ".") for seg in segments):
        raise CorpusError(f"{source}: {key} '{rel}' has an empty or '.' segment; write it as a plain relative "
                          "path such as 'train/00000.arrow'")
    return rel


class _Fields:
    """Typed access to one JSON object of the manifest, with errors that name the key."""

    def __init__(self, d: Any, source: str, where: str, known: tuple[str, ...], optional: tuple[str, ...] = ()):
        self.source, self.where = source, where
        if not isinstance(d, dict):
            raise CorpusError(f"{source}: {where or 'the top level'} must be a JSON object, got {type(d).__name__}")
        for k in d:
            if k not in known + optional:
                raise CorpusError(f"{source}: unknown key '{self._name(k)}'; expected {', '.join(known + optional)}")
        missing = [k for k in known if k not in d]
        if missing:
            raise CorpusError(f"{source}: '{self._name(missing[0])}' is missing")
        self.d = d

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def int(self, key: str, lo: int | None = 0) -> int:
        v = self.d[key]
        if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
            raise CorpusError(f"{self.source}: {self._name(key)} must be an integer >= {lo}, got {json.dumps(v)}")
        return v

    def str(self, key: str) -> str:
        v = self.d[key]
        if not isinstance(v, str) or not v:
            raise CorpusError(f"{self.source}: {self._name(key)} must be a non-empty string, got {json.dumps(v)}")
        return v

    def number(self, key: str) -> float:
        v = self.d[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
            raise CorpusError(f"{self.source}: {self._name(key)} must be a finite number >= 0, got {json.dumps(v)}")
        return float(v)

    def sha(self, key: str) -> str:
        v = self.str(key)
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise CorpusError(f"{self.source}: {self._name(key)} must be a lowercase hex sha256, got {json.dumps(v)}")
        return v


def _dtype_fits(dtype: str, vocab_size: int) -> bool:
    """The dtype prepare writes for vocab_size, or int32 for exactly 2**16 pieces (the rule before 2026-12)."""
    return dtype == token_dtype(vocab_size) or (dtype == "int32" and vocab_size == UINT16_VOCAB)


def _parse_manifest(d: Any, source: str) -> Manifest:
    top = _Fields(d, source, "", ("format", "version", "tokenizer", "dtype", "splits", "provenance"), ("mixture",))
    if d["format"] != FORMAT_NAME:
        raise CorpusError(f"{source}: format is {json.dumps(d['format'])}, not '{FORMAT_NAME}'; "
                          "not a corpus written by `python -m data_prep prepare`")
    if d["version"] != FORMAT_VERSION:
        raise CorpusError(f"{source}: corpus format version {json.dumps(d['version'])} is not supported "
                          f"(this reader knows version {FORMAT_VERSION}); re-run prepare with this version")
    tokenizer = _parse_tokenizer(d["tokenizer"], source)
    dtype = top.str("dtype")
    if not _dtype_fits(dtype, tokenizer.vocab_size):
        raise CorpusError(f"{source}: dtype '{dtype}' does not match vocab_size {tokenizer.vocab_size} "
                          f"(expected '{token_dtype(tokenizer.vocab_size)}')")
    if not isinstance(d["splits"], dict) or not d["splits"]:
        raise CorpusError(f"{source}: splits must be a non-empty JSON object of split name -> split")
    splits = {name: _parse_split(s, source, name) for name, s in d["splits"].items()}
    if not isinstance(d["provenance"], dict):
        raise CorpusError(f"{source}: provenance must be a JSON object")
    mixture = _parse_mixture(d["mixture"], source, splits) if "mixture" in d else None
    for name, split in splits.items():
        if split.index is not None:
            _check_index(split, name, mixture, source)
    return Manifest(tokenizer=tokenizer, dtype=dtype, splits=splits, provenance=d["provenance"], mixture=mixture)


SOURCE_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_source_name(name: Any, where: str) -> str:
    """A mixture source's name becomes a split name part and a folder (`valid/<name>/`): letters, digits,
    '_', '-' and '.', not starting with '.'."""
    if not isinstance(name, str) or not name or name[0] == "." or not set(name) <= SOURCE_NAME_CHARS:
        raise CorpusError(f"{where}: source name {json.dumps(name)} must be letters, digits, '_', '-' or '.' "
                          "(not starting with '.'): it names the source's valid/test splits and their folders")
    return name


def _parse_mixture(d: Any, source: str, splits: dict[str, SplitEntry]) -> MixtureEntry:
    m = _Fields(d, source, "mixture", tuple(f.name for f in dataclasses.fields(MixtureEntry)))
    if not isinstance(d["sources"], list) or not d["sources"]:
        raise CorpusError(f"{source}: mixture.sources must be a non-empty JSON list")
    if len(d["sources"]) > 255:
        raise CorpusError(f"{source}: mixture.sources lists {len(d['sources'])} sources; at most 255 are supported")
    sources = []
    for i, sd in enumerate(d["sources"]):
        f = _Fields(sd, source, f"mixture.sources[{i}]", tuple(x.name for x in dataclasses.fields(MixtureSource)))
        sources.append(MixtureSource(
            name=check_source_name(sd["name"], f"{source}: mixture.sources[{i}].name"),
            manifest_digest=f.sha("manifest_digest"), weight=f.number("weight"),
            source_tokens=f.int("source_tokens", lo=1), tokens=f.int("tokens"), documents=f.int("documents"),
            share=f.number("share"), epochs=f.number("epochs"), deviation_spread=f.int("deviation_spread")))
    if len({s.name for s in sources}) != len(sources):
        raise CorpusError(f"{source}: mixture.sources names the same source twice")
    if "train" in splits and sum(s.tokens for s in sources) != splits["train"].n_tokens:
        raise CorpusError(f"{source}: the mixture's sources hold {sum(s.tokens for s in sources)} tokens but "
                          f"splits.train.n_tokens is {splits['train'].n_tokens}")
    return MixtureEntry(seed=m.int("seed"), sources=sources,
                        documents_file=check_relative_path(d["documents_file"], source, "mixture.documents_file"),
                        documents_sha256=m.sha("documents_sha256"))


def _parse_tokenizer(d: Any, source: str) -> TokenizerEntry:
    t = _Fields(d, source, "tokenizer", tuple(f.name for f in dataclasses.fields(TokenizerEntry)))
    vocab_size = t.int("vocab_size", lo=1)
    ids = {k: t.int(k, lo=0 if k in ("eod_id", "unk_id") else -1) for k in ("eod_id", "unk_id", "bos_id", "pad_id")}
    for k, v in ids.items():
        if v >= vocab_size:
            raise CorpusError(f"{source}: tokenizer.{k} {v} is not below vocab_size {vocab_size}")
    return TokenizerEntry(file=check_relative_path(d["file"], source, "tokenizer.file"), sha256=t.sha("sha256"),
                          vocab_size=vocab_size, model_type=t.str("model_type"), **ids)


def _parse_split(d: Any, source: str, name: str) -> SplitEntry:
    where = f"splits.{name}"
    s = _Fields(d, source, where, tuple(f.name for f in dataclasses.fields(SplitEntry) if f.name != "index"),
                ("index",))
    counts = {k: s.int(k) for k in ("n_tokens", "n_documents", "n_bytes", "n_chars")}
    lay = _Fields(d["layout"], source, f"{where}.layout", ("world_size", "n_streams"))
    layout = Layout(world_size=lay.int("world_size", lo=1), n_streams=lay.int("n_streams", lo=1))
    streams_per_rank(layout.n_streams, layout.world_size, streams=f"{source}: {where}.layout.n_streams",
                     ranks="ranks (its layout.world_size)", error=CorpusError)
    if not isinstance(d["files"], list):
        raise CorpusError(f"{source}: {where}.files must be a JSON list")
    files, expect = [], 0
    for i, fd in enumerate(d["files"]):
        f = _Fields(fd, source, f"{where}.files[{i}]", ("path", "first_token", "n_tokens", "sha256"))
        entry = FileEntry(path=check_relative_path(fd["path"], source, f"{where}.files[{i}].path"),
                          first_token=f.int("first_token"), n_tokens=f.int("n_tokens", lo=1), sha256=f.sha("sha256"))
        if entry.first_token != expect:
            raise CorpusError(f"{source}: {where}.files[{i}] ('{entry.path}') starts at token {entry.first_token}, "
                              f"expected {expect}: the files must tile the stream in order")
        expect += entry.n_tokens
        files.append(entry)
    index = _parse_index(d["index"], source, where) if "index" in d else None
    if index is not None and files:
        raise CorpusError(f"{source}: {where} has both files and an index; an index split lists no files")
    if index is None and expect != counts["n_tokens"]:
        raise CorpusError(f"{source}: {where}: the files hold {expect} tokens but n_tokens is {counts['n_tokens']}")
    if len({f.path for f in files}) != len(files):
        raise CorpusError(f"{source}: {where}.files lists the same path twice")
    return SplitEntry(tokens_sha256=s.sha("tokens_sha256"), layout=layout, files=files, index=index, **counts)


def _parse_index(d: Any, source: str, where: str) -> IndexEntry:
    f = _Fields(d, source, f"{where}.index", tuple(x.name for x in dataclasses.fields(IndexEntry)))
    if f.str("tokens_sha256_covers") != INDEX_TOKENS_SHA256:
        raise CorpusError(f"{source}: {where}.index.tokens_sha256_covers is {json.dumps(d['tokens_sha256_covers'])}"
                          f", this reader knows '{INDEX_TOKENS_SHA256}'; re-run `python -m data_prep mix --index`")
    if not isinstance(d["sources"], list) or not d["sources"]:
        raise CorpusError(f"{source}: {where}.index.sources must be a non-empty JSON list of corpus folders")
    for i, path in enumerate(d["sources"]):
        key = f"{where}.index.sources[{i}]"
        if not isinstance(path, str) or not path or any(ord(c) < 32 or ord(c) == 127 for c in path) or "\\" in path:
            raise CorpusError(f"{source}: {key} must be a corpus folder path (POSIX, no control characters), "
                              f"got {json.dumps(path)}")
    return IndexEntry(sources=list(d["sources"]), tokens_sha256_covers=d["tokens_sha256_covers"])


def _check_index(split: SplitEntry, name: str, mixture: MixtureEntry | None, source: str) -> None:
    """An index split is a mixture's train split, with one source folder per mixture source and the
    tokens_sha256 its documents file and sources' digests give."""
    where = f"splits.{name}.index"
    if mixture is None or name != "train":
        raise CorpusError(f"{source}: {where}: only a mixture's train split can be an index "
                          "(made by `python -m data_prep mix --index`)")
    if len(split.index.sources) != len(mixture.sources):
        raise CorpusError(f"{source}: {where}.sources lists {len(split.index.sources)} folders for the mixture's "
                          f"{len(mixture.sources)} sources; re-run `python -m data_prep mix --index`")
    want = index_tokens_sha256(mixture.documents_sha256, [s.manifest_digest for s in mixture.sources])
    if split.tokens_sha256 != want:
        raise CorpusError(f"{source}: splits.{name}.tokens_sha256 is not the hash of its index (documents_sha256 "
                          "and the sources' manifest digests); re-run `python -m data_prep mix --index`")
