"""The model's accelerator paths keep every tensor on the model's device, proved without a GPU.

The meta device stands in for CUDA: a tensor made on the host inside forward or backward (a mask, a position
table, an index without `device=`) meets the meta tensors in an op and raises "is not on the expected
device", as it would against CUDA tensors. Meta also takes the branches a GPU takes (anything that is not
"cpu": torch's F.dropout instead of the CPU mask, the dense tail of the adaptive softmax), so this checks, in
CI, the code the GPU check would otherwise be the first to run. Numbers are not computed on meta; their
correctness is the CPU tests' (and the GPU check's) job.
"""
import dataclasses

import numpy as np
import pytest
import torch

from txl_dist.config import MemorySettings, ModelConfig
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import TailPlan, tail_plan

META = torch.device("meta")
CFG = ModelConfig(vocab_size=200, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, cutoffs=[50, 100],
                  div_val=2, tgt_len=8, mem_len=8, dropout=0.1, dropatt=0.1)
MEMORY = [MemorySettings(mem_len=8), MemorySettings(mem_len=12, clamp_len=5, same_length=True)]


def _model(impl: str, dtype: torch.dtype, tail_mode: str = "auto", checkpointing: bool = False) -> TransformerXL:
    with META:
        model = TransformerXL(CFG).to(dtype)
    model.attn_impl = impl
    model.crit.tail_mode = tail_mode
    model.set_activation_checkpointing(enabled=checkpointing)
    return model.train()


def _meta_plan(labels: np.ndarray) -> TailPlan:
    # tail_plan pins host memory for a device copy, which a machine without an accelerator cannot; the plan's
    # counts are host numbers either way, and its order is what moves to the device.
    plan = tail_plan(labels, CFG.cutoffs, torch.device("cpu"))
    return dataclasses.replace(plan, order=plan.order.to(META))


def _train_segments(model: TransformerXL, memory: MemorySettings, planned: bool, n_segments: int = 3) -> None:
    labels = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(3, CFG.tgt_len))  # [B, T]
    mems = None
    for _ in range(n_segments):
        x = torch.empty(labels.shape, dtype=torch.long, device=META)
        y = torch.from_numpy(labels).to(META)
        out = model(x, labels=y, mems=mems, memory=memory, tail_plan=_meta_plan(labels) if planned else None)
        out.nll.float().mean().backward()
        mems = out.mems
        assert out.nll.device == META and out.nll.shape == labels.shape
        assert all(m.device == META and not m.requires_grad for m in mems)
        assert mems[0].shape[1] == min(memory.mem_len, mems[0].shape[1])
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device == META for g in grads)


@pytest.mark.parametrize("memory", MEMORY, ids=["plain", "clamped_same_length"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["matmul", "sdpa"])
def test_training_segments_stay_on_the_device(impl, dtype, memory):
    # The trainer's path: a TailPlan from the host labels (the gather tail without a sync), mems carried.
    _train_segments(_model(impl, dtype), memory, planned=True)


@pytest.mark.parametrize("impl", ["matmul", "sdpa"])
def test_dense_tail_and_checkpointed_layers_stay_on_the_device(impl):
    # The tail without a plan and without a sync ("auto" picks it off the CPU when the tails are small);
    # checkpointing recomputes the layers in backward.
    model = _model(impl, torch.bfloat16, tail_mode="dense", checkpointing=True)
    _train_segments(model, MEMORY[1], planned=False)


def test_inference_log_probs_stay_on_the_device():
    # Evaluation and generation: no labels, full log-probabilities of the last position, mems carried.
    model = _model("matmul", torch.bfloat16).eval()
    mems = None
    with torch.no_grad():
        for _ in range(2):
            out = model(torch.empty(2, 5, dtype=torch.long, device=META), mems=mems, memory=MEMORY[1])
            log_probs = model.log_probs(out.hidden[:, -1])
            mems = out.mems
    assert out.nll is None
    assert log_probs.device == META and log_probs.shape == (2, CFG.vocab_size) and log_probs.dtype == torch.float32
