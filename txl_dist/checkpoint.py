"""Sharded checkpoints with exact and elastic resume.

Layout (ARCHITECTURE.md):
```
CKPT/<tag>/...                        DeepSpeed's files (engine.save_checkpoint(CKPT, tag, save_latest=False))
CKPT/<tag>/txl_state/rank-NNNNN.pt    one per rank: mems by global stream id, loader state, RNG states
CKPT/<tag>/txl_state/run.json         rank 0: step, tokens seen, S, L, world size, ZeRO stage, digests, run id
CKPT/<tag>_universal/                 DeepSpeed universal checkpoint, made once when the world size changes
CKPT/latest                           written last, atomically: a tag named here is complete
```
DeepSpeed writes `client_state` from data-parallel rank 0 only, so per-rank state needs its own files.
DeepSpeed's own `latest` is not written: it would appear before our files are complete.

Tags are `step_NNNNNNNN`, saved in step order, so a tag newer than the one in `latest` is an interrupted
save: it is ignored and removed; a save first clears any leftover folder of its tag.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import distributed
from .atomic import atomic_path, atomic_write
from .errors import Refused

LATEST = "latest"
STATE_DIR = "txl_state"
RUN_FILE = "run.json"
UNIVERSAL_SUFFIX = "_universal"
RUN_INFO_VERSION = 1


class CheckpointError(Refused, RuntimeError):
    """A checkpoint cannot be used; the message names the path and what to do."""


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
    """This process's RNG states: python, numpy (global), torch CPU, and CUDA when present."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() captured (exact resume: the same dropout masks as an uninterrupted run)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "has_gauss": n["has_gauss"], "gauss": n["gauss"],
                         "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
# Save


def save(engine, ckpt_dir: str | os.PathLike, step: int, *, rank: int, rank_state: dict[str, Any],
         run_info: dict[str, Any], keep: int) -> Path:
    """Save a complete checkpoint of step `step` on every rank (collective); returns the tag folder.

    rank_state: this rank's resumable state (mems, loader, RNG, ...). run_info: what rank 0 records in
    run.json (the step and tag are added here). Order: DeepSpeed's files and every rank file, run.json,
    a barrier, then `latest`; then tags beyond the newest `keep` are removed (0 keeps all).
    """
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for leftover in (tag_dir, ckpt_dir / (tag + UNIVERSAL_SUFFIX)):
            shutil.rmtree(leftover, ignore_errors=True)  # an interrupted earlier save of this step
        (tag_dir / STATE_DIR).mkdir(parents=True)
    distributed.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    with atomic_path(rank_file(tag_dir, rank)) as tmp:
        torch.save(rank_state, tmp)
    if rank == 0:
        info = dict(run_info, version=RUN_INFO_VERSION, tag=tag, step=step)
        atomic_write(tag_dir / STATE_DIR / RUN_FILE, json.dumps(info, indent=2, sort_keys=True) + "\n")
    distributed.barrier()  # every rank's files are on disk
    if rank == 0:
        atomic_write(ckpt_dir / LATEST, tag + "\n")
        prune(ckpt_dir, keep)
    distributed.barrier()  # nobody goes on (or exits) before `latest` names the new tag
    return tag_dir


def read_latest(ckpt_dir: str | os.PathLike) -> str | None:
    """The tag named in CKPT/latest, or None when there is none."""
    path = Path(ckpt_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if step_of(tag) is None:
        raise CheckpointError(f"{path}: names {tag!r}, not a tag of this project (step_NNNNNNNN)")
    return tag


def prune(ckpt_dir: str | os.PathLike, keep: int, protect: str | os.PathLike | None = None) -> list[str]:
    """Remove interrupted saves (tags newer than `latest`) and all but the newest `keep` complete tags.

    `protect`: a tag folder never removed here (the one a job is resuming from while this runs).
    """
    ckpt_dir = Path(ckpt_dir)
    latest = read_latest(ckpt_dir)
    if latest is None:
        return []
    latest_step = step_of(latest)
    tags = sorted((step_of(p.name), p.name) for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p.name) is not None)
    complete = [t for s, t in tags if s <= latest_step]
    doomed = [t for s, t in tags if s > latest_step]
    if keep > 0:
        doomed += complete[:-keep]
    if protect is not None:
        doomed = [t for t in doomed if (ckpt_dir / t).resolve() != Path(protect).resolve()]
    for tag in doomed:
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
        shutil.rmtree(ckpt_dir / (tag + UNIVERSAL_SUFFIX), ignore_errors=True)
    # A universal conversion whose tag is gone, or a half-made one (its temporary folder).
    for p in ckpt_dir.iterdir():
        if p.name.endswith(UNIVERSAL_SUFFIX) and not (ckpt_dir / p.name[:-len(UNIVERSAL_SUFFIX)]).is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(".") and UNIVERSAL_SUFFIX in p.name:
            shutil.rmtree(p, ignore_errors=True)
    return doomed


# ----------------------------------------------------------------------------------------------------
# Resume


def resolve_resume(resume: str, ckpt_dir: str | os.PathLike) -> Path | None:
    """The tag folder to resume from: 'none', 'auto' (checkpoint.dir's latest, if any) or a PATH.

    PATH is a checkpoint folder holding `latest`, or a tag folder (holding txl_state/run.json).
    """
    if resume == "none":
        return None
    if resume == "auto":
        tag = read_latest(ckpt_dir)
        return None if tag is None else _complete(Path(ckpt_dir) / tag)
    path = Path(resume)
    if (path / LATEST).is_file():
        return _complete(path / read_latest(path))
    if (path / STATE_DIR / RUN_FILE).is_file():
        return _complete(path)
    raise CheckpointError(
        f"--resume {resume}: not a checkpoint folder (no '{LATEST}') nor a complete tag folder "
        f"(no {STATE_DIR}/{RUN_FILE}); pass checkpoint.dir or one of its step_* folders")


def _complete(tag_dir: Path) -> Path:
    if not (tag_dir / STATE_DIR / RUN_FILE).is_file():
        raise CheckpointError(f"{tag_dir}: incomplete checkpoint (no {STATE_DIR}/{RUN_FILE}); resume another tag")
    return tag_dir


def read_run_info(tag_dir: str | os.PathLike) -> dict[str, Any]:
    """run.json of a tag."""
    path = Path(tag_dir) / STATE_DIR / RUN_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e}); resume another tag") from None
    if info.get("version") != RUN_INFO_VERSION:
        raise CheckpointError(f"{path}: version {info.get('version')!r} is not {RUN_INFO_VERSION}")
    return info


@dataclass(frozen=True)
class EngineSource:
    """Where engine.load_checkpoint reads from, and whether the engine must be built for a universal load."""

    load_dir: Path
    tag: str
    universal: bool


def needs_universal(run_info: dict[str, Any], world_size: int) -> bool:
    """A ZeRO 1-3 checkpoint is partitioned for its world size; another world size reads the universal form.

    (Stage 0 keeps the whole optimizer state, fp32 masters included under bf16, in one file any world
    size can read.)
    """
    return run_info["zero_stage"] > 0 and run_info["world_size"] != world_size


def engine_source(tag_dir: str | os.PathLike, run_info: dict[str, Any], *, world_size: int, rank: int) -> EngineSource:
    """Decide (before deepspeed.initialize) how to load the DeepSpeed state; converts once if needed (collective).

    For another world size at ZeRO 1-3, rank 0 runs DeepSpeed's ds_to_universal into <tag>_universal
    (into a temporary folder, renamed when complete; stages 1/2 need --inject_missing_state) unless it
    exists; the other ranks wait at a barrier.
    """
    tag_dir = Path(tag_dir)
    if not needs_universal(run_info, world_size):
        return EngineSource(tag_dir.parent, tag_dir.name, universal=False)
    out = tag_dir.parent / (tag_dir.name + UNIVERSAL_SUFFIX)
    failure = None
    if rank == 0 and not out.is_dir():
        try:
            convert_to_universal(tag_dir, out, zero_stage=run_info["zero_stage"])
        except CheckpointError as e:
            failure = str(e)
    failure = distributed.broadcast_object(failure)
    if failure:
        raise CheckpointError(failure)
    return EngineSource(tag_dir.parent, out.name, universal=True)


def convert_to_universal(tag_dir: Path, out: Path, *, zero_stage: int) -> None:
    """DeepSpeed's universal checkpoint conversion of one tag, atomically (temporary folder + rename)."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(tmp), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    if zero_stage in (1, 2):
        cmd.append("--inject_missing_state")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(f"{tag_dir}: universal checkpoint conversion failed ({last}); "
                              f"resume with the world size it was saved with ({zero_stage=})")
    os.replace(tmp, out)


def load_engine(engine, source: EngineSource) -> None:
    """Load DeepSpeed's state (weights, optimizer, LR schedule, step counters) into the engine."""
    path, _ = engine.load_checkpoint(str(source.load_dir), tag=source.tag, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{source.load_dir / source.tag}: DeepSpeed found no checkpoint to load")


def load_rank_states(tag_dir: str | os.PathLike, ranks: Iterable[int]) -> list[dict[str, Any]]:
    """The per-rank state files of `ranks` (weights_only: plain tensors, numbers and strings)."""
    states = []
    for r in ranks:
        path = rank_file(Path(tag_dir), r)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, resume another tag")
        states.append(torch.load(path, map_location="cpu", weights_only=True))
    return states


# ----------------------------------------------------------------------------------------------------
# Export


def load_fp32_weights(model: torch.nn.Module, tag_dir: str | os.PathLike, zero_stage: int) -> None:
    """Load a checkpoint's consolidated fp32 weights into a plain model (one process, no engine).

    ZeRO 1-3: DeepSpeed's zero_to_fp32 merges the fp32 master partitions of all ranks. Stage 0: the
    module's weights, overwritten by the fp32 masters that DeepSpeed's bf16/fp16 optimizer keeps in the
    same file (one flat list in model.parameters() order), so a bf16 run exports its fp32 masters too.
    """
    tag_dir = Path(tag_dir)
    if zero_stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        model.load_state_dict(state, strict=True)
        return
    path = tag_dir / "mp_rank_00_model_states.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; is {tag_dir} a complete stage-0 checkpoint?")
    state = torch.load(path, map_location="cpu", weights_only=False)
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
