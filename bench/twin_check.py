"""Does a run learn as the same run in fp32 at ZeRO 0 does? The config sweep's check for a configuration that
trains wrong the same way every time, which its bit-for-bit resume check cannot see (an fp16 update 65536
times too small passed it: docs/architecture.md, "Where the product corrects DeepSpeed 0.19.8").

The twin is the run's config with fp32, ZeRO 0 and no activation checkpointing, on the same ranks, seed, data,
model, optimizer, schedule and clipping; so both start from the same weights on the same batches with the same
dropout masks. Compared, from the two run folders:
- the first step's loss and gradient norm (the same weights on the same batch);
- the update over the last checkpoints' steps (the fp32 weights of the second less those of the first, from
  the checkpoints as launch/export.py consolidates them): the ratio of its norm to the twin's and the cosine
  between the two, unless a step of the run was skipped (an fp16 overflow), which leaves its optimizer state
  legitimately unlike the twin's.

    python -m bench.twin_check RUN_DIR TWIN_DIR --steps FIRST LAST

prints one JSON line: the figures, the run's precision as it ran ("auto" resolved), and "problems", one line
for each figure outside the bounds of that precision (`BOUNDS`). Exit status 0 when it compared, 1 when it could
not (a missing checkpoint or journal).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench.soak_report import read_jsonl

BOUNDS = {
    # precision: (first loss, first gradient norm: most relative difference; update: least cosine, norm ratio range).
    # Measured over sweep seed 501's first 19 cases at most: fp32 0 / 2.2e-5 / 1 - 1e-12 / 1 +- 1.3e-7; bf16
    # 3.3e-6 / 1.8e-3 / 0.9996 / 1 +- 1.7e-3; fp16 1.6e-8 / 3.3e-5 / 0.9998 / 1 + 2.5e-4. The two bf16 cases at
    # ZeRO 0 moved 0.943-0.953 as far before DeepSpeed's optimizer state initialization step was undone.
    "fp32": (1e-6, 1e-3, 0.9999, (0.999, 1.001)),
    "bf16": (1e-3, 2e-2, 0.995, (0.98, 1.02)),
    "fp16": (1e-3, 2e-2, 0.995, (0.98, 1.02)),
}


def first_step(run_dir: Path) -> dict[str, float | None]:
    """Step 1's train/loss and train/grad_norm from the run's metrics journal."""
    for row in read_jsonl(run_dir / "tracking" / "metrics.jsonl"):
        metrics = row.get("metrics", {})
        if row.get("step") == 1 and "train/loss" in metrics:
            return {"loss": metrics["train/loss"], "grad_norm": metrics.get("train/grad_norm")}
    raise FileNotFoundError(f"{run_dir}: no step 1 in its metrics journal")


def weights(run_dir: Path, step: int) -> dict:
    """The fp32 weights of the run's checkpoint at `step`, as launch/export.py reads them."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.model import TransformerXL
    from txl_dist.startup import open_export

    with open_export(str(run_dir / "checkpoints" / ckpt.tag_for(step))) as (tag_dir, run_info, model_cfg):
        model = TransformerXL(model_cfg)
        ckpt.load_fp32_weights(model, tag_dir, run_info["zero_stage"])
    return {name: p.detach().double() for name, p in model.named_parameters()}


def update(run_dir: Path, first: int, last: int):
    """Each parameter's change from checkpoint `first` to `last`, flattened into one vector."""
    import torch

    before, after = weights(run_dir, first), weights(run_dir, last)
    return torch.cat([(after[name] - before[name]).flatten() for name in sorted(after)])


def run_info(run_dir: Path, step: int) -> dict:
    """run.json of the run's checkpoint at `step` (the precision it ran in, its skipped steps)."""
    from txl_dist import checkpoint as ckpt

    return ckpt.read_run_info(run_dir / "checkpoints" / ckpt.tag_for(step))


def relative(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / max(abs(b), 1e-12)


def compare(run_dir: Path, twin_dir: Path, first: int, last: int) -> dict:
    """The figures and the problems (lines) of the run against its twin."""
    import torch

    ours, twins = first_step(run_dir), first_step(twin_dir)
    info = run_info(run_dir, last)
    precision = info["run_choices"]["precision"]
    figures = {"precision": precision, "loss_1": [ours["loss"], twins["loss"]],
               "grad_norm_1": [ours["grad_norm"], twins["grad_norm"]],
               "loss_1_rel": relative(ours["loss"], twins["loss"]),
               "grad_norm_1_rel": relative(ours["grad_norm"], twins["grad_norm"]),
               "skipped_steps": info["nonfinite_steps"]}
    loss_bound, norm_bound, least_cosine, (low, high) = BOUNDS[precision]
    problems = []
    if figures["loss_1_rel"] is None or figures["loss_1_rel"] > loss_bound:
        problems.append(f"step 1 loss {ours['loss']} against the twin's {twins['loss']}")
    if figures["grad_norm_1_rel"] is not None and figures["grad_norm_1_rel"] > norm_bound:
        problems.append(f"step 1 gradient norm {ours['grad_norm']} against the twin's {twins['grad_norm']}")
    if not info["nonfinite_steps"]:  # else no periodic checkpoint need exist (none is saved amid skipped steps)
        delta, twin_delta = update(run_dir, first, last), update(twin_dir, first, last)
        norm, twin_norm = float(delta.norm()), float(twin_delta.norm())
        ratio = norm / twin_norm if twin_norm else None
        cosine = float(torch.dot(delta, twin_delta) / (norm * twin_norm)) if norm * twin_norm else None
        figures |= {"update_norm_ratio": ratio, "update_cosine": cosine}
        if twin_norm and not low <= ratio <= high:  # a twin that did not move leaves nothing to compare
            problems.append(f"steps {first + 1}-{last} moved the weights {ratio}x as far as the twin's")
        if twin_norm and (cosine is None or cosine < least_cosine):
            problems.append(f"steps {first + 1}-{last} moved the weights at a cosine of {cosine} to the twin's")
    return figures | {"problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.twin_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("twin_dir", type=Path)
    ap.add_argument("--steps", type=int, nargs=2, metavar=("FIRST", "LAST"), required=True,
                    help="two checkpointed steps of both runs")
    args = ap.parse_args(argv)
    try:
        figures = compare(args.run_dir, args.twin_dir, *args.steps)
    except (OSError, KeyError, ValueError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
