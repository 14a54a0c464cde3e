"""Adaptive log-softmax: a normalized distribution, NLL consistent with it, both tail strategies equal."""
import pytest
import torch

from txl_dist.config import ModelConfig
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import ProjectedAdaptiveLogSoftmax

VOCAB, D_MODEL = 40, 16
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
    results = {}
    for mode in ("dense", "gather"):
        crit.tail_mode = mode
        crit.zero_grad()
        h = hidden.clone().requires_grad_()
        nll = crit(h, target)
        nll.sum().backward()
        results[mode] = (nll.detach(), h.grad, {n: p.grad.clone() for n, p in crit.named_parameters()})
    (nll_d, gh_d, gp_d), (nll_g, gh_g, gp_g) = results["dense"], results["gather"]
    torch.testing.assert_close(nll_d, nll_g, rtol=0, atol=1e-5)
    torch.testing.assert_close(gh_d, gh_g, rtol=0, atol=1e-5)
    for n in gp_d:
        torch.testing.assert_close(gp_d[n], gp_g[n], rtol=0, atol=1e-5, msg=n)


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
