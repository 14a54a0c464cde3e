"""`import deepspeed` without two imports it makes for features this project never uses: MLflow and TorchInductor.

DeepSpeed 0.19.8 imports its autotuner while it imports itself (deepspeed.runtime.config ->
deepspeed.autotuning), and the autotuner imports MLflow when it is installed (it logs autotuning trials to
MLflow). MLflow pulls pandas, fastapi and its GenAI modules: 2.5 s of every rank's start on an idle AMD Zen 3
core, twice that under load, for runs that track nothing, and for every rank but the one that tracks. The
autotuner runs only under `deepspeed --autotuning`, which launch/train.py does not take.

Every module of txl_dist that imports deepspeed imports this one first. MLflow stays importable: it is hidden
only while deepspeed imports itself, and txl_dist/tracking/ imports it when a run tracks.

DeepSpeed's Muon optimizer (which txl_dist never builds) is imported by every ZeRO 1-3 engine
(`is_zero_supported_optimizer`, and the ZeRO 1-2 optimizer at each step), and its module wraps three
functions in `torch.compile` as it is imported: that imports TorchInductor's compiler, 1.1-1.8 s of a rank's
start on a loaded AMD Zen 3 core (3 starts each, against 0.001-0.005 s). This module imports it once with
those functions compiled on their first call instead; nothing calls them unless Muon runs, and then they
compile as before.
"""
from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any


def _import_deepspeed_without_mlflow():
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return importlib.import_module("deepspeed")
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner's `has_mlflow` is False
    try:
        return importlib.import_module("deepspeed")
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]


def compile_on_first_call(fn: Callable[..., Any], compiler_fn: Compiler | None = None) -> Callable[..., Any]:
    """`fn`, compiled (torch.compile unless `compiler_fn` is given) when it is first called rather than now."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = (compiler_fn or torch.compile)(fn)
        return compiled(*args, **kwargs)

    return call


def _import_muon_compiling_on_first_call() -> None:
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager_compile = compiler.compile
    compiler.compile = lambda: compile_on_first_call  # what its module's `@compiler.compile()` finds
    try:
        importlib.import_module("deepspeed.runtime.zero.muon.original_muon")
    except ImportError:  # DeepSpeed imports it under `try` too: a release without Muon is fine
        pass
    finally:
        compiler.compile = eager_compile


deepspeed = _import_deepspeed_without_mlflow()
_import_muon_compiling_on_first_call()
