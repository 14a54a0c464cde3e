"""MLflow tracking on rank 0: one run per run dir, continued across restarts, with a local journal.

Every rank builds a tracker with ``create_tracker(cfg.tracking, rank, run_dir, resume)``. Rank 0
gets an ``MlflowTracker``; every other rank, and every rank when tracking is disabled, gets a ``Tracker``:
the same methods doing nothing. ``mlflow`` is imported only by rank 0 (it costs ~1.7 s and ~170 MB per
process).

The modules, each importing only those above it:

    errors       TrackingError (tracking could not start), ReplayError (the store failed midway in a replay)
    secrets      redaction of the tracking URI's password or token in messages, files, params, library logs
    journal      the run dir's tracking/ folder: run id, journal, delivery records, outbox, lock (no mlflow)
    store        the MLflow calls shared by the writer thread and replay; MLflow's batch limits
    tracker      the interface: ``Tracker`` (doing nothing) and ``Delivery`` (what close() reports)
    continuation which run a resuming job logs to; a rollback's or fork's continuation run (no mlflow)
    thinning     tracking.metrics_interval: the training metrics of the steps between two logged ones (no mlflow)
    mlflow_run   ``MlflowTracker`` (opening the run, the writer thread, the resume rule) and ``create_tracker``
    replay       sending what the store missed, from the journal and the outbox
    __main__     ``python -m txl_dist.tracking replay RUN_DIR [--uri URI]``

Metric names used by the trainer (step = global optimizer step): ``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/model_flops_per_s``, ``train/mfu`` (docs/performance.md),
``train/tokens_seen``, ``train/step_time_s``,
``train/nonfinite_steps``, ``train/memory_*``, and ``valid/*`` / ``test/*`` from evaluation; any other key
passes through unchanged. The train/* values come every tracking.metrics_interval steps, each summarizing the
steps since the previous one (thinning.py).
"""
from __future__ import annotations

from .continuation import ResumePoint
from .errors import TrackingError
from .mlflow_run import MlflowTracker, create_tracker, flatten_params
from .store import MAX_PARAM_VALUE_LENGTH
from .tracker import Tracker

__all__ = [
    "MAX_PARAM_VALUE_LENGTH",
    "MlflowTracker",
    "ResumePoint",
    "Tracker",
    "TrackingError",
    "create_tracker",
    "flatten_params",
]
