"""Learning quality and learning per second against the reference: txl-dist's TransformerXL and HuggingFace's
TransfoXLLMHeadModel (transformers 4.37.2, in `.venv-ref`, run as a subprocess) trained on the same tokens.

For every seed both sides start from the SAME weights (ours, initialized with the seed, handed over with
`to_hf`), read the SAME batches (our StreamLoader's, in order: S streams of tgt_len tokens per step, mems
carried from step to step), use the same optimizer (torch AdamW, fused when the config says so, no weight
decay, global-norm clipping, the learning rate the trainer's DeepSpeed WarmupCosineLR gives every step),
dropout on, float32, the same number
of threads; the seed also seeds the dropout masks (each side draws its own). Both are evaluated on the same
test windows (our evaluation loader's, in order) with the config's eval memory settings, at K checkpoints.
Printed: test perplexity per seed, mean and spread (max - min over seeds), train and eval wall time, the
learning-per-second figure below, both learning curves, and two verdicts.

Learning per second (issue 9: "on the same tokens and settings as the reference, reach the reference's test
perplexity in at most half its wall time"), per seed:
  - the reference trains N steps: its final test perplexity is P_ref, its train wall time T_ref;
  - both sides evaluate the test split after steps s_i = i * N // K, i = 1..K (`--checkpoints K`; s_K = N,
    so the last checkpoint is the final evaluation). Evaluation is outside the train clock, and it does not
    change training: train mode comes back and torch's RNG state is saved and restored around it, so the
    losses of a run are bitwise those of a run without checkpoints (tests/test_recipes.py proves it);
  - s* is the FIRST of our checkpoints whose test perplexity is <= P_ref, T_ours(s*) our train wall time of
    steps 1..s*; the figure is T_ours(s*) / T_ref. If our side never reaches P_ref within N steps the figure
    is "> T_ours(N) / T_ref" (a lower bound) and the target fails;
  - over seeds: the mean of the per-seed figures (a lower bound, printed with ">", when a seed did not reach
    P_ref). Target: every seed reaches P_ref and the mean is <= 0.5 (PASS), else FAIL.
  - s* / N, the share of the reference's tokens our side needed, is the same question without the clock: it
    does not move with the load of a shared machine (only the checkpoint spacing N / K limits it). The
    figure is then roughly (s* / N) x (our step time / the reference's step time).
The reference is evaluated at the same checkpoints (its evaluations cost a few seconds each and stay off its
clock): the two learning curves show whether s* < N comes from learning faster per token or from the seed.
The train clocks of the two sides cover the same work per step: setting the learning rate, the forward with
the carried mems, the loss, zero_grad, backward, clipping, the optimizer step and one `loss.item()`.

What differs from `launch/train.py`: our side is a single process without DeepSpeed (the same math at ZeRO
stage 0 in float32 with `torch_adam`: torch AdamW, clipping by the global gradient norm, the scheduler's
learning rate per step) and without the trainer's non-finite guard, checkpoints and tracking. The two sides
run one after the other, never at the same time, so their wall times are comparable; on a shared machine
they still move with the load (s* / N does not).

    python bench/learning_vs_reference.py --config configs/tiny.json --corpus data/shakespeare \\
        --steps 600 --seeds 1 2 3 --threads 1 --checkpoints 10
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

from txl_dist.config import RunConfig, load_config
from txl_dist.data import StreamLoader, read_manifest
from txl_dist.evaluate import Evaluator
from txl_dist.interop import to_hf
from txl_dist.model import TransformerXL

REFERENCE_SIDE = Path(__file__).resolve().parent / "learning_reference_side.py"
TARGET_TIME_RATIO = 0.5
"""Issue 9: reach the reference's test perplexity in at most half its train wall time."""


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
    fused: bool = False
    """torch's fused AdamW (the config's optimizer.params.fused) on both sides."""


def settings_from(cfg: RunConfig, steps: int, threads: int) -> Settings:
    """The shared settings; refuses what the two sides could not both do."""
    ds = cfg.deepspeed
    opt, sched = ds.get("optimizer", {}), ds.get("scheduler", {})
    if opt.get("type", "").lower() != "adamw" or opt.get("params", {}).get("weight_decay", 0.0) != 0.0:
        raise SystemExit("deepspeed.optimizer: this benchmark compares AdamW without weight decay; use that")
    if sched and sched.get("type") != "WarmupCosineLR":
        raise SystemExit("deepspeed.scheduler.type: this benchmark reproduces WarmupCosineLR only")
    base_lr = opt["params"]["lr"]
    # As the trainer's engine applies it (txl_dist.engine.build_engine): optimizer step k (from 0) uses the
    # scheduler's iteration k (the trainer logs the same numbers as train/lr).
    lrs = [warmup_cosine_lr(s, steps, base_lr, sched.get("params", {})) for s in range(steps)] \
        if sched else [base_lr] * steps
    return Settings(cfg=cfg, steps=steps, n_streams=ds["train_batch_size"], eval_streams=cfg.eval.n_streams or 1,
                    lrs=lrs, betas=tuple(opt["params"].get("betas", (0.9, 0.999))),
                    eps=opt["params"].get("eps", 1e-8), clip=ds.get("gradient_clipping", 0.0) or math.inf,
                    threads=threads, fused=bool(opt["params"].get("fused", False)))


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
    # All of the streams in one group (no micro_batch): the reference's batch.
    [loader] = evaluator._group_loaders(s.cfg.data.test_split)
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


def checkpoint_steps(steps: int, k: int) -> list[int]:
    """The K evenly spaced steps after which both sides evaluate: i * steps // k, i = 1..k (the last is steps)."""
    if not 1 <= k <= steps:
        raise SystemExit(f"--checkpoints {k}: use 1 to --steps ({steps}) evaluations per run")
    return [i * steps // k for i in range(1, k + 1)]


def evaluate_ours(evaluator: Evaluator, model: TransformerXL, split: str) -> tuple[float, int]:
    """Sum of test NLL and token count; training's RNG state is restored afterwards (the Evaluator restores the
    train mode), so the dropout masks that follow are those of a run without this evaluation."""
    rng = torch.get_rng_state()
    try:
        result = evaluator.evaluate(model, split)
    finally:
        torch.set_rng_state(rng)
    return result["loss"] * result["tokens"], int(result["tokens"])


def train_ours(s: Settings, model: TransformerXL, seed: int, inputs: torch.Tensor, labels: torch.Tensor,
               checkpoints: list[int]) -> dict:
    """Train our side in this process, evaluating after each checkpoint step; the reference side's keys."""
    torch.set_num_threads(s.threads)
    torch.manual_seed(seed)  # dropout
    evaluator = Evaluator(s.cfg.data.path, s.cfg.eval, rank=0, world_size=1, n_streams=s.eval_streams)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lrs[0], betas=s.betas, eps=s.eps, weight_decay=0.0,
                                  fused=s.fused or None)
    model.train()
    mems = None
    losses, evaluations = [], []
    at = set(checkpoints)
    train_s = 0.0
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
        if step + 1 in at:
            train_s += time.perf_counter() - start
            eval_start = time.perf_counter()
            nll_sum, tokens = evaluate_ours(evaluator, model, s.cfg.data.test_split)
            evaluations.append({"step": step + 1, "train_s": train_s, "eval_nll_sum": nll_sum, "eval_tokens": tokens,
                                "eval_s": time.perf_counter() - eval_start})
            start = time.perf_counter()
    evaluator.close()
    final = evaluations[-1]
    return {"train_loss": losses, "train_s": final["train_s"], "eval_nll_sum": final["eval_nll_sum"],
            "eval_tokens": final["eval_tokens"], "eval_s": final["eval_s"], "checkpoints": evaluations}


def train_reference(s: Settings, python: Path, work: Path, seed: int, init_dir: Path, batches: Path,
                    windows: Path, checkpoints: list[int]) -> dict:
    """Train and evaluate the reference in `.venv-ref` on the same weights, batches, windows and checkpoints."""
    out = work / f"reference-{seed}.json"
    job = {"init_dir": str(init_dir), "batches": str(batches), "eval": str(windows), "lrs": s.lrs,
           "betas": list(s.betas), "eps": s.eps, "clip": s.clip, "seed": seed, "threads": s.threads,
           "eval_mem_len": s.cfg.eval.mem_len, "eval_clamp_len": s.cfg.eval.clamp_len,
           "eval_same_length": s.cfg.eval.same_length, "checkpoints": checkpoints, "fused": s.fused,
           "out": str(out)}
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


def mean_test_nll(evaluation: dict) -> float:
    """Mean test NLL per token of one evaluation."""
    return evaluation["eval_nll_sum"] / evaluation["eval_tokens"]


def learning_per_second(ours: dict, reference: dict) -> dict:
    """One seed's figure (the module docstring defines it): s*, T_ours(s*) / T_ref and s* / N."""
    ref_loss, t_ref = mean_test_nll(reference), reference["train_s"]
    steps = ours["checkpoints"][-1]["step"]
    if {c["eval_tokens"] for c in ours["checkpoints"] + reference["checkpoints"]} != {reference["eval_tokens"]}:
        raise SystemExit("the two sides evaluated different test tokens; their perplexities do not compare")
    ref_curve = {c["step"]: mean_test_nll(c) for c in reference["checkpoints"]}
    reached = next((c for c in ours["checkpoints"] if mean_test_nll(c) <= ref_loss), None)
    at = reached or ours["checkpoints"][-1]
    return {"reached": reached is not None, "steps": steps, "reference_ppl": math.exp(ref_loss),
            "reference_train_s": t_ref, "step": reached["step"] if reached else None,
            "ours_train_s": at["train_s"], "ours_ppl": math.exp(mean_test_nll(at)),
            "reference_ppl_at_step": math.exp(ref_curve[at["step"]]) if at["step"] in ref_curve else None,
            # Unreached: T_ours(N) / T_ref and 1 are lower bounds of what the figures would be.
            "time_ratio": at["train_s"] / t_ref, "token_ratio": at["step"] / steps}


def learning_summary(per_seed: dict[int, dict]) -> dict:
    """The figures' means over seeds and the verdict: every seed reaches P_ref and the mean time ratio <= 0.5."""
    all_reached = all(r["reached"] for r in per_seed.values())
    time_mean = statistics.fmean(r["time_ratio"] for r in per_seed.values())
    token_mean = statistics.fmean(r["token_ratio"] for r in per_seed.values())
    return {"time_ratio_mean": time_mean, "token_ratio_mean": token_mean,
            "lower_bound": not all_reached, "target": TARGET_TIME_RATIO,
            "passed": all_reached and time_mean <= TARGET_TIME_RATIO}


def ratio_text(value: float, bound: bool) -> str:
    """A figure, with ">" when it is only a lower bound (P_ref not reached)."""
    return f"> {value:.2f}" if bound else f"{value:.2f}"


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
            loss = mean_test_nll(r)
            ppls.append(math.exp(loss))
            tail = statistics.fmean(r["train_loss"][-10:])
            eval_s = sum(c["eval_s"] for c in r["checkpoints"])
            lines.append(f"| {side} | {seed} | {tail:.4f} | {loss:.4f} | {ppls[-1]:.2f} | {r['train_s']:.1f} | "
                         f"{eval_s:.1f} |")
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
                 f"{ours_s / ref_s:.2f}; eval s: all checkpoints' evaluations, off the train clock")
    lines.append(f"verdict: txl-dist test ppl {ours:.2f} vs reference {ref:.2f} (difference {ours - ref:+.2f}, "
                 f"allowed {allowed:.2f} = the larger seed spread): "
                 + ("not worse beyond seed spread" if ok else "WORSE beyond seed spread"))
    return lines, ok


def learning_report(results: dict[str, dict[int, dict]], per_seed: dict[int, dict], summary: dict) -> list[str]:
    """The learning-per-second table per seed, the mean learning curves and the verdict line."""
    lines = ["| seed | reference test ppl P_ref (N steps) | T_ref s | first checkpoint s* with ppl <= P_ref | "
             "our ppl at s* (else N) | reference ppl there | T_ours(s*) s | T_ours(s*) / T_ref | s* / N |",
             "|---|---|---|---|---|---|---|---|---|"]
    for seed, r in sorted(per_seed.items()):
        where = f"{r['step']} of {r['steps']}" if r["reached"] else f"not reached in {r['steps']}"
        ref_at = f"{r['reference_ppl_at_step']:.2f}" if r["reference_ppl_at_step"] is not None else "-"
        lines.append(f"| {seed} | {r['reference_ppl']:.2f} | {r['reference_train_s']:.1f} | {where} | "
                     f"{r['ours_ppl']:.2f} | {ref_at} | {r['ours_train_s']:.1f} | "
                     f"{ratio_text(r['time_ratio'], not r['reached'])} | "
                     f"{ratio_text(r['token_ratio'], not r['reached'])} |")
    lines.append("")
    lines.append("| step | txl-dist test ppl (mean over seeds) | reference test ppl (mean) | txl-dist train s (mean) "
                 "| reference train s (mean) |")
    lines.append("|---|---|---|---|---|")
    curves = {side: [r["checkpoints"] for r in per.values()] for side, per in results.items()}
    for i, point in enumerate(curves["txl-dist"][0]):
        row = [f"{point['step']}"]
        for key in ("ppl", "train_s"):
            for side in ("txl-dist", "reference"):
                values = [run[i]["train_s"] if key == "train_s" else math.exp(mean_test_nll(run[i]))
                          for run in curves[side]]
                row.append(f"{statistics.fmean(values):.{1 if key == 'train_s' else 2}f}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    bound = summary["lower_bound"]
    lines.append(f"verdict (learning per second): T_ours(s*) / T_ref mean over {len(per_seed)} seed(s) "
                 f"{ratio_text(summary['time_ratio_mean'], bound)} (target <= {summary['target']:g}): "
                 f"{'PASS' if summary['passed'] else 'FAIL'}"
                 + ("" if not bound else " (a seed never reached the reference's test perplexity)")
                 + "; tokens to the reference's perplexity s* / N mean "
                 + ratio_text(summary["token_ratio_mean"], bound))
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train txl-dist and the HF reference (transformers 4.37.2) on the same tokens; compare test "
                    "perplexity, seed spread, wall time and learning per second (time to the reference's "
                    "final test perplexity).",
        epilog="example:\n  python bench/learning_vs_reference.py --config configs/tiny.json --corpus data/shakespeare "
               "--steps 600 --seeds 1 2 3 --threads 1 --checkpoints 10",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.json", help="run configuration (model, batch, optimizer, "
                        "scheduler, eval memory settings), e.g. configs/tiny.json")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, as in launch/train.py, e.g. --set model.n_layer=2")
    parser.add_argument("--corpus", default=None, help="prepared corpus folder (default: the config's data.path)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run, N (default 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds (>= 2 for a spread)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    parser.add_argument("--checkpoints", type=int, default=10, metavar="K",
                        help="test evaluations per run, after steps i*N//K (default 10; 1: only at the end)")
    parser.add_argument("--json-out", default=None, help="also write every number as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.set) + ([f"data.path={args.corpus}"] if args.corpus else [])
    cfg = load_config(args.config, overrides)
    vocab = read_manifest(cfg.data.path).tokenizer.vocab_size
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    s = settings_from(cfg, args.steps, args.threads)
    checkpoints = checkpoint_steps(s.steps, args.checkpoints)
    from tests.hf_reference.refvenv import ensure_reference_venv  # here: it imports pytest

    python = ensure_reference_venv()
    results: dict[str, dict[int, dict]] = {"txl-dist": {}, "reference": {}}
    per_seed: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="learning-vs-ref-") as tmp:
        work = Path(tmp)
        inputs, labels = train_batches(s)
        save_file({"input_ids": inputs, "labels": labels}, str(work / "batches.safetensors"))
        save_file(eval_windows(s), str(work / "eval.safetensors"))
        for seed in args.seeds:
            model = initial_model(s, seed)
            init_dir = to_hf(model, work / f"init-{seed}")
            results["reference"][seed] = train_reference(s, python, work, seed, init_dir, work / "batches.safetensors",
                                                         work / "eval.safetensors", checkpoints)
            results["txl-dist"][seed] = train_ours(s, model, seed, inputs, labels, checkpoints)
            per_seed[seed] = learning_per_second(results["txl-dist"][seed], results["reference"][seed])
            ppl = {side: math.exp(mean_test_nll(results[side][seed])) for side in results}
            r = per_seed[seed]
            print(f"seed {seed}: test ppl txl-dist {ppl['txl-dist']:.2f}, reference {ppl['reference']:.2f}; "
                  f"T_ours(s*) / T_ref {ratio_text(r['time_ratio'], not r['reached'])} "
                  f"(s* {r['step'] if r['reached'] else 'not reached'} of {s.steps})", flush=True)
    lines, ok = report(results, s)
    summary = learning_summary(per_seed)
    m = cfg.model
    print(f"model: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads x {m.d_head}, d_inner {m.d_inner}, "
          f"vocab {m.vocab_size}, cutoffs {m.cutoffs}, div_val {m.div_val}, tgt_len {m.tgt_len}, "
          f"mem_len {m.mem_len}, dropout {m.dropout}, dropatt {m.dropatt}; {s.steps} steps of {s.n_streams} "
          f"streams; eval tgt_len {cfg.eval.tgt_len} mem_len {cfg.eval.mem_len} clamp_len {cfg.eval.clamp_len} "
          f"same_length {cfg.eval.same_length}, {s.eval_streams} streams, after steps {checkpoints}; "
          f"{s.threads} thread(s); torch {torch.__version__}")
    print("\n".join(lines))
    print()
    print("\n".join(learning_report(results, per_seed, summary)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "results": {k: {str(seed): r for seed, r in v.items()} for k, v in results.items()}, "ok": ok,
            "learning": {"per_seed": {str(seed): r for seed, r in per_seed.items()}, **summary},
            "settings": {"config": args.config, "overrides": overrides, "steps": s.steps, "seeds": args.seeds,
                         "threads": s.threads, "checkpoints": checkpoints, "n_layer": m.n_layer,
                         "d_model": m.d_model, "n_streams": s.n_streams, "tgt_len": m.tgt_len,
                         "torch": torch.__version__}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
