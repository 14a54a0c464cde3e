"""Typed run configuration: one JSON file, one dataclass per section, validated before any work.

Sections: run, model, data, train, eval, checkpoint, tracking (typed here) and deepspeed (a plain dict handed
to deepspeed.initialize; the project's own rules are checked here, its keys against DeepSpeed's own reading
of it by deepspeed_schema.check_deepspeed_config at start-up). Every problem is reported as one
``ConfigError`` line that names the key and says what to do.

Standard library only: every other package may import this module.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import importlib.util
import json
import math
import os
import stat
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import Refused, where_relative
from .streams import micro_steps_per_rank, streams_per_rank

MAX_SEED = 2**63 - 1
MAX_WIDTH = 2**20
"""The widest model dimension (d_model, d_inner, d_embed, n_head x d_head) this code builds."""
MAX_LAYERS = 2**12
MAX_LENGTH = 2**20
"""The longest segment or memory (tgt_len, mem_len, in tokens) this code builds."""
MAX_TIMEOUT_S = 30 * 24 * 3600


class ConfigError(Refused, ValueError):
    """A configuration problem; the message is one line naming the key and the fix."""


@dataclass
class RunDirConfig:
    """The run's own folder: everything the run writes goes under it, nothing is inferred from a sibling path."""

    dir: str = "runs/default"
    """The run folder: checkpoints/ (tags and `latest`), config.resolved.json, logs/, tracking/ (the local
    metrics journal and the MLflow run id), profile/ (train.profile_steps), the default MLflow store
    (mlflow.db, mlartifacts/) and the lock that keeps a second job out. Two runs never share one."""

    def checkpoint_dir(self) -> Path:
        return Path(self.dir) / "checkpoints"


@dataclass(frozen=True)
class MemorySettings:
    """How a forward uses the memory: what training, evaluation and generation each pass to the model.

    Training uses the model section's values, evaluation its own (eval.*), generation what its caller asks;
    the model never changes its settings behind the caller's back (model.config keeps the training values).
    """

    mem_len: int
    """Hidden states kept from previous segments (0 = no recurrence)."""
    clamp_len: int = -1
    """Relative distances beyond clamp_len use clamp_len's position embedding; <= 0 disables clamping."""
    same_length: bool = False
    """Every query attends to the same number of keys (needs mem_len >= 1)."""


PRECISIONS = ("fp32", "bf16", "fp16")
"""The precisions a run trains in (train.precision also accepts "auto" and null)."""

ATTN_IMPL_NAMES = ("auto", "reference", "matmul", "sdpa", "flex", "triton")
"""Names model.attn_impl accepts (txl_dist.model.attention.ATTN_IMPLS holds the implementations)."""


@dataclass
class ModelConfig:
    """Transformer-XL hyper-parameters (names follow Dai et al. 2019 and its reference code)."""

    vocab_size: int | None = None
    """Vocabulary size. null: taken from the prepared corpus' manifest (a mismatch there is an error)."""
    n_layer: int = 2
    """Number of Transformer-XL layers."""
    d_model: int = 128
    """Hidden size of the residual stream (even: the sinusoid position embeddings pair a sine and a cosine)."""
    n_head: int = 4
    """Number of attention heads."""
    d_head: int = 32
    """Size of one attention head (n_head * d_head need not equal d_model)."""
    d_inner: int = 512
    """Hidden size of the position-wise feed-forward network."""
    d_embed: int | None = None
    """Embedding size of the first (head) cluster; null: d_model."""
    div_val: int = 1
    """Adaptive input/softmax: each further cluster's embedding size is divided by div_val."""
    cutoffs: list[int] = field(default_factory=list)
    """Adaptive softmax cluster boundaries, strictly increasing, each below vocab_size; [] = plain softmax. They
    assume frequent tokens have low ids: start-up warns when the head (ids below cutoffs[0]) holds under half of
    a sample of the training tokens (data_prep numbers the tokenizers it trains by frequency; a SentencePiece
    model given to it keeps its own order, its control and byte pieces first)."""
    tie_weight: bool = True
    """Share the adaptive softmax output embeddings with the adaptive input embeddings."""
    tie_projs: list[bool] | None = None
    """Per cluster, share the softmax projection with the input projection; null: the reference default
    ([false] + [true] * len(cutoffs))."""
    pre_lnorm: bool = False
    """Layer norm before each sub-layer instead of after (post-LN is the paper's default)."""
    untie_r: bool = True
    """Each layer has its own u (r_w_bias) and v (r_r_bias); false: all layers share one pair."""
    tgt_len: int = 64
    """Training segment length (tokens predicted per stream per step; at most 2^20, as every length here)."""
    mem_len: int = 64
    """Training memory length: hidden states kept from previous segments (0 = no recurrence)."""
    clamp_len: int = -1
    """Relative distances beyond clamp_len use clamp_len's position embedding; <= 0 disables clamping."""
    same_length: bool = False
    """Every query attends to the same number of keys (the paper's evaluation trick)."""
    dropout: float = 0.1
    """Dropout on embeddings, residual branches and the feed-forward network."""
    dropatt: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization of weights."""
    proj_init_std: float = 0.01
    """Standard deviation of the normal initialization of the adaptive projections."""
    layer_norm_epsilon: float = 1e-5
    """Epsilon of every layer norm."""
    attn_impl: str = "auto"
    """Relative attention implementation: "auto" (measured once at start-up per device and dtype, see
    txl_dist/model/attention.py), or one of "matmul", "sdpa", "flex" (FlexAttention: no attention dropout,
    so only with dropatt 0; no backward on a CPU), "triton" (fused kernels of our own, with attention
    dropout; CUDA only, needs the triton package), "reference". Changes speed, not the math: it may change
    on resume."""
    pad_vocab_multiple: int = 1
    """Store the adaptive softmax's head rows (shortlist + one per cluster) and each tail's output and
    embedding rows padded to a multiple of this (8 or 64 suit tensor cores); the padding never enters a
    softmax, so the math is that of the unpadded model. 1: the paper's exact shapes. Part of the weights'
    shapes: it cannot change on resume (interop exports and imports the unpadded tensors)."""

    def memory(self) -> MemorySettings:
        """The training memory settings."""
        return MemorySettings(self.mem_len, self.clamp_len, self.same_length)

    def resolved_d_embed(self) -> int:
        return resolve_d_embed(self.d_embed, self.d_model)

    def resolved_tie_projs(self) -> list[bool]:
        return resolve_tie_projs(self.tie_projs, self.cutoffs)


def resolve_d_embed(d_embed: int | None, d_model: int) -> int:
    """What model.d_embed null means: d_model."""
    return d_model if d_embed is None else d_embed


def resolve_tie_projs(tie_projs: list[bool] | None, cutoffs: list[int]) -> list[bool]:
    """What model.tie_projs null means: the head's projection untied, every tail cluster's tied."""
    return [False] + [True] * len(cutoffs) if tie_projs is None else list(tie_projs)


@dataclass
class DataConfig:
    """Where the prepared corpus is and how the training streams are read."""

    path: str = "data/shakespeare"
    """Folder written by `python -m data_prep prepare` (holds manifest.json)."""
    train_split: str = "train"
    """Split used for training."""
    valid_split: str = "valid"
    """Split used for periodic evaluation."""
    test_split: str = "test"
    """Split used for the final evaluation."""
    roll: bool = False
    """Start each epoch at a seeded offset so segment boundaries differ between epochs (reproducibly)."""
    seed: int = 0
    """Seed of the per-epoch offsets when roll is on."""


@dataclass
class TrainConfig:
    """The training loop. Batch sizes and the optimizer live in the deepspeed section (one owner)."""

    max_steps: int = 100
    """Optimizer steps of the whole run; the LR schedule spans exactly these."""
    exit_step: int | None = None
    """Save a checkpoint and exit cleanly after this step (the schedule still spans max_steps)."""
    seed: int = 1234
    """Seed of weight initialization and dropout (0 .. 2**63-1)."""
    log_interval: int = 1
    """Print a progress line every this many steps; its loss and grad norm are the means over those steps (the
    training metrics go to MLflow every tracking.metrics_interval steps)."""
    max_nonfinite: int = 25
    """A step whose loss or gradient norm is not finite is skipped (no weight update) and the mems of the
    streams it poisoned are reset; this many such steps in a row stop the job (exit status 1) without
    saving over the last good checkpoint. fp16 counts its loss-scale overflows here too."""
    collective_timeout_s: float = 600.0
    """A rank that stops responding (hung, stopped, its node lost) ends the job within about this many
    seconds on every other rank, with one line naming it (a rank whose process ended: within three
    heartbeats, a sixth of this each, at most 10 s; a rank alive but stuck before a micro batch or
    evaluation segment that its neighbour has waited in this long: with its stack in its log); also the
    timeout of each training collective (DeepSpeed's ZeRO collectives included), plus two heartbeats (on
    NCCL plus 120 s at least)."""
    compile: bool = False
    """torch.compile each Transformer-XL layer for training (static shapes: one graph for the first segment,
    one for the steady state with full memory; evaluation stays eager); with activation checkpointing the
    layers are then recomputed by torch's non-reentrant checkpoint. Changes speed (and which dropout masks
    are drawn), not the model: it may change on resume."""
    precision: str | None = None
    """Training precision: "fp32", "bf16", "fp16", "auto" (decided at start-up on rank 0: bf16 on a CUDA
    device that supports it, else fp32; on a CPU bf16 only where the model's forward+backward at the run's
    shapes measures clearly faster than in fp32, see docs/performance.md), or null: what the deepspeed section's
    bf16/fp16 `enabled` say. Not null: leave deepspeed.bf16.enabled and deepspeed.fp16.enabled out (or
    agree with them; null counts as left out: the GPU presets set deepspeed.bf16.enabled true, so on their
    command line fp32 is `--set train.precision=fp32 --set deepspeed.bf16.enabled=false` (or =null), "auto"
    `--set train.precision=auto --set deepspeed.bf16.enabled=null`). "auto" is decided once per run and kept
    on resume (the checkpoint records it). An explicit "bf16" on a CPU where it measures slower than fp32
    trains as configured, with a warning."""
    peak_flops: float | None = None
    """Peak FLOP/s of ONE device for the MFU metric (train/mfu); null: the peak the checkpoint recorded when
    this job runs on the same kind of device, else the documented table entry for the device and precision,
    else a matmul peak measured at start-up; found once per run (docs/performance.md)."""
    profile_steps: list[int] | None = None
    """[first, last]: record optimizer steps first..last (inclusive) with torch.profiler on the ranks of
    train.profile_ranks. Each writes into <run.dir>/profile/steps_<f>-<last>/ (f: the first step this job
    records; a job resumed inside the window writes beside the stopped one) rank<r>.trace.json.gz (a Chrome
    trace, for Perfetto or chrome://tracing), rank<r>.ops.txt (operators by self CPU time, and on a GPU the
    kernels by device time) and rank<r>.summary.json (on a GPU: the device's busy share of the steps' wall time,
    the host's waits for it, launches per step, the busiest kernels); rank 0 logs its busiest kernels (GPU)
    or operators (CPU), and on a GPU the summary's line. Evaluations and saves inside the window are
    recorded too. Profiled steps run slower, with the same numbers: their train/step_time_s and tokens/s are
    logged with train/profiled = 1, and the progress line's rate leaves them out. null: off."""
    profile_ranks: list[int] | None = field(default_factory=lambda: [0])
    """The global ranks that record train.profile_steps; null: every rank (one trace per rank)."""
    profile_shapes: bool = False
    """Record each operator's input shapes in the profile's trace (torch.profiler's record_shapes: the "Input
    Dims" Perfetto shows). Off by default: it makes a host-bound step slower still under the profiler and its
    trace slower to write (docs/performance.md), and the operator table and summary do not use it."""


@dataclass
class EvalConfig:
    """Evaluation with long memory (its own lengths, as in the paper)."""

    interval: int = 0
    """Evaluate on the valid split every this many steps; 0 = only at the end."""
    tgt_len: int = 64
    """Evaluation segment length."""
    mem_len: int = 64
    """Evaluation memory length (the paper uses far longer memories at test time)."""
    clamp_len: int = -1
    """Evaluation clamp_len; <= 0 disables clamping."""
    same_length: bool = True
    """Evaluation same_length."""
    n_streams: int | None = None
    """Parallel evaluation streams. Results depend on n_streams (each stream starts with an empty memory), not
    on the world size, which must divide it. null: the count the run evaluated at its first start, one stream
    per rank, kept by its resumes on other world sizes (recorded in each checkpoint's run.json); a resume on a
    world size that cannot split it warns and evaluates one stream per rank from then on; launch/eval.py
    evaluates the count its checkpoint recorded (refused on a world size that cannot split it)."""
    micro_batch: int | None = None
    """At most this many streams per forward pass on a rank. A rank evaluates its streams in equal groups, the
    largest not above this, each group through the whole split before the next: its memory holds one group's
    mems and activations, however many streams it evaluates (launch/eval.py on fewer GPUs than the run trained
    on). The numbers do not depend on it, up to rounding. null: the training micro batch
    (deepspeed.train_micro_batch_size_per_gpu)."""
    max_segments: int | None = None
    """Stop each evaluation after this many segments per stream (null: the whole split)."""
    at_end: bool = True
    """Evaluate on the test split when training ends."""

    def memory(self) -> MemorySettings:
        """The evaluation's memory settings."""
        return MemorySettings(self.mem_len, self.clamp_len, self.same_length)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints in <run.dir>/checkpoints: DeepSpeed's files plus one state file per rank."""

    interval: int = 0
    """Save every this many steps; 0 = only at the end (and on SIGTERM/SIGUSR1 or exit_step)."""
    keep: int = 3
    """Keep the newest this many complete tags (0 = keep all). Tags newer than the one a job resumed from
    are never removed by that job."""
    fallback: bool = False
    """--resume auto: when the newest complete tag is damaged (a file missing or failing its checksum),
    resume from the newest older tag that verifies instead of stopping (the damaged tag is kept)."""
    timeout_s: float = 3600.0
    """How long ranks wait for each other while a checkpoint is saved, verified, loaded or converted, and
    during start-up (slow file systems); a lost rank is still detected within train.collective_timeout_s,
    and a rank alive but stuck in a save or in start-up (a write or read that never returns) is named, with its
    stack in its log, once the others have waited this long."""


@dataclass
class TrackingConfig:
    """MLflow, on rank 0 only."""

    enabled: bool = True
    """Log to MLflow."""
    uri: str | None = None
    """Tracking URI; null: MLFLOW_TRACKING_URI, else a local sqlite store in the run folder. A password or
    token in it is never logged or written to the run folder (it is shown as ***)."""
    experiment: str | None = None
    """Experiment name; null: MLFLOW_EXPERIMENT_NAME, else 'txl-dist'."""
    run_name: str | None = None
    """Run name shown in the MLflow UI; null: MLflow picks one."""
    system_metrics: bool = True
    """Log CPU/GPU/memory system metrics alongside the run."""
    metrics_interval: int = 1
    """Log the training metrics (train/*) at the steps that are multiples of this, and at train.max_steps; each
    value covers the steps since the previous one: the mean of train/loss, grad_norm and step_time_s, the rate
    over those steps' time of tokens_per_s, model_flops_per_s and mfu, the peak of train/memory_*, the step's
    own lr, tokens_seen and nonfinite_steps (txl_dist/tracking/thinning.py). Evaluation, system metrics and the
    final results are not thinned. Checkpoints keep the steps since the last logged one, so a resumed run logs
    what an uninterrupted run logs; a relaunch may change the value (the kept steps are logged at the first step
    due under the new one); a job that diverges logs its last steps at the step it fails. 1: every step. Keep a
    run's logged steps around 10^5 or fewer: at 10^6 steps, 100 makes the local store 28.7 MB instead of 2.8 GB
    and the MLflow UI's chart of a metric 46 ms instead of 2.4 s (docs/reliability.md, "MLflow")."""


@dataclass
class RunConfig:
    run: RunDirConfig = field(default_factory=RunDirConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Handed to deepspeed.initialize once the values the rules below fill in are there: gradient_accumulation_steps
    derived, bf16/fp16 `enabled` set by train.precision when it names one, and where the section leaves them out
    `data_types.grad_accum_dtype` fp32 (bf16/fp16 at ZeRO 2-3), `scheduler.params.total_num_steps`,
    `timers.throughput` off; `zero_optimization.overlap_comm` off on one rank, `checkpoint.load_universal` on an
    elastic resume."""

    # Derived values are methods, not stored fields: they cannot go stale.
    def n_streams(self) -> int:
        """S: the global batch in sequences is the number of parallel token streams."""
        return int(self.deepspeed["train_batch_size"])

    def micro_batch(self) -> int:
        return int(self.deepspeed["train_micro_batch_size_per_gpu"])

    def gradient_accumulation_steps(self, world_size: int) -> int:
        return check_batch_layout(self.n_streams(), self.micro_batch(), world_size)

    def eval_streams(self, world_size: int, recorded: int | None = None, *, resize: bool = False) -> int:
        """E, the evaluation streams on world_size ranks: eval.n_streams when set; else `recorded`, the count the
        run has evaluated so far (`recorded_eval_streams` of its checkpoint), so that its numbers keep one
        definition across elastic resumes and launch/eval.py gives the ones it logged; else (a new run) the
        world size, one stream per rank.

        A count world_size cannot split is a ConfigError; with resize (training), a recorded count it cannot
        split gives world_size instead: a resume on more ranks is not refused, and the caller warns that the
        numbers change definition there."""
        if self.eval.n_streams is None and recorded is not None:
            if recorded % world_size == 0:
                return recorded
            if resize:
                return world_size
            raise ConfigError(f"eval.n_streams is null: the evaluation uses the {recorded} stream(s) the checkpoint's "
                              f"run evaluated, which {world_size} ranks cannot split; pass --set eval.n_streams=N, N a "
                              f"multiple of {world_size} (the numbers depend on N), or evaluate on a world size that "
                              f"divides {recorded}")
        n = world_size if self.eval.n_streams is None else self.eval.n_streams
        streams_per_rank(n, world_size, streams="eval.n_streams", error=ConfigError,
                         fix=f"use a multiple of {world_size} (or a world size that divides {n})")
        return n

    def eval_micro_batch(self) -> int:
        """The most streams an evaluation runs through the model at once on a rank (eval.micro_batch, else the
        training micro batch): the Evaluator's bound."""
        return self.micro_batch() if self.eval.micro_batch is None else self.eval.micro_batch

    def kept_eval_streams(self, recorded: int) -> int:
        """The evaluation streams this configuration asks of a run that has evaluated `recorded` so far: the count
        eval.n_streams names, else (null) the recorded one. A resume's changed-settings check compares it with
        the record, so null and the recorded count named are one setting (eval_streams gives it on any world
        size that splits it)."""
        return recorded if self.eval.n_streams is None else self.eval.n_streams

    def checkpoint_dir(self) -> Path:
        """<run.dir>/checkpoints: the tags and `latest`."""
        return self.run.checkpoint_dir()

    def precision(self) -> str | None:
        """"fp32", "bf16" or "fp16": what this run trains in; None while train.precision is "auto" (start-up
        decides it: txl_dist/runtime_choices.py)."""
        return precision_of(self.train.precision, self.deepspeed)

    def deepspeed_config(self, world_size: int) -> dict[str, Any]:
        """The deepspeed section with the values that follow from the world size (and train.precision, when
        it names one) filled in."""
        ds = copy.deepcopy(self.deepspeed)
        ds["gradient_accumulation_steps"] = self.gradient_accumulation_steps(world_size)
        if self.train.precision in PRECISIONS:
            for section in ("bf16", "fp16"):
                ds.setdefault(section, {})["enabled"] = self.train.precision == section
        return ds

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public_dict(self) -> dict[str, Any]:
        """to_dict() with secrets masked: what is logged, written to the run folder and to checkpoints."""
        d = self.to_dict()
        if d["tracking"]["uri"]:
            d["tracking"]["uri"] = redact_uri(d["tracking"]["uri"])
        return d

    def digest(self) -> str:
        """sha256 of what decides the numbers of a run (not where its files or metrics go)."""
        d = self.to_dict()
        for section in VOLATILE_SECTIONS:
            d.pop(section)
        for key in VOLATILE_KEYS:
            section, name = key.split(".")
            d[section].pop(name)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


# What may differ between a run and the job that resumes it without changing its numbers: where files and
# metrics go, how often progress is printed, where it stops this time, how long ranks wait for each other.
VOLATILE_SECTIONS = ("run", "checkpoint", "tracking")
VOLATILE_KEYS = ("train.exit_step", "train.log_interval", "train.collective_timeout_s", "train.max_nonfinite",
                 "train.compile", "train.peak_flops", "train.profile_steps", "train.profile_ranks",
                 "train.profile_shapes", "model.attn_impl", "eval.micro_batch")


def precision_of(train_precision: str | None, deepspeed: dict[str, Any]) -> str | None:
    """The precision named by train.precision, else by the deepspeed section; None for "auto". Works on the
    raw dicts of a saved config too (a checkpoint's run.json)."""
    if train_precision in PRECISIONS:
        return train_precision
    if train_precision == "auto":
        return None
    for section in ("bf16", "fp16"):
        if deepspeed.get(section, {}).get("enabled"):
            return section
    return "fp32"


def changed_settings(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Dotted keys whose value differs between two config dicts, leaving out the volatile ones.

    A key the saved dict lacks (written before the key existed) counts as that key's default, which is what
    the run that saved it used; a key the current dict lacks counts as its default too (None in the free-form
    deepspeed section: left out, so changed).
    """
    changed = []
    for section in set(saved) | set(now):
        values_now, values_saved = now.get(section, {}), saved.get(section, {})
        if section in VOLATILE_SECTIONS or not isinstance(values_now, dict) or not isinstance(values_saved, dict):
            continue
        # Both sides' keys: a key left out now (e.g. deepspeed.gradient_clipping) changes the run as well.
        for key in set(values_saved) | set(values_now):
            dotted = f"{section}.{key}"
            was = values_saved[key] if key in values_saved else default_value(section, key)
            value = values_now[key] if key in values_now else default_value(section, key)
            if dotted not in VOLATILE_KEYS and was != value:
                changed.append(dotted)
    return sorted(changed)


def default_value(section: str, key: str) -> Any:
    """The default of config key section.key (None when the section or key is unknown)."""
    section_type = SECTIONS.get(section)
    for f in fields(section_type) if section_type else ():
        if f.name == key:
            if f.default_factory is not MISSING:
                return f.default_factory()
            return None if f.default is MISSING else f.default
    return None


_SECRET_QUERY_KEYS = ("token", "password", "passwd", "secret", "key", "auth", "signature", "credential")


def redact_uri(uri: str) -> str:
    """A URI with its password and any secret-looking query values replaced by ***; unchanged when it holds
    none (rebuilding it would normalise it: sqlite:////abs/db must stay as it is)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "***"
    netloc, changed = parts.netloc, False
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc, changed = (f"{user}:***@{host}" if ":" in userinfo else f"***@{host}"), True
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        masked = [(k, "***" if any(s in k.lower() for s in _SECRET_QUERY_KEYS) else v) for k, v in pairs]
        if masked != pairs:
            query, changed = urlencode(masked, safe="*"), True
    if not changed:
        return uri
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


SECTIONS: dict[str, type] = {
    "run": RunDirConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "tracking": TrackingConfig,
}


def check_batch_layout(n_streams: int, micro_batch: int, world_size: int) -> int:
    """Gradient accumulation steps g with micro_batch * g * world_size == n_streams, or a ConfigError."""
    return micro_steps_per_rank(n_streams, micro_batch, world_size, streams="deepspeed.train_batch_size",
                                micro="deepspeed.train_micro_batch_size_per_gpu", error=ConfigError)


# ----------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a JSON config, apply `section.key=value` overrides, validate, return typed sections."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_json_object(path, label=f"config file {path}", object_hint=" of sections")
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


def read_json_object(path: str | Path, *, error: type[Exception] = ConfigError, label: str | None = None,
                     missing_hint: str = "", object_hint: str = "") -> dict[str, Any]:
    """A JSON file whose top level is an object, or `error` with one line naming the file (as `label`)."""
    label = str(path) if label is None else label
    if not str(path).strip():
        raise error(f"{label.rstrip()}: an empty path names no file")
    duplicates: list[tuple[str, dict]] = []

    def refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj and not duplicates:
                duplicates.append((key, obj))
            obj[key] = value
        return obj

    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError
        if not stat.S_ISREG(mode):
            # /dev/zero would be read without end, a FIFO with no writer would block: refuse, as data_prep does
            raise error(f"{label} is {_file_kind(mode)}, not a regular file; write the JSON to a file and pass "
                        "that") from None
        raw = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=refuse_duplicates)
    except FileNotFoundError:
        raise error(f"{label} does not exist{where_relative(path)}{missing_hint}") from None
    except IsADirectoryError:
        raise error(f"{label} is a folder, not a JSON file") from None
    except UnicodeDecodeError as e:
        raise error(f"{label}: not UTF-8 text (byte {e.start}); a JSON file is text") from None
    except OSError as e:
        raise error(f"{label}: cannot read it ({e.strerror or type(e).__name__})") from None
    except json.JSONDecodeError as e:
        raise error(f"{label}: invalid JSON at line {e.lineno} col {e.colno}: {e.msg}") from None
    if duplicates:
        key, obj = duplicates[0]
        keys = [*(_path_to(raw, obj) or []), key]
        dotted = "".join(k if k.startswith("[") else f".{k}" for k in keys).removeprefix(".")
        # Python's json keeps the last value silently: `"max_steps": 600, "max_steps": 2` would train 2 steps.
        raise error(f"{label}: key '{dotted}' appears more than once (JSON would keep the last silently); "
                    "keep one")
    if not isinstance(raw, dict):
        raise error(f"{label}: the top level must be a JSON object{object_hint}")
    return raw


def _file_kind(mode: int) -> str:
    for is_kind, what in ((stat.S_ISFIFO, "a pipe or FIFO"), (stat.S_ISCHR, "a character device"),
                          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if is_kind(mode):
            return what
    return "something other than a file"


def _path_to(node: Any, target: dict, at: list[str] | None = None) -> list[str] | None:
    """The keys (list items as [i]) from `node` down to the object `target` (by identity)."""
    at = [] if at is None else at
    if node is target:
        return at
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        found = _path_to(child, target, at + [key if isinstance(node, dict) else f"[{key}]"])
        if found is not None:
            return found
    return None


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    known = list(SECTIONS) + ["deepspeed"]
    for key in raw:
        if key not in known:
            raise ConfigError(f"unknown section '{key}'{_suggest(key, known)}; sections are {', '.join(known)}")
    sections = {name: _build(cls, raw.get(name, {}), name) for name, cls in SECTIONS.items()}
    deepspeed = raw.get("deepspeed", {})
    if not isinstance(deepspeed, dict):
        raise ConfigError("deepspeed: must be a JSON object (DeepSpeed's own config)")
    _check_numbers(deepspeed, "deepspeed")
    deepspeed = copy.deepcopy(deepspeed)
    for section in ("bf16", "fp16"):
        # null: as if left out (train.precision decides). The one way to take a preset's key out with --set.
        if isinstance(deepspeed.get(section), dict) and "enabled" in deepspeed[section] \
                and deepspeed[section]["enabled"] is None:
            del deepspeed[section]["enabled"]
    cfg = RunConfig(deepspeed=deepspeed, **sections)
    validate(cfg)
    return cfg


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """A type-checked, validated ModelConfig from the JSON object of a `model` section."""
    cfg = _build(ModelConfig, raw, "model")
    validate_model(cfg)
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `section.key[.subkey]=value` override; value is JSON when it parses, else a string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or "." not in key:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.max_steps=20")
    parts = key.split(".")
    section = parts[0]
    if section not in SECTIONS and section != "deepspeed":
        known = list(SECTIONS) + ["deepspeed"]
        raise ConfigError(f"--set {key}: unknown section '{section}'{_suggest(section, known)}")
    text = text.strip()  # as the key is: "data.path= /x" means /x, not a folder named " /x"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    node = raw
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: '{p}' is not a section but a value")
        node = child
    if section in SECTIONS and len(parts) == 2:
        ftype = _field_types(SECTIONS[section]).get(parts[1])
        if ftype is not None:
            value = _coerce_text(value, text, ftype)
    node[parts[-1]] = value


def _coerce_text(value: Any, text: str, ftype: Any) -> Any:
    """`--set data.path=123` means the string '123' for a string field."""
    if _accepts(ftype, str) and not isinstance(value, str) and value is not None:
        return text  # null stays null: a field that takes no null refuses it, as in a config file
    return value


def _accepts(ftype: Any, t: type) -> bool:
    args = typing.get_args(ftype) if _is_union(ftype) else (ftype,)
    return t in args


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) in (typing.Union, types.UnionType)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, raw: Any, section: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: must be a JSON object, got {type(raw).__name__}")
    types_ = _field_types(cls)
    for key in raw:
        if key not in types_:
            raise ConfigError(f"unknown key '{section}.{key}'{_suggest(key, list(types_))}")
    values = {k: _check_type(v, types_[k], f"{section}.{k}") for k, v in raw.items()}
    return cls(**values)


def _check_type(value: Any, ftype: Any, key: str) -> Any:
    ok, converted = _convert(value, ftype)
    if not ok:
        _check_numbers(value, key)  # the more precise line, when that is what is wrong
        raise ConfigError(f"{key}: expected {_type_name(ftype)}, got {json.dumps(value)}")
    return converted


def _fits_int64(value: int) -> bool:
    return -2**63 <= value < 2**63


def _check_numbers(value: Any, key: str) -> None:
    """Refuse NaN, infinities (Python's JSON reads NaN and Infinity) and integers beyond 64 bits anywhere
    in `value`: no setting means them, and they fail deep inside torch or DeepSpeed, not here."""
    if isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {json.dumps(value)} is not a finite number")
    if isinstance(value, int) and not _fits_int64(value):
        raise ConfigError(f"{key}: {value} does not fit in a 64-bit integer")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_numbers(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_numbers(v, f"{key}[{i}]")


def _convert(value: Any, ftype: Any) -> tuple[bool, Any]:
    if _is_union(ftype):
        for arm in typing.get_args(ftype):
            ok, v = _convert(value, arm)
            if ok:
                return True, v
        return False, None
    origin = typing.get_origin(ftype)
    if ftype is type(None):
        return value is None, None
    if ftype is bool:
        return isinstance(value, bool), value
    if ftype is int:
        return isinstance(value, int) and not isinstance(value, bool) and _fits_int64(value), value
    if ftype is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else None
    if ftype is str:
        return isinstance(value, str), value
    if origin is list:
        (item,) = typing.get_args(ftype)
        if not isinstance(value, list):
            return False, None
        out = []
        for v in value:
            ok, c = _convert(v, item)
            if not ok:
                return False, None
            out.append(c)
        return True, out
    if origin is Literal:
        return value in typing.get_args(ftype), value
    if origin is dict or ftype is dict:
        return isinstance(value, dict), value
    raise TypeError(f"config field type {ftype} not supported")


def _type_name(ftype: Any) -> str:
    if _is_union(ftype):
        return " or ".join(_type_name(a) for a in typing.get_args(ftype))
    if ftype is type(None):
        return "null"
    if typing.get_origin(ftype) is list:
        item = typing.get_args(ftype)[0]
        plural = {int: "integers", float: "numbers", bool: "true/false values", str: "strings"}
        return f"a list of {plural.get(item, _type_name(item))}"
    if typing.get_origin(ftype) is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(ftype))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(ftype, str(ftype))


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ----------------------------------------------------------------------------------------------------
# Validation: consistency between values, before any work starts.


def validate(cfg: RunConfig) -> None:
    if not cfg.run.dir.strip():
        raise ConfigError("run.dir: must name a folder (e.g. runs/my-run)")
    if not cfg.data.path.strip():  # "" resolves to the working folder: start-up named run.dir as lying in it
        raise ConfigError("data.path: must name a corpus folder (the one `python -m data_prep prepare --out DIR` "
                          "wrote, holding manifest.json)")
    if cfg.tracking.experiment is not None and not cfg.tracking.experiment.strip():
        raise ConfigError("tracking.experiment: must name an experiment, or be null (MLFLOW_EXPERIMENT_NAME, else "
                          f"'txl-dist'), got {json.dumps(cfg.tracking.experiment)}")
    validate_model(cfg.model)
    t, e, c, d = cfg.train, cfg.eval, cfg.checkpoint, cfg.data
    _positive("train.max_steps", t.max_steps)
    _positive("train.log_interval", t.log_interval)
    _positive("tracking.metrics_interval", cfg.tracking.metrics_interval)
    _positive("train.max_nonfinite", t.max_nonfinite)
    for key, seconds in (("train.collective_timeout_s", t.collective_timeout_s), ("checkpoint.timeout_s", c.timeout_s)):
        _positive(key, seconds)
        if seconds > MAX_TIMEOUT_S:
            raise ConfigError(f"{key}: {seconds:g} s is more than {MAX_TIMEOUT_S} s (30 days), the longest wait "
                              "this code sets")
    for key, seed in (("train.seed", t.seed), ("data.seed", d.seed)):
        if not 0 <= seed <= MAX_SEED:
            raise ConfigError(f"{key}: {seed} must be in 0..{MAX_SEED}")
    if t.exit_step is not None and not 0 < t.exit_step <= t.max_steps:
        raise ConfigError(f"train.exit_step: {t.exit_step} must be in 1..train.max_steps ({t.max_steps}) or null")
    _positive("eval.tgt_len", e.tgt_len)
    _non_negative("eval.mem_len", e.mem_len)
    for key, length in (("eval.tgt_len", e.tgt_len), ("eval.mem_len", e.mem_len)):
        _at_most_max_length(key, length)
    _non_negative("eval.interval", e.interval)
    if e.n_streams is not None:
        _positive("eval.n_streams", e.n_streams)
    if e.max_segments is not None:
        _positive("eval.max_segments", e.max_segments)
    if e.micro_batch is not None:
        _positive("eval.micro_batch", e.micro_batch)
    check_same_length("eval", e.same_length, e.mem_len)
    _non_negative("checkpoint.interval", c.interval)
    _non_negative("checkpoint.keep", c.keep)
    validate_deepspeed(cfg.deepspeed, cfg.train.max_steps)
    check_precision(t.precision, cfg.deepspeed)
    if t.peak_flops is not None:
        _positive("train.peak_flops", t.peak_flops)
    check_profile_window(t.profile_steps, t.profile_ranks, t.max_steps)


def check_profile_window(steps: list[int] | None, ranks: list[int] | None, max_steps: int) -> None:
    """train.profile_steps is [first, last] within the run's steps; train.profile_ranks names ranks."""
    if steps is not None and not (len(steps) == 2 and 1 <= steps[0] <= steps[1] <= max_steps):
        raise ConfigError(f"train.profile_steps: {json.dumps(steps)} must be [first, last] with 1 <= first <= last "
                          f"<= train.max_steps ({max_steps}), e.g. [10, 12]; or null (no profiling)")
    if ranks is not None and (not ranks or min(ranks) < 0):
        raise ConfigError(f"train.profile_ranks: {json.dumps(ranks)} must name ranks (>= 0), e.g. [0], or be null "
                          "(every rank)")


def check_precision(precision: str | None, deepspeed: dict[str, Any]) -> None:
    """train.precision against the deepspeed section's bf16/fp16 `enabled`: one owner of the precision."""
    if precision is None:
        return
    if precision != "auto" and precision not in PRECISIONS:
        raise ConfigError(f"train.precision: {precision!r} is unknown; use \"auto\", "
                          f"{', '.join(repr(p) for p in PRECISIONS)} or null")
    for section in ("bf16", "fp16"):
        enabled = deepspeed.get(section, {}).get("enabled")
        if enabled is None:
            continue
        if precision == "auto":
            raise ConfigError(
                f"train.precision: {json.dumps(precision)} conflicts with deepspeed.{section}.enabled "
                f"{json.dumps(enabled)}; leave deepspeed.{section}.enabled out or null (--set "
                f"deepspeed.{section}.enabled=null: train.precision decides) or set train.precision to null")
        if enabled != (precision == section):
            # The GPU presets name deepspeed.bf16.enabled: a key --set cannot take out, but can make agree.
            agree = json.dumps(precision == section)
            raise ConfigError(
                f"train.precision: {json.dumps(precision)} conflicts with deepspeed.{section}.enabled "
                f"{json.dumps(enabled)}; set deepspeed.{section}.enabled {agree} as well (--set "
                f"deepspeed.{section}.enabled={agree}), leave it out (train.precision decides) or set "
                "train.precision to null")


def validate_model(m: ModelConfig) -> None:
    for key in ("n_layer", "d_model", "n_head", "d_head", "d_inner", "div_val", "tgt_len", "pad_vocab_multiple"):
        _positive(f"model.{key}", getattr(m, key))
    if m.n_layer > MAX_LAYERS:
        raise ConfigError(f"model.n_layer: {m.n_layer} is more than {MAX_LAYERS}, the most layers this code builds")
    for key in ("d_model", "n_head", "d_head", "d_inner", "d_embed", "pad_vocab_multiple"):
        value = getattr(m, key)
        if value is not None and value > MAX_WIDTH:
            raise ConfigError(f"model.{key}: {value} is beyond {MAX_WIDTH}, the largest this code builds (one fp32 "
                              f"[{MAX_WIDTH}, {MAX_WIDTH}] weight is already 4 TiB)")
    if m.n_head * m.d_head > MAX_WIDTH:
        raise ConfigError(f"model.n_head x model.d_head: {m.n_head * m.d_head} is beyond {MAX_WIDTH}, the largest "
                          "width this code builds")
    if m.d_model % 2:
        raise ConfigError(f"model.d_model: {m.d_model} must be even (the sinusoid position embeddings pair a sine "
                          "and a cosine per frequency)")
    _non_negative("model.mem_len", m.mem_len)
    for key in ("tgt_len", "mem_len"):
        _at_most_max_length(f"model.{key}", getattr(m, key))
    if m.d_embed is not None:
        _positive("model.d_embed", m.d_embed)
    for key in ("dropout", "dropatt"):
        p = getattr(m, key)
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"model.{key}: {p} must be in [0, 1)")
    for key in ("init_std", "proj_init_std", "layer_norm_epsilon"):
        _positive(f"model.{key}", getattr(m, key))
    if m.vocab_size is not None:
        _positive("model.vocab_size", m.vocab_size)
    check_cutoffs(m.cutoffs, m.vocab_size)
    check_same_length("model", m.same_length, m.mem_len)
    if m.attn_impl not in ATTN_IMPL_NAMES:
        raise ConfigError(f"model.attn_impl: {m.attn_impl!r} is unknown; use one of {', '.join(ATTN_IMPL_NAMES)}")
    if m.attn_impl == "flex" and m.dropatt > 0:
        raise ConfigError(f"model.attn_impl: 'flex' has no attention dropout, so it cannot train with model.dropatt "
                          f"{m.dropatt}; set model.dropatt 0 or model.attn_impl 'auto' (no flex with dropatt)")
    if m.tie_projs is not None and len(m.tie_projs) != len(m.cutoffs) + 1:
        raise ConfigError(
            f"model.tie_projs: needs one entry per cluster ({len(m.cutoffs) + 1} for cutoffs {m.cutoffs}), "
            f"got {len(m.tie_projs)}")
    if m.div_val > 1:
        d_embed = m.resolved_d_embed()
        smallest = d_embed // m.div_val ** len(m.cutoffs)
        if smallest < 1:
            raise ConfigError(
                f"model.div_val: {m.div_val} shrinks the last cluster's embedding below 1 "
                f"(d_embed {d_embed}, {len(m.cutoffs)} cutoffs); lower div_val or raise d_embed")


def check_same_length(section: str, same_length: bool, mem_len: int) -> None:
    """same_length gives every query the same number of keys by masking into the memory: it needs one."""
    if same_length and mem_len == 0:
        raise ConfigError(f"{section}.same_length: needs {section}.mem_len > 0 (with no memory the first query "
                          f"would see no key); set {section}.same_length=false or a memory length")


def check_cutoffs(cutoffs: list[int], vocab_size: int | None) -> None:
    prev = 0
    for c in cutoffs:
        if c <= prev:
            raise ConfigError(f"model.cutoffs: {cutoffs} must be strictly increasing and positive")
        prev = c
    if vocab_size is not None and cutoffs and cutoffs[-1] >= vocab_size:
        raise ConfigError(
            f"model.cutoffs: every cutoff must be below vocab_size {vocab_size}, got {cutoffs}")


def validate_deepspeed(ds: dict[str, Any], max_steps: int) -> None:
    """The rules this project adds to DeepSpeed's own (deepspeed_schema.check_deepspeed_config checks the keys)."""
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        v = ds.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"deepspeed.{key}: must be a positive integer, got {json.dumps(v)}")
    if "gradient_accumulation_steps" in ds:
        raise ConfigError(
            "deepspeed.gradient_accumulation_steps: do not set it; it follows from train_batch_size / "
            "(train_micro_batch_size_per_gpu * world size), so one config runs on any world size")
    for alias, name in (("bfloat16", "bf16"), ("amp", "bf16 or fp16")):
        if alias in ds:
            raise ConfigError(f"deepspeed.{alias}: not supported here; use deepspeed.{name} (the precision this "
                              "project reads to choose the dtype of the model and its mems)")
    for key in ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "activation_checkpointing",
                "checkpoint", "timers", "data_types"):
        if key in ds and not isinstance(ds[key], dict):
            raise ConfigError(f"deepspeed.{key}: must be a JSON object, got {json.dumps(ds[key])}")
    if "optimizer" in ds and not isinstance(ds["optimizer"].get("type"), str):
        # DeepSpeed reads no params without a type: the unread-key check would blame params instead.
        raise ConfigError(f"deepspeed.optimizer.type: must name an optimizer, e.g. \"AdamW\", got "
                          f"{json.dumps(ds['optimizer'].get('type'))}")
    if "optimizer" in ds and not isinstance(ds["optimizer"].get("params", {}), dict):
        # Here, not only in deepspeed_schema: DeepSpeed's own reading of the section fails on it first, with
        # a line that names neither the key nor what is wrong ("'int' object has no attribute 'keys'").
        raise ConfigError(f"deepspeed.optimizer.params: must be a JSON object, got "
                          f"{json.dumps(ds['optimizer']['params'])}")
    s, m = ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]
    if s % m:
        raise ConfigError(
            f"deepspeed.train_micro_batch_size_per_gpu: {m} does not divide train_batch_size {s}")
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):  # 1.0 == 1: not a stage
        raise ConfigError(f"deepspeed.zero_optimization.stage: must be 0, 1, 2 or 3, got {json.dumps(stage)}")
    # DeepSpeed ignores an offload its stage does not do, silently: the run would not offload as asked.
    for offload, lowest in (("offload_optimizer", 1), ("offload_param", 3)):
        target = zero.get(offload)
        device = target.get("device", "none") if isinstance(target, dict) else "none"
        if device not in (None, "none") and stage < lowest:
            raise ConfigError(f"deepspeed.zero_optimization.{offload}: needs zero_optimization.stage "
                              f"{'1, 2 or 3' if lowest == 1 else '3'} (DeepSpeed ignores it at stage {stage})")
        if device == "nvme" and not target.get("nvme_path"):
            raise ConfigError(f"deepspeed.zero_optimization.{offload}: device \"nvme\" needs nvme_path, a folder "
                              "on the NVMe drive")
    for section in ("bf16", "fp16"):
        enabled = ds.get(section, {}).get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"deepspeed.{section}.enabled: must be true or false, got {json.dumps(enabled)}")
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        raise ConfigError("deepspeed.bf16.enabled and deepspeed.fp16.enabled: enable at most one")
    # The non-finite guard (train.max_nonfinite) relies on DeepSpeed skipping a step whose gradient norm
    # is not finite; these two switches turn that check off.
    if ds.get("bf16", {}).get("check_grad_overflow") is False:
        raise ConfigError("deepspeed.bf16.check_grad_overflow: must stay true; a step with a non-finite gradient "
                          "would reach the weights (train.max_nonfinite needs the check)")
    if zero.get("compute_grad_norm") is False:
        raise ConfigError("deepspeed.zero_optimization.compute_grad_norm: must stay true; without the norm a "
                          "non-finite gradient would reach the weights (train.max_nonfinite needs it)")
    every = ds.get("steps_per_print")
    if _is_number(every) and every < 1:
        raise ConfigError(f"deepspeed.steps_per_print: must be >= 1, got {every} (DeepSpeed logs every that many "
                          "steps)")
    clipping = ds.get("gradient_clipping")
    if _is_number(clipping) and clipping < 0:  # DeepSpeed clips only when > 0: a negative value is "off", unsaid
        raise ConfigError(f"deepspeed.gradient_clipping: must be >= 0, got {clipping} (the largest gradient norm; 0 "
                          "turns clipping off, as DeepSpeed does for any value <= 0)")
    factor = ds.get("gradient_predivide_factor")
    if _is_number(factor) and factor <= 0:
        raise ConfigError(f"deepspeed.gradient_predivide_factor: must be > 0, got {factor} (DeepSpeed divides the "
                          "gradients by it)")
    for monitor, module in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet_ml")):
        section = ds.get(monitor)
        if isinstance(section, dict) and section.get("enabled") and importlib.util.find_spec(module) is None:
            raise ConfigError(f"deepspeed.{monitor}.enabled: DeepSpeed's {monitor} monitor needs the {module} "
                              "package, which is not installed (the run's metrics go to MLflow: tracking.*)")
    sched = ds.get("scheduler")
    if sched is not None:
        params = sched.get("params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"deepspeed.scheduler.params: must be a JSON object, got {json.dumps(params)}")
        for key, value in params.items():
            check_scheduler_number(key, value)
        for key, value in params.items():  # DeepSpeed's schedules check none of these: a negative lr trains
            if ("lr" in key or "ratio" in key) and _is_number(value) and value < 0:
                raise ConfigError(f"deepspeed.scheduler.params.{key}: must be >= 0, got {value} (a learning rate "
                                  "or a ratio of one)")
            if key.endswith("_ratio") and _is_number(value) and value > 1:  # WarmupCosineLR's: of the peak lr
                raise ConfigError(f"deepspeed.scheduler.params.{key}: must be <= 1, got {value} (a share of the "
                                  "optimizer's lr, the schedule's peak: above 1 the schedule would go past it)")
        warmup_type = params.get("warmup_type", "log")
        if warmup_type not in ("log", "linear"):
            raise ConfigError(f"deepspeed.scheduler.params.warmup_type: must be \"log\" or \"linear\", got "
                              f"{json.dumps(warmup_type)} (DeepSpeed falls back to log with a warning)")
        total = params.get("total_num_steps")
        if total is not None and total != max_steps:
            raise ConfigError(
                f"deepspeed.scheduler.params.total_num_steps: {json.dumps(total)} differs from train.max_steps "
                f"{max_steps}; "
                "leave it out and it follows train.max_steps")


SCHEDULER_NUMBERS = frozenset({
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps", "warmup_min_ratio", "cos_min_ratio",
    "last_batch_iteration", "lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
    "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
    "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_min_mom", "cycle_max_mom",
    "decay_mom_rate"})
"""The arguments of DeepSpeed's LR schedules (deepspeed/runtime/lr_schedules.py) that they compute with. Another
value (a string, null, a list) passes the scheduler's construction, which the start-up check builds, and fails
with a TypeError inside a training step when the schedule first reaches it: cos_min_ratio after the warmup
(configs/large.json: at step 16,001)."""
SCHEDULER_PER_GROUP = frozenset({"warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
                                 "cycle_max_mom", "lr_range_test_min_lr"})
"""Of those, the ones that also take a list: one value per optimizer param group."""
SCHEDULER_NULLABLE = frozenset({"warmup_max_lr", "cycle_second_step_size", "cycle_second_stair_count"})
"""Of those, the ones whose null means something (warmup_max_lr: the optimizer's lr; the other two: the first
step size, the first stair count)."""


def check_scheduler_number(key: str, value: Any) -> None:
    """deepspeed.scheduler.params.<key> is a number where DeepSpeed's schedules compute with one."""
    if key not in SCHEDULER_NUMBERS or _is_number(value) or (value is None and key in SCHEDULER_NULLABLE):
        return
    if key in SCHEDULER_PER_GROUP and isinstance(value, list) and value and all(_is_number(v) for v in value):
        return
    wanted = "a number" + (" or a list of numbers (one per param group)" if key in SCHEDULER_PER_GROUP else "") + (
        " or null" if key in SCHEDULER_NULLABLE else "")
    raise ConfigError(f"deepspeed.scheduler.params.{key}: must be {wanted}, got {json.dumps(value)} (DeepSpeed's "
                      "schedule would fail on it in the middle of training, when it first computes with it)")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(key: str, v: float) -> None:
    if v <= 0:
        raise ConfigError(f"{key}: must be > 0, got {v}")


def _non_negative(key: str, v: float) -> None:
    if v < 0:
        raise ConfigError(f"{key}: must be >= 0, got {v}")


def _at_most_max_length(key: str, tokens: int) -> None:
    if tokens > MAX_LENGTH:
        raise ConfigError(f"{key}: {tokens} tokens is beyond {MAX_LENGTH}, the longest this code builds (a "
                          f"[{MAX_LENGTH}, {MAX_LENGTH}] attention score tensor is already 4 TiB in fp32)")
