"""HuggingFace TransfoXLConfig (config.json of transformers 4.37.2) <-> our ModelConfig.

Standard library only. Keys missing from a config.json take the defaults of TransfoXLConfig.__init__ in
4.37.2 (that is what HF itself would use). Settings our model does not implement are refused with one line.
"""
from __future__ import annotations

from typing import Any, Mapping

from txl_dist.config import ConfigError, ModelConfig, validate_model

HF_MODEL_TYPE = "transfo-xl"
HF_ARCHITECTURE = "TransfoXLLMHeadModel"
HF_VERSION = "4.37.2"

# TransfoXLConfig.__init__ defaults in transformers 4.37.2 (configuration_transfo_xl.py), plus
# PretrainedConfig's tie_word_embeddings.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 267735,
    "cutoffs": [20000, 40000, 200000],
    "d_model": 1024,
    "d_embed": 1024,
    "n_head": 16,
    "d_head": 64,
    "d_inner": 4096,
    "div_val": 4,
    "pre_lnorm": False,
    "n_layer": 18,
    "mem_len": 1600,
    "clamp_len": 1000,
    "same_length": True,
    "proj_share_all_but_first": True,
    "attn_type": 0,
    "sample_softmax": -1,
    "adaptive": True,
    "dropout": 0.1,
    "dropatt": 0.0,
    "untie_r": True,
    "init_std": 0.02,
    "proj_init_std": 0.01,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}


def _int(raw: Mapping[str, Any], key: str) -> int:
    v = raw[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"HF config.json: '{key}' must be an integer, got {v!r}")
    return v


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    v = raw[key]
    if not isinstance(v, bool):
        raise ConfigError(f"HF config.json: '{key}' must be true or false, got {v!r}")
    return v


def _float(raw: Mapping[str, Any], key: str) -> float:
    v = raw[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ConfigError(f"HF config.json: '{key}' must be a number, got {v!r}")
    return float(v)


# ModelConfig fields whose config.json key has the same name and meaning in HF 4.37.2, with their JSON type.
SAME_NAME_FIELDS = {
    "vocab_size": int, "n_layer": int, "d_model": int, "n_head": int, "d_head": int, "d_inner": int,
    "div_val": int, "pre_lnorm": bool, "untie_r": bool, "mem_len": int, "clamp_len": int, "same_length": bool,
    "dropout": float, "dropatt": float, "init_std": float, "proj_init_std": float, "layer_norm_epsilon": float,
}
_READERS = {int: _int, bool: _bool, float: _float}


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Translate a TransfoXLLMHeadModel config.json (as a dict) into a validated ModelConfig.

    Refuses what our model does not implement: another model_type, attn_type != 0, sample_softmax > 0,
    adaptive false with cutoffs (HF 4.37.2 ignores that flag and still builds an adaptive softmax).
    """
    model_type = hf.get("model_type", HF_MODEL_TYPE)
    if model_type != HF_MODEL_TYPE:
        raise ConfigError(
            f"HF config.json: model_type is {model_type!r}, not {HF_MODEL_TYPE!r}; only Transformer-XL "
            "(TransfoXLLMHeadModel) folders can be imported")
    raw = dict(HF_DEFAULTS)
    raw.update(hf)
    if "vocab_size" not in hf and "n_token" in hf:  # old configs; HF maps n_token -> vocab_size
        raw["vocab_size"] = hf["n_token"]
    if _int(raw, "attn_type") != 0:
        raise ConfigError(
            f"HF config.json: attn_type {raw['attn_type']} is not supported; only 0 (relative partial "
            "learnable attention, the one HF implements) can be imported")
    if _int(raw, "sample_softmax") > 0:
        raise ConfigError(
            f"HF config.json: sample_softmax {raw['sample_softmax']} (sampled softmax) is not supported; "
            "set it to -1 (full adaptive softmax)")
    cutoffs = raw["cutoffs"]
    if not isinstance(cutoffs, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs):
        raise ConfigError(f"HF config.json: 'cutoffs' must be a list of integers, got {cutoffs!r}")
    if not _bool(raw, "adaptive") and cutoffs:
        raise ConfigError(
            f"HF config.json: adaptive is false but cutoffs are {cutoffs}; HF would still build an adaptive "
            "softmax, so the intent is unclear: set adaptive true, or cutoffs [] for a plain softmax")
    if "tie_projs" in hf:  # written by save_pretrained; wins over proj_share_all_but_first as in HF
        tie_projs = hf["tie_projs"]
        if not isinstance(tie_projs, list) or not all(isinstance(t, bool) for t in tie_projs):
            raise ConfigError(f"HF config.json: 'tie_projs' must be a list of true/false, got {tie_projs!r}")
    else:
        tie_projs = [False] + [_bool(raw, "proj_share_all_but_first")] * len(cutoffs)
    if len(tie_projs) != len(cutoffs) + 1:
        raise ConfigError(
            f"HF config.json: tie_projs {tie_projs} needs one entry per cluster ({len(cutoffs) + 1} for "
            f"cutoffs {cutoffs}); fix tie_projs")
    tgt_len = hf.get("tgt_len")  # not an HF field; the original code's configs carry it, and so do ours
    if isinstance(tgt_len, bool):  # JSON true is no length (an int to isinstance): the default, as for 0 or 2.5
        tgt_len = None
    cfg = ModelConfig(
        **{key: _READERS[kind](raw, key) for key, kind in SAME_NAME_FIELDS.items()},
        d_embed=_int(raw, "d_embed"),
        cutoffs=list(cutoffs),
        tie_weight=_bool(raw, "tie_word_embeddings"),
        tie_projs=list(tie_projs),
        tgt_len=tgt_len if isinstance(tgt_len, int) and tgt_len > 0 else ModelConfig.tgt_len,
    )
    try:
        validate_model(cfg)
    except ConfigError as e:
        raise ConfigError(f"HF config.json does not make a valid model: {e}") from None
    return cfg


def hf_config_from_model_config(cfg: ModelConfig, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json that TransfoXLLMHeadModel.from_pretrained (4.37.2) needs to rebuild `cfg`.

    `extra` adds or overrides plain HF keys (e.g. eos_token_id from the corpus manifest).
    """
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size: is null; set it (e.g. from the corpus manifest) before exporting")
    validate_model(cfg)
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **{key: getattr(cfg, key) for key in SAME_NAME_FIELDS},
        "d_embed": cfg.resolved_d_embed(),
        "cutoffs": list(cfg.cutoffs),
        "tie_projs": cfg.resolved_tie_projs(),
        "tie_word_embeddings": cfg.tie_weight,
        "attn_type": 0,
        "sample_softmax": -1,
        "adaptive": True,
        "init": "normal",
        "tgt_len": cfg.tgt_len,
        "torch_dtype": "float32",
        "transformers_version": HF_VERSION,
    }
    hf.update(extra or {})
    return hf
