"""The model under DeepSpeed ZeRO-3 (parameters partitioned, gathered per module) with DeepSpeed's activation
checkpointing: losses and gradients over two segments (with mems) must equal plain PyTorch.

This guards the model-side contract: every parameter is used inside its own module's forward or named by the
module that reads it (`borrowed_parameters()`, registered as the engine does: txl_dist.engine.
register_borrowed_parameters), the output is a NamedTuple that ZeRO-3's hooks can see, tied and shared (untie_r
false) parameters work. One process (world size 1): what is checked here is the model, not data parallelism."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import free_port

SCRIPT = r"""
import copy, json, sys
import torch
import deepspeed
from deepspeed.utils import safe_get_full_grad
from txl_dist.config import ModelConfig
from txl_dist.engine import register_borrowed_parameters, skip_shm_comm_build
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import tail_plan

skip_shm_comm_build()  # a fresh machine would JIT-build an op that training never uses
variant = json.loads(sys.argv[1])
planned = variant.pop("tail_plan", False)
cfg = ModelConfig(**{**dict(vocab_size=50, n_layer=2, d_model=32, n_head=2, d_head=8, d_inner=48, cutoffs=[10, 25],
                            div_val=2, untie_r=False, dropout=0.0, init_std=0.3, proj_init_std=0.3), **variant})
torch.manual_seed(0)
model = TransformerXL(cfg).train()
plain = copy.deepcopy(model)
g = torch.Generator().manual_seed(1)
ids, labels = torch.randint(0, 50, (2, 2, 2, 6), generator=g)  # [input/label, segment, B, T]

def two_segments(forward, backward):
    # One backward per segment, as in training (gradient accumulation over the two micro steps).
    # Several segments in ONE backward are not supported under ZeRO-3 with reentrant checkpointing:
    # each recomputed layer would report its parameters' gradients once per segment.
    losses, mems = [], None
    for seg in range(2):
        plan = tail_plan(labels[seg].numpy(), cfg.cutoffs, torch.device("cpu")) if planned else None
        out = forward(ids[seg], labels[seg], mems, tail_plan=plan)
        loss = out.nll.mean()
        backward(loss)
        losses.append(loss.item())
        mems = out.mems
    return losses

# engine.backward divides by the 2 gradient accumulation steps; do the same here.
losses = two_segments(plain, lambda loss: (loss / 2).backward())
expected = {"losses": losses, "grads": {n: p.grad.tolist() for n, p in plain.named_parameters()}}

ds = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
      "steps_per_print": 10**9}
model.set_activation_checkpointing(deepspeed.checkpointing.checkpoint)
register_borrowed_parameters(model)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                  config=dict(ds, zero_allow_untested_optimizer=True))
deepspeed.checkpointing.configure(None, deepspeed_config=ds)
losses = two_segments(engine, engine.backward)
got = {"losses": losses, "grads": {n: safe_get_full_grad(p).tolist() for n, p in model.named_parameters()}}
print("RESULT " + json.dumps({"expected": expected, "got": got}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    {},
    # Vocabulary padding on the one shared table of div_val 1, and the softmax's plan from the host labels.
    {"div_val": 1, "d_embed": 16, "pad_vocab_multiple": 8, "tail_plan": True},
])
def test_zero3_with_deepspeed_checkpointing_gives_plain_torch_gradients(variant):
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(variant)], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    got, expected = result["got"], result["expected"]
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-6)
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        # A parameter not gathered for backward, or a tied/shared gradient lost or doubled, is far off.
        torch.testing.assert_close(torch.tensor(got["grads"][name]), torch.tensor(grad), rtol=1e-5, atol=1e-6,
                                   msg=name)
