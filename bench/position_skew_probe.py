"""Can the fused kernels compute the position product themselves? The rel-shift's skew, read off sm_90 code.

    python -m bench.position_skew_probe

The triton path reads the position term from the raw product pos = q_r . r^T [BH, T, W], computed before the
kernels by one matmul and written to device memory (with its gradient, ~8 passes over a [BH, T, W] tensor
per layer and step). Computing it inside the kernel needs, per tile of BM queries x BN keys, the band of
BM + BN - 1 distance rows (q_r . r[c0 : c0 + L]^T, L its power of two) and then the skew: row i takes the
band's columns shifted by -i. Triton has no shared-memory access of its own; `tl.gather` along the band's
columns is the skew's one expression. This compiles two minimal loops over key tiles for sm_90, bf16,
d_head 64 (scores, their exponentials and a row sum), one reading the precomputed product as the kernels do,
one computing the band and gathering it, and prints the census of each loop (bench/triton_census.py's
counts: instructions per thread and tile, per score, by kind; registers, shared memory, spills).
"""
from __future__ import annotations

import collections
import os
import re
import sys

import triton
import triton.language as tl

from bench.triton_census import _run_tool, instructions, loops


@triton.jit
def precomputed(Q, K, POS, O, T, KL, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
    total = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, KL, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + offs_n[:, None] * D + offs_d[None, :])
        pos = tl.load(POS + offs_m[:, None] * W + offs_n[None, :] + (T - 1) - offs_m[:, None])
        total += tl.sum(tl.math.exp2(tl.dot(q, tl.trans(k)) + pos.to(tl.float32)), 1)
    tl.store(O + offs_m, total)


@triton.jit
def banded(Q, QR, K, R, O, T, KL, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
           L: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
    q_r = tl.load(QR + offs_m[:, None] * D + offs_d[None, :])
    total = tl.zeros([BLOCK_M], tl.float32)
    # query start_m + a, key start_n + b reads distance column c0 + b - a + BLOCK_M - 1 of the band
    skew = tl.arange(0, BLOCK_N)[None, :] - tl.arange(0, BLOCK_M)[:, None] + (BLOCK_M - 1)
    offs_l = tl.arange(0, L)
    for start_n in range(0, KL, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + offs_n[:, None] * D + offs_d[None, :])
        r = tl.load(R + (start_n + T - start_m - BLOCK_M + offs_l)[:, None] * D + offs_d[None, :])  # [L, D]
        pos = tl.gather(tl.dot(q_r, tl.trans(r)), skew, 1)
        total += tl.sum(tl.math.exp2(tl.dot(q, tl.trans(k)) + pos), 1)
    tl.store(O + offs_m, total)


def compile_sm90(kernel, pointers: dict, constexprs: dict, num_warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**pointers, "T": "i32", "KL": "i32", "W": "i32", **{key: "constexpr" for key in constexprs}}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(key),): value for key, value in constexprs.items()},
                    attrs={(kernel.arg_names.index(key),): [["tt.divisibility", 16]] for key in [*pointers, "KL"]})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=2))


def census_line(name: str, compiled, block_m: int, block_n: int, num_warps: int) -> str:
    found = instructions(_run_tool("nvdisasm", compiled.asm["cubin"], "-c"))
    registers = re.search(r"REG:(\d+)", _run_tool("cuobjdump", compiled.asm["cubin"], "--dump-resource-usage"))
    (body, _), = loops(found)
    kinds = ", ".join(f"{k} {v}" for k, v in collections.Counter(op.split(".")[0] for op in body).most_common(8))
    return (f"{name:34} {len(body):5} instructions ({len(body) * num_warps * 32 / (block_m * block_n):5.1f} per "
            f"score), {registers.group(1) if registers else '?'} registers, {compiled.metadata.shared} B shared, "
            f"{sum(op.startswith('STL') for _, op, _ in found)} spill stores | {kinds}")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("position_skew_probe: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    print("sm_90, bf16, d_head 64; one loop over key tiles, per thread and tile")
    for block_m, block_n, num_warps in ((128, 64, 8), (64, 64, 4), (64, 32, 4)):
        tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=64)
        band = 1 << (block_m + block_n - 2).bit_length()
        print(census_line(f"{block_m}x{block_n}/{num_warps}w precomputed", compile_sm90(
            precomputed, dict(Q="*bf16", K="*bf16", POS="*bf16", O="*fp32"), tiles, num_warps),
            block_m, block_n, num_warps))
        print(census_line(f"{block_m}x{block_n}/{num_warps}w band {band} + gather", compile_sm90(
            banded, dict(Q="*bf16", QR="*bf16", K="*bf16", R="*bf16", O="*fp32"), dict(tiles, L=band), num_warps),
            block_m, block_n, num_warps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
