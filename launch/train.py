"""Train a Transformer-XL language model (the main job).

    deepspeed launch/train.py --config configs/tiny.json [--set section.key=value ...]
                              [--resume auto|none|PATH] [--log-all-ranks]

The same script runs under `torchrun --nproc_per_node N launch/train.py ...` and under `srun` (rank, world
size and rendezvous address come from the environment; see txl_dist/distributed.py). On CPU the ranks use
gloo; when OMP_NUM_THREADS is unset, each rank gets the machine's cores divided by the local ranks.

Everything the run writes goes to run.dir (checkpoints/, logs/, tracking/, config.resolved.json, the
default MLflow store); a second job on the same run.dir is refused.
--resume auto (default): continue from the newest complete checkpoint in <run.dir>/checkpoints (verified
against its checksums; `latest` is not trusted), else start fresh. --resume PATH: a run folder, checkpoint
folder or step_* tag (an older tag rolls the run back: newer tags are moved to checkpoints/superseded/).
--resume none: a fresh start, refused when run.dir already holds checkpoints.
Exit status: 0 when training ended, reached train.exit_step, or was stopped by SIGTERM/SIGUSR1 or by the
loss of its launcher after saving; 2 for refused input (configuration, corpus, checkpoint, tracking store,
a busy run.dir; one line says why, nothing is written); 1 for a fault during the run (a lost rank, a save
that failed, a diverged loss; one line says what, the newest complete checkpoint is kept).
"""
from __future__ import annotations

from txl_dist.stop_request import catch_stop_signals  # standard library only: the imports below are slow

if __name__ == "__main__":  # a stop signal during the imports below must not kill the rank
    catch_stop_signals()

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from txl_dist import distributed  # noqa: E402
from txl_dist.config import load_config  # noqa: E402
from txl_dist.entry import guarded  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no option may be a prefix of a torchrun option: that breaks torchrun)."""
    p = argparse.ArgumentParser(prog="launch/train.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", required=True, help="run configuration JSON (configs/*.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set train.max_steps=20 (repeatable)")
    p.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                   help="auto: the newest complete checkpoint in run.dir (default); none; or a run/checkpoint/tag folder")
    p.add_argument("--log-all-ranks", action="store_true", help="every rank prints, prefixed with its rank")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the main job on this rank; returns the exit status."""
    catch_stop_signals()  # before anything slow: a stop signal during start-up must not kill the rank
    args = parse_args(argv)
    log = logging.getLogger(distributed.LOGGER_NAME)

    def job() -> int:
        env = distributed.discover()
        distributed.setup_logging(env, args.log_all_ranks)
        cfg = load_config(args.config, args.overrides)
        distributed.configure_threads(env)
        from txl_dist import trainer  # imports deepspeed: after the threads are set

        return trainer.run(cfg, env, resume=args.resume, log_all_ranks=args.log_all_ranks)

    return guarded(job, log)


if __name__ == "__main__":
    sys.exit(main())
