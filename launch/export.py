"""Export a training checkpoint: consolidated fp32 weights as our native model folder, and optionally the
HuggingFace Transformer-XL folder (TransfoXLLMHeadModel of transformers 4.37.2 loads it).

    python launch/export.py --checkpoint PATH --out DIR [--hf HF_DIR]

PATH is a run folder, its checkpoints/ folder (the newest complete tag) or a step_* tag; its files are
verified against their checksums and read with weights-only unpickling. DIR gets model_config.json +
model.safetensors (txl_dist.interop.load_native reads it back). One process, CPU, no launcher needed.
Exit status 0, or 2 for a refused checkpoint (one line says why).
"""
from __future__ import annotations

import argparse
import logging
import sys

from txl_dist.entry import guarded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="launch/export.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, help="run folder, checkpoint folder or a step_* tag")
    p.add_argument("--out", required=True, help="native model folder to write (model_config.json + model.safetensors)")
    p.add_argument("--hf", default=None, help="also write a HuggingFace Transformer-XL folder here")
    return p.parse_args(argv)


def export(checkpoint: str, out: str, hf: str | None = None):
    """Build the checkpoint's model on the CPU with its fp32 weights, write the folder(s); returns the model."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.interop import save_native, to_hf
    from txl_dist.model import TransformerXL
    from txl_dist.startup import start_export

    tag_dir, run_info, model_cfg = start_export(checkpoint)
    model = TransformerXL(model_cfg)
    ckpt.load_fp32_weights(model, tag_dir, run_info["zero_stage"])
    model.eval()
    save_native(model, out)
    if hf:
        to_hf(model, hf)
    return model


def main(argv: list[str] | None = None) -> int:
    """Export; prints where the folders went."""
    args = parse_args(argv)
    log = logging.getLogger("txl_dist")

    def job() -> int:
        export(args.checkpoint, args.out, args.hf)
        print(f"exported {args.checkpoint} -> {args.out}" + (f" and {args.hf} (HuggingFace)" if args.hf else ""))
        return 0

    return guarded(job, log)


if __name__ == "__main__":
    sys.exit(main())
