"""bench/gpu_check.sh --cpu-smoke: every phase of the device check runs at toy size, so the script cannot
rot between GPU runs (the GPU itself is not needed; the phases' code paths are the same)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import torch

from txl_dist.model.attention import ATTN_IMPLS, candidate_attn_impls

REPO = Path(__file__).resolve().parents[1]
PHASES = ["env", "matmul", "attention", "model", "train", "deepspeed"]


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "out"
    # A generous overall time box: this checks that every phase runs to the end, not how fast, so the phases'
    # time boxes (shares of the total) must not cut any short on a busy machine. The smoke run needs 25-45 s
    # on an idle 2-core machine; under a load of 5 on 2 cores one phase alone took over 80 s.
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"DS_ACCELERATOR": "cpu", "GPU_CHECK_TOTAL_S": "1500"}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu-smoke", "--out", str(out)],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    status = {r["phase"]: r["status"] for r in records if r["kind"] == "phase"}
    assert list(status) == PHASES, status
    assert all(s == "ok" for s in status.values()), [r for r in records if r["kind"] in ("phase", "trace")]

    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    assert {r["dtype"] for r in by_kind["matmul"]} == {"bf16", "fp16", "tf32", "fp32"}
    assert all(r["flop_per_s"] > 0 for r in by_kind["matmul"])
    # Every implementation was checked against the float64 oracle and timed, in both dtypes (forward only
    # where it has no backward on a CPU: FlexAttention).
    trainable = {"reference", *candidate_attn_impls(torch.device("cpu"), torch.float32, training=True, dropatt=0.0)}
    forward_only = {(r["impl"], r["forward_only"]) for r in by_kind["attention_error"] if "error" not in r}
    assert forward_only == {(i, i not in trainable) for i in ATTN_IMPLS}
    pairs = {(r["impl"], r["dtype"]) for r in by_kind["attention_error"] if "error" not in r}
    assert pairs == {(i, d) for i in ATTN_IMPLS for d in ("fp32", "bf16")}
    assert {(r["impl"], r["dtype"]) for r in by_kind["attention_time"]} == pairs
    fp32_err = [r["max_abs_out"] for r in by_kind["attention_error"] if r["dtype"] == "fp32"]
    assert max(fp32_err) < 1e-4, by_kind["attention_error"]
    model = {(r["impl"], r["dtype"]): r for r in by_kind["model_error"]}
    assert set(model) == {(i, d) for i in ATTN_IMPLS for d in ("fp32", "bf16")}
    assert all(r["ok"] for r in model.values()), model
    # The training matrix: every non-reference impl surveyed, then the best with checkpointing and compile.
    steps = [r for r in by_kind["train_step"] if "error" not in r and "skipped" not in r]
    assert not [r for r in by_kind["train_step"] if "error" in r], by_kind["train_step"]
    skipped = {r["impl"] for r in by_kind["train_step"] if r.get("skipped", "").startswith("no backward")}
    assert skipped == set(ATTN_IMPLS) - trainable
    for shape in ("large", "base"):
        ran = {(r["impl"], r["checkpointing"], r["compile"]) for r in steps if r["shape"] == shape}
        assert {i for i, _, _ in ran} >= trainable - {"reference"}
        assert {(c, k) for _, c, k in ran} == {(False, False), (True, False), (False, True), (True, True)}
        assert all(r["tokens_per_s"] > 0 and r["mfu_measured_peak"] >= 0 for r in steps if r["shape"] == shape)
    (ds,) = by_kind["deepspeed"]
    assert ds["exit"] == 0 and ds["tokens_per_s_last"] > 0, ds
    table = (out / "gpu_check_table.txt").read_text()
    assert "| train | ok |" in table and "DeepSpeed trainer ZeRO 1: exit 0" in table
