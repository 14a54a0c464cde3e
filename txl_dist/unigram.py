"""The unigram baseline: the perplexity of a split under token frequencies counted on the training split.

    python -m txl_dist.unigram CORPUS_DIR [--split test] [--train-split train] [--smoothing 1.0]
                               [--model-result eval.json] [--json]

p(w) = (count_train(w) + smoothing) / (n_train + smoothing * V) (add-one, Laplace, by default: a piece never
seen in training still has a probability), and the perplexity is exp of the mean of -log p(w) over every
token of the split, end-of-document ids included. A language model that does not beat it has learnt nothing
beyond frequencies. launch/eval.py predicts every token of each eval stream but the stream's first, so its
count is a few tokens smaller; the two perplexities are still over the same text. --model-result reads
the JSON launch/eval.py writes (--output) and prints the model's perplexity beside the baseline.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import numpy as np

from txl_dist.data import CorpusError, read_manifest, split_reader
from txl_dist.entry import exit_process, guarded


def token_counts(corpus_dir: str | Path, split: str, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each id occurs in the split's stream (read once, in record batches)."""
    manifest = read_manifest(corpus_dir)
    reader = split_reader(corpus_dir, manifest, split)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in reader.chunks(0, reader.n_tokens):
        counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    return counts


def unigram_perplexity(corpus_dir: str | Path, split: str = "test", train_split: str = "train",
                       smoothing: float = 1.0) -> dict:
    """The split's perplexity under the smoothed unigram model of train_split (see the module doc)."""
    if not smoothing > 0:
        raise CorpusError(f"--smoothing must be > 0 (add-k smoothing gives unseen pieces a probability), got "
                          f"{smoothing}")
    manifest = read_manifest(corpus_dir)
    vocab = manifest.tokenizer.vocab_size
    for name in (split, train_split):
        if name not in manifest.splits:
            raise CorpusError(f"{Path(corpus_dir) / 'manifest.json'}: no split '{name}'; the corpus has "
                              f"{', '.join(sorted(manifest.splits))}")
    train = token_counts(corpus_dir, train_split, vocab).astype(np.float64)
    evaluated = token_counts(corpus_dir, split, vocab).astype(np.float64)
    log_p = np.log(train + smoothing) - math.log(train.sum() + smoothing * vocab)   # [V]
    n = evaluated.sum()
    loss = float(-(evaluated * log_p).sum() / n)
    return {"split": split, "train_split": train_split, "smoothing": smoothing, "tokens": int(n),
            "loss": loss, "perplexity": math.exp(loss)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m txl_dist.unigram", description=__doc__.split("\n\n")[0],
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
        model = _model_result(args.model_result, args.split) if args.model_result else None
        result = unigram_perplexity(args.corpus, args.split, args.train_split, args.smoothing)
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


def _model_result(path: str, split: str) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorpusError(f"--model-result {path}: cannot read it ({type(e).__name__}); pass the file "
                          "launch/eval.py --output wrote") from None
    if not isinstance(result, dict) or "perplexity" not in result or result.get("split") != split:
        raise CorpusError(f"--model-result {path}: not a launch/eval.py result for split '{split}'; evaluate "
                          f"that split with --output {path}")
    return result


if __name__ == "__main__":
    exit_process(main())
