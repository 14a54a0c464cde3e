"""The unigram baseline: the perplexity of a split under token frequencies counted on the training split.

    python -m txl_dist.unigram CORPUS_DIR [--split test] [--train-split train] [--smoothing 1.0]
                               [--model-result eval.json] [--json]

p(w) = (count_train(w) + smoothing) / (n_train + smoothing * V) (add-one, Laplace, by default: a piece never
seen in training still has a probability), and the perplexity is exp of the mean of -log p(w) over every
token of the split, end-of-document ids included. A language model that does not beat it has learnt nothing
beyond frequencies. --model-result reads the JSON launch/eval.py writes (--json-out) and prints the model's
perplexity beside the baseline, computed then over the very tokens the evaluation predicted (every token of
each eval stream but its first; with eval.max_segments, only the first windows of each); a result
of another text than CORPUS_DIR's split (its split_tokens_sha256 differs, or its token count cannot come from
the split) is refused, as are one of another split, and a file that is no such result (not UTF-8, not JSON, a
perplexity that is no number).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from txl_dist.cli_args import ArgumentParser
from txl_dist.config import read_json_object
from txl_dist.data import CorpusError, read_manifest, split_reader
from txl_dist.entry import exit_process, guarded


def token_counts(corpus_dir: str | Path, split: str, vocab_size: int,
                 ranges: list[tuple[int, int]] | None = None) -> np.ndarray:
    """int64 [vocab_size]: how often each id occurs in the split's stream, or in its token `ranges` [a, b) (read
    once, in record batches)."""
    manifest = read_manifest(corpus_dir)
    reader = split_reader(corpus_dir, manifest, split)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for a, b in ranges if ranges is not None else [(0, reader.n_tokens)]:
        for chunk in reader.chunks(a, b):
            counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    return counts


def unigram_perplexity(corpus_dir: str | Path, split: str = "test", train_split: str = "train",
                       smoothing: float = 1.0, predicted: EvalWindows | None = None) -> dict:
    """The split's perplexity under the smoothed unigram model of train_split (see the module doc); over the
    tokens an evaluation with `predicted`'s streams and windows predicts, when given."""
    if not (smoothing > 0 and math.isfinite(smoothing)):
        raise CorpusError(f"--smoothing must be a finite number > 0 (add-k smoothing gives unseen pieces a "
                          f"probability), got {smoothing}")
    manifest = read_manifest(corpus_dir)
    vocab = manifest.tokenizer.vocab_size
    for name in (split, train_split):
        if name not in manifest.splits:
            raise CorpusError(f"{Path(corpus_dir) / 'manifest.json'}: no split '{name}'; the corpus has "
                              f"{', '.join(sorted(manifest.splits))}")
    train = token_counts(corpus_dir, train_split, vocab).astype(np.float64)
    ranges = None if predicted is None else predicted_ranges(manifest.splits[split].n_tokens, *predicted)
    evaluated = token_counts(corpus_dir, split, vocab, ranges).astype(np.float64)
    log_p = np.log(train + smoothing) - math.log(train.sum() + smoothing * vocab)   # [V]
    n = evaluated.sum()
    loss = float(-(evaluated * log_p).sum() / n)
    return {"split": split, "train_split": train_split, "smoothing": smoothing, "tokens": int(n),
            "loss": loss, "perplexity": math.exp(loss)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = ArgumentParser(prog="python -m txl_dist.unigram", description=__doc__.split("\n\n")[0],
                       allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  python -m txl_dist.unigram data/shakespeare --split test "
                              "--model-result runs/tiny/eval-test.json\n")
    p.add_argument("corpus", help="prepared corpus folder (manifest.json)")
    p.add_argument("--split", default="test", help="split to evaluate (default test)")
    p.add_argument("--train-split", default="train", help="split the frequencies are counted on (default train)")
    p.add_argument("--smoothing", type=float, default=1.0, help="add-k smoothing (default 1: add-one)")
    p.add_argument("--model-result", default=None, metavar="JSON",
                   help="launch/eval.py --json-out file: print the model's perplexity beside the baseline")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Print the baseline (and the model's perplexity, with --model-result)."""
    args = parse_args(argv)
    log = logging.getLogger("txl_dist")

    def job() -> int:
        model, windows = (_model_result(args.model_result, args.split, args.corpus) if args.model_result
                          else (None, None))
        # Over the very tokens the model predicted: an evaluation limited by eval.max_segments scores a prefix.
        result = unigram_perplexity(args.corpus, args.split, args.train_split, args.smoothing, windows)
        if args.json:
            print(json.dumps({**result, **({"model_perplexity": model["perplexity"]} if model else {})}, indent=2))
            return 0
        line = f"{args.split} perplexity:"
        if model:
            line += f" model {model['perplexity']:.2f} (step {model.get('step', '?')}),"
        print(f"{line} unigram {result['perplexity']:.2f} (add-{args.smoothing:g} smoothed counts of "
              f"{args.train_split}, {result['tokens']} tokens)")
        return 0

    return guarded(job, log)


def _model_result(path: str, split: str, corpus: str | Path) -> tuple[dict, EvalWindows | None]:
    """The launch/eval.py result at `path`, checked to be one of `split` of this corpus, as far as it tells;
    and the streams and windows it predicted, where it records them."""
    hint = "; pass the file launch/eval.py --json-out wrote"
    result = read_json_object(path, error=CorpusError, label=f"--model-result {path}", missing_hint=hint,
                              object_hint=hint)
    if "perplexity" not in result or result.get("split") != split:
        raise CorpusError(f"--model-result {path}: not a launch/eval.py result for split '{split}'; evaluate "
                          f"that split with --json-out {path}")
    perplexity = result["perplexity"]
    if not _is_number(perplexity) or not perplexity > 0:
        raise CorpusError(f"--model-result {path}: perplexity {json.dumps(perplexity)} is not a number > 0; the "
                          "file is damaged: evaluate again with launch/eval.py --json-out")
    return result, _check_same_text(result, path, split, corpus)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class EvalWindows(NamedTuple):
    """What decides which tokens of a split launch/eval.py predicts (its JSON's eval_streams and eval)."""

    n_streams: int
    tgt_len: int
    max_segments: int | None


def predicted_ranges(n_tokens: int, n_streams: int, tgt_len: int, max_segments: int | None) -> list[tuple[int, int]]:
    """The token ranges [a, b) launch/eval.py predicts of a split of n_tokens: n_streams streams of
    n_tokens // n_streams tokens, every token of each but its first (the first max_segments windows of
    tgt_len, where set)."""
    stream_len = n_tokens // n_streams
    per_stream = max(stream_len - 1, 0)
    if max_segments is not None:
        per_stream = min(per_stream, max_segments * tgt_len)
    return [(s * stream_len + 1, s * stream_len + 1 + per_stream) for s in range(n_streams) if per_stream]


def predicted_tokens(n_tokens: int, n_streams: int, tgt_len: int, max_segments: int | None) -> int:
    """How many tokens launch/eval.py predicts of a split of n_tokens (predicted_ranges)."""
    return sum(b - a for a, b in predicted_ranges(n_tokens, n_streams, tgt_len, max_segments))


def _check_same_text(result: dict, path: str, split: str, corpus: str | Path) -> EvalWindows | None:
    """Refuse a result of another corpus (another vocabulary, another text), which would be compared with the
    wrong baseline: by the split's tokens_sha256 where the result records it, and by its token count, which
    must be one this corpus' split can give. A result without them (written by hand, or by an older
    launch/eval.py) is not checked."""
    recorded = result.get("split_tokens_sha256")
    counted = "tokens" in result and "eval_streams" in result
    if recorded is None and not counted:
        return None
    if counted:
        tokens, streams, memory = result["tokens"], result["eval_streams"], result.get("eval", {})
        tgt_len = memory.get("tgt_len") if isinstance(memory, dict) else None
        max_segments = memory.get("max_segments") if isinstance(memory, dict) else None
        if not (_is_number(tokens) and tokens >= 0 and float(tokens).is_integer() and isinstance(streams, int)
                and not isinstance(streams, bool) and streams > 0 and isinstance(tgt_len, int) and tgt_len > 0
                and (max_segments is None or isinstance(max_segments, int))):
            raise CorpusError(f"--model-result {path}: tokens, eval_streams or eval.tgt_len / eval.max_segments are "
                              "not the numbers launch/eval.py writes; the file is damaged: evaluate again with "
                              "--json-out")
    manifest = read_manifest(corpus)
    if split not in manifest.splits:
        return None  # refused by unigram_perplexity, naming the splits there are
    other = ("the result is of another corpus (or another preparation of it), and would be compared with the wrong "
             "baseline; pass the result of an evaluation of this corpus")
    digest = manifest.splits[split].tokens_sha256
    if recorded is not None and recorded != digest:
        raise CorpusError(f"--model-result {path}: the evaluation scored split '{split}' with tokens_sha256 "
                          f"{str(recorded)[:12]}..., but the split of {corpus} has {digest[:12]}...: {other}")
    if not counted:
        return None
    n_tokens = manifest.splits[split].n_tokens
    expected = predicted_tokens(n_tokens, streams, tgt_len, max_segments)
    if int(tokens) != expected:
        raise CorpusError(f"--model-result {path}: the evaluation predicted {int(tokens)} tokens of split '{split}' "
                          f"over {streams} streams, but the split of {corpus} has {n_tokens} tokens, which give "
                          f"{expected}: {other}")
    return EvalWindows(streams, tgt_len, max_segments)


if __name__ == "__main__":
    exit_process(main())
