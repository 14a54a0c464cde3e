"""Errors raised at random calls of the entry points other than training: what bench/fault_sweep.py's raise-rank
does to training jobs, done to `launch/eval.py` (2 ranks), `launch/export.py`, `launch/generate.py`,
`python -m txl_dist.interop` and `python -m data_prep prepare`.

Set-up (once, in OUT/setup): a 2-rank training run of configs/tiny.json on the corpus, 4 steps; a synthetic
plain-text corpus for prepare; and each command run once undisturbed, its result kept as the reference. Then
each case draws an entry point (and for eval the rank), a moment within the undisturbed run's duration and N
from 1 to 3000, starts the command with bench/sweep_hooks/ first on PYTHONPATH, and at the moment sends
SIGUSR2 to the process (once it catches it): its main thread raises a RuntimeError at its N-th call into a
Python function of txl_dist, launch/, data_prep or DeepSpeed, as a bug or an out-of-memory error would there.
A case passes when:

- where the error was raised (the hook announces it on stderr), the command failed (exit status not 0) within
  END_WITHIN_S, printed the error, and left nothing that looks like a result: no eval `--json-out` file, no
  model folder with its config unless the folder is the undisturbed export byte for byte, no corpus manifest,
  no temporary file; or, raised once its result was complete (in its closing report), it succeeded with the
  undisturbed result and a warning that names the error;
- where the command ended before the N-th call came, it succeeded with the undisturbed result;
- the same command run again, without the fault, succeeds and gives the undisturbed result (byte for byte for
  files; eval's JSON, generate's JSON output and the corpus manifest's splits and tokenizer as values).

    python -m bench.entry_fault_probe [--cases 40] [--seed 0] [--minutes 20] [--entries eval export ...]
        [--corpus data/shakespeare] [--out DIR] [--keep]

A case takes ~5-15 s on 2 cores, the set-up ~1 minute. Exit status 0 when no case failed, 1 when one did (its
folder and logs kept under --out), 2 on bad arguments. docs/reliability.md, "Random faults", has what probes
found.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.config_sweep import REPO, child_env, train_command
from bench.fault_sweep import catches
from bench.sweep_hooks.sitecustomize import ANNOUNCED, RAISE_AFTER_CALLS_ENV
from bench.sweep_hooks.sitecustomize import MARK as RAISED

ENTRIES = ("eval", "export", "generate", "interop", "prepare")
END_WITHIN_S = 60
"""A command must have ended this long after its error was raised."""
RUN_TIMEOUT_S = 300
MAX_CALLS = 3000
VARIANTS = {"eval": ("rank 0", "rank 1"), "interop": ("to-hf", "from-hf"), "prepare": ("reuse", "train", "sources")}
"""What a case of an entry draws besides: eval the rank raised on, interop the direction, prepare the tokenizer
(reused or trained) or a mixture of three sources in one step (`--source`, one document per line, the tokenizer
reused). The other entries have none."""


@dataclass(frozen=True)
class Case:
    entry: str
    variant: str
    """eval: the rank raised on; interop: to-hf / from-hf; prepare: reuse / train (the tokenizer) / sources;
    else ''."""
    calls: int
    at_share: float
    """When, as a share of the undisturbed run's duration."""

    def text(self) -> str:
        what = f"{self.entry} ({self.variant})" if self.variant else self.entry
        return f"{what}: an error at call {self.calls}, {self.at_share:.0%} into the run"


EXPORT = Case("export", "", 0, 0)
"""The undisturbed export, whose folders interop's cases convert."""


def draw_case(rng: random.Random, entries: tuple[str, ...]) -> Case:
    entry = rng.choice(entries)
    variant = rng.choice(VARIANTS[entry]) if entry in VARIANTS else ""
    return Case(entry, variant, rng.randint(1, MAX_CALLS), rng.uniform(0.0, 1.1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    """The trained run, the raw text, and each command's undisturbed result."""

    def __init__(self, folder: Path, corpus: Path):
        self.folder, self.corpus = folder, corpus
        self.run_dir, self.raw = folder / "run", folder / "raw"
        self.seconds: dict[str, float] = {}

    def command(self, case: Case, out: Path) -> list[str]:
        py = sys.executable
        if case.entry == "eval":
            torchrun = str(Path(py).with_name("torchrun"))
            return [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), "launch/eval.py",
                    "--checkpoint", str(self.run_dir), "--split", "valid", "--json-out", str(out / "result.json")]
        if case.entry == "export":
            return [py, "launch/export.py", "--checkpoint", str(self.run_dir), "--out", str(out / "native"), "--hf",
                    str(out / "hf")]
        if case.entry == "generate":
            return [py, "launch/generate.py", "--checkpoint", str(self.run_dir), "--prompt", "The king",
                    "--max-new-tokens", "24", "--seed", "1", "--json"]
        if case.entry == "interop":
            src = self.reference(EXPORT) / ("native" if case.variant == "to-hf" else "hf")
            return [py, "-m", "txl_dist.interop", case.variant, str(src), str(out / "converted")]
        tokenizer = (["--vocab-size", "512", "--tokenizer-sample", "2000"] if case.variant == "train" else
                     ["--tokenizer-model", str(self.corpus / "tokenizer.model")])
        if case.variant == "sources":
            inputs = [*(a for i, weight in ((1, 2), (2, 1), (3, 1)) for a in
                        ("--source", f"s{i}={self.raw / f'train{i}.txt'}:{weight}")),
                      "--line-docs", "--valid-fraction", "0.05", "--test-fraction", "0.05"]
        else:
            inputs = ["--train", str(self.raw / "train*.txt"), "--valid", str(self.raw / "valid.txt"), "--test",
                      str(self.raw / "test.txt")]
        return [py, "-m", "data_prep", "prepare", "--out", str(out / "corpus"), *inputs, "--world-size", "2",
                "--n-streams", "4", "--num-proc", "2", "--quiet", *tokenizer]

    def reference(self, case: Case) -> Path:
        """The folder of the undisturbed run of the case's command (its variant's; eval's ranks share one)."""
        name = case.entry + ("" if case.entry == "eval" or not case.variant else f"-{case.variant}")
        return self.folder / "reference" / name

    def prepare(self, entries: tuple[str, ...]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        train = [*train_command(2, free_port()), "--set", f"data.path={self.corpus}", "--set",
                 f"run.dir={self.run_dir}", "--set", "train.max_steps=4", "--set", "checkpoint.interval=4", "--set",
                 "eval.max_segments=4", "--set", "tracking.enabled=false"]
        if run(train, self.folder / "train.log")[0] != 0:
            raise SystemExit(f"the set-up's training run failed: {self.folder / 'train.log'}")
        write_raw_text(self.raw, seed=0)
        needed = [EXPORT] if "interop" in entries else []  # interop converts the undisturbed export
        for entry in entries:
            needed += [Case(entry, v, 0, 0) for v in VARIANTS.get(entry, ("",))]
        for case in dict.fromkeys(needed):
            out = self.reference(case)
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            started = time.monotonic()
            status, text = run(self.command(case, out), out.parent / f"{out.name}.log")
            if status != 0:
                raise SystemExit(f"the undisturbed {case.entry} failed (exit status {status}): "
                                 f"{out.parent / f'{out.name}.log'}")
            self.seconds[out.name] = time.monotonic() - started
            if case.entry == "generate":
                (out / "stdout.json").write_text(generated(text))


def write_raw_text(folder: Path, seed: int) -> None:
    """Plain-text documents of made-up words (Zipf-like), 3 train files and one each for valid and test."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    folder.mkdir(parents=True, exist_ok=True)
    for name, n_words in [("train1", 60000), ("train2", 60000), ("train3", 60000), ("valid", 8000), ("test", 8000)]:
        chosen = rng.choices(words, weights, k=n_words)
        lines = [" ".join(chosen[i:i + 12]) + "." for i in range(0, n_words, 12)]
        (folder / f"{name}.txt").write_text("\n".join(lines) + "\n")


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int | str, str]:
    """(exit status or "timeout", stdout) of `cmd` run in the repository; stderr (and stdout) into `log`."""
    with open(log, "w") as err:
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env or child_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                               timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "timeout", ""
    with open(log, "a") as err:
        err.write(p.stdout)
    return p.returncode, p.stdout


def generated(stdout: str) -> str:
    """generate --json's object (the same command gives the same samples: --seed)."""
    return json.dumps(json.loads(stdout), sort_keys=True)


def target_pid(proc: subprocess.Popen, case: Case) -> int | None:
    """The process to raise in: the command's own, or under torchrun the worker of the drawn rank."""
    if case.entry != "eval":
        return proc.pid
    import psutil

    rank = case.variant.split()[1]
    try:
        for child in psutil.Process(proc.pid).children():
            if child.environ().get("RANK") == rank:
                return child.pid
    except psutil.Error:
        pass
    return None


def faulted_run(setup: Setup, case: Case, out: Path, log: Path) -> dict[str, Any]:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "bench" / "sweep_hooks"), env["PYTHONPATH"]])
    env[RAISE_AFTER_CALLS_ENV] = str(case.calls)
    due = time.monotonic() + case.at_share * setup.seconds[setup.reference(case).name]
    with open(log, "w") as err:
        proc = subprocess.Popen(setup.command(case, out), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
        sent = None
        while proc.poll() is None and sent is None:
            pid = target_pid(proc, case) if time.monotonic() >= due else None
            if pid is not None and catches(pid, signal.SIGUSR2):
                try:
                    os.kill(pid, signal.SIGUSR2)
                    sent = time.monotonic()
                except ProcessLookupError:
                    break
            time.sleep(0.005)
        try:
            stdout, _ = proc.communicate(timeout=END_WITHIN_S if sent is not None else RUN_TIMEOUT_S)
            ended_s = round(time.monotonic() - sent, 1) if sent is not None else None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            ended_s = None
    with open(log, "a") as err:
        err.write(stdout)
    text = log.read_text(errors="replace")
    where = next((ln for ln in text.splitlines() if ANNOUNCED in ln), "")
    return {"signalled": sent is not None, "raised": bool(where), "where": where.partition(ANNOUNCED)[2].strip(),
            "exit": proc.returncode, "ended_after_s": ended_s, "error_printed": RAISED in text,
            "stdout": stdout}


def same_files(a: Path, b: Path) -> bool:
    """Whether folders a and b hold the same files with the same bytes."""
    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return a.is_dir() and b.is_dir() and files(a) == files(b)


def manifest_values(corpus: Path) -> str:
    manifest = json.loads((corpus / "manifest.json").read_text())
    return json.dumps({k: manifest.get(k) for k in ("splits", "tokenizer", "dtype", "mixture")}, sort_keys=True)


def leftovers(setup: Setup, case: Case, out: Path) -> list[str]:
    """What a failed run left in `out` that looks like a result, or is a temporary."""
    found = [str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    reference = setup.reference(case)
    if case.entry == "eval" and (out / "result.json").exists():
        found.append("result.json")
    if case.entry == "prepare" and (out / "corpus" / "manifest.json").exists():
        found.append("corpus/manifest.json")
    if case.entry == "prepare":  # the job's scratch beside its output (prepare --source's sources, a staging)
        found += [p.name for p in out.iterdir() if p.name.startswith(".corpus")]
    folders = {"export": [("native", "model_config.json"), ("hf", "config.json")],
               "interop": [("converted", "config.json" if case.variant == "to-hf" else "model_config.json")]}
    for folder, config in folders.get(case.entry, []):
        if (out / folder / config).exists() and not same_files(out / folder, reference / folder):
            found.append(f"{folder}/{config} beside files unlike the undisturbed run's")
    return found


def result_problems(setup: Setup, case: Case, out: Path, stdout: str) -> list[str]:
    """How the result of a run that succeeded differs from the undisturbed run's."""
    reference = setup.reference(case)
    try:
        if case.entry == "eval":
            same = json.loads((out / "result.json").read_text()) == json.loads((reference / "result.json").read_text())
        elif case.entry == "generate":
            same = generated(stdout) == (reference / "stdout.json").read_text()
        elif case.entry == "prepare":
            same = manifest_values(out / "corpus") == manifest_values(reference / "corpus")
        else:
            same = same_files(out, reference)
    except (OSError, ValueError) as e:
        return [f"its result cannot be read: {e}"]
    return [] if same else ["its result differs from the undisturbed run's"]


def check(setup: Setup, case: Case, out: Path, outcome: dict[str, Any]) -> list[str]:
    problems = []
    if outcome["raised"] and outcome["exit"] == 0:  # after its result was complete (a closing report): said so?
        if not outcome["error_printed"]:
            problems.append("the error was raised and the command succeeded without a word: swallowed")
        else:
            problems += result_problems(setup, case, out, outcome["stdout"])
    elif outcome["raised"]:
        if outcome["ended_after_s"] is None:
            problems.append(f"the command had not ended {END_WITHIN_S} s after the error")
        elif not outcome["error_printed"]:
            problems.append(f"the command failed (exit status {outcome['exit']}) without printing the error")
        problems += [f"left {item}" for item in leftovers(setup, case, out)]
    elif outcome["exit"] != 0:
        problems.append(f"failed (exit status {outcome['exit']}) although no error was raised")
    else:
        problems += result_problems(setup, case, out, outcome["stdout"])
    return problems


def run_case(setup: Setup, case: Case, folder: Path) -> dict[str, Any]:
    shutil.rmtree(folder, ignore_errors=True)
    out = folder / "out"
    out.mkdir(parents=True)
    outcome = faulted_run(setup, case, out, folder / "faulted.log")
    problems = check(setup, case, out, outcome)
    if case.entry == "prepare" and outcome["exit"] == 0:  # prepare refuses a finished corpus folder
        shutil.rmtree(out / "corpus", ignore_errors=True)
    status, stdout = run(setup.command(case, out), folder / "again.log")
    if status != 0:
        problems.append(f"the same command again: exit status {status} ({folder / 'again.log'})")
    else:
        problems += [f"the same command again: {p}" for p in result_problems(setup, case, out, stdout)]
    outcome.pop("stdout")
    return {"case": asdict(case), **outcome, "problems": problems, "verdict": "fail" if problems else "pass"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.entry_fault_probe", description=__doc__.split("\n\n")[0],
                                epilog="example: python -m bench.entry_fault_probe --cases 40 --seed 1 --minutes 20")
    p.add_argument("--cases", type=int, default=40, help="cases to draw (default 40)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed: the same seed draws the same cases")
    p.add_argument("--minutes", type=float, default=20, help="start no case after this long (default 20)")
    p.add_argument("--entries", nargs="+", choices=ENTRIES, default=list(ENTRIES), help="entry points to draw from")
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "shakespeare",
                   help="a prepared corpus with its tokenizer (default data/shakespeare)")
    p.add_argument("--out", type=Path, help="where the set-up and the cases' folders go (default: a new temporary "
                   "folder)")
    p.add_argument("--keep", action="store_true", help="keep the folders of passing cases too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cases < 1 or args.minutes <= 0:
        build_parser().error("--cases and --minutes must be positive")
    if not (args.corpus / "manifest.json").is_file():
        build_parser().error(f"--corpus {args.corpus}: no manifest.json (bash scripts/shakespeare_corpus.sh makes "
                             "data/shakespeare)")
    root = args.out or Path(tempfile.mkdtemp(prefix="entry-fault-probe-"))
    entries = tuple(dict.fromkeys(args.entries))
    started = time.monotonic()
    setup = Setup(root / "setup", args.corpus.resolve())
    setup.prepare(entries)
    print(f"set-up in {time.monotonic() - started:.0f} s: undisturbed runs "
          + ", ".join(f"{name} {s:.1f} s" for name, s in setup.seconds.items()), flush=True)
    rng = random.Random(f"entry faults {args.seed}")
    failed = 0
    with open(root / "results.jsonl", "a") as results:
        for i in range(args.cases):
            if time.monotonic() - started > args.minutes * 60:
                print(f"stopped drawing after {i} case(s): --minutes {args.minutes:g} reached", flush=True)
                break
            case = draw_case(rng, entries)
            record = {"index": i, **run_case(setup, case, root / f"case{i:03d}")}
            results.write(json.dumps(record) + "\n")
            how = (f"raised {record['where']}; exit {record['exit']} {record['ended_after_s']} s later"
                   if record["raised"] else f"not raised (exit {record['exit']})")
            print(f"case {i}: {record['verdict'].upper()} {case.text()}: {how}"
                  + "".join(f"\n  - {p}" for p in record["problems"]), flush=True)
            failed += record["verdict"] == "fail"
            if record["verdict"] == "pass" and not args.keep:
                shutil.rmtree(root / f"case{i:03d}", ignore_errors=True)
    print(f"{failed} case(s) failed; results in {root / 'results.jsonl'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
