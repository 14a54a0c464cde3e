"""Our own model folder: `model_config.json` (ModelConfig as JSON) + `model.safetensors` (our state_dict).

This is what `from-hf` writes and `to-hf` reads. Tied weights are stored once (safetensors' save_model
drops the duplicates of shared tensors and load_model restores them), in the dtype the model had.

model_config.json may also hold `tokenizer_sha256`, the sha256 of the SentencePiece model the weights were
trained with (launch/export.py records the checkpoint's): launch/generate.py --model checks the tokenizer it
is given or finds against it. A folder without it (an older export, from-hf) loads as before.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from txl_dist.atomic import atomic_path, atomic_write
from txl_dist.config import ConfigError, ModelConfig, model_config_from_dict, read_json_object
from txl_dist.errors import one_line
from txl_dist.interop.hf_files import CONFIG_NAME, read_hf_config
from txl_dist.model import TransformerXL

MODEL_CONFIG_NAME = "model_config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_SHA256_KEY = "tokenizer_sha256"
"""The key (in model_config.json, and in an exported HuggingFace config.json) of the tokenizer's sha256."""


def check_tokenizer_sha256(value: object, where: str | Path) -> str | None:
    """A recorded tokenizer digest (64 lowercase hex digits) or None when absent; ConfigError otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ConfigError(f"{where}: {TOKENIZER_SHA256_KEY} must be a sha256 (64 hex digits), got {value!r}; the "
                          "file is damaged: export the model again")
    return value


def _read_raw(src_dir: str | Path) -> tuple[Path, dict]:
    path = Path(src_dir) / MODEL_CONFIG_NAME
    return path, read_json_object(path, missing_hint="; pass a folder written by save_native or "
                                                     "`python -m txl_dist.interop from-hf`")


def read_tokenizer_sha256(src_dir: str | Path) -> str | None:
    """The sha256 of the tokenizer a native folder's weights were trained with, None where not recorded."""
    path, raw = _read_raw(src_dir)
    return check_tokenizer_sha256(raw.get(TOKENIZER_SHA256_KEY), path)


def recorded_tokenizer_sha256(src_dir: str | Path) -> str | None:
    """The tokenizer digest a model folder records: a native folder's model_config.json, else a HuggingFace
    folder's config.json (launch/export.py --hf writes it there too); None where none is recorded."""
    src = Path(src_dir)
    if (src / MODEL_CONFIG_NAME).is_file():
        return read_tokenizer_sha256(src)
    return check_tokenizer_sha256(read_hf_config(src).get(TOKENIZER_SHA256_KEY), src / CONFIG_NAME)


def read_model_config(src_dir: str | Path) -> ModelConfig:
    """The validated ModelConfig of a native folder."""
    path, raw = _read_raw(src_dir)
    check_tokenizer_sha256(raw.pop(TOKENIZER_SHA256_KEY, None), path)  # not a model setting
    cfg = model_config_from_dict(raw)
    if cfg.vocab_size is None:
        raise ConfigError(f"{path}: model.vocab_size is null; a saved model needs its vocabulary size")
    return cfg


def save_native(model: TransformerXL, out_dir: str | Path, tokenizer_sha256: str | None = None) -> Path:
    """Write model_config.json + model.safetensors of `model` into out_dir (created if needed);
    tokenizer_sha256: the digest of the tokenizer it was trained with, recorded in model_config.json."""
    out = Path(out_dir)
    config = dataclasses.asdict(model.config)
    if tokenizer_sha256 is not None:
        config[TOKENIZER_SHA256_KEY] = check_tokenizer_sha256(tokenizer_sha256, "tokenizer_sha256")
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_model(model, str(tmp), metadata={"format": "pt"})
    atomic_write(out / MODEL_CONFIG_NAME, json.dumps(config, indent=2) + "\n")
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
