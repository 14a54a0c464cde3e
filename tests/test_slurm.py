"""The batch scripts of launch/slurm/ on a real Slurm cluster: Slurm's own daemons (slurmctld, two slurmd as
node1 and node2 on 127.0.0.1, munge), started for this module by scripts/slurm_cluster.sh in a folder and on
ports of its own, and stopped at the end. Jobs are submitted with sbatch exactly as docs/slurm.md writes them
(plus --output, so that job logs land in the test's folder), with configs/tiny.json on CPU, one thread per
rank.

- a 2-node training job completes: both nodes ran a rank, `latest` exists, one MLflow run holds every step;
- USR1 mid-run (scancel --signal=USR1): a checkpoint, a requeue (Restarts=1), a completed job whose per-step
  train/loss equals an uninterrupted 2-node job's bitwise, in one MLflow run;
- then a rollback (--resume to that tag) stopped by a USR1 to the batch shell before its step started: the
  ranks save after their first step, the job requeues (its save is older than the newest tag it started
  with, and new), and a USR1 after the restart's step ended does not end the job;
- a plain scancel mid-run (SIGTERM, as the time limit without a warning): the ranks save, the job ends CANCELLED,
  not requeued, and the same command continues bitwise in the same MLflow run;
- preemption mid-run by a job of the higher-tier partition `urgent` (PreemptMode=REQUEUE): Slurm requeues the
  job and then SIGTERMs it, the ranks save, the script requeues nothing itself and says Slurm did, and the
  restart resumes bitwise in the same MLflow run;
- the same preemption of a job in partition `graceful` (PreemptMode=CANCEL, GraceTime): the ranks save at the
  grace time's SIGTERM and the script requeues the job itself; the restart resumes bitwise;
- a job stopped at train.exit_step is not requeued, and its 2-node checkpoint continues on 1 node;
- eval.sbatch evaluates a checkpoint on 2 nodes; refused input fails the job with exit status 2, and a killed
  rank fails it (the other rank names it) well within train.collective_timeout_s; neither is requeued;
- what the batch shell refuses (a configuration this world size cannot run, a TXL_REPO that is no repository,
  a Python without torch) ends the job in one line, exit status 2, no srun step; a configuration that stops
  before the newest checkpoint says so; the scripts find a repository whose path holds a space;
- prep.sh (train-tokenizer and `prepare --plan` side by side, an array of 2 `prepare --shard` that depends on
  both and follows the plan, a dependent finalize) gives the token streams of a single `prepare`; a
  submission the cluster refuses stops it (exit 2, nothing submitted), one that fails later cancels the
  jobs submitted before it (exit 1).

Skipped, with the script's one-line reason, only where the cluster cannot be had (not root, or Slurm missing
and no apt-get to install it). About 8 minutes on a busy 2-core machine (5 on an idle one), about 45 s of which
is the requeue delay (AuthInfo cred_expire, shortened to 10 s in the test cluster's slurm.conf; five requeues).
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dist_helpers import REPO, launcher_env, learnable_stream, write_corpus
from txl_dist.distributed import slurm_port

pytestmark = pytest.mark.slow

CLUSTER_SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
UNAVAILABLE = 3  # scripts/slurm_cluster.sh: the cluster cannot be had on this machine
VOCAB = 4096  # configs/tiny.json has cutoffs [1000, 2000]
MAX_STEPS = 80
EXIT_STEP = 24
SIGNAL_AT = 10  # USR1 once this step is printed
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


# ----------------------------------------------------------------------------------------------------
# The cluster


def _free_port_base() -> int:
    """A port p with p, p+1, p+2 free on every interface (slurmctld, slurmd node1, slurmd node2)."""
    for _ in range(200):
        base = random.randrange(17000, 19900)
        try:
            for p in range(base, base + 3):
                with socket.socket() as s:
                    s.bind(("", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no three consecutive free ports in 17000-19900")


class Cluster:
    """The running test cluster: sbatch/scontrol/scancel against it, jobs and their output files."""

    def __init__(self, folder: Path, logs: Path):
        self.folder, self.logs = folder, logs
        self.env = launcher_env() | {"SLURM_CONF": str(folder / "slurm.conf"), "OMP_NUM_THREADS": "1",
                                     "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
        if Path(sys.executable).resolve() != (REPO / ".venv" / "bin" / "python").resolve():
            self.env["TXL_PYTHON"] = sys.executable  # the scripts' default is the repository's .venv

    def run(self, *cmd: str, check: bool = True, cwd: Path = REPO, env: dict | None = None) -> str:
        p = subprocess.run(cmd, check=False, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=120)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def sbatch(self, *args: str, env: dict | None = None) -> int:
        """`sbatch --parsable --output=<logs>/%x-%j.out ARGS` in the repository; the job id."""
        out = self.run("sbatch", "--parsable", f"--output={self.logs}/%x-%j.out", *args, env=env)
        return int(out.strip().split(";")[0])

    def records(self, job_id: int) -> list[dict[str, str]]:
        """`scontrol show job` as dicts (JobState, Restarts, ExitCode, NodeList, ...): one per array task."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return [dict(tok.split("=", 1) for tok in line.split() if "=" in tok) for line in out.splitlines() if line]

    def job(self, job_id: int) -> dict[str, str]:
        (record,) = self.records(job_id)
        return record

    def output(self, job_id: int, name: str = "txl-train") -> str:
        path = self.logs / f"{name}-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, job_id: int, timeout: float = 300, name: str = "txl-train") -> dict[str, str]:
        """Wait for the job's final state (a requeued job passes through PENDING again); its record."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info["JobState"] in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                raise AssertionError(f"job {job_id} not done in {timeout:.0f} s ({info['JobState']}, "
                                     f"Reason={info.get('Reason')}):\n{self.output(job_id, name)[-5000:]}")
            time.sleep(0.5)

    def wait_for_text(self, job_id: int, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output(job_id):
            info = self.job(job_id)
            if info["JobState"] in FINAL_STATES or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} never printed {text!r} ({info['JobState']}):\n"
                                     f"{self.output(job_id)[-5000:]}")
            time.sleep(0.2)

    def signal_after_step(self, job_id: int, timeout: float = 300) -> None:
        """`scancel --batch --signal=USR1` once the job's training step (JOB.0) has run and ended, while its
        batch shell decides what comes next (a few seconds: run_state.py, then done or requeue)."""
        deadline, seen = time.monotonic() + timeout, False
        while time.monotonic() < deadline:
            steps = self.run("squeue", "-h", "-s", "-j", str(job_id), "-o", "%i", check=False).split()
            if f"{job_id}.0" in steps:
                seen = True
            elif seen:
                self.run("scancel", "--batch", "--signal=USR1", str(job_id))
                return
            elif self.job(job_id)["JobState"] in FINAL_STATES:
                break
            time.sleep(0.2)
        raise AssertionError(f"job {job_id}: no training step seen to end:\n{self.output(job_id)[-5000:]}")

    def slurmd_log(self, node: str) -> str:
        return (self.folder / "log" / f"slurmd-{node}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A short path of its own: munged's socket lives in it (a Unix socket path has at most 107 bytes).
    folder = Path(tempfile.mkdtemp(prefix="txl-slurm-"))
    env = dict(os.environ, TXL_SLURM_DIR=str(folder), TXL_SLURM_PORT=str(_free_port_base()),
               TXL_SLURM_FIRST_JOB_ID=str(random.randrange(1000, 9000)))
    try:
        start = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], check=False, env=env, capture_output=True,
                               text=True, timeout=900)
        if start.returncode == UNAVAILABLE:
            pytest.skip(start.stdout.strip().splitlines()[-1])
        assert start.returncode == 0, f"scripts/slurm_cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        yield Cluster(folder, tmp_path_factory.mktemp("slurm-logs"))
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], check=False, env=env, capture_output=True, text=True,
                       timeout=300)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def spaced_repo(tmp_path_factory) -> Path:
    """The repository under a path with a space in it (a link to it): the scripts find it from the path they
    were submitted by, which scontrol prints joined to their arguments by spaces."""
    link = tmp_path_factory.mktemp("slurm-spaced") / "my repo"
    link.symlink_to(REPO, target_is_directory=True)
    return link


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-corpus") / "corpus"
    return write_corpus(root, {"train": learnable_stream(8 * 600, VOCAB, 0), "valid": learnable_stream(400, VOCAB, 1),
                               "test": learnable_stream(400, VOCAB, 2)}, vocab_size=VOCAB, layout=(2, 8))


def train_args(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    """launch/slurm/train.sbatch's arguments: configs/tiny.json on the test corpus, a short run."""
    # fp32 and the attention path pinned: the test compares separate jobs bitwise, and "auto" is decided per
    # run by measurement (under load two runs can measure different winners).
    sets = {"data.path": corpus, "run.dir": run_dir, "train.max_steps": MAX_STEPS, "train.log_interval": 1,
            "eval.interval": 0, "tracking.system_metrics": "false", "train.precision": "fp32",
            "model.attn_impl": "matmul"}
    args = ["launch/slurm/train.sbatch", "--config", "configs/tiny.json"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args + list(extra)


def mlflow_run(run_dir: Path):
    """The one MLflow run of a run folder's default store, and its client."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def losses(client, run) -> dict[int, float]:
    """train/loss by step; every step logged once."""
    history = client.get_metric_history(run.info.run_id, "train/loss")
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)), sorted(steps)
    return {m.step: m.value for m in history}


def bits(values: dict[int, float]) -> dict[int, str]:
    return {k: float(v).hex() for k, v in values.items()}


# ----------------------------------------------------------------------------------------------------
# Training


@pytest.fixture(scope="module")
def straight(cluster, corpus, tmp_path_factory):
    """An uninterrupted 2-node job (rank logs on), run to MAX_STEPS: its job record, output and losses."""
    run_dir = tmp_path_factory.mktemp("slurm-straight") / "run"
    env = cluster.env | {"TXL_RANK_LOGS": "1"}
    start = time.monotonic()
    job_id = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(corpus, run_dir), env=env)
    info = cluster.wait(job_id)
    client, run = mlflow_run(run_dir)
    return {"job": job_id, "info": info, "run_dir": run_dir, "output": cluster.output(job_id),
            "losses": losses(client, run), "run": run, "client": client, "seconds": time.monotonic() - start}


def test_a_two_node_job_completes_with_every_step_in_one_mlflow_run(cluster, straight):
    info, out, run_dir, job = straight["info"], straight["output"], straight["run_dir"], straight["job"]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-5000:]
    assert info["Restarts"] == "0" and info["NumNodes"] == "2", info
    # The script says where and how first: node list, world size, the interpreter, checkpoint folder.
    head = out.splitlines()[:4]
    assert re.search(rf"job {job} \(txl-train\) restart 0 on 2 node\(s\): node1 node2$", head[0]), head
    assert "world size 2 (1 rank(s) per node, no GPU, OMP_NUM_THREADS=1) | rendezvous 127.0.0.1:" \
           f"{slurm_port(job)}" in head[1], head
    assert f"| repository {REPO}" in head[2], head
    assert f"checkpoints {run_dir / 'checkpoints'} (none yet: starting a new run to step {MAX_STEPS})" in head[3], head
    assert "world size 2 (slurm, 1 thread(s) per rank)" in out
    # One task of the training step ran on each node (each slurmd launched one).
    for node in ("node1", "node2"):
        assert cluster.slurmd_log(node).count(f"launch task StepId={job}.0 ") == 1, node
    ckpt = run_dir / "checkpoints"
    tag = f"step_{MAX_STEPS:08d}"
    assert (ckpt / "latest").read_text().strip() == tag
    assert sorted(p.name for p in (ckpt / tag / "txl_state").iterdir()) == \
        ["rank-00000.pt", "rank-00001.pt", "run.json"]
    assert f"txl-slurm: done: {tag} (step {MAX_STEPS} of {MAX_STEPS})" in out
    # Rank logs on request: rank 1 wrote its own file, rank 0 the job's output.
    rank1 = (run_dir / "logs" / f"slurm-{job}-rank-00001.out").read_text()
    assert f"[rank 1] step {MAX_STEPS}/{MAX_STEPS} | loss" in rank1
    assert f"[rank 0] step {MAX_STEPS}/{MAX_STEPS} | loss" in out and "[rank 1]" not in out
    # One MLflow run, finished, every step once.
    run = straight["run"]
    assert run.info.status == "FINISHED"
    assert sorted(straight["losses"]) == list(range(1, MAX_STEPS + 1))
    assert [m.step for m in straight["client"].get_metric_history(run.info.run_id, "test/loss")] == [MAX_STEPS]


def test_usr1_mid_run_saves_requeues_and_resumes_bitwise_in_the_same_mlflow_run(cluster, corpus, straight, tmp_path):
    run_dir = tmp_path / "run"
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(corpus, run_dir))
    cluster.wait_for_text(job, f"step {SIGNAL_AT}/{MAX_STEPS} | loss")
    cluster.run("scancel", "--signal=USR1", str(job))
    info = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-5000:]
    assert info["Restarts"] == "1", info
    stopped = [int(m) for m in re.findall(r"stopping after step (\d+) \(SIGUSR1\): saving a checkpoint", out)]
    assert stopped and len(set(stopped)) == 1, out[-5000:]  # every rank agreed on the step
    step = stopped[0]
    assert SIGNAL_AT <= step < MAX_STEPS
    assert f"stopped at step {step} of {MAX_STEPS} after a save; requeueing job {job} (restart 1)" in out
    # --open-mode=append: the requeued run continues the same output file, and resumes from the saved step.
    assert f"job {job} (txl-train) restart 1 on 2 node(s)" in out
    assert f"newest step_{step:08d}: resuming at step {step} of {MAX_STEPS}" in out
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:08d}'} at step {step} (same world size)" in out
    # No error line, but Slurm's own note that it ended the first run for the requeue.
    assert [line for line in out.splitlines() if "error:" in line and "DUE TO JOB REQUEUE" not in line] == []
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{MAX_STEPS:08d}"
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert bits(losses(client, run)) == bits(straight["losses"])

    # A rollback to the tag USR1 saved. A USR1 to the batch shell before its step starts is kept and handed to
    # the ranks (they save after their first step), and the job requeues: its save is older than the newest tag
    # it started with (moved to superseded/) but new. A USR1 after the restart's step ended changes nothing.
    stop_at = step + 3
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(
        corpus, run_dir, "--set", f"train.exit_step={stop_at}", "--resume",
        str(run_dir / "checkpoints" / f"step_{step:08d}")))
    cluster.wait_for_text(job, f"job {job} (txl-train) restart 0 on")
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    cluster.wait_for_text(job, f"job {job} (txl-train) restart 1 on", timeout=400)
    cluster.signal_after_step(job)
    info = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-5000:]
    assert f"(newest step_{MAX_STEPS:08d}; --resume step_{step:08d}: rolling back, newer tags move to " \
           f"checkpoints/superseded/; resuming at step {step} of {stop_at})" in out
    assert "the batch shell got SIGUSR1 before the training step started" in out
    assert f"stopping after step {step + 1} (SIGUSR1): saving a checkpoint" in out
    assert f"stopped at step {step + 1} of {stop_at} after a save; requeueing job {job} (restart 1)" in out
    assert f"(newest step_{step + 1:08d}: resuming at step {step + 1} of {stop_at})" in out
    assert "the batch shell got SIGUSR1 after the training step ended: nothing left to stop" in out
    assert f"txl-slurm: done: step_{stop_at:08d} (step {stop_at} of {stop_at})" in out


def test_usr1_in_the_last_step_requeues_and_the_restart_runs_the_final_evaluation(cluster, corpus, tmp_path):
    # The stop saves the last step before its final evaluation (evals_owed): the job must not count that as done.
    # A run of one step: the first step the ranks take is the last.
    run_dir, last = tmp_path / "run", 1
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1",
                         *train_args(corpus, run_dir, "--set", f"train.max_steps={last}"))
    cluster.wait_for_text(job, f"job {job} (txl-train) restart 0 on")
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))  # the ranks stop after their first step
    info = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-5000:]
    tag = f"step_{last:08d}"
    assert f"stopping after step {last} (SIGUSR1): saving a checkpoint; its evaluation is left to the next job" in out
    assert f"txl-slurm: {tag} (the last step) was saved before its final evaluation; the restart runs it" in out
    assert "first the evaluation of its step, which a stop request left owed" in out  # the restart's header
    assert f"step {last}: running the evaluation its checkpoint owes" in out
    assert f"txl-slurm: done: {tag} (step {last} of {last})" in out
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "test/loss")] == [last]


def test_scancel_mid_run_saves_and_the_same_command_resumes_bitwise_in_the_same_mlflow_run(cluster, corpus, straight,
                                                                                           tmp_path):
    """A plain scancel (what the time limit without a warning does too: SIGTERM to the ranks, srun and the batch
    shell, SIGKILL KillWait later): the ranks save at the next step boundary (srun's `forcing job termination`
    does not reach them), the job ends CANCELLED, not requeued, and the same command continues from that save."""
    run_dir = tmp_path / "run"
    submit = ("--nodes=2", "--ntasks-per-node=1", *train_args(corpus, run_dir))
    job = cluster.sbatch(*submit)
    cluster.wait_for_text(job, f"step {SIGNAL_AT}/{MAX_STEPS} | loss")
    cluster.run("scancel", str(job))
    info = cluster.wait(job)
    out = cluster.output(job)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), out[-5000:]
    stopped = {int(m) for m in re.findall(r"stopping after step (\d+) \(SIGTERM\): saving a checkpoint", out)}
    assert len(stopped) == 1, out[-5000:]
    (step,) = stopped
    assert SIGNAL_AT <= step < MAX_STEPS
    tag = f"step_{step:08d}"
    assert f"txl-slurm: stopped at step {step} of {MAX_STEPS} by SIGTERM (scancel, the time limit or preemption); " \
           f"newest checkpoint {tag}; not requeueing: submit the same command to continue" in out, out[-5000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == tag
    assert mlflow_run(run_dir)[1].info.status == "KILLED"
    again = cluster.sbatch(*submit)
    info = cluster.wait(again)
    out = cluster.output(again)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-5000:]
    assert f"resumed from {run_dir / 'checkpoints' / tag} at step {step} (same world size)" in out
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert bits(losses(client, run)) == bits(straight["losses"])  # every step once, as if never stopped


def test_preemption_requeues_once_and_the_restart_resumes_bitwise_in_the_same_mlflow_run(cluster, corpus, straight,
                                                                                          tmp_path):
    """A job of the higher-tier partition `urgent` preempts a training job (PreemptMode=REQUEUE, no GraceTime):
    Slurm requeues it first and then signals it as scancel does (SIGTERM to the ranks, srun and the batch shell);
    the ranks save, the script says Slurm has requeued the job and does not requeue it again, and the restart
    resumes from that save, bitwise, in the same MLflow run."""
    run_dir = tmp_path / "run"
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(corpus, run_dir))
    # The ranks catch SIGTERM from their first line on, the batch shell from its step's start: preempt as soon
    # as training runs (step 10 may already be close to the last step by the time Slurm preempts).
    cluster.wait_for_text(job, f"training steps 1..{MAX_STEPS} of {MAX_STEPS}")
    urgent = cluster.sbatch("--partition=urgent", "--nodes=2", "--job-name=urgent", "--wrap=true")
    info = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-5000:]
    ctld = (cluster.folder / "log" / "slurmctld.log").read_text(errors="replace")
    assert f"preempted JobId={job} has been requeued to reclaim resources for JobId={urgent}" in ctld
    high = cluster.wait(urgent, name="urgent")
    assert high["JobState"] == "COMPLETED" and high["StartTime"] <= info["StartTime"], (high, info)
    stopped = {int(m) for m in re.findall(r"stopping after step (\d+) \(SIGTERM\): saving a checkpoint", out)}
    assert len(stopped) == 1, out[-5000:]
    (step,) = stopped
    assert 1 <= step < MAX_STEPS
    tag = f"step_{step:08d}"
    assert "txl-slurm: the batch shell got SIGTERM (time limit, scancel or preemption): waiting for the ranks" in out
    assert f"txl-slurm: stopped at step {step} of {MAX_STEPS} by SIGTERM; Slurm has requeued this job itself " \
           f"(preemption, or scontrol requeue): restart 1 resumes from {tag} once it starts again; nothing to " \
           "submit" in out, out[-5000:]
    assert "requeueing job" not in out and "not requeueing" not in out  # the script requeued nothing itself
    assert f"job {job} (txl-train) restart 1 on 2 node(s)" in out
    assert f"resumed from {run_dir / 'checkpoints' / tag} at step {step} (same world size)" in out
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{MAX_STEPS:08d}"
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert bits(losses(client, run)) == bits(straight["losses"])


def test_preemption_that_cancels_after_a_grace_time_becomes_a_requeue(cluster, corpus, straight, tmp_path):
    """A job of partition `graceful` (PreemptMode=CANCEL, GraceTime=60) preempted by `urgent`: Slurm signals the
    ranks at the start of the grace time and would cancel the job at its end. The ranks save, the script sees
    the save and requeues the job itself, and the restart resumes from it, bitwise, in the same MLflow run;
    nothing is lost and nothing needs resubmitting."""
    run_dir = tmp_path / "run"
    job = cluster.sbatch("--partition=graceful", "--nodes=2", "--ntasks-per-node=1", *train_args(corpus, run_dir))
    cluster.wait_for_text(job, f"training steps 1..{MAX_STEPS} of {MAX_STEPS}")
    cluster.sbatch("--partition=urgent", "--nodes=2", "--job-name=urgent", "--wrap=true")
    info = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-5000:]
    stopped = {int(m) for m in re.findall(r"stopping after step (\d+) \(SIGTERM\): saving a checkpoint", out)}
    assert len(stopped) == 1, out[-5000:]
    (step,) = stopped
    tag = f"step_{step:08d}"
    assert f"txl-slurm: stopped at step {step} of {MAX_STEPS} after a save; requeueing job {job} (restart 1)" in out, \
        out[-5000:]
    assert "batch shell got SIGTERM" not in out  # a grace time signals the ranks only
    assert f"resumed from {run_dir / 'checkpoints' / tag} at step {step} (same world size)" in out
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert bits(losses(client, run)) == bits(straight["losses"])


def test_exit_step_ends_without_requeue_and_the_two_node_checkpoint_continues_on_one_node(cluster, corpus, straight,
                                                                                           tmp_path):
    run_dir = tmp_path / "run"
    first = cluster.sbatch("--nodes=2", "--ntasks-per-node=1",
                           *train_args(corpus, run_dir, "--set", f"train.exit_step={EXIT_STEP}"))
    info = cluster.wait(first)
    out = cluster.output(first)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), out[-5000:]
    assert f"txl-slurm: done: step_{EXIT_STEP:08d} (step {EXIT_STEP} of {EXIT_STEP})" in out
    # The same command without the planned stop, on one node: an elastic resume (2 -> 1 ranks).
    second = cluster.sbatch("--nodes=1", "--ntasks-per-node=1", *train_args(corpus, run_dir))
    info = cluster.wait(second)
    out = cluster.output(second)
    assert (info["JobState"], info["ExitCode"], info["NumNodes"]) == ("COMPLETED", "0:0", "1"), out[-5000:]
    assert "world size 1 (1 rank(s) per node" in out
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{EXIT_STEP:08d}'} at step {EXIT_STEP} " \
           "(elastic: 2 -> 1 ranks)" in out
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    got = losses(client, run)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    # Up to the planned stop: the uninterrupted 2-node job's losses; after it the loss goes on, finite.
    assert bits({s: v for s, v in got.items() if s <= EXIT_STEP}) == \
           bits({s: v for s, v in straight["losses"].items() if s <= EXIT_STEP})
    assert all(np.isfinite(v) for v in got.values())


def test_eval_sbatch_evaluates_a_checkpoint_on_two_nodes(cluster, straight, spaced_repo, tmp_path):
    import json

    result_file = tmp_path / "result.json"
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", str(spaced_repo / "launch" / "slurm" / "eval.sbatch"),
                         "--checkpoint", str(straight["run_dir"]), "--split", "test", "--output", str(result_file))
    info = cluster.wait(job, name="txl-eval")
    out = cluster.output(job, "txl-eval")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-5000:]
    assert f"| repository {spaced_repo}\n" in out  # submitted by a path with a space in it
    assert "world size 2 (1 rank(s) per node" in out
    result = json.loads(result_file.read_text())
    assert (result["world_size"], result["step"], result["split"]) == (2, MAX_STEPS, "test")
    (logged,) = straight["client"].get_metric_history(straight["run"].info.run_id, "test/loss")
    assert result["loss"] == pytest.approx(logged.value, rel=1e-9)  # the end-of-training evaluation, same weights


def _rank_process(job_id: int, rank: int):
    """The training process of `rank` of a job (both test nodes are this machine)."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            if "launch/train.py" in " ".join(p.info["cmdline"] or []):
                env = p.environ()
                if env.get("SLURM_JOB_ID") == str(job_id) and env.get("SLURM_PROCID") == str(rank):
                    return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def test_a_hung_rank_is_killed_by_srun_after_the_others_left(cluster, corpus, tmp_path):
    """A rank that cannot end (stopped; on a cluster: stuck in the kernel or a driver) would hold the nodes
    until the time limit: srun kills it TXL_END_WAIT_S after the first rank ended."""
    timeout_s, end_wait_s = 15, 20
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(
        corpus, tmp_path / "run", "--set", f"train.collective_timeout_s={timeout_s}", "--set", "train.max_steps=5000"),
        env=cluster.env | {"TXL_END_WAIT_S": str(end_wait_s)})
    cluster.wait_for_text(job, f"step {SIGNAL_AT}/5000 | loss")
    victim = _rank_process(job, 1)
    assert victim is not None, cluster.output(job)[-3000:]
    victim.suspend()
    stopped_at = time.monotonic()
    try:
        info = cluster.wait(job, timeout=timeout_s + end_wait_s + 120)
    finally:
        with contextlib.suppress(Exception):  # psutil.NoSuchProcess: srun has killed it
            victim.kill()
    took = time.monotonic() - stopped_at
    out = cluster.output(job)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", out[-5000:]
    assert took < timeout_s + end_wait_s + 60, took
    errors = [line for line in out.splitlines() if "error: rank 1" in line]
    assert errors and "stopped responding" in errors[0], out[-5000:]
    assert "not requeueing" in out


def test_a_lost_rank_ends_the_job_within_the_collective_timeout_without_requeue(cluster, corpus, tmp_path):
    timeout_s = 15
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(
        corpus, tmp_path / "run", "--set", f"train.collective_timeout_s={timeout_s}", "--set", "train.max_steps=5000"))
    cluster.wait_for_text(job, f"step {SIGNAL_AT}/5000 | loss")
    victim = _rank_process(job, 1)
    assert victim is not None, cluster.output(job)[-3000:]
    victim.kill()  # as if its node had gone: no save, no goodbye
    killed_at = time.monotonic()
    info = cluster.wait(job, timeout=timeout_s + 120)
    took = time.monotonic() - killed_at
    out = cluster.output(job)
    # srun's status is the killed rank's (128 + SIGKILL); the survivor said which rank it lost.
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "137:0", "0"), out[-5000:]
    assert took < timeout_s + 45, took
    errors = [line for line in out.splitlines() if "error: rank 1" in line]
    assert errors and "lost" in errors[0], out[-5000:]
    assert "srun: error: node2: task 1: Killed" in out
    assert "txl-slurm: the training step ended by signal 9: a rank (or srun itself) was killed" in out
    assert "not requeueing" in out


def test_a_wrong_rendezvous_address_ends_the_job_with_one_line_per_rank_and_no_requeue(cluster, corpus, tmp_path):
    """TXL_MASTER_ADDR naming no host: rank 1 says it could not reach the store there, rank 0 that rank 1 did
    not join; no C++ stack trace from the store client, and no requeue."""
    timeout_s = 6
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", *train_args(
        corpus, tmp_path / "run", "--set", f"train.collective_timeout_s={timeout_s}"),
        env=cluster.env | {"TXL_MASTER_ADDR": "no-such-host.invalid"})
    info = cluster.wait(job, timeout=timeout_s + 180)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "1:0", "0"), out[-5000:]
    assert re.search(r"error: rank 1 did not join the job within 8 s: 1 of 2 joined the rendezvous store at "
                     r"no-such-host\.invalid:\d+ \(MASTER_ADDR:MASTER_PORT\), hosted by rank 0; ", out), out[-5000:]
    assert re.search(r"error: rank 1 \(host [^)]+\) could not reach the rendezvous store at no-such-host\.invalid:"
                     r"\d+ \(MASTER_ADDR:MASTER_PORT\), hosted by rank 0, within 8 s: ", out), out[-5000:]
    assert "frame #" not in out and "Traceback" not in out
    assert "not requeueing" in out


def test_refused_input_fails_the_job_with_status_2_and_no_requeue(cluster, corpus, tmp_path):
    job = cluster.sbatch("--nodes=2", "--ntasks-per-node=1",
                         *train_args(corpus, tmp_path / "run", "--set", "train.max_stepz=3"))
    info = cluster.wait(job)
    out = cluster.output(job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), out
    assert "error: unknown key 'train.max_stepz' (did you mean 'max_steps'?)" in out
    assert not (tmp_path / "run").exists()


def test_what_the_batch_shell_refuses_ends_the_job_in_one_line_before_srun(cluster, corpus, straight, spaced_repo,
                                                                            tmp_path):
    script = str(spaced_repo / "launch" / "slurm" / "train.sbatch")
    # Refused for this world size only (3 eval streams on 2 ranks); submitted by a path with a space in it.
    for_world = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", script,
                               *train_args(corpus, tmp_path / "r1", "--set", "eval.n_streams=3")[1:])
    no_repo = cluster.sbatch(*train_args(corpus, tmp_path / "r2"), env=cluster.env | {"TXL_REPO": str(tmp_path / "no")})
    no_torch = cluster.sbatch(*train_args(corpus, tmp_path / "r3"), env=cluster.env | {"TXL_PYTHON": "/usr/bin/python3"})
    # A configuration that stops before the newest tag: nothing to train, and the job says so.
    shutil.copytree(straight["run_dir"], tmp_path / "r4")
    past = cluster.sbatch(*train_args(corpus, tmp_path / "r4", "--set", "train.max_steps=40"))

    def refused(job: int) -> list[str]:
        info, out = cluster.wait(job), cluster.output(job)
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), out
        for node in ("node1", "node2"):
            assert f"launch task StepId={job}.0 " not in cluster.slurmd_log(node), out  # no srun step
        return [line for line in out.splitlines() if "error" in line]

    assert refused(for_world) == ["error: eval.n_streams: 3 streams cannot be split over 2 ranks; use a multiple of 2 "
                                  "(or a world size that divides 3)"]
    assert f"| repository {spaced_repo}\n" in cluster.output(for_world)
    assert not (tmp_path / "r1").exists()
    assert refused(no_repo) == [f"txl-slurm: error: TXL_REPO={tmp_path / 'no'} is not a txl-dist repository (no "
                                "launch/slurm/common.sh in it); correct or unset it"]
    if subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode != 0:
        (line,) = refused(no_torch)
        assert line.startswith("txl-slurm: error: python /usr/bin/python3 has no torch") and \
               "set TXL_PYTHON" in line and "scripts/bootstrap.sh" in line, line
    info, out = cluster.wait(past), cluster.output(past)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-5000:]
    tag = f"step_{MAX_STEPS:08d}"
    assert f"(newest {tag}: at step {MAX_STEPS}, at or past step 40 where this configuration stops: nothing to " \
           "train)" in out
    assert f"txl-slurm: done: {tag} is at step {MAX_STEPS}, past step 40 where this configuration stops" in out


# ----------------------------------------------------------------------------------------------------
# Data preparation


def _write_texts(root: Path) -> Path:
    """Plain-text documents (one per file) of made-up words: train 12, valid 2, test 2."""
    rng = random.Random(0)
    syllables = ["ka", "to", "ri", "ne", "mo", "sa", "lu", "pe", "di", "fo", "ga", "hi", "ju", "be", "zo", "wa"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    for split, n in (("train", 12), ("valid", 2), ("test", 2)):
        (root / split).mkdir(parents=True)
        for i in range(n):
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 14))).capitalize() + "."
                     for _ in range(rng.randint(40, 120))]
            (root / split / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    return root


def _tokens(corpus: Path, split: str) -> np.ndarray:
    from txl_dist.data.format import TokenReader, read_manifest

    manifest = read_manifest(corpus)
    with TokenReader(corpus, manifest, split) as reader:
        return np.array(reader.read(0, manifest.splits[split].n_tokens), dtype=np.int64)


def test_prep_array_and_finalize_give_the_streams_of_a_single_prepare(cluster, spaced_repo, tmp_path):
    from data_prep.cli import main as data_prep
    from txl_dist.data.format import read_manifest

    _write_texts(tmp_path / "raw")
    inputs = ["--train", "raw/train/*.txt", "--valid", "raw/valid/*.txt", "--test", "raw/test/*.txt"]
    # --no-space-check reaches prepare and finalize, not train-tokenizer (whose parser has no such flag).
    out = cluster.run("bash", str(spaced_repo / "launch" / "slurm" / "prep.sh"), "--shards", "2", "--out", "corpus",
                      "--world-size", "2", "--n-streams", "4", "--logs", "logs", *inputs, "--vocab-size", "512",
                      "--no-space-check", cwd=tmp_path)
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^txl-prep: (\w+) job (\d+)", out, re.MULTILINE)}
    assert set(jobs) == {"tokenizer", "plan", "array", "finalize"}, out
    assert f"after job(s) {jobs['plan']} {jobs['tokenizer']}" in out, out
    info = cluster.wait(jobs["finalize"], timeout=400)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").iterdir()))
    assert info["JobState"] == "COMPLETED", logs
    # The chain: the shards start once the tokenizer is trained and the plan made, finalize once every shard
    # is written.
    (tokenizer,) = cluster.records(jobs["tokenizer"])
    (plan,) = cluster.records(jobs["plan"])
    assert plan["JobState"] == "COMPLETED", logs
    tasks = cluster.records(jobs["array"])
    assert len(tasks) == 2 and {t["JobState"] for t in tasks} == {"COMPLETED"}, tasks
    assert all(tokenizer["EndTime"] <= t["StartTime"] and plan["EndTime"] <= t["StartTime"]
               and t["EndTime"] <= info["StartTime"] for t in tasks)
    plan_log = (tmp_path / "logs" / f"txl-prep-plan-{jobs['plan']}.out").read_text()
    assert "prepare --out corpus.parts" in plan_log and "wrote plan corpus.parts/plan.json" in plan_log, plan_log
    assert f"| repository {spaced_repo}\n" in plan_log  # prep.sh's own repository, with a space in its path
    for i in range(2):  # each task followed the plan (no task hashed or counted every input)
        log = (tmp_path / "logs" / f"txl-prep-shard-{jobs['array']}_{i}.out").read_text()
        assert f"--shard {i}/2" in log and "data_prep prepare exited with status 0" in log, log
        assert f"wrote shard corpus.parts/shard-0000{i}-of-00002 (following its plan.json)" in log, log
    assert sorted(p.name for p in (tmp_path / "corpus.parts").iterdir()) == \
        ["plan.json", "shard-00000-of-00002", "shard-00001-of-00002", "tokenizer.model"]
    # A single prepare with the same inputs and the tokenizer the tokenizer job trained.
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert data_prep(["prepare", "--out", "single", "--tokenizer-model", "corpus.parts/tokenizer.model",
                          *inputs, "--world-size", "2", "--n-streams", "4", "--num-proc", "1", "--quiet"]) == 0
    finally:
        os.chdir(cwd)
    sharded, single = read_manifest(tmp_path / "corpus"), read_manifest(tmp_path / "single")
    assert sharded.digest() == single.digest()
    for split in ("train", "valid", "test"):
        a, b = _tokens(tmp_path / "corpus", split), _tokens(tmp_path / "single", split)
        assert len(a) > 1000 and np.array_equal(a, b), split


def test_prep_sh_stops_at_a_failed_submission_and_leaves_nothing_half_queued(cluster, tmp_path):
    prep = ["bash", str(REPO / "launch" / "slurm" / "prep.sh"), "--out", "corpus", "--train", "raw/*.txt",
            "--vocab-size", "512", "--sbatch", "--begin=now+600"]  # held: nothing runs before it is cancelled

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*prep, *args], cwd=tmp_path, env=env or cluster.env, capture_output=True, text=True,
                              timeout=120)

    # What the cluster refuses for the user's options stops prep.sh before anything is submitted.
    too_many = run("--shards", "5000")
    assert too_many.returncode == 2 and "txl-prep: tokenizer job" not in too_many.stdout, too_many
    assert too_many.stderr.strip() == "txl-prep: error: the cluster refuses these jobs (--shards 5000, --sbatch " \
        "--begin=now+600): allocation failure: Invalid job array specification", too_many.stderr
    # A submission that fails after others were made (here: sbatch fails its third call) cancels them.
    real = shutil.which("sbatch", path=cluster.env.get("PATH"))
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"""#!/bin/bash
case " $* " in *" --test-only "*) exec {real} "$@" ;; esac
n=$(( $(cat {tmp_path}/calls 2>/dev/null || echo 0) + 1 )); echo $n >{tmp_path}/calls
[ $n -lt 3 ] || {{ echo "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation" >&2; exit 1; }}
exec {real} "$@"
""")
    fake.chmod(0o755)
    failed = run("--shards", "2", env=cluster.env | {"PATH": f"{fake.parent}:{cluster.env.get('PATH', '')}"})
    submitted = [int(m) for m in re.findall(r"^txl-prep: (?:tokenizer|plan) job (\d+)", failed.stdout, re.MULTILINE)]
    assert failed.returncode == 1 and len(submitted) == 2, failed
    assert failed.stderr.strip() == "txl-prep: error: sbatch failed for the array job (status 1): sbatch: error: " \
        "Batch job submission failed: Socket timed out on send/recv operation; cancelled job(s) " \
        f"{submitted[0]} {submitted[1]} submitted before it", failed.stderr
    assert [cluster.job(j)["JobState"] for j in submitted] == ["CANCELLED", "CANCELLED"]
