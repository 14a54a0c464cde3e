"""Why `train.compile` is slower than eager on the CPU: inductor's C++ kernels against eager ATen, side by side.

On the development machine (torch 2.13.0+cpu, Intel with AVX-512/AMX) compiled layers trained slower than eager
ones (docs/performance.md "torch.compile on the CPU"). The cause is narrow: a compiled kernel that stores a
comparison's result as a mask (bool, also uint8: the ReLU mask autograd keeps for backward, a dropout mask)
converts it element by element, ~7-10 ns per element against ~0.3 ns for a float store (torch 2.11 and
2.13 alike). This script measures that in isolation, then (with --model) whole training steps of the
benchmarks' comparison model, so that a later torch can be checked in a minute:

    .venv/bin/python -m bench.compile_probe                # the element-wise cases, fp32 and bf16, 1 thread
    .venv/bin/python -m bench.compile_probe --model        # plus eager vs compiled layers (~1 minute more)

Every figure is compiled time / eager time of the same function, timed interleaved in one run (min of reps).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
from typing import Callable

import torch

from bench.suite import DTYPES
from bench.timing import interleaved

N_ELEMENTS = 1 << 20

ELEMENTWISE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    # name: (function, whether to run backward too)
    "relu -> float (no bool written)": (lambda x: torch.relu(x), False),
    "x > 0 -> bool": (lambda x: x > 0, False),
    "x > 0 -> uint8": (lambda x: (x > 0).to(torch.uint8), False),
    "relu forward+backward (a bool mask saved)": (lambda x: torch.relu(x) * 1.0, True),
}


def elementwise_case(fn: Callable[[torch.Tensor], torch.Tensor], backward: bool, dtype: torch.dtype,
                     reps: int) -> dict[str, float]:
    x = torch.randn(N_ELEMENTS, dtype=dtype, requires_grad=backward)
    grad = torch.randn_like(x)
    compiled = torch.compile(fn, dynamic=False)

    def run(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def call() -> None:
            for _ in range(10):
                y = f(x)
                if backward:
                    y.backward(grad)
        return call

    times = interleaved({"eager": run(fn), "compiled": run(compiled)}, reps, warmup=2)
    eager, comp = times["eager"][0] / 10, times["compiled"][0] / 10
    return {"eager_ms": round(eager * 1e3, 3), "compiled_ms": round(comp * 1e3, 3),
            "compiled_over_eager": round(comp / eager, 2)}


def model_case(dropout: float, dtype: torch.dtype, reps: int, quick: bool) -> dict[str, float]:
    """Training steps of the comparison model (bench/suite.py) with eager and with compiled layers."""
    from bench.suite import our_training, speed_config

    cfg = speed_config(quick)
    cfg = dataclasses.replace(cfg, dropout=dropout, dropatt=min(cfg.dropatt, dropout))
    batch = 4 if quick else 8
    eager, labels = our_training(cfg, dtype, batch)
    compiled, _ = our_training(cfg, dtype, batch, compile_layers=True)
    eager(len(labels))
    compiled(len(labels))  # compiles both layer shapes (no memory, full memory)
    times = interleaved({"eager": lambda: eager(2), "compiled": lambda: compiled(2)}, reps, warmup=1)
    e, c = times["eager"][0] / 2, times["compiled"][0] / 2
    return {"eager_ms": round(e * 1e3, 1), "compiled_ms": round(c * 1e3, 1), "compiled_over_eager": round(c / e, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--model", action="store_true", help="also time the comparison model's training step")
    ap.add_argument("--quick", action="store_true", help="the model at bench/suite.py's quick size (for tests)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s), {N_ELEMENTS} elements")
    results: dict[str, dict] = {}
    for dname in args.dtypes:
        for name, (fn, backward) in ELEMENTWISE.items():
            r = elementwise_case(fn, backward, DTYPES[dname], args.reps)
            results[f"{dname} | {name}"] = r
            print(f"{dname} | {name:44s} eager {r['eager_ms']:7.3f} ms  compiled {r['compiled_ms']:7.3f} ms"
                  f"  compiled/eager {r['compiled_over_eager']:.2f}")
    if args.model:
        for dname in args.dtypes:
            for dropout in (0.0, 0.1):
                r = model_case(dropout, DTYPES[dname], args.reps, args.quick)
                results[f"{dname} | model step, dropout {dropout}"] = r
                print(f"{dname} | comparison model step, dropout {dropout}: eager {r['eager_ms']} ms, "
                      f"compiled layers {r['compiled_ms']} ms, compiled/eager {r['compiled_over_eager']:.2f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
