"""Model FLOPs of a Transformer-XL training step, counted from the configuration (the benchmark's own count).

Used by the benchmarks when txl_dist.flops (the product's count, with the per-device peak table) is not
there; `model_flops_per_token` is named apart from it so that a reader of a result knows which one ran.

Conventions (those of MFU, PaLM appendix B): matmul FLOPs only (2 per multiply-add), training = 3x forward
(backward is two matmuls per forward matmul), activation-checkpointing recompute NOT counted. Attention is
counted over klen = tgt_len + mem_len keys per query (the content, position and value products); the keys,
values and positions are projected for all klen positions of each segment, so their cost per predicted
token is scaled by klen / tgt_len. The adaptive softmax is counted as computed: every token through the
head (shortlist + one logit per tail cluster), and cluster i's tail only for the share of tokens in it
(the "gather" tail mode; pass no shares for "dense"). With div_val > 1 the adaptive input projects every
token through every cluster's projection (as txl_dist/model/embedding.py does).
"""
from __future__ import annotations

from typing import Sequence

from txl_dist.config import ModelConfig


def cluster_shares(labels: Sequence[int] | "object", vocab_size: int, cutoffs: Sequence[int]) -> list[float]:
    """Share of the labels falling in each tail cluster (len(cutoffs) values), from a label tensor or list."""
    import torch

    labels = torch.as_tensor(labels).reshape(-1)
    ends = list(cutoffs) + [vocab_size]
    return [float(((labels >= lo) & (labels < hi)).float().mean()) for lo, hi in zip(ends, ends[1:])]


def model_flops_per_token(cfg: ModelConfig, *, tgt_len: int | None = None, mem_len: int | None = None,
                          tail_shares: Sequence[float] | None = None, batch: int = 1,
                          training: bool = True) -> float:
    """FLOPs per predicted token (see the module docstring).

    tgt_len, mem_len: the segment and memory lengths (default: the config's). tail_shares: share of tokens
    in each tail cluster (cluster_shares); None counts every tail for every token (the dense upper bound).
    batch: sequences per forward (the position projection is shared by the batch). training: 3x forward.
    """
    tgt = cfg.tgt_len if tgt_len is None else tgt_len
    mem = cfg.mem_len if mem_len is None else mem_len
    klen = tgt + mem
    d, hd = cfg.d_model, cfg.n_head * cfg.d_head
    kv_scale = klen / tgt
    per_layer = (2 * d * hd                          # q
                 + 2 * d * 2 * hd * kv_scale         # k, v over memory + segment
                 + 2 * d * hd * klen / (tgt * batch)  # r_net over klen distances, once per batch
                 + 3 * 2 * hd * klen                 # content scores, position scores, probs @ v
                 + 2 * hd * d                        # o_net
                 + 2 * 2 * d * cfg.d_inner)          # feed-forward
    forward = cfg.n_layer * per_layer + _softmax_flops(cfg, tail_shares) + _embedding_flops(cfg)
    return (3.0 if training else 1.0) * forward


def _cluster_widths(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(rows, embedding width) of each adaptive cluster, head first."""
    d_embed = cfg.resolved_d_embed()
    ends = [0] + list(cfg.cutoffs) + [cfg.vocab_size]
    widths = []
    for i, (lo, hi) in enumerate(zip(ends, ends[1:])):
        width = d_embed if cfg.div_val == 1 else d_embed // cfg.div_val ** i
        widths.append((hi - lo, width))
    return widths


def _softmax_flops(cfg: ModelConfig, tail_shares: Sequence[float] | None) -> float:
    widths = _cluster_widths(cfg)
    n_tail = len(widths) - 1
    shares = [1.0] * n_tail if tail_shares is None else list(tail_shares)
    projected = cfg.div_val > 1 or cfg.resolved_d_embed() != cfg.d_model
    rows0, width0 = widths[0]
    flops = 2 * width0 * (rows0 + n_tail) + (2 * cfg.d_model * width0 if projected else 0)
    for (rows, width), share in zip(widths[1:], shares):
        flops += share * (2 * width * rows + (2 * cfg.d_model * width if projected else 0))
    return flops


def _embedding_flops(cfg: ModelConfig) -> float:
    """The input projections (the lookups themselves are free). With div_val > 1 every cluster embeds and
    projects every token (txl_dist/model/embedding.py: no host sync), so all of them count."""
    if cfg.div_val == 1:
        return 2 * cfg.d_model * cfg.resolved_d_embed() if cfg.resolved_d_embed() != cfg.d_model else 0.0
    return sum(2 * cfg.d_model * width for _, width in _cluster_widths(cfg))
