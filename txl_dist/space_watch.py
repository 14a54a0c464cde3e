"""An early warning that the next checkpoint will not fit.

A save checks the free space only when it is due: on a long checkpoint interval, a run folder's disk that
fills (another job, the run's own logs, a quota) is found hours later, and the job then ends with every step
since its newest checkpoint lost. Rank 0 looks at each progress line instead (one statvfs call) and warns once
per shortage, naming the step whose save would fail, while there is still time to free space.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .checkpoint import size_text

log = logging.getLogger("txl_dist")

SAVE_MARGIN = 1.05
"""The share of the last checkpoint's size a save requires free (what the save itself checks)."""


def next_save_step(step: int, interval: int, last: int) -> int:
    """The step of the next checkpoint from `step` on: the next multiple of checkpoint.interval (0: none), else
    the job's last step; `step` itself when it saves (the trainer looks at the space before that step's save)."""
    if interval:
        return min(last, -(-step // interval) * interval)
    return last


class SpaceWatch:
    """Warns (rank 0) when the checkpoints' file system no longer holds the next checkpoint; once per shortage:
    it warns again only after the space came back and ran out again."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.warned = False

    def check(self, need_bytes: int, step: int, save_step: int, since: str) -> None:
        """need_bytes: the expected checkpoint size; save_step: the step of the next save; since: what that save
        failing would lose, e.g. 'the steps since step 1000'."""
        if save_step <= step:  # this step's save comes next, checks the space itself and says what it lacks
            return
        need = int(need_bytes * SAVE_MARGIN)
        try:  # before the first save the folder may not exist yet: its run folder's file system then
            free = shutil.disk_usage(self.folder if self.folder.is_dir() else self.folder.parent).free
        except OSError:  # the folder is being replaced (retention) or its mount is gone: the save will say
            return
        if free >= need:
            self.warned = False
            return
        if not self.warned:
            self.warned = True
            log.warning("step %d: %s has %s free, the next checkpoint (step %d) needs about %s: free space before "
                        "then, or that save fails and the job ends, losing %s", step, self.folder, size_text(free),
                        save_step, size_text(need), since)
