"""Run-time choices (train.precision and model.attn_impl "auto"): decided once on rank 0, the same on every
rank, recorded in the checkpoint and reused on resume; explicit values win; the MFU metric in the journal."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import learnable_stream, run_ranks, tiny_config, write_corpus
from txl_dist import runtime_choices
from txl_dist.config import ConfigError, config_from_dict, load_config
from txl_dist.flops import cluster_token_shares, flops_per_token

VOCAB = 64
TRAIN_TOKENS = 4 * 49  # S = 4 streams of L = 49: rank 0 of one holds them all
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("choices") / "corpus"
    return write_corpus(root, {"train": learnable_stream(TRAIN_TOKENS, VOCAB, 0),
                               "valid": learnable_stream(80, VOCAB, 1), "test": learnable_stream(80, VOCAB, 2)},
                        vocab_size=VOCAB)


def _cfg(tmp_path, **train):
    return config_from_dict(tiny_config(tmp_path / "corpus", tmp_path / "run", train=train,
                                        model={"attn_impl": "auto"}))


def _layer_times(monkeypatch, fp32_s: float, bf16_s: float) -> list[str]:
    """Make the layer measurement report these times; returns the precisions it was asked for."""
    asked: list[str] = []

    def fake(cfg, device, dtypes, **_):
        asked.extend(dtypes)
        return {"fp32": fp32_s, "bf16": bf16_s}

    monkeypatch.setattr(runtime_choices, "time_precisions", fake)
    return asked


def _peaks(monkeypatch, value: float = 1.07e11) -> list[tuple]:
    """Make the peak measurement answer `value`; returns the (device type, dtype, seconds) it was asked for."""
    asked: list[tuple] = []

    def fake(device, dtype, *, seconds):
        asked.append((torch.device(device).type, dtype, seconds))
        return value, f"measured: fake {value:g}"

    monkeypatch.setattr(runtime_choices, "peak_flops", fake)
    return asked


# ----------------------------------------------------------------------------------------------------
# One process: the rules


@pytest.mark.parametrize("fp32_s,bf16_s,expected", [(2.0, 1.0, "bf16"), (1.3, 1.0, "fp32"), (1.0, 3.0, "fp32")])
def test_auto_precision_on_cpu_picks_bf16_only_when_measured_faster_by_a_margin(tmp_path, monkeypatch, fp32_s,
                                                                                 bf16_s, expected):
    asked = _layer_times(monkeypatch, fp32_s, bf16_s)
    peaks = _peaks(monkeypatch)
    choices = runtime_choices.decide(_cfg(tmp_path, precision="auto"), torch.device("cpu"))
    assert choices.precision == expected and choices.origin["precision"] == "measured"
    assert sorted(asked) == ["bf16", "fp32"]
    assert choices.measured["fwd_bwd_s_fp32"] == fp32_s and choices.measured["fwd_bwd_s_bf16"] == bf16_s
    # The peak of the chosen precision, measured as a resume on another device measures it: one method.
    assert peaks == [("cpu", runtime_choices.DTYPES[expected], runtime_choices.MEASURE_SECONDS)]
    assert (choices.peak_flops, choices.peak_note) == (1.07e11, "")


@pytest.mark.parametrize("major, expected", [(8, "bf16"), (9, "bf16"), (7, "fp32")])
def test_auto_precision_on_cuda_picks_bf16_only_where_the_gpu_has_it(tmp_path, monkeypatch, major, expected):
    """torch.cuda.is_bf16_supported() counts a GPU that can merely hold bf16 tensors (compute capability 7.x: V100,
    T4, without bf16 tensor cores) as supporting it, and "auto" trained such a GPU in emulated bf16. torch's own
    function runs here, on a CUDA device of that capability as torch's stand-ins describe it."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"major": major}))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True, raising=False)
    precision, origin = runtime_choices.choose_precision(_cfg(tmp_path, precision="auto"), torch.device("cuda"), {})
    assert (precision, origin) == (expected, "device")


@pytest.mark.parametrize("vocab_size", [None, VOCAB])  # one layer before the corpus is read; then the model
def test_the_real_measurement_runs_at_the_run_shapes(tmp_path, vocab_size):
    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    seconds = runtime_choices.time_precisions(cfg, torch.device("cpu"), ("fp32", "bf16"), seconds=0.01)
    assert set(seconds) == {"fp32", "bf16"} and all(0 < s < 10 for s in seconds.values())


def test_the_cpu_measurement_counts_one_threads_cpu_time_not_waits(tmp_path, monkeypatch):
    """A step that waits (as a process preempted by others on a shared machine does) costs no measured time;
    the steps run on one thread, and the process's threads are restored after."""
    threads_seen = []

    def waiting_step(cfg, device, dtype):
        def step():
            threads_seen.append(torch.get_num_threads())
            time.sleep(0.05)
        return step

    monkeypatch.setattr(runtime_choices, "_model_step", waiting_step)
    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
    before = torch.get_num_threads()
    seconds = runtime_choices.time_precisions(cfg, torch.device("cpu"), ("fp32", "bf16"), seconds=0.01)
    assert all(s < 0.02 for s in seconds.values()), seconds  # the wall clock would say >= 0.05
    assert set(threads_seen) == {1} and len(threads_seen) >= 2 * 4  # a warm-up and >= 3 turns each
    assert torch.get_num_threads() == before


def _spinning_steps(monkeypatch, ms: dict[str, float | list[float]]) -> dict[str, int]:
    """Steps that burn `ms[precision]` milliseconds of this thread's CPU time (a list: per call, its last value
    for the calls after); returns the calls per precision."""
    calls = dict.fromkeys(ms, 0)

    def make(cfg, device, dtype):
        name = next(n for n, d in runtime_choices.DTYPES.items() if d == dtype)

        def step():
            per_call = ms[name] if isinstance(ms[name], list) else [ms[name]]
            end = time.thread_time() + per_call[min(calls[name], len(per_call) - 1)] / 1e3
            calls[name] += 1
            while time.thread_time() < end:
                pass
        return step

    monkeypatch.setattr(runtime_choices, "_model_step", make)
    return calls


@pytest.mark.parametrize("fp32_ms,bf16_ms,turns,expected", [  # turns: EARLY_TURNS, or MIN_TURNS and more
    (4.0, 40.0, 2, "fp32"),   # bf16 10x slower (a CPU without bf16 units): the early turns decide
    (30.0, 3.0, 2, "bf16"),   # 10x faster
    (7.0, 4.0, 3, "bf16"),    # 1.75x: near the threshold, every turn is taken
    (4.0, 5.0, 3, "fp32"),    # 0.8x: not clear of 1.5 / CLEAR_FACTOR
    # The first timed fp32 turn 3.5x slow (fresh pages faulted in, as seen inside the trainer), then 1.3x bf16's
    # time: one turn alone would have chosen bf16 (3.5 / 1 is clear of 1.5 x CLEAR_FACTOR).
    ([4.0, 14.0, 4.0], 3.0, 3, "fp32"),
])
def test_early_turns_far_from_the_threshold_end_the_measurement(tmp_path, monkeypatch, fp32_ms, bf16_ms, turns,
                                                                 expected):
    calls = _spinning_steps(monkeypatch, {"fp32": fp32_ms, "bf16": bf16_ms})
    cfg = _cfg(tmp_path, precision="auto", peak_flops=5e9)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
    choices = runtime_choices.decide(cfg, torch.device("cpu"))
    assert choices.precision == expected
    assert calls["fp32"] == calls["bf16"]  # a warm-up, then the timed turns (more for MEASURE_SECONDS)
    if turns == runtime_choices.EARLY_TURNS:
        assert calls["fp32"] == 1 + runtime_choices.EARLY_TURNS
    else:
        assert calls["fp32"] >= 1 + runtime_choices.MIN_TURNS


def test_an_explicit_bf16_is_measured_against_its_own_question(tmp_path, monkeypatch):
    """Is bf16 slower than fp32 at all (threshold 1): 2.7x faster is clear of it; 1.3x slower is not."""
    for bf16_ms, decided_at_once in [(1.5, True), (5.2, False)]:
        calls = _spinning_steps(monkeypatch, {"fp32": 4.0, "bf16": bf16_ms})
        cfg = _cfg(tmp_path, precision="bf16", peak_flops=5e9)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))
        runtime_choices.decide(cfg, torch.device("cpu"))
        assert calls["fp32"] == calls["bf16"], calls
        early = 1 + runtime_choices.EARLY_TURNS
        assert (calls["fp32"] == early) == decided_at_once and calls["fp32"] >= early, (bf16_ms, calls)


def test_clearly_decided_needs_the_factor_on_either_side():
    f = runtime_choices.CLEAR_FACTOR
    assert runtime_choices.clearly_decided(1.5 * f, 1.5) and runtime_choices.clearly_decided(1.5 / f, 1.5)
    assert not runtime_choices.clearly_decided(1.5 * f * 0.99, 1.5)
    assert not runtime_choices.clearly_decided(1.5 / f * 1.01, 1.5)


@pytest.mark.parametrize("precision", ["fp32", None])
def test_an_explicit_precision_wins_without_measuring(tmp_path, monkeypatch, precision):
    asked = _layer_times(monkeypatch, 1.0, 1.0)
    choices = runtime_choices.decide(_cfg(tmp_path, precision=precision, peak_flops=5e9), torch.device("cpu"))
    assert choices.precision == (precision or "fp32") and choices.origin["precision"] == "config"
    assert asked == []
    assert (choices.peak_flops, choices.peak_source) == (5e9, "config: train.peak_flops")


@pytest.mark.parametrize("fp32_s,bf16_s,warned", [(1.0, 6.5, True), (1.0, 1.02, True), (2.0, 1.0, False)])
def test_an_explicit_bf16_on_a_cpu_is_kept_and_named_when_it_is_slower_than_fp32(tmp_path, monkeypatch, caplog,
                                                                                  fp32_s, bf16_s, warned):
    """A CPU without bf16 matmul units runs bf16 several times slower than fp32: the run trains as configured,
    and one warning says so with the numbers (which run.json keeps); a resumed run measures nothing."""
    asked = _layer_times(monkeypatch, fp32_s, bf16_s)
    cfg = _cfg(tmp_path, precision="bf16", peak_flops=5e9)
    with caplog.at_level("WARNING", logger=runtime_choices.log.name):
        choices = runtime_choices.decide(cfg, torch.device("cpu"))
    assert (choices.precision, choices.origin["precision"]) == ("bf16", "config")
    assert sorted(asked) == ["bf16", "fp32"]
    assert (choices.measured["fwd_bwd_s_fp32"], choices.measured["fwd_bwd_s_bf16"]) == (fp32_s, bf16_s)
    lines = [r.getMessage() for r in caplog.records if "train.precision bf16" in r.getMessage()]
    if warned:
        assert len(lines) == 1, lines
        assert f"{bf16_s / fp32_s:.1f}x SLOWER in bf16" in lines[0] and 'precision "auto"' in lines[0]
        assert f"{bf16_s * 1e3:.1f} against {fp32_s * 1e3:.1f} ms" in lines[0]
    else:
        assert lines == []
    asked.clear()
    resumed = runtime_choices.decide(cfg, torch.device("cpu"), choices.record())
    assert resumed.precision == "bf16" and asked == []


def test_a_recorded_flex_that_cannot_train_with_this_config_is_chosen_again(tmp_path, monkeypatch, caplog):
    """A resumed run that raised model.dropatt can no longer train with the FlexAttention its first start chose
    (no attention dropout): start-up chooses again, with one warning, instead of the model refusing it after
    start-up. Evaluation keeps the recorded flex (no dropout there)."""
    _layer_times(monkeypatch, 1.0, 5.0)
    timed = []
    monkeypatch.setattr("txl_dist.model.attention.time_attn_impls",
                        lambda names, **_: timed.append(names) or {n: 1.0 + i for i, n in enumerate(names)})
    cfg = _cfg(tmp_path, precision="auto", peak_flops=5e9)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropatt=0.1))
    recorded = {"device_type": "cpu", "precision": "fp32", "attn_impl": "flex"}
    with caplog.at_level("WARNING", logger=runtime_choices.log.name):
        choices = runtime_choices.decide(cfg, torch.device("cpu"), recorded)
    assert (choices.attn_impl, choices.origin["attn_impl"]) == ("matmul", "measured") and timed
    lines = [r.getMessage() for r in caplog.records if "attn_impl 'flex'" in r.getMessage()]
    assert len(lines) == 1 and "model.dropatt is now 0.1: choosing again" in lines[0], lines
    assert choices.precision == "fp32" and choices.origin["precision"] == "checkpoint"
    evaluation = runtime_choices.decide(cfg, torch.device("cpu"), recorded, peak=False, training=False)
    assert (evaluation.attn_impl, evaluation.origin["attn_impl"]) == ("flex", "checkpoint")


def test_a_recorded_choice_is_reused_on_the_same_device_type_only(tmp_path, monkeypatch):
    asked = _layer_times(monkeypatch, 1.0, 5.0)  # a new measurement would say fp32
    cfg = _cfg(tmp_path, precision="auto")
    recorded = {"device_type": "cpu", "precision": "bf16", "attn_impl": "sdpa"}
    choices = runtime_choices.decide(cfg, torch.device("cpu"), recorded)
    assert (choices.precision, choices.attn_impl) == ("bf16", "sdpa") and asked == []
    assert choices.origin == {"precision": "checkpoint", "attn_impl": "checkpoint"}
    # From another kind of device: the attention is chosen again; the precision is kept, because the
    # checkpoint's optimizer state is in it (a new measurement would say fp32 here, which the fit check refuses).
    elsewhere = runtime_choices.decide(cfg, torch.device("cpu"), dict(recorded, device_type="cuda"))
    assert elsewhere.precision == "bf16" and elsewhere.origin["precision"] == "checkpoint"
    assert elsewhere.origin["attn_impl"] != "checkpoint"


def test_a_resumed_job_on_the_same_kind_of_device_keeps_the_runs_peak(tmp_path, monkeypatch):
    """One run, one peak: MFU must not jump at a resume by the noise of a new measurement."""
    _layer_times(monkeypatch, 1.0, 5.0)
    _peaks(monkeypatch, 1.07e11)
    cfg = _cfg(tmp_path, precision="auto")
    first = runtime_choices.decide(cfg, torch.device("cpu"), world_size=2)
    recorded = json.loads(json.dumps(first.record()))  # as run.json keeps it
    assert recorded["peak"] == {"flops_per_s": 1.07e11, "source": "measured: fake 1.07e+11",
                                "device": runtime_choices.device_kind(torch.device("cpu"), "fp32", 2)}

    asked = _peaks(monkeypatch, 1.72e11)  # what a new measurement would say now
    resumed = runtime_choices.decide(cfg, torch.device("cpu"), recorded, world_size=2)
    assert asked == [] and (resumed.peak_flops, resumed.peak_source) == (1.07e11, "measured: fake 1.07e+11")
    assert resumed.record()["peak"] == recorded["peak"] and resumed.measured == first.measured
    assert "(measured: fake 1.07e+11; reused from the checkpoint: same device)" in runtime_choices.describe(resumed)

    # Another kind of device measures again, and says why.
    for changed, world_size in [({"name": "Other CPU"}, 2), ({}, 4), ({"threads": 99}, 2)]:
        other = dict(recorded, peak=dict(recorded["peak"], device={**recorded["peak"]["device"], **changed}))
        again = runtime_choices.decide(cfg, torch.device("cpu"), other, world_size=world_size)
        assert again.peak_flops == 1.72e11 and again.peak_note.startswith("found anew on this device: the checkpoint's")
        assert "found anew on this device" in runtime_choices.describe(again)
    on_gpu = dict(recorded, device_type="cuda", peak=dict(recorded["peak"], device={**recorded["peak"]["device"],
                                                                                  "type": "cuda"}))
    assert "is of cuda" in runtime_choices.decide(cfg, torch.device("cpu"), on_gpu).peak_note
    older = {key: value for key, value in recorded.items() if key != "peak"}  # a checkpoint from before
    assert runtime_choices.decide(cfg, torch.device("cpu"), older, world_size=2).peak_note == \
        "found anew: the checkpoint records no peak"
    assert len(asked) == 5
    # train.peak_flops still wins.
    explicit = runtime_choices.decide(_cfg(tmp_path, precision="auto", peak_flops=5e9), torch.device("cpu"), recorded,
                                      world_size=2)
    assert (explicit.peak_flops, explicit.peak_source) == (5e9, "config: train.peak_flops")


def test_auto_attention_takes_the_fastest_measured_candidate(tmp_path, monkeypatch):
    from txl_dist.model import attention

    calls = []

    def time_attn_impls(names, **shapes):
        calls.append((list(names), shapes | {"threads": torch.get_num_threads()}))
        return {"matmul": 2.0, "sdpa": 1.0, "reference": 3.0}

    monkeypatch.setattr(attention, "time_attn_impls", time_attn_impls, raising=False)
    monkeypatch.setattr(attention, "candidate_attn_impls",
                        lambda device, dtype, *, training, dropatt: ["matmul", "sdpa", "reference"], raising=False)
    cfg = _cfg(tmp_path, precision="fp32")
    choices = runtime_choices.decide(cfg, torch.device("cpu"))
    assert choices.attn_impl == "sdpa" and choices.origin["attn_impl"] == "measured"
    (names, shapes), = calls
    m = cfg.model
    assert shapes == {"batch": cfg.micro_batch(), "n_head": m.n_head, "d_head": m.d_head, "qlen": m.tgt_len,
                      "klen": m.tgt_len + m.mem_len, "device": torch.device("cpu"), "dtype": torch.float32,
                      "training": True, "clock": time.thread_time, "threads": 1}  # on a CPU as the precisions are
    explicit = runtime_choices.decide(config_from_dict(tiny_config(tmp_path, tmp_path, train={"precision": "fp32"},
                                                                   model={"attn_impl": "reference"})),
                                      torch.device("cpu"))
    assert explicit.attn_impl == "reference" and explicit.origin["attn_impl"] == "config" and len(calls) == 1


@pytest.mark.parametrize("sdpa_s, chosen", [(0.95, "matmul"), (1.0 / runtime_choices.ATTN_MIN_SPEEDUP + 1e-6,
                                                                  "matmul"), (0.75, "sdpa")])
def test_auto_attention_leaves_the_usual_path_only_for_a_clearly_faster_one(tmp_path, monkeypatch, sdpa_s, chosen):
    """In a near tie the measured order flips from start to start, and two fresh runs of one config would train
    with paths that round differently: "auto" keeps the device's usual path (matmul on a CPU) unless another
    runs at least ATTN_MIN_SPEEDUP times faster."""
    from txl_dist.model import attention

    monkeypatch.setattr(attention, "time_attn_impls", lambda names, **_: {"matmul": 1.0, "sdpa": sdpa_s})
    choices = runtime_choices.decide(_cfg(tmp_path, precision="fp32"), torch.device("cpu"))
    assert (choices.attn_impl, choices.origin["attn_impl"]) == (chosen, "measured")
    assert choices.record()["measured"]["attn_s"] == {"matmul": 1.0, "sdpa": sdpa_s}


def test_precision_in_the_config(tmp_path):
    raw = tiny_config(tmp_path, tmp_path, train={"precision": "auto"}, deepspeed={"bf16": {"enabled": False}})
    with pytest.raises(ConfigError, match=r"train.precision: \"auto\" conflicts with deepspeed.bf16.enabled"):
        config_from_dict(raw)
    raw = tiny_config(tmp_path, tmp_path, train={"precision": "fp32"}, deepspeed={"bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="conflicts with deepspeed.bf16.enabled true"):
        config_from_dict(raw)
    with pytest.raises(ConfigError, match="train.precision: 'fp8' is unknown"):
        config_from_dict(tiny_config(tmp_path, tmp_path, train={"precision": "fp8"}))
    agreeing = config_from_dict(tiny_config(tmp_path, tmp_path, train={"precision": "bf16"},
                                            deepspeed={"bf16": {"enabled": True}}))
    assert agreeing.precision() == "bf16"
    ds = _cfg(tmp_path, precision="bf16").deepspeed_config(1)
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert _cfg(tmp_path, precision="auto").precision() is None
    assert _cfg(tmp_path).precision() == "fp32"  # null: the deepspeed section (no bf16/fp16 there)
    tiny = load_config(REPO / "configs" / "tiny.json")
    assert tiny.train.precision == "auto" and tiny.precision() is None


# ----------------------------------------------------------------------------------------------------
# Real processes


def _agree_with_own_measurement(raw: dict) -> dict:
    """Rank r measures bf16 as fast (rank 0) or slow (rank 1); every rank must get rank 0's choice."""
    from txl_dist import distributed

    env = distributed.discover()
    asked = []

    def fake(cfg, device, dtypes, **_):
        asked.extend(dtypes)
        bf16_faster = env.rank == 0
        return {"fp32": 3.0, "bf16": 1.0 if bf16_faster else 9.0}

    runtime_choices.time_precisions = fake  # this process only (a forked rank)
    distributed.init_process_group(env)
    try:
        choices = runtime_choices.agree(config_from_dict(raw), env)
    finally:
        distributed.destroy_process_group()
    return {"choices": choices.record(), "peak": choices.peak_flops, "asked": asked}


def test_two_ranks_get_rank_0s_choice_even_when_their_own_measurement_differs(tmp_path):
    raw = tiny_config(tmp_path / "corpus", tmp_path / "run", train={"precision": "auto"})
    rank0, rank1 = run_ranks(_agree_with_own_measurement, 2, raw)
    assert rank0["choices"]["precision"] == rank1["choices"]["precision"] == "bf16"
    assert rank0["choices"] == rank1["choices"] and rank0["peak"] == rank1["peak"] > 0
    assert sorted(rank0["asked"]) == ["bf16", "fp32"] and rank1["asked"] == []


def _train_measure_resume(runs: list[tuple[dict, str, float | None]]) -> list[dict]:
    """Training jobs in a row on this rank; before each, the layer measurement says bf16 is `speedup` times
    faster (None: any measurement fails the job). Returns per job what it chose and what it wrote."""
    from txl_dist import distributed, trainer
    from txl_dist.checkpoint import read_latest, read_run_info
    from txl_dist.engine import model_dtype

    env = distributed.discover()
    distributed.setup_logging(env)
    distributed.init_process_group(env)
    out = []
    try:
        for raw, resume, speedup in runs:
            def fake(cfg, device, dtypes, speedup=speedup, **_):
                if speedup is None:
                    raise AssertionError("measured again although the checkpoint records the choice")
                return {"fp32": speedup, "bf16": 1.0}

            runtime_choices.time_precisions = fake
            cfg = config_from_dict(raw)
            try:
                t = trainer.build(cfg, env, resume=resume)
            except Exception as e:  # a refusal: its one line
                out.append({"error": str(e)})
                continue
            try:
                t.train()
            finally:
                t.close()
            ckpt = cfg.checkpoint_dir()
            out.append({"choices": t.start.choices.record(), "dtype": str(model_dtype(t.engine.config)),
                        "saved": read_run_info(ckpt / read_latest(ckpt))["run_choices"], "step": t.step,
                        "flops_per_token": t.flops_per_token, "peak": t.peak_flops})
    finally:
        distributed.destroy_process_group()
    return out


def test_auto_precision_is_recorded_reused_on_resume_and_a_change_is_refused(corpus, tmp_path):
    run = tmp_path / "run"
    first = tiny_config(corpus, run, train={"precision": "auto", "exit_step": 2, "peak_flops": 1e9},
                        tracking={"enabled": True})
    again = tiny_config(corpus, run, train={"precision": "auto", "exit_step": 3})
    other = tiny_config(corpus, run, train={"precision": "fp32"})
    (job1, job2, job3), = run_ranks(_train_measure_resume, 1, [(first, "none", 4.0), (again, "auto", None),
                                                               (other, "auto", None)], timeout=600)
    assert job1["choices"]["precision"] == "bf16" and job1["choices"]["origin"]["precision"] == "measured"
    assert job1["dtype"] == "torch.bfloat16" and job1["saved"] == job1["choices"]
    # The resumed job did not measure (its measurement would have failed) and trains in the recorded bf16.
    assert job2["step"] == 3 and job2["dtype"] == "torch.bfloat16"
    assert job2["choices"]["precision"] == "bf16" and job2["choices"]["origin"]["precision"] == "checkpoint"
    assert job2["saved"]["precision"] == "bf16"
    # ... and keeps the run's peak (train.peak_flops of the first job) for its MFU, without measuring one.
    assert job1["saved"]["peak"]["flops_per_s"] == job2["saved"]["peak"]["flops_per_s"] == job2["peak"] == 1e9
    assert "trained in bf16, this run would be fp32" in job3["error"]

    # MFU in the journal, each step: its definition, with FLOPs per token computed here from the tokens.
    cfg = config_from_dict(first)
    model = dataclasses.replace(cfg.model, vocab_size=VOCAB)
    tokens = learnable_stream(TRAIN_TOKENS, VOCAB, 0)
    per_token = flops_per_token(model, micro_batch=cfg.micro_batch(),
                                cluster_shares=cluster_token_shares(tokens, model.cutoffs, VOCAB))
    assert job1["flops_per_token"] == pytest.approx(per_token)
    lines = [json.loads(line) for line in (run / "tracking" / "metrics.jsonl").read_text().splitlines()]
    steps = [rec["metrics"] for rec in lines if "train/mfu" in rec["metrics"]]
    assert len(steps) == 2
    for m in steps:
        assert m["train/model_flops_per_s"] == pytest.approx(m["train/tokens_per_s"] * per_token)
        assert m["train/mfu"] == pytest.approx(m["train/model_flops_per_s"] / (1e9 * 1))
    assert np.isfinite([m["train/mfu"] for m in steps]).all()
