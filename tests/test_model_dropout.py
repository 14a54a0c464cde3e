"""txl_dist/model/dropout.py: the cheap CPU dropout mask is dropout (rate, scale, gradient, RNG replay)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from txl_dist.model.dropout import Dropout, dropout

N = 1 << 22


def level(p: float) -> int:
    return round(p * 65536)


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5])
def test_drop_rate_and_expectation(p: float):
    torch.manual_seed(0)
    out = dropout(torch.ones(N), p, True)
    drop_p = level(p) / 65536
    sigma = math.sqrt(drop_p * (1 - drop_p) / N)
    assert abs((out == 0).double().mean().item() - drop_p) < 5 * sigma
    values = out.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(65536 / (65536 - level(p)))
    # the scale keeps the expectation: E[out] = 1
    assert abs(out.double().mean().item() - 1.0) < 5 * sigma / (1 - drop_p)


def test_every_16_bit_lane_is_uniform():
    """Each 64-bit draw feeds 4 consecutive elements: every lane must drop at the same rate (torch's random_()
    without a range leaves the sign bit 0, which would keep every 4th element)."""
    torch.manual_seed(1)
    out = dropout(torch.ones(N), 0.5, True).view(-1, 4)
    sigma = math.sqrt(0.25 / (N // 4))
    for lane in range(4):
        assert abs((out[:, lane] == 0).double().mean().item() - 0.5) < 5 * sigma, lane
    # neighbours independent: both dropped a quarter of the time
    both = ((out[:, 0] == 0) & (out[:, 1] == 0)).double().mean().item()
    assert abs(both - 0.25) < 5 * math.sqrt(0.25 * 0.75 / (N // 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_is_the_same_mask(dtype: torch.dtype):
    torch.manual_seed(2)
    # Drawn in float32: torch 2.11's bf16 randn gives exact zeros (~0.6%), where out != 0 would miss a kept element.
    x = torch.randn(8, 64, 128).to(dtype).requires_grad_()
    assert bool((x != 0).all())
    out = dropout(x, 0.1, True)
    assert out.dtype == dtype
    g = torch.randn_like(out)
    out.backward(g)
    scale = torch.tensor(65536 / (65536 - level(0.1)), dtype=dtype)
    kept = out != 0
    assert torch.equal(out, torch.where(kept, x.detach() * scale, 0))
    assert torch.equal(x.grad, torch.where(kept, g * scale, 0))


def test_masks_follow_torch_generator():
    """Seeding and restoring torch's RNG state replay the masks (exact resume, activation checkpointing)."""
    x = torch.randn(1000)
    torch.manual_seed(3)
    a = dropout(x, 0.1, True)
    state = torch.get_rng_state()
    b = dropout(x, 0.1, True)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.1, True), a)
    torch.set_rng_state(state)
    assert torch.equal(dropout(x, 0.1, True), b)
    assert not torch.equal(a, b)


def test_identity_when_off():
    x = torch.randn(100)
    assert torch.equal(dropout(x, 0.1, False), x)
    assert torch.equal(dropout(x, 0.0, True), x)
    module = Dropout(0.3).eval()
    assert torch.equal(module(x), x)


def test_small_rate_falls_back_to_torch():
    """p = 0.001 is 65.5 / 65536: 16 bits would miss it by 0.8%, so F.dropout draws the mask."""
    x = torch.randn(10000)
    torch.manual_seed(4)
    ours = dropout(x, 0.001, True)
    torch.manual_seed(4)
    assert torch.equal(ours, F.dropout(x, 0.001, True))


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_refuses_bad_rate(p: float):
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(p)
