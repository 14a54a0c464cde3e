"""Where a CPU training step's time goes, measured by taking one component out at a time.

torch.profiler misleads about a CPU step of this size: it slowed the comparison model's bf16 step 1.5x
(236 against 155 ms on an Intel with AMX, 2026-12-05) and charged memory-bound operators many times what
they cost unprofiled (the adaptive softmax's head log-softmax 10-13 ms a call under it, 0.7-2.5 ms timed in
place). This script instead trains the same model with one component removed and reports the step time
that saves, every variant timed interleaved with the unchanged step (min of reps), each on a model of its
own (a removed layer norm or softmax changes the values the rest computes, not its shapes or its work):

    .venv/bin/python -m bench.step_ablation [--shape comparison|tiny|large|wt103_base_aligned|wt103_base]
        [--dtype bf16|fp32] [--threads 2] [--reps 4] [--quick]

A saving is the component's own time plus what it does to its neighbours' cache and memory traffic, so the
savings need not add up to the step. The `ideal` line is the step at 100% MFU: the model's FLOPs per step
(txl_dist.flops) over the matmul peak measured between the steps as the progress line measures it
(txl_dist.flops.measure_matmul_peak).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import platform
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from bench.suite import (DTYPES, MFU_PRESETS, REPO, flops_per_token, matmul_peak_call, our_training,
                         preset_layer_config, speed_config)
from bench.timing import interleaved
from txl_dist.config import load_config

SHAPES = ("comparison", "tiny", *(name for name, _ in MFU_PRESETS))
TINY_VOCAB = 4096
"""The tiny shape's vocabulary: data/shakespeare's (configs/tiny.json reads it from the corpus)."""

Patch = tuple[Any, str, Any]


def _identity(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


def _target_logit(logits: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """F.cross_entropy's stand-in: the target's logit (no log-softmax over the row, no NLL's backward)."""
    return logits.gather(1, target.clamp(min=0)[:, None])[:, 0]


def _unnormalized(self: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return x


def _skip_step(self: torch.optim.Optimizer, closure: Callable | None = None) -> None:
    return None


def variants() -> dict[str, list[Patch]]:
    """Variant name -> the attributes it replaces while its steps run (none: the unchanged step)."""
    from txl_dist.model import attention, dropout

    drawn_once = functools.lru_cache(maxsize=None)(dropout.scaled_keep_mask)  # the original, bound before patching

    return {
        "unchanged": [],
        "dropout (masks and multiplies)": [(dropout, "dropout", _identity), (attention, "dropout", _identity)],
        "dropout masks (each drawn once, reused)": [(dropout, "scaled_keep_mask", drawn_once)],
        "attention softmax": [(F, "softmax", _identity)],
        "layer norm": [(torch.nn.LayerNorm, "forward", _unnormalized)],
        "adaptive softmax's log-softmax and NLL": [(F, "cross_entropy", _target_logit)],
        "optimizer step (fused AdamW)": [(torch.optim.AdamW, "step", _skip_step)],
    }


@contextlib.contextmanager
def patched(patches: list[Patch]) -> Iterator[None]:
    """The attributes replaced, restored on exit. A name the code no longer has is an error, not a silent no-op."""
    saved = []
    try:
        for obj, name, value in patches:
            if not hasattr(obj, name):
                owner = getattr(obj, "__name__", obj)
                raise AttributeError(f"{owner!r} has no {name!r}: update bench/step_ablation.py")
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def shape_config(shape: str, quick: bool):
    if shape == "comparison":
        return speed_config(quick)
    if shape == "tiny":  # configs/tiny.json's whole model, as the learning-per-second rows train it
        return dataclasses.replace(load_config(REPO / "configs" / "tiny.json").model, vocab_size=TINY_VOCAB,
                                   **({"n_layer": 1} if quick else {}))
    return preset_layer_config(shape, dict(MFU_PRESETS)[shape], quick)


def ablate(shape: str, dtype: torch.dtype, reps: int, quick: bool) -> dict[str, Any]:
    cfg = shape_config(shape, quick)
    batch = 4 if quick else 8
    runs: dict[str, tuple[Callable[[int], None], list[Patch]]] = {}
    labels = None
    for name, patches in variants().items():
        steps, labels = our_training(cfg, dtype, batch)
        with patched(patches):
            steps(len(labels))  # each segment once: the mems' and the tails' shapes all met before timing
        runs[name] = (steps, patches)
    k = 2

    def timed(steps: Callable[[int], None], patches: list[Patch]) -> Callable[[], None]:
        def call() -> None:
            with patched(patches):
                steps(k)
        return call

    mm, best_peak = matmul_peak_call(dtype)
    fns = {name: timed(*run) for name, run in runs.items()}
    times = interleaved({**fns, "matmul peak": mm}, reps, warmup=1)
    step = {name: times[name][0] / k for name in runs}
    peak = best_peak()
    fpt, _ = flops_per_token(cfg, batch, labels)
    ideal = fpt * batch * cfg.tgt_len / peak
    base = step["unchanged"]
    return {
        "shape": shape, "dtype": str(dtype).removeprefix("torch."), "batch": batch, "tgt_len": cfg.tgt_len,
        "step_ms": {name: round(t * 1e3, 2) for name, t in step.items()},
        "saves_share": {name: round((base - t) / base, 4) for name, t in step.items() if name != "unchanged"},
        "matmul_peak_gflops": round(peak / 1e9, 1), "ideal_step_ms": round(ideal * 1e3, 2),
        "mfu": round(ideal / base, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="comparison")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="toy sizes (bench/suite.py's quick model): a smoke run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = ablate(args.shape, DTYPES[args.dtype], args.reps, args.quick)
    print(f"# {args.shape} shape, {args.dtype}, batch {r['batch']} x {r['tgt_len']}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {args.threads} thread(s), min of {args.reps} reps")
    base = r["step_ms"]["unchanged"]
    print(f"{'unchanged step':48s} {base:8.1f} ms   MFU {r['mfu'] * 100:.1f}% (ideal {r['ideal_step_ms']:.1f} ms at "
          f"the measured peak {r['matmul_peak_gflops']:.0f} GFLOP/s)")
    for name, share in r["saves_share"].items():
        print(f"without {name:40s} {r['step_ms'][name]:8.1f} ms   saves {share * 100:5.1f}% of the step")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
