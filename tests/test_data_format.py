"""The corpus format (txl_dist.data.format): manifest round trip, rank arithmetic, Arrow files, refusals.

Corpora come from corpus_helpers.make_corpus: a synthetic token stream through the format's own writer.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from txl_dist.data.format import (
    FORMAT_NAME,
    ArrowTokenWriter,
    CorpusError,
    FileEntry,
    Layout,
    Manifest,
    TokenReader,
    file_boundaries,
    rank_token_range,
    read_manifest,
    sha256_file,
    stream_length,
    token_dtype,
    verify_corpus,
    write_manifest,
)

from corpus_helpers import (EOD, edit_manifest, flip_bytes, make_corpus, peak_rss_since_reset, synthetic_stream,
                            tokens_sha256)


# ----------------------------------------------------------------------------------------------------
# Manifest


def test_manifest_round_trip_and_digest(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003), "valid": synthetic_stream(300, seed=1)})
    m = read_manifest(root)
    raw = json.loads((root / "manifest.json").read_text())
    assert list(raw)[:2] == ["format", "version"] and raw["format"] == FORMAT_NAME
    assert Manifest.from_dict(m.to_dict()) == m
    assert m.splits["train"].files[0] == FileEntry(**raw["splits"]["train"]["files"][0])
    assert m.dtype == "uint16" and m.splits["valid"].n_tokens == 300
    # The digest identifies the tokens: provenance and the files do not count, the tokens' hash does.
    other = Manifest.from_dict({**m.to_dict(), "provenance": {"created": "later"}})
    assert other.digest() == m.digest()
    d = m.to_dict()
    d["splits"]["train"]["files"][1]["sha256"] = "0" * 64
    assert Manifest.from_dict(d).digest() == m.digest()
    d["splits"]["train"]["tokens_sha256"] = "0" * 64
    assert Manifest.from_dict(d).digest() != m.digest()
    assert m.splits["train"].tokens_sha256 == tokens_sha256(synthetic_stream(1003), "uint16")
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_digest_identifies_the_tokens_not_their_files(tmp_path):
    # relayout re-cuts the files for another world size: checkpoints must still resume on the result.
    tokens = synthetic_stream(1003)
    splits = {"train": tokens, "valid": synthetic_stream(300, seed=1)}
    a = read_manifest(make_corpus(tmp_path / "a", splits, layout=Layout(2, 8)))
    b = read_manifest(make_corpus(tmp_path / "b", splits, layout=Layout(4, 16), batch_tokens=37))
    assert [f.n_tokens for f in a.splits["train"].files] != [f.n_tokens for f in b.splits["train"].files]
    assert a.digest() == b.digest()
    changed = tokens.copy()
    changed[500] = changed[500] % 999 + 4  # another id in [4, vocab), same counts
    c = read_manifest(make_corpus(tmp_path / "c", {**splits, "train": changed}, layout=Layout(2, 8)))
    assert c.digest() != a.digest()
    assert c.splits["train"].n_tokens == a.splits["train"].n_tokens


def test_token_dtype_and_int32_files(tmp_path):
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "int32"
    tokens = synthetic_stream(500, vocab_size=70000)
    assert tokens.max() > 65535
    root = make_corpus(tmp_path / "c", {"train": tokens}, vocab_size=70000)
    m = read_manifest(root)
    assert m.dtype == "int32"
    assert m.splits["train"].tokens_sha256 == hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()
    verify_corpus(root)  # the reader's hash of int32 files agrees
    with TokenReader(root, m, "train") as r:
        np.testing.assert_array_equal(r.read(0, 500), tokens)
    with pytest.raises(CorpusError, match="dtype 'uint16' does not match vocab_size 70000"):
        Manifest.from_dict({**m.to_dict(), "dtype": "uint16"})


def test_a_vocabulary_of_exactly_2_to_the_16_pieces_is_stored_as_uint16_and_older_int32_corpora_read(tmp_path):
    # ids 0..65535 fit uint16: such corpora took int32 (twice the disk and page cache) until 2026-12.
    tokens = synthetic_stream(500, vocab_size=65536)
    tokens[7] = 65535
    root = make_corpus(tmp_path / "c", {"train": tokens}, vocab_size=65536)
    m = read_manifest(root)
    assert m.dtype == "uint16"
    verify_corpus(root)
    with TokenReader(root, m, "train") as r:
        np.testing.assert_array_equal(r.read(0, 500), tokens)
    assert Manifest.from_dict({**m.to_dict(), "dtype": "int32"}).dtype == "int32"  # written by the old rule
    with pytest.raises(CorpusError, match="dtype 'int32' does not match vocab_size 65535"):
        Manifest.from_dict({**m.to_dict(), "dtype": "int32", "tokenizer": {**m.to_dict()["tokenizer"],
                                                                           "vocab_size": 65535}})


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=2), "version 2 is not supported"),
    (lambda d: d.update(format="other"), "not 'txl-dist-corpus'"),
    (lambda d: d.update(extra=1), "unknown key 'extra'"),
    (lambda d: d["splits"]["train"].pop("n_chars"), "'splits.train.n_chars' is missing"),
    (lambda d: d["splits"]["train"].update(n_tokens=5), "the files hold 1003 tokens but n_tokens is 5"),
    (lambda d: d["splits"]["train"]["files"][1].update(first_token=7), "starts at token 7, expected 500"),
    (lambda d: d["splits"]["train"]["layout"].update(world_size=3), "layout.n_streams: 8 streams cannot be split over 3 ranks .its layout.world_size."),
    (lambda d: d["tokenizer"].update(eod_id=1000), "eod_id 1000 is not below vocab_size 1000"),
    (lambda d: d["tokenizer"].update(sha256="xyz"), "tokenizer.sha256 must be a lowercase hex sha256"),
    (lambda d: d["splits"]["train"].pop("tokens_sha256"), "'splits.train.tokens_sha256' is missing"),
    (lambda d: d["splits"]["train"].update(tokens_sha256="A" * 64),
     "splits.train.tokens_sha256 must be a lowercase hex sha256"),
])
def test_manifest_schema_errors_name_the_file(tmp_path, edit, message):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    edit_manifest(root, edit)
    with pytest.raises(CorpusError, match=message) as e:
        read_manifest(root)
    assert str(root / "manifest.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["../x.arrow", "train/../../x.arrow", "/tmp/x.arrow", "C:\\x.arrow"])
def test_path_outside_the_folder_is_refused(tmp_path, bad):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    edit_manifest(root, lambda d: d["splits"]["train"]["files"][0].update(path=bad))
    with pytest.raises(CorpusError, match="manifest.json") as e:
        read_manifest(root)
    assert bad in str(e.value)


def test_symlink_out_of_the_folder_is_refused(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    outside = tmp_path / "elsewhere"
    (root / "train").rename(outside)
    (root / "train").symlink_to(outside)
    with pytest.raises(CorpusError, match="resolves outside the corpus folder"):
        read_manifest(root)


def test_missing_or_broken_manifest(tmp_path):
    with pytest.raises(CorpusError, match="corpus folder does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "c").mkdir()
    with pytest.raises(CorpusError, match="manifest.json is missing"):
        read_manifest(tmp_path / "c")
    (tmp_path / "c" / "manifest.json").write_text("{\n  \"format\": ")
    with pytest.raises(CorpusError, match="invalid JSON at line 2"):
        read_manifest(tmp_path / "c")


def test_write_manifest_refuses_invalid_and_leaves_old_file(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    before = (root / "manifest.json").read_bytes()
    m = read_manifest(root)
    m.splits["train"].files[0].path = "../escape.arrow"
    with pytest.raises(CorpusError, match="points outside the corpus folder"):
        write_manifest(root, m)
    assert (root / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in root.iterdir()) == ["manifest.json", "tokenizer.model", "train"]


# ----------------------------------------------------------------------------------------------------
# Rank arithmetic, checked against a token-by-token assignment


@pytest.mark.parametrize("n_tokens, n_streams, world_size", [(1003, 8, 2), (1000, 8, 4), (77, 4, 1), (64, 8, 8)])
def test_rank_ranges_and_file_boundaries_match_token_assignment(n_tokens, n_streams, world_size):
    L = stream_length(n_tokens, n_streams)
    assert L == n_tokens // n_streams
    # Assign each token to (stream, rank) one at a time; tokens past S*L belong to nobody.
    owner = np.full(n_tokens, -1)
    for t in range(n_streams * L):
        owner[t] = (t // L) // (n_streams // world_size)
    for r in range(world_size):
        idx = np.flatnonzero(owner == r)
        assert rank_token_range(n_tokens, n_streams, world_size, r) == (idx[0], idx[-1] + 1)
    # File cuts: where the owner changes, plus the end; the untrained tail is a file of its own.
    expected = [0] + [t for t in range(1, n_tokens) if owner[t] != owner[t - 1]] + [n_tokens]
    assert file_boundaries(n_tokens, Layout(world_size, n_streams)) == expected


def test_a_rank_block_over_the_file_cap_is_cut_into_near_equal_files(monkeypatch):
    from txl_dist.data import manifest

    monkeypatch.setattr(manifest, "MAX_FILE_TOKENS", 200)
    # 1003 tokens, 8 streams of 125 on 2 ranks: blocks [0, 500), [500, 1000), the untrained tail [1000, 1003).
    assert file_boundaries(1003, Layout(2, 8)) == [0, 166, 333, 500, 666, 833, 1000, 1003]
    assert file_boundaries(1000, Layout(1, 4)) == [0, 200, 400, 600, 800, 1000]
    assert file_boundaries(1000, Layout(4, 4)) == [0, 125, 250, 375, 500, 625, 750, 875, 1000]


def test_rank_range_errors():
    with pytest.raises(ValueError, match="8 streams cannot be split over 3 ranks"):
        rank_token_range(100, 8, 3, 0)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        rank_token_range(100, 8, 2, 2)
    assert file_boundaries(5, Layout(2, 8)) == [0, 5]  # L = 0: one file with everything


# ----------------------------------------------------------------------------------------------------
# Arrow files: writer and reader


def test_reader_reads_any_range_across_files_and_batches(tmp_path):
    tokens = synthetic_stream(1003)
    root = make_corpus(tmp_path / "c", {"train": tokens}, batch_tokens=64)
    m = read_manifest(root)
    rng = np.random.default_rng(1)
    with TokenReader(root, m, "train") as r:
        for _ in range(50):
            a, b = sorted(rng.integers(0, 1004, size=2))
            x = r.read(a, b)
            assert x.dtype == np.uint16
            np.testing.assert_array_equal(x, tokens[a:b])
        np.testing.assert_array_equal(r.read(0, 1003), tokens)
        # chunks(): one view per record batch touched (64-token batches restart at each file cut).
        pieces = list(r.chunks(60, 1003))
        assert [len(p) for p in pieces] == [4] + [64] * 6 + [52] + [64] * 7 + [52, 3]
        np.testing.assert_array_equal(np.concatenate(pieces), tokens[60:])
        # Inside one record batch a read is a view of the mapped file: two reads share memory.
        assert np.shares_memory(r.read(130, 150), r.read(140, 160))
        with pytest.raises(IndexError, match=r"\[1000, 1004\) is outside \[0, 1003\)"):
            r.read(1000, 1004)


def test_gather_copies_short_and_long_ranges_anywhere(tmp_path):
    # Ranges short (vectorized) and long (a slice copy each: SLICE_COPY_TOKENS), inside one record batch,
    # across batches and across files, in random order, to a given out/out_at or a new array.
    from txl_dist.data.arrow_io import SLICE_COPY_TOKENS

    tokens = synthetic_stream(5003)
    root = make_corpus(tmp_path / "c", {"train": tokens}, batch_tokens=700)
    rng = np.random.default_rng(2)
    lengths = np.concatenate([rng.integers(1, 20, 300), rng.integers(SLICE_COPY_TOKENS, 3 * SLICE_COPY_TOKENS, 30)])
    starts = np.array([rng.integers(0, 5003 - n + 1) for n in lengths])
    order = rng.permutation(len(lengths))
    starts, stops = starts[order], (starts + lengths)[order]
    expected = np.concatenate([tokens[a:b] for a, b in zip(starts, stops)])
    with TokenReader(root, read_manifest(root), "train") as r:
        np.testing.assert_array_equal(r.gather(starts, stops), expected)
        out = np.zeros(len(expected) + 5, dtype=np.uint16)
        at = np.cumsum(stops - starts) - (stops - starts) + 5  # [n]: after a 5-token gap
        r.gather(starts, stops, out=out, out_at=at)
        np.testing.assert_array_equal(out[5:], expected)
        assert not out[:5].any()


def test_reader_opens_only_touched_files(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)}, layout=Layout(4, 8))
    m = read_manifest(root)
    assert [f.first_token for f in m.splits["train"].files] == [0, 250, 500, 750, 1000]
    r = TokenReader(root, m, "train")
    assert r.files_opened == []
    r.read(260, 490)
    assert r.files_opened == ["train/00001.arrow"]
    r.read(490, 510)
    assert r.files_opened == ["train/00001.arrow", "train/00002.arrow"]
    r.read(200, 260)
    assert r.files_opened == ["train/00001.arrow", "train/00002.arrow", "train/00000.arrow"]
    assert r.open_range(999, 1003) == ["train/00003.arrow", "train/00004.arrow"]
    r.close()


def test_writer_checks_values_and_cleans_up_on_error(tmp_path):
    path = tmp_path / "x.arrow"
    with pytest.raises(ValueError, match="token ids 0..70000 do not fit uint16"):
        with ArrowTokenWriter(path, "uint16") as w:
            w.write(np.array([1, 2], dtype=np.int64))
            w.write(np.array([0, 70000], dtype=np.int64))
    assert list(tmp_path.iterdir()) == []
    with ArrowTokenWriter(path, "int32") as w:
        w.write(np.array([5, 70000], dtype=np.int64))
        assert (tmp_path / "x.arrow.tmp").exists() and not path.exists()
    assert w.close() == (2, sha256_file(path))
    with pytest.raises(ValueError, match="token dtype must be one of uint16, int32"):
        ArrowTokenWriter(tmp_path / "y.arrow", "int64")


# ----------------------------------------------------------------------------------------------------
# verify_corpus and refusals that name the file


def test_verify_corpus_stats(tmp_path):
    tokens = synthetic_stream(1003)
    root = make_corpus(tmp_path / "c", {"train": tokens, "test": synthetic_stream(200, seed=2)})
    stats = verify_corpus(root)
    assert stats["digest"] == read_manifest(root).digest()
    assert stats["splits"]["train"]["n_eod"] == int(np.sum(tokens == EOD))
    assert stats["splits"]["train"]["n_distinct"] == len(np.unique(tokens))
    assert stats["splits"]["test"]["n_files"] == 2


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets the peak RSS through /proc")
def test_verify_does_not_keep_the_split_it_read_resident(tmp_path):
    # The files are memory-mapped and stayed open until the split was done: verifying a 100 GB train split
    # took its resident set to 100 GB (page cache, but counted by anything that limits or watches RSS).
    tokens = np.random.default_rng(0).integers(0, 1000, 32 << 20, dtype=np.uint16)  # 64 MiB
    tokens[-1] = EOD
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=Layout(1, 1), batch_tokens=1 << 20)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    before = peak_rss_since_reset()
    verify_corpus(root)
    grew = peak_rss_since_reset() - before
    assert grew < 32 << 20, f"verify's peak RSS grew by {grew / 2**20:.0f} MiB reading 64 MiB of tokens"


def test_corrupt_file_is_refused(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    bad = root / "train" / "00001.arrow"
    flip_bytes(bad)
    with pytest.raises(CorpusError, match="differs from the manifest") as e:
        verify_corpus(root)
    assert str(bad) in str(e.value)
    r = TokenReader(root, read_manifest(root), "train")
    r.read(0, 10)  # the intact file still reads
    with pytest.raises(CorpusError, match=str(bad)):
        r.read(600, 610)


def test_truncated_file_is_refused_even_without_checksums(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    bad = root / "train" / "00000.arrow"
    os.truncate(bad, bad.stat().st_size - 20)
    with pytest.raises(CorpusError, match="00000.arrow: sha256"):
        verify_corpus(root)
    with pytest.raises(CorpusError, match="00000.arrow: not a readable Arrow IPC file"):
        TokenReader(root, read_manifest(root), "train", verify=False).read(0, 10)


def test_missing_file_and_wrong_count_are_refused(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    (root / "train" / "00002.arrow").unlink()
    with pytest.raises(CorpusError, match="00002.arrow: corpus file is missing"):
        verify_corpus(root)
    # A file swapped for another valid one (checksum updated too): the token count gives it away.
    root = make_corpus(tmp_path / "d", {"train": synthetic_stream(1003)})
    os.replace(root / "train" / "00002.arrow", root / "train" / "00001.arrow")

    def swap(d):
        d["splits"]["train"]["files"][1]["sha256"] = sha256_file(root / "train" / "00001.arrow")
    edit_manifest(root, swap)
    with pytest.raises(CorpusError, match="00001.arrow: holds 3 tokens, the manifest says 500"):
        verify_corpus(root)


def test_tokenizer_mismatch_is_refused(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003)})
    (root / "tokenizer.model").write_bytes(b"another tokenizer")
    with pytest.raises(CorpusError, match="tokenizer.model: sha256 .* not the tokenizer the corpus was made with"):
        verify_corpus(root)


def test_wrong_tokens_sha256_is_refused_naming_the_split(tmp_path):
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003), "valid": synthetic_stream(300, seed=1)})
    edit_manifest(root, lambda d: d["splits"]["valid"].update(tokens_sha256="0" * 64))
    with pytest.raises(CorpusError, match="split 'valid': its tokens hash to .* but tokens_sha256 is 000000") as e:
        verify_corpus(root)
    assert str(root / "manifest.json") in str(e.value) and "\n" not in str(e.value)
    assert verify_corpus(root, check_tokens=False)["splits"]["valid"]["n_tokens"] == 300  # the hash needs a scan


def test_a_split_must_end_with_eod(tmp_path):
    tokens = synthetic_stream(1003)
    tokens[-1] = 5  # the last document lost its end-of-document id
    root = make_corpus(tmp_path / "c", {"train": tokens})
    with pytest.raises(CorpusError, match="00002.arrow: split 'train' has .* ends with 5: every document must end"):
        verify_corpus(root)


def test_a_split_of_tokens_without_any_document_is_refused(tmp_path):
    # n_documents 0 skipped the end check: a stream with no end-of-document id at all (its manifest counting no
    # document, or one edited to 0) passed verify.
    tokens = np.random.default_rng(0).integers(4, 1000, 500)  # no EOD anywhere
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(1003), "valid": tokens})
    with pytest.raises(CorpusError, match="manifest.json: split 'valid' holds 500 tokens but n_documents is 0"):
        verify_corpus(root)


def test_out_of_range_token_ids_are_refused(tmp_path):
    tokens = synthetic_stream(1003)
    tokens[700] = 1000  # == vocab_size
    root = make_corpus(tmp_path / "c", {"train": tokens})
    with pytest.raises(CorpusError, match="00001.arrow: token id 1000 is outside"):
        verify_corpus(root)
    assert verify_corpus(root, check_tokens=False)["splits"]["train"]["n_tokens"] == 1003
