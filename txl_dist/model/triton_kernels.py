"""The Triton kernels of fused relative attention; txl_dist/model/triton_attention.py is their interface (the
algorithm is described there). Imported only when a kernel first runs: importing triton costs time and
prints nanobind's leak report at exit, which no process that never uses the kernels should pay. Whether the
kernels are interpreted (TRITON_INTERPRET=1) is fixed by the environment at that import. SHAPE_CLASS is read by
no kernel: it is the autotuner's key (triton_attention.shape_class)."""
import triton
import triton.language as tl


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
def _scores(q, k, pos_bh, offs_m, offs_n, T, KL, W, MLEN, WINDOW, IEEE: tl.constexpr):
    """Float32 scores [BLOCK_M, BLOCK_N] (-inf where not visible) and the visibility mask."""
    visible = (offs_n[None, :] <= offs_m[:, None] + MLEN) & (offs_n[None, :] < KL) & (offs_m[:, None] < T)
    visible = visible & (offs_n[None, :] > offs_m[:, None] + MLEN - WINDOW)
    pos = tl.load(pos_bh + _position_offsets(offs_m, offs_n, T, W), mask=visible, other=0.0)
    s = _dot(q, tl.trans(k), IEEE) + pos.to(tl.float32)
    return tl.where(visible, s, float("-inf")), visible


@triton.jit
def _keep(seed, bh, offs_m, start_n, T, KL, P_DROP, BLOCK_N: tl.constexpr):
    """The dropout keep-mask of a block [BLOCK_M, BLOCK_N], the same in the backward: one Philox call gives
    four uniforms (FlashAttention's economy: a quarter of the rounds of a call per element), so key j of query
    i takes component j % 4 of the call at counter (bh * T + i) * ceil(KL / 4) + j // 4, whatever the tiling
    (BLOCK_N and start_n are multiples of 4; within a group of four, the components sit in join's order)."""
    quads = start_n // 4 + tl.arange(0, BLOCK_N // 4)
    offsets = (bh * T + offs_m[:, None].to(tl.int64)) * ((KL + 3) // 4) + quads[None, :]
    r0, r1, r2, r3 = tl.rand4x(seed, offsets)
    uniform = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (offs_m.shape[0], BLOCK_N))
    return uniform >= P_DROP


@triton.jit
def _key_range(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KL, MLEN, WINDOW):
    """Key blocks a query block may see: from its first row's window start to its last row's diagonal."""
    lo = tl.maximum(start_m + MLEN - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M + MLEN, KL)
    return lo, hi


@triton.jit
def rel_attn_fwd(Q, K, V, POS, SEED, O, LSE, T, KL, W, MLEN, WINDOW, P_DROP, SHAPE_CLASS,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_offs, q_mask = _rows(bh, offs_m, offs_d, T, D)
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
    pos_bh = POS + bh * T * W
    seed = tl.load(SEED)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, BLOCK_M, BLOCK_N, KL, MLEN, WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_offs, kv_mask = _rows(bh, offs_n, offs_d, KL, D)
        k = tl.load(K + kv_offs, mask=kv_mask, other=0.0)
        s, visible = _scores(q, k, pos_bh, offs_m, offs_n, T, KL, W, MLEN, WINDOW, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_keep(seed, bh, offs_m, start_n, T, KL, P_DROP, BLOCK_N), p / (1.0 - P_DROP), 0.0)
        # v only now: fewer registers live across the softmax (the backward loads k and v together)
        v = tl.load(V + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    tl.store(O + q_offs, acc.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + bh * T + offs_m, m_i + tl.log(l_safe), mask=offs_m < T)


@triton.jit
def _key_rows(K, V, bh, offs_n, offs_d, KL, D: tl.constexpr):
    """A key tile's k and v [BLOCK_N, BLOCK_D]; zeros past KL."""
    offs, mask = _rows(bh, offs_n, offs_d, KL, D)
    return tl.load(K + offs, mask=mask, other=0.0), tl.load(V + offs, mask=mask, other=0.0)


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, bh, offs_m, offs_d, T, D: tl.constexpr):
    """A query tile's q and dO [BLOCK_M, BLOCK_D], its log-sum-exp and rowsum(dO * O) [BLOCK_M]; zeros past T."""
    offs, mask = _rows(bh, offs_m, offs_d, T, D)
    q = tl.load(Q + offs, mask=mask, other=0.0)
    do = tl.load(DO + offs, mask=mask, other=0.0)
    lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0)
    return q, do, lse, delta


@triton.jit
def _tile_grads(q, k, v, do, lse, delta, pos_bh, seed, bh, offs_m, offs_n, start_n, T, KL, W, MLEN, WINDOW, P_DROP,
                BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    """One (query tile, key tile) of the backward: the probabilities after dropout (for dV), the scores'
    gradient dS = P * (dP - rowsum(dO * O)), and the visibility mask."""
    s, visible = _scores(q, k, pos_bh, offs_m, offs_n, T, KL, W, MLEN, WINDOW, IEEE)
    p = tl.exp(s - lse[:, None])
    dp = _dot(do, tl.trans(v), IEEE)
    if DROPOUT:
        keep = _keep(seed, bh, offs_m, start_n, T, KL, P_DROP, BLOCK_N)
        p_dropped = tl.where(keep, p / (1.0 - P_DROP), 0.0)
        dp = tl.where(keep, dp / (1.0 - P_DROP), 0.0)
    else:
        p_dropped = p
    return p_dropped, p * (dp - delta[:, None]), visible


@triton.jit
def rel_attn_bwd_dkdv(Q, K, V, POS, SEED, DO, LSE, DELTA, DK, DV, T, KL, W, MLEN, WINDOW, P_DROP,
                      SHAPE_CLASS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k, v = _key_rows(K, V, bh, offs_n, offs_d, KL, D)
    pos_bh = POS + bh * T * W
    seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Queries that see a key of this block: i + MLEN >= j (and, with a window, i + MLEN - WINDOW < j).
    lo = tl.maximum(start_n - MLEN, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N - 1 - MLEN + WINDOW, T)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _query_rows(Q, DO, LSE, DELTA, bh, offs_m, offs_d, T, D)
        p_dropped, ds, _ = _tile_grads(q, k, v, do, lse, delta, pos_bh, seed, bh, offs_m, offs_n, start_n, T, KL, W,
                                       MLEN, WINDOW, P_DROP, BLOCK_N, DROPOUT, IEEE)
        dv += _dot(tl.trans(p_dropped.to(do.dtype)), do, IEEE)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    kv_offs, kv_mask = _rows(bh, offs_n, offs_d, KL, D)
    tl.store(DK + kv_offs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def rel_attn_bwd_dq(Q, K, V, POS, SEED, DO, LSE, DELTA, DQ, DPOS, T, KL, W, MLEN, WINDOW, P_DROP,
                    SHAPE_CLASS, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q, do, lse, delta = _query_rows(Q, DO, LSE, DELTA, bh, offs_m, offs_d, T, D)
    pos_bh, dpos_bh = POS + bh * T * W, DPOS + bh * T * W
    seed = tl.load(SEED)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, BLOCK_M, BLOCK_N, KL, MLEN, WINDOW)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _key_rows(K, V, bh, offs_n, offs_d, KL, D)
        _, ds, visible = _tile_grads(q, k, v, do, lse, delta, pos_bh, seed, bh, offs_m, offs_n, start_n, T, KL, W,
                                     MLEN, WINDOW, P_DROP, BLOCK_N, DROPOUT, IEEE)
        dq += _dot(ds.to(k.dtype), k, IEEE)
        # One (query, key) pair per position entry: a plain store (the rest of dpos stays zero).
        tl.store(dpos_bh + _position_offsets(offs_m, offs_n, T, W), ds.to(DPOS.dtype.element_ty), mask=visible)
    q_offs, q_mask = _rows(bh, offs_m, offs_d, T, D)
    tl.store(DQ + q_offs, dq.to(DQ.dtype.element_ty), mask=q_mask)
