"""Train a Transformer-XL language model (the main job).

    deepspeed launch/train.py --config configs/tiny.json [--set section.key=value ...]
                              [--resume auto|none|PATH] [--log-all-ranks]

The same script runs under `torchrun --nproc_per_node N launch/train.py ...` and under `srun` (rank, world
size and rendezvous address come from the environment; see txl_dist/distributed.py). On CPU the ranks use
gloo; when OMP_NUM_THREADS is unset, each rank gets the machine's cores divided by the local ranks.

--resume auto (default): continue from checkpoint.dir's `latest` when there is one, else start fresh.
--resume PATH: a checkpoint folder (holding `latest`) or one of its step_* tags. --resume none: fresh start.
Exit status: 0 when training ended, reached train.exit_step or was stopped by SIGTERM/SIGUSR1 after saving;
2 for a refused configuration, corpus or checkpoint (one line says why).
"""
from __future__ import annotations

import argparse
import sys

from txl_dist import distributed
from txl_dist.checkpoint import CheckpointError
from txl_dist.config import ConfigError, load_config
from txl_dist.data import CorpusError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no option may be a prefix of a torchrun option: that breaks torchrun)."""
    p = argparse.ArgumentParser(prog="launch/train.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", required=True, help="run configuration JSON (configs/*.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set train.max_steps=20 (repeatable)")
    p.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                   help="auto: checkpoint.dir's latest if any (default); none; or a checkpoint/tag folder")
    p.add_argument("--log-all-ranks", action="store_true", help="every rank prints, prefixed with its rank")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the main job on this rank; returns the exit status."""
    args = parse_args(argv)
    env = distributed.discover()
    log = distributed.setup_logging(env, args.log_all_ranks)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        log.error("error: %s", e)
        return 2
    distributed.configure_threads(env)
    distributed.init_process_group(env)
    from txl_dist import trainer  # imports deepspeed: after the threads are set

    try:
        return trainer.run(cfg, env, resume=args.resume)
    except (ConfigError, CheckpointError, CorpusError, distributed.LaunchError) as e:
        log.error("error: %s", e)
        return 2
    finally:
        distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
