"""A window of training steps under torch.profiler (train.profile_steps on train.profile_ranks).

Each profiling rank writes into <run.dir>/profile/steps_<first>-<last>/ (first: the first step this job
records; a job resumed inside the window writes a folder of its own):
- rank<r>.trace.json.gz: the Chrome trace (Perfetto and chrome://tracing open it gzipped), one
  `ProfilerStep#<step>` span per optimizer step;
- rank<r>.ops.txt: the operator table (txl_dist/trace_summary.py, from the trace): operators by self CPU
  time, and on a GPU the kernels, copies and fills by device time;
- rank<r>.summary.json: where the window's wall time went: on a GPU, the share of it the device was busy, the
  host's waits for the device, kernel launches per step, the busiest kernels, and the operators with the
  most self CPU time (what a step that waits on its host spends it on).
Rank 0 logs where they go when the window opens, and when it closes its busiest kernels (GPU) or operators
(CPU) and, on a GPU, the summary's line; its operator table and summary also go to the MLflow run
(artifacts, profile/<the folder's name>/). A job that stops inside the window (a stop request, a fault)
writes what it recorded. The profiler only observes: the steps'
numbers are those of an unprofiled run (tests/test_profiling.py).
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from . import distributed
from .atomic import atomic_path, atomic_write
from .trace_summary import analyze, headline, operator_table, read_trace, shares_text, summary_line

log = logging.getLogger(distributed.LOGGER_NAME)

PROFILE_DIR = "profile"
"""The profiles' folder inside the run folder."""
OPS_TABLE_ROWS = 60
LOGGED_OPS = 8


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


class StepProfiler:
    """Opens torch.profiler before optimizer step `first` and closes it after step `last` (or at close()),
    on the ranks chosen; a no-op elsewhere and outside the window."""

    def __init__(self, steps: list[int] | None, ranks: list[int] | None, *, rank: int, is_main: bool,
                 world_size: int, run_dir: str | os.PathLike, device: torch.device, shapes: bool = False):
        self.window = tuple(steps) if steps else None
        self.shapes = shapes
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

    def _in_window(self, step: int) -> bool:
        return self.window is not None and self.window[0] <= step <= self.window[1]

    def _present_ranks(self) -> list[int] | None:
        """The ranks of train.profile_ranks that exist at this world size; None: every rank."""
        return None if self.ranks is None else [r for r in self.ranks if r < self.world_size]

    def _open(self, step: int) -> None:
        if self._done or not self._in_window(step):
            return
        self.folder = window_folder(self.run_dir, step, self.window[1])
        if self.is_main:  # also when rank 0 itself does not record (train.profile_ranks without 0)
            present = self._present_ranks()
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
        self._profiler = torch.profiler.profile(activities=profiler_activities(self.device), record_shapes=self.shapes)
        self._profiler.start()
        self._first_recorded = step

    def covers(self, step: int) -> bool:
        """Whether optimizer step `step` runs under the profiler on some rank: on every rank a slower step, since
        the others wait for the profiled ones in the step's collectives."""
        return self._in_window(step) and self._present_ranks() != []

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
        trace_path = self.folder / f"rank{self.rank:05d}.trace.json.gz"
        raw = self.folder / f".rank{self.rank:05d}.trace.{os.getpid()}.json"
        recorded = f"steps {self._first_recorded}..{step}"
        trace_written = False
        try:
            profiler.export_chrome_trace(str(raw))
            with atomic_path(trace_path) as tmp, open(raw, "rb") as src, gzip.open(tmp, "wb", compresslevel=3) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            trace_written = True
            # From the trace, not torch's key_averages(): its parsing of the events stalls the job for tens of
            # seconds (txl_dist/trace_summary.py).
            times, summary = analyze(read_trace(raw), LOGGED_OPS)
        except Exception as e:  # noqa: BLE001 - an analysis of the written trace must not stop the job
            if not trace_written:
                raise
            log.warning("rank %d: the profile of %s was not analysed (its trace is in %s): %s", self.rank, recorded,
                        trace_path, e)
            return []
        finally:
            raw.unlink(missing_ok=True)
        written = [atomic_write(self.folder / f"rank{self.rank:05d}.ops.txt",
                                f"rank {self.rank}, {recorded}\n{operator_table(times, OPS_TABLE_ROWS)}"),
                   atomic_write(self.folder / f"rank{self.rank:05d}.summary.json",
                                json.dumps({"rank": self.rank, "summary": summary}, indent=1) + "\n")]
        if self.is_main:
            _, top = headline(times, LOGGED_OPS)
            log.info("profile of %s written to %s; busiest %s: %s", recorded, self.folder,
                     "on the device" if times.device else "operators by self CPU time",
                     shares_text(top, LOGGED_OPS, name_chars=90))
            line = summary_line(summary)
            if line:
                log.info("profile of %s: %s", recorded, line)
        return written
