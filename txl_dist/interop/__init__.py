"""HuggingFace Transformer-XL interoperability, without transformers installed.

Formats:
- HF folder: what TransfoXLLMHeadModel.save_pretrained of transformers 4.37.2 writes: config.json and the
  weights as model.safetensors or pytorch_model.bin (sharded forms with an .index.json are read too).
  to_hf writes config.json + model.safetensors, loadable with from_pretrained.
- Native folder (ours): model_config.json (our ModelConfig as JSON) + model.safetensors (our state_dict,
  tied tensors stored once). from-hf writes it, to-hf reads it. Training checkpoints are exported by
  launch/export.py, which calls to_hf with extra_config={"eos_token_id": the corpus' end-of-document id,
  "tokenizer_sha256": the checkpoint's tokenizer digest} and records both in model_config.json too
  (tokenizer_sha256, eod_id); the conversions carry them from one folder to the other
  (recorded_tokenizer_sha256, native.recorded_eod_id read them), with the folder's tokenizer.model.

Python:
    from_hf(src_dir) -> TransformerXL            to_hf(model, out_dir, extra_config=None) -> Path
    load_native(src_dir) -> TransformerXL        save_native(model, out_dir, tokenizer_sha256=None, eod_id=None)
CLI:
    python -m txl_dist.interop from-hf SRC_DIR OUT_DIR     HF folder -> native folder
    python -m txl_dist.interop to-hf SRC OUT_DIR           native folder -> HF folder

Modules: hf_config (config.json <-> ModelConfig, refusals), hf_files (reading/writing HF files),
weights (tensor names and tying), convert (from_hf / to_hf), native (our folder), __main__ (CLI).
"""
from txl_dist.interop.convert import from_hf, to_hf
from txl_dist.interop.hf_config import hf_config_from_model_config, model_config_from_hf
from txl_dist.interop.hf_files import HFFormatError
from txl_dist.interop.native import load_native, recorded_tokenizer_sha256, save_native
from txl_dist.interop.weights import hf_state_dict

__all__ = [
    "HFFormatError",
    "from_hf",
    "hf_config_from_model_config",
    "hf_state_dict",
    "load_native",
    "model_config_from_hf",
    "recorded_tokenizer_sha256",
    "save_native",
    "to_hf",
]
