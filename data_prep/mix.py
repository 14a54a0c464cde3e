"""`mix`: a data mixture as one corpus, whole documents of several prepared corpora interleaved by weight.

The general frameworks blend datasets by drawing documents or fixed-length samples independently; that
would cut Transformer-XL's segment recurrence. Here the mixture's train split is ONE global token stream of
whole documents (each with the eod it already ends with), so every stream of a run is contiguous text and
the loader, resume, elastic resume and evaluation read it like any corpus.

The order: a smooth weighted round-robin over documents. Before each document, every source's deficit is
weight * (tokens so far) - (its tokens so far); the next document comes from the source with the largest
deficit (ties: a seeded order of the sources). The deficits always sum to 0, the chosen one is >= 0 and a
document of length l moves it by at most l, so no source ever leads by more than the longest document D or
lags by more than (K-1) * D (K sources). Hence over ANY window of n tokens a source's share is within
spread / n of its weight, where spread = max - min of its deviation over the stream (<= K * D); the
manifest records each source's spread, and verify recomputes it. With documents of a few thousand tokens
this is far inside 1% over every 1M-token window; whole books (D ~ 10^5 tokens) cannot be, by any order
that keeps documents whole.

Each source's documents are taken epoch by epoch, each epoch in a seeded permutation of the source's
documents: a source smaller than its share repeats (whole epochs, then the first documents of the next
permutation: a seeded partial epoch), a larger one is subsampled by whole documents (the first documents
of its first permutation). The stream ends with the document that reaches --train-tokens, so it holds at
least that many tokens and less than one document more.

Held-out splits are not mixed: each source's valid/test split is copied whole as `valid/<name>` /
`test/<name>` (evaluation reports each), and the mixture's own `valid` / `test` are those splits
concatenated in the order the sources were given (every held-out document of every source once).

Memory: tokens are copied in bounded chunks; what grows with the corpus is the documents' bookkeeping,
about 33 bytes per train document of the mixture (the schedule, the documents file) plus 8 per source
document (its end offset).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_prep.atomic import atomic_dir, check_output
from data_prep.errors import PrepError
from data_prep.layout import CHUNK_TOKENS, SplitWriter, check_fits, split_layouts
from data_prep.prepare import provenance
from txl_dist.data.format import (
    Manifest,
    MixtureEntry,
    MixtureSource,
    SplitEntry,
    TokenReader,
    check_source_name,
    read_manifest,
    sha256_file,
    write_manifest,
)
from txl_dist.data.mixture import DOCUMENTS_FILE, deviation_spread, write_documents

HELD_OUT = ("valid", "test")


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


@dataclass
class _Source:
    """A source corpus opened for mixing: its manifest, the ends of its train documents, its readers."""

    spec: SourceSpec
    index: int
    manifest: Manifest
    weight: float
    doc_stops: np.ndarray
    """int64 [n_docs]: where each train document ends in the source's stream (after its eod)."""


def _open_source(spec: SourceSpec, index: int, weight: float, progress: bool) -> _Source:
    manifest = read_manifest(spec.corpus)
    tok_path = spec.corpus / manifest.tokenizer.file
    if not tok_path.is_file() or sha256_file(tok_path) != manifest.tokenizer.sha256:
        raise PrepError(f"{tok_path}: missing or its sha256 differs from the manifest; not the corpus' tokenizer")
    if "train" not in manifest.splits:
        raise PrepError(f"--source {spec.name}: {spec.corpus} has no train split to mix")
    return _Source(spec, index, manifest, weight, _document_stops(spec, manifest, progress))


def _document_stops(spec: SourceSpec, manifest: Manifest, progress: bool) -> np.ndarray:
    """The end of every train document (one read of the train split; each file's sha256 checked on opening)."""
    split, eod = manifest.splits["train"], manifest.tokenizer.eod_id
    pieces, pos, last = [], 0, None
    with TokenReader(spec.corpus, manifest, "train", verify=True) as reader, \
            tqdm(total=split.n_tokens, unit=" tok", unit_scale=True, desc=f"scan {spec.name}",
                 disable=not progress, file=sys.stderr) as bar:
        for tokens in reader.chunks(0, split.n_tokens):
            pieces.append(np.flatnonzero(tokens == eod) + (pos + 1))
            pos += len(tokens)
            last = int(tokens[-1])
            bar.update(len(tokens))
    stops = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
    if last != eod or len(stops) != split.n_documents:
        # Documents are told apart by their eods only: a text that itself holds the eod piece would be cut.
        raise PrepError(f"--source {spec.name}: {spec.corpus} train has {split.n_documents} documents but "
                        f"{len(stops)} eod ids (id {eod}); documents cannot be told apart, re-run prepare")
    return stops.astype(np.int64)


def _check_same_tokenizer(sources: list[_Source]) -> None:
    first = sources[0]
    ref = dataclasses.replace(first.manifest.tokenizer, file="")
    for s in sources[1:]:
        tok = dataclasses.replace(s.manifest.tokenizer, file="")
        if tok != ref:
            diff = next(f.name for f in dataclasses.fields(tok) if getattr(tok, f.name) != getattr(ref, f.name))
            raise PrepError(f"--source {s.spec.name}: its tokenizer differs from {first.spec.name}'s ({diff}); "
                            "mix corpora prepared with the same tokenizer (prepare --tokenizer-model)")


class _Epochs:
    """A source's documents, epoch after epoch, each epoch a seeded permutation of them."""

    def __init__(self, source: _Source, seed: int):
        self.stops, self.seed, self.index = source.doc_stops, seed, source.index
        self.epoch, self.pos = -1, len(self.stops)
        self.order = np.empty(0, dtype=np.int64)

    def next(self) -> tuple[int, int]:
        """(start, stop) of the next document in the source's stream."""
        if self.pos == len(self.stops):
            self.epoch += 1
            self.order = np.random.default_rng([self.seed, self.index, self.epoch]).permutation(len(self.stops))
            self.pos = 0
        d = int(self.order[self.pos])
        self.pos += 1
        return (int(self.stops[d - 1]) if d else 0), int(self.stops[d])


def schedule(sources: list[_Source], train_tokens: int, seed: int) -> tuple[array, array, array]:
    """The mixture's train documents in order: (source index, start, stop in the source), as compact arrays.

    The smooth weighted round-robin of the module docstring; deterministic in (sources, weights, seed).
    """
    epochs = [_Epochs(s, seed) for s in sources]
    weights = [s.weight for s in sources]
    # Ties between equal deficits (at the start, or with equal weights) go by a seeded order of the sources.
    tie_rank = np.random.default_rng([seed, len(sources)]).permutation(len(sources)).tolist()
    taken = [0] * len(sources)
    out_source, out_start, out_stop = array("B"), array("q"), array("q")
    total, k_range = 0, range(len(sources))
    while total < train_tokens:
        best, best_key = 0, None
        for k in k_range:
            key = (weights[k] * total - taken[k], tie_rank[k])
            if best_key is None or key > best_key:
                best, best_key = k, key
        start, stop = epochs[best].next()
        out_source.append(best)
        out_start.append(start)
        out_stop.append(stop)
        taken[best] += stop - start
        total += stop - start
    return out_source, out_start, out_stop


def mix(specs: Sequence[SourceSpec], out: str | os.PathLike, *, train_tokens: int | None = None, seed: int = 0,
        world_size: int, n_streams: int, eval_streams: int | None = None, overwrite: bool = False,
        command: Sequence[str] | None = None, args: dict[str, Any] | None = None, progress: bool = True) -> Manifest:
    """Write the mixture of `specs` as a corpus folder at `out` (see the module docstring); returns its manifest."""
    out = Path(out)
    if not specs:
        raise PrepError("no source: pass --source NAME=CORPUS_DIR:WEIGHT at least once")
    if len({s.name for s in specs}) != len(specs):
        raise PrepError("--source: two sources have the same name; give each its own")
    if len(specs) > 255:
        raise PrepError(f"--source: {len(specs)} sources; at most 255 are supported")
    if seed < 0:
        raise PrepError(f"--seed must be >= 0, got {seed}")
    if train_tokens is not None and train_tokens < 1:
        raise PrepError(f"--train-tokens must be >= 1, got {train_tokens}")
    for s in specs:
        if s.corpus.resolve() == out.resolve():
            raise PrepError(f"--out {out} is the corpus of source {s.name}; write the mixture elsewhere")
    check_output(out, overwrite)
    total_weight = sum(s.weight for s in specs)
    sources = [_open_source(s, i, s.weight / total_weight, progress) for i, s in enumerate(specs)]
    _check_same_tokenizer(sources)
    first = sources[0].manifest
    n_target = train_tokens if train_tokens is not None else sum(s.manifest.splits["train"].n_tokens for s in sources)

    src, starts, stops = schedule(sources, n_target, seed)
    src_np = np.frombuffer(src, dtype=np.uint8)  # [n_docs]
    lengths = np.frombuffer(stops, dtype=np.int64) - np.frombuffer(starts, dtype=np.int64)  # [n_docs]
    mix_stops = np.cumsum(lengths)  # [n_docs]: where each document ends in the mixture
    n_tokens = int(mix_stops[-1])

    held_out = {split: [s for s in sources if split in s.manifest.splits] for split in HELD_OUT}
    split_names = ["train"] + [n for split, parts in held_out.items() if parts
                               for n in [split] + [f"{split}/{s.spec.name}" for s in parts]]
    layouts = split_layouts(split_names, world_size, n_streams, eval_streams)
    check_fits("train", n_tokens, layouts["train"], str(out))
    for split, parts in held_out.items():
        for s in parts:
            check_fits(split, s.manifest.splits[split].n_tokens, layouts[f"{split}/{s.spec.name}"], str(s.spec.corpus))
        if parts:
            check_fits(split, sum(s.manifest.splits[split].n_tokens for s in parts), layouts[split], str(out))

    vocab, dtype = first.tokenizer.vocab_size, first.dtype
    with atomic_dir(out, overwrite=overwrite) as tmp:
        (tmp / first.tokenizer.file).parent.mkdir(parents=True, exist_ok=True)
        (tmp / first.tokenizer.file).write_bytes((sources[0].spec.corpus / first.tokenizer.file).read_bytes())
        splits = {"train": _write_train(tmp, sources, src, starts, stops, n_tokens, layouts["train"], dtype, vocab,
                                        progress)}
        for split, parts in held_out.items():
            if parts:
                splits.update(_write_held_out(tmp, split, parts, layouts, dtype, vocab, progress))
        docs_sha = write_documents(tmp / DOCUMENTS_FILE, mix_stops, src_np)
        per_source_tokens = np.bincount(src_np, weights=lengths, minlength=len(sources)).astype(np.int64)
        per_source_docs = np.bincount(src_np, minlength=len(sources))
        spreads = deviation_spread(mix_stops, src_np, [s.weight for s in sources])
        mixture = MixtureEntry(seed=seed, documents_file=DOCUMENTS_FILE, documents_sha256=docs_sha, sources=[
            MixtureSource(name=s.spec.name, manifest_digest=s.manifest.digest(), weight=s.weight,
                          source_tokens=s.manifest.splits["train"].n_tokens, tokens=int(per_source_tokens[k]),
                          documents=int(per_source_docs[k]), share=int(per_source_tokens[k]) / n_tokens,
                          epochs=int(per_source_tokens[k]) / s.manifest.splits["train"].n_tokens,
                          deviation_spread=spreads[k])
            for k, s in enumerate(sources)])
        prov = provenance(command, args, sources=[{"name": s.spec.name, "corpus": str(s.spec.corpus),
                                                   "manifest_digest": s.manifest.digest()} for s in sources],
                          train_tokens_asked=n_target)
        manifest = Manifest(tokenizer=first.tokenizer, dtype=dtype, splits=splits, provenance=prov, mixture=mixture)
        write_manifest(tmp, manifest)
    return manifest


def _write_train(tmp: Path, sources: list[_Source], src: array, starts: array, stops: array, n_tokens: int,
                 layout, dtype: str, vocab: int, progress: bool) -> SplitEntry:
    """Copy the scheduled documents into the mixture's train files (bounded chunks: flat memory)."""
    writer = SplitWriter(tmp, "train", n_tokens, layout, dtype, vocab)
    readers = [TokenReader(s.spec.corpus, s.manifest, "train", verify=False) for s in sources]  # verified by the scan
    buf, fill = np.empty(CHUNK_TOKENS, dtype=dtype), 0
    try:
        with tqdm(total=n_tokens, unit=" tok", unit_scale=True, desc="mix train", disable=not progress,
                  file=sys.stderr) as bar:
            for k, a, b in zip(src, starts, stops):
                if fill + (b - a) > CHUNK_TOKENS and fill:
                    writer.write(buf[:fill], "mix")  # the writer may keep a view of it: a fresh buffer follows
                    bar.update(fill)
                    buf, fill = np.empty(CHUNK_TOKENS, dtype=dtype), 0
                if b - a > CHUNK_TOKENS:  # a document longer than the buffer goes through in pieces
                    for piece in readers[k].chunks(a, b):
                        writer.write(piece, str(sources[k].spec.corpus))
                    bar.update(b - a)
                    continue
                for piece in readers[k].chunks(a, b):
                    buf[fill:fill + len(piece)] = piece
                    fill += len(piece)
            writer.write(buf[:fill], "mix")
            bar.update(fill)
            files, tokens_sha256 = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        for r in readers:
            r.close()
    per_source = np.bincount(np.frombuffer(src, dtype=np.uint8),
                             weights=np.frombuffer(stops, dtype=np.int64) - np.frombuffer(starts, dtype=np.int64),
                             minlength=len(sources))
    # Bytes and characters per document are not recorded by prepare: whole epochs count exactly, a partial
    # epoch by its share of the source's tokens (the source's bytes per token). They feed bits per byte only.
    text = {key: sum(round(getattr(s.manifest.splits["train"], key) * per_source[s.index]
                           / s.manifest.splits["train"].n_tokens) for s in sources) for key in ("n_bytes", "n_chars")}
    return SplitEntry(n_tokens=n_tokens, n_documents=len(src), tokens_sha256=tokens_sha256, layout=layout,
                      files=files, **text)


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
        with TokenReader(s.spec.corpus, s.manifest, split, verify=True) as reader, \
                tqdm(total=entry.n_tokens, unit=" tok", unit_scale=True, desc=f"copy {name}",
                     disable=not progress, file=sys.stderr) as bar:
            for tokens in reader.chunks(0, entry.n_tokens):
                writer.write(tokens, str(s.spec.corpus))
                whole.write(tokens, str(s.spec.corpus))
                bar.update(len(tokens))
        files, tokens_sha256 = writer.close()
        if tokens_sha256 != entry.tokens_sha256:
            raise PrepError(f"{s.spec.corpus / 'manifest.json'}: split {split}: the copied tokens hash to "
                            f"{tokens_sha256[:12]}... but the manifest's tokens_sha256 is {entry.tokens_sha256[:12]}"
                            "...: the manifest does not describe these tokens; re-run prepare")
        out[name] = dataclasses.replace(entry, layout=layouts[name], files=files)
    files, tokens_sha256 = whole.close()
    counts = {k: sum(getattr(s.manifest.splits[split], k) for s in parts)
              for k in ("n_tokens", "n_documents", "n_bytes", "n_chars")}
    return {split: SplitEntry(tokens_sha256=tokens_sha256, layout=layouts[split], files=files, **counts), **out}
