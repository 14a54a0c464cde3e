"""Where an output may go and which inputs are the same file: checks made before any work.

Two names are one file when they resolve to the same path (symlinks followed) or when they have the same
(st_dev, st_ino): a hard link, or a folder reached through a bind mount, has another path but is the same file.
An output replaced with --overwrite is deleted as a whole, so it must neither be nor hold an input.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from data_prep.errors import PrepError
from txl_dist.output_paths import probe_create, same_place


def identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` names (links followed), None where it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _holder(out: Path, path: Path, out_id: tuple[int, int] | None, ids: dict[Path, tuple[int, int] | None]) -> bool:
    """Whether `out` is `path` or one of the folders above it. `ids` caches the identities of those folders:
    many inputs share them."""
    real = path.resolve()
    chain = [real, *real.parents]
    if out.resolve() in chain:
        return True
    if out_id is None:  # an output that does not exist holds nothing
        return False
    for folder in chain:
        if folder not in ids:
            ids[folder] = identity(folder)
        if ids[folder] == out_id:
            return True
    return False


def check_output_apart(out: Path, inputs: Iterable[tuple[str, Path]], out_option: str = "--out") -> None:
    """Refuse an output that is an input or holds one (`inputs`: (option, path) pairs): replacing the output
    would delete the input, and writing a file over its own training text would destroy it."""
    out = Path(out)
    out_id = identity(out)
    ids: dict[Path, tuple[int, int] | None] = {}
    for option, path in inputs:
        if not _holder(out, Path(path), out_id, ids):
            continue
        what = "is" if same_place(out, path) else "holds"
        raise PrepError(f"{out_option} {out} {what} the input {path} ({option}); the output is replaced as a "
                        "whole, which would delete it: write the output elsewhere")


def check_not_current_dir(out: Path) -> None:
    """The current directory (or a folder above it) cannot be replaced: renaming `.` fails (EBUSY), and a
    replaced ancestor would leave the job and the shell in a deleted folder."""
    cwd = Path.cwd().resolve()
    if out.resolve() == cwd or out.resolve() in cwd.parents:
        raise PrepError(f"{out} is the current directory or holds it, which cannot be replaced; run the "
                        "command from another folder or choose another output")


def nearest_existing(path: Path) -> Path:
    """`path`, else the nearest folder above it that exists (where a new output would be created)."""
    folder = Path(os.path.abspath(path))
    while not os.path.lexists(folder) and folder.parent != folder:
        folder = folder.parent
    return folder


def check_writable_parent(out: Path) -> None:
    """The output is built in a scratch folder beside it and renamed into place: the folder that holds it must
    let this user create files, found out by creating one (output_paths.probe_create: os.access says yes to
    root). A read-only file system is left to the write's own fault line (errors.py)."""
    parent = nearest_existing(Path(os.path.abspath(out)).parent)
    if not parent.is_dir():  # the probe would only say "Not a directory", and changing permissions cannot help
        raise PrepError(f"{out}: cannot be written: {parent} is {not_a_folder(parent)}; "
                        "choose another output")
    try:
        probe_create(parent)
    except OSError as e:
        if e.errno != errno.EROFS:
            raise PrepError(f"{out}: cannot be written: {parent} does not let this user create files "
                            f"({e.strerror or e}); change its permissions or choose another output") from None


def not_a_folder(path: Path) -> str:
    """What `path`, which exists (as a name at least) but is no folder, is instead."""
    if path.is_file():
        return "a file, not a folder"
    if path.is_symlink() and not path.exists():
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    return "not a folder"


def cannot_read(path: Path, error: OSError, fix: str = "check its permissions") -> PrepError:
    """The refusal of an input that exists but cannot be read (permissions, an unsearchable folder)."""
    name = Path(os.fsdecode(error.filename)) if error.filename is not None else path
    return PrepError(f"{name}: cannot be read ({error.strerror or error}); {fix}")


def read_corpus_manifest(corpus_dir: str | os.PathLike):
    """read_manifest, with one-line refusals for a file given as the corpus folder and for a manifest this
    user cannot read (both found before any work)."""
    from txl_dist.data.format import read_manifest

    corpus_dir = Path(corpus_dir)
    if corpus_dir.is_file():
        raise PrepError(f"{corpus_dir}: is a file, not a corpus folder; give the folder that holds manifest.json")
    try:
        return read_manifest(corpus_dir)
    except OSError as e:
        raise cannot_read(corpus_dir / "manifest.json", e) from None
