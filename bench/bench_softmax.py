"""The adaptive softmax's host work and head layout: a full training micro step with and without a tail
plan, with and without vocabulary padding, and the head's weight concatenation against its alternatives.

Everything is measured side by side in one run (interleaved repetitions; min and median of each) and
reported as ratios, since absolute times depend on the machine and on whatever else runs on it.

    .venv/bin/python -m bench.bench_softmax                    # fp32 and bf16 (if the CPU has bf16 units)
    .venv/bin/python -m bench.bench_softmax --dtypes fp32 --threads 1 --reps 5
    .venv/bin/python -m bench.bench_softmax --threads 1 --clock cpu     # on a busy shared machine

Cases:
- step: TransformerXL forward + backward over a memory (the reference shape of BENCHMARKS.md: 6 layers,
  d_model 256, 8 x 32 heads, d_inner 1024, vocab 16000, cutoffs [2000, 6000], tgt = mem = 128, batch 8),
  gather tail; "no plan" computes the cluster counts on the device (one host read per forward), "plan"
  makes them on the host from the numpy labels (the time of tail_plan is included), "plan+pad64" also
  stores the vocabulary tables padded to multiples of 64.
- head: the head's NLL forward + backward (N tokens x d -> S + C logits): "cat" (the model: one weight
  made by concatenating the shortlist and cluster rows per forward), "split" (two matmuls and a merged
  log-sum-exp: no weight copy), "one tensor" (the head stored as one parameter: no copy at all; the most any
  avoidance of the copy could win, at the price of the state-dict names).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from bench.timing import interleaved
from txl_dist.config import ModelConfig
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import tail_plan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REFERENCE_SHAPE = dict(vocab_size=16000, n_layer=6, d_model=256, n_head=8, d_head=32, d_inner=1024,
                       cutoffs=[2000, 6000], div_val=1, tgt_len=128, mem_len=128, dropout=0.1, dropatt=0.0)


def step_cases(dtype: torch.dtype, batch: int) -> dict[str, Callable[[], None]]:
    """One training micro step (forward over a memory + backward) per variant, on the same tokens."""
    rng = np.random.default_rng(0)
    cfg = ModelConfig(**REFERENCE_SHAPE)
    tgt_len = cfg.tgt_len
    # Zipf-like token ids, so the clusters are as unevenly filled as in text.
    tokens = np.minimum(rng.zipf(1.2, size=(batch, 2 * tgt_len + 1)) - 1, cfg.vocab_size - 1).astype(np.int64)
    labels_np = np.ascontiguousarray(tokens[:, tgt_len + 1:])
    ids, labels = torch.from_numpy(tokens[:, tgt_len:-1].copy()), torch.from_numpy(labels_np)
    cases = {}
    for name, pad, planned in (("no plan", 1, False), ("plan", 1, True), ("plan+pad64", 64, True)):
        torch.manual_seed(0)
        model = TransformerXL(ModelConfig(**{**REFERENCE_SHAPE, "pad_vocab_multiple": pad})).to(dtype).train()
        model.crit.tail_mode = "gather"
        with torch.no_grad():
            mems = model(torch.from_numpy(tokens[:, :tgt_len].copy())).mems

        def run(model=model, mems=mems, planned=planned):
            plan = tail_plan(labels_np, model.config.cutoffs, ids.device) if planned else None
            model(ids, labels=labels, mems=mems, tail_plan=plan).nll.mean().backward()
            model.zero_grad(set_to_none=True)
        cases[name] = run
    return cases


def head_cases(dtype: torch.dtype, n_tokens: int, d: int, shortlist: int, n_clusters: int) -> dict[str, Callable[[], None]]:
    """The head's NLL forward + backward, three ways, on the same weights and tokens."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(shortlist, d, generator=g) * 0.02).to(dtype).requires_grad_()
    bias = torch.zeros(shortlist, dtype=dtype, requires_grad=True)
    cluster_weight = (torch.randn(n_clusters, d, generator=g) * 0.02).to(dtype).requires_grad_()
    cluster_bias = torch.zeros(n_clusters, dtype=dtype, requires_grad=True)
    one_weight = torch.cat([weight, cluster_weight]).detach().requires_grad_()
    one_bias = torch.cat([bias, cluster_bias]).detach().requires_grad_()
    hidden = torch.randn(n_tokens, d, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, shortlist + n_clusters, (n_tokens,), generator=g)
    params = (weight, bias, cluster_weight, cluster_bias, one_weight, one_bias, hidden)

    def cat():
        logits = F.linear(hidden, torch.cat([weight, cluster_weight]), torch.cat([bias, cluster_bias]))
        return F.cross_entropy(logits.float(), target, reduction="none")          # [N]

    def split():
        short = F.linear(hidden, weight, bias).float()                             # [N, S]
        clusters = F.linear(hidden, cluster_weight, cluster_bias).float()          # [N, C]
        lse = torch.logaddexp(short.logsumexp(-1), clusters.logsumexp(-1))         # [N]
        picked = torch.where(target < shortlist,
                             short.gather(1, target.clamp(max=shortlist - 1)[:, None])[:, 0],
                             clusters.gather(1, (target - shortlist).clamp(min=0)[:, None])[:, 0])
        return lse - picked                                                        # [N]

    def one_tensor():
        return F.cross_entropy(F.linear(hidden, one_weight, one_bias).float(), target, reduction="none")

    torch.testing.assert_close(split(), cat(), rtol=0, atol=1e-3)  # the same math

    def timed(fn):
        def run():
            fn().sum().backward()
            for p in params:
                p.grad = None
        return run
    return {"cat": timed(cat), "split": timed(split), "one tensor": timed(one_tensor)}


def report(section: str, label: str, results: dict[str, tuple[float, float]], base: str, out: list[dict]) -> None:
    base_min = results[base][0]
    print(f"{section} {label}")
    for name, (t_min, t_median) in results.items():
        print(f"  {name:<12} min {t_min * 1e3:8.2f} ms  median {t_median * 1e3:8.2f} ms  "
              f"{name} / {base} (min) {t_min / base_min:.3f}")
        out.append({"section": section, "case": label, "variant": name, "min_s": t_min, "median_s": t_median,
                    "ratio_to": base, "ratio": t_min / base_min})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=["step", "head"], default=["step", "head"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", help="also write the results as JSON lines to this file")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (with --threads 1, what a busy shared machine "
                             "disturbs least)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads; python "
          f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}; {args.clock} clock")
    if "bf16" in args.dtypes and not torch.backends.mkldnn.is_available():
        print("bf16: oneDNN is not available here; measuring it anyway")
    out: list[dict] = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        if "step" in args.cases:
            report("step", f"{dtype_name} batch {args.batch}",
                   interleaved(step_cases(dtype, args.batch), args.reps, clock=clock), "no plan", out)
        for shortlist in (2000, 20000) if "head" in args.cases else ():
            report("head", f"{dtype_name} N 1024 d 256 S {shortlist} C 3",
                   interleaved(head_cases(dtype, 1024, 256, shortlist, 3), args.reps if shortlist < 20000 else 3,
                               clock=clock),
                   "cat", out)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
