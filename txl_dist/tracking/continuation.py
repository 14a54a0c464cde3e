"""Which MLflow run a job logs to when it resumes, and the run dir's switch to a continuation run.

A job that resumes from a checkpoint normally re-opens the run recorded in <run_dir>/tracking/run_id and
does not log again the steps the journal holds (mlflow_run.py: a crash re-runs them bitwise equal). That
is wrong when the run went past the checkpoint's step in work that is thrown away:

- a rollback: the job resumes from a tag older than tags of the recorded run, which start-up set aside
  (checkpoints/superseded/); the re-run steps differ (often on purpose: a lower lr after a divergence);
- a fork: the job starts a run dir from another run dir's tag.

MLflow cannot delete a logged value, so such a job opens a new run, the continuation, tagged with the run
it continues (``txl.continues_run``, ``txl.continued_at_step``, ``txl.continued_because``); the run it
leaves gets ``txl.continued_by``. The continuation's journal starts with the values the earlier run logged
at steps <= the checkpoint's (the writer sends them), so it shows the whole valid history once.

The folder after a switch (the earlier run's files move, they are never deleted; replay covers them):

    tracking/run_id, uri              the continuation
    tracking/continues.json           {"run_id", "step", "because", "ancestors", "source"}
    tracking/metrics.jsonl            the earlier values at steps <= step, then the continuation's
    tracking/superseded/<run id>/     the earlier run's run_id, uri, metrics.jsonl, delivered.jsonl, outbox/

The switch is staged in tracking/.next/ and committed file by file, run_id last; an interrupted commit is
finished by the next opening (finish_switch). Nothing here imports mlflow.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from txl_dist.atomic import atomic_write

from .errors import TrackingError
from .journal import TrackingFolder, _json_lines

CONTINUES_FILE = "continues.json"
SUPERSEDED_DIR = "superseded"
STAGING_DIR = ".next"
SWITCHED_FILES = ("metrics.jsonl", "delivered.jsonl", "outbox", "uri", CONTINUES_FILE, "run_id")
"""Committed in this order; run_id last: a folder whose run_id is the continuation's is complete."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a job resumes from, as tracking needs it."""

    run_id: str | None
    """The checkpoint's MLflow run (None: saved with tracking off)."""
    step: int
    abandoned_runs: frozenset[str] = frozenset()
    """MLflow runs of this run dir's tags newer than `step` that start-up set aside (a rollback)."""
    source_dir: Path | None = None
    """The run dir the checkpoint belongs to, when it is not this job's (a fork)."""


@dataclasses.dataclass(frozen=True)
class Continues:
    """tracking/continues.json: the run the recorded run continues."""

    run_id: str | None
    step: int
    because: str
    ancestors: tuple[str, ...] = ()
    """run_id and the runs it continued, nearest first."""
    source: str | None = None
    """A fork's source run dir."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self) | {"ancestors": list(self.ancestors)}, indent=1) + "\n"


def read_continues(folder: TrackingFolder) -> Continues | None:
    path = folder.dir / CONTINUES_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return Continues(record["run_id"], int(record["step"]), str(record["because"]),
                         tuple(record.get("ancestors") or ()), record.get("source"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrackingError(f"tracking: cannot read {path} ({type(e).__name__}: {e}); it is written by the training "
                            "job when it starts a continuation run: restore it or remove the tracking folder") from None


@dataclasses.dataclass(frozen=True)
class Opening:
    """What the tracker opens: the recorded run again, the checkpoint's run, a new run, or a continuation."""

    kind: str
    """"reopen" (run_id), "new", or "continue" (a new run continuing `continues`)."""
    run_id: str | None = None
    continues: Continues | None = None
    history: Path | None = None
    """The tracking folder whose journal holds the continued run's values (None: none to copy)."""


def plan_opening(folder: TrackingFolder, point: ResumePoint | None) -> Opening:
    """Decide which run this job logs to (the module docstring); TrackingError when the checkpoint belongs to
    no run of this run dir's lineage."""
    recorded = folder.recorded_run_id()
    if point is None:
        return Opening("reopen", recorded) if recorded else Opening("new")
    earlier = read_continues(folder) if recorded else None
    if point.source_dir is not None and (recorded is None or recorded != point.run_id):
        return _plan_fork(folder, point, recorded, earlier)  # (the same run: a copy of this run dir's tags)
    if recorded is None:
        if point.run_id is not None and point.run_id in point.abandoned_runs:
            return Opening("continue", continues=Continues(point.run_id, point.step, "rollback"))
        return Opening("reopen", point.run_id) if point.run_id else Opening("new")
    ancestors = earlier.ancestors if earlier else ()
    if point.run_id not in (None, recorded, *ancestors):
        raise TrackingError(
            f"tracking: the checkpoint's MLflow run {point.run_id} is not the run {recorded} recorded in "
            f"{folder.run_id_file} (nor one it continues); resume from a checkpoint of this run dir, or remove "
            f"{folder.dir}")
    same_continuation = earlier is not None and (point.run_id, point.step) == (earlier.run_id, earlier.step)
    went_past = recorded in point.abandoned_runs or (point.run_id in ancestors and not same_continuation)
    if not went_past:
        return Opening("reopen", recorded)
    return Opening("continue", continues=Continues(recorded, point.step, "rollback", (recorded, *ancestors)),
                   history=folder.dir)


def _plan_fork(folder: TrackingFolder, point: ResumePoint, recorded: str | None,
               earlier: Continues | None) -> Opening:
    if recorded is not None:
        if earlier is not None and (earlier.run_id, earlier.step) == (point.run_id, point.step):
            return Opening("reopen", recorded)  # the fork's first job ended before its first checkpoint
        raise TrackingError(
            f"tracking: {folder.dir} belongs to MLflow run {recorded}, and the checkpoint is from another run dir "
            f"({point.source_dir}); start the fork in a new run.dir, or remove {folder.dir}")
    source = TrackingFolder(point.source_dir)
    source_run = source.recorded_run_id()
    source_lineage = (source_run, *(c.ancestors if (c := read_continues(source)) else ())) if source_run else ()
    history = source.dir if point.run_id is not None and point.run_id in source_lineage else None
    return Opening("continue", continues=Continues(point.run_id, point.step, "fork", tuple(source_lineage),
                                                   str(point.source_dir)), history=history)


# ----------------------------------------------------------------------------------------------------
# The switch


def stage_switch(folder: TrackingFolder, new_run_id: str, shown_uri: str, continues: Continues,
                 history: Path | None) -> int:
    """Write the continuation's files into tracking/.next/ (run_id last); returns the values copied."""
    staging = folder.dir / STAGING_DIR
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    copied = 0
    with open(staging / "metrics.jsonl", "w", encoding="utf-8") as out:
        seq = 0
        for record in _json_lines(history / "metrics.jsonl") if history is not None else ():
            try:
                step, metrics = int(record["step"]), dict(record["metrics"])
            except (KeyError, TypeError, ValueError):
                continue
            if step > continues.step or not metrics:
                continue
            seq += 1
            copied += len(metrics)
            out.write(json.dumps({"seq": seq, "step": step, "time": record.get("time", 0), "metrics": metrics},
                                 separators=(",", ":")) + "\n")
        out.flush()
        os.fsync(out.fileno())
    (staging / "delivered.jsonl").touch()
    (staging / "outbox").mkdir()
    atomic_write(staging / "uri", shown_uri + "\n")
    atomic_write(staging / CONTINUES_FILE, continues.to_json())
    atomic_write(staging / "run_id", new_run_id + "\n")
    return copied


def finish_switch(folder: TrackingFolder) -> bool:
    """Commit a staged switch (or finish one a crash interrupted): each earlier file moves to
    superseded/<its run id>/, the staged one takes its place. A staging folder without run_id is an
    interrupted staging: removed. True if a switch was committed."""
    staging = folder.dir / STAGING_DIR
    if not staging.is_dir():
        return False
    if not (staging / "run_id").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        return False
    # run_id moves last, so until the commit ends the recorded run is the one the folder leaves.
    aside = folder.dir / SUPERSEDED_DIR / (folder.recorded_run_id() or "no-run")
    for name in SWITCHED_FILES:
        staged = staging / name
        if not staged.exists():
            continue  # committed before a crash
        current = folder.dir / name
        if current.exists():
            aside.mkdir(parents=True, exist_ok=True)
            os.replace(current, _free_name(aside / name))
        os.replace(staged, current)
    shutil.rmtree(staging, ignore_errors=True)
    return True


def _free_name(path: Path) -> Path:
    """path, or path.1, path.2, ... when a file of that name is already set aside."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def superseded_folders(folder: TrackingFolder) -> list[TrackingFolder]:
    """The tracking folders of the runs this run dir's continuations left (for replay)."""
    root = folder.dir / SUPERSEDED_DIR
    if not root.is_dir():
        return []
    return [TrackingFolder.at(d) for d in sorted(root.iterdir()) if d.is_dir() and (d / "run_id").is_file()]
