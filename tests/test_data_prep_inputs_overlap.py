"""An output never is nor holds an input (--overwrite would delete it), no text reaches two splits or two
sources (links, hard links, copies, overlapping globs), files this user may not read or write are one line,
CR and CRLF survive the text-keeping options, and mix refuses a corpus given twice and breaks ties by weight.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from corpus_helpers import make_corpus, small_bpe_tokenizer, split_ids, synthetic_stream, tricky_text
from data_prep.cli import main
from txl_dist.data.format import Layout, read_manifest

ROOT = Path(__file__).resolve().parents[1]
KEEP_TEXT = ["--normalization", "identity", "--byte-fallback", "--newline-piece", "--no-remove-extra-whitespaces",
             "--no-add-dummy-prefix"]


def run(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


def fail(capsys, *argv, code: int = 2) -> str:
    """Run a command that must fail; return its one error line."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_bpe_tokenizer(tmp_path_factory.mktemp("overlap-tok"))


def texts(folder: Path, n: int = 2) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i}.txt" for i in range(n)]
    for i, p in enumerate(paths):
        p.write_text(tricky_text(300, seed=i), encoding="utf-8")
    return paths


def prepare_args(out, model, *train, extra=()):
    return ["prepare", "--out", out, "--tokenizer-model", model, "--num-proc", 1, "--quiet", *extra,
            "--train", *train]


# ----------------------------------------------------------------------------------------------------
# D1: an output that is or holds an input


def test_overwrite_refuses_an_output_that_holds_its_inputs(model, tmp_path, capsys):
    raw = tmp_path / "raw"
    inputs = texts(raw)
    before = {p: p.read_bytes() for p in inputs}
    msg = fail(capsys, *prepare_args(raw, model, str(raw / "*.txt"), extra=["--overwrite"]))
    assert f"--out {raw} holds the input" in msg and "write the output elsewhere" in msg
    # a folder above the input, and the tokenizer model inside the output
    msg = fail(capsys, *prepare_args(tmp_path, model, inputs[0], extra=["--overwrite"]))
    assert "holds the input" in msg and "(--train)" in msg
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(model, corpus / "tok.model")
    msg = fail(capsys, *prepare_args(corpus, corpus / "tok.model", inputs[0], extra=["--overwrite"]))
    assert "(--tokenizer-model)" in msg
    # the same folder by another name: a symlink to it
    (tmp_path / "alias").symlink_to(raw)
    msg = fail(capsys, *prepare_args(tmp_path / "alias", model, inputs[1], extra=["--overwrite"]))
    assert "holds the input" in msg
    assert {p: p.read_bytes() for p in inputs} == before


def test_train_tokenizer_refuses_to_write_over_its_training_text(tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_text(tricky_text(2000), encoding="utf-8")
    data = text.read_bytes()
    msg = fail(capsys, "train-tokenizer", "--out", text, "--overwrite", "--train", text, "--vocab-size", 600,
               "--quiet")
    assert f"--out {text} is the input {text} (--train)" in msg
    os.link(text, tmp_path / "hard.txt")  # the same inode under another name
    msg = fail(capsys, "train-tokenizer", "--out", tmp_path / "hard.txt", "--overwrite", "--train", text,
               "--vocab-size", 600, "--quiet")
    assert "is the input" in msg
    assert text.read_bytes() == data


def test_finalize_and_mix_refuse_an_output_holding_their_inputs(tmp_path, capsys):
    parts = tmp_path / "parts"
    parts.mkdir()
    msg = fail(capsys, "finalize", parts, "--out", parts, "--overwrite", "--quiet")
    assert f"--out {parts} is the input {parts} (parts)" in msg
    a = make_corpus(tmp_path / "mixes" / "a", {"train": synthetic_stream(2000)}, Layout(1, 1))
    (tmp_path / "mixes" / "manifest.json").write_text("{}")  # so that only the overlap can refuse it
    msg = fail(capsys, "mix", "--out", tmp_path / "mixes", "--overwrite", "--source", f"a={a}:1", "--world-size", 1,
               "--n-streams", 1, "--quiet")
    assert "holds the input" in msg and "(--source a)" in msg
    assert (a / "manifest.json").is_file()


def test_overwrite_replaces_only_a_corpus_or_an_empty_folder(model, tmp_path, capsys):
    inputs = texts(tmp_path / "raw")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    msg = fail(capsys, *prepare_args(out, model, inputs[0], extra=["--overwrite"]))
    assert f"{out} is not a corpus (no manifest.json) and holds notes.txt" in msg
    assert (out / "notes.txt").read_text() == "keep me"
    (out / "notes.txt").unlink()
    run(*prepare_args(out, model, inputs[0], extra=["--overwrite"]))  # empty: replaced
    run(*prepare_args(out, model, inputs[1], extra=["--overwrite"]))  # a corpus: replaced
    assert read_manifest(out).splits["train"].n_documents == 1


def test_the_current_directory_cannot_be_replaced(model, tmp_path, monkeypatch, capsys):
    inputs = texts(tmp_path / "raw")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    msg = fail(capsys, *prepare_args(".", model, inputs[0], extra=["--overwrite"]))
    assert "current directory" in msg and "cannot be replaced" in msg
    msg = fail(capsys, *prepare_args(tmp_path, model, inputs[0], extra=["--overwrite"]))  # holds it
    assert "cannot be replaced" in msg or "holds the input" in msg


# ----------------------------------------------------------------------------------------------------
# D2: evaluation text reaching training


def test_a_hard_link_or_a_copy_of_an_evaluation_file_is_refused(model, tmp_path, capsys):
    train, valid = texts(tmp_path / "raw")
    os.link(valid, tmp_path / "hard.txt")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, train, tmp_path / "hard.txt",
                                     extra=["--valid", valid]))
    assert f"--valid: {valid} (the same file as {tmp_path / 'hard.txt'}) is also given to --train" in msg
    shutil.copy(valid, tmp_path / "copy.txt")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, train, tmp_path / "copy.txt",
                                     extra=["--valid", valid]))
    assert f"has the same bytes as {tmp_path / 'copy.txt'} (--train)" in msg and str(valid) in msg
    assert "evaluation text would be trained on" in msg
    # A copy across the two evaluation splits trains on neither: the message says what it does do.
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, train, extra=["--valid", valid, "--test",
                                                                           tmp_path / "copy.txt"]))
    assert f"--test: {tmp_path / 'copy.txt'} has the same bytes as {valid} (--valid)" in msg
    assert "valid and test would measure the same text" in msg and "trained on" not in msg
    assert not (tmp_path / "out").exists()


def test_overlapping_globs_of_two_sources_are_refused(model, tmp_path, capsys):
    texts(tmp_path / "many", 3)
    many = tmp_path / "many"
    msg = fail(capsys, "prepare", "--out", tmp_path / "mix", "--tokenizer-model", model, "--quiet",
               "--source", f"a={many}/0*.txt:1", "--source", f"b={many}/*.txt:1", "--valid-fraction", 0.3)
    assert f"--source b: {many / '0.txt'} is also given to --source a" in msg


def test_a_glob_and_a_symlink_to_its_file_name_both(model, tmp_path, capsys):
    raw = tmp_path / "raw"
    texts(raw, 1)
    (raw / "link.txt").symlink_to(raw / "0.txt")
    msg = fail(capsys, *prepare_args(tmp_path / "out", model, str(raw / "*.txt")))
    assert f"{raw / 'link.txt'} and {raw / '0.txt'} are the same file" in msg


# ----------------------------------------------------------------------------------------------------
# D3: files this user may not read or write (root ignores permission bits: the commands then run without
# the capabilities that let it)

UNPRIVILEGED = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
                "-dac_override,-dac_read_search"]
DRIVER = """
import json, sys
from data_prep.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    rc = main(argv)
    results.append(rc)
    print("--end--", file=sys.stderr, flush=True)
print(json.dumps(results))
"""


def run_unprivileged(cases: list[list]) -> list[tuple[int, list[str]]]:
    """Run the commands in one process that may not override file permissions: [(exit status, stderr lines)]."""
    prefix = UNPRIVILEGED if os.geteuid() == 0 else []
    if prefix and subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root and setpriv cannot drop CAP_DAC_OVERRIDE here: permission bits are ignored")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([*prefix, sys.executable, "-c", DRIVER, json.dumps([[str(a) for a in c] for c in cases])],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    errs = [[line for line in chunk.strip().splitlines() if line] for chunk in done.stderr.split("--end--")]
    return list(zip(codes, errs))


def test_unreadable_and_unwritable_files_are_one_line(model, tmp_path):
    corpus = make_corpus(tmp_path / "c1", {"train": synthetic_stream(2000)}, Layout(1, 1))
    (corpus / "manifest.json").chmod(0)
    corpus2 = make_corpus(tmp_path / "c2", {"train": synthetic_stream(2000)}, Layout(1, 1))
    (corpus2 / "tokenizer.model").chmod(0)
    corpus3 = make_corpus(tmp_path / "c3", {"train": synthetic_stream(2000)}, Layout(1, 1))
    (corpus3 / "train").chmod(0)
    tok = Path(shutil.copy(model, tmp_path / "tok.model"))
    tok.chmod(0)
    inputs = texts(tmp_path / "raw")
    hidden = tmp_path / "hidden"
    texts(hidden, 1)
    hidden.chmod(0)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro_corpus = make_corpus(ro / "corpus", {"train": synthetic_stream(2000)}, Layout(1, 1))
    good = make_corpus(tmp_path / "good", {"train": synthetic_stream(2000)}, Layout(1, 1))
    ro.chmod(0o555)
    relayout = ["--world-size", 1, "--n-streams", 1, "--quiet", "--no-space-check"]
    cases = {
        "verify manifest": (["verify", corpus], 2, "manifest.json: cannot be read (Permission denied)"),
        "inspect manifest": (["inspect", corpus], 2, "manifest.json: cannot be read (Permission denied)"),
        "relayout manifest": (["relayout", corpus, *relayout], 2, "manifest.json: cannot be read"),
        "verify tokenizer": (["verify", corpus2], 2, "tokenizer.model"),
        "relayout tokenizer": (["relayout", corpus2, *relayout], 2, "tokenizer.model: cannot be read"),
        "verify train": (["verify", corpus3], 2, "Permission denied"),
        "relayout train": (["relayout", corpus3, *relayout], 1, "Permission denied"),
        "prepare tokenizer": (prepare_args(tmp_path / "o1", tok, inputs[0]), 2, "tok.model: cannot be read"),
        "prepare hidden input": (prepare_args(tmp_path / "o2", model, hidden / "0.txt"), 2,
                                 "0.txt: cannot be read (Permission denied)"),
        "prepare read-only": (prepare_args(ro / "out", model, inputs[0]), 2, "does not let this user create"),
        "train-tokenizer read-only": (["train-tokenizer", "--out", ro / "t.model", "--train", inputs[0],
                                       "--quiet"], 2, "does not let this user create"),
        "mix read-only": (["mix", "--out", ro / "mix", "--source", f"a={good}:1", *relayout[:-1]], 2,
                          "does not let this user create"),
        "relayout read-only": (["relayout", ro_corpus, *relayout], 2, "does not let this user create"),
    }
    try:
        results = run_unprivileged([argv for argv, _, _ in cases.values()])
    finally:
        ro.chmod(0o755)
        hidden.chmod(0o755)
        (corpus3 / "train").chmod(0o755)
    for (name, (_, code, words)), (rc, err) in zip(cases.items(), results):
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (name, err)
        assert rc == code, (name, rc, err)
    assert sorted(p.name for p in ro.iterdir()) == ["corpus"]


# ----------------------------------------------------------------------------------------------------
# D5: CR and CRLF are kept


def test_cr_and_crlf_round_trip_with_the_text_keeping_options(tmp_path):
    text = tricky_text(3000, seed=5).replace("\u2581", "_")
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(text.replace("\r\n", "\n").replace("\n", "\r\n").encode())
    cr = tmp_path / "cr.txt"
    cr.write_bytes(b"\xef\xbb\xbf" + "one\rtwo\r\rthree\r\n".encode())  # lone CRs, and a BOM (dropped)
    out = tmp_path / "c"
    run("prepare", "--out", out, "--train", crlf, cr, "--vocab-size", 500, "--model-type", "bpe",
        "--character-coverage", 1.0, *KEEP_TEXT, "--num-proc", 1, "--quiet")
    m = read_manifest(out)
    assert m.splits["train"].n_bytes == crlf.stat().st_size + cr.stat().st_size - 3
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    ids = split_ids(out, "train")
    ends = np.flatnonzero(ids == m.tokenizer.eod_id)
    docs = [sp.decode(d.tolist()) for d in np.split(ids, ends + 1)[:-1]]
    docs = [d.replace(sp.id_to_piece(m.tokenizer.eod_id), "") for d in docs]
    assert docs == [crlf.read_bytes().decode(), "one\rtwo\r\rthree\r\n"]


def test_line_docs_still_split_at_cr_and_crlf(model, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes(b"a b\r\nc d\re f\ng h\n")
    run(*prepare_args(tmp_path / "c", model, path, extra=["--line-docs"]))
    assert read_manifest(tmp_path / "c").splits["train"].n_documents == 4


# ----------------------------------------------------------------------------------------------------
# D7: messages


def test_messages_say_what_is_wrong(model, tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n\t\n  \n")
    msg = fail(capsys, "train-tokenizer", "--out", tmp_path / "t.model", "--train", blank, "--quiet")
    assert "the training text has no non-empty line" in msg
    inputs = texts(tmp_path / "raw", 1)
    msg = fail(capsys, *prepare_args(tmp_path / "o", tmp_path / "raw", inputs[0]))
    assert "is a folder; give the model file" in msg
    msg = fail(capsys, "verify", inputs[0])
    assert f"{inputs[0]}: is a file, not a corpus folder" in msg
    if Path("/proc/self/status").is_file():
        msg = fail(capsys, *prepare_args(tmp_path / "o", model, "/proc/self/status"))
        assert "/proc/self/status: is not a regular file of text" in msg


# ----------------------------------------------------------------------------------------------------
# D8: mix


def test_mix_refuses_one_corpus_under_two_names(tmp_path, capsys):
    a = make_corpus(tmp_path / "A", {"train": synthetic_stream(2000)}, Layout(1, 1))
    layout = ["--world-size", 1, "--n-streams", 1, "--quiet"]
    msg = fail(capsys, "mix", "--out", tmp_path / "m", "--source", f"a={a}:1", "--source", f"b={a}:1", *layout)
    assert f"--source b: {a} is the corpus of source a" in msg
    msg = fail(capsys, "mix", "--out", tmp_path / "m", "--source", f"a={a}:1", "--source", f"b={a}/:1", *layout)
    assert "is the corpus of source a" in msg
    copy = tmp_path / "B"  # a copy of A: accepted before, and mixed twice
    shutil.copytree(a, copy)
    msg = fail(capsys, "mix", "--out", tmp_path / "m", "--source", f"a={a}:1", "--source", f"b={copy}:1", *layout)
    assert f"--source b: {copy} holds the train tokens of source a ({a}; tokens_sha256 " in msg
    assert not (tmp_path / "m").exists()


def test_ties_go_to_the_largest_weight(tmp_path):
    """Every source starts at 0 tokens, a tie: the largest weight goes first, whatever the seed (the seeded
    order alone started with the negligible source's one long document for some seeds). A tie can only put a
    source first, not give it a share: the tiny source still comes next, being furthest behind its share."""
    from txl_dist.data.mixture import read_documents

    long_doc = np.concatenate([np.full(5000, 7), [3]])  # one document (eod 3 in corpus_helpers)
    tiny = make_corpus(tmp_path / "tiny", {"train": long_doc}, Layout(1, 1))
    big = make_corpus(tmp_path / "big", {"train": synthetic_stream(4000, seed=1)}, Layout(1, 1))
    for seed in range(4):
        out = tmp_path / f"m{seed}"
        run("mix", "--out", out, "--source", f"tiny={tiny}:1e-320", "--source", f"big={big}:1",
            "--train-tokens", 2, "--seed", seed, "--world-size", 1, "--n-streams", 1, "--quiet")
        m = read_manifest(out)
        _, sources = read_documents(out, m)
        assert sources.tolist() == [1], (seed, sources)  # the first document, which reaches the 2 tokens asked
        assert {s.name: s.tokens for s in m.mixture.sources}["tiny"] == 0
