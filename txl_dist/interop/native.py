"""Our own model folder: `model_config.json` (ModelConfig as JSON) + `model.safetensors` (our state_dict).

This is what `from-hf` writes and `to-hf` reads. Tied weights are stored once (safetensors' save_model
drops the duplicates of shared tensors and load_model restores them), in the dtype the model had.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from txl_dist.atomic import atomic_path, atomic_write
from txl_dist.config import ConfigError, ModelConfig, model_config_from_dict, read_json_object
from txl_dist.errors import one_line
from txl_dist.model import TransformerXL

MODEL_CONFIG_NAME = "model_config.json"
WEIGHTS_NAME = "model.safetensors"


def read_model_config(src_dir: str | Path) -> ModelConfig:
    """The validated ModelConfig of a native folder."""
    path = Path(src_dir) / MODEL_CONFIG_NAME
    raw = read_json_object(path, missing_hint="; pass a folder written by save_native or "
                                              "`python -m txl_dist.interop from-hf`")
    cfg = model_config_from_dict(raw)
    if cfg.vocab_size is None:
        raise ConfigError(f"{path}: model.vocab_size is null; a saved model needs its vocabulary size")
    return cfg


def save_native(model: TransformerXL, out_dir: str | Path) -> Path:
    """Write model_config.json + model.safetensors of `model` into out_dir (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_model(model, str(tmp), metadata={"format": "pt"})
    atomic_write(out / MODEL_CONFIG_NAME, json.dumps(dataclasses.asdict(model.config), indent=2) + "\n")
    return out


def load_native(src_dir: str | Path) -> TransformerXL:
    """Rebuild a TransformerXL from a native folder: eval mode, on the CPU, float32 (other saved dtypes are cast)."""
    src = Path(src_dir)
    cfg = read_model_config(src)
    if not (src / WEIGHTS_NAME).is_file():
        raise ConfigError(f"{src / WEIGHTS_NAME} does not exist; the folder needs its weights next to "
                          f"{MODEL_CONFIG_NAME}")
    model = TransformerXL(cfg)
    try:
        missing, unexpected = load_model(model, str(src / WEIGHTS_NAME), strict=False)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{src / WEIGHTS_NAME}: cannot read the weights ({one_line(e, limit=200)}); the file is "
                          "truncated or damaged: write it again (launch/export.py, or from-hf)") from None
    if missing or unexpected:
        raise ConfigError(
            f"{src / WEIGHTS_NAME} does not fit {MODEL_CONFIG_NAME}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}")
    return model.eval()
