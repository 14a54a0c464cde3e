"""Transformer-XL (Dai et al. 2019): a pure torch nn.Module, batch-first, with segment-level recurrence.

```python
from txl_dist.model import TransformerXL, TransformerXLOutput
model = TransformerXL(cfg.model)                 # cfg.model.vocab_size must be an int
out = model(input_ids, labels=None, mems=None, memory=None,  # [B, T] LongTensors, labels already shifted;
            tail_plan=None)                     # memory: MemorySettings (None: the training settings);
                                                # tail_plan: softmax.tail_plan(labels_np, cutoffs, device)
out.nll [B, T] float32 | None;  out.mems: n_layer x [B, min(mem_len, mlen+T), d_model] detached
out.hidden [B, T, d_model];     model.log_probs(hidden) -> [..., vocab_size] float32
model.attn_impl: from cfg.attn_impl ("auto", or a name start-up chose), read at every forward
model.set_activation_checkpointing(checkpoint_fn=None, enabled=True)
model.compile_layers()                          # train.compile: layers compiled in training mode
```

Modules: embedding.py (AdaptiveEmbedding, sinusoid positions), attention.py (mask, rel-shift, the reference
and fast relative attention incl. FlexAttention, the timing that start-up's "auto" uses, the attention
sub-layer), dropout.py (dropout with a cheap CPU mask), layer.py (feed-forward, one layer), softmax.py
(projected adaptive log-softmax), transformer.py (the model). Semantics follow the reference code
(kimiyoung/transformer-xl, which HF TransfoXL 4.37.2 follows). Adaptive-softmax cluster i uses head column
cutoffs[0] + i - 1, as HF 4.37.2's forward does (the original code's unused log_prob path indexes column -i).

State dict (names are stable; interop maps them). C = len(cutoffs), V = vocab_size, E = d_embed,
n_i / E_i = size / embedding width of cluster i (E_i = E // div_val**i), HD = n_head * d_head:

    word_emb.emb_layers.{i}.weight          div_val 1: one [V, E]; div_val > 1: [n_i, E_i] for i in 0..C
    word_emb.emb_projs.{i}                  div_val 1: [d_model, E] only when E != d_model (i = 0);
                                            div_val > 1: [d_model, E_i] for i in 0..C. Applied as x @ proj.T
    r_w_bias, r_r_bias                      [n_head, d_head], only when untie_r is false (shared by layers)
    layers.{l}.attn.r_w_bias / .r_r_bias    [n_head, d_head], only when untie_r is true
    layers.{l}.attn.qkv_net.weight          [3*HD, d_model], rows q | k | v, each head-major (head h: rows
                                            h*d_head .. (h+1)*d_head-1 of its block); no bias
    layers.{l}.attn.r_net.weight            [HD, d_model], no bias
    layers.{l}.attn.o_net.weight            [d_model, HD], no bias
    layers.{l}.attn.layer_norm.weight/bias  [d_model]
    layers.{l}.pos_ff.fc_in.weight / .bias  [d_inner, d_model] / [d_inner]
    layers.{l}.pos_ff.fc_out.weight / .bias [d_model, d_inner] / [d_model]
    layers.{l}.pos_ff.layer_norm.weight/bias [d_model]
    crit.cluster_weight / crit.cluster_bias [C, E] / [C], only when C > 0; row i-1 = cluster i
    crit.out_layers.{i}.weight / .bias      div_val 1: one [V, E] / [V]; div_val > 1: [n_i, E_i] / [n_i]
    crit.out_projs.{i}                      div_val 1: [d_model, E] for i in 0..C, only when E != d_model;
                                            div_val > 1: [d_model, E_i] for i in 0..C. Applied as h @ proj

With pad_vocab_multiple m > 1 some of these are stored with padding rows at their end (never used by
the math; see softmax.py): crit.cluster_weight / cluster_bias have round_up(S + C, m) - S rows; div_val 1:
the one table (and its bias) has round_up(V, m) rows; div_val > 1: each tail table i >= 1 (and its bias and
embedding table) round_up(n_i, m), the head table only when C = 0. interop.weights.padded_rows lists them.

Tying shares the Parameter object, so a tied tensor appears in state_dict() under both names:
tie_weight: crit.out_layers.{i}.weight IS word_emb.emb_layers.{i}.weight (biases are never tied);
tie_projs[i] (default [False] + [True] * C): crit.out_projs.{i} IS word_emb.emb_projs.0 (div_val 1,
E != d_model) or word_emb.emb_projs.{i} (div_val > 1); otherwise no effect. model.parameters() lists each
tensor once; tied_groups(model) lists each tensor's names. There is no position-embedding buffer (HF's
pos_emb.inv_freq): it is recomputed in float32.
"""
from txl_dist.model.transformer import TransformerXL, TransformerXLOutput, tied_groups

__all__ = ["TransformerXL", "TransformerXLOutput", "tied_groups"]
