"""Evaluate a training checkpoint: distributed perplexity with long memory.

    deepspeed launch/eval.py --checkpoint PATH [--config C] [--set eval.mem_len=1600 ...] [--split test]
                             [--output result.json] [--log-all-ranks]

PATH is a checkpoint folder (its `latest` is used) or a step_* tag. The configuration is the checkpoint's
own (saved in run.json) unless --config names another; --set overrides either (e.g. the eval section).
Runs on any world size that divides eval.n_streams (ZeRO 1-3 checkpoints of another world size go
through the universal conversion, as for training). Rank 0 prints the result as JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from txl_dist import distributed
from txl_dist.checkpoint import CheckpointError
from txl_dist.config import ConfigError, config_from_dict, apply_override, load_config
from txl_dist.data import CorpusError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="launch/eval.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (with 'latest') or a step_* tag")
    p.add_argument("--config", default=None, help="run configuration JSON (default: the checkpoint's own)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set eval.mem_len=1600")
    p.add_argument("--split", default=None, help="split to evaluate (default: data.test_split)")
    p.add_argument("--output", default=None, help="also write the result as JSON to this file (rank 0)")
    p.add_argument("--log-all-ranks", action="store_true", help="every rank prints, prefixed with its rank")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def evaluate_checkpoint(checkpoint: str, config: str | None, overrides: list[str], split: str | None,
                        env: distributed.DistEnv) -> dict:
    """Load the checkpoint's weights into an engine of this world size and evaluate one split (collective)."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.data import read_manifest
    from txl_dist.engine import build_engine, deepspeed_config, zero_stage
    from txl_dist.evaluate import Evaluator
    from txl_dist.model import TransformerXL
    from txl_dist.trainer import resolve_model_config

    tag_dir = ckpt.resolve_resume(checkpoint, checkpoint)
    run_info = ckpt.read_run_info(tag_dir)
    if config is None:
        raw = copy.deepcopy(run_info["config"])  # apply_override edits it in place
        for item in overrides:
            apply_override(raw, item)
        cfg = config_from_dict(raw)
    else:
        cfg = load_config(config, overrides)
    manifest = read_manifest(cfg.data.path)
    if manifest.tokenizer.sha256 != run_info["tokenizer_sha256"]:
        raise CheckpointError(f"{tag_dir}: trained with another tokenizer than {cfg.data.path}'s; evaluate on "
                              "data prepared with the checkpoint's tokenizer")
    cfg = resolve_model_config(cfg, manifest.tokenizer.vocab_size, cfg.data.path)
    if zero_stage(cfg.deepspeed) != run_info["zero_stage"]:
        raise CheckpointError(f"{tag_dir}: saved with ZeRO stage {run_info['zero_stage']}; evaluate with that stage")
    source = ckpt.engine_source(tag_dir, run_info, world_size=env.world_size, rank=env.rank)
    ds_config = deepspeed_config(cfg, env.world_size, load_universal=source.universal)
    engine = build_engine(lambda: TransformerXL(cfg.model), ds_config, seed=cfg.train.seed)
    ckpt.load_engine(engine, source)
    evaluator = Evaluator(cfg.data.path, cfg.eval, rank=env.rank, world_size=env.world_size,
                          n_streams=cfg.eval_streams(env.world_size), device=engine.device)
    split = split or cfg.data.test_split
    try:
        result = evaluator.evaluate(engine.module, split)
    finally:
        evaluator.close()
    return {"checkpoint": str(tag_dir), "step": run_info["step"], "split": split,
            "eval_streams": cfg.eval_streams(env.world_size), "world_size": env.world_size, **result}


def main(argv: list[str] | None = None) -> int:
    """Evaluate on this rank; rank 0 prints the JSON result. Exit status 0, or 2 for a refused input."""
    args = parse_args(argv)
    env = distributed.discover()
    log = distributed.setup_logging(env, args.log_all_ranks)
    distributed.configure_threads(env)
    distributed.init_process_group(env)
    try:
        result = evaluate_checkpoint(args.checkpoint, args.config, args.overrides, args.split, env)
    except (ConfigError, CheckpointError, CorpusError, distributed.LaunchError) as e:
        log.error("error: %s", e)
        return 2
    finally:
        distributed.destroy_process_group()
    if env.is_main:
        text = json.dumps(result, indent=2)
        print(text)
        if args.output:
            Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
