"""Which document goes to which split and which shard: the plan every pass of a prepare job follows.

Inputs come as groups: `--train`, `--valid`, `--test` each name their split's documents; with
`--valid-fraction` / `--test-fraction`, whole documents of the --train inputs are held out (a seeded random
choice of document indices, so every shard process and every re-run picks the same ones). Within a split,
documents keep their input order. `--shard i/n` gives shard i the i-th of n contiguous document ranges of
every split, so concatenating the shards' streams in shard order rebuilds each split's global stream.

With the planning pass's records of the inputs (`prepare --plan`, data_prep/plan_file.py) nothing is counted
here, and a shard starts reading each input group at the seek point nearest before the first document it
needs (data_prep/seek.py) instead of at the group's start.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from data_prep.errors import PrepError
from data_prep.seek import BYTES, InputRecord, documents_from
from data_prep.sources import TEXT, ReadOptions, Source, count_documents, iter_documents, source_files

SPLITS = ("train", "valid", "test")


@dataclass
class InputGroup:
    """Documents read in one run of inputs: all go to `split`, except the held-out ones."""

    split: str
    sources: list[Source]
    holdout: dict[str, np.ndarray] = field(default_factory=dict)
    """Held-out split name -> sorted document indices (within this group) that go there instead."""
    records: list[InputRecord] | None = None
    """The planning pass's record of each source (counts, seek points), or None: count and read from the start."""


@dataclass
class Plan:
    """The input groups, each split's document count, and this shard's document range per split."""

    groups: list[InputGroup]
    n_documents: dict[str, int]
    shard: tuple[int, int] = (0, 1)

    def doc_range(self, split: str) -> tuple[int, int]:
        """This shard's documents [lo, hi) of `split` (contiguous; the shards tile the split in order)."""
        i, n = self.shard
        total = self.n_documents[split]
        return i * total // n, (i + 1) * total // n

    @property
    def splits(self) -> list[str]:
        """Split names in the order train, valid, test (those present)."""
        return [s for s in SPLITS if s in self.n_documents]


def make_plan(inputs: dict[str, list[Source]], fractions: dict[str, float], opts: ReadOptions, *,
              seed: int = 0, shard: tuple[int, int] = (0, 1), count: bool = True, progress=None,
              records: dict[str, list[InputRecord]] | None = None) -> Plan:
    """Build the plan: count documents (only when needed) and pick held-out documents.

    `inputs` maps split -> sources (train required); `fractions` maps a held-out split -> fraction of the
    training inputs' documents. Counting reads the inputs once (cheap: no tokenizing) unless every input is
    one-document-per-file text, or neither shards nor fractions need the counts (`count=False`), or `records`
    (split -> the planning pass's record of each source) give them; `progress(n)` is called as documents are
    counted.
    """
    if "train" not in inputs:
        raise PrepError("no training input: pass --train FILES")
    for split, frac in fractions.items():
        if split in inputs:
            raise PrepError(f"--{split} and --{split}-fraction both given; use one of them")
        if not 0.0 <= frac < 1.0:
            raise PrepError(f"--{split}-fraction {frac} must be in [0, 1)")
    fractions = {s: f for s, f in fractions.items() if f > 0}
    need_counts = count or bool(fractions) or shard[1] > 1
    groups, counts = [], {}
    for split in SPLITS:
        if split not in inputs:
            continue
        group = InputGroup(split, inputs[split], records=records[split] if records is not None else None)
        if group.records is not None:
            n = sum(r.documents for r in group.records)
        else:
            n = count_documents(group.sources, opts, progress) if need_counts else -1
        if split == "train" and fractions:
            group.holdout = _pick_holdout(n, fractions, seed)
            for held, idx in group.holdout.items():
                counts[held] = len(idx)
            n -= sum(len(idx) for idx in group.holdout.values())
            if n < 1:
                raise PrepError(f"holding out {', '.join(fractions)} leaves no training document; "
                                "use smaller fractions or more documents")
        counts[split] = n
        groups.append(group)
    return Plan(groups, counts, shard)


def _pick_holdout(n_docs: int, fractions: dict[str, float], seed: int) -> dict[str, np.ndarray]:
    sizes = {s: max(1, round(f * n_docs)) for s, f in fractions.items()}
    rng = np.random.default_rng(seed)
    # choice without replacement draws only the k indices it needs when k << n_docs
    picked = rng.choice(n_docs, size=min(sum(sizes.values()), n_docs), replace=False)
    out, at = {}, 0
    for split in SPLITS:
        if split in sizes:
            out[split] = np.sort(picked[at:at + sizes[split]])
            at += sizes[split]
    return out


def routed_documents(plan: Plan, opts: ReadOptions, splits: Sequence[str] | None = None
                     ) -> Iterator[tuple[str, str, pa.Array]]:
    """Yield (split, label, documents) batches of this shard, in input order; only `splits` if given."""
    wanted = set(plan.splits if splits is None else splits)
    sharded = plan.shard[1] > 1
    for group in plan.groups:
        targets = {group.split, *group.holdout} & wanted
        if not targets:
            continue
        ranges = {s: plan.doc_range(s) for s in targets} if sharded else {}
        seen = dict.fromkeys(targets, 0)  # documents of each split passed so far
        sources, doc = group.sources, 0
        batches = None
        # one document per file: the shard's range is a slice of the files, the rest is never read
        files = ranges[group.split] if (sharded and not group.holdout and all(s.kind == TEXT for s in sources)
                                        and not opts.line_docs) else None
        if sharded and group.records is not None:
            start = _first_needed(group, ranges)
            if start is None:
                continue  # none of this group's documents is in this shard
            doc, batches = documents_from(sources, group.records, start, opts, files=files)
            seen = _passed(group, targets, doc)
        elif files is not None:
            lo, hi = files
            sources, doc = sources[lo:hi], lo
            seen[group.split] = lo
        for label, docs in batches if batches is not None else iter_documents(sources, opts):
            for split, part in _split_batch(group, docs, doc, targets):
                start = seen[split]
                seen[split] += len(part)
                lo, hi = ranges.get(split, (0, seen[split]))
                a, b = max(lo - start, 0), min(hi - start, len(part))
                if a < b:
                    yield split, label, part.slice(a, b - a) if (a, b) != (0, len(part)) else part
            doc += len(docs)
            if sharded and all(seen[s] >= ranges[s][1] or ranges[s][0] >= ranges[s][1] for s in targets):
                break  # this shard's documents are all read (an empty range needs none)
        if batches is not None:
            batches.close()  # its open file, now


def shard_bytes(plan: Plan) -> int:
    """About how many bytes of input this shard's documents take (its tokenize bar's total). Where the plan file
    gave the inputs' seek points a document index maps to a byte offset between them (exact per file for
    one-document text files); elsewhere each input's bytes are spread evenly over its documents. A held-out
    split's documents, scattered over their group, count at the group's mean document size."""
    total = 0.0
    for group in plan.groups:
        held = _all_held(group)
        n_group = plan.n_documents[group.split] + len(held)
        doc_index, byte_offset = _byte_map(group, n_group)  # [p], [p]: increasing
        for split in {group.split, *group.holdout}:
            lo, hi = plan.doc_range(split) if split in plan.n_documents else (0, 0)
            if lo >= hi or n_group == 0:
                continue
            if split != group.split:
                total += byte_offset[-1] * (hi - lo) / n_group
                continue
            # the group indices of the split's documents lo and hi: the held-out ones before them added
            kept_before = held - np.arange(len(held))
            g_lo = lo + int(np.searchsorted(kept_before, lo, side="right"))
            g_hi = hi + int(np.searchsorted(kept_before, hi, side="right"))
            span = np.interp([g_lo, g_hi], doc_index, byte_offset)
            total += (span[1] - span[0]) * (hi - lo) / max(g_hi - g_lo, 1)
    return round(total)


def _byte_map(group: InputGroup, n_group: int) -> tuple[np.ndarray, np.ndarray]:
    """(document index, byte offset) points [p] of the group's inputs end to end, from (0, 0) to (n_group
    documents, its bytes): each input's ends and seek points when the plan file recorded them, else a line."""
    if group.records is None:
        n_bytes = sum(_size(path) for source in group.sources for path in source_files(source))
        return np.array([0.0, n_group]), np.array([0.0, n_bytes])
    points = [(0, 0)]
    for record in group.records:
        doc0, byte0 = points[-1]
        if record.seek == BYTES:
            points += [(doc0 + d, byte0 + offset) for d, offset in record.points[1:]]
        # a one-document text file also records its text's bytes, which is what the tokenize bar counts
        points.append((doc0 + record.documents, byte0 + sum(f.get("text_bytes", f["bytes"]) for f in record.files)))
    return np.array([d for d, _ in points], dtype=np.float64), np.array([b for _, b in points], dtype=np.float64)


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # the reader names the file


def _first_needed(group: InputGroup, ranges: dict[str, tuple[int, int]]) -> int | None:
    """The group's index of the first document the shard needs (None: none): the first of each split's range,
    a held-out split's found in its index list, the group's own split's among the documents not held out."""
    held = _all_held(group)
    firsts = []
    for split, (lo, hi) in ranges.items():
        if lo >= hi:
            continue
        if split == group.split:
            # the lo-th document not held out: lo plus the held-out ones before it (held[j] - j kept ones precede
            # held document j)
            firsts.append(lo + int(np.searchsorted(held - np.arange(len(held)), lo, side="right")))
        else:
            firsts.append(int(group.holdout[split][lo]))
    return min(firsts) if firsts else None


def _passed(group: InputGroup, targets: set[str], doc: int) -> dict[str, int]:
    """Documents of each split among the group's first `doc`."""
    held = _all_held(group)
    return {s: doc - int(np.searchsorted(held, doc)) if s == group.split
            else int(np.searchsorted(group.holdout[s], doc)) for s in targets}


def _all_held(group: InputGroup) -> np.ndarray:
    if not group.holdout:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(list(group.holdout.values())))


def _split_batch(group: InputGroup, docs: pa.Array, first: int, targets: set[str]
                 ) -> Iterator[tuple[str, pa.Array]]:
    if not group.holdout:
        yield group.split, docs
        return
    idx = np.arange(first, first + len(docs))
    where = np.zeros(len(docs), dtype=np.int8)  # 0: the group's split, k: k-th held-out split
    names = [group.split, *group.holdout]
    for k, held in enumerate(group.holdout.values(), start=1):
        pos = np.searchsorted(held, idx).clip(max=max(len(held) - 1, 0))
        where[(held[pos] == idx) if len(held) else np.zeros(len(idx), bool)] = k
    for k, name in enumerate(names):
        if name in targets:
            mask = where == k
            if mask.any():
                yield name, docs if mask.all() else docs.filter(pa.array(mask))
