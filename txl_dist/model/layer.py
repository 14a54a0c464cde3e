"""One Transformer-XL layer: relative multi-head attention, then a position-wise feed-forward network."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch.nn.attention.flex_attention import BlockMask

from txl_dist.model.attention import AttentionFn, RelPartialLearnableMultiHeadAttn
from txl_dist.model.dropout import Dropout


class PositionwiseFF(nn.Module):
    """ReLU feed-forward with dropout, residual and LayerNorm (post-LN, or LN on the input with pre_lnorm)."""

    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool, layer_norm_epsilon: float):
        super().__init__()
        self.pre_lnorm = pre_lnorm
        self.fc_in = nn.Linear(d_model, d_inner)
        self.fc_out = nn.Linear(d_inner, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.drop = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] -> [B, T, d_model]."""
        core = self.layer_norm(x) if self.pre_lnorm else x
        core = self.drop(F.relu(self.fc_in(core)))                                 # [B, T, d_inner]
        core = self.drop(self.fc_out(core))                                        # [B, T, d_model]
        if self.pre_lnorm:
            return x + core
        return self.layer_norm(x + core)


class TransformerXLLayer(nn.Module):
    """attn (RelPartialLearnableMultiHeadAttn) followed by pos_ff (PositionwiseFF)."""

    def __init__(self, d_model: int, n_head: int, d_head: int, d_inner: int, dropout: float, dropatt: float,
                 pre_lnorm: bool, layer_norm_epsilon: float, untie_r: bool):
        super().__init__()
        self.attn = RelPartialLearnableMultiHeadAttn(d_model, n_head, d_head, dropout, dropatt, pre_lnorm,
                                                     layer_norm_epsilon, untie_r)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout, pre_lnorm, layer_norm_epsilon)

    def forward(self, h: torch.Tensor, pos_emb: torch.Tensor, mem: torch.Tensor | None,
                attn_bias: torch.Tensor | BlockMask, attn_fn: AttentionFn,
                r_w_bias: torch.Tensor | None = None, r_r_bias: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, d_model], pos_emb [K, d_model], mem [B, mlen, d_model] or None, attn_bias [T, K] (flex:
        its BlockMask) -> [B, T, d_model]. r_w_bias / r_r_bias: the shared pair when the layer has none of
        its own."""
        h = self.attn(h, pos_emb, mem, attn_bias, attn_fn, r_w_bias, r_r_bias)    # [B, T, d_model]
        return self.pos_ff(h)                                                      # [B, T, d_model]
