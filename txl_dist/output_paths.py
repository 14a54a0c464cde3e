"""Output locations, checked before any work: launch/export.py, launch/eval.py --json-out, the interop CLI and
the MLflow tracker's folder refuse a place they cannot write (one line naming it) before they load weights,
evaluate or touch a store, instead of failing there with a traceback.

Nothing is created by a check. Standard library and txl_dist.errors only (and txl_dist.run_dir's names, imported
by the check that needs them: run_dir imports this module): every package may import this. Whether a place can
be written is found out by making and removing a temporary entry there: os.access says yes to nearly
everything for root, and knows nothing of read-only mounts or of /proc.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from txl_dist.errors import Refused

PROBE_PREFIX = ".txl-probe-"


class OutputError(Refused, ValueError):
    """An output location that cannot be written, or two outputs that would overwrite each other's files."""


def check_output_folder(path: str | os.PathLike, flag: str) -> Path:
    """The folder `path` (made later, with its parents) can be made and written; else OutputError.

    Refused: an existing path that is not a folder, a path below a regular file, a place that cannot be
    written (read-only, /proc, no permission), a folder in a checkpoint, a run's checkpoints/ or a corpus.
    `flag` names the option in the message, e.g. '--out'.
    """
    if not str(path).strip():
        raise OutputError(f"{flag}: an empty path names no folder; give one, e.g. exported/my-model")
    out = Path(path)
    if os.path.lexists(out) and not out.is_dir():  # a file, or a link to nothing
        raise OutputError(f"{flag} {path}: exists and is not a folder; choose another path")
    _check_not_in_data((out, *out.resolve().parents), flag, path, "a folder")
    existing = next((p for p in (out, *out.parents) if _exists(p, flag, path)), Path("."))
    if not existing.is_dir():
        raise OutputError(f"{flag} {path}: cannot be made ({existing} is not a folder); choose another path")
    _probe(existing, flag, path, folder=True)
    return out


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """A file can be written atomically at `path` (a temporary beside it, renamed over it); else OutputError.

    Refused: a folder at `path`, a parent folder that does not exist or is not a folder, one that cannot be
    written, a file in a checkpoint, a run's checkpoints/ or a corpus (eval --json-out C/manifest.json would
    replace the corpus' manifest), a run's own file (RUN/config.resolved.json) or one in a folder the run writes
    (RUN/logs/, RUN/tracking/). The parent is not made: a mistyped folder is more likely than a wanted new one.
    """
    if not str(path).strip():
        raise OutputError(f"{flag}: an empty path names no file; give one, e.g. result.json")
    out = Path(path)
    if _exists(out, flag, path) and out.is_dir():
        raise OutputError(f"{flag} {path}: is a folder; name a file, e.g. {out / 'result.json'}")
    parent = out.parent
    if not _exists(parent, flag, path):
        raise OutputError(f"{flag} {path}: the folder {parent} does not exist; make it first or choose another "
                          "path")
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: {parent} is not a folder; choose another path")
    _check_not_in_data((parent.resolve(), *parent.resolve().parents), flag, path, "a file")
    _check_not_a_run_file(out.resolve(), flag, path)
    _probe(parent, flag, path, folder=False)
    return out


def is_checkpoint_tag(folder: Path) -> bool:
    """A checkpoint tag folder (txl_dist.checkpoint: a step_* folder is complete once it holds run.json)."""
    return (folder / "txl_state" / "run.json").is_file()


def is_checkpoint_folder(folder: Path) -> bool:
    """A run's checkpoints/ folder: it holds a checkpoint tag (its `latest` and retention live there)."""
    return folder.name == "checkpoints" and any(is_checkpoint_tag(tag) for tag in folder.glob("step_*"))


def is_corpus(folder: Path) -> bool:
    """A corpus folder written by `python -m data_prep prepare` (its manifest and tokenizer)."""
    return (folder / "manifest.json").is_file() and (folder / "tokenizer.model").is_file()


def _check_not_in_data(folders: tuple[Path, ...], flag: str, path: str | os.PathLike, what: str) -> None:
    """Refuse an output (`what`: "a folder" or "a file") whose `folders` (the output folder or a file's folder,
    then their parents) include a checkpoint tag, a run's checkpoints/ folder or a corpus: it would replace or
    sit among files that are checksummed (a tag's run.json, the corpus' manifest) or pruned by retention."""
    for folder in folders:
        if is_checkpoint_tag(folder):
            raise OutputError(f"{flag} {path}: lies in the checkpoint {folder}; its files are checksummed and "
                              f"retention removes it: choose {what} outside it")
        if is_checkpoint_folder(folder):
            raise OutputError(f"{flag} {path}: lies in the checkpoint folder {folder} (its tags and `latest`, "
                              f"which retention prunes): choose {what} outside it")
        if is_corpus(folder):
            raise OutputError(f"{flag} {path}: lies in the corpus {folder}; choose {what} outside it")


def is_run_folder(folder: Path) -> bool:
    """A folder a training job has used as its run.dir (txl_dist.run_dir: the resolved config or the lock)."""
    from txl_dist.run_dir import LOCK_FILE, RESOLVED_CONFIG

    return (folder / RESOLVED_CONFIG).is_file() or (folder / LOCK_FILE).is_file()


def _check_not_a_run_file(out: Path, flag: str, path: str | os.PathLike) -> None:
    """Refuse a file output (resolved) that would replace a run's own file (its resolved config, its MLflow
    store, its lock) or lie in one of the folders the run writes (its logs, its tracking journal: a resume reads
    them). The run folder itself takes other files (eval --json-out RUN/test.json, as docs/recipes.md does)."""
    from txl_dist.run_dir import OWN_FILES, OWN_FOLDERS

    if out.name in OWN_FILES and is_run_folder(out.parent):
        raise OutputError(f"{flag} {path}: is the run {out.parent}'s own {out.name}; writing there would replace "
                          "it: choose another file name")
    for folder in out.parents:
        if folder.name in OWN_FOLDERS and is_run_folder(folder.parent):
            raise OutputError(f"{flag} {path}: lies in {folder.name}/ of the run {folder.parent}, which the run "
                              "writes: choose a file outside it")


def check_distinct_folders(first: str | os.PathLike, first_flag: str, second: str | os.PathLike, second_flag: str,
                           why: str) -> None:
    """OutputError when the two paths name the same folder (same_place)."""
    if same_place(first, second):
        raise OutputError(f"{first_flag} {first} and {second_flag} {second} are the same folder ({why}); give "
                          "each its own folder")


def same_place(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Whether two paths name one file or folder: the same path once resolved ('.', '..', a trailing '/',
    symlinks), or the same device and inode (a hard link, a folder under a bind mount, which resolve() keeps
    apart); False when either cannot be looked up."""
    a, b = Path(first), Path(second)
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _exists(candidate: Path, flag: str, path: str | os.PathLike) -> bool:
    # Path.exists raises for a place this user may not even look into (no search permission).
    try:
        candidate.stat()
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot be written ({e.strerror or type(e).__name__}: {candidate}); "
                          "choose another path") from None


def probe_create(where: Path, *, folder: bool = True) -> None:
    """Make and remove a temporary folder (or file) in the existing folder `where`; the OSError of a place
    this process cannot create in (permissions, a read-only mount, /proc), whatever os.access would say."""
    if folder:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=where))
    else:
        fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=where)
        os.close(fd)
        os.unlink(name)


def _probe(where: Path, flag: str, path: str | os.PathLike, *, folder: bool) -> None:
    try:
        probe_create(where, folder=folder)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot be written ({e.strerror or type(e).__name__}: {where}); choose "
                          "another path") from None
