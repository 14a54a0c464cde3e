"""Atomic folder outputs: work happens in a hidden temporary folder renamed over the target at the end."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from txl_dist.atomic import current_umask

from data_prep.errors import PrepError


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing output unless overwrite is set (checked before any work starts)."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise PrepError(f"{out} already exists; pass --overwrite to replace it")
        if not out.is_dir():
            raise PrepError(f"{out} exists and is not a folder; remove it or choose another output")


@contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; when the block succeeds it becomes `out`.

    On any error the temporary folder is removed and `out` is left as it was, so a reader never sees a
    half-written output. The temporary folder is a sibling so that the final rename stays on one file system.
    """
    out = Path(out)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    # mkdtemp makes the folder private (0700); an output folder gets the usual permissions.
    os.chmod(tmp, 0o777 & ~current_umask())
    try:
        yield tmp
        check_output(out, overwrite)  # someone may have created it meanwhile
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move folder src to dst, replacing an existing dst (renamed aside first, then deleted)."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.rename(dst, old / dst.name)
        os.rename(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, dst)
