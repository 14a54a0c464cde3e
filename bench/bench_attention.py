"""Relative attention and a full Transformer-XL training step: the fast paths against the reference path.

Everything is measured side by side in one run (interleaved repetitions; the min of each, the median beside
it), and reported as ratios; absolute times depend on the machine and on whatever else runs on it.

    .venv/bin/python -m bench.bench_attention                  # attention fp32 + bf16, model step fp32
    .venv/bin/python -m bench.bench_attention --threads 1 --step-dtypes fp32 bf16
    .venv/bin/python -m bench.bench_attention --threads 1 --clock cpu --no-model --forward-mlens 128 640
    .venv/bin/python -m bench.bench_attention --reps 1 --batch 1 --dtypes fp32 --forward-mlens 16   # smallest

The forward-only comparison (evaluation and generation, no grad) includes flex, whose CPU kernel has no
backward; it is compiled once per shape before the timed calls.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import torch.nn.functional as F

from bench.timing import interleaved
from txl_dist.config import ModelConfig
from txl_dist.model import TransformerXL
from txl_dist.model.attention import ATTN_IMPLS, attn_bias_from_mask, build_attn_mask, flex_block_mask

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rel_attention_seq_first(q, kv, r_head_k, r_w_bias, r_r_bias, attn_bias):
    """The layout of the reference code and HF TransfoXL, for comparison only: everything seq-first
    ([len, batch, heads, d_head]), einsum per term, rel-shift by pad + reshape. q [T, B, H*D],
    kv [K, B, 2*H*D] -> [T, B, H*D]."""
    n_head, d_head = r_w_bias.shape
    qlen, bsz, klen = q.shape[0], q.shape[1], kv.shape[0]
    head_q = q.view(qlen, bsz, n_head, d_head)                                    # [T, B, H, D]
    head_k, head_v = kv.view(klen, bsz, 2, n_head, d_head).unbind(2)              # [K, B, H, D] each
    head_r = r_head_k.view(klen, n_head, d_head)                                  # [K, H, D]
    ac = torch.einsum("ibnd,jbnd->ijbn", head_q + r_w_bias, head_k)                # [T, K, B, H]
    bd = torch.einsum("ibnd,jnd->ijbn", head_q + r_r_bias, head_r)                # [T, K, B, H]
    bd = torch.cat([bd.new_zeros(qlen, 1, bsz, n_head), bd], dim=1)               # [T, K+1, B, H]
    bd = bd.view(klen + 1, qlen, bsz, n_head)[1:].view(qlen, klen, bsz, n_head)    # [T, K, B, H]
    scores = (ac + bd) * d_head ** -0.5 + attn_bias[:, :, None, None]             # [T, K, B, H]
    probs = F.softmax(scores.float(), dim=1).to(q.dtype)                          # [T, K, B, H]
    attn_vec = torch.einsum("ijbn,jbnd->ibnd", probs, head_v)                      # [T, B, H, D]
    return attn_vec.contiguous().view(qlen, bsz, n_head * d_head)                 # [T, B, H*D]


def attention_case(impl: str, dtype: torch.dtype, bsz: int, n_head: int, qlen: int, mlen: int,
                   d_head: int) -> Callable[[], None]:
    """One fwd+bwd of relative attention alone, on fixed random inputs."""
    g = torch.Generator().manual_seed(0)
    klen, hd = qlen + mlen, n_head * d_head

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    seq_first = impl == "seq-first"
    x = dict(q=rnd(qlen, bsz, hd) if seq_first else rnd(bsz, qlen, hd),
             kv=rnd(klen, bsz, 2 * hd) if seq_first else rnd(bsz, klen, 2 * hd),
             r_head_k=rnd(klen, hd), r_w_bias=rnd(n_head, d_head), r_r_bias=rnd(n_head, d_head))
    bias = attn_bias_from_mask(build_attn_mask(qlen, mlen, mlen, False), dtype)
    grad = torch.randn(*x["q"].shape, generator=g).to(dtype)
    fn = rel_attention_seq_first if seq_first else ATTN_IMPLS[impl]

    def run():
        torch.autograd.grad(fn(**x, attn_bias=bias), list(x.values()), grad)

    return run


def attention_forward_case(impl: str, dtype: torch.dtype, bsz: int, n_head: int, qlen: int, mlen: int,
                           d_head: int) -> Callable[[], None]:
    """One no-grad forward of relative attention alone (evaluation: same_length over a memory of mlen)."""
    g = torch.Generator().manual_seed(0)
    klen, hd = qlen + mlen, n_head * d_head

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x = dict(q=rnd(bsz, qlen, hd), kv=rnd(bsz, klen, 2 * hd), r_head_k=rnd(klen, hd),
             r_w_bias=rnd(n_head, d_head), r_r_bias=rnd(n_head, d_head))
    if impl == "flex":
        mask = flex_block_mask(qlen, mlen, mlen, True, torch.device("cpu"))
    else:
        mask = attn_bias_from_mask(build_attn_mask(qlen, mlen, mlen, True), dtype)
    fn = ATTN_IMPLS[impl]

    def run():
        with torch.no_grad():
            fn(**x, attn_bias=mask)

    return run


def bench_config() -> ModelConfig:
    """~9.2M parameters: the configuration docs/architecture.md times the HF reference with."""
    return ModelConfig(vocab_size=16000, n_layer=6, d_model=256, n_head=8, d_head=32, d_inner=1024,
                       cutoffs=[2000, 6000], div_val=1, tgt_len=128, mem_len=128, dropout=0.1, dropatt=0.0)


def step_case(model: TransformerXL, impl: str, bsz: int, mems_dtype: torch.dtype) -> Callable[[], None]:
    """One training step's fwd+bwd on a segment with full memory, with the given attention path."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    # Zipf-distributed tokens (p ~ 1/rank) as in real text: most fall in the adaptive softmax head.
    zipf = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64)
    ids, labels = torch.multinomial(zipf, 2 * bsz * cfg.tgt_len, replacement=True,
                                    generator=g).view(2, bsz, cfg.tgt_len)
    mems = [torch.randn(bsz, cfg.mem_len, cfg.d_model, generator=g).to(mems_dtype) for _ in range(cfg.n_layer)]

    def run():
        model.attn_impl = impl
        model.zero_grad(set_to_none=True)
        out = model(ids, labels, mems)
        out.nll.mean().backward()

    return run


def main(argv: list[str] | None = None) -> None:
    """Print attention and model-step timings side by side, as ratios to the reference path."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES),
                    help="dtypes of the attention-only comparison")
    ap.add_argument("--step-dtypes", nargs="+", default=["fp32"], choices=sorted(DTYPES),
                    help="dtypes of the model-step comparison (bf16 is very slow on CPUs without AVX512-BF16/AMX)")
    ap.add_argument("--reps", type=int, default=7,
                    help="interleaved repetitions per case (min and median reported; model step: max(3, reps // 2))")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time, robust on a busy shared machine (use with --threads 1)")
    ap.add_argument("--no-model", action="store_true", help="attention only, skip the model step")
    ap.add_argument("--forward-mlens", type=int, nargs="*", default=[128, 640],
                    help="memory lengths of the forward-only (evaluation) comparison, q 128; none: skip it")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.clock} clock")
    shape = dict(bsz=args.batch, n_head=8, qlen=128, mlen=128, d_head=32)
    print(f"\nrelative attention fwd+bwd, B {shape['bsz']}, H {shape['n_head']}, q {shape['qlen']}, "
          f"k {shape['qlen'] + shape['mlen']}, d {shape['d_head']}; reference = our batch-first einsum oracle, "
          "seq-first = the reference code's / HF's layout")
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        impls = ("reference", "seq-first", "matmul", "sdpa")
        fns = {impl: attention_case(impl, dtype, **shape) for impl in impls}
        times = interleaved(fns, args.reps, clock=clock)
        (ref, ref_med) = times["reference"]
        line = ", ".join(f"{impl} {t * 1e3:.1f} ms ({ref / t:.2f}x; median {ref_med / med:.2f}x)"
                         for impl, (t, med) in times.items())
        print(f"  {dname} (min): {line}")

    for mlen in args.forward_mlens:
        print(f"\nrelative attention forward only (no grad, same_length), B {shape['bsz']}, H {shape['n_head']}, "
              f"q {shape['qlen']}, k {shape['qlen'] + mlen}, d {shape['d_head']}")
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            impls = ("reference", "matmul", "sdpa", "flex")
            fns = {impl: attention_forward_case(impl, dtype, **{**shape, "mlen": mlen}) for impl in impls}
            times = interleaved(fns, args.reps, warmup=2, clock=clock)
            (ref, ref_med) = times["reference"]
            line = ", ".join(f"{impl} {t * 1e3:.1f} ms ({ref / t:.2f}x; median {ref_med / med:.2f}x)"
                             for impl, (t, med) in times.items())
            print(f"  {dname} (min): {line}")

    if args.no_model:
        return
    cfg = bench_config()
    torch.manual_seed(0)
    model = TransformerXL(cfg).train()
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * cfg.tgt_len
    print(f"\ntraining step fwd+bwd, {n_params / 1e6:.2f}M params, {cfg.n_layer} layers, d_model {cfg.d_model}, "
          f"B {args.batch}, tgt_len {cfg.tgt_len}, mem_len {cfg.mem_len}")
    for dname in args.step_dtypes:
        dtype = DTYPES[dname]
        model.to(dtype)
        fns = {impl: step_case(model, impl, args.batch, dtype) for impl in ("reference", "matmul", "sdpa")}
        times = interleaved(fns, max(3, args.reps // 2), clock=clock)
        (ref, ref_med) = times["reference"]
        line = ", ".join(f"{impl} {tokens / t:.0f} tok/s ({ref / t:.2f}x; median {ref_med / med:.2f}x)"
                         for impl, (t, med) in times.items())
        print(f"  {dname} (best): {line}")
    model.to(torch.float32)


if __name__ == "__main__":
    main()
