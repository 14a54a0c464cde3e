"""Rank 0's tracker: ``MlflowTracker`` (one MLflow run, sent by one writer thread, journaled locally) and
``create_tracker``, which gives it to rank 0 and the no-op ``Tracker`` to every other rank.

Opening. continuation.plan_opening decides the run: the one recorded in ``<run_dir>/tracking/run_id``
(a requeued job, or one that crashed before its first checkpoint and left it RUNNING), else the
checkpoint's, else a new one, whose id is written to that file (atomically) as soon as it exists: a later
job in the run dir re-opens it instead of leaving an orphan. A job resuming from a step the run went past
in work thrown away (a rollback, a fork) opens a continuation run instead (continuation.py). A recorded or
resumed run that the store does not hold (unknown, deleted), or a checkpoint of no run of the run dir's
lineage, is a TrackingError naming the fix, never a silent new run: the journal in the run dir belongs to
the recorded run. The opening calls run with
MLflow's HTTP retries bounded (MLflow reads MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT / _BACKOFF_FACTOR
at each request, so they are lowered around these calls alone): an unreachable store is refused in
seconds, not after minutes of retries, and a refused start writes nothing in the run dir.

Logging goes through an explicit ``MlflowClient`` and run id, never MLflow's fluent API, whose global
"active run" would be hidden state. The training thread never waits on the store: log_params, log_metrics,
log_artifact, log_dict and log_text put an item on a bounded queue that ONE writer thread sends in call
order. A full queue drops the item (counted), a failure is logged once as a warning and training goes
on, and ``close()`` (bounded by its timeout, never raising for the store's errors) reports what was lost.
Params go in batches of 100, values over 6000 characters truncated. MLflow's system metrics
(``system/*``) have their own sampler thread.

Resume rule: at open, the journal gives each metric key's highest logged step j. A job re-opening the
run from a checkpoint at step k < j (a crash after the checkpoint) re-runs steps k+1..j bitwise equal;
log_metrics drops values at steps <= j of that key (counted in Delivery.skipped), because MLflow cannot
delete a value once logged. Only the highest step counts, never a sequence: a key's steps need not follow
each other (tracking.metrics_interval logs every n-th; the window of steps a resumed job logs next is saved
with its checkpoint, so the values it repeats are the same too). What the journal holds and the store lacks
(an earlier job's values while the store was down, a continuation's copied history) the writer sends first,
before this job's own items.
The journal is read once at open, from where the last opening's summary.json leaves off (journal.py's
_summarize: a million-step journal is ~430 MB, ~5-15 s to read whole); the store's metric history is never
downloaded.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import posixpath
import queue
import re
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from txl_dist.config import TrackingConfig
from txl_dist.errors import failure_of_the_process
from txl_dist.output_paths import OutputError, check_output_folder
from txl_dist.write_faults import mount_point

from .continuation import STAGING_DIR, Opening, ResumePoint, finish_switch, plan_opening, stage_switch
from .errors import TrackingError
from .journal import TrackingFolder, _Batch, _DeliveryLog, _Journal, _JournalSummary, _OutboxItem, _summarize
from .secrets import _one_line, _quiet_store_tracebacks, _remember_secrets, _scrub_library_logs, scrub_secrets, \
    shown_uri
from .store import (ENDED_TAG, LOCAL_ARTIFACTS, MAX_KEY_LENGTH, MAX_METRICS_PER_BATCH, MAX_PARAM_VALUE_LENGTH,
                    RUNNING_HTTP_LIMITS, _check_reopenable, _chunks, _deliver_item, _mark_terminated,
                    _quick_http_failures, _refuse_empty_store, _relocate_local_artifacts, _send_metrics,
                    _undelivered, sqlite_database)
from .tracker import Delivery, Tracker, _check_status

STORE_PAUSE_S = 30.0
"""After a failed call, how long the writer leaves the store alone (counting what comes as failed) before
trying it again."""

logger = logging.getLogger("txl_dist.tracking")  # one logger for the whole package

DEFAULT_EXPERIMENT = "txl-dist"
"""Experiment used when neither tracking.experiment nor MLFLOW_EXPERIMENT_NAME is set."""
LOCAL_DB = "mlflow.db"
"""File name of the default local store, inside the run dir."""
TRUNCATED = "...[truncated]"


def resolve_uri(cfg: TrackingConfig, run_dir: str | os.PathLike) -> str:
    """tracking.uri, else MLFLOW_TRACKING_URI, else a sqlite store at <run_dir>/mlflow.db (no server)."""
    if cfg.uri:
        return cfg.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    # MLflow's own default is sqlite:///<cwd>/mlflow.db: it moves with the working directory of each job.
    return f"sqlite:///{Path(run_dir).resolve() / LOCAL_DB}"


def ui_hint(shown: str, experiment_id: str, run_id: str) -> str:
    """How to open a run in the MLflow UI: a server's page for the run, else the `mlflow ui` command on the
    store (sqlite, a file store) and the page it serves. `shown` is the URI as it may be shown (redacted)."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    scheme = urlsplit(shown).scheme
    if scheme in ("http", "https"):
        return f"open {shown.rstrip('/')}/{page}"
    if scheme.startswith("databricks"):
        return f"run {run_id} of experiment {experiment_id} in the Databricks workspace ({shown})"
    return f"mlflow ui --backend-store-uri {shlex.quote(shown)}, then open http://127.0.0.1:5000/{page}"


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


def create_tracker(
    cfg: TrackingConfig,
    rank: int,
    run_dir: str | os.PathLike,
    resume: ResumePoint | None = None,
) -> Tracker:
    """The tracker of this rank: an open MLflow run on rank 0, else a no-op.

    The run is the one recorded in <run_dir>/tracking/run_id, else the checkpoint's (resume), else a new
    one; a continuation when the run went past the checkpoint (continuation.py). run_dir also holds the
    journal (<run_dir>/tracking/) and the default local store (``<run_dir>/mlflow.db`` and
    ``<run_dir>/mlartifacts``) when neither tracking.uri nor MLFLOW_TRACKING_URI names one.
    """
    if rank != 0 or not cfg.enabled:
        return Tracker()
    return MlflowTracker(cfg, run_dir, resume=resume)


class _Flush:
    """A marker in the queue: set once everything queued before it has been handled."""

    def __init__(self) -> None:
        self.done = threading.Event()


class _Backfill:
    """A marker in the queue (the first item): send what the journal and outbox hold up to this seq and the
    store lacks."""

    def __init__(self, through_seq: int, start: int) -> None:
        self.through_seq = through_seq
        self.start = start
        """The journal's byte offset of the first line the store lacks (_JournalSummary.first_missing_offset)."""


_STOP = object()
_FROM_STEP = re.compile(r" \(from step \d+\)$")


class MlflowTracker(Tracker):
    """Rank 0's tracker: one MLflow run, everything sent by one background thread, journaled locally."""

    def __init__(
        self,
        cfg: TrackingConfig,
        run_dir: str | os.PathLike,
        resume: ResumePoint | None = None,
        max_pending: int = 10_000,
    ) -> None:
        """Open the run. max_pending bounds the queue in calls (steps, params, artifacts) not yet sent."""
        # Imported here, on rank 0 only, and only when tracking is on.
        from mlflow import MlflowClient

        self.uri = resolve_uri(cfg, run_dir)
        self.shown_uri = shown_uri(self.uri)
        self.experiment = resolve_experiment(cfg)
        self.run_dir = Path(run_dir)
        self.folder = TrackingFolder(self.run_dir)
        holds_secret = _remember_secrets(self.uri)
        _check_folder_usable(self.folder.dir)
        self._finish_interrupted_switch()
        opening = plan_opening(self.folder, resume)
        self.reopened = opening.kind == "reopen"
        self.delivery = Delivery()
        self._warned = False
        self._closed = False
        self._lock = threading.Lock()  # guards delivery and _warned: the writer thread updates them too
        new_store = None  # a local store this opening creates: a refused opening removes it again
        if self.uri.startswith("sqlite:///"):
            database = Path(self.uri[len("sqlite:///"):])
            database.parent.mkdir(parents=True, exist_ok=True)
            new_store = None if database.exists() else database
            if opening.kind == "reopen":  # the run must be in the store: a 0-byte file cannot hold it
                _refuse_empty_store(database, "tracking", f"the MLflow run {opening.run_id}",
                                    "point tracking.uri at the store that holds it")
        _quiet_store_tracebacks()
        try:
            self._client = MlflowClient(tracking_uri=self.uri)
        except Exception as e:  # noqa: BLE001 - MLflow's store registry raises several kinds for a URI it cannot use
            if new_store is not None:
                new_store.unlink(missing_ok=True)
            if failure_of_the_process(e):
                raise
            raise TrackingError(_unusable_store(self.shown_uri, self.uri, e)) from None
        if holds_secret:
            _scrub_library_logs()
        if new_store is None:
            self._follow_moved_run_dir()
        try:
            with _quick_http_failures():
                run = self._open_run(cfg, opening, resume.run_id if resume is not None else None)
                self._run_id: str = run.info.run_id
                self.experiment_id: str = run.info.experiment_id
                try:
                    summary = self._claim_folder(opening)
                except BaseException as e:
                    self._give_back(opening, run)
                    if isinstance(e, OSError):
                        raise TrackingError(f"tracking: {self.folder.dir}: {e.strerror or e}; fix the folder or "
                                            "choose another run.dir") from None
                    raise
                self._system_monitor = self._start_system_metrics() if cfg.system_metrics else None
        except BaseException:  # a refusal, or a failure of the process: the store it began goes with it
            if new_store is not None:
                new_store.unlink(missing_ok=True)
            raise
        if holds_secret:
            _scrub_library_logs()  # again: the system metrics sampler's logger exists only now
        self._params: dict[str, str] = dict(run.data.params)
        for item in self.folder.outbox_items():  # params an earlier job could not send still count as held
            if item.meta["kind"] == "params":
                self._params.update(item.meta["params"])
        self._logged_through = summary.logged_through
        self._seqs = itertools.count(summary.next_seq)
        self._journal = _Journal(self.folder.journal)
        self._delivered = _DeliveryLog(self.folder.delivered)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._http_limits = contextlib.ExitStack()
        self._http_limits.enter_context(_quick_http_failures(RUNNING_HTTP_LIMITS))
        self._store_paused_until = 0.0
        """After a failed call the store is left alone for STORE_PAUSE_S: what comes meanwhile is counted as
        failed at once (it is in the journal or outbox for replay) instead of each call retrying on its own."""
        self._writer = threading.Thread(target=self._send_loop, name="txl-mlflow-writer", daemon=True)
        self._backfill_left = summary.missing_values
        if summary.missing_values or summary.missing_items:
            self._queue.put_nowait(_Backfill(summary.next_seq - 1, summary.first_missing_offset))
        self._writer.start()
        logger.info("MLflow run %s (%s) at %s", self._run_id, {"reopen": "re-opened", "new": "new"}.get(
            opening.kind, "continuation"), self.shown_uri)
        self._report_opening(opening, summary)

    # ---------------------------------------------------------------------------------------------
    # Opening

    def _open_run(self, cfg: TrackingConfig, opening: Opening, checkpoint_run: str | None):
        try:
            if opening.kind == "reopen":
                if opening.run_id == self.folder.recorded_run_id():
                    # A changed tracking.uri (the run is in the store it was logged to), and a checkpoint of
                    # the run (removing the folder would only lead to its run's refusal): both said.
                    was = self.folder.recorded_uri()
                    was = f" (logged to {was})" if was and was != self.shown_uri else ""
                    fix = ("set tracking.enabled=false" if checkpoint_run is not None else
                           f"remove {self.folder.dir} to start a new run")
                    return self._reopen(opening.run_id, f"the MLflow run {opening.run_id} recorded in "
                                        f"{self.folder.run_id_file}{was}", fix)
                return self._reopen(opening.run_id, f"the checkpoint's MLflow run {opening.run_id}",
                                    "set tracking.enabled=false")
            if opening.kind == "continue":
                return self._create_continuation(cfg, opening)
            return self._client.create_run(self._experiment_id(), run_name=cfg.run_name, tags=_context_tags())
        except TrackingError:
            raise
        except Exception as e:
            if failure_of_the_process(e):
                raise
            # from None: the cause's text quotes the request URL, credentials included; its first line,
            # scrubbed, is in the message.
            raise TrackingError(
                f"tracking.uri {self.shown_uri}: cannot open an MLflow run ({_one_line(e)}); start the server, "
                f"fix tracking.uri / MLFLOW_TRACKING_URI, or set tracking.enabled=false") from None

    def _create_continuation(self, cfg: TrackingConfig, opening: Opening):
        """A new run tagged with the run it continues, named after it unless tracking.run_name says."""
        continues = opening.continues
        name = cfg.run_name
        if name is None and continues.run_id is not None:
            with contextlib.suppress(Exception):  # a parent in another store (a fork): MLflow picks a name
                parent = self._client.get_run(continues.run_id).info.run_name
                name = f"{_FROM_STEP.sub('', parent)} (from step {continues.step})" if parent else None
        tags = _context_tags() | {"txl.continued_at_step": str(continues.step),
                                  "txl.continued_because": continues.because}
        if continues.run_id is not None:
            tags["txl.continues_run"] = continues.run_id
        return self._client.create_run(self._experiment_id(), run_name=name, tags=tags)

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
                f"tracking.experiment '{self.experiment}' is deleted in {self.shown_uri}; restore it "
                f"(mlflow experiments restore --experiment-id {experiment.experiment_id}) or choose another "
                "tracking.experiment")
        return experiment.experiment_id

    def _artifact_location(self) -> str | None:
        """Beside a sqlite database file; elsewhere (a server) the store picks the place."""
        db = sqlite_database(self.uri)
        return None if db is None else (db.parent / LOCAL_ARTIFACTS).resolve().as_uri()

    def _follow_moved_run_dir(self) -> None:
        """The run dir's own sqlite store, recorded at another path (the run dir was moved or copied): its
        artifact locations follow it (store.py's _relocate_local_artifacts)."""
        recorded = self.folder.recorded_uri()
        if not (recorded and recorded.startswith("sqlite:///") and self.uri.startswith("sqlite:///")):
            return
        database = Path(self.uri[len("sqlite:///"):]).resolve()
        old = Path(recorded[len("sqlite:///"):])
        if recorded == self.uri or not old.is_absolute() or database.parent != self.run_dir.resolve():
            return
        try:
            moved = _relocate_local_artifacts(database, old, self._artifact_location())
        except Exception as e:  # noqa: BLE001 - sqlite3's errors, an older schema: uploads go where they went
            logger.warning("tracking: the run dir was at %s; its store %s still names the artifact folder there "
                           "(%s)", old.parent, database, _one_line(e))
            return
        if moved:
            logger.info("tracking: the run dir was at %s: %d artifact location(s) of its store now point at %s",
                        old.parent, moved, self._artifact_location())

    def _reopen(self, run_id: str, described: str, other_fix: str):
        """Set a known, active run RUNNING again; described and other_fix word the refusal when it is not."""
        run = _check_reopenable(
            self._client, run_id, self.shown_uri, described,
            unknown_fix=f"point tracking.uri at the store that holds it, or {other_fix}", deleted_fix=other_fix)
        self._client.update_run(run_id, status="RUNNING")
        if ENDED_TAG in run.data.tags:  # an earlier job's ending: this one has not ended
            self._client.delete_tag(run_id, ENDED_TAG)
        return run

    def _give_back(self, opening: Opening, run) -> None:
        """The run dir refused the run after the store opened it: a run this opening created is deleted, a
        re-opened one gets its earlier status back (not left RUNNING for ever)."""
        self.folder.unlock()
        with contextlib.suppress(Exception):
            if opening.kind == "reopen":
                self._client.update_run(self._run_id, status=run.info.status)
            else:
                self._client.delete_run(self._run_id)

    def _finish_interrupted_switch(self) -> None:
        """A job killed while switching the folder to a continuation run: finish the switch first."""
        if (self.folder.dir / STAGING_DIR).is_dir():
            self.folder.lock("this job")
            try:
                finish_switch(self.folder)
            finally:
                self.folder.unlock()

    def _claim_folder(self, opening: Opening) -> _JournalSummary:
        """Lock <run_dir>/tracking, switch it to a continuation run, record the run there at once, and read
        what earlier jobs left."""
        self.folder.lock("this job")
        if opening.kind == "continue":
            self._switch_folder(opening)
        self.folder.record(self._run_id, self.uri)
        self.folder.repair()
        for item in self.folder.outbox_items():
            if item.meta["kind"] == "status":  # an earlier job's final status: this job sets its own
                self.folder.remove(item)
        return _summarize(self.folder, keep=True)

    def _switch_folder(self, opening: Opening) -> None:
        continues = opening.continues
        try:
            stage_switch(self.folder, self._run_id, self.shown_uri, continues, opening.history)
            finish_switch(self.folder)
        except OSError as e:
            with contextlib.suppress(Exception):
                self._client.set_terminated(self._run_id, status="FAILED")
            raise TrackingError(f"tracking: cannot switch {self.folder.dir} to the continuation run "
                                f"({type(e).__name__}: {e}); free space or fix its permissions") from None
        if continues.run_id is not None:
            with contextlib.suppress(Exception):  # a tag on the earlier run: a convenience, maybe in another store
                self._client.set_tag(continues.run_id, "txl.continued_by", self._run_id)
            if continues.because == "rollback":
                self._end_left_run(continues.run_id)

    def _end_left_run(self, run_id: str) -> None:
        """A rollback leaves the run for good: one still RUNNING (its last job was killed outright, a SIGKILL or
        a lost node, and set no status) becomes KILLED, else it would show as running for ever. Only this run
        dir's run (a rollback), whose journal this job holds: a fork's source run may be training elsewhere."""
        with contextlib.suppress(Exception):  # the status of a run this job no longer logs to: a convenience
            if self._client.get_run(run_id).info.status == "RUNNING":
                _mark_terminated(self._client, run_id, "KILLED", int(time.time() * 1000))

    def _report_opening(self, opening: Opening, summary: _JournalSummary) -> None:
        if opening.kind == "continue":
            continues = opening.continues
            went = ("rolled back: its tags after that step were set aside" if continues.because == "rollback" else
                    f"continued from another run dir, {continues.source}")
            logger.warning(
                "tracking: MLflow run %s went past step %d (%s); this job logs to a new run, %s, tagged "
                "txl.continues_run; it starts with the %d values the earlier run logged at steps <= %d%s",
                continues.run_id or "(none)", continues.step, went, self._run_id, summary.missing_values,
                continues.step, f" (its files: {self.folder.dir / 'superseded'})"
                if continues.because == "rollback" else "")
            return
        if summary.logged_through:
            logger.info("tracking: the journal holds steps up to %d; values at steps a key already has are not "
                        "logged again", max(summary.logged_through.values()))
        if summary.missing_values or summary.missing_items:
            logger.warning(
                "tracking: %d metric values and %d params/artifact items of earlier jobs are not in run %s; "
                "sending them first", summary.missing_values, summary.missing_items, self._run_id)

    def _start_system_metrics(self):
        """MLflow's CPU/memory/disk/network (and GPU) sampler, bound to this run id and store."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # resume_logging: the system/* steps continue after the ones already in the run.
            monitor = SystemMetricsMonitor(self._run_id, resume_logging=self.reopened, tracking_uri=self.uri)
            monitor.start()
            return monitor
        except Exception as e:
            self._failed("system metrics", 0, e)
            return None

    # ---------------------------------------------------------------------------------------------
    # Logging: the training thread's side (journal, outbox, queue; never the store)

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def active(self) -> bool:
        return not self._closed

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Queue new params (sent in batches of 100); a param the run already holds with another value (a
        resumed run whose config changed) cannot be changed in MLflow: it is kept and named in a warning.
        URLs in values are redacted (a tracking URI with a password)."""
        self._check_open("log_params")
        flat = {key[:MAX_KEY_LENGTH]: scrub_secrets(value) for key, value in flatten_params(params).items()}
        changed = sorted(k for k, v in flat.items() if k in self._params and self._params[k] != v)
        if changed:
            logger.warning(
                "tracking: run %s keeps its earlier values of %d changed param(s): %s", self._run_id,
                len(changed), ", ".join(changed[:20]) + (" ..." if len(changed) > 20 else ""))
        new = {k: v for k, v in flat.items() if k not in self._params}
        if not new:
            return
        self._params.update(new)
        self._put_outbox({"kind": "params", "params": new}, None)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Journal the batch and queue it; values at a step the journal already holds for their key are
        skipped (the resume rule in the module docstring)."""
        self._check_open("log_metrics")
        step = int(step)
        values = {key: float(value) for key, value in metrics.items() if value is not None}
        logged = {key for key in values if step <= self._logged_through.get(key, -1)}
        if logged:  # a resumed job repeating a step the journal already holds
            self.delivery.skipped += len(logged)
            values = {key: value for key, value in values.items() if key not in logged}
        if not values:
            return
        batch = _Batch(next(self._seqs), step, int(time.time() * 1000), values)
        self._journal.append(batch)
        self._enqueue(batch, len(values))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy the file (or folder) into the outbox now and queue its upload."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tracking: artifact {path} does not exist")
        self._check_open("log_artifact")
        is_dir = path.is_dir()

        def copy(content: Path) -> None:
            if is_dir:
                shutil.copytree(path, content / path.name)
            else:
                shutil.copy2(path, content / path.name)

        meta = {"kind": "artifact", "name": path.name, "artifact_path": artifact_path, "is_dir": is_dir}
        self._put_outbox(meta, copy)

    def log_dict(self, dictionary: Mapping[str, Any], artifact_file: str) -> None:
        """Serialized now, as MLflow would: YAML for .yml/.yaml, else JSON (indented, str() for the rest)."""
        if posixpath.splitext(artifact_file)[1] in (".yml", ".yaml"):
            import yaml

            text = yaml.dump(dict(dictionary), indent=2, default_flow_style=False)
        else:
            text = json.dumps(dict(dictionary), indent=2, default=str)
        self.log_text(text, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Write the text into the outbox now and queue its upload as artifact_file."""
        self._check_open("log_text")
        folder, name = posixpath.split(artifact_file)

        def write(content: Path) -> None:
            (content / name).write_text(text, encoding="utf-8")

        self._put_outbox({"kind": "artifact", "name": name, "artifact_path": folder or None, "is_dir": False},
                         write)

    def flush(self, timeout: float | None = None) -> bool:
        """Write the journal out, then wait until everything queued is sent or failed."""
        if self._closed:
            return True
        self._journal.flush()
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def flush_journal(self) -> None:
        if not self._closed:
            self._journal.flush()

    def ui_hint(self) -> str:
        return ui_hint(self.shown_uri, self.experiment_id, self._run_id)

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"tracking: {call} after close() (run {self._run_id})")

    def _put_outbox(self, meta: dict[str, Any], fill: Callable[[Path], None] | None) -> None:
        seq = next(self._seqs)
        try:
            item = self.folder.put(seq, meta, fill)
        except OSError as e:  # the run dir's disk, not the store: still no reason to stop training
            self._failed(f"{meta['kind']} (writing the outbox)", 1, e)
            return
        self._enqueue(item, 1)

    def _enqueue(self, item: _Batch | _OutboxItem, n: int) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self.delivery.dropped += n
            self._warn_once(f"the queue is full ({self._queue.maxsize} calls waiting for {self.shown_uri}); "
                            "what does not fit stays in the journal for replay")

    # ---------------------------------------------------------------------------------------------
    # Closing

    def close(self, status: str = "FINISHED", timeout: float | None = 120.0, ended: str | None = None) -> Delivery:
        """Stop system metrics, send what is queued (at most timeout seconds), terminate the run (with the
        tag txl.ended = `ended`, when given).

        Returns the delivery counts and logs one warning if anything was dropped or failed (it stays in the
        journal for replay). Never raises for the store's errors: this often runs while an exception from
        training is on its way out.
        """
        _check_status(status)
        if self._closed:
            return self.delivery
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each store call below may sit in MLflow's HTTP retries for minutes when the server is gone; run
        # them in helper threads so that the timeout bounds close() as a whole.
        if self._system_monitor is not None:
            # Before the run is terminated: the monitor's last samples need a RUNNING run.
            if not _finish_by(deadline, self._system_monitor.finish):
                self._failed("system metrics", 0, TimeoutError("close timed out stopping system metrics"))
        self._journal.flush()
        writer_done = self._stop_writer(deadline)
        self._terminate(status, deadline, ended)
        self._journal.close()
        if writer_done:  # a writer still in a request may yet record its chunk as delivered
            self._delivered.close()
        self.folder.unlock()
        self._http_limits.close()
        self._report(status)
        return self.delivery

    def _stop_writer(self, deadline: float | None) -> bool:
        try:
            self._queue.put(_STOP, timeout=_left(deadline))
        except queue.Full:
            pass
        self._writer.join(_left(deadline))
        if self._writer.is_alive():
            self._count_unsent()
            return False
        return True

    def _terminate(self, status: str, deadline: float | None, ended: str | None) -> None:
        """Mark the run terminated; the status waits in the outbox until the store has it (replay sends it)."""
        try:
            item = self.folder.put(next(self._seqs), {"kind": "status", "status": status, "ended": ended,
                                                      "end_time": int(time.time() * 1000)})
        except OSError as e:
            self._failed("run status (writing the outbox)", 0, e)
            return
        if self._store_paused():
            self._failed("run status", 0, ConnectionError("the store failed moments ago; the status waits in the "
                                                          "outbox"))
            return
        errors: list[BaseException] = []

        def terminate() -> None:
            try:
                _deliver_item(self._client, self._run_id, item)
                self.folder.remove(item)
            except Exception as e:
                errors.append(e)

        if not _finish_by(deadline, terminate):
            errors.append(TimeoutError(f"close timed out marking the run {status}"))
        if errors:
            self._failed("run status", 0, errors[0])

    def _report(self, status: str) -> None:
        d = self.delivery
        if d.ok:
            return
        if self._journal.error is None:
            kept = f"the journal keeps them: `python -m txl_dist.tracking replay {self.run_dir}` sends what is missing"
        else:  # its warning said so when it happened; the summary must not promise a replay
            why = self._journal.error.strerror or self._journal.error
            kept = (f"the journal stopped at a failed write ({why}): what failed after it is lost to the store, what "
                    f"failed before it is kept (`python -m txl_dist.tracking replay {self.run_dir}` sends it)")
        logger.warning(
            "tracking: run %s (closing as %s): %d metric values sent, %d dropped because the queue was full, "
            "%d values or items failed%s; %s", self._run_id, status, d.sent, d.dropped, d.failed,
            f"; first error: {d.first_error}" if d.first_error else "", kept)

    # ---------------------------------------------------------------------------------------------
    # The writer thread and error policy

    def _send_loop(self) -> None:
        """Handle queue items in call order: runs of metric batches as one log_batch, items one by one."""
        carry = None
        while True:
            item = carry if carry is not None else self._queue.get()
            carry = None
            try:
                if isinstance(item, _Batch):
                    batches, carry = self._gather(item)
                    self._deliver_metrics(batches)
                elif isinstance(item, _OutboxItem):
                    self._deliver(item)
                elif isinstance(item, _Backfill):
                    self._backfill(item.through_seq, item.start)
                elif isinstance(item, _Flush):
                    item.done.set()
                elif item is _STOP:
                    return
            except Exception as e:  # a writer that died would leave every later flush() waiting forever
                self._failed("the delivery records", 0, e)

    def _backfill(self, through_seq: int, start: int = 0) -> None:
        """Send, as replay would, what the journal (seqs <= through_seq) and the outbox hold and the store
        lacks; at the first failure stop (counting the rest as failed: it stays for replay)."""
        for batches in _undelivered(self.folder, through_seq, start):
            values = sum(len(b.metrics) for b in batches)
            sent = self.delivery.sent
            self._deliver_metrics(batches)
            self._backfill_left -= values
            if self.delivery.sent - sent != values:
                self._count_failed(self._backfill_left)
                return
        for item in self.folder.outbox_items():
            if item.seq <= through_seq:
                self._deliver(item)

    def _gather(self, first: _Batch) -> tuple[list[_Batch], Any]:
        """first and the metric batches queued right after it, up to one log_batch; and the next other item."""
        batches, size = [first], len(first.metrics)
        while size < MAX_METRICS_PER_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batches, None
            if not isinstance(item, _Batch):
                return batches, item
            batches.append(item)
            size += len(item.metrics)
        return batches, None

    def _deliver_metrics(self, batches: list[_Batch]) -> None:
        # The journal first: whatever the store holds is journaled, so a restart never logs it again.
        self._journal.flush()
        for chunk in _chunks(batches):
            n = sum(len(b.metrics) for b in chunk)
            if self._store_paused():
                self._count_failed(n)
                continue
            try:
                _send_metrics(self._client, self._run_id, chunk)
            except Exception as e:
                self._failed("metrics", n, e)
                continue
            self._delivered.record(b.seq for b in chunk)
            with self._lock:
                self.delivery.sent += n

    def _deliver(self, item: _OutboxItem) -> None:
        older, newer_waits = self.folder.copies_of(item)
        if newer_waits:  # the newer copy goes instead; its upload removes this one
            return
        if self._store_paused():
            self._count_failed(1)
            return
        try:
            _deliver_item(self._client, self._run_id, item)
        except Exception as e:
            self._failed(item.what, 1, e)
            return
        for stale in [*older, item]:
            self.folder.remove(stale)

    def _count_unsent(self) -> None:
        """At the close timeout: what is still queued will not be sent now; count it as failed."""
        n = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Batch):
                n += len(item.metrics)
            elif isinstance(item, _OutboxItem):
                n += 1
        with self._lock:
            self.delivery.failed += n
            self.delivery.first_error = self.delivery.first_error or f"close timed out with {n} values unsent"

    def _failed(self, what: str, n: int, exc: BaseException) -> None:
        with self._lock:
            self.delivery.failed += n
            if self.delivery.first_error is None:
                self.delivery.first_error = _one_line(exc)
            self._store_paused_until = time.monotonic() + STORE_PAUSE_S
        self._warn_once(f"could not log {what} to {self.shown_uri} ({_one_line(exc)})")

    def _count_failed(self, n: int) -> None:
        with self._lock:
            self.delivery.failed += n

    def _store_paused(self) -> bool:
        return time.monotonic() < self._store_paused_until

    def _warn_once(self, message: str) -> None:
        # One warning per run: a server that is down would otherwise warn at every step.
        with self._lock:
            if self._warned:
                return
            self._warned = True
        then = ("the rest stays in the journal" if self._closed else
                f"training goes on; the store is tried again every {STORE_PAUSE_S:.0f} s, what fails meanwhile "
                "stays in the journal")
        logger.warning("tracking: %s; %s (`python -m txl_dist.tracking replay %s` sends it)", message, then,
                       self.run_dir)


def _unusable_store(shown: str, uri: str, error: BaseException) -> str:
    """The refusal of a tracking.uri MLflow could not open; a local store on a full disk says so (SQLite's
    "database or disk is full"), not that the URI is wrong."""
    detail = _one_line(error)
    database = sqlite_database(uri)
    if database is not None and ("disk is full" in detail or "No space left on device" in detail):
        return (f"tracking.uri {shown}: its file system is full ({detail}); free space on "
                f"{mount_point(database)}, or put the store elsewhere (tracking.uri sqlite:///path/to/mlflow.db "
                "or http(s)://host:port)")
    return (f"tracking.uri {shown}: MLflow cannot use it ({detail}); use http(s)://host:port (a server), "
            "sqlite:///path/to/mlflow.db, or leave it out (sqlite in run.dir)")


def _check_folder_usable(path: Path) -> None:
    """Refuse a tracking folder that cannot be created or written before the store is touched (a run
    created first would be left RUNNING with nothing logged)."""
    try:
        check_output_folder(path, "tracking:")
    except OutputError as e:
        raise TrackingError(f"{e} (it lies in run.dir)") from None


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
