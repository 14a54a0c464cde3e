"""Evaluate a training checkpoint: distributed perplexity with long memory.

    deepspeed launch/eval.py --checkpoint PATH [--config C] [--set eval.mem_len=1600 ...] [--split test]
                             [--output result.json] [--log-all-ranks]

PATH is a run folder, its checkpoints/ folder (the newest complete tag is used) or a step_* tag; the tag's
files are verified against their checksums first. The configuration is the checkpoint's own (saved in
run.json) unless --config names another; --set overrides either (e.g. the eval section). Runs on any world
size that divides eval.n_streams (ZeRO 1-3 checkpoints of another world size go through the universal
conversion, as for training). Rank 0 prints the result as JSON. Exit status 0; 2 for refused input (one
line says why); 1 for a fault during the evaluation (a lost rank).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from txl_dist import distributed
from txl_dist.atomic import atomic_write
from txl_dist.entry import guarded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="launch/eval.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, help="run folder, checkpoint folder or a step_* tag")
    p.add_argument("--config", default=None, help="run configuration JSON (default: the checkpoint's own)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set eval.mem_len=1600")
    p.add_argument("--split", default=None, help="split to evaluate (default: data.test_split)")
    p.add_argument("--output", default=None, help="also write the result as JSON to this file (rank 0)")
    p.add_argument("--log-all-ranks", action="store_true", help="every rank prints, prefixed with its rank")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def evaluate_checkpoint(cfg, tag_dir: Path, run_info: dict, split: str | None, env: distributed.DistEnv) -> dict:
    """Load the checkpoint's weights into an engine of this world size and evaluate one split (collective)."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.engine import build_engine, deepspeed_config
    from txl_dist.model import TransformerXL
    from txl_dist.startup import start_evaluation

    start = start_evaluation(cfg, tag_dir, run_info, env)
    try:
        cfg = start.cfg
        ds_config = deepspeed_config(cfg, env.world_size, load_universal=start.resume.source.universal)
        engine = build_engine(lambda: TransformerXL(cfg.model), ds_config, seed=cfg.train.seed)
        ckpt.load_engine(engine, start.resume.source)
        split = split or cfg.data.test_split
        result = start.evaluator.evaluate(engine.module, split)
    finally:
        start.evaluator.close()
    return {"checkpoint": str(tag_dir), "step": run_info["step"], "split": split,
            "eval_streams": cfg.eval_streams(env.world_size), "world_size": env.world_size, **result}


def main(argv: list[str] | None = None) -> int:
    """Evaluate on this rank; rank 0 prints the JSON result."""
    args = parse_args(argv)
    log = logging.getLogger(distributed.LOGGER_NAME)

    def job() -> int:
        from txl_dist.startup import eval_config

        env = distributed.discover()
        distributed.setup_logging(env, args.log_all_ranks)
        cfg, tag_dir, run_info = eval_config(args.checkpoint, args.config, args.overrides)
        distributed.configure_threads(env)
        result = evaluate_checkpoint(cfg, tag_dir, run_info, args.split, env)
        if env.is_main:
            text = json.dumps(result, indent=2)
            print(text)
            if args.output:
                atomic_write(args.output, text + "\n")
        return 0

    return guarded(job, log)


if __name__ == "__main__":
    sys.exit(main())
