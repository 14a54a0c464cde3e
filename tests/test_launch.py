"""The entry points under real launchers: deepspeed, torchrun, an srun-style environment; SIGTERM mid-run;
one MLflow run (on a real server) continued across the restarts; export of the result."""
from __future__ import annotations

import json
import signal
import sys

import pytest

from dist_helpers import Launch, REPO, free_port, launcher_env, learnable_corpus, run_ranks, tiny_config, venv_bin
from mlflow_server import mlflow_server  # noqa: F401  (pytest finds the fixture by name)
from txl_dist.checkpoint import read_latest, read_run_info, rank_file

VOCAB = 64
MAX_STEPS = 30


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch") / "corpus"
    return learnable_corpus(root, 4 * 49, VOCAB)


def _train_main(argv):
    from launch.train import main

    return main(argv)


def test_deepspeed_then_torchrun_with_sigterm_then_resume_one_mlflow_run(corpus, tmp_path, mlflow_server):  # noqa: F811
    from mlflow import MlflowClient

    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    experiment = f"launch-{tmp_path.name}"
    raw = tiny_config(corpus, run, train={"max_steps": MAX_STEPS, "log_interval": 1},
                      deepspeed={"zero_optimization": {"stage": 1}},
                      tracking={"enabled": True, "uri": mlflow_server.uri, "experiment": experiment,
                                "system_metrics": False})
    config = tmp_path / "run.json"
    config.write_text(json.dumps(raw))
    script = str(REPO / "launch" / "train.py")

    # 1. The deepspeed launcher, 2 CPU ranks, OMP_NUM_THREADS unset; a planned stop at step 2.
    ds = Launch([venv_bin("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), script,
                 "--config", str(config), "--set", "train.exit_step=2"])
    assert ds.wait() == 0, ds.output[-4000:]
    assert "world size 2 (deepspeed, 1 thread(s) per rank)" in ds.output
    assert "the whole gradient after each" not in ds.output  # ZeRO 1 all-reduces once per step
    assert sum("step 2/2 | loss" in line for line in ds.lines) == 1  # rank 0 alone prints
    assert read_latest(ckpt) == "step_00000002"

    # 2. torchrun resumes (auto); SIGTERM to rank 1 only: both ranks agree, save at the next step, exit 0.
    tr = Launch([venv_bin("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), script,
                 "--config", str(config)])
    tr.wait_for(f"step 4/{MAX_STEPS} | loss")
    tr.worker(1).send_signal(signal.SIGTERM)
    assert tr.wait() == 0, tr.output[-4000:]
    assert "resumed from" in tr.output and "stopping after step" in tr.output
    stopped = read_run_info(ckpt / read_latest(ckpt))["step"]
    assert 4 <= stopped < MAX_STEPS, tr.output[-4000:]
    tag = ckpt / read_latest(ckpt)
    assert rank_file(tag, 0).is_file() and rank_file(tag, 1).is_file() and (tag / "txl_state" / "run.json").is_file()

    # 3. Resume again (here from a fork of the test process) and run to the end: final eval on test.
    assert run_ranks(_train_main, 2, ["--config", str(config)], timeout=600) == [0, 0]
    assert read_latest(ckpt) == f"step_{MAX_STEPS:08d}"
    info = read_run_info(ckpt / read_latest(ckpt))

    # One MLflow run across the three jobs, its steps continuing, finished, with the final evaluation.
    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert info["mlflow_run_id"] == run_id
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, MAX_STEPS + 1))
    assert [m.step for m in client.get_metric_history(run_id, "test/loss")] == [MAX_STEPS]

    # 4. Relaunched with a lower max_steps (1 rank): nothing to do, and the run stays FINISHED.
    assert run_ranks(_train_main, 1, ["--config", str(config), "--set", f"train.max_steps={MAX_STEPS - 1}"],
                     timeout=600) == [0]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert read_latest(ckpt) == f"step_{MAX_STEPS:08d}"
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/tokens_seen", "train/step_time_s",
                "train/memory_peak_mib", "valid/loss", "test/bits_per_byte"):
        assert client.get_metric_history(run_id, key), key
    assert runs[0].data.params["model.d_model"] == "32"
    artifacts = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "data")}
    assert {"final_eval.json", "config.resolved.json", "data/manifest.json", "data/tokenizer.model"} <= artifacts


def test_srun_style_environment(corpus, tmp_path):
    """Two plain processes that know only SLURM_* variables, as srun starts them (at ZeRO 2 with 2 micro steps
    per rank: the start-up names the extra gradient traffic)."""
    ckpt = tmp_path / "run" / "checkpoints"
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(corpus, tmp_path / "run", train={"max_steps": 2},
                                             eval={"at_end": False}, deepspeed={"zero_optimization": {"stage": 2}})))
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = launcher_env() | {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                                 "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2",
                                 "SLURM_STEP_NODELIST": "127.0.0.1", "MASTER_PORT": port}
        procs.append(Launch([sys.executable, "launch/train.py", "--config", str(config), "--log-all-ranks"], env))
    codes = [p.wait() for p in procs]
    assert codes == [0, 0], procs[0].output[-3000:] + procs[1].output[-3000:]
    assert "world size 2 (slurm, 1 thread(s) per rank)" in procs[0].output
    assert "ZeRO 2 all-reduces the whole gradient after each of the step's 2 micro steps" in procs[0].output
    assert "[rank 1] " in procs[1].output  # --log-all-ranks: rank 1 prints too, prefixed
    assert read_run_info(ckpt / read_latest(ckpt))["world_size"] == 2


def test_config_errors_exit_2_with_one_line(corpus, tmp_path):
    from launch.train import main

    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(corpus, tmp_path / "ckpt")))
    assert main(["--config", str(config), "--set", "train.max_stepz=3"]) == 2


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_refusal_before_the_ranks_connect_is_one_line_per_node(corpus, tmp_path, nodes):
    # Every rank reads the configuration before the ranks connect; the ranks of a node read the same files and
    # arguments, so their node's first rank speaks for them (2 ranks on 1 node: 1 line; on 2 nodes: 2 lines).
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(corpus, tmp_path / "ckpt")))
    per_node = 2 // nodes
    ranks = []
    for rank in range(2):
        env = launcher_env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank % per_node),
                                "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        ranks.append(Launch([sys.executable, "launch/train.py", "--config", str(config), "--set",
                             "train.max_steps=-1"], env))
    for launch in ranks:
        assert launch.wait(timeout=120) == 2, launch.output
    lines = [line for launch in ranks for line in launch.output.splitlines() if "error:" in line]
    assert len(lines) == nodes and all("train.max_steps: must be > 0, got -1" in line for line in lines), lines


def test_a_stop_signal_after_the_job_does_not_end_the_process(corpus, tmp_path):
    # Slurm's --signal warning after a user's scancel --signal=USR1: the rank has saved and returns 0, but a
    # USR1 during the interpreter's shutdown (which puts back the default action of the signals Python
    # handled: death) used to kill it (exit 138), and Slurm then failed the job instead of requeueing it.
    # Here a second process sends USR1 every half millisecond while this one returns from main and exits.
    import subprocess

    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(corpus, tmp_path / "ckpt")))
    sender = ("import os, signal, sys, time\n"
              "end = time.monotonic() + 20\n"
              "while time.monotonic() < end:\n"
              "    try:\n"
              "        os.kill(int(sys.argv[1]), signal.SIGUSR1)\n"
              "    except ProcessLookupError:\n"
              "        break\n"
              "    time.sleep(0.0005)\n")
    script = ("import os, subprocess, sys, time\n"
              "from launch.train import main\n"
              f"code = main(['--config', {str(config)!r}, '--set', 'train.max_stepz=3'])\n"
              f"subprocess.Popen([sys.executable, '-c', {sender!r}, str(os.getpid())], stdout=subprocess.DEVNULL, "
              "stderr=subprocess.DEVNULL)\n"
              "time.sleep(1.0)\n"
              "sys.exit(0 if code == 2 else 1)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=launcher_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_exit_process_keeps_the_status_the_threads_and_the_exit_handlers():
    # txl_dist/entry.py: the entry points end without the interpreter's teardown; what runs at exit must still
    # run (MLflow ends its run in an atexit handler, after the threads the interpreter waits for), buffered
    # output must still reach its file, and nothing may be printed after the job's last line (triton's
    # bindings, imported by torch's optimizers, reported "leaked instances" after a gc.freeze).
    import subprocess

    script = ("import atexit, sys, threading, time\n"
              "import torch, triton\n"
              "from txl_dist.entry import exit_process\n"
              "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()\n"
              "from concurrent.futures import ThreadPoolExecutor\n"
              "pool = ThreadPoolExecutor(1)\n"  # its idle worker ends only through the interpreter's exit hooks
              "pool.submit(print, 'pool done').result()\n"
              "sys.stdout.write('buffered line\\n')\n"
              "sys.stderr.write('error: the last line\\n')\n"
              "exit_process(3)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (3, "pool done\nbuffered line\nthread done\nexit handler ran\n"), \
        done.stderr
    assert done.stderr == "error: the last line\n"


def test_a_ctrl_c_that_stops_at_once_is_one_line_and_exit_130():
    # Training's second Ctrl-C (or the first of an evaluation, an export): KeyboardInterrupt, through the
    # entry points' guarded(); it used to print a traceback of ~100 lines.
    import subprocess

    script = ("import logging, os, signal, time\n"
              "from txl_dist import stop_request\n"
              "from txl_dist.entry import exit_process, guarded\n"
              "stop_request.FORCE_AFTER_S = 0.0\n"  # the second press counts as the user insisting at once
              "stop_request.catch_stop_signals()\n"
              "logging.basicConfig(format='%(message)s')\n"
              "def job():\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(30)\n"
              "    return 0\n"
              "exit_process(guarded(job, logging.getLogger('txl_dist')))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "error: interrupted (Ctrl-C): stopped at once, without saving", done.stderr
    assert "Traceback" not in done.stderr


SLOW_TORCH_IMPORT = '''
import sys, time
class SlowTorch:  # `import torch` on a cold network file system: it takes long enough for two presses of Ctrl-C
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("importing torch", flush=True)
            time.sleep(120)
        return None
sys.meta_path.insert(0, SlowTorch())
'''


def test_a_second_ctrl_c_during_the_imports_of_training_is_one_line_and_exit_130(tmp_path):
    """launch/train.py keeps stop signals from its first line on; a second Ctrl-C raised KeyboardInterrupt out of
    the imports above main(), where no entry point catches it: a traceback through torch's import instead of
    the line."""
    import os
    import time

    from txl_dist.stop_request import FORCE_AFTER_S

    (tmp_path / "sitecustomize.py").write_text(SLOW_TORCH_IMPORT)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = Launch([sys.executable, "launch/train.py", "--config", "configs/tiny.json"],
                  launcher_env() | {"PYTHONPATH": path})
    proc.wait_for("importing torch", timeout=60)
    proc.proc.send_signal(signal.SIGINT)
    proc.wait_for("Ctrl-C: saving a checkpoint at the next step boundary", timeout=30)
    time.sleep(FORCE_AFTER_S + 0.2)  # the user insisting (the process clocks the first press before it prints)
    proc.proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130, proc.output
    lines = [line for line in proc.lines if line.strip()]
    assert lines[-1].rstrip("\n") == "error: interrupted (Ctrl-C): stopped at once, without saving", proc.output
    assert "Traceback" not in proc.output
