"""A training step waits for the device once, at its end (docs/architecture.md "Host syncs"): DeepSpeed's own
waits for the device (`get_accelerator().synchronize()`) are counted inside real training steps of the tiny
model on one rank. The CPU accelerator resolves data dependencies, so here DeepSpeed skips the waits that CUDA
alone takes (overlap_comm's): bench/gpu_check.py runs this file on a GPU too, and tests/test_deepspeed_config.py
checks that the switch is off. The reads of device values (`.item()`, `bool()`, ...), free on a CPU, are
counted per call site instead: the same in steps of 2 and of 4 micro steps."""
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


HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero",
                        "masked_select", "unique", "bincount", "repeat_interleave", "multinomial"})
"""Tensor calls that read the device on a GPU (on a CPU they are free, so the calls are counted instead)."""


def _host_reads_per_step(raw: dict) -> list[dict[str, int]]:
    """Train `raw` on this rank; per optimizer step after the first two, the host reads inside it by call site
    ("name file:function", the first frame outside torch)."""
    import collections
    import traceback

    import torch
    from torch.overrides import TorchFunctionMode

    from txl_dist.trainer import Trainer

    per_step: list[dict[str, int]] = []

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.sites = collections.Counter()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
            bool_index = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                             for i in (index if isinstance(index, (tuple, list)) else (index,)))
            if name in HOST_READS or bool_index:
                frames = traceback.extract_stack(limit=16)[:-1]
                site = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in reversed(frames)
                             if "/torch/" not in f.filename and not f.filename.endswith(__file__.rsplit("/", 1)[-1])),
                            "?")
                self.sites[f"{name} {site}"] += 1
            return func(*args, **(kwargs or {}))

    real_step = Trainer.train_step

    def train_step(self):
        if self.step < 2:  # the first steps set things up (DeepSpeed's lazy state)
            return real_step(self)
        mode = Reads()
        with mode:
            out = real_step(self)
        per_step.append(dict(mode.sites))
        return out

    Trainer.train_step = train_step
    [result] = train_jobs([(raw, "none")])
    assert result["code"] == 0, result
    return per_step


def test_host_reads_in_a_step_do_not_grow_with_its_micro_steps(tmp_path):
    """The GPU presets' section (ZeRO 2, bf16, fp32 gradient sums): the reads of device values inside an
    optimizer step are the same with 2 and with 4 micro steps, so none is per micro step; they are DeepSpeed's
    few per step (docs/architecture.md "Host syncs") and the trainer's one."""
    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 49, VOCAB, 0),
                                                "valid": learnable_stream(80, VOCAB, 1),
                                                "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)
    reads = {}
    for micro_batch in (2, 1):  # 4 streams: 2 and 4 micro steps per step
        raw = tiny_config(corpus, tmp_path / f"run{micro_batch}", train={"max_steps": 4}, eval={"at_end": False},
                          deepspeed={"train_micro_batch_size_per_gpu": micro_batch, "bf16": {"enabled": True},
                                     "zero_optimization": {"stage": 2, "contiguous_gradients": True}})
        [reads[micro_batch]] = run_ranks(_host_reads_per_step, 1, raw, timeout=300)
    assert len(reads[1]) == len(reads[2]) == 2
    assert reads[1] == reads[2], reads
    assert reads[1][0].get("tolist trainer.py:train_step") == 1  # the trainer's one read
    assert sum(reads[1][0].values()) <= 6, reads[1][0]
