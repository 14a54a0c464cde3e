"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one.

Standard library only, so every package (data, checkpoint, interop, data_prep) can share it.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` for any writer (torch.save, safetensors, ...); on success it is
    fsynced, given the usual permissions (0666 minus the umask, not mkstemp's private 0600) and renamed over
    `path`; on failure it is removed and `path` is left as it was."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write text (UTF-8) or bytes to `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def fsync_file(path: str | os.PathLike) -> None:
    """Force a file's data to disk (written by a library that does not, such as torch.save)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (files created or renamed in it) durable; a no-op where folders cannot be
    opened for it (not POSIX)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; the rename itself was still made
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    # os.umask can only be read by setting it; put it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
