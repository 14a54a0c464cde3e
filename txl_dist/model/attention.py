"""Relative multi-head attention of Transformer-XL ("RelPartialLearnable", Dai et al. 2019, section 3.3).

score[i, j] = (q_i + u) . k_j + (q_i + v) . r_{i-j}, with u = r_w_bias, v = r_r_bias and r the projected
sinusoid embedding of the distance between query i and key j.

Five interchangeable implementations take the same arguments and return the same attention vectors:
- `rel_attention_reference`: plain einsum + the reference code's rel-shift; the test oracle.
- `rel_attention_matmul`: contiguous head-major layouts, batched matmuls, a free rel-shift, a softmax in
  the scores' dtype (accumulating in float32). The fastest on CPU (bench/bench_attention.py).
- `rel_attention_sdpa`: torch's scaled_dot_product_attention with the position term as an additive float
  mask; on CUDA, when that mask needs a gradient, only the memory-efficient kernel or the math path
  (`sdpa_backends`). Slower on CPU (docs/architecture.md).
- `rel_attention_flex`: FlexAttention (compiled): the content term is the fused kernel's own q.k, the
  position term a `score_mod` reading one precomputed [B, H, T, K+1] tensor at the rel-shifted index, the
  memory-causal pattern a BlockMask whose empty blocks are skipped. No score tensor is written, no
  attention dropout exists (docs/architecture.md: the dropatt policy), and on CPU there is no backward.
- `rel_attention_triton`: our own fused kernels (txl_dist/model/triton_attention.py): the same position
  tensor read at the rel-shifted index, the mask as index arithmetic, attention dropout from a counter-based
  generator, and a backward that writes the position gradient without atomics. CUDA only.

`attn_bias` is the additive [T, K] bias (0 visible, -inf masked) for matmul, sdpa and the reference; flex
takes the BlockMask of the same pattern (`flex_block_mask`), triton its `KeyPattern`: `attn_mask_for` gives
each path its form. "auto" is chosen by measurement at start-up (`candidate_attn_impls`, `time_attn_impls`),
or statically (`resolve_attn_impl`).

Shapes: B batch, T query length (the segment), K = mlen + T key length, H heads, D head size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from txl_dist.model import triton_attention
from txl_dist.model.dropout import Dropout, dropout

AttentionFn = Callable[..., torch.Tensor]


def build_attn_mask(qlen: int, mlen: int, mem_len: int, same_length: bool,
                    device: torch.device | None = None) -> torch.Tensor:
    """Bool [qlen, mlen + qlen], True where query i may NOT attend key j (exactly the reference code).

    Key j is masked for query i when j > i + mlen (the future). With same_length, keys that fall out of a
    window of the configured mem_len (not the actual mlen) are masked too, so every query sees the same
    number of keys.
    """
    klen = mlen + qlen
    ones = torch.ones(qlen, klen, dtype=torch.bool, device=device)
    mask = torch.triu(ones, diagonal=1 + mlen)                                     # [T, K]
    if same_length:
        mask_len = klen - mem_len
        mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
        mask = mask | torch.tril(ones, diagonal=-mask_shift_len)                   # [T, K]
    return mask


def visible_key(query_idx, key_idx, mlen: int, mem_len: int, same_length: bool):
    """True where query i may attend key j: the complement of build_attn_mask, as index arithmetic.

    Query i sits at key position i + mlen: it sees keys j <= i + mlen, and with same_length only the last
    mem_len of them (j > i + mlen - mem_len). Works on ints and on index tensors (FlexAttention's mask_mod).
    """
    visible = key_idx <= query_idx + mlen
    if same_length:
        visible = visible & (key_idx > query_idx + mlen - mem_len)
    return visible


@functools.lru_cache(maxsize=64)
def flex_block_mask(qlen: int, mlen: int, mem_len: int, same_length: bool, device: torch.device) -> BlockMask:
    """The BlockMask of build_attn_mask's pattern for flex_attention, made once per shape and settings.

    Broadcast over batch and heads (B = H = None). Its blocks are 128 x 128: blocks wholly in the future
    (or, with same_length, wholly out of the window) are skipped, partial ones evaluate the mask_mod.
    """
    def mask_mod(b, h, query_idx, key_idx):
        return visible_key(query_idx, key_idx, mlen, mem_len, same_length)

    # Kept eager: compiling the mask builder would add a compile per shape for a one-time cost.
    return create_block_mask(mask_mod, None, None, qlen, mlen + qlen, device=device)


@dataclasses.dataclass(frozen=True)
class KeyPattern:
    """build_attn_mask's pattern as the numbers `visible_key` needs: the fused Triton kernels' mask."""
    mlen: int
    mem_len: int
    same_length: bool

    @property
    def window(self) -> int | None:
        """Keys j > i + mlen - window only (same_length), or None."""
        return self.mem_len if self.same_length else None


def attn_mask_for(impl: str, qlen: int, mlen: int, mem_len: int, same_length: bool, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor | BlockMask | KeyPattern:
    """The `attn_bias` argument implementation `impl` takes for this pattern (built once per forward and
    shared by the layers): flex's cached BlockMask, triton's KeyPattern, else the additive [T, K] bias."""
    if impl == "flex":
        return flex_block_mask(qlen, mlen, mem_len, same_length, device)
    if impl == "triton":
        return KeyPattern(mlen, mem_len, same_length)
    return attn_bias_from_mask(build_attn_mask(qlen, mlen, mem_len, same_length, device), dtype)


def attn_bias_from_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask [T, K] -> additive bias [T, K]: 0 where visible, -inf where masked (built once per forward)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """The reference rel-shift on [..., T, K] scores whose column p holds distance K-1-p.

    Returns [..., T, K] whose entry [i, j] holds x[i, j + T - 1 - i], i.e. the term for distance
    (i + K - T) - j between query i and key j. Entries with j > i + K - T (the masked future) hold junk,
    exactly as in the reference code (pad a zero column in front, fold, drop the first row).
    """
    *lead, qlen, klen = x.shape
    padded = F.pad(x, (1, 0))                                                      # [..., T, K+1]
    padded = padded.view(*lead, klen + 1, qlen)                                    # [..., K+1, T]
    return padded[..., 1:, :].reshape(*lead, qlen, klen)                           # [..., T, K]


def _split_heads_reference(q: torch.Tensor, kv: torch.Tensor, n_head: int):
    bsz, qlen, _ = q.shape
    klen = kv.shape[1]
    head_q = q.view(bsz, qlen, n_head, -1)                                        # [B, T, H, D]
    head_k, head_v = kv.view(bsz, klen, 2, n_head, -1).unbind(2)                  # [B, K, H, D] each
    return head_q, head_k, head_v


def rel_attention_reference(q: torch.Tensor, kv: torch.Tensor, r_head_k: torch.Tensor,
                            r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, attn_bias: torch.Tensor,
                            dropatt: float = 0.0, training: bool = False) -> torch.Tensor:
    """Relative attention written plainly, as the reference code does it (the oracle for the fast paths).

    q: [B, T, H*D] queries of the segment; kv: [B, K, 2*H*D] keys then values of memory + segment;
    r_head_k: [K, H*D] projected position embeddings for distances K-1 .. 0; r_w_bias, r_r_bias: [H, D];
    attn_bias: [T, K] additive (0 or -inf). Returns attention vectors [B, T, H*D].
    """
    n_head, d_head = r_w_bias.shape
    head_q, head_k, head_v = _split_heads_reference(q, kv, n_head)
    head_r = r_head_k.view(-1, n_head, d_head)                                    # [K, H, D]
    ac = torch.einsum("bind,bjnd->bnij", head_q + r_w_bias, head_k)                # [B, H, T, K]
    bd = rel_shift(torch.einsum("bind,jnd->bnij", head_q + r_r_bias, head_r))     # [B, H, T, K]
    scores = (ac + bd) * d_head ** -0.5 + attn_bias                                # [B, H, T, K]
    probs = F.softmax(scores.float(), dim=-1).to(q.dtype)                         # [B, H, T, K]
    probs = F.dropout(probs, dropatt, training)
    attn_vec = torch.einsum("bnij,bjnd->bind", probs, head_v)                      # [B, T, H, D]
    return attn_vec.reshape(attn_vec.shape[0], attn_vec.shape[1], -1)             # [B, T, H*D]


def _head_major(q: torch.Tensor, kv: torch.Tensor, n_head: int):
    """Queries [H, B, T, D] and keys/values [H, B, K, D], contiguous: one copy each."""
    bsz, qlen, _ = q.shape
    klen = kv.shape[1]
    head_q = q.view(bsz, qlen, n_head, -1).permute(2, 0, 1, 3).contiguous()       # [H, B, T, D]
    head_kv = kv.view(bsz, klen, 2, n_head, -1).permute(2, 3, 0, 1, 4).contiguous()  # [2, H, B, K, D]
    head_k, head_v = head_kv.unbind(0)  # unbind: its backward stacks, indexing would zero-fill twice
    return head_q, head_k, head_v


POSITION_ROW_ALIGN: dict[str, int] = {"cpu": 1, "cuda": 8}
"""Per device type: the raw position scores' row width (K+1 distances) is rounded up to a multiple of this
(default 1: no padding). Tensor-core GEMMs on CUDA need 16-byte aligned rows; K+1 is odd for the presets
(K = tgt_len + mem_len), which left cuBLAS its alignment-1 kernels (cutlass_75 ..._align1) for the position
product forward and both of its gradients. Measured on an H200, bf16, configs/large.json's shape
(`python -m bench.position_rows`, 2026-12-04): padded 769 -> 776, attention alone forward + backward took
0.88x the time at micro batch 16 (0.93x at 8), the model's eager forward + backward 0.93x at 16 (1.00x at 8).
The CPU stays unpadded: not measured at the presets' shapes there, and the strided view costs the baddbmm
one copy of the scores."""


def position_row_width(klen: int, device: torch.device) -> int:
    """The raw position scores' row width for `klen` keys on `device` (POSITION_ROW_ALIGN)."""
    align = POSITION_ROW_ALIGN.get(device.type, 1)
    return -(-(klen + 1) // align) * align


def _raw_position_scores(q_r: torch.Tensor, r_head_k: torch.Tensor, klen: int) -> torch.Tensor:
    """Unshifted position products [H*B, T, W] of q_r [H, B, T, D] with the distance rows K-1 .. 0 of r,
    padded with all-zero rows to the width W = position_row_width (>= K+1): one matmul per head."""
    n_head, bsz, qlen, d_head = q_r.shape
    width = position_row_width(klen, q_r.device)
    head_r = r_head_k.view(klen, n_head, d_head)                                  # [K, H, D]
    head_r = F.pad(head_r, (0, 0, 0, 0, 0, width - klen)).permute(1, 2, 0)        # [H, D, W]
    raw = torch.bmm(q_r.reshape(n_head, bsz * qlen, d_head), head_r)             # [H, B*T, W]
    return raw.view(n_head * bsz, qlen, width)                                    # [H*B, T, W]


def _position_scores(q_r: torch.Tensor, r_head_k: torch.Tensor, klen: int) -> torch.Tensor:
    """Rel-shifted position term [H*B, T, K] from q_r = (q + v) * scale [H, B, T, D], for free.

    r gets all-zero distance rows up to the row width W (at least one: W >= K+1, position_row_width), so the
    raw scores are [H, B*T, W]. The shifted entry [i, j] = raw[i, j + T - 1 - i] sits at flat offset
    i*(W-1) + j + T - 1 of each [T, W] block: a narrow + view + narrow gives the shifted [T, K] matrix with row
    stride W-1 (no copy, no as_strided overlap; contiguous when W = K+1). Positions past the diagonal + mlen
    read zeros or junk and are masked.
    """
    n_head, bsz, qlen, _ = q_r.shape
    raw = _raw_position_scores(q_r, r_head_k, klen)                               # [H*B, T, W]
    width = raw.shape[2]
    raw = raw.view(n_head * bsz, qlen * width)                                    # [H*B, T*W]
    shifted = raw.narrow(1, qlen - 1, qlen * (width - 1)).view(n_head * bsz, qlen, width - 1)
    return shifted.narrow(2, 0, klen)                                             # [H*B, T, K]


def rel_attention_matmul(q: torch.Tensor, kv: torch.Tensor, r_head_k: torch.Tensor,
                         r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, attn_bias: torch.Tensor,
                         dropatt: float = 0.0, training: bool = False) -> torch.Tensor:
    """Fast relative attention (same arguments and result as `rel_attention_reference`).

    Head-major [H, B, T, D] layouts make the position term one large matmul per head (B*T query rows
    against the K+1 distances, no broadcast copy of r per batch row) and every other product a plain
    bmm over H*B; the content term accumulates onto the shifted position term in one baddbmm; the mask
    is added in place (its backward is free). The softmax takes bf16/fp16 scores as they are: torch's CPU and
    CUDA kernels accumulate in float32 and round once at the end, so the forward equals softmax in float32
    cast back bit for bit, without the two float32 copies of the score tensor (and the float32 one saved for
    backward) that an explicit upcast writes.
    """
    n_head, d_head = r_w_bias.shape
    bsz, qlen, _ = q.shape
    klen = kv.shape[1]
    scale = d_head ** -0.5
    head_q, head_k, head_v = _head_major(q, kv, n_head)                           # [H,B,T,D], [H,B,K,D] x2
    q_w = (head_q + r_w_bias[:, None, None]) * scale                              # [H, B, T, D]
    q_r = (head_q + r_r_bias[:, None, None]) * scale                              # [H, B, T, D]
    bd = _position_scores(q_r, r_head_k, klen)                                    # [H*B, T, K]
    scores = torch.baddbmm(bd, q_w.view(n_head * bsz, qlen, d_head),
                           head_k.view(n_head * bsz, klen, d_head).transpose(1, 2))  # [H*B, T, K]
    scores.add_(attn_bias)
    probs = F.softmax(scores, dim=-1)                                              # [H*B, T, K]
    probs = dropout(probs, dropatt, training)
    attn_vec = torch.bmm(probs, head_v.view(n_head * bsz, klen, d_head))          # [H*B, T, D]
    attn_vec = attn_vec.view(n_head, bsz, qlen, d_head).permute(1, 2, 0, 3)        # [B, T, H, D] (view)
    return attn_vec.reshape(bsz, qlen, n_head * d_head)                           # [B, T, H*D]


def sdpa_backends(device: torch.device, mask_needs_grad: bool) -> list[SDPBackend] | None:
    """The SDPA kernels rel_attention_sdpa allows on `device`; None: torch's own choice, unrestricted.

    The float mask carries the position term, so in training it needs a gradient. On CUDA torch may pick a
    kernel that cannot give one: cuDNN attention, first in recent torch's order on SM 9.0/10.0 (H100, H200,
    B200) with a recent cuDNN, whose eligibility check ignores whether the mask requires grad; its op then
    refuses the mask ("not differentiable with respect to argument 'attn_bias'", already when the forward
    records the graph). Flash takes no arbitrary mask at all. The memory-efficient kernel returns the mask's
    gradient; the math path is the fallback where it cannot run (e.g. float64). A CPU has no memory-efficient
    kernel and its dispatcher already takes the math path for a mask that needs grad: restricting it would
    only take the flash kernel from its no-grad forwards.
    """
    if device.type == "cuda" and mask_needs_grad:
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return None


def rel_attention_sdpa(q: torch.Tensor, kv: torch.Tensor, r_head_k: torch.Tensor,
                       r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, attn_bias: torch.Tensor,
                       dropatt: float = 0.0, training: bool = False) -> torch.Tensor:
    """Relative attention through F.scaled_dot_product_attention (same arguments and result).

    The content term is SDPA's own q.k product with q + u; the rel-shifted position term plus the causal
    mask go in as an additive float mask. On CUDA a mask that needs a gradient runs on the memory-efficient
    kernel (or the math path), never cuDNN or flash (`sdpa_backends`); a no-grad forward and every CPU call
    leave the choice to torch.
    """
    n_head, d_head = r_w_bias.shape
    bsz, qlen, _ = q.shape
    klen = kv.shape[1]
    scale = d_head ** -0.5
    head_q, head_k, head_v = _head_major(q, kv, n_head)                           # [H,B,T,D], [H,B,K,D] x2
    q_r = (head_q + r_r_bias[:, None, None]) * scale                              # [H, B, T, D]
    bd = _position_scores(q_r, r_head_k, klen) + attn_bias                        # [H*B, T, K]
    backends = sdpa_backends(head_q.device, torch.is_grad_enabled() and bd.requires_grad)
    # SDPA treats dims 0 and 1 as batch and heads; head-major [H, B, ...] is as good as [B, H, ...].
    with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext():
        attn_vec = F.scaled_dot_product_attention(
            head_q + r_w_bias[:, None, None], head_k, head_v,
            attn_mask=bd.view(n_head, bsz, qlen, klen),
            dropout_p=dropatt if training else 0.0, scale=scale)                  # [H, B, T, D]
    return attn_vec.permute(1, 2, 0, 3).reshape(bsz, qlen, n_head * d_head)        # [B, T, H*D]


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once per process (lazily: importing the model compiles nothing). Called
    eagerly, flex_attention would materialize the scores; inside a compiled layer the plain function is
    traced instead (rel_attention_flex). Static shapes: torch 2.13's CPU kernel for dynamic shapes fails to
    build (inductor C++ error), and a static kernel per key length is the fastest on any device."""
    return torch.compile(flex_attention, dynamic=False)


FLEX_RECOMPILE_LIMIT = 64
"""Key lengths the compiled flex_attention may specialize on. Evaluation and generation grow the memory
segment by segment (eval.mem_len / eval.tgt_len + 1 key lengths: 14 for the large preset), which would pass
torch's default recompile limit (8) and leave the steady state, full memory, on the unfused kernel."""


def recompile_limit(n: int):
    """A context in which dynamo compiles a function for up to n shapes (then runs it eagerly). The setting is
    `recompile_limit` from torch 2.7 on and `cache_size_limit` before (torch 2.6 has no recompile_limit)."""
    config = torch._dynamo.config
    return config.patch(**{"recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit": n})


def rel_attention_flex(q: torch.Tensor, kv: torch.Tensor, r_head_k: torch.Tensor,
                       r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, attn_bias: torch.Tensor | BlockMask,
                       dropatt: float = 0.0, training: bool = False) -> torch.Tensor:
    """Relative attention through compiled FlexAttention (same arguments and result as the reference).

    attn_bias: the BlockMask of the pattern (`flex_block_mask`; masked blocks are skipped), or the
    additive [T, K] bias, then added in the score_mod over every block. The position term is the raw
    (q + v) . r product against K+1 distance rows (padded to position_row_width), [B, H, T, W], read by
    the score_mod at the rel-shifted column j + T - 1 - i (as `_position_scores` does by layout): no
    shifted copy, no [T, K] score tensor.
    Entries past the diagonal + mlen read the zero row (clamped index) and are masked anyway.
    FlexAttention has no dropout: training with dropatt > 0 is refused (config validation; here too).
    """
    if training and dropatt > 0:
        raise ValueError(f"attn_impl 'flex' has no attention dropout but dropatt is {dropatt}; set dropatt 0 "
                         "or use attn_impl 'auto' (docs/architecture.md: the dropatt policy)")
    n_head, d_head = r_w_bias.shape
    bsz, qlen, _ = q.shape
    klen = kv.shape[1]
    scale = d_head ** -0.5
    head_q = q.view(bsz, qlen, n_head, d_head).transpose(1, 2)                    # [B, H, T, D]
    head_k, head_v = kv.view(bsz, klen, 2, n_head, d_head).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, K, D] x2
    if head_q.device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, kv, r_head_k, r_w_bias, r_r_bias)):
        raise ValueError("attn_impl 'flex' cannot train on a CPU (FlexAttention has no CPU backward); use "
                         "attn_impl 'auto' or 'matmul' (flex serves evaluation there)")
    width = position_row_width(klen, head_q.device)                              # W >= K+1: rows K.. zero
    head_r = F.pad(r_head_k.view(klen, n_head, d_head), (0, 0, 0, 0, 0, width - klen))  # [W, H, D]
    pos = torch.matmul((head_q + r_r_bias[:, None]) * scale,
                       head_r.permute(1, 2, 0))                                    # [B, H, T, W]
    shift, last = qlen - 1, klen  # python ints: constants of the compiled kernel

    if isinstance(attn_bias, BlockMask):
        def score_mod(score, b, h, query_idx, key_idx):
            return score + pos[b, h, query_idx, torch.clamp(key_idx + shift - query_idx, max=last)]
        block_mask = attn_bias
    else:
        def score_mod(score, b, h, query_idx, key_idx):
            rel = torch.clamp(key_idx + shift - query_idx, max=last)
            return score + pos[b, h, query_idx, rel] + attn_bias[query_idx, key_idx]
        block_mask = None
    # Inside a compiled layer (train.compile) dynamo fuses flex_attention into the layer's graph itself.
    args = ((head_q + r_w_bias[:, None]).contiguous(), head_k.contiguous(), head_v.contiguous())
    if torch.compiler.is_compiling():
        attn_vec = flex_attention(*args, score_mod=score_mod, block_mask=block_mask, scale=scale)  # [B, H, T, D]
    else:
        with recompile_limit(FLEX_RECOMPILE_LIMIT):
            attn_vec = _compiled_flex_attention()(*args, score_mod=score_mod, block_mask=block_mask,
                                                  scale=scale)                    # [B, H, T, D]
    return attn_vec.transpose(1, 2).reshape(bsz, qlen, n_head * d_head)          # [B, T, H*D]


def rel_attention_triton(q: torch.Tensor, kv: torch.Tensor, r_head_k: torch.Tensor,
                         r_w_bias: torch.Tensor, r_r_bias: torch.Tensor, attn_bias: KeyPattern,
                         dropatt: float = 0.0, training: bool = False) -> torch.Tensor:
    """Relative attention through the fused Triton kernels (same arguments and result as the reference).

    attn_bias: the KeyPattern of the mask (`attn_mask_for`). The inputs go in as rel_attention_matmul
    prepares them: head-major q_w = (q + u) * scale and k, v, and the unshifted position products
    ((q + v) * scale) . r [H*B, T, W], all in the projections' dtype (float32 biases under autocast would
    otherwise promote them). Attention dropout is the kernels' own (txl_dist/model/triton_attention.py).
    """
    if not isinstance(attn_bias, KeyPattern):
        raise TypeError(f"attn_impl 'triton' takes a KeyPattern as attn_bias (attn_mask_for), got "
                        f"{type(attn_bias).__name__}")
    if q.device.type != "cuda" and not triton_attention.interpreting():
        raise ValueError("attn_impl 'triton' runs on CUDA only (its kernels are Triton's); use attn_impl 'auto' "
                         "or 'matmul'")
    n_head, d_head = r_w_bias.shape
    bsz, qlen, _ = q.shape
    klen = kv.shape[1]
    scale = d_head ** -0.5
    head_q, head_k, head_v = _head_major(q, kv, n_head)                           # [H,B,T,D], [H,B,K,D] x2
    dtype = head_q.dtype
    q_w = ((head_q + r_w_bias[:, None, None]) * scale).to(dtype)                  # [H, B, T, D]
    q_r = ((head_q + r_r_bias[:, None, None]) * scale).to(dtype)                  # [H, B, T, D]
    pos = _raw_position_scores(q_r, r_head_k.to(dtype), klen)                     # [H*B, T, W]
    attn_vec = triton_attention.fused_rel_attention(
        q_w.view(n_head * bsz, qlen, d_head), head_k.view(n_head * bsz, klen, d_head),
        head_v.view(n_head * bsz, klen, d_head), pos, attn_bias.mlen, attn_bias.window,
        dropatt if training else 0.0)                                              # [H*B, T, D]
    attn_vec = attn_vec.view(n_head, bsz, qlen, d_head).permute(1, 2, 0, 3)        # [B, T, H, D] (view)
    return attn_vec.reshape(bsz, qlen, n_head * d_head)                           # [B, T, H*D]


ATTN_IMPLS: dict[str, AttentionFn] = {
    "reference": rel_attention_reference,
    "matmul": rel_attention_matmul,
    "sdpa": rel_attention_sdpa,
    "flex": rel_attention_flex,
    "triton": rel_attention_triton,
}
"""Attention implementations by name; `TransformerXL.attn_impl` picks one ("auto": see AUTO_ATTN_IMPL)."""

AUTO_ATTN_IMPL: dict[str, str] = {"cpu": "matmul"}
"""What "auto" means per device type without a start-up measurement (bench/bench_attention.py). CUDA was
not measured (no GPU where this was written): "matmul" until start-up measures (time_attn_impls)."""


@functools.lru_cache(maxsize=None)
def _cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # unknown: keep the default


def resolve_attn_impl(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The implementation name that `name` ("auto" or one of ATTN_IMPLS) means on `device` for `dtype`."""
    if name == "auto":
        # Measured: on a CPU without native bf16 (AVX2 only) bf16 bmm runs ~10x slower than fp32, and SDPA's
        # CPU kernel (which does its products blockwise in fp32) beats the matmul path 1.7-3x; with native
        # bf16 (AMX, docs/architecture.md) SDPA loses.
        if device.type == "cpu" and dtype == torch.bfloat16 and not _cpu_has_native_bf16():
            return "sdpa"
        return AUTO_ATTN_IMPL.get(device.type, "matmul")
    if name not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {name!r} is unknown; use 'auto' or one of {', '.join(ATTN_IMPLS)}")
    return name


def candidate_attn_impls(device: torch.device, dtype: torch.dtype, *, training: bool, dropatt: float) -> list[str]:
    """The implementations "auto" may pick on this device and dtype (what start-up measures).

    The reference einsum is the test oracle, never a candidate. flex has no attention dropout (so not for
    training with dropatt > 0: docs/architecture.md, the dropatt policy) and no backward on a CPU; its CPU
    forward (compiled C++) lost to sdpa in fp32 and bf16 and to matmul in fp32 on evaluation shapes
    (bench/bench_attention.py, docs/architecture.md), so on a CPU it is a candidate for neither training
    nor evaluation (measuring it would only add a compile to start-up). triton (our fused kernels, with
    attention dropout) is a candidate on CUDA wherever the triton package imports.
    """
    del dtype  # every path serves every dtype; the measurement decides between them
    names = ["matmul", "sdpa"]
    if device.type != "cpu" and not (training and dropatt > 0):
        names.append("flex")
    if device.type == "cuda" and triton_attention.triton_available():
        names.append("triton")
    return names


def time_attn_impls(names: list[str], *, batch: int, n_head: int, d_head: int, qlen: int, klen: int,
                    device: torch.device, dtype: torch.dtype, training: bool, reps: int = 5,
                    warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per call of each named implementation on these shapes: forward + backward when training,
    a no-grad forward otherwise. The median of `reps` calls, interleaved so that load changes hit all alike,
    after `warmup` calls (which absorb flex's and triton's compiles), timed by `clock` (the wall clock; a
    CPU's caller may pass time.thread_time, whose seconds leave out the time the thread spent preempted).
    Memory is full (mlen = klen - qlen = mem_len), the steady state of training; inputs are seeded random
    numbers. A path that fails on these shapes (a kernel limit, out of memory, a kernel that does not
    compile) gets math.inf: it can never be the fastest.
    """
    device = torch.device(device)
    mlen = klen - qlen
    hd = n_head * d_head
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.5).to(dtype).requires_grad_(training)

    x = dict(q=rnd(batch, qlen, hd), kv=rnd(batch, klen, 2 * hd), r_head_k=rnd(klen, hd),
             r_w_bias=rnd(n_head, d_head), r_r_bias=rnd(n_head, d_head))
    grad_out = torch.randn(batch, qlen, hd, generator=gen, device=device).to(dtype)
    masks = {name: attn_mask_for(name, qlen, mlen, mlen, False, device, dtype) for name in names}

    def call(name: str) -> None:
        fn = ATTN_IMPLS[name]
        mask = masks[name]
        if training:
            torch.autograd.grad(fn(**x, attn_bias=mask, training=True), list(x.values()), grad_out)
        else:
            with torch.no_grad():
                fn(**x, attn_bias=mask)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    unknown = [name for name in names if name not in ATTN_IMPLS]
    if unknown:
        raise ValueError(f"time_attn_impls: unknown implementation(s) {unknown}; use names of ATTN_IMPLS")
    failed: set[str] = set()
    for name in names:
        try:
            for _ in range(warmup):
                call(name)
            sync()
        except Exception:  # noqa: BLE001  (a kernel limit, out of memory, a Triton compile error: not a candidate)
            failed.add(name)
    times: dict[str, list[float]] = {name: [math.inf] for name in failed}
    times.update({name: [] for name in names if name not in failed})
    for _ in range(reps):
        for name in (n for n in names if n not in failed):
            sync()
            start = clock()
            call(name)
            sync()
            times[name].append(clock() - start)
    return {name: statistics.median(times[name]) for name in names}


class QKVProjection(nn.Linear):
    """One bias-free weight [3*H*D, d_model] (rows: q, k, v). Queries come from the segment only, keys and
    values from memory + segment, which skips the reference code's query rows for the memory.

    Slicing the weight inside this module's own forward keeps ZeRO-3 happy (it gathers a module's
    parameters when that module runs, also when activation checkpointing recomputes it).
    """

    def __init__(self, d_model: int, n_head: int, d_head: int):
        super().__init__(d_model, 3 * n_head * d_head, bias=False)

    def forward(self, cat: torch.Tensor, qlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cat [B, K, d_model] -> q [B, T, H*D] (last T positions), kv [B, K, 2*H*D]."""
        hd = self.out_features // 3
        q = F.linear(cat[:, cat.shape[1] - qlen:], self.weight[:hd])              # [B, T, H*D]
        kv = F.linear(cat, self.weight[hd:])                                       # [B, K, 2*H*D]
        return q, kv


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """The attention sub-layer: projections, relative attention, output projection, residual + LayerNorm.

    untie_r: this layer owns its r_w_bias (u) and r_r_bias (v) [n_head, d_head]; otherwise the caller passes
    the pair shared by all layers.
    """

    def __init__(self, d_model: int, n_head: int, d_head: int, dropout: float, dropatt: float,
                 pre_lnorm: bool, layer_norm_epsilon: float, untie_r: bool):
        super().__init__()
        self.n_head = n_head
        self.d_head = d_head
        self.dropatt = dropatt
        self.pre_lnorm = pre_lnorm
        self.qkv_net = QKVProjection(d_model, n_head, d_head)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.drop = Dropout(dropout)
        if untie_r:
            self.r_w_bias = nn.Parameter(torch.empty(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.empty(n_head, d_head))
        else:
            self.r_w_bias = self.r_r_bias = None

    def forward(self, h: torch.Tensor, pos_emb: torch.Tensor, mem: torch.Tensor | None,
                attn_bias: torch.Tensor | BlockMask, attn_fn: AttentionFn,
                r_w_bias: torch.Tensor | None = None, r_r_bias: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, d_model], pos_emb [K, d_model], mem [B, mlen, d_model] or None -> [B, T, d_model]."""
        r_w_bias = self.r_w_bias if self.r_w_bias is not None else r_w_bias
        r_r_bias = self.r_r_bias if self.r_r_bias is not None else r_r_bias
        qlen = h.shape[1]
        cat = h if mem is None or mem.shape[1] == 0 else torch.cat([mem, h], dim=1)  # [B, K, d_model]
        if self.pre_lnorm:
            cat = self.layer_norm(cat)
        q, kv = self.qkv_net(cat, qlen)                                            # [B,T,H*D], [B,K,2*H*D]
        r_head_k = self.r_net(pos_emb)                                             # [K, H*D]
        attn_vec = attn_fn(q, kv, r_head_k, r_w_bias, r_r_bias, attn_bias,
                           self.dropatt, self.training)                            # [B, T, H*D]
        attn_out = self.drop(self.o_net(attn_vec))                                 # [B, T, d_model]
        if self.pre_lnorm:
            return h + attn_out
        return self.layer_norm(h + attn_out)
