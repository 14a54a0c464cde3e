"""The DeepSpeed engine: the only call to deepspeed.initialize in the project.

What the engine owns: ZeRO stages 0-3 (stage 3 builds the model inside deepspeed.zero.Init), bf16 / fp16 /
fp32 (the engine casts the model; mems then travel in the model's dtype), activation checkpointing of the
Transformer-XL layers with deepspeed.checkpointing.checkpoint (torch's non-reentrant checkpoint when the
layers are compiled: train.compile), gradient accumulation (derived from the world size), gradient
clipping, the LR schedule and the optimizer, all from the config's deepspeed section.

The optimizer: `"type": "AdamW"` with `"torch_adam": true` in its params makes DeepSpeed 0.19.8 build
torch.optim.AdamW (engine.get_optimizer_configuration checks torch_adam before anything else), which needs
no JIT op build; it also serves ZeRO-Offload (`offload_optimizer.device: cpu`) because a config-built
optimizer skips the client-optimizer check. Without torch_adam DeepSpeed picks FusedAdam (a ~50 s JIT
build on CPU) or, with offload, DeepSpeedCPUAdam (~57 s build, faster steps on big models).

fp16 on a CPU: DeepSpeed refuses it ("Type fp16 is not supported on your device") unless oneDNN has fp16
kernels (torch.ops.mkldnn._is_mkldnn_fp16_supported(), AVX512-FP16/AMX-FP16); bf16 is the CPU's fast path.
"""
from __future__ import annotations

import copy
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed
from .config import ConfigError, RunConfig
from .deepspeed_import import deepspeed  # first: deepspeed's own modules need no MLflow

from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer  # noqa: E402
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer  # noqa: E402

log = logging.getLogger(distributed.LOGGER_NAME)

# Schedulers of DeepSpeed whose params include total_num_steps (WarmupLR has none).
_SCHEDULERS_WITH_TOTAL = ("WarmupDecayLR", "WarmupCosineLR")

# DeepSpeed 0.19.8's own optimizers (config "type", lower case) and the op builder deepspeed.initialize loads
# for each (runtime/engine.py, _configure_basic_optimizer): (without optimizer offload, with it). None: a torch
# optimizer, nothing to build. Adam/AdamW with "torch_adam" build nothing either (optimizer_op_builder).
_OPTIMIZER_OPS: dict[str, tuple[str | None, str | None]] = {
    "adam": ("FusedAdamBuilder", "CPUAdamBuilder"),
    "adamw": ("FusedAdamBuilder", "CPUAdamBuilder"),
    "lamb": ("FusedLambBuilder", "FusedLambBuilder"),
    "lion": ("FusedLionBuilder", "CPULionBuilder"),
    "adagrad": (None, "CPUAdagradBuilder"),
}


def deepspeed_config(cfg: RunConfig, world_size: int, *, load_universal: bool = False) -> dict[str, Any]:
    """The deepspeed section as handed to deepspeed.initialize for this world size.

    gradient_accumulation_steps = S / (micro batch * W); bf16/fp16 runs at ZeRO 2-3 accumulate gradients
    in fp32 unless data_types.grad_accum_dtype says otherwise; the scheduler's total_num_steps follows
    train.max_steps when left out; `load_universal` makes load_checkpoint read a universal checkpoint
    (elastic resume), which DeepSpeed must know before initialize.
    """
    ds = cfg.deepspeed_config(world_size)
    if model_dtype(ds) != torch.float32 and zero_stage(ds) >= 2:
        # A 16-bit sum of micro-batch gradients drops the small ones (bf16 keeps 8 significant bits: 32 + 0.125
        # stays 32), and larger batches mean more micro steps. DeepSpeed sums in fp32 when asked, in its usual
        # checkpoint format at ZeRO 2-3. Not at 0 (no such mix) nor 1 (bf16 there switches to its BF16_Optimizer,
        # whose checkpoints its zero_to_fp32 cannot export): deepspeed_schema refuses those. A config that names a
        # dtype keeps it.
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    sched = ds.get("scheduler")
    if sched is not None and sched.get("type") in _SCHEDULERS_WITH_TOTAL:
        sched.setdefault("params", {}).setdefault("total_num_steps", cfg.train.max_steps)
    if load_universal:
        ds.setdefault("checkpoint", {})["load_universal"] = True
    # DeepSpeed's throughput timer (on unless configured) waits for the device twice per micro step from the
    # third step on, for a number this project never prints (the trainer times its steps itself).
    ds.setdefault("timers", {}).setdefault("throughput", {"enabled": False})
    zero = ds.get("zero_optimization", {})
    if world_size == 1 and zero.get("overlap_comm") and zero_stage(ds) in (1, 2):
        # ZeRO 1-2's overlap_comm waits for the device after every micro step's backward on a GPU
        # (independent_gradient_partition_epilogue); one rank has no reduction to overlap it with.
        zero["overlap_comm"] = False
    return ds


def zero_stage(ds_config: dict[str, Any]) -> int:
    """The ZeRO stage of a deepspeed config (0 when absent)."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def model_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype the engine casts the model to (and so the dtype of the mems)."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def gradient_traffic_note(stage: int, world_size: int, accumulation_steps: int) -> str | None:
    """What a ZeRO 2 run with several micro steps per rank sends more than ZeRO 1, or None where it sends the same.

    DeepSpeed 0.19.8's ZeRO 2 all-reduces each micro step's whole gradient as backward produces it
    (stage_1_and_2.py, reduce_ready_partitions_and_remove_grads), ZeRO 1 once per optimizer step:
    `python -m bench.probes comm-volume` counts it (docs/performance.md, "ZeRO stage and gradient traffic")."""
    if stage != 2 or world_size == 1 or accumulation_steps == 1:
        return None
    return (f"ZeRO 2 all-reduces the whole gradient after each of the step's {accumulation_steps} micro steps: "
            f"{accumulation_steps}x the gradient traffic of ZeRO 1, which all-reduces once per step. Over slow links "
            "(PCIe without NVLink, Ethernet between nodes) fewer micro steps (more ranks, or a larger micro batch) "
            "send less; ZeRO 1 does too, but sums a bf16 run's gradients in bf16 (docs/performance.md, "
            "\"ZeRO stage and gradient traffic\")")


ZERO3_COMPILE_WARNING = (
    "train.compile at ZeRO-3: DeepSpeed's hooks that gather each submodule's weights break every layer's graph "
    "(2 layers: 23 graphs, 39 breaks, dynamo's recompile limit hit, where ZeRO 0-2 compile 3 graphs and no "
    "break); it trains like eager, but the compiled layers may not be faster: measure, or use ZeRO 0-2")


def build_engine(model_fn: Callable[[], nn.Module], ds_config: dict[str, Any], *, seed: int,
                 compile_layers: bool = False):
    """Build the model (seeded: the same weights on every rank and every world size) and its engine.

    `model_fn()` returns the model; under ZeRO-3 it runs inside deepspeed.zero.Init so that no rank ever
    holds all the weights. compile_layers (train.compile): torch.compile each layer
    (TransformerXL.compile_layers); activation checkpointing then recomputes the layers with torch's
    non-reentrant checkpoint, because DeepSpeed's is reentrant: it runs each layer under no_grad and again
    with grad inside backward, a second graph per layer shape. The LR scheduler stands at iteration 0: optimizer
    step k (from 0) trains at the schedule's iteration k. Returns the DeepSpeedEngine (`engine(...)`,
    `engine.backward`, `engine.step`).
    """
    skip_shm_comm_build()
    # DeepSpeed's ZeRO calls these torch collectives at every step; the deprecation is theirs to fix and
    # would print twice per step and rank.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # DeepSpeed's comm layer must know the process group before zero.Init reads the world size from it
    # (otherwise it sees a world of one and refuses the batch layout).
    deepspeed.init_distributed()
    _clone_world_group_with_the_collective_timeout()
    ds_config = copy.deepcopy(ds_config)  # deepspeed.initialize pops keys from it
    torch.manual_seed(seed)
    if zero_stage(ds_config) == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = model_fn()
        # zero.Init partitions each submodule's weights as soon as that submodule is built, so the
        # initialization a parent runs at the end of its __init__ (TransformerXL.reset_parameters) drew
        # nothing into the partitions, and the RNG is not where it would be without zero.Init. Initialize
        # again on the gathered weights from a reseeded RNG (one full gather, once, at start-up).
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            _reinitialize(model, seed)
        register_borrowed_parameters(model)
    else:
        model = model_fn()
        # The same draws as under ZeRO-3 on a CPU: weights depend on the seed alone. On a GPU zero.Init's
        # gathered weights are on the device, whose generator draws other values (docs/checkpoints.md).
        _reinitialize(model, seed)
    if "activation_checkpointing" in ds_config and compile_layers:
        model.set_activation_checkpointing(None)  # None: torch's non-reentrant checkpoint
    elif "activation_checkpointing" in ds_config:
        deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
        model.set_activation_checkpointing(deepspeed.checkpointing.checkpoint)
    if compile_layers:
        if zero_stage(ds_config) == 3:
            log.warning(ZERO3_COMPILE_WARNING, extra=distributed.RANK_ZERO_ONLY)
        model.compile_layers()
    announce_optimizer_op_build(ds_config)
    with dropped_deepspeed_warning(_SCHEDULER_NOT_STARTED):  # the step() below starts it
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    forget_state_initialization_step(engine.optimizer)
    if engine.fp16_enabled():
        grow_the_loss_scale_after_the_step(engine.optimizer)
    if engine.lr_scheduler is not None:
        # DeepSpeed builds the scheduler at iteration -1, whose learning rate is 0 whatever warmup_min_ratio
        # says, and moves it after each optimizer step: the first step would train at lr 0 and the schedule
        # would run one step late. One move now makes optimizer step k (from 0) use the schedule's iteration
        # k. A resumed run then loads the scheduler's state from its checkpoint, which replaces this.
        engine.lr_scheduler.step()
    return engine


def forget_state_initialization_step(optimizer) -> None:
    """Undo the step DeepSpeed 0.19.8's FP16_Optimizer and FP16_UnfusedOptimizer (bf16 and fp16 at ZeRO 0) take
    when built: they step the optimizer once with zero gradients to create its state. Adam counts that step,
    so every update used the bias correction of one step later: the first real update came out ~0.74 of fp32's,
    the 4th-6th ~0.95 (found by the config sweep's fp32 twin, bench/twin_check.py); decoupled weight decay
    shrank the fp32 master weights once at the configured learning rate; coupled decay left Adam's moments
    non-zero. ZeRO 1-3 no longer take that step (DeepSpeed pull request 5104). Here the optimizer's state is
    dropped, so torch's and DeepSpeed's Adam create it afresh at the first real step, and the master weights
    are copied again from the 16-bit weights they were cloned from (the wrappers never copy back before a real
    step)."""
    if isinstance(optimizer, FP16_Optimizer):
        pairs = list(zip(optimizer.fp16_groups_flat, optimizer.fp32_groups_flat))
    elif isinstance(optimizer, FP16_UnfusedOptimizer):
        pairs = [pair for low, high in zip(optimizer.fp16_groups, optimizer.fp32_groups) for pair in zip(low, high)]
    else:
        return
    with torch.no_grad():
        for low, master in pairs:
            master.copy_(low)
    optimizer.optimizer.state.clear()


def grow_the_loss_scale_after_the_step(optimizer) -> None:
    """Make DeepSpeed 0.19.8's fp16 optimizers (its FP16 wrappers at ZeRO 0, its ZeRO 1-3 optimizers) unscale a step's
    gradients by the loss scale they were scaled with. Each step() grows the dynamic scale (after loss_scale_window
    steps without an overflow) before it unscales and clips, so such a step divided its gradients by twice their
    scale: its update was halved (unless clipping shrank it anyway, which judged the norm right: the scale cancels),
    and at ZeRO 3 (and in FP16_Optimizer) the reported gradient norm too (tests/test_engine.py; the config sweep's
    fp32 twin, bench/twin_check.py, sees it with a window of 2). Here a growth waits until the step is done; a shrink
    after an overflow, which no unscale follows, happens at once. The scale's state (scale, iteration, last overflow)
    ends each step as before, so checkpoints are unchanged. Every one of these optimizers calls its own _update_scale
    inside step()."""
    if not callable(getattr(optimizer, "_update_scale", None)):
        return
    update_scale, step = optimizer._update_scale, optimizer.step
    deferred = False

    def update_scale_after_the_step(skip: bool) -> None:
        nonlocal deferred
        if skip:
            update_scale(skip)
        else:
            deferred = True

    def step_then_update_scale(*args, **kwargs):
        nonlocal deferred
        try:
            return step(*args, **kwargs)
        finally:
            if deferred:
                deferred = False
                update_scale(False)

    optimizer._update_scale = update_scale_after_the_step
    optimizer.step = step_then_update_scale


def backward(engine, loss: torch.Tensor) -> float:
    """engine.backward(loss), with the loss scaled where DeepSpeed 0.19.8 leaves it unscaled: fp16 at ZeRO 0.
    Returns the factor the loss was multiplied by here (1.0 elsewhere), for deepspeed_grad_norm.

    There DeepSpeed wraps the optimizer in FP16_Optimizer or FP16_UnfusedOptimizer, whose step() divides the
    gradients by the loss scale (2**16 at first), but engine.backward scales the loss only for ZeRO's own
    optimizers and runs loss.backward() on the loss as it is. Every fp16 update at ZeRO 0 came out 65536
    times too small (with SGD the fp16 weights did not move at all; Adam's eps swallowed most of the
    gradient), and no overflow was ever seen, so the scale kept growing. Scaled here as the wrappers' own
    backward() scales it (DeepSpeed pull request 8393 makes the same change upstream; tests/test_engine.py
    fails if a DeepSpeed that scales it too would scale it twice)."""
    optimizer = engine.optimizer
    factor = 1.0
    if engine.fp16_enabled() and isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        scaling = optimizer.loss_scale_config
        if getattr(scaling, "use_grad_scaling", True):  # FP16_UnfusedOptimizer's backward asks it too
            factor = float(scaling.cur_scale)
            loss = loss.float() * factor
    engine.backward(loss)
    return factor


def deepspeed_grad_norm(engine, loss_factor: float):
    """engine.get_global_grad_norm() after engine.step(), of the unscaled gradients. loss_factor: what
    backward() returned for the step's micro batches. FP16_UnfusedOptimizer reports the norm of the gradients
    as the scaled loss left them (FP16_Optimizer and ZeRO's optimizers divide by their scale first)."""
    norm = engine.get_global_grad_norm()
    if norm is not None and loss_factor != 1.0 and isinstance(engine.optimizer, FP16_UnfusedOptimizer):
        norm = norm / loss_factor
    return norm


def register_borrowed_parameters(model: nn.Module) -> None:
    """Tell ZeRO-3 which weights each module's forward reads from its submodules without calling them (the
    modules' `borrowed_parameters()`: the adaptive softmax's tables and projections, the input projections).

    ZeRO-3 gathers a module's own weights when the module is called. DeepSpeed 0.19.8 registers a weight read
    from elsewhere only when a forward finds it partitioned, so what it knew depended on what a checkpoint load
    or a skipped fp16 step had left gathered, and a step whose reads differed from the trace recorded at the
    first step failed in its backward ("tracing error ... expected the next 4 parameters in the parameter
    fetch queue": a resumed fp16 run whose first step overflowed, tests/test_trainer.py). Named up front, the
    set is the same in every step of every run."""
    for module in model.modules():
        borrowed = getattr(module, "borrowed_parameters", None)
        for param in borrowed() if callable(borrowed) else ():
            deepspeed.zero.register_external_parameter(module, param)


def announce_optimizer_op_build(ds_config: dict[str, Any]) -> str | None:
    """Log one line when deepspeed.initialize is about to JIT-build an op for the optimizer (minutes on the
    first start on a machine, with nothing printed meanwhile); returns the op's name, or None when nothing
    is built (a torch optimizer, an op DeepSpeed was installed with, or one already built and cached)."""
    builder_name = optimizer_op_builder(ds_config)
    op = op_to_build(builder_name) if builder_name else None
    if op is not None:
        log.info("DeepSpeed builds its %s op on the first start on a machine (minutes, nothing printed meanwhile; "
                 "cached in %s); `\"torch_adam\": true` in the optimizer params uses torch's AdamW instead",
                 builder_name.removesuffix("Builder"), op_cache_dir(op))
    return op


def check_optimizer_op_available(ds_config: dict[str, Any]) -> None:
    """Refuse an optimizer whose DeepSpeed op this accelerator lacks (Lamb's and Lion's fused CUDA ops on a
    CPU), or whose CUDA op DeepSpeed would have to build here and cannot (no CUDA toolkit, or one of another
    CUDA version than torch's): deepspeed.initialize would fail with it after the model is built, on every
    rank, with a traceback."""
    builder_name = optimizer_op_builder(ds_config)
    if builder_name is None:
        return
    kind, op = (ds_config.get("optimizer") or {}).get("type"), builder_name.removesuffix("Builder")
    if _op_builder(builder_name) is None:
        raise ConfigError(f"deepspeed.optimizer.type: {kind!r} needs DeepSpeed's {op} op, which the "
                          f"{get_accelerator().device_name()} accelerator lacks; use AdamW (\"torch_adam\": true) or a "
                          "torch.optim class")
    why = cuda_op_build_problem(builder_name)
    if why is not None:
        raise ConfigError(f"deepspeed.optimizer: {kind!r} needs DeepSpeed's {op} op, which DeepSpeed would compile "
                          f"for this GPU at start-up and cannot: {why}; set \"torch_adam\": true in "
                          "deepspeed.optimizer.params (torch's fused AdamW: nothing to compile), or make CUDA_HOME a "
                          f"CUDA toolkit of torch's version ({torch.version.cuda}) with nvcc")


def cuda_op_build_problem(builder_name: str) -> str | None:
    """Why DeepSpeed cannot JIT-compile its CUDA op `builder_name` here (its own checks: CUDA_HOME with an nvcc
    of torch's CUDA version, ninja), or None: nothing to compile (installed, cached, not a CUDA op) or it can.
    A pip-installed CUDA torch brings no nvcc, and a cluster's default toolkit is often of another version."""
    from deepspeed.ops.op_builder import builder as op_builder

    builder = _op_builder(builder_name)
    if not isinstance(builder, op_builder.CUDAOpBuilder) or op_to_build(builder_name) is None:
        return None
    try:
        op_builder.assert_no_cuda_mismatch(builder.name)
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except Exception as e:  # noqa: BLE001 - DeepSpeed's and torch's reasons, in their words
        return " ".join(str(e).lstrip(">- ").split()) or type(e).__name__
    return None


def _op_builder(builder_name: str):
    """DeepSpeed's builder of that op for this accelerator, or None where it has none."""
    builder = get_accelerator().create_op_builder(builder_name)
    return None if builder is None or type(builder).__name__ == "NotImplementedBuilder" else builder


def optimizer_op_builder(ds_config: dict[str, Any]) -> str | None:
    """The class name of the DeepSpeed op builder that deepspeed.initialize will load for the config's
    optimizer (e.g. "FusedAdamBuilder"), or None when it builds a torch optimizer."""
    optimizer = ds_config.get("optimizer") or {}
    kind = str(optimizer.get("type", "")).lower()
    if kind in ("adam", "adamw") and (optimizer.get("params") or {}).get("torch_adam"):
        return None
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    offloaded = offload.get("device") in ("cpu", "nvme")
    builders = _OPTIMIZER_OPS.get(kind)
    return None if builders is None else builders[offloaded]


def op_to_build(builder_name: str) -> str | None:
    """The name of the op `builder_name` makes when loading it means a JIT build here, else None: DeepSpeed
    has no such op for this accelerator (it fails on its own), the op was installed with DeepSpeed or is
    loaded already, or torch's extension cache holds its library (a cheap look: no source hashing, so a
    cache that torch finds stale still rebuilds, silently)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    builder = _op_builder(builder_name)
    if builder is None:
        return None
    name = builder.NAME
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(name) or name in getattr(OpBuilder, "_loaded_ops", {}):
        return None
    cache = op_cache_dir(name)
    return None if cache is not None and (cache / f"{name}.so").is_file() else name


def op_cache_dir(name: str) -> Path | None:
    """torch's JIT extension folder of op `name` (TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions/<py>_<cu>/),
    the one DeepSpeed's build uses; torch creates it if missing (the build would). None where torch's private
    helper is not what this expects."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - a hint only: it must never stop a start
        return None


_SCHEDULER_NOT_STARTED = "Attempting to get learning rate from scheduler before it has started"


@contextmanager
def dropped_deepspeed_warning(prefix: str) -> Iterator[None]:
    """Leave out one DeepSpeed log message that says nothing to the user here."""
    from deepspeed.utils import logger

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _clone_world_group_with_the_collective_timeout() -> None:
    """Make DeepSpeed's clone of the world group, on which ZeRO runs its gradient and parameter collectives,
    with the default group's timeout (distributed.group_timeout).

    DeepSpeed 0.19.8 clones the world group lazily (deepspeed.utils.groups._clone_world_group) with torch's
    default timeout: 10 minutes on NCCL, 30 on gloo, whatever train.collective_timeout_s says. A clone made
    here first is the one it keeps. Nothing to do outside init_process_group (no timeout known) or once a
    clone exists.
    """
    from deepspeed.utils import groups

    timeout = distributed.collective_timeout()
    if timeout is None or getattr(groups, "_WORLD_GROUP", None) is not None:
        return
    groups._WORLD_GROUP = torch.distributed.new_group(ranks=list(range(torch.distributed.get_world_size())),
                                                      timeout=timeout)


def _reinitialize(model: nn.Module, seed: int) -> None:
    if hasattr(model, "reset_parameters"):
        torch.manual_seed(seed)
        model.reset_parameters()


def global_grad_norm(engine) -> torch.Tensor | None:
    """The 2-norm of the whole (data-parallel averaged) gradient, before clipping: a 0-d tensor on the device.

    DeepSpeed reports it after engine.step() at ZeRO 1-3 and under its bf16/fp16 optimizers; a plain
    fp32 stage-0 engine reports None (docs/architecture.md). There the gradients are complete and identical on every
    rank once the last micro batch's backward has run, so call this BEFORE engine.step(): it computes the
    norm itself when DeepSpeed will not, and returns None when DeepSpeed will (read it after the step with
    deepspeed_grad_norm).
    """
    if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


@contextmanager
def skipped_unless_finite(engine, norm: torch.Tensor | None) -> Iterator[None]:
    """Around engine.step(): when `norm` (the engine's own global_grad_norm; None: nothing to do) is not
    finite, the optimizer leaves the weights and its state as they are, as DeepSpeed does itself everywhere
    but at fp32 stage 0. torch's fused Adam/AdamW takes the verdict on the device (`found_inf`, as under a
    GradScaler), so the step has no host sync; any other optimizer's step is skipped after reading the norm
    on the host. The gradients stay (DeepSpeed's clipping indexes them), the LR schedule moves on."""
    optimizer = engine.optimizer
    if norm is None:
        yield
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and optimizer.defaults.get("fused"):
        # (AdamW subclasses Adam in newer torch; in torch 2.6 it is a class of its own with the same fused step)
        optimizer.found_inf = (~torch.isfinite(norm)).float()  # 0-d, like the steps it is subtracted from
        try:
            yield
        finally:
            del optimizer.found_inf
    elif math.isfinite(float(norm)):
        yield
    else:
        optimizer.step = lambda *args, **kwargs: None  # shadows the class's step for this one call
        try:
            yield
        finally:
            del optimizer.step


def skip_shm_comm_build() -> None:
    """Do not JIT-build DeepSpeed's shared-memory comm op on CPU (58 s to minutes on a fresh machine).

    DeepSpeed 0.19.8 builds `deepspeed_shm_comm` in TorchBackend.__init__ whenever the op is marked
    compatible, but only inference_all_reduce (tensor-parallel inference) uses it; training collectives
    go to gloo. There is no environment switch; deepspeed.ops keeps its compatibility table in one module
    dict that later lookups read (its own comment says edits persist), so marking the op incompatible
    there makes build_shm_op return None. Must run before the first deepspeed.init_distributed.
    """
    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
