"""Every shipped preset starts and trains: configs/*.json with its own deepspeed section (optimizer, precision,
ZeRO stage, activation checkpointing, LR schedule), its train and checkpoint settings and its evaluation's memory
settings (the paper's mem_len 1600 / 3800, clamp_len, same_length), shrunk to a toy model on a toy corpus: 3
steps on one CPU rank, then the final evaluations (3 segments each). Config checks alone missed that
three presets could not start (DeepSpeed's WarmupCosineLR refused their warmup_num_steps 0 inside
deepspeed.initialize). Each trains with its own optimizer: torch's fused AdamW ("torch_adam": true), which
DeepSpeed need not compile."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dist_helpers import REPO, learnable_stream, write_corpus

PRESETS = sorted(p.stem for p in (REPO / "configs").glob("*.json"))
TOY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
       "model.d_embed=null", "model.vocab_size=null", "model.cutoffs=[20,40]", "model.div_val=1", "model.tgt_len=8",
       "model.mem_len=8", "eval.max_segments=3", "tracking.enabled=false",
       "train.max_steps=3", "train.log_interval=1", "eval.interval=0", "checkpoint.interval=0",
       "deepspeed.train_batch_size=4", "deepspeed.train_micro_batch_size_per_gpu=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets") / "corpus"
    return write_corpus(root, {"train": learnable_stream(64 * 40, 64, 0), "valid": learnable_stream(2000, 64, 1),
                               "test": learnable_stream(2000, 64, 2)}, vocab_size=64)


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_the_preset_trains_three_steps_at_toy_size(name, corpus, tmp_path):
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--config", str(REPO / "configs" / f"{name}.json"),
           "--resume", "none"]
    for item in [*TOY, f"data.path={corpus}", f"run.dir={tmp_path / 'run'}"]:
        cmd += ["--set", item]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "step 3/3 | loss" in proc.stdout
    after = proc.stdout.split("step 3/3 | loss", 1)[1]
    # After the steps: the final validation, the checkpoint and the test evaluation.
    assert "valid at step 3: loss" in after and "checkpoints/step_00000003" in after and "test at step 3: loss" in after


@pytest.mark.parametrize("name,vocab_size,stated", [("ptb", 10001, "32,064,501"), ("large", None, "285,205,322")])
def test_the_parameter_counts_in_the_recipes_are_what_the_presets_build(name, vocab_size, stated):
    """docs/recipes.md once gave the paper's figures (24M, 257M) as the presets' sizes."""
    import dataclasses

    from txl_dist.config import load_config
    from txl_dist.startup import count_parameters

    model = load_config(REPO / "configs" / f"{name}.json").model
    if vocab_size is not None:  # ptb.json takes it from the corpus: PTB's 10,001 ids (docs/recipes.md)
        model = dataclasses.replace(model, vocab_size=vocab_size)
    assert count_parameters(model) == int(stated.replace(",", ""))
    assert stated in (REPO / "docs" / "recipes.md").read_text()
