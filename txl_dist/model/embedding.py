"""Input side of Transformer-XL: adaptive word embeddings and sinusoid relative position embeddings."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from txl_dist.model.softmax import padded_table_rows


class AdaptiveEmbedding(nn.Module):
    """Adaptive input embeddings (Baevski & Auli 2019) as in the Transformer-XL reference code.

    div_val == 1: one table [vocab_size, d_embed], projected to d_model only when d_embed != d_model.
    div_val > 1: cluster i (tokens cutoff_ends[i] .. cutoff_ends[i+1]-1) has a table of width
    d_embed // div_val**i and its own projection to d_model. The output is scaled by sqrt(d_model).
    pad_multiple > 1: the tables have the adaptive softmax's padded shapes (padded_table_rows), so that
    tie_weight can share them; a padded row is never looked up.
    """

    def __init__(self, vocab_size: int, d_embed: int, d_model: int, cutoffs: list[int], div_val: int,
                 pad_multiple: int = 1):
        super().__init__()
        self.vocab_size = vocab_size
        self.d_embed = d_embed
        self.d_model = d_model
        self.div_val = div_val
        self.cutoff_ends = [0] + list(cutoffs) + [vocab_size]
        self.emb_scale = d_model ** 0.5
        # Stored row counts as ints: a partitioned parameter (ZeRO-3) does not show its shape.
        self.table_rows = table_rows = padded_table_rows(vocab_size, cutoffs, div_val, pad_multiple)
        self.emb_layers = nn.ModuleList()
        # A projection is stored as [d_model, d_emb_i] and applied as F.linear (x @ proj.T), so the adaptive
        # softmax can share the very same tensor and apply it transposed (hidden @ proj).
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(table_rows[0], d_embed))
            if d_model != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_model, d_embed)))
        else:
            for i in range(len(self.cutoff_ends) - 1):
                d_emb_i = d_embed // div_val ** i
                self.emb_layers.append(nn.Embedding(table_rows[i], d_emb_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_model, d_emb_i)))

    def borrowed_parameters(self) -> list[nn.Parameter]:
        """The submodules' parameters that forward reads itself: the projections (emb_projs, a ParameterList
        that is never called; the tables are called). See ProjectedAdaptiveLogSoftmax.borrowed_parameters."""
        return list(self.emb_projs)

    def padded_rows(self) -> dict[str, int]:
        """State-dict names (relative to this module) of the tables stored padded -> their real row count."""
        sizes = [self.vocab_size] if self.div_val == 1 else [self.cutoff_ends[i + 1] - self.cutoff_ends[i]
                                                             for i in range(len(self.cutoff_ends) - 1)]
        return {f"emb_layers.{i}.weight": size for i, size in enumerate(sizes)
                if self.table_rows[i] != size}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> scaled embeddings [..., d_model]."""
        if self.div_val == 1:
            embed = self.emb_layers[0](input_ids)                                  # [..., d_embed]
            if len(self.emb_projs):
                embed = F.linear(embed, self.emb_projs[0])                         # [..., d_model]
            return embed * self.emb_scale
        # Every cluster embeds every token (ids clamped into its range) and a select keeps the right one.
        # This is sync-free (no nonzero() per cluster as in the reference code) and cheap: the projections
        # together cost at most div_val / (div_val - 1) times the head cluster's projection.
        embed = None
        for i, (emb_layer, proj) in enumerate(zip(self.emb_layers, self.emb_projs)):
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            local_ids = (input_ids - lo).clamp(0, hi - lo - 1)                     # [...]
            embed_i = F.linear(emb_layer(local_ids), proj)                         # [..., d_model]
            if embed is None:
                embed = torch.zeros_like(embed_i)                                  # [..., d_model]
            in_cluster = ((input_ids >= lo) & (input_ids < hi)).unsqueeze(-1)     # [..., 1]
            embed = torch.where(in_cluster, embed_i, embed)                        # [..., d_model]
        return embed * self.emb_scale


def sinusoid_position_embedding(klen: int, d_model: int, clamp_len: int, device: torch.device,
                                dtype: torch.dtype) -> torch.Tensor:
    """Relative position embeddings for distances klen-1 .. 0 (clamped at clamp_len when > 0): [klen, d_model].

    Computed in float32 and cast at the end: positions above 256 are not representable in bfloat16, so the
    reference code's arange in the compute dtype would blur long distances under bf16.
    """
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, device=device, dtype=torch.float32) / d_model))
    pos_seq = torch.arange(klen - 1, -1, -1, device=device, dtype=torch.float32)   # [klen]
    if clamp_len > 0:
        pos_seq = pos_seq.clamp(max=clamp_len)
    sinusoid = torch.outer(pos_seq, inv_freq)                                      # [klen, d_model/2]
    return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1).to(dtype)         # [klen, d_model]
