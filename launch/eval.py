"""Evaluate a training checkpoint: distributed perplexity with long memory.

    deepspeed launch/eval.py --checkpoint PATH [--config C] [--set eval.mem_len=1600 ...] [--split test]
                             [--json-out result.json] [--log-all-ranks]

PATH is a run folder, its checkpoints/ folder (the newest complete tag is used) or a step_* tag; the tag's
files are verified against their checksums first. The tag is held for reading from its choice to the end of
the load, so a run still training there does not remove it meanwhile (its retention keeps it until its next
save). The configuration is the checkpoint's own (saved in run.json) unless --config names another; --set
overrides either (e.g. the eval section). Runs on any world size that divides eval.n_streams (null: the
streams the checkpoint's run evaluated, recorded in its run.json; ZeRO 1-3 checkpoints of another world size
go through the universal conversion, as for training). The split (--split) is checked with the corpus,
before anything is built or written. Rank 0 prints a short table (loss, perplexity, bits per token/byte/char,
the tokens predicted, the precision and attention path the numbers were computed with, the memory settings),
then the result as JSON; --json-out also writes the JSON to a file (atomically; its folder must exist, and the
path is checked before the evaluation). Exit status 0; 2 for refused input (one line says why); 1 for a fault
during the evaluation (a lost rank); 143 for SIGTERM (scancel, a time limit, kill), SIGUSR1 or the end of its
launcher (torchrun, deepspeed), which stop it at once: each rank it reached says where (`error: evaluation
stopped by SIGTERM at segment 2 of 40 of split test; no result written`), the others stop naming it, and no
--json-out is written (one that comes once the numbers exist waits for them to be printed and written).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable

from txl_dist.host import quiet_torch_cpp_warnings  # standard library only
from txl_dist.stop_request import (Terminated, catch_sigterm_early, finish_despite_sigterm,  # standard library only
                                   stop_at_once)

if __name__ == "__main__":  # before torch: a lost rank is reported in one line, without C++ stack dumps
    quiet_torch_cpp_warnings()
    catch_sigterm_early()  # scancel (or --signal=USR1) during the imports: the job's line too, not a silent death

from txl_dist import distributed  # noqa: E402
from txl_dist.atomic import atomic_write  # noqa: E402
from txl_dist.cli_args import ArgumentParser  # noqa: E402
from txl_dist.entry import exit_process, guarded, print_result  # noqa: E402
from txl_dist.errors import RunFailed  # noqa: E402


EPILOG = """examples:
  deepspeed --num_gpus 2 launch/eval.py --checkpoint runs/tiny --split test --set eval.mem_len=256
  python launch/eval.py --checkpoint runs/tiny/checkpoints/step_00000100 --split valid --json-out valid.json
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = ArgumentParser(prog="launch/eval.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="what to evaluate: a run folder or its checkpoints/ folder (the newest complete tag), or "
                        "one tag, e.g. runs/tiny/checkpoints/step_00000100")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="run configuration JSON to use instead of the checkpoint's own, e.g. configs/tiny.json "
                        "(its model must match the checkpoint)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set eval.mem_len=1600 --set eval.n_streams=8")
    p.add_argument("--split", default=None, metavar="NAME",
                   help="split to evaluate, e.g. valid (default: data.test_split)")
    p.add_argument("--json-out", "--output", dest="json_out", default=None, metavar="FILE",
                   help="also write the result as JSON to this file, atomically (rank 0; its folder must exist, "
                        "checked before evaluating), e.g. result.json")
    p.add_argument("--log-all-ranks", action="store_true", help="every rank prints, prefixed with its rank")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def with_checkpoints_streams(choice, world_size: int):
    """choice with eval.n_streams resolved by RunConfig.eval_streams for this world size and the checkpoint's
    record: where the configuration leaves it null (the GPU presets do), the streams its run evaluated
    (checkpoint.recorded_eval_streams), not one per rank here, so that any world size gives the numbers that run
    logged (each stream starts with an empty memory). Refused, the hold released, where this world size cannot
    split them."""
    import dataclasses

    from txl_dist.checkpoint import recorded_eval_streams

    cfg = choice.cfg
    try:
        streams = cfg.eval_streams(world_size, recorded_eval_streams(choice.run_info))
    except BaseException:
        choice.hold.release()
        raise
    resolved = dataclasses.replace(cfg.eval, n_streams=streams)
    return dataclasses.replace(choice, cfg=dataclasses.replace(cfg, eval=resolved))


def evaluate_checkpoint(choice, split: str | None, env: distributed.DistEnv, check_outputs=None,
                        at: Callable[[str], None] | None = None) -> dict:
    """Load the checkpoint's weights into an engine of this world size and evaluate one split (collective);
    choice: what startup.eval_config read (the tag is held for reading until its weights are loaded);
    check_outputs: rank 0's check of what it will write, before any work (startup.start_evaluation);
    at: told where the evaluation is as each segment begins ('at segment 2 of 40 of split test')."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.data import read_manifest
    from txl_dist.engine import build_engine, deepspeed_config
    from txl_dist.model import TransformerXL
    from txl_dist.startup import start_evaluation
    from txl_dist.watchdog import note_progress, note_start_up

    start = start_evaluation(choice, env, split, check_outputs)
    tag_dir, run_info = start.resume.tag_dir, start.resume.run_info  # rank 0's, on every rank
    try:
        cfg = start.cfg
        ds_config = deepspeed_config(cfg, env.world_size, load_universal=start.resume.source.universal)
        engine = build_engine(lambda: TransformerXL(cfg.model), ds_config, seed=cfg.train.seed)
        note_start_up("the engine built")  # a rank stuck loading is named as past this
        ckpt.load_engine(engine, start.resume.source)
        start.release_checkpoint()  # loaded: the run's retention may remove the tag now
        segments = start.evaluator.segments(start.split)

        def on_segment(i: int) -> None:  # a rank stuck between segments is named by the watchdog, not waited for
            note_progress((0, i + 1), f"evaluation of {start.split}, segment {i + 1}")
            if at is not None:
                at(f"at segment {i + 1} of {segments} of split {start.split}")

        result = start.evaluator.evaluate(engine.module, start.split, on_segment=on_segment)
    finally:
        start.close()
    memory = {key: getattr(cfg.eval, key) for key in ("tgt_len", "mem_len", "clamp_len", "same_length", "max_segments")}
    # What the numbers were computed in: a bf16 and an fp32 evaluation of one checkpoint differ in the 5th digit.
    runtime = {"precision": start.choices.precision, "attn_impl": start.choices.attn_impl}
    # Which text was scored: unigram --model-result refuses a result of another corpus (or preparation) by it.
    tokens_sha256 = read_manifest(cfg.data.path).splits[start.split].tokens_sha256
    return {"checkpoint": str(tag_dir), "step": run_info["step"], "split": start.split,
            "split_tokens_sha256": tokens_sha256, "eval_streams": cfg.eval_streams(env.world_size),
            "world_size": env.world_size, "streams_per_forward": start.evaluator.group, "eval": memory, **runtime,
            **result}


def result_table(result: dict) -> str:
    """The result as a short aligned table, for people (the JSON follows it for programs)."""
    memory = result["eval"]
    rows = [
        ("checkpoint", f"{result['checkpoint']} (step {result['step']})"),
        ("split", f"{result['split']}: {int(result['tokens']):,} tokens predicted over {result['eval_streams']} "
                  f"streams on {result['world_size']} rank(s), {result['streams_per_forward']} at a time"),
        ("precision", f"{result['precision']} | attention {result['attn_impl']}"),
        ("memory", f"tgt_len {memory['tgt_len']} | mem_len {memory['mem_len']} | clamp_len {memory['clamp_len']} | "
                   f"same_length {str(memory['same_length']).lower()}"
                   + (f" | max_segments {memory['max_segments']}" if memory["max_segments"] is not None else "")),
        ("loss", f"{result['loss']:.4f} nats/token"),
        ("perplexity", f"{result['perplexity']:.3f}"),
        ("bits/token", f"{result['bits_per_token']:.4f}"),
        ("bits/byte", f"{result['bits_per_byte']:.4f}"),
        ("bits/char", f"{result['bits_per_char']:.4f}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def write_json_out(path: str | None, text: str, printed: bool) -> None:
    """Write the result to --json-out (where given); RunFailed in one line when it cannot be written."""
    if path is None:
        return
    try:
        atomic_write(path, text + "\n")
    except OSError as e:  # the path was checked at the start: a full disk, a read-only remount, a folder removed
        where = "the result is printed above" if printed else "nor can the standard output take the result"
        raise RunFailed(f"--json-out {path}: cannot write it ({e.strerror or e}); {where}; free space there or "
                        "choose another path, and evaluate again") from None


def main(argv: list[str] | None = None) -> int:
    """Evaluate on this rank; rank 0 prints the table and the JSON result."""
    args = parse_args(argv)
    log = logging.getLogger(distributed.LOGGER_NAME)

    where = ["during start-up"]  # then the segment begun last: what a SIGTERM's line says

    def at(text: str) -> None:
        where[0] = text

    def job() -> int:
        try:
            with stop_at_once():
                return evaluation()
        except Terminated as e:  # scancel, a time limit, kill, its launcher gone: no result exists, none was written
            raise Terminated(f"evaluation stopped {e.by} {where[0]}; no result written") from None

    def evaluation() -> int:
        # stdout is for the table and the JSON (a program may parse them). DeepSpeed's logger prints to the
        # stdout it finds when first imported (its accelerator warning, with DS_ACCELERATOR unset): until the
        # result exists, stdout is stderr.
        with contextlib.redirect_stdout(sys.stderr):
            from txl_dist.output_paths import check_output_file
            from txl_dist.startup import eval_config

            env = distributed.discover()
            distributed.setup_logging(env, args.log_all_ranks)
            choice = with_checkpoints_streams(eval_config(args.checkpoint, args.config, args.overrides),
                                              env.world_size)
            distributed.configure_threads(env)
            # Only rank 0 writes it, so only rank 0 can judge the path; every rank refuses with it.
            check = (lambda: check_output_file(args.json_out, "--json-out")) if args.json_out is not None else None
            result = evaluate_checkpoint(choice, args.split, env, check, at=at)
        finish_despite_sigterm()  # the numbers exist: printing and writing them take milliseconds
        if env.is_main:
            text = json.dumps(result, indent=2)
            try:
                print_result(result_table(result), text, sep="\n\n")
            except RunFailed:  # stdout on a full disk: the result still goes to --json-out, where it has room
                write_json_out(args.json_out, text, printed=False)
                raise
            write_json_out(args.json_out, text, printed=True)
        return 0

    return guarded(job, log)


if __name__ == "__main__":
    exit_process(main())
