"""Read and write the files of a HuggingFace save_pretrained folder without transformers.

A folder holds config.json and the weights as one of (the order HF's from_pretrained looks for them):
model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin, pytorch_model.bin.index.json.
We write config.json + model.safetensors (metadata {"format": "pt"}, which from_pretrained requires).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from txl_dist.atomic import atomic_path, atomic_write
from txl_dist.config import read_json_object

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


class HFFormatError(ValueError):
    """A folder is not a readable HuggingFace save_pretrained folder; the message is one line."""


def read_hf_config(src_dir: str | Path) -> dict[str, Any]:
    """config.json of a save_pretrained folder as a dict."""
    return read_json_object(Path(src_dir) / CONFIG_NAME, error=HFFormatError,
                            missing_hint="; pass a folder written by save_pretrained")


def _load_one(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(path)
    # weights_only: a .bin is a pickle; never run code from a downloaded file.
    return torch.load(path, map_location="cpu", weights_only=True)


def read_hf_weights(src_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained folder by HF parameter name (shards merged)."""
    src = Path(src_dir)
    for single, index in ((SAFE_WEIGHTS, SAFE_INDEX), (BIN_WEIGHTS, BIN_INDEX)):
        if (src / single).is_file():
            return _load_one(src / single)
        if (src / index).is_file():
            try:
                weight_map = json.loads((src / index).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise HFFormatError(f"{src / index}: not a shard index (needs a 'weight_map' object)") from None
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                tensors.update(_load_one(src / shard))
            return tensors
    raise HFFormatError(
        f"{src}: no weights found (looked for {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS}, {BIN_INDEX})")


def write_hf_folder(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write config.json + model.safetensors (fp32 on the CPU, contiguous, no shared storage) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage (tied weights): each name gets its own copy here, and
    # the caller leaves tied copies out as save_pretrained does.
    plain = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
    with atomic_path(out / SAFE_WEIGHTS) as tmp:
        save_file(plain, tmp, metadata={"format": "pt"})
    atomic_write(out / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
