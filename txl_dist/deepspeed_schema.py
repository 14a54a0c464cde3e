"""The deepspeed section of a run config against DeepSpeed's own reading of it (check_deepspeed_config).

DeepSpeed reads the keys it knows with defaults and ignores every other one: `"gradient_cliping": 1.0` runs
with DeepSpeed's default clipping (1.0, not off) and nothing says so. Imports deepspeed
(through deepspeed_import.py, as engine.py, checkpoint.py and safe_load.py do).
"""
from __future__ import annotations

import collections
import copy
import inspect
import json
import logging
import sys
import typing
from collections.abc import KeysView
from typing import Any

import pydantic
import torch

from .config import ConfigError, _suggest, _type_name
from .deepspeed_import import deepspeed  # first: deepspeed's own modules below need no MLflow
from .errors import one_line

from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime import config as ds_config_module  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_scalar_param  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS  # noqa: E402


def check_deepspeed_config(ds: dict[str, Any], world_size: int) -> None:
    """Refuse a deepspeed section that DeepSpeed would misread, with one ConfigError line naming the key.

    DeepSpeed reads the keys it knows with defaults and ignores every other one, so a misspelled key runs on
    DeepSpeed's default and a value of the wrong type fails steps later, if ever. `ds` is the dict handed to
    deepspeed.initialize (deepspeed_config's result). DeepSpeedConfig reads it here at `world_size` (no
    process group, no op build, no device) through views that record every key it looks up: a key of a
    section it reads key by key must be one it looked up; a section it hands whole to one of its pydantic
    models is judged by that model; a scalar it reads with get_scalar_param must have the type of its
    default; optimizer.params and scheduler.params must be arguments of the class DeepSpeed builds for them.
    Recording the reading, rather than collecting DeepSpeed's key constants, follows DeepSpeed exactly: its
    constants mix top-level and nested names ("enabled", "type") and miss the keys it spells inline
    (hybrid_engine, pipeline, compile, tensor_parallel, comms_logger, ...).
    """
    if not isinstance(ds, dict):
        raise ConfigError(f"deepspeed: must be a JSON object, got {_json(ds)}")
    reading = _Reading()
    config = _read_as_deepspeed(ds, world_size, reading)
    _check_unread_keys(ds, reading, config)
    _check_scalar_types(ds, reading)
    _check_precision_supported(config)
    _check_gradient_accumulation_dtype(config)
    _check_activation_checkpointing(ds)
    _check_optimizer(ds, config)
    _check_scheduler(ds)


def _check_precision_supported(config: ds_config_module.DeepSpeedConfig) -> None:
    # DeepSpeed refuses these inside deepspeed.initialize, after the model is built: here, before any work.
    accelerator = get_accelerator()
    for name, enabled, supported in (("fp16", config.float16_config.enabled, accelerator.is_fp16_supported),
                                     ("bf16", config.bfloat16_config.enabled, accelerator.is_bf16_supported)):
        if enabled and not supported():
            raise ConfigError(f"train.precision / deepspeed.{name}.enabled: {_DS_VERSION} does not support {name} "
                              f"on this {accelerator.device_name()} device; use another precision (or \"auto\")")


def _check_gradient_accumulation_dtype(config: ds_config_module.DeepSpeedConfig) -> None:
    # DeepSpeed reads the name inside deepspeed.initialize, after the model is built; at stage 0 it accumulates
    # in the model's dtype only (another one is a NotImplementedError there: "unsupported mix").
    if config.grad_accum_dtype is None:
        return
    try:
        accum = ds_config_module.DtypeEnum(config.grad_accum_dtype).name
    except ValueError:
        accum = None
    if accum not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"deepspeed.data_types.grad_accum_dtype: {_json(config.grad_accum_dtype)} is not a dtype "
                          f"{_DS_VERSION} accumulates in; use \"fp32\", \"bf16\" or \"fp16\"")
    model = "fp16" if config.float16_config.enabled else "bf16" if config.bfloat16_config.enabled else "fp32"
    if config.zero_optimization_stage == 0 and accum != model:
        raise ConfigError(
            f"deepspeed.data_types.grad_accum_dtype: {accum} with a {model} model needs ZeRO stage 1-3 "
            f"({_DS_VERSION} accumulates in the model's dtype at stage 0); set deepspeed.zero_optimization.stage "
            f"to 1 or remove grad_accum_dtype")
    if config.zero_optimization_stage == 1 and model == "bf16" and accum == "fp32":
        # DeepSpeed then trains with its BF16_Optimizer, whose optimizer files its own zero_to_fp32 refuses ("is
        # not a zero checkpoint"): launch/export.py and launch/generate.py could not read the run's checkpoints.
        raise ConfigError(
            "deepspeed.data_types.grad_accum_dtype: fp32 with a bf16 model at ZeRO stage 1 makes "
            f"{_DS_VERSION} use its BF16_Optimizer, whose checkpoints its zero_to_fp32 cannot export; use "
            "deepspeed.zero_optimization.stage 2 (fp32 sums, the usual checkpoints) or remove grad_accum_dtype")


_INPUT_EMPTYING_CHECKPOINTING = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
"""activation_checkpointing switches with which DeepSpeed's checkpoint empties every floating-point tensor a layer
was given (`arg.data = torch.empty([])`) once the layer's forward has run, keeping a partition or a CPU copy for its
backward (contiguous_memory_optimization needs partition_activations). Megatron's layers take only their input
there; a Transformer-XL layer is also given the position embeddings all layers share and its memory, so the next
layer failed in its forward ("both arguments to linear need to be at least 1D") and the mems would be lost."""


def _check_activation_checkpointing(ds: dict) -> None:
    section = ds.get("activation_checkpointing")
    if not isinstance(section, dict):
        return
    for key in _INPUT_EMPTYING_CHECKPOINTING:
        if section.get(key) is not True:
            continue
        why = (f"{_DS_VERSION} then empties the tensors each layer is given once its forward has run, and the "
               "Transformer-XL layers share the position embeddings and read the mems, so the next layer's forward "
               "fails")
        if key == "contiguous_memory_optimization":
            why = f"it needs partition_activations, which is not supported here ({why})"
        raise ConfigError(f"deepspeed.activation_checkpointing.{key}: true is not supported here: {why}; leave it "
                          "out (every layer is still recomputed in the backward pass)")


_DS_VERSION = f"DeepSpeed {deepspeed.__version__}"
_MISSING = object()

# Keys DeepSpeed looks up only to refuse them (removed features): never a suggestion.
_REMOVED_KEYS = frozenset(getattr(ds_config_module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})) | frozenset(
    getattr(ds_config_module, "_REMOVED_ZERO_CONFIG_KEYS", {}))

# Keys DeepSpeed reads with get_scalar_param and a default of None, which says nothing about their type.
_SCALAR_TYPES_WITHOUT_DEFAULT: dict[tuple[str, ...], type] = {
    ("steps_per_print",): int,  # the engine prints when (global_steps + 1) % steps_per_print == 0
}
_SCALAR_KINDS = (bool, int, float, str)  # bool first: Python counts it as an int, a JSON config does not


class _Reading:
    """What DeepSpeed did with each section of a config while reading it; a path is a tuple of keys."""

    def __init__(self) -> None:
        self.looked_up: dict[tuple[str, ...], set[str]] = collections.defaultdict(set)
        self.scalar_defaults: dict[tuple[str, ...], Any] = {}
        self.handed_out: list[tuple[str, ...]] = []
        self.whole: set[tuple[str, ...]] = set()
        self.views: list[_RecordingDict] = []  # kept alive so that their ids stay theirs

    def view(self, section: dict, path: tuple[str, ...]) -> _RecordingDict:
        view = _RecordingDict(section, self, path)
        self.views.append(view)
        if path:
            self.handed_out.append(path)
        return view

    def taken_whole(self, path: tuple[str, ...]) -> bool:
        return any(path[:i] in self.whole for i in range(len(path) + 1))


class _RecordingDict(dict):
    """A copy of one config section that notes in a _Reading each key DeepSpeed looks up in it.

    Iterating or copying a section means DeepSpeed took it whole (to unpack it into a pydantic model, or to
    keep it), so its keys are then not judged by lookups.
    """

    def __init__(self, section: dict, reading: _Reading, path: tuple[str, ...]) -> None:
        super().__init__(section)
        self._reading, self._path = reading, path

    def __getitem__(self, key):
        self._reading.looked_up[self._path].add(key)
        return self._view_of(key, dict.__getitem__(self, key))

    def get(self, key, default=None):
        self._reading.looked_up[self._path].add(key)
        # get_scalar_param is `param_dict.get(name, default)`: its frame marks the default as a typed scalar.
        if sys._getframe(1).f_code is get_scalar_param.__code__:
            self._reading.scalar_defaults.setdefault(self._path + (key,), default)
        if not dict.__contains__(self, key):
            return default
        return self._view_of(key, dict.__getitem__(self, key))

    def __contains__(self, key):
        self._reading.looked_up[self._path].add(key)
        return dict.__contains__(self, key)

    def pop(self, key, *default):
        self._reading.looked_up[self._path].add(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        self._reading.looked_up[self._path].add(key)
        return dict.setdefault(self, key, default)

    def keys(self):
        return _RecordingKeys(self)  # `key in d.keys()` is a lookup; iterating the keys takes the section

    def __iter__(self):
        self._reading.whole.add(self._path)
        return dict.__iter__(self)

    def items(self):
        self._reading.whole.add(self._path)
        return dict.items(self)

    def values(self):
        self._reading.whole.add(self._path)
        return dict.values(self)

    def __copy__(self):
        # DeepSpeedConfig reads a shallow copy of the whole config, which must go on recording.
        if self._path:
            self._reading.whole.add(self._path)
        return self._reading.view(self._plain(), self._path)

    def __deepcopy__(self, memo):
        if self._path:
            self._reading.whole.add(self._path)
        return copy.deepcopy(self._plain(), memo)

    def _plain(self) -> dict:
        return dict(dict.items(self))  # dict.copy and dict() would go through keys() and take it whole

    def _view_of(self, key, value):
        # Below a section taken whole, every key belongs to whoever took it.
        if not isinstance(value, dict) or self._reading.taken_whole(self._path):
            return value
        return self._reading.view(value, self._path + (key,))


class _RecordingKeys(KeysView):
    """keys() of a _RecordingDict: membership goes through its __contains__, iteration through its __iter__."""


class _DeepSpeedConfigAtWorldSize(ds_config_module.DeepSpeedConfig):
    """DeepSpeedConfig that checks the batch layout at a given world size, with or without a process group.

    Without a process group DeepSpeedConfig takes the world size to be 1 (dist.get_rank fails before it would
    ask an mpu), which refuses every layout of more than one rank; the world size it works out is ignored.
    """

    def __init__(self, config: dict, world_size: int) -> None:
        self._pinned_world_size = world_size
        super().__init__(config)

    @property
    def world_size(self) -> int:
        return self._pinned_world_size

    @world_size.setter
    def world_size(self, _guess) -> None:
        pass


def _read_as_deepspeed(ds: dict, world_size: int, reading: _Reading) -> ds_config_module.DeepSpeedConfig:
    """DeepSpeedConfig of `ds` at `world_size`, read through a recording view; its refusals as ConfigError."""
    try:
        # A deep copy: DeepSpeed writes into the config it reads (data_efficiency), which must not reach `ds`.
        return _DeepSpeedConfigAtWorldSize(reading.view(copy.deepcopy(ds), ()), world_size)
    except pydantic.ValidationError as e:
        raise ConfigError(_validation_error_line(e, ds, reading)) from None
    except CONFIG_REFUSALS as e:
        _check_scalar_types(ds, reading)  # a value of the wrong type explains the refusal better than it does
        raise ConfigError(f"deepspeed: {_DS_VERSION} refuses it: {one_line(e)}") from e


CONFIG_REFUSALS = (AssertionError, ValueError, ds_config_module.DeepSpeedConfigError, TypeError, LookupError,
                   AttributeError, ArithmeticError)
"""What DeepSpeedConfig raises on a config it refuses: its assertions, ValueErrors and own error type, and what
a value of the wrong kind or shape makes its code raise. Not a RuntimeError or an OSError (a device that failed,
out of memory, a bug): a refusal is the same on every rank that reads the same config, so before the ranks
connect only a node's first rank prints it (distributed.refused_alike_by_this_nodes_first_rank); an error of
one rank's own, turned into one, ended that rank in silence (exit 2) while the others waited for it to join
(fault sweep seed 2001, cases 11 and 25)."""


def _check_unread_keys(ds: dict, reading: _Reading, config: ds_config_module.DeepSpeedConfig) -> None:
    # DeepSpeedConfig keeps some sections as they are for the engine (optimizer and scheduler params): they
    # count as taken whole, their keys are judged against the class they go to (_check_optimizer, ...).
    kept = {id(value) for value in vars(config).values()}
    reading.whole.update(view._path for view in reading.views if view._path and id(view) in kept)
    for path in dict.fromkeys([(), *reading.handed_out]):
        looked_up = reading.looked_up[path]
        # A section handed out but never looked into went whole to a pydantic model inside another dict
        # (monitor's tensorboard, wandb, ...): that model judges its keys.
        if reading.taken_whole(path) or (path and not looked_up):
            continue
        section = _value_at(ds, path)
        if not isinstance(section, dict):  # a section DeepSpeed added to its own copy
            continue
        for key in section:
            if key not in looked_up:
                raise ConfigError(f"{_dotted(path + (key,))}: not a key {_DS_VERSION} reads, it would be "
                                  f"ignored{_suggest(key, sorted(looked_up - _REMOVED_KEYS))}")


def _check_scalar_types(ds: dict, reading: _Reading) -> None:
    # DeepSpeed uses these values as they come (a string clip value fails at the first step, a float
    # steps_per_print never prints): each must have the type of its default, an integer will do for a number.
    for path, default in reading.scalar_defaults.items():
        value = _value_at(ds, path)
        kind = _SCALAR_TYPES_WITHOUT_DEFAULT.get(path) if default is None else _scalar_kind(default)
        if value is _MISSING or kind is None or _is_kind(value, kind):
            continue
        said = "" if default is None else f" like DeepSpeed's default {_json(default)}"
        raise ConfigError(f"{_dotted(path)}: expected {_type_name(kind)}{said}, got {_json(value)}")


def _scalar_kind(default: Any) -> type | None:
    return next((kind for kind in _SCALAR_KINDS if isinstance(default, kind)), None)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def _validation_error_line(error: pydantic.ValidationError, ds: dict, reading: _Reading) -> str:
    """The first problem one of DeepSpeed's pydantic models found, as the dotted key and what it expected."""
    problem = error.errors()[0]
    loc = tuple(str(part) for part in problem["loc"])
    path = _section_of(loc, ds, reading) + loc
    if problem["type"] == "extra_forbidden":
        known = _model_keys(error.title, loc[:-1])
        return f"{_dotted(path)}: not a key {_DS_VERSION} knows{_suggest(loc[-1], known)}"
    got = f", got {_json(problem['input'])}" if loc else ""
    return f"{_dotted(path)}: {problem['msg']}{got}"


def _section_of(loc: tuple[str, ...], ds: dict, reading: _Reading) -> tuple[str, ...]:
    # pydantic names keys from the model's point of view, and a model may be fed several sections inside a
    # plain dict (the monitor): the section is the latest one DeepSpeed took that holds the refused key.
    candidates = [*reversed(reading.handed_out), ()]
    return next((path for path in candidates if _value_at(ds, path + loc) is not _MISSING), candidates[0])


def _model_keys(title: str, within: tuple[str, ...]) -> list[str]:
    """Keys (names, aliases; not deprecated ones) of DeepSpeed's model `title` or of the one nested at `within`."""
    model = next((m for m in _subclasses(DeepSpeedConfigModel) if m.__name__ == title), None)
    for key in within:
        model = _nested_model(model, key) if model is not None else None
    if model is None:
        return []
    current = [(name, f) for name, f in model.model_fields.items() if not _deprecated(f)]
    return [key for name, f in current for key in (name, f.alias) if key]


def _deprecated(field: pydantic.fields.FieldInfo) -> bool:
    return bool((field.json_schema_extra or {}).get("deprecated"))  # DeepSpeedConfigModel's own marker


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def _nested_model(model: type, key: str) -> type | None:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            arms = (field.annotation, *typing.get_args(field.annotation))
            return next((t for t in arms if isinstance(t, type) and issubclass(t, pydantic.BaseModel)), None)
    return None


def _check_optimizer(ds: dict, config: ds_config_module.DeepSpeedConfig) -> None:
    section = ds.get("optimizer")
    if section is None:
        return
    name = section.get("type")
    if not isinstance(name, str) or not _is_known_optimizer(name):
        known = ", ".join(ds_config_module.DEEPSPEED_OPTIMIZERS)
        raise ConfigError(f"deepspeed.optimizer.type: {_json(name)} is not an optimizer {_DS_VERSION} builds"
                          f"{_suggest_optimizer(str(name))}; use one of {known} or a torch.optim class name")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"deepspeed.optimizer.params: must be a JSON object, got {_json(params)}")
    if ds_config_module.MAX_GRAD_NORM in params:
        raise ConfigError(f"deepspeed.optimizer.params.{ds_config_module.MAX_GRAD_NORM}: {_DS_VERSION} refuses it "
                          "as an optimizer parameter; use deepspeed.gradient_clipping")
    built = _optimizer_built(name, dict(params), config)
    if built is not None:
        cls, taken, own = built
        what = f"{cls.__module__}.{cls.__qualname__}, which {_DS_VERSION} builds for type '{name}' here"
        _check_arguments(params, cls, key="deepspeed.optimizer.params", what=what, taken=taken, own=set(own))
        _check_flags(params, cls, taken)
        _check_optimizer_values(cls, {k: v for k, v in params.items() if k not in taken}, own, what)
        _check_optimizer_steps_here(name, cls, config)


def _check_optimizer_steps_here(name: str, cls: type, config: ds_config_module.DeepSpeedConfig) -> None:
    """Refuse an optimizer class DeepSpeed builds and then cannot step: one whose step() needs a closure (DeepSpeed
    calls step() without one), SparseAdam (the model's gradients are dense), and at ZeRO 1-3 a class its ZeRO has
    not tested unless zero_allow_untested_optimizer says so. Each failed after the model was built: the first two
    at the first step, the last inside deepspeed.initialize (an AssertionError)."""
    if not isinstance(cls, type):  # mup's optimizers are functions that build a torch class
        return
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(f"deepspeed.optimizer.type: {name!r} needs a closure at every step (it evaluates the loss "
                          f"itself), which {_DS_VERSION} never passes; use AdamW (\"torch_adam\": true) or another "
                          "torch.optim class")
    if issubclass(cls, torch.optim.SparseAdam):
        raise ConfigError(f"deepspeed.optimizer.type: {name!r} takes sparse gradients only, and the model's are "
                          "dense; use AdamW (\"torch_adam\": true) or Adam")
    if config.zero_enabled and cls not in ZERO_SUPPORTED_OPTIMIZERS and not config.zero_allow_untested_optimizer:
        raise ConfigError(f"deepspeed.optimizer.type: {name!r} ({cls.__module__}.{cls.__qualname__}) is not an "
                          f"optimizer {_DS_VERSION}'s ZeRO has tested, and ZeRO stage {config.zero_optimization_stage}"
                          " refuses it inside deepspeed.initialize; set deepspeed.zero_allow_untested_optimizer true "
                          "to train with it anyway, use AdamW (\"torch_adam\": true), Adam or Adagrad, or ZeRO stage 0")


def _check_flags(params: dict, cls: type, taken: set[str]) -> None:
    """Switches must be JSON booleans: DeepSpeed and torch test them for truth, so a string, "false" too, would
    turn one ON. A switch is one of the keys DeepSpeed consumes itself (_DEEPSPEED_SWITCHES) or an argument of
    `cls` whose default is a bool, or that is annotated `bool | None` (then null is allowed)."""
    arguments, class_name = inspect.signature(cls).parameters, f"{cls.__module__}.{cls.__qualname__}"
    for key, value in params.items():
        argument = arguments.get(key)
        if key in taken:
            if key not in _DEEPSPEED_SWITCHES:
                continue
            optional, reader = _DEEPSPEED_SWITCHES[key], _DS_VERSION
        elif argument is not None and isinstance(argument.default, bool):
            optional, reader = False, class_name
        elif argument is not None and set(typing.get_args(argument.annotation)) == {bool, type(None)}:
            optional, reader = True, class_name  # `bool | None`
        else:
            continue
        if not isinstance(value, bool) and not (optional and value is None):
            allowed = "true, false or null" if optional else "true or false"
            raise ConfigError(f"deepspeed.optimizer.params.{key}: must be {allowed}, got {_json(value)} (a switch "
                              f"that {reader} tests for truth: a string, \"false\" too, would turn it on)")


_DEEPSPEED_SWITCHES = {"torch_adam": False, "adam_w_mode": False, "fp32_optimizer_states": True, "foreach": True}
"""Optimizer params DeepSpeed consumes itself that are switches, and whether null is one of their values."""


def _check_optimizer_values(cls: type, params: dict, own: dict, what: str) -> None:
    """A torch.optim class is built here on a stand-in parameter, so that its own value checks (lr >= 0,
    betas in [0, 1), their types) refuse at start-up, not in deepspeed.initialize after the model is built.
    DeepSpeed's own classes may compile an op when built: their usual values are only checked for type."""
    if cls.__module__.startswith("torch.optim"):
        stand_in = torch.nn.Parameter(torch.zeros(1))
        try:
            cls([stand_in], **params, **own)
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            raise ConfigError(f"deepspeed.optimizer.params: {what} refuses them: {one_line(e)}") from None
        return
    for key in ("lr", "eps", "weight_decay"):
        if key in params and (isinstance(params[key], bool) or not isinstance(params[key], (int, float))):
            raise ConfigError(f"deepspeed.optimizer.params.{key}: must be a number, got {_json(params[key])}")
    betas = params.get("betas", [0.0, 0.0])
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
        raise ConfigError(f"deepspeed.optimizer.params.betas: must be two numbers, e.g. [0.9, 0.999], got "
                          f"{_json(betas)}")


def _is_known_optimizer(name: str) -> bool:
    # DeepSpeed lower-cases its own names; any other goes to getattr(torch.optim, name) as it is.
    return name.lower() in ds_config_module.DEEPSPEED_OPTIMIZERS or _is_torch_optimizer(name)


def _is_torch_optimizer(name: str) -> bool:
    cls = getattr(torch.optim, name, None)
    return isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)


def _suggest_optimizer(name: str) -> str:
    # DeepSpeed's names are lower-case, torch's carry the casing people type (AdamW): offer both spellings.
    names = set(ds_config_module.DEEPSPEED_OPTIMIZERS) | {n for n in dir(torch.optim) if _is_torch_optimizer(n)}
    return _suggest(name, sorted(names))


class _EngineView:
    """The DeepSpeedEngine methods that pick the Adam class, run on a DeepSpeedConfig instead of an engine.

    get_optimizer_configuration pops the params DeepSpeed consumes itself and returns the class with the
    keyword arguments DeepSpeed adds, building nothing: DeepSpeed's own choice rather than a copy of it.
    """

    zero_use_cpu_optimizer = DeepSpeedEngine.zero_use_cpu_optimizer
    bf16_optimizer_states = DeepSpeedEngine.bf16_optimizer_states
    get_optimizer_configuration = DeepSpeedEngine.get_optimizer_configuration

    def __init__(self, config: ds_config_module.DeepSpeedConfig) -> None:
        self._config = config
        # What configure_zenflow sets on an engine (ZenFlow's CPU Adam takes **kwargs: nothing to check).
        self.zenflow = config.zero_config.zenflow is not None
        self.overlap_step = getattr(config.zero_config.zenflow, "overlap_step", False)


_MUP_OPTIMIZERS = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}


def _optimizer_built(name: str, params: dict,
                     config: ds_config_module.DeepSpeedConfig) -> tuple[type, set[str], dict[str, Any]] | None:
    """The class DeepSpeed's _configure_basic_optimizer builds for `name` here, the keys of `params` it
    consumes itself and the keyword arguments it passes itself; None for Muon, whose params DeepSpeed
    spreads over two param groups of its own."""
    lower, c = name.lower(), ds_config_module
    engine = _EngineView(config)
    on_cpu = engine.zero_use_cpu_optimizer()
    if lower in (c.ADAM_OPTIMIZER, c.ADAMW_OPTIMIZER):
        given = set(params)
        adam_w_mode = params.pop(c.ADAM_W_MODE, c.ADAM_W_MODE_DEFAULT)
        cls, own = engine.get_optimizer_configuration(params, lower == c.ADAMW_OPTIMIZER or adam_w_mode)
        return cls, given - set(params), dict(own)
    if lower == c.MUON_OPTIMIZER:
        return None
    if lower == c.ADAGRAD_OPTIMIZER:
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        return (DeepSpeedCPUAdagrad if on_cpu else torch.optim.Adagrad), set(), {}
    if lower == c.LAMB_OPTIMIZER:
        from deepspeed.ops.lamb import FusedLamb
        return FusedLamb, set(), {}
    if lower == c.LION_OPTIMIZER:
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        return (DeepSpeedCPULion if on_cpu else FusedLion), set(), {}
    if lower in _MUP_OPTIMIZERS:
        try:
            import mup
        except ImportError:
            raise ConfigError(f"deepspeed.optimizer.type: '{name}' needs the mup package, which is not "
                              "installed") from None
        return getattr(mup, _MUP_OPTIMIZERS[lower]), set(), {}
    return getattr(torch.optim, name), set(), {}


def _check_scheduler(ds: dict) -> None:
    section = ds.get("scheduler")
    if section is None:
        return
    name = section.get("type")
    valid = list(lr_schedules.VALID_LR_SCHEDULES)
    if name not in valid:
        raise ConfigError(f"deepspeed.scheduler.type: {_json(name)} is not an LR schedule of {_DS_VERSION}"
                          f"{_suggest(str(name), valid)}; use one of {', '.join(valid)}")
    params = section.get("params")
    if not isinstance(params, dict):
        raise ConfigError(f"deepspeed.scheduler.params: must be a JSON object, got {_json(params)} "
                          f"(DeepSpeed calls {name}(optimizer, **params))")
    _check_arguments(params, getattr(lr_schedules, name), key="deepspeed.scheduler.params",
                     what=f"DeepSpeed's {name}")
    if name in _BUILT_TO_CHECK:
        _check_scheduler_values(name, params)


_BUILT_TO_CHECK = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
"""Schedulers whose constructors read nothing of the optimizer but its learning rates and param groups (OneCycle
also whether its defaults have betas: the stand-in's have none, so momentum cycling is left out of the check):
built here on a stand-in optimizer, so that DeepSpeed's own value checks refuse at start-up, not inside
deepspeed.initialize after the model is built (and on a cluster, after the queue)."""


def _check_scheduler_values(name: str, params: dict) -> None:
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    level = lr_schedules.logger.level
    lr_schedules.logger.setLevel(logging.ERROR)  # its warnings about the stand-in would precede every start
    try:
        getattr(lr_schedules, name)(stand_in, **params)
    except (ValueError, TypeError) as e:
        message = one_line(e)
        if "warmup_num_steps" in message:
            raise ConfigError(f"deepspeed.scheduler.params.warmup_num_steps: DeepSpeed's {name} refuses it: "
                              f"{message}; it warms up over max(2, warmup_num_steps) steps, so 1 is the least "
                              "warmup it has") from None
        raise ConfigError(f"deepspeed.scheduler.params: DeepSpeed's {name} refuses them: {message}") from None
    finally:
        lr_schedules.logger.setLevel(level)


def _check_arguments(params: dict, cls: type, *, key: str, what: str, taken: set[str] = frozenset(),
                     own: set[str] = frozenset()) -> None:
    """Each of `params` but those `taken` by DeepSpeed must be an argument of `cls(first, **params)` that
    DeepSpeed does not pass itself (`own`), and every argument `cls` requires must be there."""
    arguments = list(inspect.signature(cls).parameters.values())[1:]  # the first gets the params / optimizer
    if any(a.kind is a.VAR_KEYWORD for a in arguments):
        return  # takes any keyword: nothing to hold the keys against
    named = [a for a in arguments if a.kind in (a.POSITIONAL_OR_KEYWORD, a.KEYWORD_ONLY) and a.name not in own]
    accepted = [a.name for a in named]
    for name in params:
        if name not in taken and name not in accepted:
            raise ConfigError(f"{key}.{name}: not an argument of {what}{_suggest(name, accepted)}")
    for argument in named:
        if argument.default is argument.empty and argument.name not in params:
            raise ConfigError(f"{key}.{argument.name}: missing; {what} requires it")


def _value_at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(("deepspeed", *path))


def _json(value: Any) -> str:
    return json.dumps(value, default=str)
