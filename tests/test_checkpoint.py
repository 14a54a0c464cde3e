"""Checkpoint files: `latest` and tag resolution, pruning of old and interrupted tags, RNG states, export of
consolidated fp32 weights (ZeRO-3, and the fp32 masters of a bf16 stage-0 run) to native and HF folders."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dist_helpers import learnable_stream, run_ranks, tiny_config, write_corpus
from txl_dist import checkpoint
from txl_dist.checkpoint import CheckpointError


def _tag(ckpt, step, complete=True, universal=False):
    tag = ckpt / checkpoint.tag_for(step)
    (tag / checkpoint.STATE_DIR).mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (tag / checkpoint.STATE_DIR / checkpoint.RUN_FILE).write_text(json.dumps({"version": 1, "step": step}))
    if universal:
        (ckpt / (tag.name + checkpoint.UNIVERSAL_SUFFIX)).mkdir()
    return tag


def _names(ckpt):
    return sorted(p.name for p in ckpt.iterdir())


def test_tags_sort_by_step():
    assert checkpoint.tag_for(12) == "step_00000012"
    assert checkpoint.step_of("step_00000012") == 12
    assert checkpoint.step_of("global_step12") is None and checkpoint.step_of("step_x") is None


def test_prune_keeps_the_newest_complete_tags_and_drops_interrupted_saves(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _tag(ckpt, step, universal=step == 10)
    _tag(ckpt, 40, complete=False)  # a save interrupted before `latest` moved
    (ckpt / "latest").write_text("step_00000030\n")
    removed = checkpoint.prune(ckpt, keep=2)
    assert sorted(removed) == ["step_00000010", "step_00000040"]
    assert _names(ckpt) == ["latest", "step_00000020", "step_00000030"]  # step 10's universal copy went too
    _tag(ckpt, 50, complete=False)
    checkpoint.prune(ckpt, keep=0)  # keep all complete ones, still drop the interrupted one
    assert _names(ckpt) == ["latest", "step_00000020", "step_00000030"]
    checkpoint.prune(ckpt, keep=1, protect=ckpt / "step_00000020")  # a job is resuming from step 20
    assert _names(ckpt) == ["latest", "step_00000020", "step_00000030"]
    checkpoint.prune(ckpt, keep=1)
    assert _names(ckpt) == ["latest", "step_00000030"]


def test_resolve_resume_auto_none_and_paths(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert checkpoint.resolve_resume("auto", ckpt) is None  # nothing yet: a fresh start
    tag = _tag(ckpt, 5)
    assert checkpoint.resolve_resume("auto", ckpt) is None  # a tag without `latest` is not a checkpoint
    (ckpt / "latest").write_text("step_00000005\n")
    assert checkpoint.resolve_resume("auto", ckpt) == tag
    assert checkpoint.resolve_resume("none", ckpt) is None
    assert checkpoint.resolve_resume(str(ckpt), tmp_path / "elsewhere") == tag
    assert checkpoint.resolve_resume(str(tag), tmp_path / "elsewhere") == tag
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        checkpoint.resolve_resume(str(tmp_path), ckpt)
    (ckpt / "latest").write_text("step_00000007\n")
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        checkpoint.resolve_resume("auto", ckpt)
    (ckpt / "latest").write_text("garbage\n")
    with pytest.raises(CheckpointError, match="not a tag of this project"):
        checkpoint.resolve_resume("auto", ckpt)


def test_run_info_of_another_version_is_refused(tmp_path):
    tag = _tag(tmp_path, 1)
    (tag / "txl_state" / "run.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        checkpoint.read_run_info(tag)


def test_needs_universal_only_for_partitioned_state_of_another_world_size():
    assert checkpoint.needs_universal({"zero_stage": 2, "world_size": 2}, 1)
    assert not checkpoint.needs_universal({"zero_stage": 2, "world_size": 2}, 2)
    assert not checkpoint.needs_universal({"zero_stage": 0, "world_size": 2}, 1)


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    checkpoint.seed_rng(5, rank=1)
    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    torch.save(state, tmp_path / "rng.pt")
    checkpoint.seed_rng(99, rank=0)  # move every generator elsewhere
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_seeded_rng_differs_per_rank_and_repeats():
    checkpoint.seed_rng(1, rank=0)
    a = torch.rand(2)
    checkpoint.seed_rng(1, rank=1)
    b = torch.rand(2)
    checkpoint.seed_rng(1, rank=0)
    assert torch.equal(torch.rand(2), a) and not torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------
# Export


def _train_and_gather(raw):
    """Train a short run on this rank; return the weights its engine holds at the end (gathered, as fp32)."""
    import deepspeed

    from dist_helpers import Recorder
    from txl_dist import distributed, trainer
    from txl_dist.config import config_from_dict

    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        t = trainer.build(config_from_dict(raw), env, resume="none")
        t.tracker = Recorder()
        assert t.train() == 0
        with deepspeed.zero.GatheredParameters(list(t.engine.module.parameters())):
            weights = {k: v.detach().float().clone() for k, v in t.engine.module.state_dict().items()}
        t.evaluator.close()
        t.loader.close()
        return weights
    finally:
        distributed.destroy_process_group()


@pytest.mark.parametrize("stage, bf16", [(3, False), (0, True)])
def test_export_writes_the_fp32_weights(tmp_path, stage, bf16):
    from launch.export import main
    from txl_dist.interop import load_native

    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 49, 64, 0),
                                                "valid": learnable_stream(80, 64, 1),
                                                "test": learnable_stream(80, 64, 2)})
    ds = {"zero_optimization": {"stage": stage}} | ({"bf16": {"enabled": True}} if bf16 else {})
    raw = tiny_config(corpus, tmp_path / "ckpt", train={"max_steps": 3}, eval={"at_end": False}, deepspeed=ds)
    engine_weights = run_ranks(_train_and_gather, 2, raw)[0]
    assert main(["--checkpoint", str(tmp_path / "ckpt" / "checkpoints"), "--out", str(tmp_path / "native"),
                 "--hf", str(tmp_path / "hf")]) == 0
    exported = load_native(tmp_path / "native").state_dict()
    assert set(exported) == set(engine_weights)
    for name, value in exported.items():
        assert value.dtype == torch.float32, name
        if bf16:
            # The engine's module holds bf16 copies of the fp32 masters the export wrote.
            torch.testing.assert_close(value.bfloat16().float(), engine_weights[name], rtol=0, atol=0)
        else:
            torch.testing.assert_close(value, engine_weights[name], rtol=0, atol=0)
    if bf16:  # masters, not the bf16 copies: some weights carry more precision than bf16 has
        assert any(not torch.equal(v, v.bfloat16().float()) for v in exported.values())
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
