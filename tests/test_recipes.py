"""The recipes (docs/recipes.md): the presets they run, the enwik8 recipe's tokenizer options (every byte of
the text kept), and bench/learning_vs_reference.py at toy size.

The learning-quality benchmark hands our weights, batches, learning rates and evaluation windows to the
reference (transformers 4.37.2 in `.venv-ref`); with dropout off nothing random is left, so both sides must
follow the same loss curve and reach the same test loss: a wrong handover (a shifted batch, another learning
rate, other memory settings) shows up as a difference.
"""
from __future__ import annotations

import json
import math
import shlex

import pytest

from bench.learning_vs_reference import main as learning_vs_reference
from bench.learning_vs_reference import warmup_cosine_lr
from corpus_helpers import make_corpus, split_ids, synthetic_stream, tricky_text
from dist_helpers import REPO
from hf_reference.refvenv import reference_python  # noqa: F401  (fixture)
from txl_dist.config import load_config
from txl_dist.data.format import Layout
from test_config import CONFIGS

PAPER_EVAL = {  # Dai et al. 2019, evaluation of the large models: tgt_len, mem_len, clamp_len, same_length
    "large": (128, 1600, 1000, True),  # WikiText-103, 18.3 ppl
    "enwik8_large": (128, 3800, 1000, True),  # enwik8, 0.99 bpc
}


def test_the_paper_presets_evaluate_with_the_papers_memory_settings():
    for name, expected in PAPER_EVAL.items():
        ev = load_config(CONFIGS[0].parent / f"{name}.json").eval
        assert (ev.tgt_len, ev.mem_len, ev.clamp_len, ev.same_length) == expected, name


def test_the_cpu_ptb_preset_is_shipped_and_fits_one_or_two_ranks():
    cfg = load_config(CONFIGS[0].parent / "ptb_cpu.json")
    assert cfg.data.path == "data/ptb"
    for world_size in (1, 2):
        ds = cfg.deepspeed_config(world_size)
        assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world_size == 16


def test_the_learning_rates_follow_deepspeeds_warmup_cosine():
    params = {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}
    lrs = [warmup_cosine_lr(step, 10, 1.0, params) for step in range(10)]
    assert lrs[:4] == [0.0, 0.25, 0.5, 0.75]
    assert lrs[3] < lrs[4] and lrs[4] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 6)) / 2)
    assert lrs[-1] == pytest.approx(0.1)


def recipe_prepare_options(corpus: str) -> list[str]:
    """The options of docs/recipes.md's `python -m data_prep prepare --out CORPUS` command, but for its inputs
    and layout (those of the test go in their place)."""
    text = (REPO / "docs" / "recipes.md").read_text().replace("\\\n", " ")
    [command] = [line for line in text.splitlines() if line.startswith(f"python -m data_prep prepare --out {corpus} ")]
    args, kept = shlex.split(command)[4:], []
    while args:
        option = args.pop(0)
        if option in ("--out", "--train", "--valid", "--test", "--world-size", "--n-streams"):
            args.pop(0)
        else:
            kept.append(option)
    return kept


def test_the_enwik8_recipe_keeps_every_byte_of_the_text(tmp_path):
    """The recipe's tokenizer options on text of newlines, blank lines, tabs, runs of spaces and characters of
    many scripts, where valid and test hold characters that train lacks: no split has an <unk>, each decodes
    to its text (as prepare reads it: CRLF and CR kept) and counts all its bytes, so its bits per byte are those
    of the text. A char model's vocabulary is its training characters plus the end-of-document, unknown,
    newline and 256 byte pieces (a CR, where the tokenizer's training lines end, is a byte piece): the recipe's
    --vocab-size 6000 is a maximum, not refused."""
    import sentencepiece as spm

    from data_prep.cli import main as prep

    texts = {}
    for split, seed, extra in (("train", 1, ""), ("valid", 2, "Ω ∮ 😺\x01"), ("test", 3, "\u00ad ꙮ")):
        (tmp_path / f"{split}.txt").write_bytes((tricky_text(600, seed) + extra).encode())
        with open(tmp_path / f"{split}.txt", encoding="utf-8", newline="") as f:  # as prepare reads: CR kept
            texts[split] = f.read()
    corpus = tmp_path / "enwik8"
    assert prep(["prepare", "--out", str(corpus), *(f"--{s}={tmp_path / s}.txt" for s in texts),
                 *recipe_prepare_options("data/enwik8"), "--num-proc", "1", "--quiet"]) == 0
    manifest = json.loads((corpus / "manifest.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(corpus / "tokenizer.model"))
    # SentencePiece's one lossy character: its visible space "▁" (U+2581), which spaces become, decodes as one.
    visible_space = "\u2581"
    characters = set(texts["train"].replace(" ", visible_space)) - {"\n", "\r"}
    assert manifest["tokenizer"]["vocab_size"] == 2 + 1 + 256 + len(characters)  # <unk> <eod>, "\n", bytes
    for split, text in texts.items():
        ids = split_ids(corpus, split)
        assert (ids != sp.unk_id()).all(), split
        assert ids[-1] == sp.eos_id() and (ids == sp.eos_id()).sum() == 1
        assert sp.decode(ids[:-1].tolist()) == text.replace(visible_space, " "), split
        assert manifest["splits"][split]["n_bytes"] == len(text.encode())
    assert any(sp.is_byte(i) for i in split_ids(corpus, "valid").tolist())  # characters train lacks: bytes
    for text in ("a\n\n\nb", "a\tb", "a   b", "  lead\n\n trail  ", "\n", "ünï 日本 😀 \x01"):
        assert sp.decode(sp.encode(text)) == text


TOY_VOCAB = 97
TOY_SETTINGS = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
                "model.cutoffs=[40,70]", "model.tgt_len=8", "model.mem_len=8", "eval.tgt_len=8", "eval.mem_len=16",
                "eval.clamp_len=6", "eval.n_streams=2", "deepspeed.train_batch_size=4",
                "deepspeed.train_micro_batch_size_per_gpu=4", "deepspeed.scheduler.params.warmup_num_steps=3"]


def toy_corpus(root):
    return make_corpus(root, {"train": synthetic_stream(4000, TOY_VOCAB, seed=1),
                              "valid": synthetic_stream(600, TOY_VOCAB, seed=2),
                              "test": synthetic_stream(600, TOY_VOCAB, seed=3)},
                       layout=Layout(1, 4), vocab_size=TOY_VOCAB)


def run_toy(corpus, out, *extra: str, settings: list[str] = ()) -> dict:
    """bench/learning_vs_reference.py at toy size on one seed; its JSON."""
    argv = ["--config", str(CONFIGS[0].parent / "tiny.json"), "--corpus", str(corpus), "--seeds", "5",
            "--json-out", str(out), *extra]
    for item in [*TOY_SETTINGS, *settings]:
        argv += ["--set", item]
    assert learning_vs_reference(argv) == 0
    return json.loads(out.read_text())


def test_without_dropout_both_sides_follow_the_same_curve(tmp_path, reference_python):  # noqa: F811
    results = run_toy(toy_corpus(tmp_path / "corpus"), tmp_path / "result.json", "--steps", "6", "--checkpoints", "1",
                      settings=["model.dropout=0.0"])["results"]
    ours, ref = results["txl-dist"]["5"], results["reference"]["5"]
    assert len(ours["train_loss"]) == len(ref["train_loss"]) == 6
    assert ours["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-4)
    assert ours["train_loss"][-1] < ours["train_loss"][0]  # it learned, so the comparison compares something
    # Every test token but the first of each of the 2 streams is predicted once, on both sides.
    assert ours["eval_tokens"] == ref["eval_tokens"] == 600 - 2
    assert ours["eval_nll_sum"] / ours["eval_tokens"] == pytest.approx(ref["eval_nll_sum"] / ref["eval_tokens"],
                                                                       abs=1e-4)


def test_checkpoint_evaluations_leave_training_bitwise_unchanged(tmp_path, reference_python):  # noqa: F811
    """Dropout on: the evaluations at checkpoints 3, 6 and 9 (eval mode, their own memory settings, the same RNG)
    must give back the train mode, the training memory settings and the RNG state, on both sides."""
    corpus = toy_corpus(tmp_path / "corpus")
    plain = run_toy(corpus, tmp_path / "plain.json", "--steps", "9", "--checkpoints", "1")["results"]
    checked = run_toy(corpus, tmp_path / "checked.json", "--steps", "9", "--checkpoints", "3")["results"]
    for side in ("txl-dist", "reference"):
        a, b = plain[side]["5"], checked[side]["5"]
        assert [c["step"] for c in b["checkpoints"]] == [3, 6, 9] and len(a["checkpoints"]) == 1
        assert b["train_loss"] == a["train_loss"], side  # bitwise: every dropout mask and update the same
        assert b["eval_nll_sum"] == a["eval_nll_sum"], side
        # The train clock stops for evaluations: its readings grow with the steps and end at the total.
        times = [c["train_s"] for c in b["checkpoints"]]
        assert times == sorted(times) and times[-1] == b["train_s"]
    # Dropout made the two sides differ (each draws its own masks), so the sameness above is not the model's.
    assert plain["txl-dist"]["5"]["train_loss"] != plain["reference"]["5"]["train_loss"]
