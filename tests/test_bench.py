"""The benchmark command: its FLOP count against torch's own counter, and a --quick run of two sections
that rewrites only the marked block of a BENCHMARKS.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.flop_count import cluster_shares, model_flops_per_token
from txl_dist.config import ModelConfig
from txl_dist.model import TransformerXL

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("div_val,d_embed", [(1, 48), (2, 64)])
def test_flop_count_matches_torch_flop_counter(div_val, d_embed):
    cfg = ModelConfig(vocab_size=500, n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128, d_embed=d_embed,
                      div_val=div_val, cutoffs=[100, 300], tgt_len=12, mem_len=20, dropout=0.0)
    torch.manual_seed(0)
    model = TransformerXL(cfg).eval()
    model.attn_impl = "matmul"
    batch = 3
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.tgt_len))
    labels = torch.randint(0, cfg.vocab_size, (batch, cfg.tgt_len))
    mems = [torch.randn(batch, cfg.mem_len, cfg.d_model) for _ in range(cfg.n_layer)]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, labels, mems)
    counted = counter.get_total_flops()
    estimate = batch * cfg.tgt_len * model_flops_per_token(
        cfg, batch=batch, training=False, tail_shares=cluster_shares(labels, cfg.vocab_size, cfg.cutoffs))
    # The only difference: the position product runs over one extra (zero) distance row.
    assert estimate == pytest.approx(counted, rel=0.03)


@pytest.mark.slow
def test_quick_run_rewrites_only_the_marked_block(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nhand-written intro\n\n<!-- bench:start -->\nold table\n<!-- bench:end -->\n\n"
                   "## Speed changes\nhand-written rows\n")
    result = tmp_path / "latest.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--sections", "longmem", "checkpoint",
                           "--out", str(out), "--json", str(result)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    text = out.read_text()
    assert "hand-written intro" in text and "## Speed changes\nhand-written rows" in text
    assert "old table" not in text and text.count("<!-- bench:start -->") == 1
    assert "| long-memory evaluation tokens/s" in text and "| checkpoint save MB/s" in text
    res = json.loads(result.read_text())
    assert res["longmem"]["speedup"] > 0 and res["checkpoint"]["save_mb_s"] > 0
    assert res["machine"]["torch"] == torch.__version__
