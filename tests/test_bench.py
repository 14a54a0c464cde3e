"""The benchmark command: a --quick run of two sections rewrites only the marked block of a BENCHMARKS.md.
(Its FLOP count is the product's, txl_dist/flops.py, tested in tests/test_flops.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


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
