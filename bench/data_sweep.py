"""A random sweep over corpora and data_prep options: each case through every data_prep command it can take.

Each case writes a few small input files (plain text, whole-file or one document per line, or JSON Lines; words
with accents, CJK, emoji, tabs, CRLF and blank lines; now and then a file without documents), draws the
splits (held-out fractions or files of their own), the layout (world size, streams, evaluation streams) and
the tokenizer's options (model type, byte fallback with a vocabulary to suit, normalization, the newline
piece, whitespace), then runs:

- `train-tokenizer`, then `prepare` with that model (one process or two);
- `prepare --plan`, N `prepare --shard i/N` tasks and `finalize`: the corpus must hold the same token streams
  as the one-shot `prepare` (every split's token count, document count and sha256);
- `verify` and `inspect` of the corpus;
- a second corpus of other drawn inputs with the same tokenizer, `mix` of the two (drawn weights, `--index`
  or a copy, `--train-tokens`), then `verify` of the mixture;
- `relayout` of a copy to another world size and stream count, then `verify`: the tokens must not change;
- two training steps of a toy model on the corpus or the mixture (`launch/train.py` on 1 rank, drawn streams
  and segment length), with the final validation and test: it must train, or refuse in one line.

A case refused with one `error:` line (exit status 2) counts as refused, not failed: a refusal is an answer.

    python -m bench.data_sweep [--cases 60] [--seed 0] [--minutes 30] [--out DIR] [--keep]

A case takes ~10-20 s on 2 cores. Exit status 0 when no case failed, 1 when one did (its folder kept, with
the inputs and every command's output), 2 on bad arguments. What sweeps found: docs/reliability.md, "Random
configurations".
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import string
import sys
from pathlib import Path
from typing import Any

from bench.config_sweep import refusal, run, set_arguments, sweep, sweep_arguments, train_command

_WORD_RNG = random.Random(0)
WORDS = ["the", "king", "queen", "\u03a9", "na\u00efve", "\u65e5\u672c", "\U0001f642", "x" * 30, "co-op", "\t",
         "it's"] + ["".join(_WORD_RNG.choice(string.ascii_lowercase + "\u00e9\u00fc")
                            for _ in range(_WORD_RNG.randint(1, 8))) for _ in range(400)]
SEPARATORS = [" ", " ", " ", "\n", "  ", "\r\n", ", "]


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(n))


def write_inputs(rng: random.Random, folder: Path) -> tuple[list[str], str]:
    """The case's input files and its inputs' arguments of prepare (and a line describing them)."""
    kind = rng.choice(["text", "text", "jsonl"])
    line_docs = kind == "text" and rng.random() < 0.5
    suffix = ".jsonl" if kind == "jsonl" else ".txt"

    def write(path: Path, n_docs: int) -> Path:
        if kind == "jsonl":
            path.write_text("".join(json.dumps({"text": words(rng, rng.choice([0, 5, 200, 200]))}) + "\n"
                                    for _ in range(n_docs)))
        elif line_docs:
            path.write_text("\n".join(words(rng, rng.choice([1, 5, 200])).replace("\n", " ").replace("\r", " ")
                                      for _ in range(n_docs)))
        else:
            path.write_text(words(rng, rng.choice([5, 300]) if n_docs else 0))
        return path

    # Now and then a file without documents (an empty file): refused, in one line. A whole plain-text file is
    # one document, so such inputs come as more files (held-out fractions pick whole documents).
    n_files = rng.choice([1, 2, 3, 5]) if kind == "jsonl" or line_docs else rng.choice([3, 5, 8])
    train = [write(folder / f"train{k}{suffix}", rng.choice([3, 20, 40] if k == 0 else [0, *[1, 20, 40] * 3]))
             for k in range(n_files)]
    args = ["--train", *map(str, train), *(["--line-docs"] if line_docs else [])]
    if rng.random() < 0.5:
        args += ["--valid-fraction", str(rng.choice([0.1, 0.3])), "--test-fraction", str(rng.choice([0.1, 0.3]))]
        splits = "held-out fractions"
    else:
        args += ["--valid", str(write(folder / f"valid{suffix}", rng.choice([2, 20]))),
                 "--test", str(write(folder / f"test{suffix}", rng.choice([2, 20])))]
        splits = "valid and test files"
    return args, f"{len(train)} {kind}{' line-docs' if line_docs else ''} train file(s), {splits}"


def tokenizer_options(rng: random.Random) -> list[str]:
    model_type = rng.choice(["unigram", "bpe", "char", "word"])
    byte_fallback = model_type != "word" and rng.random() < 0.5  # 256 byte pieces: a vocabulary above them
    return ["--model-type", model_type,
            "--vocab-size", str(rng.choice([300, 400]) if byte_fallback else rng.choice([40, 80, 150])),
            "--byte-fallback" if byte_fallback else "--no-byte-fallback",
            *rng.choice([[], ["--normalization", "identity"], ["--normalization", "nfkc"]]),
            *rng.choice([[], ["--newline-piece"]]), *rng.choice([[], ["--no-remove-extra-whitespaces"]])]


def layout(rng: random.Random) -> list[str]:
    world = rng.choice([1, 2, 3, 4])
    return ["--world-size", str(world), "--n-streams", str(world * rng.choice([1, 2, 4])),
            *rng.choice([[], ["--eval-streams", str(world)], ["--eval-streams", str(2 * world)]])]


def digests(corpus: Path) -> dict[str, list]:
    """Per split: token count, document count and the tokens' sha256, from the manifest."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    return {name: [s["n_tokens"], s["n_documents"], s["tokens_sha256"]] for name, s in manifest["splits"].items()}


def run_case(rng: random.Random, folder: Path) -> tuple[dict[str, Any], str]:
    inputs_dir = folder / "inputs"
    inputs_dir.mkdir()
    inputs, text = write_inputs(rng, inputs_dir)
    tok, lay = tokenizer_options(rng), layout(rng)
    shards, procs = rng.choice([1, 2, 3, 7]), rng.choice([1, 2])
    text += f"; {' '.join(tok[:4])}; {' '.join(lay)}; {shards} shard(s)"
    record: dict[str, Any] = {"inputs": inputs, "tokenizer": tok, "layout": lay, "shards": shards, "failed": []}
    data_prep = [sys.executable, "-m", "data_prep"]
    model = folder / "tokenizer.model"
    quiet = ["--quiet", "--no-space-check"]

    def step(name: str, *args: str, refusable: bool = False) -> bool:
        status = run([*data_prep, *map(str, args)], folder / f"{name}.log")
        if status == 0:
            return True
        if refusable and status == 2 and refusal(folder / f"{name}.log"):
            record["refusal"] = refusal(folder / f"{name}.log")
        else:
            record["failed"].append(f"{name}: exit status {status}" + (f" ({refusal(folder / f'{name}.log')})"
                                                                      if status == 2 else ""))
        return False

    if not (step("train-tokenizer", "train-tokenizer", "--out", model, *inputs, *tok, "--quiet", refusable=True)
            and step("prepare", "prepare", "--out", folder / "corpus", *inputs, "--tokenizer-model", model, *lay,
                     "--num-proc", procs, *quiet, refusable=True)):
        return record | {"verdict": "fail" if record["failed"] else "refused"}, text
    parts = folder / "parts"
    if step("plan", "prepare", "--plan", "--out", parts, *inputs, "--tokenizer-model", model, "--quiet") and all(
            step(f"shard-{i}-of-{shards}", "prepare", "--shard", f"{i}/{shards}", "--out", parts, *inputs,
                 "--tokenizer-model", model, *quiet) for i in range(shards)):
        if step("finalize", "finalize", parts, "--out", folder / "sharded", *lay, *quiet):
            if digests(folder / "sharded") != digests(folder / "corpus"):
                record["failed"].append(f"sharded corpus differs from the one-shot one: "
                                        f"{digests(folder / 'sharded')} against {digests(folder / 'corpus')}")
    step("verify", "verify", folder / "corpus")
    step("inspect", "inspect", folder / "corpus")
    (folder / "inputs2").mkdir()
    other_inputs, _ = write_inputs(rng, folder / "inputs2")
    if step("prepare-other", "prepare", "--out", folder / "other", *other_inputs, "--tokenizer-model", model, *lay,
            *quiet, refusable=True):
        weights = rng.choice([(1, 1), (3, 1), (1, 9)])
        mixed = ["--source", f"a={folder / 'corpus'}:{weights[0]}", "--source", f"b={folder / 'other'}:{weights[1]}"]
        options = [*rng.choice([[], ["--index"]]), *rng.choice([[], ["--train-tokens", str(rng.choice([50, 2000]))]]),
                   "--seed", str(rng.randint(0, 9))]
        record["mix"] = [*mixed[1::2], *options]
        if step("mix", "mix", "--out", folder / "mixed", *mixed, *options, *lay, *quiet, refusable=True):
            step("verify-mixed", "verify", folder / "mixed")
    if "refusal" in record:  # of the second corpus or of the mixture: the case itself was prepared
        record["mix_refusal"] = record.pop("refusal")
    shutil.copytree(folder / "corpus", folder / "relaid")
    world = rng.choice([1, 2, 4])
    if step("relayout", "relayout", folder / "relaid", "--world-size", world, "--n-streams",
            world * rng.choice([1, 2]), *quiet, refusable=True):
        if step("verify-relaid", "verify", folder / "relaid") and digests(folder / "relaid") != digests(
                folder / "corpus"):
            record["failed"].append("relayout changed the tokens")
    if "refusal" in record:  # the relayout's: the case itself was prepared
        record["relayout_refusal"] = record.pop("refusal")
    trained = folder / "mixed" if (folder / "mixed" / "manifest.json").is_file() and rng.random() < 0.5 \
        else folder / "corpus"
    train(rng, trained, folder, record)
    return record | {"verdict": "fail" if record["failed"] else "pass"}, text


def train(rng: random.Random, corpus: Path, folder: Path, record: dict[str, Any]) -> None:
    """Two steps of a toy model on `corpus` (launch/train.py, 1 rank, drawn streams and segment length), with
    the final validation and test: the trainer must read whatever data_prep wrote, or refuse it in one line
    (a split too short for the streams, say: recorded as "train_refusal", not a failure)."""
    streams = rng.choice([1, 2, 4])
    sets = [f"data.path={corpus}", f"run.dir={folder / 'run'}", "train.max_steps=2", "train.log_interval=1",
            "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
            "model.cutoffs=[]", f"model.tgt_len={rng.choice([4, 16])}", f"model.mem_len={rng.choice([0, 8])}",
            f"eval.tgt_len={rng.choice([4, 16])}", "eval.mem_len=8", f"eval.n_streams={rng.choice([1, 2])}",
            f"deepspeed.train_batch_size={streams}", f"deepspeed.train_micro_batch_size_per_gpu={streams}",
            "train.precision=fp32", "model.attn_impl=matmul", "tracking.enabled=false"]
    record["train"] = [corpus.name, *sets[2:]]
    log = folder / "train.log"
    status = run(train_command(1) + set_arguments(sets), log)
    if status == 2 and refusal(log):
        record["train_refusal"] = refusal(log)
    elif status != 0:
        record["failed"].append(f"train on {corpus.name}: exit status {status}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.data_sweep", description=__doc__.split("\n\n")[0],
                                 epilog="example: python -m bench.data_sweep --cases 60 --seed 3 --minutes 30")
    sweep_arguments(ap)
    args = ap.parse_args(argv)
    if args.cases < 1 or args.minutes <= 0:
        ap.error("--cases and --minutes must be positive, e.g. --cases 60 --minutes 30")
    return sweep(args, lambda rng, i, folder: run_case(rng, folder))


if __name__ == "__main__":
    raise SystemExit(main())
