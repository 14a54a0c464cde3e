"""The typed configuration: every shipped preset loads, overrides are typed, bad values are refused early."""
import json
from pathlib import Path

import pytest

from txl_dist.config import (
    ConfigError,
    RunConfig,
    check_batch_layout,
    config_from_dict,
    load_config,
)

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.json"))


def minimal(**sections) -> dict:
    raw = {"deepspeed": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def test_every_shipped_preset_loads_and_validates():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "ptb", "wt103_base", "large", "enwik8_large"} <= names
    for path in CONFIGS:
        cfg = load_config(path)
        assert isinstance(cfg, RunConfig)
        # One config runs unchanged on any world size that divides S.
        for world_size in (1, 2):
            ds = cfg.deepspeed_config(world_size)
            assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds[
                "gradient_accumulation_steps"] * world_size


def test_paper_presets_have_the_paper_shapes():
    base = load_config(CONFIGS[0].parent / "wt103_base.json").model
    assert (base.n_layer, base.d_model, base.n_head, base.d_head, base.d_inner) == (16, 410, 10, 41, 2100)
    assert (base.tgt_len, base.mem_len) == (150, 150)
    large = load_config(CONFIGS[0].parent / "large.json")
    m = large.model
    assert (m.n_layer, m.d_model, m.n_head, m.d_head, m.d_inner) == (18, 1024, 16, 64, 4096)
    assert (m.tgt_len, m.mem_len, m.dropout, m.dropatt, m.div_val) == (384, 384, 0.2, 0.2, 4)
    assert (large.eval.tgt_len, large.eval.mem_len, large.eval.clamp_len) == (128, 1600, 1000)
    assert large.deepspeed["bf16"]["enabled"] and large.deepspeed["zero_optimization"]["stage"] >= 1
    # Chosen by measurement on an H200 (BENCHMARKS.md, "GPU check"): no recomputation, compiled layers.
    assert "activation_checkpointing" not in large.deepspeed and large.train.compile
    e = load_config(CONFIGS[0].parent / "enwik8_large.json").model
    assert (e.n_layer, e.d_model, e.n_head, e.d_head, e.d_inner, e.tgt_len, e.mem_len) == (
        24, 1024, 8, 128, 3072, 768, 768)


# An aligned preset is its base with tensor-core friendly shapes; anything else must follow the base.
ALIGNED_PRESETS = {  # aligned preset -> (base preset, model keys it may change)
    "large_aligned": ("large", {"pad_vocab_multiple"}),
    "wt103_base_aligned": ("wt103_base", {"pad_vocab_multiple", "d_model", "n_head", "d_head", "d_inner"}),
}


@pytest.mark.parametrize("name", sorted(ALIGNED_PRESETS))
def test_aligned_presets_differ_from_their_base_only_in_alignment(name):
    base_name, model_keys = ALIGNED_PRESETS[name]
    aligned = load_config(CONFIGS[0].parent / f"{name}.json").to_dict()
    base = load_config(CONFIGS[0].parent / f"{base_name}.json").to_dict()
    assert aligned["model"]["pad_vocab_multiple"] == 64
    m = aligned["model"]
    assert m["d_model"] % 32 == 0 and m["d_head"] % 32 == 0 and m["d_inner"] % 64 == 0
    for section, values in base.items():
        for key, value in values.items():
            if (section, key) == ("run", "dir") or (section == "model" and key in model_keys):
                continue
            if (section, key) == ("tracking", "experiment") and model_keys != {"pad_vocab_multiple"}:
                continue  # another architecture is another experiment; padding alone is the same model
            assert aligned[section][key] == value, f"{name}.json: {section}.{key} must follow {base_name}.json"


def test_overrides_are_typed_and_reach_nested_deepspeed_keys(tmp_path):
    cfg = load_config(CONFIGS[0].parent / "tiny.json", [
        "train.max_steps=20",
        "deepspeed.zero_optimization.stage=3",
        "data.path=/data/ptb",
        "run.dir=123",
        "checkpoint.interval=5",
        "eval.interval=7",
        "model.cutoffs=[500,1500]",
        "model.same_length=true",
        "tracking.uri=null",
    ])
    assert cfg.train.max_steps == 20
    assert cfg.deepspeed["zero_optimization"]["stage"] == 3
    assert cfg.data.path == "/data/ptb"
    assert cfg.run.dir == "123"  # a string field keeps digits as text
    assert (cfg.checkpoint.interval, cfg.eval.interval) == (5, 7)
    assert cfg.model.cutoffs == [500, 1500] and cfg.model.same_length is True
    assert cfg.tracking.uri is None


@pytest.mark.parametrize("overrides, message", [
    (["model.n_layers=3"], "unknown key 'model.n_layers' (did you mean 'n_layer'?)"),
    (["modle.n_layer=3"], "unknown section 'modle' (did you mean 'model'?)"),
    (["model.n_layer=three"], "model.n_layer: expected an integer"),
    (["model.dropout=true"], "model.dropout: expected a number"),
    (["model.cutoffs=[2000,1000]"], "model.cutoffs"),
    (["model.vocab_size=1500", "model.cutoffs=[1000,2000]"], "below vocab_size 1500"),
    (["model.tgt_len=0"], "model.tgt_len: must be > 0"),
    (["model.mem_len=-1"], "model.mem_len: must be >= 0"),
    (["deepspeed.train_micro_batch_size_per_gpu=3"], "does not divide train_batch_size 8"),
    (["deepspeed.gradient_accumulation_steps=2"], "deepspeed.gradient_accumulation_steps: do not set it"),
    (["train.exit_step=50000"], "train.exit_step"),
    (["deepspeed.scheduler.params.total_num_steps=7"], "differs from train.max_steps"),
    (["train.max_steps"], "expected section.key=value"),
    (["deepspeed.gradient_clipping=-1"], "deepspeed.gradient_clipping: must be >= 0, got -1"),
    (["deepspeed.gradient_clipping=-0.5"], "deepspeed.gradient_clipping: must be >= 0, got -0.5"),
    # Each of these reached the model or the engine and failed there with a traceback (exit 1).
    (["model.d_model=129"], "model.d_model: 129 must be even"),
    (["model.mem_len=1000000000000"], "model.mem_len: 1000000000000 tokens is beyond 1048576"),
    (["model.tgt_len=1048577"], "model.tgt_len: 1048577 tokens is beyond 1048576"),
    (["eval.mem_len=1048577"], "eval.mem_len: 1048577 tokens is beyond"),
    (["eval.tgt_len=1048577"], "eval.tgt_len: 1048577 tokens is beyond"),
    (["deepspeed.timers=null"], "deepspeed.timers: must be a JSON object, got null"),
    (["deepspeed.data_types=3"], "deepspeed.data_types: must be a JSON object, got 3"),
    (["deepspeed.zero_optimization.stage=1.0"], "deepspeed.zero_optimization.stage: must be 0, 1, 2 or 3, got 1.0"),
])
def test_bad_values_are_refused_with_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS[0].parent / "tiny.json", overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_batch_layout_follows_from_world_size():
    assert check_batch_layout(8, 2, 1) == 4
    assert check_batch_layout(8, 2, 2) == 2
    assert check_batch_layout(8, 2, 4) == 1
    with pytest.raises(ConfigError, match="cannot be split over 3 ranks"):
        check_batch_layout(8, 2, 3)
    with pytest.raises(ConfigError, match="does not divide"):
        check_batch_layout(8, 4, 4)


def test_eval_streams_must_divide_over_ranks():
    cfg = config_from_dict(minimal(eval={"n_streams": 4}))
    assert cfg.eval_streams(2) == 4
    with pytest.raises(ConfigError, match="eval.n_streams"):
        cfg.eval_streams(3)
    assert config_from_dict(minimal()).eval_streams(3) == 3


def test_digest_ignores_where_files_go_but_not_what_is_computed():
    a = config_from_dict(minimal())
    b = config_from_dict(minimal(run={"dir": "elsewhere"}, train={"exit_step": 3}))
    c = config_from_dict(minimal(model={"d_model": 64}))
    assert a.digest() == b.digest() != c.digest()


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"model\": {")
    with pytest.raises(ConfigError, match="invalid JSON at line 1"):
        load_config(bad)
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_config(bad)


def test_set_strips_the_value_as_it_strips_the_key():
    cfg = load_config(CONFIGS[0].parent / "tiny.json", ["data.path= /data/ptb ", " train.max_steps = 20"])
    assert cfg.data.path == "/data/ptb" and cfg.train.max_steps == 20


def test_a_null_structure_key_and_the_value_it_stands_for_are_the_same_model():
    """d_embed null is d_model, tie_projs null is [false, true, ...]: a config that writes them out fits a
    checkpoint saved with null (large.json writes d_embed out)."""
    from txl_dist.startup import changed_structure

    saved = RunConfig().to_dict()["model"] | {"d_model": 128, "d_embed": None, "cutoffs": [10, 20], "tie_projs": None}
    written = saved | {"d_embed": 128, "tie_projs": [False, True, True]}
    assert changed_structure(saved, written) == [] and changed_structure(written, saved) == []
    assert changed_structure(saved, saved | {"d_embed": 64, "tie_projs": [False, False, True]}) == ["d_embed",
                                                                                                  "tie_projs"]
    # What a null implies changes with d_model or cutoffs, which are named alone.
    assert changed_structure(saved, saved | {"d_model": 256, "cutoffs": [10]}) == ["cutoffs", "d_model"]
    assert changed_structure(written, saved | {"d_model": 256}) == ["d_embed", "d_model"]


def test_tie_projs_default_and_length_check():
    cfg = config_from_dict(minimal(model={"cutoffs": [10, 20]}))
    assert cfg.model.resolved_tie_projs() == [False, True, True]
    with pytest.raises(ConfigError, match="model.tie_projs: needs one entry per cluster"):
        config_from_dict(minimal(model={"cutoffs": [10, 20], "tie_projs": [True]}))


def test_a_key_missing_from_a_saved_config_counts_as_its_default():
    from txl_dist.config import changed_settings

    now = RunConfig().to_dict()
    saved = RunConfig().to_dict()
    del saved["model"]["pad_vocab_multiple"]  # a checkpoint written before the key existed
    assert changed_settings(saved, now) == []
    now["model"]["pad_vocab_multiple"] = 8
    assert changed_settings(saved, now) == ["model.pad_vocab_multiple"]


def test_a_key_left_out_of_the_resumed_config_counts_as_changed():
    from txl_dist.config import changed_settings

    saved = RunConfig().to_dict()
    saved["deepspeed"]["gradient_clipping"] = 0.25
    saved["deepspeed"]["activation_checkpointing"] = {"partition_activations": False}
    now = RunConfig().to_dict()
    for key in ("gradient_clipping", "activation_checkpointing"):
        now["deepspeed"].pop(key, None)  # a config file without them: clipping and checkpointing are off now
    assert changed_settings(saved, now) == ["deepspeed.activation_checkpointing", "deepspeed.gradient_clipping"]
    del saved["model"]["pad_vocab_multiple"]  # left out on both sides in turn: each side's default
    assert changed_settings(now, saved) == ["deepspeed.activation_checkpointing", "deepspeed.gradient_clipping"]


def test_gradient_clipping_zero_turns_it_off_and_is_accepted():
    """0 is DeepSpeed's "no clipping" (it clips only above 0); a negative value, which it would treat the same
    without a word, is refused (test_bad_values_are_refused_with_one_line_naming_the_key)."""
    cfg = load_config(CONFIGS[0].parent / "tiny.json", ["deepspeed.gradient_clipping=0"])
    assert cfg.deepspeed["gradient_clipping"] == 0
