"""A random fault sweep: each case trains a drawn configuration once straight and once with faults injected at
random moments, then restarts it with `--resume auto` until it finishes, and checks what docs/reliability.md
promises after a crash or a stop request.

The tests put each fault at one chosen point (tests/test_faults.py, tests/test_distributed_faults.py) and
bench/soak.sh kills one rank once, mid-step. Here a case draws a model, engine and world size as
bench/config_sweep.py does ("auto" precision and attention made explicit: a fresh start times them anew and
may choose otherwise; fp16 made bf16 where DeepSpeed refuses fp16, as on a CPU without fp16 kernels), trains
STEPS steps with a checkpoint every CHECKPOINT_INTERVAL (keep KEEP) and a validation every EVAL_INTERVAL, and
draws one or two faults:

- what: SIGKILL of one rank (a crash, the OOM killer) or of the whole job (a node lost), SIGSTOP of one rank
  (a hang; 2 ranks only: one rank alone has no neighbour to notice), or a stop request: SIGTERM to one worker
  or to torchrun, SIGUSR1 to torchrun (it dies of it; its workers see their launcher gone), SIGINT to every
  process (Ctrl-C);
- when: during start-up (a random share of the time the straight run took to its first step), right after a
  random step's progress line, or while a random checkpoint's staging folder exists (a save in flight);
- where a 2-rank case draws it, the jobs after the first fault run on 1 rank: the restart of a job that lost a
  node, on the nodes left, through DeepSpeed's universal checkpoint (an elastic resume);
- in a share of the cases (--disk-share, drawn apart, so that a machine that cannot mount a tmpfs runs the same other
  cases), the first fault is a full disk instead, at the same moment: the faulted run's folder lives on a tmpfs
  of its own, which a filler file fills to no byte, a few KiB, or part of a checkpoint's size left free; the
  filler is removed a drawn while later (space came back) or only once the job has ended (the user freed space
  before restarting);
- in a share of the other cases (--raise-share, drawn apart too), the first fault is an error instead, raised
  on one rank at the same moment: that rank's main thread raises a RuntimeError at its N-th call into a Python
  function of txl_dist, launch/ or DeepSpeed (N drawn from 1 to 2000; bench/sweep_hooks/sitecustomize.py), as a
  bug or an out-of-memory error would.

A faulted job must end on its own within END_WITHIN_S (a hang is a failure), a stop request must leave a
complete checkpoint of the step it names (`stopping after step N`), and each restart must resume from the
newest complete checkpoint on disk. A job that a full disk ended must say so in an `error:` line, and one that
a raised error ended must print that error. Once the last restart has finished:

- every value of the deterministic metrics (train loss, learning rate, gradient norm, tokens seen, validation
  and test figures) in the metrics journal, every copy logged by a job that trained a step again included,
  equals the straight run's bit for bit, and every step has its loss (after an elastic resume, whose ranks
  sum in another order, the steps it trained need only a finite loss; a step that a job logged after its
  metrics journal said it stopped at a full disk, and that no later job trained again, may be missing);
- the MLflow run is the one the first job opened, FINISHED, and its `train/loss` history holds the straight
  run's values only (and every step's, but for those the journal lost); `python -m txl_dist.tracking replay`
  of the run folder succeeds;
- the checkpoint folder holds no leftover (interrupted save, replacement, removal, conversion), no incomplete
  tag, no universal copy of a tag it no longer keeps, at most KEEP complete tags, the newest at STEPS and named
  by `latest`, each one verifying against its checksums.

    python -m bench.fault_sweep [--cases 40] [--seed 0] [--minutes 45] [--corpus data/shakespeare] [--world 1|2]
        [--out DIR] [--keep] [--disk-share 0.25] [--raise-share 0.25]

Full-disk faults need a tmpfs mount (root or CAP_SYS_ADMIN); where none can be mounted, or with --disk-share
0, those cases keep their other faults.

A case takes ~20-60 s on 2 cores (one with a hung rank ~2 minutes). Exit status 0 when no case failed, 1 when
one did (their folders kept under --out), 2 on bad arguments. docs/reliability.md, "Random faults", has what
sweeps found.
"""
from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.config_sweep import (REPO, Case, child_env, draw, parse_training_sweep, refusal, sweep, train_command,
                                training_sweep_parser)
from bench.soak_report import read_jsonl
from bench.sweep_hooks.sitecustomize import ANNOUNCED, RAISE_AFTER_CALLS_ENV
from bench.sweep_hooks.sitecustomize import MARK as RAISED

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
            "usr1-worker": signal.SIGUSR1, "raise-rank": signal.SIGUSR2}
"""Faults that signal one rank's process, and their signals."""
STOPPING = re.compile(r"stopping after step (\d+)")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) \((same world size|elastic)")
MLFLOW_RUN = re.compile(r"MLflow run ([0-9a-f]{32}) \((\w+)\)")
DISK_SHARE = 0.25
"""Of the cases where a tmpfs can be mounted: those whose first fault is a full disk."""
RAISE_SHARE = 0.25
"""Of the cases whose first fault is not a full disk: those where it is an error raised on one rank instead."""
SWEEP_HOOKS = Path(__file__).resolve().parent / "sweep_hooks"
"""Its sitecustomize.py arms raise-rank's error in the faulted job's processes."""
FULL_DISK = re.compile(r"error: .*(No space left on device|Errno 28|disk is full|free space)")
JOURNAL_STOPPED = "tracking: cannot write the metrics journal"

DETERMINISTIC = ("train/loss", "train/lr", "train/grad_norm", "train/tokens_seen", "train/nonfinite_steps")
"""Journal metrics a resumed run must repeat exactly, besides every valid/* and test/* figure."""


@dataclass
class Fault:
    kind: str
    """One of STOPS or KILLS, "fill-disk" or "raise-rank"."""
    trigger: str
    """"start-up", "step" or "save"."""
    at: float
    """start-up: the share of the straight run's time to its first step; step: the step whose progress line fires
    it; save: the step of the checkpoint whose staging folder fires it."""
    delay_s: float
    """How long after the trigger the fault comes."""
    rank: int
    """The rank a one-rank fault hits."""
    leave_bytes: int = 0
    """fill-disk: the bytes left free (where leave_of_tag is 0)"""
    leave_of_tag: float = 0.0
    """fill-disk: the share of the newest checkpoint's size (the straight run's where the job has none) left free"""
    freed_after_s: float | None = None
    """fill-disk: the filler removed this long after the fill, the job still running; None: once it has ended"""
    raise_after_calls: int = 0
    """raise-rank: the rank's main thread raises at its this-many-th call into txl_dist, launch/ or DeepSpeed code
    after the fault's moment"""

    def text(self) -> str:
        where = {"start-up": f"{self.at:.2f} of the straight run's time to step 1", "step": f"after step {self.at:g}",
                 "save": f"in the save of step {self.at:g}"}[self.trigger]
        rank = f" of rank {self.rank}" if self.kind in ONE_RANK else ""
        if self.kind == "fill-disk":
            left = f"{self.leave_of_tag:.2f} of a checkpoint" if self.leave_of_tag else f"{self.leave_bytes} bytes"
            freed = f"freed after {self.freed_after_s:.1f} s" if self.freed_after_s is not None else "freed at the end"
            rank = f" to {left} free, {freed},"
        if self.kind == "raise-rank":
            rank += f" at its call {self.raise_after_calls}"
        return f"{self.kind}{rank} {where} (+{self.delay_s * 1e3:.0f} ms)"


def draw_fault(rng: random.Random, world: int) -> Fault:
    kind = rng.choice([k for k in KILLS + STOPS if world > 1 or k not in LAUNCHER_ONLY])
    trigger = rng.choice(["start-up", "step", "step", "save", "save"])
    at = {"start-up": rng.random(), "step": rng.randint(1, STEPS - 1),
          "save": rng.randrange(CHECKPOINT_INTERVAL, STEPS + 1, CHECKPOINT_INTERVAL)}[trigger]
    delay = rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0, 0.2)])
    return Fault(kind, trigger, at, delay, rng.randrange(world))


def draw_disk_fault(rng: random.Random, fault: Fault) -> Fault:
    """`fault` turned into a full disk at the same moment."""
    leave = rng.choice(["none", "bytes", "tag"])
    return replace(fault, kind="fill-disk", leave_bytes=rng.randrange(1, 64 << 10) if leave == "bytes" else 0,
                   leave_of_tag=rng.uniform(0.2, 0.9) if leave == "tag" else 0.0,
                   freed_after_s=rng.choice([None, None, rng.uniform(0.2, 3.0)]))


def draw_raise_fault(rng: random.Random, fault: Fault, world: int) -> Fault:
    """`fault` turned into an error raised on one rank at the same moment."""
    return replace(fault, kind="raise-rank", rank=rng.randrange(world),
                   raise_after_calls=rng.choice([1, rng.randint(2, 50), rng.randint(50, 2000)]))


def draw_case(rng: random.Random, vocab: int, world: int | None, disk_rng: random.Random | None = None,
              disk_share: float = DISK_SHARE, raise_rng: random.Random | None = None,
              raise_share: float = RAISE_SHARE, fp16: bool = True) -> tuple[Case, list[Fault], bool]:
    """A case, its faults, and whether the jobs after the first fault run on 1 rank (a 2-rank case only: the
    restart of a job that lost a node, on the nodes left). `disk_rng` (its own stream: the other draws stay the
    same without it) turns the first fault into a full disk in `disk_share` of the cases; `raise_rng` (another)
    turns it into an error raised on one rank in `raise_share` of the others. Without `fp16` (a machine whose
    DeepSpeed refuses it) a case drawn in fp16 runs in bf16, the other half precision, with the same faults."""
    case = draw(rng, vocab, world or rng.choice([1, 2, 2]))
    if case.precision == "auto":
        case.precision = "fp32"
    if case.precision == "fp16" and not fp16:
        case.precision = "bf16"
        case.engine = {k: v for k, v in case.engine.items() if k != "deepspeed.fp16"}
        if case.engine.get("deepspeed.data_types") == {"grad_accum_dtype": "fp16"}:
            case.engine["deepspeed.data_types"] = {"grad_accum_dtype": "bf16"}
    if case.model["attn_impl"] == "auto":
        case.model["attn_impl"] = "matmul"
    elastic = case.world > 1 and rng.random() < 0.3
    faults = [draw_fault(rng, case.world)]
    if rng.random() < 0.3:
        faults.append(draw_fault(rng, 1 if elastic else case.world))
    if disk_rng is not None and disk_rng.random() < disk_share:
        faults[0] = draw_disk_fault(disk_rng, faults[0])
    elif raise_rng is not None and raise_rng.random() < raise_share:
        faults[0] = draw_raise_fault(raise_rng, faults[0], case.world)
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


LIVE_JOBS: set[Job] = set()
"""The jobs started and not yet ended: what an interrupted sweep must end (each runs in a session of its own)."""


def end_live_jobs() -> None:
    for job in list(LIVE_JOBS):
        job.end()


class Job:
    """One launch of the case's training command. The job is every process of it: torchrun's workers outlive a
    torchrun that died (of SIGUSR1), see it gone, save and exit; a scheduler waits for them too."""

    def __init__(self, case: Case, corpus: Path, run_dir: Path, log: Path, port: int, raise_after_calls: int = 0
                 ) -> None:
        """raise_after_calls: arm raise-rank's hook (bench/sweep_hooks) in the job's processes."""
        self.case, self.log = case, log
        cmd = train_command(case.world, port) + ["--set", f"data.path={corpus}"] + sets(case, run_dir)
        env = child_env()
        if raise_after_calls:
            env = dict(env, PYTHONPATH=os.pathsep.join([str(SWEEP_HOOKS), env["PYTHONPATH"]]),
                       **{RAISE_AFTER_CALLS_ENV: str(raise_after_calls)})
        self.out = open(log, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # a Ctrl-C to the sweep stays the sweep's
        self.known: dict[int, Any] = {}
        self.tracked_at = 0.0
        LIVE_JOBS.add(self)

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

        LIVE_JOBS.discard(self)

        left = list({p.pid: p for p in [*self.known.values(), *self.processes()]}.values())
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=30)
        self.proc.wait()
        self.out.close()


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def mount_tmpfs(where: Path, size_bytes: int) -> str | None:
    """Mount a tmpfs of `size_bytes` on the folder `where` -> None, or why it could not be mounted."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    return None if mounted.returncode == 0 else (mounted.stderr.strip() or f"mount: exit {mounted.returncode}")


def fp16_supported() -> bool:
    """Whether DeepSpeed takes fp16 in the sweep's jobs (their environment: on a CPU, only one with oneDNN's fp16
    kernels), asked of DeepSpeed in such a process."""
    asked = subprocess.run([sys.executable, "-c", "from deepspeed.accelerator import get_accelerator; "
                            "print(bool(get_accelerator().is_fp16_supported()))"],
                           cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    return asked.stdout.strip().splitlines()[-1:] == ["True"]


def tmpfs_unavailable() -> str | None:
    """None where this process can mount a tmpfs (full-disk faults need one), else why not."""
    probe = Path(tempfile.mkdtemp(prefix="txl-tmpfs-probe."))
    why = mount_tmpfs(probe, 1 << 20)
    if why is None:
        subprocess.run(["umount", "-l", str(probe)], check=False)
    shutil.rmtree(probe, ignore_errors=True)
    return why


class RunDisk:
    """The faulted run's folder on a tmpfs of its own, which filler files fill up."""

    def __init__(self, where: Path, size_bytes: int) -> None:
        self.where = where
        why = mount_tmpfs(where, size_bytes)
        if why is not None:
            raise RuntimeError(f"cannot mount a tmpfs on {where}: {why}")
        self.fillers: list[Path] = []

    def free_bytes(self) -> int:
        st = os.statvfs(self.where)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int) -> None:
        """Leave about `leave` bytes free (the run writes meanwhile: a few tries)."""
        for _ in range(4):
            n = self.free_bytes() - leave
            if n < 4096:
                return
            path = self.where / f"filler{len(self.fillers)}"
            self.fillers.append(path)
            with open(path, "wb") as f:
                try:
                    os.posix_fallocate(f.fileno(), 0, n)
                except OSError:  # a write of the run took some of it first
                    f.truncate(0)

    def free(self) -> None:
        for path in self.fillers:
            path.unlink(missing_ok=True)

    def release(self) -> None:
        """Copy the run's folder off the tmpfs into a plain folder of the same name, then unmount it."""
        self.free()
        kept = self.where.with_name(self.where.name + ".kept")
        shutil.copytree(self.where, kept, symlinks=True)
        subprocess.run(["umount", "-l", str(self.where)], check=False)
        self.where.rmdir()
        kept.rename(self.where)


def fired(job: Job, fault: Fault, ckpt_dir: Path, startup_s: float) -> bool:
    """Whether the fault's moment has come (its delay not yet waited)."""
    if fault.trigger == "start-up":
        return time.time() - job.started >= fault.at * startup_s
    if fault.trigger == "step":
        return f" step {int(fault.at)}/{STEPS} " in job.text()
    tag = f"step_{int(fault.at):08d}"
    return (ckpt_dir / f".saving-{tag}").exists() or (ckpt_dir / tag).exists()


def newest_tag_bytes(*ckpt_dirs: Path) -> int:
    """The size of the newest complete checkpoint in the first of `ckpt_dirs` that has one."""
    from txl_dist import checkpoint

    for ckpt_dir in ckpt_dirs:
        if complete := checkpoint.inventory(ckpt_dir).complete:
            return tree_bytes(ckpt_dir / complete[-1])
    return 0


def inject(job: Job, fault: Fault, disk: RunDisk | None = None, tag_bytes: int = 0) -> str | None:
    """Send the fault's signal(s), or fill the disk; None once done, else why not (the ranks not started yet, the
    job over). `tag_bytes`: a checkpoint's size, for a fill that leaves a share of it free."""
    if job.proc.poll() is not None:
        return "the job had ended"
    if fault.kind == "fill-disk":
        disk.fill(fault.leave_bytes or int(fault.leave_of_tag * tag_bytes))
        return None
    pids = rank_pids(job.processes(), job.case.world)  # each process of the job known before any of them dies
    if fault.kind in ONE_RANK and fault.rank not in pids:
        return "ranks not started"
    if fault.kind == "raise-rank" and not catches(pids[fault.rank], signal.SIGUSR2):
        return "the rank's hook not installed yet"  # SIGUSR2's default action would end the process
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


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` now (Linux: SigCgt in /proc/<pid>/status); True where that
    cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    caught = re.search(r"^SigCgt:\s*([0-9a-fA-F]+)", status, flags=re.MULTILINE)
    return caught is None or bool(int(caught.group(1), 16) >> (signum - 1) & 1)


def last_step(text: str) -> int:
    """The last step whose progress line `text` holds, 0 if none."""
    return max((int(s) for s in re.findall(rf" step (\d+)/{STEPS} ", text)), default=0)


def faulted_run(job: Job, fault: Fault, ckpt_dir: Path, startup_s: float, disk: RunDisk | None = None,
                tag_bytes: int = 0) -> dict[str, Any]:
    """Watch the job, inject the fault at its moment, wait for the job's end -> what happened (for a full disk,
    "full_after_step": the last step the job had logged before it; "saved_before_full": the step of the newest
    checkpoint complete right after it, 0 if none: the first save after it is the one the disk cannot take, which
    a loaded machine may put later than the step the fault came after)."""
    from txl_dist import checkpoint

    due = None
    sent = None
    full_after = saved_before = None
    while job.alive():
        now = time.monotonic()
        if sent is None and due is None and fired(job, fault, ckpt_dir, startup_s):
            due = now + fault.delay_s
        if sent is None and due is not None and now >= due:
            logged = last_step(job.text()) if fault.kind == "fill-disk" else None
            if inject(job, fault, disk, tag_bytes) is None:
                sent, full_after = now, logged
                if fault.kind == "fill-disk":
                    complete = checkpoint.inventory(ckpt_dir).complete if ckpt_dir.is_dir() else []
                    saved_before = checkpoint.step_of(complete[-1]) if complete else 0
        if sent is not None and disk is not None and fault.freed_after_s is not None \
                and now - sent >= fault.freed_after_s:
            disk.free()
        if sent is not None and now - sent > END_WITHIN_S:
            break
        if sent is None and time.time() - job.started > RUN_TIMEOUT_S:
            break
        time.sleep(POLL_S if fault.trigger == "save" else 5 * POLL_S)
    status = job.proc.poll()
    ended_s = round(time.monotonic() - sent, 1) if sent is not None and not job.alive() else None
    job.end()
    if disk is not None:
        disk.free()  # the user frees space before restarting
    text = job.text()
    stopped = STOPPING.search(text)
    return {"fault": fault.text(), "landed": sent is not None, "exit": status, "ended_after_s": ended_s,
            "stopped_after_step": int(stopped.group(1)) if stopped else None, "full_after_step": full_after,
            "saved_before_full": saved_before,
            "last_line": next((ln for ln in reversed(text.splitlines()) if "error:" in ln), "")[-300:]}


def raise_problems(fault: Fault, outcome: dict[str, Any], text: str) -> list[str]:
    """What raise-rank's job did wrong with the error it raised (outcome["raised"] says whether it came: a job
    may end before the rank's N-th call): a job that failed must print it, and one that went on must say it
    went on despite it (a warning), not swallow it."""
    outcome["raised"] = ANNOUNCED in text
    if not outcome["raised"]:
        if outcome["exit"] not in (0, None):
            return [f"{fault.text()}: the job failed (exit status {outcome['exit']}) before the error was raised"]
        return []
    if RAISED not in text:
        how = "went on" if outcome["exit"] in (0, None) else f"ended (exit status {outcome['exit']})"
        return [f"{fault.text()}: the job {how} without saying what the rank raised"]
    return []


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


def check_metrics(expected: dict[tuple[int, str], list[float]], faulty: Path, exact_through: int = STEPS,
                  may_miss: frozenset[int] = frozenset()) -> list[str]:
    """The faulted run's journal against the straight run's values (journal_values) -> problems. Steps after
    `exact_through` (the step an elastic resume continued from: fewer ranks sum in another order) need only a
    finite loss; the steps in `may_miss` (logged on a full disk, not trained again) may be missing."""
    got = journal_values(faulty / "tracking" / "metrics.jsonl")
    problems = []
    loose = [s for s in range(exact_through + 1, STEPS + 1) if s not in may_miss and not all(
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
    missing = sorted(k for k in set(expected) - set(got) if k[0] not in may_miss)
    if missing:
        problems.append(f"{len(missing)} straight-run value(s) missing from the journal, first {missing[0]}")
    return problems


def check_mlflow(run_dir: Path, run_id: str | None, expected: dict[tuple[int, str], list[float]],
                 exact_through: int = STEPS, may_miss: frozenset[int] = frozenset()) -> list[str]:
    """The MLflow run: the first job's, FINISHED, its train/loss history the straight run's values (`expected`,
    up to `exact_through`, as in check_metrics), a value at every step but those in `may_miss`."""
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
    if wrong or not set(range(1, STEPS + 1)) - may_miss <= steps <= set(range(1, STEPS + 1)):
        problems.append(f"MLflow's train/loss: {len(wrong)} value(s) unlike the straight run's (first {wrong[:1]}), "
                        f"steps {sorted(steps)}")
    return problems


def run_case(case: Case, faults: list[Fault], folder: Path, corpus: Path, port: int, elastic: bool = False
             ) -> dict[str, Any]:
    """The straight run, the faulted jobs and the last restart (after the first fault on 1 rank where `elastic`),
    and the checks -> the case's record: "verdict" pass / refused / fail, "failed" what failed."""
    record: dict[str, Any] = {"case": asdict(case), "elastic": elastic, "faults": [], "failed": []}
    straight = folder / "straight"
    try:
        job = Job(case, corpus, straight, folder / "straight.log", port)
        status = job.wait(RUN_TIMEOUT_S)
    finally:
        end_live_jobs()
    if status == 2 and refusal(job.log):
        return record | {"verdict": "refused", "refusal": refusal(job.log)}
    if status != 0:
        return record | {"verdict": "fail", "failed": [f"straight run: exit status {status}"]}
    disk = None
    if any(f.kind == "fill-disk" for f in faults):  # room for keep + 1 tags, a universal copy, the stores
        disk = RunDisk(folder / "faulty", 3 * tree_bytes(straight) + (64 << 20))
    try:
        return _faulted_jobs(record, case, faults, folder, corpus, port, elastic, disk,
                             first_step_seconds(job.log, job.started))
    finally:
        end_live_jobs()  # an interrupted sweep's (a Ctrl-C, SIGTERM): before its tmpfs goes
        if disk is not None:
            disk.release()


def _faulted_jobs(record: dict[str, Any], case: Case, faults: list[Fault], folder: Path, corpus: Path, port: int,
                  elastic: bool, disk: RunDisk | None, startup_s: float) -> dict[str, Any]:
    from txl_dist import checkpoint

    straight, faulty = folder / "straight", folder / "faulty"
    ckpt_dir = faulty / "checkpoints"
    run_id, exact_through = None, STEPS
    may_miss: set[int] = set()
    full_after = None  # a full disk's job whose journal stopped: the last step it logged before the fill
    for i, fault in enumerate([*faults, None]):
        newest = (checkpoint.inventory(ckpt_dir).complete or [None])[-1]
        job_case = replace(case, world=1) if elastic and i > 0 else case
        job = Job(job_case, corpus, faulty, folder / f"job{i}.log", port + 1 + i,
                  fault.raise_after_calls if fault is not None else 0)
        if fault is None:
            status = job.wait(RUN_TIMEOUT_S)
            job.end()
            outcome = {"exit": status}
            if status != 0:
                record["failed"].append(f"the last restart: exit status {status}")
        else:
            tag_bytes = newest_tag_bytes(ckpt_dir, straight / "checkpoints") if fault.kind == "fill-disk" else 0
            outcome = faulted_run(job, fault, ckpt_dir, startup_s, disk, tag_bytes)
            record["faults"].append(outcome)
            if outcome["landed"] and outcome["ended_after_s"] is None:
                record["failed"].append(f"{fault.text()}: the job had not ended {END_WITHIN_S} s after it")
            if fault.kind in ("kill-rank", "stop-rank") and outcome["exit"] not in (0, None) \
                    and not names_the_rank(job.text(), fault.rank):
                record["failed"].append(f"{fault.text()}: the job ended (exit status {outcome['exit']}) without "
                                        f"a line naming rank {fault.rank}")
            if fault.kind == "raise-rank" and outcome["landed"]:
                record["failed"] += raise_problems(fault, outcome, job.text())
            if fault.kind == "fill-disk" and outcome["landed"] and outcome["exit"] not in (0, None) \
                    and not FULL_DISK.search(job.text()):
                record["failed"].append(f"{fault.text()}: the job ended (exit status {outcome['exit']}) without "
                                        "an error line saying the disk was full")
            if fault.kind in STOPS and (n := outcome["stopped_after_step"]) is not None \
                    and checkpoint.tag_for(n) not in checkpoint.inventory(ckpt_dir).complete:
                record["failed"].append(f"{fault.text()}: stopped after step {n} without its checkpoint")
        text = job.text()
        resumed = RESUMED.search(text)
        trained = re.search(rf" step \d+/{STEPS} ", text) is not None
        if full_after is not None:  # what the full disk's job logged after the fill counts if trained again here
            may_miss |= set(range(full_after + 1, (int(resumed.group(2)) if resumed else 0) + 1))
        # Only a journal that said it stopped may lack values: the restart sends the store what the journal has.
        full_after = outcome.get("full_after_step") if JOURNAL_STOPPED in text else None
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
    record["may_miss"] = sorted(may_miss)
    expected = journal_values(straight / "tracking" / "metrics.jsonl")
    missable = frozenset(may_miss)
    record["failed"] += (check_folder(faulty) + check_metrics(expected, faulty, exact_through, missable)
                         + check_mlflow(faulty, run_id, expected, exact_through, missable))
    replay = subprocess.run([sys.executable, "-m", "txl_dist.tracking", "replay", str(faulty)], cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if replay.returncode != 0:
        record["failed"].append(f"replay: exit status {replay.returncode}: {replay.stderr.strip()[-300:]}")
    return record | {"verdict": "fail" if record["failed"] else "pass"}


def main(argv: list[str] | None = None) -> int:
    parser = training_sweep_parser("bench.fault_sweep", __doc__)
    parser.add_argument("--disk-share", type=float, default=DISK_SHARE,
                        help=f"the share of cases whose first fault is a full disk (default {DISK_SHARE}; 0: none)")
    parser.add_argument("--raise-share", type=float, default=RAISE_SHARE,
                        help=f"of the others, the share whose first fault is an error raised on one rank (default "
                             f"{RAISE_SHARE}; 0: none)")
    args, corpus, vocab = parse_training_sweep(parser, argv)
    for name in ("disk_share", "raise_share"):
        if not 0 <= getattr(args, name) <= 1:
            parser.error(f"--{name.replace('_', '-')} must lie in [0, 1], e.g. --{name.replace('_', '-')} 0.25")
    disk = args.disk_share > 0
    if disk and (why := tmpfs_unavailable()):
        print(f"no full-disk faults: cannot mount a tmpfs here ({why})")
        disk = False

    fp16 = fp16_supported()
    if not fp16:
        print("cases drawn in fp16 run in bf16: DeepSpeed refuses fp16 on this machine")

    def run_one(rng: random.Random, i: int, folder: Path) -> tuple[dict[str, Any], str]:
        disk_rng = random.Random(f"disk {args.seed} {i}") if disk else None
        raise_rng = random.Random(f"raise {args.seed} {i}") if args.raise_share > 0 else None
        case, faults, elastic = draw_case(rng, vocab, args.world, disk_rng, args.disk_share, raise_rng,
                                          args.raise_share, fp16)
        port = 29300 + (args.seed * 97 + i * 4) % 360
        text = f"{case.text()}; " + ", then ".join(f.text() for f in faults)
        text += ", restarted on 1 rank" if elastic else ""
        return run_case(case, faults, folder, corpus, port, elastic), text

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the case's jobs ended, its tmpfs unmounted
    try:
        return sweep(args, run_one)
    except KeyboardInterrupt:
        print("interrupted: the case's jobs ended, its folder kept", flush=True)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
