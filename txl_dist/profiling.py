"""A window of training steps under torch.profiler (train.profile_steps on train.profile_ranks).

Each profiling rank writes into <run.dir>/profile/steps_<first>-<last>/ (first: the first step this job
records; a job resumed inside the window writes a folder of its own):
- rank<r>.trace.json.gz: the Chrome trace (Perfetto and chrome://tracing open it gzipped), one
  `ProfilerStep#<step>` span per optimizer step;
- rank<r>.ops.txt: torch's operator table, sorted by self device time on a GPU, else by self CPU time;
- rank<r>.summary.json: where the window's wall time went (txl_dist/trace_summary.py): on a GPU, the share of
  it the device was busy, the host's waits for the device, kernel launches per step, the busiest kernels,
  and the operators with the most self CPU time (what a step that waits on its host spends it on).
Rank 0 logs where they go when the window opens, and when it closes its busiest kernels (GPU) or operators
(CPU) and, on a GPU, the summary's line; its operator table and summary also go to the MLflow run
(artifacts, profile/<the folder's name>/). A job that stops
inside the window (a stop request, a fault) writes what it recorded. The profiler only observes: the steps'
numbers are those of an unprofiled run (tests/test_profiling.py).
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEventAvg

from . import distributed
from .atomic import atomic_path, atomic_write
from .trace_summary import activities_from_events, summarize, summary_line

log = logging.getLogger(distributed.LOGGER_NAME)

PROFILE_DIR = "profile"
"""The profiles' folder inside the run folder."""
OPS_TABLE_ROWS = 60
LOGGED_OPS = 8

# torch renamed the CUDA timings "device" timings (2.4); both names are tried so that either torch works (they
# are instance attributes: the class itself has neither).
_DEVICE_SELF_TIME = next((name for name in ("self_device_time_total", "self_cuda_time_total")
                          if hasattr(FunctionEventAvg(), name)), None)


def window_folder(run_dir: str | os.PathLike, first: int, last: int) -> Path:
    """<run.dir>/profile/steps_<first>-<last> (8-digit step numbers, as the checkpoint tags): `first` is the
    first step this job records, so a job resumed inside a window writes beside what the stopped one wrote."""
    return Path(run_dir) / PROFILE_DIR / f"steps_{first:08d}-{last:08d}"


def profiler_activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """What torch.profiler records for a model on `device`: the CPU side, and the CUDA kernels on a GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def self_time_key(device_type: str) -> str:
    """The key_averages() attribute that ranks operators: self device time on a GPU, self CPU time else."""
    return _DEVICE_SELF_TIME if device_type == "cuda" and _DEVICE_SELF_TIME else "self_cpu_time_total"


def ranking_key(averages: list[Any], device_type: str) -> str:
    """self_time_key, or self CPU time when the profile holds no device time (a GPU whose kernel tracing,
    CUPTI, was not available: torch then records the CPU side only)."""
    key = self_time_key(device_type)
    if key != "self_cpu_time_total" and not any(getattr(e, key) for e in averages):
        return "self_cpu_time_total"
    return key


def busiest(averages: list[Any], device_type: str, limit: int) -> list[dict[str, Any]]:
    """The `limit` entries of a profile's key_averages() with the most self time: name, calls, self time in ms
    and its share of the total, of that kind (see ranking_key). By device time, the entries are what ran on
    the device (kernels, copies, fills), as torch's own total counts them: an operator's self device time is
    its kernels' again, and an annotation's (`ProfilerStep*`, a compiled graph's `## Call CompiledFxGraph`)
    is the length of its span on the device, idle time included (46% of "device time" in the first GPU
    run's log was the step span itself). By CPU time, every entry: an annotation's self CPU time is what no
    operator inside it accounts for (`ProfilerStep*`: Python, the loop, DeepSpeed's bookkeeping; a compiled
    graph's: its C++ kernels, which are no aten operators)."""
    key = ranking_key(averages, device_type)
    rows = averages
    if key != "self_cpu_time_total":
        rows = [e for e in averages if not getattr(e, "is_user_annotation", False)
                and getattr(e.device_type, "name", "CPU") != "CPU"]
    total = sum(getattr(e, key) for e in rows) or 1.0
    ranked = sorted(rows, key=lambda e: getattr(e, key), reverse=True)[:limit]
    return [{"name": e.key, "calls": e.count, "self_ms": round(getattr(e, key) / 1e3, 3),
             "share": round(getattr(e, key) / total, 4)} for e in ranked]


def window_summary(events: Any, averages: list[Any], host_rows: int = LOGGED_OPS) -> dict[str, Any] | None:
    """trace_summary's summary of a profiled window (`profiler.events()`), with, when the device was traced,
    "host_busiest": the `host_rows` entries with the most self CPU time (busiest): where a step that waits on
    its host spends it (Python, launches, DeepSpeed's hooks)."""
    summary = summarize(activities_from_events(events))
    if summary is not None and summary["device"] is not None:
        summary["host_busiest"] = busiest(averages, "cpu", host_rows)
    return summary


class StepProfiler:
    """Opens torch.profiler before optimizer step `first` and closes it after step `last` (or at close()),
    on the ranks chosen; a no-op elsewhere and outside the window."""

    def __init__(self, steps: list[int] | None, ranks: list[int] | None, *, rank: int, is_main: bool,
                 world_size: int, run_dir: str | os.PathLike, device: torch.device):
        self.window = tuple(steps) if steps else None
        self.ranks = ranks
        self.rank, self.is_main, self.world_size, self.device = rank, is_main, world_size, device
        self.records = self.window is not None and (ranks is None or rank in ranks)
        self.run_dir = run_dir
        self.folder: Path | None = None
        """Where this job's profile goes (set when the window opens)."""
        self._profiler: torch.profiler.profile | None = None
        self._first_recorded: int | None = None
        self._step_span: torch.profiler.record_function | None = None
        self._done = False

    def announce(self, next_step: int) -> None:
        """Rank 0, before training: where the window lies against the steps this job runs."""
        if not (self.window and self.is_main):
            return
        first, last = self.window
        missing = sorted(set(self.ranks or ()) - set(range(self.world_size)))
        if missing:
            log.warning("train.profile_ranks: rank(s) %s do not exist at world size %d", missing, self.world_size)
        if next_step > last:
            log.info("train.profile_steps %d..%d: already trained (this job starts at step %d); no profile",
                     first, last, next_step)

    def before_step(self, step: int) -> None:
        """Called before optimizer step `step` (1-based) runs."""
        if self._profiler is None:
            self._open(step)
        if self._profiler is not None:
            # The span profilers and trace viewers know a step by (torch's own schedule writes the same).
            self._step_span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step_span.__enter__()

    def _open(self, step: int) -> None:
        if self._done or self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        self.folder = window_folder(self.run_dir, step, self.window[1])
        if self.is_main:  # also when rank 0 itself does not record (train.profile_ranks without 0)
            present = None if self.ranks is None else [r for r in self.ranks if r < self.world_size]
            if present == []:
                log.info("train.profile_steps %d..%d: none of train.profile_ranks %s exist at world size %d; no "
                         "profile", step, self.window[1], ", ".join(map(str, self.ranks)), self.world_size)
                self._done = True
                return
            ranks = "every rank" if present is None else f"rank(s) {', '.join(map(str, present))}"
            log.info("profiling steps %d..%d on %s into %s", step, self.window[1], ranks, self.folder)
        if not self.records:
            self._done = True
            return
        self._profiler = torch.profiler.profile(activities=profiler_activities(self.device), record_shapes=True)
        self._profiler.start()
        self._first_recorded = step

    def after_step(self, step: int) -> list[Path]:
        """Called after optimizer step `step`: ends the step's span; at the window's last step, writes the
        profile and returns the paths of the operator table and the summary (the files MLflow gets)."""
        if self._profiler is None:
            return []
        self._end_step_span()
        return self._finish(step) if step >= self.window[1] else []

    def close(self, step: int) -> list[Path]:
        """The job ends (normally, on a stop request or a fault) after `step`: writes what was recorded and
        returns the paths after_step returns (none when nothing was recorded or the writing failed)."""
        if self._profiler is None:
            return []
        try:
            return self._finish(step)
        except Exception as e:  # noqa: BLE001 - a failed profile must not hide the job's own outcome
            log.warning("rank %d: the profile of steps %d..%d was not written: %s", self.rank,
                        self._first_recorded, step, e)
            return []

    def _end_step_span(self) -> None:
        span, self._step_span = self._step_span, None
        if span is not None:
            span.__exit__(None, None, None)

    def _finish(self, step: int) -> list[Path]:
        self._end_step_span()
        profiler, self._profiler, self._done = self._profiler, None, True
        profiler.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank:05d}.trace.json.gz"
        raw = self.folder / f".rank{self.rank:05d}.trace.{os.getpid()}.json"
        try:
            profiler.export_chrome_trace(str(raw))
            with atomic_path(trace) as tmp, open(raw, "rb") as src, gzip.open(tmp, "wb", compresslevel=3) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        finally:
            raw.unlink(missing_ok=True)
        averages = profiler.key_averages()
        key = ranking_key(averages, self.device.type)
        table = averages.table(sort_by=key, row_limit=OPS_TABLE_ROWS, max_name_column_width=90)
        recorded = f"steps {self._first_recorded}..{step}"
        ops = atomic_write(self.folder / f"rank{self.rank:05d}.ops.txt",
                           f"rank {self.rank}, {recorded}, sorted by {key}\n{table}\n")
        written, summary = [ops], None
        try:
            summary = window_summary(profiler.events(), averages)
            written.append(atomic_write(self.folder / f"rank{self.rank:05d}.summary.json",
                                        json.dumps({"rank": self.rank, "summary": summary}, indent=1) + "\n"))
        except Exception as e:  # noqa: BLE001 - an analysis of the events must not stop the training
            log.warning("rank %d: the profile's summary was not written: %s", self.rank, e)
        if self.is_main:
            top = busiest(averages, self.device.type, LOGGED_OPS)
            log.info("profile of %s written to %s; by %s: %s", recorded, self.folder, key,
                     ", ".join(f"{op['name']} {100 * op['share']:.1f}%" for op in top))
            line = summary_line(summary)
            if line:
                log.info("profile of %s: %s", recorded, line)
        return written
