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

from txl_dist.host import quiet_torch_cpp_warnings  # standard library only, as the next line
from txl_dist.stop_request import catch_stop_signals, ignore_stop_signals  # standard library only: slow imports below

if __name__ == "__main__":  # a stop signal during the imports below must not kill the rank
    catch_stop_signals()
    quiet_torch_cpp_warnings()

import argparse  # noqa: E402
import logging  # noqa: E402

from txl_dist import distributed  # noqa: E402
from txl_dist.cli_args import ArgumentParser  # noqa: E402
from txl_dist.config import load_config  # noqa: E402
from txl_dist.entry import exit_process, guarded  # noqa: E402


EPILOG = """examples:
  deepspeed launch/train.py --config configs/tiny.json --set train.max_steps=50
  deepspeed --num_gpus 8 launch/train.py --config configs/large.json --set data.path=/data/wt103 \\
      --set model.vocab_size=null
  torchrun --nproc_per_node 2 launch/train.py --config configs/tiny.json --resume none
  python launch/train.py --config configs/tiny.json --resume runs/tiny/checkpoints/step_00000050

Every key of the configuration: docs/configuration.md. Where a run writes: run.dir (runs/default unless set).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line (no option may be a prefix of a torchrun option: that breaks torchrun)."""
    p = ArgumentParser(prog="launch/train.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE",
                   help="run configuration JSON, e.g. configs/tiny.json (every key: docs/configuration.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value; the value is JSON when it parses, else a string (repeatable), "
                        "e.g. --set train.max_steps=20 --set model.cutoffs=[2000,6000]")
    p.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                   help="auto (default): continue from the newest complete checkpoint in run.dir, else start "
                        "fresh; none: start fresh (refused when run.dir holds checkpoints); PATH: a run folder, "
                        "checkpoints/ folder or step_* tag, e.g. runs/tiny/checkpoints/step_00000050 (an older "
                        "tag rolls the run back)")
    p.add_argument("--log-all-ranks", action="store_true",
                   help="every rank prints, prefixed with its rank (default: rank 0 only; others print warnings)")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


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

    try:
        return guarded(job, log)
    finally:
        ignore_stop_signals()


if __name__ == "__main__":
    exit_process(main())
