"""`import deepspeed` without the MLflow import it makes for a feature this project never uses.

DeepSpeed 0.19.8 imports its autotuner while it imports itself (deepspeed.runtime.config ->
deepspeed.autotuning), and the autotuner imports MLflow when it is installed (it logs autotuning trials to
MLflow). MLflow pulls pandas, fastapi and its GenAI modules: 2.5 s of every rank's start on an idle AMD Zen 3
core, twice that under load, for runs that track nothing, and for every rank but the one that tracks. The
autotuner runs only under `deepspeed --autotuning`, which launch/train.py does not take.

Every module of txl_dist that imports deepspeed imports this one first. MLflow stays importable: it is hidden
only while deepspeed imports itself, and txl_dist/tracking/ imports it when a run tracks.
"""
from __future__ import annotations

import importlib
import sys


def _import_deepspeed_without_mlflow():
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return importlib.import_module("deepspeed")
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError: the autotuner's `has_mlflow` is False
    try:
        return importlib.import_module("deepspeed")
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


deepspeed = _import_deepspeed_without_mlflow()
