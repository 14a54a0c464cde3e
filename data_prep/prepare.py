"""The `prepare`, `prepare --plan`, `train-tokenizer` and `finalize` jobs.

prepare = check and hash inputs -> plan (splits, hold-out, shard ranges) -> tokenizer (train or copy) ->
tokenize in parallel into one stream file per split (a shard folder) -> lay the stream(s) out as the corpus.
With `--shard i/n` a process stops after its shard folder; `finalize` then lays all shards out. A shard
finding OUT/plan.json (written once by `prepare --plan`, data_prep/plan_file.py) takes the checksums and
counts from it instead of reading every input, and reads only its own documents. Every output appears
atomically (built in a temporary folder, renamed at the end).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from data_prep.atomic import atomic_dir, owned_scratch, owned_work_folder
from data_prep.paths import check_output_apart, check_writable_parent, nearest_existing, not_a_folder
from data_prep.encode import Encoded, Encoder, document_texts
from data_prep.errors import PrepError
from data_prep.layout import SplitWriter, check_fits, iter_token_file, split_layouts
from data_prep.plan import SPLITS, Plan, make_plan, routed_documents, shard_bytes
from data_prep.plan_file import (
    PLAN_FILE,
    InputPlan,
    load_for_shard,
    mismatch,
    provenance_entries,
    read_plan,
    scan_inputs,
    total_bytes,
    write_plan,
)
from data_prep.progress import Heartbeat, finish
from data_prep.space import check_free_space, estimate_note, files_bytes, input_text_bytes, size_text, \
    token_bytes
from data_prep.shards import ShardInfo, SplitPart, find_shards, shard_name, write_shard_info
from data_prep.sources import FORMATS, ReadOptions, Source, check_disjoint_splits, check_no_copies_across_splits, \
    resolve_sources, scan_sources, source_files
from data_prep.tokenizer import (
    TOKENIZER_FILE,
    TrainerOptions,
    check_trainer_options,
    describe_tokenizer,
    train_tokenizer,
    training_sentences,
)
from txl_dist import __version__
from txl_dist.data.format import (
    ArrowTokenWriter,
    Layout,
    Manifest,
    SplitEntry,
    sha256_file,
    token_dtype,
    write_manifest,
)


SEED_LIMIT = 2**32
"""Seeds are in [0, 2**32): SentencePiece's seed is an unsigned 32-bit integer and numpy takes no negative one
(both were tracebacks, after the inputs were read); mix takes the same range, so that a seed is valid for every
data_prep command alike."""


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise PrepError(f"--seed must be in 0..{SEED_LIMIT - 1}, got {seed}")


@dataclass
class InputSpec:
    """What a job reads: file patterns per split, hold-out fractions, how files become documents."""

    train: list[str]
    valid: list[str] = field(default_factory=list)
    test: list[str] = field(default_factory=list)
    valid_fraction: float = 0.0
    test_fraction: float = 0.0
    seed: int = 0
    """Seed of the held-out document choice (and of the tokenizer's sentence sample)."""
    format: str = "auto"
    read: ReadOptions = field(default_factory=ReadOptions)

    def resolve(self) -> dict[str, list[Source]]:
        """split -> sources; every pattern must match (checked before any work)."""
        if self.format not in FORMATS:
            raise PrepError(f"--format {self.format!r}: choose one of {', '.join(FORMATS)}")
        if not self.train:
            raise PrepError("no training input: pass --train FILES")
        given = {"train": self.train, "valid": self.valid, "test": self.test}
        sources = {s: resolve_sources(p, f"--{s}", self.format) for s, p in given.items() if p}
        check_disjoint_splits(sources)
        return sources

    def resolve_apart_from(self, out: Path, *also: tuple[str, str | os.PathLike | None]) -> dict[str, list[Source]]:
        """resolve(), refusing an output `out` that is or holds an input (or one of `also`: (option, path)
        pairs such as the tokenizer model), before any work: --overwrite would delete it."""
        sources = self.resolve()
        check_output_apart(out, input_paths(sources, *also))
        return sources

    def fractions(self) -> dict[str, float]:
        """Held-out split -> fraction of the training inputs' documents (only those asked for)."""
        return {s: f for s, f in (("valid", self.valid_fraction), ("test", self.test_fraction)) if f}

    def plan_key(self) -> dict[str, Any]:
        """The options that decide which tokens come out (shards of one job must agree on them)."""
        return {"format": self.format, "line_docs": self.read.line_docs, "text_field": self.read.text_field,
                "errors": self.read.errors, "valid_fraction": self.valid_fraction,
                "test_fraction": self.test_fraction, "seed": self.seed}


def input_paths(sources: dict[str, list[Source]], *also: tuple[str, str | os.PathLike | None]
                ) -> list[tuple[str, Path]]:
    """(option, path) of every input: the split sources, then the other files given (None ones skipped)."""
    paths = [(f"--{split}", s.path) for split, split_sources in sources.items() for s in split_sources]
    return paths + [(option, Path(path)) for option, path in also if path is not None]


def provenance(command: Sequence[str] | None, args: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    """How an output was made: time, tool, command line, arguments, and job-specific entries."""
    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "tool": f"txl-dist {__version__}",
            "command": list(command) if command is not None else [sys.executable, "-m", "data_prep", *sys.argv[1:]],
            "args": args or {}, **extra}


MAX_LISTED_INPUTS = 1000
"""A split with more input files than this is summarised in the provenance (count, bytes, one digest)."""


def provenance_inputs(inputs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """The manifest's provenance.inputs: [{split, path, bytes, sha256}], one entry per file or per large split."""
    out = []
    for split, entries in inputs.items():
        if len(entries) <= MAX_LISTED_INPUTS:
            out += [{"split": split, **e} for e in entries]
        else:
            digest = hashlib.sha256("".join(e["sha256"] for e in entries).encode()).hexdigest()
            out.append({"split": split, "path": f"{entries[0]['path']} ... {entries[-1]['path']}",
                        "files": len(entries), "bytes": sum(e["bytes"] for e in entries),
                        "sha256": digest, "sha256_of": "the files' sha256 hex digests, concatenated in order"})
    return out


@dataclass
class _Job:
    """State shared by the steps of one prepare run."""

    spec: InputSpec
    opts: ReadOptions
    sources: dict[str, list[Source]]
    work: Path
    progress: bool
    inputs: dict[str, list[dict]] = field(default_factory=dict)
    planned: InputPlan | None = None
    """OUT/plan.json when a shard follows it (counts, checksums and seek points of every input)."""


def prepare(spec: InputSpec, out: str | os.PathLike, *, tokenizer_model: str | os.PathLike | None = None,
            eod_piece: str | None = None, trainer: TrainerOptions | None = None, num_proc: int = 1,
            world_size: int = 1, n_streams: int = 1, eval_streams: int | None = None,
            shard: tuple[int, int] | None = None, overwrite: bool = False, work_dir: str | os.PathLike | None = None,
            command: Sequence[str] | None = None, args: dict[str, Any] | None = None,
            progress: bool = True, space_check: bool = True) -> Path:
    """Prepare a corpus at `out` (or, with shard=(i, n), shard i's folder under `out`); returns its path.

    With `space_check` a job refused up front when the disk(s) cannot hold its estimated output (data_prep/space.py).
    """
    out = Path(out)
    target = out / shard_name(*shard) if shard is not None else out
    sources = spec.resolve_apart_from(target, ("--tokenizer-model", tokenizer_model))
    trainer = trainer or TrainerOptions()
    if num_proc < 1:
        raise PrepError(f"--num-proc must be >= 1, got {num_proc}")
    if tokenizer_model is None:
        check_trainer_options(trainer)
        if shard is not None and shard[1] > 1:
            raise PrepError("--shard needs --tokenizer-model: every shard must use the same tokenizer "
                            "(train one first with `python -m data_prep train-tokenizer`)")
        vocab_size = trainer.vocab_size
    else:
        # refuse a bad model or eod piece before any work
        vocab_size = describe_tokenizer(tokenizer_model, eod_piece).vocab_size
    splits = [s for s in SPLITS if s in sources or s in spec.fractions()]
    layouts = split_layouts(splits, world_size, n_streams, eval_streams)
    planned = None
    if shard is not None and (out / PLAN_FILE).exists():  # refused before any work unless it fits
        planned = load_for_shard(out / PLAN_FILE, spec.plan_key(), sources)
    if work_dir is not None:
        check_work_dir(Path(work_dir), target)
    if space_check:
        _check_prepare_space(sources, spec.read.text_field, vocab_size, target, work_dir, shard)
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    with atomic_dir(target, overwrite, marker="shard.json" if shard is not None else "manifest.json") as tmp, \
            _work_folder(work_dir, target, tmp) as work:
        job = _Job(spec, _read_options(spec.read, work), sources, work, progress, planned=planned)
        shard_dir = tmp if shard is not None else work / shard_name(0, 1)
        shard_dir.mkdir(exist_ok=True)
        info = _tokenize_shard(job, shard_dir, shard or (0, 1), tokenizer_model, eod_piece, trainer, num_proc,
                               command, args)
        if shard is None:
            build_corpus([(shard_dir, info)], tmp, layouts, info.provenance, progress)
    return target


@contextmanager
def _work_folder(work_dir: str | os.PathLike | None, target: Path, tmp: Path) -> Iterator[Path]:
    """The job's scratch (its token stream, datasets' cache): in the temporary output, or an owned folder of
    --work-dir, which the next job for `target` removes if this one is killed (a plain folder there stayed for
    good: a whole corpus's tokens, per killed job)."""
    if work_dir is not None:
        with owned_work_folder(Path(work_dir), target) as work:
            yield work
        return
    work = Path(tempfile.mkdtemp(prefix=".work-", dir=tmp))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_work_dir(work_dir: Path, target: Path) -> None:
    """The output is built beside `target` and swapped in at the end: a work folder inside it would create the
    output before the job ran (then refused as existing) or be replaced under the job's feet."""
    work, out = work_dir.resolve(), target.resolve()
    if work == out or out in work.parents:
        raise PrepError(f"--work-dir {work_dir} is inside the output {target}, which is built elsewhere and "
                        "swapped in at the end; give a work folder outside it")
    existing = nearest_existing(work_dir)
    if not existing.is_dir():  # else making it fails with a bare "Not a directory" traceback
        raise PrepError(f"--work-dir {work_dir}: {existing} is {not_a_folder(existing)}; give another work folder")


def _check_prepare_space(sources: dict[str, list[Source]], text_field: str, vocab_size: int, target: Path,
                         work_dir: str | os.PathLike | None, shard: tuple[int, int] | None) -> None:
    """prepare writes each split's token stream (into the work folder) and then lays it out beside `target`:
    about twice the tokens' bytes, both kept until the end; a shard writes only its stream, its 1/n share."""
    n_input = input_text_bytes((s for ss in sources.values() for s in ss), text_field)
    note = estimate_note(n_input, vocab_size)
    if shard is not None:
        need = token_bytes(n_input, vocab_size) // shard[1]
        needs = [(target.parent, need, f"shard {shard[0]}/{shard[1]}'s share of the tokens, 1/{shard[1]} of {note}")]
    else:
        need = token_bytes(n_input, vocab_size)
        needs = [(Path(work_dir) if work_dir is not None else target.parent, need, f"the token stream: {note}"),
                 (target.parent, need, "the corpus laid out: as much again")]
    check_free_space(needs, "prepare", "give --out (or --work-dir) on another file system")


def train_tokenizer_job(spec: InputSpec, out: str | os.PathLike, trainer: TrainerOptions, *,
                        overwrite: bool = False, progress: bool = True, verbose: bool = False,
                        parts: dict[str, Sequence[str]] | None = None) -> Path:
    """Train a tokenizer on the training documents of `spec` (held-out documents excluded) into file `out`.

    `parts`: the --train inputs in groups that each hold out their own documents, as preparing each group on
    its own does (`prepare --source`: a mixture's sources), by the name a refusal of the group starts with;
    default: one group, spec.train.
    """
    out = Path(out)
    if parts is not None:
        spec = dataclasses.replace(spec, train=[path for part in parts.values() for path in part])
    sources = spec.resolve_apart_from(out)
    check_trainer_options(trainer)
    if out.is_dir():
        raise PrepError(f"{out} is a folder; give --out the model file to write, e.g. {out / TOKENIZER_FILE}")
    if out.exists() and not overwrite:
        raise PrepError(f"{out} already exists; pass --overwrite to replace it")
    check_writable_parent(out)
    with owned_scratch(out, "tmp") as tmp:
        job = _Job(spec, _read_options(spec.read, Path(tmp)), sources, Path(tmp), progress)
        counting = bool(spec.fractions())  # only held-out fractions need the documents counted
        with tqdm(desc="count documents", unit=" docs", disable=not (progress and counting), file=sys.stderr,
                  leave=False) as bar:
            plans = []
            for name, part in ({None: spec.train} if parts is None else parts).items():
                part_sources = sources if name is None else dataclasses.replace(spec, train=list(part)).resolve()
                try:
                    plans.append(make_plan(part_sources, spec.fractions(), job.opts, seed=spec.seed, count=False,
                                           progress=bar.update))
                except PrepError as e:
                    raise (e if name is None else PrepError(f"{name}: {e}")) from None
        # Each group's held-out documents are picked among its own (a pick over all of them would hold out
        # others, and train the tokenizer on documents that its group's prepare holds out).
        plan = Plan([g for p in plans for g in p.groups],
                    {split: sum(p.n_documents.get(split, 0) for p in plans) for split in plans[0].n_documents})
        model = _train(job, plan, Path(tmp) / TOKENIZER_FILE, trainer, verbose)
        os.replace(model, out)
    return out


def plan_job(spec: InputSpec, out: str | os.PathLike, *, overwrite: bool = False, progress: bool = True,
             num_proc: int = 1, command: Sequence[str] | None = None,
             args: dict[str, Any] | None = None) -> tuple[Path, bool]:
    """`prepare --plan`: read every input once into OUT/plan.json for the `prepare --shard` tasks of the same
    inputs and options. Returns (its path, whether it was written now): a plan that still fits is kept unless
    `overwrite`, one that does not is refused."""
    path = Path(out) / PLAN_FILE
    sources = spec.resolve_apart_from(path)
    if Path(out).exists() and not Path(out).is_dir():
        raise PrepError(f"{out} exists and is not a folder; give --out the folder of the shards")
    check_writable_parent(path)
    if path.exists() and not overwrite:
        why = mismatch(read_plan(path), spec.plan_key(), sources)
        if why:
            raise PrepError(f"{path} already exists, {why}; pass --overwrite to replace it")
        return path, False
    made_folder = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with owned_scratch(path, "tmp") as tmp:
            opts = _read_options(spec.read, Path(tmp))
            with tqdm(total=total_bytes(sources), unit="B", unit_scale=True, desc="plan: read inputs",
                      disable=not progress, file=sys.stderr) as bar:
                records = scan_inputs(sources, opts, progress=bar.update, workers=num_proc)
            # refuses bad fractions (or a hold-out that leaves no training document) now, not in every task
            make_plan(sources, spec.fractions(), opts, seed=spec.seed, records=records)
            write_plan(path, spec.plan_key(), records, provenance(command, args))
    except BaseException:
        if made_folder:  # an interrupted or refused plan leaves no empty --out behind (one made by the user stays)
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        raise
    return path, True


def finalize(parts_dir: str | os.PathLike, out: str | os.PathLike, *, world_size: int = 1, n_streams: int = 1,
             eval_streams: int | None = None, overwrite: bool = False, command: Sequence[str] | None = None,
             args: dict[str, Any] | None = None, progress: bool = True, space_check: bool = True) -> Path:
    """Lay the shards of `parts_dir` out as the corpus `out` (cheap: copies tokens, no tokenizing)."""
    check_output_apart(Path(out), [("parts", Path(parts_dir))])
    shards = find_shards(parts_dir)
    layouts = split_layouts(shards[0][1].splits, world_size, n_streams, eval_streams)
    if space_check:  # the corpus takes what the shards' token files take (known here, not estimated)
        need = files_bytes(d / part.file for d, info in shards for part in info.splits.values())
        check_free_space([(Path(out).parent, need, f"the shards' token files in {parts_dir}: {size_text(need)}")],
                         "finalize", "give --out on another file system")
    prov = provenance(command, args, inputs=shards[0][1].provenance.get("inputs", []),
                      shards=[info.provenance for _, info in shards])
    with atomic_dir(out, overwrite, marker="manifest.json") as tmp:
        build_corpus(shards, tmp, layouts, prov, progress)
    return Path(out)


# ----------------------------------------------------------------------------------------------------
# Steps


def _read_options(read: ReadOptions, work: Path) -> ReadOptions:
    # datasets must never reach the network, nor leave files behind: its cache goes into the job's temporary
    # folder unless the user chose one.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    if read.cache_dir is None and not os.environ.get("HF_DATASETS_CACHE"):
        read = dataclasses.replace(read, cache_dir=work / "hf-cache")
    return read


def update_keeping_total(bar: tqdm, n: int) -> None:
    """bar.update(n), raising the total the count has passed: the total is an estimate (input bytes, the text
    counted may be more: a compressed Parquet file), and tqdm drops a passed total, and with it the bar and
    the ETA."""
    if bar.total and bar.n + n > bar.total:
        bar.total = bar.n + n
    bar.update(n)


def _scan(job: _Job) -> None:
    """Hash and check every input once (provenance + early errors on empty or undecodable files)."""
    total = sum(p.stat().st_size for ss in job.sources.values() for s in ss for p in source_files(s))
    with tqdm(total=total, unit="B", unit_scale=True, desc="check inputs", disable=not job.progress,
              file=sys.stderr) as bar:
        for split, sources in job.sources.items():
            job.inputs[split] = scan_sources(sources, job.opts, progress=bar.update)


def _train(job: _Job, plan: Plan, model_path: Path, trainer: TrainerOptions, verbose: bool = False) -> Path:
    trainer = dataclasses.replace(trainer, seed=job.spec.seed)
    # In bytes, not documents: a single document of 500 MB would hold a document count still for half a minute.
    total = input_text_bytes(job.sources["train"], job.opts.text_field)  # held-out documents included: about
    bar = tqdm(total=total or None, desc="tokenizer: read training text", unit="B", unit_scale=True,
               disable=not job.progress, file=sys.stderr)
    # SentencePiece says nothing while it trains (a minute for 8,000 pieces): an elapsed time ticks meanwhile.
    training = Heartbeat(f"tokenizer: training {trainer.model_type} sentencepiece, vocab {trainer.vocab_size}",
                         enabled=job.progress)

    def documents():
        for _, _, docs in routed_documents(plan, job.opts, splits=["train"]):
            yield from document_texts(docs, progress=lambda n: update_keeping_total(bar, n))
        finish(bar)
        bar.close()
        training.start()  # SentencePiece has read every sentence: it trains from here until it returns

    try:
        return train_tokenizer(training_sentences(documents()), model_path, trainer, verbose)
    finally:
        bar.close()
        training.stop()


def _tokenize_shard(job: _Job, shard_dir: Path, shard: tuple[int, int], tokenizer_model, eod_piece,
                    trainer: TrainerOptions, num_proc: int, command, args) -> ShardInfo:
    """Steps of one shard: scan (or the plan file's records), plan, tokenizer, tokenize every split into
    shard_dir/<split>.arrow."""
    records = None
    if job.planned is not None:
        job.inputs, records = provenance_entries(job.planned, job.sources), job.planned.inputs
    else:
        _scan(job)
    check_no_copies_across_splits(job.sources, job.inputs)
    prov = provenance(command, args, inputs=provenance_inputs(job.inputs))
    if job.planned is not None:
        prov["plan"] = {"file": str(job.planned.path), "sha256": job.planned.sha256}
    counting = records is None and (shard[1] > 1 or bool(job.spec.fractions()))  # a plan file has the counts
    with tqdm(desc="count documents", unit=" docs", disable=not (job.progress and counting), file=sys.stderr,
              leave=False) as bar:
        plan = make_plan(job.sources, job.spec.fractions(), job.opts, seed=job.spec.seed, shard=shard,
                         count=shard[1] > 1, progress=bar.update, records=records)
    model_path = shard_dir / TOKENIZER_FILE
    if tokenizer_model is not None:
        shutil.copyfile(tokenizer_model, model_path)
        prov["tokenizer"] = {"source": str(tokenizer_model)}
    else:
        _train(job, plan, model_path, trainer)
        prov["tokenizer"] = {"trained": dataclasses.asdict(dataclasses.replace(trainer, seed=job.spec.seed))}
    tok = describe_tokenizer(model_path, eod_piece)
    dtype = token_dtype(tok.vocab_size)

    writers = {s: ArrowTokenWriter(shard_dir / f"{s}.arrow", dtype) for s in plan.splits}
    counts = {s: [0, 0, 0] for s in plan.splits}  # documents, bytes, chars
    total = shard_bytes(plan) if shard[1] > 1 else sum(e["bytes"] for s in job.inputs.values() for e in s)
    bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="tokenize", disable=not job.progress,
               file=sys.stderr)

    def sink(split: str, enc: Encoded) -> None:
        writers[split].write(enc.tokens)
        c = counts[split]
        c[0], c[1], c[2] = c[0] + enc.n_documents, c[1] + enc.n_bytes, c[2] + enc.n_chars
        update_keeping_total(bar, enc.n_bytes)

    try:
        with Encoder(str(model_path), tok.eod_id, dtype, num_proc) as encoder:
            encoder.run(routed_documents(plan, job.opts), sink)
        finish(bar)
        results = {s: w.close() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
    parts = {}
    for s in plan.splits:
        lo, hi = plan.doc_range(s) if shard[1] > 1 else (0, counts[s][0])
        if counts[s][0] != hi - lo:
            raise PrepError(f"split {s}: read {counts[s][0]} documents, planned {hi - lo}; "
                            "did an input change while the job ran?")
        n_tokens, sha = results[s]
        parts[s] = SplitPart(f"{s}.arrow", n_tokens, counts[s][0], counts[s][1], counts[s][2], sha, [lo, hi])
    plan_key = {"inputs": {s: [{"bytes": e["bytes"], "sha256": e["sha256"]} for e in entries]
                           for s, entries in job.inputs.items()},
                "options": job.spec.plan_key(), "n_documents": plan.n_documents if shard[1] > 1 else None}
    info = ShardInfo(shard[0], shard[1], tok, dtype, parts, plan_key, prov)
    write_shard_info(shard_dir, info)
    return info


def build_corpus(shards: list[tuple[Path, ShardInfo]], dest: Path, layouts: dict[str, Layout],
                 prov: dict[str, Any], progress: bool = True) -> Manifest:
    """Concatenate the shards' streams split by split into dest/<split>/NNNNN.arrow + tokenizer + manifest."""
    first_dir, first = shards[0]
    tok = first.tokenizer
    shutil.copyfile(first_dir / TOKENIZER_FILE, dest / TOKENIZER_FILE)
    if sha256_file(dest / TOKENIZER_FILE) != tok.sha256:
        raise PrepError(f"{first_dir / TOKENIZER_FILE}: sha256 differs from its shard.json; the shard is damaged")
    splits = {}
    for split in (s for s in SPLITS if s in first.splits):
        parts = [(d, info.splits[split]) for d, info in shards]
        expect = 0
        for d, part in parts:
            if part.doc_range[0] != expect:
                raise PrepError(f"{d}: split {split} starts at document {part.doc_range[0]}, expected {expect}")
            expect = part.doc_range[1]
        n_tokens = sum(p.n_tokens for _, p in parts)
        if n_tokens == 0:  # a shard may hold no document of a split, the whole job may not
            raise PrepError(f"split {split} has no documents; give it inputs")
        check_fits(split, n_tokens, layouts[split], str(first_dir.parent if len(shards) > 1 else "prepare"))
        writer = SplitWriter(dest, split, n_tokens, layouts[split], first.dtype, tok.vocab_size)
        with tqdm(total=n_tokens, unit=" tok", unit_scale=True, desc=f"layout {split}", disable=not progress,
                  file=sys.stderr) as bar:
            try:
                for d, part in parts:
                    for chunk in iter_token_file(d / part.file, part.sha256):
                        writer.write(chunk, str(d / part.file))
                        bar.update(len(chunk))
                files, tokens_sha256 = writer.close()
            except BaseException:
                writer.abort()
                raise
        splits[split] = SplitEntry(n_tokens=n_tokens, n_documents=sum(p.n_documents for _, p in parts),
                                   n_bytes=sum(p.n_bytes for _, p in parts),
                                   n_chars=sum(p.n_chars for _, p in parts), tokens_sha256=tokens_sha256,
                                   layout=layouts[split], files=files)
    manifest = Manifest(tokenizer=tok, dtype=first.dtype, splits=splits, provenance=prov)
    write_manifest(dest, manifest)
    return manifest

