"""Generation: incremental decoding against cached mems vs recomputing the full context for every token.

The model is configs/tiny.json's architecture with random weights (the speed does not depend on what it
learnt) and a 4096-piece vocabulary, as the quickstart trains it. For each length N, N tokens are decoded
greedily after a one-token prompt: incrementally (mem_len = N, so every token sees the whole context and the
tokens are the same as the recompute's, which is checked), incrementally with the model's default memory
(mem_len + tgt_len = 128: the cost per token stops growing once the memory is full), and by running the
whole context through the model for every token. Reported: tokens/s of each and the ratios, measured side
by side in one process (the minimum of --reps runs, the least disturbed by other load).

    .venv/bin/python bench/bench_generate.py                       # lengths 128 and 512, 1 thread
    .venv/bin/python bench/bench_generate.py --lengths 256 1024 --threads 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from txl_dist.config import MemorySettings, model_config_from_dict
from txl_dist.generation import GenerationSession, SamplingSettings
from txl_dist.model import TransformerXL

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingSettings(greedy=True)


def tiny_model(vocab_size: int) -> TransformerXL:
    raw = json.loads((REPO / "configs" / "tiny.json").read_text())["model"]
    cfg = dataclasses.replace(model_config_from_dict(raw), vocab_size=vocab_size)
    torch.manual_seed(0)
    return TransformerXL(cfg).eval()


def incremental(model: TransformerXL, n: int, mem_len: int | None) -> tuple[list[int], float]:
    """n greedy tokens after the prompt [0] through a session; (tokens, seconds)."""
    start = time.perf_counter()
    session = GenerationSession(model, mem_len=mem_len)
    session.feed([0])
    tokens = session.sample(n, GREEDY)[0].tolist()
    return tokens, time.perf_counter() - start


def recompute(model: TransformerXL, n: int) -> tuple[list[int], float]:
    """n greedy tokens after the prompt [0], the whole context through the model for each; (tokens, seconds)."""
    start = time.perf_counter()
    context = [0]
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([context]), memory=MemorySettings(mem_len=0))
            context.append(int(torch.argmax(model.log_probs(out.hidden[0, -1]))))
    return context[1:], time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512], help="tokens to generate")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=2, help="runs of each, interleaved; the fastest counts")
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tiny_model(args.vocab_size)
    default_mem = model.config.mem_len + model.config.tgt_len
    print(f"tiny.json model, vocab {args.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters, {args.threads} thread(s), fp32, greedy, best of {args.reps}")
    print(f"{'tokens':>7} | {'incremental, mem=N':>19} | {f'incremental, mem={default_mem}':>21} | "
          f"{'full recompute':>15} | {'speed-up (mem=N)':>16} | same tokens")
    for n in args.lengths:
        best = {"full": float("inf"), "short": float("inf"), "recompute": float("inf")}
        for _ in range(args.reps):
            full_tokens, t = incremental(model, n, mem_len=n)
            best["full"] = min(best["full"], t)
            _, t = incremental(model, n, mem_len=None)
            best["short"] = min(best["short"], t)
            ref_tokens, t = recompute(model, n)
            best["recompute"] = min(best["recompute"], t)
        rate = {k: n / v for k, v in best.items()}
        print(f"{n:>7} | {rate['full']:>13.0f} tok/s | {rate['short']:>15.0f} tok/s | {rate['recompute']:>9.0f} "
              f"tok/s | {rate['full'] / rate['recompute']:>15.1f}x | {'yes' if full_tokens == ref_tokens else 'NO'}")


if __name__ == "__main__":
    main()
