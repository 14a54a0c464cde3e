"""Fused relative attention in Triton (attn_impl "triton"): the scores never reach device memory.

One kernel per query block walks the visible key blocks with an online softmax (FlashAttention-2's scheme):
content term q_w . k from the block's own dot product, position term read from the raw position product
`pos` [BH, T, W] (W >= K+1 distance columns) at the rel-shifted column j + T - 1 - i, the memory-causal
pattern (and same_length's window) as index arithmetic, attention dropout from a counter-based generator
(Philox, `tl.philox`) keyed by one seed per call (one Philox call per eight scores with 16-bit draws,
`dropout_words`; the mask depends on the head-batch row, query and key, not on the tiles). The forward stores
the mask as bits, one per score, and the backward reads them instead of drawing again (Philox was about half
of each backward loop's instructions, bench/triton_census.py; the bits are 1/16 of a bf16 score tensor). Key
tiles that every row of the query tile sees whole run without the mask's arithmetic (`_full_keys`,
`_full_queries` in the kernels); exponentials are base 2.
Saved for backward: the output, one float32 log-sum-exp per query row and the dropout bits. On CUDA each
kernel times its candidate tiles at its first call per shape class and keeps the fastest (TILE_CANDIDATES).

The backward is two kernels that recompute the probabilities block by block: one per key block (dk, dv in
registers), one per query block (dq, and the position term's gradient). Every entry of `pos` is read by at
most one (query, key) pair (for a fixed row i the column j + T - 1 - i is one-to-one in j), so `dpos` is
written with plain stores, no atomics: the reason this path exists beside FlexAttention, whose generic
gradient of a captured tensor must assume collisions. A small store kernel writes the zeros of the entries no
pair reads, so `dpos` is never zero-filled as a whole.

Inputs are pre-scaled as in `rel_attention_matmul` (q_w = (q + u) / sqrt(D), pos = ((q + v) / sqrt(D)) . r),
so score = q_w . k + pos[i, j + T - 1 - i]. Shapes: BH = batch x heads (any order), T queries, KL = mlen + T
keys, D head size (any: padded to a power of two in registers).

CUDA only in production (`rel_attention_triton` in attention.py refuses a CPU tensor). Under Triton's
interpreter (TRITON_INTERPRET=1 when the kernels are first imported) the same kernels run on CPU tensors:
the test suite checks them that way against the einsum reference (tests/test_triton_attention.py), and
compiles them for sm_90 without a GPU (`compile_for_target`).
"""
import functools
import importlib.util
import inspect
import math
import os
from typing import NamedTuple

import torch

from txl_dist.model.dropout import drop_level


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


KERNEL_NAMES = {"fwd": "rel_attn_fwd", "dkdv": "rel_attn_bwd_dkdv", "dq": "rel_attn_bwd_dq"}
"""The kernels of txl_dist/model/triton_kernels.py by role."""

TILE_CANDIDATES: dict[str, tuple[Blocks, ...]] = {
    "fwd": (Blocks(128, 64, 8, 2), Blocks(64, 64, 4, 2), Blocks(64, 32, 4, 2)),
    "dkdv": (Blocks(128, 64, 8, 2), Blocks(64, 64, 4, 2), Blocks(32, 64, 4, 2)),
    "dq": (Blocks(128, 32, 8, 2), Blocks(64, 32, 4, 2), Blocks(32, 64, 4, 2)),
}
"""The tiles each kernel chooses from on CUDA, by timing them (triton.autotune) at its first call per shape
class (`shape_class`), head size, dtype and dropout: measured on the device, not fixed here. Chosen by the
kernels' machine code for sm_90 (bench/triton_census.py, bf16, d_head 64, dropout, 2026-12-05): the fewest
issue cycles per score among tiles whose loops spill nothing (dkdv's 64 x 64 on 4 warps since the stored dropout
bits: 0.220 in its whole-tile loop against 0.228 for the default, the edge loops the other way round; it took the
place of 64 x 32 on 4 warps, 0.364). A Hopper warpgroup multiplies 64 rows at a
time, so a block of rows must be at least 16 x warps: 64 rows on 8 warps (the old default) computed every
score twice. First of each: the default where nothing is timed (`kernel_blocks`). A tile that does not fit
the device (shared memory, registers) is skipped by the tuner. Tiles change the order of the float32 sums (not
the dropout mask: it is a function of the head-batch row, query and key), so two runs on one GPU may pick
differently and differ in the last bits, as GPU runs do anyway (docs/checkpoints.md)."""


CRASHES_OLDER_TRITON = (("dkdv", Blocks(64, 64, 8, 2)),)
"""Tiles whose compile aborts the process in triton before 3.6: Triton 3.2 (torch 2.6's) fails an assertion in
its layout code (LinearLayout::reshapeOuts) on dkdv at 64 x 64 on 8 warps, with or without dropout, for sm_90
and sm_80 alike (the kernels of 2026-12-04; every candidate of today compiles with 3.2, 3.6 and 3.9). An abort
cannot be caught, so the tuner must never try it there: the entry stays though that tile is no candidate now
(64 rows on 8 warps duplicate work on Hopper, TILE_CANDIDATES), should it come back."""


def _triton_version() -> tuple[int, int]:
    import importlib.metadata

    return tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])


def tile_candidates(name: str) -> tuple[Blocks, ...]:
    """TILE_CANDIDATES[name] that this triton compiles (CRASHES_OLDER_TRITON)."""
    if _triton_version() >= (3, 6):
        return TILE_CANDIDATES[name]
    return tuple(b for b in TILE_CANDIDATES[name] if (name, b) not in CRASHES_OLDER_TRITON)


INTERPRETER_BLOCKS = Blocks(16, 16, 1, 1)
"""Every kernel's tiles in the interpreter: the smallest a dot product takes, so small test shapes cross tile
borders."""


def kernel_blocks(device: torch.device) -> dict[str, Blocks]:
    """Tile sizes per kernel without tuning: on CUDA the first candidate of each (tile_candidates); in the
    interpreter INTERPRETER_BLOCKS."""
    if device.type != "cuda":
        return dict.fromkeys(KERNEL_NAMES, INTERPRETER_BLOCKS)
    return {name: tile_candidates(name)[0] for name in KERNEL_NAMES}


def shape_class(qlen: int, klen: int) -> int:
    """The tuner's key for a shape: query and key lengths rounded up to powers of two. Evaluation's memory grows
    segment by segment, a new key length each time: exact lengths would time the tiles again for each."""
    return (1 << (qlen - 1).bit_length()) << 24 | (1 << (klen - 1).bit_length())


def tunes(device: torch.device) -> bool:
    """Whether the kernels choose their tiles by timing on this device (CUDA; the interpreter has no clock)."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=None)
def _tuned(name: str):
    """The kernel `name` wrapped in triton.autotune over its tile_candidates (CUDA)."""
    import triton

    configs = [triton.Config({"BLOCK_M": b.block_m, "BLOCK_N": b.block_n}, num_warps=b.num_warps,
                             num_stages=b.num_stages) for b in tile_candidates(name)]
    return triton.autotune(configs, key=["SHAPE_CLASS", "D", "DROP_BITS", "IEEE"])(
        getattr(_kernels(), KERNEL_NAMES[name]))


def tuned_tiles() -> dict[str, str]:
    """The tile each tuned kernel last ran with (for a benchmark's record); empty before the first CUDA call."""
    if not _tuned.cache_info().currsize:
        return {}
    picked = {name: getattr(_tuned(name), "best_config", None) for name in KERNEL_NAMES}
    return {name: str(config) for name, config in picked.items() if config is not None}


def _kernels():
    """The kernels module (txl_dist/model/triton_kernels.py), imported at the first call."""
    if not triton_available():
        raise RuntimeError("attn_impl 'triton' needs the triton package (it comes with torch's CUDA wheels); "
                           "use attn_impl 'auto' or 'matmul'")
    from txl_dist.model import triton_kernels

    return triton_kernels


class DropoutWords(NamedTuple):
    """How the kernels draw attention dropout for a drop probability: `bits` per draw (0: no dropout; 16: eight
    draws per Philox call; 32: four), a score kept where its draw is at least `keep_from` (passed to the kernel
    as the int32 of the same bits), kept scores scaled by `scale`."""
    bits: int
    keep_from: int
    scale: float


def dropout_words(p_drop: float) -> DropoutWords:
    """16-bit draws where they hold p_drop within 0.1% (as the CPU dropout's masks, txl_dist/model/dropout.py:
    every p from ~0.0076 up, and some below), else 32-bit ones. The drop probability is then keep_from / 2^bits,
    and `scale` is exactly 1 / (1 - that), so the expectation is preserved exactly."""
    if p_drop == 0:
        return DropoutWords(0, 0, 1.0)
    k16 = drop_level(p_drop)
    if k16 is not None:
        return DropoutWords(16, k16, 65536 / (65536 - k16))
    k32 = min(max(round(p_drop * 2 ** 32), 1), 2 ** 32 - 1)
    return DropoutWords(32, k32, 2 ** 32 / (2 ** 32 - k32))


def _int32_bits(value: int) -> int:
    """The int32 with the bits of a uint32 (a kernel's integer arguments are signed 32-bit up to 2^31 - 1)."""
    return value - 2 ** 32 if value >= 2 ** 31 else value


def _kernel_meta(d_head: int, dtype: torch.dtype, drop_bits: int) -> dict:
    """The kernels' compile-time parameters other than the tiles: the head size, its power-of-two register
    width (at least 16, a dot product's minimum), the dropout draws' bits (0: none; dropout_words), and IEEE
    products for float32."""
    return dict(D=d_head, BLOCK_D=max(16, 1 << (d_head - 1).bit_length()), DROP_BITS=drop_bits,
                IEEE=dtype == torch.float32)


def key_groups(klen: int) -> int:
    """Bytes per query row of the stored dropout mask: one bit per key."""
    return -(-klen // 8)


def _launch(name: str, rows: int, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, tensors: tuple,
            mlen: int, window: int, p_drop: float) -> None:
    """Runs kernel `name` over `rows` rows (queries; keys for dkdv) of each head-batch row: tuned on CUDA, with
    kernel_blocks' tiles in the interpreter."""
    bh, qlen, d_head = q.shape
    klen = k.shape[1]
    words = dropout_words(p_drop)
    drawn = (_int32_bits(words.keep_from),) if name == "fwd" else ()  # the backward reads the forward's mask
    args = (*tensors, qlen, klen, pos.shape[2], key_groups(klen), mlen, window, *drawn, words.scale,
            shape_class(qlen, klen))
    meta = _kernel_meta(d_head, q.dtype, words.bits)

    def grid(tiles: dict) -> tuple[int, int]:
        return math.ceil(rows / tiles["BLOCK_N" if name == "dkdv" else "BLOCK_M"]), bh

    if tunes(q.device):
        _tuned(name)[grid](*args, **meta)
        return
    b = kernel_blocks(q.device)[name]
    tiles = dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n)
    getattr(_kernels(), KERNEL_NAMES[name])[grid(tiles)](*args, **meta, **tiles, num_warps=b.num_warps,
                                                         num_stages=b.num_stages)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, mlen: int) -> None:
    bh, qlen, d_head = q.shape
    if k.shape != (bh, qlen + mlen, d_head) or v.shape != k.shape:
        raise ValueError(f"rel_attn: keys/values {tuple(k.shape)}/{tuple(v.shape)} do not fit queries "
                         f"{tuple(q.shape)} with mlen {mlen}")
    if pos.shape[:2] != (bh, qlen) or pos.shape[2] < qlen + mlen + 1:
        raise ValueError(f"rel_attn: position scores {tuple(pos.shape)} need [{bh}, {qlen}, >= {qlen + mlen + 1}]")
    if len({t.dtype for t in (q, k, v, pos)}) != 1 or not all(t.is_contiguous() for t in (q, k, v, pos)):
        raise ValueError("rel_attn: q, k, v and pos must be contiguous and of one dtype")


def _keep_mask_shape(q: torch.Tensor, k: torch.Tensor, p_drop: float) -> tuple[int, ...]:
    """The stored dropout mask: [BH, T, KL / 8] bytes, one bit per score; one unread byte without dropout."""
    return (q.shape[0], q.shape[1], key_groups(k.shape[1])) if p_drop > 0 else (1,)


@torch.library.custom_op("txl_dist::rel_attn_fwd", mutates_args=())
def rel_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seed: torch.Tensor,
                 mlen: int, window: int, p_drop: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output [BH, T, D], float32 log-sum-exp [BH, T] and the dropout mask as bits (uint8 [BH, T, KL / 8]:
    bit b of byte g keeps key 8g + b; bytes of blocks no visible pair reads are left unwritten) of fused relative
    attention (module doc).

    window: keys j > i + mlen - window only (same_length's mem_len; KL, the key count, for no window);
    seed: int64 [1] on the device, read by the kernel (dropout's key; unused when p_drop is 0)."""
    _check_inputs(q, k, v, pos, mlen)
    bh, qlen, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(bh, qlen, dtype=torch.float32, device=q.device)
    keep = torch.empty(_keep_mask_shape(q, k, p_drop), dtype=torch.uint8, device=q.device)
    _launch("fwd", qlen, q, k, pos, (q, k, v, pos, seed, out, lse, keep), mlen, window, p_drop)
    return out, lse, keep


@rel_attn_fwd.register_fake
def _(q, k, v, pos, seed, mlen, window, p_drop):
    return (torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32),
            q.new_empty(_keep_mask_shape(q, k, p_drop), dtype=torch.uint8))


ZERO_BLOCKS = Blocks(32, 128, 4, 1)
"""Tiles of rel_attn_zero_unread on CUDA (a store-only kernel: not tuned; INTERPRETER_BLOCKS there)."""


def position_grad_buffer(pos: torch.Tensor) -> torch.Tensor:
    """The position gradient's storage, uninitialized: the dq kernel and rel_attn_zero_unread write every entry
    once (a memset of the whole [BH, T, W] fewer per layer and step: ~26% of it is zeros at large's shape;
    the tests hand it NaNs)."""
    return torch.empty_like(pos)


def _zero_unread(dpos: torch.Tensor, qlen: int, klen: int, mlen: int, window: int) -> None:
    """Zeros where no (query, key) pair reads the position product (rel_attn_zero_unread)."""
    b = ZERO_BLOCKS if dpos.device.type == "cuda" else INTERPRETER_BLOCKS
    _kernels().rel_attn_zero_unread[(math.ceil(qlen / b.block_m), dpos.shape[0])](
        dpos, qlen, klen, dpos.shape[2], mlen, window, BLOCK_M=b.block_m, BLOCK_N=b.block_n,
        num_warps=b.num_warps, num_stages=b.num_stages)


@torch.library.custom_op("txl_dist::rel_attn_bwd", mutates_args=())
def rel_attn_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, keep: torch.Tensor, mlen: int, window: int,
                 p_drop: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv, dpos) of rel_attn_fwd's output; keep: its dropout bits (read when p_drop > 0)."""
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)                              # [BH, T]: rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dpos = position_grad_buffer(pos)
    _zero_unread(dpos, q.shape[1], k.shape[1], mlen, window)
    _launch("dkdv", k.shape[1], q, k, pos, (q, k, v, pos, keep, grad_out, lse, delta, dk, dv), mlen, window, p_drop)
    _launch("dq", q.shape[1], q, k, pos, (q, k, v, pos, keep, grad_out, lse, delta, dq, dpos), mlen, window, p_drop)
    return dq, dk, dv, dpos


@rel_attn_bwd.register_fake
def _(grad_out, q, k, v, pos, out, lse, keep, mlen, window, p_drop):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(pos)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, pos, seed, mlen, window, p_drop = inputs
    out, lse, keep = output
    ctx.save_for_backward(q, k, v, pos, out, lse, keep)
    ctx.settings = (mlen, window, p_drop)


def _backward(ctx, grad_out, grad_lse, grad_keep):
    del grad_lse, grad_keep  # internal outputs (the log-sum-exp, the mask): nothing downstream differentiates them
    q, k, v, pos, out, lse, keep = ctx.saved_tensors
    dq, dk, dv, dpos = rel_attn_bwd(grad_out, q, k, v, pos, out, lse, keep, *ctx.settings)
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
    out, _, _ = rel_attn_fwd(q_w, k, v, pos, seed, mlen, window, p_drop)
    return out


class TargetShape(NamedTuple):
    """The lengths a compile for a target specializes on, as Triton's launcher does at run time: every pointer
    argument (torch's allocations are 16-byte aligned) and every integer argument divisible by 16 is compiled
    as such, which decides whether loads become 16-byte vectors. Default: configs/large.json's training
    attention (T 384, mem_len 384, K+1 = 769 distances padded to 776 on CUDA, no same_length window)."""
    qlen: int = 384
    klen: int = 768
    width: int = 776
    window: int = 768


def compile_for_target(arch: int = 90, dtype: torch.dtype = torch.bfloat16, d_head: int = 64,
                       dropout: bool = True, every_candidate: bool = False,
                       shape: TargetShape = TargetShape()) -> list[tuple[str, Blocks, object]]:
    """Compile the three kernels for CUDA architecture `arch` (90: H100/H200) without a GPU: Triton's own
    front end, optimizer and ptxas run; what fails to compile on the device fails here. The default tiles, or
    every one of tile_candidates; and the zero-store kernel ("zero", ZERO_BLOCKS). Specialized for `shape` as
    the launcher would specialize a call with it. Returns (kernel role, tiles, Triton's compiled kernel: its
    `asm` holds the PTX and the cubin) per compile."""
    kernels = _kernels()
    if interpreting():
        raise RuntimeError("compile_for_target: TRITON_INTERPRET=1 made the kernels interpreted; run it in a "
                           "process without it")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    ints = {"T": "i32", "KL": "i32", "W": "i32", "KG": "i32", "MLEN": "i32", "WINDOW": "i32", "KEEP_FROM": "i32",
            "KEEP_SCALE": "fp32", "SHAPE_CLASS": "i32"}
    drop_bits = dropout_words(0.2).bits if dropout else 0  # the presets' dropatt
    values = dict(T=shape.qlen, KL=shape.klen, W=shape.width, KG=key_groups(shape.klen), MLEN=shape.klen - shape.qlen,
                  WINDOW=shape.window,
                  SHAPE_CLASS=shape_class(shape.qlen, shape.klen))
    tensors = {
        "fwd": (kernels.rel_attn_fwd, dict(Q=elem, K=elem, V=elem, POS=elem, SEED="*i64", O=elem, LSE="*fp32",
                                           KEEP="*u8")),
        "dkdv": (kernels.rel_attn_bwd_dkdv, dict(Q=elem, K=elem, V=elem, POS=elem, KEEP="*u8", DO=elem,
                                          LSE="*fp32", DELTA="*fp32", DK=elem, DV=elem)),
        "dq": (kernels.rel_attn_bwd_dq, dict(Q=elem, K=elem, V=elem, POS=elem, KEEP="*u8", DO=elem, LSE="*fp32",
                                      DELTA="*fp32", DQ=elem, DPOS=elem)),
    }
    tensors["zero"] = (kernels.rel_attn_zero_unread, dict(DPOS=elem))
    compiled = []
    for name, (kernel, pointers) in tensors.items():
        aligned = [*pointers, *(key for key, value in values.items() if value % 16 == 0 and key in kernel.arg_names)]
        kernel_ints = {key: value for key, value in ints.items() if key in kernel.arg_names}
        for b in (ZERO_BLOCKS,) if name == "zero" else tile_candidates(name)[:None if every_candidate else 1]:
            constexprs = dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n)
            if name != "zero":
                constexprs.update(_kernel_meta(d_head, dtype, drop_bits))
            signature = {**pointers, **kernel_ints, **{key: "constexpr" for key in constexprs}}
            if "constexprs" in inspect.signature(ASTSource).parameters:
                src = ASTSource(fn=kernel, signature=signature, constexprs={
                    (kernel.arg_names.index(key),): value for key, value in constexprs.items()},
                    attrs={(kernel.arg_names.index(key),): [["tt.divisibility", 16]] for key in aligned})
            else:  # triton before 3.3 (torch 2.6 brings 3.2): constants by name, alignment in a descriptor
                from triton.backends.compiler import AttrsDescriptor

                src = ASTSource(fn=kernel, signature=signature, constants=constexprs, attrs=AttrsDescriptor.from_hints(
                    {kernel.arg_names.index(key): 16 for key in aligned}))
            compiled.append((name, b, triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                                     options=dict(num_warps=b.num_warps, num_stages=b.num_stages))))
    return compiled
