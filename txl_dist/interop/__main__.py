"""CLI: convert between HuggingFace Transformer-XL folders and our native model folders.

    python -m txl_dist.interop from-hf SRC_DIR OUT_DIR   HF save_pretrained folder -> native folder
    python -m txl_dist.interop to-hf SRC OUT_DIR         native folder -> HF folder (from_pretrained loads it)

OUT_DIR is checked before anything is read: it must be makeable and writable, and not the source folder.
What launch/export.py records beside the weights goes along into OUT_DIR, as export --hf writes it: the
digest of the tokenizer the weights were trained with (tokenizer_sha256), so that launch/generate.py --model
still checks the tokenizer it is given; the source's tokenizer.model (where it has one that fits that digest;
OUT_DIR's own is removed otherwise, so that no other model's tokenizer stays beside the new weights); and the
end-of-document id (eod_id in model_config.json, eos_token_id in config.json, where HF generate() stops).
to-hf of a native folder that records no eod_id (an older export, one that could not read its corpus, or
from-hf of a folder without one) writes no eos_token_id, with one warning line, as export does when it cannot.
Refused input (those, a source that is no such folder, truncated weights, weights that do not fit the folder's
config in a tensor's name or shape) is one `error:` line, exit status 2;
a write that fails after the checks passed (a full disk, say) is one `error:` line, exit status 1, like a job's
fault (txl_dist/entry.py).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import sys
from pathlib import Path

from txl_dist.atomic import atomic_write
from txl_dist.cli_args import ArgumentParser
from txl_dist.errors import EXIT_FAILED, EXIT_REFUSED, Refused, one_line
from txl_dist.interop.convert import from_hf, to_hf
from txl_dist.interop.hf_files import CONFIG_NAME
from txl_dist.interop.native import (HF_EOS_KEY, MODEL_CONFIG_NAME, TOKENIZER_NAME, TOKENIZER_SHA256_KEY, load_native,
                                     recorded_eod_id, recorded_tokenizer_sha256, save_native)
from txl_dist.output_paths import check_distinct_folders, check_output_folder
from txl_dist.write_faults import write_fault_line


_FROM_HF = "python -m txl_dist.interop from-hf path/to/hf_transfo_xl out/native"
_TO_HF = "python -m txl_dist.interop to-hf exported/tiny exported/tiny-hf"


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = ArgumentParser(prog="python -m txl_dist.interop", description=__doc__.split("\n")[0],
                            epilog=f"examples:\n  {_FROM_HF}\n  {_TO_HF}\n", formatter_class=raw)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the conversion")
    what = "HF TransfoXLLMHeadModel folder -> native folder"
    p = sub.add_parser("from-hf", help=what, description=what + " (no `transformers` needed).",
                       epilog=f"example:\n  {_FROM_HF}\n", formatter_class=raw)
    p.add_argument("src_dir",
                   help="folder written by save_pretrained (config.json + weights), e.g. path/to/hf_transfo_xl")
    p.add_argument("out_dir", help="native folder to write (model_config.json + model.safetensors), e.g. out/native")
    what = "native folder -> HF TransfoXLLMHeadModel folder"
    p = sub.add_parser("to-hf", help=what, description=what + " (TransfoXLLMHeadModel.from_pretrained loads it).",
                       epilog=f"example:\n  {_TO_HF}\n", formatter_class=raw)
    p.add_argument("src", help="native folder (model_config.json + model.safetensors), e.g. exported/tiny")
    p.add_argument("out_dir", help="folder to write (config.json + model.safetensors), e.g. exported/tiny-hf")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one conversion; bad input exits with a one-line error."""
    args = build_parser().parse_args(argv)
    src, src_name = (args.src_dir, "SRC_DIR") if args.command == "from-hf" else (args.src, "SRC")
    try:
        # Before the weights are read: both kinds of folder keep theirs in model.safetensors, so converting
        # a folder into itself would overwrite the source.
        check_distinct_folders(src, src_name, args.out_dir, "OUT_DIR", "the output's model.safetensors would "
                               "replace the source's")
        check_output_folder(args.out_dir, "OUT_DIR")
        model = from_hf(src) if args.command == "from-hf" else load_native(src)
        tokenizer_sha256 = recorded_tokenizer_sha256(src)  # carried over, for launch/generate.py --model's check
        eod_id = recorded_eod_id(src)
        tokenizer = source_tokenizer(src, tokenizer_sha256)
    except (Refused, ValueError, OSError) as e:  # the package's refusals are one-liners
        _exit(EXIT_REFUSED, one_line(e, limit=2000))
    if args.command == "to-hf" and eod_id is None:
        # HF generate() stops at config.json's eos_token_id; without one transformers takes 0 (not our end of document).
        logging.getLogger("txl_dist").warning(
            "to-hf: no eos_token_id in the HuggingFace config.json (transformers then takes 0): %s records no "
            "end-of-document id (eod_id in %s: an export by an older txl-dist, or one that could not read the "
            "training corpus): export the checkpoint again, or add eos_token_id (the corpus manifest's "
            "tokenizer.eod_id) to %s by hand",
            src, "model_config.json", Path(args.out_dir) / "config.json")
    # The config is what makes OUT_DIR a model folder: a former one goes first with the tokenizer, and the new one
    # is removed again when the tokenizer after it cannot be written. A conversion that fails midway (a full
    # disk) then leaves no config beside new weights: the folder loads as nothing, not as a finished model.
    out_config = Path(args.out_dir) / (MODEL_CONFIG_NAME if args.command == "from-hf" else CONFIG_NAME)
    try:
        out_tokenizer = Path(args.out_dir) / TOKENIZER_NAME
        out_tokenizer.unlink(missing_ok=True)  # never another model's tokenizer beside the new weights
        out_config.unlink(missing_ok=True)
        if args.command == "from-hf":
            out = save_native(model, args.out_dir, tokenizer_sha256, eod_id)
        else:
            extra = {**({TOKENIZER_SHA256_KEY: tokenizer_sha256} if tokenizer_sha256 else {}),
                     **({HF_EOS_KEY: eod_id} if eod_id is not None else {})}
            out = to_hf(model, args.out_dir, extra_config=extra or None)
        if tokenizer is not None:  # OUT_DIR is then all launch/generate.py --model needs, as after export
            atomic_write(out_tokenizer, tokenizer)
    except BaseException as e:  # each file is written whole or not at all; whatever ends it, no config stays
        with contextlib.suppress(OSError):  # best effort: the disk is failing
            out_config.unlink(missing_ok=True)
        if not isinstance(e, OSError):  # Ctrl-C, or an error of the process: its traceback
            raise
        # The input was fine: a fault of the machine. Where the error names its file, the line names the file
        # system to free space on, as data_prep's do.
        named = write_fault_line(e, args.out_dir, "choose another OUT_DIR") if e.filename is not None else None
        _exit(EXIT_FAILED, f"writing {args.out_dir} failed: {named or one_line(e, limit=2000)}")
    print(f"wrote {out}")
    return 0


def source_tokenizer(src: str | Path, tokenizer_sha256: str | None) -> bytes | None:
    """The bytes of the source folder's tokenizer.model (launch/export.py writes it into both its folders) to
    copy into OUT_DIR; None when it has none, or (with one warning) one that is not the tokenizer the folder
    records the digest of (generate --model would refuse it)."""
    path = Path(src) / TOKENIZER_NAME
    if not path.is_file():
        return None
    data = path.read_bytes()
    if tokenizer_sha256 is not None and hashlib.sha256(data).hexdigest() != tokenizer_sha256:
        logging.getLogger("txl_dist").warning(
            "%s: not the tokenizer %s records (tokenizer_sha256 differs): left out of the folder written "
            "(launch/generate.py --model then needs --tokenizer)", path, src)
        return None
    return data


def _exit(status: int, message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status) from None


if __name__ == "__main__":
    sys.exit(main())
