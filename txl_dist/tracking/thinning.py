"""tracking.metrics_interval: the per-step training metrics logged every n steps, each value covering the
steps since the previous one. Nothing here imports mlflow.

``MetricsWindow`` gathers each step's training metrics (every rank keeps one: the trainer is the same on
every rank, and an elastic resume reads the window from whichever rank file it reads its position from) and
says what to log at the steps that log: the multiples of the interval and train.max_steps. A logged value
summarizes the window, the steps since the last logged step:

- the mean: ``train/loss`` (every step trains the same number of tokens: the window's mean loss per token),
  ``train/grad_norm`` and ``train/step_time_s``; a non-finite value makes the mean non-finite (the window
  held a skipped step, as ``train/nonfinite_steps`` says);
- the rate over the window's time, the harmonic mean: ``train/tokens_per_s``, ``train/model_flops_per_s`` and
  ``train/mfu`` (each is a constant over one step's time: their harmonic mean is that constant over the
  window's mean step time, as the progress line computes it);
- the largest: ``train/memory_*`` (peaks) and ``train/profiled`` (1 when the window held a profiled step);
- every other key, the logged step's own value (``train/lr``, ``train/tokens_seen``, ``train/nonfinite_steps``:
  where the run is, not a sample of a step).

The window is part of the checkpoint (the trainer saves ``state_dict()`` with each rank's state), so a job
resumed from a step that logs nothing (a stop request, train.exit_step, a periodic checkpoint off the
interval) logs at the next due step the value an uninterrupted run logs there, bit for bit: the sums go on
in the same order. tracking is a volatile section, so the interval may change between jobs: the saved window
goes on and is logged at the first step due under the new interval (its value then covers more steps than
the new interval; nothing is left out or counted twice). A checkpoint saved before this existed has no window:
the first logged value covers the steps since the resume.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

STATE_VERSION = 1

MEAN_KEYS = frozenset({"train/loss", "train/grad_norm", "train/step_time_s"})
RATE_KEYS = frozenset({"train/tokens_per_s", "train/model_flops_per_s", "train/mfu"})
PEAK_KEYS = frozenset({"train/profiled"})
PEAK_PREFIXES = ("train/memory_",)


def how_summarized(key: str) -> str:
    """"mean", "rate" (harmonic mean), "peak" or "last" (the logged step's value): the module docstring's rule."""
    if key in MEAN_KEYS:
        return "mean"
    if key in RATE_KEYS:
        return "rate"
    if key in PEAK_KEYS or key.startswith(PEAK_PREFIXES):
        return "peak"
    return "last"


class MetricsWindow:
    """The training metrics of the steps since the last logged one (the module docstring)."""

    def __init__(self, interval: int, max_steps: int) -> None:
        if interval < 1:
            raise ValueError(f"metrics interval {interval} must be >= 1")
        self.interval, self.max_steps = interval, max_steps
        self._reset()

    def _reset(self) -> None:
        self.first_step: int | None = None
        """The window's first step (None: empty)."""
        self._totals: dict[str, float] = {}
        """Per key: the sum (mean), the sum of reciprocals (rate) or the largest value (peak)."""
        self._counts: dict[str, int] = {}
        self._last: dict[str, float] = {}
        """Per key, its last value: what "last" keys log, and what a key of one value logs (1 / (1 / x) may
        differ from x in its last bit: an interval of 1 logs each value exactly as it came)."""

    def due(self, step: int) -> bool:
        """Whether the training metrics are logged at `step`."""
        return step % self.interval == 0 or step == self.max_steps

    def add(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float] | None:
        """Take the metrics of `step` (None values: nothing for that key); what to log at `step` if it is due
        (the window ends there), else None."""
        if self.first_step is None:
            self.first_step = step
        totals, counts = self._totals, self._counts
        for key, value in metrics.items():
            if value is None:
                continue
            value = float(value)
            how = how_summarized(key)
            if how == "mean":
                totals[key] = totals.get(key, 0.0) + value
            elif how == "rate":
                totals[key] = totals.get(key, 0.0) + (1.0 / value if value else math.inf)
            elif how == "peak":
                totals[key] = max(totals.get(key, value), value)
            self._last[key] = value
            counts[key] = counts.get(key, 0) + 1
        return self.take() if self.due(step) else None

    def take(self) -> dict[str, float] | None:
        """The window's summary (None when it is empty), and a new window."""
        if self.first_step is None:
            return None
        out = {}
        for key, last in self._last.items():
            how, n = how_summarized(key), self._counts[key]
            if n == 1 or how == "last":
                out[key] = last
            elif how == "mean":
                out[key] = self._totals[key] / n
            elif how == "rate":
                out[key] = n / self._totals[key] if self._totals[key] else math.inf
            else:
                out[key] = self._totals[key]
        self._reset()
        return out

    def state_dict(self) -> dict[str, Any]:
        """The window as a checkpoint holds it (Python numbers only: the rank file is loaded weights_only)."""
        return {"version": STATE_VERSION, "first_step": self.first_step, "totals": dict(self._totals),
                "counts": dict(self._counts), "last": dict(self._last)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Go on with a saved window; None (a checkpoint from before windows were saved): an empty one."""
        self._reset()
        if state is None:
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"metrics window state version {state.get('version')!r} is not {STATE_VERSION}")
        self.first_step = None if state["first_step"] is None else int(state["first_step"])
        self._totals = {str(k): float(v) for k, v in state["totals"].items()}
        self._counts = {str(k): int(v) for k, v in state["counts"].items()}
        self._last = {str(k): float(v) for k, v in state["last"].items()}
