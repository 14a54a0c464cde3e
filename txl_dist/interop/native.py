"""Our own model folder: `model_config.json` (ModelConfig as JSON) + `model.safetensors` (our state_dict).

This is what `from-hf` writes and `to-hf` reads. Tied weights are stored once, under the first of their names
(safetensors' load_model restores the others), in the dtype the model had.

model_config.json may also hold `tokenizer_sha256`, the sha256 of the SentencePiece model the weights were
trained with (launch/export.py records the checkpoint's): launch/generate.py --model checks the tokenizer it
is given or finds against it; and `eod_id`, the end-of-document id of the training corpus (launch/export.py
records the manifest's), which to-hf writes into config.json as eos_token_id. A folder without them (an older
export, from-hf of a folder that records neither) loads as before.

The weights must fit the config tensor by tensor: a name or a shape that does not (an edited
model_config.json, another model's weights) is a one-line refusal, before anything is loaded.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_file

from txl_dist.atomic import atomic_path, atomic_write
from txl_dist.config import ConfigError, ModelConfig, model_config_from_dict, read_json_object
from txl_dist.errors import one_line
from txl_dist.write_faults import safetensors_write
from txl_dist.interop.hf_files import CONFIG_NAME, read_hf_config
from txl_dist.interop.weights import check_shape
from txl_dist.model import TransformerXL

MODEL_CONFIG_NAME = "model_config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.model"
"""The SentencePiece model an exported folder holds beside its weights (launch/generate.py --model reads it)."""
TOKENIZER_SHA256_KEY = "tokenizer_sha256"
"""The key (in model_config.json, and in an exported HuggingFace config.json) of the tokenizer's sha256."""
EOD_ID_KEY = "eod_id"
"""The key in model_config.json of the training corpus' end-of-document id (HF's config.json: HF_EOS_KEY)."""
HF_EOS_KEY = "eos_token_id"
"""HF's name for it: generate() stops there (without one, transformers takes 0)."""


def check_tokenizer_sha256(value: object, where: str | Path) -> str | None:
    """A recorded tokenizer digest (64 lowercase hex digits) or None when absent; ConfigError otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ConfigError(f"{where}: {TOKENIZER_SHA256_KEY} must be a sha256 (64 hex digits), got {value!r}; the "
                          "file is damaged: export the model again")
    return value


def check_eod_id(value: object, where: str | Path, vocab_size: int | None) -> int | None:
    """A recorded end-of-document id (an integer in [0, vocab_size)) or None when absent; ConfigError otherwise."""
    if value is None:
        return None
    if (not isinstance(value, int) or isinstance(value, bool) or value < 0
            or (vocab_size is not None and value >= vocab_size)):
        raise ConfigError(f"{where}: {EOD_ID_KEY} must be a token id in [0, {vocab_size}), got {value!r}; the file "
                          "is damaged: export the model again")
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


def _read_config(src_dir: str | Path) -> tuple[ModelConfig, int | None]:
    """The validated ModelConfig of a native folder and the eod id it records (None where not recorded)."""
    path, raw = _read_raw(src_dir)
    check_tokenizer_sha256(raw.pop(TOKENIZER_SHA256_KEY, None), path)  # not model settings
    eod_id = raw.pop(EOD_ID_KEY, None)
    cfg = model_config_from_dict(raw)
    if cfg.vocab_size is None:
        raise ConfigError(f"{path}: model.vocab_size is null; a saved model needs its vocabulary size")
    return cfg, check_eod_id(eod_id, path, cfg.vocab_size)


def read_model_config(src_dir: str | Path) -> ModelConfig:
    """The validated ModelConfig of a native folder."""
    return _read_config(src_dir)[0]


def read_eod_id(src_dir: str | Path) -> int | None:
    """The end-of-document id a native folder records (launch/export.py writes the corpus'), None where none is."""
    return _read_config(src_dir)[1]


def recorded_eod_id(src_dir: str | Path) -> int | None:
    """The end-of-document id a model folder records: a native folder's model_config.json (checked: a bad one
    is a ConfigError), else a HuggingFace folder's config.json eos_token_id where it is a token id of the
    model's vocabulary (HF's own configs may hold none, or a list); None where none is recorded."""
    src = Path(src_dir)
    if (src / MODEL_CONFIG_NAME).is_file():
        return read_eod_id(src)
    hf = read_hf_config(src)
    value, vocab_size = hf.get(HF_EOS_KEY), hf.get("vocab_size", hf.get("n_token"))
    try:
        return check_eod_id(value, src / CONFIG_NAME, vocab_size if isinstance(vocab_size, int) else None)
    except ConfigError:
        return None


def _tied_stored_once(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each group of tied tensors under one name, the first in sorted order, as safetensors'
    save_model keeps it (load_model restores the others from the model). save_model also lists the dropped names
    in the file header's metadata, which safetensors writes in a random order (a hash map), so two exports of one
    checkpoint differed in their bytes; without that list they are the same file."""
    state = model.state_dict()
    tied: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        where = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                 tensor.stride())
        tied.setdefault(where, []).append(name)
    return {min(names): state[min(names)] for names in tied.values()}


def save_native(model: TransformerXL, out_dir: str | Path, tokenizer_sha256: str | None = None,
                eod_id: int | None = None) -> Path:
    """Write model_config.json + model.safetensors of `model` into out_dir (created if needed);
    tokenizer_sha256: the digest of the tokenizer it was trained with, eod_id: the end-of-document id of its
    corpus, each recorded in model_config.json where given."""
    out = Path(out_dir)
    config = dataclasses.asdict(model.config)
    if tokenizer_sha256 is not None:
        config[TOKENIZER_SHA256_KEY] = check_tokenizer_sha256(tokenizer_sha256, "tokenizer_sha256")
    if eod_id is not None:
        config[EOD_ID_KEY] = check_eod_id(eod_id, "eod_id", model.config.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp, safetensors_write(out / WEIGHTS_NAME):  # a full disk: OSError
        save_file(_tied_stored_once(model), str(tmp), metadata={"format": "pt"})
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
        # Shapes first, from the file's header: torch's load_state_dict raises a traceback-sized RuntimeError
        # for a tensor of another shape (strict=False or not), where the HF path refuses in one line.
        with safe_open(str(src / WEIGHTS_NAME), framework="pt") as f:
            stored = set(f.keys())
            for name, tensor in model.state_dict().items():  # in the model's order, as the HF path checks
                if name in stored:  # names: missing or unexpected ones are refused below
                    check_shape(str(src / WEIGHTS_NAME), name, f.get_slice(name).get_shape(), tensor.shape,
                                MODEL_CONFIG_NAME, error=ConfigError)
        missing, unexpected = load_model(model, str(src / WEIGHTS_NAME), strict=False)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{src / WEIGHTS_NAME}: cannot read the weights ({one_line(e, limit=200)}); the file is "
                          "truncated or damaged: write it again (launch/export.py, or from-hf)") from None
    if missing or unexpected:
        raise ConfigError(
            f"{src / WEIGHTS_NAME} does not fit {MODEL_CONFIG_NAME}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}")
    return model.eval()
