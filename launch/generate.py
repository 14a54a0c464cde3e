"""Generate text from a trained Transformer-XL, decoding incrementally against its memory.

    python launch/generate.py --checkpoint PATH --prompt TEXT [--max-new-tokens 100] [--temperature 1.0]
                              [--top-k 0] [--top-p 1.0] [--greedy] [--seed N] [--num-samples 1] [--mem-len M]
    python launch/generate.py --model DIR --prompt-file prompt.txt   (- : standard input)

PATH is a run folder, its checkpoints/ folder (the newest complete tag) or a step_* tag, verified against its
checksums and read with weights-only unpickling; its text goes through the SentencePiece model of the corpus
it was trained on (data.path of its configuration, checked against the tokenizer's sha256 it recorded), or
--tokenizer. DIR is an exported native folder (launch/export.py --out) or a HuggingFace Transformer-XL folder
(config.json + weights); its tokenizer is --tokenizer, else DIR/tokenizer.model (launch/export.py writes
it), checked against the tokenizer's sha256 the folder records (tokenizer_sha256, which launch/export.py
writes; an older folder without it is not checked). Sampling stops at the end-of-document id: the corpus
manifest's when --tokenizer is a corpus folder, else the one DIR records (eod_id in model_config.json,
eos_token_id in config.json), else the tokenizer's <eod> piece or its eos id. The prompt starts a new
document (the end-of-document id goes first, as in the training stream) unless --continue-document; an empty
--prompt '' generates a document from nothing. One process; CPU unless --device cuda. Exit status 0,
2 for refused input (one line says why), 143 for SIGTERM or SIGUSR1 before the samples are printed (one line
says so).
Only the samples go to stdout (whatever a library prints meanwhile goes to stderr), so --json output can be
parsed as it is.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from txl_dist.stop_request import (Terminated, catch_sigterm_early, finish_despite_sigterm,  # standard library only
                                   stop_at_once)

if __name__ == "__main__":
    catch_sigterm_early()  # a SIGTERM during the imports: the job's line too, not a silent death

from txl_dist.cli_args import ArgumentParser  # noqa: E402
from txl_dist.entry import exit_process, guarded, print_result  # noqa: E402

EXAMPLES = """examples:
  python launch/generate.py --checkpoint runs/tiny --prompt 'ROMEO:' --max-new-tokens 60 --seed 0
  python launch/generate.py --checkpoint runs/tiny/checkpoints/step_00000600 --prompt-file p.txt \\
      --num-samples 3 --temperature 0.8 --top-k 40 --top-p 0.95 --json
  python launch/generate.py --model exported/tiny --prompt 'KING' --greedy
  python launch/generate.py --checkpoint runs/tiny --prompt-file - --seed 0 < prompt.txt    # - : standard input

The printed text is the prompt and the samples as the tokenizer decodes them: a tokenizer that normalises
text (the Shakespeare corpus' removes extra whitespace and has no newline piece) prints the prompt
normalised ("  two  spaces\\nand" as "two spaces and"); --json's "prompt" is the text as given. Prompt text a
tokenizer without byte fallback has no piece for is read as its unknown id and printed as ⁇ (one warning line on
stderr counts them).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = ArgumentParser(prog="launch/generate.py", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    src = p.add_argument_group("model (one of)")
    src.add_argument("--checkpoint", default=None, help="run folder, checkpoint folder or a step_* tag")
    src.add_argument("--model", default=None, metavar="DIR",
                     help="exported native folder (model_config.json) or HuggingFace folder (config.json)")
    src.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="corpus folder (its manifest names the tokenizer) or a SentencePiece .model file "
                          "(default: the checkpoint's corpus, or DIR/tokenizer.model)")
    text = p.add_argument_group("prompt (one of)")
    text.add_argument("--prompt", default=None, help="prompt text ('' = start a document from nothing)")
    text.add_argument("--prompt-file", default=None, metavar="FILE",
                      help="read the prompt from this UTF-8 file ('-': standard input)")
    text.add_argument("--continue-document", action="store_true",
                      help="the prompt continues a document (default: it starts one after an end-of-document)")
    dec = p.add_argument_group("decoding")
    dec.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate per sample (default 100)")
    dec.add_argument("--num-samples", type=int, default=1, help="samples of the same prompt (default 1)")
    dec.add_argument("--temperature", type=float, default=1.0, help="> 0; below 1 sharper (default 1.0)")
    dec.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0 = all)")
    dec.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    dec.add_argument("--greedy", action="store_true", help="always the most probable token (no sampling)")
    dec.add_argument("--seed", type=int, default=None,
                     help="sampling seed in [0, 2**64 - 1] (default: random, printed with --json)")
    dec.add_argument("--ignore-eod", action="store_true",
                     help="keep generating past an end-of-document (default: a sample ends there)")
    mem = p.add_argument_group("memory")
    mem.add_argument("--mem-len", type=int, default=None,
                     help="hidden states kept per layer (default: the model's mem_len + tgt_len)")
    mem.add_argument("--clamp-len", type=int, default=None, help="default: the model's clamp_len")
    mem.add_argument("--chunk-len", type=int, default=None,
                     help="prompt tokens read per forward (default: the model's tgt_len)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--json", action="store_true", help="print one JSON object (settings, ids, texts)")
    return p.parse_args(argv)


@dataclass
class Loaded:
    """A model ready to generate and the tokenizer of its text."""

    model: object
    tokenizer: object
    source: str
    """What was loaded (the verified tag folder, or the model folder)."""


def load(checkpoint: str | None, model_dir: str | None, tokenizer: str | None, device: str = "cpu") -> Loaded:
    """The model (fp32, eval mode, on `device`) and its tokenizer; every problem is one refused line."""
    import torch

    from txl_dist.generation import GenerationError
    from txl_dist.interop.native import recorded_eod_id

    if (checkpoint is None) == (model_dir is None):
        raise GenerationError("pass exactly one of --checkpoint PATH (a run, checkpoints/ folder or step_* tag) "
                              "and --model DIR (an exported native or HuggingFace folder)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GenerationError(f"--device {device}: CUDA is not available here; use --device cpu")
    if checkpoint is not None:
        model, source, expected_sha, default_tok = _from_checkpoint(checkpoint)
        recorded_eod = None  # the checkpoint's corpus manifest, found by default, records it
    else:
        model, source, expected_sha, default_tok = _from_folder(model_dir)
        recorded_eod = recorded_eod_id(model_dir)  # a tokenizer loaded with --eod-piece ends documents otherwise
    tok = _tokenizer(tokenizer or default_tok, expected_sha, model.config.vocab_size, source,
                     found_beside=model_dir is not None and tokenizer is None, recorded_eod=recorded_eod)
    try:
        model = model.to(torch.device(device))
    except (RuntimeError, ValueError) as e:
        raise GenerationError(f"--device {device}: {e}; use cpu or cuda[:N]") from None
    return Loaded(model.eval(), tok, source)


def _from_checkpoint(path: str):
    from txl_dist import checkpoint as ckpt
    from txl_dist.model import TransformerXL
    from txl_dist.startup import open_export

    with open_export(path) as (tag_dir, run_info, model_cfg):  # held: a training run's retention waits
        model = TransformerXL(model_cfg)
        # DeepSpeed's ZeRO consolidation prints its progress to stdout and stderr: noise to a user of generate.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ckpt.load_fp32_weights(model, tag_dir, run_info["zero_stage"])
    corpus = run_info["config"]["data"]["path"]
    return model, str(tag_dir), run_info["tokenizer_sha256"], corpus


def _from_folder(path: str):
    from txl_dist.errors import where_relative
    from txl_dist.generation import GenerationError
    from txl_dist.interop import from_hf, load_native, recorded_tokenizer_sha256
    from txl_dist.interop.native import MODEL_CONFIG_NAME, TOKENIZER_NAME

    folder = Path(path)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else f"does not exist{where_relative(path)}"
        raise GenerationError(f"--model {path} {what}; pass a folder written by launch/export.py --out or "
                              "save_pretrained")
    if (folder / MODEL_CONFIG_NAME).is_file():
        model = load_native(folder)
    elif (folder / "config.json").is_file():
        model = from_hf(folder)
    else:
        raise GenerationError(f"--model {path}: neither {MODEL_CONFIG_NAME} (native) nor config.json (HuggingFace) "
                              "is in it; pass a folder written by launch/export.py or save_pretrained")
    # The digest of the tokenizer it was trained with, where the folder records one (launch/export.py does): a
    # tokenizer.model left there by an earlier export, or a wrong --tokenizer, is then refused.
    expected_sha = recorded_tokenizer_sha256(folder)
    default = folder / TOKENIZER_NAME
    return model, str(folder), expected_sha, str(default) if default.is_file() else None


def _tokenizer(path: str | None, expected_sha: str | None, vocab_size: int, source: str, found_beside: bool = False,
               recorded_eod: int | None = None):
    """The SentencePiece model at `path` (a corpus folder or a .model file) as a generation Tokenizer, checked
    against expected_sha where known; found_beside: `path` is the model folder's own tokenizer.model. The end of
    document: a corpus manifest's, else `recorded_eod` (the model folder's), else the .model file's own guess."""
    from txl_dist.data import read_manifest
    from txl_dist.data.format import sha256_file
    from txl_dist.generation import GenerationError, Tokenizer

    if path is None:
        raise GenerationError(f"{source} has no tokenizer.model; pass --tokenizer CORPUS_DIR (or the "
                              "SentencePiece .model file the model was trained with)")
    where = Path(path)
    if where.is_dir():
        manifest = read_manifest(where)
        model_file, eod_id = where / manifest.tokenizer.file, manifest.tokenizer.eod_id
    elif where.is_file():
        model_file, eod_id = where, recorded_eod
    else:
        raise GenerationError(f"tokenizer {path} does not exist (the model's corpus moved?); pass --tokenizer "
                              "CORPUS_DIR or a SentencePiece .model file")
    if expected_sha is not None and sha256_file(model_file) != expected_sha:
        left = " (a file another model's export left there?)" if found_beside else ""
        raise GenerationError(f"{model_file} is not the tokenizer {source} was trained with (sha256 differs){left}; "
                              "pass --tokenizer with the corpus it was trained on")
    tok = Tokenizer(str(model_file), eod_id)
    if tok.vocab_size != vocab_size:
        raise GenerationError(f"the tokenizer {model_file} has {tok.vocab_size} pieces, the model a vocabulary of "
                              f"{vocab_size}; pass the tokenizer the model was trained with")
    return tok


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt text from --prompt or --prompt-file (exactly one)."""
    from txl_dist.generation import GenerationError

    if (prompt is None) == (prompt_file is None):
        raise GenerationError("pass exactly one of --prompt TEXT and --prompt-file FILE (--prompt '' starts a "
                              "document from nothing)")
    if prompt is not None:
        return prompt
    try:
        if prompt_file == "-":  # standard input, as bytes: UTF-8 whatever the locale's encoding
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--prompt-file {prompt_file}: cannot read it ({type(e).__name__}); pass a UTF-8 "
                              "text file") from None


def check_args(args: argparse.Namespace):
    """The decoding settings, refused with one line naming the option before any model is loaded."""
    from txl_dist.generation import GenerationError, SamplingSettings, check_seed

    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 0), ("--num-samples", args.num_samples, 1),
                             ("--mem-len", args.mem_len, 0), ("--chunk-len", args.chunk_len, 1)):
        if value is not None and value < low:
            raise GenerationError(f"{flag} must be >= {low}, got {value}")
    if args.top_k < 0:
        raise GenerationError(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise GenerationError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if not args.greedy and not 0 < args.temperature < float("inf"):
        raise GenerationError(f"--temperature must be a finite number > 0 when sampling, got {args.temperature}; "
                              "use --greedy for the most probable token")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise GenerationError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    check_seed(args.seed, "--seed")
    return SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy)


def check_memory_for_samples(config, args: argparse.Namespace) -> None:
    """Refuse --num-samples whose memories alone (fp32, every layer's, for the whole batch of samples) exceed
    the memory free on the device: one line instead of an allocation failure in the middle of decoding."""
    import psutil
    import torch

    from txl_dist.generation import GenerationError, default_mem_len

    mem_len = default_mem_len(config) if args.mem_len is None else args.mem_len  # the session's own default
    window = mem_len + (args.chunk_len or config.tgt_len)
    need = args.num_samples * (config.n_layer + 1) * window * config.d_model * 4
    if args.device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(args.device))[0]
    else:
        free = psutil.virtual_memory().available
    if need > free:
        raise GenerationError(f"--num-samples {args.num_samples}: their memories alone need {need / 2**30:,.1f} GiB, "
                              f"more than the {free / 2**30:,.1f} GiB free on {args.device}; generate fewer at a "
                              "time")


def samples_output(args: argparse.Namespace) -> str:
    """Load, generate and format the samples: the text, or one JSON object with --json."""
    import torch

    from txl_dist.generation import GenerationError, generate

    sampling = check_args(args)
    prompt = read_prompt(args.prompt, args.prompt_file)
    loaded = load(args.checkpoint, args.model, args.tokenizer, args.device)
    check_memory_for_samples(loaded.model.config, args)
    tok = loaded.tokenizer
    prompt_ids = tok.encode(prompt, start_of_document=not args.continue_document)
    if not prompt_ids:
        raise GenerationError("--continue-document needs a prompt with at least one token")
    unknown = prompt_ids.count(tok.unk_id)
    if unknown:  # otherwise silent: the model reads <unk> and the printed prompt shows each as " ⁇ "
        logging.getLogger("txl_dist").warning(
            "warning: %d piece(s) of the prompt are not in the tokenizer's vocabulary: the model reads each as its "
            "unknown id (printed as ⁇); text of the training corpus' characters and words avoids it", unknown)
    seed = args.seed if args.seed is not None else int(torch.seed() % 2**31)
    samples = generate(loaded.model, prompt_ids, args.max_new_tokens, sampling, num_samples=args.num_samples,
                       stop_id=None if args.ignore_eod else tok.eod_id, seed=seed, mem_len=args.mem_len,
                       clamp_len=args.clamp_len, chunk_len=args.chunk_len)
    # Decoded with the prompt, so that pieces join across the boundary as they would in the corpus.
    texts = [tok.decode(prompt_ids + ids) for ids in samples]
    if args.json:
        return json.dumps({"source": loaded.source, "prompt": prompt, "prompt_ids": prompt_ids, "seed": seed,
                           "sampling": dataclasses.asdict(sampling), "samples": [
                               {"ids": ids, "text": text} for ids, text in zip(samples, texts)]}, indent=2)
    if len(texts) == 1:
        return texts[0]
    return "\n".join(f"--- sample {i + 1} of {len(texts)} ---\n{text}" for i, text in enumerate(texts))


def main(argv: list[str] | None = None) -> int:
    """Generate and print the samples (text, or one JSON object with --json); nothing else goes to stdout."""
    args = parse_args(argv)
    log = logging.getLogger("txl_dist")
    if not log.hasHandlers():  # a command line: the progress of a long prompt's reading (info) goes to stderr too
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

    def job() -> int:
        # stdout is for the samples (a program parses --json from it). What the libraries print meanwhile goes
        # to stderr: DeepSpeed, imported with the checkpoint readers, logs to stdout (its accelerator warning
        # when DS_ACCELERATOR is unset), through a handler bound to the sys.stdout it finds at import.
        try:
            with stop_at_once(), contextlib.redirect_stdout(sys.stderr):
                output = samples_output(args)
        except Terminated as e:  # a time limit, kill, its launcher gone: the samples are printed once all are made
            raise Terminated(f"generation stopped {e.by}; no sample printed") from None
        finish_despite_sigterm()  # the samples exist: printing them takes milliseconds
        print_result(output)
        return 0

    return guarded(job, log)


if __name__ == "__main__":
    exit_process(main())
