"""`mix --index`: a mixture whose train split is an index of document ranges into its sources.

The reference is the copied mixture of the same sources, weights and seed (`mix` without --index), read
with plain pyarrow: the index must give the same stream token for token through read() at random ranges,
through the loader for several layouts, and in training (bitwise, 2 ranks on gloo), and must refuse (one
line) sources that are missing, changed, moved away or truncated, and a corrupt index.

Sources are synthetic (tests/corpus_helpers.py): three corpora of very different document lengths, files
of many small record batches, so that windows cross documents, record batches and files of the sources.
"""
from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import data_prep.mix
from corpus_helpers import edit_manifest, make_corpus, mapped_rss, open_as_an_unprivileged_user, synthetic_stream
from data_prep.cli import main
from dist_helpers import run_ranks, tiny_config, train_jobs
from test_mix import split_tokens
from txl_dist.data.format import (
    CorpusError,
    IndexReader,
    Layout,
    TokenReader,
    index_tokens_sha256,
    read_manifest,
    split_reader,
    verify_corpus,
)
from txl_dist.data.loader import StreamLoader
from txl_dist.data.mixture import DOCUMENTS_FILE, DocumentsWriter, read_documents_table
from txl_dist.unigram import token_counts

# (train tokens, mean document length): short, long (across record batches and files) and medium documents
SOURCES = {"short": (6000, 5), "long": (24000, 300), "mid": (3000, 20)}
WEIGHTS = {"short": 2.0, "long": 5.0, "mid": 1.0}
TRAIN_TOKENS = 40_000


def run(*argv) -> int:
    return main([str(a) for a in argv])


def refused(capsys, *argv) -> str:
    """The one error line of a refused command (exit 2)."""
    assert run(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def make_sources(root: Path) -> dict[str, Path]:
    out = {}
    for i, (name, (n, mean_doc)) in enumerate(SOURCES.items()):
        out[name] = make_corpus(root / name, {"train": synthetic_stream(n, seed=i, mean_doc=mean_doc),
                                              "valid": synthetic_stream(2000, seed=10 + i),
                                              "test": synthetic_stream(1000, seed=20 + i)}, batch_tokens=700)
    return out


def mix_argv(sources: dict[str, Path], out: Path, *extra) -> list:
    return ["mix", "--out", out, *[a for n, w in WEIGHTS.items() for a in ("--source", f"{n}={sources[n]}:{w}")],
            "--train-tokens", TRAIN_TOKENS, "--seed", 5, "--world-size", 2, "--n-streams", 8, "--quiet", *extra]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """root/{short,long,mid} (sources), root/copy and root/index (their mixtures), the schedule in rounds of
    3,000 tokens so that the documents file has many record batches (the index looks documents up across
    them)."""
    root = tmp_path_factory.mktemp("mixindex")
    sources = make_sources(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data_prep.mix, "ROUND_TOKENS", 3000)
        assert run(*mix_argv(sources, root / "copy")) == 0
        assert run(*mix_argv(sources, root / "index", "--index")) == 0
    return root


def copy_of_tree(tree: Path, dest: Path) -> Path:
    """The sources and the index mixture, copied to dest (tests that break a source work on this copy)."""
    for name in [*SOURCES, "index"]:
        shutil.copytree(tree / name, dest / name)
    return dest


# ----------------------------------------------------------------------------------------------------
# The stream


def test_the_manifest_records_an_index(tree):
    copy, index = read_manifest(tree / "copy"), read_manifest(tree / "index")
    train = index.splits["train"]
    assert train.files == [] and train.index.sources == ["../short", "../long", "../mid"]  # relative: a tree
    assert train.index.tokens_sha256_covers == "index"
    assert train.tokens_sha256 == index_tokens_sha256(index.mixture.documents_sha256,
                                                      [s.manifest_digest for s in index.mixture.sources])
    assert not list((tree / "index").glob("train/*"))  # no token of the train split is stored
    # the same documents, shares and counts as the copy; only the documents file's extra column differs
    assert [dataclass_without(s, "manifest_digest") for s in index.mixture.sources] == \
           [dataclass_without(s, "manifest_digest") for s in copy.mixture.sources]
    for key in ("n_tokens", "n_documents", "n_bytes", "n_chars"):
        assert getattr(train, key) == getattr(copy.splits["train"], key), key
    assert index.splits["valid/long"] == copy.splits["valid/long"]  # held-out splits are copies either way
    # the digest stands for the index, so a copy and an index mixture do not share checkpoints
    assert index.digest() != copy.digest()
    stops, sources, source_starts = read_documents_table(tree / "index", index)
    np.testing.assert_array_equal((stops, sources), read_documents_table(tree / "copy", copy))


def dataclass_without(obj, key: str) -> dict:
    import dataclasses

    d = dataclasses.asdict(obj)
    del d[key]
    return d


@pytest.mark.parametrize("gather_mapped_bytes", [None, 64])
def test_read_equals_the_copy_at_random_ranges(tree, gather_mapped_bytes, monkeypatch):
    if gather_mapped_bytes is not None:  # a gather in groups of a document or two, each unmapped before the next
        import txl_dist.data.index_split as index_split

        monkeypatch.setattr(index_split, "GATHER_MAPPED_BYTES", gather_mapped_bytes)
    want = split_tokens(tree / "copy", "train")  # [n]: the copy, read with plain pyarrow
    n = len(want)
    manifest = read_manifest(tree / "index")
    with split_reader(tree / "index", manifest, "train") as reader:
        assert isinstance(reader, IndexReader) and (reader.n_tokens, reader.dtype) == (n, "uint16")
        np.testing.assert_array_equal(reader.read(0, n), want)
        stops = read_documents_table(tree / "index", manifest)[0]
        rng = np.random.default_rng(0)
        ranges = [(0, 0), (0, 1), (n - 1, n), (n - 5000, n), (0, 5000), (int(stops[0]) - 1, int(stops[0]) + 1)]
        for length in (1, 3, 17, 200, 2500, 12000):  # up to thousands of documents per window
            ranges += [(a, a + length) for a in rng.integers(0, n - length, size=40).tolist()]
        for a, b in ranges:
            got = reader.read(a, b)
            assert got.dtype == np.uint16
            np.testing.assert_array_equal(got, want[a:b], err_msg=f"[{a}, {b})")
        # a window inside one document of its source is a view of the source's mapped file, not a copy
        inside = int(np.argmax(np.diff(stops, prepend=0) > 50))
        view = reader.read(int(stops[inside]) - 40, int(stops[inside]) - 10)
        assert view.base is not None and not view.flags.owndata
        pieces = list(reader.chunks(123, n))
        np.testing.assert_array_equal(np.concatenate(pieces), want[123:])
        with pytest.raises(IndexError):
            reader.read(0, n + 1)
    # gather opens (and verifies) only the files that hold its ranges, as read() does
    source = read_manifest(tree / "long")
    second = source.splits["train"].files[1]
    with TokenReader(tree / "long", source, "train") as reader:
        starts = second.first_token + np.array([5, 900, 40, 2000])  # across record batches of 700 tokens too
        got = reader.gather(starts, starts + np.array([3, 600, 1, 10]))
        assert reader.files_opened == [second.path]
        np.testing.assert_array_equal(got, np.concatenate([reader.read(a, a + n) for a, n in
                                                           zip(starts, [3, 600, 1, 10])]))
    # the unigram baseline (another reader of corpus splits) counts the same tokens
    np.testing.assert_array_equal(token_counts(tree / "index", "train", 1000), token_counts(tree / "copy", "train",
                                                                                            1000))


@pytest.mark.parametrize("rank, world_size, n_streams, micro_batch, roll", [
    (0, 1, 8, 2, False), (1, 2, 8, 2, False), (3, 4, 8, 1, True), (2, 3, 6, 1, False)])
def test_the_loader_reads_the_same_windows(tree, rank, world_size, n_streams, micro_batch, roll):
    loaders = [StreamLoader(tree / name, "train", rank=rank, world_size=world_size, n_streams=n_streams,
                            micro_batch=micro_batch, tgt_len=24, roll=roll, seed=3, epochs=2)
               for name in ("copy", "index")]
    n = 0
    for copied, indexed in zip(*loaders, strict=True):
        np.testing.assert_array_equal(copied.input_ids, indexed.input_ids)
        np.testing.assert_array_equal(copied.labels, indexed.labels)
        np.testing.assert_array_equal(copied.reset, indexed.reset)
        n += 1
    assert n > 20
    opened = loaders[1].files_opened
    assert opened[0] == DOCUMENTS_FILE and all(p.split("/")[1] in SOURCES for p in opened[1:])
    for loader in loaders:
        loader.close()


def test_verify_reads_every_token_and_matches_the_copy(tree):
    stats = verify_corpus(tree / "index")
    copy = read_manifest(tree / "copy")
    # the gathered stream hashes to what the copy recorded: verify checked the tokens themselves
    assert stats["splits"]["train"]["stream_sha256"] == copy.splits["train"].tokens_sha256
    assert stats["splits"]["train"]["n_eod"] == copy.splits["train"].n_documents


@pytest.mark.parametrize("kind", ["copy", "index"])
@pytest.mark.parametrize("check_tokens", [True, False])
def test_verify_reads_the_documents_file_once(tree, kind, check_tokens, monkeypatch):
    """The documents file (GBs at 100B tokens) is mapped once and hashed from that mapping; the record's check,
    the eods where documents end and the index reader all read the same views. It used to be opened to hash
    and mapped again for every check (copy: 3 times, index: 6)."""
    documents = (tree / kind / DOCUMENTS_FILE).resolve()
    opened = []

    def counting(real):
        def wrapper(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path).resolve() == documents:
                opened.append(real.__name__)
            return real(path, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(pa, "memory_map", counting(pa.memory_map))
    monkeypatch.setattr(builtins, "open", counting(builtins.open))
    monkeypatch.setattr(io, "open", counting(io.open))  # pathlib's
    verify_corpus(tree / kind, check_tokens=check_tokens)
    assert opened == ["memory_map"]


# ----------------------------------------------------------------------------------------------------
# Sources moved, changed, truncated; a corrupt index


def test_a_moved_tree_keeps_working_a_moved_source_does_not(tree, tmp_path, capsys):
    moved = copy_of_tree(tree, tmp_path / "elsewhere")
    assert run("verify", moved / "index") == 0
    capsys.readouterr()
    (moved / "long").rename(tmp_path / "long-away")
    err = refused(capsys, "verify", moved / "index")
    assert "index source 'long'" in err and str(moved / "index" / "../long") in err and "put that corpus back" in err
    assert "nothing there" in err and "prepare --out" not in err  # one fix: a new corpus there would be another
    with pytest.raises(CorpusError, match="index source 'long'"):
        StreamLoader(moved / "index", "train", rank=0, world_size=1, n_streams=8, micro_batch=8, tgt_len=8)


def test_a_changed_source_is_refused(tree, tmp_path, capsys):
    work = copy_of_tree(tree, tmp_path / "t")
    shutil.rmtree(work / "mid")  # prepared again from other text: same layout, another digest
    make_corpus(work / "mid", {"train": synthetic_stream(3000, seed=99, mean_doc=20),
                               "valid": synthetic_stream(2000, seed=12), "test": synthetic_stream(1000, seed=22)},
                batch_tokens=700)
    err = refused(capsys, "verify", work / "index")
    assert "index source 'mid'" in err and "manifest digest" in err and "changed since" in err


def test_a_source_made_again_with_the_same_tokens_is_no_change(tree, tmp_path):
    """The recorded digest covers a source's tokens, not its files: the same tokens written again in other
    files and record batches (prepare run again on the same text, or a relayout) keep the index working."""
    work = copy_of_tree(tree, tmp_path / "t")
    shutil.rmtree(work / "long")
    n, mean_doc = SOURCES["long"]
    make_corpus(work / "long", {"train": synthetic_stream(n, seed=1, mean_doc=mean_doc),
                                "valid": synthetic_stream(2000, seed=11), "test": synthetic_stream(1000, seed=21)},
                layout=Layout(4, 8), batch_tokens=333)
    assert read_manifest(work / "long").splits["train"].files != read_manifest(tree / "long").splits["train"].files
    result = verify_corpus(work / "index")
    assert result["splits"]["train"]["stream_sha256"] == read_manifest(tree / "copy").splits["train"].tokens_sha256


def test_a_truncated_or_corrupt_source_file_is_refused(tree, tmp_path, capsys):
    work = copy_of_tree(tree, tmp_path / "t")
    source_file = work / "long" / "train" / "00001.arrow"
    source_file.write_bytes(source_file.read_bytes()[:-100])  # the manifest (and its digest) unchanged
    err = refused(capsys, "verify", work / "index")
    assert f"{work / 'index' / '../long/train/00001.arrow'}: sha256" in err
    with pytest.raises(CorpusError, match="sha256"):  # the loader verifies the source files its block reads
        StreamLoader(work / "index", "train", rank=0, world_size=1, n_streams=8, micro_batch=8, tgt_len=8)


def test_a_corrupt_index_is_refused(tree, tmp_path, capsys):
    work = copy_of_tree(tree, tmp_path / "t")
    documents = work / "index" / DOCUMENTS_FILE
    data = bytearray(documents.read_bytes())
    data[len(data) // 2] ^= 0xFF
    documents.write_bytes(bytes(data))
    err = refused(capsys, "verify", work / "index")
    assert str(documents) in err and "sha256" in err


def test_a_documents_file_this_user_may_not_read_is_one_line(tree, tmp_path):
    # document_batches asked Path.is_file(), which raises for a folder this user may not search: a training start
    # on the mixture ended in a PermissionError traceback where its sources' files are refused in one line.
    index = copy_of_tree(tree, tmp_path) / "index"
    said = open_as_an_unprivileged_user(index, index / "mixture")
    assert said.startswith(f"refused: {index / DOCUMENTS_FILE}: cannot be read ("), said
    assert "Permission denied" in said and "folders above it" in said


def test_an_index_of_partial_documents_is_refused_by_verify(tree, tmp_path, capsys):
    """An index whose checksums and hash are made consistent again but whose documents do not start where
    source documents start: only reading the tokens can tell, and verify does."""
    work = copy_of_tree(tree, tmp_path / "t")
    manifest = read_manifest(work / "index")
    stops, sources, source_starts = read_documents_table(work / "index", manifest)
    shifted = source_starts.copy()
    long_doc = int(np.argmax((np.diff(stops, prepend=0) > 2) & (source_starts > 0)))
    shifted[long_doc] += 1  # the document now starts one token into a source document
    writer = DocumentsWriter(work / "index" / DOCUMENTS_FILE, index=True)
    writer.write(stops, sources, shifted)
    sha = writer.close()
    d = json.loads((work / "index" / "manifest.json").read_text())
    d["mixture"]["documents_sha256"] = sha
    d["splits"]["train"]["tokens_sha256"] = index_tokens_sha256(sha, [s["manifest_digest"]
                                                                      for s in d["mixture"]["sources"]])
    (work / "index" / "manifest.json").write_text(json.dumps(d))
    err = refused(capsys, "verify", work / "index")
    assert "not the start of one of its documents" in err


def test_manifest_refusals(tree, tmp_path, capsys):
    work = copy_of_tree(tree, tmp_path / "t")
    original = (work / "index" / "manifest.json").read_text()
    edits = [
        (lambda d: d["splits"]["train"]["index"]["sources"].pop(), "lists 2 folders for the mixture's 3 sources"),
        (lambda d: d["splits"]["train"].update(tokens_sha256="0" * 64), "not the hash of its index"),
        (lambda d: d["splits"]["train"]["index"].update(tokens_sha256_covers="stream"), "tokens_sha256_covers"),
        (lambda d: d["splits"]["valid"].update(index=d["splits"]["train"]["index"], files=[]),
         "only a mixture's train split can be an index"),
        (lambda d: d["splits"]["train"].update(files=d["splits"]["valid"]["files"]), "both files and an index"),
    ]
    for edit, message in edits:
        d = json.loads(original)
        edit(d)
        (work / "index" / "manifest.json").write_text(json.dumps(d))
        assert message in refused(capsys, "verify", work / "index"), message


def test_mix_index_refusals(tree, tmp_path, capsys):
    # a source inside --out: replacing --out would delete what the index points at
    inside = tmp_path / "out" / "src"
    shutil.copytree(tree / "mid", inside)
    err = refused(capsys, "mix", "--out", tmp_path / "out", "--source", f"mid={inside}:1", "--index", "--overwrite",
                  "--world-size", 2, "--n-streams", 8, "--quiet")
    assert "lies inside --out" in err and inside.is_dir()
    # an index mixture cannot be a source (it has no token files of its own)
    err = refused(capsys, "mix", "--out", tmp_path / "again", "--source", f"m={tree / 'index'}:1", "--index",
                  "--world-size", 2, "--n-streams", 8, "--quiet")
    assert "is an index mixture" in err and not (tmp_path / "again").exists()
    # a source whose eod ids do not count its documents (more or fewer than the manifest says), either mode
    for delta in (-1, 1):
        odd = tmp_path / f"odd{delta}"
        shutil.copytree(tree / "mid", odd)
        edit_manifest(odd, lambda d: d["splits"]["train"].update(n_documents=d["splits"]["train"]["n_documents"]
                                                                 + delta))
        for mode in ([], ["--index"]):
            err = refused(capsys, "mix", "--out", tmp_path / "x", "--source", f"odd={odd}:1", *mode,
                          "--world-size", 2, "--n-streams", 8, "--quiet")
            assert "documents cannot be told apart" in err, err


# ----------------------------------------------------------------------------------------------------
# relayout, absolute paths


def test_relayout_changes_only_the_layout_hint(tree, tmp_path):
    work = copy_of_tree(tree, tmp_path / "t")
    assert run("relayout", work / "index", "--world-size", 1, "--n-streams", 4, "--quiet") == 0
    before, after = read_manifest(tree / "index"), read_manifest(work / "index")
    assert after.digest() == before.digest() and after.mixture == before.mixture
    assert after.splits["train"].layout == Layout(1, 4) and after.splits["train"].index == before.splits["train"].index
    assert len(after.splits["valid"].files) == 1  # the copied held-out splits are re-cut
    assert verify_corpus(work / "index")["splits"]["train"]["stream_sha256"] == \
        read_manifest(tree / "copy").splits["train"].tokens_sha256


def test_sources_without_a_common_folder_are_named_absolutely(tree, monkeypatch):
    from txl_dist.data import index_split

    assert index_split.source_reference("/data/mixes/m", "/data/corpora/web") == "../../corpora/web"
    assert index_split.source_reference("/mix", "/corpora/web") == "/corpora/web"
    assert index_split.source_folder("/mix", "/corpora/web") == Path("/corpora/web")
    with TokenReader(tree / "copy", read_manifest(tree / "copy"), "train") as reader:  # still the plain reader
        assert not isinstance(reader, IndexReader)
    assert isinstance(split_reader(tree / "copy", read_manifest(tree / "copy"), "train"), TokenReader)


# ----------------------------------------------------------------------------------------------------
# Training


def test_training_on_the_index_equals_the_copy_and_resumes(tree, tmp_path):
    """Same losses bit for bit on the copy and on the index (2 ranks, gloo); a run stopped at step k and
    resumed continues exactly; a resume on one rank (elastic) continues within float tolerance."""
    n, k = 4, 2

    def cfg(corpus, name, **train):
        return tiny_config(tree / corpus, tmp_path / name, train={"max_steps": n, **train},
                           model={"dropout": 0.0}, deepspeed={"zero_optimization": {"stage": 1}})

    two = run_ranks(train_jobs, 2, [(cfg("copy", "copy"), "none"), (cfg("index", "index"), "none"),
                                    (cfg("index", "resumed", exit_step=k), "none"), (cfg("index", "resumed"), "auto"),
                                    (cfg("index", "elastic", exit_step=k), "none")], timeout=900)[0]
    (on_one,) = run_ranks(train_jobs, 1, [(cfg("index", "elastic"), "auto")], timeout=900)[0]
    copied, indexed, first, second, _ = two
    assert [r["code"] for r in (*two, on_one)] == [0] * 6
    assert sorted(indexed["losses"]) == list(range(1, n + 1))
    assert indexed["losses"] == copied["losses"]  # bitwise: the same windows in the same order
    assert {**first["losses"], **second["losses"]} == indexed["losses"]
    assert sorted(on_one["losses"]) == [3, 4]
    for step in (3, 4):
        np.testing.assert_allclose(on_one["losses"][step], indexed["losses"][step], rtol=1e-4)



def test_split_files_lists_every_file_a_loader_of_the_index_split_opens(tree):
    from txl_dist.data.index_split import split_files

    listed = {p.resolve() for p in split_files(tree / "index", read_manifest(tree / "index"), "train")}
    opened = set()
    for rank in range(2):
        with StreamLoader(tree / "index", "train", rank=rank, world_size=2, n_streams=8, micro_batch=2,
                          tgt_len=24) as loader:
            reader = loader.reader
            opened |= {(tree / "index" / reader._documents_file).resolve()}
            opened |= {(src.corpus_dir / p).resolve() for src in reader.sources for p in src.files_opened}
    assert opened and opened <= listed
    assert (tree / "index" / DOCUMENTS_FILE).resolve() in listed
    assert {(tree / name / "train").resolve() for name in SOURCES} == {p.parent for p in listed} - {
        (tree / "index" / DOCUMENTS_FILE).resolve().parent}


# ----------------------------------------------------------------------------------------------------
# A long run on an index split: resident memory, and a file cut shorter under it


def make_large_index(root: Path, source_tokens: int, train_tokens: int) -> Path:
    """root/{a,b} (sources of source_tokens each, 1 MiB record batches) and root/index, their index mixture
    for 1 rank of 4 streams."""
    argv = ["mix", "--out", root / "index", "--train-tokens", train_tokens, "--seed", 1, "--world-size", 1,
            "--n-streams", 4, "--quiet", "--index"]
    for i, (name, mean_doc) in enumerate((("a", 40), ("b", 300))):
        make_corpus(root / name, {"train": synthetic_stream(source_tokens, seed=i, mean_doc=mean_doc),
                                  "valid": synthetic_stream(4000, seed=10 + i)}, layout=Layout(1, 4),
                    batch_tokens=1 << 19)
        argv += ["--source", f"{name}={root / name}:1"]
    assert run(*argv) == 0
    return root / "index"


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident set from /proc/self/smaps")
def test_resident_memory_stays_flat_while_streaming_an_index_split(tmp_path):
    # The loader's read-ahead pieces gather documents shuffled across the sources: a mapped page stays resident
    # until its file is closed, and one piece of 32 K tokens mapped most of the sources (a fault maps up to
    # 2 MiB around the document it reads); release() was a no-op, so a rank held every source file whole,
    # and the documents file, as resident memory (measured: 667 MiB after 44 M tokens of a 400 MB mixture).
    index = make_large_index(tmp_path, 8 << 20, 8 << 20)  # 2 x 16 MiB of sources, a 16 MiB stream
    with StreamLoader(index, "train", rank=0, world_size=1, n_streams=4, micro_batch=4, tgt_len=2048,
                      verify=False, epochs=2) as streams:
        peak = n = 0
        for n, _ in enumerate(streams, 1):  # two epochs: the second reads the unmapped pages again
            if n % 32 == 0:
                peak = max(peak, mapped_rss(tmp_path))
    assert n >= 2 * (8 << 20) // (4 * 2048) - 2  # the whole block, twice
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB of the sources and index resident while streaming 32 MiB"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the peak resident set from /proc")
def test_verify_holds_neither_the_documents_file_nor_the_sources_resident(tmp_path, monkeypatch):
    # verify's checks before its token scan: the documents file was hashed from its mapping and every page of it
    # stayed resident (then check_mixture and the document-start check read it all again, unreleased), and the
    # check that each document starts after an eod read a token before every document, which mapped every page
    # of the sources (a 400 MB mixture of 11-token documents: 810 MiB peak RSS, 295 MiB of documents file and
    # 382 MiB of sources; 525 MiB after, what is left being the token scan's gathered reads).
    import gc

    from txl_dist.data.index_split import DocumentIndex
    from txl_dist.data.verify import _check_index_documents, check_mixture

    index, files = make_short_document_index(tmp_path, monkeypatch)
    manifest = read_manifest(index)

    def checks() -> None:
        documents = DocumentIndex(index, manifest, verify=True)  # hashed
        check_mixture(index, manifest, documents)
        with split_reader(index, manifest, "train", verify=True, documents=documents) as reader:
            _check_index_documents(reader, manifest.tokenizer.eod_id)
        documents.close()
        gc.collect()

    grown = peak_growth(checks)
    assert grown < files / 4, f"{grown / 2**20:.1f} MiB resident at the peak for {files / 2**20:.1f} MiB of files"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the peak resident set from /proc")
def test_reading_an_index_split_holds_a_bounded_part_of_its_sources_resident(tmp_path, monkeypatch):
    # A read gathers documents shuffled across the sources, and a fault maps up to 2 MiB around each: one read
    # mapped most of both sources before it unmapped them (a 400 MB mixture of 11-token documents: verify's
    # 1 M-token chunks peaked at 376 MiB RSS, 266 MiB above its start; the loader's 32 K-token pieces 201 MiB).
    # Reads now unmap every GATHER_MAPPED_BYTES of a source as they go (scaled down with these sources).
    from txl_dist.data.loader import READ_AHEAD_TOKENS

    index, files = make_short_document_index(tmp_path, monkeypatch)
    with split_reader(index, read_manifest(index), "train", verify=False) as reader:

        def reads() -> None:  # verify's token scan (chunks of 1 M tokens), then a loader's pieces
            pieces = [(a, min(reader.n_tokens, a + (1 << 20))) for a in range(0, reader.n_tokens, 1 << 20)]
            pieces += [(a, a + READ_AHEAD_TOKENS) for a in range(0, 8 * READ_AHEAD_TOKENS, READ_AHEAD_TOKENS)]
            for a, b in pieces:
                reader.read(a, b)  # a copy, dropped before the next read
                reader.release(a, b)  # as both callers do: the documents file's pages the lookup read

        grown = peak_growth(reads)
    assert grown < files / 6, f"{grown / 2**20:.1f} MiB resident at the peak for {files / 2**20:.1f} MiB of files"


def make_short_document_index(tmp_path: Path, monkeypatch) -> tuple[Path, int]:
    """tmp_path/{a,b} (16 MiB sources of 11-token documents) and tmp_path/index, their index mixture, whose
    documents file has record batches far smaller than the file, as at scale; the index and the bytes of its
    files (documents file and sources). Gathers from them unmap every 2 MiB of a source (GATHER_MAPPED_BYTES:
    32 MiB, as large as these sources, would bound nothing here)."""
    import txl_dist.data.index_split as index_split

    monkeypatch.setattr(data_prep.mix, "ROUND_TOKENS", 1 << 18)
    monkeypatch.setattr(index_split, "GATHER_MAPPED_BYTES", 1 << 21)
    argv = ["mix", "--out", tmp_path / "index", "--seed", 1, "--world-size", 1, "--n-streams", 4, "--quiet", "--index"]
    for i, name in enumerate(("a", "b")):
        make_corpus(tmp_path / name, {"train": synthetic_stream(8 << 20, seed=i, mean_doc=11)}, layout=Layout(1, 4),
                    batch_tokens=1 << 19)
        argv += ["--source", f"{name}={tmp_path / name}:1"]
    assert run(*argv) == 0
    index = tmp_path / "index"
    return index, (index / DOCUMENTS_FILE).stat().st_size + sum(p.stat().st_size for p in tmp_path.glob("[ab]/train/*"))


def peak_growth(work) -> int:
    """Bytes the resident set grew by at its peak during work(), run once before (the libraries' pages and the
    allocator's pools are then resident already)."""
    from corpus_helpers import peak_rss_since_reset

    work()
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    Path("/proc/self/clear_refs").write_text("5")
    work()
    return peak_rss_since_reset() - before


def _read_on_after_truncating(index: str, victim: str) -> str:
    """A loader on the index split that has read one batch; `victim` cut to 4 KiB in place; what reading on
    raises."""
    from txl_dist.data.manifest import CorpusFault

    streams = StreamLoader(index, "train", rank=0, world_size=1, n_streams=4, micro_batch=4, tgt_len=64,
                           verify=False)
    next(iter(streams))
    os.truncate(victim, 4096)
    try:
        for _ in zip(range(2000), streams):  # past the first read-ahead piece of each stream
            pass
    except CorpusFault as e:
        return str(e)
    return "read on"


@pytest.mark.parametrize("victim", ["a/train/00000.arrow", f"index/{DOCUMENTS_FILE}"])
def test_a_source_or_index_file_cut_shorter_during_the_run_is_one_line_not_a_bus_error(tmp_path, victim):
    # The pages past a file's new end give SIGBUS when read: the loader checked the files of a copied split
    # before each piece, not the sources' files nor the documents file that an index split reads (a child
    # process: without the check, the test's own process would die).
    import re

    index = make_large_index(tmp_path, 1 << 20, 1 << 20)
    [said] = run_ranks(_read_on_after_truncating, 1, str(index), str(tmp_path / victim))
    named, _, rest = said.partition(": ")  # a source file as the mixture names it: index/../a/train/...
    assert Path(named).resolve() == (tmp_path / victim).resolve(), said
    assert re.match(r"the file shrank from \d+ to 4096 bytes while this run read it", rest), said
    assert "put the prepared file back" in said and "\n" not in said, said
