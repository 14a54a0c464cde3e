"""A synthetic corpus folder for benchmark training runs, written through the corpus format's own writer.

Zipf-distributed ids (as in real text: most tokens fall in the adaptive softmax head), documents of ~200
tokens, every split ending with the end-of-document id. No tokenizer is needed: the format treats
tokenizer.model as bytes (only its sha256 is checked), so the loader and the trainer read such a corpus;
`python -m data_prep verify` and `inspect` load the tokenizer and refuse it (not a SentencePiece model).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from txl_dist.data.format import (
    ArrowTokenWriter,
    FileEntry,
    Layout,
    Manifest,
    SplitEntry,
    TokenizerEntry,
    file_boundaries,
    sha256_file,
    token_dtype,
    write_manifest,
)

EOD = 3


def zipf_tokens(n_tokens: int, vocab_size: int, seed: int, mean_doc: int = 200) -> np.ndarray:
    """Ids in [4, vocab) with p ~ 1/rank, cut into documents by EOD; the stream ends with EOD."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab_size - 3, dtype=np.float64)
    p = 1.0 / ranks
    tokens = 4 + rng.choice(len(ranks), size=n_tokens, p=p / p.sum())
    tokens[rng.random(n_tokens) < 1 / mean_doc] = EOD
    tokens[-1] = EOD
    return tokens.astype(np.int64)


def write_corpus(root: Path, n_tokens: dict[str, int], vocab_size: int, layout: Layout, seed: int = 0,
                 mean_doc: int = 200) -> Path:
    """Write a corpus folder with the given token count per split (documents of ~mean_doc tokens); returns it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.model").write_bytes(b"synthetic benchmark corpus, vocab " + str(vocab_size).encode())
    dtype = token_dtype(vocab_size)
    entries = {}
    for k, (name, count) in enumerate(n_tokens.items()):
        tokens = zipf_tokens(count, vocab_size, seed + k, mean_doc)
        (root / name).mkdir(exist_ok=True)
        cuts = file_boundaries(len(tokens), layout)
        files = []
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            rel = f"{name}/{i:05d}.arrow"
            with ArrowTokenWriter(root / rel, dtype) as writer:
                writer.write(tokens[a:b])
            n, sha = writer.close()
            files.append(FileEntry(path=rel, first_token=a, n_tokens=n, sha256=sha))
        digest = hashlib.sha256(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).hexdigest()
        entries[name] = SplitEntry(n_tokens=len(tokens), n_documents=int(np.sum(tokens == EOD)),
                                   n_bytes=5 * len(tokens), n_chars=4 * len(tokens), tokens_sha256=digest,
                                   layout=layout, files=files)
    tok = TokenizerEntry(file="tokenizer.model", sha256=sha256_file(root / "tokenizer.model"),
                         vocab_size=vocab_size, model_type="unigram", eod_id=EOD, unk_id=0, bos_id=-1, pad_id=-1)
    write_manifest(root, Manifest(tokenizer=tok, dtype=dtype, splits=entries,
                                  provenance={"created": "synthetic", "tool": "bench/synthetic_corpus.py"}))
    return root
