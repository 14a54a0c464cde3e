"""Rank discovery for the deepspeed launcher, torchrun and srun; threads per rank; rank-0 logging."""
import logging
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

from txl_dist import distributed
from txl_dist.distributed import DistEnv, LaunchError, discover
from dist_helpers import REPO
from txl_dist.host import raise_open_file_limit


def test_torchrun_environment():
    env = discover({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert env == DistEnv(3, 4, 1, 2, "10.0.0.5", 1234, "torchrun")
    assert not env.is_main


def test_deepspeed_launcher_environment():
    # The deepspeed launcher names the local world LOCAL_SIZE (and passes --local_rank, see test_launch).
    env = discover({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (1, 2, 1, 2, "deepspeed")


def test_slurm_environment_rendezvous_at_the_steps_first_node():
    # Task 0 runs on the step's first node; the node srun was typed on (a login node under salloc) is not
    # part of the job, so SLURM_LAUNCH_NODE_IPADDR must not be the address.
    env = discover({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
                    "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_LAUNCH_NODE_IPADDR": "192.168.1.7",
                    "SLURM_STEP_NODELIST": "gpu17,gpu18", "SLURM_JOB_NODELIST": "gpu16,gpu17,gpu18"})
    assert env == DistEnv(5, 6, 2, 3, "gpu17", distributed.DEFAULT_MASTER_PORT, "slurm")


def test_slurm_port_follows_the_job_id_unless_given():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "n1", "SLURM_JOB_ID": "123456"}
    assert discover(base).master_port == distributed.slurm_port(123456) == 20000 + 123456 % 12000
    assert discover(base | {"MASTER_PORT": "4321"}).master_port == 4321


def test_slurm_tasks_per_node_uneven():
    env = discover({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                    "SLURM_TASKS_PER_NODE": "2(x2),1", "MASTER_ADDR": "n1"})
    assert env.local_world_size == 1 and env.master_addr == "n1"


def test_slurm_first_node_from_scontrol(tmp_path, monkeypatch):
    # A stand-in scontrol on PATH: prints the expansion the real one would, and records its arguments.
    log = tmp_path / "args"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {log}\nprintf 'node7\\nnode8\\n'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                    "SLURM_JOB_NODELIST": "node[7-8]", "MASTER_PORT": "4000"})
    assert env.master_addr == "node7" and env.master_port == 4000
    assert log.read_text().split() == ["show", "hostnames", "node[7-8]"]


def test_no_launcher_is_a_world_of_one():
    assert discover({}) == DistEnv(0, 1, 0, 1, "127.0.0.1", distributed.ANY_FREE_PORT, "single")
    assert discover({"MASTER_PORT": "4321"}).master_port == 4321
    # Under a launcher the ranks must meet on an agreed port: the fixed default stays.
    assert discover({"RANK": "0", "WORLD_SIZE": "1"}).master_port == distributed.DEFAULT_MASTER_PORT


# Joins a world of one as `python launch/train.py` does (no launcher, no MASTER_PORT), then waits until the
# other process has joined too, so that both hold their stores at once.
_JOIN_ALONE = '''
import sys, time
from pathlib import Path
from txl_dist import distributed
env = distributed.discover()
distributed.init_process_group(env, collective_timeout_s=30, control_timeout_s=30)
try:
    mine, other = Path(sys.argv[1]), Path(sys.argv[2])
    mine.write_text(str(distributed.collective_timeout()))
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert other.exists(), "the other process never joined"
    assert distributed.gather_objects(7) == [7]
finally:
    distributed.destroy_process_group()
'''


def test_two_single_process_jobs_on_one_machine_join_at_once(tmp_path):
    import subprocess
    import sys
    import time

    from dist_helpers import REPO, launcher_env

    marks = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([sys.executable, "-c", _JOIN_ALONE, str(mine), str(other)], cwd=REPO,
                              env=launcher_env() | {"OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
             for mine, other in (marks, marks[::-1])]
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode for p in procs):  # one failed: the other would only wait for it
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    errors = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside 0..1 .WORLD_SIZE=2."),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "set MASTER_ADDR"),
])
def test_bad_environments_are_refused_in_one_line(environ, message):
    with pytest.raises(LaunchError, match=message) as info:
        discover(environ)
    assert "\n" not in str(info.value)


def test_a_node_whose_ranks_see_fewer_gpus_than_it_runs_ranks_is_refused(monkeypatch):
    # No GPU here: torch.cuda's counts stand in. With a per-task GPU binding each of a node's 8 ranks sees one
    # GPU, and cuda:<local rank> (DeepSpeed's choice too) would fail in torch as "invalid device ordinal".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device before the check"))
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
                        | {"CUDA_VISIBLE_DEVICES": "5"})  # export() writes here; no DS_ACCELERATOR=cpu
    env = DistEnv(11, 16, 3, 8, "127.0.0.1", 29500, "slurm")
    for local_rank in (0, 3):  # every rank of the node refuses, local rank 0 too: they stop together
        with pytest.raises(LaunchError, match=r"rank \d+: 8 ranks on this node but each sees 1 GPU\(s\) "
                                              r"\(CUDA_VISIBLE_DEVICES=5\).*--gpus-per-task"):
            distributed.init_process_group(DistEnv(8 + local_rank, 16, local_rank, 8, "127.0.0.1", 29500, "slurm"))
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    distributed.check_visible_gpus(env)  # all 8 visible: fine
    distributed.check_visible_gpus(DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single"))


def test_ds_accelerator_cpu_puts_the_whole_run_on_the_cpu_beside_gpus(monkeypatch):
    # The first GPU check (H200, 2026-12-04): with DS_ACCELERATOR=cpu DeepSpeed's engine kept the model on the
    # CPU while the evaluator took cuda:0, and the first validation failed in the embedding ("index is on
    # cuda:0, different from other tensors on cpu"). One answer now serves the engine, batches and evaluator.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    env = DistEnv(1, 2, 1, 2, "127.0.0.1", 29500, "torchrun")
    for value in ("cpu", " CPU "):
        monkeypatch.setenv("DS_ACCELERATOR", value)
        assert distributed.device_for(env) == torch.device("cpu")
        assert distributed.default_backend() == "gloo"
        distributed.check_visible_gpus(env)  # no GPU is needed, however many are visible
    for value in ("cuda", None):
        if value is None:
            monkeypatch.delenv("DS_ACCELERATOR")
        else:
            monkeypatch.setenv("DS_ACCELERATOR", value)
        assert distributed.device_for(env) == torch.device("cuda", 1)
        assert distributed.default_backend() == "cpu:gloo,cuda:nccl"


def test_ranks_on_a_node_with_gpus_that_torch_cannot_use_are_refused(monkeypatch):
    # A CPU build of torch (or a driver older than its CUDA) on a node Slurm gave GPUs: without the refusal
    # every rank would take the CPU and gloo and train at CPU speed.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    env = DistEnv(3, 16, 3, 8, "127.0.0.1", 29500, "slurm")
    for gpus in ({"SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7"}, {"SLURM_GPUS_ON_NODE": "8"}):
        monkeypatch.setattr(os, "environ", dict(os.environ, **gpus))
        with pytest.raises(LaunchError, match=r"^rank 3: Slurm gave this node 8 GPU\(s\) but torch .* cannot use "
                                              r"them .*DS_ACCELERATOR=cpu to train on the CPU on purpose$"):
            distributed.init_process_group(env)
        assert not torch.distributed.is_initialized()
    monkeypatch.setattr(os, "environ", dict(os.environ, SLURM_GPUS_ON_NODE="8", DS_ACCELERATOR="cpu"))
    distributed.check_visible_gpus(env)  # the CPU on purpose
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    distributed.check_visible_gpus(env)  # no GPU given: a CPU job


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard limit {hard}: no room below it to lower the soft limit")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # what a login shell's ulimit may pass on
        now = raise_open_file_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now > 256
        assert now == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_threads_are_shared_out_unless_omp_num_threads_is_set():
    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
        env = DistEnv(0, 2, 0, 2, "127.0.0.1", 1, "deepspeed")
        assert distributed.configure_threads(env, environ={}) == max(1, cores // 2)
        torch.set_num_threads(1)
        assert distributed.configure_threads(env, environ={"OMP_NUM_THREADS": "1"}) == 1
    finally:
        torch.set_num_threads(before)


def test_a_rank_bound_to_its_own_cpus_is_not_given_a_share_of_them(monkeypatch):
    from txl_dist import host

    monkeypatch.setattr(host, "usable_cpus", lambda: 12)
    slurm = {"SLURM_PROCID": "3", "SLURM_CPUS_PER_TASK": "12"}
    assert host.cpus_per_rank(8, slurm) == 12  # srun bound the task to its 12 CPUs
    assert host.cpus_per_rank(8, {}) == 1  # a launcher that leaves every rank the node's CPUs: 12 / 8
    assert host.cpus_per_rank(4, slurm | {"SLURM_CPUS_PER_TASK": "3"}) == 3  # no binding (12 seen, 3 asked)
    assert host.cpus_per_rank(16, {}) == 1


def test_collectives_work_without_a_process_group():
    t = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    assert distributed.gather_objects(3) == [3]


# setup_logging's process-wide loggers are put back after each test by conftest.project_loggers_put_back.
def test_only_rank_zero_logs_info_unless_all_ranks():
    main = distributed.setup_logging(DistEnv(0, 2, 0, 2, "h", 1, "torchrun"))
    assert main.isEnabledFor(logging.INFO)
    other = distributed.setup_logging(DistEnv(1, 2, 1, 2, "h", 1, "torchrun"))
    assert not other.isEnabledFor(logging.INFO) and other.isEnabledFor(logging.WARNING)
    loud = distributed.setup_logging(DistEnv(1, 2, 1, 2, "h", 1, "torchrun"), log_all_ranks=True)
    assert loud.isEnabledFor(logging.INFO)
    assert "[rank 1]" in loud.handlers[0].formatter._fmt


def test_a_warning_every_rank_logs_alike_is_printed_by_rank_zero_only(capfd):
    for rank, log_all_ranks in ((0, False), (1, False), (1, True)):
        log = distributed.setup_logging(DistEnv(rank, 2, rank, 2, "h", 1, "torchrun"), log_all_ranks=log_all_ranks)
        log.warning("alike %d %s", rank, log_all_ranks, extra=distributed.RANK_ZERO_ONLY)
        log.warning("own %d %s", rank, log_all_ranks)
    err = capfd.readouterr().err
    assert "alike 0 False" in err and "alike 1 False" not in err and "alike 1 True" in err
    assert all(f"own {r}" in err for r in (0, 1))


def _check_run_dir(paths):
    from txl_dist.run_dir import RunDirUnusable
    from txl_dist.startup import check_run_dir_shared

    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        check_run_dir_shared(paths[env.rank], env)
        return "shared"
    except RunDirUnusable as e:
        return f"refused: {e}"
    finally:
        distributed.destroy_process_group()


def test_a_run_dir_that_is_not_one_folder_for_all_ranks_is_refused_on_every_rank(tmp_path):
    from dist_helpers import run_ranks

    shared, node0, node1 = tmp_path / "shared", tmp_path / "node0", tmp_path / "node1"
    for d in (shared, node0, node1):
        d.mkdir()
    assert run_ranks(_check_run_dir, 2, [shared, shared]) == ["shared", "shared"]
    # A node-local run.dir (/tmp on each node): the same name, two folders; played by a folder per rank.
    results = run_ranks(_check_run_dir, 2, [node0, node1])
    assert results[0] == results[1] and results[0].startswith(f"refused: run.dir {node0} is not one folder for all "
                                                                "ranks: rank(s) 1 (")
    assert "\n" not in results[0]
    assert not list(shared.iterdir()) and not list(node0.iterdir())  # rank 0 removed its file both times


def _start_up_fails_on_rank_1(kind):
    from txl_dist.config import ConfigError
    from txl_dist.errors import EXIT_FAILED, EXIT_REFUSED, Refused, RunFailed

    env = distributed.discover()
    distributed.init_process_group(env)
    errors = {"bug": ValueError("rank 1's data file is corrupt"), "fault": RunFailed("rank 1's disk is full"),
              "refusal": ConfigError("rank 1's config is wrong")}
    try:
        def check():
            if env.rank == 1:
                raise errors[kind]
            return "ok"

        distributed.together(check, "the data checked")
        return "went on"
    except Exception as e:
        status = EXIT_REFUSED if isinstance(e, Refused) else EXIT_FAILED if isinstance(e, RunFailed) else "bug"
        return f"{type(e).__name__} ({status}): {e}"
    finally:
        distributed.destroy_process_group()


@pytest.mark.parametrize("kind, told", [("bug", "StartFailed (1)"), ("fault", "StartFailed (1)"),
                                        ("refusal", "LaunchError (2)")])
def test_a_start_up_failure_on_one_rank_stops_all_ranks_with_its_kind(kind, told):
    from dist_helpers import run_ranks

    rank0, rank1 = run_ranks(_start_up_fails_on_rank_1, 2, kind)
    # Rank 0 names the rank, its host and the message (it prints the job's one line); rank 1 raises its own.
    # Rank 0's exit status is the failed rank's kind: a fault (or a bug) is not a refusal.
    own = {"bug": "ValueError (bug): rank 1's data file is corrupt", "fault": "RunFailed (1): rank 1's disk is full",
           "refusal": "ConfigError (2): rank 1's config is wrong"}[kind]
    assert re.fullmatch(rf"{re.escape(told)}: rank 1 \(\S+\) failed while starting: {re.escape(own.split(': ', 1)[1])}",
                        rank0), rank0
    assert rank1 == own


def test_a_world_of_one_joins_without_a_watchdog_and_leaves_cleanly(monkeypatch):
    from dist_helpers import free_port
    from txl_dist import watchdog

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # init exports them; put the suite's back afterwards
    env = DistEnv(0, 1, 0, 1, "127.0.0.1", free_port(), "torchrun")
    distributed.init_process_group(env, collective_timeout_s=30, control_timeout_s=60)
    try:
        assert torch.distributed.get_backend() == distributed.default_backend() == "gloo"
        assert not watchdog.running()  # nobody to watch
        assert distributed.any_rank(True) and distributed.gather_objects(3) == [3]
        distributed.barrier()
    finally:
        distributed.destroy_process_group()
    assert not torch.distributed.is_initialized()


def test_explain_failure_ignores_what_is_not_a_collective_failure():
    assert distributed.explain_failure(ValueError("bad value")) is None
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4711")
    assert distributed.explain_failure(gloo) == f"a collective failed: {gloo}"  # no watchdog: nothing to name


def _start_on_a_taken_port(port):
    env = distributed.discover()
    try:
        distributed.init_process_group(env, collective_timeout_s=5)
        return "joined"
    except LaunchError as e:
        return f"LaunchError: {e}"
    finally:
        distributed.destroy_process_group()


def test_a_master_port_another_process_listens_on_is_one_line_naming_it():
    """Rank 0 hosts the rendezvous store; a port taken by another job is said as such (not 'a collective
    failed' with the backend's message). Rank 0 of a 2-rank job, alone: it fails at the bind, before waiting."""
    import socket

    from dist_helpers import context, rank_env

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        ctx = context()
        with ctx.Pool(1) as pool:
            env = rank_env(0, 2, port)
            result = pool.apply(_in_env, (env, _start_on_a_taken_port, port))
    finally:
        taken.close()
    assert result == (f"LaunchError: MASTER_PORT {port} on 127.0.0.1 is in use by another process (another job?); "
                      "choose a free port (deepspeed --master_port, torchrun --master-port, or MASTER_PORT)")


def _in_env(env, fn, *args):
    os.environ.update(env)
    return fn(*args)


STORE_OF_A_DEAD_RANK = """
import subprocess, sys
if sys.argv[1] == "quiet":
    from txl_dist.host import quiet_torch_cpp_warnings
    quiet_torch_cpp_warnings()
import torch.distributed as dist
server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                           "s = d.TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False); "
                           "print(s.port, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
client = dist.TCPStore("127.0.0.1", int(server.stdout.readline()), 2, is_master=False)
client.add("beat", 1)
server.kill(); server.wait()
try:
    client.add("beat", 1)  # the heartbeat of a rank whose store host has just died
except RuntimeError as e:
    print("raised", type(e).__name__)
"""


@pytest.mark.parametrize("mode", ["quiet", "default"])
def test_a_call_on_the_store_of_a_dead_rank_prints_no_cpp_stack_unless_asked(mode):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", STORE_OF_A_DEAD_RANK, mode], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert done.stdout.strip() == "raised DistNetworkError", done.stderr[-2000:]
    # torch's own default prints a warning with C++ frames (the test would fail without the quiet level).
    assert ("TCPStore.cpp" in done.stderr and "frame #" in done.stderr) == (mode == "default"), done.stderr[-2000:]


@pytest.mark.parametrize("entry", ["launch/train.py", "launch/eval.py"])
def test_the_entry_points_quiet_torchs_cpp_warnings_before_torch_is_imported(entry):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    probe = (f"import runpy, sys, builtins; real = builtins.__import__\n"
             "def spy(name, *a, **k):\n"
             "    if name.split('.')[0] == 'torch' and 'torch' not in sys.modules:\n"
             "        import os; print('level at torch import:', os.environ.get('TORCH_CPP_LOG_LEVEL'), flush=True)\n"
             "    return real(name, *a, **k)\n"
             f"builtins.__import__ = spy; sys.argv = ['{entry}', '--help']\n"
             f"runpy.run_path('{entry}', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert "level at torch import: ERROR" in done.stdout.splitlines()[0], done.stdout[:500] + done.stderr[-2000:]
