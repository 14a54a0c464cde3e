"""data_prep refuses bad input with one clear line and a non-zero exit, and never leaves half-written output:
missing, empty or undecodable inputs, bad options, incomplete shards; damaged corpora (corrupt or truncated
Arrow files, a manifest path outside the folder, a replaced tokenizer, out-of-range token ids).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm

from data_prep.cli import main
from txl_dist.data.format import read_manifest, sha256_file

ROOT = Path(__file__).resolve().parents[1]


def run(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


def fail(capsys, *argv) -> str:
    """Run a command that must fail; return its one error line."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def untouched(parent: Path, names: set[str]) -> bool:
    """The folder holds exactly `names`: no output appeared, no temporary folder was left behind."""
    return {p.name for p in parent.iterdir()} == names


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> list[Path]:
    raw = tmp_path_factory.mktemp("raw") / "shakespeare"
    run("fetch-corpus", "shakespeare", raw)
    return sorted((raw / "train").glob("*.txt"))[:3]


@pytest.fixture(scope="module")
def model(plays, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe.model"
    run("train-tokenizer", "--out", out, "--train", *plays, "--vocab-size", 400, "--model-type", "bpe", "--quiet")
    return out


@pytest.fixture(scope="module")
def base_corpus(plays, model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base") / "corpus"
    run("prepare", "--out", out, "--train", *plays[:2], "--valid", plays[2], "--tokenizer-model", model,
        "--world-size", 2, "--n-streams", 4, "--num-proc", 1, "--quiet")
    return out


@pytest.fixture
def corpus(base_corpus, tmp_path) -> Path:
    """A fresh copy of the small corpus, to damage."""
    return Path(shutil.copytree(base_corpus, tmp_path / "corpus"))


def prepare_args(out, model, *inputs, extra=()):
    return ["prepare", "--out", out, "--tokenizer-model", model, "--num-proc", 1, "--quiet", *extra,
            "--train", *inputs]


# ----------------------------------------------------------------------------------------------------
# Bad inputs to prepare


def test_missing_input_and_unmatched_glob(model, tmp_path, capsys):
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "nope.txt"))
    assert "nope.txt" in msg and "no such file" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "none" / "*.txt"))
    assert "none/*.txt" in msg and "no file matches" in msg
    assert untouched(tmp_path, set())


def test_empty_input(model, plays, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[0], tmp_path / "empty.txt"))
    assert "empty.txt" in msg and "empty" in msg
    assert untouched(tmp_path, {"empty.txt"})


@pytest.mark.parametrize("before", [b"Good text.\n" * 100, b"a" * ((4 << 20) - 1) + "\u00e9".encode() + b"b" * 10],
                         ids=["small", "past-a-read-chunk"])
def test_undecodable_bytes_name_file_and_offset(model, tmp_path, capsys, before):
    data = before + b"\xff and more text\n"
    (tmp_path / "bad.txt").write_bytes(data)
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "bad.txt"))
    offset = data.index(b"\xff")
    assert "bad.txt" in msg and f"byte offset {offset}" in msg and "--errors replace" in msg
    assert untouched(tmp_path, {"bad.txt"})


def test_errors_replace_substitutes_undecodable_bytes(model, tmp_path):
    data = b"The quality of mercy \xff is not strained.\n"
    (tmp_path / "bad.txt").write_bytes(data)
    run(*prepare_args(tmp_path / "out", model, tmp_path / "bad.txt", extra=["--errors", "replace"]))
    sp = spm.SentencePieceProcessor(model_file=str(model))
    want = sp.encode(data.decode("utf-8", errors="replace")) + [sp.eos_id()]
    got = pa.ipc.open_file(str(tmp_path / "out/train/00000.arrow")).read_all().column(0).to_numpy()
    np.testing.assert_array_equal(got, want)


def test_undecodable_json_lines(model, tmp_path, capsys):
    data = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'
    (tmp_path / "bad.jsonl").write_bytes(data)
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "bad.jsonl"))
    offset = data.index(b"\xe9")
    assert "bad.jsonl" in msg and f"byte offset {offset}" in msg


def test_malformed_json_lines_name_the_line_in_one_line(model, tmp_path, capsys):
    # a blank line, and two objects on one line (Arrow takes both), before the bad line: Arrow said "row 1"
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": "b"} {"text": "c"}\n{"text": broken}\n')
    out = subprocess.run([sys.executable, "-m", "data_prep",
                          *map(str, prepare_args(tmp_path / "out", model, tmp_path / "bad.jsonl"))],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == (f"error: input {tmp_path / 'bad.jsonl'}: cannot be read as json "
                                                  "(line 4, column 10: Expecting value)\n"), out.stderr
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n  [1, 2]\n')
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "bad.jsonl"))
    assert "cannot be read as json (line 2, column 3: an array, not an object)" in msg
    assert untouched(tmp_path, {"bad.jsonl"})


def test_missing_or_non_text_field(model, tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "text"}) + "\n")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "a.jsonl"))
    assert "a.jsonl" in msg and "'text'" in msg and "--text-field" in msg
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "n.parquet"))
    assert "n.parquet" in msg and "not text" in msg
    (tmp_path / "null.jsonl").write_text('{"text": "a"}\n{"text": null}\n')
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "null.jsonl"))
    assert "null.jsonl" in msg and "no text" in msg


def test_bad_tokenizer_and_options(model, plays, tmp_path, capsys):
    p = plays[0]
    assert "no such file" in fail(capsys, *prepare_args(tmp_path / "o", tmp_path / "none.model", p))
    msg = fail(capsys, *prepare_args(tmp_path / "o", p, p))  # a text file is not a model
    assert p.name in msg and "not a SentencePiece model" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "o", model, p, extra=["--world-size", 3, "--n-streams", 8]))
    assert "--n-streams: 8 streams cannot be split over 3 ranks (--world-size)" in msg
    msg = fail(capsys, "prepare", "--out", tmp_path / "o", "--train", p, "--shard", "0/2", "--quiet")
    assert "--tokenizer-model" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "o", model, p, extra=["--shard", "2/2"]))
    assert "--shard '2/2'" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "o", model, p, extra=["--valid", plays[1], "--valid-fraction", "0.1"]))
    assert "--valid-fraction" in msg
    msg = fail(capsys, "prepare", "--out", tmp_path / "o", "--train", p, "--model-type", "word", "--byte-fallback")
    assert "--byte-fallback works with unigram, bpe, char models, not word" in msg
    msg = fail(capsys, "prepare", "--out", tmp_path / "o", "--train", p, "--vocab-size", 60000, "--model-type", "bpe",
               "--quiet", "--num-proc", 1)
    assert "vocab" in msg.lower()
    assert untouched(tmp_path, set())


def test_existing_output_is_refused_and_failures_keep_it(base_corpus, model, plays, tmp_path, capsys):
    out = Path(shutil.copytree(base_corpus, tmp_path / "out"))
    before = read_manifest(out).digest()
    msg = fail(capsys, *prepare_args(out, model, plays[0]))
    assert str(out) in msg and "--overwrite" in msg
    # a run that fails after tokenizing (the split is too small for its streams) leaves the old corpus as it was
    msg = fail(capsys, *prepare_args(out, model, plays[0], extra=["--overwrite", "--n-streams", 10 ** 8]))
    assert "fewer than its 100000000 streams" in msg
    assert read_manifest(out).digest() == before and untouched(tmp_path, {"out"})
    run(*prepare_args(out, model, plays[0], extra=["--overwrite"]))
    assert read_manifest(out).splits["train"].n_documents == 1 and untouched(tmp_path, {"out"})


def test_fetch_corpus_overwrite_replaces_only_a_fetched_corpus_or_an_empty_folder(plays, tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    msg = fail(capsys, "fetch-corpus", "shakespeare", out, "--overwrite")
    assert msg == (f"error: {out} is not a fetched corpus (no README.txt written by fetch-corpus) and holds notes.txt, "
                   "sub; --overwrite replaces only a fetched corpus or an empty folder: move those files away or "
                   "choose another output")
    (out / "notes.txt").rename(out / "README.txt")  # a README of one's own does not make a fetched corpus
    assert "holds README.txt, sub" in fail(capsys, "fetch-corpus", "shakespeare", out, "--overwrite")
    assert (out / "README.txt").read_text() == "keep me" and (out / "sub").is_dir()
    assert untouched(tmp_path, {"mine"})
    run("fetch-corpus", "shakespeare", tmp_path / "empty", "--overwrite")  # an empty folder, made just now
    (tmp_path / "empty" / "train" / "extra.txt").write_text("fetched, then added to")
    run("fetch-corpus", "shakespeare", tmp_path / "empty", "--overwrite")  # a fetched corpus: replaced
    assert not (tmp_path / "empty" / "train" / "extra.txt").exists()
    assert untouched(tmp_path, {"mine", "empty"})


def test_an_output_below_a_file_is_refused_as_a_file(model, plays, tmp_path, capsys):
    file = Path(shutil.copy(plays[0], tmp_path / "train.txt"))
    for out in (file / "sub", file / "deeper" / "sub"):
        msg = fail(capsys, *prepare_args(out, model, plays[1]))
        assert msg == f"error: {out}: cannot be written: {file} is a file, not a folder; choose another output"
    msg = fail(capsys, "train-tokenizer", "--out", file / "t.model", "--train", plays[1], "--quiet")
    assert f"{file} is a file, not a folder" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[1], extra=["--work-dir", file / "w"]))
    assert msg == f"error: --work-dir {file / 'w'}: {file} is a file, not a folder; give another work folder"
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    msg = fail(capsys, *prepare_args(tmp_path / "link" / "out", model, plays[1]))
    assert f"{tmp_path / 'link'} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in msg
    assert untouched(tmp_path, {"train.txt", "link"}) and file.read_bytes() == plays[0].read_bytes()


def test_an_output_that_is_a_file_is_refused_as_a_file_with_or_without_overwrite(model, plays, tmp_path, capsys):
    """Without --overwrite it said "pass --overwrite to replace it", which then refused it as no folder."""
    file = Path(shutil.copy(plays[0], tmp_path / "out"))
    for extra in ([], ["--overwrite"]):
        msg = fail(capsys, *prepare_args(file, model, plays[1], extra=extra))
        assert msg == f"error: {file} exists and is not a folder; remove it or choose another output"
    assert untouched(tmp_path, {"out"}) and file.read_bytes() == plays[0].read_bytes()


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_outside_32_bits_is_refused_before_any_work(model, plays, tmp_path, capsys, seed):
    """Was a traceback of numpy (-1, holding documents out) or SentencePiece (training), exit 1, after the
    inputs were read; `prepare --source` refused -1 only in mix, after preparing every source."""
    want = f"error: --seed must be in 0..4294967295, got {seed}"
    out = tmp_path / "out"
    lines = ["--line-docs", "--valid-fraction", 0.1, "--seed"]
    assert fail(capsys, *prepare_args(out, model, plays[0], extra=[*lines, seed])) == want
    assert fail(capsys, "prepare", "--out", out, "--train", plays[0], "--vocab-size", 400, *lines, seed,
                "--quiet") == want
    assert fail(capsys, "train-tokenizer", "--out", tmp_path / "t.model", "--train", plays[0], *lines, seed,
                "--quiet") == want
    assert fail(capsys, "prepare", "--out", out, "--source", f"a={plays[0]}:1", "--source", f"b={plays[1]}:1",
                "--tokenizer-model", model, *lines, seed, "--quiet") == want
    assert untouched(tmp_path, set())
    # The largest seed works for both the held-out choice (numpy) and tokenizer training (SentencePiece).
    run(*prepare_args(out, model, plays[0], extra=[*lines, 2**32 - 1]))
    run("train-tokenizer", "--out", tmp_path / "t.model", "--train", plays[0], "--vocab-size", 400, "--model-type",
        "bpe", *lines, 2**32 - 1, "--quiet")


def test_finalize_refuses_incomplete_or_mixed_shards(model, plays, tmp_path, capsys):
    run(*prepare_args(tmp_path / "parts", model, *plays[:2], extra=["--shard", "0/2"]))
    msg = fail(capsys, "finalize", tmp_path / "parts", "--out", tmp_path / "c")
    assert "shard-00001-of-00002 is missing" in msg and "--shard 1/2" in msg
    run(*prepare_args(tmp_path / "parts", model, plays[0], plays[2], extra=["--shard", "1/2"]))
    msg = fail(capsys, "finalize", tmp_path / "parts", "--out", tmp_path / "c")
    assert "shard-00001-of-00002" in msg and "other inputs" in msg
    assert untouched(tmp_path, {"parts"})


# ----------------------------------------------------------------------------------------------------
# Damaged corpora are refused by verify (and relayout), naming the file


def test_verify_accepts_the_intact_corpus(corpus, capsys):
    run("verify", corpus)
    assert "OK" in capsys.readouterr().out


def test_corrupt_arrow_file(corpus, capsys):
    path = corpus / "train/00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "train/00001.arrow" in fail(capsys, "verify", corpus)
    # relayout must not re-bless damaged tokens with fresh checksums
    assert "train/00001.arrow" in fail(capsys, "relayout", corpus, "--world-size", 1, "--n-streams", 2, "--quiet")
    assert path.read_bytes() == bytes(data) and untouched(corpus.parent, {"corpus"})


def test_truncated_arrow_file(corpus, capsys):
    path = corpus / "train/00000.arrow"
    path.write_bytes(path.read_bytes()[:1000])
    assert "train/00000.arrow" in fail(capsys, "verify", corpus)
    assert "train/00000.arrow" in fail(capsys, "inspect", corpus)  # inspect skips checksums, still names it


def test_manifest_path_outside_the_folder(corpus, capsys):
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["splits"]["train"]["files"][0]["path"] = "../outside.arrow"
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    msg = fail(capsys, "verify", corpus)
    assert "manifest.json" in msg and "../outside.arrow" in msg


def test_tokenizer_mismatch(corpus, plays, tmp_path, capsys):
    # a real model of the same size, trained on other text: loads fine, but is not the corpus' tokenizer
    run("train-tokenizer", "--out", tmp_path / "other.model", "--train", plays[2], "--vocab-size", 400,
        "--model-type", "bpe", "--quiet")
    shutil.copy(tmp_path / "other.model", corpus / "tokenizer.model")
    msg = fail(capsys, "verify", corpus)
    assert "tokenizer.model" in msg and "sha256" in msg
    assert "tokenizer.model" in fail(capsys, "relayout", corpus, "--world-size", 1, "--n-streams", 2, "--quiet")


def test_out_of_range_token_id(corpus, capsys):
    manifest = json.loads((corpus / "manifest.json").read_text())
    vocab = manifest["tokenizer"]["vocab_size"]
    entry = manifest["splits"]["valid"]["files"][1]
    path = corpus / entry["path"]
    tokens = pa.ipc.open_file(str(path)).read_all().column(0).to_numpy().copy()
    tokens[5] = vocab  # fits uint16, but no such token
    with pa.ipc.new_file(str(path), pa.schema([("tokens", pa.uint16())])) as w:
        w.write_batch(pa.record_batch([pa.array(tokens)], names=["tokens"]))
    entry["sha256"] = sha256_file(path)  # a consistent checksum: only the id range can catch it
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    msg = fail(capsys, "verify", corpus)
    assert entry["path"] in msg and str(vocab) in msg
    msg = fail(capsys, "relayout", corpus, "--world-size", 1, "--n-streams", 2, "--quiet")
    assert entry["path"] in msg and "outside" in msg


def test_wrong_tokens_sha256(corpus, capsys):
    # every file intact, but the manifest does not describe these tokens: relayout must not carry it over
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["splits"]["valid"]["tokens_sha256"] = "0" * 64
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    assert "split 'valid'" in fail(capsys, "verify", corpus)
    msg = fail(capsys, "relayout", corpus, "--world-size", 1, "--n-streams", 2, "--quiet")
    assert "manifest.json" in msg and "split valid" in msg and "tokens_sha256" in msg
    assert json.loads((corpus / "manifest.json").read_text()) == manifest and untouched(corpus.parent, {"corpus"})


def test_cli_exit_codes_in_a_subprocess(corpus):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "data_prep", "verify", str(corpus)], env=env, capture_output=True,
                        text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stderr
    (corpus / "tokenizer.model").write_bytes(b"not a model")
    bad = subprocess.run([sys.executable, "-m", "data_prep", "verify", str(corpus)], env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tokenizer.model" in bad.stderr


def test_a_data_prep_job_raises_its_open_file_limit(tmp_path):
    """Readers keep a descriptor per Arrow file they touch (a mixture of many sources): a job started under a
    soft limit of 64 runs under the hard limit (a refused job here, which is enough to see the limit)."""
    script = ("import resource, sys\n"
              "from data_prep.cli import main\n"
              "main(['inspect', sys.argv[1]])\n"
              "print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0])")

    def lower_soft_limit():
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "no-corpus")], capture_output=True, text=True,
                         preexec_fn=lower_soft_limit, timeout=120)
    assert int(out.stdout.split("soft")[-1]) == (hard if hard != resource.RLIM_INFINITY else 1 << 20), out.stderr


# ----------------------------------------------------------------------------------------------------
# Inputs that are not plain files of text, and inputs given twice


def test_a_pipe_is_refused_before_it_is_read(model, plays, tmp_path, capsys):
    """`--train <(cat FILE)`: a stream is read once; the corpus needs its inputs twice (scan, then tokenize)."""
    read_end, write_end = os.pipe()
    os.write(write_end, plays[0].read_bytes()[:4096])
    os.close(write_end)  # the stream ends: the old code read it whole once, then found it empty
    try:
        msg = fail(capsys, *prepare_args(tmp_path / "out", model, f"/dev/fd/{read_end}"))
    finally:
        os.close(read_end)
    assert "pipe" in msg and "not a regular file" in msg and "write it to a file first" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, "/dev/null"))
    assert "/dev/null" in msg and "character device" in msg
    assert untouched(tmp_path, set())


def test_a_named_fifo_is_refused_instead_of_waiting_for_a_writer(model, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "data_prep", *map(str, prepare_args(tmp_path / "out", model,
                                                                                     tmp_path / "fifo"))],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "fifo: is a pipe (FIFO)" in out.stderr
    assert untouched(tmp_path, {"fifo"})


def test_a_file_that_changes_between_scan_and_read_is_refused(plays, tmp_path):
    from data_prep.errors import PrepError
    from data_prep.sources import ReadOptions, read_text_documents, resolve_sources, scan_sources

    path = Path(shutil.copy(plays[0], tmp_path / "a.txt"))
    sources = resolve_sources([str(path)], "--train")
    path.write_bytes(path.read_bytes()[:-100])  # shrank after it was found
    with pytest.raises(PrepError, match="a.txt: changed while the job ran"):
        scan_sources(sources, ReadOptions())
    sources = resolve_sources([str(path)], "--train")
    scan_sources(sources, ReadOptions())
    path.write_bytes(path.read_bytes()[:-100])  # shrank after it was scanned
    with pytest.raises(PrepError, match="a.txt: changed while the job ran"):
        list(read_text_documents(sources, "strict", 8))


def test_a_file_given_to_two_splits_is_refused(model, plays, tmp_path, capsys):
    (tmp_path / "link.txt").symlink_to(plays[0])
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[0], plays[1], extra=["--valid", plays[0]]))
    assert f"--valid: {plays[0]} is also given to --train; each input may appear once" in msg
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[1], extra=["--test", tmp_path / "link.txt",
                                                                              "--valid", plays[0]]))
    assert f"link.txt (the same file as {plays[0]}) is also given to --valid" in msg  # both names
    assert untouched(tmp_path, {"link.txt"})


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz", "zstd"])
def test_compressed_inputs_are_refused_with_what_to_do(model, plays, tmp_path, capsys, kind):
    import bz2
    import gzip
    import lzma
    text = plays[0].read_bytes()
    data = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress,
            "zstd": lambda b: b"\x28\xb5\x2f\xfd" + b"\x00" * 8}[kind](text)
    for name in ("docs.txt", "docs.jsonl"):  # by their bytes, whatever the name says
        (tmp_path / name).write_bytes(data)
        msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / name, extra=["--errors", "replace"]))
        assert f"{name}: is {kind}-compressed; decompress it first" in msg
        (tmp_path / name).unlink()
    assert untouched(tmp_path, set())


def test_text_that_merely_starts_like_bzip2_is_read(model, tmp_path):
    (tmp_path / "a.txt").write_text("BZh9 is not a bzip2 header when no block follows.\n")
    run(*prepare_args(tmp_path / "out", model, tmp_path / "a.txt"))


def test_save_to_disk_without_documents_and_dataset_dicts(model, tmp_path, capsys):
    import datasets
    datasets.Dataset.from_dict({"text": pa.array([], pa.string())}).save_to_disk(str(tmp_path / "empty"))
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "empty"))
    assert "empty: holds no documents" in msg
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]})}).save_to_disk(str(tmp_path / "dd"))
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, tmp_path / "dd"))
    assert f"is a DatasetDict (train); give the folder of one split, e.g. {tmp_path / 'dd'}/train" in msg
    assert untouched(tmp_path, {"empty", "dd"})


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_a_json_lines_input_without_documents_is_refused_in_one_line(tmp_path, capsys, content):
    """datasets 5.2's JSON reader raises StopIteration on a file with no line of JSON: inside our reading
    generator that became "RuntimeError: generator raised StopIteration", a traceback, with the empty file
    among other inputs too (found by a random sweep of inputs and options). `prepare` refuses a 0-byte input
    before reading it (test_empty_input); `train-tokenizer` reads its inputs only once."""
    (tmp_path / "empty.jsonl").write_text(content)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"the king {i}"}) + "\n" for i in range(5)))
    for inputs in (["empty.jsonl"], ["docs.jsonl", "empty.jsonl"]):
        msg = fail(capsys, "train-tokenizer", "--out", tmp_path / "tok.model", "--vocab-size", 300, "--quiet",
                   "--train", *(tmp_path / name for name in inputs))
        assert f"input {tmp_path / 'empty.jsonl'}: holds no documents; remove it or give it text" in msg
    assert untouched(tmp_path, {"empty.jsonl", "docs.jsonl"})


# ----------------------------------------------------------------------------------------------------
# Tokenizer options and errors found while the tokenizer trains


def test_eod_piece_must_be_a_control_piece(model, plays, tmp_path, capsys):
    spm.SentencePieceTrainer.train(input=str(plays[0]), model_prefix=str(tmp_path / "user"), vocab_size=300,
                                   model_type="bpe", eos_id=-1, bos_id=-1, user_defined_symbols=["<doc>"],
                                   control_symbols=["<end>"], minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "user.model"))
    word = next(sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.id_to_piece(i).startswith("\u2581t"))
    for piece in ("<doc>", word, "<unk>"):  # encoding text produces each of them
        msg = fail(capsys, "prepare", "--out", tmp_path / "out", "--tokenizer-model", tmp_path / "user.model",
                   "--eod-piece", piece, "--train", plays[0], "--quiet", "--num-proc", 1)
        assert f"--eod-piece {piece!r} is not a control piece" in msg and "'<end>'" in msg
    assert untouched(tmp_path, {"user.model", "user.vocab"})


@pytest.mark.parametrize("command", ["prepare", "train-tokenizer"])
def test_an_input_error_found_while_training_is_the_inputs_refusal(plays, tmp_path, capsys, command):
    (tmp_path / "null.jsonl").write_text('{"text": "a"}\n{"text": null}\n')
    args = [command, "--out", tmp_path / "out", "--vocab-size", 300, "--quiet", "--num-proc", 1]
    first = fail(capsys, *args, "--train", tmp_path / "null.jsonl", plays[0])
    second = fail(capsys, *args, "--train", plays[0], tmp_path / "null.jsonl")
    assert second == first == f"error: input {tmp_path / 'null.jsonl'}: 1 document(s) have no text (null 'text'); " \
                              "drop them or fill them in"
    assert untouched(tmp_path, {"null.jsonl"})


def test_training_options_next_to_a_reused_tokenizer_must_be_its_own(base_corpus, model, plays, tmp_path, capsys):
    """They cannot change the model: one it was not trained with is refused instead of ignored (and recorded as if
    it had applied); its own are accepted, as prep.sh passes the tokenizer job's options to the shard tasks."""
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[0], extra=[
        "--vocab-size", 500, "--model-type", "unigram", "--character-coverage", 0.99]))
    assert msg == (f"error: --tokenizer-model {model} was not trained with --vocab-size 500 (the model's: 400), "
                   "--model-type unigram (the model's: bpe), --character-coverage 0.99 (the model's: 0.9995); "
                   "tokenizer-training options cannot change a reused model: drop them or give the model's values")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[0], extra=[
        "--tokenizer-sample", 5000, "--no-byte-fallback", "--normalization", "identity", "--newline-piece",
        "--no-remove-extra-whitespaces", "--no-add-dummy-prefix"]))
    assert ("--tokenizer-sample 5000 (the model's: 1000000), --no-byte-fallback (the model's: --byte-fallback), "
            "--normalization identity (the model's: nmt_nfkc), --newline-piece (the model's: no newline piece), "
            "--no-remove-extra-whitespaces (the model's: --remove-extra-whitespaces), --no-add-dummy-prefix "
            "(the model's: --add-dummy-prefix);") in msg
    # an option given with its default value is given: checked like any other
    assert "--vocab-size 4096 (the model's: 400)" in fail(capsys, *prepare_args(tmp_path / "out", model, plays[0],
                                                                                 extra=["--vocab-size", 4096]))
    assert untouched(tmp_path, set())
    own = ["--vocab-size", 400, "--model-type", "bpe", "--character-coverage", 0.9995, "--tokenizer-sample", 1000000,
           "--byte-fallback", "--normalization", "nmt_nfkc", "--remove-extra-whitespaces", "--add-dummy-prefix"]
    run(*prepare_args(tmp_path / "out", model, plays[0], extra=own))
    recorded = read_manifest(tmp_path / "out").provenance["args"]
    assert (recorded["vocab_size"], recorded["model_type"], recorded["byte_fallback"]) == (400, "bpe", True)
    # left out, they did not apply: not recorded at all (once the defaults, vocab_size 4096 for a model of 400)
    assert not {"vocab_size", "model_type", "character_coverage"} & set(read_manifest(base_corpus).provenance["args"])
    # the plan reads only the inputs: prep.sh runs it beside the job that trains the model it names
    run("prepare", "--plan", "--out", tmp_path / "parts", "--tokenizer-model", tmp_path / "parts/tokenizer.model",
        "--vocab-size", 400, "--quiet", "--train", plays[0])


def test_a_text_keeping_tokenizer_is_reused_with_the_options_it_was_trained_with(plays, tmp_path, capsys):
    keep = ["--vocab-size", 400, "--model-type", "char", "--character-coverage", 1.0, "--tokenizer-sample", 2000,
            "--normalization", "identity", "--no-byte-fallback", "--newline-piece", "--no-remove-extra-whitespaces",
            "--no-add-dummy-prefix"]
    run("train-tokenizer", "--out", tmp_path / "keep.model", "--train", plays[0], "--quiet", *keep)
    run(*prepare_args(tmp_path / "out", tmp_path / "keep.model", plays[1], extra=keep))
    tokenizer = read_manifest(tmp_path / "out").tokenizer
    assert tokenizer.model_type == "char" and tokenizer.vocab_size < 400  # a piece per character, all of them
    fewer = tokenizer.vocab_size - 1  # would have left a character out
    msg = fail(capsys, *prepare_args(tmp_path / "again", tmp_path / "keep.model", plays[1],
                                     extra=["--vocab-size", fewer]))
    assert f"--vocab-size {fewer} (the model's: {tokenizer.vocab_size});" in msg


def test_trainer_options_outside_sentencepiece_limits(plays, tmp_path, capsys):
    args = ["prepare", "--out", tmp_path / "out", "--train", plays[0], "--quiet", "--num-proc", 1]
    assert "--tokenizer-sample must be >= 101" in fail(capsys, *args, "--tokenizer-sample", 100)
    for coverage in (0.97, 1.01):
        msg = fail(capsys, *args, "--character-coverage", coverage)
        assert f"--character-coverage must be in [0.98, 1.0] (SentencePiece's range), got {coverage}" in msg
    msg = fail(capsys, "train-tokenizer", "--out", tmp_path / "t.model", "--train", plays[0], "--num-proc", 0)
    assert "--num-proc must be >= 1, got 0" in msg
    assert untouched(tmp_path, set())


def test_the_trained_tokenizer_does_not_depend_on_num_proc(plays, tmp_path):
    from data_prep.tokenizer import TRAINING_THREADS
    common = ["--train", *plays[:2], "--vocab-size", 400, "--quiet", "--world-size", 1]
    run("prepare", "--out", tmp_path / "one", "--num-proc", 1, *common)
    run("prepare", "--out", tmp_path / "two", "--num-proc", 2, *common)
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert one.tokenizer.sha256 == two.tokenizer.sha256 and one.digest() == two.digest()
    assert one.provenance["tokenizer"]["trained"]["num_threads"] == TRAINING_THREADS
    run("train-tokenizer", "--out", tmp_path / "t1.model", "--num-proc", 1, *common[:-2])
    run("train-tokenizer", "--out", tmp_path / "t2.model", "--num-proc", 2, *common[:-2])
    assert sha256_file(tmp_path / "t1.model") == sha256_file(tmp_path / "t2.model") == one.tokenizer.sha256


# ----------------------------------------------------------------------------------------------------
# Work folder, inspect and verify options


def test_a_work_dir_inside_a_new_output_is_refused_before_anything_is_made(model, plays, tmp_path, capsys):
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, plays[0], extra=["--work-dir", tmp_path / "out/w"]))
    assert f"--work-dir {tmp_path / 'out/w'} is inside the output {tmp_path / 'out'}" in msg
    assert untouched(tmp_path, set())
    run(*prepare_args(tmp_path / "out", model, plays[0], extra=["--work-dir", tmp_path / "w"]))


def test_inspect_refuses_counts_below_their_minimum(corpus, capsys):
    assert "--sample-tokens must be >= 0, got -1" in fail(capsys, "inspect", corpus, "--sample-tokens", -1)
    assert "--samples must be >= 0, got -2" in fail(capsys, "inspect", corpus, "--samples", -2)
    for option in ("--world-size", "--n-streams", "--eval-streams"):
        for value in (0, -1):
            assert f"{option} must be >= 1, got {value}" in fail(capsys, "inspect", corpus, option, value)


@pytest.mark.parametrize("field,value", [("vocab_size", 500), ("model_type", "unigram"), ("unk_id", 2)])
def test_verify_refuses_tokenizer_fields_that_do_not_describe_the_model(corpus, capsys, field, value):
    manifest = json.loads((corpus / "manifest.json").read_text())
    found = manifest["tokenizer"][field]
    manifest["tokenizer"][field] = value
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    msg = fail(capsys, "verify", corpus)
    assert f"tokenizer {field} is {value!r}, but {corpus / 'tokenizer.model'} has {found!r}" in msg


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_report_whose_reader_left_ends_quietly(base_corpus, command):
    """`inspect CORPUS | head`: the pipe closes before the report is written; no traceback, SIGPIPE's status."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        proc = subprocess.run([sys.executable, "-m", "data_prep", command, str(base_corpus)], cwd=ROOT,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr
