"""The training loop on 2 real gloo ranks: exact resume (ZeRO 0-3, fp32 and bf16), elastic resume (2 -> 1 and
1 -> 2 ranks), per-rank mems that match a one-process computation and reset at the wrap. (Refusals before
training starts: tests/test_refusals.py.)"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from dist_helpers import learnable_stream, run_ranks, tiny_config, train_jobs, train_jobs_in_fp16_anywhere, write_corpus
from txl_dist.checkpoint import read_latest, read_run_info, rank_file
from txl_dist.config import config_from_dict

VOCAB = 64
TRAIN_TOKENS = 4 * 49  # S = 4 streams of L = 49: 6 windows of tgt_len 8 per epoch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer") / "corpus"
    return write_corpus(root, {"train": learnable_stream(TRAIN_TOKENS, VOCAB, 0),
                               "valid": learnable_stream(80, VOCAB, 1), "test": learnable_stream(80, VOCAB, 2)},
                        vocab_size=VOCAB)


def _variant(corpus, ckpt, stage, bf16, **sections):
    ds = {"zero_optimization": {"stage": stage}}
    if bf16:
        ds["bf16"] = {"enabled": True}
    return tiny_config(corpus, ckpt, deepspeed=ds, **sections)


# ----------------------------------------------------------------------------------------------------
# The reference under the config sweep's fp32 twin


def test_the_trainer_in_fp32_at_zero_0_trains_as_a_plain_torch_loop(corpus, tmp_path):
    """The config sweep takes fp32 at ZeRO 0 as right (its twin, bench/twin_check.py); this holds that to an
    independent loop: the trainer (DeepSpeed, 2 micro steps of 2 streams, clipping, WarmupCosineLR, torch's
    AdamW, the memory bank) against bench/learning_vs_reference.py's plain loop (one batch of the 4 streams,
    torch.optim.AdamW, clip_grad_norm_, the schedule's learning rates computed on their own), from the same
    weights on the same batches with dropout off: the same loss at every step and the same final weights."""
    from bench.learning_vs_reference import settings_from, train_batches, train_ours
    from txl_dist.checkpoint import load_fp32_weights
    from txl_dist.model import TransformerXL

    steps = 6  # one pass over the 4 streams
    raw = tiny_config(corpus, tmp_path / "run", model={"dropout": 0.0}, train={"max_steps": steps},
                      deepspeed={"train_micro_batch_size_per_gpu": 2})
    ((job,),) = run_ranks(train_jobs, 1, [(raw, "none")], timeout=300)
    cfg = config_from_dict(raw)
    cfg.model.vocab_size = VOCAB  # the trainer takes it from the corpus
    settings = settings_from(cfg, steps, threads=1)
    inputs, labels = train_batches(settings)
    model = TransformerXL(cfg.model)
    torch.manual_seed(cfg.train.seed)  # the trainer's initialization (txl_dist.engine.build_engine)
    model.reset_parameters()
    initial = [p.detach().clone() for p in model.parameters()]
    plain = train_ours(settings, model, 0, inputs, labels, checkpoints=[steps])
    assert job["code"] == 0 and sorted(job["losses"]) == list(range(1, steps + 1))
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), initial))
    assert moved > 3e-3  # the steps moved the weights (lr up to 3e-3): the comparison compares something
    np.testing.assert_allclose([job["losses"][s] for s in range(1, steps + 1)], plain["train_loss"], rtol=1e-5)
    trained = TransformerXL(cfg.model)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    load_fp32_weights(trained, ckpt_dir / read_latest(ckpt_dir), zero_stage=0)
    for (name, ours), theirs in zip(trained.named_parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------------------------------
# Exact resume


def test_exact_resume_is_bitwise_for_zero_0_to_3_fp32_and_bf16(corpus, tmp_path):
    n, k = 4, 2
    jobs, names = [], []
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            name = f"zero{stage}_{'bf16' if bf16 else 'fp32'}"
            straight = _variant(corpus, tmp_path / name / "straight", stage, bf16, train={"max_steps": n})
            first = _variant(corpus, tmp_path / name / "resumed", stage, bf16, train={"max_steps": n, "exit_step": k})
            second = _variant(corpus, tmp_path / name / "resumed", stage, bf16, train={"max_steps": n})
            jobs += [(straight, "none"), (first, "auto"), (second, "auto")]
            names.append(name)
    rank0, rank1 = run_ranks(train_jobs, 2, jobs, timeout=900)
    for i, name in enumerate(names):
        straight, first, second = rank0[3 * i: 3 * i + 3]
        assert [r["code"] for r in (straight, first, second)] == [0, 0, 0], name
        assert sorted(straight["losses"]) == list(range(1, n + 1)), name
        assert sorted(first["losses"]) == list(range(1, k + 1)), name  # stopped at exit_step
        assert sorted(second["losses"]) == list(range(k + 1, n + 1)), name  # continued, not restarted
        resumed = {**first["losses"], **second["losses"]}
        assert resumed == straight["losses"], f"{name}: {resumed} != {straight['losses']}"  # bitwise
        assert second["tokens_seen"] == straight["tokens_seen"] == n * 4 * 8
        # The loss is the mean over all ranks' tokens: rank 1 logged exactly rank 0's numbers.
        assert rank1[3 * i]["losses"] == straight["losses"], name
        # The run learns (so the equality above compares moving numbers); the LR schedule resumed too.
        assert straight["losses"][n] != straight["losses"][1], name
        lrs = [straight["metrics"][s]["train/lr"] for s in range(1, n + 1)]
        assert [{**first["metrics"], **second["metrics"]}[s]["train/lr"] for s in range(1, n + 1)] == lrs, name
        assert max(lrs) > 0, name
        assert all(straight["metrics"][s]["train/grad_norm"] > 0 for s in range(1, n + 1)), name
    ckpt = tmp_path / "zero2_bf16" / "resumed" / "checkpoints"
    assert read_latest(ckpt) == "step_00000004"
    info = read_run_info(ckpt / "step_00000004")
    assert (info["step"], info["world_size"], info["zero_stage"], info["n_streams"]) == (4, 2, 2, 4)
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002", "step_00000004"]  # keep 2


def test_a_resume_with_a_changed_schedule_trains_its_first_step_on_the_new_schedule(corpus, tmp_path):
    # A lower lr after a divergence, or more steps: the first resumed step must not keep the old schedule's lr.
    def config(run, lr, **train):
        return tiny_config(corpus, tmp_path / run, train={"max_steps": 6, **train},
                           deepspeed={"zero_optimization": {"stage": 1}, "optimizer": {"params": {"lr": lr}}})

    jobs = [(config("fresh", 1e-3), "none"), (config("resumed", 3e-3, exit_step=3), "none"),
            (config("resumed", 1e-3), "auto")]
    fresh, first, second = run_ranks(train_jobs, 1, jobs, timeout=600)[0]
    lrs = {s: m["train/lr"] for s, m in {**first["metrics"], **second["metrics"]}.items()}
    fresh_lrs = {s: m["train/lr"] for s, m in fresh["metrics"].items()}
    assert [lrs[s] for s in (1, 2, 3)] == [3 * fresh_lrs[s] for s in (1, 2, 3)]  # the first job's schedule
    assert [lrs[s] for s in (4, 5, 6)] == [fresh_lrs[s] for s in (4, 5, 6)]  # from the first resumed step on
    assert len(set(fresh_lrs.values())) == 6  # the schedule moves at every step: the comparison can fail


def test_a_bf16_run_saved_with_bf16_accumulation_continues_with_the_fp32_default(corpus, tmp_path):
    # Runs started before fp32 accumulation became the default at ZeRO 2-3 continue from their checkpoints.
    n, k = 4, 2
    jobs = []
    for stage in (2, 3):
        old = _variant(corpus, tmp_path / f"z{stage}", stage, True, train={"max_steps": n, "exit_step": k})
        old["deepspeed"]["data_types"] = {"grad_accum_dtype": "bf16"}
        jobs += [(old, "none"), (_variant(corpus, tmp_path / f"z{stage}", stage, True, train={"max_steps": n}), "auto"),
                 (_variant(corpus, tmp_path / f"z{stage}_straight", stage, True, train={"max_steps": n}), "none")]
    results = run_ranks(train_jobs, 2, jobs, timeout=900)[0]
    for i, stage in enumerate((2, 3)):
        first, resumed, straight = results[3 * i: 3 * i + 3]
        assert [r["code"] for r in (first, resumed, straight)] == [0, 0, 0], stage
        assert sorted(resumed["losses"]) == [3, 4], stage
        for step in (3, 4):  # the accumulation dtype of two steps barely moves a bf16 loss
            np.testing.assert_allclose(resumed["losses"][step], straight["losses"][step], rtol=1e-3)


# ----------------------------------------------------------------------------------------------------
# Elastic resume


def test_elastic_resume_2_to_1_and_1_to_2_ranks_continues_the_loss(corpus, tmp_path):
    n, k = 4, 2
    common = dict(model={"dropout": 0.0}, deepspeed={"zero_optimization": {"stage": 2}})

    def cfg(ckpt, **train):
        return tiny_config(corpus, tmp_path / ckpt, train={"max_steps": n, **train}, **common)

    two = run_ranks(train_jobs, 2, [(cfg("straight2"), "none"), (cfg("from2", exit_step=k), "none")])[0]
    one = run_ranks(train_jobs, 1, [(cfg("from2"), "auto"), (cfg("straight1"), "none"),
                               (cfg("from1", exit_step=k), "none")])[0]
    back = run_ranks(train_jobs, 2, [(cfg("from1"), "auto")])[0]
    straight2, _, resumed_on_1, straight1, _ = two + one
    (resumed_on_2,) = back
    assert resumed_on_1["code"] == resumed_on_2["code"] == 0
    assert sorted(resumed_on_1["losses"]) == sorted(resumed_on_2["losses"]) == [3, 4]
    for step in (3, 4):
        np.testing.assert_allclose(resumed_on_1["losses"][step], straight2["losses"][step], rtol=1e-4)
        np.testing.assert_allclose(resumed_on_2["losses"][step], straight1["losses"][step], rtol=1e-4)
    # The loss does not depend on the world size (same streams, same weights): 1 and 2 ranks agree.
    for step in range(1, n + 1):
        np.testing.assert_allclose(straight1["losses"][step], straight2["losses"][step], rtol=1e-5)
    # The ZeRO-2 shards went through DeepSpeed's universal checkpoint, made once, beside the tag.
    assert (tmp_path / "from2" / "checkpoints" / "step_00000002_universal" / "zero").is_dir()
    assert (tmp_path / "from1" / "checkpoints" / "step_00000002_universal" / "zero").is_dir()


@pytest.mark.parametrize("stage, bf16", [(2, True), (3, False)], ids=["bf16_zero2", "fused_adamw_zero3"])
def test_elastic_resume_2_to_1_continues_the_loss(corpus, tmp_path, stage, bf16):
    # bf16 at ZeRO 2 sums gradients in an fp32 buffer of the rank's partition: its checkpoints go through the
    # universal conversion like the fp32 ones of the test above. ZeRO-3 with the GPU presets' fused AdamW: the
    # universal load leaves the steps where its files were, in state that the optimizer's groups do not name
    # (checkpoint.steps_with_their_params).
    ds = {"zero_optimization": {"stage": stage}} | ({"bf16": {"enabled": True}} if bf16 else {})
    if stage == 3:
        ds["optimizer"] = {"type": "AdamW",
                           "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True, "fused": True}}

    def cfg(run, **train):
        return tiny_config(corpus, tmp_path / run, train={"max_steps": 4, **train}, model={"dropout": 0.0},
                           deepspeed=ds)

    first, straight = run_ranks(train_jobs, 2, [(cfg("from2", exit_step=2), "none"), (cfg("straight2"), "none")])[0]
    (resumed,) = run_ranks(train_jobs, 1, [(cfg("from2"), "auto")])[0]
    assert first["code"] == straight["code"] == resumed["code"] == 0
    assert sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):
        np.testing.assert_allclose(resumed["losses"][step], straight["losses"][step], rtol=1e-4)
    assert (tmp_path / "from2" / "checkpoints" / "step_00000002_universal" / "zero").is_dir()


def _zero3_fp16_overflowing(corpus, run_dir, **train):
    """A 3-step ZeRO-3 fp16 run at a loss scale of 2**32, at which every step here overflows and is skipped."""
    return tiny_config(corpus, run_dir, model={"dropout": 0.0},
                       deepspeed={"zero_optimization": {"stage": 3}, "fp16": {"initial_scale_power": 32}},
                       train={"max_steps": 3, "precision": "fp16", "max_nonfinite": 100, **train})


def test_a_zero3_fp16_run_whose_first_step_after_resume_overflows_trains_on(corpus, tmp_path):
    """Found by `python -m bench.config_sweep --seed 303` (case 1). The adaptive softmax reads its output tables and
    projections itself, never calling their modules, so ZeRO-3 gathers them as "external parameters" of the
    softmax, which DeepSpeed 0.19.8 registers only when a forward finds one partitioned. After a checkpoint load
    the small (persistent) ones were already gathered, so the first step's trace of the softmax lacked them; an
    fp16 overflow's skipped step partitioned them again, the next step registered them, and its backward failed
    with DeepSpeed's "tracing error ... expected the next 4 parameters in the parameter fetch queue". A restart
    failed the same way. A loss scale of 2**32 makes every step here overflow."""
    stopped = _zero3_fp16_overflowing(corpus, tmp_path / "run", exit_step=1)
    whole = _zero3_fp16_overflowing(corpus, tmp_path / "run")
    (first,) = run_ranks(train_jobs_in_fp16_anywhere, 1, [(stopped, "none")])[0]
    (resumed,) = run_ranks(train_jobs_in_fp16_anywhere, 1, [(whole, "auto")])[0]
    assert first["code"] == resumed["code"] == 0, resumed
    assert sorted(resumed["losses"]) == [2, 3]


def test_a_zero3_fp16_checkpoint_whose_steps_all_overflowed_resumes_on_another_world_size(corpus, tmp_path):
    """Found by `python -m bench.config_sweep --seed 304` (case 64). Every step before the save was skipped (a
    loss scale of 2**32), so DeepSpeed 0.19.8's ZeRO-3 optimizer files held no Adam state, and its universal
    conversion failed with "KeyError: 0": neither an elastic resume nor launch/eval.py on another world size
    could read the checkpoint. The conversion now gives such files the state Adam starts from
    (txl_dist.safe_load.with_never_stepped_state)."""
    def cfg(run, **train):
        return _zero3_fp16_overflowing(corpus, tmp_path / run, **train)

    first, straight = run_ranks(train_jobs_in_fp16_anywhere, 2, [(cfg("run", exit_step=1), "none"),
                                                                (cfg("straight"), "none")])[0]
    (resumed,) = run_ranks(train_jobs_in_fp16_anywhere, 1, [(cfg("run"), "auto")])[0]
    assert first["code"] == straight["code"] == resumed["code"] == 0, resumed
    assert (tmp_path / "run" / "checkpoints" / "step_00000001_universal" / "zero").is_dir()
    # Nothing stepped: the weights are the first ones, on 1 rank as on 2.
    assert sorted(resumed["losses"]) == [2, 3]
    for step in (2, 3):
        np.testing.assert_allclose(resumed["losses"][step], straight["losses"][step], rtol=1e-3)


# ----------------------------------------------------------------------------------------------------
# Per-rank mems


def _reference_mems(model, stream_tokens: np.ndarray, windows: list[int], tgt_len: int):
    """Run the model over windows of the given streams (one batch), carrying mems; the final mems."""
    mems = None
    with torch.no_grad():
        for w in windows:
            x = torch.from_numpy(stream_tokens[:, w * tgt_len:(w + 1) * tgt_len])  # [n, T]
            y = torch.from_numpy(stream_tokens[:, w * tgt_len + 1:(w + 1) * tgt_len + 1])  # [n, T]
            mems = model(x, labels=y, mems=mems).mems
    return mems


def test_each_rank_holds_the_mems_of_its_own_streams_and_resets_them_at_the_wrap(corpus, tmp_path):
    from txl_dist.model import TransformerXL
    from txl_dist.startup import with_vocab

    ckpt = tmp_path / "run" / "checkpoints"
    # lr 0 and no dropout: the weights stay those of step 0 and the mems are a function of the tokens.
    sections = dict(model={"dropout": 0.0},
                    deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}}})
    at_6 = tiny_config(corpus, ckpt.parent, train={"max_steps": 8, "exit_step": 6}, **sections)
    at_7 = tiny_config(corpus, ckpt.parent, train={"max_steps": 8, "exit_step": 7}, **sections)
    run_ranks(train_jobs, 2, [(at_6, "none"), (at_7, "auto")])

    cfg = with_vocab(config_from_dict(at_6), VOCAB, str(corpus))
    model = TransformerXL(cfg.model)
    weights = torch.load(ckpt / "step_00000006" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    model.load_state_dict(weights)
    model.eval()
    tokens = _train_tokens(corpus)
    L, T = TRAIN_TOKENS // 4, cfg.model.tgt_len
    streams = tokens[:4 * L].reshape(4, L)  # [S, L]
    assert (L - 1) // T == 6  # windows per epoch: step 7 starts epoch 1

    for rank, own in ((0, [0, 1]), (1, [2, 3])):
        saved_6 = torch.load(rank_file(ckpt / "step_00000006", rank), weights_only=True)["mems"]["mems"]
        saved_7 = torch.load(rank_file(ckpt / "step_00000007", rank), weights_only=True)["mems"]["mems"]
        assert sorted(saved_6) == sorted(saved_7) == own  # a rank keeps its own streams, keyed globally
        carried = _reference_mems(model, streams[own], [0, 1, 2, 3, 4, 5], T)  # this rank's streams alone
        fresh = _reference_mems(model, streams[own], [0], T)  # epoch 1, window 0, empty memory
        continued = _reference_mems(model, streams[own], [0, 1, 2, 3, 4, 5, 0], T)  # what no reset would give
        for layer in range(cfg.model.n_layer):
            for j, s in enumerate(own):
                torch.testing.assert_close(saved_6[s][layer], carried[layer][j], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(saved_7[s][layer], fresh[layer][j], rtol=1e-5, atol=1e-5)
                assert saved_7[s][layer].shape[0] == T  # only the new window: mem_len 8 = T
                if layer > 0:  # mems[0] is the embedding output: the same with or without context
                    assert not torch.allclose(saved_7[s][layer], continued[layer][j], atol=1e-3)


def _train_tokens(corpus) -> np.ndarray:
    from txl_dist.data import StreamLoader

    with StreamLoader(corpus, "train", rank=0, world_size=1, n_streams=1, micro_batch=1, tgt_len=8) as loader:
        return np.asarray(loader.reader.read(0, TRAIN_TOKENS), dtype=np.int64)


# ----------------------------------------------------------------------------------------------------
# A non-finite step at fp32 ZeRO stage 0 (the one configuration where DeepSpeed does not skip it itself)


def _nonfinite_step_at_stage_0(raw: dict) -> dict:
    """Three steps, the second with a NaN loss: the state before and after it, and the host reads it made."""
    import copy

    from txl_dist import distributed
    from txl_dist.trainer import build

    trainer = build(config_from_dict(raw), distributed.discover())

    def state():
        return ({k: v.clone() for k, v in trainer.engine.module.state_dict().items()},
                copy.deepcopy(trainer.engine.optimizer.state_dict()["state"]))

    try:
        trainer.train_step()
        before = state()

        def poison(module, args, output):  # a product: the NaN reaches the gradients, as an overflow's would
            handle.remove()
            return output._replace(nll=output.nll * torch.full_like(output.nll, float("nan")))

        handle = trainer.engine.module.register_forward_hook(poison)
        reads = []
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__float__", "__bool__")}

        def counting(name):
            def read(self, *args):
                reads.append(name)
                return originals[name](self, *args)
            return read

        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        try:
            skipped = trainer.train_step()
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
        after = state()
        trainer.train_step()
        moved = state()
    finally:
        trainer.tracker.close()
        trainer.start.close()
        distributed.destroy_process_group()
    same = lambda a, b: all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(  # noqa: E731
        torch.equal(x, y) for s in a[1] for x, y in zip(a[1][s].values(), b[1][s].values()))
    return {"nonfinite": skipped["nonfinite"], "kept": same(before, after), "moved": not same(after, moved),
            "reads": reads}


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_step_at_fp32_stage_0_leaves_weights_and_optimizer_state(corpus, tmp_path, fused):
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False}, deepspeed={"optimizer": {
        "type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True, "fused": fused}}})
    (out,) = run_ranks(_nonfinite_step_at_stage_0, 1, raw)
    assert out["nonfinite"] and out["kept"] and out["moved"], out
    # The fused optimizer takes the verdict on the device: the step's one host read is its final transfer.
    assert out["reads"] == (["tolist"] if fused else ["__float__", "tolist"]), out["reads"]


# ----------------------------------------------------------------------------------------------------
# What a job reports at its end


def _final_eval_and_last_line(raws: tuple[dict, dict]) -> dict:
    """Job 1: trainer.run with tracking off, its log lines. Job 2: a trainer whose tracker keeps log_dict's
    artifacts, trained to the end: its final_eval.json."""
    import logging

    from dist_helpers import Recorder
    from txl_dist import distributed, trainer

    class DictRecorder(Recorder):
        def __init__(self):
            super().__init__()
            self.dicts = {}

        def log_dict(self, dictionary, artifact_file):
            self.dicts[artifact_file] = dictionary

    env = distributed.discover()
    distributed.setup_logging(env)
    distributed.init_process_group(env)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(distributed.LOGGER_NAME).addHandler(handler)
    try:
        code = trainer.run(config_from_dict(raws[0]), env, resume="none")
        t = trainer.build(config_from_dict(raws[1]), env, resume="none")
        t.tracker.close()
        t.tracker = DictRecorder()
        try:
            t.train()
        finally:
            t.close()
    finally:
        distributed.destroy_process_group()
    return {"code": code, "lines": lines, "dicts": t.tracker.dicts}


def test_the_last_line_without_tracking_and_a_self_describing_final_eval(corpus, tmp_path):
    from txl_dist.trainer import mlflow_status

    # The corpus's ids are uniform over 4..63: cutoffs [60] hold ~95% of its tokens in the head, [8] ~15%.
    raws = tuple(tiny_config(corpus, tmp_path / name, train={"max_steps": 2}, eval={"clamp_len": 5},
                             model={"cutoffs": [cutoff]})
                 for name, cutoff in (("untracked", 60), ("recorded", 8)))
    (out,) = run_ranks(_final_eval_and_last_line, 1, raws, timeout=600)
    assert out["code"] == 0
    small_head = [line for line in out["lines"] if "the head cluster" in line]
    assert len(small_head) == 1 and small_head[0].startswith("model.cutoffs [8]: the head cluster (ids below 8) "
                                                             "holds only 1"), small_head
    last = [line for line in out["lines"] if line.startswith("run folder ")][-1]
    assert last.endswith(" | MLflow off") or " | MLflow off | " in last, last  # no status of a run that is not
    assert mlflow_status("0123abcd", "KILLED") == "MLflow run 0123abcd (KILLED)"

    final = out["dicts"]["final_eval.json"]
    assert {key: final[key] for key in ("split", "step", "precision", "attn_impl", "world_size", "eval_streams")} == \
        {"split": "test", "step": 2, "precision": "fp32", "attn_impl": "matmul", "world_size": 1, "eval_streams": 2}
    assert final["eval"] == {"tgt_len": 8, "mem_len": 16, "clamp_len": 5, "same_length": True, "max_segments": 3}
    assert isinstance(final["tokens"], int) and final["tokens"] > 0
    assert final["checkpoint"] == str(tmp_path / "recorded" / "checkpoints" / "step_00000002")
    assert final["perplexity"] > 1 and final["loss"] > 0 and "bits_per_byte" in final


def test_a_job_with_a_peak_of_its_own_leaves_the_runs_run_choices_artifact_alone():
    from types import SimpleNamespace

    from txl_dist.trainer import run_choices_artifact

    def start(resumed_peak, peak):
        resume = None if resumed_peak is False else SimpleNamespace(
            run_info={"run_choices": None if resumed_peak is None else {"peak": {"flops_per_s": resumed_peak}}})
        return SimpleNamespace(resume=resume, choices=SimpleNamespace(peak_flops=peak))

    assert run_choices_artifact(start(False, 2e9), 0) == "run_choices.json"  # a new run
    assert run_choices_artifact(start(2e9, 2e9), 7) == "run_choices.json"  # the run's peak kept: the same numbers
    assert run_choices_artifact(start(1e9, 2e9), 7) == "run_choices_from_step_00000007.json"  # another device
    assert run_choices_artifact(start(None, 2e9), 7) == "run_choices_from_step_00000007.json"  # recorded none


def test_a_failed_job_says_why_on_its_mlflow_run():
    """The line of the tag txl.ended for a failure: the error's own line, but for a failed collective (whose
    explanation, the lost rank, comes later, from the entry point) a pointer to the log that names it."""
    from txl_dist.trainer import failure_line

    assert failure_line(ValueError("the shard is corrupt\nmore")) == "the shard is corrupt"
    collective = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                              "[127.0.0.1]:39221")
    assert failure_line(collective) == ("a collective failed: a rank was lost or stopped (the job's log, "
                                        "logs/train.log, names it)")


def _finite_check_with_nan_padding() -> list[bool]:
    """A ZeRO-3 engine of 2 ranks over a Linear(3, 3): rank 1's partitions end in padding (weight 9 = 5 + 4,
    bias 3 = 2 + 1). NaN written into the padding, then into a weight of rank 1: what _weights_finite says."""
    import deepspeed

    from txl_dist import distributed
    from txl_dist.engine import skip_shm_comm_build
    from txl_dist.trainer import _weights_finite

    skip_shm_comm_build()  # else DeepSpeed JIT-builds its CPU shared-memory op here (42 s more), unused
    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        deepspeed.init_distributed()
        ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
        model = torch.nn.Linear(3, 3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                          config=ds)
        seen = [_weights_finite(engine)]
        for p in engine.module.parameters():
            part = p.ds_tensor.data
            valid = max(0, min(p.ds_numel - env.rank * part.numel(), part.numel()))
            part[valid:] = float("nan")  # what uninitialized padding may hold
        seen.append(_weights_finite(engine))
        if env.rank == 1:
            next(engine.module.parameters()).ds_tensor.data[0] = float("nan")
        seen.append(_weights_finite(engine))
        return seen
    finally:
        distributed.destroy_process_group()


def test_zero3_partition_padding_is_not_a_weight_of_the_finite_check():
    """Before a save every rank checks that its weights are finite. ZeRO-3 pads the last partitions with memory
    it never writes: NaN there is no divergence (a save was refused at random); NaN in a weight is."""
    rank0, rank1 = run_ranks(_finite_check_with_nan_padding, 2)
    assert rank0 == [True, True, True]
    assert rank1 == [True, True, False]


def test_the_progress_rate_leaves_out_profiled_steps_and_says_so():
    """The progress line's tokens/s is the mean step time of the steps since the last line, without the
    steps under the profiler (1.3-1.6x slower on a host-bound step, BENCHMARKS.md) when there are others."""
    from txl_dist.trainer import RateWindow

    def report(*steps):
        window = RateWindow()
        for seconds, profiled in steps:
            window.add(seconds, profiled)
        return window.report()

    assert report((1.0, False), (3.0, False)) == (2.0, "")
    assert report((1.0, False), (9.0, True), (3.0, False)) == (2.0, " | 1 profiled step(s) left out")
    assert report((5.0, True), (7.0, True)) == (6.0, " | profiled")


def test_a_failure_to_close_the_run_never_replaces_the_jobs_own_failure(monkeypatch, tmp_path, caplog):
    import logging
    import types

    import txl_dist.trainer as trainer_module

    class SaveFailed(Exception):
        pass

    def raising(exc):
        def call(*args, **kwargs):
            raise exc
        return call

    fake = types.SimpleNamespace(
        step=7, ended=None, train=raising(SaveFailed("checkpoint step_00000008 could not be saved")),
        draw_curves=lambda: None, close=raising(OSError(28, "No space left on device")),
        tracker=types.SimpleNamespace(run_id=None, ui_hint=lambda: None))
    monkeypatch.setattr(trainer_module, "build", lambda *args, **kwargs: fake)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(max_steps=10), run=types.SimpleNamespace(dir=str(tmp_path)))
    env = types.SimpleNamespace(is_main=True)
    with caplog.at_level(logging.WARNING), pytest.raises(SaveFailed):
        trainer_module.run(cfg, env)
    assert "closing the run after the failure failed too: [Errno 28] No space left on device" in caplog.text
    assert fake.ended == "failed after step 7: checkpoint step_00000008 could not be saved"
    fake.train = lambda: 0  # no failure in flight: a failing close is the job's failure
    with pytest.raises(OSError):
        trainer_module.run(cfg, env)
