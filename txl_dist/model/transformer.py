"""TransformerXL: the whole language model, batch-first, with segment-level recurrence through mems."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn

from txl_dist.config import MemorySettings, ModelConfig, validate_model
from txl_dist.model.attention import ATTN_IMPLS, attn_mask_for, resolve_attn_impl
from txl_dist.model.dropout import Dropout
from txl_dist.model.embedding import AdaptiveEmbedding, sinusoid_position_embedding
from txl_dist.model.layer import TransformerXLLayer
from txl_dist.model.softmax import ProjectedAdaptiveLogSoftmax, TailPlan

CheckpointFn = Callable[..., torch.Tensor]


def tied_groups(module: nn.Module) -> list[list[str]]:
    """The module's state-dict names grouped by the tensor they hold, in state-dict order: a tied Parameter
    has several names (crit.out_layers.0.weight is word_emb.emb_layers.0.weight under tie_weight), a buffer is
    a group of its own."""
    by_param: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    group_of = {name: names for names in by_param.values() for name in names}
    groups, seen = [], set()
    for name in module.state_dict():
        group = group_of.get(name, [name])
        if group[0] not in seen:
            seen.add(group[0])
            groups.append(group)
    return groups


class TransformerXLOutput(NamedTuple):
    """What one forward returns (all batch-first).

    A NamedTuple (not a dataclass) because DeepSpeed's ZeRO-3 hooks only look into tuples, lists and dicts
    of outputs: they must see these tensors to gather the model's own parameters again for backward.
    """

    nll: torch.Tensor | None
    """float32 [batch, tgt_len] per-token negative log-likelihood; None when no labels were given."""
    mems: list[torch.Tensor]
    """n_layer tensors [batch, min(mem_len, mlen + tgt_len), d_model], detached, in the compute dtype."""
    hidden: torch.Tensor
    """[batch, tgt_len, d_model] final hidden states (after the last dropout), input of log_probs."""


class TransformerXL(nn.Module):
    """Transformer-XL language model (Dai et al. 2019) with adaptive input and adaptive softmax.

    The memory settings (mem_len, clamp_len, same_length) come with each forward (`memory=`; the config's
    training values when left out); the attention implementation is `attn_impl`, the config's value or the
    concrete name start-up measured for "auto" ("auto" left as it is resolves statically: see
    resolved_attn_impl). The module tree is documented in txl_dist/model/__init__.py.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg.vocab_size, int) or isinstance(cfg.vocab_size, bool):
            raise ValueError(f"model.vocab_size is {cfg.vocab_size!r}: set it to the tokenizer's vocabulary size "
                             "(e.g. from the corpus manifest) before building TransformerXL")
        validate_model(cfg)
        if cfg.d_model % 2:
            raise ValueError(f"model.d_model: {cfg.d_model} must be even (sinusoid position embeddings pair "
                             "sin and cos); use an even d_model")
        self.config = cfg
        d_embed = cfg.resolved_d_embed()
        self.n_layer = cfg.n_layer
        self.d_model = cfg.d_model
        self.vocab_size = cfg.vocab_size
        self.memory = cfg.memory()
        """The training memory settings: what a forward without `memory=` uses."""
        self.attn_impl = cfg.attn_impl
        self._checkpoint_fn: CheckpointFn | None = None
        self._compiled_layers: list[Callable[..., torch.Tensor]] | None = None  # a plain list: not submodules

        self.word_emb = AdaptiveEmbedding(cfg.vocab_size, d_embed, cfg.d_model, cfg.cutoffs, cfg.div_val,
                                          cfg.pad_vocab_multiple)
        self.drop = Dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            TransformerXLLayer(cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner, cfg.dropout, cfg.dropatt,
                               cfg.pre_lnorm, cfg.layer_norm_epsilon, cfg.untie_r)
            for _ in range(cfg.n_layer))
        if cfg.untie_r:
            self.r_w_bias = self.r_r_bias = None
        else:
            self.r_w_bias = nn.Parameter(torch.empty(cfg.n_head, cfg.d_head))
            self.r_r_bias = nn.Parameter(torch.empty(cfg.n_head, cfg.d_head))
        self.crit = ProjectedAdaptiveLogSoftmax(cfg.vocab_size, d_embed, cfg.d_model, cfg.cutoffs, cfg.div_val,
                                                cfg.pad_vocab_multiple)
        self._tie(cfg)
        self.reset_parameters()

    def _tie(self, cfg: ModelConfig) -> None:
        """Share output layers / projections with the input embedding, as the reference code does."""
        if cfg.tie_weight:
            for out_layer, emb_layer in zip(self.crit.out_layers, self.word_emb.emb_layers):
                out_layer.weight = emb_layer.weight
        for i, tie_proj in enumerate(cfg.resolved_tie_projs()):
            if not tie_proj:
                continue
            if cfg.div_val == 1 and cfg.d_model != cfg.resolved_d_embed():
                self.crit.out_projs[i] = self.word_emb.emb_projs[0]
            elif cfg.div_val > 1:
                self.crit.out_projs[i] = self.word_emb.emb_projs[i]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference code's initialization, drawn from torch's global RNG (seed it first)."""
        std, proj_std = self.config.init_std, self.config.proj_init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, std)
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("r_w_bias", "r_r_bias", "cluster_weight"):
                nn.init.normal_(param, 0.0, std)
            elif leaf == "cluster_bias":
                nn.init.zeros_(param)
            elif ".emb_projs." in name or ".out_projs." in name:
                nn.init.normal_(param, 0.0, proj_std)

    # ------------------------------------------------------------------------------------------------

    def set_activation_checkpointing(self, checkpoint_fn: CheckpointFn | None = None, enabled: bool = True) -> None:
        """Recompute each layer in backward instead of keeping its activations.

        checkpoint_fn(function, *args) -> output, e.g. deepspeed.checkpointing.checkpoint; None: torch's
        non-reentrant torch.utils.checkpoint.checkpoint. enabled=False turns checkpointing off.
        """
        if not enabled:
            self._checkpoint_fn = None
        elif checkpoint_fn is None:
            self._checkpoint_fn = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        else:
            self._checkpoint_fn = checkpoint_fn

    def compile_layers(self, **compile_kwargs) -> None:
        """Run each layer through torch.compile in training mode (train.compile), with static shapes.

        A training run has two layer shapes, the first segment (no memory) and every later one (full
        memory, as mem_len <= tgt_len in every preset; a longer memory adds one shape per segment until it
        is full), so each compiles once and no step recompiles; the layers share one graph per shape
        (their code is one, parameters are graph inputs). Evaluation and generation (eval mode) run the
        layers eagerly: their memory grows segment by segment to eval.mem_len, a new shape each time. The
        compiled wrappers are kept outside the module tree, so parameter names and the state dict do not
        change. compile_kwargs go to torch.compile (backend, mode). Activation checkpointing composes
        through torch's non-reentrant checkpoint (set_activation_checkpointing(None)).
        """
        compile_kwargs.setdefault("dynamic", False)
        self._compiled_layers = [torch.compile(layer, **compile_kwargs) for layer in self.layers]

    def resolved_attn_impl(self) -> str:
        """The attention implementation a forward uses now (for the parameters' device and dtype)."""
        weight = self.word_emb.emb_layers[0].weight
        return resolve_attn_impl(self.attn_impl, weight.device, weight.dtype)

    # ------------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                mems: list[torch.Tensor] | None = None, *,
                memory: MemorySettings | None = None, tail_plan: TailPlan | None = None,
                attn_impl: str | None = None) -> TransformerXLOutput:
        """input_ids, labels: [batch, tgt_len] (labels already shifted: labels[b, t] follows input_ids[b, t]);
        mems: None (empty memory) or n_layer tensors [batch, mlen, d_model]; memory: how long the memory is
        and how it is attended (None: the config's training settings); tail_plan: the labels' TailPlan made on
        the host (txl_dist.model.softmax.tail_plan), which spares the adaptive softmax its host sync;
        attn_impl: the attention implementation of this forward (None: the model's `attn_impl`)."""
        memory = self.memory if memory is None else memory
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tgt_len], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)} (pass the already shifted next tokens)")
        if memory.same_length and memory.mem_len == 0:
            raise ValueError("same_length with mem_len 0 masks every key (the reference code yields NaN); "
                             "set mem_len >= 1 or same_length false")
        bsz, qlen = input_ids.shape
        word_emb = self.word_emb(input_ids)                                        # [B, T, d_model]
        mems = self._check_mems(mems, bsz, word_emb.dtype)
        mlen = mems[0].shape[1] if mems else 0
        klen = mlen + qlen
        device = word_emb.device

        # Built once per forward, shared by every layer (flex: its cached BlockMask, triton: a KeyPattern).
        impl = resolve_attn_impl(self.attn_impl if attn_impl is None else attn_impl, device, word_emb.dtype)
        attn_fn = ATTN_IMPLS[impl]
        attn_bias = attn_mask_for(impl, qlen, mlen, memory.mem_len, memory.same_length, device, word_emb.dtype)
        pos_emb = sinusoid_position_embedding(klen, self.d_model, memory.clamp_len, device,
                                              word_emb.dtype)                      # [K, d_model]

        h = self.drop(word_emb)                                                    # [B, T, d_model]
        pos_emb = self.drop(pos_emb)                                               # [K, d_model]
        hids = [h]
        checkpoint_fn = self._checkpoint_fn if torch.is_grad_enabled() else None
        layers = self._compiled_layers if self._compiled_layers is not None and self.training else self.layers
        for i, layer in enumerate(layers):
            mem = mems[i] if mems else None
            args = (h, pos_emb, mem, attn_bias, attn_fn, self.r_w_bias, self.r_r_bias)
            h = layer(*args) if checkpoint_fn is None else checkpoint_fn(layer, *args)  # [B, T, d_model]
            if i < self.n_layer - 1:
                hids.append(h)
        h = self.drop(h)                                                           # [B, T, d_model]
        new_mems = self._update_mems(hids, mems, memory.mem_len)

        nll = None
        if labels is not None:
            nll = self.crit(h.reshape(bsz * qlen, self.d_model), labels.reshape(-1), tail_plan).view(bsz, qlen)
        return TransformerXLOutput(nll=nll, mems=new_mems, hidden=h)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d_model] -> float32 normalized log-probabilities [..., vocab_size]."""
        lead = hidden.shape[:-1]
        return self.crit.log_probs(hidden.reshape(-1, hidden.shape[-1])).view(*lead, self.vocab_size)

    # ------------------------------------------------------------------------------------------------

    def _check_mems(self, mems: list[torch.Tensor] | None, bsz: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        if mems is None:
            return None
        if len(mems) != self.n_layer:
            raise ValueError(f"mems: expected {self.n_layer} tensors (one per layer), got {len(mems)}; pass "
                             "out.mems of the previous segment, or None for an empty memory")
        mlen = mems[0].shape[1] if mems[0].dim() == 3 else -1
        for i, mem in enumerate(mems):
            if mem.dim() != 3 or mem.shape[0] != bsz or mem.shape[1] != mlen or mem.shape[2] != self.d_model:
                raise ValueError(f"mems[{i}] has shape {tuple(mem.shape)}; every mem must be "
                                 f"[batch={bsz}, mlen, d_model={self.d_model}] with one mlen for all layers")
        # Mems are activations: follow the compute dtype (e.g. fp32 mems fed to a bf16 model).
        return [mem.to(dtype) for mem in mems]

    def _update_mems(self, hids: list[torch.Tensor], mems: list[torch.Tensor] | None,
                     mem_len: int) -> list[torch.Tensor]:
        """new_mems[l] = the last min(mem_len, mlen + qlen) positions of [mems[l], hids[l]], detached."""
        with torch.no_grad():
            new_mems = []
            for i, hid in enumerate(hids):
                cat = hid if not mems else torch.cat([mems[i], hid], dim=1)       # [B, mlen + T, d_model]
                keep = min(mem_len, cat.shape[1])
                mem = cat[:, cat.shape[1] - keep:].detach()                        # [B, keep, d_model]
                # Own storage: a fresh cat is compacted; a bare layer output is copied so mems never
                # alias tensors that autograd saved (and do not keep the whole segment alive).
                new_mems.append(mem.contiguous() if mems else mem.clone())
        return new_mems
