"""`relayout`: re-cut a corpus' files for another (world size, streams) without re-tokenizing."""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from data_prep.atomic import atomic_dir
from data_prep.errors import PrepError
from data_prep.layout import SplitWriter, check_fits, iter_token_file, split_layouts
from data_prep.prepare import provenance
from data_prep.space import check_free_space, files_bytes, size_text
from data_prep.paths import cannot_read, read_corpus_manifest
from txl_dist.data.format import Manifest, sha256_file, write_manifest


def relayout(corpus_dir: str | os.PathLike, *, world_size: int, n_streams: int, eval_streams: int | None = None,
             command: Sequence[str] | None = None, args: dict[str, Any] | None = None,
             progress: bool = True, space_check: bool = True) -> Manifest:
    """Rewrite the corpus in place with files cut for the new layout; the token streams stay identical.

    An index split (`mix --index`) keeps its index and gets the new layout hint only; its source folders are
    named relative to the corpus folder, which stays where it is.

    The new corpus is built beside the old one and swapped in at the end; every old file's sha256 is checked
    as it is copied, so a damaged corpus is refused rather than re-blessed with fresh checksums. The copy's
    tokens_sha256 (hashed while writing) must equal the manifest's: digest() then stays the same, so
    checkpoints made on the old layout resume on the new one. With `space_check` a job refused up front when
    the disk cannot hold the new files (_check_relayout_space).
    """
    corpus_dir = Path(corpus_dir)
    manifest = read_corpus_manifest(corpus_dir)
    tok = manifest.tokenizer
    tok_path = corpus_dir / tok.file
    try:
        tok_sha256 = sha256_file(tok_path) if tok_path.is_file() else None
    except OSError as e:
        raise cannot_read(tok_path, e) from None
    if tok_sha256 != tok.sha256:
        raise PrepError(f"{tok_path}: missing or its sha256 differs from the manifest; not the corpus' tokenizer")
    layouts = split_layouts(manifest.splits, world_size, n_streams, eval_streams)
    for name, split in manifest.splits.items():
        check_fits(name, split.n_tokens, layouts[name], str(corpus_dir))
    if space_check:
        _check_relayout_space(corpus_dir, manifest)
    splits = {}
    with atomic_dir(corpus_dir, overwrite=True) as tmp:
        (tmp / tok.file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tok_path, tmp / tok.file)
        for name, split in manifest.splits.items():
            if split.index is not None:
                # An index split has no files to cut: its rank blocks read the sources wherever their
                # documents lie, so only the layout hint changes (and the documents file is kept below).
                splits[name] = dataclasses.replace(split, layout=layouts[name])
                continue
            writer = SplitWriter(tmp, name, split.n_tokens, layouts[name], manifest.dtype, tok.vocab_size)
            with tqdm(total=split.n_tokens, unit=" tok", unit_scale=True, desc=f"relayout {name}",
                      disable=not progress, file=sys.stderr) as bar:
                for entry in split.files:
                    for chunk in iter_token_file(corpus_dir / entry.path, entry.sha256):
                        writer.write(chunk, str(corpus_dir / entry.path))
                        bar.update(len(chunk))
                files, tokens_sha256 = writer.close()
            if tokens_sha256 != split.tokens_sha256:
                raise PrepError(f"{corpus_dir / 'manifest.json'}: split {name}: the copied tokens hash to "
                                f"{tokens_sha256[:12]}... but the manifest's tokens_sha256 is "
                                f"{split.tokens_sha256[:12]}...: the manifest does not describe these tokens; "
                                "re-run prepare")
            splits[name] = dataclasses.replace(split, layout=layouts[name], files=files)
        prov = dict(manifest.provenance)
        prov["relayout"] = [*prov.get("relayout", []), provenance(command, args)]
        if manifest.mixture is not None:  # the documents file indexes the stream, not its files: kept as is
            docs = corpus_dir / manifest.mixture.documents_file
            if not docs.is_file() or sha256_file(docs) != manifest.mixture.documents_sha256:
                raise PrepError(f"{docs}: missing or its sha256 differs from the manifest; re-run mix")
            (tmp / manifest.mixture.documents_file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(docs, tmp / manifest.mixture.documents_file)
        new = Manifest(tokenizer=tok, dtype=manifest.dtype, splits=splits, provenance=prov, mixture=manifest.mixture)
        write_manifest(tmp, new)
    return new


def _check_relayout_space(corpus_dir: Path, manifest: Manifest) -> None:
    """The new corpus takes what the old one's re-cut files take now (the same tokens; only the Arrow framing
    of the new cut differs, a few hundred bytes a file) plus the tokenizer and documents file it copies. The
    old files stay until the new corpus is swapped in, so all of it is needed on top of what the disk holds
    now; an index split has no files to cut and takes nothing."""
    recut = files_bytes(corpus_dir / f.path for split in manifest.splits.values() for f in split.files)
    copies = {"tokenizer": corpus_dir / manifest.tokenizer.file}
    if manifest.mixture is not None:
        copies["documents file"] = corpus_dir / manifest.mixture.documents_file
    copied = files_bytes(copies.values())
    check_free_space([(corpus_dir.parent, recut, f"the re-cut splits, as large as their files now: {size_text(recut)}"),
                      (corpus_dir.parent, copied, f"the {' and '.join(copies)} copied: {size_text(copied)}")],
                     "relayout", "move the corpus to another file system first")
