"""Padded position rows against unpadded, side by side: POSITION_ROW_ALIGN's measurement.

    python -m bench.position_rows [--shape large] [--batches 8 16] [--reps 10] [--cpu-smoke]

The position product of relative attention writes K+1 distances per query row (txl_dist/model/attention.py
`_position_scores`); K+1 is odd for the presets, and cuBLAS then runs its alignment-1 kernels for it and both
of its gradients (the first GPU check's profile: cutlass_75 ..._align1, one of each per layer and step).
Padding the rows to a multiple of 8 aligns the GEMMs but makes the rel-shifted view strided (the baddbmm
copies it once). Timed here, bf16, interleaved, per micro batch:
  attention  relative attention alone, forward + backward (matmul and sdpa paths), at the shape's T, K, H, D
  layer_step the shape's whole model, eager forward + backward with full memory (no optimizer)
Prints one JSON line per measurement: row_align, seconds (min, median), and the ratio padded / unpadded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

import txl_dist.model.attention as attention
from bench.timing import interleaved
from txl_dist.config import load_config
from txl_dist.model import TransformerXL

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"large": "configs/large.json", "base": "configs/wt103_base.json"}


def synced(fn, device: torch.device):
    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return call


def with_align(align: int, device: torch.device, fn):
    """fn run with POSITION_ROW_ALIGN[device.type] = align (main puts the table back at the end)."""
    def call() -> None:
        attention.POSITION_ROW_ALIGN[device.type] = align
        fn()
    return call


def attention_call(impl: str, cfg, batch: int, device: torch.device, dtype: torch.dtype):
    qlen, klen, n_head, d_head = cfg.tgt_len, cfg.tgt_len + cfg.mem_len, cfg.n_head, cfg.d_head
    gen = torch.Generator(device=device).manual_seed(0)
    hd = n_head * d_head

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.5).to(dtype).requires_grad_()

    x = dict(q=rnd(batch, qlen, hd), kv=rnd(batch, klen, 2 * hd), r_head_k=rnd(klen, hd),
             r_w_bias=rnd(n_head, d_head), r_r_bias=rnd(n_head, d_head))
    grad_out = torch.randn(batch, qlen, hd, generator=gen, device=device).to(dtype)
    mask = attention.build_attn_mask(qlen, klen - qlen, klen - qlen, False, device)
    bias = attention.attn_bias_from_mask(mask, dtype)
    fn = attention.ATTN_IMPLS[impl]
    return lambda: torch.autograd.grad(fn(**x, attn_bias=bias, dropatt=cfg.dropatt, training=True),
                                       list(x.values()), grad_out)


def model_call(cfg, batch: int, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    model = TransformerXL(cfg).to(device=device, dtype=dtype).train()
    model.attn_impl = "matmul"
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.tgt_len + 1), generator=gen).to(device)
    with torch.no_grad():
        mems = model(ids[:, :-1], labels=ids[:, 1:]).mems  # full memory: the steady state

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids[:, :-1], labels=ids[:, 1:], mems=mems).nll.float().mean().backward()
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="large")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--align", type=int, default=8, help="the padded side's row alignment")
    ap.add_argument("--cpu-smoke", action="store_true", help="a toy shape on the CPU (checks the wiring)")
    args = ap.parse_args(argv)
    cfg = load_config(REPO / SHAPES[args.shape]).model
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        cfg = dataclasses.replace(cfg, vocab_size=2000, n_layer=2, d_model=32, n_head=2, d_head=8, d_inner=64,
                                  d_embed=32, cutoffs=[500, 1000], tgt_len=16, mem_len=14)
        args.batches, args.reps = [2], 2
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        print("position_rows: no CUDA device (use --cpu-smoke)", file=sys.stderr)
        return 2
    saved = dict(attention.POSITION_ROW_ALIGN)
    try:
        measure(cfg, args, device, dtype)
    finally:
        attention.POSITION_ROW_ALIGN.clear()
        attention.POSITION_ROW_ALIGN.update(saved)
    return 0


def measure(cfg, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """One JSON line per case and micro batch: both row widths timed in turns."""
    klen = cfg.tgt_len + cfg.mem_len
    for batch in args.batches:
        cases = {f"attention/{impl}": attention_call(impl, cfg, batch, device, dtype) for impl in ("matmul", "sdpa")}
        cases["layer_step"] = model_call(cfg, batch, device, dtype)
        for name, fn in cases.items():
            sides = {f"align {a}": synced(with_align(a, device, fn), device) for a in (1, args.align)}
            times = interleaved(sides, reps=args.reps, warmup=2)
            (min1, med1), (minp, medp) = times["align 1"], times[f"align {args.align}"]
            print(json.dumps({"probe": "position_rows", "case": name, "shape": args.shape, "batch": batch,
                              "klen_plus_1": klen + 1, "padded_width": -(-(klen + 1) // args.align) * args.align,
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "unpadded_ms": [round(min1 * 1e3, 3), round(med1 * 1e3, 3)],
                              "padded_ms": [round(minp * 1e3, 3), round(medp * 1e3, 3)],
                              "padded_over_unpadded_median": round(medp / med1, 3)}), flush=True)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
