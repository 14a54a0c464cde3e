"""Parameter counts of the shipped big configs, built on the meta device (nothing is allocated)."""
import json
from pathlib import Path

import pytest
import torch

from txl_dist.config import ModelConfig, config_from_dict
from txl_dist.model import TransformerXL

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def expected_params(m: ModelConfig) -> int:
    """Count from the paper's architecture, written out independently of the model code."""
    d, hd, e, V = m.d_model, m.n_head * m.d_head, m.resolved_d_embed(), m.vocab_size
    ends = [0] + m.cutoffs + [V]
    sizes = [ends[i + 1] - ends[i] for i in range(len(ends) - 1)]
    widths = [e] * len(sizes) if m.div_val == 1 else [e // m.div_val ** i for i in range(len(sizes))]
    n_clusters = len(m.cutoffs)
    tie_projs = m.resolved_tie_projs()
    # Padding (pad_vocab_multiple): stored rows are rounded up: the one table (div_val 1); every tail table
    # (div_val > 1), and the head table when there is no tail; the head's S + C logits through the cluster rows.
    pad = m.pad_vocab_multiple
    def up(n):
        return -(-n // pad) * pad
    V = up(V) if m.div_val == 1 else V
    sizes = [n if i == 0 and n_clusters else up(n) for i, n in enumerate(sizes)]
    cluster_rows = up(sizes[0] + n_clusters) - sizes[0] if n_clusters else 0
    if m.div_val > 1:
        V = sum(sizes)

    # Adaptive input: tables, plus projections to d_model where the width differs (div_val 1) or always.
    if m.div_val == 1:
        emb = V * e + (d * e if e != d else 0)
    else:
        emb = sum(n * w + d * w for n, w in zip(sizes, widths))
    # One layer: q, k, v, r and output projections (no bias), two LayerNorms, the feed-forward with biases,
    # and the layer's own u, v biases when untied.
    layer = 3 * d * hd + d * hd + hd * d + 2 * (2 * d) + (d * m.d_inner + m.d_inner) + (m.d_inner * d + d)
    layer += 2 * hd if m.untie_r else 0
    shared_uv = 0 if m.untie_r else 2 * hd
    # Adaptive softmax: cluster logits in the head; output biases always; output weights unless tied;
    # output projections where they exist and are not tied to an input projection.
    softmax = cluster_rows * e + cluster_rows + V
    if not m.tie_weight:
        softmax += V * e if m.div_val == 1 else sum(n * w for n, w in zip(sizes, widths))
    for i, w in enumerate(widths):
        has_proj = m.div_val > 1 or e != d
        if has_proj and not tie_projs[i]:
            softmax += d * w
    return emb + m.n_layer * layer + shared_uv + softmax


def meta_model(cfg: ModelConfig) -> TransformerXL:
    with torch.device("meta"):
        return TransformerXL(cfg)


@pytest.mark.parametrize("name", ["wt103_base", "large", "wt103_base_aligned", "large_aligned"])
def test_shipped_config_parameter_count(name):
    cfg = config_from_dict(json.loads((CONFIGS / f"{name}.json").read_text())).model
    model = meta_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected_params(cfg)
    if name == "wt103_base":  # Dai et al. 2019, Table 1: the standard WikiText-103 model has 151M
        assert round(expected_params(cfg) / 1e6) == 151


@pytest.mark.parametrize("variant", [
    dict(), dict(untie_r=False), dict(tie_weight=False), dict(tie_projs=[False, False, False, False]),
    dict(div_val=1, d_embed=512), dict(div_val=1, d_embed=512, tie_projs=[True, True, False, True]),
    dict(cutoffs=[], div_val=1, tie_projs=None), dict(pad_vocab_multiple=64), dict(pad_vocab_multiple=8, tie_weight=False),
    dict(div_val=1, d_embed=512, pad_vocab_multiple=64), dict(cutoffs=[], div_val=1, tie_projs=None, pad_vocab_multiple=8)])
def test_parameter_count_formula_across_variants(variant):
    base = dict(vocab_size=267735, n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096,
                d_embed=1024, cutoffs=[20000, 40000, 200000], div_val=4)
    base.update(variant)
    cfg = ModelConfig(**base)
    assert sum(p.numel() for p in meta_model(cfg).parameters()) == expected_params(cfg)
