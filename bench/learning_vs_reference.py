"""Learning quality against the reference: txl-dist's TransformerXL and HuggingFace's TransfoXLLMHeadModel
(transformers 4.37.2, in `.venv-ref`, run as a subprocess) trained on the same tokens, side by side.

For every seed both sides start from the SAME weights (ours, initialized with the seed, handed over with
`to_hf`), read the SAME batches (our StreamLoader's, in order: S streams of tgt_len tokens per step, mems
carried from step to step), use the same optimizer (torch AdamW, no weight decay, global-norm clipping, the
learning rate the trainer's DeepSpeed WarmupCosineLR gives every step), dropout on, float32, the same number
of threads; the seed also seeds the dropout masks (each side draws its own). Then both are evaluated on the
same test windows (our evaluation loader's, in order) with the config's eval memory settings. Printed: test
perplexity per seed, mean and spread (max - min over seeds), train and eval wall time, and a verdict.

What differs from `launch/train.py`: our side is a single process without DeepSpeed (the same math at ZeRO
stage 0 in float32 with `torch_adam`: torch AdamW, clipping by the global gradient norm, the scheduler's
learning rate per step) and without the trainer's non-finite guard, checkpoints and tracking. The two sides
run one after the other, never at the same time, so their wall times are comparable.

    python bench/learning_vs_reference.py --config configs/tiny.json --corpus data/shakespeare \\
        --steps 300 --seeds 1 2 3 --threads 1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from tests.hf_reference.refvenv import ensure_reference_venv
from txl_dist.config import RunConfig, load_config
from txl_dist.data import StreamLoader, read_manifest
from txl_dist.evaluate import Evaluator
from txl_dist.interop import to_hf
from txl_dist.model import TransformerXL

REFERENCE_SIDE = Path(__file__).resolve().parent / "learning_reference_side.py"


def warmup_cosine_lr(step: int, total: int, base_lr: float, params: dict) -> float:
    """The learning rate DeepSpeed's WarmupCosineLR (linear warmup) gives optimizer step `step` (from 0)."""
    warmup = max(2, params.get("warmup_num_steps", 1000))
    if params.get("warmup_type", "log") != "linear":
        raise SystemExit("scheduler.warmup_type: this benchmark reproduces 'linear' only; set it to linear")
    min_ratio, cos_min = params.get("warmup_min_ratio", 0.0), params.get("cos_min_ratio", 0.0001)
    if step < warmup:
        return base_lr * (min_ratio + step / warmup * (1.0 - min_ratio))
    progress = (step - warmup + 1) / max(1, total - warmup)
    return base_lr * max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


@dataclasses.dataclass
class Settings:
    """Everything both sides share, read from the run configuration."""

    cfg: RunConfig
    steps: int
    n_streams: int
    eval_streams: int
    lrs: list[float]
    betas: tuple[float, float]
    eps: float
    clip: float
    threads: int


def settings_from(cfg: RunConfig, steps: int, threads: int) -> Settings:
    """The shared settings; refuses what the two sides could not both do."""
    ds = cfg.deepspeed
    opt, sched = ds.get("optimizer", {}), ds.get("scheduler", {})
    if opt.get("type", "").lower() != "adamw" or opt.get("params", {}).get("weight_decay", 0.0) != 0.0:
        raise SystemExit("deepspeed.optimizer: this benchmark compares AdamW without weight decay; use that")
    if sched and sched.get("type") != "WarmupCosineLR":
        raise SystemExit("deepspeed.scheduler.type: this benchmark reproduces WarmupCosineLR only")
    base_lr = opt["params"]["lr"]
    # As the trainer's engine applies it: DeepSpeed sets the scheduler's lr (0: not started) when it is built
    # and moves the scheduler after each step, so optimizer step k (from 0) uses the scheduler's iteration
    # k - 1 (the trainer logs the same numbers as train/lr).
    lrs = [0.0] + [warmup_cosine_lr(s, steps, base_lr, sched.get("params", {})) for s in range(steps - 1)] \
        if sched else [base_lr] * steps
    return Settings(cfg=cfg, steps=steps, n_streams=ds["train_batch_size"], eval_streams=cfg.eval.n_streams or 1,
                    lrs=lrs, betas=tuple(opt["params"].get("betas", (0.9, 0.999))),
                    eps=opt["params"].get("eps", 1e-8), clip=ds.get("gradient_clipping", 0.0) or math.inf,
                    threads=threads)


def train_batches(s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """Our loader's first `steps` batches of the train split: input_ids, labels int64 [steps, S, T]."""
    loader = StreamLoader(s.cfg.data.path, s.cfg.data.train_split, rank=0, world_size=1, n_streams=s.n_streams,
                          micro_batch=s.n_streams, tgt_len=s.cfg.model.tgt_len, roll=s.cfg.data.roll,
                          seed=s.cfg.data.seed)
    inputs, labels = [], []
    for mb in loader:
        if len(inputs) == s.steps:
            break
        if mb.reset.any() and inputs:
            raise SystemExit(f"--steps {s.steps}: more than one pass over the train streams; the two sides "
                             "reset mems differently at a wrap: use fewer steps")
        inputs.append(torch.from_numpy(mb.input_ids))
        labels.append(torch.from_numpy(mb.labels))
    loader.close()
    return torch.stack(inputs), torch.stack(labels)  # [steps, S, T]


def eval_windows(s: Settings) -> dict[str, torch.Tensor]:
    """The windows our Evaluator reads from the test split, in order (the same loader settings)."""
    evaluator = Evaluator(s.cfg.data.path, s.cfg.eval, rank=0, world_size=1, n_streams=s.eval_streams)
    # The Evaluator's own loader (not a second one built alike): the reference reads the very windows ours does.
    loader = evaluator._loader(s.cfg.data.test_split)
    windows: dict[str, torch.Tensor] = {}
    for i, mb in enumerate(loader):
        if s.cfg.eval.max_segments is not None and i >= s.cfg.eval.max_segments:
            break
        windows[f"input_ids.{i}"] = torch.from_numpy(np.ascontiguousarray(mb.input_ids))  # [E, T_i]
        windows[f"labels.{i}"] = torch.from_numpy(np.ascontiguousarray(mb.labels))  # [E, T_i]
    evaluator.close()
    return windows


def initial_model(s: Settings, seed: int) -> TransformerXL:
    """Our model with the seed's initialization (the reference starts from these very weights)."""
    torch.manual_seed(seed)
    return TransformerXL(s.cfg.model)


def train_ours(s: Settings, model: TransformerXL, seed: int, inputs: torch.Tensor,
               labels: torch.Tensor) -> dict:
    """Train and evaluate our side in this process; the result has the reference side's keys."""
    torch.set_num_threads(s.threads)
    torch.manual_seed(seed)  # dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lrs[0], betas=s.betas, eps=s.eps, weight_decay=0.0)
    model.train()
    mems = None
    losses = []
    start = time.perf_counter()
    for step, lr in enumerate(s.lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        out = model(inputs[step], labels=labels[step], mems=mems)
        loss = out.nll.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        optimizer.step()
        mems = out.mems
        losses.append(loss.item())
    train_s = time.perf_counter() - start
    evaluator = Evaluator(s.cfg.data.path, s.cfg.eval, rank=0, world_size=1, n_streams=s.eval_streams)
    start = time.perf_counter()
    result = evaluator.evaluate(model, s.cfg.data.test_split)
    eval_s = time.perf_counter() - start
    evaluator.close()
    return {"train_loss": losses, "train_s": train_s, "eval_nll_sum": result["loss"] * result["tokens"],
            "eval_tokens": int(result["tokens"]), "eval_s": eval_s}


def train_reference(s: Settings, python: Path, work: Path, seed: int, init_dir: Path, batches: Path,
                    windows: Path) -> dict:
    """Train and evaluate the reference in `.venv-ref` on the same weights, batches and windows."""
    out = work / f"reference-{seed}.json"
    job = {"init_dir": str(init_dir), "batches": str(batches), "eval": str(windows), "lrs": s.lrs,
           "betas": list(s.betas), "eps": s.eps, "clip": s.clip, "seed": seed, "threads": s.threads,
           "eval_mem_len": s.cfg.eval.mem_len, "eval_clamp_len": s.cfg.eval.clamp_len,
           "eval_same_length": s.cfg.eval.same_length, "out": str(out)}
    job_file = work / f"reference-{seed}.job.json"
    job_file.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", OMP_NUM_THREADS=str(s.threads))
    proc = subprocess.run([str(python), str(REFERENCE_SIDE), str(job_file)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"the reference side failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return json.loads(out.read_text())


def spread(values: list[float]) -> float:
    """Max - min over seeds (0 for one seed)."""
    return max(values) - min(values)


def report(results: dict[str, dict[int, dict]], s: Settings) -> tuple[list[str], bool]:
    """The table lines and whether ours is not worse than the reference beyond the seed spread."""
    lines = ["| side | seed | final train loss (mean of last 10 steps) | test loss | test ppl | train s | eval s |",
             "|---|---|---|---|---|---|---|"]
    summary = {}
    for side, per_seed in results.items():
        ppls = []
        for seed, r in sorted(per_seed.items()):
            loss = r["eval_nll_sum"] / r["eval_tokens"]
            ppls.append(math.exp(loss))
            tail = statistics.fmean(r["train_loss"][-10:])
            lines.append(f"| {side} | {seed} | {tail:.4f} | {loss:.4f} | {ppls[-1]:.2f} | {r['train_s']:.1f} | "
                         f"{r['eval_s']:.1f} |")
        train_s = statistics.fmean(r["train_s"] for r in per_seed.values())
        summary[side] = (statistics.fmean(ppls), spread(ppls), train_s)
    lines.append("")
    lines.append("| side | test ppl mean | spread (max - min) | train s (mean) |")
    lines.append("|---|---|---|---|")
    for side, (mean, width, train_s) in summary.items():
        lines.append(f"| {side} | {mean:.2f} | {width:.2f} | {train_s:.1f} |")
    (ours, ours_w, ours_s), (ref, ref_w, ref_s) = summary["txl-dist"], summary["reference"]
    allowed = max(ours_w, ref_w)
    ok = ours - ref <= allowed
    tokens = {r["eval_tokens"] for per_seed in results.values() for r in per_seed.values()}
    lines.append("")
    lines.append(f"test tokens per side: {sorted(tokens)}; train wall time ratio txl-dist / reference: "
                 f"{ours_s / ref_s:.2f}")
    lines.append(f"verdict: txl-dist test ppl {ours:.2f} vs reference {ref:.2f} (difference {ours - ref:+.2f}, "
                 f"allowed {allowed:.2f} = the larger seed spread): "
                 + ("not worse beyond seed spread" if ok else "WORSE beyond seed spread"))
    return lines, ok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train txl-dist and the HF reference (transformers 4.37.2) on the same tokens; compare test "
                    "perplexity, seed spread and wall time.",
        epilog="example:\n  python bench/learning_vs_reference.py --config configs/tiny.json --corpus data/shakespeare "
               "--steps 300 --seeds 1 2 3 --threads 1",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.json", help="run configuration (model, batch, optimizer, "
                        "scheduler, eval memory settings), e.g. configs/tiny.json")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, as in launch/train.py, e.g. --set model.n_layer=2")
    parser.add_argument("--corpus", default=None, help="prepared corpus folder (default: the config's data.path)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds (>= 2 for a spread)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    parser.add_argument("--json-out", default=None, help="also write every number as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.set) + ([f"data.path={args.corpus}"] if args.corpus else [])
    cfg = load_config(args.config, overrides)
    vocab = read_manifest(cfg.data.path).tokenizer.vocab_size
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    s = settings_from(cfg, args.steps, args.threads)
    python = ensure_reference_venv()
    results: dict[str, dict[int, dict]] = {"txl-dist": {}, "reference": {}}
    with tempfile.TemporaryDirectory(prefix="learning-vs-ref-") as tmp:
        work = Path(tmp)
        inputs, labels = train_batches(s)
        save_file({"input_ids": inputs, "labels": labels}, str(work / "batches.safetensors"))
        save_file(eval_windows(s), str(work / "eval.safetensors"))
        for seed in args.seeds:
            model = initial_model(s, seed)
            init_dir = to_hf(model, work / f"init-{seed}")
            results["reference"][seed] = train_reference(s, python, work, seed, init_dir,
                                                         work / "batches.safetensors", work / "eval.safetensors")
            results["txl-dist"][seed] = train_ours(s, model, seed, inputs, labels)
            ppl = {side: math.exp(results[side][seed]["eval_nll_sum"] / results[side][seed]["eval_tokens"])
                   for side in results}
            print(f"seed {seed}: test ppl txl-dist {ppl['txl-dist']:.2f}, reference {ppl['reference']:.2f}", flush=True)
    lines, ok = report(results, s)
    m = cfg.model
    print(f"model: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads x {m.d_head}, d_inner {m.d_inner}, "
          f"vocab {m.vocab_size}, cutoffs {m.cutoffs}, div_val {m.div_val}, tgt_len {m.tgt_len}, "
          f"mem_len {m.mem_len}, dropout {m.dropout}, dropatt {m.dropatt}; {s.steps} steps of {s.n_streams} "
          f"streams; eval tgt_len {cfg.eval.tgt_len} mem_len {cfg.eval.mem_len} clamp_len {cfg.eval.clamp_len} "
          f"same_length {cfg.eval.same_length}, {s.eval_streams} streams; {s.threads} thread(s); "
          f"torch {torch.__version__}")
    print("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"results": {k: {str(seed): r for seed, r in v.items()}
                                                               for k, v in results.items()}, "ok": ok}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
