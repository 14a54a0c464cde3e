"""check_deepspeed_config: a deepspeed section DeepSpeed would misread is refused with one line naming the key."""
import copy
import json
import time
from pathlib import Path

import pytest
import torch
from deepspeed import comm as dist

from txl_dist.config import ConfigError, config_from_dict, load_config
from txl_dist.deepspeed_schema import check_deepspeed_config
from txl_dist.engine import deepspeed_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.json"))

# Every section this project uses: ZeRO-3 with the optimizer offloaded to the CPU, activation checkpointing,
# bf16, WarmupCosineLR (deepspeed_config adds total_num_steps, gradient_accumulation_steps and, with
# load_universal, checkpoint.load_universal).
EVERY_SECTION = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.25,
    "steps_per_print": 1000000000,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True},
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                 "cpu_checkpointing": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.0, "torch_adam": True}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear",
                                                       "warmup_min_ratio": 0.0, "cos_min_ratio": 0.01}},
}


def handed_over(section: dict, world_size: int = 2) -> dict:
    """The section as the project hands it to deepspeed.initialize at this world size."""
    cfg = config_from_dict({"train": {"max_steps": 50}, "deepspeed": copy.deepcopy(section)})
    return deepspeed_config(cfg, world_size, load_universal=True)


def with_values(ds: dict, settings: dict) -> dict:
    """A copy of `ds` with each dotted key of `settings` set (sections created as needed)."""
    ds = copy.deepcopy(ds)
    for dotted, value in settings.items():
        *sections, key = dotted.split(".")
        node = ds
        for name in sections:
            node = node.setdefault(name, {})
        node[key] = value
    return ds


def refusal(ds: dict, world_size: int = 2) -> str:
    with pytest.raises(ConfigError) as caught:
        check_deepspeed_config(ds, world_size)
    return str(caught.value)


@pytest.mark.parametrize("settings, key, suggestion", [
    pytest.param({"gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping", id="top-level-typo"),
    pytest.param({"zero_optimization.stgae": 2}, "zero_optimization.stgae", "stage", id="zero-stage-typo"),
    pytest.param({"zero_optimization.overlap_com": True}, "zero_optimization.overlap_com", "overlap_comm",
                 id="zero-overlap-typo"),
    pytest.param({"zero_optimization.offload_optimizer.pin_memry": True},
                 "zero_optimization.offload_optimizer.pin_memry", "pin_memory", id="nested-zero-model-typo"),
    pytest.param({"bf16.enabeld": True}, "bf16.enabeld", "enabled", id="bf16-typo"),
    pytest.param({"activation_checkpointing.partition_activation": True},
                 "activation_checkpointing.partition_activation", "partition_activations",
                 id="activation-checkpointing-typo"),
    pytest.param({"checkpoint.load_universl": True}, "checkpoint.load_universl", "load_universal",
                 id="checkpoint-typo"),
    pytest.param({"tensorboard.enabeld": True}, "tensorboard.enabeld", "enabled", id="monitor-typo"),
    pytest.param({"optimizer.parmas": {}}, "optimizer.parmas", "params", id="optimizer-section-typo"),
    pytest.param({"optimizer.params.weight_decy": 0.01}, "optimizer.params.weight_decy", "weight_decay",
                 id="torch-adamw-param-typo"),
    pytest.param({"optimizer.params.torch_adam": False, "optimizer.params.weight_decy": 0.01},
                 "optimizer.params.weight_decy", "weight_decay", id="cpu-adam-param-typo"),
    pytest.param({"optimizer.type": "AdamWW"}, "optimizer.type", "AdamW", id="optimizer-type-typo"),
    pytest.param({"scheduler.type": "WarmupCosine"}, "scheduler.type", "WarmupCosineLR", id="scheduler-type-typo"),
    pytest.param({"scheduler.params.warmup_num_step": 5}, "scheduler.params.warmup_num_step", "warmup_num_steps",
                 id="scheduler-param-typo"),
    pytest.param({"gradient_clipping": "1.0"}, "gradient_clipping", None, id="clipping-as-string"),
    pytest.param({"zero_optimization.stage": "two"}, "zero_optimization.stage", None, id="stage-as-word"),
    pytest.param({"steps_per_print": 1.5}, "steps_per_print", None, id="fractional-steps-per-print"),
    pytest.param({"activation_checkpointing.partition_activations": "false"},
                 "activation_checkpointing.partition_activations", None, id="switch-as-string"),
])
def test_a_misread_key_is_refused_in_one_line_naming_it(settings, key, suggestion):
    message = refusal(with_values(handed_over(EVERY_SECTION), settings))
    assert "\n" not in message
    assert message.startswith(f"deepspeed.{key}: ")
    if suggestion is None:
        assert "did you mean" not in message
    else:
        assert message.endswith(f"(did you mean '{suggestion}'?)") or f"(did you mean '{suggestion}'?);" in message


@pytest.mark.parametrize("torch_adam, settings", [
    pytest.param(True, {"optimizer.params.lr": "0.001"}, id="torch-adamw-lr-as-string"),
    pytest.param(True, {"optimizer.params.lr": -1}, id="torch-adamw-negative-lr"),
    pytest.param(True, {"optimizer.params.betas": [0.9]}, id="torch-adamw-one-beta"),
    # DeepSpeed's CPU Adam compiles an op when built: its values are checked for type only
    pytest.param(False, {"optimizer.params.lr": "0.001"}, id="deepspeed-cpu-adam-lr-as-string"),
    pytest.param(False, {"optimizer.params.betas": [0.9]}, id="deepspeed-cpu-adam-one-beta"),
])
def test_optimizer_values_are_refused_before_the_model_is_built(torch_adam, settings):
    # They used to fail inside deepspeed.initialize with a traceback, after the run folder and the model.
    ds = with_values(handed_over(EVERY_SECTION), {"optimizer.params.torch_adam": torch_adam, **settings})
    text = refusal(ds)
    assert "\n" not in text and text.startswith("deepspeed.optimizer.params"), text


@pytest.mark.parametrize("torch_adam, key, value, allowed", [
    (True, "fused", "no", "true, false or null"),        # torch AdamW: `fused: bool | None`
    (True, "amsgrad", 0, "true or false"),                # torch AdamW: default False
    (True, "foreach", "false", "true, false or null"),    # DeepSpeed pops it for torch's AdamW
    (False, "torch_adam", "no", "true or false"),         # DeepSpeed's own switch
    (False, "adam_w_mode", "yes", "true or false"),
])
def test_an_optimizer_switch_that_is_not_a_boolean_is_refused(torch_adam, key, value, allowed):
    # DeepSpeed and torch test these for truth: "no" or "false" as a string would turn them on.
    ds = with_values(handed_over(EVERY_SECTION), {"optimizer.params.torch_adam": torch_adam})
    ds["optimizer"]["params"][key] = value
    text = refusal(ds)
    assert text.startswith(f"deepspeed.optimizer.params.{key}: must be {allowed}, got {json.dumps(value)}"), text
    for fine in ([True, False, None] if "null" in allowed else [True, False]):
        ds["optimizer"]["params"][key] = fine
        check_deepspeed_config(ds, 2)


def test_a_precision_the_device_lacks_is_refused_before_the_model_is_built(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    ds = with_values(handed_over(EVERY_SECTION), {"bf16.enabled": False, "fp16.enabled": True})
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    assert refusal(ds).startswith("train.precision / deepspeed.fp16.enabled: DeepSpeed")
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    check_deepspeed_config(ds, 2)


def test_an_error_of_the_rank_itself_while_deepspeed_reads_the_config_is_not_a_refusal(monkeypatch):
    """A refusal is the same on every rank reading the same config, so a node's other ranks stay silent about it
    before the ranks connect. A device that failed, or a bug, on one rank (a RuntimeError) must not become one:
    that rank ended silently with exit 2 while the others waited for it (fault sweep seed 2001, case 11)."""
    from deepspeed.runtime import config as ds_config_module

    ds = handed_over(EVERY_SECTION)

    def failing(self, *args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ds_config_module.DeepSpeedConfig, "__init__", failing)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        check_deepspeed_config(ds, 2)

    def refusing(self, *args, **kwargs):
        raise ds_config_module.DeepSpeedConfigError("no such thing")

    monkeypatch.setattr(ds_config_module.DeepSpeedConfig, "__init__", refusing)
    assert refusal(ds).endswith("refuses it: no such thing")


@pytest.mark.parametrize("torch_adam", [True, False], ids=["torch-adamw", "deepspeed-cpu-adam"])
def test_a_config_with_every_section_this_project_uses_passes(torch_adam):
    ds = with_values(handed_over(EVERY_SECTION), {"optimizer.params.torch_adam": torch_adam})
    assert ds["checkpoint"] == {"load_universal": True} and "total_num_steps" in ds["scheduler"]["params"]
    before = copy.deepcopy(ds)
    check_deepspeed_config(ds, 2)
    assert ds == before  # DeepSpeed pops optimizer params and writes into its config: never into ours


def test_every_shipped_config_passes_at_each_world_size_its_batch_layout_allows():
    checked = []
    for path in CONFIGS:
        cfg = load_config(path)
        for world_size in (1, 2, 8):
            try:
                cfg.gradient_accumulation_steps(world_size)
            except ConfigError:
                continue  # the project refuses this layout before DeepSpeed sees it
            for load_universal in (False, True):
                check_deepspeed_config(deepspeed_config(cfg, world_size, load_universal=load_universal), world_size)
            checked.append((path.stem, world_size))
    assert {name for name, _ in checked} == {path.stem for path in CONFIGS}
    assert ("wt103_base", 8) in checked and ("enwik8_large", 8) in checked


def test_the_batch_layout_is_checked_at_the_given_world_size():
    ds = handed_over(EVERY_SECTION, world_size=2)  # gradient_accumulation_steps 2 for 8 = 2 x 2 x 2
    check_deepspeed_config(ds, 2)
    message = refusal(ds, world_size=4)
    assert "\n" not in message and message.startswith("deepspeed: ") and "8 != 2 * 2 * 4" in message


def test_the_check_is_quick_and_needs_no_process_group():
    ds = handed_over(EVERY_SECTION)
    process_group_before = dist.is_initialized()
    check_deepspeed_config(ds, 2)  # the first call pays for lazy imports
    start = time.perf_counter()
    for _ in range(20):
        check_deepspeed_config(ds, 2)
    assert (time.perf_counter() - start) / 20 < 0.1
    assert dist.is_initialized() == process_group_before
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("stage, settings, expected", [
    pytest.param(0, {"data_types.grad_accum_dtype": "fp32"}, "fp32 with a bf16 model needs ZeRO stage 1-3",
                 id="fp32-accumulation-of-bf16-at-stage-0"),
    pytest.param(0, {"bf16.enabled": False, "data_types.grad_accum_dtype": "bfloat16"},
                 "bf16 with a fp32 model needs ZeRO stage 1-3", id="bf16-accumulation-of-fp32-at-stage-0"),
    pytest.param(2, {"data_types.grad_accum_dtype": "float64"}, '"float64" is not a dtype DeepSpeed',
                 id="a-dtype-deepspeed-does-not-accumulate-in"),
    pytest.param(1, {"data_types.grad_accum_dtype": "fp32"}, "use its BF16_Optimizer, whose checkpoints its "
                 "zero_to_fp32 cannot export", id="fp32-accumulation-of-bf16-at-stage-1"),
])
def test_a_gradient_accumulation_dtype_deepspeed_cannot_run_is_refused(stage, settings, expected):
    # DeepSpeed raised these inside deepspeed.initialize (NotImplementedError "unsupported mix"), after the model,
    # or (stage 1) trained with an optimizer whose checkpoints its zero_to_fp32 cannot export.
    ds = with_values(handed_over(EVERY_SECTION), {"zero_optimization.stage": stage, **settings})
    message = refusal(ds)
    assert message.startswith("deepspeed.data_types.grad_accum_dtype: ") and expected in message, message
    for accum in ("bf16", "fp32"):  # what a stage 2-3 bf16 run may ask for
        check_deepspeed_config(with_values(handed_over(EVERY_SECTION), {"data_types.grad_accum_dtype": accum}), 2)


@pytest.mark.parametrize("stage, accum", [(0, "fp32"), (1, "fp32")])
def test_auto_precision_is_checked_for_bf16_too_before_it_is_decided(stage, accum):
    """precision "auto" is decided after the ranks connect: the start-up check read the section as fp32, so a
    gradient sum's dtype DeepSpeed refuses only for a bf16 model (NotImplementedError inside deepspeed.initialize at
    ZeRO 0; its BF16_Optimizer at ZeRO 1) passed, on a machine where auto then picks bf16 (any recent GPU)."""
    from txl_dist.startup import check_run_config

    raw = json.loads((REPO / "configs" / "tiny.json").read_text())
    raw["deepspeed"]["zero_optimization"] = {"stage": stage}
    raw["deepspeed"]["data_types"] = {"grad_accum_dtype": accum}
    for precision in ("fp32", "auto"):
        raw["train"]["precision"] = precision
        if precision == "fp32":
            check_run_config(config_from_dict(copy.deepcopy(raw)), 1)  # in fp32 the section is fine
            continue
        with pytest.raises(ConfigError) as refused:
            check_run_config(config_from_dict(copy.deepcopy(raw)), 1)
        message = str(refused.value)
        assert message.startswith("deepspeed.data_types.grad_accum_dtype: fp32 with a bf16 model") and \
            message.endswith('(train.precision "auto" may pick bf16 for this run; name a precision to train in, or '
                             "change the deepspeed section)"), message
    raw["deepspeed"]["zero_optimization"] = {"stage": 2}  # fp32 sums of a bf16 model: fine at ZeRO 2
    check_run_config(config_from_dict(copy.deepcopy(raw)), 1)


def test_deepspeed_imports_without_mlflow_or_the_inductor_and_mlflow_still_imports_afterwards():
    """txl_dist/deepspeed_import.py: DeepSpeed's autotuner would import MLflow, and its Muon module (which every
    ZeRO 1-3 engine imports) TorchInductor's compiler: seconds of every rank's start."""
    import subprocess
    import sys

    probe = ("import sys; import txl_dist.engine, txl_dist.deepspeed_schema; "
             "from deepspeed.runtime.zero.muon import original_muon, muon_optimizer; "
             "print('mlflow' in sys.modules, sys.modules['deepspeed.autotuning.autotuner'].has_mlflow, "
             "'torch._inductor.compile_fx' in sys.modules, hasattr(original_muon.muon_update, '__wrapped__')); "
             "import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "False", "True", "mlflow"], out.stdout


def test_compile_on_first_call_compiles_once_when_first_called():
    from txl_dist.deepspeed_import import compile_on_first_call

    compiled = []

    def compiler_fn(fn):
        compiled.append(fn)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    def double(x, *, by=2):
        return x * by

    lazy = compile_on_first_call(double, compiler_fn)
    assert compiled == [] and lazy.__name__ == "double"
    assert lazy(3) == ("compiled", 6) and lazy(3, by=3) == ("compiled", 9)
    assert compiled == [double]


def test_deepspeed_waits_for_the_device_only_where_it_pays():
    """DeepSpeed's throughput timer waits for the device twice per micro step for a number nothing reads: off
    unless the config names it. overlap_comm (the GPU presets' ZeRO 2) waits once per micro step after the
    backward on a GPU: off on one rank, which has no reduction to overlap with it; kept on more."""
    overlapped = {**EVERY_SECTION, "zero_optimization": {"stage": 2, "overlap_comm": True}}
    one, two = handed_over(overlapped, world_size=1), handed_over(overlapped, world_size=2)
    assert one["timers"] == two["timers"] == {"throughput": {"enabled": False}}
    assert (one["zero_optimization"]["overlap_comm"], two["zero_optimization"]["overlap_comm"]) == (False, True)
    assert handed_over(EVERY_SECTION, world_size=1)["zero_optimization"]["overlap_comm"]  # ZeRO-3's own
    timed = {**EVERY_SECTION, "timers": {"throughput": {"enabled": True, "synchronized": False}}}
    assert handed_over(timed)["timers"] == timed["timers"]
    check_deepspeed_config(one, 1)  # as DeepSpeed reads them


@pytest.mark.parametrize("key", ["partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"])
def test_activation_checkpointing_that_empties_a_layers_inputs_is_refused(key):
    """DeepSpeed's checkpoint then empties every tensor a layer was given once its forward has run; the layers share
    the position embeddings, so the second layer's forward failed with a traceback ("both arguments to linear need
    to be at least 1D"), after the model was built."""
    ds = with_values(handed_over(EVERY_SECTION), {f"activation_checkpointing.{key}": True})
    message = refusal(ds)
    assert message.startswith(f"deepspeed.activation_checkpointing.{key}: true is not supported here"), message
    assert "\n" not in message
    check_deepspeed_config(with_values(ds, {f"activation_checkpointing.{key}": False}), 2)
    for harmless in ({"number_checkpoints": 1}, {"profile": True}, {"synchronize_checkpoint_boundary": True}):
        check_deepspeed_config(with_values(handed_over(EVERY_SECTION),
                                           {f"activation_checkpointing.{k}": v for k, v in harmless.items()}), 2)


@pytest.mark.parametrize("stage, optimizer, expected", [
    pytest.param(2, "SGD", "'SGD' (torch.optim.sgd.SGD) is not an optimizer DeepSpeed", id="sgd-at-zero-2"),
    pytest.param(1, "RMSprop", "ZeRO stage 1 refuses it inside deepspeed.initialize", id="rmsprop-at-zero-1"),
    pytest.param(3, "SGD", "set deepspeed.zero_allow_untested_optimizer true", id="sgd-at-zero-3"),
    pytest.param(0, "LBFGS", "'LBFGS' needs a closure at every step", id="lbfgs"),
    pytest.param(0, "SparseAdam", "'SparseAdam' takes sparse gradients only", id="sparse-adam"),
])
def test_an_optimizer_deepspeed_builds_and_cannot_step_is_refused(stage, optimizer, expected):
    """These passed the checks and failed after the model was built: an untested optimizer at ZeRO 1-3 with an
    AssertionError inside deepspeed.initialize, LBFGS (no closure) and SparseAdam (dense gradients) at the first
    step."""
    section = {**EVERY_SECTION, "zero_optimization": {"stage": stage},
               "optimizer": {"type": optimizer, "params": {"lr": 0.01}}}
    message = refusal(handed_over(section))
    assert message.startswith("deepspeed.optimizer.type: ") and expected in message, message
    if stage:
        # What DeepSpeed asks for: it then trains with it; so does ZeRO 0 and a tested optimizer at the same stage.
        check_deepspeed_config(handed_over({**section, "zero_allow_untested_optimizer": True}), 2)
        check_deepspeed_config(handed_over({**section, "zero_optimization": {"stage": 0}}), 2)
        check_deepspeed_config(handed_over({**section, "optimizer": {"type": "Adagrad", "params": {"lr": 0.01}}}), 2)


@pytest.mark.parametrize("scheduler, params, expected", [
    pytest.param("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 0},
                 "OneCycle refuses them: cycle_first_step_size must be positive", id="one-cycle"),
    pytest.param("LRRangeTest", {"lr_range_test_step_size": 0}, "LRRangeTest refuses them: lr_range_test_step_size",
                 id="lr-range-test"),
])
def test_every_schedule_is_built_at_start_up(scheduler, params, expected):
    """DeepSpeed's OneCycle and LRRangeTest refused these inside deepspeed.initialize, after the model was built."""
    section = {**EVERY_SECTION, "scheduler": {"type": scheduler, "params": params}}
    message = refusal(handed_over(section))
    assert message.startswith("deepspeed.scheduler.params: DeepSpeed's ") and expected in message, message
    fine = {key: value for key, value in params.items() if not key.endswith("step_size")}
    check_deepspeed_config(handed_over({**section, "scheduler": {"type": scheduler, "params": fine}}), 2)
