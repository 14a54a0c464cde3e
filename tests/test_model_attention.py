"""Relative attention: the reference oracle against first principles, the fast paths against the oracle."""
import math

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import create_mask

import txl_dist.model.attention as attention

from txl_dist.config import ConfigError, ModelConfig, validate_model
from txl_dist.model import triton_attention
from txl_dist.model.attention import (ATTN_IMPLS, attn_bias_from_mask, attn_mask_for, build_attn_mask,
                                      candidate_attn_impls,
                                      flex_block_mask, rel_attention_flex, rel_attention_matmul,
                                      rel_attention_reference, rel_attention_sdpa, rel_shift, resolve_attn_impl,
                                      sdpa_backends, time_attn_impls)
from triton_helpers import why_the_interpreter_cannot_run_the_kernels

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


@pytest.mark.parametrize("row_align", [1, 8, 32])
@pytest.mark.parametrize("impl", sorted(FAST))
@pytest.mark.parametrize("qlen,mlen,mem_len,same_length", CASES)
def test_fast_equals_reference_fp32(impl, qlen, mlen, mem_len, same_length, row_align, monkeypatch):
    # row_align: the raw position scores' rows padded with zero distances (CUDA's tensor-core alignment), so
    # that the rel-shifted view has a row stride past K; 32 pads more rows than there are keys.
    monkeypatch.setitem(attention.POSITION_ROW_ALIGN, "cpu", row_align)
    assert attention.position_row_width(qlen + mlen, torch.device("cpu")) % row_align == 0
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
    for name, fn in ATTN_IMPLS.items():
        if name == "flex" or (name == "triton" and why_the_interpreter_cannot_run_the_kernels()):
            continue  # flex has no dropout (see below); triton's own file tests its kernels' dropout
        mask = attn_mask_for(name, 4, 3, 3, False, torch.device("cpu"), torch.float32)  # triton: interpreted
        a = fn(**x, attn_bias=mask, dropatt=0.5, training=False)
        torch.testing.assert_close(a, rel_attention_reference(**x, attn_bias=bias), rtol=0, atol=1e-5)
        torch.manual_seed(0)
        b = fn(**x, attn_bias=mask, dropatt=0.5, training=True)
        assert not torch.allclose(a, b), name


def test_resolve_attn_impl():
    assert resolve_attn_impl("auto", torch.device("cpu")) == "matmul"
    assert resolve_attn_impl("auto", torch.device("cpu"), torch.bfloat16) in ("matmul", "sdpa")
    assert resolve_attn_impl("matmul", torch.device("cpu"), torch.bfloat16) == "matmul"
    assert resolve_attn_impl("sdpa", torch.device("cpu")) == "sdpa"
    assert resolve_attn_impl("flex", torch.device("cpu")) == "flex"
    with pytest.raises(ValueError, match="attn_impl 'flash' is unknown"):
        resolve_attn_impl("flash", torch.device("cpu"))



# ---- SDPA: the kernels it may use. On CUDA a mask that needs grad must never reach cuDNN attention (no gradient
# for the mask: "not differentiable with respect to argument 'attn_bias'") or flash (no arbitrary mask). ----

def test_sdpa_backends_restrict_only_a_cuda_mask_that_needs_grad():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert sdpa_backends(cuda, mask_needs_grad=True) == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert sdpa_backends(cuda, mask_needs_grad=False) is None
    assert sdpa_backends(torch.device("cuda", 1), mask_needs_grad=True) == sdpa_backends(cuda, True)
    for needs_grad in (False, True):  # a CPU keeps torch's choice: its flash kernel serves no-grad forwards
        assert sdpa_backends(cpu, mask_needs_grad=needs_grad) is None


def _enabled_sdpa_backends() -> set[str]:
    flags = torch.backends.cuda  # the global switches sdpa_kernel sets; the CPU dispatcher reads them too
    switches = {"flash": flags.flash_sdp_enabled(), "efficient": flags.mem_efficient_sdp_enabled(),
                "math": flags.math_sdp_enabled(), "cudnn": flags.cudnn_sdp_enabled()}
    return {name for name, on in switches.items() if on}


ALL_SDPA_BACKENDS = {"flash", "efficient", "math", "cudnn"}


def _as_if_on_cuda(monkeypatch):
    """rel_attention_sdpa on a CPU, deciding its kernels as it would on CUDA."""
    decide = attention.sdpa_backends
    monkeypatch.setattr(attention, "sdpa_backends",
                        lambda device, mask_needs_grad: decide(torch.device("cuda"), mask_needs_grad))


def test_sdpa_runs_a_mask_that_needs_grad_on_the_kernels_sdpa_backends_names(monkeypatch):
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(_enabled_sdpa_backends())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    assert _enabled_sdpa_backends() == ALL_SDPA_BACKENDS
    x = _inputs(2, 5, 7, 2, 8)
    bias = attn_bias_from_mask(build_attn_mask(5, 7, 7, True), torch.float32)
    ref = rel_attention_reference(**x, attn_bias=bias)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, list(x.values()), grad_out)

    def forward_backward_and_no_grad_forward():
        out = rel_attention_sdpa(**x, attn_bias=bias)
        grads = torch.autograd.grad(out, list(x.values()), grad_out)
        with torch.no_grad():
            rel_attention_sdpa(**x, attn_bias=bias)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        for name, g_got, g_ref in zip(x, grads, ref_grads):
            torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-5, msg=f"grad of {name}")

    forward_backward_and_no_grad_forward()  # on the CPU: torch's choice, whole
    assert seen == [ALL_SDPA_BACKENDS, ALL_SDPA_BACKENDS]
    seen.clear()
    _as_if_on_cuda(monkeypatch)
    forward_backward_and_no_grad_forward()  # with grad: efficient or math only (a CPU runs math); no grad: whole
    assert seen == [{"efficient", "math"}, ALL_SDPA_BACKENDS]
    assert _enabled_sdpa_backends() == ALL_SDPA_BACKENDS  # the context restored torch's switches


def _compile_capturing_graphs(fn, graphs: list[str]):
    """torch.compile(fn, fullgraph=True) (a graph break fails) through AOTAutograd, keeping the code of the
    forward and backward graphs it makes (the ATen ops, i.e. the SDPA kernel that was chosen)."""
    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


def test_sdpa_kernel_choice_holds_inside_a_compiled_function(monkeypatch):
    # train.compile compiles each layer, rel_attention_sdpa with it: dynamo must trace the sdpa_kernel context
    # without a graph break, and the choice must reach the compiled graph.
    x = _inputs(2, 5, 7, 2, 8)
    bias = attn_bias_from_mask(build_attn_mask(5, 7, 7, False), torch.float32)
    ref = rel_attention_reference(**x, attn_bias=bias)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, list(x.values()), grad_out)
    graphs: list[str] = []
    with monkeypatch.context() as patch:
        _as_if_on_cuda(patch)
        compiled = _compile_capturing_graphs(rel_attention_sdpa, graphs)
        out = compiled(**x, attn_bias=bias)
        grads = torch.autograd.grad(out, list(x.values()), grad_out)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name, g_got, g_ref in zip(x, grads, ref_grads):
        torch.testing.assert_close(g_got, g_ref, rtol=0, atol=1e-5, msg=f"grad of {name}")
    assert len(graphs) == 2  # one forward, one backward: no break
    # The choice reaches the graph: a CPU's no-grad forward takes its flash kernel unless the context forbids it.
    flash_cpu = "_scaled_dot_product_flash_attention_for_cpu"
    frozen = {k: v.detach() for k, v in x.items()}
    for decision, flash_expected in ((None, True), ([SDPBackend.MATH], False)):
        graphs.clear()
        with monkeypatch.context() as patch:
            patch.setattr(attention, "sdpa_backends", lambda device, mask_needs_grad: decision)
            with torch.no_grad():
                got = _compile_capturing_graphs(rel_attention_sdpa, graphs)(**frozen, attn_bias=bias)
        torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-5)
        assert len(graphs) == 1 and (flash_cpu in graphs[0]) == flash_expected, decision
    torch._dynamo.reset()

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
def test_flex_forward_equals_reference_on_cpu(qlen, mlen, mem_len, same_length, monkeypatch):
    monkeypatch.setitem(attention.POSITION_ROW_ALIGN, "cpu", 8)  # the position rows padded as on CUDA
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


def test_candidate_attn_impls(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for training in (False, True):
        assert candidate_attn_impls(cpu, torch.float32, training=training, dropatt=0.0) == ["matmul", "sdpa"]
    # triton (with attention dropout) wherever the package is installed, on CUDA only.
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    assert candidate_attn_impls(cuda, torch.bfloat16, training=True, dropatt=0.0) == ["matmul", "sdpa", "flex",
                                                                                     "triton"]
    assert candidate_attn_impls(cuda, torch.bfloat16, training=True, dropatt=0.1) == ["matmul", "sdpa", "triton"]
    assert candidate_attn_impls(cuda, torch.bfloat16, training=False, dropatt=0.1) == ["matmul", "sdpa", "flex",
                                                                                      "triton"]
    assert candidate_attn_impls(cpu, torch.float32, training=False, dropatt=0.0) == ["matmul", "sdpa"]
    monkeypatch.setattr(triton_attention, "triton_available", lambda: False)
    assert candidate_attn_impls(cuda, torch.bfloat16, training=True, dropatt=0.1) == ["matmul", "sdpa"]
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


def test_time_attn_impls_reads_the_clock_it_is_given():
    """A CPU's caller times in the thread's CPU seconds (runtime_choices): every call is read on that clock."""
    ticks = iter(range(1000))
    times = time_attn_impls(["matmul", "sdpa"], batch=2, n_head=2, d_head=8, qlen=4, klen=8,
                            device=torch.device("cpu"), dtype=torch.float32, training=True, reps=3, warmup=1,
                            clock=lambda: float(next(ticks)))
    assert times == {"matmul": 1.0, "sdpa": 1.0} and next(ticks) == 2 * 2 * 3  # a start and an end per call


def test_time_attn_impls_gives_inf_to_a_path_that_cannot_run():
    # flex has no backward on a CPU: timed for training it fails, and auto must simply never pick it.
    times = time_attn_impls(["matmul", "flex"], batch=2, n_head=2, d_head=8, qlen=4, klen=8,
                            device=torch.device("cpu"), dtype=torch.float32, training=True, reps=2, warmup=1)
    assert times["flex"] == math.inf and 0 < times["matmul"] < math.inf
    with pytest.raises(ValueError, match="unknown implementation"):
        time_attn_impls(["flash"], batch=2, n_head=2, d_head=8, qlen=4, klen=8, device=torch.device("cpu"),
                        dtype=torch.float32, training=False)
