"""Test helpers: run a function on W real processes joined in a gloo process group; tiny corpora,
configs and training jobs for those processes.

The processes come from a forkserver that has imported torch, deepspeed and the project once, so a
multi-process check costs a fork, not ~10-20 s of imports per rank. Each child gets the environment a
launcher would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
OMP_NUM_THREADS=1 (2 cores, 2 ranks), runs `fn(*args)` and sends back its return value or its traceback.

The target must be importable by name (a module-level function of a test module or of this one).
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import psutil
import torch.multiprocessing as mp

from txl_dist.tracking import Tracker

if TYPE_CHECKING:
    import numpy as np

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ["torch", "torch._dynamo", "txl_dist.deepspeed_import", "numpy", "pyarrow", "txl_dist.engine", "txl_dist.trainer"]
_ctx = None


def context():
    """The shared forkserver context (started on first use, preloaded with the heavy imports)."""
    global _ctx
    if _ctx is None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _ctx = ctx
    return _ctx


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerator() -> str:
    """DeepSpeed's accelerator for the ranks: the CPU (tests/conftest.py's default) unless the test run names
    another (bench/gpu_check.py runs the CUDA tests with DS_ACCELERATOR=cuda)."""
    return os.environ.get("DS_ACCELERATOR") or "cpu"


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun would set for this rank on one machine."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": accelerator()}


def _child(fn: Callable[..., Any], args: tuple, env: dict[str, str], results) -> None:
    os.environ.update(env)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    rank = int(env["RANK"])
    try:
        out = fn(*args)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)
    # Pickled here, by value: a tensor sent as is would travel as a shared-memory handle that dies with us.
    results.put((rank, "ok", pickle.dumps(out)))


class RankFailed(AssertionError):
    """A rank raised or died; the message holds its traceback."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; their return values in rank order, or RankFailed with the
    first traceback (the other ranks are killed: they may be waiting in a collective for the failed one)."""
    ctx = context()
    port = free_port()
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, args, rank_env(rank, world_size, port), results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [out[r] for r in range(world_size)]


def launcher_env() -> dict[str, str]:
    """The test process's environment minus what a launcher sets (and OMP_NUM_THREADS: we set it)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS"}
    return ({k: v for k, v in os.environ.items() if k not in drop}
            | {"DS_ACCELERATOR": accelerator(), "PYTHONUNBUFFERED": "1"})


def launch_ranks(entry: str, args: list[str], faults=(), world: int = 2) -> list[Launch]:
    """`world` plain processes of launch/<entry>.py, each told its rank as srun would; through tests/fault_job.py
    with the faults (KIND:RANK:STEP) given."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = launcher_env() | {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                "OMP_NUM_THREADS": "1"}
        # The entry point itself where there is no fault to inject.
        script = ["tests/fault_job.py", "--entry", entry, *[a for f in faults for a in ("--fault", f)], "--"] \
            if faults else [f"launch/{entry}.py"]
        procs.append(Launch([sys.executable, *script, *args], env))
    return procs


class Launch:
    """A launcher command in its own process group; its output collected line by line."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env or launcher_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"never printed {text!r}:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float = 300.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{' '.join(self.cmd)} did not finish in {timeout:.0f} s:\n{self.output[-4000:]}")
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def worker(self, rank: int) -> psutil.Process:
        """The training process of `rank` among the launcher's descendants."""
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "launch/train.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank):
                    return p
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no worker with RANK={rank} under {self.cmd[0]}")


def venv_bin(name: str) -> str:
    """An executable of the interpreter's venv (torchrun, deepspeed)."""
    return str(Path(sys.executable).parent / name)


# ----------------------------------------------------------------------------------------------------
# Small corpora and configs for training tests


def learnable_stream(n_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """Tokens a tiny model can learn from: random 'sentences' of a small phrase book, EOD (3) between."""
    import numpy as np

    rng = np.random.default_rng(seed)
    phrases = [rng.integers(4, vocab_size, size=rng.integers(3, 9)) for _ in range(12)]
    out: list[int] = []
    while len(out) < n_tokens:
        for k in rng.integers(0, len(phrases), size=rng.integers(2, 6)):
            out.extend(phrases[k].tolist())
        out.append(3)
    tokens = np.asarray(out[:n_tokens], dtype=np.int64)
    tokens[-1] = 3
    return tokens


def learnable_corpus(root: Path, train_tokens: int, vocab_size: int = 64) -> Path:
    """write_corpus of learnable streams: train_tokens of train, 80 tokens each of valid and test."""
    return write_corpus(root, {"train": learnable_stream(train_tokens, vocab_size, 0),
                               "valid": learnable_stream(80, vocab_size, 1),
                               "test": learnable_stream(80, vocab_size, 2)}, vocab_size=vocab_size)


def write_corpus(root: Path, splits: dict, vocab_size: int = 64, layout=(2, 4)) -> Path:
    """A prepared corpus folder (manifest, tokenizer file, Arrow files) through the public format API."""
    from corpus_helpers import make_corpus
    from txl_dist.data import Layout

    return make_corpus(root, splits, Layout(*layout), vocab_size, bytes_per_token=6, chars_per_token=5)


def tiny_config(corpus: Path, run_dir: Path, **sections) -> dict:
    """A raw run config for a 2-layer, d_model 32 model on `corpus`, writing to `run_dir` (checkpoints in
    run_dir/checkpoints); `sections` update it per section.

    The attention path is pinned ("matmul"): tests compare separate runs bit for bit, and "auto" is measured
    per run, so two fresh runs could pick paths that round differently (tests/test_runtime_choices.py
    tests "auto" itself)."""
    import copy

    raw = {
        "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "d_head": 16, "d_inner": 64, "cutoffs": [32],
                  "div_val": 2, "tgt_len": 8, "mem_len": 8, "dropout": 0.1, "attn_impl": "matmul"},
        "data": {"path": str(corpus)},
        "train": {"max_steps": 4, "seed": 11, "log_interval": 1},
        "eval": {"interval": 0, "tgt_len": 8, "mem_len": 16, "n_streams": 2, "max_segments": 3},
        "run": {"dir": str(run_dir)},
        "checkpoint": {"interval": 0, "keep": 2},
        "tracking": {"enabled": False},
        "deepspeed": {
            "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}},
            "steps_per_print": 10**9,
        },
    }
    raw = copy.deepcopy(raw)
    for section, values in sections.items():
        raw[section] = _merge(raw.get(section, {}), values)
    return raw


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ----------------------------------------------------------------------------------------------------
# Training jobs inside test ranks


class Recorder(Tracker):
    """A tracker that keeps the metrics in memory (every rank computes the same all-reduced numbers)."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}
        self.artifacts: list[tuple[str, str | None]] = []

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((str(path), artifact_path))


def train_job(raw: dict, resume: str = "auto") -> dict:
    """One training job on this rank (the process group is already up); its per-step losses and exit code."""
    from txl_dist import distributed, trainer
    from txl_dist.config import config_from_dict

    env = distributed.discover()
    t = trainer.build(config_from_dict(raw), env, resume=resume)
    t.tracker.close()
    t.tracker = Recorder()
    try:
        code = t.train()
    finally:
        t.close()
    losses = {s: m["train/loss"] for s, m in t.tracker.metrics.items() if "train/loss" in m}
    return {"code": code, "losses": losses, "step": t.step, "tokens_seen": t.tokens_seen,
            "metrics": t.tracker.metrics, "artifacts": t.tracker.artifacts}


def train_jobs(jobs: list[tuple[dict, str]]) -> list[dict]:
    """Several training jobs in a row on this rank, in one process group (DeepSpeed caches its groups)."""
    from txl_dist import distributed

    env = distributed.discover()
    distributed.setup_logging(env)
    distributed.init_process_group(env)
    try:
        return [train_job(raw, resume) for raw, resume in jobs]
    finally:
        distributed.destroy_process_group()




def allow_fp16_on_this_cpu() -> None:
    """Let DeepSpeed (and the product's check that reads it) take fp16 on a CPU without oneDNN's fp16 kernels
    (AVX512-FP16 or AMX-FP16; an AMD EPYC has neither): torch computes in fp16 there too, only slowly. For
    tests of fp16's loss scaling, which must run whatever the CI machine's CPU. Call it in the rank's process."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def train_jobs_in_fp16_anywhere(jobs: list[tuple[dict, str]]) -> list[dict]:
    """train_jobs, with fp16 allowed on this CPU (allow_fp16_on_this_cpu)."""
    allow_fp16_on_this_cpu()
    return train_jobs(jobs)


def without_cuda_toolkit(monkeypatch, torch_cuda: str = "13.0") -> None:
    """Make txl_dist.engine see DeepSpeed's FusedAdam as the CUDA op it is on a GPU (this machine's
    accelerator is the CPU, whose FusedAdam is a C++ op), on a machine without a CUDA toolkit (CUDA_HOME
    unset, as with a pip-installed CUDA torch) and with torch built for CUDA `torch_cuda`."""
    from deepspeed.ops.op_builder import builder as op_builder

    from txl_dist import engine

    class CudaFusedAdam(op_builder.CUDAOpBuilder):
        NAME = "fused_adam"

        def __init__(self):  # DeepSpeed's would ask the accelerator for its compute capabilities
            self.name = self.NAME

        def absolute_name(self):
            return f"deepspeed.ops.adam.{self.NAME}_op"

        def sources(self):
            return []

    monkeypatch.setattr(engine, "_op_builder", lambda name: CudaFusedAdam() if name == "FusedAdamBuilder" else None)
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    monkeypatch.setattr("torch.version.cuda", torch_cuda)


def sentencepiece_corpus(root: Path, words: list[str], n_docs: tuple[int, int, int], seed: int = 0) -> Path:
    """A corpus made by data_prep from random sentences of `words` (30 lines per document; n_docs: train, valid,
    test documents), with a real 64-piece SentencePiece model; root/corpus."""
    import random

    from data_prep.cli import main as prep

    rng = random.Random(seed)
    for split, count in zip(("train", "valid", "test"), n_docs):
        (root / "raw" / split).mkdir(parents=True)
        for d in range(count):
            lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))).capitalize() + "."
                     for _ in range(30)]
            (root / "raw" / split / f"{d:02d}.txt").write_text("\n".join(lines) + "\n")
    corpus = root / "corpus"
    assert prep(["prepare", "--out", str(corpus), *(f"--{s}={root / 'raw' / s / '*.txt'}" for s in
                                                    ("train", "valid", "test")),
                 "--vocab-size", "64", "--no-byte-fallback", "--world-size", "1", "--n-streams", "4",
                 "--num-proc", "1", "--quiet"]) == 0
    return corpus
