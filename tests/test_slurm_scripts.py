"""The pieces of launch/slurm/ that need no cluster (tests/test_slurm.py runs the scripts under a real Slurm):

- run_state.py, what train.sbatch asks before and after its training step: the header's account of where
  training starts (a rollback, --resume none, checkpoint.fallback, a configuration that stops before the
  newest tag), a damaged newest tag left to the training start's verdict (checkpoint.fallback), refusals
  before any node runs (a configuration this world size cannot run, --resume none on a folder with
  checkpoints), and the tag ids that tell a save of this job from the tags it started with;
- a USR1 that reached the batch shell before the ranks existed (TXL_STOP_SIGNAL) stops them after their first step;
- the repository discovery lines are the same in every .sbatch script;
- common.sh's layout of a GPU job (txl_layout, with Slurm's variables faked): a per-task GPU binding and CPUs
  per task that the allocation cannot give every rank are refused before srun; the rendezvous port stays
  below the kernel's ephemeral ports and is the one txl_dist.distributed derives;
- a job with GPUs whose Python has a CPU build of torch is refused before srun;
- TXL_MAX_RESTARTS and TXL_END_WAIT_S that are no whole number are refused before srun;
- what eval.sbatch says of a step that ended with a signal's status (143: the ranks' own stop on SIGTERM or SIGUSR1);
- train.sbatch after its step (with a stand-in srun that saves a tag): a job started with --resume none requeues
  after its save and is done at its last step; TXL_MAX_RESTARTS=0 on a first start (no SLURM_RESTART_COUNT
  yet) stops without a requeue; a job started with a --resume is told to continue without it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dist_helpers import REPO

RUN_STATE = REPO / "launch" / "slurm" / "run_state.py"


def fake_tag(ckpt_dir: Path, step: int) -> Path:
    """A complete tag as inventory() and read_run_info() see it (run_state reads nothing else)."""
    tag = ckpt_dir / f"step_{step:08d}"
    (tag / "txl_state").mkdir(parents=True)
    (tag / "txl_state" / "run.json").write_text(json.dumps({"version": 2, "step": step}))
    return tag


def state(tmp_path: Path, *args: str, max_steps: int = 200) -> dict[str, str]:
    """run_state.py's key=value lines for configs/tiny.json in tmp_path/run."""
    from launch.slurm.run_state import describe

    return describe(["--config", str(REPO / "configs" / "tiny.json"), "--set", f"run.dir={tmp_path / 'run'}",
                     "--set", f"train.max_steps={max_steps}", *args])


@pytest.fixture
def ckpt(tmp_path) -> Path:
    folder = tmp_path / "run" / "checkpoints"
    for step in (10, 20, 30):
        fake_tag(folder, step)
    return folder


def test_the_header_says_where_training_starts(tmp_path, ckpt):
    assert state(tmp_path)["plan"] == "newest step_00000030: resuming at step 30 of 200"
    rollback = state(tmp_path, "--resume", str(ckpt / "step_00000020"))
    assert rollback["plan"] == ("newest step_00000030; --resume step_00000020: rolling back, newer tags move to "
                                "checkpoints/superseded/; resuming at step 20 of 200")
    lowered = state(tmp_path, max_steps=25)
    assert lowered["plan"] == ("newest step_00000030: at step 30, at or past step 25 where this configuration "
                               "stops: nothing to train")
    fresh = state(tmp_path.parent / (tmp_path.name + "-new"), "--resume", "none")
    assert fresh["plan"] == "none yet: starting a new run to step 200" and fresh["newest"] == ""


def test_a_damaged_newest_tag_is_left_to_the_start_and_fallback_names_the_older_tag(tmp_path, ckpt):
    (ckpt / "step_00000030" / "txl_state" / "run.json").write_text('{"version": 2, "st\x01')
    fallback = state(tmp_path, "--set", "checkpoint.fallback=true")
    assert fallback["plan"] == ("newest step_00000030: its run.json does not read; checkpoint.fallback: "
                                "step_00000020, resuming at step 20 of 200")
    assert (fallback["newest"], fallback["newest_step"]) == ("step_00000030", "30")
    plain = state(tmp_path)  # not refused here: the training start refuses it (or falls back), with the reason
    assert plain["plan"].startswith("newest step_00000030: its run.json does not read; training refuses it")


def test_refused_before_any_node_runs(tmp_path, ckpt):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(RUN_STATE), *args, "--config", str(REPO / "configs" / "tiny.json"),
                               "--set", f"run.dir={tmp_path / 'run'}", "--set", "eval.n_streams=3"],
                              capture_output=True, text=True, timeout=300, env=os.environ | {"DS_ACCELERATOR": "cpu"})

    on_two = run("--world-size", "2")
    errors = [line for line in on_two.stderr.splitlines() if line.startswith("error:")]
    assert on_two.returncode == 2 and errors == [
        "error: eval.n_streams: 3 streams cannot be split over 2 ranks; use a multiple of 2 (or a world size that "
        "divides 3)"], on_two.stderr
    assert run("--world-size", "1").returncode == 0
    from txl_dist.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"^--resume none: .* already holds checkpoints up to step_00000030"):
        state(tmp_path, "--resume", "none")


def test_a_save_of_this_job_is_a_tag_that_was_not_there_before_whatever_its_step(tmp_path, ckpt):
    before = state(tmp_path)["tag_ids"].split()
    assert state(tmp_path)["newest_id"] in before  # nothing saved: no requeue
    # A rollback to step 20: step 30 moves aside, the job saves step 26 (older than the newest it started with).
    (ckpt / "superseded").mkdir()
    os.replace(ckpt / "step_00000030", ckpt / "superseded" / "step_00000030")
    fake_tag(ckpt, 26)
    after = state(tmp_path)
    assert (after["newest"], after["newest_step"]) == ("step_00000026", "26")
    assert after["newest_id"] not in before
    # ... or trains on to step 30 and saves it again under the name it had.
    fake_tag(ckpt, 30)
    assert state(tmp_path)["newest_id"] not in before


def test_a_newest_tag_saved_before_its_evaluation_says_so(tmp_path, ckpt):
    assert state(tmp_path)["newest_owes_evaluation"] == "0"
    run_json = ckpt / "step_00000030" / "txl_state" / "run.json"
    run_json.write_text(json.dumps({"version": 2, "step": 30, "evals_owed": True}))
    owed = state(tmp_path, max_steps=30)
    assert owed["newest_owes_evaluation"] == "1"
    assert owed["plan"] == ("newest step_00000030: at step 30, at or past step 30 where this configuration stops: "
                            "nothing to train; first the evaluation of its step, which a stop request left owed")


def test_a_usr1_kept_for_the_ranks_stops_them_after_their_first_step(monkeypatch):
    from txl_dist import stop_request

    saved = {sig: signal.getsignal(sig) for sig in stop_request.STOP_SIGNALS}
    monkeypatch.setenv(stop_request.PENDING_SIGNAL_ENV, "USR1")
    try:
        stop_request.catch_stop_signals()
        assert stop_request.PENDING_SIGNAL_ENV not in os.environ  # not passed on to anything the rank starts
        request = stop_request.StopRequest()
        assert request.reason() == "SIGUSR1"
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        stop_request._early_signal = None


def test_every_sbatch_script_finds_the_repository_with_the_same_lines():
    def discovery(name: str) -> str:
        text = (REPO / "launch" / "slurm" / name).read_text()
        found = re.search(r"^# The repository: .*?^txl_find_repo$", text, re.MULTILINE | re.DOTALL)
        assert found, name
        return found.group(0)

    assert discovery("train.sbatch") == discovery("eval.sbatch") == discovery("prep.sbatch")


def layout(tmp_path: Path, **slurm: str) -> subprocess.CompletedProcess:
    """common.sh's txl_layout in a bash with only `slurm`'s variables (and a stand-in scontrol) set; prints its
    srun options and the rendezvous port."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$2\" = hostnames ] && printf 'gpu1\\ngpu2\\n'\nexit 0\n")
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "REPO": str(REPO), "SLURM_JOB_NODELIST": "gpu[1-2]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "123"} | slurm
    script = 'source "$REPO/launch/slurm/common.sh"; txl_layout; echo "${SRUN_LAYOUT[*]}"; echo "$MASTER_PORT"'
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)


EIGHT_GPU_NODES = {"SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_NTASKS": "16"}


def test_the_layout_of_a_gpu_job_gives_every_rank_its_cpus_on_one_socket(tmp_path):
    done = layout(tmp_path, **EIGHT_GPU_NODES, SLURM_CPUS_PER_TASK="12", SLURM_CPUS_ON_NODE="96",
                  TXL_SRUN_OPTS="--mpi=none --network=x")
    assert done.returncode == 0, done.stderr
    options = done.stdout.splitlines()[0].split()
    assert options == ["--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--distribution=block:block",
                       "--cpus-per-task=12", "--mpi=none", "--network=x"]


def test_cpus_per_task_that_the_allocation_cannot_give_every_rank_are_refused_before_srun(tmp_path):
    # sbatch --gpus-per-node=8 --cpus-per-task=12 without --ntasks-per-node: 12 CPUs per node for one task,
    # while the step would start 8 ranks of 12 (srun: "More processors requested than permitted").
    done = layout(tmp_path, SLURM_GPUS_ON_NODE="8", SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="1(x2)",
                  SLURM_CPUS_PER_TASK="12", SLURM_CPUS_ON_NODE="12")
    assert done.returncode == 2 and done.stdout == ""
    assert ("error: 8 ranks per node of --cpus-per-task=12 need 96 CPUs per node; the job has 12: submit with "
            "--ntasks-per-node=8") in done.stderr


@pytest.mark.parametrize("variable, value", [("SLURM_GPUS_PER_TASK", "1"), ("SLURM_NTASKS_PER_GPU", "1"),
                                             ("SLURM_TRES_PER_TASK", "cpu:12,gres/gpu:1"),
                                             ("SLURM_GPU_BIND", "closest"), ("SLURM_GPU_BIND", "verbose,single:1")])
def test_a_per_task_gpu_binding_is_refused_before_srun(tmp_path, variable, value):
    done = layout(tmp_path, **EIGHT_GPU_NODES, **{variable: value})
    assert done.returncode == 2 and done.stdout == ""
    assert f"({variable}={value}" in done.stderr
    assert "every rank must see all of its node's GPUs" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("bind", ["none", "verbose,none"])
def test_gpu_bind_none_is_no_binding(tmp_path, bind):
    assert layout(tmp_path, **EIGHT_GPU_NODES, SLURM_GPU_BIND=bind).returncode == 0


def test_the_rendezvous_port_is_below_the_ephemeral_ports_and_the_same_as_the_ranks_derive(tmp_path):
    from txl_dist.distributed import slurm_port

    for job in (123, 12000 + 11999, 15000, 31999):
        port = int(layout(tmp_path, **EIGHT_GPU_NODES, SLURM_JOB_ID=str(job)).stdout.split()[-1])
        assert port == slurm_port(job) and 20000 <= port < 32768  # Linux's default ephemeral range: 32768-60999


@pytest.mark.parametrize("script, variable, value", [("train.sbatch", "TXL_MAX_RESTARTS", "two"),
                                                      ("train.sbatch", "TXL_END_WAIT_S", "1.5"),
                                                      ("eval.sbatch", "TXL_END_WAIT_S", "-5")])
def test_a_count_in_the_environment_that_is_no_whole_number_is_refused_before_srun(tmp_path, script, variable, value):
    """TXL_MAX_RESTARTS=two was only read after the training step (a bash error, and the job requeued regardless
    of the cap); srun refuses a --wait=TXL_END_WAIT_S that is no whole number, which failed the job as a fault."""
    bin_dir = _fake_slurm_tools(tmp_path, ["n1", "n2"], f"touch {tmp_path / 'srun-ran'}\nexit 0")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(REPO), "DS_ACCELERATOR": "cpu", variable: value}
    args = {"train.sbatch": ["--config", "configs/tiny.json", "--set", f"run.dir={tmp_path / 'run'}"],
            "eval.sbatch": ["--checkpoint", str(tmp_path / "run")]}[script]
    done = subprocess.run(["bash", str(REPO / "launch" / "slurm" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"txl-slurm: error: {variable}={value} is not a whole number ("
        + {"TXL_MAX_RESTARTS": "the restarts after which the job is not requeued",
           "TXL_END_WAIT_S": "seconds srun waits for the other ranks after the first one ended"}[variable]
        + "); correct or unset it"]), (done.stdout, done.stderr)
    assert not (tmp_path / "srun-ran").exists()


def test_a_job_with_gpus_and_a_cpu_build_of_torch_is_refused_before_srun(tmp_path, monkeypatch):
    import torch

    from launch.slurm.run_state import describe
    from txl_dist.distributed import LaunchError

    args = ["--config", str(REPO / "configs" / "tiny.json"), "--set", f"run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1,2,3")
    with pytest.raises(LaunchError, match=r"the job: Slurm gave this node 4 GPU\(s\) but torch \S+ cannot use "
                                          r"them \(a CPU build\); put a CUDA build of torch"):
        describe(["--world-size", "1", *args])
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # the CPU on purpose
    assert describe(["--world-size", "1", *args])["newest"] == ""


@pytest.mark.parametrize("status, said", [
    (143, "evaluation exited with status 143: stopped by SIGTERM or SIGUSR1 (the time limit, scancel or preemption) "
          "before its result existed; the ranks' error lines above say where; evaluation keeps no partial result: "
          "submit it again"),
    (137, "evaluation exited with status 137: a rank was ended by signal 9 (KILL); evaluation keeps no partial "
          "result: submit it again")])
def test_eval_sbatch_says_what_a_signal_status_of_its_step_means(tmp_path, status, said):
    """143 is launch/eval.py's own status for SIGTERM and SIGUSR1, after each rank said where it stopped: eval.sbatch
    said `a rank was ended by signal 15 (TERM)`, as if the ranks had died without a word."""
    bin_dir = _fake_slurm_tools(tmp_path, ["n1"], f"exit {status}")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(REPO), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "eval.sbatch"), "--checkpoint",
                           str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == status, (done.stdout, done.stderr)
    assert done.stdout.splitlines()[-1] == f"txl-slurm: {said}", (done.stdout, done.stderr)


def test_eval_sbatch_stopped_by_usr1_before_its_step_says_so(tmp_path):
    """A USR1 to the batch shell while it set the job up (a time limit's warning, scancel --batch --signal=USR1)
    killed it without a word (bash's default: the job FAILED, status 0:10); now it ends as the ranks would have,
    143 and one line, and no step starts."""
    import signal
    import time

    bin_dir = _fake_slurm_tools(tmp_path, ["n1"], f"touch {tmp_path / 'started'}")
    scontrol = bin_dir / "scontrol"  # slow while it expands the node list: the signal comes meanwhile
    slow = f"#!/bin/sh\ntouch {tmp_path / 'setup'}; sleep 2\n"
    scontrol.write_text(scontrol.read_text().replace("#!/bin/sh\n", slow, 1))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(REPO), "DS_ACCELERATOR": "cpu"}
    shell = subprocess.Popen(["bash", str(REPO / "launch" / "slurm" / "eval.sbatch"), "--checkpoint",
                              str(tmp_path / "run")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "setup").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    shell.send_signal(signal.SIGUSR1)
    out, err = shell.communicate(timeout=120)
    assert shell.returncode == 143, (out, err)
    assert out.splitlines()[-1] == ("txl-slurm: the batch shell got SIGUSR1 before the evaluation started: not "
                                    "starting it; evaluation keeps no partial result: submit it again"), (out, err)
    assert not (tmp_path / "started").exists()


def _fake_slurm_tools(tmp_path, nodes: list[str], srun_body: str):
    """tmp_path/bin with an scontrol that expands the node list to `nodes` and an srun running srun_body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hostnames = "\\n".join(nodes)
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n[ \"$2\" = hostnames ] && printf '{hostnames}\\n'\nexit 0\n")
    (bin_dir / "srun").write_text(f"#!/bin/sh\n{srun_body}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _train_sbatch(tmp_path: Path, srun_body: str, *args: str, **environ: str) -> tuple[subprocess.CompletedProcess,
                                                                                        list[str]]:
    """train.sbatch on one stand-in node with configs/tiny.json in tmp_path/run (train.max_steps 20), its step an
    srun running srun_body; the process and the `scontrol requeue` calls it made."""
    bin_dir = _fake_slurm_tools(tmp_path, ["n1"], srun_body)
    requeues = tmp_path / "requeues"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(scontrol.read_text().replace(
        "#!/bin/sh\n", f"#!/bin/sh\n[ \"$1\" = requeue ] && echo \"$2\" >>{requeues}\n", 1))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_SUBMIT_DIR": str(REPO), "DS_ACCELERATOR": "cpu"} | environ
    done = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "train.sbatch"), "--config", "configs/tiny.json",
                           "--set", f"run.dir={tmp_path / 'run'}", "--set", "train.max_steps=20", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    return done, requeues.read_text().split() if requeues.exists() else []


def _saves(tmp_path: Path, step: int) -> str:
    """A stand-in step's shell lines that save a complete tag at `step` in tmp_path/run/checkpoints."""
    state = tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "txl_state"
    return f"mkdir -p {state}\necho '{{\"version\": 2, \"step\": {step}}}' >{state / 'run.json'}"


@pytest.mark.parametrize("step, said, requeued", [
    (10, "stopped at step 10 of 20 after a save; requeueing job 123 (restart 1)", ["123"]),
    (20, "done: step_00000020 (step 20 of 20); checkpoints {ckpt}", [])])
def test_a_job_started_with_resume_none_requeues_after_its_save_and_ends_done_at_its_last_step(tmp_path, step, said,
                                                                                               requeued):
    """The state after the step was read with the job's own --resume none, which a folder holding checkpoints
    refuses: the job's own save ended it with exit status 2 and `error: --resume none: ... already holds
    checkpoints`, not requeued (and a run that reached train.max_steps FAILED)."""
    done, requeues = _train_sbatch(tmp_path, _saves(tmp_path, step), "--resume", "none")
    assert done.returncode == 0, (done.stdout, done.stderr)
    said = said.format(ckpt=tmp_path / "run" / "checkpoints")
    assert (done.stdout.splitlines()[-1], requeues) == (f"txl-slurm: {said}", requeued), (done.stdout, done.stderr)


def test_txl_max_restarts_0_stops_the_first_start_without_requeue(tmp_path):
    """Slurm sets SLURM_RESTART_COUNT only once a job has been requeued: the first start's line about the cap read
    it bare, and `set -u` ended the job after its save with `SLURM_RESTART_COUNT: unbound variable`, status 1."""
    done, requeues = _train_sbatch(tmp_path, _saves(tmp_path, 10), TXL_MAX_RESTARTS="0")
    assert (done.returncode, done.stderr) == (0, ""), (done.stdout, done.stderr)
    assert done.stdout.splitlines()[-1] == ("txl-slurm: stopped at step 10 of 20; not requeueing: 0 restart(s) "
                                            "already (TXL_MAX_RESTARTS); submit the same command to continue")
    assert requeues == []


def test_a_job_started_with_a_resume_is_continued_without_it(tmp_path):
    """`submit the same command to continue` repeated the first start's --resume: a rollback again to its tag (the
    tags saved since set aside), or --resume none refused on the folder the job had filled."""
    done, requeues = _train_sbatch(tmp_path, f"kill -TERM $PPID\n{_saves(tmp_path, 10)}", "--resume", "none")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.splitlines()[-1] == (
        "txl-slurm: stopped at step 10 of 20 by SIGTERM (scancel, the time limit or preemption); newest checkpoint "
        "step_00000010; not requeueing: submit the same command without its --resume to continue")
    assert requeues == []
