"""Adaptive log-softmax: a normalized distribution, NLL consistent with it, both tail strategies equal,
the host-made tail plan equal to none (and free of host reads), padding that leaves the numbers unchanged
(tables padded to a multiple, tail rows padded to a bucket)."""
import dataclasses

import numpy as np
import pytest
import torch

from txl_dist.config import ModelConfig
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import ProjectedAdaptiveLogSoftmax, bucketed_rows, tail_plan

VOCAB, D_MODEL = 40, 16
PADDED_TOL = {"rtol": 0, "atol": 5e-5}
"""Padded against unpadded numbers: a matmul with more rows may be blocked differently by the CPU's BLAS, which
then sums in another order. The values here reach about 90 (log-probabilities, NLLs, the tables' gradients),
where a float32 ulp is 7.6e-6; measured apart by at most 1.5e-5 (an AMD EPYC with torch 2.13), so 5e-5.
That the padding carries nothing is checked exactly: its rows' gradients must be 0."""

SHAPES = {  # name: (d_embed, cutoffs, div_val)
    "plain": (16, [], 1),
    "plain_projected": (8, [], 1),
    "div1": (16, [10, 25], 1),
    "div1_projected": (12, [10, 25], 1),
    "div2": (16, [10, 25], 2),
    "div2_wide": (32, [5, 12, 30], 2),
}


def make_crit(name, seed=0):
    d_embed, cutoffs, div_val = SHAPES[name]
    torch.manual_seed(seed)
    crit = ProjectedAdaptiveLogSoftmax(VOCAB, d_embed, D_MODEL, cutoffs, div_val)
    for p in crit.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    return crit


def hidden_and_target(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(n, D_MODEL, generator=g), torch.randint(0, VOCAB, (n,), generator=g)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_log_probs_normalized_and_nll_consistent(name):
    crit = make_crit(name)
    hidden, target = hidden_and_target()
    log_probs = crit.log_probs(hidden)
    assert log_probs.shape == (64, VOCAB) and log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(64), rtol=0, atol=1e-5)
    expected = -log_probs.gather(1, target[:, None]).squeeze(1)
    for mode in ("dense", "gather", "auto"):
        crit.tail_mode = mode
        torch.testing.assert_close(crit(hidden, target), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["div1", "div1_projected", "div2", "div2_wide"])
def test_dense_and_gather_tails_same_nll_and_grads(name):
    crit = make_crit(name)
    hidden, target = hidden_and_target(n=48, seed=2)
    target[:5] = 0  # head tokens present; some clusters may be empty, which gather must survive
    assert_gather_equals_dense(crit, hidden, target)


def assert_gather_equals_dense(crit, hidden, target):
    """The gather tail mode gives the dense mode's NLL and gradients (of the hidden states and parameters)."""
    results = {}
    for mode in ("dense", "gather"):
        crit.tail_mode = mode
        crit.zero_grad()
        h = hidden.clone().requires_grad_()
        nll = crit(h, target)
        nll.sum().backward()
        results[mode] = (nll.detach(), h.grad, {n: p.grad.clone() for n, p in crit.named_parameters()})
    (nll_d, gh_d, gp_d), (nll_g, gh_g, gp_g) = results["dense"], results["gather"]
    torch.testing.assert_close(nll_g, nll_d, rtol=0, atol=1e-5)
    torch.testing.assert_close(gh_g, gh_d, rtol=0, atol=1e-5)
    for n in gp_d:
        torch.testing.assert_close(gp_g[n], gp_d[n], rtol=0, atol=1e-5, msg=n)


def test_gather_path_with_only_head_tokens():
    crit = make_crit("div2")
    crit.tail_mode = "gather"
    hidden, _ = hidden_and_target(n=8)
    target = torch.arange(8)  # all in the shortlist
    expected = -crit.log_probs(hidden).gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(crit(hidden, target), expected, rtol=0, atol=1e-5)


def test_cluster_i_uses_head_column_shortlist_plus_i_minus_1():
    # Natural order: a huge bias on cluster row 0 must send the mass to cluster 1 (tokens 10..24), a huge
    # bias on row 1 to cluster 2 (tokens 25..39).
    crit = make_crit("div1")
    hidden, _ = hidden_and_target(n=4)
    with torch.no_grad():
        for row, (lo, hi) in enumerate([(10, 25), (25, 40)]):
            crit.cluster_bias.zero_()
            crit.cluster_bias[row] = 1e4
            mass = crit.log_probs(hidden).exp()[:, lo:hi].sum(-1)
            torch.testing.assert_close(mass, torch.ones(4), rtol=0, atol=1e-5)


def test_bf16_gives_float32_close_to_fp32():
    crit = make_crit("div2")
    hidden, target = hidden_and_target()
    nll32 = crit(hidden, target)
    crit16 = make_crit("div2").to(torch.bfloat16)
    nll16 = crit16(hidden.bfloat16(), target)
    assert nll16.dtype == torch.float32 and crit16.log_probs(hidden.bfloat16()).dtype == torch.float32
    assert (nll16 - nll32).abs().max() < 0.05 * nll32.abs().max()


def test_auto_tail_mode():
    small_tails = ProjectedAdaptiveLogSoftmax(1000, 64, 64, [900], 4)  # tail: 100 tokens x 16 dims
    big_tails = ProjectedAdaptiveLogSoftmax(1000, 64, 64, [100], 1)    # tail: 900 tokens x 64 dims
    # Per token: head 64*64 + 64*901; tail 64*16 + 16*100. Independently: 2624 / 61760.
    assert small_tails.dense_tail_cost_ratio() == pytest.approx((64 * 16 + 16 * 100) / (64 * 64 + 64 * 901))
    cuda = torch.device("cuda")  # a device object only; nothing runs on it
    assert small_tails.resolved_tail_mode(cuda) == "dense"
    assert big_tails.resolved_tail_mode(cuda) == "gather"
    assert small_tails.resolved_tail_mode(torch.device("cpu")) == "gather"  # a sync is free on the CPU
    small_tails.tail_mode = "fast"
    with pytest.raises(ValueError, match="tail_mode 'fast' is unknown"):
        small_tails.resolved_tail_mode(cuda)


def test_model_log_probs_match_nll():
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=1, d_model=D_MODEL, n_head=2, d_head=8, d_inner=32,
                      cutoffs=[10, 25], div_val=2, dropout=0.0, init_std=0.3)
    torch.manual_seed(0)
    model = TransformerXL(cfg).eval()
    ids = torch.randint(0, VOCAB, (2, 5))
    labels = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        out = model(ids, labels)
        log_probs = model.log_probs(out.hidden)
    assert log_probs.shape == (2, 5, VOCAB)
    torch.testing.assert_close(-log_probs.gather(-1, labels[..., None]).squeeze(-1), out.nll, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tail_mode", ["gather", "dense"])
def test_every_parameter_gets_a_gradient_when_a_cluster_has_no_token(tail_mode):
    # Data-parallel gradient reduction needs the same set of gradients on every rank, whatever tokens a
    # rank's micro batch happens to hold.
    torch.manual_seed(0)
    model = TransformerXL(ModelConfig(vocab_size=64, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32,
                                      cutoffs=[32, 48], div_val=2))
    model.crit.tail_mode = tail_mode
    x = torch.randint(0, 32, (2, 8))  # head tokens only: both tail clusters are empty
    model(x, labels=x).nll.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


# ------------------------------------------------------------------------------------------------
# The tail plan: cluster counts and order from the host labels


def _model_and_batch(cutoffs=(10, 25), div_val=2, seed=0):
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=1, d_model=D_MODEL, n_head=2, d_head=8, d_inner=32,
                      cutoffs=list(cutoffs), div_val=div_val, dropout=0.0, init_std=0.3, tgt_len=6, mem_len=6)
    torch.manual_seed(seed)
    model = TransformerXL(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (3, 6), generator=g)
    labels = torch.randint(0, VOCAB, (3, 6), generator=g)
    labels[0, :4] = 0  # the head always has tokens; which tails do depends on the draw
    return model, ids, labels


def test_bucketed_rows_few_shapes_little_waste():
    assert bucketed_rows(0) == 0
    buckets = [bucketed_rows(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in enumerate(buckets, 1))
    assert all(b <= max(n + 7, n * 9 // 8) for n, b in enumerate(buckets, 1))     # <= 1/8 waste above 64
    assert buckets == sorted(buckets)
    for low in (64, 128, 1024, 2048):                                              # one octave (low, 2 low]
        assert len({bucketed_rows(n) for n in range(low + 1, 2 * low + 1)}) <= 8


@pytest.mark.parametrize("name", ["div1", "div2"])
def test_gather_pads_tail_rows_to_a_bucket_without_changing_a_number(name, monkeypatch):
    crit = make_crit(name)
    hidden, target = hidden_and_target(n=40, seed=3)
    # Cluster sizes 11 (head), 9 (first tail: tokens 10..24), 20 (second tail): padded to 16 and 24 rows.
    target = torch.tensor([0] * 11 + [12] * 9 + [30] * 20)[torch.randperm(40, generator=torch.Generator().manual_seed(4))]
    rows_seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: rows_seen.append(x.shape[0]) or linear(x, *a))
    assert_gather_equals_dense(crit, hidden, target)  # hidden[0]'s gradient too: padding rows read it
    assert rows_seen[-3:] == [40, 16, 24]                                          # the gather pass: head, tails


def test_shared_table_gradient_equals_per_cluster_slices(monkeypatch):
    # div_val 1 splits the one table once per forward; its gradient must be what slicing per cluster gives.
    crit = make_crit("div1")
    hidden, target = hidden_and_target(n=48, seed=5)
    crit(hidden, target).sum().backward()
    leaf = crit.out_layers[0].weight.detach().clone().requires_grad_()          # the same values, a new leaf
    ends = crit.cutoff_ends
    slices = tuple(leaf[ends[k]:ends[k + 1]] for k in range(3))
    biases = tuple(crit.out_layers[0].bias[ends[k]:ends[k + 1]] for k in range(3))
    monkeypatch.setattr(crit, "_shared_table_pieces", lambda: (slices, biases))
    crit(hidden, target).sum().backward()
    assert torch.equal(crit.out_layers[0].weight.grad, leaf.grad)


def test_tail_plan_counts_and_order_from_the_host_labels():
    labels = np.random.default_rng(0).integers(0, VOCAB, size=(4, 9))
    plan = tail_plan(labels, [10, 25], torch.device("cpu"))
    flat = labels.reshape(-1).tolist()
    # Independently: a token's cluster is how many cutoffs it reaches; the order lists positions cluster by
    # cluster, each in increasing position.
    cluster_of = [sum(t >= c for c in (10, 25)) for t in flat]
    assert plan.counts == [cluster_of.count(i) for i in range(3)]
    assert plan.order.dtype == torch.int64
    assert plan.order.tolist() == [pos for i in range(3) for pos in range(len(flat)) if cluster_of[pos] == i]


def test_forward_with_a_plan_equals_without_bitwise():
    model, ids, labels = _model_and_batch()
    model.crit.tail_mode = "gather"
    results = []
    for plan in (None, tail_plan(labels.numpy(), model.config.cutoffs, torch.device("cpu"))):
        model.zero_grad()
        out = model(ids, labels=labels, tail_plan=plan)
        out.nll.mean().backward()
        results.append((out.nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (nll_a, grads_a), (nll_b, grads_b) = results
    assert torch.equal(nll_a, nll_b)
    for name, grad in grads_a.items():
        assert torch.equal(grad, grads_b[name]), name


def test_a_plan_that_does_not_fit_the_labels_is_refused():
    model, ids, labels = _model_and_batch()
    plan = tail_plan(labels[:2].numpy(), model.config.cutoffs, torch.device("cpu"))
    with pytest.raises(ValueError, match="tail plan .* does not describe 18 targets"):
        model(ids, labels=labels, tail_plan=plan)


def _no_host_reads(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a host read of a tensor (a device sync on an accelerator)")
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_forward_and_backward_with_a_plan_read_no_tensor_on_the_host(monkeypatch):
    model, ids, labels = _model_and_batch()
    plan = tail_plan(labels.numpy(), model.config.cutoffs, torch.device("cpu"))
    first = model(ids, labels=labels, tail_plan=plan)  # a second segment attends to a memory too
    with monkeypatch.context() as patch:
        _no_host_reads(patch)
        out = model(ids, labels=labels, mems=first.mems, tail_plan=plan)
        out.nll.mean().backward()
        # The check can fail: without a plan the gather tail reads the cluster counts on the host.
        with pytest.raises(AssertionError, match="host read"):
            model(ids, labels=labels, mems=first.mems)


# ------------------------------------------------------------------------------------------------
# Padding to tensor-core multiples (pad_vocab_multiple)


def copy_real_rows(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst's parameters := src's (the leading rows of a padded one); padding rows get large random values,
    which must not matter."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
            assert a.shape[1:] == b.shape[1:] and a.shape[0] <= b.shape[0], name
            b.copy_(10 * torch.randn(b.shape, generator=g))
            b[:a.shape[0]] = a


@pytest.mark.parametrize("multiple", [8, 64])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_padded_softmax_gives_the_unpadded_numbers(name, multiple):
    d_embed, cutoffs, div_val = SHAPES[name]
    crit = make_crit(name)
    padded = ProjectedAdaptiveLogSoftmax(VOCAB, d_embed, D_MODEL, cutoffs, div_val, pad_multiple=multiple)
    copy_real_rows(crit, padded)
    head_rows = padded._cluster_params(0)[0].shape[0]
    assert head_rows % multiple == 0 and head_rows >= padded.n_logits(0)
    hidden, target = hidden_and_target(n=40, seed=3)
    target[:3] = VOCAB - 1  # the last token sits next to the padding
    torch.testing.assert_close(padded.log_probs(hidden), crit.log_probs(hidden), **PADDED_TOL)
    for mode in ("dense", "gather"):
        crit.tail_mode = padded.tail_mode = mode
        results = []
        for module in (crit, padded):
            module.zero_grad()
            h = hidden.clone().requires_grad_()
            nll = module(h, target)
            nll.sum().backward()
            results.append((nll.detach(), h.grad, [p.grad for p in module.parameters()]))
        (nll_a, gh_a, gp_a), (nll_b, gh_b, gp_b) = results
        torch.testing.assert_close(nll_b, nll_a, **PADDED_TOL)
        torch.testing.assert_close(gh_b, gh_a, **PADDED_TOL)
        for a, b in zip(gp_a, gp_b):
            torch.testing.assert_close(b[:a.shape[0]], a, **PADDED_TOL)
            assert not b[a.shape[0]:].any()  # padding rows learn nothing


@pytest.mark.parametrize("div_val", [1, 2])
def test_padded_model_gives_the_unpadded_numbers(div_val):
    model, ids, labels = _model_and_batch(div_val=div_val)
    padded = TransformerXL(dataclasses.replace(model.config, pad_vocab_multiple=8))
    copy_real_rows(model, padded)
    model.eval(), padded.eval()
    with torch.no_grad():
        a, b = model(ids, labels=labels), padded(ids, labels=labels)
        torch.testing.assert_close(b.nll, a.nll, **PADDED_TOL)
        torch.testing.assert_close(padded.log_probs(b.hidden), model.log_probs(a.hidden), **PADDED_TOL)
    assert padded.word_emb.emb_layers[0].weight is padded.crit.out_layers[0].weight  # tie_weight still ties


def test_padded_shapes_of_the_large_preset():
    # configs/large.json: S + C = 20000 + 3 head logits; tails of 20000, 160000 and 67735 tokens.
    cfg = ModelConfig(vocab_size=267735, n_layer=1, d_model=1024, n_head=16, d_head=64, d_inner=4096,
                      d_embed=1024, cutoffs=[20000, 40000, 200000], div_val=4, pad_vocab_multiple=64)
    with torch.device("meta"):
        model = TransformerXL(cfg)
    assert [model.crit._cluster_params(i)[0].shape[0] for i in range(4)] == [20032, 20032, 160000, 67776]
    assert model.crit.padded_rows() == {"cluster_weight": 3, "cluster_bias": 3, "out_layers.1.weight": 20000,
                                        "out_layers.1.bias": 20000, "out_layers.3.weight": 67735,
                                        "out_layers.3.bias": 67735}
    assert model.word_emb.padded_rows() == {"emb_layers.1.weight": 20000, "emb_layers.3.weight": 67735}
