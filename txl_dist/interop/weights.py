"""Tensor names and tying between our TransformerXL and HF's TransfoXLLMHeadModel (transformers 4.37.2).

Both follow the Transformer-XL reference code, so every tensor maps one to one with the same layout
(projections are [d_model, d_emb_i] on both sides; the adaptive softmax's cluster rows are in the same,
natural order: HF's forward uses head column cutoffs[0] + i - 1 for cluster i, as we do). Only names differ:

    ours                                 HF
    word_emb.*                           transformer.word_emb.*
    layers.L.attn.*                      transformer.layers.L.dec_attn.*
    layers.L.pos_ff.fc_in / fc_out       transformer.layers.L.pos_ff.CoreNet.0 / CoreNet.3
    layers.L.pos_ff.layer_norm           transformer.layers.L.pos_ff.layer_norm
    r_w_bias, r_r_bias (untie_r false)   transformer.r_w_bias, transformer.r_r_bias
    crit.*                               crit.*
    (computed on the fly)                transformer.pos_emb.inv_freq (a saved buffer)

Tied tensors (tie_weight, tie_projs, the shared r biases) are one Parameter in our model. HF's
save_pretrained keeps one copy in safetensors and every copy in pytorch_model.bin; we read either (the
copies must agree) and write one, as save_pretrained does.

A model with model.pad_vocab_multiple > 1 stores some vocabulary tables with padding rows at their end
(padded_rows); HF holds the real rows only, so the export cuts the padding off and the import appends
zero rows (they never carry probability or are looked up, whatever their values).
"""
from __future__ import annotations

import re

import torch

from txl_dist.interop.hf_files import HFFormatError
from txl_dist.model import TransformerXL, tied_groups

INV_FREQ = "transformer.pos_emb.inv_freq"

# (our pattern, HF replacement) and the inverse; applied first match wins.
_OURS_TO_HF = [
    (r"^word_emb\.", "transformer.word_emb."),
    (r"^layers\.(\d+)\.attn\.", r"transformer.layers.\1.dec_attn."),
    (r"^layers\.(\d+)\.pos_ff\.fc_in\.", r"transformer.layers.\1.pos_ff.CoreNet.0."),
    (r"^layers\.(\d+)\.pos_ff\.fc_out\.", r"transformer.layers.\1.pos_ff.CoreNet.3."),
    (r"^layers\.(\d+)\.pos_ff\.layer_norm\.", r"transformer.layers.\1.pos_ff.layer_norm."),
    (r"^(r_w_bias|r_r_bias)$", r"transformer.\1"),
    (r"^crit\.", "crit."),
]


def hf_name(ours: str) -> str:
    """The HF state-dict name of one of our tensor names."""
    for pattern, repl in _OURS_TO_HF:
        name, n = re.subn(pattern, repl, ours)
        if n:
            return name
    raise KeyError(f"no HF name for model tensor {ours!r}; txl_dist/interop/weights.py needs a rule for it")


def inv_freq(d_model: int) -> torch.Tensor:
    """HF's PositionalEmbedding buffer (saved with the weights): 1 / 10000 ** (arange(0, d, 2) / d), [d/2]."""
    return 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model))


def _hf_aliases(model: TransformerXL, group: list[str]) -> list[str]:
    """Every HF name that holds this group's tensor, the one save_pretrained keeps first."""
    names = [hf_name(n) for n in group]
    if group[0] in ("r_w_bias", "r_r_bias"):  # untie_r false: HF's layers all point at the shared pair
        names += [f"transformer.layers.{i}.dec_attn.{group[0]}" for i in range(model.n_layer)]
    return names


def padded_rows(model: TransformerXL) -> dict[str, int]:
    """Our state-dict names of the tensors stored with padding rows (pad_vocab_multiple) -> real row count."""
    rows = {f"crit.{name}": n for name, n in model.crit.padded_rows().items()}
    rows.update({f"word_emb.{name}": n for name, n in model.word_emb.padded_rows().items()})
    return rows


def hf_state_dict(model: TransformerXL) -> dict[str, torch.Tensor]:
    """Our model's tensors under HF names, each tied tensor once (as save_pretrained writes safetensors),
    without padding rows."""
    state = model.state_dict()
    rows = padded_rows(model)
    out = {}
    for group in tied_groups(model):
        tensor = state[group[0]]
        out[hf_name(group[0])] = tensor[:rows[group[0]]].clone() if group[0] in rows else tensor
    out[INV_FREQ] = inv_freq(model.d_model)
    return out


def check_shape(source: str, name: str, shape, want, config_name: str = "config.json",
                error: type[Exception] = HFFormatError) -> None:
    """Refuse (one line, `error`) a stored tensor whose shape is not the one its config implies: the config was
    edited, or the weights come from another model. Used for HF folders and for our native folders alike, so
    that a mismatch is refused before torch's load_state_dict turns it into a traceback."""
    if tuple(shape) != tuple(want):
        raise error(f"{source}: tensor {name} has shape {tuple(shape)} but {config_name} implies {tuple(want)}; "
                    "the weights do not belong to this config")


def load_hf_state_dict(model: TransformerXL, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy HF-named tensors into `model` (built from the matching config); strict about names and shapes.

    A tied tensor may come as any subset of its HF copies (at least one); copies that disagree are refused.
    """
    ours = model.state_dict()
    rows = padded_rows(model)
    loaded: dict[str, torch.Tensor] = {}
    used = {INV_FREQ}
    missing = []
    for group in tied_groups(model):
        aliases = _hf_aliases(model, group)
        used.update(aliases)
        present = [a for a in aliases if a in tensors]
        if not present:
            missing.append(aliases[0])
            continue
        value = tensors[present[0]]
        stored = ours[group[0]].shape
        want = (rows[group[0]], *stored[1:]) if group[0] in rows else tuple(stored)
        for a in present:
            check_shape(source, a, tensors[a].shape, want)
            if not torch.equal(tensors[a], value):
                raise HFFormatError(
                    f"{source}: tensor {a} differs from {present[0]} although config.json says they are tied "
                    "(tie_word_embeddings / tie_projs / untie_r); fix the config or the weights")
        if group[0] in rows:
            value = torch.cat([value, value.new_zeros(stored[0] - value.shape[0], *stored[1:])])
        for name in group:
            loaded[name] = value
    if missing:
        raise HFFormatError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                            f"({len(missing)} in all) that config.json implies")
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise HFFormatError(f"{source}: unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
                            f"({len(unexpected)} in all) that config.json does not imply")
    model.load_state_dict(loaded, strict=True)
