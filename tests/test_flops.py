"""FLOPs per token against torch's own count of a real forward+backward; the peak table and measurement."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from txl_dist.config import ModelConfig
from txl_dist.flops import (cluster_token_shares, flops_breakdown, flops_per_token, measure_matmul_peak, peak_flops,
                            small_head_warning, table_peak, zipf_cluster_shares)
from txl_dist.model import TransformerXL

VOCAB, T, M, B = 200, 12, 20, 3


def _model(tail_mode: str, **model):
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128, tgt_len=T,
                      mem_len=M, dropout=0.1, **model)
    torch.manual_seed(0)
    net = TransformerXL(cfg)
    net.crit.tail_mode = tail_mode
    return cfg, net


# Adaptive input and softmax with div_val > 1 (a projection per cluster), div_val 1 with d_embed != d_model
# (one shared projection), a plain softmax without projections; tails gathered and dense.
CASES = [("gather", {"div_val": 2, "cutoffs": [40, 100]}), ("dense", {"div_val": 2, "cutoffs": [40, 100]}),
         ("gather", {"div_val": 1, "d_embed": 48, "cutoffs": [40]}), ("dense", {"div_val": 1, "cutoffs": [40]}),
         ("gather", {"cutoffs": [], "untie_r": False, "pre_lnorm": True}),
         # Vocabulary padding: the padded rows are computed, so they are counted.
         ("gather", {"div_val": 2, "cutoffs": [40, 100], "pad_vocab_multiple": 64}),
         ("dense", {"div_val": 1, "cutoffs": [40, 100], "pad_vocab_multiple": 64}),
         ("gather", {"cutoffs": [], "pad_vocab_multiple": 64})]


@pytest.mark.parametrize("tail_mode,model", CASES)
def test_training_flops_match_torchs_count_of_a_real_step(tail_mode, model):
    cfg, net = _model(tail_mode, **model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)                          # [B, T]
    # Skewed labels (most in the head), as real text: the tails' share must come from the tokens.
    labels = (torch.rand(B, T, generator=gen) ** 3 * VOCAB).long()                # [B, T]
    mems = [torch.randn(B, M, cfg.d_model, generator=gen) for _ in range(cfg.n_layer)]
    with FlopCounterMode(display=False) as counter:
        out = net(ids, labels, mems)
        out.nll.mean().backward()
    shares = cluster_token_shares(labels.numpy().ravel(), cfg.cutoffs, VOCAB)
    expected = flops_per_token(cfg, micro_batch=B, cluster_shares=shares, tail_mode=tail_mode) * B * T
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)


def test_forward_only_flops_match_torchs_count():
    cfg, net = _model("gather", div_val=2, cutoffs=[40, 100])
    net.eval()
    ids = torch.randint(0, VOCAB, (B, T))
    labels = torch.randint(0, VOCAB, (B, T))
    mems = [torch.randn(B, M, cfg.d_model) for _ in range(cfg.n_layer)]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(ids, labels, mems)
    shares = cluster_token_shares(labels.numpy().ravel(), cfg.cutoffs, VOCAB)
    expected = flops_per_token(cfg, micro_batch=B, cluster_shares=shares, training=False) * B * T
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)


def test_breakdown_parts_follow_the_settings():
    cfg = ModelConfig(vocab_size=1000, n_layer=3, d_model=64, n_head=4, d_head=16, d_inner=256, tgt_len=32,
                      mem_len=32, cutoffs=[100, 500], div_val=2)
    gather = flops_breakdown(cfg, micro_batch=4, cluster_shares=[0.8, 0.15, 0.05])
    dense = flops_breakdown(cfg, micro_batch=4, cluster_shares=[0.8, 0.15, 0.05], tail_mode="dense")
    assert dense["softmax_tails"] > gather["softmax_tails"] > 0
    assert dense["layers"] == gather["layers"]
    longer = flops_breakdown(cfg, micro_batch=4, cluster_shares=[0.8, 0.15, 0.05], mem_len=96)
    assert longer["layers"] > gather["layers"]
    assert flops_breakdown(cfg, micro_batch=8)["r_net"] == pytest.approx(gather["r_net"] / 2)


def test_cluster_shares_count_tokens_per_cluster():
    tokens = np.array([0, 5, 99, 100, 499, 500, 999, 3, 4, 7])
    assert cluster_token_shares(tokens, [100, 500], 1000) == pytest.approx([0.6, 0.2, 0.2])
    zipf = zipf_cluster_shares([100, 500], 1000)
    assert sum(zipf) == pytest.approx(1.0)
    # Zipf: the first 100 ids hold more mass than the next 400, which hold more than the last 500.
    assert zipf[0] > zipf[1] > zipf[2] > 0


def test_peak_table_names_the_datasheet_and_unknown_devices_are_measured():
    value, source = table_peak("NVIDIA H200", torch.bfloat16)
    assert value == 989.4e12 and "H200" in source
    assert table_peak("NVIDIA H100 PCIe", torch.bfloat16)[0] == 756.5e12
    assert table_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16)[0] == 312e12
    assert table_peak("NVIDIA A10", torch.bfloat16)[0] == 125e12
    assert table_peak("Some Future GPU", torch.bfloat16) is None
    assert table_peak("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 there: measure
    assert table_peak("Tesla V100-SXM2-16GB", torch.float16)[0] == 125e12
    assert table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16)[0] == 989.4e12
    assert table_peak("NVIDIA H200 NVL", torch.bfloat16)[0] == 835.5e12  # not the SXM part's peak
    assert table_peak("NVIDIA GH200 480GB", torch.bfloat16)[0] == 989.4e12
    # Whole words: an L40 is no L4, an A10G no A10 (other peaks, not in the table: measured).
    assert table_peak("NVIDIA L40", torch.bfloat16) is None
    assert table_peak("NVIDIA A10G", torch.bfloat16) is None
    assert table_peak("NVIDIA L40S", torch.bfloat16)[0] == 362.05e12
    assert table_peak("NVIDIA L4", torch.bfloat16)[0] == 121e12
    value, source = peak_flops("cpu", torch.float32, seconds=0.05)
    assert value > 0 and source.startswith("measured: ")
    assert measure_matmul_peak("cpu", torch.bfloat16, seconds=0.02, sizes=(64,))[1] == 64



def test_a_pcie_v100_has_its_own_peak_not_the_sxm2_parts():
    # "Tesla V100-PCIE-16GB" took the SXM2 part's 125 / 15.7 TFLOP/s: its MFU came out ~10% low.
    assert table_peak("Tesla V100-PCIE-16GB", torch.float16)[0] == 112e12
    assert table_peak("Tesla V100-PCIE-32GB", torch.float32)[0] == 14e12
    assert table_peak("Tesla V100-SXM2-32GB", torch.float16)[0] == 125e12
    assert table_peak("Tesla V100-PCIE-16GB", torch.bfloat16) is None


def test_the_cpu_peak_is_one_threads_best_rate_times_the_threads(monkeypatch):
    """On a shared CPU a multi-threaded product waits for its slowest (preempted) thread: the peak is measured
    on one thread and counts every thread of the process. A fake clock makes every product take 1 ms."""
    from types import SimpleNamespace

    from txl_dist import flops

    clock = iter(i * 1e-3 for i in range(10**6))
    monkeypatch.setattr(flops, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    threads_seen = []
    real_matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: threads_seen.append(torch.get_num_threads()) or real_matmul(a, b))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        value, size = measure_matmul_peak("cpu", torch.float32, seconds=0.01, sizes=(32, 64))
        assert torch.get_num_threads() == 2  # restored
        source = peak_flops("cpu", torch.float32, seconds=0.01)[1]
    finally:
        torch.set_num_threads(before)
    assert set(threads_seen) == {1}
    assert size == 64 and value == pytest.approx(2 * 64 ** 3 / 1e-3 * 2)
    assert "one cpu thread x 2 thread(s)" in source


def test_the_trainers_flops_count_the_tail_mode_its_planned_steps_run():
    """The trainer passes every micro batch's TailPlan, so its tails are gathered even where "auto" without a
    plan would score every token in every tail (a GPU, cheap tails): MFU counts the gathered FLOPs."""
    from txl_dist.trainer import trained_tail_mode

    _, net = _model("auto", div_val=4, cutoffs=[150])
    gpu = torch.device("cuda")  # a device object only: the rule reads its type
    assert net.crit.resolved_tail_mode(gpu) == "dense"  # what the count used to take
    assert trained_tail_mode(net.crit, gpu) == "gather"
    assert trained_tail_mode(net.crit, torch.device("cpu")) == "gather"
    net.crit.tail_mode = "dense"  # an explicit mode is what the steps run
    assert trained_tail_mode(net.crit, gpu) == "dense"


def test_start_up_warns_of_a_head_cluster_that_holds_few_tokens():
    assert small_head_warning([], [1.0]) is None and small_head_warning([8], None) is None
    assert small_head_warning([1000, 2000], [0.861, 0.083, 0.056]) is None  # the tiny preset on Shakespeare
    line = small_head_warning([200, 500], [0.0003, 0.2, 0.7997])
    assert line.startswith("model.cutoffs [200, 500]: the head cluster (ids below 200) holds only 0.0% of") and \
        "256 byte pieces" in line


def test_the_cpu_peak_times_several_products_of_a_size_in_a_row(monkeypatch):
    """In bf16 on an Intel with AMX a product right after one of another size ran ~10% slower: single alternating
    products put the peak 12-14% low. Each size's turn is PRODUCTS_PER_TURN products in a row."""
    from txl_dist import flops

    sizes_seen = []
    real_matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: sizes_seen.append(a.shape[-1]) or real_matmul(a, b))
    measure_matmul_peak("cpu", torch.float32, seconds=0.0, sizes=(32, 64))
    turns = sizes_seen[2:]  # after one warm-up product per size
    k = flops.PRODUCTS_PER_TURN
    assert k >= 2 and len(turns) == 3 * 2 * k  # at least 3 rounds
    assert turns[:2 * k] == [32] * k + [64] * k
