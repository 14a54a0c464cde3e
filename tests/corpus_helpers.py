"""Corpus folders for tests: a synthetic token stream written through the format's own public writer.

The tokenizer is a SentencePiece model built directly (no training): `vocab_size` pieces, <unk> at 0 and the
end-of-document control piece at EOD, what `verify` checks the manifest's tokenizer fields against.
"""
from __future__ import annotations

import hashlib
import json
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


def synthetic_stream(n_tokens: int, vocab_size: int = 1000, seed: int = 0, mean_doc: int = 40) -> np.ndarray:
    """Random ids in [4, vocab) cut into documents, each ending with EOD (the stream ends with one)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, vocab_size, size=n_tokens)
    tokens[rng.random(n_tokens) < 1 / mean_doc] = EOD
    tokens[-1] = EOD
    return tokens


def sentencepiece_model(vocab_size: int, eod_id: int = EOD) -> bytes:
    """A loadable unigram SentencePiece model of `vocab_size` pieces: <unk> at 0, the control piece <eod> at
    eod_id, the rest normal pieces."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    kind = pb.ModelProto.SentencePiece
    for i in range(vocab_size):
        piece = model.pieces.add()
        if i == 0:
            piece.piece, piece.type = "<unk>", kind.UNKNOWN
        elif i == eod_id:
            piece.piece, piece.type = "<eod>", kind.CONTROL
        else:
            piece.piece, piece.type, piece.score = f"\u2581p{i}", kind.NORMAL, -float(i)
    model.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    model.trainer_spec.vocab_size = vocab_size
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.pad_id = 0, -1, -1
    model.normalizer_spec.name = "identity"
    return model.SerializeToString()


def make_corpus(root: Path, splits: dict[str, np.ndarray], layout: Layout = Layout(2, 8), vocab_size: int = 1000,
                batch_tokens: int | None = None, bytes_per_token: int = 5, chars_per_token: int = 4) -> Path:
    """Write a corpus folder: files cut by file_boundaries(layout), record batches of batch_tokens.

    The manifest's byte and character counts are bytes_per_token / chars_per_token times the token count;
    tokens_sha256 is computed here from the tokens themselves (an oracle independent of the writers).
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.model").write_bytes(sentencepiece_model(vocab_size))
    dtype = token_dtype(vocab_size)
    entries = {}
    for name, tokens in splits.items():
        (root / name).mkdir(exist_ok=True)
        cuts = file_boundaries(len(tokens), layout)
        files = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            rel = f"{name}/{k:05d}.arrow"
            step = batch_tokens or (b - a)
            with ArrowTokenWriter(root / rel, dtype) as w:
                for s in range(a, b, step):
                    w.write(tokens[s:min(b, s + step)])
            n, sha = w.close()
            files.append(FileEntry(path=rel, first_token=a, n_tokens=n, sha256=sha))
        entries[name] = SplitEntry(n_tokens=len(tokens), n_documents=int(np.sum(tokens == EOD)),
                                   n_bytes=bytes_per_token * len(tokens),
                                   n_chars=chars_per_token * len(tokens), tokens_sha256=tokens_sha256(tokens, dtype),
                                   layout=layout, files=files)
    tok = TokenizerEntry(file="tokenizer.model", sha256=sha256_file(root / "tokenizer.model"), vocab_size=vocab_size,
                         model_type="unigram", eod_id=EOD, unk_id=0, bos_id=-1, pad_id=-1)
    write_manifest(root, Manifest(tokenizer=tok, dtype=dtype, splits=entries,
                                  provenance={"created": "2025-01-01T00:00:00Z", "tool": "test"}))
    return root


def tokens_sha256(tokens: np.ndarray, dtype: str) -> str:
    """The manifest's tokens_sha256 by its definition: sha256 of the whole stream as little-endian dtype bytes."""
    return hashlib.sha256(np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tobytes()).hexdigest()


def split_ids(corpus: Path, split: str) -> np.ndarray:
    """A split's token stream as int64, read straight from its Arrow files in manifest order."""
    import pyarrow as pa

    manifest = json.loads((Path(corpus) / "manifest.json").read_text())
    files = manifest["splits"][split]["files"]
    return np.concatenate([pa.ipc.open_file(pa.OSFile(str(Path(corpus) / f["path"]))).read_all().column(0).to_numpy()
                           for f in files]).astype(np.int64)


def edit_manifest(root: Path, edit) -> None:
    """Change manifest.json in place with `edit(dict)`, bypassing validation (to test the reader's checks)."""
    d = json.loads((root / "manifest.json").read_text())
    edit(d)
    (root / "manifest.json").write_text(json.dumps(d))


def flip_bytes(path: Path) -> None:
    """Corrupt a file in its middle, keeping its size."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def tricky_text(n_words: int, seed: int = 0) -> str:
    """Text that tests whitespace handling: many newlines, blank lines, runs of spaces, tabs, CRLF and lone CR,
    leading and trailing whitespace, non-ASCII words and characters that NFKC rewrites (ligatures, full-width
    forms, combining accents after a newline)."""
    import random

    rng = random.Random(seed)
    words = ["the", "of", "and", "to", "a", "Thou", "hast", "héllo", "naïve", "straße", "ﬁne", "Ａｂｃ", "①",
             "e\u0301t\u00e9", "日本語", "ΣΊΣΥΦΟΣ", "x\u2581y", "12,5", "don't", "—", "😀"]
    gaps = [" ", " ", " ", "  ", "\n", "\n", "\n\n", "\n \n", " \n", "\n ", "\t", " \t", "\r\n", "\r\n\r\n", "\r",
            "\u3000", "\u00a0", "\n\u0301", " \u0301", "\n\n\n\t "]
    parts = [rng.choice(["", " ", "\n", "  \n\t", "\r\n"])]
    for _ in range(n_words):
        made_up = "".join(rng.choices("etaoinshrdlucmfwyp", k=rng.randint(1, 8)))
        word = rng.choice(words) if rng.random() < 0.5 else made_up
        parts += [word, rng.choice(gaps)]
    return "".join(parts)


def small_bpe_tokenizer(folder: Path) -> Path:
    """A 400-piece BPE SentencePiece model trained on tricky_text, at folder/tok.model (seconds)."""
    from data_prep.tokenizer import TrainerOptions, train_tokenizer, training_sentences

    sentences = training_sentences([tricky_text(2000, seed) for seed in range(2)])
    return train_tokenizer(sentences, folder / "tok.model", TrainerOptions(vocab_size=400, model_type="bpe"))


def mapped_rss(folder) -> int:
    """Bytes of this process's resident set that are pages of files under `folder` (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and not head[0].endswith(":"):  # a mapping's header line: address range, perms, ..., path
                inside = len(head) >= 6 and head[5].startswith(str(folder))
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def peak_rss_since_reset() -> int:
    """VmHWM in bytes (reset to the current RSS by writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def open_as_an_unprivileged_user(corpus: Path, hidden: Path) -> str:
    """What opening `corpus`'s train split prints in a process that permission bits stop (as root: one without
    CAP_DAC_OVERRIDE, through setpriv), with `hidden` (a file or folder) made unreadable meanwhile: 'refused: '
    and the CorpusError, or nothing. Skips the test where root cannot drop the capability."""
    import os
    import subprocess
    import sys

    import pytest

    unprivileged = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
                    "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []  # root ignores permission bits
    if unprivileged and subprocess.run([*unprivileged, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root and setpriv cannot drop CAP_DAC_OVERRIDE here")
    code = ("import sys; from txl_dist.data import CorpusError, StreamLoader\n"
            "try:\n"
            "    StreamLoader(sys.argv[1], 'train', rank=0, world_size=1, n_streams=8, micro_batch=8, tgt_len=10)\n"
            "except CorpusError as e:\n"
            "    print('refused:', e)\n")
    mode = hidden.stat().st_mode
    hidden.chmod(0)
    try:
        done = subprocess.run([*unprivileged, sys.executable, "-c", code, str(corpus)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    finally:
        hidden.chmod(mode)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
