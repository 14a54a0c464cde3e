"""Sharded checkpoints: saved atomically with checksums, verified before use, never lost to retention.

Layout of <run.dir>/checkpoints:
```
step_NNNNNNNN/...                      DeepSpeed's files (engine.save_checkpoint(..., save_latest=False))
step_NNNNNNNN/txl_state/rank-RRRRR.pt  one per rank: mems by global stream id, loader state, RNG states
step_NNNNNNNN/txl_state/run.json       written last: step, layout, digests, MLflow run id, and the size and
                                       sha256 of every file of the tag (the completeness marker)
step_NNNNNNNN_universal/               DeepSpeed's universal form, made when the world size changes; its
                                       txl_state/universal.json (written last) records the size and sha256 of
                                       its files and the tag's run.json it was made from; verified before use,
                                       made again when it does not verify (derived data, never trusted as is)
latest                                 the tag saved last (for people and tools; resume does not trust it, and a
                                       `latest` that names no tag is ignored and rewritten by the next save)
zero_to_fp32.py, zero_to_torch.py      DeepSpeed's consolidation scripts, copied in by its saves
.saving-step_NNNNNNNN/                 a save in progress; left behind only by a crash, removed at the next start
superseded/step_.../                   tags newer than the point a job rolled back to, moved aside, never deleted
```
The save protocol (collective): every rank writes into `.saving-<tag>/` (DeepSpeed's files and its own state
file); the ranks hash the files between them and fsync them; rank 0 writes run.json, fsyncs the folder,
renames it to `<tag>` (an existing `<tag>` is moved aside first and removed only once the new one is in
place), fsyncs the parent, then writes `latest` and prunes. A folder named `step_*` with a run.json is
therefore complete; a crash at any point leaves the previous complete tags and `latest` as they were.

A failure on any rank during a save (ENOSPC, an I/O error) is reported by every rank as one RunFailed line;
DeepSpeed's own writes are routed through a recorder so that a rank whose write failed still takes part in
DeepSpeed's remaining collectives instead of leaving the others waiting.

Resume (`--resume auto`) takes the newest complete tag whatever `latest` says, verifies its checksums (the
ranks share the hashing) and, with checkpoint.fallback, falls back to older tags that verify. A load on
another world size reads the tag's universal copy only once that verifies against its own record (the same
shared hashing); one that does not is converted again from the tag. Retention
removes only complete tags older than the newest `keep`, after a save has completed, and never one another
job is reading (a shared flock on its run.json, held by evaluation and export from the choice of the tag to
the end of the load: hold_for_reading); tags newer than the point a job resumes from are moved to
superseded/ at start (a rollback), never removed.

DeepSpeed writes `client_state` from data-parallel rank 0 only, so per-rank state needs its own files.
Everything is loaded with weights_only unpickling (txl_dist.safe_load restricts DeepSpeed's own loads).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

import numpy as np
import torch

from . import distributed, watchdog
from .atomic import atomic_path, atomic_write, fsync_dir, fsync_file
from .errors import EXIT_REFUSED, Refused, RunFailed, failure_of_the_process, one_line, where_relative
from .host import usable_cpus
from .scratch import owned_scratch, owner_lock, remove_abandoned
from .streams import ranks_holding

LATEST = "latest"
STATE_DIR = "txl_state"
RUN_FILE = "run.json"
UNIVERSAL_SUFFIX = "_universal"
UNIVERSAL_SCRATCH = "tmp"
"""The kind of a conversion's owned scratch folder: .step_NNNNNNNN_universal.tmp-* (txl_dist.scratch)."""
UNIVERSAL_RECORD = "universal.json"
"""In a universal copy's txl_state/: its files' sizes and sha256, written last (a copy without it is incomplete)."""
UNIVERSAL_RECORD_VERSION = 1
STAGING_PREFIX = ".saving-"
REPLACED_PREFIX = ".replaced-"
PRUNED_SUFFIX = "-pruned"
"""A tag retention is removing: .replaced-<tag>-pruned (never put back, unlike a replaced tag)."""
SUPERSEDED_DIR = "superseded"
RUN_INFO_VERSION = 2  # version 1 (no checksums, checkpoint.dir in its config) predates run folders


class CheckpointError(Refused, RuntimeError):
    """A checkpoint cannot be used; the message names the path and what to do."""


class SaveFailed(RunFailed):
    """A save could not complete on some rank; the previous complete tags are untouched."""


def tag_for(step: int) -> str:
    """The tag of the checkpoint taken after optimizer step `step`."""
    return f"step_{step:08d}"


def step_of(tag: str) -> int | None:
    """The step in a tag name, None for anything that is not one of our tags."""
    if tag.startswith("step_") and tag[5:].isdigit():
        return int(tag[5:])
    return None


def rank_file(tag_dir: Path, rank: int) -> Path:
    """Where rank `rank` keeps its state in a tag."""
    return Path(tag_dir) / STATE_DIR / f"rank-{rank:05d}.pt"


# ----------------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy (global), torch CPU, and its own CUDA device's when present.

    Only the current device's CUDA state: a rank that sees all of a node's GPUs and one that sees only its own
    (a per-task CUDA_VISIBLE_DEVICES) then save and restore the same thing, its device's generator."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() captured (exact resume: the same dropout masks as an uninterrupted run)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "has_gauss": n["has_gauss"], "gauss": n["gauss"],
                         "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


def seed_rng(seed: int, rank: int, step: int = 0) -> None:
    """Deterministic per-rank RNG streams (a fresh job, or an elastic resume, where states cannot carry over)."""
    words = np.random.SeedSequence([seed, rank, step]).generate_state(2)
    value = int(words[0]) << 32 | int(words[1])
    random.seed(value)
    np.random.seed(int(words[0]))
    torch.manual_seed(value)


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ----------------------------------------------------------------------------------------------------
# What a checkpoint folder holds


@dataclass(frozen=True)
class Inventory:
    """The tags of a checkpoint folder, by what they are (read from the folder, not from `latest`)."""

    complete: list[str]
    """Tags with their run.json, oldest first."""
    incomplete: list[str]
    """step_* folders without run.json (not made by this version's saves; reported, never used)."""
    leftovers: list[str]
    """Interrupted saves and replacements (.saving-*, .replaced-*, half-made universal copies)."""
    latest: str | None
    """The tag `latest` names, if the file exists and names one."""
    latest_problem: str | None = None
    """Why `latest` was ignored (it names no tag of this project), else None."""


def inventory(ckpt_dir: str | os.PathLike) -> Inventory:
    """What `ckpt_dir` holds now (an empty inventory when it does not exist)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return Inventory([], [], [], None)
    complete, incomplete, leftovers = [], [], []
    for p in ckpt_dir.iterdir():
        if leftover_kind(p.name) is not None:
            leftovers.append(p.name)
        elif p.is_dir() and step_of(p.name) is not None:
            (complete if (p / STATE_DIR / RUN_FILE).is_file() else incomplete).append(p.name)
    latest, problem = _read_latest(ckpt_dir)
    return Inventory(sorted(complete, key=step_of), sorted(incomplete, key=step_of), sorted(leftovers), latest,
                     problem)


def read_latest(ckpt_dir: str | os.PathLike) -> str | None:
    """The tag named in CKPT/latest, or None when there is none or it names no tag of this project."""
    return _read_latest(ckpt_dir)[0]


def _read_latest(ckpt_dir: str | os.PathLike) -> tuple[str | None, str | None]:
    """(tag, None), (None, why it is ignored), or (None, None) without a `latest`. Never raises: nothing
    depends on `latest` (resume takes the newest complete tag), so a damaged one must not block a job."""
    path = Path(ckpt_dir) / LATEST
    if not path.is_file():
        return None, None
    try:
        tag = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: cannot be read ({one_line(e)})"
    if step_of(tag) is None:
        return None, f"{path}: names {tag[:40]!r}, not a tag of this project (step_NNNNNNNN)"
    return tag, None


LATEST_TMP_GLOB = f".{LATEST}.*.tmp"
"""atomic_write's temporary file of `latest`: a kill between its creation and its rename leaves it."""


def leftover_kind(name: str) -> str | None:
    """What an entry of a checkpoint folder was left by: 'save' (an interrupted save, its replacement of an older
    tag or its write of `latest`), 'removal' (an interrupted retention), 'conversion' (a killed universal
    conversion's scratch folder), or None for anything else."""
    if name.startswith(REPLACED_PREFIX) and name.endswith(PRUNED_SUFFIX):
        return "removal"
    if name.startswith((STAGING_PREFIX, REPLACED_PREFIX)) or PurePosixPath(name).match(LATEST_TMP_GLOB):
        return "save"
    if name.startswith(".") and UNIVERSAL_SUFFIX in name:
        return "conversion"
    return None


def remove_leftovers(ckpt_dir: str | os.PathLike) -> list[str]:
    """Remove interrupted saves and replacements, and killed conversions (rank 0, at start, before anything is
    written); their names."""
    ckpt_dir = Path(ckpt_dir)
    leftovers, found = inventory(ckpt_dir).leftovers, []
    for name in leftovers:
        if leftover_kind(name) in ("save", "removal"):  # only the job holding the run folder makes these
            path = ckpt_dir / name
            if name.startswith(REPLACED_PREFIX) and leftover_kind(name) == "save":  # a pruned tag stays gone
                _restore_replaced(ckpt_dir, name)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink(missing_ok=True)
            found.append(name)
    # A universal conversion's folder, only when its job is gone: an evaluation may be converting right now.
    outputs = {name[1:name.index(UNIVERSAL_SUFFIX) + len(UNIVERSAL_SUFFIX)]
               for name in leftovers if leftover_kind(name) == "conversion"}
    for out in sorted(outputs):
        found += [p.name for p in remove_abandoned(ckpt_dir / out, (UNIVERSAL_SCRATCH,))]
    # A universal copy whose tag is gone.
    for p in ckpt_dir.glob(f"step_*{UNIVERSAL_SUFFIX}"):
        if not (ckpt_dir / p.name[:-len(UNIVERSAL_SUFFIX)]).is_dir():
            shutil.rmtree(p, ignore_errors=True)
            found.append(p.name)
    return found


def _restore_replaced(ckpt_dir: Path, name: str) -> None:
    """A crash between moving a complete tag aside and renaming its replacement in: put the old one back."""
    tag = name[len(REPLACED_PREFIX):].rsplit("-", 1)[0]
    old = ckpt_dir / name
    if step_of(tag) is not None and not (ckpt_dir / tag).exists() and (old / STATE_DIR / RUN_FILE).is_file():
        os.replace(old, ckpt_dir / tag)


READER_WAIT_S = 300.0
"""Seconds a rollback waits for another job (an evaluation, an export) to finish loading a tag it moves aside:
a reader holds a tag only from its choice to the end of its load, so a longer wait means a stuck reader."""


def supersede_newer(ckpt_dir: str | os.PathLike, step: int,
                    reader_wait_s: float = READER_WAIT_S) -> tuple[Path, list[str]] | None:
    """Move complete tags newer than `step` into superseded/<time>/ (a job rolling back to `step`).

    A tag another job is loading (hold_for_reading) is moved once that job has loaded it: the move would
    otherwise pull the files from under its load. All or none move: a reader that holds a tag past
    `reader_wait_s` leaves every tag in place and the rollback is refused (CheckpointError)."""
    ckpt_dir = Path(ckpt_dir)
    newer = [t for t in inventory(ckpt_dir).complete if step_of(t) > step]
    if not newer:
        return None
    with ExitStack() as held:
        for tag in newer:
            if not held.enter_context(_held_for_removal(ckpt_dir / tag, wait_s=reader_wait_s, why=(
                    f"before moving it aside (rolling back to step {step})"))):
                raise CheckpointError(
                    f"{ckpt_dir / tag}: another job (an evaluation, export or fork) has been loading it for more than "
                    f"{reader_wait_s:.0f} s, and rolling back to step {step} moves it aside; stop that job, then "
                    "start this one again (nothing was moved)")
        dest = ckpt_dir / SUPERSEDED_DIR / time.strftime("%Y%m%d-%H%M%S")
        dest.mkdir(parents=True, exist_ok=False)
        for tag in newer:
            os.replace(ckpt_dir / tag, dest / tag)
            universal = ckpt_dir / (tag + UNIVERSAL_SUFFIX)
            if universal.is_dir():
                os.replace(universal, dest / universal.name)
    fsync_dir(ckpt_dir)
    return dest, newer


def restore_superseded(ckpt_dir: str | os.PathLike, dest: str | os.PathLike, tags: list[str]) -> None:
    """Undo supersede_newer(...) -> (dest, tags): the start that rolled back was refused after the move."""
    ckpt_dir, dest = Path(ckpt_dir), Path(dest)
    for tag in tags:
        for name in (tag, tag + UNIVERSAL_SUFFIX):
            if (dest / name).is_dir():
                os.replace(dest / name, ckpt_dir / name)
    for folder in (dest, dest.parent):
        with suppress(OSError):
            folder.rmdir()  # only when empty
    fsync_dir(ckpt_dir)


def superseded_runs(ckpt_dir: str | os.PathLike, step: int) -> set[str]:
    """The MLflow run ids of set-aside tags (superseded/) newer than `step`: runs that went past it in work a
    rollback threw away (tracking opens a continuation run for them)."""
    runs = set()
    for run_file in Path(ckpt_dir).glob(f"{SUPERSEDED_DIR}/*/step_*/{STATE_DIR}/{RUN_FILE}"):
        tag_step = step_of(run_file.parents[1].name)
        if tag_step is None or tag_step <= step:
            continue
        try:
            run_id = json.loads(run_file.read_text()).get("mlflow_run_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(run_id, str):
            runs.add(run_id)
    return runs


def prune(ckpt_dir: str | os.PathLike, keep: int) -> list[str]:
    """Remove all but the newest `keep` complete tags (0 keeps all), with their universal copies; the newest
    good tag (saved outside a run of non-finite steps) is always kept, so a run that then diverges can
    restart from it. A tag another job is reading (hold_for_reading: an evaluation, an export) is kept for
    now, said in one info line once (not at every save it stays held), and its removal by the first save
    after that job lets it go is said too. Returns the tags removed.

    Called only after a save has completed, so the tag just saved is among the kept ones.
    """
    ckpt_dir = Path(ckpt_dir)
    log = logging.getLogger(distributed.LOGGER_NAME)
    complete = inventory(ckpt_dir).complete
    doomed = complete[:-keep] if keep > 0 else []
    good = next((t for t in reversed(complete) if _is_good(ckpt_dir / t)), None)
    removed = []
    for tag in (t for t in doomed if t != good):
        with _held_for_removal(ckpt_dir / tag) as free:
            if not free:
                if ckpt_dir / tag not in _said_kept:
                    _said_kept.add(ckpt_dir / tag)
                    log.info("checkpoint: keeping %s for now: another job (an evaluation, export or fork) is reading "
                             "it; the first save's retention after that job lets it go removes it", tag)
                continue
            # Rename first: a crash while deleting must not leave a step_* folder that looks complete.
            trash = ckpt_dir / f"{REPLACED_PREFIX}{tag}{PRUNED_SUFFIX}"
            os.replace(ckpt_dir / tag, trash)
            shutil.rmtree(trash, ignore_errors=True)
            shutil.rmtree(ckpt_dir / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
        removed.append(tag)
        if ckpt_dir / tag in _said_kept:
            _said_kept.discard(ckpt_dir / tag)
            log.info("checkpoint: removed %s, kept since an earlier save while another job read it", tag)
    return removed


def mend_interrupted_commit(ckpt_dir: str | os.PathLike, tag: str, keep: int) -> tuple[str | None, list[str]]:
    """Finish what the save of `tag`, the newest complete tag, may not have done before its job ended: `latest`
    naming it, and retention. A job killed between a save's rename of its folder and these two steps leaves
    `latest` naming an older tag and one tag more than checkpoint.keep; the next save mends both, but a job that
    resumes with nothing left to train makes none, and tools that read `latest` (DeepSpeed's zero_to_fp32.py in
    the folder) would take the older tag. Rank 0 of a job that resumed from `tag` calls it. Returns (what `latest`
    named before, where it was rewritten, else None; the tags retention removed)."""
    ckpt_dir = Path(ckpt_dir)
    rewritten = None
    if (named := read_latest(ckpt_dir)) != tag:
        write_latest(ckpt_dir, tag)
        rewritten = named or "nothing"
    return rewritten, prune(ckpt_dir, keep)


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """`latest` names `tag`, atomically and durably."""
    atomic_write(ckpt_dir / LATEST, tag + "\n")
    fsync_dir(ckpt_dir)


_said_kept: set[Path] = set()
"""The tags prune has said it keeps for a reader (in this process), until it removes them: a long evaluation
spans many saves, and the line at each of them said nothing new."""


# ----------------------------------------------------------------------------------------------------
# Readers and retention
#
# A job that reads a tag it did not write (an evaluation, an export, generate) holds a shared flock on the
# tag's run.json from the moment it chose the tag to the end of its load; retention takes an exclusive one,
# without waiting, before it removes a tag, and keeps a tag it cannot lock. run.json, because every complete
# tag has one (older tags included) and a reader without write access can open it. Where the file system has
# no flock (some NFS mounts) both go on unlocked, as the run folder's lock does: retention then removes as
# before, and a reader whose tag vanished before it opened it still chooses again.


class ReadHold:
    """A shared lock on a tag that retention respects; release() (or process exit) drops it."""

    def __init__(self, tag_dir: Path, fd: int | None) -> None:
        self.tag_dir, self._fd = tag_dir, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


_LOCK_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def hold_for_reading(tag_dir: str | os.PathLike) -> ReadHold | None:
    """A shared hold on a complete tag, or None when the tag is gone or being removed by retention (it was
    chosen a moment ago: the caller chooses again, or refuses a tag the user named)."""
    tag_dir = Path(tag_dir)
    run_file = tag_dir / STATE_DIR / RUN_FILE
    try:
        fd = os.open(run_file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _LOCK_BUSY:  # retention holds it: the tag is being removed
            os.close(fd)
            return None
        logging.getLogger(distributed.LOGGER_NAME).warning(
            "checkpoint %s: this file system does not support locks (%s); a training run's retention may remove "
            "it while it is read", tag_dir, one_line(e))
    # Retention may have removed the tag between the open and the lock (the lock is then on a deleted file).
    if not _same_file(fd, run_file):
        os.close(fd)
        return None
    return ReadHold(tag_dir, fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


@contextmanager
def _held_for_removal(tag_dir: Path, wait_s: float = 0.0, why: str = "") -> Iterator[bool]:
    """An exclusive lock on a tag while a job removes or moves it: True when nobody reads it (or the file
    system has no locks: go on as before), False when a reader holds it (after waiting up to wait_s for it to
    let go, with one info line saying what waits, and `why`)."""
    run_file = tag_dir / STATE_DIR / RUN_FILE
    try:
        fd = os.open(run_file, os.O_RDWR)  # NFS emulates flock with POSIX locks: an exclusive one needs write
    except PermissionError:
        fd = os.open(run_file, os.O_RDONLY)
    deadline, told = time.monotonic() + wait_s, False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in _LOCK_BUSY:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    if not told:
                        logging.getLogger(distributed.LOGGER_NAME).info(
                            "checkpoint: waiting for another job (an evaluation, export or fork) to finish loading "
                            "%s %s", tag_dir.name, why)
                        told = True
                    time.sleep(0.2)
                    continue
            break
        yield True
    finally:
        os.close(fd)


def hold_named_tag(tag_dir: str | os.PathLike, then: str) -> ReadHold:
    """hold_for_reading of a tag this job has already chosen; refused (CheckpointError) when retention removed
    it meanwhile, with `then` saying what the user can do."""
    hold = hold_for_reading(tag_dir)
    if hold is None:
        raise CheckpointError(f"{tag_dir}: removed by its run's retention (checkpoint.keep) while this job "
                              f"started; {then}")
    return hold


MAX_CHOICES = 5
"""Times a reader chooses the newest tag again when the one it chose was removed before it could hold it (a
training run saving and pruning meanwhile); more in a row means something else removes tags."""


def resolve_and_hold(path: str | os.PathLike) -> tuple[Path, ReadHold]:
    """The tag a user's PATH means (resolve_path), held for reading (hold_for_reading). A run or checkpoints
    folder whose chosen tag retention removed meanwhile names its newest complete tag again; a tag the user
    named that retention removed is refused."""
    for _ in range(MAX_CHOICES):
        tag_dir = resolve_path(path)
        if tag_dir == Path(path):
            return tag_dir, hold_named_tag(tag_dir, "name a newer tag, or the run folder (its newest tag)")
        hold = hold_for_reading(tag_dir)
        if hold is not None:
            return tag_dir, hold
    raise CheckpointError(f"{path}: the newest tag was removed {MAX_CHOICES} times in a row before it could be "
                          "read; is another job deleting its checkpoints?")


def _is_good(tag_dir: Path) -> bool:
    try:
        return not read_run_info(tag_dir).get("nonfinite_streak")
    except CheckpointError:
        return False


def tag_bytes(tag_dir: str | os.PathLike) -> int:
    """Bytes of a tag's files (from its run.json when it lists them)."""
    tag_dir = Path(tag_dir)
    try:
        files = read_run_info(tag_dir).get("files")
    except CheckpointError:
        files = None
    if files:
        return sum(int(f["bytes"]) for f in files.values())
    return sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------------
# Save


def save(engine, ckpt_dir: str | os.PathLike, step: int, *, rank: int, world_size: int,
         rank_state: dict[str, Any], run_info: dict[str, Any], keep: int, min_free_bytes: int = 0,
         on_phase: Callable[[str], None] | None = None) -> Path:
    """Save a complete checkpoint of step `step` on every rank (collective); returns the tag folder.

    rank_state: this rank's resumable state. run_info: what rank 0 records in run.json (the step, tag and
    file checksums are added here). min_free_bytes: the free space rank 0 requires before writing.
    on_phase(what): called as this rank has done its part of a phase ("its own state written") and goes to
    wait for the others (the watchdog's progress: a rank stuck in a write stays behind).
    Raises SaveFailed on every rank when any rank's part failed; nothing complete is touched then.
    """
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    staging = ckpt_dir / (STAGING_PREFIX + tag)
    phase = on_phase or (lambda what: None)
    try:
        _save_into(engine, ckpt_dir, tag, staging, rank=rank, world_size=world_size, rank_state=rank_state,
                   run_info=run_info, min_free_bytes=min_free_bytes, phase=phase)
    except SaveFailed:
        if rank == 0:  # give the space back now; a crash leaves the folder to the next start instead
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if rank == 0:
        try:
            prune(ckpt_dir, keep)
        except OSError as e:  # the new tag is complete: a failed clean-up must not stop the run
            logging.getLogger(distributed.LOGGER_NAME).warning("checkpoint: could not remove old tags in %s (%s)",
                                                               ckpt_dir, one_line(e))
    phase("older checkpoints pruned")
    distributed.barrier()  # nobody goes on (or exits) before `latest` names the new tag
    return ckpt_dir / tag


def _save_into(engine, ckpt_dir: Path, tag: str, staging: Path, *, rank: int, world_size: int,
               rank_state: dict[str, Any], run_info: dict[str, Any], min_free_bytes: int,
               phase: Callable[[str], None]) -> None:
    """The steps of save(), each agreed by all ranks: staging folder, DeepSpeed's files and the rank files,
    checksums, then rank 0 commits (run.json, rename, `latest`)."""
    step = step_of(tag)
    _agree(lambda: _prepare_staging(ckpt_dir, staging, min_free_bytes) if rank == 0 else None,
           f"checkpoint {tag} could not be saved", lambda: phase("staging folder made"))
    try:
        with _recorded_writes(engine) as recorder, _deepspeed_barriers_on_control_group(phase):
            engine.save_checkpoint(str(ckpt_dir), tag=staging.name, save_latest=False)
    except (OSError, RuntimeError) as e:  # not in a write (recorded): out of memory gathering the state, a bug
        if watchdog.is_collective_failure(e):
            raise  # a peer failed or was lost: the entry point names it
        # This rank has left DeepSpeed's save between its barriers; agreeing would pair this rank's next collective
        # with another's barrier, and every rank would wait for checkpoint.timeout_s (fault_job's fail-in-save).
        _fail_alone(SaveFailed(f"checkpoint {tag} could not be saved: DeepSpeed's save failed on rank {rank} "
                               f"({type(e).__name__}: {one_line(e)}); the checkpoint before it is kept"))
    own_error = recorder.error

    def write_own_state() -> None:
        if own_error:
            raise OSError(own_error)
        write_rank_state(rank_file(staging, rank), rank_state)

    _agree(write_own_state, f"checkpoint {tag} could not be saved", lambda: phase("its own state written"))
    listed = _list_files(staging) if rank == 0 else None
    phase("files listed")
    files = distributed.broadcast_object(listed)
    digests = _agree(lambda: _hash_share(staging, files, rank, world_size, fsync=True),
                     f"checkpoint {tag} could not be checksummed", lambda: phase("its checksums computed"))

    def commit() -> None:
        if rank != 0:
            return
        manifest = {}
        for part in digests:
            manifest.update(part)
        _commit(ckpt_dir, staging, tag, dict(run_info, version=RUN_INFO_VERSION, tag=tag, step=step,
                                              files={name: manifest[name] for name in sorted(manifest)}))

    _agree(commit, f"checkpoint {tag} could not be committed", lambda: phase("committed"))


def _commit(ckpt_dir: Path, staging: Path, tag: str, info: dict[str, Any]) -> None:
    """Rank 0's end of a save: run.json, the rename into place, then `latest`."""
    run_file = staging / STATE_DIR / RUN_FILE
    with _naming(run_file):
        atomic_write(run_file, json.dumps(info, indent=2, sort_keys=True) + "\n")
    for d in (staging / STATE_DIR, staging):
        fsync_dir(d)
    _move_into_place(ckpt_dir, staging, ckpt_dir / tag)
    with _naming(ckpt_dir / LATEST):
        write_latest(ckpt_dir, tag)


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError that names no file (a write's ENOSPC on a full disk) names `path`, as the save's other errors
    do (`<file>: [Errno 28] No space left on device`)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(f"{path}: {one_line(e)}") from None


def write_rank_state(path: Path, rank_state: dict[str, Any]) -> None:
    """A rank's state file, atomically; a failed write is an OSError whose line names a full disk as such."""
    try:
        with atomic_path(path) as tmp:
            torch.save(rank_state, tmp)
    except RuntimeError as e:  # torch's zip writer (atomic_path has removed the partial file)
        raise OSError(write_error(path, e, rank_state)) from None


def _prepare_staging(ckpt_dir: Path, staging: Path, min_free_bytes: int) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ckpt_dir).free
    if free < min_free_bytes:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {size_text(free)} free on the file system of "
                      f"{ckpt_dir}, a checkpoint needs about {size_text(min_free_bytes)}; free space or lower "
                      "checkpoint.keep")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / STATE_DIR).mkdir(parents=True)


def size_text(n_bytes: int) -> str:
    """A size that reads right at any scale: '512 bytes', '15.0 KiB', '1.2 MiB', '3.4 GiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:,.1f} {unit}"
    return f"{n_bytes} bytes"


NEARLY_FULL_SLACK_BYTES = 1 << 20
"""A file system with less room than a failed file needs plus this is full (for write_error)."""


def write_error(path: str | os.PathLike, error: BaseException, saved: Any) -> str:
    """One line for a torch.save of `saved` to `path` that failed with `error` (the partial file removed).

    torch's zip writer reports a full disk as a RuntimeError ("[enforce fail at inline_container.cc] unexpected
    pos ..."), not as ENOSPC: when the file system now has less room than the file needs, the line says
    `[Errno 28] No space left on device`, with torch's own words after it."""
    detail = one_line(error)
    if not isinstance(error, OSError) and _lacks_room(Path(path).parent, _tensor_bytes(saved)):
        return f"{path}: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({detail})"
    return f"{path}: {detail}"


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0  # a file system that cannot even be asked has no room to offer


def _lacks_room(folder: Path, needed: int) -> bool:
    try:
        return shutil.disk_usage(folder).free < needed + NEARLY_FULL_SLACK_BYTES
    except OSError:
        return False  # nothing known about the space: report the error as it is


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor storages in a nested state (each storage once, as torch.save writes it)."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sum(seen.values())


def _move_into_place(ckpt_dir: Path, staging: Path, tag_dir: Path) -> None:
    """Rename the finished staging folder to its tag; an existing tag of that name is replaced only now."""
    old = None
    if tag_dir.exists():
        old = ckpt_dir / f"{REPLACED_PREFIX}{tag_dir.name}-{os.getpid()}"
        os.replace(tag_dir, old)
    os.replace(staging, tag_dir)
    fsync_dir(ckpt_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(ckpt_dir / (tag_dir.name + UNIVERSAL_SUFFIX), ignore_errors=True)  # made from the old one


class _WriteRecorder:
    """Wraps DeepSpeed's checkpoint engine: a failed write is recorded instead of raised, so this rank still
    joins DeepSpeed's remaining collectives (a raise would leave the other ranks waiting in a barrier)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.error: str | None = None

    def save(self, state_dict, path, *args, **kwargs):
        if self.error is not None:
            return None
        try:
            return self._inner.save(state_dict, path, *args, **kwargs)
        except (OSError, RuntimeError) as e:
            Path(path).unlink(missing_ok=True)  # first: the room it took counts as free below
            self.error = write_error(path, e, state_dict)
            return None

    def makedirs(self, path, exist_ok=False):
        try:
            return self._inner.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.error = self.error or f"{path}: {one_line(e)}"
            return None

    def recorded_copy(self, copy_scripts: Callable[[str], None]) -> Callable[[str], None]:
        """DeepSpeed's copy of its recovery scripts (RECOVERY_SCRIPTS) into the checkpoint folder, which rank 0
        makes in each ZeRO 1-3 save, recorded as a write is. Raised, it left rank 0 out of DeepSpeed's last
        barrier, where the others waited for it, and the job hung for checkpoint.timeout_s (a full disk, fault
        sweep seed 1006 case 55). A script copied in part is removed: a later save copies it again."""

        def copy(save_path: str) -> None:
            if self.error is not None:
                return
            try:
                copy_scripts(save_path)
            except OSError as e:
                for script in RECOVERY_SCRIPTS:
                    Path(save_path, script).unlink(missing_ok=True)
                if e.filename2 is not None:  # shutil's copy names both files
                    self.error = f"{e.filename2}: [Errno {e.errno}] {e.strerror} (DeepSpeed's recovery script)"
                else:
                    self.error = f"DeepSpeed's recovery scripts in {save_path}: {one_line(e)}"

        return copy

    def __getattr__(self, name):
        return getattr(self._inner, name)


RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""What DeepSpeed copies into the checkpoint folder at each ZeRO 1-3 save (rank 0)."""


@contextmanager
def _recorded_writes(engine) -> Iterator[_WriteRecorder]:
    recorder = _WriteRecorder(engine.checkpoint_engine)
    engine.checkpoint_engine = recorder
    copy_scripts = getattr(engine, "_copy_recovery_script", None)
    if copy_scripts is not None:
        engine._copy_recovery_script = recorder.recorded_copy(copy_scripts)
    try:
        yield recorder
    finally:
        engine.checkpoint_engine = recorder._inner
        if copy_scripts is not None:
            del engine._copy_recovery_script  # the class's method again


@contextmanager
def _deepspeed_barriers_on_control_group(phase: Callable[[str], None]) -> Iterator[None]:
    """DeepSpeed's barriers inside save_checkpoint wait on the control group (timeout checkpoint.timeout_s).

    On the default group a rank whose write is slower than train.collective_timeout_s (ZeRO 0: rank 0 writes
    the whole model and optimizer) would fail the save on every rank, however long checkpoint.timeout_s is.
    Its other collectives (the tag check) come before any write, so they wait for nobody's I/O.
    """
    from .deepspeed_import import deepspeed  # noqa: F401  (first: no MLflow)
    from deepspeed import comm

    default_group_barrier = comm.barrier
    barriers = 0

    def barrier(group=None, *args, **kwargs):
        nonlocal barriers
        if group is not None:
            return default_group_barrier(group, *args, **kwargs)
        barriers += 1
        phase(f"DeepSpeed's save, barrier {barriers}")
        distributed.barrier()

    comm.barrier = barrier
    try:
        yield
    finally:
        comm.barrier = default_group_barrier


def _agree(fn, what: str, done: Callable[[], None] = lambda: None) -> list[Any]:
    """fn() on every rank, then done(), gathered in rank order; if it failed anywhere, SaveFailed naming the
    first failed rank and its error, on every rank (so all of them stop, and say the same thing)."""
    try:
        value, error = fn(), None
    except (OSError, RuntimeError, CheckpointError) as e:
        value, error = None, one_line(e)
    done()
    gathered = distributed.gather_objects((value, error))
    failures = [(r, err) for r, (_, err) in enumerate(gathered) if err]
    if failures:
        r, err = failures[0]
        raise distributed.agreed(SaveFailed(f"{what}: rank {r}: {err}"))
    return [v for v, _ in gathered]


def _list_files(tag_dir: Path) -> list[tuple[str, int]]:
    """Every file under a tag folder as (relative POSIX path, bytes), sorted."""
    out = []
    for p in sorted(tag_dir.rglob("*")):
        if p.is_file():
            out.append((p.relative_to(tag_dir).as_posix(), p.stat().st_size))
    return out


def share_of(files: list[tuple[str, int]], rank: int, world_size: int) -> list[str]:
    """The files rank `rank` hashes: largest first to the least loaded rank (the same answer on every rank)."""
    loads = [0] * world_size
    mine = []
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        loads[r] += size
        if r == rank:
            mine.append(name)
    return mine


def _hash_share(tag_dir: Path, files: list[tuple[str, int]], rank: int, world_size: int, *,
                fsync: bool) -> dict[str, dict[str, Any]]:
    """{name: {'bytes', 'sha256'}} of this rank's share of the files. With fsync each file is also forced to disk
    (DeepSpeed's torch.save does not), on a second thread: the disk writes the pages back while this thread
    hashes them from the page cache, so the two overlap (BENCHMARKS.md, "Speed changes of issue 9"). An error of
    either raises here."""
    names = share_of(files, rank, world_size)
    if not fsync:
        return {name: hash_file(tag_dir / name) for name in names}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="txl-fsync") as pool:
        synced = [pool.submit(fsync_file, tag_dir / name) for name in names]
        out = {name: hash_file(tag_dir / name) for name in names}
        for done in synced:
            done.result()
    return out


def hash_file(path: Path) -> dict[str, Any]:
    """{'bytes', 'sha256'} of a file."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
        size = f.tell()
    return {"bytes": size, "sha256": digest.hexdigest()}


# ----------------------------------------------------------------------------------------------------
# Verify


def verify(tag_dir: str | os.PathLike, *, rank: int = 0, world_size: int = 1) -> str | None:
    """Check this rank's share of a tag's files against run.json; a one-line problem, or None when fine.

    Collective-free: each rank checks its share; the caller agrees on the results.
    """
    tag_dir = Path(tag_dir)
    try:
        info = checked_run_info(tag_dir)
    except CheckpointError as e:
        return str(e)
    files = info["files"]
    if not files:
        return f"{tag_dir / STATE_DIR / RUN_FILE}: lists no files to verify"
    return _check_share(tag_dir, files, rank, world_size, record=tag_dir / STATE_DIR / RUN_FILE)


def _check_share(root: Path, files: dict[str, dict[str, Any]], rank: int, world_size: int, *,
                 record: Path) -> str | None:
    """This rank's share of `files` ({name: {'bytes', 'sha256'}} under `root`, as `record` lists them) checked
    on disk; the first problem, or None."""
    listed = [(name, int(entry["bytes"])) for name, entry in files.items()]
    for name in share_of(listed, rank, world_size):
        path = root / safe_relative(name, root, record)
        if not path.is_file():
            return f"{path}: missing (the checkpoint lists it)"
        got = hash_file(path)
        want = files[name]
        if got["bytes"] != want["bytes"]:
            return f"{path}: {got['bytes']} bytes, the checkpoint recorded {want['bytes']} (truncated or replaced)"
        if got["sha256"] != want["sha256"]:
            return f"{path}: sha256 differs from the one recorded at save time (corrupted)"
    return None


def safe_relative(name: str, root: Path, record: Path | None = None) -> str:
    """A relative path from a checkpoint's own file (`record`, default the tag's run.json) that stays inside
    `root`, or CheckpointError."""
    p = PurePosixPath(name)
    if p.is_absolute() or not p.parts or ".." in p.parts or "\\" in name or "\0" in name:
        record = record or root / STATE_DIR / RUN_FILE
        raise CheckpointError(f"{record}: lists {name!r}, which is not a path inside the tag")
    return name


# ----------------------------------------------------------------------------------------------------
# Resume


def check_resume_request(resume: str, ckpt_dir: str | os.PathLike, complete: list[str]) -> None:
    """Refuse a --resume that does not fit the run folder's checkpoints (`complete`, oldest first): 'none' where
    there are some, or another run folder's tag (two runs would share one folder). One owner: the training
    start and launch/slurm/run_state.py (which refuses it before any node runs anything)."""
    ckpt_dir = Path(ckpt_dir)
    if resume == "none" and complete:
        raise CheckpointError(
            f"--resume none: {ckpt_dir} already holds checkpoints up to {complete[-1]}; continue them "
            "(--resume auto), roll back to one (--resume PATH), or choose a new run.dir")
    if resume not in ("auto", "none") and complete and resolve_path(resume).parent.resolve() != ckpt_dir.resolve():
        tag = resolve_path(resume).resolve()
        if tag.parent.parent == (ckpt_dir / SUPERSEDED_DIR).resolve():
            raise CheckpointError(
                f"--resume {resume}: a tag this run set aside when it rolled back; to go back to it, move it into "
                f"{ckpt_dir} (`mv {tag} {ckpt_dir}/`, after moving a tag of the same name there out of the way) "
                f"and resume from it there (--resume {ckpt_dir / tag.name}): the tags newer than it are then set "
                "aside in turn")
        raise CheckpointError(
            f"--resume {resume}: a checkpoint of another run folder, but {ckpt_dir} already holds checkpoints "
            f"up to {complete[-1]}; start from it in a new run.dir")


def candidate_tags(resume: str, ckpt_dir: str | os.PathLike) -> list[Path]:
    """Tag folders to resume from, best first: [] for 'none', the complete tags newest first for 'auto'
    (whatever `latest` says), or the one tag a PATH names (a checkpoint folder: its newest complete tag)."""
    if resume == "none":
        return []
    if resume == "auto":
        ckpt_dir = Path(ckpt_dir)
        return [ckpt_dir / t for t in reversed(inventory(ckpt_dir).complete)]
    return [resolve_path(resume)]


def resolve_path(path: str | os.PathLike) -> Path:
    """The tag folder a user's PATH means: a tag folder, a checkpoint folder (its newest complete tag) or a
    run folder (the newest complete tag of its checkpoints/)."""
    path = Path(path)
    if (path / STATE_DIR / RUN_FILE).is_file():
        return path
    for folder in (path, path / "checkpoints"):
        complete = inventory(folder).complete
        if complete:
            return folder / complete[-1]
    if step_of(path.name) is not None and path.is_dir():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {STATE_DIR}/{RUN_FILE}); use another tag")
    if not path.exists():
        raise CheckpointError(f"{path} does not exist{where_relative(path)}; pass a run folder, its checkpoints/ "
                              "folder or one of its step_* tags")
    raise CheckpointError(
        f"{path}: not a checkpoint: no complete step_* tag in it (nor in {path / 'checkpoints'}); pass a run folder, "
        "its checkpoints/ folder or one of its step_* tags")


def read_run_info(tag_dir: str | os.PathLike) -> dict[str, Any]:
    """run.json of a tag."""
    path = Path(tag_dir) / STATE_DIR / RUN_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text
        raise CheckpointError(f"{path}: cannot read ({one_line(e)}); use another tag") from None
    # Every run.json this project wrote is an object with an integer version: anything else is damaged, not old.
    version = info.get("version") if isinstance(info, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        what = ("not a JSON object" if not isinstance(info, dict) else "no version" if "version" not in info
                else f"version {version!r} is not an integer")
        raise CheckpointError(f"{path}: damaged ({what}; every run.json txl-dist writes has its integer version); "
                              "use another tag")
    if version != RUN_INFO_VERSION:
        raise CheckpointError(f"{path}: version {version} is not {RUN_INFO_VERSION} (saved by another version of "
                              "txl-dist); use the version that wrote it")
    return info


RUN_INFO_FIELDS = {"step": int, "world_size": int, "n_streams": int, "zero_stage": int, "tokenizer_sha256": str,
                   "manifest_digest": str, "config": dict, "files": dict}
"""What a resume, an evaluation or an export reads of a run.json (every save of this version writes them)."""
RUN_INFO_CONFIG_SECTIONS = ("model", "train", "data")


def checked_run_info(tag_dir: str | os.PathLike) -> dict[str, Any]:
    """read_run_info of a tag that is to be used, with the fields a resume, an evaluation or an export reads
    checked: run.json is not in its own checksums, so a damaged one that still parses (a key's name with a
    flipped bit) is refused here as damaged, instead of failing with a KeyError where the field is read."""
    info = read_run_info(tag_dir)
    problem = _run_info_problem(info, Path(tag_dir).name)
    if problem:
        raise CheckpointError(f"{Path(tag_dir) / STATE_DIR / RUN_FILE}: damaged ({problem}); use another tag")
    return info


def _run_info_problem(info: dict[str, Any], tag: str) -> str | None:
    for key, kind in RUN_INFO_FIELDS.items():
        value = info.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"no {key}" if key not in info else f"{key} {value!r:.40} is not {_KIND_NAMES[kind]}"
    missing = [s for s in RUN_INFO_CONFIG_SECTIONS if not isinstance(info["config"].get(s), dict)]
    if missing:
        return f"its config has no {missing[0]} section"
    if step_of(tag) is not None and info["step"] != step_of(tag):
        return f"step {info['step']}, but the tag is {tag}"
    for name, entry in info["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or isinstance(entry["bytes"], bool) \
                or not isinstance(entry.get("sha256"), str):
            return f"its entry of {name!r:.60} is not a size and a sha256"
    return None


_KIND_NAMES = {int: "an integer", str: "a string", dict: "an object"}


@dataclass(frozen=True)
class EngineSource:
    """Where engine.load_checkpoint reads from, and whether the engine must be built for a universal load."""

    load_dir: Path
    tag: str
    universal: bool


def recorded_eval_streams(run_info: dict[str, Any]) -> int:
    """The evaluation streams the checkpoint's run evaluated up to its step (run.json "eval_streams", what
    RunConfig.eval_streams resolved for the job that saved it); for a tag saved before it was recorded, its
    configuration's eval.n_streams, else its world size (null then meant one stream per rank)."""
    if run_info.get("eval_streams") is not None:
        return int(run_info["eval_streams"])
    return int(run_info.get("config", {}).get("eval", {}).get("n_streams") or run_info["world_size"])


def needs_universal(run_info: dict[str, Any], world_size: int) -> bool:
    """A ZeRO 1-3 checkpoint is partitioned for its world size; another world size reads the universal form.

    (Stage 0 keeps the whole optimizer state, fp32 masters included under bf16, in one file any world
    size can read.)
    """
    return run_info["zero_stage"] > 0 and run_info["world_size"] != world_size


def engine_source(tag_dir: str | os.PathLike, run_info: dict[str, Any], *, world_size: int) -> EngineSource:
    """How the DeepSpeed state is loaded: from the tag, or from its universal copy (see convert_if_needed)."""
    tag_dir = Path(tag_dir)
    if not needs_universal(run_info, world_size):
        return EngineSource(tag_dir.parent, tag_dir.name, universal=False)
    return EngineSource(tag_dir.parent, tag_dir.name + UNIVERSAL_SUFFIX, universal=True)


def verify_universal(copy_dir: str | os.PathLike, tag_dir: str | os.PathLike, *, rank: int = 0,
                     world_size: int = 1) -> str | None:
    """Check this rank's share of a universal copy's files against its record, and that it was made from the
    tag as it is now; a one-line problem (a missing copy, or one without a record: made by an older version
    or never finished), or None when fine. Collective-free, like verify()."""
    copy_dir, tag_dir = Path(copy_dir), Path(tag_dir)
    if not copy_dir.is_dir():
        return f"{copy_dir}: missing"
    record_path = copy_dir / STATE_DIR / UNIVERSAL_RECORD
    try:
        record = json.loads(record_path.read_text())
        made_from = hash_file(tag_dir / STATE_DIR / RUN_FILE)["sha256"]
    except (OSError, ValueError) as e:
        return f"{record_path}: cannot be read ({one_line(e)}; a copy made by an older version, or unfinished)"
    if not isinstance(record, dict) or record.get("version") != UNIVERSAL_RECORD_VERSION \
            or not isinstance(record.get("files"), dict) or not record["files"]:
        return f"{record_path}: not a record of this version"
    if record.get("tag_run_sha256") != made_from:
        return f"{copy_dir}: made from another save of {tag_dir.name}"
    try:
        return _check_share(copy_dir, record["files"], rank, world_size, record=record_path)
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        return f"{record_path}: unusable ({one_line(e)})"


def _record_universal(copy_dir: Path, tag_dir: Path, workers: int) -> None:
    """Write a fresh copy's record, last: the size and sha256 of its every file (hashed on `workers` threads:
    hashlib releases the GIL) and the sha256 of the tag's run.json it was made from."""
    files = [name for name, _ in _list_files(copy_dir)]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="txl-hash") as pool:
        digests = dict(zip(files, pool.map(lambda name: hash_file(copy_dir / name), files)))
    record = {"version": UNIVERSAL_RECORD_VERSION, "tag": tag_dir.name,
              "tag_run_sha256": hash_file(tag_dir / STATE_DIR / RUN_FILE)["sha256"], "files": digests}
    (copy_dir / STATE_DIR).mkdir(exist_ok=True)
    atomic_write(copy_dir / STATE_DIR / UNIVERSAL_RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")


CONVERSION_MAX_WORKERS = 8
"""Worker processes of a universal conversion, each for extracting shards and for merging parameters (at most
the cores this process may use)."""


class ConversionFailed(RunFailed):
    """The universal conversion of a verified tag stopped midway (a full disk, a killed worker): a fault, not
    a refusal; nothing of it is left (its scratch folder goes with it), the tag is untouched."""


def universal_copy_bytes(tag_dir: str | os.PathLike) -> int:
    """About the bytes of a tag's universal copy: its ZeRO optimizer files (fp32 weights and both Adam moments
    of every parameter, which the copy holds once more). A lower bound: the conversion also writes its
    extracted shards beside it while it runs."""
    try:
        files = read_run_info(tag_dir).get("files") or {}
        return sum(int(entry["bytes"]) for name, entry in files.items() if name.endswith("optim_states.pt"))
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
        return 0


def _no_room_for_copy(tag_dir: Path, folder: Path, free: int, detail: str) -> ConversionFailed:
    # Measured (114M parameters, ZeRO 1 and 3): the copy takes 1.2-1.5x its optimizer files, the conversion
    # 2-2.3x while it runs (DeepSpeed's extracted shards beside the merged copy).
    need = universal_copy_bytes(tag_dir)
    return ConversionFailed(
        f"{tag_dir}: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: the universal copy that a load at another "
        f"world size reads beside the tag does not fit on the file system of {folder} ({size_text(free)} free "
        f"{detail}); it takes more than {size_text(need)}, about twice that while it is made; free space (or lower "
        "checkpoint.keep), or load it with the world size it was saved with")


def convert_to_universal(tag_dir: Path, out: Path, *, zero_stage: int) -> bool:
    """DeepSpeed's universal checkpoint conversion of one (verified) tag, atomically (temporary folder, its
    record, rename), with its loads restricted to weights (txl_dist.safe_load). Whatever `out` holds (a copy
    that did not verify) is moved into the scratch folder first and removed with it.

    True when this conversion's copy is in place (its record was made from the files just written); False
    when another job's, converted meanwhile, was kept: not verified here, the caller must verify it.
    ConversionFailed (one line, ENOSPC named as such) when the file system cannot hold the copy, before the
    conversion when it has less room than the copy's files alone, or when the conversion stopped midway."""
    # The other ranks wait (control timeout) while this one converts: the node's idle cores do the work, a few
    # shards at a time (each worker holds one optimizer shard or one parameter's pieces).
    try:
        return _convert_to_universal(tag_dir, out, zero_stage)
    except OSError as e:  # a read-only or full file system: the bare error would name a temporary folder
        if e.errno == errno.ENOSPC:
            # Full midway outside the converter (its scratch folder, the copy's record): a fault, as when the
            # converter fills it (exit 1, the full disk named), not a folder to make writable.
            raise _no_room_for_copy(tag_dir, out.parent, _free_bytes(out.parent), "after it stopped") from None
        raise CheckpointError(
            f"{tag_dir}: cannot write the universal copy that a load at another world size reads beside it "
            f"({e.strerror or one_line(e)}); make {out.parent} writable (or copy the run folder to where it can "
            "be), or load it with the world size it was saved with") from None


def _convert_to_universal(tag_dir: Path, out: Path, zero_stage: int) -> bool:
    workers = str(max(1, min(CONVERSION_MAX_WORKERS, usable_cpus())))
    # An owned scratch folder: a training job starting meanwhile removes only a killed conversion's folder,
    # never one in progress (an evaluation job's, which holds no lock on the run folder). DeepSpeed's converter
    # also writes a `latest_universal` beside its output: inside the scratch folder, it goes with it.
    with owned_scratch(out, UNIVERSAL_SCRATCH) as scratch:
        _discard(out, scratch)
        shutil.rmtree(scratch / "discarded", ignore_errors=True)  # its room counts for the new copy
        free = shutil.disk_usage(out.parent).free
        if free < universal_copy_bytes(tag_dir):  # found now, not after minutes of converting a large model
            raise _no_room_for_copy(tag_dir, out.parent, free, "before converting")
        tmp = scratch / "output"
        # --parent_pid: the converter and its workers end with this process, however it ends (Linux), so a
        # restarted start never converts beside them with a killed rank's conversion still holding memory.
        cmd = [sys.executable, "-m", "txl_dist.safe_load", "ds_to_universal", "--input_folder", str(tag_dir),
               "--output_folder", str(tmp), "--num_extract_workers", workers, "--num_merge_workers", workers,
               "--parent_pid", str(os.getpid())]
        if zero_stage in (1, 2):
            cmd.append("--inject_missing_state")
        # Said before and after: at scale the conversion takes minutes, during which the job prints nothing else.
        log = logging.getLogger(distributed.LOGGER_NAME)
        log.info("checkpoint: converting %s (%s of optimizer files) to DeepSpeed's universal form for a load at "
                 "another world size: %s", tag_dir.name, size_text(universal_copy_bytes(tag_dir)), out)
        started = time.monotonic()
        # The converter holds the folder's lock too (its workers inherit it): while any of them runs, no start
        # removes the folder under it; once they ended with this job, the kernel drops the lock and the next
        # start removes the folder.
        proc = subprocess.run(cmd, capture_output=True, text=True, pass_fds=(owner_lock(scratch),))
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            if proc.returncode < 0:  # killed: its last line (a warning, "no output") is not why it stopped
                last = _killed_by(-proc.returncode)
            if proc.returncode == EXIT_REFUSED:  # a file weights-only unpickling refuses (its line names it)
                last = last.removeprefix("error: ")
                raise CheckpointError(f"{tag_dir}: universal checkpoint conversion refused it ({last}); "
                                      f"resume with the world size it was saved with ({zero_stage=})")
            # torch's zip writer reports a full disk only as "unexpected pos ...": the partial files are still in
            # the scratch folder here, so a file system without room left is what stopped it.
            if _lacks_room(out.parent, 0):
                raise _no_room_for_copy(tag_dir, out.parent, free, f"before converting; it stopped with {last}")
            raise ConversionFailed(f"{tag_dir}: universal checkpoint conversion failed ({last}); nothing of it "
                                   f"is left: start again, or resume with the world size it was saved with "
                                   f"({zero_stage=})")
        _record_universal(tmp, tag_dir, int(workers))
        copy_bytes = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        try:
            os.replace(tmp, out)
            log.info("checkpoint: %s converted in %.1f s (%s)", out.name, time.monotonic() - started,
                     size_text(copy_bytes))
            return True
        except OSError:
            if not out.is_dir():
                raise
            # Another job converted the same tag meanwhile (a second evaluation): the same files; keep theirs.
            return False


def _killed_by(signum: int) -> str:
    """Why a converter that a signal ended stopped: a SIGKILL nobody sent by hand is the kernel's OOM killer
    (each worker holds a ZeRO shard or a parameter's pieces)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    oom = ": the kernel's OOM killer, if the node ran out of memory" if signum == signal.SIGKILL else ""
    return f"the converter was killed by {name}{oom}"


def _discard(copy_dir: Path, scratch: Path) -> None:
    """Move a universal copy into this job's scratch folder: removed with it, or by the next start when this
    job is killed (a rename, so no half-deleted copy is ever left at the copy's name)."""
    try:
        os.replace(copy_dir, scratch / "discarded")
    except FileNotFoundError:
        pass  # none there (or another job discarded it first)


class LoadFailed(RunFailed):
    """DeepSpeed's load of a checkpoint that verified at start failed on this rank (which left the job at once)."""


MPU_NOT_PROVIDED = "MPU is not provided, setting tp size to 1"


def load_engine(engine, source: EngineSource) -> None:
    """Load DeepSpeed's state (weights, optimizer, LR schedule, step counters) into the engine.

    A failure inside DeepSpeed's load ends the job at once (LoadFailed here, one line naming this rank on the
    others), not after train.collective_timeout_s: see _fail_alone."""
    from .engine import dropped_deepspeed_warning
    from .safe_load import restricted_torch_loads

    try:
        # ZeRO 1/2 on another world size: DeepSpeed's warning about tensor parallelism, which this project
        # does not use, would print once per rank.
        with restricted_torch_loads(), dropped_deepspeed_warning(MPU_NOT_PROVIDED):
            path, _ = engine.load_checkpoint(str(source.load_dir), tag=source.tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    except Exception as e:
        if watchdog.is_collective_failure(e):
            raise  # a peer failed or was lost: the entry point names it
        _fail_alone(LoadFailed(f"{source.load_dir / source.tag}: DeepSpeed's load failed ({one_line(e)}); "
                               "its files verified at start: check the file system, then restart"))
    if path is None:
        raise CheckpointError(f"{source.load_dir / source.tag}: DeepSpeed found no checkpoint to load")
    optimizer = getattr(engine, "optimizer", None)  # DeepSpeed's wrapper (ZeRO, bf16) holds the torch optimizer
    steps_with_their_params(getattr(optimizer, "optimizer", optimizer))
    scheduler = engine.lr_scheduler
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        # The optimizer's state brought back the learning rate the saved run's schedule set for the next step;
        # the scheduler's state is only its position, and this run's config (lr, warmup, max_steps) may have
        # changed the schedule (e.g. a lower lr after a divergence). Set the next step's lr from this run's
        # schedule at that position: the same number when nothing changed.
        scheduler.step(scheduler.last_batch_iteration)


def steps_with_their_params(optimizer) -> int:
    """Put the `step` of each fused (or capturable) torch optimizer state on its parameter's device in float32,
    as torch's Optimizer.load_state_dict does; returns how many moved.

    DeepSpeed 0.19.8's universal load (an elastic resume at ZeRO 1-3) sets the step it reads from the
    universal copy's CPU files straight into the torch optimizer's state (base_optimizer.py and stage3.py set
    state["step"]), bypassing load_state_dict: on a GPU the presets' fused AdamW then fails at its first step
    ("Expected all tensors to be on the same device ... cuda:0 and cpu ... state_steps"). A load at the same
    world size goes through load_state_dict: nothing moves then."""
    groups = getattr(optimizer, "param_groups", [])
    group_of = {id(param): group for group in groups for param in group["params"]}
    # ZeRO-3 keeps its groups' "params" empty between steps (its universal load sets them to []): a state
    # whose parameter no group names takes the flag of any group, as DeepSpeed builds them all alike.
    any_group_on_device = any(group.get("fused") or group.get("capturable") for group in groups)
    moved = 0
    for param, state in getattr(optimizer, "state", {}).items():
        group = group_of.get(id(param))
        on_device = bool(group.get("fused") or group.get("capturable")) if group is not None else any_group_on_device
        step = state.get("step")
        if on_device and torch.is_tensor(step) and (step.device != param.device or step.dtype != torch.float32):
            state["step"] = step.to(device=param.device, dtype=torch.float32)
            moved += 1
    return moved


def _fail_alone(failure: RunFailed) -> NoReturn:
    """Leave the process group and raise `failure`, for a DeepSpeed load or save that failed on this rank.

    Both run collectives (ZeRO partitions gathered, barriers): the other ranks may be waiting in one that this
    rank will never join, where agreeing on the failure (distributed.together, on the control group) would leave
    everyone until train.collective_timeout_s or checkpoint.timeout_s. Leaving the group publishes this rank's
    line: the others stop within a heartbeat ("rank r ... stopped after an error: ...")."""
    distributed.destroy_process_group(failure)
    raise failure from None


def load_rank_states(tag_dir: str | os.PathLike, ranks: Iterable[int]) -> list[dict[str, Any]]:
    """The per-rank state files of `ranks` (weights_only: plain tensors, numbers and strings)."""
    states = []
    for r in ranks:
        path = rank_file(Path(tag_dir), r)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, resume another tag")
        try:
            states.append(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as e:  # a corrupt or foreign file: unpickling errors have many types
            if failure_of_the_process(e):
                raise
            raise CheckpointError(f"{path}: cannot be read ({one_line(e)}); resume another tag") from None
    return states


def load_holders_of(tag_dir: str | os.PathLike, stream_ids: Iterable[int], *, n_streams: int,
                    saved_world_size: int) -> list[dict[str, Any]]:
    """The rank files of the saved ranks whose streams overlap `stream_ids` (an elastic resume), in rank order.

    A new rank reads only those (about S/W_new / (S/W_saved) + 1 files), not every saved rank's: memory per
    rank and reads on the shared file system stay flat as the saved world size grows.
    """
    return load_rank_states(tag_dir, ranks_holding(stream_ids, n_streams, saved_world_size))


# ----------------------------------------------------------------------------------------------------
# Export


def load_fp32_weights(model: torch.nn.Module, tag_dir: str | os.PathLike, zero_stage: int) -> None:
    """Load a checkpoint's consolidated fp32 weights into a plain model (one process, no engine).

    ZeRO 1-3: DeepSpeed's zero_to_fp32 merges the fp32 master partitions of all ranks (at ZeRO 3 one tensor
    at a time, copied into the model: copy_in_one_at_a_time). Stage 0: the
    module's weights, overwritten by the fp32 masters that DeepSpeed's bf16/fp16 optimizer keeps in the
    same file (one flat list in model.parameters() order), so a bf16 run exports its fp32 masters too.
    Both read the files with weights-only unpickling.
    """
    from .safe_load import fp32_state_dict_from_zero, load_weights_only

    tag_dir = Path(tag_dir)
    if zero_stage > 0:
        copy_in_one_at_a_time(model, fp32_state_dict_from_zero(tag_dir, lazy=True), tag_dir)
        return
    path = tag_dir / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; is {tag_dir} a complete stage-0 checkpoint?")
    state = load_weights_only(path, map_location="cpu")
    model.load_state_dict({k: v.float() for k, v in state["module"].items()}, strict=True)
    groups = (state.get("optimizer") or {}).get("fp32_groups")
    if groups:
        masters = [t for group in groups for t in group]
        params = list(model.parameters())
        if [tuple(t.shape) for t in masters] != [tuple(p.shape) for p in params]:
            raise CheckpointError(f"{path}: the fp32 master weights do not match the model's parameters")
        with torch.no_grad():
            for p, t in zip(params, masters):
                p.copy_(t)


def copy_in_one_at_a_time(model: torch.nn.Module, weights: dict[str, Any], tag_dir: Path) -> None:
    """Copy consolidated weights (values gathered by .contiguous(): DeepSpeed's lazy zero_to_fp32) into the
    model's own tensors one at a time, each dropped after its copy, with load_state_dict's strict checks.

    load_state_dict of the whole consolidated dict holds all of it beside the model: at ZeRO 3 (114M
    parameters, 435 MiB of fp32 weights) the export peaked at 1.55 GiB, three copies with the memory-mapped
    partitions; one tensor at a time, at about two.

    A tied tensor is copied once, under any one of its names the weights hold: DeepSpeed 0.19.8 restores the
    other names of a tied Parameter from the checkpoint's shared_params, which keeps one name per module
    (named_parameters drops a module's second name for one Parameter). So with div_val 1, d_embed != d_model
    and two cutoffs, crit.out_projs.2 (one projection with crit.out_projs.1 and word_emb.emb_projs.0) came back
    missing."""
    from .model import tied_groups

    targets = model.state_dict()  # detached, sharing the parameters' storage
    groups = tied_groups(model)
    missing = [group[0] for group in groups if not any(name in weights for name in group)]
    unexpected = sorted(weights.keys() - targets.keys())
    if missing or unexpected:
        raise CheckpointError(f"{tag_dir}: its weights do not match its model (missing: "
                              f"{', '.join(missing[:3]) or '-'}; unexpected: {', '.join(unexpected[:3]) or '-'}); "
                              "export a tag of this project's model")
    with torch.no_grad():
        for group in groups:
            name = next(name for name in group if name in weights)
            value = weights.pop(name).contiguous()
            for alias in group:
                weights.pop(alias, None)
            target = targets[name]
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(f"{tag_dir}: {name} has shape {tuple(value.shape)}, its model's "
                                      f"{tuple(target.shape)}; export a tag of this project's model")
            target.copy_(value)
            del value
