"""Export a training checkpoint: consolidated fp32 weights as our native model folder, and optionally the
HuggingFace Transformer-XL folder (TransfoXLLMHeadModel of transformers 4.37.2 loads it).

    python launch/export.py --checkpoint PATH --out DIR [--hf HF_DIR]

PATH is a run folder, its checkpoints/ folder (the newest complete tag) or a step_* tag; its files are
verified against their checksums and read with weights-only unpickling. DIR gets model_config.json +
model.safetensors (txl_dist.interop.load_native reads it back) and the training corpus' tokenizer.model (so
that launch/generate.py --model DIR needs no --tokenizer; HF_DIR gets it too). One process, CPU, no launcher needed.
The output folders are checked first: one that cannot be made or written (below a regular file, in a
read-only place), --hf naming the --out folder itself (both write model.safetensors), or an existing folder
that holds other files than a former export (a model of elsewhere, files of the user's: they would be
replaced or left beside the new weights; --overwrite writes into it anyway) is refused before the checkpoint
is read. A former export's folder is written over: its files are replaced, and its tokenizer.model removed
when this export has none, so that no other model's tokenizer stays beside the new weights. Both folders
record the digest of the checkpoint's tokenizer (tokenizer_sha256 in model_config.json and config.json), which
launch/generate.py --model checks its tokenizer against, and the corpus' end-of-document id (eod_id in
model_config.json, eos_token_id in config.json; `python -m txl_dist.interop to-hf DIR HF_DIR` carries it over
as export --hf writes it). Exit status 0, 2 for a refused checkpoint or output
(one line says why), 1 when writing fails midway (a full disk, a read-only remount: one line naming the file and
its file system), 143 for SIGTERM (scancel, a time limit, kill), SIGUSR1 or the end of its launcher: it stops
at once, in one line. Each folder gets
its config last, so one whose export failed or was stopped holds none (nor the file it was writing): it loads as
nothing, and the next export writes into it without --overwrite.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from txl_dist.stop_request import (Terminated, catch_sigterm_early, finish_despite_sigterm,  # standard library only
                                   stop_at_once)

if __name__ == "__main__":
    catch_sigterm_early()  # scancel during the imports: the job's line too, not a silent death

from txl_dist.atomic import atomic_write  # noqa: E402
from txl_dist.cli_args import ArgumentParser  # noqa: E402
from txl_dist.entry import exit_process, guarded, print_result  # noqa: E402
from txl_dist.errors import RunFailed  # noqa: E402


EPILOG = """examples:
  python launch/export.py --checkpoint runs/tiny --out exported/tiny
  python launch/export.py --checkpoint runs/tiny/checkpoints/step_00000100 --out exported/tiny --hf exported/tiny-hf

Load the native folder with txl_dist.interop.load_native(DIR); the HuggingFace folder with
TransfoXLLMHeadModel.from_pretrained(HF_DIR) (transformers 4.37.2). Its config.json has eos_token_id, the
end-of-document id of the training corpus (read from its manifest), so that HF generate() stops at the end
of a document. Both folders get the corpus' tokenizer.model, checked against the digest the checkpoint
recorded. When the corpus cannot be read, or holds another tokenizer by now, both are left out with a
warning (and a former export's tokenizer.model is removed); the digest is recorded all the same, so that
launch/generate.py --model DIR --tokenizer CORPUS refuses a corpus of another tokenizer.

In HuggingFace, mems=None is not an empty memory but mem_len zero vectors that the first segments attend
to: their log-probs differ from txl-dist (and the paper), by up to 3 nats on the first segment of a small
trained model, then 0.9, 0.07, 0.008 on the next. Start from empty mems (mem_len > 0) for the same numbers:
    mems = [torch.zeros(0, batch_size, model.config.d_model) for _ in range(model.config.n_layer)]
    for segment in segments:                   # [batch_size, tgt_len] token ids
        out = model(input_ids=segment, mems=mems)
        mems = out.mems
HF generate() always reads its prompt from the zero vectors; launch/generate.py --model HF_DIR does not.
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = ArgumentParser(prog="launch/export.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="what to export: a run folder or its checkpoints/ folder (the newest complete tag), or one "
                        "tag, e.g. runs/tiny/checkpoints/step_00000100")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="native model folder to write (model_config.json + model.safetensors), e.g. exported/tiny")
    p.add_argument("--hf", default=None, metavar="HF_DIR",
                   help="also write a HuggingFace Transformer-XL folder here, e.g. exported/tiny-hf")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out / --hf folder that holds other files than a former export (refused "
                        "without it): the export's files there are replaced, a tokenizer.model is removed when the "
                        "export has none, other files stay")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_outputs(out: str, hf: str | None, overwrite: bool = False) -> None:
    """Refuse output folders that cannot be written, that are one folder, or (unless overwrite) that hold other
    files than a former export, before the checkpoint is read."""
    from txl_dist.output_paths import check_distinct_folders, check_output_folder

    check_output_folder(out, "--out")
    if hf is not None:
        check_output_folder(hf, "--hf")
        # Nested folders are fine (each writes only its own top level); one folder is not.
        check_distinct_folders(out, "--out", hf, "--hf", "the HuggingFace model.safetensors would replace the "
                               "native one")
    if not overwrite:
        check_former_export(out, "--out", native=True, other=hf)
        if hf is not None:
            check_former_export(hf, "--hf", native=False, other=out)


def foreign_files(folder: str | Path, *, native: bool, other: str | Path | None = None) -> list[str]:
    """The entries of `folder` that make it something else than a new or empty folder or a former export of
    ours (of the native or the HuggingFace kind): the export would replace them or leave them beside its
    weights. [] when the export may write there. other: the export's other output folder; where it is nested
    in this one (--out X --hf X/hf), the entry that holds it is the export's own."""
    from txl_dist.interop.hf_files import CONFIG_NAME
    from txl_dist.interop.native import MODEL_CONFIG_NAME, TOKENIZER_NAME, TOKENIZER_SHA256_KEY, WEIGHTS_NAME
    from txl_dist.output_paths import PROBE_PREFIX

    folder = Path(folder)
    if not folder.is_dir():
        return []
    config = MODEL_CONFIG_NAME if native else CONFIG_NAME
    ours = (config, WEIGHTS_NAME, TOKENIZER_NAME)
    nested = Path(other).resolve() if other is not None else None

    def holds_the_other_folder(entry: Path) -> bool:
        # An export that failed or was stopped after it made the nested folder and before it wrote this one's
        # config (which comes last) left that folder here: it must not need --overwrite to run again.
        return nested is not None and (entry.resolve() == nested or entry.resolve() in nested.parents)

    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(PROBE_PREFIX) and not any(
        p.name.startswith(f".{name}.") and p.name.endswith(".tmp") for name in ours)  # atomic_write's temporaries
        and not holds_the_other_folder(p))
    if not names or set(names) <= {WEIGHTS_NAME}:  # empty, or an export stopped before it wrote its config
        return []
    if config in names:
        if native:  # model_config.json: a folder of ours (save_native)
            return []
        try:  # a config.json launch/export.py wrote records the tokenizer's digest; one of elsewhere does not
            if TOKENIZER_SHA256_KEY in json.loads((folder / config).read_text(encoding="utf-8")):
                return []
        except (OSError, ValueError, TypeError):
            pass
    return names


def check_former_export(folder: str, flag: str, *, native: bool, other: str | None = None) -> None:
    """OutputError for an existing folder holding other files than a former export (foreign_files; other: the
    export's other output folder)."""
    from txl_dist.output_paths import OutputError

    names = foreign_files(folder, native=native, other=other)
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise OutputError(f"{flag} {folder}: holds files that are not those of a former export ({shown}); the export "
                          "would replace them or leave them beside its weights: choose a new or empty folder, or "
                          "pass --overwrite to write into it")


def export(checkpoint: str, out: str, hf: str | None = None, overwrite: bool = False):
    """Build the checkpoint's model on the CPU with its fp32 weights, write the folder(s); returns the model."""
    from txl_dist import checkpoint as ckpt
    from txl_dist.errors import one_line
    from txl_dist.interop import save_native, to_hf
    from txl_dist.interop.hf_files import CONFIG_NAME
    from txl_dist.interop.native import MODEL_CONFIG_NAME, TOKENIZER_NAME, TOKENIZER_SHA256_KEY
    from txl_dist.write_faults import write_fault_line
    from txl_dist.model import TransformerXL
    from txl_dist.startup import open_export

    check_outputs(out, hf, overwrite)
    with open_export(checkpoint) as (tag_dir, run_info, model_cfg):  # held: a training run's retention waits
        # The folders are read elsewhere (another machine, the CPU): the attention path the run trained with
        # ('triton' runs on CUDA only) changes speed, not the weights, so they record "auto".
        model = TransformerXL(dataclasses.replace(model_cfg, attn_impl="auto"))
        ckpt.load_fp32_weights(model, tag_dir, run_info["zero_stage"])
    model.eval()
    tokenizer_sha256 = run_info["tokenizer_sha256"]
    tokenizer = training_tokenizer(run_info["config"]["data"]["path"], tokenizer_sha256, hf is not None)
    # HF generate() stops at config.json's eos_token_id; without one transformers takes 0 (not our end of document).
    hf_extra = {TOKENIZER_SHA256_KEY: tokenizer_sha256, **({"eos_token_id": tokenizer[0]} if tokenizer else {})}
    folders = [Path(out)] + ([Path(hf)] if hf is not None else [])
    configs = list(zip(folders, (MODEL_CONFIG_NAME, CONFIG_NAME)))  # the file that makes each folder an export
    finished: list[Path] = []
    try:
        # What a former export left goes first: its tokenizer (never beside the new weights), and its config. The
        # config is what makes a folder an export; written after the weights, it is the last file of a folder
        # but its tokenizer, which a failure removes again (unfinish_exports). So a folder whose export failed
        # midway holds no config: it loads as nothing, not as the new weights under the old config, and the
        # next export writes into it without --overwrite (foreign_files: weights alone are a stopped export).
        for folder, config_name in configs:
            (folder / TOKENIZER_NAME).unlink(missing_ok=True)
            (folder / config_name).unlink(missing_ok=True)
        # eod_id in model_config.json: to-hf of this folder then writes eos_token_id as --hf does.
        save_native(model, out, tokenizer_sha256, eod_id=tokenizer[0] if tokenizer else None)
        if tokenizer:  # the folders are then all launch/generate.py --model needs
            atomic_write(Path(out) / TOKENIZER_NAME, tokenizer[1])
        finished.append(Path(out))
        if hf is not None:
            to_hf(model, hf, extra_config=hf_extra)
            if tokenizer:
                atomic_write(Path(hf) / TOKENIZER_NAME, tokenizer[1])
            finished.append(Path(hf))
    except BaseException as e:  # the folders were checked at the start: a full disk, a read-only remount, a
        # folder removed; SIGTERM, Ctrl-C (the file being written is removed: atomic.atomic_path); or a bug, out of
        # memory: whatever ends it, no unfinished folder keeps a config that would make it look finished
        unfinished = [folder for folder in folders if folder not in finished]
        unfinish_exports([(folder, name) for folder, name in configs if folder in unfinished])
        left = " and ".join(str(folder) for folder in unfinished)
        if isinstance(e, Terminated):
            raise Terminated(f"export stopped {e.by} while writing {unfinished[0]}; {left} hold(s) no complete "
                             "export (no config), run the export again", by=e.by) from None
        if not isinstance(e, OSError):  # Ctrl-C, or an error of the process: its traceback
            raise
        line = write_fault_line(e, unfinished[0], "export to a folder elsewhere") or one_line(e, limit=500)
        raise RunFailed(f"export failed: {line}; {left} hold(s) no complete export (no config), run the export "
                        "again") from None
    return model


def unfinish_exports(configs: list[tuple[Path, str]]) -> None:
    """Remove the config of each (folder, config name) whose export failed (best effort: the disk is failing):
    a folder whose weights and config were written before its tokenizer failed would otherwise look finished."""
    for folder, name in configs:
        try:
            (folder / name).unlink(missing_ok=True)
        except OSError:  # a read-only file system: then nothing of this export was written there either
            pass


def training_tokenizer(corpus: str, tokenizer_sha256: str, hf: bool) -> tuple[int, bytes] | None:
    """(end-of-document id, tokenizer.model's bytes) of the corpus the checkpoint was trained on, checked
    against the digest the checkpoint recorded; None with one warning (naming what the export then lacks)
    when the corpus cannot be read or holds another tokenizer by now."""
    from txl_dist.data import read_manifest
    from txl_dist.errors import Refused, one_line

    lacking = ("no tokenizer.model in the exported folders (launch/generate.py --model then needs --tokenizer)" +
               (" and no eos_token_id in the HuggingFace config.json (transformers then takes 0)" if hf else ""))
    log = logging.getLogger("txl_dist")
    try:
        tokenizer = read_manifest(corpus).tokenizer
        model_bytes = (Path(corpus) / tokenizer.file).read_bytes()
    except (Refused, OSError) as e:
        log.warning("export: %s: the training corpus %s cannot be read (%s)", lacking, corpus, one_line(e, limit=200))
        return None
    if tokenizer.sha256 != tokenizer_sha256 or hashlib.sha256(model_bytes).hexdigest() != tokenizer_sha256:
        log.warning("export: %s: the corpus %s has another tokenizer than the checkpoint was trained with",
                    lacking, corpus)
        return None
    return tokenizer.eod_id, model_bytes


def main(argv: list[str] | None = None) -> int:
    """Export; prints where the folders went."""
    args = parse_args(argv)
    log = logging.getLogger("txl_dist")

    def job() -> int:
        try:
            with stop_at_once():
                export(args.checkpoint, args.out, args.hf, args.overwrite)
        except Terminated as e:
            if e.args:  # export's own line: it stopped while writing
                raise
            raise Terminated(f"export stopped {e.by} before writing; nothing written") from None
        finish_despite_sigterm()  # the folders are complete
        done = f"exported {args.checkpoint} -> {args.out}" + (f" and {args.hf} (HuggingFace)" if args.hf else "")
        try:
            print_result(done)
        except RunFailed:  # stdout on a full disk: the folders are complete all the same, so not a failure
            log.warning("%s (said here: the standard output cannot be written, its disk is full or read-only)", done)
        return 0

    return guarded(job, log)


if __name__ == "__main__":
    exit_process(main())
