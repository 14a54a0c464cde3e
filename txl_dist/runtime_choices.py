"""Run-time choices: what "auto" means for this run (train.precision, model.attn_impl), decided ONCE.

A choice made by measurement could come out differently on another start (other processes on the machine,
timing noise); a run and its resume that disagreed would break the bitwise-exact resume. So:

- rank 0 decides, every rank receives its answer (`agree`, a collective of start-up);
- an explicit value in the configuration always wins (an explicit bf16 on a CPU is timed against fp32 all
  the same, and a warning names it when it is the slower one); "auto" reuses the choice recorded in the checkpoint
  being resumed (run.json "run_choices") when it was made on the same device type, and is measured only
  for a new run; on another device type the recorded precision is kept (the checkpoint's optimizer state is
  in it) and the attention is chosen again;
- the trainer records the choices in every checkpoint's run.json.

precision "auto": bf16 on a CUDA device that supports it (compute capability 8.0 and above; a V100 or T4 only
emulates it, without bf16 tensor cores), else fp32; on a CPU bf16 only where the model's forward+backward at
the run's shapes (one layer's when the vocabulary is not known yet) runs at least BF16_MIN_SPEEDUP times faster
than in fp32 (AMX or AVX512-BF16 machines; on CPUs without bf16 units bf16 is several times slower).
fp16 is never chosen (it needs loss scaling and, on a CPU, kernels few have).
attn_impl "auto": of `candidate_attn_impls` timed at the run's shapes by `time_attn_impls`
(txl_dist/model/attention.py), the device's usual path (the static rule `resolve_attn_impl`) unless another is
ATTN_MIN_SPEEDUP times faster (then the fastest); the static rule alone where those are not available.

The peak FLOP/s of the MFU metric is found here too, once per RUN: train.peak_flops when set, else the
peak the checkpoint recorded when this job runs on the same kind of device (`device_kind`: device type and
name, CPU threads, precision, world size), else the table or a measurement (`flops.peak_flops`, the same
method for a new run and for a job on another device). A peak measured anew by each job would move MFU at
every resume by the noise of the measurement, not by anything the run did.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from . import distributed
from .config import RunConfig
from .distributed import DistEnv
from .flops import peak_flops, torch_threads

log = logging.getLogger(distributed.LOGGER_NAME)

BF16_MIN_SPEEDUP = 1.5
"""precision "auto" on a CPU picks bf16 only when the model's forward+backward runs this many times faster
than in fp32: DeepSpeed's bf16 step (fp32 master weights, casts) costs time the measurement does not see.
Measured (docs/performance.md): configs/tiny.json's model ran 1.2x faster in bf16 on an AMX machine, its
whole training steps were not faster."""
ATTN_MIN_SPEEDUP = 1.25
"""attn_impl "auto" leaves the device's usual path (resolve_attn_impl's: matmul on a CPU) only for a candidate
at least this many times faster. In a near tie the measured order flips from start to start (toy shapes on a
shared CPU: matmul 0.50-0.54 ms against sdpa 0.50-0.53), and two fresh runs of one config trained with paths
that round differently, so their losses parted at step 1 (the 8th significant digit; the 3rd with dropatt 0.1,
whose dropout the two paths draw differently; bench/config_sweep.py). A margin of 1.1 was not enough: at a
toy shape where the two paths tie within ~4% (bf16, batch 2, 4 heads of 16, 16 queries, 24 keys), 72 timings
on one thread gave matmul / sdpa ratios of 0.87-1.21 (the wall clock under load; 0.95-1.17 quiet, in the
thread's CPU time), and a config sweep's two fresh starts chose sdpa (1.13) and matmul (2026-12-06). Within
the margin the choice costs at most 20% of the attention's time, a smaller share of the step."""
MEASURE_SECONDS = 0.4
"""Time budget of each timed measurement (a few of them at start-up: well under 2 s in all)."""
MIN_TURNS = 3
"""Timed turns per precision, at the least, when the first EARLY_TURNS leave the choice open."""
CLEAR_FACTOR = 2.0
"""Best times after EARLY_TURNS turns whose fp32 / bf16 ratio lies this many times beyond the threshold (either
side) decide: on a shared machine the thread-time ratio varied by about +-15% from start to start
(docs/performance.md), and on a CPU without bf16 units (AMD Zen 3) tiny.json's bf16 ran 8.5-9.7x slower in
every turn, and the choice took 1.03-1.09 s instead of 2.02-2.16 s (then after one turn)."""
EARLY_TURNS = 2
"""Turns each precision takes before the choice may end early: never one. A single turn can be an outlier of
several times: inside the trainer, the first timed fp32 forward+backward of configs/tiny.json sometimes
faulted in ~5,000-6,000 fresh pages (the allocator had returned the warm-up's memory to the system) and took
82-118 ms of CPU time against 31-34 ms in every later turn, 3.2-4.4x the bf16 turn, so that one turn alone
chose bf16 for a model 1.3x faster in it (the threshold is 1.5x) in 3 of 4 starts (2026-12-06, Intel with
AMX). Each keeps its best time, so a second turn outvotes such a first."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunChoices:
    """What this run trains with, and where each value came from."""

    device_type: str
    """"cpu" or "cuda": a recorded choice is reused only on the same device type."""
    precision: str
    """"fp32", "bf16" or "fp16"."""
    attn_impl: str
    """A name of txl_dist.model.attention.ATTN_IMPLS."""
    origin: dict[str, str] = field(default_factory=dict)
    """Per choice: "config", "checkpoint", "device" (a rule of the device type) or "measured"."""
    measured: dict[str, Any] = field(default_factory=dict)
    """The numbers behind measured choices (seconds per call, FLOP/s)."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device in `precision` (train.peak_flops, the checkpoint's, the table, or measured)."""
    peak_source: str = ""
    """Where peak_flops comes from first (a reused peak keeps its source)."""
    peak_device: dict[str, Any] = field(default_factory=dict)
    """The kind of device peak_flops was found for (`device_kind`); a resumed job on the same kind reuses it."""
    peak_note: str = ""
    """How this job got the peak, when it is not the first of the run: reused from the checkpoint, or why
    it was found again."""

    def record(self) -> dict[str, Any]:
        """What run.json keeps: the choices, the numbers behind them, and the run's peak with its device."""
        recorded = {"device_type": self.device_type, "precision": self.precision, "attn_impl": self.attn_impl,
                    "origin": dict(self.origin), "measured": dict(self.measured)}
        if self.peak_flops:
            recorded["peak"] = {"flops_per_s": self.peak_flops, "source": self.peak_source,
                                "device": dict(self.peak_device)}
        return recorded

    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]


def agree(cfg: RunConfig, env: DistEnv, recorded: dict[str, Any] | None = None, *, peak: bool = True,
          training: bool = True) -> RunChoices:
    """The run's choices, decided on rank 0 and the same on every rank (collective; failures agreed).

    recorded: the "run_choices" of the checkpoint being resumed (None for a new run). peak: also find the
    peak FLOP/s (training; evaluation does not report MFU). training: the choices are for training steps.
    """
    device = distributed.device_for(env)
    decided = distributed.together(lambda: decide(cfg, device, recorded, peak=peak, world_size=env.world_size,
                                                  training=training) if env.is_main else None,
                                   "the run-time choices decided")
    choices = distributed.broadcast_object(decided)
    log.info("run-time choices: %s", describe(choices))
    return choices


def apply(cfg: RunConfig, choices: RunChoices) -> RunConfig:
    """cfg with the choices written in (train.precision and model.attn_impl name what the run does)."""
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, precision=choices.precision),
        model=dataclasses.replace(cfg.model, attn_impl=choices.attn_impl))


def decide(cfg: RunConfig, device: torch.device, recorded: dict[str, Any] | None = None, *,
           peak: bool = True, world_size: int = 1, training: bool = True) -> RunChoices:
    """The choices for a run on `device` (one process; `agree` runs this on rank 0 only)."""
    reuse = recorded if recorded and recorded.get("device_type") == device.type else None
    if recorded and reuse is None:
        log.warning("the checkpoint's run-time choices were made on %s, this job runs on %s: it keeps their "
                    "precision %s (the checkpoint's optimizer state is in it) and decides the rest again",
                    recorded.get("device_type"), device.type, recorded.get("precision"))
    origin: dict[str, str] = {}
    # The numbers behind reused choices stay with them (run.json and run_choices.json keep describing them).
    measured: dict[str, Any] = dict(reuse.get("measured") or {}) if reuse is not None else {}

    precision = cfg.precision()
    if precision is not None:
        origin["precision"] = "config"
        if precision == "bf16" and device.type == "cpu" and reuse is None:
            warn_if_slower_than_fp32(cfg, device, precision, measured)
    elif recorded and recorded.get("precision"):
        # On any device: DeepSpeed cannot load the checkpoint's optimizer state into another precision (the fit
        # check would refuse what a new decision chose, e.g. bf16 on a GPU for a run trained in fp32 on CPUs).
        precision, origin["precision"] = recorded["precision"], "checkpoint"
    else:
        precision, origin["precision"] = choose_precision(cfg, device, measured)

    if cfg.model.attn_impl != "auto":
        attn_impl, origin["attn_impl"] = cfg.model.attn_impl, "config"
    elif reuse is not None and (unfit := _unfit_attn_impl(cfg, device, DTYPES[precision], reuse["attn_impl"],
                                                          training)) is None:
        attn_impl, origin["attn_impl"] = reuse["attn_impl"], "checkpoint"
    else:
        if reuse is not None:
            log.warning("the checkpoint's model.attn_impl %r %s: choosing again", reuse["attn_impl"], unfit)
        attn_impl, origin["attn_impl"] = choose_attn_impl(cfg, device, DTYPES[precision], measured)

    kind = device_kind(device, precision, world_size)
    if cfg.train.peak_flops is not None:
        peak_value, source, note = cfg.train.peak_flops, "config: train.peak_flops", ""
    elif not peak:
        peak_value, source, note = 0.0, "not measured", ""
    else:
        peak_value, source, note = choose_peak(device, kind, recorded)
    return RunChoices(device.type, precision, attn_impl, origin, measured, float(peak_value), source,
                      kind if peak_value else {}, note)


REUSED_PEAK = "reused from the checkpoint: same device"


def choose_peak(device: torch.device, kind: dict[str, Any],
                recorded: dict[str, Any] | None) -> tuple[float, str, str]:
    """(peak FLOP/s of one device, its source, a note on how this job got it) when train.peak_flops is unset.

    recorded: the checkpoint's run choices (None: a new run). Their peak is reused when it was found on this
    kind of device; else the peak is found now (the table, or `peak_flops`' measurement: one method for a
    new run and for a resume on another device), and the note says why.
    """
    saved = (recorded or {}).get("peak")
    if saved and saved.get("device") == kind:
        return float(saved["flops_per_s"]), str(saved["source"]), REUSED_PEAK
    value, source = peak_flops(device, DTYPES[kind["precision"]], seconds=MEASURE_SECONDS)
    if recorded is None:
        return value, source, ""
    if not saved:
        return value, source, "found anew: the checkpoint records no peak"
    return value, source, f"found anew on this device: the checkpoint's is of {_kind_text(saved.get('device'))}"


def device_kind(device: torch.device, precision: str, world_size: int) -> dict[str, Any]:
    """What a peak FLOP/s depends on: the device type and model name (on a CPU also the threads per rank),
    the precision, and the world size (which sets a CPU rank's threads)."""
    kind: dict[str, Any] = {"type": device.type, "name": device_name(device)}
    if device.type == "cpu":
        kind["threads"] = torch.get_num_threads()
    return {**kind, "precision": precision, "world_size": world_size}


def device_name(device: torch.device) -> str:
    """The device's model name: torch's for a GPU, /proc/cpuinfo's "model name" for a CPU (platform's
    processor or machine elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _kind_text(kind: dict[str, Any] | None) -> str:
    if not kind:
        return "an unrecorded device"
    threads = f" x {kind['threads']} thread(s)" if "threads" in kind else ""
    return (f"{kind.get('type')} {kind.get('name')!r}{threads}, {kind.get('precision')}, "
            f"world size {kind.get('world_size')}")


AUTO_PRECISIONS = ("fp32", "bf16")
"""What precision "auto" can pick (choose_precision)."""


def choose_precision(cfg: RunConfig, device: torch.device, measured: dict[str, Any]) -> tuple[str, str]:
    """("bf16" or "fp32", origin) for precision "auto"; the numbers behind it go into `measured`."""
    if device.type == "cuda":
        # Not torch's default, which counts a GPU that only emulates bf16 (compute capability below 8.0: V100, T4,
        # without bf16 tensor cores) as supporting it; PEAK_TABLE has no bf16 peak for them either.
        return ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"), "device"
    if device.type != "cpu":
        return "fp32", "device"
    seconds = _timed_precisions(cfg, device, "bf16", measured, threshold=BF16_MIN_SPEEDUP)
    faster = seconds["fp32"] / seconds["bf16"]
    return ("bf16" if faster >= BF16_MIN_SPEEDUP else "fp32"), "measured"


def warn_if_slower_than_fp32(cfg: RunConfig, device: torch.device, precision: str,
                             measured: dict[str, Any]) -> None:
    """A warning when the configured `precision` trains slower than fp32 on this CPU (timed as "auto" times it;
    the numbers go into `measured`). Where a CPU has no bf16 matmul units, bf16 runs several times slower than
    fp32 and nothing else would say so; the run keeps the precision it was given. A new run only: a resumed
    one was warned at its first start."""
    seconds = _timed_precisions(cfg, device, precision, measured, threshold=1.0)
    if seconds[precision] > seconds["fp32"]:
        log.warning("train.precision %s: on this CPU the %s forward+backward measured %.1fx SLOWER in %s than in "
                    "fp32 (%.1f against %.1f ms, one thread); this run trains in %s as configured, slower than it "
                    "would in fp32: precision \"auto\" (or \"fp32\") picks the faster one",
                    precision, measured["timed"], seconds[precision] / seconds["fp32"], precision,
                    seconds[precision] * 1e3, seconds["fp32"] * 1e3, precision)


def _timed_precisions(cfg: RunConfig, device: torch.device, precision: str, measured: dict[str, Any], *,
                      threshold: float) -> dict[str, float]:
    """time_precisions of fp32 and `precision`, the numbers also written into `measured` (run.json keeps them);
    the question is whether fp32's time over `precision`'s reaches `threshold`, so early turns far from it
    end the measurement (clearly_decided)."""
    measured["timed"] = "model" if cfg.model.vocab_size is not None else "one layer"
    seconds = time_precisions(cfg, device, ("fp32", precision),
                              decided=lambda best: clearly_decided(best["fp32"] / best[precision], threshold))
    for name, value in seconds.items():
        measured[f"fwd_bwd_s_{name}"] = value
    return seconds


def _unfit_attn_impl(cfg: RunConfig, device: torch.device, dtype: torch.dtype, name: str,
                     training: bool) -> str | None:
    """Why a recorded attention implementation cannot serve this job, or None when it can: a resumed run may
    have raised model.dropatt, which FlexAttention does not have (the model would refuse it after start-up)."""
    from .model import attention

    if name == "triton" and name not in attention.candidate_attn_impls(device, dtype, training=False, dropatt=0.0):
        return "runs on CUDA only, with the triton package"
    if not training or name in attention.candidate_attn_impls(device, dtype, training=True, dropatt=cfg.model.dropatt):
        return None
    if name == "flex" and cfg.model.dropatt > 0:
        return f"has no attention dropout and model.dropatt is now {cfg.model.dropatt}"
    return f"is not one this job may train with on {device.type}"


def choose_attn_impl(cfg: RunConfig, device: torch.device, dtype: torch.dtype,
                     measured: dict[str, Any]) -> tuple[str, str]:
    """(implementation name, origin) for attn_impl "auto": the device's usual path, unless a candidate measured
    at the run's shapes runs at least ATTN_MIN_SPEEDUP times faster (then the fastest)."""
    from .model import attention

    time_impls = getattr(attention, "time_attn_impls", None)
    candidates_for = getattr(attention, "candidate_attn_impls", None)
    if time_impls is None or candidates_for is None:
        return attention.resolve_attn_impl("auto", device, dtype), "device"
    m = cfg.model
    candidates = candidates_for(device, dtype, training=True, dropatt=m.dropatt)
    if len(candidates) == 1:
        return candidates[0], "device"
    with timing_clock(device) as clock:  # on a CPU as the precisions are timed: one thread, its CPU seconds
        seconds = time_impls(candidates, batch=cfg.micro_batch(), n_head=m.n_head, d_head=m.d_head,
                             qlen=m.tgt_len, klen=m.tgt_len + m.mem_len, device=device, dtype=dtype, training=True,
                             clock=clock)
    measured["attn_s"] = {name: float(s) for name, s in seconds.items()}
    fastest = min(seconds, key=seconds.get)
    usual = attention.resolve_attn_impl("auto", device, dtype)
    if usual in seconds and seconds[usual] <= seconds[fastest] * ATTN_MIN_SPEEDUP:
        return usual, "measured"
    return fastest, "measured"


def clearly_decided(ratio: float, threshold: float) -> bool:
    """Whether a measured ratio is so far from the threshold it is compared with (CLEAR_FACTOR times, either
    side) that more turns could not move it across."""
    return ratio >= threshold * CLEAR_FACTOR or ratio <= threshold / CLEAR_FACTOR


def time_precisions(cfg: RunConfig, device: torch.device, dtypes: tuple[str, ...] = ("fp32", "bf16"), *,
                    seconds: float = MEASURE_SECONDS,
                    decided: Callable[[dict[str, float]], bool] | None = None) -> dict[str, float]:
    """Seconds per forward+backward at the run's shapes, per precision name: of the whole model when
    model.vocab_size is known (embeddings and adaptive softmax included), else of one Transformer-XL layer.

    The precisions take turns, repeat after repeat, for about `seconds` (at least MIN_TURNS each), and each
    keeps its best time: a burst of load from other processes then hits both alike instead of the one measured
    while it lasted. `decided`, given the best times after EARLY_TURNS turns, may end it there: the caller's
    question is already answered (clearly_decided). On a CPU the steps run on ONE thread and are timed in that
    thread's CPU seconds (time.thread_time; a CPU's autograd runs on the calling thread): the time the process
    spends preempted is not counted, and no thread waits at a barrier for a preempted one. On a shared 2-core
    machine at load average 10-15, configs/tiny.json's fp32 / bf16 ratio timed by the wall clock on 2 threads
    ranged 0.40-2.38 (8 starts), enough to flip a clear choice, which the run keeps to its end; timed so,
    1.24-1.66 (docs/performance.md).
    """
    make_step = _model_step if cfg.model.vocab_size is not None else _layer_step
    with timing_clock(device) as clock:
        steps = {name: make_step(cfg, device, DTYPES[name]) for name in dtypes}
        for step in steps.values():
            step()  # warm-up: kernel selection, allocations
        best = dict.fromkeys(steps, float("inf"))
        end, rounds = time.perf_counter() + seconds, 0
        while rounds < MIN_TURNS or time.perf_counter() < end:
            for name, step in steps.items():
                start = clock()
                step()
                best[name] = min(best[name], clock() - start)
            rounds += 1
            if rounds == EARLY_TURNS and decided is not None and decided(best):
                break
    return best


@contextlib.contextmanager
def timing_clock(device: torch.device) -> Iterator[Callable[[], float]]:
    """The clock start-up's timings read on `device`, inside the setting they run in: on a CPU one torch thread
    and that thread's CPU seconds (time.thread_time: time preempted is not counted; time_precisions says why),
    elsewhere the wall clock."""
    if device.type != "cpu":
        yield time.perf_counter
        return
    with torch_threads(1):
        yield time.thread_time


def _model_step(cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """The model's forward+backward on one micro batch (with a full memory) in `dtype`, as a function to time."""
    from .model import TransformerXL

    m = cfg.model
    torch.manual_seed(0)
    model = TransformerXL(m).to(device=device, dtype=dtype)
    batch = cfg.micro_batch()
    input_ids = torch.randint(0, m.vocab_size, (batch, m.tgt_len), device=device)  # [B, T]
    # Labels skewed to the frequent ids, as text is: the adaptive softmax's tails see their usual share.
    labels = (torch.rand(batch, m.tgt_len, device=device) ** 4 * m.vocab_size).long()  # [B, T]
    mems = [torch.randn(batch, m.mem_len, m.d_model, device=device, dtype=dtype) for _ in range(m.n_layer)]

    def step() -> None:
        out = model(input_ids, labels, mems)
        out.nll.mean().backward()

    return step


def _layer_step(cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """One layer's forward+backward at the run's shapes in `dtype`, as a function to time."""
    from .model.attention import ATTN_IMPLS, attn_bias_from_mask, build_attn_mask, resolve_attn_impl
    from .model.layer import TransformerXLLayer

    m = cfg.model
    batch = min(cfg.micro_batch(), 4)  # the per-token speed is what counts; keeps large presets quick
    torch.manual_seed(0)
    layer = TransformerXLLayer(m.d_model, m.n_head, m.d_head, m.d_inner, m.dropout, m.dropatt, m.pre_lnorm,
                               m.layer_norm_epsilon, untie_r=True).to(device=device, dtype=dtype)
    torch.nn.init.normal_(layer.attn.r_w_bias, 0.0, 0.02)
    torch.nn.init.normal_(layer.attn.r_r_bias, 0.0, 0.02)
    klen = m.tgt_len + m.mem_len
    h = torch.randn(batch, m.tgt_len, m.d_model, device=device, dtype=dtype, requires_grad=True)  # [B, T, d]
    mem = torch.randn(batch, m.mem_len, m.d_model, device=device, dtype=dtype)    # [B, M, d]
    pos_emb = torch.randn(klen, m.d_model, device=device, dtype=dtype)            # [K, d]
    attn_bias = attn_bias_from_mask(build_attn_mask(m.tgt_len, m.mem_len, m.mem_len, False, device), dtype)
    attn_fn = ATTN_IMPLS[resolve_attn_impl("auto", device, dtype)]

    def step() -> None:
        out = layer(h, pos_emb, mem, attn_bias, attn_fn)                          # [B, T, d]
        out.float().sum().backward()

    return step


def describe(choices: RunChoices) -> str:
    """One line: each choice, where it came from, and the measured numbers."""
    parts = [f"precision {choices.precision} ({choices.origin.get('precision', '?')})",
             f"attn_impl {choices.attn_impl} ({choices.origin.get('attn_impl', '?')})"]
    numbers = choices.measured
    if choices.origin.get("precision") == "measured":  # reused numbers are the checkpoint's, not this job's
        parts.append(f"{numbers['timed']} fwd+bwd {numbers['fwd_bwd_s_fp32'] * 1e3:.1f} ms fp32 / "
                     f"{numbers['fwd_bwd_s_bf16'] * 1e3:.1f} ms bf16")
    if choices.origin.get("attn_impl") == "measured":
        parts.append("attention " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in numbers["attn_s"].items()))
    if choices.peak_flops:
        note = f"; {choices.peak_note}" if choices.peak_note else ""
        parts.append(f"peak {choices.peak_flops / 1e12:.3g} TFLOP/s per device ({choices.peak_source}{note})")
    return " | ".join(parts)

