"""Measurements that need a fresh process of their own (peak memory, a DeepSpeed engine); bench/suite.py
runs them as subprocesses and reads one JSON line from their stdout.

    python -m bench.probes step-memory --checkpointing 0|1 [--quick]
    python -m bench.probes checkpoint --dir DIR [--quick]
    python -m bench.probes grad-accum [--stage 1|2|3] [--micro-steps 4] [--reps 5] [--quick]
    python -m bench.probes comm-volume [--stages 0 1 2 3] [--micro-steps 1 2 4] [--dtype bf16|fp32] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from txl_dist.config import ModelConfig


def memory_model_config(quick: bool) -> ModelConfig:
    """~20M parameters: model states (16 bytes a parameter with AdamW) well above the interpreter's own."""
    if quick:
        return ModelConfig(vocab_size=4000, n_layer=2, d_model=256, n_head=4, d_head=64, d_inner=1024,
                           cutoffs=[1000, 2000], tgt_len=64, mem_len=64, dropout=0.1)
    return ModelConfig(vocab_size=16000, n_layer=4, d_model=512, n_head=8, d_head=64, d_inner=2048,
                       cutoffs=[2000, 6000], tgt_len=128, mem_len=128, dropout=0.1)


def proc_status_mib(field: str, pid: int | str = "self") -> float:
    """A memory field of /proc/PID/status (VmRSS: now; VmHWM: the peak resident set) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def step_memory(checkpointing: bool, quick: bool) -> dict:
    """Peak RSS of training steps of one model, with or without activation checkpointing."""
    from txl_dist.model import TransformerXL

    cfg = memory_model_config(quick)
    torch.manual_seed(0)
    model = TransformerXL(cfg).train()
    model.set_activation_checkpointing(enabled=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = 4 if quick else 8
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, batch, cfg.tgt_len), generator=g)
    mems = None
    base = start = 0.0
    for i, seg in enumerate(ids):
        out = model(seg, seg.roll(-1, 1), mems)
        out.nll.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mems = out.mems
        if i == 0:  # weights and optimizer state now exist: above this are activations and gradients
            base, start = proc_status_mib("VmRSS"), time.perf_counter()
    return {"checkpointing": checkpointing, "rss_before_steps_mib": round(base, 1),
            "peak_rss_mib": round(proc_status_mib("VmHWM"), 1), "seconds": round(time.perf_counter() - start, 2),
            "n_params": sum(p.numel() for p in model.parameters())}


def checkpoint_speed(folder: Path, quick: bool, reps: int) -> dict:
    """checkpoint.save / load_engine of a one-rank DeepSpeed engine against plain torch.save / torch.load of
    the same state (the module's and the optimizer's state_dict), repetitions interleaved."""
    _one_rank_process_group()
    from txl_dist import checkpoint
    from txl_dist.engine import build_engine
    from txl_dist.model import TransformerXL

    cfg = memory_model_config(quick)
    ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    engine = build_engine(lambda: TransformerXL(cfg), ds, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.tgt_len))
    out = engine(ids, ids)  # one step, so that the optimizer holds its state
    engine.backward(out.nll.mean())
    engine.step()
    folder.mkdir(parents=True, exist_ok=True)
    plain = folder / "plain.pt"
    times: dict[str, list[float]] = {"save": [], "load": [], "plain_save": [], "plain_load": []}
    nbytes = {}
    for rep in range(reps):
        start = time.perf_counter()
        tag = checkpoint.save(engine, folder / "ckpt", rep + 1, rank=0, world_size=1, rank_state={},
                              run_info={"zero_stage": 1, "world_size": 1}, keep=1)
        times["save"].append(time.perf_counter() - start)
        nbytes["ours"] = checkpoint.tag_bytes(tag)
        start = time.perf_counter()
        checkpoint.load_engine(engine, checkpoint.EngineSource(tag.parent, tag.name, universal=False))
        times["load"].append(time.perf_counter() - start)

        start = time.perf_counter()
        with open(plain, "wb") as f:  # fsync'd like ours: a checkpoint is only saved once it is on disk
            torch.save({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        times["plain_save"].append(time.perf_counter() - start)
        nbytes["plain"] = plain.stat().st_size
        start = time.perf_counter()
        state = torch.load(plain, map_location="cpu", weights_only=False)
        engine.module.load_state_dict(state["module"])
        engine.optimizer.load_state_dict([state["optimizer"]])  # ZeRO takes one state per rank
        times["plain_load"].append(time.perf_counter() - start)
    shutil.rmtree(folder, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    mb = {"save": nbytes["ours"], "load": nbytes["ours"], "plain_save": nbytes["plain"], "plain_load": nbytes["plain"]}
    return {"bytes_ours": nbytes["ours"], "bytes_plain": nbytes["plain"],
            **{f"{k}_mb_s": round(mb[k] / 1e6 / s, 1) for k, s in best.items()},
            **{f"{k}_s": round(s, 3) for k, s in best.items()}}


def _one_rank_process_group() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from bench.gpu_check import free_port

    os.environ["MASTER_PORT"] = str(free_port())


def _optimizer_step(engine, ids: torch.Tensor) -> None:
    for x in ids:
        engine.backward(engine(x, x).nll.float().mean())
        engine.step()


def grad_accum_cost(stage: int, micro_steps: int, reps: int, quick: bool) -> dict:
    """bf16 training steps with gradients accumulated in fp32 (the default at ZeRO 1-3) against bf16, one
    engine each, the same model and batches, timed in turns; and the optimizer's extra fp32 gradient bytes."""
    _one_rank_process_group()
    from txl_dist.config import config_from_dict
    from txl_dist.engine import build_engine, deepspeed_config
    from txl_dist.model import TransformerXL

    model_cfg = memory_model_config(quick)
    micro = 2
    engines = {}
    for accum in ("fp32", "bf16"):
        raw = {"train": {"max_steps": 10**6}, "deepspeed": {
            "train_batch_size": micro * micro_steps, "train_micro_batch_size_per_gpu": micro,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
            "data_types": {"grad_accum_dtype": accum}, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}}}}
        ds = deepspeed_config(config_from_dict(raw), 1)
        engines[accum] = build_engine(lambda: TransformerXL(model_cfg), ds, seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model_cfg.vocab_size, (micro_steps, micro, model_cfg.tgt_len), generator=g)

    def step(engine) -> float:
        start = time.perf_counter()
        _optimizer_step(engine, ids)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {k: [] for k in engines}
    for name, engine in engines.items():  # warm-up: kernels built, optimizer state allocated
        step(engine)
    for _ in range(reps):
        for name, engine in engines.items():
            times[name].append(step(engine))
    best = {k: min(v) for k, v in times.items()}
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engines["fp32"].module.parameters())  # ZeRO-3: whole
    return {"stage": stage, "micro_steps": micro_steps, "n_params": n_params,
            "step_s_fp32_accum": round(best["fp32"], 4), "step_s_bf16_accum": round(best["bf16"], 4),
            "ratio_fp32_over_bf16": round(best["fp32"] / best["bf16"], 3),
            "optimizer": {k: type(e.optimizer).__name__ for k, e in engines.items()}}


COMM_WORLD = 2
PRESET_ZERO_1_2 = {"overlap_comm": True, "contiguous_gradients": True}
"""The GPU presets' ZeRO 2 settings (configs/large.json), also given to ZeRO 1: the defaults count the same."""


def comm_volume(stages: list[int], micro_steps: list[int], dtype: str, quick: bool) -> dict:
    """What DeepSpeed's collectives carry per optimizer step, for each ZeRO stage and number of micro steps:
    `comm-volume-rank` on 2 ranks (gloo) under torch.distributed.run, as the suite's zero section starts its
    ranks; rank 0's result."""
    from bench.gpu_check import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(COMM_WORLD),
           "--master_port", str(free_port()), "-m", "bench.probes", "comm-volume-rank", "--dtype", dtype,
           "--stages", *map(str, stages), "--micro-steps", *map(str, micro_steps), *(["--quick"] if quick else [])]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")  # 2 ranks on 2 cores
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"comm-volume ranks failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return json.loads(line[len("PROBE "):])


def comm_volume_rank(stages: list[int], micro_steps: list[int], dtype: str, quick: bool) -> dict:
    """One rank of `comm-volume`: per (stage, micro steps), an engine trains 1 step (warm-up), then 2 steps with
    DeepSpeed's comms logger reset before them; per collective, its calls and the bytes of the tensors handed to
    it (the logger's message sizes) per optimizer step, also as a multiple of the gradient's bytes (parameters x
    the model dtype's size: 1.0 is one whole gradient)."""
    import deepspeed.comm as ds_comm

    from txl_dist.config import config_from_dict
    from txl_dist.engine import build_engine, deepspeed_config
    from txl_dist.model import TransformerXL

    model_cfg = memory_model_config(quick)
    micro, measured_steps = 2, 2
    element_bytes = {"bf16": 2, "fp32": 4}[dtype]
    runs = []
    for stage in stages:
        for k in micro_steps:
            ds_section: dict = {
                "train_batch_size": micro * k * COMM_WORLD, "train_micro_batch_size_per_gpu": micro,
                "zero_optimization": {"stage": stage, **(PRESET_ZERO_1_2 if stage in (1, 2) else {})},
                "gradient_clipping": 1.0, "steps_per_print": 10**9, "comms_logger": {"enabled": True, "prof_all": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
            if dtype == "bf16":
                ds_section["bf16"] = {"enabled": True}
            raw = {"train": {"max_steps": 10**6}, "deepspeed": ds_section}
            ds = deepspeed_config(config_from_dict(raw), COMM_WORLD)
            engine = build_engine(lambda: TransformerXL(model_cfg), ds, seed=0)
            ids = torch.randint(0, model_cfg.vocab_size, (k, micro, model_cfg.tgt_len),
                                generator=torch.Generator().manual_seed(1))

            _optimizer_step(engine, ids)
            ds_comm.reset_log()
            for _ in range(measured_steps):
                _optimizer_step(engine, ids)
            summary = ds_comm.log_summary(return_dict=True)["summary"]
            n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())  # ZeRO-3: whole
            grad_bytes = n_params * element_bytes
            ops = {}
            for op, sizes in summary.items():
                if op.startswith("log_summary"):
                    continue
                nbytes = sum(v["count"] * v["msg_size_bytes"] for v in sizes.values()) / measured_steps
                ops[op] = {"calls": sum(v["count"] for v in sizes.values()) / measured_steps,
                           "bytes": nbytes, "gradients": round(nbytes / grad_bytes, 3)}
            runs.append({"stage": stage, "micro_steps": k, "optimizer": type(engine.optimizer).__name__,
                         "gradient_bytes": grad_bytes, "ops": ops})
    return {"world": COMM_WORLD, "dtype": dtype, "n_params": n_params, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="probe", required=True)
    mem = sub.add_parser("step-memory")
    mem.add_argument("--checkpointing", type=int, choices=(0, 1), required=True)
    mem.add_argument("--quick", action="store_true")
    ck = sub.add_parser("checkpoint")
    ck.add_argument("--dir", type=Path, required=True)
    ck.add_argument("--reps", type=int, default=3)
    ck.add_argument("--quick", action="store_true")
    acc = sub.add_parser("grad-accum")
    acc.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    acc.add_argument("--micro-steps", type=int, default=4)
    acc.add_argument("--reps", type=int, default=5)
    acc.add_argument("--quick", action="store_true")
    for name in ("comm-volume", "comm-volume-rank"):
        cv = sub.add_parser(name)
        cv.add_argument("--stages", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1, 2, 3])
        cv.add_argument("--micro-steps", type=int, nargs="+", default=[1, 2, 4])
        cv.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
        cv.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.probe == "step-memory":
        result = step_memory(bool(args.checkpointing), args.quick)
    elif args.probe in ("comm-volume", "comm-volume-rank"):
        run = comm_volume if args.probe == "comm-volume" else comm_volume_rank
        result = run(args.stages, args.micro_steps, args.dtype, args.quick)
    elif args.probe == "grad-accum":
        result = grad_accum_cost(args.stage, args.micro_steps, args.reps, args.quick)
    else:
        result = checkpoint_speed(args.dir, args.quick, args.reps)
    if args.probe != "comm-volume-rank" or os.environ.get("RANK") == "0":  # one line, not one per rank
        print("PROBE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
