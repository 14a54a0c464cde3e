"""Read and write the files of a HuggingFace save_pretrained folder without transformers.

A folder holds config.json and the weights as one of (the order HF's from_pretrained looks for them):
model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin, pytorch_model.bin.index.json.
We write config.json + model.safetensors (metadata {"format": "pt"}, which from_pretrained requires).
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path, PureWindowsPath
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from txl_dist.atomic import atomic_path, atomic_write
from txl_dist.config import read_json_object
from txl_dist.errors import Refused, one_line
from txl_dist.write_faults import safetensors_write

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


class HFFormatError(Refused, ValueError):
    """A folder is not a readable HuggingFace save_pretrained folder; the message is one line."""


def read_hf_config(src_dir: str | Path) -> dict[str, Any]:
    """config.json of a save_pretrained folder as a dict."""
    return read_json_object(Path(src_dir) / CONFIG_NAME, error=HFFormatError,
                            missing_hint="; pass a folder written by save_pretrained")


def _load_one(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        # weights_only: a .bin is a pickle; never run code from a downloaded file.
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError, OSError) as e:
        raise unreadable_weights(path, e) from None
    # A pickle may hold anything weights_only allows (a bare tensor, a list, a checkpoint dict with an optimizer
    # state): the name and shape checks downstream would fail on it with a traceback, not a refusal.
    if (instead := not_a_state_dict(loaded)) is not None:
        raise HFFormatError(f"{path}: holds no state dict (tensors by name) but {instead}; it is not a model's "
                            "weights file: pass the folder save_pretrained wrote")
    return loaded


def not_a_state_dict(value: Any) -> str | None:
    """None for a state dict (tensors by name); else a few words on what a weights pickle holds instead: its type,
    and for a dict the first entry that is not a tensor under a name."""
    if not isinstance(value, dict):
        return f"an object of type {type(value).__name__}"
    for name, item in value.items():
        if not isinstance(name, str):
            return f"a dict with the key {name!r}, which is no tensor name"
        if not isinstance(item, torch.Tensor):
            return f"a dict whose {name!r} is no tensor (type {type(item).__name__})"
    return None


def unreadable_weights(path: Path, error: BaseException) -> HFFormatError:
    """The one-line refusal of a weights file that does not load (truncated by a copy, damaged, not weights)."""
    return HFFormatError(f"{path}: cannot read the weights ({one_line(error, limit=200)}); the file is truncated "
                         "or damaged: write or download it again")


def read_hf_weights(src_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained folder by HF parameter name (shards merged)."""
    src = Path(src_dir)
    for single, index in ((SAFE_WEIGHTS, SAFE_INDEX), (BIN_WEIGHTS, BIN_INDEX)):
        if (src / single).is_file():
            return _load_one(src / single)
        if (src / index).is_file():
            tensors: dict[str, torch.Tensor] = {}
            for shard in read_shard_names(src / index):
                tensors.update(_load_one(src / shard))
            return tensors
    raise HFFormatError(
        f"{src}: no weights found (looked for {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS}, {BIN_INDEX})")


def read_shard_names(index: Path) -> list[str]:
    """The shard files an HF `*.index.json` names (its weight_map's values, sorted, once each)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):  # not UTF-8 or not JSON (ValueErrors), or no weight_map
        weight_map = None
    if not isinstance(weight_map, dict):
        raise HFFormatError(f"{index}: not a shard index (needs a 'weight_map' object)")
    return sorted({check_shard_name(value, index) for value in weight_map.values()})


def check_shard_name(value: Any, index: Path) -> str:
    """A weight_map value that is a plain file name inside the index's folder, else HFFormatError.

    Refused: anything but a non-empty string, '.', '..', a separator ('/' or '\\': no subfolders, no
    absolute or UNC paths), a Windows drive ('C:x'), NUL or another control character.
    """
    if (not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\\" in value
            or PureWindowsPath(value).drive or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        raise HFFormatError(f"{index}: weight_map names shard {json.dumps(value)}, which is not a plain file name "
                            f"in {index.parent}; list the shard files of this folder by name")
    return value


def write_hf_folder(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write config.json + model.safetensors (fp32 on the CPU, contiguous, no shared storage) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share storage (tied weights): each name gets its own copy here, and
    # the caller leaves tied copies out as save_pretrained does.
    plain = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}
    with atomic_path(out / SAFE_WEIGHTS) as tmp, safetensors_write(out / SAFE_WEIGHTS):  # a full disk: OSError
        save_file(plain, tmp, metadata={"format": "pt"})
    atomic_write(out / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
