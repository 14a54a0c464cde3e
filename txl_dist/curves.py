"""The run's loss curves: <run.dir>/curves.png, drawn from the metrics journal by rank 0.

The picture: training loss against tokens seen, raw (faint) and smoothed; validation loss at every
evaluation (points); the test loss of the final evaluation (a star). Loss is the mean NLL per token in nats,
as `train/loss` and `valid/loss` are logged.

The source is the run's metrics journal, <run.dir>/tracking/metrics.jsonl (txl_dist/tracking/journal.py):
it holds every step of every job of the run, each step once, whether or not the MLflow store took it, so
a resumed run draws its whole history. It is read incrementally (only the lines added since the last
drawing), so redrawing after each evaluation stays cheap on long runs. Without tracking
(tracking.enabled=false) there is no journal and no picture.

Smoothing: an exponential moving average, debiased as TensorBoard's (the first values are not pulled
towards zero), with a span of about 4% of the logged steps drawn (1 to 1000; every tracking.metrics_interval-th step is
logged, each value the mean over the steps since the one before). Under 50 logged steps the span is 1
(nothing to smooth): one train line, with markers under 3 of them (a line through one point draws nothing).

matplotlib (a Figure without pyplot: the Agg renderer, no display) is imported on first drawing. A failure
to draw never stops training: RunCurves warns once and goes on.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import os
from pathlib import Path

from .atomic import atomic_path
from .tracking.journal import TrackingFolder

log = logging.getLogger("txl_dist")

CURVES_FILE = "curves.png"
"""File name of the picture, in the run folder (beside checkpoints/)."""
MAX_SPAN = 1000
"""The smoothing span never exceeds this many logged steps."""
READ_BLOCK_BYTES = 8 << 20
"""The journal is read in blocks of this size (a journal line is ~400 bytes)."""
MAX_PLOTTED_POINTS = 5000
"""Longer training curves are thinned to about this many points (after smoothing over all of them)."""


@dataclasses.dataclass
class CurvePoints:
    """What the picture is made of (x = tokens seen, all ranks together, at the step the value was logged)."""

    train_tokens: list[float]
    train_loss: list[float]
    """train/loss at every logged step with a finite value, in step order."""
    train_smoothed: list[float]
    """The same, smoothed (ema_debiased with smoothing_span(len(train_loss)))."""
    valid_tokens: list[float]
    valid_loss: list[float]
    """valid/loss at every evaluation during training."""
    test_tokens: list[float]
    test_loss: list[float]
    """test/loss of the final evaluation (empty until it ran)."""


def smoothing_span(n_points: int) -> int:
    """The EMA span for a curve of n_points logged steps: about 4% of them, 1 .. MAX_SPAN."""
    return max(1, min(MAX_SPAN, n_points // 25))


def ema_debiased(values: list[float], span: int) -> list[float]:
    """Exponential moving average with alpha = 2 / (span + 1), divided by the weight it has gathered so far
    (1 - (1 - alpha)^t), so the start of the curve is not biased towards zero. span 1: the values themselves."""
    alpha = 2.0 / (span + 1)
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(acc / weight)
    return out


class LossHistory:
    """The losses and tokens seen per step, read from a run's metrics journal as it grows."""

    def __init__(self, journal: str | os.PathLike) -> None:
        self.journal = Path(journal)
        self._reset()

    def _reset(self) -> None:
        self._offset = 0
        self.tokens_seen: dict[int, float] = {}
        """Step -> train/tokens_seen."""
        self._known_steps: list[int] | None = None
        """The steps of tokens_seen, sorted (tokens_at; rebuilt when more came)."""
        self.losses: dict[str, dict[int, float]] = {"train": {}, "valid": {}, "test": {}}
        """Per prefix (train/valid/test), step -> loss."""

    def update(self) -> None:
        """Read the journal lines written since the last call (complete lines only: the writer may be in
        the middle of one)."""
        try:
            size = self.journal.stat().st_size
        except FileNotFoundError:
            return
        if size < self._offset:  # cut back by a new job's repair of a torn tail: read it again
            self._reset()
        with open(self.journal, "rb") as f:
            f.seek(self._offset)
            # In blocks: a long run's journal is ~430 MB per million steps, and one read of it all (as bytes,
            # then as lines) peaked at ~1 GiB on rank 0.
            while self._offset < size:
                data = f.read(min(READ_BLOCK_BYTES, size - self._offset))
                end = data.rfind(b"\n") + 1
                if end == 0:
                    if len(data) < READ_BLOCK_BYTES:
                        return  # the writer's incomplete last line
                    end = len(data)  # a line longer than a block is no journal line: skip it
                self._offset += end
                f.seek(self._offset)
                for line in data[:end].splitlines():
                    try:
                        record = json.loads(line)
                        step, metrics = int(record["step"]), record["metrics"]
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn line left by a crash
                    self._add(step, metrics)

    def _add(self, step: int, metrics: dict) -> None:
        tokens = metrics.get("train/tokens_seen")
        if tokens is not None:
            self.tokens_seen.setdefault(step, float(tokens))
        for prefix, by_step in self.losses.items():
            loss = metrics.get(f"{prefix}/loss")
            if loss is not None:
                # A step is journaled once per key; a later job never logs it again (the resume rule).
                by_step.setdefault(step, float(loss))

    def tokens_at(self, step: int) -> float | None:
        """Tokens seen after `step`: the logged value, else derived from the nearest logged steps (None when
        none is logged). train/tokens_seen comes only at the steps that log train/* (every
        tracking.metrics_interval-th), an evaluation at any eval.interval step; every step trains the same
        number of tokens (a resume cannot change it), so tokens seen grow linearly with the step."""
        if step in self.tokens_seen:
            return self.tokens_seen[step]
        if self._known_steps is None or len(self._known_steps) != len(self.tokens_seen):
            self._known_steps = sorted(self.tokens_seen)
        known = self._known_steps
        if not known:
            return None
        i = bisect.bisect_left(known, step)
        if 0 < i < len(known):  # between two logged steps
            lo, hi = known[i - 1], known[i]
            return self.tokens_seen[lo] + (self.tokens_seen[hi] - self.tokens_seen[lo]) * (step - lo) / (hi - lo)
        nearest = known[min(i, len(known) - 1)]  # before the first or after the last: tokens per step
        return self.tokens_seen[nearest] * step / nearest if nearest else None

    def points(self) -> CurvePoints:
        """The curves as they stand (steps without a finite loss, or before any known token count, are left
        out)."""

        def series(prefix: str) -> tuple[list[float], list[float]]:
            pairs = [(tokens, v) for s, v in sorted(self.losses[prefix].items())
                     if math.isfinite(v) and (tokens := self.tokens_at(s)) is not None]
            return [t for t, _ in pairs], [v for _, v in pairs]

        train_tokens, train_loss = series("train")
        valid_tokens, valid_loss = series("valid")
        test_tokens, test_loss = series("test")
        smoothed = ema_debiased(train_loss, smoothing_span(len(train_loss)))
        return CurvePoints(train_tokens, train_loss, smoothed, valid_tokens, valid_loss, test_tokens, test_loss)


def figure(points: CurvePoints, title: str = ""):
    """The picture of `points` as a matplotlib Figure (not drawn yet)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    stride = max(1, math.ceil(len(points.train_loss) / MAX_PLOTTED_POINTS))
    # A Figure without pyplot renders with Agg: no display, no global figure registry, the host's backend untouched.
    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot()
    # A line through one point draws nothing: a run's first steps (or a one-step run) get markers.
    few = {"marker": "o", "markersize": 4} if len(points.train_loss) < 3 else {}
    span = smoothing_span(len(points.train_loss))
    if span > 1:
        ax.plot(points.train_tokens[::stride], points.train_loss[::stride], color="tab:blue", alpha=0.25,
                linewidth=0.8, label="train (raw)")
    # Span 1 (under 50 logged steps) smooths nothing: one line, not the same one twice.
    ax.plot(points.train_tokens[::stride], points.train_smoothed[::stride], color="tab:blue", linewidth=1.6,
            label=f"train (EMA, span {span} logged steps)" if span > 1 else "train", **few)
    if points.valid_loss:
        ax.plot(points.valid_tokens, points.valid_loss, color="tab:orange", marker="o", markersize=4, linewidth=1.2,
                label="valid")
    if points.test_loss:
        ax.plot(points.test_tokens, points.test_loss, color="tab:red", marker="*", markersize=11, linestyle="none",
                label="test")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats per token)")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")  # where it hides the fewest points
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def draw(points: CurvePoints, out: str | os.PathLike, title: str = "") -> Path:
    """Write the picture of `points` to `out` (PNG, atomically); returns the path."""
    fig = figure(points, title)
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    return out


class RunCurves:
    """Rank 0's <run.dir>/curves.png: redrawn after each evaluation and at the end, logged to MLflow."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / CURVES_FILE
        self.history = LossHistory(TrackingFolder(run_dir).journal)
        self._warned = False

    def draw(self, tracker) -> Path | None:
        """Redraw from the journal and upload the picture; the path, or None (nothing to draw, or a failure,
        which is warned about once and never raised: the curves must not stop a run)."""
        try:
            tracker.flush_journal()
            self.history.update()
            points = self.history.points()
            if not points.train_loss:
                return None
            draw(points, self.path, title=str(self.path.parent.name))
            tracker.log_artifact(self.path)
            return self.path
        except Exception as e:  # noqa: BLE001  (matplotlib, the disk: any failure only costs the picture)
            if not self._warned:
                self._warned = True
                log.warning("curves: cannot draw %s (%s: %s); training goes on without it", self.path,
                            type(e).__name__, e)
            return None
