"""Where a training run stands, for launch/slurm/train.sbatch (one process, before and after the training step).

    python launch/slurm/run_state.py --config C [--set section.key=value ...] [--resume ...] [--log-all-ranks]

Takes launch/train.py's own arguments (parsed by its parser, so the two never disagree) and prints `key=value`
lines that the batch script reads:

    run_dir=/abs/run/folder           run.dir of the resolved configuration
    checkpoints=/abs/run/folder/checkpoints
    max_steps=600                     train.max_steps
    target_step=600                   where this configuration stops: train.exit_step if set, else max_steps
    newest=step_00000200              the newest complete checkpoint tag ('' when there is none)
    newest_step=200                   its step (0 when there is none)

The batch script compares newest_step with target_step after a training step that exited 0: equal or past
it, the run reached its end (or its planned exit_step); short of it, the job was stopped by a signal after
a save, and it requeues itself. Refused input (a bad config or override) prints one `error:` line and exits
2, as launch/train.py would, before any node runs anything.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def describe(argv: list[str]) -> dict[str, str]:
    """The run folder, its checkpoint folder, the step this configuration trains to, the newest checkpoint."""
    from launch.train import parse_args
    from txl_dist.checkpoint import inventory, read_run_info
    from txl_dist.config import load_config

    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(cfg.run.dir).resolve()
    ckpt_dir = cfg.checkpoint_dir().resolve()
    complete = inventory(ckpt_dir).complete
    newest, newest_step = "", 0
    if complete:
        newest = complete[-1]
        newest_step = int(read_run_info(ckpt_dir / newest)["step"])
    target = cfg.train.exit_step if cfg.train.exit_step is not None else cfg.train.max_steps
    return {"run_dir": str(run_dir), "checkpoints": str(ckpt_dir), "max_steps": str(cfg.train.max_steps),
            "target_step": str(target), "newest": newest, "newest_step": str(newest_step)}


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
