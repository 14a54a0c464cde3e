"""`verify` and `inspect`: what a prepared corpus holds, as readable text."""
from __future__ import annotations

import os
from pathlib import Path

from data_prep.layout import split_layouts
from data_prep.errors import PrepError
from data_prep.paths import read_corpus_manifest
from data_prep.progress import Heartbeat
from data_prep.space import size_text
from data_prep.tokenizer import load_processor, model_type_of, sp_model_proto
from txl_dist.data.format import (
    Manifest,
    rank_token_range,
    read_manifest,
    split_reader,
    stream_length,
    verify_corpus,
)
from txl_dist.data.mixture import source_tokens_at


VERIFY_QUIET_S = 5.0
"""verify says that it is at work only when it runs longer than this (a small corpus prints its report alone)."""


def verify_report(corpus_dir: str | os.PathLike, progress: bool = True) -> str:
    """Re-check every checksum, count and token id (format.verify_corpus); a summary when all is well.

    verify_corpus reports nothing until it is done, and it reads every token file twice (its sha256, then its
    tokens): minutes for a corpus of tens of GB. With `progress` an elapsed time ticks on stderr meanwhile,
    naming what is read, so that a long check is not taken for a hung one."""
    manifest = read_corpus_manifest(corpus_dir)  # a file, or an unreadable manifest: one line naming it
    ticking = Heartbeat(f"verify: checking {_token_files_text(Path(corpus_dir), manifest)}", enabled=progress,
                        delay=VERIFY_QUIET_S)
    ticking.start()
    try:
        stats = verify_corpus(corpus_dir, check_tokens=True)
    finally:
        ticking.stop()
    check_tokenizer_entry(corpus_dir)
    lines = [f"OK {corpus_dir}: digest {stats['digest']}, vocab {stats['vocab_size']}, dtype {stats['dtype']}"]
    manifest = read_manifest(corpus_dir)
    for name, s in stats["splits"].items():
        stored = (f"{s['n_files']} files" if manifest.splits[name].index is None else
                  f"an index into its sources (their tokens hash to {s['stream_sha256'][:16]}...)")
        lines.append(f"  {name}: {s['n_tokens']:,} tokens, {s['n_documents']:,} documents, {s['n_bytes']:,} bytes, "
                     f"{stored}, {s['n_eod']:,} eod, {s['n_distinct']:,} distinct ids")
    mixture = manifest.mixture
    if mixture is not None:
        lines.append("  mixture (checked against its documents file): " + "; ".join(
            f"{m.name} share {m.share:.4f} of weight {m.weight:.4f}, {m.epochs:.3f} epochs" for m in mixture.sources))
    return "\n".join(lines)


def written_summary(corpus_dir: str | os.PathLike, seconds: float) -> str:
    """What `prepare` and `finalize` say at the end: the corpus, how long it took and, per split, what the
    manifest records (a job of hours should not end on the folder's name alone)."""
    m = read_manifest(corpus_dir)
    tok = m.tokenizer
    lines = [f"wrote corpus {corpus_dir} in {duration_text(seconds)}: {tok.model_type} tokenizer of "
             f"{tok.vocab_size:,} pieces, {m.dtype}"]
    for name, split in m.splits.items():
        per_byte = f" ({split.n_tokens / split.n_bytes:.3f} tokens per byte)" if split.n_bytes else ""
        lines.append(f"  {name}: {split.n_tokens:,} tokens, {split.n_documents:,} documents, "
                     f"{split.n_bytes:,} bytes of text{per_byte}, {len(split.files)} files")
    return "\n".join(lines)


def duration_text(seconds: float) -> str:
    """e.g. 0.4 s, 42 s, 3 min 05 s, 2 h 07 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _token_files_text(corpus_dir: Path, manifest: Manifest) -> str:
    """What verify reads, e.g. "12 token files, 176.4 GiB" (files that cannot be looked up are verify's to
    report)."""
    paths = [corpus_dir / f.path for split in manifest.splits.values() for f in split.files]
    sizes = []
    for path in paths:
        try:
            sizes.append(path.stat().st_size)
        except OSError:
            pass
    text = f"{len(paths)} token files, {size_text(sum(sizes))}"
    if any(split.index is not None for split in manifest.splits.values()):
        text += ", and the sources of its index split"
    return text


def check_tokenizer_entry(corpus_dir: str | os.PathLike) -> None:
    """The manifest's tokenizer fields must describe its tokenizer file (a checksum only proves the file is the one
    the manifest names, not that the manifest's ids and size are that model's)."""
    tok = read_manifest(corpus_dir).tokenizer
    path = Path(corpus_dir) / tok.file
    sp = load_processor(path)
    proto = sp_model_proto(sp)
    found = {"vocab_size": sp.get_piece_size(), "unk_id": sp.unk_id(), "bos_id": sp.bos_id(), "pad_id": sp.pad_id(),
             "model_type": model_type_of(proto)}
    for name, value in found.items():
        recorded = getattr(tok, name)
        if recorded not in (None, "") and recorded != value:
            raise PrepError(f"{Path(corpus_dir) / 'manifest.json'}: tokenizer {name} is {recorded!r}, but {path} "
                            f"has {value!r}; the manifest does not describe its tokenizer")
    if not (0 <= tok.eod_id < sp.get_piece_size() and sp.is_control(tok.eod_id)):
        raise PrepError(f"{Path(corpus_dir) / 'manifest.json'}: tokenizer eod_id {tok.eod_id} is not a control piece "
                        f"of {path}; the manifest does not describe its tokenizer")


def inspect_report(corpus_dir: str | os.PathLike, *, world_size: int | None = None, n_streams: int | None = None,
                   eval_streams: int | None = None, samples: int = 2, sample_tokens: int = 40) -> str:
    """Statistics, the rank blocks of a layout and decoded samples, as text.

    The layout is each split's own hint unless world_size / n_streams / eval_streams are given: then the
    train split is cut into n_streams and the others into eval_streams (default: the world size) streams,
    as `prepare` would. Files are not checksummed here
    (run verify for that); only the files holding the samples are read.
    """
    for option, value in (("--world-size", world_size), ("--n-streams", n_streams), ("--eval-streams", eval_streams)):
        if value is not None and value < 1:  # 0 would silently mean "the manifest's" below
            raise PrepError(f"{option} must be >= 1, got {value}")
    for option, value in (("--samples", samples), ("--sample-tokens", sample_tokens)):
        if value < 0:
            raise PrepError(f"{option} must be >= 0, got {value}")
    corpus_dir = Path(corpus_dir)
    m = read_corpus_manifest(corpus_dir)
    tok = m.tokenizer
    sp = load_processor(corpus_dir / tok.file)
    lines = [f"corpus {corpus_dir} (format {m.format} v{m.version}, digest {m.digest()[:16]}...)",
             f"tokenizer {tok.file}: {tok.model_type}, vocab {tok.vocab_size}, dtype {m.dtype}, "
             f"eod {tok.eod_id} {sp.id_to_piece(tok.eod_id)!r}, unk {tok.unk_id}, sha256 {tok.sha256[:16]}...",
             f"made {m.provenance.get('created', '?')} by {m.provenance.get('tool', '?')}"]
    if m.mixture is not None:
        lines.append(f"mixture of {len(m.mixture.sources)} sources, seed {m.mixture.seed}:")
        for src in m.mixture.sources:
            lines.append(f"  {src.name}: weight {src.weight:.4f}, share {src.share:.4f}, {src.tokens:,} tokens in "
                         f"{src.documents:,} documents, {src.epochs:.3f} epochs of its {src.source_tokens:,}; any "
                         f"window of n tokens within {src.deviation_spread:,}/n of the weight "
                         f"({src.deviation_spread / 1e6:.2%} over 1M tokens); manifest {src.manifest_digest[:16]}...")
    layouts = {n: s.layout for n, s in m.splits.items()}
    if (world_size, n_streams, eval_streams) != (None, None, None):
        hint = m.splits["train"].layout if "train" in m.splits else next(iter(layouts.values()))
        layouts = split_layouts(m.splits, hint.world_size if world_size is None else world_size,
                                hint.n_streams if n_streams is None else n_streams, eval_streams)
    for name, s in m.splits.items():
        stored = (f"{len(s.files)} files cut for" if s.index is None else
                  f"an index into {', '.join(s.index.sources)} (no token files), made for")
        lines.append(f"split {name}: {s.n_tokens:,} tokens, {s.n_documents:,} documents, {s.n_bytes:,} bytes, "
                     f"{s.n_chars:,} chars; {s.n_tokens / max(s.n_documents, 1):,.1f} tokens/document, "
                     f"{s.n_bytes / max(s.n_tokens, 1):.2f} bytes/token; {stored} "
                     f"world size {s.layout.world_size}, {s.layout.n_streams} streams")
        layout = layouts[name]
        lines.extend(_blocks(m, corpus_dir, name, layout.world_size, layout.n_streams, sp, samples, sample_tokens))
    return "\n".join(lines)


def _blocks(m: Manifest, corpus_dir: Path, name: str, w: int, n_streams: int, sp, samples: int,
            sample_tokens: int) -> list[str]:
    s = m.splits[name]
    length = stream_length(s.n_tokens, n_streams)
    out = [f"  rank blocks for world size {w}, {n_streams} streams of {length:,} tokens "
           f"({s.n_tokens - n_streams * length:,} tokens past S*L unused):"]
    bounds = [rank_token_range(s.n_tokens, n_streams, w, r) for r in range(w)]
    shares = None
    if m.mixture is not None and name == "train":  # each rank block's tokens per source, one streaming pass
        before = source_tokens_at(corpus_dir, m, [p for b in bounds for p in b])  # [2w, K]
        shares = before[1::2] - before[0::2]  # [w, K]
    with split_reader(corpus_dir, m, name, verify=False) as reader:
        for r, (start, stop) in enumerate(bounds):
            # an index split has no files of its own: its rank blocks read the sources' (verify names them)
            files = [s.files[i].path for i in reader.file_indices(start, stop)] if s.index is None else [
                m.mixture.documents_file]
            first = r * n_streams // w
            out.append(f"    rank {r}: tokens [{start:,}, {stop:,}), streams [{first}, {first + n_streams // w}), "
                       f"files {', '.join(files) or '-'}")
            if shares is not None and stop > start:
                out.append("      mixture: " + ", ".join(f"{src.name} {shares[r, i] / (stop - start):.4f}"
                                                         for i, src in enumerate(m.mixture.sources)))
            if r < samples and stop > start:
                ids = reader.read(start, min(stop, start + sample_tokens)).tolist()
                out.append(f"      sample: {_decode(sp, ids, m.tokenizer.eod_id)!r}")
    return out


def _decode(sp, ids: list[int], eod_id: int) -> str:
    """Decoded text with every eod shown as <eod> (SentencePiece decodes control pieces to nothing)."""
    pieces, cur = [], []
    for i in ids:
        if i == eod_id:
            pieces.append(sp.decode(cur) + "<eod>")
            cur = []
        else:
            cur.append(i)
    pieces.append(sp.decode(cur))
    return "".join(pieces)
