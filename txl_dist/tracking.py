"""MLflow tracking on rank 0: one run per training job, continued across restarts.

Every rank builds a tracker with ``create_tracker(cfg.tracking, rank, run_dir, resume_run_id)``. Rank 0
gets an ``MlflowTracker``: it creates the experiment if needed and starts a run (or re-opens the run whose
id the checkpoint saved, so a resumed job keeps logging into the same run at its global steps). Every
other rank, and every rank when tracking is disabled, gets a ``Tracker``: the same methods doing nothing.
``mlflow`` is imported only by rank 0 (it costs ~1.7 s and ~170 MB per process).

Logging goes through an explicit ``MlflowClient`` and run id, never MLflow's fluent API, whose global
"active run" would be hidden state. Metrics go to a background thread through a bounded queue, so a slow
or unreachable server never stalls a training step; a failure is logged once as a warning and training
goes on, and ``close()`` waits for what is queued and reports what was lost.

Metric names used by the trainer (step = global optimizer step): ``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``, ``train/tokens_seen``, ``train/step_time_s``,
``train/memory_*``, and ``valid/*`` / ``test/*`` from evaluation. MLflow adds ``system/*`` itself.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from txl_dist.config import TrackingConfig
from txl_dist.errors import Refused

logger = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "txl-dist"
"""Experiment used when neither tracking.experiment nor MLFLOW_EXPERIMENT_NAME is set."""
LOCAL_DB = "mlflow.db"
"""File name of the default local store, inside the run dir."""
LOCAL_ARTIFACTS = "mlartifacts"
"""Artifact folder of an experiment created in a local sqlite store, beside the database file."""
CLOSE_STATUSES = ("FINISHED", "FAILED", "KILLED")

# MLflow's own limits (mlflow.utils.validation); a batch over them is refused as a whole.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_KEY_LENGTH = 250
TRUNCATED = "...[truncated]"


class TrackingError(Refused, RuntimeError):
    """Tracking could not start (unreachable store, unknown run to resume); the message names the fix."""


@dataclasses.dataclass
class Delivery:
    """What became of the metric values handed to ``log_metrics`` (returned by ``close``)."""

    sent: int = 0
    """Values the tracking store accepted."""
    dropped: int = 0
    """Values thrown away because the queue was full (the store was slower than training)."""
    failed: int = 0
    """Values (and params/artifacts) whose logging raised, or that were still queued at the close timeout."""
    first_error: str | None = None
    """The first error, one line."""

    @property
    def ok(self) -> bool:
        """Nothing dropped and no error (including ones that lose no values, e.g. the final run status)."""
        return self.dropped == 0 and self.failed == 0 and self.first_error is None


def resolve_uri(cfg: TrackingConfig, run_dir: str | os.PathLike) -> str:
    """tracking.uri, else MLFLOW_TRACKING_URI, else a sqlite store at <run_dir>/mlflow.db (no server)."""
    if cfg.uri:
        return cfg.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    # MLflow's own default is sqlite:///<cwd>/mlflow.db: it moves with the working directory of each job.
    return f"sqlite:///{Path(run_dir).resolve() / LOCAL_DB}"


def resolve_experiment(cfg: TrackingConfig) -> str:
    """tracking.experiment, else MLFLOW_EXPERIMENT_NAME, else 'txl-dist'."""
    return cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> {dotted.key: text}; non-strings as JSON (true, null, [2000, 6000]) like the config.

    An empty mapping stays one entry ("{}") so that its key is still visible. Values longer than MLflow's
    6000-character limit are cut and end in '...[truncated]'.
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) > MAX_PARAM_VALUE_LENGTH:
            text = text[: MAX_PARAM_VALUE_LENGTH - len(TRUNCATED)] + TRUNCATED
        flat[name] = text
    return flat


def _one_line(exc: BaseException) -> str:
    """MLflow errors can carry whole HTML pages; a warning gets the first line, bounded."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}"


class Tracker:
    """The tracking interface; this base class does nothing (ranks other than 0, tracking disabled).

    Use it as a context manager: leaving the block closes the run as FINISHED, or FAILED on an exception
    (KILLED on KeyboardInterrupt).
    """

    @property
    def run_id(self) -> str | None:
        """The MLflow run id; None where no run is open (other ranks share rank 0's id by a collective)."""
        return None

    @property
    def active(self) -> bool:
        """True where calls really log (rank 0 with tracking enabled)."""
        return False

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log a (nested) mapping such as the resolved config as flat dotted-key params."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Queue metric values at a global optimizer step; None values are skipped.

        Never blocks, and the store's errors never raise here (they are counted and reported by close()).
        """

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file, or a folder's contents, under artifact_path of the run.

        A local path that does not exist raises FileNotFoundError (the caller's mistake, not the store's).
        """

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """Store a dict as a JSON (or .yaml) artifact file, e.g. the final evaluation."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store a text artifact file."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queued metrics are sent; False if the timeout passed first."""
        return True

    def close(self, status: str = "FINISHED", timeout: float | None = 120.0) -> Delivery:
        """Flush, stop system metrics and mark the run terminated with status FINISHED, FAILED or KILLED."""
        _check_status(status)
        return Delivery()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        self.close(status)


def _check_status(status: str) -> None:
    if status not in CLOSE_STATUSES:
        raise ValueError(f"close(status={status!r}): use one of {', '.join(CLOSE_STATUSES)}")


def create_tracker(
    cfg: TrackingConfig,
    rank: int,
    run_dir: str | os.PathLike,
    resume_run_id: str | None = None,
) -> Tracker:
    """The tracker of this rank: an open MLflow run on rank 0 (new, or resume_run_id continued), else a no-op.

    run_dir holds the default local store (``<run_dir>/mlflow.db`` and ``<run_dir>/mlartifacts``) when
    neither tracking.uri nor MLFLOW_TRACKING_URI names one.
    """
    if rank != 0 or not cfg.enabled:
        return Tracker()
    return MlflowTracker(cfg, run_dir, resume_run_id=resume_run_id)


class _Flush:
    """A marker in the metrics queue: set once everything queued before it has been handled."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class MlflowTracker(Tracker):
    """Rank 0's tracker: one MLflow run, metrics sent by a background thread in batches."""

    def __init__(
        self,
        cfg: TrackingConfig,
        run_dir: str | os.PathLike,
        resume_run_id: str | None = None,
        max_pending: int = 10_000,
    ) -> None:
        """Open the run. max_pending bounds the queue in log_metrics calls (steps) not yet sent."""
        # Imported here, on rank 0 only, and only when tracking is on.
        from mlflow import MlflowClient

        self.uri = resolve_uri(cfg, run_dir)
        self.experiment = resolve_experiment(cfg)
        self.resumed = resume_run_id is not None
        if self.uri.startswith("sqlite:///"):
            Path(self.uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.uri)
        try:
            if resume_run_id is not None:
                run = self._reopen(resume_run_id)
            else:
                run = self._client.create_run(
                    self._experiment_id(), run_name=cfg.run_name, tags=_context_tags())
        except TrackingError:
            raise
        except Exception as e:
            raise TrackingError(
                f"tracking.uri {self.uri}: cannot open an MLflow run ({_one_line(e)}); start the server, fix "
                f"tracking.uri / MLFLOW_TRACKING_URI, or set tracking.enabled=false") from e
        self._run_id: str = run.info.run_id
        self._params: dict[str, str] = dict(run.data.params)
        self.delivery = Delivery()
        self._warned = False
        self._closed = False
        self._lock = threading.Lock()  # guards delivery and _warned: the writer thread updates them too
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._writer = threading.Thread(target=self._send_loop, name="txl-mlflow-metrics", daemon=True)
        self._writer.start()
        self._system_monitor = self._start_system_metrics() if cfg.system_metrics else None
        logger.info("MLflow run %s (%s) at %s", self._run_id, "resumed" if self.resumed else "new", self.uri)

    # ---------------------------------------------------------------------------------------------
    # Opening

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return self._client.create_experiment(self.experiment, artifact_location=self._artifact_location())
            except Exception:
                # Another job may have created it between our two calls.
                experiment = self._client.get_experiment_by_name(self.experiment)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise TrackingError(
                f"tracking.experiment '{self.experiment}' is deleted in {self.uri}; restore it "
                f"(mlflow experiments restore) or choose another tracking.experiment")
        return experiment.experiment_id

    def _artifact_location(self) -> str | None:
        """Beside a sqlite database file; elsewhere (a server) the store picks the place."""
        if self.uri.startswith("sqlite:///") and not self.uri.endswith(":memory:"):
            db = Path(self.uri[len("sqlite:///"):])
            return (db.parent / LOCAL_ARTIFACTS).resolve().as_uri()
        return None

    def _reopen(self, run_id: str):
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise TrackingError(
                    f"tracking: the checkpoint's MLflow run {run_id} is not in {self.uri}; point tracking.uri "
                    f"at the store that holds it, or set tracking.enabled=false") from e
            raise
        if run.info.lifecycle_stage != "active":
            raise TrackingError(
                f"tracking: the checkpoint's MLflow run {run_id} is deleted in {self.uri}; restore it "
                f"(mlflow runs restore --run-id {run_id}) or set tracking.enabled=false")
        self._client.update_run(run_id, status="RUNNING")
        return run

    def _start_system_metrics(self):
        """MLflow's CPU/memory/disk/network (and GPU) sampler, bound to this run id and store."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # resume_logging: the system/* steps continue after the ones already in the run.
            monitor = SystemMetricsMonitor(self._run_id, resume_logging=self.resumed, tracking_uri=self.uri)
            monitor.start()
            return monitor
        except Exception as e:
            self._failed("system metrics", 0, e)
            return None

    # ---------------------------------------------------------------------------------------------
    # Logging

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def active(self) -> bool:
        return not self._closed

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log new params in batches of 100; a param the run already holds with another value (a resumed
        run whose config changed) cannot be changed in MLflow: it is kept and named in a warning."""
        from mlflow.entities import Param

        flat = {key[:MAX_KEY_LENGTH]: value for key, value in flatten_params(params).items()}
        changed = sorted(k for k, v in flat.items() if k in self._params and self._params[k] != v)
        if changed:
            logger.warning(
                "tracking: run %s keeps its earlier values of %d changed param(s): %s", self._run_id,
                len(changed), ", ".join(changed[:20]) + (" ..." if len(changed) > 20 else ""))
        new = [Param(k, v) for k, v in flat.items() if k not in self._params]
        for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
            chunk = new[i: i + MAX_PARAMS_PER_BATCH]
            try:
                self._client.log_batch(self._run_id, params=chunk, synchronous=True)
            except Exception as e:
                self._failed("params", len(chunk), e)
                continue
            self._params.update((p.key, p.value) for p in chunk)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._closed:
            raise RuntimeError(f"tracking: log_metrics after close() (run {self._run_id})")
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        batch = [Metric(key, float(value), timestamp, int(step)) for key, value in metrics.items()
                 if value is not None]
        if not batch:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            with self._lock:
                self.delivery.dropped += len(batch)
            self._warn_once(f"the metrics queue is full ({self._queue.maxsize} steps waiting for {self.uri}); "
                            "values are dropped until it drains")

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tracking: artifact {path} does not exist")
        try:
            if path.is_dir():
                self._client.log_artifacts(self._run_id, str(path), artifact_path)
            else:
                self._client.log_artifact(self._run_id, str(path), artifact_path)
        except Exception as e:
            self._failed(f"artifact {path}", 1, e)

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        try:
            self._client.log_dict(self._run_id, dict(dictionary), artifact_file)
        except Exception as e:
            self._failed(f"artifact {artifact_file}", 1, e)

    def log_text(self, text: str, artifact_file: str) -> None:
        try:
            self._client.log_text(self._run_id, text, artifact_file)
        except Exception as e:
            self._failed(f"artifact {artifact_file}", 1, e)

    def flush(self, timeout: float | None = None) -> bool:
        if self._closed:
            return True
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def close(self, status: str = "FINISHED", timeout: float | None = 120.0) -> Delivery:
        """Stop system metrics, send what is queued (at most timeout seconds), terminate the run.

        Returns the delivery counts and logs one warning if anything was dropped or failed. Never raises
        for the store's errors: this often runs while an exception from training is on its way out.
        """
        _check_status(status)
        if self._closed:
            return self.delivery
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each store call below may sit in MLflow's HTTP retries for minutes when the server is gone; run
        # them in helper threads so that the timeout bounds close() as a whole.
        if self._system_monitor is not None:
            # Before set_terminated: the monitor's last samples need a RUNNING run.
            if not _finish_by(deadline, self._system_monitor.finish):
                self._failed("system metrics", 0, TimeoutError("close timed out stopping system metrics"))
        try:
            self._queue.put(_STOP, timeout=_left(deadline))
        except queue.Full:
            pass
        self._writer.join(_left(deadline))
        if self._writer.is_alive():
            self._count_unsent()
        terminate_error: list[BaseException] = []

        def terminate() -> None:
            try:
                self._client.set_terminated(self._run_id, status=status)
            except Exception as e:
                terminate_error.append(e)

        if not _finish_by(deadline, terminate):
            terminate_error.append(TimeoutError(f"close timed out marking the run {status}"))
        if terminate_error:
            self._failed("run status", 0, terminate_error[0])
        d = self.delivery
        if not d.ok:
            logger.warning(
                "tracking: run %s (closing as %s): %d metric values sent, %d dropped because the queue was "
                "full, %d values or items failed%s", self._run_id, status, d.sent, d.dropped, d.failed,
                f"; first error: {d.first_error}" if d.first_error else "")
        return d

    # ---------------------------------------------------------------------------------------------
    # The writer thread and error policy

    def _send_loop(self) -> None:
        """Take every batch that is waiting, send it in chunks of MLflow's maximum, then mark flushes."""
        while True:
            item = self._queue.get()
            metrics = []
            while isinstance(item, list):
                metrics.extend(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                chunk = metrics[i: i + MAX_METRICS_PER_BATCH]
                try:
                    # synchronous: MLFLOW_ENABLE_ASYNC_LOGGING must not move errors out of our sight.
                    self._client.log_batch(self._run_id, metrics=chunk, synchronous=True)
                except Exception as e:
                    self._failed("metrics", len(chunk), e)
                else:
                    with self._lock:
                        self.delivery.sent += len(chunk)
            if isinstance(item, _Flush):
                item.done.set()
            elif item is _STOP:
                return

    def _count_unsent(self) -> None:
        """At the close timeout: what is still queued will not be sent; count it as failed."""
        n = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, list):
                n += len(item)
        with self._lock:
            self.delivery.failed += n
            self.delivery.first_error = self.delivery.first_error or f"close timed out with {n} values unsent"

    def _failed(self, what: str, n: int, exc: BaseException) -> None:
        with self._lock:
            self.delivery.failed += n
            if self.delivery.first_error is None:
                self.delivery.first_error = _one_line(exc)
        self._warn_once(f"could not log {what} to {self.uri} ({_one_line(exc)})")

    def _warn_once(self, message: str) -> None:
        # One warning per run: a server that is down would otherwise warn at every step.
        with self._lock:
            if self._warned:
                return
            self._warned = True
        logger.warning("tracking: %s; training goes on, further failures are counted and reported by close()",
                       message)


def _left(deadline: float | None) -> float | None:
    """Seconds until deadline (None: no limit), never negative."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _finish_by(deadline: float | None, fn) -> bool:
    """Run fn in a daemon thread and wait for it until deadline; False if it is still running then."""
    thread = threading.Thread(target=fn, name="txl-mlflow-close", daemon=True)
    thread.start()
    thread.join(_left(deadline))
    return not thread.is_alive()


def _context_tags() -> dict[str, str]:
    """MLflow's usual run tags (user, source script, git commit), as its fluent start_run would set them."""
    try:
        from mlflow.tracking.context.registry import resolve_tags

        return resolve_tags()
    except Exception:  # tags are a convenience; never a reason to stop a job
        return {}
