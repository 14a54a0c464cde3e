"""The presets against what the documents say of them, and the configuration refusals a preset user meets.

- Every GPU preset against the reference implementation's run scripts (kimiyoung/transformer-xl:
  pytorch/run_wt103_base.sh, pytorch/run_wt103_large.sh, tf/scripts/enwik8_tpu.sh, the large enwik8 model), key by
  key; where a preset differs, docs/recipes.md says so.
- The figures docs/recipes.md and docs/performance.md give for the presets (parameters, FLOPs per token).
- Scheduler params a schedule computes with must be numbers (a string passed start-up and failed with a
  TypeError mid-run, when the schedule first reached it); optimizer.params must be an object (DeepSpeed's own
  reading failed first, with a line naming neither); a precision conflict on a GPU preset names the --set that
  agrees (the fix the message gave, "leave deepspeed.bf16.enabled out", cannot be done with --set).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from txl_dist.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
RECIPES = (REPO / "docs" / "recipes.md").read_text(encoding="utf-8")

# The reference's run scripts: the paper's models as trained (batch = streams, max_step = steps, clip from
# train.py's default 0.25, eval_* from the scripts' eval branches).
REFERENCE = {
    "wt103_base": dict(n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100, cutoffs=[20000, 40000, 200000],
                       div_val=1, dropout=0.1, dropatt=0.0, tgt_len=150, mem_len=150, lr=0.00025, warmup=0,
                       max_steps=200000, batch=60, clip=0.25, eval_tgt_len=64, eval_mem_len=640, eval_clamp_len=400),
    "large": dict(n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096, cutoffs=[20000, 40000, 200000],
                  div_val=4, dropout=0.2, dropatt=0.2, tgt_len=384, mem_len=384, lr=0.00025, warmup=16000,
                  max_steps=4000000, batch=128, clip=0.25, eval_tgt_len=128, eval_mem_len=1600, eval_clamp_len=1000),
    "enwik8_large": dict(n_layer=24, d_model=1024, n_head=8, d_head=128, d_inner=3072, cutoffs=[], div_val=1,
                         dropout=0.15, dropatt=0.15, tgt_len=768, mem_len=768, lr=0.00025, warmup=4000,
                         max_steps=400000, batch=64, clip=0.25, eval_tgt_len=128, eval_mem_len=3800,
                         eval_clamp_len=1000),
}
# What docs/recipes.md says differs from the reference (DeepSpeed's least warmup is 2 steps; 60 streams do not
# divide over 8 ranks at micro batch 8).
DOCUMENTED_DIFFERENCES = {"wt103_base": {"batch": 64, "warmup": 1}}


def preset_values(name: str) -> dict:
    cfg = load_config(CONFIGS / f"{name}.json")
    m, ds = cfg.model, cfg.deepspeed
    return dict(n_layer=m.n_layer, d_model=m.d_model, n_head=m.n_head, d_head=m.d_head, d_inner=m.d_inner,
                cutoffs=m.cutoffs, div_val=m.div_val, dropout=m.dropout, dropatt=m.dropatt, tgt_len=m.tgt_len,
                mem_len=m.mem_len, lr=ds["optimizer"]["params"]["lr"],
                warmup=ds["scheduler"]["params"]["warmup_num_steps"], max_steps=cfg.train.max_steps,
                batch=ds["train_batch_size"], clip=ds["gradient_clipping"], eval_tgt_len=cfg.eval.tgt_len,
                eval_mem_len=cfg.eval.mem_len, eval_clamp_len=cfg.eval.clamp_len)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_the_paper_presets_are_the_reference_scripts_but_for_the_documented_differences(name):
    values = preset_values(name)
    expected = {**REFERENCE[name], **DOCUMENTED_DIFFERENCES.get(name, {})}
    assert values == expected
    cfg = load_config(CONFIGS / f"{name}.json")
    assert cfg.eval.same_length and cfg.model.tie_weight and not cfg.model.pre_lnorm
    assert cfg.deepspeed["optimizer"]["params"]["weight_decay"] == 0.0  # AdamW without decay: the reference's Adam
    sched = cfg.deepspeed["scheduler"]
    assert sched["type"] == "WarmupCosineLR" and sched["params"]["cos_min_ratio"] == 0.0  # eta_min 0


def test_the_recipes_name_every_paper_preset_and_its_differences():
    for name in ("ptb_cpu", "ptb", "wt103_base", "wt103_base_aligned", "large", "large_aligned", "enwik8_large"):
        assert f"configs/{name}.json" in RECIPES, f"docs/recipes.md does not mention configs/{name}.json"
    assert "## WikiText-103 base: `configs/wt103_base.json` (GPU)" in RECIPES
    assert "64 streams instead of 60" in RECIPES and "a 2-step warmup instead of none" in RECIPES


@pytest.mark.parametrize("name,vocab_size,stated", [
    ("ptb_cpu", 10001, "3.34M"), ("wt103_base", None, "151,119,838"), ("wt103_base_aligned", None, "153.7M"),
    ("large_aligned", None, "285.24M"), ("enwik8_large", 204, "277.28M"), ("enwik8_large", 6000, "283.2M")])
def test_the_recipes_parameter_counts(name, vocab_size, stated):
    from txl_dist.startup import count_parameters

    model = load_config(CONFIGS / f"{name}.json").model
    if vocab_size is not None:
        model = dataclasses.replace(model, vocab_size=vocab_size)
    n = count_parameters(model)
    if stated.endswith("M"):
        digits = len(stated[:-1].split(".")[1])
        assert f"{n / 1e6:.{digits}f}M" == stated
    else:
        assert n == int(stated.replace(",", ""))
    assert stated in RECIPES


def test_the_flops_per_token_docs_performance_gives_for_the_presets():
    from txl_dist.flops import flops_breakdown, flops_per_token

    text = " ".join((REPO / "docs" / "performance.md").read_text(encoding="utf-8").split())
    large = load_config(CONFIGS / "large.json")
    parts = flops_breakdown(large.model, micro_batch=large.micro_batch())
    total = sum(parts.values())
    rest = total - parts["layers"] - parts["softmax_head"]
    assert (f"`configs/large.json` {total / 1e9:.2f} GFLOP (layers {parts['layers'] / 1e9:.2f}, softmax head "
            f"{parts['softmax_head'] / 1e9:.2f}, the rest {rest / 1e9:.2f})") in text
    assert total == pytest.approx(flops_per_token(large.model, micro_batch=large.micro_batch()))

    def gflop(name: str, vocab_size: int | None = None) -> float:
        cfg = load_config(CONFIGS / f"{name}.json")
        model = cfg.model if vocab_size is None else dataclasses.replace(cfg.model, vocab_size=vocab_size)
        return flops_per_token(model, micro_batch=cfg.micro_batch()) / 1e9

    assert f"`configs/wt103_base.json` {gflop('wt103_base'):.2f}" in text
    assert f"`configs/enwik8_large.json` {gflop('enwik8_large', 204):.2f}" in text
    assert f"{gflop('enwik8_large', 6000):.2f} at the recipe's 6000" in text
    assert f"`configs/tiny.json` {gflop('tiny', 4096):.3f}" in text


# ----------------------------------------------------------------------------------------------------
# Refusals a preset user meets


@pytest.mark.parametrize("override,message", [
    ("cos_min_ratio=x", 'deepspeed.scheduler.params.cos_min_ratio: must be a number, got "x"'),
    ("cos_min_ratio=null", "deepspeed.scheduler.params.cos_min_ratio: must be a number, got null"),
    ("cos_min_ratio=[0.1]", "deepspeed.scheduler.params.cos_min_ratio: must be a number, got [0.1]"),
    ("warmup_min_ratio=true", "deepspeed.scheduler.params.warmup_min_ratio: must be a number, got true"),
    ("total_num_steps=\"3\"", "deepspeed.scheduler.params.total_num_steps: must be a number"),
])
def test_a_scheduler_param_the_schedule_computes_with_must_be_a_number(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "tiny.json", [f"deepspeed.scheduler.params.{override}"])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_scheduler_params_deepspeed_takes_as_lists_or_null_still_load():
    cfg = load_config(CONFIGS / "tiny.json", ["deepspeed.scheduler.type=WarmupLR",
                                              "deepspeed.scheduler.params={\"warmup_min_lr\": [0.0], "
                                              "\"warmup_max_lr\": null, \"warmup_num_steps\": 5}"])
    assert cfg.deepspeed["scheduler"]["params"]["warmup_max_lr"] is None
    with pytest.raises(ConfigError, match="warmup_min_lr: must be a number or a list of numbers"):
        load_config(CONFIGS / "tiny.json", ["deepspeed.scheduler.type=WarmupLR",
                                            "deepspeed.scheduler.params={\"warmup_min_lr\": [\"a\"]}"])


def test_a_scheduler_param_that_is_no_number_is_refused_at_start_not_mid_run(tmp_path):
    """The symptom: launch/train.py accepted cos_min_ratio "x", trained through the warmup and ended with a
    TypeError traceback (exit status 1) at the first step after it; now exit status 2, one error line."""
    corpus = _corpus(tmp_path)
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--config", str(CONFIGS / "tiny.json"),
           "--resume", "none"]
    for item in [*TOY, f"data.path={corpus}", f"run.dir={tmp_path / 'run'}",
                 "deepspeed.scheduler.params.warmup_num_steps=1", "deepspeed.scheduler.params.cos_min_ratio=x"]:
        cmd += ["--set", item]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "deepspeed.scheduler.params.cos_min_ratio: must be a number" in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


TOY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
       "model.cutoffs=[20,40]", "model.div_val=1", "model.tgt_len=8", "model.mem_len=8", "eval.max_segments=2",
       "tracking.enabled=false", "train.max_steps=3", "eval.interval=0", "checkpoint.interval=0",
       "train.precision=fp32", "model.attn_impl=matmul", "deepspeed.train_batch_size=4",
       "deepspeed.train_micro_batch_size_per_gpu=2"]
"""tests/test_presets.py's toy shapes: without the refusal this trains into the schedule's cosine (step 3)."""


def _corpus(tmp_path: Path) -> Path:
    from dist_helpers import learnable_stream, write_corpus

    return write_corpus(tmp_path / "corpus", {"train": learnable_stream(64 * 40, 64, 0),
                                              "valid": learnable_stream(500, 64, 1),
                                              "test": learnable_stream(500, 64, 2)}, vocab_size=64)


@pytest.mark.parametrize("value", ["3", "[1]", "\"lr\""])
def test_optimizer_params_that_are_no_object_are_refused_naming_the_key(value):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "tiny.json", [f"deepspeed.optimizer.params={value}"])
    assert str(info.value).startswith("deepspeed.optimizer.params: must be a JSON object, got ")


GPU_PRESETS = sorted(p.stem for p in CONFIGS.glob("*.json")
                     if load_config(p).deepspeed.get("bf16", {}).get("enabled") is True)


def test_the_gpu_presets_are_the_bf16_ones():
    assert GPU_PRESETS == ["enwik8_large", "large", "large_aligned", "ptb", "wt103_base", "wt103_base_aligned"]


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_fp32_on_a_gpu_preset_is_refused_with_the_override_that_agrees(name):
    """docs/performance.md: `--set train.precision=fp32` wins; on a preset that names deepspeed.bf16.enabled it was
    refused with a fix --set cannot make ("leave deepspeed.bf16.enabled out")."""
    path = CONFIGS / f"{name}.json"
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.precision=fp32"])
    assert "(--set deepspeed.bf16.enabled=false)" in str(info.value)
    assert load_config(path, ["train.precision=fp32", "deepspeed.bf16.enabled=false"]).precision() == "fp32"
    # "auto": null takes the key out (docs/refusals.md's config.precision-conflict says so).
    with pytest.raises(ConfigError, match=r"out or null \(--set deepspeed.bf16.enabled=null: train.precision"):
        load_config(path, ["train.precision=auto"])
    auto = load_config(path, ["train.precision=auto", "deepspeed.bf16.enabled=null"])
    assert auto.precision() is None and "enabled" not in auto.deepspeed["bf16"]  # start-up decides
    assert auto.deepspeed_config(1)["bf16"] == {}
    assert load_config(path, ["train.precision=fp32", "deepspeed.bf16.enabled=null"]).deepspeed_config(1)["bf16"] == {
        "enabled": False}


@pytest.mark.parametrize("item,message", [
    ("model.n_layer.x=3", "--set model.n_layer.x: 'n_layer' is not a section but a value"),
    ("deepspeed.train_batch_size.x=1", "'train_batch_size' is not a section but a value"),
    ("deepspeed=3", "expected section.key=value"),
    ("=3", "expected section.key=value"),
    (".x=3", "unknown section ''"),
    ("model.n_layer=1e3", "model.n_layer: expected an integer, got 1000.0"),
    ("model.dropout=.1", "model.dropout: expected a number, got \".1\""),
    ("data.path=null", "data.path: expected a string, got null"),
    ("deepspeed.bf16=true", "deepspeed.bf16: must be a JSON object, got true"),
])
def test_set_overrides_with_a_bad_nesting_or_type_are_one_line(item, message):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "tiny.json", [item])
    assert message in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------
# The documents' commands


WT103_PRESETS = ("large", "large_aligned", "wt103_base", "wt103_base_aligned")


def train_commands(text: str) -> list[str]:
    """The launch/train.py commands of a text (shell continuations joined) that train a WikiText-103 preset."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if ("launch/train.py" in line or "train.sbatch" in line)
            and any(f"configs/{name}.json" in line for name in WT103_PRESETS)]


def test_the_wikitext_commands_take_the_vocabulary_of_the_corpus():
    """The presets name the paper's 267,735 ids; the recipe's corpus has 267,736 (its --vocab-size: the words,
    the end-of-document id and SentencePiece's unknown id), so a command without model.vocab_size=null was
    refused: `model.vocab_size: 267735 differs from the tokenizer of /data/wt103 (267736)`."""
    assert {load_config(CONFIGS / f"{name}.json").model.vocab_size for name in WT103_PRESETS} == {267735}
    assert "--vocab-size 267736" in RECIPES
    from launch import train as launch_train

    texts = {name: (REPO / name).read_text(encoding="utf-8") for name in
             ("README.md", "docs/recipes.md", "docs/performance.md")}
    texts["launch/train.py --help"] = launch_train.build_parser().epilog
    commands = [(name, c) for name, text in texts.items() for c in train_commands(text)]
    assert len(commands) >= 5, commands
    assert [(name, c) for name, c in commands if "model.vocab_size=null" not in c] == []
