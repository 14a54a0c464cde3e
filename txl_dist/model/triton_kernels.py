"""The Triton kernels of fused relative attention; txl_dist/model/triton_attention.py is their interface (the
algorithm is described there). Imported only when a kernel first runs: importing triton costs time and
prints nanobind's leak report at exit, which no process that never uses the kernels should pay. Whether the
kernels are interpreted (TRITON_INTERPRET=1) is fixed by the environment at that import. SHAPE_CLASS is read by
no kernel: it is the autotuner's key (triton_attention.shape_class)."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
"""log2(e): the kernels' exponentials are base 2 (exp2 is one instruction; exp is five, with its range checks)."""


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # float32 inputs: IEEE products, as torch's float32 matmuls (tensor-core tf32 would differ by ~1e-3)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _rows(bh, offs, offs_d, N, D: tl.constexpr):
    """Element offsets and in-bounds mask of rows `offs` [len, BLOCK_D] of head-batch row bh of a [BH, N, D]
    tensor (q, k, v, their gradients, the output)."""
    return bh * N * D + offs[:, None] * D + offs_d[None, :], (offs < N)[:, None] & (offs_d < D)[None, :]


@triton.jit
def _position_offsets(offs_m, offs_n, T, W):
    """Offsets [BLOCK_M, BLOCK_N] into a head-batch row of the position product [T, W]: query i, key j read
    column j + T - 1 - i (the rel-shift)."""
    return offs_m[:, None] * W + offs_n[None, :] + (T - 1) - offs_m[:, None]


@triton.jit
def _visible(offs_m, offs_n, T, KL, MLEN, WINDOW):
    """Which (query, key) pairs of a tile are scored: key j <= i + MLEN, inside same_length's window
    (j > i + MLEN - WINDOW), and both in range."""
    visible = (offs_n[None, :] <= offs_m[:, None] + MLEN) & (offs_n[None, :] < KL) & (offs_m[:, None] < T)
    return visible & (offs_n[None, :] > offs_m[:, None] + MLEN - WINDOW)


@triton.jit
def _scores(q, k, pos_bh, offs_m, offs_n, T, KL, W, MLEN, WINDOW, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Float32 scores [BLOCK_M, BLOCK_N] of a tile, -inf where not visible. An unmasked tile (MASKED False:
    every pair visible, _full_keys / _full_queries) skips the mask's compares and selects, most of a tile's
    instructions besides the exponentials (bench/triton_census.py)."""
    offsets = _position_offsets(offs_m, offs_n, T, W)
    if MASKED:
        visible = _visible(offs_m, offs_n, T, KL, MLEN, WINDOW)
        pos = tl.load(pos_bh + offsets, mask=visible, other=0.0)
        return tl.where(visible, _dot(q, tl.trans(k), IEEE) + pos.to(tl.float32), float("-inf"))
    return _dot(q, tl.trans(k), IEEE) + tl.load(pos_bh + offsets).to(tl.float32)


@triton.jit
def _keep_draws(seed, bh, offs_m, start_n, T, BLOCK_N: tl.constexpr, DROP_BITS: tl.constexpr):
    """Dropout's draws for a block as eight tensors [BLOCK_M, BLOCK_N // 8] (uint32): number b is the draw of key
    start_n + 8g + b of group g. The counter: the key group (two counters per group with 32-bit draws) and the
    query row bh * T + i as two words; a Philox call gives four 32-bit words, eight 16-bit draws with DROP_BITS
    16, else four (FlashAttention's economy: a fraction of a call's rounds per element; Philox is most of a
    dropout tile's instructions, bench/triton_census.py). A draw keeps its score when it is at least KEEP_FROM
    (triton_attention `dropout_words`): an integer compare, no float per element. Only the forward draws; it
    stores the decisions as bits for the backward (`_keep_byte`, `_stored_keep`)."""
    groups = (start_n // 8 + tl.arange(0, BLOCK_N // 8)).to(tl.uint32)
    rows = bh * T + offs_m.to(tl.int64)
    zeros = tl.zeros((offs_m.shape[0], BLOCK_N // 8), tl.uint32)
    row_lo, row_hi = rows.to(tl.uint32)[:, None] + zeros, (rows >> 32).to(tl.uint32)[:, None] + zeros
    if DROP_BITS == 16:
        r0, r1, r2, r3 = tl.philox(seed, groups[None, :] + zeros, row_lo, row_hi, zeros)
        return r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16, r2 & 0xFFFF, r2 >> 16, r3 & 0xFFFF, r3 >> 16
    r0, r1, r2, r3 = tl.philox(seed, 2 * groups[None, :] + zeros, row_lo, row_hi, zeros)
    r4, r5, r6, r7 = tl.philox(seed, 2 * groups[None, :] + 1 + zeros, row_lo, row_hi, zeros)
    return r0, r1, r2, r3, r4, r5, r6, r7


@triton.jit
def _by_key(x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Eight tensors [BLOCK_M, BLOCK_N // 8] as one [BLOCK_M, BLOCK_N], number b at key 8g + b: joins (the
    innermost the slowest of the three new axes) place them without moving data between threads."""
    joined = tl.join(tl.join(tl.join(x0, x4), tl.join(x2, x6)), tl.join(tl.join(x1, x5), tl.join(x3, x7)))
    return tl.reshape(joined, (BLOCK_M, BLOCK_N))


@triton.jit
def _keep_byte(d0, d1, d2, d3, d4, d5, d6, d7, keep_from):
    """A group's eight keep decisions as one byte: bit b for key 8g + b (the forward stores it)."""
    return ((d0 >= keep_from).to(tl.uint32) | ((d1 >= keep_from).to(tl.uint32) << 1)
            | ((d2 >= keep_from).to(tl.uint32) << 2) | ((d3 >= keep_from).to(tl.uint32) << 3)
            | ((d4 >= keep_from).to(tl.uint32) << 4) | ((d5 >= keep_from).to(tl.uint32) << 5)
            | ((d6 >= keep_from).to(tl.uint32) << 6) | ((d7 >= keep_from).to(tl.uint32) << 7)).to(tl.uint8)


@triton.jit
def _keep_offsets(offs_m, start_n, T, KG, BLOCK_N: tl.constexpr):
    """Offsets and mask [BLOCK_M, BLOCK_N // 8] of a block's bytes in a head-batch row [T, KG] of the stored
    keep-mask."""
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    return offs_m[:, None] * KG + groups[None, :], (offs_m < T)[:, None] & (groups < KG)[None, :]


@triton.jit
def _drawn_keep(seed, keep_bh, bh, offs_m, start_n, T, KG, KEEP_FROM, BLOCK_N: tl.constexpr,
                DROP_BITS: tl.constexpr):
    """The forward's keep-mask [BLOCK_M, BLOCK_N] of a block, its bits stored for the backward on the way."""
    d0, d1, d2, d3, d4, d5, d6, d7 = _keep_draws(seed, bh, offs_m, start_n, T, BLOCK_N, DROP_BITS)
    keep_from = KEEP_FROM.to(tl.uint32, bitcast=True)
    offsets, in_range = _keep_offsets(offs_m, start_n, T, KG, BLOCK_N)
    tl.store(keep_bh + offsets, _keep_byte(d0, d1, d2, d3, d4, d5, d6, d7, keep_from), mask=in_range)
    return _by_key(d0, d1, d2, d3, d4, d5, d6, d7, offs_m.shape[0], BLOCK_N) >= keep_from


@triton.jit
def _stored_keep(keep_bh, offs_m, start_n, T, KG, BLOCK_N: tl.constexpr):
    """The forward's keep-mask of a block, read back from its bytes (bytes no visible pair reads were never
    written: their scores are masked anyway)."""
    offsets, in_range = _keep_offsets(offs_m, start_n, T, KG, BLOCK_N)
    b = tl.load(keep_bh + offsets, mask=in_range, other=0)
    return _by_key(b & 1, b & 2, b & 4, b & 8, b & 16, b & 32, b & 64, b & 128, offs_m.shape[0], BLOCK_N) != 0


@triton.jit
def _key_range(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KL, MLEN, WINDOW):
    """Key blocks a query block may see: from its first row's window start to its last row's diagonal."""
    lo = tl.maximum(start_m + MLEN - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M + MLEN, KL)
    return lo, hi


@triton.jit
def _query_range(start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T, MLEN, WINDOW):
    """Query blocks that may see a key block: i + MLEN >= j (and, with a window, i + MLEN - WINDOW < j)."""
    lo = tl.maximum(start_n - MLEN, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N - 1 - MLEN + WINDOW, T)
    return lo, hi


@triton.jit
def _full_keys(start_m, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[a, b): the key blocks of [lo, hi) that every row of the query block sees whole. a is where the last
    row's window has begun, b where the first row's diagonal or the keys end; none if the block has rows past
    T. [lo, a) and [b, hi) are the masked blocks (the window's edge, the diagonal). lo <= a <= b <= hi, and a
    and b are multiples of BLOCK_N unless they equal hi."""
    a = tl.minimum(tl.maximum(lo, (tl.maximum(start_m + BLOCK_M + MLEN - WINDOW, 0) + BLOCK_N - 1)
                              // BLOCK_N * BLOCK_N), hi)
    b = tl.minimum(start_m + MLEN + 1, KL) // BLOCK_N * BLOCK_N
    b = tl.where(start_m + BLOCK_M <= T, b, a)
    return a, tl.maximum(a, b)  # <= hi: min(start_m + MLEN + 1, KL) <= hi


@triton.jit
def _full_queries(start_n, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[a, b): the query blocks of [lo, hi) whose every row sees the whole key block (the counterpart of
    _full_keys for the backward's loop over query blocks). hi < lo where a window narrower than the memory
    leaves the key block unseen: then a = b = hi, and every range is empty."""
    a = tl.minimum(tl.maximum(lo, (tl.maximum(start_n + BLOCK_N - 1 - MLEN, 0) + BLOCK_M - 1)
                              // BLOCK_M * BLOCK_M), hi)
    b = tl.maximum(tl.minimum(start_n - MLEN + WINDOW, T), 0) // BLOCK_M * BLOCK_M
    b = tl.where(start_n + BLOCK_N <= KL, b, a)
    return a, tl.minimum(tl.maximum(a, b), hi)


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, K, V, pos_bh, seed, keep_bh, KEEP_FROM, bh, offs_m, offs_d, lo, hi, T, KL, W,
                KG, MLEN, WINDOW, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DROP_BITS: tl.constexpr,
                IEEE: tl.constexpr):
    """The forward's online softmax over key blocks [lo, hi). Exponentials in base 2, the scale folded into
    one multiply-add per score. m_i stays in natural units."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_offs, kv_mask = _rows(bh, offs_n, offs_d, KL, D)
        k = tl.load(K + kv_offs, mask=kv_mask, other=0.0)
        s = _scores(q, k, pos_bh, offs_m, offs_n, T, KL, W, MLEN, WINDOW, MASKED, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.math.exp2(s * LOG2E - (m_new * LOG2E)[:, None])
        alpha = tl.math.exp2((m_i - m_new) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROP_BITS:
            keep = _drawn_keep(seed, keep_bh, bh, offs_m, start_n, T, KG, KEEP_FROM, BLOCK_N, DROP_BITS)
            p = tl.where(keep, p, 0.0)
        # v only now: fewer registers live across the softmax (the backward loads k and v together)
        v = tl.load(V + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def rel_attn_fwd(Q, K, V, POS, SEED, O, LSE, KEEP, T, KL, W, KG, MLEN, WINDOW, KEEP_FROM, KEEP_SCALE, SHAPE_CLASS,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROP_BITS: tl.constexpr, IEEE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_offs, q_mask = _rows(bh, offs_m, offs_d, T, D)
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
    pos_bh, keep_bh = POS + bh * T * W, KEEP + bh * T * KG
    seed = tl.load(SEED)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, BLOCK_M, BLOCK_N, KL, MLEN, WINDOW)
    a, b = _full_keys(start_m, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K, V, pos_bh, seed, keep_bh, KEEP_FROM, bh, offs_m, offs_d, a, b,
                                T, KL, W, KG, MLEN, WINDOW, D, BLOCK_N, False, DROP_BITS, IEEE)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K, V, pos_bh, seed, keep_bh, KEEP_FROM, bh, offs_m, offs_d, lo, a,
                                T, KL, W, KG, MLEN, WINDOW, D, BLOCK_N, True, DROP_BITS, IEEE)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K, V, pos_bh, seed, keep_bh, KEEP_FROM, bh, offs_m, offs_d, b, hi,
                                T, KL, W, KG, MLEN, WINDOW, D, BLOCK_N, True, DROP_BITS, IEEE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if DROP_BITS:
        acc = acc * KEEP_SCALE  # kept probabilities are p / (1 - p_drop): one multiply per output, not per score
    acc = acc / l_safe[:, None]
    tl.store(O + q_offs, acc.to(O.dtype.element_ty), mask=q_mask)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    tl.store(LSE + bh * T + offs_m, m_safe + tl.log(l_safe), mask=offs_m < T)


@triton.jit
def _key_rows(K, V, bh, offs_n, offs_d, KL, D: tl.constexpr):
    """A key tile's k and v [BLOCK_N, BLOCK_D]; zeros past KL."""
    offs, mask = _rows(bh, offs_n, offs_d, KL, D)
    return tl.load(K + offs, mask=mask, other=0.0), tl.load(V + offs, mask=mask, other=0.0)


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, bh, offs_m, offs_d, T, D: tl.constexpr):
    """A query tile's q and dO [BLOCK_M, BLOCK_D], its log-sum-exp (in base 2: times log2(e)) and
    rowsum(dO * O) [BLOCK_M]; zeros past T."""
    offs, mask = _rows(bh, offs_m, offs_d, T, D)
    q = tl.load(Q + offs, mask=mask, other=0.0)
    do = tl.load(DO + offs, mask=mask, other=0.0)
    lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0)
    return q, do, lse * LOG2E, delta


@triton.jit
def _tile_grads(q, k, v, do, lse2, delta, pos_bh, keep_bh, KEEP_SCALE, offs_m, offs_n, start_n, T, KL, W, KG, MLEN,
                WINDOW, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DROP_BITS: tl.constexpr, IEEE: tl.constexpr):
    """One (query tile, key tile) of the backward: the probabilities kept by dropout, not yet scaled by
    1 / (1 - p_drop) (dV takes the scale once at its end), and the scores' gradient
    dS = P * (dP - rowsum(dO * O)). lse2: the log-sum-exp in base 2."""
    s = _scores(q, k, pos_bh, offs_m, offs_n, T, KL, W, MLEN, WINDOW, MASKED, IEEE)
    p = tl.math.exp2(s * LOG2E - lse2[:, None])
    dp = _dot(do, tl.trans(v), IEEE)
    if DROP_BITS:
        keep = _stored_keep(keep_bh, offs_m, start_n, T, KG, BLOCK_N)
        return tl.where(keep, p, 0.0), p * (tl.where(keep, dp, 0.0) * KEEP_SCALE - delta[:, None])
    return p, p * (dp - delta[:, None])


@triton.jit
def _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, pos_bh, keep_bh, KEEP_SCALE, bh, offs_n, offs_d, start_n, lo, hi,
                 T, KL, W, KG, MLEN, WINDOW, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, DROP_BITS: tl.constexpr, IEEE: tl.constexpr):
    """dk and dv of one key block summed over query blocks [lo, hi)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, lse2, delta = _query_rows(Q, DO, LSE, DELTA, bh, offs_m, offs_d, T, D)
        p_kept, ds = _tile_grads(q, k, v, do, lse2, delta, pos_bh, keep_bh, KEEP_SCALE, offs_m, offs_n, start_n, T,
                                 KL, W, KG, MLEN, WINDOW, BLOCK_N, MASKED, DROP_BITS, IEEE)
        dv += _dot(tl.trans(p_kept.to(do.dtype)), do, IEEE)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    return dk, dv


@triton.jit
def rel_attn_bwd_dkdv(Q, K, V, POS, KEEP, DO, LSE, DELTA, DK, DV, T, KL, W, KG, MLEN, WINDOW, KEEP_SCALE, SHAPE_CLASS,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, DROP_BITS: tl.constexpr, IEEE: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k, v = _key_rows(K, V, bh, offs_n, offs_d, KL, D)
    pos_bh, keep_bh = POS + bh * T * W, KEEP + bh * T * KG
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, hi = _query_range(start_n, BLOCK_M, BLOCK_N, T, MLEN, WINDOW)
    a, b = _full_queries(start_n, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M, BLOCK_N)
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, pos_bh, keep_bh, KEEP_SCALE, bh, offs_n, offs_d, start_n,
                          a, b, T, KL, W, KG, MLEN, WINDOW, D, BLOCK_M, BLOCK_N, False, DROP_BITS, IEEE)
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, pos_bh, keep_bh, KEEP_SCALE, bh, offs_n, offs_d, start_n,
                          lo, a, T, KL, W, KG, MLEN, WINDOW, D, BLOCK_M, BLOCK_N, True, DROP_BITS, IEEE)
    dk, dv = _dkdv_blocks(dk, dv, k, v, Q, DO, LSE, DELTA, pos_bh, keep_bh, KEEP_SCALE, bh, offs_n, offs_d, start_n,
                          b, hi, T, KL, W, KG, MLEN, WINDOW, D, BLOCK_M, BLOCK_N, True, DROP_BITS, IEEE)
    if DROP_BITS:
        dv = dv * KEEP_SCALE
    kv_offs, kv_mask = _rows(bh, offs_n, offs_d, KL, D)
    tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, K, V, pos_bh, dpos_bh, keep_bh, KEEP_SCALE, bh, offs_m, offs_d, lo, hi, T, KL,
               W, KG, MLEN, WINDOW, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               DROP_BITS: tl.constexpr, IEEE: tl.constexpr):
    """dq of one query block summed over key blocks [lo, hi), and those blocks' position gradient."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _key_rows(K, V, bh, offs_n, offs_d, KL, D)
        _, ds = _tile_grads(q, k, v, do, lse2, delta, pos_bh, keep_bh, KEEP_SCALE, offs_m, offs_n, start_n, T, KL, W,
                            KG, MLEN, WINDOW, BLOCK_N, MASKED, DROP_BITS, IEEE)
        dq += _dot(ds.to(k.dtype), k, IEEE)
        # One (query, key) pair per position entry: a plain store (the rest: rel_attn_zero_unread).
        offsets = _position_offsets(offs_m, offs_n, T, W)
        if MASKED:
            tl.store(dpos_bh + offsets, ds.to(dpos_bh.dtype.element_ty),
                     mask=_visible(offs_m, offs_n, T, KL, MLEN, WINDOW))
        else:
            tl.store(dpos_bh + offsets, ds.to(dpos_bh.dtype.element_ty))
    return dq


@triton.jit
def rel_attn_bwd_dq(Q, K, V, POS, KEEP, DO, LSE, DELTA, DQ, DPOS, T, KL, W, KG, MLEN, WINDOW, KEEP_SCALE, SHAPE_CLASS,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DROP_BITS: tl.constexpr, IEEE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q, do, lse2, delta = _query_rows(Q, DO, LSE, DELTA, bh, offs_m, offs_d, T, D)
    pos_bh, dpos_bh, keep_bh = POS + bh * T * W, DPOS + bh * T * W, KEEP + bh * T * KG
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, BLOCK_M, BLOCK_N, KL, MLEN, WINDOW)
    a, b = _full_keys(start_m, lo, hi, T, KL, MLEN, WINDOW, BLOCK_M, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse2, delta, K, V, pos_bh, dpos_bh, keep_bh, KEEP_SCALE, bh, offs_m, offs_d, a, b, T,
                    KL, W, KG, MLEN, WINDOW, D, BLOCK_N, False, DROP_BITS, IEEE)
    dq = _dq_blocks(dq, q, do, lse2, delta, K, V, pos_bh, dpos_bh, keep_bh, KEEP_SCALE, bh, offs_m, offs_d, lo, a, T,
                    KL, W, KG, MLEN, WINDOW, D, BLOCK_N, True, DROP_BITS, IEEE)
    dq = _dq_blocks(dq, q, do, lse2, delta, K, V, pos_bh, dpos_bh, keep_bh, KEEP_SCALE, bh, offs_m, offs_d, b, hi, T,
                    KL, W, KG, MLEN, WINDOW, D, BLOCK_N, True, DROP_BITS, IEEE)
    q_offs, q_mask = _rows(bh, offs_m, offs_d, T, D)
    tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def rel_attn_zero_unread(DPOS, T, KL, W, MLEN, WINDOW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Zeros in the position gradient [BH, T, W] where no (query, key) pair reads: row i's columns before its
    first visible key's, first(i) = max(i + MLEN - WINDOW + 1, 0) + T - 1 - i, and the padding from KL on (its
    rows of r are zero, but a non-finite gradient there would still reach dq_r through the position product's
    backward). Every column from first(i) to KL - 1 is one visible pair's, which the dq kernel stores, so the
    two kernels together write each entry once and dpos needs no zero-fill of all of it. A kernel of its own:
    inside the dq kernel the same stores made its loops spill registers (bench/triton_census.py)."""
    start_m = tl.program_id(0) * BLOCK_M
    dpos_bh = DPOS + tl.program_id(1).to(tl.int64) * T * W
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows_in = offs_m < T
    first = tl.maximum(offs_m + MLEN - WINDOW + 1, 0) + (T - 1) - offs_m  # non-increasing in i
    zeros = tl.zeros([BLOCK_M, BLOCK_N], DPOS.dtype.element_ty)
    for start_c in range(0, tl.maximum(start_m + MLEN - WINDOW + 1, 0) + (T - 1) - start_m, BLOCK_N):
        offs_c = start_c + tl.arange(0, BLOCK_N)
        tl.store(dpos_bh + offs_m[:, None] * W + offs_c[None, :], zeros,
                 mask=rows_in[:, None] & (offs_c[None, :] < first[:, None]))
    for start_c in range(KL, W, BLOCK_N):
        offs_c = start_c + tl.arange(0, BLOCK_N)
        tl.store(dpos_bh + offs_m[:, None] * W + offs_c[None, :], zeros,
                 mask=rows_in[:, None] & (offs_c[None, :] < W))
