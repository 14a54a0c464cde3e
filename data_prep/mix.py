"""`mix`: a data mixture as one corpus, whole documents of several prepared corpora interleaved by weight.

The general frameworks blend datasets by drawing documents or fixed-length samples independently; that
would cut Transformer-XL's segment recurrence. Here the mixture's train split is ONE global token stream of
whole documents (each with the eod it already ends with), so every stream of a run is contiguous text and
the loader, resume, elastic resume and evaluation read it like any corpus.

The order: a smooth weighted round-robin over documents (stride scheduling). The next document comes
from the source furthest behind its share: the one whose tokens so far divided by its weight, x_k, is the
smallest (ties: the largest weight first, then a seeded order of the sources). Taking the smallest x_k and adding l / w_k to it keeps
max x - min x <= R, R = the largest document length / its source's weight; the tokens so far T are the
weighted mean of the x_k, so a source's count never strays from w_k * T by more than w_k * R. Hence over
ANY window of n tokens a source's share is within spread / n of its weight, where spread = max - min of its
deviation (tokens so far - w_k * T) over the stream, at most 2 * w_k * R; the manifest records each
source's spread and verify recomputes it. With documents of a few thousand tokens this is far inside 1%
over every 1M-token window; whole books (10^5 tokens) cannot be, by any order that keeps documents whole.

Each source's documents are taken epoch by epoch, each epoch in a seeded permutation of the source's
documents: a source smaller than its share repeats (whole epochs, then the first documents of the next
permutation: a seeded partial epoch), a larger one is subsampled by whole documents (the first documents
of its first permutation). The stream ends with the document that reaches --train-tokens, so it holds at
least that many tokens and less than one document more.

Held-out splits are not mixed: each source's valid/test split is copied whole as `valid/<name>` /
`test/<name>` (evaluation reports each), and the mixture's own `valid` / `test` are those splits
concatenated in the order the sources were given (every held-out document of every source once).

Memory is flat in tokens and in documents: tokens are copied in bounded chunks (a long document across
several), the schedule holds one round, each epoch's order is a Permutation evaluated slice by slice (no
permutation array; a source much smaller than its share has many whole epochs evaluated at once), and the
sources' document ends (8 bytes per source document) live in memory-mapped files in a scratch folder beside
the output (page cache, removed at the end).

Index mode (`--index`): the train split is not copied. The documents file gets each document's start in
its source (the schedule has it anyway) and becomes the split: the loader gathers a window's documents from
the sources' memory-mapped files (txl_dist/data/index_split.py). What it saves: the copy (a second set of
train bytes on disk), hashing the written bytes twice, and the first pass of the schedule (files are not
cut at rank blocks, so the length need not be known before writing). What remains: scanning each source
once for its document ends, with its files' sha256 checked (a corrupt source must not be indexed). What it
costs: the mixture depends on its sources staying where they are, unchanged (checked on every opening),
and its digest is the index's, not the tokens' (so a copy and an index mixture do not share checkpoints).
Held-out splits are copied either way: they are small, and each source's must stay its own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_prep.atomic import atomic_dir, check_output, owned_scratch
from data_prep.errors import PrepError
from data_prep.layout import CHUNK_TOKENS, SplitWriter, check_fits, split_layouts
from data_prep.paths import check_output_apart, read_corpus_manifest
from txl_dist.output_paths import same_place
from data_prep.prepare import InputSpec, check_seed, check_work_dir, prepare, provenance, train_tokenizer_job
from data_prep.sources import check_disjoint, resolve_sources
from data_prep.space import check_free_space, estimate_note, input_text_bytes, size_text, token_bytes
from data_prep.tokenizer import TrainerOptions, describe_tokenizer
from txl_dist.data.format import (
    Manifest,
    MixtureEntry,
    MixtureSource,
    SplitEntry,
    IndexEntry,
    TokenReader,
    check_source_name,
    index_tokens_sha256,
    sha256_file,
    token_dtype,
    update_tokens_sha256,
    write_manifest,
)
from txl_dist.data.index_split import source_reference
from txl_dist.data.mixture import DOCUMENTS_FILE, DOCUMENTS_SCHEMA, INDEX_SCHEMA, DeviationSpread, DocumentsWriter

HELD_OUT = ("valid", "test")
MIN_STREAM_TOKENS = 2
"""The fewest tokens a stream of a run can train on: one segment of model.tgt_len 1 and its last label (the
loader needs tgt_len + 1 per stream). mix cannot know the run's tgt_len, so --train-tokens below this many per
--n-streams stream is refused as a length no run of the streams the mixture is cut for can train on."""


@dataclass(frozen=True)
class SourceSpec:
    """One `--source NAME=CORPUS_DIR:WEIGHT`."""

    name: str
    """Names the source's held-out splits (`valid/<name>`) and its entry in the manifest."""
    corpus: Path
    """A corpus folder made by `prepare` (all sources must share one tokenizer)."""
    weight: float
    """Relative weight (> 0); the weights are normalized to shares of the train tokens."""


def parse_source(text: str) -> SourceSpec:
    """NAME=CORPUS_DIR:WEIGHT (the weight after the last ':', so a path may hold ':')."""
    name, eq, rest = text.partition("=")
    path, colon, weight = rest.rpartition(":")
    if not eq or not colon or not path:
        raise PrepError(f"--source {text!r}: write it as NAME=CORPUS_DIR:WEIGHT, e.g. web=data/web:0.7")
    check_source_name(name, f"--source {text!r}")  # CorpusError is a Refused too: one line, exit 2
    try:
        w = float(weight)
    except ValueError:
        w = float("nan")
    if not (w > 0 and math.isfinite(w)):
        raise PrepError(f"--source {text!r}: weight {weight!r} must be a positive number")
    return SourceSpec(name, Path(path), w)


def normalized_weights(weights: Sequence[float]) -> list[float]:
    """The weights (each positive and finite) as shares summing to 1. Where their sum overflows (two weights of
    1e308 made every share 0, and the schedule never moved on) they are scaled by the largest first; else
    they are divided as they always were, so that a mix command gives the same corpus as with earlier versions."""
    total = sum(weights)
    if not math.isfinite(total):
        largest = max(weights)
        weights = [w / largest for w in weights]  # each in (0, 1]: the sum is at most len(weights)
        total = sum(weights)
    return [w / total for w in weights]


@dataclass
class _Source:
    """A source corpus opened for mixing: its manifest, normalized weight and the ends of its train documents."""

    spec: SourceSpec
    index: int
    manifest: Manifest
    weight: float
    doc_stops: np.ndarray
    """int64 [n_docs]: where each train document ends in the source's stream (after its eod)."""


def _open_source(spec: SourceSpec, index: int, weight: float, progress: bool, scratch: Path) -> _Source:
    manifest = read_corpus_manifest(spec.corpus)
    tok_path = spec.corpus / manifest.tokenizer.file
    if not tok_path.is_file() or sha256_file(tok_path) != manifest.tokenizer.sha256:
        raise PrepError(f"{tok_path}: missing or its sha256 differs from the manifest; not the corpus' tokenizer")
    if "train" not in manifest.splits:
        raise PrepError(f"--source {spec.name}: {spec.corpus} has no train split to mix")
    if manifest.splits["train"].index is not None:
        raise PrepError(f"--source {spec.name}: {spec.corpus} is an index mixture (mix --index), whose train split "
                        "has no token files; mix its sources instead")
    return _Source(spec, index, manifest, weight,
                   _document_stops(spec, manifest, progress, scratch / f"{index}.stops.npy"))


def _document_stops(spec: SourceSpec, manifest: Manifest, progress: bool, path: Path) -> np.ndarray:
    """The end of every train document (one read of the train split; each file's sha256 checked on opening),
    in a memory-mapped file at `path`: page cache, not the process's memory (8 bytes per source document)."""
    split, eod = manifest.splits["train"], manifest.tokenizer.eod_id
    # Filled in place (the manifest says how many).
    stops = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(split.n_documents,))  # [n_docs]
    found, pos, last = 0, 0, None
    with TokenReader(spec.corpus, manifest, "train", verify=True) as reader, \
            tqdm(total=split.n_tokens, unit=" tok", unit_scale=True, desc=f"scan {spec.name}",
                 disable=not progress, file=sys.stderr) as bar:
        for tokens in reader.chunks(0, split.n_tokens):
            ends = np.flatnonzero(tokens == eod) + (pos + 1)  # [e]
            if found + len(ends) <= len(stops):
                stops[found:found + len(ends)] = ends
            found += len(ends)
            pos += len(tokens)
            last = int(tokens[-1])
            bar.update(len(tokens))
    if last != eod or found != split.n_documents:
        # Documents are told apart by their eods only: a text that itself holds the eod piece would be cut.
        raise PrepError(f"--source {spec.name}: {spec.corpus} train has {split.n_documents} documents but "
                        f"{found} eod ids (id {eod}); documents cannot be told apart, re-run prepare")
    return stops


def _check_same_tokenizer(sources: list[_Source]) -> None:
    first = sources[0]
    ref = dataclasses.replace(first.manifest.tokenizer, file="")
    for s in sources[1:]:
        tok = dataclasses.replace(s.manifest.tokenizer, file="")
        if tok != ref:
            diff = next(f.name for f in dataclasses.fields(tok) if getattr(tok, f.name) != getattr(ref, f.name))
            raise PrepError(f"--source {s.spec.name}: its tokenizer differs from {first.spec.name}'s ({diff}); "
                            "mix corpora prepared with the same tokenizer (prepare --tokenizer-model)")


ROUND_TOKENS = 1 << 22
"""Mixture tokens scheduled per round of the merge (the bound on the schedule's memory)."""
SLICE_DOCS = 1 << 16
"""Documents of a source's epoch looked at per step while filling a round."""


class Permutation:
    """A seeded permutation of range(n) evaluated at any positions, in memory that does not grow with n.

    A balanced Feistel network over the smallest domain of 2b bits holding n (4 rounds, each mixing one half
    with a splitmix64-style hash of the other half and a round key drawn from the seed) is a bijection of
    that domain; cycle walking (apply it again to every result >= n, until it lands below n) restricts it
    to a bijection of range(n), in fewer than 4 applications on average as the domain is < 4n. Vectorized
    over the positions asked: a source of 10^9 documents needs no permutation array (4 or 8 bytes per
    document for a shuffled one).
    """

    ROUNDS = 4
    _M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)

    def __init__(self, n: int, seed: Sequence[int]):
        self.n = n
        bits = max(2, (max(n, 2) - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = self.round_keys(seed)[:, None]  # [ROUNDS, 1]: the same keys for every position

    @classmethod
    def round_keys(cls, seed: Sequence[int]) -> np.ndarray:
        """uint64 [ROUNDS]: the round keys of the permutation of this seed."""
        return np.random.default_rng(list(seed)).integers(0, 2**63, cls.ROUNDS, dtype=np.uint64)

    def _mix(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        z = x ^ key  # [c] uint64, wrapping arithmetic from here on
        z = (z ^ (z >> np.uint64(30))) * self._M1
        z = (z ^ (z >> np.uint64(27))) * self._M2
        return (z ^ (z >> np.uint64(31))) & self.mask

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask  # [c] each
        for key in keys:  # [1] or [c]: a key per position
            left, right = right, left ^ self._mix(right, key)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """int64 [c]: the permutation's values at positions (each in range(n))."""
        return self.evaluate(positions, self.keys)

    def evaluate(self, positions: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """int64 [c]: the values at positions of the permutations of range(n) with round keys `keys`
        ([ROUNDS, 1]: this one's; [ROUNDS, c]: each position its own, round_keys of its seed), so that many
        epochs of a small source are one vectorized evaluation."""
        y = self._feistel(np.asarray(positions, dtype=np.uint64), keys)  # [c]
        outside = np.flatnonzero(y >= np.uint64(self.n))
        while len(outside):
            y[outside] = self._feistel(y[outside], keys if keys.shape[1] == 1 else keys[:, outside])
            outside = outside[y[outside] >= np.uint64(self.n)]
        return y.astype(np.int64)


class _Sequence:
    """A source's documents epoch after epoch, each epoch a seeded permutation of them, taken by key.

    The key of a document is the source's tokens before it divided by the source's weight: the mixture
    position at which the source, kept at its share, would reach it. Keys increase along the sequence.
    """

    def __init__(self, source: _Source, seed: int):
        self.stops, self.weight, self.seed, self.index = source.doc_stops, source.weight, seed, source.index
        self.n_docs = len(self.stops)
        self.epoch, self.pos, self.before = 0, 0, 0
        self.order = self._permutation()

    def _permutation(self) -> Permutation:
        return Permutation(self.n_docs, [self.seed, self.index, self.epoch])

    def _whole_epochs(self, key_limit: float) -> np.ndarray:
        """int64 [E * n_docs]: the documents of the next E whole epochs, each in its own permutation (the one
        _permutation() gives), in one vectorized evaluation. A source much smaller than its share repeats for
        thousands of epochs per round: one Python step (and a few arrays) per epoch cost ~100 us and ~1.5 KB
        of the round's memory each (measured: 19 s and 330 MB for the 222K epochs of a one-document source's
        round). E: the epochs up to the one where key_limit falls (the caller sees the round end there; asks
        again if rounding fell short), at most SLICE_DOCS // n_docs."""
        epoch_tokens = int(self.stops[-1])
        needed = max(0.0, key_limit * self.weight - self.before) / epoch_tokens
        n_epochs = int(min(SLICE_DOCS // self.n_docs, math.floor(needed) + 1))
        if self.n_docs == 1:  # the one permutation of range(1)
            return np.zeros(n_epochs, dtype=np.int64)
        keys = np.stack([Permutation.round_keys([self.seed, self.index, e])
                         for e in range(self.epoch, self.epoch + n_epochs)], axis=1)  # [ROUNDS, E]
        return self.order.evaluate(np.tile(np.arange(self.n_docs), n_epochs),
                                   np.repeat(keys, self.n_docs, axis=1))  # [E * n_docs]

    def take(self, key_limit: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys float64, starts, stops int64) of the next documents whose key is below key_limit."""
        keys, starts, stops = [], [], []
        while True:
            whole = self.pos == 0 and self.n_docs <= SLICE_DOCS // 2  # a small source: several epochs at once
            ids = self._whole_epochs(key_limit) if whole else self.order(
                np.arange(self.pos, min(self.pos + SLICE_DOCS, self.n_docs)))  # [c]
            doc_stops = self.stops[ids]  # [c]
            doc_starts = np.where(ids > 0, self.stops[ids - 1], 0)  # [c]
            lengths = doc_stops - doc_starts  # [c]
            with np.errstate(over="ignore"):  # a weight like 1e-320: keys past the first are inf, last anyway
                slice_keys = (self.before + np.cumsum(lengths) - lengths) / self.weight  # [c]
            n = int(np.searchsorted(slice_keys, key_limit))  # keys below the limit
            keys.append(slice_keys[:n])
            starts.append(doc_starts[:n])
            stops.append(doc_stops[:n])
            self.before += int(lengths[:n].sum())
            epochs, self.pos = divmod(self.pos + n, self.n_docs)
            if epochs:
                self.epoch += epochs
                self.order = self._permutation()
            if n < len(ids):
                return np.concatenate(keys), np.concatenate(starts), np.concatenate(stops)


def schedule(sources: list[_Source], seed: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The mixture's train documents in order, round after round, without end: (source id uint8, start,
    stop int64 in the source) per document.

    The smooth weighted round-robin of the module docstring. Every source's keys increase along its
    sequence, so taking the smallest key each time is a merge of the sequences by key; round r merges, with
    one sort, every document whose key lies in [r, r + 1) * ROUND_TOKENS, which are exactly the next ones.
    Deterministic in (sources, weights, seed); memory: one round (the orders are computed, the document
    ends memory-mapped).
    """
    seqs = [_Sequence(s, seed) for s in sources]
    # Ties between equal keys (every source at the start, or commensurate lengths later) go to the largest
    # weight first: a seeded order alone could start with a source of negligible weight, whose one long
    # document would then fill the mixture before any other source is reached. Equal weights: a seeded order.
    neg_weight = -np.array([s.weight for s in sources])  # [K]
    tie_rank = np.random.default_rng([seed, len(sources)]).permutation(len(sources))
    limit = 0
    while True:
        limit += ROUND_TOKENS
        taken = [seq.take(limit) for seq in seqs]
        keys = np.concatenate([t[0] for t in taken])  # [M]
        src = np.concatenate([np.full(len(t[0]), k, dtype=np.uint8) for k, t in enumerate(taken)])  # [M]
        order = np.lexsort((tie_rank[src], neg_weight[src], keys))  # [M]
        yield (src[order], np.concatenate([t[1] for t in taken])[order],
               np.concatenate([t[2] for t in taken])[order])


def _rounds(sources: list[_Source], seed: int, train_tokens: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """schedule() up to the first document that reaches train_tokens tokens."""
    total = 0
    for src, starts, stops in schedule(sources, seed):
        cum = total + np.cumsum(stops - starts)  # [M]
        if len(cum) and cum[-1] >= train_tokens:
            n = int(np.searchsorted(cum, train_tokens)) + 1
            yield src[:n], starts[:n], stops[:n]
            return
        total = int(cum[-1]) if len(cum) else total
        yield src, starts, stops


def mix(specs: Sequence[SourceSpec], out: str | os.PathLike, *, train_tokens: int | None = None, seed: int = 0,
        world_size: int, n_streams: int, eval_streams: int | None = None, overwrite: bool = False,
        index: bool = False, command: Sequence[str] | None = None, args: dict[str, Any] | None = None,
        progress: bool = True, space_check: bool = True) -> Manifest:
    """Write the mixture of `specs` as a corpus folder at `out` (see the module docstring); returns its manifest.
    With `index` the train split is an index of document ranges into the sources instead of a copy. With
    `space_check` a job refused up front when out's disk cannot hold what it will write (_check_mix_space)."""
    out = Path(out)
    check_sources(specs)
    check_seed(seed)
    check_train_tokens(train_tokens, n_streams)
    for s in specs:
        if same_place(s.corpus, out):
            raise PrepError(f"--out {out} is the corpus of source {s.name}; write the mixture elsewhere")
        if index and s.corpus.resolve().is_relative_to(out.resolve()):
            raise PrepError(f"--index: source {s.name} ({s.corpus}) lies inside --out {out}, which is replaced as a "
                            "whole; keep the sources the index points at outside the mixture's folder")
    check_output_apart(out, [(f"--source {s.name}", s.corpus) for s in specs])
    _check_distinct_corpora(specs)
    if train_tokens is None:  # the default length, from the manifests: before the scan reads any token
        trains = [read_corpus_manifest(s.corpus).splits.get("train") for s in specs]
        n_default = sum(t.n_tokens for t in trains if t is not None)
        check_train_tokens(n_default, n_streams, f"the default length (no --train-tokens), the sources' {n_default} "
                                                 "train tokens,")
    check_output(out, overwrite, marker="manifest.json")
    if space_check:
        _check_mix_space(specs, out, train_tokens, index)
    with owned_scratch(out, "scan") as scratch:
        return _mix(specs, out, Path(scratch), train_tokens=train_tokens, seed=seed, world_size=world_size,
                    n_streams=n_streams, eval_streams=eval_streams, overwrite=overwrite, index=index,
                    command=command, args=args, progress=progress)


def check_sources(specs: Sequence[SourceSpec]) -> None:
    """What the --source list itself must be, checked before any work (by mix, and by prepare --source before
    it prepares a source): a name names one source (its held-out splits, its scratch corpus), and every weight
    must leave its source a share (1e-20 beside 1e308 normalized to 0: a source named but never mixed)."""
    if not specs:
        raise PrepError("no source: pass --source NAME=CORPUS_DIR:WEIGHT at least once")
    if len({s.name for s in specs}) != len(specs):
        raise PrepError("--source: two sources have the same name; give each its own")
    if len(specs) > 255:
        raise PrepError(f"--source: {len(specs)} sources; at most 255 are supported")
    for s, share in zip(specs, normalized_weights([s.weight for s in specs])):
        if share == 0:
            raise PrepError(f"--source {s.name}: weight {s.weight!r} is too small beside the largest, "
                            f"{max(s.weight for s in specs)!r}: its share of the mixture is 0 in floating point; "
                            "give weights closer together")


def check_train_tokens(train_tokens: int | None, n_streams: int, what: str | None = None) -> None:
    """--train-tokens that no run of the mixture's --n-streams streams could train on is refused before any work
    (before, `--train-tokens 5` gave a mixture of one document that training refused as too short). `what`
    names a length that was not given as --train-tokens (mix's default, the sources' train tokens)."""
    need = MIN_STREAM_TOKENS * n_streams
    if train_tokens is not None and train_tokens < need:
        length = what or f"--train-tokens {train_tokens}"
        raise PrepError(f"{length} is below {need}, the least any run of the mixture's "
                        f"--n-streams {n_streams} streams trains on ({MIN_STREAM_TOKENS} per stream, model.tgt_len 1); "
                        "a run needs deepspeed.train_batch_size x (model.tgt_len + 1) tokens, e.g. 8 x 65 = 520 for "
                        "configs/tiny.json")


def _check_distinct_corpora(specs: Sequence[SourceSpec]) -> None:
    """One corpus under two names (`a=A:1 b=A:1`, `A` and `A/`, a link to it) would be mixed twice, its weight
    doubled and its valid documents listed twice: refused like an input given twice to prepare. So is a copy of
    one (`cp -r A B`, then `a=A b=B`): the same train tokens (the manifests' tokens_sha256), found before the
    sources are scanned."""
    for i, s in enumerate(specs):
        for first in specs[:i]:
            if same_place(s.corpus, first.corpus):
                raise PrepError(f"--source {s.name}: {s.corpus} is the corpus of source {first.name} "
                                f"({first.corpus}); give each corpus once (its weight says how much of it to mix)")
    seen: dict[str, SourceSpec] = {}
    for s in specs:
        train = read_corpus_manifest(s.corpus).splits.get("train")
        if train is None or train.index is not None:  # refused with their own lines when opened
            continue
        first = seen.setdefault(train.tokens_sha256, s)
        if first is not s:
            raise PrepError(f"--source {s.name}: {s.corpus} holds the train tokens of source {first.name} "
                            f"({first.corpus}; tokens_sha256 {train.tokens_sha256[:12]}...): a copy of one corpus; "
                            "give each corpus once (its weight says how much of it to mix)")


def _mix(specs: Sequence[SourceSpec], out: Path, scratch: Path, *, train_tokens: int | None, seed: int,
         world_size: int, n_streams: int, eval_streams: int | None, overwrite: bool, index: bool,
         command: Sequence[str] | None, args: dict[str, Any] | None, progress: bool) -> Manifest:
    """mix() once its arguments are checked; the sources' document ends live in files under `scratch`."""
    shares = normalized_weights([s.weight for s in specs])
    sources = [_open_source(s, i, share, progress, scratch) for i, (s, share) in enumerate(zip(specs, shares))]
    _check_same_tokenizer(sources)
    first = sources[0].manifest
    n_target = train_tokens if train_tokens is not None else sum(s.manifest.splits["train"].n_tokens for s in sources)
    # The files are cut at rank blocks, so the length must be known before the first token is written: a
    # first pass of the (deterministic, cheap) schedule gives it, the second writes. An index has no files.
    n_tokens = None if index else sum(int((stops - starts).sum()) for _, starts, stops in _rounds(sources, seed,
                                                                                                   n_target))

    held_out = {split: [s for s in sources if split in s.manifest.splits] for split in HELD_OUT}
    split_names = ["train"] + [n for split, parts in held_out.items() if parts
                               for n in [split] + [f"{split}/{s.spec.name}" for s in parts]]
    layouts = split_layouts(split_names, world_size, n_streams, eval_streams)
    if n_tokens is not None:
        check_fits("train", n_tokens, layouts["train"], str(out))
    for split, parts in held_out.items():
        for s in parts:
            check_fits(split, s.manifest.splits[split].n_tokens, layouts[f"{split}/{s.spec.name}"], str(s.spec.corpus))
        if parts:
            check_fits(split, sum(s.manifest.splits[split].n_tokens for s in parts), layouts[split], str(out))

    vocab, dtype = first.tokenizer.vocab_size, mixture_dtype([s.manifest for s in sources])
    with atomic_dir(out, overwrite=overwrite, marker="manifest.json") as tmp:
        (tmp / first.tokenizer.file).parent.mkdir(parents=True, exist_ok=True)
        (tmp / first.tokenizer.file).write_bytes((sources[0].spec.corpus / first.tokenizer.file).read_bytes())
        if index:
            train, mixture = _write_index(tmp, out, sources, seed, n_target, layouts["train"], progress)
            check_fits("train", train.n_tokens, layouts["train"], str(out))
        else:
            train, mixture = _write_train(tmp, sources, seed, n_target, n_tokens, layouts["train"], dtype, vocab,
                                          progress)
        splits = {"train": train}
        for split, parts in held_out.items():
            if parts:
                splits.update(_write_held_out(tmp, split, parts, layouts, dtype, vocab, progress))
        prov = provenance(command, args, sources=[{"name": s.spec.name, "corpus": str(s.spec.corpus),
                                                   "manifest_digest": s.manifest.digest()} for s in sources],
                          train_tokens_asked=n_target)
        manifest = Manifest(tokenizer=first.tokenizer, dtype=dtype, splits=splits, provenance=prov, mixture=mixture)
        write_manifest(tmp, manifest)
    return manifest


def mixture_dtype(manifests: Sequence[Manifest]) -> str:
    """The dtype the mixture is written in: the sources' when they share one; else (a tokenizer of 65,536 pieces,
    whose corpora an earlier version wrote as int32, beside a uint16 one) the current format's, which every id
    of the tokenizer fits."""
    dtypes = {m.dtype for m in manifests}
    return dtypes.pop() if len(dtypes) == 1 else token_dtype(manifests[0].tokenizer.vocab_size)


def _write_train(tmp: Path, sources: list[_Source], seed: int, n_target: int, n_tokens: int, layout, dtype: str,
                 vocab: int, progress: bool) -> tuple[SplitEntry, MixtureEntry]:
    """Copy the scheduled documents into the mixture's train files, CHUNK_TOKENS at a time (each source's
    documents of a chunk gathered in one vectorized call per record batch; a longer document cut across
    chunks), and write the documents file: flat memory, also with documents of 10^8 tokens, and no Python
    step per document. Returns the split and the mixture record."""
    writer = SplitWriter(tmp, "train", n_tokens, layout, dtype, vocab)
    documents = DocumentsWriter(tmp / DOCUMENTS_FILE)
    spread = DeviationSpread([s.weight for s in sources])
    readers = [TokenReader(s.spec.corpus, s.manifest, "train", verify=False) for s in sources]  # verified by the scan
    per_source_tokens = np.zeros(len(sources), dtype=np.int64)
    per_source_docs = np.zeros(len(sources), dtype=np.int64)
    written = 0
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mix-writer")
    pending: list[Future] = []
    try:
        with tqdm(total=n_tokens, unit=" tok", unit_scale=True, desc="mix train", disable=not progress,
                  file=sys.stderr) as bar:
            for src, starts, stops in _rounds(sources, seed, n_target):
                lengths = stops - starts  # [M]
                mix_starts = written + np.cumsum(lengths) - lengths  # [M]: where each document starts in the mixture
                documents.write(mix_starts + lengths, src)
                spread.add(mix_starts + lengths, src)
                per_source_tokens += np.bincount(src, weights=lengths, minlength=len(sources)).astype(np.int64)
                per_source_docs += np.bincount(src, minlength=len(sources))
                round_end = written + int(lengths.sum())
                for lo in range(written, round_end, CHUNK_TOKENS):
                    chunk = _gather_chunk(readers, src, starts, mix_starts, lengths, lo, min(lo + CHUNK_TOKENS,
                                                                                             round_end), dtype)
                    # The writer (two sha256 passes, the Arrow batch, the file write: all release the GIL) works
                    # on this chunk in its own thread while the next one is gathered; at most two in flight.
                    pending.append(background.submit(writer.write, chunk, "mix"))
                    if len(pending) > 1:
                        pending.pop(0).result()
                    bar.update(len(chunk))
                written = round_end
            for done in pending:
                done.result()
            files, tokens_sha256 = writer.close()
            documents_sha256 = documents.close()
    except BaseException:
        background.shutdown(wait=True, cancel_futures=True)  # the writer thread is idle before the file goes
        writer.abort()
        raise
    finally:
        background.shutdown(wait=True)
        for r in readers:
            r.close()
    train = SplitEntry(n_tokens=n_tokens, n_documents=int(per_source_docs.sum()), tokens_sha256=tokens_sha256,
                       layout=layout, files=files, **_text_counts(sources, per_source_tokens))
    return train, _mixture_record(sources, seed, n_tokens, per_source_tokens, per_source_docs, spread.result(),
                                  documents_sha256)


def _gather_chunk(readers: list[TokenReader], src: np.ndarray, starts: np.ndarray, mix_starts: np.ndarray,
                  lengths: np.ndarray, lo: int, hi: int, dtype: str) -> np.ndarray:
    """The mixture's tokens [lo, hi) of a round: the parts of its documents (source ids src, source starts,
    mixture starts and lengths [M]) that fall inside, each source's gathered in one call. A document longer
    than the chunk is cut across chunks: the files are a token stream (the documents file and the eod ids
    mark where documents end), and the split writer cuts record batches by token count whatever it is handed,
    so the bytes written do not depend on the cut, and memory does not grow with the longest document."""
    first = int(np.searchsorted(mix_starts + lengths, lo, side="right"))  # the first document ending after lo
    last = int(np.searchsorted(mix_starts, hi, side="left"))  # past the last one starting before hi
    part = slice(first, last)
    skip = np.maximum(lo - mix_starts[part], 0)  # [c]: tokens of a document's start already in earlier chunks
    cut = np.maximum(mix_starts[part] + lengths[part] - hi, 0)  # [c]: tokens of its end left to later chunks
    part_starts, part_stops = starts[part] + skip, starts[part] + lengths[part] - cut  # [c], [c]: in the source
    at = mix_starts[part] + skip - lo  # [c]: where each part goes in the chunk
    chunk = np.empty(hi - lo, dtype=dtype)  # a fresh array: the writer may keep a view
    part_src = src[part]
    for k in np.unique(part_src):
        sel = np.flatnonzero(part_src == k)
        readers[k].gather(part_starts[sel], part_stops[sel], out=chunk, out_at=at[sel])
    return chunk


def _write_index(tmp: Path, out: Path, sources: list[_Source], seed: int, n_target: int, layout,
                 progress: bool) -> tuple[SplitEntry, MixtureEntry]:
    """The train split as an index: the documents file with each document's start in its source, written a
    round of the schedule at a time (flat memory: one round), and no token copied or hashed."""
    documents = DocumentsWriter(tmp / DOCUMENTS_FILE, index=True)
    spread = DeviationSpread([s.weight for s in sources])
    per_source_tokens = np.zeros(len(sources), dtype=np.int64)
    per_source_docs = np.zeros(len(sources), dtype=np.int64)
    written = 0
    with tqdm(total=n_target, unit=" tok", unit_scale=True, desc="mix train (index)", disable=not progress,
              file=sys.stderr) as bar:
        for src, starts, stops in _rounds(sources, seed, n_target):
            lengths = stops - starts  # [M]
            mix_stops = written + np.cumsum(lengths)  # [M]: where each document ends in the mixture
            documents.write(mix_stops, src, starts)
            spread.add(mix_stops, src)
            per_source_tokens += np.bincount(src, weights=lengths, minlength=len(sources)).astype(np.int64)
            per_source_docs += np.bincount(src, minlength=len(sources))
            if len(mix_stops):
                bar.update(int(mix_stops[-1]) - written)
                written = int(mix_stops[-1])
    documents_sha256 = documents.close()
    digests = [s.manifest.digest() for s in sources]
    train = SplitEntry(n_tokens=written, n_documents=int(per_source_docs.sum()),
                       tokens_sha256=index_tokens_sha256(documents_sha256, digests), layout=layout, files=[],
                       index=IndexEntry(sources=[source_reference(out, s.spec.corpus) for s in sources]),
                       **_text_counts(sources, per_source_tokens))
    return train, _mixture_record(sources, seed, written, per_source_tokens, per_source_docs, spread.result(),
                                  documents_sha256)


def _text_counts(sources: list[_Source], per_source_tokens: np.ndarray) -> dict[str, int]:
    """The train split's n_bytes and n_chars. Bytes and characters per document are not recorded by
    prepare: whole epochs count exactly, a partial epoch by its share of the source's tokens (the source's
    bytes per token). They feed bits per byte only."""
    return {key: sum(round(getattr(s.manifest.splits["train"], key) * int(per_source_tokens[s.index])
                           / s.manifest.splits["train"].n_tokens) for s in sources) for key in ("n_bytes", "n_chars")}


def _mixture_record(sources: list[_Source], seed: int, n_tokens: int, per_source_tokens: np.ndarray,
                    per_source_docs: np.ndarray, spreads: list[int], documents_sha256: str) -> MixtureEntry:
    return MixtureEntry(seed=seed, documents_file=DOCUMENTS_FILE, documents_sha256=documents_sha256, sources=[
        MixtureSource(name=s.spec.name, manifest_digest=s.manifest.digest(), weight=s.weight,
                      source_tokens=s.manifest.splits["train"].n_tokens, tokens=int(per_source_tokens[k]),
                      documents=int(per_source_docs[k]), share=int(per_source_tokens[k]) / n_tokens,
                      epochs=int(per_source_tokens[k]) / s.manifest.splits["train"].n_tokens,
                      deviation_spread=spreads[k])
        for k, s in enumerate(sources)])


def _write_held_out(tmp: Path, split: str, parts: list[_Source], layouts: dict, dtype: str, vocab: int,
                    progress: bool) -> dict[str, SplitEntry]:
    """`<split>/<name>` for every source that has the split (its tokens unchanged) and `<split>` holding
    them all, in the order of the sources; one read of each source's split."""
    whole = SplitWriter(tmp, split, sum(s.manifest.splits[split].n_tokens for s in parts), layouts[split], dtype,
                        vocab)
    out = {}
    for s in parts:
        entry = s.manifest.splits[split]
        name = f"{split}/{s.spec.name}"
        writer = SplitWriter(tmp, name, entry.n_tokens, layouts[name], dtype, vocab)
        # The manifest hashed the tokens in the source's dtype, which may not be the mixture's (an int32 corpus
        # of an older version beside a uint16 one): checked in the source's, recorded in the mixture's.
        source_hash = hashlib.sha256()
        with TokenReader(s.spec.corpus, s.manifest, split, verify=True) as reader, \
                tqdm(total=entry.n_tokens, unit=" tok", unit_scale=True, desc=f"copy {name}",
                     disable=not progress, file=sys.stderr) as bar:
            for tokens in reader.chunks(0, entry.n_tokens):
                update_tokens_sha256(source_hash, tokens, s.manifest.dtype)
                writer.write(tokens, str(s.spec.corpus))
                whole.write(tokens, str(s.spec.corpus))
                bar.update(len(tokens))
        files, tokens_sha256 = writer.close()
        if (copied := source_hash.hexdigest()) != entry.tokens_sha256:
            raise PrepError(f"{s.spec.corpus / 'manifest.json'}: split {split}: the copied tokens hash to "
                            f"{copied[:12]}... but the manifest's tokens_sha256 is {entry.tokens_sha256[:12]}"
                            "...: the manifest does not describe these tokens; re-run prepare")
        out[name] = dataclasses.replace(entry, layout=layouts[name], files=files, tokens_sha256=tokens_sha256)
    files, tokens_sha256 = whole.close()
    counts = {k: sum(getattr(s.manifest.splits[split], k) for s in parts)
              for k in ("n_tokens", "n_documents", "n_bytes", "n_chars")}
    return {split: SplitEntry(tokens_sha256=tokens_sha256, layout=layouts[split], files=files, **counts), **out}


def prepare_mixture(sources: Sequence[SourceSpec], spec: InputSpec, out: str | os.PathLike, *,
                    tokenizer_model: str | os.PathLike | None, eod_piece: str | None, trainer: TrainerOptions,
                    num_proc: int, world_size: int, n_streams: int, eval_streams: int | None,
                    train_tokens: int | None, overwrite: bool, command: Sequence[str] | None,
                    args: dict[str, Any] | None, progress: bool, space_check: bool = True,
                    work_dir: str | os.PathLike | None = None) -> Manifest:
    """`prepare --source NAME=FILES:WEIGHT ...`: raw text to a mixture in one step.

    One tokenizer for all sources (trained on all their training documents, or --tokenizer-model), each
    source prepared on its own with the held-out fractions of `spec` (so each has its own valid/test), then
    mixed. The per-source corpora live in an owned scratch folder beside `out` (`.<out>.sources-*`), removed
    at the end, and by the next job for `out` when this one is killed; with `work_dir`, their token streams
    while they are prepared go there (as `prepare --work-dir`'s do).
    """
    out = Path(out)
    if spec.train or spec.valid or spec.test:
        raise PrepError("--source gives each source's files: drop --train/--valid/--test (hold out documents "
                        "of every source with --valid-fraction/--test-fraction)")
    # Before hours of preparing the sources, not in mix() after them.
    check_sources(sources)
    check_seed(spec.seed)
    check_train_tokens(train_tokens, n_streams)
    split_layouts(["train"], world_size, n_streams, eval_streams)  # the sources are prepared for 1 stream
    check_output(out, overwrite, marker="manifest.json")
    if work_dir is not None:
        check_work_dir(Path(work_dir), out)
    _check_source_files(sources, spec, out, tokenizer_model)
    if space_check:
        _check_mixture_space(sources, spec, out, tokenizer_model, eod_piece, trainer, train_tokens, work_dir)
    with owned_scratch(out, "sources") as work:
        if tokenizer_model is None:  # on what each source's prepare below keeps for training
            tokenizer_model = train_tokenizer_job(spec, work / "tokenizer.model", trainer, progress=progress,
                                                  parts={f"--source {s.name}": [str(s.corpus)] for s in sources})
        trained_by: dict[str, SourceSpec] = {}  # train tokens_sha256 -> the first source that gave them
        for s in sources:
            try:
                # One stream per split: mix lays every split out for the mixture's streams and checks that each
                # fits them, so a source too small for them alone is mixed as it would be by hand.
                prepare(dataclasses.replace(spec, train=[str(s.corpus)]), work / s.name,
                        tokenizer_model=tokenizer_model, eod_piece=eod_piece, trainer=trainer, num_proc=num_proc,
                        world_size=1, n_streams=1, work_dir=work_dir, command=command, args=args, progress=progress,
                        space_check=False)  # checked for the whole job above
            except PrepError as e:  # which source it was (e.g. one too small for the held-out fractions)
                raise PrepError(f"--source {s.name}: {e}") from None
            # Two sources of the same text (a copied file) would be mixed twice, as mix refuses for a copied
            # corpus; said here, as soon as the second is prepared, in the user's files, not the scratch folders.
            first = trained_by.setdefault(read_corpus_manifest(work / s.name).splits["train"].tokens_sha256, s)
            if first is not s:
                raise PrepError(f"--source {s.name}: its files ({s.corpus}) give the same training tokens as those "
                                f"of source {first.name} ({first.corpus}): one text under two names; give it once "
                                "(its weight says how much of it to mix)")
        return mix([SourceSpec(s.name, work / s.name, s.weight) for s in sources], out, train_tokens=train_tokens,
                   seed=spec.seed, world_size=world_size, n_streams=n_streams, eval_streams=eval_streams,
                   overwrite=overwrite, command=command, args=args, progress=progress,
                   space_check=False)  # checked for the whole job above


def _check_source_files(sources: Sequence[SourceSpec], spec: InputSpec, out: Path,
                        tokenizer_model: str | os.PathLike | None) -> None:
    """Before any work: no file may feed two sources (overlapping globs), since each source holds out its
    own valid/test documents and a file in two sources would put them into the other's training text; and
    the output must neither be nor hold an input."""
    files = {f"--source {s.name}": resolve_sources([str(s.corpus)], f"--source {s.name}", spec.format)
             for s in sources}
    check_disjoint(files)
    inputs = [(option, f.path) for option, found in files.items() for f in found]
    if tokenizer_model is not None:
        inputs.append(("--tokenizer-model", Path(tokenizer_model)))
    check_output_apart(out, inputs)


def _check_mixture_space(sources: Sequence[SourceSpec], spec: InputSpec, out: Path,
                         tokenizer_model: str | os.PathLike | None, eod_piece: str | None, trainer: TrainerOptions,
                         train_tokens: int | None, work_dir: str | os.PathLike | None = None) -> None:
    """On out's file system: the per-source corpora, while the last one is made its token stream too (in
    `work_dir` when given), and then the mixture (as large as the sources, or --train-tokens' worth plus the
    held-out documents)."""
    vocab_size = trainer.vocab_size if tokenizer_model is None else describe_tokenizer(tokenizer_model,
                                                                                       eod_piece).vocab_size
    n_input = [input_text_bytes(resolve_sources([str(s.corpus)], f"--source {s.name}", spec.format),
                                spec.read.text_field) for s in sources]
    corpora = token_bytes(sum(n_input), vocab_size)
    largest = token_bytes(max(n_input), vocab_size)
    held_out = spec.valid_fraction + spec.test_fraction
    mixture = corpora if train_tokens is None else int(
        train_tokens * token_bytes(1, vocab_size) + held_out * corpora)
    needs = [(out.parent, corpora, f"the sources' corpora: {estimate_note(sum(n_input), vocab_size)}")]
    if work_dir is None:
        needs.append((out.parent, max(largest, mixture), "then the mixture, or a source's token stream while it is "
                                                         "laid out"))
    else:
        needs += [(out.parent, mixture, "then the mixture"),
                  (Path(work_dir), largest, "a source's token stream while it is laid out")]
    check_free_space(needs, "prepare --source", "give --out (or --work-dir) on another file system")


def _check_mix_space(specs: Sequence[SourceSpec], out: Path, train_tokens: int | None, index: bool) -> None:
    """What mix will write beside `out`, from the sources' manifests alone (before the scan reads any token),
    all on out's file system: the train tokens (copy mode; the stream overshoots by less than one document),
    the documents file (the documents those tokens hold at each source's mean document length, a row of the
    file's columns each), every held-out split twice (`valid/<name>` and `valid`) and the scan's document
    ends (8 bytes per source document, kept until the end). An index copies no train token."""
    manifests = [read_corpus_manifest(s.corpus) for s in specs]  # a bad one is refused here as it would be later
    trains = [(s.weight, m.splits["train"]) for s, m in zip(specs, manifests) if "train" in m.splits]
    dtype = mixture_dtype(manifests)  # one tokenizer for all (checked after the scan)
    itemsize = np.dtype(dtype).itemsize
    n_tokens = train_tokens if train_tokens is not None else sum(t.n_tokens for _, t in trains)
    shares = normalized_weights([w for w, _ in trains])
    n_docs = math.ceil(sum(share * n_tokens * t.n_documents / max(t.n_tokens, 1)
                           for share, (_, t) in zip(shares, trains)))
    row_bytes = sum(f.type.bit_width for f in (INDEX_SCHEMA if index else DOCUMENTS_SCHEMA)) // 8
    held_out = 2 * itemsize * sum(m.splits[split].n_tokens for m in manifests for split in HELD_OUT
                                  if split in m.splits)
    source_docs = sum(t.n_documents for _, t in trains)
    needs = [] if index else [(out.parent, n_tokens * itemsize,
                               f"the train split: {n_tokens:,} tokens x {itemsize} bytes per {dtype} token")]
    needs += [(out.parent, n_docs * row_bytes, f"the documents file: about {n_docs:,} documents x {row_bytes} bytes"),
              (out.parent, held_out, f"the held-out splits, per source and together: {size_text(held_out)}"),
              (out.parent, source_docs * 8, f"the scan's document ends: {source_docs:,} x 8 bytes")]
    check_free_space(needs, "mix --index" if index else "mix", "give --out on another file system")
