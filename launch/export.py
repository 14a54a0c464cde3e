"""Export a training checkpoint: consolidated fp32 weights as our native model folder, and optionally the
HuggingFace Transformer-XL folder (TransfoXLLMHeadModel of transformers 4.37.2 loads it).

    python launch/export.py --checkpoint PATH --out DIR [--hf HF_DIR]

PATH is a checkpoint folder (its `latest` is used) or a step_* tag. DIR gets model_config.json +
model.safetensors (txl_dist.interop.load_native reads it back). One process, CPU, no launcher needed.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from txl_dist.checkpoint import CheckpointError
from txl_dist.config import ConfigError, ModelConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="launch/export.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (with 'latest') or a step_* tag")
    p.add_argument("--out", required=True, help="native model folder to write (model_config.json + model.safetensors)")
    p.add_argument("--hf", default=None, help="also write a HuggingFace Transformer-XL folder here")
    return p.parse_args(argv)


def export(checkpoint: str, out: str, hf: str | None = None):
    """Build the checkpoint's model on the CPU with its fp32 weights, write the folder(s); returns the model."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.interop import save_native, to_hf
    from txl_dist.model import TransformerXL

    tag_dir = ckpt.resolve_resume(checkpoint, checkpoint)
    run_info = ckpt.read_run_info(tag_dir)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in run_info["config"]["model"].items() if k in fields})
    model = TransformerXL(model_cfg)
    ckpt.load_fp32_weights(model, tag_dir, run_info["zero_stage"])
    model.eval()
    save_native(model, out)
    if hf:
        to_hf(model, hf)
    return model


def main(argv: list[str] | None = None) -> int:
    """Export; exit status 0, or 2 for a refused checkpoint."""
    args = parse_args(argv)
    try:
        export(args.checkpoint, args.out, args.hf)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {args.out}" + (f" and {args.hf} (HuggingFace)" if args.hf else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
