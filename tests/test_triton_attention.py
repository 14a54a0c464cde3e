"""The fused Triton kernels of relative attention (attn_impl "triton", txl_dist/model/triton_attention.py).

On a CUDA device they run compiled; elsewhere in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
where the machine has no NVIDIA device), the same kernel code on CPU tensors. Checked against an independent
O(T*K) reference written from the definition (scores, shifted position term, mask, softmax, dropout mask),
forward and all four gradients, over shapes that cross tile borders, with and without same_length's window,
head sizes that are not powers of two and padded position rows. Dropout: the kernels' mask is read back
through one-hot values (the output row is then the dropped probabilities), its rate checked, and the backward
checked against the reference run with that same mask. Every tile the CUDA tuner may pick gives the same
results (a stand-in tuner). compile_for_target compiles the kernels for an H100/H200 (sm_90) with Triton's own
compiler and ptxas, no GPU needed.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_helpers import why_the_interpreter_cannot_run_the_kernels

triton = pytest.importorskip("triton", reason="scripts/test.sh installs triton (its interpreter runs these kernels "
                                                "on a CPU)")

from txl_dist.config import ModelConfig  # noqa: E402
from txl_dist.model import TransformerXL, triton_attention  # noqa: E402
from txl_dist.model.attention import (KeyPattern, attn_mask_for, build_attn_mask,  # noqa: E402
                                      candidate_attn_impls, rel_attention_triton)

REPO = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CANNOT_INTERPRET = why_the_interpreter_cannot_run_the_kernels() if DEVICE.type == "cpu" else None
runs_the_kernels = pytest.mark.skipif(CANNOT_INTERPRET is not None, reason=str(CANNOT_INTERPRET))
"""On tests that run the kernels: compiled on CUDA, interpreted on a CPU where the interpreter can. The tests that
compile them for sm_90 (Triton's compiler and ptxas, no GPU) and those of the tile and device choices run with
any triton, so a suite run with the GPU machine's triton checks that it compiles them."""


@pytest.fixture(autouse=True)
def position_grad_of_nans(monkeypatch):
    """The position gradient's buffer filled with NaNs instead of left uninitialized (memory that happens to
    hold zeros would hide an entry the dq kernel forgot to write): every gradient checked here sees them."""
    monkeypatch.setattr(triton_attention, "position_grad_buffer", lambda pos: torch.full_like(pos, float("nan")))


def reference(q, k, v, pos, mlen, mem_len, same_length, keep=None):
    """Float64 attention from the definition: score[i, j] = q_i . k_j + pos[i, j + T - 1 - i], masked."""
    q, k, v, pos = (t.double() for t in (q, k, v, pos))
    _, qlen, _ = q.shape
    klen = k.shape[1]
    i = torch.arange(qlen, device=q.device)[:, None]
    j = torch.arange(klen, device=q.device)[None, :]
    column = (j + qlen - 1 - i).clamp(max=pos.shape[2] - 1)  # past the diagonal + mlen: masked below
    scores = q @ k.transpose(1, 2) + pos[:, i, column]
    mask = build_attn_mask(qlen, mlen, mem_len, same_length, q.device)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    if keep is not None:  # dropout's mask, times the kept scores' scale
        probs = probs * keep
    return probs @ v


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def inputs(bh, qlen, mlen, d_head, pad, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    klen = qlen + mlen

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()

    return rnd(bh, qlen, d_head), rnd(bh, klen, d_head), rnd(bh, klen, d_head), rnd(bh, qlen, klen + 1 + pad)


CASES = [  # bh, qlen, mlen, d_head, position-row padding, same_length's window (mem_len) or None
    (3, 20, 13, 12, 0, None),
    (2, 33, 40, 16, 7, 40),
    (2, 16, 0, 24, 0, None),
    (2, 40, 24, 16, 1, 24),
    (1, 17, 50, 32, 3, 50),  # the window starts inside the first key tiles
    (2, 20, 70, 16, 0, 5),  # a window narrower than the memory: the first key tiles are seen by no query
]


@runs_the_kernels
@pytest.mark.parametrize("bh,qlen,mlen,d_head,pad,window", CASES)
def test_forward_and_every_gradient_equal_the_reference(bh, qlen, mlen, d_head, pad, window):
    q, k, v, pos = inputs(bh, qlen, mlen, d_head, pad)
    out = triton_attention.fused_rel_attention(q, k, v, pos, mlen, window, 0.0)
    expected = reference(q, k, v, pos, mlen, window or mlen, window is not None)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v, pos), grad_out)
    want = torch.autograd.grad(expected, (q, k, v, pos), grad_out.double())
    assert rel_err(out, expected) < 1e-5, rel_err(out, expected)
    for name, g_got, g_want in zip("q k v pos".split(), got, want):
        assert rel_err(g_got, g_want) < 1e-5, (name, rel_err(g_got, g_want))
    # Position columns that no (query, key) pair reads get no gradient (the padding, the future's columns). Found
    # from the mask, not from the reference's zeros: a row with one visible key has a gradient that is zero in
    # exact arithmetic (p = 1, dp - delta = 0) and a rounding residue in float32 (2^-20 on an AMD EPYC).
    visible = ~build_attn_mask(qlen, mlen, window or mlen, window is not None, DEVICE)
    read = torch.zeros(pos.shape[1:], dtype=torch.bool, device=DEVICE)
    i, j = torch.nonzero(visible, as_tuple=True)
    read[i, j + qlen - 1 - i] = True
    assert torch.all(got[3][:, ~read] == 0) and torch.all(want[3][:, ~read] == 0)


# Triton 3.9's interpreter multiplies bf16 tiles wrongly (tl.dot reads their bits as integers: an identity times
# a bf16 matrix is off by 2.7e8), so on a CPU the 16-bit case is fp16; the compiled kernels take bf16 on CUDA
# (and compile in it: test_the_kernels_compile_for_an_h200_without_a_gpu).
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


class OneCandidate:
    """triton.autotune's stand-in for the interpreter (which has no clock to time with): runs candidate `index`
    of each kernel's list, so that every tile the CUDA tuner may pick is checked for its results."""

    def __init__(self, index):
        self.index = index

    def __call__(self, configs, key):
        assert "SHAPE_CLASS" in key
        config = configs[self.index % len(configs)]

        class Tuned:
            best_config = config

            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                return lambda *args, **meta: self.kernel[grid(config.kwargs)](
                    *args, **meta, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)

        return Tuned


@runs_the_kernels
@pytest.mark.parametrize("index", range(max(map(len, triton_attention.TILE_CANDIDATES.values()))))
def test_every_tile_the_tuner_may_pick_gives_the_same_results(index, monkeypatch):
    monkeypatch.setattr(triton_attention, "tunes", lambda device: True)
    monkeypatch.setattr(triton, "autotune", OneCandidate(index))
    triton_attention._tuned.cache_clear()
    try:
        q, k, v, pos = inputs(2, 70, 60, 16, 3)  # 130 keys: partial tiles of every candidate size
        torch.manual_seed(3)
        out = triton_attention.fused_rel_attention(q, k, v, pos, 60, 100, 0.25)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        got = torch.autograd.grad(out, (q, k, v, pos), grad_out)
        tiles = triton_attention.tuned_tiles()
    finally:
        triton_attention._tuned.cache_clear()
    assert set(tiles) == {"fwd", "dkdv", "dq"}
    torch.manual_seed(3)  # the same mask with the untuned tiles
    again = triton_attention.fused_rel_attention(q, k, v, pos, 60, 100, 0.25)
    want = torch.autograd.grad(again, (q, k, v, pos), grad_out)
    assert rel_err(out, again) < 1e-5
    for name, g_got, g_want in zip("q k v pos".split(), got, want):
        assert rel_err(g_got, g_want) < 1e-5, (name, rel_err(g_got, g_want))


@runs_the_kernels
def test_half_precision_error_is_its_rounding():
    q, k, v, pos = inputs(4, 48, 40, 32, 1, HALF)
    out = triton_attention.fused_rel_attention(q, k, v, pos, 40, None, 0.0)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v, pos), grad_out.to(HALF))
    exact = reference(q, k, v, pos, 40, 40, False)
    want = torch.autograd.grad(exact, (q, k, v, pos), grad_out.double())
    # The floor: the exact result rounded once to the 16-bit type.
    assert rel_err(out, exact) < 3 * rel_err(exact.to(HALF), exact) + 1e-3
    for name, g_got, g_want in zip("q k v pos".split(), got, want):
        assert rel_err(g_got, g_want) < 3 * rel_err(g_want.to(HALF), g_want) + 2e-2, (name, rel_err(g_got, g_want))


def one_hot_values(bh, klen, d_head):
    """Values whose row j is the unit vector j: the output row i is then row i of the (dropped) probabilities."""
    v = torch.zeros(bh, klen, d_head, device=DEVICE)
    v[:, torch.arange(klen), torch.arange(klen)] = 1.0
    return v.requires_grad_()


@runs_the_kernels
@pytest.mark.parametrize("p_drop, bits", [(0.3, 16), (0.001, 32)])
def test_dropout_mask_rate_backward_and_repeatability(monkeypatch, p_drop, bits):
    """16-bit draws where they hold p within 0.1%, 32-bit ones below (triton_attention.dropout_words)."""
    words = triton_attention.dropout_words(p_drop)
    assert words.bits == bits and abs(words.keep_from / 2 ** bits - p_drop) <= 1e-3 * p_drop
    assert words.scale == 2 ** bits / (2 ** bits - words.keep_from)
    bh, qlen, mlen = 4, 32, 24
    klen = qlen + mlen
    q, k, _, pos = inputs(bh, qlen, mlen, 64, 2)
    v = one_hot_values(bh, klen, 64)
    torch.manual_seed(7)
    out = triton_attention.fused_rel_attention(q, k, v, pos, mlen, None, p_drop)
    probs = reference(q, k, v, pos, mlen, mlen, False)[..., :klen]                # undropped probabilities
    dropped = out[..., :klen].detach().double()
    visible = probs > 0
    keep = (dropped > 0) & visible
    # Kept entries are the probabilities scaled by 1 / (1 - p); dropped ones are exactly zero.
    torch.testing.assert_close(dropped[keep], probs[keep] * words.scale, rtol=1e-5, atol=1e-6)
    assert torch.all(dropped[~visible] == 0)
    n_visible = int(visible.sum())
    rate = 1 - int(keep.sum()) / n_visible
    assert abs(rate - p_drop) < 5 * math.sqrt(p_drop * (1 - p_drop) / n_visible), (rate, n_visible)

    # The backward reads the forward's mask back: gradients equal the reference run with that mask.
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v, pos), grad_out)
    expected = reference(q, k, v, pos, mlen, mlen, False, keep=keep.double() * words.scale)
    want = torch.autograd.grad(expected, (q, k, v, pos), grad_out.double())
    for name, g_got, g_want in zip("q k v pos".split(), got, want):
        assert rel_err(g_got, g_want) < 1e-5, (name, rel_err(g_got, g_want))

    # The seed comes from torch's generator: the same state gives the same mask, another state another.
    torch.manual_seed(7)
    again = triton_attention.fused_rel_attention(q, k, v, pos, mlen, None, p_drop)
    other = triton_attention.fused_rel_attention(q, k, v, pos, mlen, None, p_drop)
    assert torch.equal(again, out)
    assert not torch.equal(other, out)

    # The mask is a function of (head-batch row, query, key) alone: other tile sizes draw the same one.
    tiles = triton_attention.Blocks(32, 32, 4, 2)
    monkeypatch.setattr(triton_attention, "kernel_blocks", lambda device: dict.fromkeys(("fwd", "dkdv", "dq"), tiles))
    torch.manual_seed(7)
    retiled = triton_attention.fused_rel_attention(q, k, v, pos, mlen, None, p_drop)
    assert torch.equal((retiled[..., :klen].detach() > 0) & visible, keep)


@runs_the_kernels
def test_no_dropout_outside_training():
    x = dict(q=torch.randn(2, 16, 64, device=DEVICE), kv=torch.randn(2, 40, 128, device=DEVICE),
             r_head_k=torch.randn(40, 64, device=DEVICE), r_w_bias=torch.randn(4, 16, device=DEVICE),
             r_r_bias=torch.randn(4, 16, device=DEVICE))
    pattern = KeyPattern(24, 24, False)
    plain = rel_attention_triton(**x, attn_bias=pattern, dropatt=0.5, training=False)
    assert torch.equal(plain, rel_attention_triton(**x, attn_bias=pattern, dropatt=0.0, training=True))
    assert not torch.equal(plain, rel_attention_triton(**x, attn_bias=pattern, dropatt=0.5, training=True))


@runs_the_kernels
@pytest.mark.parametrize("same_length", [False, True])
def test_the_model_with_triton_attention_equals_matmul(same_length):
    """Two segments with mems through a whole (small) model, every parameter's gradient, fp32."""
    cfg = ModelConfig(vocab_size=300, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, cutoffs=[100],
                      div_val=1, dropout=0.0, dropatt=0.0, tgt_len=16, mem_len=20, same_length=same_length)
    torch.manual_seed(0)
    model = TransformerXL(cfg).to(DEVICE).train()
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = {}
    for impl in ("matmul", "triton"):
        model.attn_impl = impl
        model.zero_grad(set_to_none=True)
        first = model(ids[:, :16], labels=ids[:, 1:17])
        second = model(ids[:, 16:32], labels=ids[:, 17:33], mems=first.mems)
        nll = torch.cat([first.nll, second.nll], dim=1)
        nll.mean().backward()
        results[impl] = nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(results["triton"][0], results["matmul"][0], rtol=0, atol=1e-5)
    for name, grad in results["matmul"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@runs_the_kernels
def test_the_custom_ops_registrations_hold():
    """torch.library.opcheck: the schema, the fake (meta) implementation torch.compile traces with, and the
    autograd registration, on a small case with dropout."""
    q, k, v, pos = (t.detach().requires_grad_() for t in inputs(2, 16, 16, 16, 0))
    seed = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(triton_attention.rel_attn_fwd, (q, k, v, pos, seed, 16, 32, 0.2))


@runs_the_kernels
def test_traced_by_torch_compile_with_its_backward():
    """The layer code around the kernels under dynamo + AOT autograd (the fake implementations, the backward
    op), as train.compile runs it; aot_eager keeps the rest eager, so this stays quick on a CPU."""
    x = dict(q=torch.randn(2, 16, 32, device=DEVICE, requires_grad=True),
             kv=torch.randn(2, 32, 64, device=DEVICE, requires_grad=True),
             r_head_k=torch.randn(32, 32, device=DEVICE, requires_grad=True),
             r_w_bias=torch.randn(2, 16, device=DEVICE), r_r_bias=torch.randn(2, 16, device=DEVICE))
    pattern = KeyPattern(16, 16, True)
    eager = rel_attention_triton(**x, attn_bias=pattern)
    torch._dynamo.reset()
    compiled = torch.compile(rel_attention_triton, backend="aot_eager", fullgraph=True)(**x, attn_bias=pattern)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(compiled.sum(), [x["q"], x["kv"], x["r_head_k"]])
    want = torch.autograd.grad(eager.sum(), [x["q"], x["kv"], x["r_head_k"]])
    for g_got, g_want in zip(grads, want):
        torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-5)


def compiling(*args: str) -> subprocess.CompletedProcess:
    """python `args` in a process of its own without TRITON_INTERPRET (this one may have made the kernels
    interpreted), where Triton's compiler and ptxas run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_the_kernels_compile_for_an_h200_without_a_gpu():
    """Triton's compiler and ptxas for sm_90 (H100/H200), bf16 with dropout, the GPU presets' head size."""
    done = compiling("-c", "import torch; from txl_dist.model import triton_attention as t; "
                     "print([name for name, _, _ in t.compile_for_target(90, torch.bfloat16, 64, dropout=True)])")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "['fwd', 'dkdv', 'dq', 'zero']"


def test_machine_code_of_the_unmasked_tiles(tmp_path):
    """The kernels' sm_90 code as bench/triton_census.py reads it (nvdisasm): each kernel's first loop, over the
    key (or query) tiles that every row sees whole, selects no -inf (the mask's signature: a tile classified as
    whole that was not would fail the reference tests, one never classified so would show here), while the
    loops over the edge tiles do; no loop of the default tiles touches spilled registers; and the issue floors
    count tiles that cover the attention."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip(f"triton {triton.__version__} ships no nvdisasm")
    out = tmp_path / "census.jsonl"
    done = compiling("-m", "bench.triton_census", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["kernel"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"fwd", "dkdv", "dq"}
    for name, row in rows.items():
        whole, *edges = row["loops"]
        assert len(edges) == 2, (name, row["loops"])
        assert whole["mask_selects"] == 0 and all(edge["mask_selects"] > 0 for edge in edges), (name, row)
        assert whole["instructions"] < min(edge["instructions"] for edge in edges), (name, row)
        assert all(loop["local_memory"] == 0 for loop in row["loops"]), (name, row)
        # The floors count the kernels' own loop trips (interpreted): their tiles cover every visible pair of
        # the census shape (T 384 under 384 of memory, no window: 384 x 385 + 384 x 383 / 2) with little waste.
        block_m, block_n = map(int, row["tiles"].split("/")[0].split("x"))
        covered = sum(row["trips"]) * block_m * block_n
        assert 221_376 <= covered <= 1.25 * 221_376, (name, row["trips"])
        assert 0 < row["tensor_us"] < row["floor_us"], (name, row)


def test_the_position_skew_probe_compiles_both_loops():
    """bench/position_skew_probe.py (docs/performance.md's reason the position product stays outside the
    kernels) still compiles its two loops for sm_90 and reads their machine code."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip(f"triton {triton.__version__} ships no nvdisasm")
    done = compiling("-m", "bench.position_skew_probe")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "per score" in line]
    assert len(lines) == 6 and sum("gather" in line for line in lines) == 3, done.stdout


def test_older_triton_never_tries_the_tile_its_compiler_aborts_on(monkeypatch):
    monkeypatch.setattr(triton_attention, "_triton_version", lambda: (3, 2))
    crashing = dict(triton_attention.CRASHES_OLDER_TRITON)
    assert crashing["dkdv"] not in triton_attention.tile_candidates("dkdv")
    assert triton_attention.kernel_blocks(torch.device("cuda"))["dkdv"] == triton_attention.tile_candidates("dkdv")[0]
    assert triton_attention.tile_candidates("fwd") == triton_attention.TILE_CANDIDATES["fwd"]
    monkeypatch.setattr(triton_attention, "_triton_version", lambda: (3, 6))
    assert triton_attention.tile_candidates("dkdv") == triton_attention.TILE_CANDIDATES["dkdv"]


def test_where_the_path_may_run(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "triton" not in candidate_attn_impls(cpu, torch.float32, training=True, dropatt=0.1)
    assert "triton" in candidate_attn_impls(cuda, torch.bfloat16, training=True, dropatt=0.1)  # has dropout
    assert isinstance(attn_mask_for("triton", 16, 8, 8, True, cpu, torch.float32), KeyPattern)
    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)
    x = dict(q=torch.randn(1, 4, 32), kv=torch.randn(1, 4, 64), r_head_k=torch.randn(4, 32),
             r_w_bias=torch.randn(2, 16), r_r_bias=torch.randn(2, 16))
    with pytest.raises(ValueError, match="CUDA only"):
        rel_attention_triton(**x, attn_bias=KeyPattern(0, 4, False))
    with pytest.raises(TypeError, match="KeyPattern"):
        rel_attention_triton(**x, attn_bias=torch.zeros(4, 4))
