"""txl_dist.safe_load: every DeepSpeed checkpoint this project writes loads with weights-only unpickling
(engine.load_checkpoint, the universal conversion subprocess, fp32 export), and a malicious file is refused
by each of them in one line without running.

One 2-rank gloo job (one process group) trains every variant for a few steps, converts each ZeRO 1-3 tag
to a universal checkpoint through `python -m txl_dist.safe_load ds_to_universal`, loads every tag (and
every universal copy) into a fresh engine inside restricted_torch_loads(), and tries the planted
malicious copies. The weights an engine loaded are compared with an unrestricted load of the same files.
"""
from __future__ import annotations

import builtins
import multiprocessing
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from dist_helpers import learnable_stream, run_ranks, tiny_config, train_job, write_corpus
from txl_dist.errors import Refused
from txl_dist.safe_load import (
    UntrustedCheckpointError,
    check_checkpoint_files,
    fp32_state_dict_from_zero,
    load_weights_only,
    restricted_process_pool,
    restricted_torch_loads,
)

VOCAB = 64
STEPS = 3  # the warmup gives step 1 a zero learning rate: the weights move from step 2 on
TAG = f"step_{STEPS:08d}"
UNIVERSAL_TAG = TAG + "_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
FRAGMENTS = "zero/*/fp32.pt"  # each parameter's fp32 weights in a universal checkpoint
CHECKPOINTING = {"partition_activations": False}

VARIANTS = {
    **{f"zero{stage}_{'bf16' if bf16 else 'fp32'}": {"zero_optimization": {"stage": stage},
                                                      **({"bf16": {"enabled": True}} if bf16 else {})}
       for stage in (0, 1, 2, 3) for bf16 in (False, True)},
    "zero2_fp32_offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3_bf16_activation_checkpointing": {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                            "activation_checkpointing": CHECKPOINTING},
}
# Malicious copies the engine tries to load: (the variant copied, its tag, per rank the files (a glob) it reads
# and refuses). At ZeRO 1/2 rank r reads only its own optimizer file and the fragments of its own partition,
# so those cases replace every rank's files: a rank that refused alone would leave the others waiting in a
# collective (check_checkpoint_files, run on every rank first, prevents that).
ENGINE_CASES = {
    "model_states": ("zero2_fp32", TAG, (MODEL_STATES, MODEL_STATES)),
    "optim_states": ("zero2_fp32", TAG, (OPTIM_STATES, OPTIM_STATES.replace("pp_rank_0", "pp_rank_1"))),
    "universal_fragment": ("zero2_fp32", UNIVERSAL_TAG, (FRAGMENTS, FRAGMENTS)),
}


def stage_of(variant: str) -> int:
    return VARIANTS[variant]["zero_optimization"]["stage"]


def is_bf16(variant: str) -> bool:
    return "bf16" in VARIANTS[variant]


# ----------------------------------------------------------------------------------------------------
# Malicious files


class _MakesMarker:
    """Unpickling this calls open(marker, 'w'): the marker file exists iff the pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


def plant_malicious(path: Path, marker: Path) -> None:
    """Replace a checkpoint file with a torch.save'd dict whose unpickling would create `marker`."""
    torch.save({"module": _MakesMarker(marker), "optimizer_state_dict": {}}, path)


def copy_with_malicious(src_tag: Path, dst_root: Path, tag: str, patterns: tuple[str, ...], marker: Path) -> Path:
    """A copy of a tag folder in dst_root/tag with the files matching `patterns` made malicious; returns it."""
    dst = dst_root / tag
    shutil.copytree(src_tag, dst)
    for pattern in patterns:
        files = list(dst.glob(pattern))
        assert files, pattern
        for path in files:
            plant_malicious(path, marker)
    return dst


def assert_one_line_refusal(message: str, folder: Path, pattern: str) -> None:
    """One line that names a file of `folder` matching `pattern`, and the global it needed."""
    assert "\n" not in message.strip(), message
    named = Path(message.removeprefix("error: ").split(": refused:")[0])
    assert named.is_relative_to(folder) and named.relative_to(folder).match(pattern), message
    # builtins.open, as pickle names it: io.open (Python 3.11), _io.open (3.12)
    assert "global io.open" in message or "global _io.open" in message, message


# ----------------------------------------------------------------------------------------------------
# The 2-rank job


def variant_config(corpus: Path, root: Path, variant: str) -> dict:
    return tiny_config(corpus, root / variant, deepspeed=VARIANTS[variant], train={"max_steps": STEPS})


def tag_dir(root: Path, variant: str) -> Path:
    return root / variant / "checkpoints" / TAG


def convert(tag: Path, stage: int) -> subprocess.CompletedProcess:
    """The universal conversion subprocess, as checkpoint.convert_to_universal runs it."""
    cmd = [sys.executable, "-m", "txl_dist.safe_load", "ds_to_universal", "--input_folder", str(tag),
           "--output_folder", str(tag.parent / (tag.name + "_universal")),
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    if stage in (1, 2):  # their tags lack state the universal form needs
        cmd.append("--inject_missing_state")
    return subprocess.run(cmd, capture_output=True, text=True)


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The module's parameters in fp32, gathered under ZeRO-3 (collective)."""
    import deepspeed

    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().float().clone() for n, p in named}


def load_engine_restricted(raw: dict, load_dir: Path, tag: str, *, universal: bool) -> dict:
    """Build an engine as the trainer does and load a tag into it inside restricted_torch_loads()."""
    from txl_dist.config import config_from_dict
    from txl_dist.engine import build_engine, deepspeed_config
    from txl_dist.model import TransformerXL

    # The trainer takes vocab_size from the corpus' tokenizer; here it is known.
    cfg = config_from_dict({**raw, "model": {**raw["model"], "vocab_size": VOCAB}})
    ds = deepspeed_config(cfg, 2, load_universal=universal)
    engine = build_engine(lambda: TransformerXL(cfg.model), ds, seed=cfg.train.seed)
    try:
        before = full_weights(engine)
        try:
            with restricted_torch_loads():
                path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        except UntrustedCheckpointError as e:
            return {"refused": str(e)}
        return {"path": path, "steps": engine.global_steps, "before": before, "after": full_weights(engine)}
    finally:
        engine.destroy()


def train_convert_and_load(root: str, corpus: str) -> dict:
    """On each rank: train every variant, (rank 0) convert and plant malicious copies, load everything."""
    from txl_dist import distributed

    root, corpus = Path(root), Path(corpus)
    env = distributed.discover()
    distributed.setup_logging(env)
    distributed.init_process_group(env)
    try:
        raws = {v: variant_config(corpus, root, v) for v in VARIANTS}
        codes = {v: train_job(raw, resume="none")["code"] for v, raw in raws.items()}
        converted = None
        if env.rank == 0:
            converted = {v: convert(tag_dir(root, v), stage_of(v)) for v in VARIANTS if stage_of(v) > 0}
            converted = {v: (p.returncode, p.stderr[-2000:]) for v, p in converted.items()}
            for case, (variant, tag, patterns) in ENGINE_CASES.items():
                source = tag_dir(root, variant).parent / tag
                if source.is_dir():  # else its conversion failed, and that test says why
                    copy_with_malicious(source, root / "malicious" / case, tag, patterns,
                                        root / "malicious" / f"{case}.marker")
        converted = distributed.broadcast_object(converted)
        loads = {}
        for v, raw in raws.items():
            loads[v] = load_engine_restricted(raw, tag_dir(root, v).parent, TAG, universal=False)
            if stage_of(v) > 0 and converted[v][0] == 0:
                loads[v + "_universal"] = load_engine_restricted(raw, tag_dir(root, v).parent, UNIVERSAL_TAG,
                                                                 universal=True)
        refusals = {case: load_engine_restricted(raws[variant], root / "malicious" / case, tag,
                                                 universal=tag == UNIVERSAL_TAG)
                    for case, (variant, tag, _) in ENGINE_CASES.items() if (root / "malicious" / case).is_dir()}
        if env.rank != 0:  # one copy of the weights is enough
            loads = {k: {key: r[key] for key in ("path", "steps", "refused") if key in r} for k, r in loads.items()}
        return {"codes": codes, "converted": converted, "loads": loads, "refusals": refusals}
    finally:
        distributed.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("safe_load")
    corpus = write_corpus(root / "corpus", {"train": learnable_stream(4 * 49, VOCAB, 0),
                                            "valid": learnable_stream(80, VOCAB, 1),
                                            "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)
    rank0, rank1 = run_ranks(train_convert_and_load, 2, str(root), str(corpus), timeout=900)
    assert rank0["codes"] == dict.fromkeys(VARIANTS, 0)
    return root, rank0, rank1


# ----------------------------------------------------------------------------------------------------
# (1) Every variant loads inside the restriction


def unrestricted_weights(tag: Path, variant: str) -> dict[str, torch.Tensor]:
    """The oracle: the tag's weights read with DeepSpeed's own unrestricted loads, in the model's dtype."""
    if stage_of(variant) == 0:
        module = torch.load(tag / MODEL_STATES, map_location="cpu", weights_only=False)["module"]
        return {k: v.float() for k, v in module.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=tag.name)
    dtype = torch.bfloat16 if is_bf16(variant) else torch.float32
    return {k: v.to(dtype).float() for k, v in state.items()}


# Stage 0 has no universal form: any world size reads its files.
LOADS = [(v, False) for v in VARIANTS] + [(v, True) for v in VARIANTS if stage_of(v) > 0]


@pytest.mark.parametrize("variant, universal", LOADS, ids=[v + ("-universal" if u else "-tag") for v, u in LOADS])
def test_engine_loads_every_variant_inside_the_restriction(job, variant, universal):
    root, rank0, rank1 = job
    key = variant + ("_universal" if universal else "")
    for rank, out in enumerate((rank0, rank1)):
        assert key in out["loads"], f"{key}: not loaded (see the conversion test)"
        loaded = out["loads"][key]
        assert "refused" not in loaded, f"rank {rank}: {loaded.get('refused')}"
        assert loaded["path"] is not None and loaded["steps"] == STEPS, (rank, loaded)
    loaded = rank0["loads"][key]
    expected = unrestricted_weights(tag_dir(root, variant), variant)
    assert set(loaded["after"]) <= set(expected)
    moved = [n for n in loaded["after"] if not torch.equal(loaded["after"][n], loaded["before"][n])]
    assert moved, "training did not move the weights: this comparison would not see a load that did nothing"
    for name, value in loaded["after"].items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("variant", [v for v in VARIANTS if stage_of(v) > 0])
def test_universal_conversion_subprocess_converts_every_zero_stage(job, variant):
    root, rank0, _ = job
    code, stderr = rank0["converted"][variant]
    assert code == 0, stderr
    out = tag_dir(root, variant).parent / UNIVERSAL_TAG
    assert (out / "zero" / "optimizer_state.pt").is_file()
    assert list((out / "zero").glob("*/fp32.pt"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_file_check_accepts_every_tag_and_universal_copy(job, variant):
    root, _, _ = job
    check_checkpoint_files(tag_dir(root, variant))
    if stage_of(variant) > 0:
        check_checkpoint_files(tag_dir(root, variant).parent / UNIVERSAL_TAG)


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_reads_the_same_weights_as_an_unrestricted_load(job, variant):
    root, _, _ = job
    tag = tag_dir(root, variant)
    if stage_of(variant) == 0:
        assert_same(load_weights_only(tag / MODEL_STATES, map_location="cpu"),
                    torch.load(tag / MODEL_STATES, map_location="cpu", weights_only=False))
        return
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert_same(fp32_state_dict_from_zero(tag), get_fp32_state_dict_from_zero_checkpoint(str(tag.parent), tag=TAG))


# ----------------------------------------------------------------------------------------------------
# (2) A malicious file is refused by each entry point and never runs


def test_the_planted_file_runs_code_when_unpickled_without_the_restriction(tmp_path):
    marker = tmp_path / "marker"
    plant_malicious(tmp_path / "file.pt", marker)
    torch.load(tmp_path / "file.pt", weights_only=False)
    assert marker.exists()  # so the refusals below are refusals of a live payload


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_load_refuses_a_malicious_file_on_every_rank(job, case):
    root, rank0, rank1 = job
    _, tag, patterns = ENGINE_CASES[case]
    for rank, out in enumerate((rank0, rank1)):
        assert case in out["refusals"], f"{case}: no malicious copy was made (see the conversion test)"
        outcome = out["refusals"][case]
        assert "refused" in outcome, f"rank {rank} loaded {case}"
        assert_one_line_refusal(outcome["refused"], root / "malicious" / case / tag, patterns[rank])
    assert not (root / "malicious" / f"{case}.marker").exists()


def test_file_check_refuses_a_malicious_file_that_only_one_rank_would_read(job, tmp_path):
    root, _, _ = job
    marker = tmp_path / "marker"
    tag = copy_with_malicious(tag_dir(root, "zero2_fp32"), tmp_path, TAG, (OPTIM_STATES,), marker)
    with pytest.raises(UntrustedCheckpointError) as refused:
        check_checkpoint_files(tag)
    assert_one_line_refusal(str(refused.value), tag, OPTIM_STATES)
    assert not marker.exists()


@pytest.mark.parametrize("rel", [MODEL_STATES, OPTIM_STATES])
def test_universal_conversion_refuses_a_malicious_file(job, tmp_path, rel):
    root, _, _ = job
    marker = tmp_path / "marker"
    tag = copy_with_malicious(tag_dir(root, "zero2_fp32"), tmp_path / "checkpoints", TAG, (rel,), marker)
    proc = convert(tag, 2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr[-2000:]
    assert_one_line_refusal(last, tag, rel)
    assert not marker.exists()


@pytest.mark.parametrize("variant, rel", [("zero0_bf16", MODEL_STATES), ("zero2_fp32", MODEL_STATES),
                                          ("zero2_fp32", OPTIM_STATES)])
def test_export_refuses_a_malicious_file(job, tmp_path, variant, rel):
    root, _, _ = job
    marker = tmp_path / "marker"
    tag = copy_with_malicious(tag_dir(root, variant), tmp_path, TAG, (rel,), marker)
    with pytest.raises(UntrustedCheckpointError) as refused:
        if stage_of(variant) == 0:
            load_weights_only(tag / rel)
        else:
            fp32_state_dict_from_zero(tag)
    assert isinstance(refused.value, Refused)
    assert_one_line_refusal(str(refused.value), tag, rel)
    assert not marker.exists()


def load_without_asking(path: str) -> None:
    """What DeepSpeed's code does in a conversion worker: torch.load with weights_only=False."""
    torch.load(path, weights_only=False)


def test_spawned_conversion_workers_are_restricted_too(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    leaked, kept = tmp_path / "leaked.marker", tmp_path / "kept.marker"
    plant_malicious(tmp_path / "leaks.pt", leaked)
    plant_malicious(tmp_path / "kept.pt", kept)
    with restricted_torch_loads():
        # A spawned worker imports torch afresh: a plain pool does not inherit the parent's restriction...
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            pool.submit(load_without_asking, str(tmp_path / "leaks.pt")).result()
        # ...the pool the conversion uses restricts each worker itself.
        with restricted_process_pool(max_workers=1, mp_context=spawn) as pool:
            with pytest.raises(UntrustedCheckpointError) as refused:
                pool.submit(load_without_asking, str(tmp_path / "kept.pt")).result()
    assert leaked.exists()
    assert not kept.exists()
    assert_one_line_refusal(str(refused.value), tmp_path, "kept.pt")


# ----------------------------------------------------------------------------------------------------
# The context itself


def test_context_restores_torch_load_and_nests():
    original = torch.load
    with restricted_torch_loads():
        with restricted_torch_loads():
            assert torch.load is not original
        assert torch.load is not original  # the outer one still holds
    assert torch.load is original and torch.serialization.load is original


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch notes the protocol before refusing
def test_a_plain_pickle_file_is_refused_in_one_line(tmp_path):
    import pickle

    marker = tmp_path / "marker"
    with open(tmp_path / "raw.pt", "wb") as f:
        pickle.dump({"module": _MakesMarker(marker)}, f)
    with restricted_torch_loads(), pytest.raises(UntrustedCheckpointError) as refused:
        torch.load(tmp_path / "raw.pt", weights_only=False)
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path / "raw.pt") in message
    assert not marker.exists()
