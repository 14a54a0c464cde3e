"""CUDA paths of the model (marked `gpu`; they run wherever a CUDA device is present, e.g. a GPU CI box).

Each fast attention implementation and both adaptive-softmax tail modes must equal the plain reference on
the GPU as they do on the CPU: fp32 (TF32 off) within 1e-4, bf16 within 2e-2 relative. A training micro
step with a tail plan runs under torch.cuda.set_sync_debug_mode("error"): no host sync at all.
"""
import dataclasses

import numpy as np
import pytest
import torch

from txl_dist.config import ModelConfig
from txl_dist.host_copy import to_device
from txl_dist.model import TransformerXL
from txl_dist.model.softmax import tail_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make_model(**overrides):
    kw = dict(vocab_size=500, n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=128, cutoffs=[100, 300],
              div_val=2, dropout=0.0, dropatt=0.0, tgt_len=16, mem_len=16, init_std=0.1, proj_init_std=0.1)
    kw.update(overrides)
    torch.manual_seed(0)
    return TransformerXL(ModelConfig(**kw)).cuda()


def two_segments(model, ids):
    first = model(ids[:, :16], labels=ids[:, 1:17])
    second = model(ids[:, 16:32], labels=ids[:, 17:33], mems=first.mems)
    return torch.cat([first.nll, second.nll], dim=1)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


TOLERANCES = {torch.float32: dict(rtol=0, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["matmul", "sdpa", "auto"])
@pytest.mark.parametrize("same_length", [False, True])
def test_cuda_attention_equals_reference(impl, same_length, dtype):
    model = make_model(same_length=same_length).eval().to(dtype)
    ids = torch.randint(0, 500, (3, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        model.attn_impl = "reference"
        expected = two_segments(model, ids)
        model.attn_impl = impl
        got = two_segments(model, ids)
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_cuda_dense_and_gather_tails_agree():
    model = make_model().train()
    ids = torch.randint(0, 500, (3, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    results = {}
    for mode in ("dense", "gather"):
        model.crit.tail_mode = mode
        model.zero_grad()
        nll = two_segments(model, ids)
        nll.mean().backward()
        results[mode] = (nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["dense"][0], results["gather"][0], rtol=0, atol=1e-5)
    for name, grad in results["dense"][1].items():
        torch.testing.assert_close(grad, results["gather"][1][name], rtol=1e-4, atol=1e-6)


def test_cuda_training_step_with_a_tail_plan_never_syncs():
    # What train_step does per micro batch: pinned non-blocking copies of the host batch, the tail plan
    # from the host labels, forward over a memory, backward. None of it may wait for the device.
    model = make_model().train()
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, 500, size=(3, 17)) for _ in range(3)]
    device = torch.device("cuda")

    def micro_step(tokens, mems):
        ids = to_device(np.ascontiguousarray(tokens[:, :-1]), device)  # [3, 16]
        labels_np = np.ascontiguousarray(tokens[:, 1:])
        labels = to_device(labels_np, device)  # [3, 16]
        out = model(ids, labels=labels, mems=mems, tail_plan=tail_plan(labels_np, model.config.cutoffs, device))
        out.nll.mean().backward()
        return out.mems

    mems = micro_step(batches[0], None)  # warm-up: lazy CUDA/cuBLAS initialization may synchronize
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for tokens in batches[1:]:
            mems = micro_step(tokens, mems)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_padded_model_gives_the_unpadded_numbers(dtype):
    model = make_model().eval()
    padded = TransformerXL(dataclasses.replace(model.config, pad_vocab_multiple=64)).cuda().eval()
    with torch.no_grad():
        for a, b in zip(model.parameters(), padded.parameters()):
            b.fill_(3.0)
            b[:a.shape[0]] = a
    model, padded = model.to(dtype), padded.to(dtype)
    ids = torch.randint(0, 500, (3, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(two_segments(padded, ids), two_segments(model, ids), **TOLERANCES[dtype])
