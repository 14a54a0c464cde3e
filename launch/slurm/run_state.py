"""Where a training run stands, for launch/slurm/train.sbatch (one process, before and after the training step).

    python launch/slurm/run_state.py [--world-size N] --config C [--set section.key=value ...] [--resume ...]

Takes launch/train.py's own arguments (parsed by its parser, so the two never disagree) and prints `key=value`
lines that the batch script reads:

    run_dir=/abs/run/folder           run.dir of the resolved configuration
    checkpoints=/abs/run/folder/checkpoints
    max_steps=600                     train.max_steps
    target_step=600                   where this configuration stops: train.exit_step if set, else max_steps
    collective_timeout_s=600          train.collective_timeout_s, rounded up to whole seconds
    newest=step_00000200              the newest complete checkpoint tag ('' when there is none)
    newest_step=200                   its step (0 when there is none)
    newest_id=step_00000200:123:456   the newest tag as one save made it (see tag_id; '' when there is none)
    newest_owes_evaluation=0          1 when a stop request saved the newest tag before its step's evaluation
                                      (evals_owed in its run.json: the next job runs it first), else 0
    tag_ids=step_00000100:... ...     every complete tag's id, space-separated
    plan=newest step_00000200: ...    what the training step will start from, for the job's header

After the training step exited 0, the batch script compares newest_step with target_step: equal or past it,
the run reached its end (or its planned exit_step), unless this step's own save at the last step owes its
final evaluation (a stop request in that step): then the job requeues like any stopped one, and the
restart, which saves nothing new, runs that evaluation and is done. Short of it, the ranks were stopped by a signal, and the
job requeues itself if they saved: if the newest tag now is not one of the tags that were there before the
step (newest_id not in the earlier tag_ids). Not a comparison of steps: a job that rolled back (--resume PATH)
or fell back to an older tag (checkpoint.fallback) saves a tag older than the newest one it started with.

Refused input prints one `error:` line and exits 2, as launch/train.py would, before any node runs anything:
a configuration that is bad on its own or (with --world-size, the job's number of ranks) on this world size,
a --resume that does not fit the run folder, and (with --world-size) a CPU build of torch in a job with GPUs.
Nothing here refuses what the training start accepts: a damaged checkpoint is the start's to judge (it
verifies checksums, and falls back with checkpoint.fallback).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def split_world_size(argv: list[str]) -> tuple[int | None, list[str]]:
    """(--world-size N, launch/train.py's arguments): run_state's own option comes first."""
    if argv[:1] != ["--world-size"]:
        return None, argv
    if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
        from txl_dist.errors import Refused

        raise Refused(f"--world-size needs a positive integer, not {argv[1:2]}")
    return int(argv[1]), argv[2:]


def tag_id(tag_dir: Path) -> str:
    """A tag as one save made it: its name, the inode of its folder and the modification time of its run.json.
    A save writes a new folder and renames it into place, so a tag saved again under the same name (after a
    rollback moved the old one to superseded/) has another id; no clock is compared (nodes' clocks may differ)."""
    from txl_dist.checkpoint import RUN_FILE, STATE_DIR

    folder = os.stat(tag_dir)
    run_file = os.stat(tag_dir / STATE_DIR / RUN_FILE)
    return f"{tag_dir.name}:{folder.st_ino}:{run_file.st_mtime_ns}"


def owes_evaluation(tag_dir: Path) -> bool:
    """Whether a stop request saved the tag before its step's evaluation (txl_dist/trainer.py's evals_owed)."""
    from txl_dist.checkpoint import CheckpointError, read_run_info

    try:
        return read_run_info(tag_dir).get("evals_owed") is True
    except (CheckpointError, AttributeError):
        return False


def tag_step(tag_dir: Path) -> int | None:
    """The step a tag holds: from its name (saves name tags by step), else from its run.json; None when unreadable."""
    from txl_dist.checkpoint import CheckpointError, read_run_info, step_of

    step = step_of(tag_dir.name)
    if step is not None:
        return step
    try:
        return int(read_run_info(tag_dir)["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return None


def readable(tag_dir: Path) -> bool:
    """Whether a tag's run.json reads (the cheap part of the start's verification; it also checks checksums)."""
    from txl_dist.checkpoint import CheckpointError, read_run_info

    try:
        read_run_info(tag_dir)
    except CheckpointError:
        return False
    return True


def to_step(step: int | None, target: int) -> str:
    """'resuming at step 20 of 200', or what happens when the tag is at or past where the configuration stops."""
    if step is None:
        return f"its step unknown; training to step {target}"
    if step >= target:
        return f"at step {step}, at or past step {target} where this configuration stops: nothing to train"
    return f"resuming at step {step} of {target}"


def auto_plan(ckpt_dir: Path, complete: list[str], target: int, fallback: bool) -> str:
    """--resume auto: the newest complete tag; with checkpoint.fallback, the newest whose run.json reads."""
    if not complete:
        return f"none yet: starting a new run to step {target}"
    newest = ckpt_dir / complete[-1]
    if readable(newest):
        owed = "; first the evaluation of its step, which a stop request left owed" if owes_evaluation(newest) else ""
        return f"newest {newest.name}: {to_step(tag_step(newest), target)}{owed}"
    damaged = f"newest {newest.name}: its run.json does not read"
    if not fallback:
        return f"{damaged}; training refuses it (checkpoint.fallback=true resumes from an older tag)"
    older = next((ckpt_dir / t for t in reversed(complete[:-1]) if readable(ckpt_dir / t)), None)
    if older is None:
        return f"{damaged}, nor does an older tag's; training refuses them"
    return f"{damaged}; checkpoint.fallback: {older.name}, {to_step(tag_step(older), target)}"


def path_plan(resume: str, ckpt_dir: Path, complete: list[str], target: int) -> str:
    """--resume PATH: the tag it names (a rollback when it is an older tag of this run folder)."""
    from txl_dist.checkpoint import resolve_path

    tag_dir = resolve_path(resume)
    step = tag_step(tag_dir)
    if not complete:
        return f"none yet; --resume {tag_dir}: {to_step(step, target)}"
    if tag_dir.name != complete[-1]:
        return (f"newest {complete[-1]}; --resume {tag_dir.name}: rolling back, newer tags move to "
                f"{ckpt_dir.name}/superseded/; {to_step(step, target)}")
    return f"newest {tag_dir.name}: {to_step(step, target)}"


def describe(argv: list[str]) -> dict[str, str]:
    """The run folder, its checkpoints, the step this configuration trains to, and where training starts."""
    from launch.train import parse_args
    from txl_dist.checkpoint import check_resume_request, inventory
    from txl_dist.config import load_config

    world_size, argv = split_world_size(argv)
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if world_size is not None:
        import torch

        from txl_dist.distributed import check_gpus_usable
        from txl_dist.startup import check_run_config  # imports DeepSpeed: only before the step

        # A CPU build of torch refused here, before srun starts the ranks (they would train on the CPU). Whether
        # a CUDA build sees its GPUs is each rank's check: the batch shell's own devices are the site's choice.
        check_gpus_usable("the job", cuda_available=torch.version.cuda is not None)
        check_run_config(cfg, world_size)
    run_dir = Path(cfg.run.dir).resolve()
    ckpt_dir = cfg.checkpoint_dir().resolve()
    complete = inventory(ckpt_dir).complete
    check_resume_request(args.resume, ckpt_dir, complete)
    target = cfg.train.exit_step if cfg.train.exit_step is not None else cfg.train.max_steps
    if args.resume == "auto":
        plan = auto_plan(ckpt_dir, complete, target, cfg.checkpoint.fallback)
    elif args.resume == "none":
        plan = f"none yet: starting a new run to step {target}"  # check_resume_request refused it otherwise
    else:
        plan = path_plan(args.resume, ckpt_dir, complete, target)
    newest = complete[-1] if complete else ""
    return {"run_dir": str(run_dir), "checkpoints": str(ckpt_dir), "max_steps": str(cfg.train.max_steps),
            "target_step": str(target), "collective_timeout_s": str(math.ceil(cfg.train.collective_timeout_s)),
            "newest": newest,
            "newest_step": str(tag_step(ckpt_dir / newest) or 0) if newest else "0",
            "newest_id": tag_id(ckpt_dir / newest) if newest else "",
            "newest_owes_evaluation": "1" if newest and owes_evaluation(ckpt_dir / newest) else "0",
            "tag_ids": " ".join(tag_id(ckpt_dir / t) for t in complete), "plan": plan}


def main(argv: list[str] | None = None) -> int:
    from txl_dist.errors import EXIT_REFUSED, Refused, one_line

    try:
        state = describe(list(sys.argv[1:] if argv is None else argv))
    except Refused as e:
        print(f"error: {one_line(e, limit=2000)}", file=sys.stderr)
        return EXIT_REFUSED
    for key, value in state.items():
        if "\n" in value:
            print(f"error: {key} holds a line break: {value!r}", file=sys.stderr)
            return EXIT_REFUSED
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
