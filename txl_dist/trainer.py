"""The training loop, and the setup that runs before it (checks, engine, resume).

One optimizer step, on every rank (ARCHITECTURE.md, "Flow of one step"):
```
for each of the g micro batches (the rank's streams, m at a time, at the same time position):
    mems = bank.get(streams, reset)            # the chunk's memory; None after a wrap
    out  = engine(input_ids, labels, mems)     # per-token NLL [m, T], new mems (detached)
    engine.backward(out.nll.mean())
    bank.put(streams, out.mems)
    engine.step()                              # DeepSpeed steps the optimizer after the g-th micro batch
```
`train/loss` is the mean NLL over all ranks' tokens (one all-reduce per step, which also carries the
stop flag), so it does not depend on the world size. Evaluation runs on valid every eval.interval steps
and at the end, and on test at the end (eval.at_end); checkpoints every checkpoint.interval steps, at the end, at train.exit_step, and
on SIGTERM/SIGUSR1 (the handler only sets a flag; all ranks agree at the next step boundary, save, and
return exit status 0).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, distributed
from .config import ConfigError, RunConfig, check_cutoffs
from .data import StreamLoader, read_manifest
from .distributed import DistEnv
from .engine import build_engine, deepspeed_config, global_grad_norm, model_dtype, zero_stage
from .evaluate import Evaluator
from .memory import MemoryBank, merge_state_dicts
from .tracking import create_tracker

log = logging.getLogger(distributed.LOGGER_NAME)

STATE_VERSION = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Model settings a checkpoint's weights are tied to; the others (dropout, mem_len, ...) may change on resume.
MODEL_STRUCTURE = ("vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed", "div_val",
                   "cutoffs", "tie_weight", "tie_projs", "pre_lnorm", "untie_r")


class Trainer:
    """The loop. Holds the engine, the train loader, the memory bank, the evaluator and the tracker."""

    def __init__(self, cfg: RunConfig, env: DistEnv, *, engine, loader: StreamLoader, bank: MemoryBank,
                 evaluator: Evaluator, tracker, run_info: dict[str, Any]):
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
        self.tokens_per_step = cfg.n_streams() * cfg.model.tgt_len
        self.stop_signal: int | None = None
        self._batches = iter(loader)

    # ------------------------------------------------------------------------------------------------
    # Resumable state

    def state_dict(self) -> dict[str, Any]:
        """The loop's own position (the engine, loader and bank save theirs)."""
        return {"version": STATE_VERSION, "step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue counting from a saved position."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"trainer state version {state.get('version')!r} is not {STATE_VERSION}")
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    # ------------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> int:
        """Train to train.max_steps (or exit_step, or a stop signal); returns the process exit status."""
        cfg = self.cfg
        last = cfg.train.max_steps if cfg.train.exit_step is None else cfg.train.exit_step
        if self.step >= last:
            log.info("nothing to do: the checkpoint is at step %d, training stops at %d", self.step, last)
            return 0
        self._install_signal_handlers()
        log.info("training steps %d..%d of %d on %d rank(s): %d streams x %d tokens per step, %d micro "
                 "step(s) of %d streams per rank", self.step + 1, last, cfg.train.max_steps, self.env.world_size,
                 cfg.n_streams(), cfg.model.tgt_len, self.loader.accumulation_steps, cfg.micro_batch())
        window_time, window_steps = 0.0, 0  # training time only: evaluations and saves do not count
        while self.step < last:
            stats = self.train_step()
            stop = stats.pop("stop")
            window_time, window_steps = window_time + stats["train/step_time_s"], window_steps + 1
            self.tracker.log_metrics(stats, step=self.step)
            if self.step % cfg.train.log_interval == 0 or self.step == last:
                self._progress(stats, window_time / window_steps, last)
                window_time, window_steps = 0.0, 0
            if stop:
                name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another rank"
                log.warning("stopping after step %d (%s): saving a checkpoint", self.step, name)
                self.save()
                return 0
            final = self.step == cfg.train.max_steps
            if final or (cfg.eval.interval and self.step % cfg.eval.interval == 0):
                self.run_eval(cfg.data.valid_split, "valid")
            if (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0) or self.step == last:
                self.save()
        if self.step == cfg.train.max_steps and cfg.eval.at_end:
            result = self.run_eval(cfg.data.test_split, "test")
            self.tracker.log_dict(result, "final_eval.json")
        return 0

    def train_step(self) -> dict[str, float]:
        """One optimizer step over all micro batches; returns this step's metrics (the same on every rank)."""
        engine = self.engine
        start = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # [nll sum, tokens, stop flag]
        own_norm = None
        lr = engine.optimizer.param_groups[0]["lr"]  # what this step uses (the scheduler moves it after)
        for micro in range(self.loader.accumulation_steps):
            mb = next(self._batches)
            input_ids = torch.from_numpy(mb.input_ids).to(self.device)  # [m, T]
            labels = torch.from_numpy(mb.labels).to(self.device)  # [m, T]
            mems = self.bank.get(mb.stream_ids, mb.reset)  # n_layer x [m, mlen, d_model] or None
            out = engine(input_ids, labels=labels, mems=mems)
            engine.backward(out.nll.mean())
            self.bank.put(mb.stream_ids, out.mems)
            sums[0] += out.nll.detach().double().sum()
            sums[1] += out.nll.numel()
            if micro == self.loader.accumulation_steps - 1:
                own_norm = global_grad_norm(engine)  # only where DeepSpeed reports none (fp32 stage 0)
            engine.step()
        sums[2] = float(self.stop_signal is not None)
        distributed.all_reduce_sum(sums)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        step_time = time.perf_counter() - start
        norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
        return {
            "train/loss": (sums[0] / sums[1]).item(),
            "train/lr": lr,
            "train/grad_norm": None if norm is None else float(norm),
            "train/tokens_per_s": self.tokens_per_step / step_time,
            "train/tokens_seen": float(self.tokens_seen),
            "train/step_time_s": step_time,
            **memory_metrics(self.device),
            "stop": bool(sums[2].item()),
        }

    def run_eval(self, split: str, prefix: str) -> dict[str, float]:
        """Evaluate the current weights on a split (all ranks), log `<prefix>/*` and return the numbers."""
        start = time.perf_counter()
        result = self.evaluator.evaluate(self.engine.module, split)
        metrics = {f"{prefix}/{k}": v for k, v in result.items()}
        self.tracker.log_metrics(metrics, step=self.step)
        log.info("%s at step %d: loss %.4f | ppl %.2f | %.4f bits/byte | %.4f bits/char | %d tokens | %.1f s",
                 prefix, self.step, result["loss"], result["perplexity"], result["bits_per_byte"],
                 result["bits_per_char"], result["tokens"], time.perf_counter() - start)
        return result

    def save(self) -> Path:
        """A checkpoint of the current step on every rank (collective)."""
        start = time.perf_counter()
        rank_state = {
            "trainer": self.state_dict(), "loader": self.loader.state_dict(), "mems": self.bank.state_dict(),
            "rng": checkpoint.rng_state(), "rank": self.env.rank, "world_size": self.env.world_size,
        }
        info = dict(self.run_info, **self.state_dict(), world_size=self.env.world_size,
                    mlflow_run_id=self.tracker.run_id)
        tag_dir = checkpoint.save(self.engine, self.cfg.checkpoint_dir(), self.step, rank=self.env.rank,
                                  rank_state=rank_state, run_info=info, keep=self.cfg.checkpoint.keep)
        log.info("checkpoint %s (%.1f s)", tag_dir, time.perf_counter() - start)
        return tag_dir

    def restore(self, tag_dir: Path, run_info: dict[str, Any], source: checkpoint.EngineSource) -> None:
        """Load a checkpoint: DeepSpeed's state, then this rank's mems, loader position and RNG.

        Same world size: the rank's own file, RNG included (exact resume, bitwise). Another world size:
        the mems of the streams this rank owns now, from every rank file; the loader position (the same
        on all ranks at a step boundary) from rank 0's; fresh per-rank RNG seeded from (seed, rank, step),
        so an elastic resume continues the loss but is not bitwise equal to an uninterrupted run.
        """
        checkpoint.load_engine(self.engine, source)
        same_world = run_info["world_size"] == self.env.world_size
        if same_world:
            (state,) = checkpoint.load_rank_states(tag_dir, [self.env.rank])
            mems = state["mems"]
        else:
            states = checkpoint.load_rank_states(tag_dir, range(run_info["world_size"]))
            state = states[0]
            mems = merge_state_dicts(s["mems"] for s in states)
        self.load_state_dict(state["trainer"])
        self.loader.load_state_dict(state["loader"])
        self._batches = iter(self.loader)
        self.bank.load_state_dict(mems, stream_ids=self.loader.stream_ids, device=self.device)
        if self.engine.global_steps != self.step:
            raise checkpoint.CheckpointError(
                f"{tag_dir}: DeepSpeed's step {self.engine.global_steps} differs from the trainer's {self.step}")
        if same_world:
            checkpoint.set_rng_state(state["rng"])
        else:
            checkpoint.seed_rng(self.cfg.train.seed, self.env.rank, self.step)
        log.info("resumed from %s at step %d (%s)", tag_dir, self.step,
                 "same world size" if same_world else
                 f"elastic: {run_info['world_size']} -> {self.env.world_size} ranks")

    # ------------------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stop_signal = signum

        for sig in STOP_SIGNALS:
            signal.signal(sig, request_stop)

    def _progress(self, stats: dict[str, float], step_time: float, last: int) -> None:
        eta = step_time * (last - self.step)
        norm = stats["train/grad_norm"]
        log.info("step %d/%d | loss %.4f | lr %.3e | grad norm %s | %.0f tok/s | %.3f s/step | ETA %s",
                 self.step, last, stats["train/loss"], stats["train/lr"],
                 "n/a" if norm is None else f"{norm:.3f}", self.tokens_per_step / step_time, step_time,
                 _hms(eta))


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory of this process: CUDA allocator on a GPU, resident set size on the CPU (MiB)."""
    if device.type == "cuda":
        return {"train/memory_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20}
    return {"train/memory_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ----------------------------------------------------------------------------------------------------
# Setup: everything that is refused is refused here, before the engine exists.


def resolve_model_config(cfg: RunConfig, vocab_size: int, corpus: str) -> RunConfig:
    """cfg with model.vocab_size taken from the corpus' tokenizer; a different explicit value is refused."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != vocab_size:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} differs from the tokenizer of {corpus} ({vocab_size}); "
            "set it to null (taken from the manifest) or prepare the data with the matching tokenizer")
    check_cutoffs(cfg.model.cutoffs, vocab_size)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def check_resume(cfg: RunConfig, run_info: dict[str, Any], tag_dir: Path, *, tokenizer_sha256: str,
                 manifest_digest: str, zero: int) -> None:
    """Refuse a checkpoint this run cannot continue (one line naming the difference); warn on other changes."""
    saved_cfg = run_info["config"]
    problems = []
    if run_info["tokenizer_sha256"] != tokenizer_sha256:
        problems.append("the data was prepared with another tokenizer (sha256 differs); use the checkpoint's data")
    elif run_info["manifest_digest"] != manifest_digest:
        problems.append("the prepared data differs (manifest digest); resume on the data it was trained on")
    if run_info["n_streams"] != cfg.n_streams():
        problems.append(f"deepspeed.train_batch_size (the number of streams) is {cfg.n_streams()}, the checkpoint "
                        f"has {run_info['n_streams']}; keep it to resume (any world size dividing it works)")
    model = dataclasses.asdict(cfg.model)
    changed_model = sorted(k for k in MODEL_STRUCTURE if saved_cfg["model"].get(k) != model[k])
    if changed_model:
        problems.append(f"model settings differ: {', '.join('model.' + k for k in changed_model)}; the weights "
                        "only fit the model they were trained as")
    if run_info["zero_stage"] != zero:
        problems.append(f"ZeRO stage {zero} differs from the checkpoint's {run_info['zero_stage']}; resume with "
                        "the stage it was saved with")
    if problems:
        raise checkpoint.CheckpointError(f"cannot resume from {tag_dir}: {problems[0]}")
    now = cfg.to_dict()
    changed = sorted(f"{section}.{k}" for section, values in now.items() if isinstance(values, dict)
                     for k, v in values.items() if saved_cfg.get(section, {}).get(k) != v)
    changed = [k for k in changed if not k.startswith(("checkpoint.", "tracking.", "train.exit_step",
                                                       "train.log_interval"))]
    if changed:
        log.warning("resuming %s with changed settings: %s", tag_dir, ", ".join(changed))


@dataclasses.dataclass
class _Start:
    """What build() checks and opens before the engine exists."""

    cfg: RunConfig
    manifest: Any
    tag_dir: Path | None
    run_info: dict[str, Any] | None
    loader: StreamLoader
    evaluator: Evaluator


def _prepare(cfg: RunConfig, env: DistEnv, resume: str) -> _Start:
    cfg.gradient_accumulation_steps(env.world_size)  # S divisible by micro batch x W, or a ConfigError
    eval_streams = cfg.eval_streams(env.world_size)
    manifest = read_manifest(cfg.data.path)
    cfg = resolve_model_config(cfg, manifest.tokenizer.vocab_size, cfg.data.path)
    tag_dir = checkpoint.resolve_resume(resume, cfg.checkpoint_dir())
    run_info = None
    if tag_dir is not None:
        run_info = checkpoint.read_run_info(tag_dir)
        check_resume(cfg, run_info, tag_dir, tokenizer_sha256=manifest.tokenizer.sha256,
                     manifest_digest=manifest.digest(), zero=zero_stage(cfg.deepspeed))
    # The loaders open (and verify) their files now: bad data fails the start, not step 10,000.
    loader = StreamLoader(cfg.data.path, cfg.data.train_split, rank=env.rank, world_size=env.world_size,
                          n_streams=cfg.n_streams(), micro_batch=cfg.micro_batch(), tgt_len=cfg.model.tgt_len,
                          roll=cfg.data.roll, seed=cfg.data.seed)
    eval_splits = [cfg.data.valid_split] + ([cfg.data.test_split] if cfg.eval.at_end else [])
    evaluator = Evaluator(cfg.data.path, cfg.eval, rank=env.rank, world_size=env.world_size,
                          n_streams=eval_streams, device=distributed.device_for(env), splits=eval_splits)
    return _Start(cfg, manifest, tag_dir, run_info, loader, evaluator)


def build(cfg: RunConfig, env: DistEnv, *, resume: str = "auto") -> Trainer:
    """Check the run, build engine, loader, bank, evaluator and tracker, and restore a checkpoint if any.

    Every refusal (configuration, corpus, checkpoint) comes before the engine exists, on all ranks
    together: a rank that fails makes the others stop too instead of waiting in a collective.
    """
    start = distributed.together(lambda: _prepare(cfg, env, resume))
    cfg, tag_dir, run_info = start.cfg, start.tag_dir, start.run_info
    source = None
    if tag_dir is not None:
        source = checkpoint.engine_source(tag_dir, run_info, world_size=env.world_size, rank=env.rank)
    # Rank 0 alone removes interrupted saves (tags newer than `latest`) before anything is written; the
    # tag the other ranks are reading now is left alone.
    if env.is_main and cfg.checkpoint_dir().is_dir():
        checkpoint.prune(cfg.checkpoint_dir(), cfg.checkpoint.keep, protect=tag_dir)

    ds_config = deepspeed_config(cfg, env.world_size, load_universal=source is not None and source.universal)
    from .model import TransformerXL  # the model package is heavy; import it when a model is built

    engine = build_engine(lambda: TransformerXL(cfg.model), ds_config, seed=cfg.train.seed)
    checkpoint.seed_rng(cfg.train.seed, env.rank)  # dropout differs between ranks, reproducibly
    run_dir = Path(cfg.run.dir)
    tracker = create_tracker(cfg.tracking, env.rank, run_dir,
                             resume_run_id=None if run_info is None else run_info.get("mlflow_run_id"))
    manifest = start.manifest
    info = {
        "n_streams": cfg.n_streams(), "stream_len": start.loader.stream_len, "zero_stage": zero_stage(cfg.deepspeed),
        "config_digest": cfg.digest(), "config": cfg.to_dict(), "manifest_digest": manifest.digest(),
        "tokenizer_sha256": manifest.tokenizer.sha256, "vocab_size": manifest.tokenizer.vocab_size,
    }
    trainer = Trainer(cfg, env, engine=engine, loader=start.loader, bank=MemoryBank(), evaluator=start.evaluator,
                      tracker=tracker, run_info=info)
    if tag_dir is not None:
        trainer.restore(tag_dir, run_info, source)
    if env.is_main:
        _log_run_start(trainer, cfg, env, manifest)
    return trainer


def _log_run_start(trainer: Trainer, cfg: RunConfig, env: DistEnv, manifest) -> None:
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.engine.module.parameters())
    tracker = trainer.tracker
    tracker.log_params(cfg.to_dict())
    tracker.log_params({"derived": {"n_params": n_params, "stream_len": trainer.loader.stream_len,
                                    "tokens_per_step": trainer.tokens_per_step}})
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "config.resolved.json"
    resolved.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    tracker.log_artifact(resolved)
    corpus = Path(cfg.data.path)
    tracker.log_artifact(corpus / "manifest.json", "data")
    tracker.log_artifact(corpus / manifest.tokenizer.file, "data")
    log.info("model: %.2fM parameters | world size %d (%s, %d thread(s) per rank) | ZeRO stage %d | %s | "
             "MLflow run %s", n_params / 1e6, env.world_size, env.launcher, torch.get_num_threads(),
             zero_stage(cfg.deepspeed),
             str(model_dtype(trainer.engine.config)).replace("torch.", ""),
             tracker.run_id or "off")


def run(cfg: RunConfig, env: DistEnv, *, resume: str = "auto") -> int:
    """The main job on this rank: build (with its checks), train, close the MLflow run. Exit status."""
    trainer = build(cfg, env, resume=resume)
    status = "FAILED"
    try:
        code = trainer.train()
        status = "FINISHED" if trainer.step == cfg.train.max_steps else "KILLED"
        return code
    finally:
        trainer.evaluator.close()
        trainer.loader.close()
        trainer.tracker.close(status)
        if env.is_main:
            log.info("checkpoints in %s | MLflow run %s (%s)", cfg.checkpoint_dir().resolve(),
                     trainer.tracker.run_id or "off", status)
