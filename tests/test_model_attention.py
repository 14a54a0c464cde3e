"""Relative attention: the reference oracle against first principles, the fast paths against the oracle."""
import math

import pytest
import torch

from torch.nn.attention.flex_attention import create_mask

from txl_dist.config import ConfigError, ModelConfig, validate_model
from txl_dist.model.attention import (ATTN_IMPLS, attn_bias_from_mask, build_attn_mask, candidate_attn_impls,
                                      flex_block_mask, rel_attention_flex, rel_attention_matmul,
                                      rel_attention_reference, rel_attention_sdpa, rel_shift, resolve_attn_impl,
                                      time_attn_impls)

FAST = {"matmul": rel_attention_matmul, "sdpa": rel_attention_sdpa}


def test_rel_shift_puts_distance_i_minus_j_at_i_j():
    # Column p of the raw scores holds distance K-1-p; after the shift, entry [i, j] must hold the score of
    # distance (i + mlen) - j, i.e. raw column j + T - 1 - i, wherever j is not in the future.
    torch.manual_seed(0)
    qlen, mlen = 4, 3
    klen = qlen + mlen
    raw = torch.randn(2, 3, qlen, klen)
    shifted = rel_shift(raw)
    for i in range(qlen):
        for j in range(i + mlen + 1):
            distance = i + mlen - j
            assert torch.equal(shifted[..., i, j], raw[..., i, klen - 1 - distance])


@pytest.mark.parametrize("same_length", [False, True])
def test_attn_mask_is_causal_window(same_length):
    # Definition: query i sits at key position i + mlen; it sees keys j <= i + mlen, and with same_length
    # only the last mem_len of them (j > i + mlen - mem_len).
    for qlen, mlen, mem_len in [(4, 0, 4), (4, 3, 3), (5, 2, 6), (3, 6, 4), (6, 2, 3), (2, 0, 1)]:
        mask = build_attn_mask(qlen, mlen, mem_len, same_length)
        assert mask.shape == (qlen, mlen + qlen) and mask.dtype == torch.bool
        for i in range(qlen):
            for j in range(mlen + qlen):
                visible = j <= i + mlen and (not same_length or j > i + mlen - mem_len)
                assert bool(mask[i, j]) == (not visible), (qlen, mlen, mem_len, i, j)


def _inputs(bsz, qlen, mlen, n_head, d_head, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    klen = qlen + mlen
    hd = n_head * d_head

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    return dict(q=rnd(bsz, qlen, hd), kv=rnd(bsz, klen, 2 * hd), r_head_k=rnd(klen, hd),
                r_w_bias=rnd(n_head, d_head), r_r_bias=rnd(n_head, d_head))


def test_reference_matches_the_paper_formula_by_loops():
    # score[i, j] = (q_i + u) . k_j + (q_i + v) . r_{i+mlen-j}, scaled by 1/sqrt(d), masked, softmax, . v
    bsz, qlen, mlen, n_head, d_head = 2, 3, 2, 2, 4
    x = _inputs(bsz, qlen, mlen, n_head, d_head)
    klen = qlen + mlen
    mask = build_attn_mask(qlen, mlen, mem_len=3, same_length=True)
    out = rel_attention_reference(**x, attn_bias=attn_bias_from_mask(mask, torch.float32))
    q = x["q"].detach().view(bsz, qlen, n_head, d_head)
    k, v = x["kv"].detach().view(bsz, klen, 2, n_head, d_head).unbind(2)
    r = x["r_head_k"].detach().view(klen, n_head, d_head)  # row p: distance klen - 1 - p
    u, vb = x["r_w_bias"].detach(), x["r_r_bias"].detach()
    expected = torch.zeros(bsz, qlen, n_head, d_head)
    for b in range(bsz):
        for h in range(n_head):
            for i in range(qlen):
                scores = []
                for j in range(klen):
                    if mask[i, j]:
                        scores.append(-math.inf)
                        continue
                    distance = i + mlen - j
                    s = (q[b, i, h] + u[h]) @ k[b, j, h] + (q[b, i, h] + vb[h]) @ r[klen - 1 - distance, h]
                    scores.append(float(s) / math.sqrt(d_head))
                probs = torch.softmax(torch.tensor(scores), dim=0)
                expected[b, i, h] = (probs[:, None] * v[b, :, h]).sum(0)
    torch.testing.assert_close(out.detach(), expected.view(bsz, qlen, -1), rtol=0, atol=1e-5)


CASES = [  # (qlen, mlen, mem_len, same_length)
    (6, 0, 6, False), (6, 0, 4, True), (5, 7, 7, False), (5, 7, 7, True), (4, 9, 6, True), (1, 5, 5, False)]


@pytest.mark.parametrize("impl", sorted(FAST))
@pytest.mark.parametrize("qlen,mlen,mem_len,same_length", CASES)
def test_fast_equals_reference_fp32(impl, qlen, mlen, mem_len, same_length):
    x = _inputs(3, qlen, mlen, 4, 8, seed=qlen * 100 + mlen)
    bias = attn_bias_from_mask(build_attn_mask(qlen, mlen, mem_len, same_length), torch.float32)
    ref = rel_attention_reference(**x, attn_bias=bias)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, list(x.values()), grad_out)
    fast = FAST[impl](**x, attn_bias=bias)
    fast_grads = torch.autograd.grad(fast, list(x.values()), grad_out)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    for name, g_fast, g_ref in zip(x, fast_grads, ref_grads):
        torch.testing.assert_close(g_fast, g_ref, rtol=0, atol=1e-5, msg=f"grad of {name}")


def _rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("impl", sorted(FAST))
@pytest.mark.parametrize("qlen,mlen,mem_len,same_length", [(6, 0, 6, False), (5, 7, 7, True)])
def test_fast_bf16_close_to_reference(impl, qlen, mlen, mem_len, same_length):
    x16 = _inputs(2, qlen, mlen, 2, 8, dtype=torch.bfloat16, seed=7)
    x32 = {k: v.detach().float().requires_grad_() for k, v in x16.items()}  # the same (rounded) numbers
    mask = build_attn_mask(qlen, mlen, mem_len, same_length)
    ref = rel_attention_reference(**x32, attn_bias=attn_bias_from_mask(mask, torch.float32))
    fast = FAST[impl](**x16, attn_bias=attn_bias_from_mask(mask, torch.bfloat16))
    assert fast.dtype == torch.bfloat16
    assert _rel_err(fast, ref) < 2e-2
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, list(x32.values()), grad_out)
    fast_grads = torch.autograd.grad(fast, list(x16.values()), grad_out.bfloat16())
    for name, g_fast, g_ref in zip(x16, fast_grads, ref_grads):
        assert _rel_err(g_fast, g_ref) < 2e-2, name


def test_dropatt_only_in_training():
    x = _inputs(2, 4, 3, 2, 8)
    bias = attn_bias_from_mask(build_attn_mask(4, 3, 3, False), torch.float32)
    for fn in (fn for name, fn in ATTN_IMPLS.items() if name != "flex"):  # flex has no dropout: see below
        a = fn(**x, attn_bias=bias, dropatt=0.5, training=False)
        torch.testing.assert_close(a, rel_attention_reference(**x, attn_bias=bias), rtol=0, atol=1e-5)
        torch.manual_seed(0)
        b = fn(**x, attn_bias=bias, dropatt=0.5, training=True)
        assert not torch.allclose(a, b)


def test_resolve_attn_impl():
    assert resolve_attn_impl("auto", torch.device("cpu")) == "matmul"
    assert resolve_attn_impl("auto", torch.device("cpu"), torch.bfloat16) in ("matmul", "sdpa")
    assert resolve_attn_impl("matmul", torch.device("cpu"), torch.bfloat16) == "matmul"
    assert resolve_attn_impl("sdpa", torch.device("cpu")) == "sdpa"
    assert resolve_attn_impl("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="attn_impl 'flash' is unknown"):
        resolve_attn_impl("flash", torch.device("cpu"))


# ---- FlexAttention: the block mask, the forward on CPU (its backward is CUDA-only: tests/test_gpu.py) ----

@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("qlen,mlen,mem_len", [(5, 7, 7), (4, 9, 6), (6, 0, 6), (200, 300, 300), (150, 100, 120)])
def test_flex_block_mask_is_build_attn_mask(qlen, mlen, mem_len, same_length):
    block_mask = flex_block_mask(qlen, mlen, mem_len, same_length, torch.device("cpu"))
    visible = create_mask(block_mask.mask_mod, None, None, qlen, mlen + qlen, device="cpu")[0, 0]  # [T, K]
    torch.testing.assert_close(visible, ~build_attn_mask(qlen, mlen, mem_len, same_length), rtol=0, atol=0)
    # The blocks the kernel skips hold no visible key; every block it visits holds at least one.
    size_q, size_k = block_mask.BLOCK_SIZE
    dense = block_mask.to_dense()[0, 0]                                            # [T blocks, K blocks]
    for bq in range(dense.shape[0]):
        for bk in range(dense.shape[1]):
            tile = visible[bq * size_q:(bq + 1) * size_q, bk * size_k:(bk + 1) * size_k]
            assert bool(dense[bq, bk]) == bool(tile.any()), (bq, bk)


def test_flex_block_mask_is_cached():
    cpu = torch.device("cpu")
    assert flex_block_mask(5, 7, 7, True, cpu) is flex_block_mask(5, 7, 7, True, cpu)
    assert flex_block_mask(5, 7, 7, True, cpu) is not flex_block_mask(5, 7, 7, False, cpu)


FLEX_CASES = [(6, 0, 6, False), (5, 7, 7, True), (4, 9, 6, True)]  # each shape compiles once (~5 s on CPU)


@pytest.mark.parametrize("qlen,mlen,mem_len,same_length", FLEX_CASES)
def test_flex_forward_equals_reference_on_cpu(qlen, mlen, mem_len, same_length):
    x = {k: v.detach() for k, v in _inputs(3, qlen, mlen, 4, 8, seed=qlen * 100 + mlen).items()}
    mask = build_attn_mask(qlen, mlen, mem_len, same_length)
    bias = attn_bias_from_mask(mask, torch.float32)
    ref = rel_attention_reference(**x, attn_bias=bias)
    block_mask = flex_block_mask(qlen, mlen, mem_len, same_length, torch.device("cpu"))
    torch.testing.assert_close(rel_attention_flex(**x, attn_bias=block_mask), ref, rtol=0, atol=1e-5)
    # The bias form (no block skipping, the mask added in the score_mod) agrees too.
    torch.testing.assert_close(rel_attention_flex(**x, attn_bias=bias), ref, rtol=0, atol=1e-5)


def test_flex_bf16_forward_close_to_reference():
    qlen, mlen, mem_len = 5, 7, 7
    x16 = {k: v.detach() for k, v in _inputs(2, qlen, mlen, 2, 8, dtype=torch.bfloat16, seed=7).items()}
    x32 = {k: v.float() for k, v in x16.items()}
    mask = build_attn_mask(qlen, mlen, mem_len, True)
    ref = rel_attention_reference(**x32, attn_bias=attn_bias_from_mask(mask, torch.float32))
    fast = rel_attention_flex(**x16, attn_bias=flex_block_mask(qlen, mlen, mem_len, True, torch.device("cpu")))
    assert fast.dtype == torch.bfloat16
    assert _rel_err(fast, ref) < 2e-2


def test_flex_refuses_what_it_cannot_do():
    x = _inputs(2, 4, 3, 2, 8)
    block_mask = flex_block_mask(4, 3, 3, False, torch.device("cpu"))
    with pytest.raises(ValueError, match="no attention dropout but dropatt is 0.1"):
        rel_attention_flex(**x, attn_bias=block_mask, dropatt=0.1, training=True)
    with pytest.raises(ValueError, match="cannot train on a CPU"):
        rel_attention_flex(**x, attn_bias=block_mask, training=True)
    with pytest.raises(ConfigError, match=r"^model.attn_impl: 'flex' has no attention dropout.*model.dropatt 0.1"):
        validate_model(ModelConfig(vocab_size=10, attn_impl="flex", dropatt=0.1))
    validate_model(ModelConfig(vocab_size=10, attn_impl="flex", dropatt=0.0))


def test_candidate_attn_impls():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for training in (False, True):
        assert candidate_attn_impls(cpu, torch.float32, training=training, dropatt=0.0) == ["matmul", "sdpa"]
    assert candidate_attn_impls(cuda, torch.bfloat16, training=True, dropatt=0.0) == ["matmul", "sdpa", "flex"]
    assert candidate_attn_impls(cuda, torch.bfloat16, training=True, dropatt=0.1) == ["matmul", "sdpa"]
    assert candidate_attn_impls(cuda, torch.bfloat16, training=False, dropatt=0.1) == ["matmul", "sdpa", "flex"]
    for names in (candidate_attn_impls(d, torch.float32, training=t, dropatt=p)
                  for d in (cpu, cuda) for t in (False, True) for p in (0.0, 0.1)):
        assert set(names) <= set(ATTN_IMPLS) and "reference" not in names


@pytest.mark.parametrize("training", [False, True])
def test_time_attn_impls_times_each_named_path(training):
    names = ["matmul", "sdpa", "reference"]
    times = time_attn_impls(names, batch=2, n_head=2, d_head=8, qlen=4, klen=8, device=torch.device("cpu"),
                            dtype=torch.float32, training=training, reps=2, warmup=1)
    assert list(times) == names
    assert all(isinstance(t, float) and 0 < t < math.inf for t in times.values())


def test_time_attn_impls_gives_inf_to_a_path_that_cannot_run():
    # flex has no backward on a CPU: timed for training it fails, and auto must simply never pick it.
    times = time_attn_impls(["matmul", "flex"], batch=2, n_head=2, d_head=8, qlen=4, klen=8,
                            device=torch.device("cpu"), dtype=torch.float32, training=True, reps=2, warmup=1)
    assert times["flex"] == math.inf and 0 < times["matmul"] < math.inf
    with pytest.raises(ValueError, match="unknown implementation"):
        time_attn_impls(["flash"], batch=2, n_head=2, d_head=8, qlen=4, klen=8, device=torch.device("cpu"),
                        dtype=torch.float32, training=False)
