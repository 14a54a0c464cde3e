"""`mix`: a data mixture as one corpus, whole documents of several prepared corpora interleaved by weight.

The general frameworks blend datasets by drawing documents or fixed-length samples independently; that
would cut Transformer-XL's segment recurrence. Here the mixture's train split is ONE global token stream of
whole documents (each with the eod it already ends with), so every stream of a run is contiguous text and
the loader, resume, elastic resume and evaluation read it like any corpus.

The order: a smooth weighted round-robin over documents (stride scheduling). The next document comes
from the source furthest behind its share: the one whose tokens so far divided by its weight, x_k, is the
smallest (ties: a seeded order of the sources). Taking the smallest x_k and adding l / w_k to it keeps
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

Memory: tokens are copied in bounded chunks; what grows with the corpus is the documents' bookkeeping,
about 33 bytes per train document of the mixture (the schedule, the documents file) plus 8 per source
document (its end offset).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
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


def _epochs(source: _Source, seed: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, stops) int64 of the source's documents, epoch after epoch, each epoch a seeded permutation,
    up to the first document that reaches `tokens` tokens."""
    stops = source.doc_stops
    starts = np.concatenate([[0], stops[:-1]])  # [n_docs]
    n_epochs = max(1, -(-tokens // int(stops[-1])))
    order = np.concatenate([np.random.default_rng([seed, source.index, e]).permutation(len(stops))
                            for e in range(n_epochs)])  # [n_epochs * n_docs]
    cum = np.cumsum(stops[order] - starts[order])  # [n_epochs * n_docs]
    order = order[:int(np.searchsorted(cum, tokens)) + 1]
    return starts[order], stops[order]


def schedule(sources: list[_Source], train_tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mixture's train documents in order: (source index uint8, start, stop int64 in the source).

    The smooth weighted round-robin of the module docstring. Each source's keys (tokens before the document
    / weight) increase along its document sequence, so taking the smallest key every time is a merge of
    the sources' sequences by key: one sort instead of a Python step per document. Deterministic in
    (sources, weights, seed).
    """
    # Ties between equal keys (at the start, or with commensurate lengths) go by a seeded order of the sources.
    tie_rank = np.random.default_rng([seed, len(sources)]).permutation(len(sources))
    longest = max(int(np.diff(s.doc_stops, prepend=0).max()) for s in sources)
    need = [int(s.weight * train_tokens) + 2 * longest for s in sources]
    while True:
        seqs = [_epochs(s, seed, n) for s, n in zip(sources, need)]
        lengths = [b - a for a, b in seqs]
        keys = np.concatenate([(np.cumsum(n) - n) / s.weight for s, n in zip(sources, lengths)])  # [M]
        src = np.concatenate([np.full(len(n), k, dtype=np.uint8) for k, n in enumerate(lengths)])  # [M]
        order = np.lexsort((tie_rank[src], keys))  # [M]
        cum = np.cumsum(np.concatenate(lengths)[order])  # [M]
        if cum[-1] >= train_tokens:
            order = order[:int(np.searchsorted(cum, train_tokens)) + 1]
            used = np.bincount(src[order], minlength=len(sources))
            ran_out = [k for k, n in enumerate(lengths) if used[k] == len(n)]
            if not ran_out:  # every source still had documents left: the merge is the greedy order
                break
        else:
            ran_out = list(range(len(sources)))
        for k in ran_out:
            need[k] *= 2
    all_starts = np.concatenate([a for a, _ in seqs])  # [M]
    all_stops = np.concatenate([b for _, b in seqs])  # [M]
    return src[order], all_starts[order], all_stops[order]


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

    src_np, starts, stops = schedule(sources, n_target, seed)  # [n_docs] each
    lengths = stops - starts  # [n_docs]
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
        splits = {"train": _write_train(tmp, sources, src_np, starts, stops, n_tokens, layouts["train"], dtype, vocab,
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


def _write_train(tmp: Path, sources: list[_Source], src: np.ndarray, starts: np.ndarray, stops: np.ndarray,
                 n_tokens: int, layout, dtype: str, vocab: int, progress: bool) -> SplitEntry:
    """Copy the scheduled documents into the mixture's train files, about CHUNK_TOKENS at a time (each source's
    documents of a chunk gathered in one vectorized call): flat memory, no Python step per document."""
    writer = SplitWriter(tmp, "train", n_tokens, layout, dtype, vocab)
    readers = [TokenReader(s.spec.corpus, s.manifest, "train", verify=False) for s in sources]  # verified by the scan
    lengths = stops - starts  # [n_docs]
    mix_starts = np.cumsum(lengths) - lengths  # [n_docs]: where each document starts in the mixture
    try:
        with tqdm(total=n_tokens, unit=" tok", unit_scale=True, desc="mix train", disable=not progress,
                  file=sys.stderr) as bar:
            first = 0
            while first < len(src):
                # the documents that start in the next CHUNK_TOKENS tokens (at least one)
                last = max(first + 1, int(np.searchsorted(mix_starts, mix_starts[first] + CHUNK_TOKENS)))
                part_src = src[first:last]  # [c]
                part_len = lengths[first:last]  # [c]
                chunk = np.empty(int(part_len.sum()), dtype=dtype)  # a fresh array: the writer may keep a view
                at = np.cumsum(part_len) - part_len  # [c]
                for k in np.unique(part_src):
                    sel = np.flatnonzero(part_src == k)
                    tokens = readers[k].gather(starts[first:last][sel], stops[first:last][sel])
                    chunk[np.repeat(at[sel], part_len[sel]) + np.arange(len(tokens))
                          - np.repeat(np.cumsum(part_len[sel]) - part_len[sel], part_len[sel])] = tokens
                writer.write(chunk, "mix")
                bar.update(len(chunk))
                first = last
            files, tokens_sha256 = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        for r in readers:
            r.close()
    per_source = np.bincount(src, weights=lengths, minlength=len(sources))
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
