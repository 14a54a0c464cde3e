"""The command line: ``python -m txl_dist.tracking replay RUN_DIR [--uri URI]`` (see replay.py)."""
from __future__ import annotations

import argparse
import logging
import sys

from txl_dist.cli_args import ArgumentParser
from txl_dist.errors import EXIT_FAILED, EXIT_REFUSED, Refused, RunFailed, one_line
from txl_dist.write_faults import print_result

from .replay import replay
from .secrets import scrub_secrets


def main(argv: list[str] | None = None) -> int:
    """``python -m txl_dist.tracking replay RUN_DIR [--uri URI]``; the exit status (0, 1 store failure, 2 refused)."""
    example = ("example:\n  python -m txl_dist.tracking replay runs/tiny\n"
               "  python -m txl_dist.tracking replay runs/tiny --uri http://mlflow.example.com:5000\n")
    raw = argparse.RawDescriptionHelpFormatter
    parser = ArgumentParser(prog="python -m txl_dist.tracking",
                            description="MLflow tracking tools for a txl-dist run dir.", epilog=example,
                            formatter_class=raw)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the tool")
    replay_cmd = commands.add_parser(
        "replay", help="send to the run's MLflow run what its journal says the store lacks",
        description="Send the metrics, params, artifacts and final status that the training job could not "
                    "deliver (server down, queue full, close timeout, crash) to the run recorded in "
                    "RUN_DIR/tracking/run_id. Safe to repeat: a second replay sends nothing.",
        epilog=example, formatter_class=raw)
    replay_cmd.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of the training job, e.g. runs/tiny")
    replay_cmd.add_argument("--uri", help="tracking URI (default: the one the run was logged to, else "
                                          "MLFLOW_TRACKING_URI; a run dir moved or copied with its own "
                                          "RUN/mlflow.db: that one), e.g. http://mlflow.example.com:5000")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = replay(args.run_dir, args.uri, announce=_say)
        print_result(report.summary())  # stdout on a full disk (`replay RUN > log`): one line, not a traceback
    except Refused as e:
        print(f"error: {scrub_secrets(one_line(e, limit=2000))}", file=sys.stderr)
        return EXIT_REFUSED
    except RunFailed as e:
        print(f"error: {scrub_secrets(one_line(e, limit=2000))}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _say(line: str) -> None:
    """Print a line before the sending, which a standard output that cannot be written must not stop (the
    error would be taken for the run dir's)."""
    try:
        print(line, flush=True)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
