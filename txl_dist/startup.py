"""One start-up path for training, evaluation and export: every check before any engine exists.

Everything that can be refused is refused here, on all ranks together (a rank that fails makes the others
stop with it instead of waiting in a collective), before the engine is built and before anything is written
to a run folder another job might own. The phases:

0. every rank on its own, before the process group exists: the configuration for this world size (batch
   layout, eval streams, DeepSpeed's own schema; the same answer on every rank); then the process group
   (with the configured timeouts) is joined;
1. every rank: the corpus (manifest, tokenizer, the rank's files verified; each file not remembered from
   an earlier start of the run is hashed by one rank, share_corpus_hashing), and on rank 0 the run
   folder's lock;
2. rank 0: what the checkpoint folder holds (interrupted saves are reported and removed) and which tags
   the job may resume from;
3. every rank: the chosen tag's checksums (the ranks share the hashing) and its fit with this run
   (one owner: check_checkpoint_fits); with checkpoint.fallback an older tag when the newest is damaged;
4. rank 0: the universal conversion when the world size changed; then, last, tags newer than the resume
   point moved to superseded/ (a rollback never deletes them), free disk space and the MLflow run (a refusal
   there moves the tags back: a refused start leaves the checkpoints as they were).

Before the fit check of phase 3 (for a new run: after phase 2) rank 0 decides what "auto" means for
train.precision and model.attn_impl (measured, or the choices the checkpoint recorded) and every rank takes
its answer (txl_dist/runtime_choices.py); the configuration start-up returns names the decided values.
After the resume is chosen, the evaluation keeps the streams the run evaluated so far (eval.n_streams null:
the count its checkpoint recorded, not one per rank of this world size; _keep_eval_streams).

Evaluation and export read a tag of a run that may still be training: they hold it for reading from its
choice to the end of the load (checkpoint.resolve_and_hold; that run's retention keeps it meanwhile). An
evaluation checks the checkpoint's fit with the corpus before the configuration's own checks against it, and
opens the split it evaluates, all before an engine is built or a universal copy written.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from . import checkpoint, distributed, runtime_choices
from .checkpoint import CheckpointError, EngineSource
from .config import ConfigError, RunConfig, apply_override, changed_settings, check_cutoffs, config_from_dict, \
    default_value, load_config, model_config_from_dict, precision_of, resolve_d_embed, resolve_tie_projs
from .data import CorpusError, Manifest, SplitTooShort, StreamLoader, read_manifest
from .data.index_split import split_files
from .data.manifest import sha256_file
from .data.hash_record import HashRecord
from .distributed import DistEnv
from .errors import Refused, one_line
from .deepspeed_schema import check_deepspeed_config
from .engine import check_optimizer_op_available, deepspeed_config, zero_stage
from .evaluate import Evaluator
from .flops import sample_cluster_shares
from .host import cpus_per_rank
from .run_dir import RunDir, RunDirUnusable, RunLock, acquire_lock, attach_log_file, check_run_dir_place, \
    sees_shared_check, write_shared_check
from .runtime_choices import RunChoices

log = logging.getLogger(distributed.LOGGER_NAME)
T = TypeVar("T")

# Model settings a checkpoint's weights are tied to; the others (dropout, mem_len, ...) may change on resume.
MODEL_STRUCTURE = ("vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed", "div_val",
                   "cutoffs", "tie_weight", "tie_projs", "pre_lnorm", "untie_r", "pad_vocab_multiple")


def changed_structure(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The MODEL_STRUCTURE keys whose values differ between two `model` sections, sorted. A null and the value it
    stands for are the same (d_embed null and d_embed d_model build the same model); null on both sides is the
    same setting (what it implies differs only through d_model or cutoffs, named themselves). A key newer than a
    section counts as its default (the shape a checkpoint saved before the key was added has)."""
    def value(model: dict[str, Any], key: str) -> Any:
        return model.get(key, default_value("model", key))

    def meant(model: dict[str, Any], key: str) -> Any:
        if key == "d_embed":
            return resolve_d_embed(value(model, key), value(model, "d_model"))
        if key == "tie_projs":
            return resolve_tie_projs(value(model, key), value(model, "cutoffs"))
        return value(model, key)

    return sorted(k for k in MODEL_STRUCTURE if value(saved, k) != value(now, k) and meant(saved, k) != meant(now, k))


# Bytes per parameter of a checkpoint before any exists to measure: fp32 weights or masters + Adam's two
# moments, plus the bf16/fp16 copy (an over-estimate for fp32 runs, which is the safe side).
CHECKPOINT_BYTES_PER_PARAM = 18


@dataclass
class Resume:
    """The checkpoint a job continues from."""

    tag_dir: Path
    run_info: dict[str, Any]
    source: EngineSource


@dataclass
class TrainStart:
    """What start_training checked and opened."""

    cfg: RunConfig
    """The configuration with model.vocab_size resolved from the corpus."""
    manifest: Manifest
    run_dir: RunDir
    resume: Resume | None
    loader: StreamLoader
    evaluator: Evaluator
    tracker: Any
    lock: RunLock | None
    checkpoint_bytes: int = 0
    """The expected size of a checkpoint, estimated by rank 0 for its free-space checks (0 on other ranks)."""
    choices: RunChoices | None = None
    """What "auto" means for this run (precision, attention), decided once (txl_dist/runtime_choices.py);
    already written into cfg."""
    cluster_shares: list[float] | None = None
    """Fraction of the training tokens per adaptive-softmax cluster (rank 0's block, sampled): the expected
    cost of the softmax tails in the FLOPs count (txl_dist/flops.py)."""
    hold: checkpoint.ReadHold | None = None
    """Another run folder's tag this job starts from (a fork), held for reading until it is loaded: that run may
    still be training, and its retention keeps the tag meanwhile (checkpoint.hold_for_reading)."""

    def release_checkpoint(self) -> None:
        """Let the other run's retention remove the tag again (once its files are loaded)."""
        if self.hold is not None:
            self.hold.release()

    def close(self) -> None:
        """Close what start-up opened (loaders, lock, a hold on another run's tag); the tracker is closed by its
        owner, the log file by the entry point (run_dir.detach_log_file)."""
        self.evaluator.close()
        self.loader.close()
        self.release_checkpoint()
        if self.lock is not None:
            self.lock.release()


@dataclass
class EvalStart:
    """What start_evaluation checked: the configuration to build the model with, the tag to load (held for
    reading until release_checkpoint), the split to evaluate and the choices it runs with."""

    cfg: RunConfig
    resume: Resume
    evaluator: Evaluator
    split: str
    choices: RunChoices
    hold: checkpoint.ReadHold | None = None

    def release_checkpoint(self) -> None:
        """Let the run's retention remove the tag again (once its files are loaded)."""
        if self.hold is not None:
            self.hold.release()

    def close(self) -> None:
        self.evaluator.close()
        self.release_checkpoint()


# ----------------------------------------------------------------------------------------------------
# Rules with one owner


def check_run_config(cfg: RunConfig, world_size: int) -> None:
    """The configuration on this world size: batch layout, eval streams (a count eval.n_streams names; null is
    settled with the checkpoint's record: _keep_eval_streams, launch/eval.py), DeepSpeed's schema."""
    cfg.gradient_accumulation_steps(world_size)
    cfg.eval_streams(world_size)
    ds_config = deepspeed_config(cfg, world_size)
    check_deepspeed_config(ds_config, world_size)
    check_optimizer_op_available(ds_config)
    if cfg.train.precision == "auto":
        _check_each_auto_precision(cfg, world_size)


def _check_each_auto_precision(cfg: RunConfig, world_size: int) -> None:
    """precision "auto" is decided after the ranks connect, and the check above read the section as written (fp32
    unless it enables bf16 itself), while the engine gets it in the precision auto picks: what DeepSpeed refuses
    only for a bf16 model (a grad_accum_dtype that is not the model's at ZeRO 0, fp32 sums at ZeRO 1) would fail
    inside deepspeed.initialize, or train another way, where "auto" picks bf16 (any GPU with bf16 units, a CPU
    that measures it faster)."""
    for precision in runtime_choices.AUTO_PRECISIONS:
        picked = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
        try:
            check_deepspeed_config(deepspeed_config(picked, world_size), world_size)
        except ConfigError as e:
            if e.args[0].startswith("train.precision / "):  # DeepSpeed cannot train in it here: auto will not pick it
                continue
            raise ConfigError(f"{e} (train.precision \"auto\" may pick {precision} for this run; name a precision "
                              "to train in, or change the deepspeed section)") from None


def check_has_optimizer(cfg: RunConfig) -> None:
    """Training needs deepspeed.optimizer (DeepSpeed would build the engine without one and fail at the first
    step); evaluation and export do not."""
    if "optimizer" not in cfg.deepspeed:
        raise ConfigError('deepspeed.optimizer: training needs one, e.g. {"type": "AdamW", "params": {"lr": '
                          '0.00025, "torch_adam": true}} (as configs/tiny.json)')


def check_attn_impl_runs_here(cfg: RunConfig, device, *, training: bool) -> None:
    """FlexAttention has no backward on a CPU, and the Triton kernels run on CUDA only (and need triton): a job
    that names them where they cannot run is refused at start (the model would raise at the first step or
    batch, after the engine and the run folder exist)."""
    if training and cfg.model.attn_impl == "flex" and device.type == "cpu":
        raise ConfigError("model.attn_impl: 'flex' cannot train on a CPU (FlexAttention has no CPU backward); use "
                          "'auto' or 'matmul' (flex serves evaluation there)")
    if cfg.model.attn_impl == "triton":
        from .model import triton_attention

        if device.type != "cuda":
            raise ConfigError(f"model.attn_impl: 'triton' runs on CUDA only, and this job runs on {device.type}; "
                              "use 'auto' or 'matmul' (e.g. --set model.attn_impl=auto)")
        if not triton_attention.triton_available():
            raise ConfigError("model.attn_impl: 'triton' needs the triton package, which does not import here "
                              "(torch's CUDA wheels bring it); use 'auto' or 'matmul'")


def join(cfg: RunConfig, env: DistEnv) -> None:
    """Phase 0: check the configuration on this world size, then join the process group (a no-op when the
    caller made it already) with the configured timeouts."""
    check_run_config(cfg, env.world_size)
    distributed.init_process_group(env, collective_timeout_s=cfg.train.collective_timeout_s,
                                   control_timeout_s=cfg.checkpoint.timeout_s)


def read_data_path(cfg: RunConfig) -> Manifest:
    """The manifest of the corpus at data.path. A folder that is not there is refused naming the key: the
    usual cause is a corpus moved, or a checkpoint (its data.path) evaluated on another machine, where a new
    `prepare` is not the fix."""
    if not os.path.lexists(cfg.data.path):
        home = os.path.expanduser(cfg.data.path)
        if home != cfg.data.path:  # a shell would expand `--out ~/x` in the advice below: the next start fails again
            raise CorpusError(f"data.path: {cfg.data.path} does not exist: a ~ is not expanded in data.path (it names "
                              f"a folder called {cfg.data.path.split('/')[0]} here); write the full path, e.g. "
                              f"--set data.path={home}")
        raise CorpusError(f"data.path: {cfg.data.path} does not exist; point it at the folder the corpus was "
                          f"prepared in (--set data.path=DIR), or prepare it there (`python -m data_prep prepare "
                          f"--out {cfg.data.path}`)")
    return read_manifest(cfg.data.path)


def open_corpus(cfg: RunConfig) -> tuple[RunConfig, Manifest]:
    """The corpus' manifest, and cfg with model.vocab_size taken from its tokenizer."""
    manifest = read_data_path(cfg)
    return with_vocab(cfg, manifest.tokenizer.vocab_size, cfg.data.path), manifest


def with_vocab(cfg: RunConfig, vocab_size: int, corpus: str) -> RunConfig:
    """cfg with model.vocab_size = the corpus tokenizer's; a different explicit value is refused."""
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != vocab_size:
        # The advice must not lead into the next refusal: cutoffs that only fit the old size are named too.
        cutoffs = "" if _cutoffs_fit(cfg.model.cutoffs, vocab_size) else \
            f" and model.cutoffs {cfg.model.cutoffs} below {vocab_size}"
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} differs from the tokenizer of {corpus} ({vocab_size}); "
            f"set it to null (taken from the manifest){cutoffs} or prepare the data with the matching tokenizer")
    check_cutoffs(cfg.model.cutoffs, vocab_size)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def with_absolute_data_path(cfg: RunConfig) -> RunConfig:
    """cfg with data.path made absolute against the working directory (symlinks kept, as the user named them).

    data.path is the one path of a run's config that is read again after training (launch/eval.py,
    generate.py and export.py take it from the checkpoint's config); a relative one would resolve against their
    working directory. run.dir is not read from a checkpoint's config (a resume names its own)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=os.path.abspath(cfg.data.path)))


def check_training_splits(cfg: RunConfig, manifest: Manifest) -> None:
    """Refuse a split that data.train_split, data.valid_split or (with eval.at_end) data.test_split names and
    the corpus lacks, naming the key and a way on: a corpus prepared with --train alone has no held-out split."""
    keys = {"data.train_split": cfg.data.train_split, "data.valid_split": cfg.data.valid_split}
    if cfg.eval.at_end:
        keys["data.test_split"] = cfg.data.test_split
    missing = {key: name for key, name in keys.items() if name not in manifest.splits}
    if not missing:
        return
    key, name = next(iter(missing.items()))
    line = (f"{Path(cfg.data.path) / 'manifest.json'}: no split '{name}' for {key}; the corpus has "
            f"{', '.join(sorted(manifest.splits))}")
    if key == "data.train_split":
        raise CorpusError(f"{line}; set data.train_split to one of them")
    # Every held-out split missing is named at once: the advice must not lead into the next refusal.
    fixes = {}
    for k in missing:
        default = default_value(*k.split("."))
        fixes[k] = default if default in manifest.splits else cfg.data.train_split
    line += f"; use {' '.join(f'--set {k}={v}' for k, v in fixes.items())}"
    lacking = [k.split(".")[1].removesuffix("_split") for k, v in fixes.items() if v == cfg.data.train_split]
    if lacking:
        options = " and ".join(f"--{s}-fraction F or --{s} FILE" for s in lacking)
        line += (" (evaluates on training text: no held-out measure), or prepare the corpus with held-out text "
                 f"(`python -m data_prep prepare` with {options})")
        if list(fixes) == ["data.test_split"]:
            line += ", or --set eval.at_end=false (no final test evaluation)"
    raise CorpusError(line)


def _cutoffs_fit(cutoffs: list[int], vocab_size: int) -> bool:
    try:
        check_cutoffs(cutoffs, vocab_size)
        return True
    except ConfigError:
        return False


def check_checkpoint_fits(cfg: RunConfig, manifest: Manifest, run_info: dict[str, Any], tag_dir: Path, *,
                          purpose: str) -> None:
    """Refuse a checkpoint this run cannot use (one line naming the difference).

    purpose "resume": the same tokens (manifest digest), streams, model structure and ZeRO stage; other
    changed settings are named in a warning. "evaluate": the same tokenizer, model structure and ZeRO stage
    (any corpus made with that tokenizer may be evaluated).
    """
    problems = []
    if run_info["tokenizer_sha256"] != manifest.tokenizer.sha256:
        problems.append(f"{cfg.data.path} was prepared with another tokenizer (sha256 differs); use data made "
                        "with the checkpoint's tokenizer")
    elif purpose == "resume" and run_info["manifest_digest"] != manifest.digest():
        problems.append(f"the tokens of {cfg.data.path} differ from the ones it was trained on (manifest digest); "
                        "resume on the data it was trained on")
    if purpose == "resume" and run_info["n_streams"] != cfg.n_streams():
        problems.append(f"deepspeed.train_batch_size (the number of streams) is {cfg.n_streams()}, the checkpoint "
                        f"has {run_info['n_streams']}; keep it to resume (any world size dividing it works)")
    saved_model = run_info["config"]["model"]
    model = dataclasses.asdict(cfg.model)
    changed_model = changed_structure(saved_model, model)
    if changed_model:
        problems.append(f"model settings differ: {', '.join('model.' + k for k in changed_model)}; the weights "
                        "only fit the model they were trained as")
    if purpose == "resume":
        problems += _stream_position_problems(cfg, run_info["config"])
    if run_info["zero_stage"] != zero_stage(cfg.deepspeed):
        problems.append(f"ZeRO stage {zero_stage(cfg.deepspeed)} differs from the checkpoint's "
                        f"{run_info['zero_stage']}; use the stage it was saved with")
    saved_config = run_info["config"]
    saved_precision = precision_of(saved_config["train"].get("precision"), saved_config.get("deepspeed", {}))
    precision = cfg.precision()
    if precision is not None and saved_precision is not None and precision != saved_precision:
        # DeepSpeed's optimizer state differs by precision; its load_checkpoint fails on the other one at every
        # ZeRO stage (measured: docs/performance.md), inside a collective: refuse it here, before the engine.
        problems.append(f"it was trained in {saved_precision}, this run would be {precision}; set "
                        f"train.precision={saved_precision} to {purpose} it")
    if problems:
        raise CheckpointError(f"cannot {purpose} from {tag_dir}: {problems[0]}")
    if purpose == "resume":
        changed = changed_settings(*_eval_streams_resolved(cfg, run_info))
        if changed:
            log.warning("resuming %s with changed settings: %s", tag_dir, ", ".join(changed),
                        extra=distributed.RANK_ZERO_ONLY)


def _eval_streams_resolved(cfg: RunConfig, run_info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's configuration and this one, eval.n_streams in each replaced by the count it stands for:
    the checkpoint's recorded count, and what this one keeps of it (RunConfig.kept_eval_streams). On a resume
    null means the recorded count, so null and that count named evaluate the same streams and are not a change;
    a world size that cannot split it has its own warning (_keep_eval_streams)."""
    recorded = checkpoint.recorded_eval_streams(run_info)
    saved, now = copy.deepcopy(run_info["config"]), cfg.to_dict()
    saved.setdefault("eval", {})["n_streams"] = recorded
    now["eval"]["n_streams"] = cfg.kept_eval_streams(recorded)
    return saved, now


STREAM_POSITION_KEYS = (("model", "tgt_len"), ("data", "train_split"), ("data", "roll"))
"""Settings the saved position in the training streams is counted in (windows of tgt_len of one split, at
offsets data.roll moves): another value cannot continue that position exactly (data.StreamLoader)."""


def _stream_position_problems(cfg: RunConfig, saved_config: dict[str, Any]) -> list[str]:
    """The refusal for a resume that changes what the saved stream position is counted in."""
    now = cfg.to_dict()

    def saved(section: str, key: str) -> Any:
        return saved_config.get(section, {}).get(key, default_value(section, key))

    keys = [(sec, key) for sec, key in STREAM_POSITION_KEYS if saved(sec, key) != now[sec][key]]
    if cfg.data.roll and saved("data", "roll") and saved("data", "seed") != cfg.data.seed:
        keys.append(("data", "seed"))  # the epochs' offsets; without roll there are none
    if not keys:
        return []
    listed = ", ".join(f"{sec}.{key} {now[sec][key]!r} (the checkpoint's: {saved(sec, key)!r})" for sec, key in keys)
    return [f"{listed}: the position in the training streams it saved is counted in these; keep the checkpoint's "
            "values to resume it"]


def checkpoint_bytes_estimate(ckpt_dir: Path, n_params: int) -> int:
    """The size of the next checkpoint: the newest complete tag's, else from the parameter count."""
    complete = checkpoint.inventory(ckpt_dir).complete
    if complete:
        return checkpoint.tag_bytes(ckpt_dir / complete[-1])
    return n_params * CHECKPOINT_BYTES_PER_PARAM


def count_parameters(model_cfg) -> int:
    """Parameters of the model a config describes, without building it (meta tensors)."""
    import torch

    from .model import TransformerXL

    with torch.device("meta"):
        model = TransformerXL(model_cfg)
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# Agreement helpers


class StartupIOError(Refused):
    """A file or folder start-up needs could not be read or made (permissions, a missing mount, ...)."""


def _together(fn: Callable[[], T], done: str) -> T:
    """fn() on every rank, failures agreed (distributed.together; `done`: the phase, for the watchdog); an
    OSError becomes a one-line refusal."""
    def checked() -> T:
        try:
            return fn()
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise StartupIOError(f"{where}{e.strerror or one_line(e)}") from None

    return distributed.together(checked, done)


def _on_main(env: DistEnv, fn: Callable[[], T], done: str) -> T:
    """fn() on rank 0 (failures agreed by all ranks, `done` as for _together); its result on every rank."""
    return distributed.broadcast_object(_together(lambda: fn() if env.is_main else None, done))


def check_run_dir_shared(path: Path, env: DistEnv) -> None:
    """Refuse (every rank together) a run folder that is not the same folder on every rank: all ranks write
    their checkpoint files into one tag folder that rank 0 then checks and renames, so a node-local run.dir
    (/tmp, a node's scratch disk) would fail the first save, thousands of steps in. Rank 0 writes a file there
    and every rank reads it back."""
    if env.world_size == 1:
        return
    name, main_path = _on_main(env, lambda: (write_shared_check(path), path), "the run folder's check file written")
    try:
        mine = _together(lambda: None if sees_shared_check(path, name) else f"{env.rank} ({socket.gethostname()})",
                         "the run folder's check file read back")
        missing = [m for m in distributed.gather_objects(mine) if m]
        if missing:
            raise distributed.agreed(RunDirUnusable(
                f"run.dir {main_path} is not one folder for all ranks: rank(s) {', '.join(missing[:8])}"
                f"{' and more' if len(missing) > 8 else ''} do not see the file rank 0 wrote there; put run.dir on "
                "a file system every node mounts (checkpoints from all ranks go into one folder)"))
    finally:
        if env.is_main:
            (path / name).unlink(missing_ok=True)


def _verified(candidates: list[Path], env: DistEnv, *, fallback: bool) -> tuple[Path, dict[str, Any]]:
    """The first candidate tag whose files verify on every rank's share; CheckpointError for a damaged one
    unless fallback (then the next candidate, with a warning)."""
    for i, tag_dir in enumerate(candidates):
        problem = _together(lambda: checkpoint.verify(tag_dir, rank=env.rank, world_size=env.world_size),
                            f"its share of checkpoint {tag_dir.name} verified")
        problems = [p for p in distributed.gather_objects(problem) if p]
        if not problems:
            return tag_dir, checkpoint.checked_run_info(tag_dir)
        older = candidates[i + 1:]
        if not fallback or not older:
            hint = (" (checkpoint.fallback=true resumes from the newest older tag that verifies)"
                    if older and not fallback else "")
            raise distributed.agreed(CheckpointError(f"checkpoint {tag_dir.name} is damaged: {problems[0]}{hint}"))
        log.warning("checkpoint %s is damaged (%s); falling back to %s (checkpoint.fallback)", tag_dir.name,
                    problems[0], older[0].name, extra=distributed.RANK_ZERO_ONLY)
    raise CheckpointError("no checkpoint to verify")


# ----------------------------------------------------------------------------------------------------
# Training


def start_training(cfg: RunConfig, env: DistEnv, resume: str = "auto", *, log_file: bool = False) -> TrainStart:
    """Phases 0-4 of the module docstring for a training job; returns what the trainer needs. log_file:
    append this rank's log to <run.dir>/logs/ once the run folder is held (after phase 1)."""
    from .tracking import create_tracker

    run_dir = RunDir(Path(cfg.run.dir))
    join(cfg, env)
    # Before the corpus is read and the lock taken: a run folder in the corpus would put the lock and the log there.
    _together(lambda: check_run_dir_place(run_dir.path, cfg.data.path), "the run folder's place checked")

    def local_checks():
        check_attn_impl_runs_here(cfg, distributed.device_for(env), training=True)
        check_has_optimizer(cfg)
        resolved, manifest = open_corpus(cfg)
        check_training_splits(resolved, manifest)
        # The config written to the run folder and into checkpoints names the corpus absolutely: eval, generate
        # and export read data.path from it, from whatever folder they run in.
        resolved = with_absolute_data_path(resolved)
        # The loaders open (and verify) their files now: bad data fails the start, not step 10,000.
        try:
            loader = StreamLoader(resolved.data.path, resolved.data.train_split, rank=env.rank,
                                  world_size=env.world_size, n_streams=resolved.n_streams(),
                                  micro_batch=resolved.micro_batch(), tgt_len=resolved.model.tgt_len,
                                  roll=resolved.data.roll, seed=resolved.data.seed)
        except SplitTooShort as e:  # the loader cannot know which settings made its streams: name them
            raise SplitTooShort(f"{e} (training: deepspeed.train_batch_size {resolved.n_streams()}, "
                              f"model.tgt_len {resolved.model.tgt_len})") from None
        return resolved, manifest, loader, _training_evaluator(resolved, env, resolved.eval_streams(env.world_size))

    # Files hashed by an earlier start of this run and unchanged since are not read again (hash_record.py);
    # the others are hashed once, by one rank each.
    hashes = HashRecord(run_dir.corpus_hashes)
    with hashes.in_use():
        share_corpus_hashing(cfg, env, hashes)
        resolved, manifest, loader, evaluator = _together(local_checks, "the corpus and its loaders checked")
    start = TrainStart(resolved, manifest, run_dir, None, loader, evaluator, None, None)
    try:
        # A phase of its own: a lock taken while another rank's checks failed would outlive the refusal.
        start.lock = _together(lambda: acquire_lock(run_dir.path, stale_after_s=resolved.train.collective_timeout_s)
                               if env.is_main else None, "the run folder locked")
        check_run_dir_shared(run_dir.path, env)
        # Together: a log file one rank cannot open is refused on every rank, not left to the next collective.
        # Before the corpus' lines: the relayout advice belongs in the log a batch job's user reads.
        _together(lambda: attach_log_file(log, run_dir.log_file(env.rank)) if log_file else None,
                  "the run's log file opened")
        if hashes.hashed or hashes.remembered or hashes.taken:
            taken = f" ({len(hashes.taken)} more hashed by other ranks)" if hashes.taken else ""
            log.info("corpus: %d file(s) verified by sha256%s, %d unchanged since an earlier start of this run",
                     len(hashes.hashed), taken, len(hashes.remembered))
        if env.is_main and (warning := layout_warning(resolved, manifest, loader, env.world_size,
                                                      sum(Path(p).stat().st_size for p in hashes.hashed))):
            log.warning("%s", warning)
        start.resume = _choose_resume(start, env, resume)
        if start.choices is None:  # a new run: nothing recorded to reuse
            _agree_choices(start, env, None)
        with hashes.in_use():  # an evaluator opened again verifies its files from the record
            _keep_eval_streams(start, env)
        loader, model = start.loader, start.cfg.model
        start.cluster_shares = _on_main(env, lambda: _sample_and_release(loader, model), "the softmax clusters' "
                                        "shares sampled")
        # Last, with the MLflow run: a rollback's move of the newer tags is undone if the run is refused.
        set_aside = _on_main(env, lambda: _set_aside_newer(start), "newer checkpoints set aside")
        try:
            start.tracker = _open_tracker(start, env, create_tracker)
        except BaseException:
            if env.is_main and set_aside is not None:
                checkpoint.restore_superseded(start.run_dir.checkpoints, *set_aside)
                log.warning("the start was refused: moved %s back from %s", ", ".join(set_aside[1]), set_aside[0])
            raise
    except BaseException:
        start.close()
        raise
    hashes.save()  # only once nothing can refuse the start: a refused start writes nothing
    return start


def _training_evaluator(cfg: RunConfig, env: DistEnv, n_streams: int) -> Evaluator:
    """The run's evaluator over n_streams streams: its valid split, and its test split with eval.at_end, opened
    and verified now."""
    splits = [cfg.data.valid_split] + ([cfg.data.test_split] if cfg.eval.at_end else [])
    return Evaluator(cfg.data.path, cfg.eval, rank=env.rank, world_size=env.world_size, n_streams=n_streams,
                     micro_batch=cfg.eval_micro_batch(), device=distributed.device_for(env), splits=splits)


def _keep_eval_streams(start: TrainStart, env: DistEnv) -> None:
    """A resume evaluates the streams its run evaluated so far (RunConfig.eval_streams with the checkpoint's
    record), not one per rank of this world size: the valid and test numbers of one run keep one definition
    across elastic resumes, and launch/eval.py reproduces them. The evaluator phase 1 opened (for a new run's
    count) is opened again when they differ. A world size that cannot split the recorded count is not refused
    (a requeue on more nodes must go on): one warning, and this world size's count from here on, recorded in
    the checkpoints that follow."""
    if start.resume is None:
        return
    cfg, run_info = start.cfg, start.resume.run_info
    recorded = checkpoint.recorded_eval_streams(run_info)
    streams = cfg.eval_streams(env.world_size, recorded, resize=True)
    if cfg.eval.n_streams is None and streams != recorded:
        # "From now on" includes the evaluations the checkpoint still owes (a stop in its last step).
        log.warning("eval.n_streams is null: this run has evaluated %d stream(s) so far (its checkpoint of step %d "
                    "records them), which these %d ranks cannot split; it evaluates %d from now on, so its valid "
                    "and test numbers from here on are not comparable with the earlier ones; set eval.n_streams to "
                    "choose the count", recorded, run_info["step"], env.world_size, streams,
                    extra=distributed.RANK_ZERO_ONLY)
    if streams == start.evaluator.n_streams:
        return
    start.evaluator.close()
    start.evaluator = _together(lambda: _training_evaluator(cfg, env, streams),
                                f"the evaluation's {streams} streams opened")


def _sample_and_release(loader: StreamLoader, model) -> list[float]:
    """sample_cluster_shares over the rank's block, then its pages unmapped: the sample's windows, spread over
    the block, would otherwise stay in the rank's resident memory for the whole run (130 MiB measured on a
    block of 3.2 GB: large page-cache folios map more than the 8 MB read)."""
    shares = sample_cluster_shares(loader.reader, *loader.block, model.cutoffs, model.vocab_size)
    loader.reader.release(*loader.block)
    return shares


def share_corpus_hashing(cfg: RunConfig, env: DistEnv, hashes: HashRecord) -> None:
    """Phase 1's hashing shared by the ranks: every corpus file the start reads that `hashes` does not answer
    for is hashed by one rank (largest first to the least loaded, checkpoint.share_of), its files on several
    threads, and every rank takes the others' digests. Each rank then checks the files it opens against the
    manifest as before, answered from those digests where the file is the one the hashing rank saw
    (hash_record.py); a file the ranks see differently (a node-local copy) is hashed by each rank that opens it.

    Without this, a corpus laid out for fewer ranks than the run (the default layout is 1 rank) has every
    rank hash every file its block touches: at 64 ranks, the whole corpus read 64 times on a first start; and
    one rank hashed its files one after the other. Best effort: a corpus that cannot be listed shares nothing,
    and the checks that follow refuse it."""
    listed = _on_main(env, lambda: _corpus_files_to_hash(cfg, hashes), "the corpus files to hash listed")
    mine = checkpoint.share_of(listed, env.rank, env.world_size)
    threads = max(1, min(HASH_THREADS, len(mine), cpus_per_rank(env.local_world_size)))

    def hash_one(path: str) -> None:
        try:
            sha256_file(path)  # hashlib releases the GIL: the threads hash in parallel
        except OSError:
            pass  # the rank that opens the file refuses it, with the reason

    def hash_my_share() -> dict[str, dict]:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(hash_one, mine))
        return hashes.hashed_entries()

    if env.world_size == 1:
        hash_my_share()
        return
    for entries in distributed.gather_objects(_together(hash_my_share, "its share of the corpus hashed")):
        hashes.take(entries)


HASH_THREADS = 8
"""Files a rank hashes at once at start-up (at most; and at most its share of the machine's cores)."""


def _corpus_files_to_hash(cfg: RunConfig, hashes: HashRecord) -> list[tuple[str, int]]:
    """(path, bytes) of the files phase 1 reads on some rank (the tokenizer, the train split and the eval
    splits) that the record does not answer for; [] when the manifest cannot be read."""
    corpus = Path(cfg.data.path)
    try:
        manifest = read_manifest(corpus)
        files = [corpus / manifest.tokenizer.file]
        splits = [cfg.data.train_split, cfg.data.valid_split] + ([cfg.data.test_split] if cfg.eval.at_end else [])
        for split in dict.fromkeys(s for s in splits if s in manifest.splits):
            files += split_files(corpus, manifest, split)
    except (CorpusError, OSError):
        return []
    listed = []
    for path in dict.fromkeys(files):
        try:
            if not hashes.answers(path):
                listed.append((str(path), path.stat().st_size))
        except OSError:
            pass  # missing or unreadable: the rank that opens it refuses it
    return listed


LAYOUT_WARNING_MIN_BYTES = 1 << 30


def layout_warning(cfg: RunConfig, manifest: Manifest, loader: StreamLoader, world_size: int,
                   hashed_bytes: int) -> str | None:
    """A line when this rank hashed far more of the train split than its own block (at least 4x and 1 GiB):
    the files were cut for another layout, so each rank reads files holding other ranks' streams; `relayout`
    cuts one file set per rank. None otherwise, and for an index mixture (its blocks read the sources)."""
    split = manifest.splits[cfg.data.train_split]
    if split.index is not None:
        return None
    block_bytes = (loader.block[1] - loader.block[0]) * np.dtype(manifest.dtype).itemsize
    if hashed_bytes < max(4 * block_bytes, LAYOUT_WARNING_MIN_BYTES):
        return None
    return (f"corpus: this rank hashed {hashed_bytes / 1e9:.1f} GB of corpus files to read its {block_bytes / 1e9:.2f} "
            f"GB block: split '{cfg.data.train_split}' is laid out for {split.layout.world_size} rank(s) and "
            f"{split.layout.n_streams} stream(s), this run has {world_size} and {cfg.n_streams()}; "
            f"`python -m data_prep relayout {cfg.data.path} --world-size {world_size} --n-streams {cfg.n_streams()}` "
            "cuts one file set per rank (later starts of this run hash only files changed since)")


def _choose_resume(start: TrainStart, env: DistEnv, resume: str) -> Resume | None:
    cfg, ckpt_dir = start.cfg, start.run_dir.checkpoints

    def survey() -> list[Path]:
        _report_leftovers(ckpt_dir, checkpoint.remove_leftovers(ckpt_dir))
        inv = checkpoint.inventory(ckpt_dir)
        if inv.incomplete:
            log.warning("checkpoint folder %s: ignoring incomplete tag(s) without run.json: %s", ckpt_dir,
                        ", ".join(inv.incomplete))
        checkpoint.check_resume_request(resume, ckpt_dir, inv.complete)
        if inv.latest_problem:
            log.warning("checkpoint folder %s: ignoring `latest` (%s); resume does not need it, the next save "
                        "rewrites it", ckpt_dir, inv.latest_problem)
        elif resume == "auto" and inv.complete and inv.latest != inv.complete[-1]:
            log.warning("checkpoint folder %s: `latest` names %s, the newest complete tag is %s; resuming from the "
                        "newest complete tag", ckpt_dir, inv.latest or "nothing", inv.complete[-1])
        if resume not in ("auto", "none") and not _in_folder(checkpoint.resolve_path(resume), ckpt_dir):
            # Another run's tag (a fork), held from its choice to the end of its load as an evaluation holds its
            # tag: that run may still be training, and its retention removed the tag from under the load.
            tag_dir, start.hold = checkpoint.resolve_and_hold(resume)
            return [tag_dir]
        return checkpoint.candidate_tags(resume, ckpt_dir)

    candidates = _on_main(env, survey, "the checkpoint folder surveyed")
    if not candidates:
        return None
    if not _in_folder(candidates[0], ckpt_dir):  # a fork: every node reads the tag, so every rank holds it
        start.hold = _together(lambda: start.hold or checkpoint.hold_named_tag(candidates[0], "start this job again"),
                               f"checkpoint {candidates[0].name} held")
    chosen = _verified(candidates, env, fallback=cfg.checkpoint.fallback and resume == "auto")
    tag_dir, run_info = chosen
    # Before the fit check: it compares the resolved precision with the checkpoint's.
    cfg = _agree_choices(start, env, run_info.get("run_choices"))
    _together(lambda: check_checkpoint_fits(cfg, start.manifest, run_info, tag_dir, purpose="resume"),
              f"checkpoint {tag_dir.name}'s fit with this run checked")
    source = checkpoint.engine_source(tag_dir, run_info, world_size=env.world_size)
    _ready_universal_copy(source, tag_dir, run_info, env)
    _check_loadable(source)
    return Resume(tag_dir, run_info, source)


def _in_folder(tag_dir: Path, ckpt_dir: Path) -> bool:
    """Whether a tag is one of this run folder's own (not another run's: a fork)."""
    return tag_dir.parent.resolve() == ckpt_dir.resolve()


def _set_aside_newer(start: TrainStart) -> tuple[Path, list[str]] | None:
    """A rollback (resuming this run folder's own tag, with newer tags beside it): those tags moved to
    superseded/<time>/, never deleted; (that folder, the tags), or None when nothing moved."""
    resume, ckpt_dir = start.resume, start.run_dir.checkpoints
    if resume is None or resume.tag_dir.parent.resolve() != ckpt_dir.resolve():
        return None
    moved = checkpoint.supersede_newer(ckpt_dir, resume.run_info["step"])
    if moved:
        dest, tags = moved
        log.warning("resuming from %s: moved %d newer tag(s) (%s) to %s; they are not deleted", resume.tag_dir.name,
                    len(tags), ", ".join(tags), dest)
    return moved


LEFTOVER_REPORTS = {"save": "removed %d interrupted save(s): %s", "removal": "finished %d interrupted removal(s): %s",
                    "conversion": "removed %d killed universal conversion(s) or orphaned copies: %s"}


def _report_leftovers(ckpt_dir: Path, removed: list[str]) -> None:
    """One line per kind of what remove_leftovers removed (an interrupted save, a tag retention was removing, a
    killed conversion), so that a half-removed old tag does not read as a lost save."""
    by_kind: dict[str, list[str]] = {}
    for name in removed:
        by_kind.setdefault(checkpoint.leftover_kind(name) or "conversion", []).append(name)
    for kind, names in by_kind.items():
        log.warning("checkpoint folder %s: " + LEFTOVER_REPORTS[kind], ckpt_dir, len(names), ", ".join(names))


def _ready_universal_copy(source: EngineSource, tag_dir: Path, run_info: dict[str, Any], env: DistEnv) -> None:
    """Make sure the universal copy an elastic load reads is the verified tag's, before anything reads it.

    The ranks share the hashing of the copy found there (as for the tag). A copy that is missing, unfinished,
    made by an older version (no record), made from another save of the tag or damaged is derived data: rank 0
    converts the tag again (its record is made from the files it writes). Another job's copy kept instead
    (two evaluations converting at once) is verified like a found one. Never loads an unverified copy."""
    if not source.universal:
        return
    copy = source.load_dir / source.tag
    problem = _first_problem(lambda: checkpoint.verify_universal(copy, tag_dir, rank=env.rank,
                                                                 world_size=env.world_size),
                             f"its share of universal copy {copy.name} verified")
    if problem is None:
        return

    def convert() -> bool:
        if copy.exists():
            log.warning("universal copy %s does not verify (%s); converting %s again", copy.name, problem,
                        tag_dir.name)
        return checkpoint.convert_to_universal(tag_dir, copy, zero_stage=run_info["zero_stage"])

    if _on_main(env, convert, f"universal copy {copy.name} converted"):
        return
    problem = _first_problem(lambda: checkpoint.verify_universal(copy, tag_dir, rank=env.rank,
                                                                 world_size=env.world_size),
                             f"its share of universal copy {copy.name} verified again")
    if problem is not None:
        raise CheckpointError(f"universal copy {copy.name} (made by another job meanwhile) does not verify: "
                              f"{problem}; start again to convert {tag_dir.name} anew")


def _first_problem(check: Callable[[], str | None], done: str) -> str | None:
    """check() on every rank (each its share of some files); the first rank's problem, or None on all."""
    problems = [p for p in distributed.gather_objects(_together(check, done)) if p]
    return problems[0] if problems else None


def _agree_choices(start: TrainStart, env: DistEnv, recorded: dict[str, Any] | None) -> RunConfig:
    """Decide what "auto" means for this run (rank 0; reusing `recorded`, a checkpoint's choices) and write
    it into start.cfg, before the DeepSpeed config is built from it."""
    start.choices = runtime_choices.agree(start.cfg, env, recorded)
    start.cfg = runtime_choices.apply(start.cfg, start.choices)
    return start.cfg


def _check_loadable(source: EngineSource) -> None:
    """Every rank refuses together a file DeepSpeed's load would refuse inside a collective (at ZeRO 1/2 each
    rank reads only its own optimizer file and fragments)."""
    from .safe_load import check_checkpoint_files

    _together(lambda: check_checkpoint_files(source.load_dir / source.tag), f"{source.tag}'s files checked for loading")


def _open_tracker(start: TrainStart, env: DistEnv, create_tracker):
    cfg = start.cfg

    def check_space_and_open():
        if not env.is_main:
            return create_tracker(cfg.tracking, env.rank, start.run_dir.path)
        ckpt_dir = start.run_dir.checkpoints
        need = checkpoint_bytes_estimate(ckpt_dir, count_parameters(cfg.model))
        start.checkpoint_bytes = need
        free = shutil.disk_usage(ckpt_dir if ckpt_dir.is_dir() else start.run_dir.path).free
        if free < need:
            raise CheckpointError(f"{ckpt_dir}: {checkpoint.size_text(free)} free, one checkpoint needs about "
                                  f"{checkpoint.size_text(need)}; free space or choose another run.dir")
        if cfg.checkpoint.keep and free < need * (cfg.checkpoint.keep + 1):
            log.warning("%s: %s free, %d checkpoints (checkpoint.keep + the one being saved) need about %s",
                        ckpt_dir, checkpoint.size_text(free), cfg.checkpoint.keep + 1,
                        checkpoint.size_text(need * (cfg.checkpoint.keep + 1)))
        return create_tracker(cfg.tracking, env.rank, start.run_dir.path, _resume_point(start))

    return _together(check_space_and_open, "the free space checked and the MLflow run opened")


def _resume_point(start: TrainStart):
    """What tracking needs of the checkpoint: its run and step, the runs of tags newer than it that a rollback
    set aside (now or in a start that was refused later), and its run dir when it is another's (a fork)."""
    from .tracking import ResumePoint

    if start.resume is None:
        return None
    info, tag_dir, ckpt_dir = start.resume.run_info, start.resume.tag_dir, start.run_dir.checkpoints
    if tag_dir.parent.resolve() == ckpt_dir.resolve():
        return ResumePoint(info.get("mlflow_run_id"), info["step"],
                           frozenset(checkpoint.superseded_runs(ckpt_dir, info["step"])))
    return ResumePoint(info.get("mlflow_run_id"), info["step"], source_dir=tag_dir.parent.parent)


# ----------------------------------------------------------------------------------------------------
# Evaluation and export


@dataclass
class EvalChoice:
    """What eval_config read on one rank: the configuration, and the tag it names, held for reading."""

    cfg: RunConfig
    tag_dir: Path
    run_info: dict[str, Any]
    hold: checkpoint.ReadHold


def eval_config(checkpoint_path: str, config: str | None, overrides: list[str]) -> EvalChoice:
    """The configuration to evaluate a checkpoint with (its own, or --config) and the tag it names, held for
    reading from now on (a training run's retention keeps it: checkpoint.hold_for_reading).

    Read by every rank on its own (no collectives: the process group is made with this config's timeouts).
    """
    tag_dir, hold = checkpoint.resolve_and_hold(checkpoint_path)
    try:
        run_info = checkpoint.checked_run_info(tag_dir)
        if config is None:
            raw = copy.deepcopy(run_info["config"])  # apply_override edits it in place
            for item in overrides:
                apply_override(raw, item)
            cfg = config_from_dict(raw)
        else:
            cfg = load_config(config, overrides)
    except BaseException:
        hold.release()
        raise
    return EvalChoice(cfg, tag_dir, run_info, hold)


def evaluation_batch(cfg: RunConfig, world_size: int) -> RunConfig:
    """cfg with a training batch this world size can hold (deepspeed.train_batch_size = the micro batch x the
    world size) when the trained one cannot: an evaluation builds an engine but trains nothing, so only
    eval.n_streams has to divide over its ranks."""
    try:
        cfg.gradient_accumulation_steps(world_size)
        return cfg
    except ConfigError:
        ds = {**cfg.deepspeed, "train_batch_size": cfg.micro_batch() * world_size}
        return dataclasses.replace(cfg, deepspeed=ds)


def start_evaluation(choice: EvalChoice, env: DistEnv, split: str | None = None,
                     check_outputs: Callable[[], None] | None = None) -> EvalStart:
    """Checks for evaluating a checkpoint on this world size (collective): config, corpus, fit, the split
    (default data.test_split), checksums, and check_outputs (what rank 0 will write, e.g. --json-out: run on
    rank 0, refused on every rank together). All before an engine is built or a universal copy written.

    Every rank resolved the checkpoint path on its own (eval_config, before the process group existed): a run
    folder names its newest tag, and a save landing between two ranks' reads would give them different tags
    (at ZeRO 1-2 a mix of both tags' optimizer shards). Rank 0's tag, with the config and record read from it,
    is what every rank evaluates, and holds for reading (multi-node: every node reads it)."""
    hold, evaluator = choice.hold, None
    try:
        cfg = evaluation_batch(choice.cfg, env.world_size)
        join(cfg, env)
        if check_outputs is not None:
            _on_main(env, check_outputs, "the evaluation's outputs checked")
        tag_dir, run_info, cfg = distributed.broadcast_object(
            (choice.tag_dir, choice.run_info, cfg) if env.is_main else None)
        hold = _together(lambda: _hold_rank_zeros_tag(choice, tag_dir, env), f"checkpoint {tag_dir.name} held")
        # "auto" in an evaluation config means what the checkpoint's run chose (a fresh decision when the
        # checkpoint recorded none; on another device type, its precision and a fresh attention choice).
        choices = runtime_choices.agree(cfg, env, run_info.get("run_choices"), peak=False, training=False)
        cfg = runtime_choices.apply(cfg, choices)
        resolved, evaluator, split = _together(lambda: _eval_local_checks(cfg, run_info, tag_dir, split, env),
                                               "the corpus and the split checked")
        _verified([tag_dir], env, fallback=False)
        source = checkpoint.engine_source(tag_dir, run_info, world_size=env.world_size)
        _ready_universal_copy(source, tag_dir, run_info, env)
        _check_loadable(source)
    except BaseException:
        if evaluator is not None:
            evaluator.close()
        hold.release()
        raise
    return EvalStart(resolved, Resume(tag_dir, run_info, source), evaluator, split, choices, hold)


def _hold_rank_zeros_tag(choice: EvalChoice, tag_dir: Path, env: DistEnv) -> checkpoint.ReadHold:
    """This rank's hold on rank 0's tag: its own when it chose the same one, else a new one (rank 0 holds that
    tag, so retention cannot have removed it, except on a file system without locks)."""
    if choice.tag_dir.resolve() == tag_dir.resolve():
        return choice.hold
    log.warning("rank %d: the checkpoint path named %s here and %s on rank 0 (a save while the ranks started); "
                "evaluating rank 0's", env.rank, choice.tag_dir.name, tag_dir.name)
    choice.hold.release()
    return checkpoint.hold_named_tag(tag_dir, "start the evaluation again")


def _eval_local_checks(cfg: RunConfig, run_info: dict[str, Any], tag_dir: Path, split: str | None,
                       env: DistEnv) -> tuple[RunConfig, Evaluator, str]:
    """The corpus, the checkpoint's fit with it, and the split (opened and verified now), on this rank.

    The fit first: a corpus made with another tokenizer, or a model that is not the checkpoint's, is what the
    user must hear about; the config's own checks against the corpus (model.vocab_size, model.cutoffs) come
    after, and a config that fits the checkpoint passes them (its vocabulary and cutoffs are the checkpoint's)."""
    check_attn_impl_runs_here(cfg, distributed.device_for(env), training=False)
    manifest = read_data_path(cfg)
    check_checkpoint_fits(with_vocab_if_unset(cfg, manifest.tokenizer.vocab_size), manifest, run_info, tag_dir,
                          purpose="evaluate")
    resolved = with_vocab(cfg, manifest.tokenizer.vocab_size, cfg.data.path)
    split = resolved.data.test_split if split is None else split
    evaluator = Evaluator(resolved.data.path, resolved.eval, rank=env.rank, world_size=env.world_size,
                          n_streams=resolved.eval_streams(env.world_size), micro_batch=resolved.eval_micro_batch(),
                          device=distributed.device_for(env), splits=[split])
    return resolved, evaluator, split


def with_vocab_if_unset(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """cfg with model.vocab_size = vocab_size where it is null (no checks: with_vocab makes them)."""
    if cfg.model.vocab_size is not None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


@contextmanager
def open_export(checkpoint_path: str) -> Iterator[tuple[Path, dict[str, Any], Any]]:
    """The tag a path names, verified, and the validated model config it was trained with (one process); the
    tag is held for reading while the block runs (load its weights inside it)."""
    tag_dir, hold = checkpoint.resolve_and_hold(checkpoint_path)
    try:
        run_info = checkpoint.checked_run_info(tag_dir)
        problem = checkpoint.verify(tag_dir)
        if problem:
            raise CheckpointError(f"checkpoint {tag_dir.name} is damaged: {problem}")
        yield tag_dir, run_info, model_config_from_dict(run_info["config"]["model"])
    finally:
        hold.release()
