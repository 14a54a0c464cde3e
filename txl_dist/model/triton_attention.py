"""Fused relative attention in Triton (attn_impl "triton"): the scores never reach device memory.

One kernel per query block walks the visible key blocks with an online softmax (FlashAttention-2's scheme):
content term q_w . k from the block's own dot product, position term read from the raw position product
`pos` [BH, T, W] (W >= K+1 distance columns) at the rel-shifted column j + T - 1 - i, the memory-causal
pattern (and same_length's window) as index arithmetic, attention dropout from a counter-based generator
(Philox, `tl.rand`) keyed by one seed per call, so the backward regenerates the same mask instead of storing
it. Saved for backward: the output and one float32 log-sum-exp per query row.

The backward is two kernels that recompute the probabilities block by block: one per key block (dk, dv in
registers), one per query block (dq, and the position term's gradient). Every entry of `pos` is read by at
most one (query, key) pair (for a fixed row i the column j + T - 1 - i is one-to-one in j), so `dpos` is
written with plain stores, no atomics: the reason this path exists beside FlexAttention, whose generic
gradient of a captured tensor must assume collisions.

Inputs are pre-scaled as in `rel_attention_matmul` (q_w = (q + u) / sqrt(D), pos = ((q + v) / sqrt(D)) . r),
so score = q_w . k + pos[i, j + T - 1 - i]. Shapes: BH = batch x heads (any order), T queries, KL = mlen + T
keys, D head size (any: padded to a power of two in registers).

CUDA only in production (`rel_attention_triton` in attention.py refuses a CPU tensor). Under Triton's
interpreter (TRITON_INTERPRET=1 when triton is imported) the same kernels run on CPU tensors with numpy:
the test suite checks them that way against the einsum reference (tests/test_triton_attention.py), and
compiles them for sm_90 without a GPU (`compile_for_target`).
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import NamedTuple

import torch



def triton_available() -> bool:
    """Whether the triton package is installed here (found, not imported: see _kernels)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether triton runs its kernels in the interpreter (TRITON_INTERPRET=1: CPU tensors, numpy, slow)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class Blocks(NamedTuple):
    """Tile sizes and launch settings of one kernel."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def kernel_blocks(device: torch.device) -> dict[str, Blocks]:
    """Tile sizes per kernel. CUDA: 64 x 64 tiles over 8 warps, chosen without a GPU by what ptxas reports for
    sm_90 (bf16, d_head 64, 2026-12-04; `compile_for_target`): of six candidates the only one without register
    spills in any kernel without dropout (with dropout: 0, 24 and 96 bytes of spill stores in fwd, dkdv, dq),
    where 128 x 64 on 4 warps, FlashAttention-2's usual forward tile, spilled 3 KB. Not yet timed on a GPU
    (bench/gpu_check.py times this path beside the others). The interpreter: the smallest tiles a dot product
    takes (16), so that small test shapes still cross tile borders."""
    if device.type != "cuda":
        return {name: Blocks(16, 16, 1, 1) for name in ("fwd", "dkdv", "dq")}
    return {name: Blocks(64, 64, 8, 2) for name in ("fwd", "dkdv", "dq")}


def _kernels():
    """The kernels module (txl_dist/model/triton_kernels.py), imported at the first call."""
    if not triton_available():
        raise RuntimeError("attn_impl 'triton' needs the triton package (it comes with torch's CUDA wheels); "
                           "use attn_impl 'auto' or 'matmul'")
    from txl_dist.model import triton_kernels

    return triton_kernels


def _block_d(d_head: int) -> int:
    return max(16, 1 << (d_head - 1).bit_length())


def _launch_args(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, mlen: int, window: int,
                 p_drop: float) -> tuple:
    _, qlen, d_head = q.shape
    return (qlen, k.shape[1], pos.shape[2], mlen, window, p_drop)


def _constexprs(q: torch.Tensor, blocks: Blocks, p_drop: float) -> dict:
    d_head = q.shape[2]
    return dict(D=d_head, BLOCK_D=_block_d(d_head), BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                DROPOUT=p_drop > 0, IEEE=q.dtype == torch.float32, num_warps=blocks.num_warps,
                num_stages=blocks.num_stages)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, mlen: int) -> None:
    bh, qlen, d_head = q.shape
    if k.shape != (bh, qlen + mlen, d_head) or v.shape != k.shape:
        raise ValueError(f"rel_attn: keys/values {tuple(k.shape)}/{tuple(v.shape)} do not fit queries "
                         f"{tuple(q.shape)} with mlen {mlen}")
    if pos.shape[:2] != (bh, qlen) or pos.shape[2] < qlen + mlen + 1:
        raise ValueError(f"rel_attn: position scores {tuple(pos.shape)} need [{bh}, {qlen}, >= {qlen + mlen + 1}]")
    if len({t.dtype for t in (q, k, v, pos)}) != 1 or not all(t.is_contiguous() for t in (q, k, v, pos)):
        raise ValueError("rel_attn: q, k, v and pos must be contiguous and of one dtype")


@torch.library.custom_op("txl_dist::rel_attn_fwd", mutates_args=())
def rel_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seed: torch.Tensor,
                 mlen: int, window: int, p_drop: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [BH, T, D] and float32 log-sum-exp [BH, T] of fused relative attention (module doc).

    window: keys j > i + mlen - window only (same_length's mem_len; KL, the key count, for no window); seed: int64 [1] on the
    device, read by the kernel (dropout's key; unused when p_drop is 0)."""
    kernels = _kernels()
    _check_inputs(q, k, v, pos, mlen)
    bh, qlen, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(bh, qlen, dtype=torch.float32, device=q.device)
    blocks = kernel_blocks(q.device)["fwd"]
    grid = (math.ceil(qlen / blocks.block_m), bh)
    kernels.rel_attn_fwd[grid](q, k, v, pos, seed, out, lse, *_launch_args(q, k, pos, mlen, window, p_drop),
                        **_constexprs(q, blocks, p_drop))
    return out, lse


@rel_attn_fwd.register_fake
def _(q, k, v, pos, seed, mlen, window, p_drop):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("txl_dist::rel_attn_bwd", mutates_args=())
def rel_attn_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, seed: torch.Tensor, mlen: int, window: int,
                 p_drop: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dpos) of rel_attn_fwd's output."""
    kernels = _kernels()
    bh, qlen, _ = q.shape
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)                              # [BH, T]: rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dpos = torch.zeros_like(pos)  # entries no (query, key) pair reads keep a zero gradient
    args = _launch_args(q, k, pos, mlen, window, p_drop)
    blocks = kernel_blocks(q.device)
    grid = (math.ceil(k.shape[1] / blocks["dkdv"].block_n), bh)
    kernels.rel_attn_bwd_dkdv[grid](q, k, v, pos, seed, grad_out, lse, delta, dk, dv, *args,
                             **_constexprs(q, blocks["dkdv"], p_drop))
    grid = (math.ceil(qlen / blocks["dq"].block_m), bh)
    kernels.rel_attn_bwd_dq[grid](q, k, v, pos, seed, grad_out, lse, delta, dq, dpos, *args,
                           **_constexprs(q, blocks["dq"], p_drop))
    return dq, dk, dv, dpos


@rel_attn_bwd.register_fake
def _(grad_out, q, k, v, pos, out, lse, seed, mlen, window, p_drop):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(pos)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, pos, seed, mlen, window, p_drop = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, pos, out, lse, seed)
    ctx.settings = (mlen, window, p_drop)


def _backward(ctx, grad_out, grad_lse):
    del grad_lse  # the log-sum-exp is an internal output: nothing downstream differentiates it
    q, k, v, pos, out, lse, seed = ctx.saved_tensors
    dq, dk, dv, dpos = rel_attn_bwd(grad_out, q, k, v, pos, out, lse, seed, *ctx.settings)
    return dq, dk, dv, dpos, None, None, None, None


rel_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def fused_rel_attention(q_w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, mlen: int,
                        window: int | None, p_drop: float) -> torch.Tensor:
    """Attention vectors [BH, T, D] (differentiable in all four tensors). window: same_length's mem_len, or
    None. p_drop > 0 draws the dropout seed from torch's generator of the device, so a run's RNG state
    (checkpointed) fixes the masks."""
    if window is None:
        window = k.shape[1]  # no key is older than the window
    if p_drop > 0:
        seed = torch.randint(0, 2 ** 62, (1,), device=q_w.device, dtype=torch.int64)
    else:
        seed = torch.zeros(1, device=q_w.device, dtype=torch.int64)
    out, _ = rel_attn_fwd(q_w, k, v, pos, seed, mlen, window, p_drop)
    return out


def compile_for_target(arch: int = 90, dtype: torch.dtype = torch.bfloat16, d_head: int = 64,
                       dropout: bool = True) -> list[str]:
    """Compile the three kernels for CUDA architecture `arch` (90: H100/H200) without a GPU: Triton's own
    front end, optimizer and ptxas run; what fails to compile on the device fails here. Returns the kernel
    names compiled (for the test to check)."""
    kernels = _kernels()
    if interpreting():
        raise RuntimeError("compile_for_target: TRITON_INTERPRET=1 made the kernels interpreted; run it in a "
                           "process without it")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    blocks = kernel_blocks(torch.device("cuda"))
    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    ints = {"T": "i32", "KL": "i32", "W": "i32", "MLEN": "i32", "WINDOW": "i32", "P_DROP": "fp32"}
    tensors = {
        "fwd": (kernels.rel_attn_fwd, dict(Q=elem, K=elem, V=elem, POS=elem, SEED="*i64", O=elem, LSE="*fp32")),
        "dkdv": (kernels.rel_attn_bwd_dkdv, dict(Q=elem, K=elem, V=elem, POS=elem, SEED="*i64", DO=elem,
                                          LSE="*fp32", DELTA="*fp32", DK=elem, DV=elem)),
        "dq": (kernels.rel_attn_bwd_dq, dict(Q=elem, K=elem, V=elem, POS=elem, SEED="*i64", DO=elem, LSE="*fp32",
                                      DELTA="*fp32", DQ=elem, DPOS=elem)),
    }
    compiled = []
    for name, (kernel, pointers) in tensors.items():
        b = blocks[name]
        constexprs = dict(D=d_head, BLOCK_D=_block_d(d_head), BLOCK_M=b.block_m, BLOCK_N=b.block_n,
                          DROPOUT=dropout, IEEE=dtype == torch.float32)
        signature = {**pointers, **ints, **{key: "constexpr" for key in constexprs}}
        src = ASTSource(fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(key),): value
                                                                    for key, value in constexprs.items()})
        triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=b.num_warps, num_stages=b.num_stages))
        compiled.append(name)
    return compiled
