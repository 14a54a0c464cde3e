"""The training loop, and the setup that runs before it (checks in txl_dist.startup, engine, resume).

One optimizer step, on every rank (docs/architecture.md, "Flow of one step"):
```
for each of the g micro batches (the rank's streams, m at a time, at the same time position):
    mems = bank.get(streams, reset)            # the chunk's memory; None after a wrap
    out  = engine(input_ids, labels, mems)     # per-token NLL [m, T], new mems (detached)
    backward(engine, out.nll.mean())           # engine.backward (fp16 at ZeRO 0: the loss scaled first)
    bank.put(streams, out.mems)
    engine.step()                              # DeepSpeed steps the optimizer after the g-th micro batch
```
`train/loss` is the mean NLL over all ranks' tokens (one all-reduce per step, which also carries the stop
and non-finite flags; one host read per step), so it does not depend on the world size. Evaluation runs on
valid every eval.interval steps and at the end, and on test at the end (eval.at_end); checkpoints every
checkpoint.interval steps, at the end, at train.exit_step, and on SIGTERM/SIGUSR1 or when the launcher is
gone (txl_dist.stop_request: all ranks agree at the next step boundary, save, and return exit status 0). A stop
saves before the evaluations due at its step and records them as owed (`evals_owed`): the job that resumes
from that checkpoint runs them before its first step, logged at that step (at train.max_steps: the final
valid and test evaluations and final_eval.json).

Non-finite values: a step whose loss or gradient norm is not finite on any rank updates no weight (DeepSpeed
skips it under bf16/fp16 and ZeRO 1-3; at fp32 stage 0 engine.skipped_unless_finite does), the memory
of every micro batch whose loss or new mems hold a non-finite value is thrown away (bank.forget), and
`train/nonfinite_steps` counts it. train.max_nonfinite such steps in a row end the job with one line and exit
status 1 (Diverged), without a save; a save also refuses weights that are no longer finite.
"""
from __future__ import annotations

import json
import logging
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, distributed
from .atomic import atomic_write
from .config import RunConfig
from .curves import RunCurves
from .data import StreamLoader
from .distributed import DistEnv
from .engine import backward, build_engine, deepspeed_config, deepspeed_grad_norm, global_grad_norm, \
    gradient_traffic_note, model_dtype, skipped_unless_finite, zero_stage
from .errors import RunFailed, one_line
from .flops import flops_per_token, small_head_warning
from .evaluate import Evaluator, batch_to_device
from .memory import MemoryBank, merge_state_dicts
from .profiling import StepProfiler
from .progress import hms
from .space_watch import SAVE_MARGIN, SpaceWatch, next_save_step
from .startup import Resume, TrainStart, start_training
from .stop_request import StopRequest, describe_reasons
from .tracking.thinning import MetricsWindow
from .watchdog import is_collective_failure, note_progress, note_start_up

log = logging.getLogger(distributed.LOGGER_NAME)

STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)


class Diverged(RunFailed):
    """Too many non-finite steps in a row, or weights that are no longer finite."""


class Trainer:
    """The loop. Holds the engine, the train loader, the memory bank, the evaluator and the tracker."""

    def __init__(self, cfg: RunConfig, env: DistEnv, *, engine, loader: StreamLoader, bank: MemoryBank,
                 evaluator: Evaluator, tracker, run_info: dict[str, Any], start: TrainStart):
        self.cfg, self.env = cfg, env
        self.engine, self.loader, self.bank = engine, loader, bank
        self.evaluator, self.tracker = evaluator, tracker
        self.run_info = run_info
        """What every checkpoint's run.json records besides step and tokens (digests, layout, run id)."""
        self.device = engine.device
        self.step = 0
        """Optimizer steps done."""
        self.tokens_seen = 0
        """Tokens trained on, all ranks together."""
        self.nonfinite_steps = 0
        """Steps skipped because a loss or gradient norm was not finite, over the whole run."""
        self.nonfinite_streak = 0
        """Such steps in a row, up to the current one."""
        self.evals_owed = False
        """The evaluations due after the current step (eval.interval's validation; at train.max_steps the final
        valid and test) have not run: a stop request saved the step before them. Saved with the step; the job
        that resumes from it runs them before its first step (checkpoints without it: none owed)."""
        self.last_checkpoint: Path | None = None
        """The tag this job saved last (the final evaluation's weights are its)."""
        self.resumed_from: Path | None = None
        """The tag this job resumed from (the weights of an owed final evaluation, with no save of its own)."""
        self.ended: str | None = None
        """How this job ended, in one line: the MLflow run's tag txl.ended."""
        self.checkpoint_bytes = start.checkpoint_bytes
        """The expected size of a checkpoint (rank 0 checks the free space for it before each save)."""
        self.space_watch = SpaceWatch(cfg.checkpoint_dir()) if env.is_main else None
        """Rank 0's early warning, at each progress line, that the next checkpoint will not fit."""
        self.tokens_per_step = cfg.n_streams() * cfg.model.tgt_len
        self.flops_per_token = flops_per_token(cfg.model, micro_batch=cfg.micro_batch(),
                                               cluster_shares=start.cluster_shares,
                                               tail_mode=trained_tail_mode(engine.module.crit, engine.device))
        """Model FLOPs per trained token, forward + backward (txl_dist/flops.py)."""
        self.peak_flops = start.choices.peak_flops * env.world_size if start.choices else 0.0
        """Peak FLOP/s of all ranks' devices together: the denominator of train/mfu."""
        self.stop: StopRequest | None = None
        self.start = start
        """What start-up opened for this trainer (closed by close())."""
        self.curves = RunCurves(cfg.run.dir)
        """<run.dir>/curves.png, redrawn by rank 0 after each evaluation and at the end."""
        self.profiler = StepProfiler(cfg.train.profile_steps, cfg.train.profile_ranks, rank=env.rank,
                                     is_main=env.is_main, world_size=env.world_size, run_dir=cfg.run.dir,
                                     device=self.device, shapes=cfg.train.profile_shapes)
        self.metrics_window = MetricsWindow(cfg.tracking.metrics_interval, cfg.train.max_steps)
        """The training metrics of the steps since the last logged one (tracking.metrics_interval); saved with
        each checkpoint, so a resumed run logs what an uninterrupted run logs."""
        self._batches = iter(loader)
        self._notes_between_steps = 0  # evaluation segments and save phases noted for the watchdog

    # ------------------------------------------------------------------------------------------------
    # Resumable state

    def state_dict(self) -> dict[str, Any]:
        """The loop's own position (the engine, loader and bank save theirs)."""
        return {"version": STATE_VERSION, "step": self.step, "tokens_seen": self.tokens_seen,
                "nonfinite_steps": self.nonfinite_steps, "nonfinite_streak": self.nonfinite_streak,
                "evals_owed": self.evals_owed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue counting from a saved position."""
        if state.get("version") not in READABLE_STATE_VERSIONS:
            raise ValueError(f"trainer state version {state.get('version')!r} is not one of {READABLE_STATE_VERSIONS}")
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        self.evals_owed = bool(state.get("evals_owed", False))

    # ------------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> int:
        """Train to train.max_steps (or exit_step, or a stop request); returns the process exit status.

        Raises Diverged after train.max_nonfinite non-finite steps in a row.
        """
        cfg = self.cfg
        last = cfg.train.max_steps if cfg.train.exit_step is None else cfg.train.exit_step
        owed = self.evals_owed and self._validation_due()
        if owed:
            self._run_owed_evaluations()
        self.evals_owed = False
        if self.step >= last:
            if owed and self.step == cfg.train.max_steps:
                self.ended = f"finished at step {self.step}"
            elif owed:
                self.ended = f"evaluated step {self.step}, which the checkpoint owed; training stops at {last}"
            else:
                log.info("nothing to do: the checkpoint is at step %d, training stops at %d", self.step, last)
                self.ended = f"nothing to do: the checkpoint is at step {self.step}, training stops at {last}"
            return 0
        self.stop = StopRequest()
        self.profiler.announce(self.step + 1)
        try:
            return self._loop(last)
        finally:
            self._log_profile(self.profiler.close(self.step))
            self.stop.restore()

    def _log_profile(self, files: list[Path]) -> None:
        for path in files:
            try:
                self.tracker.log_artifact(path, f"profile/{path.parent.name}")
            except Exception as e:  # noqa: BLE001 - also runs while a fault unwinds: it must not replace it
                log.warning("tracking: the profile's %s was not logged: %s", path.name, e)

    def _loop(self, last: int) -> int:
        cfg = self.cfg
        log.info("training steps %d..%d of %d on %d rank(s): %d streams x %d tokens per step, %d micro "
                 "step(s) of %d streams per rank", self.step + 1, last, cfg.train.max_steps, self.env.world_size,
                 cfg.n_streams(), cfg.model.tgt_len, self.loader.accumulation_steps, cfg.micro_batch())
        window = RateWindow()
        # The progress line's loss and grad norm: means over the steps since the previous line, by the rule of
        # MLflow's windows (the paper's code printed the log interval's mean loss too).
        shown = MetricsWindow(cfg.train.log_interval, cfg.train.max_steps)
        tested: dict[str, float] | None = None  # the final test's numbers, logged once their weights are saved
        while self.step < last:
            profiled = self.profiler.covers(self.step + 1)
            self.profiler.before_step(self.step + 1)
            stats = self.train_step()
            self._log_profile(self.profiler.after_step(self.step))
            stop = stats.pop("stop")
            diverged = self._count_nonfinite(stats.pop("nonfinite"))
            stats["train/nonfinite_steps"] = float(self.nonfinite_steps)
            if profiled:
                stats["train/profiled"] = 1.0
            window.add(stats["train/step_time_s"], profiled)
            line = shown.add(self.step, stats)
            logged = self.metrics_window.add(self.step, stats)
            if logged is not None:
                self.tracker.log_metrics(logged, step=self.step)
            if diverged:
                # The steps since the last logged one, up to the failure: the run's last values.
                self._log_window_rest()
                raise distributed.agreed(diverged)
            if self.step % cfg.train.log_interval == 0 or self.step == last:
                self._progress(line or shown.take(), *window.report(), last)  # take: a last step off the interval
                window = RateWindow()
                self._watch_space(last)
            if stop:  # every rank sees it at this step (reduced with the loss): the gather is collective
                reasons = describe_reasons(distributed.gather_objects(self.stop.reason()))
                # Save first (the window before a preemption's kill is short): this step's evaluations, if
                # any, are left to the job that resumes from the checkpoint, which records them as owed.
                self.evals_owed = self._validation_due()
                log.warning("stopping after step %d (%s): saving a checkpoint%s", self.step, reasons,
                            "; its evaluation is left to the next job" if self.evals_owed else "",
                            extra=distributed.RANK_ZERO_ONLY)
                saved = self.save()
                self.ended = (f"stopped after step {self.step} ({reasons}); the next job resumes from {saved.name}"
                              + (", evaluating its step first" if self.evals_owed else ""))
                return 0
            if self._validation_due():
                self._validate()
            # The final test before the final save: a job killed during it has no checkpoint at max_steps, so
            # its restart trains the last steps again and tests them, instead of finding nothing to do.
            tested = self._test() if self._final_test_due() else None
            if self.step == last:
                self.save()
            elif cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                if self.nonfinite_streak:  # the newest good checkpoint stays the one to restart from
                    log.warning("step %d: no periodic checkpoint during a run of non-finite steps", self.step)
                else:
                    self.save()
        if tested is not None:
            self._log_final_eval(tested)
        self.ended = (f"finished at step {self.step}" if self.step == cfg.train.max_steps else
                      f"stopped at train.exit_step {self.step}; the next job resumes from {self.last_checkpoint.name}")
        return 0

    def _log_window_rest(self) -> None:
        """Log the training metrics the window holds at the current step, off the interval: a job that fails
        with Diverged logs the steps that led to it."""
        rest = self.metrics_window.take()
        if rest is not None:
            self.tracker.log_metrics(rest, step=self.step)

    def _watch_space(self, last: int) -> None:
        if self.space_watch is None:
            return
        newest = self.last_checkpoint or self.resumed_from
        since = f"the steps since {newest.name}" if newest else "every step of this job"
        self.space_watch.check(self.checkpoint_bytes, self.step,
                               next_save_step(self.step, self.cfg.checkpoint.interval, last), since)

    def _validation_due(self) -> bool:
        """Whether the current step is one to validate after: every eval.interval steps, and train.max_steps
        (so that a stop there, which saves before any evaluation, owes the final valid and test)."""
        interval = self.cfg.eval.interval
        return self.step == self.cfg.train.max_steps or bool(interval and self.step % interval == 0)

    def _final_test_due(self) -> bool:
        """Whether the current step is train.max_steps with eval.at_end: test and final_eval.json follow."""
        return self.step == self.cfg.train.max_steps and self.cfg.eval.at_end

    def _validate(self) -> None:
        self.run_eval(self.cfg.data.valid_split, "valid")
        self.draw_curves()

    def _test(self) -> dict[str, float]:
        return self.run_eval(self.cfg.data.test_split, "test")

    def _log_final_eval(self, result: dict[str, float]) -> None:
        """final_eval.json, once the weights it names are saved."""
        record = self.final_eval_record(self.cfg.data.test_split, result)
        self.tracker.log_dict(record, "final_eval.json")
        # A job that saved nothing (it ran the test its checkpoint owed) names the resumed tag, whose run.json keeps
        # the count of the job that saved it: after a switch (startup._keep_eval_streams) not this one's.
        resumed = self.start.resume
        if self.last_checkpoint is None and resumed is not None:
            recorded = checkpoint.recorded_eval_streams(resumed.run_info)
            if recorded != record["eval_streams"]:
                log.warning("final_eval.json: step %d was evaluated over %d streams, its checkpoint %s records %d "
                            "(what launch/eval.py evaluates by default); reproduce it with launch/eval.py "
                            "--checkpoint %s --set eval.n_streams=%d", self.step, record["eval_streams"],
                            resumed.tag_dir.name, recorded, record["checkpoint"], record["eval_streams"],
                            extra=distributed.RANK_ZERO_ONLY)

    def _run_owed_evaluations(self) -> None:
        """The evaluations of the checkpoint's step that a stop request saved before (all ranks, before any new
        step): logged at that step, on the same weights, as the stopped job would have logged them. Evaluation
        uses its own loaders and memory and no randomness: the training that follows stays exact."""
        log.info("step %d: running the evaluation its checkpoint owes (a stop request saved it first)", self.step)
        self._validate()
        if self._final_test_due():
            self._log_final_eval(self._test())

    def final_eval_record(self, split: str, numbers: dict[str, float]) -> dict[str, Any]:
        """The final evaluation as the artifact final_eval.json holds it: the numbers with what they were computed
        on and how (split, step, the eval section's memory settings, precision), in the layout of
        launch/eval.py's JSON, so that the two can be compared key by key."""
        cfg = self.cfg
        memory = {key: getattr(cfg.eval, key) for key in ("tgt_len", "mem_len", "clamp_len", "same_length",
                                                          "max_segments")}
        saved = self.last_checkpoint or self.resumed_from  # the weights evaluated: this job's save, else its resume
        return {"checkpoint": str(saved) if saved is not None else None, "step": self.step, "split": split,
                "eval_streams": self.evaluator.n_streams,
                "world_size": self.env.world_size, "eval": memory, "precision": cfg.train.precision,
                "attn_impl": cfg.model.attn_impl, **numbers, "tokens": int(numbers["tokens"])}

    def _count_nonfinite(self, nonfinite: bool) -> Diverged | None:
        """Count a (non-)finite step; the error to stop with once train.max_nonfinite come in a row."""
        if not nonfinite:
            self.nonfinite_streak = 0
            return None
        self.nonfinite_steps += 1
        self.nonfinite_streak += 1
        first = self.step - self.nonfinite_streak + 1
        if self.nonfinite_streak >= self.cfg.train.max_nonfinite:
            return Diverged(
                f"training diverged: steps {first}..{self.step} ({self.nonfinite_streak} in a row, "
                f"train.max_nonfinite {self.cfg.train.max_nonfinite}) had a non-finite loss or gradient norm and "
                f"were skipped; the weights are those after step {first - 1}; {self._newest_checkpoint()}")
        log.warning("step %d: non-finite loss or gradient norm; the step was skipped and the memory of the "
                    "affected streams reset (%d in a row, %d in all)", self.step, self.nonfinite_streak,
                    self.nonfinite_steps, extra=distributed.RANK_ZERO_ONLY)
        return None

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over all micro batches; returns this step's metrics (the same on every rank)."""
        engine = self.engine
        start = time.perf_counter()
        # [nll sum, tokens, stop flag, non-finite flag]: reduced together, read once.
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        poisoned = []  # per micro batch: a [1] flag, its memory holds or came from a non-finite value
        streams = []
        own_norm = None
        lr = engine.optimizer.param_groups[0]["lr"]  # what this step uses (the scheduler moves it after)
        cutoffs = self.cfg.model.cutoffs
        g = self.loader.accumulation_steps
        for micro in range(g):
            mb = next(self._batches)
            # Before this micro batch's collectives: a rank that never gets here is found stuck by its peers.
            begun, where = self.step * g + micro + 1, f"step {self.step + 1}, micro batch {micro + 1}/{g}"
            note_progress((begun,), where)
            # Non-blocking copies, and the softmax's cluster counts from the host labels: no sync here.
            input_ids, labels, plan = batch_to_device(mb.input_ids, mb.labels, self.device, cutoffs)  # [m, T] x2
            mems = self.bank.get(mb.stream_ids, mb.reset)  # n_layer x [m, mlen, d_model] or None
            out = engine(input_ids, labels=labels, mems=mems, tail_plan=plan)
            # At ZeRO 0-2 the first collective of a micro batch is in its backward: a rank stuck in the forward
            # stays behind this (n, 0), before any note between steps, (n, k >= 1).
            note_progress((begun, 0), f"{where}, its forward done")
            loss_factor = backward(engine, out.nll.mean())
            self.bank.put(mb.stream_ids, out.mems)
            nll_sum = out.nll.detach().double().sum()
            finite = torch.isfinite(nll_sum)  # 0-d, on the device: no sync here
            for t in out.mems:
                finite &= torch.isfinite(t).all()
            poisoned.append(~finite.reshape(1))
            streams.append(mb.stream_ids)
            sums[0] += nll_sum
            sums[1] += out.nll.numel()
            if micro == g - 1:
                # Only where DeepSpeed reports no norm, fp32 at ZeRO stage 0: also the one configuration where
                # DeepSpeed does not skip a non-finite step itself.
                own_norm = global_grad_norm(engine)
            with skipped_unless_finite(engine, own_norm):
                engine.step()
        flags = torch.cat(poisoned)  # [g]
        sums[2] = float(self.stop.reason() is not None) if self.stop is not None else 0.0
        sums[3] = flags.any().double()
        distributed.all_reduce_sum(sums)
        # The norm (DeepSpeed's at ZeRO 1-3 and bf16/fp16, else our own) rides along in the same transfer when
        # it is a device tensor.
        norm = own_norm if own_norm is not None else deepspeed_grad_norm(engine, loss_factor)
        norm_on_device = isinstance(norm, torch.Tensor)
        tail = [norm.detach().reshape(1).to(sums.device, torch.float64)] if norm_on_device else []
        host = torch.cat([sums, flags.double(), *tail]).tolist()  # the one host sync of the step
        nll, tokens, stop, nonfinite_anywhere = host[:4]
        for stream_ids, bad in zip(streams, host[4:4 + len(streams)]):
            if bad:
                self.bank.forget(stream_ids)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        step_time = time.perf_counter() - start
        norm = host[-1] if norm_on_device else None if norm is None else float(norm)
        skipped = not engine.was_step_applied() or (norm is not None and not math.isfinite(norm))
        return {
            "train/loss": nll / tokens,
            "train/lr": lr,
            "train/grad_norm": norm,
            "train/tokens_per_s": self.tokens_per_step / step_time,
            **self._flops_metrics(step_time),
            "train/tokens_seen": float(self.tokens_seen),
            "train/step_time_s": step_time,
            **memory_metrics(self.device),
            "stop": bool(stop),
            "nonfinite": bool(nonfinite_anywhere) or skipped or not math.isfinite(nll),
        }

    def run_eval(self, split: str, prefix: str) -> dict[str, float]:
        """Evaluate the current weights on a split (all ranks), log `<prefix>/*` and return the numbers; a
        mixture's per-source parts `<split>/<name>` are evaluated too and logged as `<prefix>/<name>/*`."""
        result = {}
        for name in [split, *self.evaluator.parts(split)]:
            start = time.perf_counter()
            numbers = self.evaluator.evaluate(self.engine.module, name, on_segment=lambda i: self._note_between_steps(
                f"evaluation of {name} after step {self.step}, segment {i + 1}"))
            tag = prefix + name[len(split):]
            self.tracker.log_metrics({f"{tag}/{k}": v for k, v in numbers.items()}, step=self.step)
            log.info("%s at step %d: loss %.4f | ppl %.2f | %.4f bits/byte | %.4f bits/char | %d tokens | %.1f s",
                     tag, self.step, numbers["loss"], numbers["perplexity"], numbers["bits_per_byte"],
                     numbers["bits_per_char"], numbers["tokens"], time.perf_counter() - start)
            result = result or numbers  # the split's own numbers are the result
        return result

    def _note_between_steps(self, label: str, patience_s: float | None = None) -> None:
        """Note an evaluation segment or a phase of a save for the watchdog: after the micro batches of the
        steps so far, before the next one. Counted over the process: all ranks note the same in the same order."""
        self._notes_between_steps += 1
        note_progress((self.step * self.loader.accumulation_steps, self._notes_between_steps), label, patience_s)

    def draw_curves(self) -> Path | None:
        """Rank 0 with tracking on: redraw <run.dir>/curves.png from the metrics journal and log it to MLflow;
        never raises (txl_dist/curves.py)."""
        return self.curves.draw(self.tracker) if self.tracker.active else None

    def save(self) -> Path:
        """A checkpoint of the current step on every rank (collective); refuses non-finite weights."""
        if distributed.any_rank(not _weights_finite(self.engine)):
            raise distributed.agreed(Diverged(
                f"the weights are no longer finite after step {self.step} (a learning rate too high?); not saving "
                f"them; {self._newest_checkpoint()}"))
        start = time.perf_counter()
        rank_state = {
            "trainer": self.state_dict(), "loader": self.loader.state_dict(), "mems": self.bank.state_dict(),
            "rng": checkpoint.rng_state(), "rank": self.env.rank, "world_size": self.env.world_size,
            "metrics_window": self.metrics_window.state_dict(),
        }
        info = dict(self.run_info, **self.state_dict(), world_size=self.env.world_size,
                    mlflow_run_id=self.tracker.run_id)
        tag_dir = checkpoint.save(self.engine, self.cfg.checkpoint_dir(), self.step, rank=self.env.rank,
                                  world_size=self.env.world_size, rank_state=rank_state, run_info=info,
                                  keep=self.cfg.checkpoint.keep,
                                  min_free_bytes=int(self.checkpoint_bytes * SAVE_MARGIN),
                                  on_phase=lambda what: self._note_between_steps(
                                      f"saving step {self.step}: {what}", patience_s=self.cfg.checkpoint.timeout_s))
        if self.env.is_main:
            self.checkpoint_bytes = checkpoint.tag_bytes(tag_dir)
        self.last_checkpoint = tag_dir
        log.info("checkpoint %s (%.1f s)", tag_dir, time.perf_counter() - start)
        return tag_dir

    def restore(self, resume: Resume) -> None:
        """Load a checkpoint: DeepSpeed's state, then this rank's mems, loader position and RNG.

        Same world size: the rank's own file, RNG included (exact resume, bitwise). Another world size:
        the mems of the streams this rank owns now, from the files of the saved ranks that held them; the
        loader position (the same on all ranks at a step boundary) from the first of those; fresh per-rank
        RNG seeded from (seed, rank, step), so an elastic resume continues the loss but is not bitwise equal
        to an uninterrupted run.
        """
        tag_dir, run_info = resume.tag_dir, resume.run_info
        checkpoint.load_engine(self.engine, resume.source)
        same_world = run_info["world_size"] == self.env.world_size
        if same_world:
            (state,) = checkpoint.load_rank_states(tag_dir, [self.env.rank])
            mems = state["mems"]
        else:
            states = checkpoint.load_holders_of(tag_dir, self.loader.stream_ids, n_streams=self.loader.n_streams,
                                                saved_world_size=run_info["world_size"])
            state = states[0]  # the trainer's and loader's entries are the same in every rank file
            mems = merge_state_dicts(s["mems"] for s in states)
        self.load_state_dict(state["trainer"])
        self.metrics_window.load_state_dict(state.get("metrics_window"))
        self.loader.load_state_dict(state["loader"])
        self._batches = iter(self.loader)
        self.bank.load_state_dict(mems, stream_ids=self.loader.stream_ids, device=self.device,
                                  mem_len=self.cfg.model.mem_len)
        if self.engine.global_steps != self.step:
            raise checkpoint.CheckpointError(
                f"{tag_dir}: DeepSpeed's step {self.engine.global_steps} differs from the trainer's {self.step}")
        if same_world:
            checkpoint.set_rng_state(state["rng"])
        else:
            checkpoint.seed_rng(self.cfg.train.seed, self.env.rank, self.step)
        self.resumed_from = tag_dir
        log.info("resumed from %s at step %d (%s)", tag_dir, self.step,
                 "same world size" if same_world else
                 f"elastic: {run_info['world_size']} -> {self.env.world_size} ranks")
        if self.env.is_main:
            self._mend_interrupted_commit(tag_dir)

    def _mend_interrupted_commit(self, tag_dir: Path) -> None:
        """Resumed from the newest tag of this run's own folder: `latest` and retention as its save left them
        when its job ended in between (checkpoint.mend_interrupted_commit). A failure is only warned of, as a
        save's retention is: the run does not need either."""
        ckpt_dir = self.cfg.checkpoint_dir()
        try:
            if tag_dir.parent.resolve() != ckpt_dir.resolve() or \
                    checkpoint.inventory(ckpt_dir).complete[-1:] != [tag_dir.name]:
                return
            named, removed = checkpoint.mend_interrupted_commit(ckpt_dir, tag_dir.name, self.cfg.checkpoint.keep)
        except OSError as e:
            log.warning("checkpoint folder %s: could not bring `latest` and retention up to date (%s)", ckpt_dir,
                        one_line(e))
            return
        if named is not None:
            log.warning("checkpoint folder %s: `latest` named %s; it names %s now, the tag this job resumed from",
                        ckpt_dir, named, tag_dir.name)
        if removed:
            log.warning("checkpoint folder %s: removed %s: checkpoint.keep keeps the newest %d tag(s)", ckpt_dir,
                        ", ".join(removed), self.cfg.checkpoint.keep)

    def close(self, status: str = "FINISHED") -> None:
        """End the MLflow run with `status` (and the line saying how the job ended) and close what start-up
        opened (loaders, the run folder's lock)."""
        self.tracker.close(status, ended=self.ended)
        self.start.close()

    # ------------------------------------------------------------------------------------------------

    def _newest_checkpoint(self) -> str:
        complete = checkpoint.inventory(self.cfg.checkpoint_dir()).complete
        if not complete:
            return "there is no checkpoint yet"
        return f"the newest complete checkpoint, {self.cfg.checkpoint_dir() / complete[-1]}, is kept"

    def _flops_metrics(self, step_time: float) -> dict[str, float]:
        """Model FLOP/s of all ranks together and MFU = that / (peak per device * world size)."""
        flops_per_s = self.tokens_per_step / step_time * self.flops_per_token
        metrics = {"train/model_flops_per_s": flops_per_s}
        if self.peak_flops:
            metrics["train/mfu"] = flops_per_s / self.peak_flops
        return metrics

    def _progress(self, stats: dict[str, float], step_time: float, note: str, last: int) -> None:
        """The progress line; stats: the steps' summary since the last line (MetricsWindow), step_time and note:
        RateWindow.report()'s."""
        eta = step_time * (last - self.step)
        norm = stats.get("train/grad_norm")
        flops = self._flops_metrics(step_time)
        mfu = f" | MFU {flops['train/mfu'] * 100:.3g}%" if "train/mfu" in flops else ""
        log.info("step %d/%d | loss %.4f | lr %.3e | grad norm %s | %.0f tok/s | %s%s | %.3f s/step | ETA %s%s",
                 self.step, last, stats["train/loss"], stats["train/lr"],
                 "n/a" if norm is None else f"{norm:.3f}", self.tokens_per_step / step_time,
                 _flops_text(flops["train/model_flops_per_s"]), mfu, step_time, hms(eta), note)


class RateWindow:
    """The steps since the last progress line, by their training time (evaluations and saves do not count):
    those under the profiler apart, since its overhead is no training rate to report."""

    def __init__(self) -> None:
        self._seconds = {False: 0.0, True: 0.0}
        self._steps = {False: 0, True: 0}

    def add(self, seconds: float, profiled: bool) -> None:
        self._seconds[profiled] += seconds
        self._steps[profiled] += 1

    def report(self) -> tuple[float, str]:
        """The mean step time the line reports, and what the line says of profiled steps: the unprofiled steps'
        mean with " | <n> profiled step(s) left out" when there are both, the profiled steps' with " | profiled"
        when there are only those, else no note."""
        if not self._steps[False]:
            return self._seconds[True] / self._steps[True], " | profiled"
        left_out = self._steps[True]
        return (self._seconds[False] / self._steps[False],
                f" | {left_out} profiled step(s) left out" if left_out else "")


def failure_line(e: BaseException) -> str:
    """What the MLflow run says of a failed job: the error's line, except for a failed collective, whose
    explanation (which rank was lost) the job's log has."""
    if is_collective_failure(e):
        return "a collective failed: a rank was lost or stopped (the job's log, logs/train.log, names it)"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    return one_line(e, limit=2000)


def mlflow_status(run_id: str | None, status: str | None = None) -> str:
    """The MLflow part of a log line: the run (and the status it was closed with, at the end), or "MLflow off"
    when tracking is off: there is no run, so no status either."""
    if not run_id:
        return "MLflow off"
    return f"MLflow run {run_id}" + (f" ({status})" if status else "")


def trained_tail_mode(crit, device: torch.device) -> str:
    """The adaptive softmax's tail mode in this trainer's steps, which always pass the micro batch's TailPlan
    (batch_to_device): "gather" unless model.tail_mode says otherwise. Without a plan "auto" may mean "dense"
    on a GPU, where every tail scores every token: FLOPs the steps do not compute."""
    return crit.resolved_tail_mode(device, planned=True)


def _weights_finite(engine) -> bool:
    """Every weight this rank holds is finite (its ZeRO-3 partition, or the whole module); one sync."""
    held = [_held_weights(p) for p in engine.module.parameters()]
    flags = [torch.isfinite(t).all() for t in held if t.numel()]
    return bool(torch.stack(flags).all()) if flags else True


def _held_weights(param: torch.Tensor) -> torch.Tensor:
    """The weights of `param` this rank holds: all of them, or under ZeRO-3 the elements of its partition
    that are weights. DeepSpeed pads every parameter to world size x partition size and allocates the padding
    with torch.empty, never writing it: on the last ranks it holds whatever the memory held, NaN bit patterns
    included: a save was refused "weights no longer finite" at random (seen once, on rank 1 of a 2-rank ZeRO-3
    fp32 test run on a CPU)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param.detach()
    size = part.numel()
    start = size * torch.distributed.get_rank(group=param.ds_process_group)
    return part.detach().narrow(0, 0, max(0, min(param.ds_numel - start, size)))


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory of this process: CUDA allocator on a GPU, resident set size on the CPU (MiB)."""
    if device.type == "cuda":
        return {"train/memory_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"train/memory_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _flops_text(flops_per_s: float) -> str:
    for scale, unit in ((1e15, "PFLOP/s"), (1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.2f} {unit}"
    return f"{flops_per_s / 1e6:.2f} MFLOP/s"


# ----------------------------------------------------------------------------------------------------
# Building a trainer: every check in txl_dist.startup first, then the engine.


def build(cfg: RunConfig, env: DistEnv, *, resume: str = "auto", log_file: bool = False) -> Trainer:
    """Check the run (txl_dist.startup), build the engine, loader, bank, evaluator and tracker, restore a
    checkpoint if any. Every refusal comes before the engine exists, on all ranks together. log_file: this
    rank appends its log to <run.dir>/logs/ (from the moment the run folder is held)."""
    start = start_training(cfg, env, resume, log_file=log_file)
    try:
        return _build_from(start, env)
    except BaseException:
        start.tracker.close("FAILED")
        start.close()
        raise


def _build_from(start: TrainStart, env: DistEnv) -> Trainer:
    cfg, resume = start.cfg, start.resume
    ds_config = deepspeed_config(cfg, env.world_size, load_universal=resume is not None and resume.source.universal)
    from .model import TransformerXL  # the model package is heavy; import it when a model is built

    engine = build_engine(lambda: TransformerXL(cfg.model), ds_config, seed=cfg.train.seed,
                          compile_layers=cfg.train.compile)
    note_start_up("the engine built")  # a rank stuck loading is then named as past this, not before
    checkpoint.seed_rng(cfg.train.seed, env.rank)  # dropout differs between ranks, reproducibly
    manifest = start.manifest
    info = {
        "n_streams": cfg.n_streams(), "stream_len": start.loader.stream_len, "zero_stage": zero_stage(cfg.deepspeed),
        "config_digest": cfg.digest(), "config": cfg.public_dict(), "manifest_digest": manifest.digest(),
        "tokenizer_sha256": manifest.tokenizer.sha256, "vocab_size": manifest.tokenizer.vocab_size,
        "run_choices": start.choices.record() if start.choices else None,
        # What eval.n_streams null resolved to for this run (its resumes keep it: startup._keep_eval_streams).
        "eval_streams": start.evaluator.n_streams,
    }
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    trainer = Trainer(cfg, env, engine=engine, loader=start.loader, bank=MemoryBank(), evaluator=start.evaluator,
                      tracker=start.tracker, run_info=info, start=start)
    # A lost rank ends this process from the watchdog's thread: the MLflow run is marked FAILED first.
    distributed.on_abort(lambda: trainer.tracker.close("FAILED", timeout=3.0))
    if resume is not None:
        # Together: a refusal on one rank (a rank file gone since start-up verified it) is every rank's, as the
        # entry point assumes of a refusal, and a slow rank is waited for on the control group's timeout.
        distributed.together(lambda: trainer.restore(resume), f"checkpoint {resume.tag_dir.name} loaded")
        start.release_checkpoint()  # another run's tag (a fork): loaded, its retention may remove it again
    if env.is_main:
        _log_run_start(trainer, start, env, n_params)
    return trainer


def _log_run_start(trainer: Trainer, start: TrainStart, env: DistEnv, n_params: int) -> None:
    cfg, tracker = start.cfg, trainer.tracker
    tracker.log_params(cfg.public_dict())
    tracker.log_params({"derived": {"n_params": n_params, "stream_len": trainer.loader.stream_len,
                                    "tokens_per_step": trainer.tokens_per_step}})
    choices = start.choices
    tracker.log_dict({"run_choices": choices.record() if choices else None,
                      "peak_flops_per_device": choices.peak_flops if choices else None,
                      "peak_flops_source": choices.peak_source if choices else None,
                      "flops_per_token": trainer.flops_per_token, "cluster_shares": start.cluster_shares},
                     run_choices_artifact(start, trainer.step))
    resolved = start.run_dir.resolved_config
    atomic_write(resolved, json.dumps(cfg.public_dict(), indent=2) + "\n")
    tracker.log_artifact(resolved)
    corpus = Path(cfg.data.path)
    tracker.log_artifact(corpus / "manifest.json", "data")
    tracker.log_artifact(corpus / start.manifest.tokenizer.file, "data")
    log.info("model: %.2fM parameters, %.3g GFLOP per token (forward+backward) | world size %d (%s, %d thread(s) "
             "per rank) | ZeRO stage %d | %s | run folder %s | %s", n_params / 1e6,
             trainer.flops_per_token / 1e9, env.world_size, env.launcher, torch.get_num_threads(),
             zero_stage(cfg.deepspeed), str(model_dtype(trainer.engine.config)).replace("torch.", ""),
             start.run_dir.path, mlflow_status(tracker.run_id))
    traffic = gradient_traffic_note(zero_stage(cfg.deepspeed), env.world_size, trainer.loader.accumulation_steps)
    if traffic:
        log.info("%s", traffic)
    head = small_head_warning(cfg.model.cutoffs, start.cluster_shares)
    if head:
        log.warning("%s", head)


def run_choices_artifact(start: TrainStart, step: int) -> str:
    """The artifact name of a job's run choices and peak: run_choices.json for a new run and for a resume that
    kept the checkpoint's peak (the same numbers again); a job with a peak of its own (another device, or
    train.peak_flops changed) writes run_choices_from_step_<step>.json beside it, so the first job's stay.
    An artifact, not params: MLflow params cannot change, and a run on another device has another peak."""
    if start.resume is None or start.choices is None:
        return "run_choices.json"
    recorded = (start.resume.run_info.get("run_choices") or {}).get("peak") or {}
    if recorded.get("flops_per_s") == start.choices.peak_flops:
        return "run_choices.json"
    return f"run_choices_from_step_{step:08d}.json"


def run(cfg: RunConfig, env: DistEnv, *, resume: str = "auto", log_all_ranks: bool = False) -> int:
    """The main job on this rank: build (with its checks), train, close the MLflow run. Exit status.

    Rank 0 (every rank with log_all_ranks) also appends its log to <run.dir>/logs/ once start-up holds the
    run folder.
    """
    trainer = build(cfg, env, resume=resume, log_file=env.is_main or log_all_ranks)
    status, failing = "FAILED", False
    try:
        code = trainer.train()
        # >=: a job relaunched with a lower max_steps than its checkpoint has nothing to do, and its run stays
        # FINISHED rather than turning KILLED. A stop at max_steps that left the final evaluation to the next job
        # is not finished: KILLED, as other stops.
        status = "FINISHED" if trainer.step >= cfg.train.max_steps and not trainer.evals_owed else "KILLED"
        return code
    except BaseException as e:
        failing = True
        trainer.ended = f"failed after step {trainer.step}: {failure_line(e)}"
        raise
    finally:
        try:
            if env.is_main:
                curves = trainer.draw_curves()
                log.info("run folder %s | %s%s", Path(cfg.run.dir).resolve(), mlflow_status(
                    trainer.tracker.run_id, status), f" | curves {curves.resolve()}" if curves else "")
                hint = trainer.tracker.ui_hint()
                if hint:
                    log.info("MLflow UI: %s", hint)
            trainer.close(status)
        except Exception as e:
            if not failing:
                raise
            # The job's own failure is what the user must read; this one would replace it.
            log.warning("closing the run after the failure failed too: %s", failure_line(e))
