"""Export a training checkpoint: consolidated fp32 weights as our native model folder, and optionally the
HuggingFace Transformer-XL folder (TransfoXLLMHeadModel of transformers 4.37.2 loads it).

    python launch/export.py --checkpoint PATH --out DIR [--hf HF_DIR]

PATH is a run folder, its checkpoints/ folder (the newest complete tag) or a step_* tag; its files are
verified against their checksums and read with weights-only unpickling. DIR gets model_config.json +
model.safetensors (txl_dist.interop.load_native reads it back). One process, CPU, no launcher needed.
The output folders are checked first: one that cannot be made or written (below a regular file, in a
read-only place), or --hf naming the --out folder itself (both write model.safetensors), is refused before
the checkpoint is read. Exit status 0, 2 for a refused checkpoint or output (one line says why), 1 when
writing fails midway (a full disk).
"""
from __future__ import annotations

import argparse
import logging
import sys

from txl_dist.entry import guarded
from txl_dist.errors import RunFailed


EPILOG = """examples:
  python launch/export.py --checkpoint runs/tiny --out exported/tiny
  python launch/export.py --checkpoint runs/tiny/checkpoints/step_00000100 --out exported/tiny --hf exported/tiny-hf

Load the native folder with txl_dist.interop.load_native(DIR); the HuggingFace folder with
TransfoXLLMHeadModel.from_pretrained(HF_DIR) (transformers 4.37.2).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="launch/export.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="what to export: a run folder or its checkpoints/ folder (the newest complete tag), or one "
                        "tag, e.g. runs/tiny/checkpoints/step_00000100")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="native model folder to write (model_config.json + model.safetensors), e.g. exported/tiny")
    p.add_argument("--hf", default=None, metavar="HF_DIR",
                   help="also write a HuggingFace Transformer-XL folder here, e.g. exported/tiny-hf")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_outputs(out: str, hf: str | None) -> None:
    """Refuse output folders that cannot be written, or that are one folder, before the checkpoint is read."""
    from txl_dist.output_paths import check_distinct_folders, check_output_folder

    check_output_folder(out, "--out")
    if hf:
        check_output_folder(hf, "--hf")
        # Nested folders are fine (each writes only its own top level); one folder is not.
        check_distinct_folders(out, "--out", hf, "--hf", "the HuggingFace model.safetensors would replace the "
                               "native one")


def export(checkpoint: str, out: str, hf: str | None = None):
    """Build the checkpoint's model on the CPU with its fp32 weights, write the folder(s); returns the model."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.interop import save_native, to_hf
    from txl_dist.model import TransformerXL
    from txl_dist.startup import open_export

    check_outputs(out, hf)
    with open_export(checkpoint) as (tag_dir, run_info, model_cfg):  # held: a training run's retention waits
        model = TransformerXL(model_cfg)
        ckpt.load_fp32_weights(model, tag_dir, run_info["zero_stage"])
    model.eval()
    try:
        save_native(model, out)
        if hf:
            to_hf(model, hf)
    except OSError as e:  # the folders were checked at the start: a full disk, a folder removed since
        raise RunFailed(f"export to {e.filename or out}: {e.strerror or e}; the files already there are whole "
                        "(each is written atomically), run the export again") from None
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
