"""The device check: what one GPU does with txl-dist, in under 8 minutes (bench/gpu_check.sh runs it).

    python bench/gpu_check.py --out DIR [--cpu-smoke] [--budget-s 430]

Phases, each time-boxed, each writing JSON lines to DIR/gpu_check.jsonl as it goes (a kill leaves what
was measured), then DIR/gpu_check_table.txt (a short table):
  env        device, torch / CUDA / Triton versions, free memory
  matmul     the device's matmul peak (bf16, fp16, tf32, fp32): the denominator of the measured MFU
  attention  relative attention alone, forward+backward, every implementation in ATTN_IMPLS (discovered),
             fp32 and bf16: max abs errors of output and gradients against the einsum reference run in
             float64, beside the reference's own error in that dtype; time per call; and one profiled bf16
             call of each: its busiest kernels (attention_profile)
  model      whole-model forward+backward on the device for every implementation (two segments with mems,
             and an evaluation segment with long memory, same_length and clamp_len) against the float64
             reference model; every implementation but flex in both dtypes first, flex last
  cuda_tests tests/test_gpu.py and tests/test_triton_attention.py under pytest (CUDA-only correctness: every
             attention path and tail mode against the reference, forward and backward, the fused Triton kernels
             compiled for the device, no host sync in a micro step, compiled layers equal to eager), the tests
             without flex first, then flex's, each part's output in DIR/cuda_tests*.log; on a CPU every test of
             test_gpu.py is skipped and the Triton file left out (the suite runs it interpreted; the smoke run
             checks the wiring)
  deepspeed  when DeepSpeed imports: the project's own trainer (launch/train.py) on a synthetic corpus with
             the base config, ZeRO 1 and 2, bf16, tracking off, 8 steps; its output streams to
             DIR/deepspeed_zero<N>.log (the end of it kept), its progress lines (one per step) go to the record;
             every stage profiles its steps 5-6 (train.profile_steps): its busiest kernels and where the steps'
             wall time went (the device's busy share, the host's waits, launches per step:
             txl_dist/trace_summary.py) go to the record, with the tokens/s of the steps from 3 on without the
             profiler and under it, and the busy share estimated for an unprofiled step (unprofiled_reading)
  train      configs/large.json and configs/wt103_base.json shapes in bf16: step time, tokens/s, MFU, peak
             memory, for each implementation at micro batch 8 (flex after the first torch.compile'd case, which
             takes the fastest of the others); then for the fastest one the config accepts, micro batch 8/16/32
             with and without activation checkpointing, eager, then torch.compile'd (plain torch AdamW, no
             DeepSpeed); the compile's warm-up time and dynamo's graph count per case; and profiles of the
             fastest one's eager step and of its compiled step at the large presets' micro batch (16): the
             busiest kernels and the wall time summary, as the trainer's, each beside as many steps timed without
             the profiler (train_profile). --train-shapes, --train-batches and --train-impls run a subset (a
             focused call)

One deadline (start + --budget-s) holds for all: the phases run (--phases, in the order given) share it by
their PHASE_BUDGET weights; each phase gets its share plus what earlier phases left
(minus what they overran), deepspeed at least its share (the only end-to-end run of the product trainer),
and the last phase what is left. DIR receives only small files (the device tool brings back at most 8 files
of at most 16 MiB); the corpus and the trainer's run folders go to a temporary folder that is removed.
Every record has "phase" and "kind"; each phase ends with a {"kind": "phase", "status": ...} record
(ok, error, skipped, truncated or killed, with the reason). --cpu-smoke runs every phase at toy size on the
CPU (the trainer at toy widths, whatever --trainer-config names), and exits 1 when a phase ended in an error
or a trainer stage or CUDA test part exited non-zero (on a GPU those are recorded and the run goes on).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from txl_dist.config import ConfigError, MemorySettings, ModelConfig, load_config, validate_model
from txl_dist.flops import table_peak
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import tail_plan
from txl_dist.profiling import profiler_activities
from txl_dist.trace_summary import analyze, headline, operator_times, read_trace, shares_text, summary_line
from txl_dist.model import triton_attention
from txl_dist.model.attention import (ATTN_IMPLS, attn_mask_for, build_attn_mask, candidate_attn_impls,
                                      recompile_limit)

REPO = Path(__file__).resolve().parents[1]
JSONL = "gpu_check.jsonl"
TABLE = "gpu_check_table.txt"


# Per phase, in running order: share of the budget (seconds on the GPU); the smoke run gets the same shares
# of its own. deepspeed runs before train: train can use whatever is left, the trainer run cannot.
PHASE_BUDGET = {"env": 5, "matmul": 20, "attention": 45, "model": 30, "cuda_tests": 60, "deepspeed": 100,
                "train": 190}
SMOKE_BUDGET = {"env": 3, "matmul": 3, "attention": 8, "model": 10, "cuda_tests": 24, "deepspeed": 45, "train": 19}
"""The smoke run's shares: on a CPU the trainer's start-up (imports, DeepSpeed) dominates."""
GUARANTEED_PHASES = ("cuda_tests", "deepspeed")
"""Phases that get at least their own share even after earlier phases overran (the overrun is charged to
the phases after them)."""

FIRST_COMPILE_MIN_S = {"gpu": {"compile": 90.0, "flex": 60.0}, "smoke": {"compile": 5.0, "flex": 5.0}}
"""Seconds a train shape's time box must still hold before its first compiled case and before its first flex
case: their first steps compile (compile_layers: inductor forward and backward for two memory shapes; flex:
its kernels, for shapes the attention phase may not have had), a minute or two on a GPU, far longer than the
eager case before them that the usual guard (1.5 x the last case) goes by. The smoke run compiles with the
eager backend. The attention phase uses the flex entry too: flex in its second dtype (fp32) only with that
much left (the suite's CUDA tests check flex in fp32 as well)."""
COMPILING_IMPLS = ("flex",)
"""Attention implementations whose eager training steps compile (flex_attention's kernels, per shape)."""
TRAIN_RECOMPILE_LIMIT = 64
TRAIN_BATCHES = (8, 16, 32)
"""The train phase's micro batches (--train-batches picks some)."""
PRESET_MICRO_BATCH = 16
"""configs/large.json's micro batch: the train phase profiles its compiled step at this size."""
PROFILE_TOP_OPS = 15
"""Operators and kernels a train_profile record lists (by self time: device time on a GPU)."""
PROFILE_NAME_CHARS = 120
"""CUDA kernel names are C++ template instantiations: cut to this many characters."""
ATTENTION_PROFILE_TOP = 8
"""Kernels (operators on a CPU) an attention_profile record lists, by device time (self CPU time)."""
PROFILE_MIN_S = {"gpu": 20.0, "smoke": 3.0}
"""Time box left that a profile of the best eager case needs (4 steps and torch's summary of the events)."""
"""dynamo's recompile limit during the train phase. Its default (8) is below what the compiled matrix needs:
compile_layers uses static shapes, so every micro batch and memory shape, with and without checkpointing, is
a graph of its own, and past the limit dynamo runs the layer eagerly with only a warning (the row would
time eager code under the name compile)."""

DS_FIRST_STAGE_SHARE = 0.55
"""Of the deepspeed phase's time, what its first ZeRO stage may use, so that the second still runs."""
LOG_TAIL_BYTES = 200_000
"""What a DeepSpeed stage's log in DIR keeps of the trainer's output: its end."""
LOG_CUT_BYTES = 2_000_000
"""While the trainer runs, its log is cut back to its end whenever it grows past this (a kill of this
script then still leaves a small file)."""


class Recorder:
    """Appends JSON lines to DIR/gpu_check.jsonl, flushed line by line; keeps them for the table."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / JSONL
        self.records: list[dict[str, Any]] = []
        self.file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 3), **record}
        self.records.append(record)
        self.file.write(json.dumps(record, default=str) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        print(json.dumps(record, default=str), flush=True)


class Phase:
    """What a phase sees: the device, sizes, its own deadline, and the recorder (tagged with its name)."""

    def __init__(self, name: str, rec: Recorder, device: torch.device, smoke: bool, budget_s: float,
                 shared: dict[str, Any]):
        self.name, self.rec, self.device, self.smoke = name, rec, device, smoke
        self.deadline = time.monotonic() + budget_s
        self.shared = shared  # results later phases use (the matmul peak)
        self.first_compile_min_s = FIRST_COMPILE_MIN_S["smoke" if smoke else "gpu"]
        self.truncated: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self, kind: str, **fields: Any) -> None:
        self.rec.write({"phase": self.name, "kind": kind, **fields})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def timed(phase: Phase, fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved (load changes hit all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    phase.sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            phase.sync()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


# ----------------------------------------------------------------------------------------------------
# a. env


NO_DEEPSPEED_ENV = "TXL_GPU_CHECK_NO_DEEPSPEED"
"""Set by gpu_check.sh when DeepSpeed did not install or did not import within its time limit there: this
process then does not try (an import that hung would hang a phase with no time limit of its own)."""


def import_deepspeed() -> Any:
    reason = os.environ.get(NO_DEEPSPEED_ENV)
    if reason:
        raise ImportError(f"gpu_check.sh: {reason}")
    from txl_dist.deepspeed_import import deepspeed

    return deepspeed


def phase_env(p: Phase) -> None:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "device": str(p.device), "cpu": platform.processor(),
                            "cpu_count": os.cpu_count(), "attn_impls": sorted(ATTN_IMPLS)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    # What inductor and Triton build with (their kernels' launchers and CPU code): without them every compiled
    # path fails, and the failures' first lines do not say so.
    info["c_compiler"] = next(filter(None, (shutil.which(c) for c in (os.environ.get("CC"), "gcc", "cc") if c)), None)
    info["python_h"] = (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()
    try:
        info["deepspeed"] = import_deepspeed().__version__
    except Exception as e:  # noqa: BLE001  (absent or broken: the deepspeed phase records it)
        info["deepspeed"] = f"unavailable: {type(e).__name__}: {e}"[:200]
    if p.device.type == "cuda":
        props = torch.cuda.get_device_properties(p.device)
        free, total = torch.cuda.mem_get_info(p.device)
        info.update(device_name=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_total_gib=round(total / 2**30, 2), memory_free_gib=round(free / 2**30, 2))
    else:
        info.update(device_name="cpu", cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    threads=torch.get_num_threads())
    p.shared["device_name"] = info["device_name"]
    p.write("env", **info)


# ----------------------------------------------------------------------------------------------------
# b. matmul peak


def phase_matmul(p: Phase) -> None:
    n = 256 if p.smoke else 8192
    seconds = 0.2 if p.smoke else 3.0
    cases = [("bf16", torch.bfloat16, False), ("fp16", torch.float16, False), ("tf32", torch.float32, True),
             ("fp32", torch.float32, False)]
    for name, dtype, tf32 in cases:
        if p.left() < seconds + 1:
            p.truncated.append(name)
            continue
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            a = torch.randn(n, n, device=p.device, dtype=dtype)
            b = torch.randn(n, n, device=p.device, dtype=dtype)
            torch.mm(a, b)
            p.sync()
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for _ in range(10):
                    torch.mm(a, b)
                calls += 10
                p.sync()
            flops = 2 * n ** 3 * calls / (time.perf_counter() - start)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        p.shared[f"peak_{name}"] = flops
        p.write("matmul", dtype=name, n=n, tflops=round(flops / 1e12, 3), flop_per_s=flops)


# ----------------------------------------------------------------------------------------------------
# c. attention alone


def attention_inputs(shape: dict[str, int], device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, h, t, m, d = shape["batch"], shape["n_head"], shape["qlen"], shape["mlen"], shape["d_head"]
    k = t + m
    x = dict(q=torch.randn(b, t, h * d, generator=g), kv=torch.randn(b, k, 2 * h * d, generator=g),
             r_head_k=torch.randn(k, h * d, generator=g), r_w_bias=torch.randn(h, d, generator=g) * 0.1,
             r_r_bias=torch.randn(h, d, generator=g) * 0.1)
    return {name: v.to(device, torch.float64) for name, v in x.items()}


def trains_here(impl: str, device: torch.device) -> bool:
    """Whether an implementation has a backward on this device (FlexAttention has none on a CPU)."""
    return impl == "reference" or impl in candidate_attn_impls(device, torch.float32, training=True, dropatt=0.0)


def impls_here(device: torch.device) -> list[str]:
    """ATTN_IMPLS that run on this device: triton's kernels only on CUDA, where the triton package imports."""
    runnable = candidate_attn_impls(device, torch.float32, training=False, dropatt=0.0)
    return [impl for impl in ATTN_IMPLS if impl != "triton" or impl in runnable]


def attention_fwd_bwd(impl: str, x64: dict[str, torch.Tensor], grad64: torch.Tensor, bias_mask: torch.Tensor,
                      dtype: torch.dtype) -> tuple[Callable[[], None], Callable[[], dict[str, torch.Tensor]]]:
    """A timing closure and a closure returning float64 output + grads of one impl in one dtype (the output
    only, and a forward-only timing, where the impl has no backward on this device).

    Each gets the mask in the form the model gives it (attn_mask_for: flex its BlockMask, whose fully masked
    blocks are skipped, triton its KeyPattern, the others the additive bias); bias_mask is full memory
    (mlen = klen - qlen), without same_length."""
    x = {k: v.to(dtype).requires_grad_() for k, v in x64.items()}
    grad = grad64.to(dtype)
    qlen, klen = bias_mask.shape
    bias = attn_mask_for(impl, qlen, klen - qlen, klen - qlen, False, bias_mask.device, dtype)
    fn = ATTN_IMPLS[impl]
    if not trains_here(impl, bias_mask.device):
        def forward() -> torch.Tensor:
            with torch.no_grad():
                return fn(**x, attn_bias=bias)
        return forward, lambda: {"out": forward().double()}

    def run() -> None:
        torch.autograd.grad(fn(**x, attn_bias=bias), list(x.values()), grad)

    def result() -> dict[str, torch.Tensor]:
        out = fn(**x, attn_bias=bias)
        grads = torch.autograd.grad(out, list(x.values()), grad)
        return {"out": out.detach().double(), **{f"d_{k}": g.double() for k, g in zip(x, grads)}}

    return run, result


def max_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((got[k] - ref[k]).abs().max()) for k in got}


def phase_attention(p: Phase) -> None:
    shape = (dict(batch=2, n_head=2, qlen=16, mlen=16, d_head=8) if p.smoke
             else dict(batch=8, n_head=16, qlen=384, mlen=384, d_head=64))  # configs/large.json's attention
    x64 = attention_inputs(shape, p.device)
    grad64 = torch.randn(shape["batch"], shape["qlen"], shape["n_head"] * shape["d_head"],
                         generator=torch.Generator().manual_seed(1)).to(p.device, torch.float64)
    mask = build_attn_mask(shape["qlen"], shape["mlen"], shape["mlen"], False, p.device)
    oracle = attention_fwd_bwd("reference", x64, grad64, mask, torch.float64)[1]()
    reps = 3 if p.smoke else 10
    # bf16 first: what training runs in (flex compiles anew per dtype; fp32 is what an overrun gives up).
    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if p.left() < 5:
            p.truncated.append(dname)
            continue
        runs = {}
        for impl in impls_here(p.device):
            if impl in COMPILING_IMPLS and dname != "bf16" and p.left() < p.first_compile_min_s["flex"]:
                p.truncated.append(f"{impl}/{dname}")
                continue
            try:
                run, result = attention_fwd_bwd(impl, x64, grad64, mask, dtype)
                errors = max_errors(result(), oracle)
                runs[impl] = run
                p.write("attention_error", impl=impl, dtype=dname, **shape, forward_only=not trains_here(impl, p.device),
                        **{f"max_abs_{k}": v for k, v in errors.items()})
            except Exception as e:  # noqa: BLE001  (an impl that cannot run here is a result)
                p.write("attention_error", impl=impl, dtype=dname, error=one_line(e), trace=trace_tail())
        try:
            seconds = timed(p, runs, reps, warmup=2)
        except Exception as e:  # noqa: BLE001
            p.write("attention_time", dtype=dname, error=one_line(e), trace=trace_tail())
            continue
        ref = seconds.get("reference")
        for impl, s in seconds.items():
            # triton: the tiles its kernels' tuner picked on this device (txl_dist/model/triton_attention.py)
            extra = {"tiles": triton_attention.tuned_tiles()} if impl == "triton" else {}
            p.write("attention_time", impl=impl, dtype=dname, ms=round(s * 1e3, 3),
                    speedup_vs_reference=round(ref / s, 3) if ref else None, **extra)
        if dname == "bf16":
            for impl, run in runs.items():
                attention_profile(p, impl, run, dname)


def exported_trace(prof: torch.profiler.profile) -> dict[str, Any]:
    """A finished profiler's Chrome trace, read back (txl_dist/trace_summary.py analyses that form)."""
    with tempfile.TemporaryDirectory() as folder:
        prof.export_chrome_trace(f"{folder}/trace.json")
        return read_trace(f"{folder}/trace.json")


def attention_profile(p: Phase, impl: str, run: Callable[[], None], dtype_name: str) -> None:
    """One profiled call of an implementation after its timing: its time kernel by kernel (operators on a CPU).
    For triton, the measured side of bench/triton_census.py's issue floors (rel_attn_fwd, rel_attn_bwd_dkdv,
    rel_attn_bwd_dq) beside the position product's matmuls and the zero stores."""
    try:
        with torch.profiler.profile(activities=profiler_activities(p.device)) as prof:
            run()
            p.sync()
        sorted_by, ops = headline(operator_times(exported_trace(prof)), ATTENTION_PROFILE_TOP)
        p.write("attention_profile", impl=impl, dtype=dtype_name, sorted_by=sorted_by, ops=ops)
    except Exception as e:  # noqa: BLE001  (a profile that fails leaves the timings standing)
        p.write("attention_profile", impl=impl, dtype=dtype_name, error=one_line(e), trace=trace_tail())


# ----------------------------------------------------------------------------------------------------
# d. whole model correctness


def small_model_config(smoke: bool) -> ModelConfig:
    return ModelConfig(vocab_size=1000, n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128,
                       cutoffs=[200, 500], div_val=2, tgt_len=16, mem_len=16, dropout=0.0, dropatt=0.0)


def model_outputs(model: TransformerXL, impl: str, ids: torch.Tensor, labels: torch.Tensor,
                  memory: MemorySettings) -> dict[str, torch.Tensor]:
    """NLL of two training segments (mems carried) + grads of the second, and an eval segment's NLL (only the
    latter where the impl has no backward on this device)."""
    model.attn_impl = impl
    model.zero_grad(set_to_none=True)
    tgt = model.config.tgt_len
    if not trains_here(impl, ids.device):
        return {"nll_eval_last": eval_segments(model, ids, labels, memory)}
    out1 = model(ids[:, :tgt], labels[:, :tgt])
    out2 = model(ids[:, tgt:2 * tgt], labels[:, tgt:2 * tgt], out1.mems)
    out2.nll.float().mean().backward()
    res = {"nll1": out1.nll.detach().double(), "nll2": out2.nll.detach().double()}
    res.update({f"grad.{n}": prm.grad.double() for n, prm in model.named_parameters() if prm.grad is not None})
    res["nll_eval_last"] = eval_segments(model, ids, labels, memory)
    return res


def eval_segments(model: TransformerXL, ids: torch.Tensor, labels: torch.Tensor,
                  memory: MemorySettings) -> torch.Tensor:
    """The last segment's NLL after reading every segment with the evaluation's memory settings."""
    tgt = model.config.tgt_len
    with torch.no_grad():
        mems = None
        for s in range(ids.shape[1] // tgt):
            ev = model(ids[:, s * tgt:(s + 1) * tgt], labels[:, s * tgt:(s + 1) * tgt], mems, memory=memory)
            mems = ev.mems
    return ev.nll.double()


def phase_model(p: Phase) -> None:
    cfg = small_model_config(p.smoke)
    torch.manual_seed(0)
    base = TransformerXL(cfg).to(p.device).train()
    g = torch.Generator().manual_seed(2)
    n_seg = 4
    tokens = torch.randint(0, cfg.vocab_size, (2, n_seg * cfg.tgt_len + 1), generator=g).to(p.device)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    memory = MemorySettings(mem_len=3 * cfg.tgt_len, clamp_len=cfg.tgt_len, same_length=True)
    oracle = model_outputs(copy.deepcopy(base).double(), "reference", ids, labels, memory)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    # The reference first (each dtype's baseline), flex last and in bf16 only: it compiles for every key
    # length (6 graphs per dtype here) and must not eat the time of the others; the attention phase checks
    # flex in both dtypes.
    others = [i for i in impls_here(p.device) if i not in ("reference", "flex")]
    order = [(impl, d) for impl in ["reference", *others] for d in dtypes]
    order += [("flex", "bf16")] if "flex" in ATTN_IMPLS else []
    baselines: dict[str, dict[str, float]] = {}
    for impl, dname in order:
        if p.left() < 2:
            p.truncated.append(f"{impl}/{dname}")
            continue
        try:
            got = model_outputs(copy.deepcopy(base).to(dtypes[dname]), impl, ids, labels, memory)
        except Exception as e:  # noqa: BLE001
            p.write("model_error", impl=impl, dtype=dname, error=one_line(e), trace=trace_tail())
            continue
        errs = {"max_abs_nll_eval": float((got["nll_eval_last"] - oracle["nll_eval_last"]).abs().max())}
        if "nll1" in got:
            errs["max_abs_nll"] = max(float((got[k] - oracle[k]).abs().max()) for k in ("nll1", "nll2"))
            errs["max_rel_grad"] = max(float((got[k] - oracle[k]).norm() / oracle[k].norm().clamp_min(1e-30))
                                       for k in oracle if k.startswith("grad."))
        if impl == "reference":
            baselines[dname] = errs
        # An implementation is as good as the einsum reference in the same dtype, within a margin.
        baseline = baselines.get(dname)
        ok = baseline is not None and all(v <= 4 * baseline[k] + 1e-6 for k, v in errs.items())
        p.write("model_error", impl=impl, dtype=dname, ok=ok, forward_only="nll1" not in got, **errs)


# ----------------------------------------------------------------------------------------------------
# e. training steps at the shipped shapes


def flops_per_token(cfg: ModelConfig, batch: int, labels: torch.Tensor, dense_tails: bool) -> tuple[float, str]:
    """Model FLOPs per token as the product counts them for train/mfu (dense_tails: the adaptive softmax runs
    every token through every tail, as it does on a GPU when the tails are cheap enough)."""
    from txl_dist.flops import cluster_token_shares, flops_per_token as product_count

    shares = cluster_token_shares(labels.cpu().numpy().ravel(), cfg.cutoffs, cfg.vocab_size)
    return (product_count(cfg, micro_batch=batch, cluster_shares=shares, tail_mode="dense" if dense_tails else "gather"),
            "txl_dist.flops.flops_per_token")


def train_shapes(smoke: bool) -> dict[str, ModelConfig]:
    shapes = {}
    for name, path in (("large", "configs/large.json"), ("base", "configs/wt103_base.json")):
        cfg = load_config(REPO / path).model
        if smoke:
            cfg = dataclasses.replace(cfg, vocab_size=2000, n_layer=2, d_model=32, n_head=2, d_head=8, d_inner=64,
                                      d_embed=32, cutoffs=[500, 1000], tgt_len=16, mem_len=16)
        shapes[name] = cfg
    return shapes


def config_refusal(cfg: ModelConfig, impl: str) -> str | None:
    """The config's own one-line refusal of training this shape with this attention implementation (flex
    with dropatt > 0), or None: a setting the product refuses is never recommended."""
    try:
        validate_model(dataclasses.replace(cfg, attn_impl=impl))
    except ConfigError as e:
        return str(e)
    return None


class DynamoWatch(logging.Handler):
    """Over one case: how many graphs dynamo compiled, and how often it hit a recompile limit (after which it
    runs that code eagerly, saying so only in a warning: a compiled row would time eager code)."""

    def __enter__(self) -> DynamoWatch:
        from torch._dynamo.utils import counters

        self.counters = counters
        self.graphs_before = counters["stats"]["unique_graphs"]
        self.limit_hits = 0
        self.logger = logging.getLogger("torch._dynamo")
        self.logger.addHandler(self)
        return self

    def emit(self, record: logging.LogRecord) -> None:
        if "hit config." in record.getMessage():  # "torch._dynamo hit config.recompile_limit (8)"
            self.limit_hits += 1

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)

    def stats(self) -> dict[str, int]:
        return {"dynamo_graphs": self.counters["stats"]["unique_graphs"] - self.graphs_before,
                "recompile_limit_hits": self.limit_hits}


class TrainCase:
    """One model + optimizer in bf16 on the device, stepping over random Zipf tokens with carried mems."""

    def __init__(self, p: Phase, cfg: ModelConfig, compiled: bool):
        self.p, self.cfg = p, cfg
        torch.manual_seed(0)
        self.model = TransformerXL(cfg).to(p.device, torch.bfloat16).train()
        self.compile_via = None
        if compiled:
            if hasattr(self.model, "compile_layers"):
                # The smoke run checks the wiring; inductor's C++ build on a CPU is tested elsewhere
                # (tests/test_model_transformer.py) and would eat the smoke run's time box.
                self.model.compile_layers(**({"backend": "eager"} if p.smoke else {}))
                self.compile_via = "TransformerXL.compile_layers" + (" (eager backend)" if p.smoke else "")
            else:  # the product has no switch yet: what compiling each layer would give
                for layer in self.model.layers:  # the smoke run checks the wiring, not inductor's C++ build
                    layer.compile(backend="eager" if p.smoke else "inductor")
                self.compile_via = "nn.Module.compile per layer (TransformerXL has no compile_layers)"
        fused = p.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)

    def _setup(self, impl: str, checkpointing: bool) -> float:
        """The model set to this case; the attention dropout it trains with."""
        model = self.model
        model.attn_impl = impl
        # FlexAttention has no attention dropout (the config refuses flex with dropatt > 0): time it at
        # dropatt 0 and say so in the record; the other paths keep the preset's dropatt.
        dropatt = 0.0 if impl == "flex" else self.cfg.dropatt
        for layer in model.layers:
            layer.attn.dropatt = dropatt
        model.set_activation_checkpointing(enabled=checkpointing)
        return dropatt

    def _stepper(self, batch: int, n: int) -> tuple[Callable[[int], None], torch.Tensor]:
        """step(i) trains on segment i of n random Zipf segments [batch, tgt_len] with the carried mems; and
        the labels [n, batch, tgt_len]."""
        p, cfg, model = self.p, self.cfg, self.model
        g = torch.Generator().manual_seed(3)
        zipf = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64)
        tokens = torch.multinomial(zipf, n * batch * cfg.tgt_len + batch, replacement=True, generator=g)
        tokens = tokens[: n * batch * cfg.tgt_len].view(n, batch, cfg.tgt_len)
        labels = tokens.roll(-1, dims=2)
        # The trainer's path: each micro batch's TailPlan made from the host labels (no host sync in the
        # adaptive softmax, its tails in "gather" mode).
        plans = [tail_plan(labels[i].numpy(), cfg.cutoffs, p.device) if cfg.cutoffs else None for i in range(n)]
        tokens, labels = tokens.to(p.device), labels.to(p.device)
        mems = None

        def step(i: int) -> None:
            nonlocal mems
            out = model(tokens[i], labels[i], mems, tail_plan=plans[i])
            out.nll.float().mean().backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            mems = out.mems

        return step, labels

    def profile(self, impl: str, batch: int, steps: int) -> dict[str, Any]:
        """`steps` training steps (after two unrecorded ones: the first has no memory) under torch.profiler:
        the busiest operators and kernels by self time (device time on a GPU), as the trainer's
        train.profile_steps logs them (txl_dist/profiling.py)."""
        p = self.p
        self._setup(impl, checkpointing=False)
        step, labels = self._stepper(batch, 2 * steps + 2)
        step(0)
        step(1)
        p.sync()
        # As many steps unprofiled first: the profiler's own host work slows a host-bound step, and the busy
        # share the trace gives is read against them too (unprofiled_reading).
        start = time.perf_counter()
        for i in range(2, steps + 2):
            step(i)
        p.sync()
        step_ms_unprofiled = (time.perf_counter() - start) / steps * 1e3
        with torch.profiler.profile(activities=profiler_activities(p.device)) as prof:
            for i in range(steps + 2, 2 * steps + 2):
                with torch.profiler.record_function(f"ProfilerStep#{i}"):  # the trainer's step spans
                    step(i)
            p.sync()
        times, summary = analyze(exported_trace(prof), PROFILE_TOP_OPS)
        sorted_by, ops = headline(times, PROFILE_TOP_OPS)
        for op in ops:
            op["name"] = op["name"][:PROFILE_NAME_CHARS]
        fpt, _ = flops_per_token(self.cfg, batch, labels, self._dense_tails())
        return dict(sorted_by=sorted_by, steps=steps, ops=ops, summary=summary,
                    **unprofiled_reading(summary, step_ms_unprofiled, fpt * batch * self.cfg.tgt_len))

    def _dense_tails(self) -> bool:
        """Whether this case's adaptive softmax runs its tails dense (the FLOPs it counts depend on it)."""
        return self.model.crit.resolved_tail_mode(self.p.device, planned=True) == "dense"

    def run(self, impl: str, batch: int, checkpointing: bool, warmup: int, steps: int) -> dict[str, Any]:
        p, cfg = self.p, self.cfg
        dropatt = self._setup(impl, checkpointing)
        n = warmup + steps
        step, labels = self._stepper(batch, n)
        if p.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(p.device)
        start_all = time.perf_counter()

        with DynamoWatch() as dynamo:
            for i in range(warmup):  # the first segment has no memory: shapes settle from the second on
                step(i)
            p.sync()
            warm_s = time.perf_counter() - start_all
            start = time.perf_counter()
            for i in range(warmup, n):
                step(i)
            p.sync()
        step_s = (time.perf_counter() - start) / steps
        tok_s = batch * cfg.tgt_len / step_s
        dense = self._dense_tails()
        fpt, counter = flops_per_token(cfg, batch, labels, dense)
        # compile_s: what the warm-up steps took beyond as many steady steps (compiles, autotuning).
        rec = dict(step_ms=round(step_s * 1e3, 2), tokens_per_s=round(tok_s), warmup_s=round(warm_s, 2),
                   compile_s=round(max(0.0, warm_s - warmup * step_s), 2), dropatt=dropatt, config_dropatt=cfg.dropatt,
                   model_tflops=round(fpt * tok_s / 1e12, 2), flops_per_token=round(fpt), flop_counter=counter,
                   softmax_tails="dense" if dense else "gather", **dynamo.stats())
        peak = p.shared.get("peak_bf16")
        if peak:
            rec["mfu_measured_peak"] = round(fpt * tok_s / peak, 4)
        spec = table_peak(str(p.shared.get("device_name", "")), torch.bfloat16)  # the product's own table
        if spec:
            rec["mfu_spec_peak"] = round(fpt * tok_s / spec[0], 4)
        if p.device.type == "cuda":
            rec["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(p.device) / 2**30, 2)
        return rec


def unprofiled_reading(summary: dict[str, Any] | None, step_ms_unprofiled: float | None,
                       flops_per_step: float | None = None) -> dict[str, Any]:
    """A profile window read against the same steps timed without the profiler: its slowdown (profiled over
    unprofiled step time), and on a GPU the device's busy share of an unprofiled step, estimated as the window's
    device busy time per step over the unprofiled step time (the kernels take about as long either way; the
    profiler adds host work, which lowers the busy share of a host-bound step under it). With the model's
    FLOPs per step (all matrix products: txl_dist/flops.py), also the matmul kernels' time per step, their
    share of an unprofiled step and the FLOP/s they ran at: MFU is about that share times that rate over the
    peak, so the two say whether the GEMMs are slow or the rest of the step is long."""
    if not step_ms_unprofiled:
        return {}
    out: dict[str, Any] = {"step_ms_unprofiled": round(step_ms_unprofiled, 3)}
    if summary and summary.get("step_ms"):
        n = len(summary["step_ms"])
        profiled = sum(summary["step_ms"]) / n
        out["step_ms_profiled"] = round(profiled, 3)
        # Significant digits, not decimals: a ratio far below 1 (a slow unprofiled window: compilation, load)
        # rounded to 3 decimals was 1.4% off the step times it is read with (0.03 for 0.0296).
        out["profiler_slowdown"] = float(f"{profiled / step_ms_unprofiled:.4g}")
        if device := summary.get("device"):
            out["busy_share_unprofiled_est"] = round(min(1.0, device["busy_ms"] / n / step_ms_unprofiled), 4)
            matmul_ms = sum(k["ms"] for k in device.get("kinds", []) if k["name"] == "matmul") / n
            if matmul_ms > 0:
                out["matmul_ms_per_step"] = round(matmul_ms, 3)
                out["matmul_share_unprofiled_est"] = round(min(1.0, matmul_ms / step_ms_unprofiled), 4)
                if flops_per_step:
                    out["matmul_tflops_est"] = round(flops_per_step / (matmul_ms / 1e3) / 1e12, 1)
    return out


class TrainMatrix:
    """One shape's training cases inside its time box. A case starts only if one as long as the last of its
    kind (eager, compiled) still fits, or, before the first compiled case and the first flex case,
    FIRST_COMPILE_MIN_S. One model (with its optimizer state) is resident at a time: building the eager one
    frees the compiled one and the other way round (peak memory is per model)."""

    def __init__(self, p: Phase, name: str, cfg: ModelConfig, box: float, warmup: int, steps: int,
                 impls: list[str]):
        self.p, self.name, self.cfg, self.box, self.warmup, self.steps = p, name, cfg, box, warmup, steps
        self.refused = {impl: reason for impl in impls if (reason := config_refusal(cfg, impl))}
        """The config's refusals among impls (flex with dropatt > 0): timed for information, never recommended."""
        self.eager: TrainCase | None = None
        self.compiled: TrainCase | None = None
        self.flex_started = False
        self.estimate_s = {False: 0.0, True: 0.0}
        """What the next eager / compiled case will take, from the last one: an eager case's compiles (flex's
        first shapes) are not repeated, a compiled case's are (each micro batch is a new graph)."""

    def run(self, impl: str, batch: int, checkpointing: bool, use_compile: bool) -> dict[str, Any] | None:
        """Runs one case and writes its record; returns it, or None when it was skipped or failed."""
        p = self.p
        key = dict(shape=self.name, impl=impl, micro_batch=batch, checkpointing=checkpointing, compile=use_compile)
        needed = 1.5 * self.estimate_s[use_compile]
        if use_compile and self.compiled is None:
            needed = max(needed, p.first_compile_min_s["compile"])
        if impl == "flex" and not self.flex_started:
            needed = max(needed, p.first_compile_min_s["flex"])
        left = self.box - time.monotonic()
        if needed > left:
            p.write("train_step", **key, skipped=f"time box: {left:.0f} s left, {needed:.0f} s needed")
            p.truncated.append(f"{self.name}/{impl}/mb{batch}/ckpt{int(checkpointing)}/compile{int(use_compile)}")
            return None
        self.flex_started |= impl == "flex"
        t0 = time.perf_counter()
        rec = None
        try:
            if use_compile and self.compiled is None:
                self.free(compiled=False)
                self.compiled = TrainCase(p, self.cfg, compiled=True)
            elif not use_compile and self.eager is None:
                self.free(compiled=True)
                self.eager = TrainCase(p, self.cfg, compiled=False)
            runner = self.compiled if use_compile else self.eager
            rec = runner.run(impl, batch, checkpointing, self.warmup, self.steps)
            if use_compile:
                rec["compile_via"] = runner.compile_via
            if impl in self.refused:
                rec["config_refuses"] = self.refused[impl]
            rec["case_s"] = round(time.perf_counter() - t0, 2)  # building the model included
            p.write("train_step", **key, **rec)
            # flex recompiles for each new micro batch even eagerly (static shapes): its estimate keeps them
            again = use_compile or impl == "flex"
            self.estimate_s[use_compile] = rec["case_s"] - (0.0 if again else rec["compile_s"])
        except torch.cuda.OutOfMemoryError:
            rec = None
            p.write("train_step", **key, error="out of memory")
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            rec = None
            p.write("train_step", **key, error=one_line(e), trace=trace_tail())
        if rec is None:
            self.estimate_s[use_compile] = time.perf_counter() - t0
        return rec

    def profile(self, impl: str, batch: int, compiled: bool = False) -> None:
        """Writes a train_profile record: the busiest kernels (operators on a CPU) of `impl`'s steps, eager or
        compiled, and where their wall time went (trace_summary: the device's busy share, host waits,
        launches), where time allows."""
        p = self.p
        key = dict(shape=self.name, impl=impl, micro_batch=batch, checkpointing=False, compile=compiled)
        left, needed = self.box - time.monotonic(), PROFILE_MIN_S["smoke" if p.smoke else "gpu"]
        if needed > left:
            p.write("train_profile", **key, skipped=f"time box: {left:.0f} s left, {needed:.0f} s needed")
            return
        t0 = time.perf_counter()
        try:
            if compiled and self.compiled is None:
                self.free(compiled=False)
                self.compiled = TrainCase(p, self.cfg, compiled=True)
            elif not compiled and self.eager is None:  # the eager cases that follow use it too
                self.free(compiled=True)
                self.eager = TrainCase(p, self.cfg, compiled=False)
            rec = (self.compiled if compiled else self.eager).profile(impl, batch, steps=2)
            p.write("train_profile", **key, **rec, seconds=round(time.perf_counter() - t0, 2))
        except Exception as e:  # noqa: BLE001 - a profile is information: the cases after it still run
            p.write("train_profile", **key, error=one_line(e), trace=trace_tail())

    def free(self, compiled: bool) -> None:
        """Drop one of the two models (and its optimizer state): only one is resident while a case runs."""
        if compiled:
            self.compiled = None
        else:
            self.eager = None
        gc.collect()
        if self.p.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.compiled = None  # the device memory goes before the next shape
        self.free(compiled=False)


def phase_train(p: Phase, shapes: list[str] | None = None, batches: list[int] | None = None,
                impls: list[str] | None = None) -> None:
    with recompile_limit(TRAIN_RECOMPILE_LIMIT):
        train_matrix(p, shapes, batches, impls)


TRAIN_IMPLS = tuple(i for i in ATTN_IMPLS if i != "reference")  # the oracle's speed is not a product question


def train_matrix(p: Phase, only_shapes: list[str] | None = None, only_batches: list[int] | None = None,
                 only_impls: list[str] | None = None) -> None:
    """Each shape's cases (--train-shapes, --train-batches, --train-impls: a subset, for a focused call)."""
    impls = [i for i in TRAIN_IMPLS if not only_impls or i in only_impls]
    no_backward = [i for i in impls if not trains_here(i, p.device)]
    impls = [i for i in impls if trains_here(i, p.device)]
    batches = tuple(only_batches or ((2,) if p.smoke else TRAIN_BATCHES))
    profiled_batch = PRESET_MICRO_BATCH if PRESET_MICRO_BATCH in batches else batches[len(batches) // 2]
    warmup, steps = (1, 1) if p.smoke else (3, 5)
    shapes = {k: v for k, v in train_shapes(p.smoke).items() if not only_shapes or k in only_shapes}
    share = {"large": 0.6, "base": 0.4}
    for index, (name, cfg) in enumerate(shapes.items()):
        for impl in no_backward:
            p.write("train_step", shape=name, impl=impl, micro_batch=batches[0], checkpointing=False, compile=False,
                    skipped=f"{impl} does not train on {p.device.type}")
        # This shape's share of what is left, among the shapes still to run.
        share_now = share[name] / sum(share[n] for n in list(shapes)[index:])
        matrix = TrainMatrix(p, name, cfg, time.monotonic() + share_now * max(0.0, p.left()), warmup, steps, impls)
        # What the config refuses is timed last, for information only: it can never be the recommendation, and
        # its first case compiles.
        refused = matrix.refused
        survey: dict[str, float] = {}

        def survey_of(candidates: list[str]) -> None:
            for impl in candidates:
                if impl not in refused and (rec := matrix.run(impl, batches[0], False, False)):
                    survey[impl] = rec["step_ms"]

        # The implementations whose eager steps compile nothing first, then the first compiled case (it needs
        # the most time left: FIRST_COMPILE_MIN_S) with the fastest of them, then those that compile (flex):
        # the attention phase has timed flex already, the compiled layers are timed nowhere else.
        survey_of([i for i in impls if i not in COMPILING_IMPLS])
        compiled_first = min(survey, key=survey.get) if survey else None
        if compiled_first:
            matrix.run(compiled_first, batches[0], False, True)
        survey_of([i for i in impls if i in COMPILING_IMPLS])
        if survey:
            best = min(survey, key=survey.get)
            p.shared[name] = {"best": best}
            p.write("train_best", shape=name, impl=best, survey_step_ms=survey, refused=refused)
            matrix.profile(best, batches[0])  # where its step's time goes: for the next optimization
            # The fastest implementation: the eager rest, then the compiled cases not run yet.
            for use_compile in (False, True):
                for batch in batches:
                    for checkpointing in (False, True):
                        done = (batch, checkpointing) == (batches[0], False) and (
                            not use_compile or best == compiled_first)
                        if not done:
                            matrix.run(best, batch, checkpointing, use_compile)
            # The compiled step the large presets run, beside the trainer's profile (phase_deepspeed): the same
            # kernels, so a difference in the device's busy share is the trainer's host side.
            matrix.profile(best, profiled_batch, compiled=True)
        else:
            p.write("train_best", shape=name, impl=None, survey_step_ms=survey, refused=refused,
                    reason="no implementation the config accepts ran")
        for impl in refused:
            matrix.run(impl, batches[0], False, False)
        matrix.close()


# ----------------------------------------------------------------------------------------------------
# f. the CUDA tests of the suite

HOST_SYNCS_AT_ZERO2 = ("tests/test_host_syncs.py::"
                       "test_deepspeed_does_not_wait_for_the_device_inside_a_step_of_one_rank[2]")
CUDA_TEST_PARTS = (("cuda_tests.log", "not flex", ("tests/test_gpu.py", "tests/test_triton_attention.py",
                                                  HOST_SYNCS_AT_ZERO2)),
                   ("cuda_tests_flex.log", "flex", ("tests/test_gpu.py",)))
"""The CUDA tests in two pytest runs (log name, -k selection, files or test ids): tests/test_gpu.py, the fused
Triton kernels compiled for the device (tests/test_triton_attention.py), and the tiny trainer's DeepSpeed waits
for the device inside a step at the GPU presets' ZeRO 2 (CUDA takes waits that the CPU skips; a trainer start
of ~15 s, so one stage only); flex's tests compile per shape and dtype, so they come second and get what the
first part left."""
INTERPRETED_ON_CPU = ("tests/test_triton_attention.py",)
"""Files that a CPU runs in Triton's interpreter (~15 s, and the suite runs them anyway): --cpu-smoke leaves
them out of its toy-sized time box."""
PYTEST_OUTCOME = re.compile(r"^(tests/\w+\.py::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", re.M)


def phase_cuda_tests(p: Phase, out: Path, parts: list[str] | None = None) -> None:
    """A "cuda_tests" record per part: the outcome counts, the failed tests with pytest's one-line reasons, and
    the exit status ("timeout" when the time box ended it: the log says how far it got)."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        p.write("cuda_tests", skipped="pytest is not installed")
        raise Skipped("pytest unavailable")
    if p.device.type == "cuda":
        torch.cuda.empty_cache()  # this process's cached blocks: the tests run in a process of their own
    # DeepSpeed's CUDA accelerator for the trainer tests (tests/conftest.py defaults to the CPU one, under which
    # the trainer runs on the CPU, GPU or not: distributed.uses_cuda).
    env = child_env(**({"DS_ACCELERATOR": "cuda"} if p.device.type == "cuda" else {}))
    for log_name, selection, files in CUDA_TEST_PARTS:
        if parts is not None and selection not in parts:
            continue
        if p.left() < 10:
            p.truncated.append(selection)
            continue
        if p.device.type != "cuda":
            files = tuple(f for f in files if f not in INTERPRETED_ON_CPU)
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-k", selection, *files]
        start = time.perf_counter()
        code = run_logged(cmd, env, out / log_name, p.left())
        text = (out / log_name).read_text(errors="replace")
        outcomes = Counter(outcome.lower() for _, outcome in PYTEST_OUTCOME.findall(text))
        reasons = [ln.strip()[:300] for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        p.write("cuda_tests", selection=selection, files=list(files), exit=code,
                seconds=round(time.perf_counter() - start, 1), log=log_name, **outcomes, failures=reasons[:20])


# ----------------------------------------------------------------------------------------------------
# g. the project's own trainer through DeepSpeed


def phase_deepspeed(p: Phase, out: Path, scratch: Path, *, config: str | None = None,
                    stages: list[int] | None = None, steps: int | None = None, extra_sets: list[str] | None = None
                    ) -> None:
    """Each ZeRO stage: a "deepspeed_started" record, the trainer's output streamed to DIR/deepspeed_zero<N>.log,
    then a "deepspeed" record (also after a timeout or a SIGTERM). The corpus and the run folder (the trainer
    saves a checkpoint at its last step, GBs at the base shape) live under scratch; each run folder is removed
    after its stage. The --trainer-* options may name another config, stages, step count and extra --set
    overrides, put after the phase's own (a preset's end-to-end check)."""
    try:
        import_deepspeed()
    except Exception as e:  # noqa: BLE001
        p.write("deepspeed", skipped=f"deepspeed does not import: {one_line(e)}")
        raise Skipped("deepspeed unavailable")
    from bench.synthetic_corpus import write_corpus
    from txl_dist.data.format import Layout

    cfg_path = config or ("configs/tiny.json" if p.smoke else "configs/wt103_base.json")
    base = load_config(REPO / cfg_path)
    vocab = 1000 if p.smoke else base.model.vocab_size
    streams = base.deepspeed["train_batch_size"]
    steps = steps or (4 if p.smoke else 8)
    tgt = base.model.tgt_len
    corpus = scratch / "corpus"
    if not (corpus / "manifest.json").exists():
        n_train = streams * (tgt * (steps + 2) + 1)
        write_corpus(corpus, {"train": n_train, "valid": 8 * tgt * 3 + 8, "test": 8 * tgt * 3 + 8}, vocab,
                     Layout(1, streams))
    stages = tuple(stages or ((1,) if p.smoke else (1, 2)))
    for index, stage in enumerate(stages):
        run_dir = scratch / f"run-zero{stage}"
        log_path = out / f"deepspeed_zero{stage}.log"
        sets = [f"data.path={corpus}", f"run.dir={run_dir}", "tracking.enabled=false", f"train.max_steps={steps}",
                "train.log_interval=1", "eval.interval=0", "eval.at_end=false",
                "eval.max_segments=2", "eval.n_streams=1", "checkpoint.interval=0",
                f"deepspeed.zero_optimization.stage={stage}", "deepspeed.optimizer.params.torch_adam=true",
                # "auto" would time flex at start-up (a compile inside this phase's box); the attention paths
                # are the other phases' business, the trainer end to end is this one's.
                "model.attn_impl=matmul"]
        if p.smoke:
            sets += [f"model.vocab_size={vocab}", "model.cutoffs=[200,500]", *SMOKE_TRAINER_WIDTHS,
                     "train.precision=fp32", "train.compile=false"]
            # A GPU preset's deepspeed section names bf16 (or fp16): train.precision decides here.
            sets += [f"deepspeed.{k}.enabled=false" for k in ("bf16", "fp16") if k in base.deepspeed]
        sets += extra_sets or []
        if window := trainer_profile_window(steps):
            sets.append(f"train.profile_steps=[{window[0]},{window[1]}]")
        cmd = [sys.executable, "launch/train.py", "--config", cfg_path, "--resume", "none"]
        for s in sets:
            cmd += ["--set", s]
        last = index == len(stages) - 1
        timeout_s = p.left() if last else p.left() * DS_FIRST_STAGE_SHARE
        if timeout_s < 20:
            p.write("deepspeed", zero_stage=stage, skipped=f"time box: {timeout_s:.0f} s for this stage")
            p.truncated.append(f"zero{stage}")
            continue
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        p.write("deepspeed_started", zero_stage=stage, timeout_s=round(timeout_s, 1), log=log_path.name,
                argv=cmd[1:])
        start = time.perf_counter()
        try:
            code = run_logged(cmd, env, log_path, timeout_s)
        except Terminated:
            p.write("deepspeed", zero_stage=stage, exit="killed: SIGTERM (overall time box)",
                    seconds=round(time.perf_counter() - start, 1), **trainer_progress(log_path))
            raise
        finally:
            summaries = profile_summaries(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
        progress = trainer_progress(log_path, tail_chars=2000 if code != 0 else 0)
        summary = summaries[0] if summaries else None
        unprofiled_s = progress.get("step_s_unprofiled")
        p.write("deepspeed", zero_stage=stage, exit=code, seconds=round(time.perf_counter() - start, 1), **progress,
                **({"profile_summary": summary} if summary else {}),
                **unprofiled_reading(summary, unprofiled_s and unprofiled_s * 1e3, progress.get("flops_per_step")))


def unprofiled_text(rec: dict[str, Any]) -> str | None:
    """unprofiled_reading's numbers in a record, as a table line."""
    if "profiler_slowdown" not in rec:
        return None
    busy, matmul = rec.get("busy_share_unprofiled_est"), rec.get("matmul_share_unprofiled_est")
    return (f"unprofiled {rec['step_ms_unprofiled']:.1f} ms/step, profiled {rec['step_ms_profiled']:.1f} "
            f"(x{rec['profiler_slowdown']:.2f})" + (f"; device busy ~{busy:.1%} of an unprofiled step" if busy else "")
            + (f", matmul kernels ~{matmul:.1%}" if matmul else "")
            + (f" at {rec['matmul_tflops_est']:g} TFLOP/s" if rec.get("matmul_tflops_est") else ""))


SMOKE_TRAINER_WIDTHS = ("model.d_model=32", "model.d_embed=32", "model.n_head=2", "model.d_head=16",
                        "model.d_inner=64", "model.tgt_len=16", "model.mem_len=16")
"""The smoke run's trainer at toy widths, whatever --trainer-config names (a GPU preset keeps its depth, its
micro steps and its ZeRO settings: the wiring the smoke run checks)."""


def trainer_profile_window(steps: int) -> tuple[int, int] | None:
    """The trainer's profile window (the product's own, CUDA kernels included) for a stage of `steps` steps:
    two steps with two unprofiled ones after them (six or more steps; the first two compile and have no memory
    yet), else the last two but the last; none under 3 steps (profile_steps start at 1)."""
    if steps >= 6:
        return steps - 3, steps - 2
    return (steps - 2, steps - 1) if steps >= 3 else None


def profile_summaries(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer's profile summaries in run_dir (txl_dist/profiling.py writes one per profiling rank)."""
    out = []
    for path in sorted(run_dir.glob("profile/*/rank*.summary.json")):
        try:
            out.append(json.loads(path.read_text())["summary"])
        except (OSError, ValueError, KeyError):
            continue
    return out


PROGRESS_LINE = re.compile(r"step (\d+)/\d+ \|.* ([\d.]+) tok/s \| ([\d.]+) ([MGTP])FLOP/s \|.* ([\d.]+) s/step \|")
FLOPS_UNITS = {"M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
FIRST_STEADY_STEP = 3
"""The trainer's first step whose rate counts: step 1 has no memory yet, steps 1 and 2 compile."""


def trainer_progress(log_path: Path, tail_chars: int = 0) -> dict[str, Any]:
    """From the trainer's log (one progress line per step, train.log_interval 1): its last progress lines, its
    last tokens/s, and the medians of its steady steps' tokens/s and seconds per step apart for the steps under
    the profiler (whose lines end "| profiled"); with tail_chars, also the log's last characters (a failed
    run's error), from the same read."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    progress = [ln.strip() for ln in text.splitlines() if "tok/s" in ln]
    rates: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}  # tok/s, s/step, FLOPs/step
    tok_s = []
    for line in progress:
        if m := PROGRESS_LINE.search(line):
            tok_s.append(float(m.group(2)))
            if int(m.group(1)) >= FIRST_STEADY_STEP:
                step_s = float(m.group(5))
                flops = float(m.group(3)) * FLOPS_UNITS[m.group(4)] * step_s
                rates[line.endswith("| profiled")].append((tok_s[-1], step_s, flops))
    # The profile's "written to" line; its summary line reaches the record from the run folder (profile_summaries).
    profile = [ln.strip() for ln in text.splitlines() if "profile of steps" in ln and " written to " in ln]
    result = {"tokens_per_s_last": tok_s[-1] if tok_s else None, "progress": progress[-3:], "profile": profile[-1:]}
    for profiled, suffix in ((False, "unprofiled"), (True, "profiled")):
        if rates[profiled]:
            result[f"tokens_per_s_{suffix}"] = statistics.median(r[0] for r in rates[profiled])
            result[f"step_s_{suffix}"] = statistics.median(r[1] for r in rates[profiled])
    if rates[False]:  # the model's FLOPs per step (the same every step; the line's rounding aside)
        result["flops_per_step"] = statistics.median(r[2] for r in rates[False])
    if tail_chars:
        result["tail"] = text[-tail_chars:]
    return result


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that imports the repository (txl_dist, launch/), unbuffered."""
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1",
                **extra)


def run_logged(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> int | str:
    """Runs cmd in a process group of its own, its output copied to log_path as it comes (LogCopier); at the
    end (its exit, timeout_s, or this script being stopped) whatever is left of the group is killed. Returns
    the exit status, or "timeout"."""
    proc: subprocess.Popen | None = None
    copier: LogCopier | None = None
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, process_group=0)
        copier = LogCopier(proc.stdout, log_path)
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        if proc is not None:
            # SIGKILL, not SIGTERM: the trainer answers SIGTERM by saving a checkpoint first. Also after a
            # normal exit: a child left in the group (a compile worker) would hold the log's pipe.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if copier is not None:
            copier.join()


class LogCopier:
    """Copies a child's output to a file as it comes, so that a kill leaves what was written. The file is cut
    back to its last LOG_TAIL_BYTES whenever it passes LOG_CUT_BYTES, and once more at the end: the device
    tool brings back no file over 16 MiB, and with too much in DIR nothing at all."""

    CUT = b"[gpu_check: the start of this output was cut; its end follows]\n"

    def __init__(self, stream: Any, path: Path):
        self.stream, self.path = stream, path
        self.thread = threading.Thread(target=self.copy, name=f"log {path.name}", daemon=True)
        self.thread.start()

    def copy(self) -> None:
        tail = bytearray()
        size = 0
        with self.path.open("wb") as f:
            while chunk := os.read(self.stream.fileno(), 65536):
                f.write(chunk)
                f.flush()
                size += len(chunk)
                tail += chunk
                del tail[:-LOG_TAIL_BYTES]
                if size > LOG_CUT_BYTES:
                    size = self.rewrite(f, tail)
            if size > LOG_TAIL_BYTES:
                self.rewrite(f, tail)
        self.stream.close()

    def rewrite(self, f: Any, tail: bytearray) -> int:
        f.seek(0)
        f.truncate()
        f.write(self.CUT + tail)
        f.flush()
        return len(self.CUT) + len(tail)

    def join(self) -> None:
        self.thread.join(timeout=10)  # the group is dead, so the pipe is at its end


# ----------------------------------------------------------------------------------------------------


class Skipped(Exception):
    """A phase that cannot run here (its record says why)."""


class Terminated(BaseException):
    """SIGTERM (gpu_check.sh's overall time box): stop, but still write the table."""


def _terminate(signum: int, frame: Any) -> None:
    # GNU timeout sends SIGTERM to this process and then to its whole group: the second one must not raise
    # again inside the cleanup (the record, the group kill, the table).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def free_port() -> int:
    """A TCP port that was free a moment ago (the default 29500 may belong to another job on the machine)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def trace_tail(chars: int = 1500) -> str:
    """The end of the exception being handled, with its cause: inductor's and FlexAttention's errors say only
    "backend='inductor' raised:" on their first line, the reason (a missing compiler, shared memory) after."""
    return traceback.format_exc()[-chars:]


def run_phase(name: str, fn: Callable[[Phase], None], rec: Recorder, device: torch.device, smoke: bool,
              budget_s: float, shared: dict[str, Any]) -> None:
    p = Phase(name, rec, device, smoke, budget_s, shared)
    start = time.perf_counter()
    status, reason = "ok", None
    try:
        fn(p)
        if p.truncated:
            status, reason = "truncated", f"time box: not run: {', '.join(p.truncated[:12])}"
    except Skipped as e:
        status, reason = "skipped", str(e)
    except Exception as e:  # noqa: BLE001  (one phase failing must not stop the others)
        status, reason = "error", one_line(e)
        p.write("trace", trace=traceback.format_exc()[-3000:])
    p.write("phase", status=status, reason=reason, seconds=round(time.perf_counter() - start, 2),
            budget_s=round(budget_s, 1))


def phase_budget(name: str, share: float, carry: float, last: bool, time_left: float) -> float:
    """Seconds a phase may use: its share plus the carry (what earlier phases left, negative after they
    overran), at least its share for a GUARANTEED_PHASES one, all that is left for the last phase; never
    past the overall deadline (time_left)."""
    planned = share + carry
    if name in GUARANTEED_PHASES:
        planned = max(planned, share)
    if last:
        planned = time_left
    return min(planned, time_left)


def write_table(rec: Recorder, out: Path) -> Path:
    """A short markdown summary of the JSON lines."""
    lines = ["# txl-dist device check", ""]
    env = next((r for r in rec.records if r["kind"] == "env"), {})
    lines.append(f"device {env.get('device_name')} | torch {env.get('torch')} | CUDA {env.get('cuda')} | "
                 f"triton {env.get('triton')} | deepspeed {env.get('deepspeed')}")
    lines += ["", "| phase | status | seconds | reason |", "|---|---|---|---|"]
    lines += [f"| {r['phase']} | {r['status']} | {r['seconds']} | {r['reason'] or ''} |"
              for r in rec.records if r["kind"] == "phase"]
    mm = [r for r in rec.records if r["kind"] == "matmul"]
    if mm:
        lines += ["", "matmul peak: " + ", ".join(f"{r['dtype']} {r['tflops']} TFLOP/s" for r in mm)]
    att = [r for r in rec.records if r["kind"] == "attention_time"]
    errs = {(r["impl"], r["dtype"]): r for r in rec.records if r["kind"] == "attention_error"}
    if att:
        lines += ["", "| attention fwd+bwd | dtype | ms | x reference | max abs err out | max abs err dq |",
                  "|---|---|---|---|---|---|"]
        for r in att:
            e = errs.get((r.get("impl"), r["dtype"]), {})
            lines.append(f"| {r.get('impl')} | {r['dtype']} | {r.get('ms')} | {r.get('speedup_vs_reference')} | "
                         f"{e.get('max_abs_out', e.get('error'))} | {e.get('max_abs_d_q')} |")
        for r in (r for r in rec.records if r["kind"] == "attention_profile"):
            kernels = ", ".join(f"{o['name'][:48]} {1e3 * o['self_ms']:.0f} us" for o in r.get("ops", [])[:6])
            lines.append(f"{r['impl']} ({r['dtype']}, one call, by {r.get('sorted_by')}): "
                         f"{kernels or r.get('error')}")
        lines += [f"triton's tiles ({r['dtype']}), picked by timing: "
                  + ", ".join(f"{kernel} {tile}" for kernel, tile in r["tiles"].items())
                  for r in att if r.get("tiles")]
    model = [r for r in rec.records if r["kind"] == "model_error"]
    if model:
        lines += ["", "| model fwd+bwd vs float64 | dtype | ok | nll | eval nll | rel grad |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['impl']} | {r['dtype']} | {r.get('ok', r.get('error'))} | {r.get('max_abs_nll')} | "
                  f"{r.get('max_abs_nll_eval')} | {r.get('max_rel_grad')} |" for r in model]
    train = [r for r in rec.records if r["kind"] == "train_step"]
    if train:
        lines += ["", "| shape | impl | micro batch | ckpt | compile | ms/step | tokens/s | MFU (measured peak) | "
                  "MFU (spec) | peak GiB | warm-up s (compile s) | dynamo graphs (limit hits) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in train:
            # A setting the config refuses (flex with dropatt > 0, timed at dropatt 0) is labelled so.
            impl = f"{r['impl']} (dropatt {r['dropatt']}: the config refuses)" if r.get("config_refuses") else r["impl"]
            warm = f"{r['warmup_s']} ({r['compile_s']})" if "warmup_s" in r else ""
            graphs = f"{r['dynamo_graphs']} ({r['recompile_limit_hits']})" if "dynamo_graphs" in r else ""
            lines.append(f"| {r['shape']} | {impl} | {r['micro_batch']} | {r['checkpointing']} | {r['compile']} | "
                         f"{r.get('step_ms', r.get('error', r.get('skipped')))} | {r.get('tokens_per_s')} | "
                         f"{r.get('mfu_measured_peak')} | {r.get('mfu_spec_peak')} | {r.get('peak_memory_gib')} | "
                         f"{warm} | {graphs} |")
        # What a preset for this device should say: per shape, the fastest setting that ran and that the
        # config accepts, with no compiled code that fell back to eager.
        for shape in dict.fromkeys(r["shape"] for r in train):
            ran = [r for r in train if r["shape"] == shape and r.get("tokens_per_s") and not r.get("config_refuses")
                   and not r.get("recompile_limit_hits")]
            if ran:
                b = max(ran, key=lambda r: r["tokens_per_s"])
                lines.append(f"\nfastest for {shape}: attn_impl {b['impl']}, micro batch {b['micro_batch']}, activation "
                             f"checkpointing {b['checkpointing']}, compile {b['compile']}: {b['tokens_per_s']} tokens/s, "
                             f"MFU {b.get('mfu_measured_peak')} of the measured peak, {b.get('peak_memory_gib')} GiB")
            refused = {r["impl"]: r["config_refuses"] for r in train if r["shape"] == shape and r.get("config_refuses")}
            for impl, reason in refused.items():
                lines.append(f"(not a candidate for {shape}: {impl}: {reason})")
    for r in (r for r in rec.records if r["kind"] == "train_profile"):
        if r.get("ops"):
            top = shares_text(r["ops"], 6)
            case = f"{r['shape']}/{r['impl']}/mb{r['micro_batch']}{'/compiled' if r.get('compile') else ''}"
            lines.append(f"\nbusiest in {case} (by {r['sorted_by']}): {top}")
            if line := summary_line(r.get("summary")):
                lines.append(f"  {line}")
            if line := unprofiled_text(r):
                lines.append(f"  {line}")
        else:
            lines.append(f"\nprofile {r['shape']}/{r['impl']}: {r.get('error', r.get('skipped'))}")
    for r in (r for r in rec.records if r["kind"] == "cuda_tests" and "selection" in r):
        counts = ", ".join(f"{r[k]} {k}" for k in ("passed", "failed", "error", "skipped") if r.get(k))
        tests = " ".join(r.get("files", ["tests/test_gpu.py"]))
        lines.append(f"\nCUDA tests ({tests} -k '{r['selection']}'): {counts or 'none ran'}, exit {r['exit']}, "
                     f"{r['seconds']} s, log {r['log']}" + "".join(f"\n  {f}" for f in r["failures"]))
    ds = [r for r in rec.records if r["kind"] == "deepspeed"]
    for r in ds:
        rate = (f"{r['tokens_per_s_unprofiled']:.0f} tok/s (median of the unprofiled steps from step "
                f"{FIRST_STEADY_STEP})" if r.get("tokens_per_s_unprofiled") else
                f"{r.get('tokens_per_s_last')} tok/s (last progress line)")
        lines.append(f"\nDeepSpeed trainer ZeRO {r.get('zero_stage')}: exit {r.get('exit')}, {rate}, "
                     f"{r.get('seconds')} s"
                     + (f" ({r['skipped']})" if r.get("skipped") else "")
                     + (f", log deepspeed_zero{r['zero_stage']}.log" if "exit" in r else ""))
        lines += [f"  {line.split(' ', 1)[-1]}" for line in r.get("profile", [])]
        if line := summary_line(r.get("profile_summary")):
            lines.append(f"  {line}")
        if line := unprofiled_text(r):
            lines.append(f"  {line}")
    path = out / TABLE
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Run every phase; JSON lines and the table go to --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                    help="folder for gpu_check.jsonl and gpu_check_table.txt (default: $OUT when set)")
    ap.add_argument("--cpu-smoke", action="store_true", help="every phase at toy size on the CPU (< 2 minutes)")
    ap.add_argument("--budget-s", type=float, default=float(sum(PHASE_BUDGET.values())),
                    help="total seconds for all phases (each gets its share)")
    ap.add_argument("--phases", nargs="+", default=list(PHASE_BUDGET), choices=list(PHASE_BUDGET),
                    help="the phases to run, in this order; env always runs, first (its record names the device "
                         "and versions in the table, and the train phase reads the device's data-sheet peak from it)")
    ap.add_argument("--end-epoch", type=float, default=None,
                    help="wall-clock time (seconds since the epoch) the phases must end by; gpu_check.sh passes its "
                         "own start + time box - margin, so that Python's imports count too")
    ap.add_argument("--cuda-test-parts", nargs="+", choices=[part[1] for part in CUDA_TEST_PARTS], default=None,
                    help="the cuda_tests phase's parts to run (-k selections; default: all, in order)")
    ap.add_argument("--trainer-config", default=None,
                    help="the deepspeed phase's config (default: configs/wt103_base.json, tiny.json for the smoke run)")
    ap.add_argument("--trainer-stages", type=int, nargs="+", default=None, help="its ZeRO stages (default 1 2)")
    ap.add_argument("--trainer-steps", type=int, default=None, help="its training steps (default 8)")
    ap.add_argument("--trainer-set", action="append", default=None, metavar="KEY=VALUE",
                    help="a further --set for the trainer (repeatable), after the phase's own")
    ap.add_argument("--train-shapes", nargs="+", choices=["large", "base"], default=None,
                    help="the train phase's shapes (default: both)")
    ap.add_argument("--train-batches", type=int, nargs="+", default=None,
                    help=f"the train phase's micro batches (default: {' '.join(map(str, TRAIN_BATCHES))})")
    ap.add_argument("--train-impls", nargs="+", choices=TRAIN_IMPLS, default=None,
                    help="the train phase's attention implementations (default: all)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    else:
        print("gpu_check: no CUDA device (use --cpu-smoke to run the phases on the CPU)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    if args.end_epoch is not None:
        deadline = min(deadline, time.monotonic() + args.end_epoch - time.time())
    rec = Recorder(out)
    # Scratch work (corpus, the trainer's run folders) stays out of --out, which the device tool brings back.
    scratch = Path(tempfile.mkdtemp(prefix="txl-gpu-check-"))  # under $TMPDIR when set
    rec.write({"phase": "start", "kind": "start", "argv": sys.argv[1:], "smoke": args.cpu_smoke,
               "budget_s": args.budget_s, "scratch": str(scratch)})
    budgets = SMOKE_BUDGET if args.cpu_smoke else PHASE_BUDGET
    phases = ["env", *dict.fromkeys(name for name in args.phases if name != "env")]
    # The phases run share the whole budget (a focused call with --phases gets all of it).
    scale = args.budget_s / sum(budgets[name] for name in phases)
    signal.signal(signal.SIGTERM, _terminate)
    shared: dict[str, Any] = {}
    fns: dict[str, Callable[[Phase], None]] = {
        "env": phase_env, "matmul": phase_matmul, "attention": phase_attention, "model": phase_model,
        "cuda_tests": lambda p: phase_cuda_tests(p, out, args.cuda_test_parts),
        "deepspeed": lambda p: phase_deepspeed(p, out, scratch, config=args.trainer_config, stages=args.trainer_stages,
                                               steps=args.trainer_steps, extra_sets=args.trainer_set),
        "train": lambda p: phase_train(p, args.train_shapes, args.train_batches, args.train_impls)}
    carry = 0.0  # the schedule's time minus what the phases so far took: an overrun makes it negative
    code = 0
    try:
        for index, name in enumerate(phases):
            start = time.monotonic()
            share = budgets[name] * scale
            budget = phase_budget(name, share, carry, index == len(phases) - 1, deadline - start)
            if budget < 1:
                reason = ("overall deadline reached" if deadline - start < 1 else
                          f"earlier phases overran their shares by more than this one's ({share:.0f} s)")
                rec.write({"phase": name, "kind": "phase", "status": "skipped", "seconds": 0.0, "reason": reason,
                           "budget_s": round(budget, 1)})
                carry += share
                continue
            try:
                run_phase(name, fns[name], rec, device, args.cpu_smoke, budget, shared)
            except Terminated:
                rec.write({"phase": name, "kind": "phase", "status": "killed", "reason": "SIGTERM (overall time box)",
                           "seconds": round(time.monotonic() - start, 2), "budget_s": round(budget, 1)})
                code = 124
                break
            carry += share - (time.monotonic() - start)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the table is written whatever arrives now
        shutil.rmtree(scratch, ignore_errors=True)
    table = write_table(rec, out)
    print(f"gpu_check: {rec.path} and {table}", flush=True)
    if args.cpu_smoke and code == 0 and (failed := smoke_failures(rec.records)):
        # On a GPU a failed part is a measurement to record and the rest still runs; the smoke run exists so
        # that the script cannot rot, so there it fails the run.
        print(f"gpu_check --cpu-smoke: failed: {'; '.join(failed)}", file=sys.stderr, flush=True)
        code = 1
    return code


def smoke_failures(records: list[dict[str, Any]]) -> list[str]:
    """What failed in a run's records: phases that ended in an error, trainer stages and CUDA test parts that
    exited non-zero."""
    failed = [f"phase {r['phase']}: {r.get('reason', 'error')}" for r in records
              if r["kind"] == "phase" and r.get("status") == "error"]
    failed += [f"trainer ZeRO {r.get('zero_stage')} exit {r['exit']} (deepspeed_zero{r.get('zero_stage')}.log)"
               for r in records if r["kind"] == "deepspeed" and "exit" in r and r["exit"] != 0]
    failed += [f"CUDA tests -k '{r.get('selection')}' exit {r['exit']}" for r in records
               if r["kind"] == "cuda_tests" and "exit" in r and r["exit"] != 0]
    return failed


if __name__ == "__main__":
    sys.exit(main())
