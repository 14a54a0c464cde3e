"""Dropout whose CPU masks cost a fraction of torch's.

torch's CPU `bernoulli_` draws a Mersenne-Twister number and a double per element, ~5 ns each: dropout's
masks were 13-17% of a CPU training step (docs/performance.md). Here one 64-bit draw of torch's default
generator gives four 16-bit uniforms u; an element is kept when u >= k with k = round(p * 65536), so the drop
probability is k / 65536 (0.1 -> 0.1000061) and kept elements are scaled by 65536 / (65536 - k): the
expectation is exactly preserved. Because the draws come from torch's generator, `torch.manual_seed`, saved
RNG states (exact resume) and activation checkpointing's RNG replay behave as with F.dropout.

F.dropout stays where its mask is cheap or the fast one does not apply: off the CPU (CUDA's kernel is fused),
under torch.compile (inductor has its own RNG), and when p is too small for 16 bits (k / 65536 would be more
than 0.1% away from p: p below ~0.0076).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16
_MAX_RELATIVE_ERROR = 1e-3


def drop_level(p: float) -> int | None:
    """k of the 16-bit mask for drop probability p, or None where 16 bits cannot hold p (F.dropout serves then;
    the fused Triton attention draws 32-bit words instead)."""
    k = round(p * _LEVELS)
    if k <= 0 or k >= _LEVELS or abs(k / _LEVELS - p) > _MAX_RELATIVE_ERROR * p:
        return None
    return k


def _fast_path(x: torch.Tensor, p: float, training: bool) -> int | None:
    if not training or p == 0.0 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return drop_level(p)


def scaled_keep_mask(shape: torch.Size, k: int, dtype: torch.dtype) -> torch.Tensor:
    """65536 / (65536 - k) with probability (65536 - k) / 65536, else 0, per element of `shape` (torch's
    generator). Float in `dtype`: `x * mask` is then one plain multiply forward and backward (a bool mask would
    be converted on every use: 2-3x the time), for 4 (fp32) or 2 (bf16) bytes per element saved for backward
    instead of 1."""
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64)
    words.random_(torch.iinfo(torch.int64).min, None)  # the full 64 bits (random_() alone leaves the sign bit 0)
    mask = torch.empty(shape, dtype=dtype)
    torch.ge(words.view(torch.int16)[:n].view(shape), k - _LEVELS // 2, out=mask)  # 0 / 1, written as dtype
    return mask.mul_(_LEVELS / (_LEVELS - k))


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout(x, p, training), with the cheap CPU mask where it applies."""
    k = _fast_path(x, p, training)
    if k is None:
        return F.dropout(x, p, training)
    return x * scaled_keep_mask(x.shape, k, x.dtype)


class Dropout(nn.Module):
    """nn.Dropout with the cheap CPU mask (`dropout`); no parameters, so state dicts do not change."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p}: use 0 <= p < 1")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
