"""Generation: incremental decoding against cached mems equals re-running the full context; sampling is
reproducible by seed and filters as documented; a session saved and restored continues identically; the CLI
refuses bad arguments with one line and generates text from a checkpoint of a real (tiny) training run, with
nothing but the samples on stdout."""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from dist_helpers import REPO, run_ranks, sentencepiece_corpus, tiny_config
import txl_dist.model.attention as attention
from txl_dist.config import MemorySettings, ModelConfig
from txl_dist.errors import EXIT_REFUSED
from txl_dist.generation import (GenerationError, GenerationSession, SamplingSettings, decoding_attn_impl,
                                 filter_top_k, filter_top_p, generate, next_tokens)
from txl_dist.model import TransformerXL

VOCAB = 50


@pytest.fixture(autouse=True)
def one_thread():
    """Models this small decode many times faster on one thread than on two of a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> TransformerXL:
    """A small random model with an adaptive softmax (two clusters) and pre-norm layers."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=3, d_model=32, n_head=2, d_head=16, d_inner=64, cutoffs=[20],
                      div_val=2, pre_lnorm=True, tgt_len=8, mem_len=8, dropout=0.1)
    return TransformerXL(cfg).eval()


@pytest.fixture(scope="module")
def sharp_model() -> TransformerXL:
    """The same architecture with 10x the initial weights: its log-probs depend strongly on the context and
    on the relative positions (at init_std 0.02 they barely do), so a wrong mem or position shows."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=3, d_model=32, n_head=2, d_head=16, d_inner=64, cutoffs=[20],
                      div_val=2, pre_lnorm=True, tgt_len=8, mem_len=8, dropout=0.1, init_std=0.25,
                      proj_init_std=0.25)
    return TransformerXL(cfg).eval()


def full_recompute(model, context: list[int], n: int, clamp_len: int = -1) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding the obvious way: the whole context through the model (no mems) for every token."""
    context = list(context)
    tokens, log_probs = [], []
    with torch.no_grad():
        for _ in range(n + 1):
            out = model(torch.tensor([context]), memory=MemorySettings(mem_len=0, clamp_len=clamp_len))
            lp = model.log_probs(out.hidden[0, -1])                                 # [V]
            log_probs.append(lp)
            token = int(torch.argmax(lp))
            tokens.append(token)
            context.append(token)
    return tokens[:n], log_probs


@pytest.mark.parametrize("chunk_len, clamp_len", [(1, -1), (5, -1), (64, -1), (5, 4)])
def test_incremental_greedy_equals_full_recompute(sharp_model, chunk_len, clamp_len):
    model = sharp_model
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    n = 20
    # mem_len covers the whole context (13 + 20 tokens); chunk_len 1, a cut prompt, or all of it at once;
    # clamped relative positions too.
    session = GenerationSession(model, mem_len=len(prompt) + n, chunk_len=chunk_len, clamp_len=clamp_len)
    log_probs = [session.feed(prompt)[0]]
    tokens = []
    for _ in range(n):
        tokens.append(int(session.sample(1, SamplingSettings(greedy=True))[0, 0]))
        log_probs.append(session.next_log_probs[0])
    ref_tokens, ref_log_probs = full_recompute(model, prompt, n, clamp_len)
    assert tokens == ref_tokens and len(set(tokens)) > 1
    torch.testing.assert_close(torch.stack(log_probs), torch.stack(ref_log_probs), rtol=1e-5, atol=1e-4)
    # Not a vacuous comparison: the log-probs depend on the clamping and on the first prompt token.
    other_clamp_len = 4 if clamp_len <= 0 else -1
    assert not torch.allclose(full_recompute(model, prompt, 0, other_clamp_len)[1][0], ref_log_probs[0], atol=1e-2)
    assert not torch.allclose(full_recompute(model, prompt[1:], 0, clamp_len)[1][0], ref_log_probs[0], atol=1e-2)
    assert session.n_tokens == len(prompt) + n
    assert all(m.shape == (1, len(prompt) + n, 32) for m in session.mems)


def test_short_memory_differs_from_full_context_and_keeps_cost_bounded(sharp_model):
    """mem_len below the context: each token sees mem_len states (the mems never grow past it), so the
    log-probs differ from the full recompute once the context is longer than mem_len + 1."""
    model = sharp_model
    prompt = list(range(1, 21))
    session = GenerationSession(model, mem_len=4, chunk_len=1)
    session.feed(prompt)
    assert all(m.shape == (1, 4, 32) for m in session.mems)
    _, ref = full_recompute(model, prompt, 0)
    assert not torch.allclose(session.next_log_probs[0], ref[0], atol=1e-2)


def test_generate_matches_the_session_and_is_reproducible_by_seed(model):
    settings = SamplingSettings(temperature=0.9, top_k=20, top_p=0.9)
    a = generate(model, [3, 4, 5], 16, settings, num_samples=3, seed=7)
    b = generate(model, [3, 4, 5], 16, settings, num_samples=3, seed=7)
    c = generate(model, [3, 4, 5], 16, settings, num_samples=3, seed=8)
    assert a == b and a != c
    assert len({tuple(s) for s in a}) > 1  # the samples of one prompt differ from each other
    torch.manual_seed(123)  # the global RNG is not used: reseeding it changes nothing
    assert generate(model, [3, 4, 5], 16, settings, num_samples=3, seed=7) == a
    session = GenerationSession(model, seed=7)
    session.feed([3, 4, 5])
    session.expand(3)
    assert session.sample(16, settings).tolist() == a


def test_stop_id_ends_each_sample_after_it(model):
    samples = generate(model, [1, 2], 40, SamplingSettings(temperature=2.0), num_samples=4, seed=3, stop_id=7)
    unstopped = generate(model, [1, 2], 40, SamplingSettings(temperature=2.0), num_samples=4, seed=3)
    for s, full in zip(samples, unstopped):
        cut = full.index(7) + 1 if 7 in full else len(full)
        assert s == full[:cut]
    assert any(s[-1] == 7 for s in samples), "the test needs a sample that stops"



def with_attn_impl(model: TransformerXL, attn_impl: str) -> TransformerXL:
    """A copy of model (same weights) whose forwards use attn_impl, as a run that chose it has."""
    twin = copy.deepcopy(model)
    twin.attn_impl = attn_impl
    return twin


def test_decoding_attn_impl_replaces_only_flex_and_triton():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decoding_attn_impl("flex", cpu, torch.float32) == "matmul"
    assert decoding_attn_impl("flex", cuda, torch.bfloat16) == "matmul"
    assert decoding_attn_impl("flex", cpu, torch.bfloat16) in ("matmul", "sdpa")  # auto's choice for this CPU
    for name in ("auto", "matmul", "sdpa", "reference"):
        assert decoding_attn_impl(name, cpu, torch.float32) == name == decoding_attn_impl(name, cuda, torch.bfloat16)
    # A model trained with the fused Triton kernels decodes with auto's static choice too (one query row).
    assert decoding_attn_impl("triton", cpu, torch.float32) == "matmul"
    assert decoding_attn_impl("triton", cuda, torch.bfloat16) == "matmul"


def test_a_flex_model_decodes_without_flex_exactly_like_matmul(sharp_model, monkeypatch):
    """A run that chose flex: its compiled kernel has static shapes, and decoding brings a new key length with
    every token (a compile each, then an eager fallback). The session decodes with another implementation of
    the same math: flex is never called, and the tokens and log-probs are those of a matmul model."""
    flex_calls = []
    # Counts every call of the compiled flex_attention; hands out the eager one, so nothing compiles regardless.
    monkeypatch.setattr(attention, "_compiled_flex_attention", lambda: flex_calls.append(1) or flex_attention)
    flex, matmul = with_attn_impl(sharp_model, "flex"), with_attn_impl(sharp_model, "matmul")
    impls_seen = []
    flex.register_forward_pre_hook(lambda module, args, kwargs: impls_seen.append(kwargs.get("attn_impl")),
                                   with_kwargs=True)
    prompt = [3, 4, 5, 6, 7]
    # mem_len 12 < 5 + 24 tokens: the memory grows one token per forward, then stays full.
    kwargs = dict(num_samples=3, seed=7, mem_len=12, chunk_len=2)
    for settings in (SamplingSettings(greedy=True), SamplingSettings(temperature=0.9, top_k=20)):
        samples = generate(flex, prompt, 24, settings, **kwargs)
        assert samples == generate(matmul, prompt, 24, settings, **kwargs)
        assert len({tuple(s) for s in samples}) > 1 or settings.greedy  # seeded samples that differ
    sessions = [GenerationSession(m, mem_len=12, chunk_len=2, seed=3) for m in (flex, matmul)]
    for session in sessions:
        session.feed(prompt)
        session.sample(8, SamplingSettings(temperature=0.9))
    assert torch.equal(sessions[0].next_log_probs, sessions[1].next_log_probs)
    assert flex_calls == [] and set(impls_seen) == {"matmul"}
    assert flex.attn_impl == "flex"  # the model's own choice, for its other callers


def test_each_forward_is_told_its_implementation_and_the_model_keeps_its_own(sharp_model):
    """The session passes the decoding implementation to every forward (no attribute of a model that other
    callers share is switched); any choice but flex is the session's too."""
    for impl, expected in [("flex", "matmul"), ("sdpa", "sdpa"), ("matmul", "matmul")]:
        model = with_attn_impl(sharp_model, impl)
        seen = []
        model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("attn_impl")),
                                        with_kwargs=True)
        generate(model, [1, 2, 3], 4, SamplingSettings(greedy=True), chunk_len=2)
        assert seen and set(seen) == {expected}, (impl, seen)
        assert model.attn_impl == impl


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, -2.0], [0.0, 0.1, 0.2, 0.3, 0.4]])
    kept = torch.isfinite(filter_top_k(logits, 2))
    assert kept.tolist() == [[False, True, True, True, False], [False, False, False, True, True]]  # ties stay
    assert torch.equal(filter_top_k(logits, 0), logits) and torch.equal(filter_top_k(logits, 5), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15], [0.97, 0.01, 0.01, 0.01]])
    logits = probs.log()
    assert torch.isfinite(filter_top_p(logits, 0.8)).tolist() == [[False, True, True, False],
                                                                 [True, False, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.81)).tolist()[0] == [False, True, True, True]
    assert torch.isfinite(filter_top_p(logits, 1e-6)).sum(-1).tolist() == [1, 1]  # the most probable stays
    # Against an independent computation: random rows, the kept set is the sorted prefix reaching p.
    rows = torch.randn(200, 30, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.3, 0.9):
        kept = torch.isfinite(filter_top_p(rows, p))
        for row, k in zip(rows, kept):
            order = torch.argsort(row, descending=True).tolist()
            probs_sorted = torch.softmax(row.double(), -1)[order].tolist()
            n, mass = 0, 0.0
            while mass < p:
                mass += probs_sorted[n]
                n += 1
            assert sorted(order[:n]) == torch.nonzero(k).flatten().tolist()


def test_sampling_follows_the_filtered_distribution():
    log_probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().expand(20000, -1)
    counts = torch.bincount(next_tokens(log_probs, SamplingSettings(top_k=2), torch.Generator().manual_seed(0)),
                            minlength=4).double() / 20000
    torch.testing.assert_close(counts, torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.double), atol=0.02, rtol=0)
    counts = torch.bincount(next_tokens(log_probs, SamplingSettings(temperature=0.5), torch.Generator().manual_seed(0)),
                            minlength=4).double() / 20000
    sharp = torch.tensor([0.16, 0.09, 0.04, 0.01], dtype=torch.double)
    torch.testing.assert_close(counts, sharp / sharp.sum(), atol=0.02, rtol=0)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_like_greedy(model, temperature):
    # Near-uniform rows (every log-prob about -4.2): divided by 1e-38 in float32 they all overflowed to -inf,
    # and 1e-300 itself rounded to 0 in float32, so multinomial met NaN.
    log_probs = torch.log_softmax(torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0)) * 0.1, -1)
    tiny = SamplingSettings(temperature=temperature)
    assert next_tokens(log_probs, tiny, torch.Generator().manual_seed(0)).tolist() == log_probs.argmax(-1).tolist()
    prompt = [1, 5, 9, 2]
    assert generate(model, prompt, 6, tiny, num_samples=2, seed=3) == \
        generate(model, prompt, 6, SamplingSettings(greedy=True), num_samples=2)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-6])
def test_a_tiny_top_p_keeps_the_most_probable_token(top_p):
    # 1e-46 is 0 in float32: every token's mass-before (0 for the best one) reached it, and all were dropped.
    log_probs = torch.log_softmax(torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    assert torch.isfinite(filter_top_p(log_probs, top_p)).sum(-1).tolist() == [1] * 16
    for temperature in (1.0, 1e-38):
        chosen = next_tokens(log_probs, SamplingSettings(temperature=temperature, top_p=top_p, top_k=3),
                             torch.Generator().manual_seed(0))
        assert chosen.tolist() == log_probs.argmax(-1).tolist()


def test_session_save_and_restore_continues_identically(model, tmp_path):
    settings = SamplingSettings(temperature=1.0, top_p=0.95)
    session = GenerationSession(model, mem_len=12, chunk_len=3, seed=5)
    session.feed([1, 2, 3, 4, 5, 6, 7])
    session.expand(2)
    session.sample(4, settings)
    torch.save(session.state_dict(), tmp_path / "session.pt")
    expected = [session.sample(6, settings), session.feed([[9, 9], [8, 8]]), session.sample(5, settings)]

    restored = GenerationSession(model, mem_len=12, chunk_len=3, seed=999)  # the RNG comes from the state
    restored.load_state_dict(torch.load(tmp_path / "session.pt", weights_only=True))
    assert restored.n_tokens == 7 + 4 and restored.batch_size == 2
    got = [restored.sample(6, settings), restored.feed([[9, 9], [8, 8]]), restored.sample(5, settings)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)

    with pytest.raises(GenerationError, match="mem_len=12.*mem_len=20"):
        GenerationSession(model, mem_len=20).load_state_dict(session.state_dict())
    with pytest.raises(GenerationError, match="version"):
        GenerationSession(model, mem_len=12).load_state_dict({**session.state_dict(), "version": 99})


def test_session_refusals(model):
    session = GenerationSession(model)
    with pytest.raises(GenerationError, match="feed at least one token"):
        session.sample(1)
    with pytest.raises(GenerationError, match=r"token ids must be in \[0, 50\)"):
        session.feed([1, 50])
    with pytest.raises(GenerationError, match=r"token ids must be integers, got torch.float32"):
        session.feed([1.7, 2.0])                          # not truncated to [1, 2]
    with pytest.raises(GenerationError, match=r"integer ids \[n\] or \[batch, n\]: expected sequence of length 2"):
        session.feed([[1, 2], [3]])
    with pytest.raises(GenerationError, match=r"must be \[n\] or \[batch, n\] with n >= 1"):
        session.feed([])
    with pytest.raises(GenerationError, match="temperature must be > 0"):
        SamplingSettings(temperature=0.0).check()
    with pytest.raises(GenerationError, match="top_p must be in"):
        SamplingSettings(top_p=1.5).check()
    SamplingSettings(temperature=0.0, greedy=True).check()  # temperature is not used by greedy decoding
    # torch.Generator overflows past 64 bits and maps a negative seed onto a positive one (-1 is 2**64 - 1).
    for seed in (-1, 2**64, 1.5):
        with pytest.raises(GenerationError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
            GenerationSession(model, seed=seed)
    assert GenerationSession(model, seed=2**64 - 1).generator.initial_seed() == 2**64 - 1
    model.train()
    try:
        with pytest.raises(GenerationError, match="model.eval"):
            GenerationSession(model)
    finally:
        model.eval()


# ----------------------------------------------------------------------------------------------------
# The command line


def _train_main(argv):
    from launch.train import main

    return main(argv)


def _generate_main(argv):
    from launch.generate import main

    return main(argv)


WORDS = ("the king queen crown sword night day love war peace lord lady speak hear gentle noble cousin brother "
         "sister father mother heaven earth fire water blood honour grace").split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A corpus with a real SentencePiece model (made by data_prep) and a ZeRO-1 run trained on it for 3 steps."""
    root = tmp_path_factory.mktemp("generation")
    corpus = sentencepiece_corpus(root, WORDS, (12, 2, 2))
    config = root / "config.json"
    # ZeRO 1: the weights go through DeepSpeed's consolidation, which prints (and must not reach --json).
    config.write_text(json.dumps(tiny_config(corpus, root / "run", train={"max_steps": 3},
                                             eval={"at_end": False}, checkpoint={"interval": 0},
                                             deepspeed={"zero_optimization": {"stage": 1}})))
    assert run_ranks(_train_main, 1, ["--config", str(config)]) == [0]
    return corpus, root / "run"


def test_cli_generates_text_from_a_trained_checkpoint(trained, tmp_path, capsys):
    corpus, run = trained
    argv = ["--checkpoint", str(run), "--prompt", "The king", "--max-new-tokens", "12", "--num-samples", "2",
            "--seed", "4", "--top-k", "20", "--ignore-eod", "--json"]
    assert _generate_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert _generate_main(argv) == 0
    assert json.loads(capsys.readouterr().out) == out  # the seed fixes the samples
    assert [len(s["ids"]) for s in out["samples"]] == [12, 12]
    from txl_dist.generation import Tokenizer

    tok = Tokenizer(str(corpus / "tokenizer.model"))
    assert out["prompt_ids"] == tok.encode("The king")  # the eod id first: the prompt starts a document
    for s in out["samples"]:
        assert s["text"] == tok.decode(out["prompt_ids"] + s["ids"]) and s["text"].startswith("The king")

    # Greedy through the CLI equals the Python API on the exported weights; and --model reads that folder.
    from launch.export import export

    model = export(str(run), str(tmp_path / "native"), str(tmp_path / "hf"))
    capsys.readouterr()  # DeepSpeed's consolidation printed its progress
    # HF generate() stops at the corpus' end of document (transformers would take 0 without the key).
    from txl_dist.data import read_manifest

    eod_id = read_manifest(corpus).tokenizer.eod_id
    assert eod_id != 0 and json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == eod_id
    ids = generate(model, tok.encode("The king"), 10, SamplingSettings(greedy=True))[0]
    # A session fed text: the first text starts a document, sample_text continues the text read so far.
    session = GenerationSession(model, tokenizer=tok)
    session.feed("The king")
    texts = session.sample_text(8, SamplingSettings(greedy=True))
    assert session.n_tokens == len(tok.encode("The king")) + 8
    assert "The king" + texts[0] == tok.decode(tok.encode("The king") + ids[:8])
    session.feed(" the queen")
    assert session.n_tokens == len(tok.encode("The king")) + 8 + len(tok.encode(" the queen", False))

    (tmp_path / "prompt.txt").write_text("The king")
    assert _generate_main(["--model", str(tmp_path / "native"), "--tokenizer", str(corpus), "--prompt-file",
                           str(tmp_path / "prompt.txt"), "--max-new-tokens", "10", "--greedy", "--json"]) == 0
    via_folder = json.loads(capsys.readouterr().out)
    ids_no_stop = via_folder["samples"][0]["ids"]
    assert ids_no_stop == ids[:len(ids_no_stop)] and (len(ids_no_stop) == 10 or ids_no_stop[-1] == tok.eod_id)
    # The export wrote the corpus' tokenizer.model into both folders: --model needs no --tokenizer.
    for folder in ("native", "hf"):
        assert (tmp_path / folder / "tokenizer.model").read_bytes() == (corpus / "tokenizer.model").read_bytes()
    assert _generate_main(["--model", str(tmp_path / "hf"), "--prompt", "The king", "--max-new-tokens", "10",
                           "--greedy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"][0]["ids"] == ids_no_stop

    assert _generate_main(["--checkpoint", str(run), "--prompt", "", "--max-new-tokens", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() != ""


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--temperature", "0"], "--temperature must be a finite number > 0 when sampling"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1"),
    (["--mem-len", "-1"], "--mem-len must be >= 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**64 - 1], got -1"),
    (["--seed", str(2**64)], f"--seed must be an integer in [0, 2**64 - 1], got {2**64}"),
    (["--no-prompt"], "pass exactly one of --prompt TEXT and --prompt-file FILE"),
    (["--prompt-file", "missing.txt"], "--prompt-file missing.txt: cannot read it"),
    (["--checkpoint", "nowhere"], "nowhere does not exist (looked for "),
    (["--no-model"], "pass exactly one of --checkpoint PATH"),
    (["--model", "."], "--model .: neither model_config.json (native) nor config.json"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--tokenizer", "missing.model"], "tokenizer missing.model does not exist"),
])
def test_cli_refuses_bad_arguments_with_one_line(trained, tmp_path, monkeypatch, caplog, args, message):
    if "--device" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, run = trained
    monkeypatch.chdir(tmp_path)
    argv = ["--checkpoint", str(run), "--prompt", "The"]
    if "--no-prompt" in args:
        argv, args = argv[:2], []
    elif "--no-model" in args:
        argv, args = argv[2:], []
    elif args[0] in ("--checkpoint", "--model"):
        argv = argv[2:]
    elif args[0] == "--prompt-file":
        argv = argv[:2]
    with caplog.at_level(logging.ERROR, logger="txl_dist"):
        assert _generate_main(argv + args) == EXIT_REFUSED
    err = [r.getMessage() for r in caplog.records]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_cli_warns_once_about_prompt_text_the_tokenizer_has_no_piece_for(trained, capsys, caplog):
    # The fixture's tokenizer has no byte fallback: characters it never saw become its unknown id, which the
    # model reads as such, silently (the printed prompt only showed " ⁇ ").
    _, run = trained
    argv = ["--checkpoint", str(run), "--max-new-tokens", "2", "--seed", "0", "--json"]
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert _generate_main(argv + ["--prompt", "Ω the king ∑"]) == 0
        unknown = json.loads(capsys.readouterr().out)["prompt_ids"].count(0)
        assert _generate_main(argv + ["--prompt", "the king"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert unknown == 2
    assert warnings == ["warning: 2 piece(s) of the prompt are not in the tokenizer's vocabulary: the model reads "
                        "each as its unknown id (printed as ⁇); text of the training corpus' characters and words "
                        "avoids it"]


def test_cli_stdout_is_only_the_json_whatever_the_environment(trained, tmp_path):
    """DeepSpeed logs to stdout when it is imported (without DS_ACCELERATOR: "Setting accelerator to CPU"):
    that goes to stderr, so that a program can parse stdout. A fresh process, as the README runs it."""
    _, run = trained
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "generate.py"), "--checkpoint", str(run),
                           "--prompt", "The king", "--max-new-tokens", "3", "--seed", str(2**64 - 1), "--json"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["seed"] == 2**64 - 1 and len(out["samples"][0]["ids"]) == 3


def test_cli_refusal_is_one_line_on_stderr_and_exit_status_2(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "generate.py"), "--checkpoint", str(tmp_path),
                           "--prompt", "x", "--top-p", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == EXIT_REFUSED and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: --top-p must be in (0, 1] (1 = off), got 2.0"]


def test_cli_model_folder_with_truncated_weights_is_one_line_exit_2(model, tmp_path, caplog):
    from txl_dist.interop import save_native, to_hf

    native, hf = save_native(model, tmp_path / "native"), to_hf(model, tmp_path / "hf")
    for folder in (native, hf):
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="txl_dist"):
            # Refused at the weights, before the tokenizer is looked at (it does not exist).
            assert _generate_main(["--model", str(folder), "--tokenizer", str(tmp_path / "tok.model"),
                                   "--prompt", "x"]) == EXIT_REFUSED
        err = [r.getMessage() for r in caplog.records]
        assert len(err) == 1 and err[0].startswith(f"error: {weights}: cannot read the weights ("), err


# ----------------------------------------------------------------------------------------------------
# Streaming text: characters spelled in byte pieces


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A SentencePiece model with byte fallback (characters outside its pieces are UTF-8 byte pieces), like the
    corpora data_prep makes, and a tiny model of its vocabulary."""
    import io

    import sentencepiece as spm

    from txl_dist.generation import Tokenizer

    model_file = tmp_path_factory.mktemp("byte_tokenizer") / "tokenizer.model"
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))),
                                   model_writer=writer, vocab_size=300, byte_fallback=True,
                                   user_defined_symbols=["<eod>"], minloglevel=2)
    model_file.write_bytes(writer.getvalue())
    tok = Tokenizer(str(model_file))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, cutoffs=[],
                      tgt_len=4, mem_len=4)
    return tok, TransformerXL(cfg).eval()


def force_samples(monkeypatch, ids):
    """Make every sampled token the next of `ids` (one stream)."""
    forced = iter(ids)
    monkeypatch.setattr("txl_dist.generation.next_tokens", lambda *args: torch.tensor([next(forced)]))


def forced_session(byte_tokenizer, monkeypatch, text):
    """A session that has read 'the king' and whose samples are the ids of `text`, in order."""
    tok, small = byte_tokenizer
    force_samples(monkeypatch, tok.encode(text, start_of_document=False))
    session = GenerationSession(small, seed=0, tokenizer=tok)
    session.feed("the king")
    return session


@pytest.mark.parametrize("sizes", [[1] * 10, [2, 3, 1, 4], [4, 6], [10]])
def test_streamed_text_never_splits_a_character_and_joins_into_the_one_call_text(byte_tokenizer, monkeypatch, sizes):
    text = " 日本 é"  # not in the pieces: 3 + 3 + 2 byte pieces
    assert len(byte_tokenizer[0].encode(text, False)) == 10
    session = forced_session(byte_tokenizer, monkeypatch, text)
    parts = [session.sample_text(n)[0] for n in sizes]
    assert not any("\ufffd" in part for part in parts), parts
    assert "".join(parts) == text and session.finish_text() == [""]


def forced_ids_session(byte_tokenizer, monkeypatch, ids):
    """A session that has read 'the king' and whose samples are `ids`, in order."""
    tok, small = byte_tokenizer
    force_samples(monkeypatch, ids)
    session = GenerationSession(small, seed=0, tokenizer=tok)
    session.feed("the king")
    return session


@pytest.mark.parametrize("cut", ["every token", "before the end", "after it", "between the ends", "in a character",
                                 "one call"])
def test_streamed_text_keeps_the_blank_line_between_documents_wherever_a_call_ends(byte_tokenizer, monkeypatch, cut):
    tok, _ = byte_tokenizer
    # A document ends after " the queen" (twice: an empty document between), then " 日" (byte pieces) begins one.
    ids = tok.encode(" the queen", False) + [tok.eod_id, tok.eod_id] + tok.encode(" 日 lord", False)
    end, n = ids.index(tok.eod_id), len(ids)
    whole = tok.decode(tok.encode("the king") + ids)
    assert whole == "the king the queen\n\n日 lord"
    first_byte = next(i for i, token in enumerate(ids) if tok.processor.is_byte(token))
    calls = {"every token": [1] * n, "before the end": [end, n - end], "after it": [end + 1, n - end - 1],
             "between the ends": [end + 1, 1, n - end - 2], "in a character": [first_byte + 1, n - first_byte - 1],
             "one call": [n]}[cut]
    session = forced_ids_session(byte_tokenizer, monkeypatch, ids)
    parts = [session.sample_text(k)[0] for k in calls]
    assert "the king" + "".join(parts) + session.finish_text()[0] == whole, parts


def test_text_sampled_after_a_fed_end_of_document_starts_with_the_blank_line(byte_tokenizer, monkeypatch, tmp_path):
    tok, _ = byte_tokenizer
    session = forced_ids_session(byte_tokenizer, monkeypatch, tok.encode(" lord", False) * 2)
    session.feed([tok.eod_id])
    assert session.sample_text(1) == ["\n\nlord"]
    # A restored session continues the same text; one whose first text starts a document shows no blank line.
    torch.save(session.state_dict(), tmp_path / "session.pt")
    restored = GenerationSession(session.model, seed=0, tokenizer=tok)
    restored.load_state_dict(torch.load(tmp_path / "session.pt", weights_only=True))
    assert restored.sample_text(1) == [" lord"]
    fresh = GenerationSession(session.model, seed=0, tokenizer=tok)
    fresh.feed("")
    force_samples(monkeypatch, tok.encode(" lord", False))
    assert fresh.sample_text(1) == ["lord"]


def test_a_saved_state_of_the_former_layout_still_continues_its_text(byte_tokenizer, monkeypatch):
    tok, small = byte_tokenizer
    session = forced_session(byte_tokenizer, monkeypatch, " 日本")
    assert session.sample_text(2) == [" "]                     # the first byte of 日 held back
    state = session.state_dict()
    context, held = state.pop("unshown_text")[0]
    former = {**state, "unshown_text_ids": [context[-1:] + held], "last_tokens": torch.tensor([held[-1]])}
    del former["text_context"]
    restored = GenerationSession(small, seed=0, tokenizer=tok)
    restored.load_state_dict(former)
    assert restored.sample_text(5) == ["日本"]


def test_what_is_still_held_back_at_the_end_comes_out_as_decode_gives_it(byte_tokenizer, monkeypatch, tmp_path):
    tok, _ = byte_tokenizer
    whole = forced_session(byte_tokenizer, monkeypatch, " 日本")
    one_call = whole.sample_text(6)[0] + whole.finish_text()[0]                 # the last character cut short
    session = forced_session(byte_tokenizer, monkeypatch, " 日本")
    streamed = [session.sample_text(1)[0] for _ in range(5)]
    # A saved session keeps what it held back; a restored one finishes the character.
    torch.save(session.state_dict(), tmp_path / "session.pt")
    restored = GenerationSession(session.model, seed=0, tokenizer=tok)
    restored.load_state_dict(torch.load(tmp_path / "session.pt", weights_only=True))
    assert "".join(streamed) + session.sample_text(1)[0] + session.finish_text()[0] == one_call == " 日\ufffd\ufffd"
    assert "".join(streamed) == " 日"
    force_samples(monkeypatch, tok.encode(" 日本", False)[5:])                    # 0x9C 0xAC
    assert restored.sample_text(2) == ["本"] and restored.finish_text() == [""]


def test_unfinished_tail_counts_only_the_bytes_of_a_character_still_open(byte_tokenizer):
    tok, _ = byte_tokenizer
    ids = tok.encode(" 日本", False)                   # ▁ E6 97 A5 E6 9C AC
    assert [tok.unfinished_tail(ids[:n]) for n in range(len(ids) + 1)] == [0, 0, 1, 2, 0, 1, 2, 0]
    byte = {b: tok.processor.piece_to_id(f"<0x{b:02X}>") for b in (0x97, 0xE0, 0x80)}
    assert tok.unfinished_tail([byte[0x97]]) == 0          # a lone continuation byte: nothing can finish it
    assert tok.unfinished_tail([byte[0xE0], byte[0x80]]) == 0   # invalid already (an overlong form)
    assert tok.unfinished_tail(ids[:2] + [tok.eod_id]) == 0


def test_prompt_file_dash_reads_standard_input_as_utf8(monkeypatch):
    import io

    from launch.generate import read_prompt

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("ROMEO.\n日本\n".encode()), encoding="ascii"))
    assert read_prompt(None, "-") == "ROMEO.\n日本\n"  # UTF-8 whatever the stream's own encoding
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff")))
    with pytest.raises(GenerationError, match=r"^--prompt-file -: cannot read it \(UnicodeDecodeError\)"):
        read_prompt(None, "-")


def test_model_folder_recorded_end_of_document_wins_over_the_tokenizer_files_guess(trained, tmp_path):
    """A corpus laid out with a loaded tokenizer and --eod-piece ends documents with a piece other than <eod>: its
    export records that id, and generate --model (whose tokenizer is a .model file, no manifest) must stop there."""
    from launch.export import export
    from launch.generate import load
    from txl_dist.data import read_manifest
    from txl_dist.interop.native import EOD_ID_KEY, MODEL_CONFIG_NAME

    corpus, run = trained
    export(str(run), str(tmp_path / "native"), str(tmp_path / "hf"))
    eod_id = read_manifest(corpus).tokenizer.eod_id
    other = eod_id + 1  # stands for the corpus' own end-of-document piece
    for folder, name, key in (("native", MODEL_CONFIG_NAME, EOD_ID_KEY), ("hf", "config.json", "eos_token_id")):
        assert load(None, str(tmp_path / folder), None).tokenizer.eod_id == eod_id
        config = tmp_path / folder / name
        config.write_text(json.dumps({**json.loads(config.read_text()), key: other}))
        assert load(None, str(tmp_path / folder), None).tokenizer.eod_id == other
        # A corpus folder passed as --tokenizer: its manifest says what ends a document.
        assert load(None, str(tmp_path / folder), str(corpus)).tokenizer.eod_id == eod_id


def test_export_without_the_training_corpus_leaves_tokenizer_and_eos_token_id_out_with_one_warning(trained, tmp_path,
                                                                                                 caplog):
    from launch.export import training_tokenizer
    from txl_dist.data import read_manifest

    corpus, _ = trained
    tokenizer = read_manifest(corpus).tokenizer
    model_bytes = (corpus / "tokenizer.model").read_bytes()
    assert training_tokenizer(str(corpus), tokenizer.sha256, hf=True) == (tokenizer.eod_id, model_bytes)
    replaced = tmp_path / "replaced"  # the manifest's digest is right, the file is another tokenizer
    shutil.copytree(corpus, replaced)
    (replaced / "tokenizer.model").write_bytes(model_bytes + b"\0")
    for path, sha, words in ((tmp_path / "moved", tokenizer.sha256, "cannot be read"),
                             (corpus, "0" * 64, "has another tokenizer"),
                             (replaced, tokenizer.sha256, "has another tokenizer")):
        for hf in (True, False):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="txl_dist"):
                assert training_tokenizer(str(path), sha, hf=hf) is None
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1 and words in lines[0] and "\n" not in lines[0]
            assert "no tokenizer.model in the exported folders" in lines[0]
            assert ("no eos_token_id" in lines[0]) == hf


def other_tokenizer(folder):
    """A SentencePiece model of the trained corpus' vocabulary size (64) made from other text: another tokenizer."""
    import io

    import sentencepiece as spm

    writer = io.BytesIO()
    lines = [f"{' '.join(reversed(WORDS[i:] + WORDS[:i]))} {' '.join(WORDS[i:]).upper()} {i * 7919}"
             for i in range(len(WORDS))]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines),
                                   model_writer=writer, vocab_size=64, user_defined_symbols=["<eod>"], minloglevel=2)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(writer.getvalue())
    return folder / "tokenizer.model"


def test_export_over_a_former_export_leaves_no_other_models_tokenizer_and_generate_checks_the_digest(trained,
                                                                                                  tmp_path, caplog):
    """Run A exported into E (with A's tokenizer.model); then run B, trained with another tokenizer of the same
    vocabulary size, whose corpus has moved away, into E: E keeps no tokenizer.model, records B's tokenizer digest,
    and launch/generate.py --model E refuses A's tokenizer (found in E, or given) and takes B's."""
    from launch.export import main as export_main
    from txl_dist.data.format import sha256_file

    corpus, run = trained
    native, hf = tmp_path / "E", tmp_path / "E-hf"
    assert export_main(["--checkpoint", str(run), "--out", str(native), "--hf", str(hf)]) == 0
    a_sha = sha256_file(corpus / "tokenizer.model")
    for folder, config in ((native, "model_config.json"), (hf, "config.json")):
        assert (folder / "tokenizer.model").read_bytes() == (corpus / "tokenizer.model").read_bytes()
        assert json.loads((folder / config).read_text())["tokenizer_sha256"] == a_sha

    # Run B: A's weights, recorded as trained on a corpus (now moved away) of another tokenizer.
    b_tokenizer = other_tokenizer(tmp_path / "b-tokenizer")
    b_sha = sha256_file(b_tokenizer)
    run_b = tmp_path / "run-b"
    shutil.copytree(run, run_b)
    for run_json in run_b.glob("checkpoints/step_*/txl_state/run.json"):
        info = json.loads(run_json.read_text())
        info["tokenizer_sha256"] = b_sha
        info["config"]["data"]["path"] = str(tmp_path / "moved-corpus")
        run_json.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        assert export_main(["--checkpoint", str(run_b), "--out", str(native), "--hf", str(hf)]) == 0
    assert "no tokenizer.model in the exported folders" in caplog.text
    for folder, config in ((native, "model_config.json"), (hf, "config.json")):
        assert not (folder / "tokenizer.model").exists()  # A's is not left beside B's weights
        assert json.loads((folder / config).read_text())["tokenizer_sha256"] == b_sha

    def refused(argv) -> str:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="txl_dist"):
            assert _generate_main(argv + ["--prompt", "hello", "--max-new-tokens", "2", "--greedy"]) == EXIT_REFUSED
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    for folder in (native, hf):
        assert "has no tokenizer.model; pass --tokenizer" in refused(["--model", str(folder)])
        for wrong in (corpus, corpus / "tokenizer.model"):  # A's tokenizer, given: refused as --checkpoint does
            assert "is not the tokenizer" in refused(["--model", str(folder), "--tokenizer", str(wrong)])
        assert _generate_main(["--model", str(folder), "--tokenizer", str(b_tokenizer), "--prompt", "hello",
                               "--max-new-tokens", "2", "--greedy"]) == 0
        # A tokenizer.model another export left there (an older txl-dist did) is refused, not used silently.
        shutil.copy(corpus / "tokenizer.model", folder / "tokenizer.model")
        message = refused(["--model", str(folder)])
        assert "is not the tokenizer" in message and "another model's export left there" in message

    # An export from before the digest was recorded still loads, with any tokenizer of its vocabulary.
    config = json.loads((native / "model_config.json").read_text())
    del config["tokenizer_sha256"]
    (native / "model_config.json").write_text(json.dumps(config))
    assert _generate_main(["--model", str(native), "--prompt", "hello", "--max-new-tokens", "2", "--greedy"]) == 0

    # A --hf folder holding a model of elsewhere (its config.json records no digest) is refused, not written over;
    # --overwrite writes into it.
    (hf / "config.json").write_text(json.dumps({"model_type": "transfo-xl", "n_layer": 2}))
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="txl_dist"):
        assert export_main(["--checkpoint", str(run), "--out", str(native), "--hf", str(hf)]) == EXIT_REFUSED
    assert "holds files that are not those of a former export (config.json, model.safetensors, tokenizer.model)" \
        in caplog.text
    assert json.loads((hf / "config.json").read_text()) == {"model_type": "transfo-xl", "n_layer": 2}
    assert export_main(["--checkpoint", str(run), "--out", str(native), "--hf", str(hf), "--overwrite"]) == 0
    assert json.loads((hf / "config.json").read_text())["tokenizer_sha256"] == a_sha
    assert (hf / "tokenizer.model").read_bytes() == (corpus / "tokenizer.model").read_bytes()


def test_the_samples_memory_check_counts_the_sessions_own_default_mem_len(monkeypatch):
    """Without --mem-len a session keeps mem_len + tgt_len states per layer (default_mem_len): the check before
    decoding counts that window (with one prompt chunk), not the model's training mem_len."""
    import argparse
    from types import SimpleNamespace

    import psutil

    from launch.generate import check_memory_for_samples

    config = ModelConfig(vocab_size=64, n_layer=3, d_model=16, n_head=2, d_head=8, d_inner=32, tgt_len=8, mem_len=24)
    per_sample = (3 + 1) * (24 + 8 + 8) * 16 * 4  # layers + embeddings, x (default mem_len + a chunk) x d_model x 4 B
    args = argparse.Namespace(mem_len=None, chunk_len=None, num_samples=10, device="cpu")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=10 * per_sample))
    check_memory_for_samples(config, args)  # fits exactly
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=10 * per_sample - 1))
    with pytest.raises(GenerationError, match="--num-samples 10: their memories alone need"):
        check_memory_for_samples(config, args)
    args.mem_len = 0  # an explicit --mem-len is what the session keeps
    check_memory_for_samples(config, args)


def test_a_long_prompt_read_logs_progress_at_the_interval_on_stderr_only(model, monkeypatch, caplog, capsys):
    """A line every PROGRESS_INTERVAL_S while the prompt is read (tokens read / total, rate, ETA), through the
    logger (stderr), never stdout; none for a short read, none while sampling; the log-probs unchanged."""
    import txl_dist.progress as progress

    prompt = [random.Random(0).randrange(VOCAB) for _ in range(40)]  # 5 segments of chunk_len 8

    def read_prompt() -> tuple[torch.Tensor, list[str]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="txl_dist"):
            session = GenerationSession(model, mem_len=16, chunk_len=8, seed=0)
            log_probs = session.feed(prompt)
            session.sample(3)  # one-token reads: never a line
        return log_probs, [r.getMessage() for r in caplog.records if r.getMessage().startswith("reading")]

    quick, lines = read_prompt()
    assert lines == []  # it ends before the first interval
    seconds = iter(range(0, 1000, 10))  # 10 s pass between two looks at the clock
    monkeypatch.setattr(progress, "_clock", lambda: float(next(seconds)))
    timed, lines = read_prompt()
    assert torch.equal(timed, quick)
    # Looks after 8, 16, 24, 32 tokens at 10, 20, 30, 40 s: one line at 30 s, none after the last segment.
    assert lines == ["reading the prompt: 24/40 tokens | 1 tok/s | ETA 0:00:20"]
    assert capsys.readouterr().out == ""
