"""Remembered sha256 checks: a training job hashes a corpus file once, not at every start.

A loader checks the sha256 of every file it opens (manifest.sha256_file). At tens of GB per rank that is
minutes of reading at each start, and a job requeued at every time limit starts often. While a HashRecord is
in use (`with record.in_use():`), sha256_file answers from the record for a file whose path, inode, size and
modification time are those it was hashed at, and hashes (and remembers) any other. `save()` writes what was
hashed, one small JSON file per corpus file, each atomically: ranks that hashed the same file leave one whole
entry. A file changed in place with its size and modification time kept is not noticed on later starts; its
first start noticed anything before.

The ranks of one start can share the hashing (txl_dist/startup.py): each hashes its share, and `take()` hands
the others' digests to this record, which answers with one only where the file here has the identity the
hashing rank saw (a node-local copy of the corpus is hashed by its own rank).

Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from txl_dist.atomic import atomic_write

RECORD_VERSION = 1
_active: HashRecord | None = None


def _identity(st: os.stat_result) -> list[int]:
    # Not st_dev: an NFS client numbers its mounts itself, so nodes see one file under different devices.
    return [st.st_ino, st.st_size, st.st_mtime_ns]


class HashRecord:
    """The sha256 of files as they were when hashed, kept in `folder` (created by save())."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._new: dict[str, dict] = {}
        self.hashed: list[str] = []
        """Files hashed while in use (not answered from the saved record), in order."""
        self.remembered: set[str] = set()
        """Files (real paths) answered from the saved record."""
        self._taken: dict[str, dict] = {}
        self.taken: set[str] = set()
        """Files (real paths) answered with another rank's digest from this start (take())."""

    def _entry_file(self, real: str) -> Path:
        return self.folder / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")

    def sha256(self, path: str | os.PathLike, compute: Callable[[], str]) -> str:
        """The recorded sha256 of `path` when the file is as it was then, else compute() (remembered)."""
        real = os.path.realpath(path)
        identity = _identity(os.stat(real))
        new = self._new.get(real)
        if new is not None and new["identity"] == identity:  # hashed in this start already
            return new["sha256"]
        taken = self._taken.get(real)
        if taken is not None and taken["identity"] == identity:
            self.taken.add(real)
            return taken["sha256"]
        if (recorded := self._recorded(real, identity)) is not None:
            self.remembered.add(real)
            return recorded
        digest = compute()
        if _identity(os.stat(real)) == identity:  # changed while it was read: remember nothing
            self._new[real] = {"version": RECORD_VERSION, "path": real, "identity": identity, "sha256": digest}
        self.hashed.append(str(path))
        return digest

    def answers(self, path: str | os.PathLike) -> bool:
        """Whether the saved record answers for `path` as the file is now (so it needs no hashing)."""
        real = os.path.realpath(path)
        try:
            identity = _identity(os.stat(real))
        except OSError:
            return False
        return self._recorded(real, identity) is not None

    def hashed_entries(self) -> dict[str, dict]:
        """What this record hashed in this start (by real path), for take() on the other ranks."""
        return dict(self._new)

    def take(self, entries: dict[str, dict]) -> None:
        """Digests another rank computed in this start (its hashed_entries()): sha256() answers with one when
        the file has the same identity here. They are not saved by this record (the hashing rank saves them)."""
        for real, entry in entries.items():
            if real not in self._new:
                self._taken[real] = entry

    def _recorded(self, real: str, identity: list[int]) -> str | None:
        entry = self._read(real)
        if entry is not None and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        return None

    def _read(self, real: str) -> dict | None:
        try:
            entry = json.loads(self._entry_file(real).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("version") != RECORD_VERSION or entry.get("path") != real:
            return None
        return entry

    def save(self) -> None:
        """Write what was hashed since the last save (best effort: a failed write only costs a hash later)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for real, entry in self._new.items():
                atomic_write(self._entry_file(real), json.dumps(entry) + "\n")
        except OSError:
            pass
        self._new.clear()

    @contextmanager
    def in_use(self) -> Iterator[HashRecord]:
        """sha256_file answers from this record inside the block."""
        global _active
        previous, _active = _active, self
        try:
            yield self
        finally:
            _active = previous


def active() -> HashRecord | None:
    """The record in use, if any (manifest.sha256_file asks)."""
    return _active
