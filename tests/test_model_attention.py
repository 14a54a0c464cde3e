"""Relative attention: the reference oracle against first principles, the fast paths against the oracle."""
import math

import pytest
import torch

from txl_dist.model.attention import (ATTN_IMPLS, attn_bias_from_mask, build_attn_mask, rel_attention_matmul,
                                      rel_attention_reference, rel_attention_sdpa, rel_shift, resolve_attn_impl)

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
    for fn in ATTN_IMPLS.values():
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
    with pytest.raises(ValueError, match="attn_impl 'flash' is unknown"):
        resolve_attn_impl("flash", torch.device("cpu"))
