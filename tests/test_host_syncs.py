"""A training step waits for the device once, at its end (docs/architecture.md "Host syncs"): DeepSpeed's own
waits for the device (`get_accelerator().synchronize()`) are counted inside real training steps of the tiny
model on one rank. The CPU accelerator resolves data dependencies, so here DeepSpeed skips the waits that CUDA
alone takes (overlap_comm's): bench/gpu_check.py runs this file on a GPU too, and tests/test_deepspeed_config.py
checks that the switch is off."""
from __future__ import annotations

import pytest

from dist_helpers import learnable_stream, run_ranks, tiny_config, train_jobs, write_corpus

VOCAB = 64


def _device_waits_per_step(raw: dict) -> list[int]:
    """Train `raw` on this rank; the accelerator's synchronize calls inside each optimizer step."""
    from deepspeed.accelerator import get_accelerator

    from txl_dist.trainer import Trainer

    accelerator = type(get_accelerator())
    waits, per_step = [0], []
    inside = [False]
    real_synchronize, real_step = accelerator.synchronize, Trainer.train_step

    def synchronize(self, *args, **kwargs):
        waits[0] += inside[0]
        return real_synchronize(self, *args, **kwargs)

    def train_step(self):
        inside[0], waits[0] = True, 0
        try:
            return real_step(self)
        finally:
            inside[0] = False
            per_step.append(waits[0])

    accelerator.synchronize = synchronize
    Trainer.train_step = train_step
    [result] = train_jobs([(raw, "none")])
    assert result["code"] == 0, result
    return per_step


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_deepspeed_does_not_wait_for_the_device_inside_a_step_of_one_rank(tmp_path, stage):
    """DeepSpeed's throughput timer, on unless configured, waited twice per micro step from the third step on
    (8 waits per step here: 4 micro steps) for a number nothing reads; the GPU presets' ZeRO-2 section
    (overlap_comm) waited once per micro step on a GPU with no reduction to overlap on one rank. Both are off
    (engine.deepspeed_config)."""
    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 49, VOCAB, 0),
                                                "valid": learnable_stream(80, VOCAB, 1),
                                                "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)
    zero = {"stage": stage} | ({"overlap_comm": True, "contiguous_gradients": True} if stage == 2 else {})
    raw = tiny_config(corpus, tmp_path / "run", train={"max_steps": 4}, eval={"at_end": False},
                      deepspeed={"zero_optimization": zero})
    [waits] = run_ranks(_device_waits_per_step, 1, raw, timeout=300)
    assert waits == [0, 0, 0, 0]
