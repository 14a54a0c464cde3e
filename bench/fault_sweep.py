"""A random fault sweep: each case trains a drawn configuration once straight and once with faults injected at
random moments, then restarts it with `--resume auto` until it finishes, and checks what docs/reliability.md
promises after a crash or a stop request.

The tests put each fault at one chosen point (tests/test_faults.py, tests/test_distributed_faults.py) and
bench/soak.sh kills one rank once, mid-step. Here a case draws a model, engine and world size as
bench/config_sweep.py does ("auto" precision and attention made explicit: a fresh start times them anew and
may choose otherwise), trains STEPS steps with a checkpoint every CHECKPOINT_INTERVAL (keep KEEP) and a
validation every EVAL_INTERVAL, and draws one or two faults:

- what: SIGKILL of one rank (a crash, the OOM killer) or of the whole job (a node lost), SIGSTOP of one rank
  (a hang; 2 ranks only: one rank alone has no neighbour to notice), or a stop request: SIGTERM to one worker
  or to torchrun, SIGUSR1 to torchrun (it dies of it; its workers see their launcher gone), SIGINT to every
  process (Ctrl-C);
- when: during start-up (a random share of the time the straight run took to its first step), right after a
  random step's progress line, or while a random checkpoint's staging folder exists (a save in flight);
- where a 2-rank case draws it, the jobs after the first fault run on 1 rank: the restart of a job that lost a
  node, on the nodes left, through DeepSpeed's universal checkpoint (an elastic resume).

A faulted job must end on its own within END_WITHIN_S (a hang is a failure), a stop request must leave a
complete checkpoint of the step it names (`stopping after step N`), and each restart must resume from the
newest complete checkpoint on disk. Once the last restart has finished:

- every value of the deterministic metrics (train loss, learning rate, gradient norm, tokens seen, validation
  and test figures) in the metrics journal, every copy logged by a job that trained a step again included,
  equals the straight run's bit for bit, and every step has its loss (after an elastic resume, whose ranks
  sum in another order, the steps it trained need only a finite loss);
- the MLflow run is the one the first job opened, FINISHED, and its `train/loss` history holds the straight
  run's values only; `python -m txl_dist.tracking replay` of the run folder succeeds;
- the checkpoint folder holds no leftover (interrupted save, replacement, removal, conversion), no incomplete
  tag, no universal copy of a tag it no longer keeps, at most KEEP complete tags, the newest at STEPS and named
  by `latest`, each one verifying against its checksums.

    python -m bench.fault_sweep [--cases 40] [--seed 0] [--minutes 45] [--corpus data/shakespeare] [--world 1|2]
        [--out DIR] [--keep]

A case takes ~20-60 s on 2 cores (one with a hung rank ~2 minutes). Exit status 0 when no case failed, 1 when
one did (their folders kept under --out), 2 on bad arguments. docs/reliability.md, "Random faults", has what
sweeps found.
"""
from __future__ import annotations

import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.config_sweep import (REPO, Case, child_env, draw, parse_training_sweep, refusal, sweep, train_command,
                                training_sweep_parser)
from bench.soak_report import read_jsonl

STEPS, CHECKPOINT_INTERVAL, KEEP, EVAL_INTERVAL = 10, 2, 2, 4
COLLECTIVE_TIMEOUT_S = 30
"""train.collective_timeout_s of every run: a lost rank is noticed within 3 heartbeats of a sixth of it, a hung
one after it."""
END_WITHIN_S = 120
"""A faulted job must have ended this long after its fault: the hang's timeout, the watchdog's, a margin."""
RUN_TIMEOUT_S = 600
POLL_S = 0.002

STOPS = ("term-worker", "usr1-worker", "term-launcher", "usr1-launcher", "int-all")
"""Stop requests: the job saves at the next step boundary and exits."""
LAUNCHER_ONLY = ("term-launcher", "usr1-launcher", "kill-rank", "stop-rank")
"""Faults of a job on 2 ranks only (1 rank runs without torchrun, and kill-rank is kill-job there)."""
KILLS = ("kill-rank", "kill-job", "stop-rank")
ONE_RANK = {"kill-rank": signal.SIGKILL, "stop-rank": signal.SIGSTOP, "term-worker": signal.SIGTERM,
            "usr1-worker": signal.SIGUSR1}
"""Faults that signal one rank's process, and their signals."""
STOPPING = re.compile(r"stopping after step (\d+)")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) \((same world size|elastic)")
MLFLOW_RUN = re.compile(r"MLflow run ([0-9a-f]{32}) \((\w+)\)")
DETERMINISTIC = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_seen", "train/nonfinite_steps")
"""Journal metrics a resumed run must repeat exactly, besides every valid/* and test/* figure."""


@dataclass
class Fault:
    kind: str
    """One of STOPS or KILLS."""
    trigger: str
    """"start-up", "step" or "save"."""
    at: float
    """start-up: the share of the straight run's time to its first step; step: the step whose progress line fires
    it; save: the step of the checkpoint whose staging folder fires it."""
    delay_s: float
    """How long after the trigger the fault comes."""
    rank: int
    """The rank a one-rank fault hits."""

    def text(self) -> str:
        where = {"start-up": f"{self.at:.2f} of the straight run's time to step 1", "step": f"after step {self.at:g}",
                 "save": f"in the save of step {self.at:g}"}[self.trigger]
        rank = f" of rank {self.rank}" if self.kind in ONE_RANK else ""
        return f"{self.kind}{rank} {where} (+{self.delay_s * 1e3:.0f} ms)"


def draw_fault(rng: random.Random, world: int) -> Fault:
    kind = rng.choice([k for k in KILLS + STOPS if world > 1 or k not in LAUNCHER_ONLY])
    trigger = rng.choice(["start-up", "step", "step", "save", "save"])
    at = {"start-up": rng.random(), "step": rng.randint(1, STEPS - 1),
          "save": rng.randrange(CHECKPOINT_INTERVAL, STEPS + 1, CHECKPOINT_INTERVAL)}[trigger]
    delay = rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0, 0.2)])
    return Fault(kind, trigger, at, delay, rng.randrange(world))


def draw_case(rng: random.Random, vocab: int, world: int | None) -> tuple[Case, list[Fault], bool]:
    """A case, its faults, and whether the jobs after the first fault run on 1 rank (a 2-rank case only: the
    restart of a job that lost a node, on the nodes left)."""
    case = draw(rng, vocab, world or rng.choice([1, 2, 2]))
    if case.precision == "auto":
        case.precision = "fp32"
    if case.model["attn_impl"] == "auto":
        case.model["attn_impl"] = "matmul"
    elastic = case.world > 1 and rng.random() < 0.3
    faults = [draw_fault(rng, case.world)]
    if rng.random() < 0.3:
        faults.append(draw_fault(rng, 1 if elastic else case.world))
    return case, faults, elastic


def sets(case: Case, run_dir: Path) -> list[str]:
    return case.sets(run_dir, f"train.max_steps={STEPS}", f"checkpoint.interval={CHECKPOINT_INTERVAL}",
                     f"checkpoint.keep={KEEP}", f"eval.interval={EVAL_INTERVAL}",
                     f"train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}")


def rank_pids(processes: list, world: int) -> dict[int, int]:
    """{rank: pid} of the job's training processes among `processes` (Job.processes(): the launcher first, which
    is the one training process on 1 rank)."""
    if world == 1:
        return {0: processes[0].pid} if processes else {}
    import psutil

    pids = {}
    for child in processes[1:]:
        try:
            if "launch/train.py" in " ".join(child.cmdline()):
                pids[int(child.environ()["RANK"])] = child.pid
        except (psutil.Error, KeyError, ValueError):
            continue
    return pids


def first_step_seconds(log: Path, started: float) -> float:
    """Seconds from `started` (a time.time()) to the log's first progress line, by the line's time of day."""
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"(\d\d):(\d\d):(\d\d) step 1/", line)
        if m:
            t = time.localtime(started)
            first = time.mktime(t[:3] + tuple(int(x) for x in m.groups()) + t[6:])
            return max(1.0, first - started)
    return 10.0


class Job:
    """One launch of the case's training command. The job is every process of it: torchrun's workers outlive a
    torchrun that died (of SIGUSR1), see it gone, save and exit; a scheduler waits for them too."""

    def __init__(self, case: Case, corpus: Path, run_dir: Path, log: Path, port: int) -> None:
        self.case, self.log = case, log
        cmd = train_command(case.world, port) + ["--set", f"data.path={corpus}"] + sets(case, run_dir)
        self.out = open(log, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # a Ctrl-C to the sweep stays the sweep's
        self.known: dict[int, Any] = {}
        self.tracked_at = 0.0

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def processes(self) -> list:
        """The launcher and every process under it now (torchrun starts its workers in sessions of their own,
        out of the launcher's process group), also remembered for when the launcher is gone."""
        import psutil

        try:
            launcher = psutil.Process(self.proc.pid)
            found = [launcher, *launcher.children(recursive=True)]
        except psutil.Error:
            found = []
        for process in found:
            self.known.setdefault(process.pid, process)
        self.tracked_at = time.monotonic()
        return found

    def alive(self) -> bool:
        """Whether any process of the job still runs (its processes looked up every 50 ms)."""
        import psutil

        if self.proc.poll() is None:
            if time.monotonic() - self.tracked_at > 0.05:
                self.processes()
            return True
        for process in self.known.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                continue
        return False

    def wait(self, timeout: float) -> int | str:
        """The launcher's exit status once every process of the job has ended, or "timeout"."""
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(0.05)
        return self.proc.returncode

    def signal_all(self, signum: int) -> None:
        import psutil

        for process in self.processes():
            try:
                process.send_signal(signum)
            except psutil.Error:
                pass

    def end(self) -> None:
        """Kill whatever of the job is left (a stopped rank, an orphan) and close its log."""
        import psutil

        left = list({p.pid: p for p in [*self.known.values(), *self.processes()]}.values())
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=30)
        self.proc.wait()
        self.out.close()


def fired(job: Job, fault: Fault, ckpt_dir: Path, startup_s: float) -> bool:
    """Whether the fault's moment has come (its delay not yet waited)."""
    if fault.trigger == "start-up":
        return time.time() - job.started >= fault.at * startup_s
    if fault.trigger == "step":
        return f" step {int(fault.at)}/{STEPS} " in job.text()
    tag = f"step_{int(fault.at):08d}"
    return (ckpt_dir / f".saving-{tag}").exists() or (ckpt_dir / tag).exists()


def inject(job: Job, fault: Fault) -> str | None:
    """Send the fault's signal(s); None once sent, else why not (the ranks not started yet, the job over)."""
    if job.proc.poll() is not None:
        return "the job had ended"
    pids = rank_pids(job.processes(), job.case.world)  # each process of the job known before any of them dies
    if fault.kind in ONE_RANK and fault.rank not in pids:
        return "ranks not started"
    try:
        if fault.kind in ONE_RANK:
            os.kill(pids[fault.rank], ONE_RANK[fault.kind])
        elif fault.kind in ("kill-job", "int-all"):
            job.signal_all(signal.SIGKILL if fault.kind == "kill-job" else signal.SIGINT)
        else:  # term-launcher, usr1-launcher: torchrun
            os.kill(job.proc.pid, signal.SIGTERM if fault.kind == "term-launcher" else signal.SIGUSR1)
    except ProcessLookupError:
        return "the process had ended"
    return None


def faulted_run(job: Job, fault: Fault, ckpt_dir: Path, startup_s: float) -> dict[str, Any]:
    """Watch the job, inject the fault at its moment, wait for the job's end -> what happened."""
    due = None
    sent = None
    while job.alive():
        now = time.monotonic()
        if sent is None and due is None and fired(job, fault, ckpt_dir, startup_s):
            due = now + fault.delay_s
        if sent is None and due is not None and now >= due and inject(job, fault) is None:
            sent = now
        if sent is not None and now - sent > END_WITHIN_S:
            break
        if sent is None and time.time() - job.started > RUN_TIMEOUT_S:
            break
        time.sleep(POLL_S if fault.trigger == "save" else 5 * POLL_S)
    status = job.proc.poll()
    ended_s = round(time.monotonic() - sent, 1) if sent is not None and not job.alive() else None
    job.end()
    text = job.text()
    stopped = STOPPING.search(text)
    return {"fault": fault.text(), "landed": sent is not None, "exit": status, "ended_after_s": ended_s,
            "stopped_after_step": int(stopped.group(1)) if stopped else None,
            "last_line": next((ln for ln in reversed(text.splitlines()) if "error:" in ln), "")[-300:]}


def names_the_rank(text: str, rank: int) -> bool:
    """Whether a job's output names `rank` as the one lost or hung: a peer's `error:` line, or torchrun's root
    cause. A rank lost early in its start-up (before the product's rendezvous) leaves its peers waiting to join it
    for the group's timeout; torchrun ends them sooner (its SIGTERM, which a start-up keeps for after the first
    step, then SIGKILL 30 s later) and reports the rank that died first."""
    if re.search(rf"error: .*\brank {rank}\b", text):
        return True
    cause = text.partition("Root Cause (first observed failure):")[2]
    return re.search(rf"^\s*rank\s*: {rank} \(local_rank", cause, flags=re.MULTILINE) is not None


def journal_values(path: Path) -> dict[tuple[int, str], list[float]]:
    """{(step, metric): every value the journal holds for it} for the metrics a resumed run must repeat."""
    values: dict[tuple[int, str], list[float]] = {}
    for row in read_jsonl(path):
        for key, v in row.get("metrics", {}).items():
            if key in DETERMINISTIC or key.startswith(("valid/", "test/")):
                values.setdefault((int(row["step"]), key), []).append(float(v))
    return values


def check_folder(run_dir: Path) -> list[str]:
    """The checkpoint folder's state after the last job -> problems."""
    from txl_dist import checkpoint

    ckpt_dir = run_dir / "checkpoints"
    inv = checkpoint.inventory(ckpt_dir)
    problems = []
    if inv.leftovers or inv.incomplete:
        problems.append(f"checkpoints/ holds leftovers {inv.leftovers} and incomplete tags {inv.incomplete}")
    newest = checkpoint.tag_for(STEPS)
    if not inv.complete or inv.complete[-1] != newest or inv.latest != newest:
        problems.append(f"the newest tag is {inv.complete[-1:]} and latest names {inv.latest}, not {newest}")
    if len(inv.complete) > KEEP:
        problems.append(f"{len(inv.complete)} complete tags kept, checkpoint.keep is {KEEP}: {inv.complete}")
    for tag in inv.complete:
        if (problem := checkpoint.verify(ckpt_dir / tag)) is not None:
            problems.append(f"{tag} does not verify: {problem}")
    stray = [p.name for p in ckpt_dir.glob(f"step_*{checkpoint.UNIVERSAL_SUFFIX}")
             if p.name.removesuffix(checkpoint.UNIVERSAL_SUFFIX) not in inv.complete]
    if stray:
        problems.append(f"universal copies of tags no longer kept: {stray}")
    return problems


def check_metrics(expected: dict[tuple[int, str], list[float]], faulty: Path, exact_through: int = STEPS
                  ) -> list[str]:
    """The faulted run's journal against the straight run's values (journal_values) -> problems. Steps after
    `exact_through` (the step an elastic resume continued from: fewer ranks sum in another order) need only a
    finite loss."""
    got = journal_values(faulty / "tracking" / "metrics.jsonl")
    problems = []
    loose = [s for s in range(exact_through + 1, STEPS + 1) if not all(
        math.isfinite(v) for v in got.get((s, "train/loss"), [math.nan]))]
    if loose:
        problems.append(f"after the elastic resume at step {exact_through}, no finite loss at steps {loose}")
    expected = {k: v for k, v in expected.items() if k[0] <= exact_through}
    got = {k: v for k, v in got.items() if k[0] <= exact_through}
    differ = sorted(k for k, vs in got.items() if k not in expected or any(v != expected[k][0] for v in vs))
    if differ:
        step, key = differ[0]
        problems.append(f"{len(differ)} journal value(s) differ from the straight run's, first {key} at step {step}: "
                        f"{got[differ[0]]} against {expected.get(differ[0])}")
    missing = sorted(set(expected) - set(got))
    if missing:
        problems.append(f"{len(missing)} straight-run value(s) missing from the journal, first {missing[0]}")
    return problems


def check_mlflow(run_dir: Path, run_id: str | None, expected: dict[tuple[int, str], list[float]],
                 exact_through: int = STEPS) -> list[str]:
    """The MLflow run: the first job's, FINISHED, its train/loss history the straight run's values (`expected`,
    up to `exact_through`, as in check_metrics), a value at every step."""
    from mlflow.tracking import MlflowClient

    if run_id is None:
        return ["no MLflow run id in the first job's log"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(run_id)
    problems = [] if run.info.status == "FINISHED" else [f"MLflow run {run_id} is {run.info.status}"]
    history = client.get_metric_history(run_id, "train/loss")
    wrong = [(m.step, m.value) for m in history
             if m.step <= exact_through and m.value != expected.get((m.step, "train/loss"), [None])[0]]
    steps = {m.step for m in history}
    if wrong or steps != set(range(1, STEPS + 1)):
        problems.append(f"MLflow's train/loss: {len(wrong)} value(s) unlike the straight run's (first {wrong[:1]}), "
                        f"steps {sorted(steps)}")
    return problems


def run_case(case: Case, faults: list[Fault], folder: Path, corpus: Path, port: int, elastic: bool = False
             ) -> dict[str, Any]:
    """The straight run, the faulted jobs and the last restart (after the first fault on 1 rank where `elastic`),
    and the checks -> the case's record: "verdict" pass / refused / fail, "failed" what failed."""
    from txl_dist import checkpoint

    record: dict[str, Any] = {"case": asdict(case), "elastic": elastic, "faults": [], "failed": []}
    straight, faulty = folder / "straight", folder / "faulty"
    job = Job(case, corpus, straight, folder / "straight.log", port)
    status = job.wait(RUN_TIMEOUT_S)
    job.end()
    if status == 2 and refusal(job.log):
        return record | {"verdict": "refused", "refusal": refusal(job.log)}
    if status != 0:
        return record | {"verdict": "fail", "failed": [f"straight run: exit status {status}"]}
    startup_s = first_step_seconds(job.log, job.started)
    ckpt_dir = faulty / "checkpoints"
    run_id, exact_through = None, STEPS
    for i, fault in enumerate([*faults, None]):
        newest = (checkpoint.inventory(ckpt_dir).complete or [None])[-1]
        job_case = replace(case, world=1) if elastic and i > 0 else case
        job = Job(job_case, corpus, faulty, folder / f"job{i}.log", port + 1 + i)
        if fault is None:
            status = job.wait(RUN_TIMEOUT_S)
            job.end()
            outcome = {"exit": status}
            if status != 0:
                record["failed"].append(f"the last restart: exit status {status}")
        else:
            outcome = faulted_run(job, fault, ckpt_dir, startup_s)
            record["faults"].append(outcome)
            if outcome["landed"] and outcome["ended_after_s"] is None:
                record["failed"].append(f"{fault.text()}: the job had not ended {END_WITHIN_S} s after it")
            if fault.kind in ("kill-rank", "stop-rank") and outcome["exit"] not in (0, None) \
                    and not names_the_rank(job.text(), fault.rank):
                record["failed"].append(f"{fault.text()}: the job ended (exit status {outcome['exit']}) without "
                                        f"a line naming rank {fault.rank}")
            if fault.kind in STOPS and (n := outcome["stopped_after_step"]) is not None \
                    and checkpoint.tag_for(n) not in checkpoint.inventory(ckpt_dir).complete:
                record["failed"].append(f"{fault.text()}: stopped after step {n} without its checkpoint")
        text = job.text()
        resumed = RESUMED.search(text)
        trained = re.search(rf" step \d+/{STEPS} ", text) is not None
        if job_case is not case and exact_through == STEPS and (resumed or trained):
            exact_through = int(resumed.group(2)) if resumed and resumed.group(3) == "elastic" else 0
        if newest is not None and (Path(resumed.group(1)).name != newest if resumed else trained):
            record["failed"].append(f"job {i} resumed from {resumed.group(1) if resumed else 'nothing'}, "
                                    f"the newest complete tag was {newest}")
        if run_id is None and (faulty / "tracking" / "run_id").is_file():
            run_id = (faulty / "tracking" / "run_id").read_text().strip()
        if fault is None and (m := MLFLOW_RUN.search(text)) and m.group(1) != run_id:
            record["failed"].append(f"the last job logged to MLflow run {m.group(1)}, the first to {run_id}")
        if record["failed"]:
            return record | {"verdict": "fail"}
    record["exact_through"] = exact_through
    expected = journal_values(straight / "tracking" / "metrics.jsonl")
    record["failed"] += (check_folder(faulty) + check_metrics(expected, faulty, exact_through)
                         + check_mlflow(faulty, run_id, expected, exact_through))
    replay = subprocess.run([sys.executable, "-m", "txl_dist.tracking", "replay", str(faulty)], cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if replay.returncode != 0:
        record["failed"].append(f"replay: exit status {replay.returncode}: {replay.stderr.strip()[-300:]}")
    return record | {"verdict": "fail" if record["failed"] else "pass"}


def main(argv: list[str] | None = None) -> int:
    args, corpus, vocab = parse_training_sweep(training_sweep_parser("bench.fault_sweep", __doc__), argv)

    def run_one(rng: random.Random, i: int, folder: Path) -> tuple[dict[str, Any], str]:
        case, faults, elastic = draw_case(rng, vocab, args.world)
        port = 29300 + (args.seed * 97 + i * 4) % 360
        text = f"{case.text()}; " + ", then ".join(f.text() for f in faults)
        text += ", restarted on 1 rank" if elastic else ""
        return run_case(case, faults, folder, corpus, port, elastic), text

    return sweep(args, run_one)


if __name__ == "__main__":
    raise SystemExit(main())
