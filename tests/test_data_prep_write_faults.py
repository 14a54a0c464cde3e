"""A fault while a data_prep job writes its output (a full disk, a quota, an I/O error, a read-only file system)
ends the job with one `error:` line naming the file and the problem, exit status 1 (a fault, not a refusal),
and the temporary output removed: through the real CLI `main()`, with the writer failing (monkeypatched) and,
where this process may mount one, on a real 256 KiB tmpfs that fills up.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from corpus_helpers import make_corpus, small_bpe_tokenizer, synthetic_stream, tricky_text
from data_prep.cli import main
from txl_dist.data import arrow_io
from txl_dist.data.format import Layout, read_manifest
from txl_dist.errors import EXIT_FAILED


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_bpe_tokenizer(tmp_path_factory.mktemp("write-fault-tok"))


@pytest.fixture
def text_input(tmp_path) -> Path:
    path = tmp_path / "raw" / "a.txt"
    path.parent.mkdir()
    path.write_text(tricky_text(60_000, seed=3), encoding="utf-8")  # ~300 KB: more than the small tmpfs holds
    return path


def failing_writes(monkeypatch, code: int) -> None:
    """Every token file write fails as the file system would: an OSError without a filename."""
    def write(self, b):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(arrow_io._HashingSink, "write", write)


def one_fault_line(capsys, argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def prepare_args(out, model, text_input):
    return ["prepare", "--out", out, "--train", text_input, "--tokenizer-model", model, "--num-proc", 1, "--quiet",
            "--no-space-check"]


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "free space on /"), (errno.EDQUOT, "quota"),
                                          (errno.EIO, "I/O error"), (errno.EROFS, "read-only")])
def test_a_failing_write_in_prepare_is_one_line_and_exit_1(model, text_input, tmp_path, monkeypatch, capsys,
                                                          code, advice):
    failing_writes(monkeypatch, code)
    line = one_fault_line(capsys, prepare_args(tmp_path / "out", model, text_input))
    assert f"[Errno {code}] {os.strerror(code)}" in line and advice in line, line
    assert ".arrow.tmp: " in line and str(tmp_path) in line, line  # names the file being written
    assert line.endswith("choose another --out"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no output, no temporary folder left


def test_a_failing_write_in_relayout_keeps_the_corpus(tmp_path, monkeypatch, capsys):
    corpus = make_corpus(tmp_path / "corpus", {"train": synthetic_stream(4000)}, Layout(2, 8))
    before = read_manifest(corpus).to_dict()
    failing_writes(monkeypatch, errno.ENOSPC)
    line = one_fault_line(capsys, ["relayout", corpus, "--world-size", 4, "--n-streams", 8, "--quiet",
                                   "--no-space-check"])
    assert "[Errno 28] No space left on device; free space on /" in line and "another file system" in line, line
    assert read_manifest(corpus).to_dict() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_other_os_errors_keep_their_traceback(model, text_input, tmp_path, monkeypatch):
    """Only the faults of writing are one line: another OSError is a bug to see whole."""
    failing_writes(monkeypatch, errno.EBADF)
    with pytest.raises(OSError, match="Bad file descriptor"):
        main([str(a) for a in prepare_args(tmp_path / "out", model, text_input)])


def test_prepare_onto_a_really_full_file_system(model, text_input, small_file_system, capsys):
    line = one_fault_line(capsys, prepare_args(small_file_system / "out", model, text_input))
    assert "[Errno 28] No space left on device" in line and f"free space on {small_file_system}" in line, line
    assert line.startswith(f"error: {small_file_system}"), line
    assert list(small_file_system.iterdir()) == []  # the temporary output is gone, the space free again
