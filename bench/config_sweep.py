"""A random sweep over model and engine options, each case through the product's whole path on the CPU.

Each case draws a model (layers, widths, heads, d_embed, div_val, cutoffs, tying, pre-LN, untie_r,
same_length, clamp_len, dropout, dropatt, attention path, vocabulary padding, tgt_len, mem_len), a world
size (1 or 2 ranks), a ZeRO stage (0-3), a precision (fp32, bf16, fp16, "auto"), a micro batch, activation
checkpointing on or off, evaluation memory settings, and the engine's schedule, optimizer, clipping and
gradient sums' dtype, fp16's loss scaling (`draw_engine`), then runs launch/train.py for 6 steps three times:

- straight, with a checkpoint at step 3;
- its fp32 twin (`Case.twin`: fp32, ZeRO 0, no activation checkpointing; skipped where the case is that
  already), whose first loss, first gradient norm and last three steps' update the case's must match
  (bench/twin_check.py): a configuration that trains wrong the same way every time passes the resume check;
- stopped at step 3 (`train.exit_step`), then resumed: its per-step losses must equal the straight run's bit
  for bit (where the precision or the attention path is "auto", the two fresh starts must also choose alike:
  each times the candidates anew);
- at 2 ranks, the step 3 checkpoint also resumed on 1 rank (elastic: through DeepSpeed's universal
  checkpoint; it must finish with finite losses);

then launch/eval.py, launch/generate.py and launch/export.py on the resumed run. A case whose config the
product refuses with one `error:` line (exit status 2) counts as refused, not failed. Each case's logs stay in
its folder under --out when it fails (or always with --keep).

    python -m bench.config_sweep [--cases 40] [--seed 0] [--minutes 45] [--corpus data/shakespeare]
        [--world 1|2] [--precision fp32|bf16|fp16|auto] [--out DIR] [--keep]

The corpus needs its tokenizer (generate.py encodes a prompt): `bash scripts/shakespeare_corpus.sh` builds
data/shakespeare. A case takes ~30-60 s on 2 cores. Exit status 0 when no case failed, 1 when one did (the
failures listed), 2 on bad arguments. docs/reliability.md, "Random configurations", has what sweeps found.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench.soak_report import journal_losses

REPO = Path(__file__).resolve().parent.parent
STEPS, EXIT_STEP = 6, 3
CASE_TIMEOUT_S = 600
"""One process of a case (a train, an eval, ...) is killed after this long: a hang is a failure too."""


@dataclass
class Case:
    model: dict[str, Any]
    world: int
    stage: int
    precision: str
    micro_batch: int
    activation_checkpointing: bool
    eval: dict[str, Any]
    generate: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    """More --set values (dotted key -> JSON value): the optimizer, schedule, clipping, gradient sums' dtype."""

    def sets(self, run_dir: Path, *extra: str) -> list[str]:
        """launch/train.py's --set arguments for this case (configs/tiny.json underneath)."""
        values = [f"run.dir={run_dir}", f"train.max_steps={STEPS}", "train.log_interval=1", "eval.interval=1000",
                  f"checkpoint.interval={EXIT_STEP}", "eval.max_segments=4", "deepspeed.train_batch_size=4",
                  f"deepspeed.train_micro_batch_size_per_gpu={self.micro_batch}",
                  f"deepspeed.zero_optimization.stage={self.stage}", f"train.precision={self.precision}"]
        values += [f"model.{k}={json.dumps(v)}" for k, v in self.model.items()]
        values += [f"eval.{k}={json.dumps(v)}" for k, v in self.eval.items()]
        values += [f"{k}={json.dumps(v)}" for k, v in self.engine.items()]
        if self.activation_checkpointing:
            values.append('deepspeed.activation_checkpointing={"partition_activations": false}')
        return set_arguments((*values, *extra))

    def twin(self) -> "Case":
        """The same case in fp32 at ZeRO 0 without activation checkpointing (bench/twin_check.py): the same ranks,
        seed, batches, model and optimizer; an "auto" attention path becomes matmul (fp32's timings may pick
        another)."""
        engine = {k: v for k, v in self.engine.items() if k not in ("deepspeed.data_types", "deepspeed.fp16")}
        model = self.model | ({"attn_impl": "matmul"} if self.model["attn_impl"] == "auto" else {})
        return Case(model=model, world=self.world, stage=0, precision="fp32", micro_batch=self.micro_batch,
                    activation_checkpointing=False, eval=self.eval, generate=self.generate, engine=engine)

    def text(self) -> str:
        m = self.model
        return (f"{self.world} rank(s), ZeRO {self.stage}, {self.precision}, micro batch {self.micro_batch}"
                f"{', activation checkpointing' if self.activation_checkpointing else ''}; {m['n_layer']} layer(s) "
                f"d_model {m['d_model']} d_embed {m['d_embed']} div_val {m['div_val']} cutoffs {m['cutoffs']} "
                f"{m['attn_impl']}" + "".join(f"; {k.removeprefix('deepspeed.')} {json.dumps(v)}"
                                              for k, v in self.engine.items()))


def draw(rng: random.Random, vocab: int, world: int | None) -> Case:
    """One random case; the choices are the config's own ranges at toy sizes (a few refusals are part of it)."""
    cutoffs = rng.choice([[], [vocab // 4], [vocab // 8, vocab // 2]])
    mem_len = rng.choice([0, 8, 16])
    model = {"n_layer": rng.choice([1, 2, 3]), "d_model": rng.choice([32, 48, 64]), "n_head": rng.choice([1, 2, 4]),
             "d_head": rng.choice([8, 16]), "d_inner": rng.choice([64, 96]),
             "d_embed": rng.choice([None, None, 16, 48]), "div_val": rng.choice([1, 2, 4]), "cutoffs": cutoffs,
             "tie_weight": rng.random() < 0.7, "pre_lnorm": rng.random() < 0.5, "untie_r": rng.random() < 0.5,
             "same_length": mem_len > 0 and rng.random() < 0.3, "clamp_len": rng.choice([-1, -1, 8]),
             "dropout": rng.choice([0.0, 0.1]), "dropatt": rng.choice([0.0, 0.0, 0.1]),
             "attn_impl": rng.choice(["matmul", "sdpa"]), "pad_vocab_multiple": rng.choice([1, 8, 64]),
             "tgt_len": rng.choice([8, 16]), "mem_len": mem_len}
    if cutoffs and rng.random() < 0.3:
        model["tie_projs"] = [False] + [rng.random() < 0.5 for _ in cutoffs]
    world = world or rng.choice([1, 1, 2])
    eval_mem = rng.choice([0, 8, 32])
    evaluation = {"mem_len": eval_mem, "clamp_len": rng.choice([-1, 4]),
                  "same_length": eval_mem > 0 and rng.random() < 0.5}
    generate = ["--max-new-tokens", str(rng.choice([1, 8])), "--num-samples", str(rng.choice([1, 2])),
                *rng.choice([[], ["--greedy"], ["--top-k", "5"], ["--top-p", "0.9"]]),
                *rng.choice([[], ["--mem-len", "4"], ["--chunk-len", "3"]])]
    case = Case(model=model, world=world, stage=rng.choice([0, 1, 2, 3]), precision=rng.choice(["fp32", "bf16"]),
                micro_batch=rng.choice([1, 2]) if world == 2 else rng.choice([2, 4]),
                activation_checkpointing=rng.random() < 0.3, eval=evaluation, generate=generate)
    case.engine = draw_engine(rng, case)
    return case


SCHEDULES = (
    None,  # configs/tiny.json's WarmupCosineLR
    {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.001}},
    {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.001}},
    {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "warmup_type": "log"}},
)
OPTIMIZERS = (
    None,  # configs/tiny.json's AdamW: torch's, fused
    {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01, "torch_adam": True}},
    {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
)


def draw_engine(rng: random.Random, case: Case) -> dict[str, Any]:
    """The engine's further options, drawn after the rest of the case (whose other draws kept the values they had
    before these were added; the cases after it differ): fp16 and "auto" precision and attention beside the
    explicit ones, the schedule, the optimizer, clipping, the gradient sums' dtype at ZeRO 2-3, and fp16's
    dynamic loss scaling (scales high enough to overflow and skip steps)."""
    engine: dict[str, Any] = {}
    if rng.random() < 0.25:
        case.precision = rng.choice(["fp16", "auto"])
    if rng.random() < 0.2:
        case.model["attn_impl"] = "auto"
    if (schedule := rng.choice(SCHEDULES)) is not None:
        engine["deepspeed.scheduler"] = schedule
    if (optimizer := rng.choice(OPTIMIZERS)) is not None:
        engine["deepspeed.optimizer"] = optimizer
    if (clip := rng.choice([None, 0.0, 1.0])) is not None:
        engine["deepspeed.gradient_clipping"] = clip
    if case.precision in ("bf16", "fp16") and case.stage >= 2 and rng.random() < 0.5:
        engine["deepspeed.data_types"] = {"grad_accum_dtype": rng.choice(["fp32", case.precision])}
    if case.precision == "fp16" and rng.random() < 0.5:
        # Loss scales that overflow: skipped steps before, at and after the resume (sweep seed 303 found a
        # ZeRO-3 failure only there).
        engine["deepspeed.fp16"] = {"initial_scale_power": rng.choice([16, 24, 32]),
                                    "hysteresis": rng.choice([1, 2]), "loss_scale_window": rng.choice([2, 1000])}
    return engine


def child_env() -> dict[str, str]:
    """The environment of a sweep's commands. The repository comes first on PYTHONPATH: a sweep tests the tree it
    runs from, even where `import txl_dist` would otherwise find an editable install of another checkout (a sweep
    run from a clone once tested edits made meanwhile)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=path)


def run(cmd: list[str], log: Path) -> int | str:
    """Exit status of `cmd` (run in the repository with child_env(), output into `log`), or "timeout"."""
    with open(log, "w") as out:
        try:
            return subprocess.run(cmd, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=CASE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


REFUSAL_LINE = re.compile(r"(\d\d:\d\d:\d\d )?error: ")
"""A refusal's line: data_prep's start with `error: `, the trainer's with the time of day before it."""


def refusal(log: Path) -> str:
    """The last refusal line of a command's output, or "" where there is none."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if REFUSAL_LINE.match(line)]
    return lines[-1] if lines else ""


def set_arguments(values) -> list[str]:
    """launch/train.py's `--set` arguments for `key=value` strings."""
    return [arg for value in values for arg in ("--set", value)]


def train_command(world: int, port: int | None = None) -> list[str]:
    """launch/train.py with configs/tiny.json underneath: in this process's Python on 1 rank, through torchrun
    (rendezvous on `port`) on more."""
    if world == 1:
        return [sys.executable, "launch/train.py", "--config", "configs/tiny.json"]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--nproc_per_node", str(world), "--master_port", str(port), "launch/train.py",
            "--config", "configs/tiny.json"]


def run_case(case: Case, folder: Path, corpus: Path, port: int) -> dict[str, Any]:
    """The case's runs and checks -> its record: "verdict" pass / refused / fail, "failed" what failed."""
    record: dict[str, Any] = {"case": asdict(case), "failed": []}
    data = ["--set", f"data.path={corpus}"]
    straight, resumed, elastic = folder / "straight", folder / "resumed", folder / "elastic"
    status = run(train_command(case.world, port) + data + case.sets(straight), folder / "straight.log")
    if status == 2 and refusal(folder / "straight.log"):
        return record | {"verdict": "refused", "refusal": refusal(folder / "straight.log")}
    if status != 0:
        return record | {"verdict": "fail", "failed": [f"straight run: exit status {status}"]}
    if (twin := case.twin()) != case:
        record["twin"] = learns_like_twin(twin, straight, folder / "twin", data, port)
        record["failed"] += [f"learns unlike fp32 at ZeRO 0: {line}" for line in record["twin"].get("problems", [])]
    stopped = run(train_command(case.world, port) + data + case.sets(resumed, f"train.exit_step={EXIT_STEP}"),
                  folder / "stopped.log")
    if case.world > 1 and stopped == 0:
        shutil.copytree(resumed, elastic)
        shutil.rmtree(elastic / "tracking", ignore_errors=True)  # the elastic run's journal starts empty
    finished = run(train_command(case.world, port) + data + case.sets(resumed), folder / "resumed.log")
    if stopped != 0 or finished != 0:
        record["failed"].append(f"stop and resume: exit status {stopped}, {finished}")
    expected, got = (journal_losses(run_dir / "tracking" / "metrics.jsonl") for run_dir in (straight, resumed))
    if sorted(expected) != list(range(1, STEPS + 1)) or any(got.get(s) != expected[s] for s in expected):
        record["failed"].append(f"resumed losses differ: straight {[expected.get(s) for s in range(1, STEPS + 1)]}, "
                                f"resumed {[got.get(s) for s in range(1, STEPS + 1)]}")
    if case.world > 1 and elastic.is_dir():
        status = run(train_command(1) + data + case.sets(elastic), folder / "elastic.log")
        after = journal_losses(elastic / "tracking" / "metrics.jsonl")
        if status != 0 or not after or not all(math.isfinite(v) for v in after.values()):
            record["failed"].append(f"elastic resume on 1 rank: exit status {status}, losses {after}")
    tools = {
        "eval": [sys.executable, "launch/eval.py", "--checkpoint", str(resumed), "--split", "test"],
        "generate": [sys.executable, "launch/generate.py", "--checkpoint", str(resumed), "--prompt", "The king",
                     "--seed", "1", *case.generate],
        "export": [sys.executable, "launch/export.py", "--checkpoint", str(resumed), "--out", str(folder / "export")],
    }
    for name, cmd in tools.items():
        status = run(cmd, folder / f"{name}.log")
        if status != 0:
            record["failed"].append(f"{name}: exit status {status}")
    return record | {"verdict": "fail" if record["failed"] else "pass"}


def learns_like_twin(twin: Case, run_dir: Path, twin_dir: Path, extra: list[str], port: int) -> dict[str, Any]:
    """Train a case's fp32 ZeRO 0 twin and compare it with the case's run in `run_dir` (bench/twin_check.py) ->
    the comparison's figures and "problems"; a twin that fails to train or compare is a problem too."""
    log = twin_dir.with_suffix(".log")
    status = run(train_command(twin.world, port) + extra + twin.sets(twin_dir), log)
    if status != 0:
        return {"problems": [f"the twin's run: exit status {status}"]}
    compare_log = twin_dir.with_name("twin_check.log")
    status = run([sys.executable, "-m", "bench.twin_check", str(run_dir), str(twin_dir),
                  "--steps", str(EXIT_STEP), str(STEPS)], compare_log)
    lines = compare_log.read_text(errors="replace").splitlines()
    try:
        figures = json.loads(lines[-1])
    except (IndexError, ValueError):
        figures = {}
    if status != 0 or "error" in figures or not figures:
        return figures | {"problems": [f"the comparison: exit status {status}, {figures.get('error', lines[-1:])}"]}
    return figures


def corpus_vocab(corpus: Path) -> int | None:
    """The corpus's vocabulary size, or None where the folder is no prepared corpus with its tokenizer."""
    manifest = corpus / "manifest.json"
    if not manifest.is_file() or not (corpus / "tokenizer.model").is_file():
        return None
    return int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"])


def training_sweep_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The options of a sweep that trains on a corpus (this one, bench/fault_sweep.py)."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=(doc or "").split("\n\n")[0],
                                 epilog=f"example: python -m {prog} --cases 40 --seed 3 --minutes 45")
    sweep_arguments(ap)
    ap.add_argument("--corpus", type=Path, default=REPO / "data" / "shakespeare",
                    help="a prepared corpus with its tokenizer (default data/shakespeare)")
    ap.add_argument("--world", type=int, choices=(1, 2), help="every case on this many ranks (default: drawn)")
    return ap


def parse_training_sweep(parser: argparse.ArgumentParser, argv: list[str] | None
                         ) -> tuple[argparse.Namespace, Path, int]:
    """(the arguments, the corpus folder, its vocabulary size); bad ones end the process with status 2."""
    args = parser.parse_args(argv)
    if args.cases < 1 or args.minutes <= 0:
        parser.error("--cases and --minutes must be positive, e.g. --cases 40 --minutes 45")
    corpus = args.corpus.resolve()
    vocab = corpus_vocab(corpus)
    if vocab is None:
        parser.error(f"--corpus {corpus}: no prepared corpus with its tokenizer there; build one with `bash "
                     "scripts/shakespeare_corpus.sh` (data/shakespeare) or pass a folder `python -m data_prep "
                     "prepare` wrote")
    return args, corpus, vocab


def build_parser() -> argparse.ArgumentParser:
    ap = training_sweep_parser("bench.config_sweep", __doc__)
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16", "auto"),
                    help="only the drawn cases in this precision (the others are drawn and passed over)")
    return ap


def sweep(args: argparse.Namespace, run_one: Callable[[random.Random, int, Path], tuple[dict[str, Any], str]]
          ) -> int:
    """The sweep's loop, shared with bench/data_sweep.py: `run_one(rng, i, folder)` draws case i and runs it in
    `folder`, returning its record ("verdict": pass / refused / fail, "failed": what failed, "refusal") and a
    line describing the case. Prints a line per case and the counts; failed cases keep their folders."""
    out = args.out or Path(tempfile.mkdtemp(prefix="txl-sweep."))
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    counts = {"pass": 0, "refused": 0, "fail": 0}
    failures = []
    with open(out / "results.jsonl", "a") as results:
        for i in range(args.cases):
            if time.monotonic() > deadline:
                print(f"--minutes {args.minutes:g} reached after {i} case(s)")
                break
            folder = out / f"seed{args.seed}_case{i:03d}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            start = time.monotonic()
            record, text = run_one(rng, i, folder)
            record |= {"seed": args.seed, "index": i, "seconds": round(time.monotonic() - start, 1)}
            results.write(json.dumps(record, default=str) + "\n")
            results.flush()
            counts[record["verdict"]] += 1
            detail = record.get("refusal") or "; ".join(record["failed"])
            print(f"case {i}: {record['verdict'].upper()} in {record['seconds']:.0f} s ({text})"
                  + (f": {detail}" if detail else ""), flush=True)
            if record["verdict"] == "fail":
                failures.append(folder)
            elif not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"{counts['pass']} passed, {counts['refused']} refused, {counts['fail']} failed; results: "
          f"{out / 'results.jsonl'}")
    for folder in failures:
        print(f"failed: {folder} (its logs and outputs)")
    return 1 if failures else 0


def sweep_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every sweep takes."""
    ap.add_argument("--cases", type=int, default=40, help="cases to draw (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed: the same seed draws the same cases")
    ap.add_argument("--minutes", type=float, default=45.0, help="start no case after this long (default 45)")
    ap.add_argument("--out", type=Path, help="where the cases' folders go (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the folders of passing cases too")


def main(argv: list[str] | None = None) -> int:
    args, corpus, vocab = parse_training_sweep(build_parser(), argv)

    def run_one(rng: random.Random, i: int, folder: Path) -> tuple[dict[str, Any], str]:
        case = draw(rng, vocab, args.world)
        while args.precision and case.precision != args.precision:
            case = draw(rng, vocab, args.world)
        return run_case(case, folder, corpus, port=29700 + (args.seed * 131 + i) % 250), case.text()

    return sweep(args, run_one)


if __name__ == "__main__":
    raise SystemExit(main())
