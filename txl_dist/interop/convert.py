"""from_hf / to_hf: a HuggingFace TransfoXLLMHeadModel folder <-> our TransformerXL, without transformers."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from txl_dist.config import validate_model
from txl_dist.interop.hf_config import hf_config_from_model_config, model_config_from_hf
from txl_dist.interop.hf_files import read_hf_config, read_hf_weights, write_hf_folder
from txl_dist.interop.weights import hf_state_dict, load_hf_state_dict
from txl_dist.model import TransformerXL


def from_hf(src_dir: str | Path, pad_vocab_multiple: int = 1) -> TransformerXL:
    """Build our TransformerXL from a save_pretrained folder of TransfoXLLMHeadModel (transformers 4.37.2).

    Reads config.json and model.safetensors / pytorch_model.bin (or their sharded forms). The model comes
    back on the CPU in float32 and in eval mode, like from_pretrained. Unsupported settings and weights that
    do not fit the config raise one-line errors. pad_vocab_multiple: our model.pad_vocab_multiple for the
    model built (its padding rows are zeros; HF has none).
    """
    src = Path(src_dir)
    cfg = dataclasses.replace(model_config_from_hf(read_hf_config(src)), pad_vocab_multiple=pad_vocab_multiple)
    validate_model(cfg)
    tensors = read_hf_weights(src)
    model = TransformerXL(cfg)
    load_hf_state_dict(model, tensors, str(src))
    return model.eval()


def to_hf(model: TransformerXL, out_dir: str | Path, extra_config: Mapping[str, Any] | None = None) -> Path:
    """Write `model` as a folder TransfoXLLMHeadModel.from_pretrained (transformers 4.37.2) loads as is.

    Writes config.json (from model.config, the architecture it was built with; runtime changes of
    mem_len / clamp_len / same_length are not exported) and model.safetensors (float32, tied tensors once).
    `extra_config` adds plain HF config keys, e.g. {"eos_token_id": ...}. Returns out_dir.
    """
    config = hf_config_from_model_config(model.config, extra_config)
    return write_hf_folder(out_dir, config, hf_state_dict(model))

