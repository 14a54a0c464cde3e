"""An elastic load reads the universal copy only once it verifies: a copy damaged after it was made (a flipped
fp32 fragment, a file gone) is converted again from the verified tag, and the numbers are the clean copy's.
(The checks themselves, an older version's copy and the record: tests/test_checkpoint.py.)"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from corpus_helpers import flip_bytes
from dist_helpers import learnable_stream, run_ranks, tiny_config, train_jobs, write_corpus
from txl_dist import checkpoint

VOCAB = 64


def _eval_main(argv):
    from launch.eval import main

    return main(argv)


def test_a_damaged_universal_copy_is_converted_again_before_two_ranks_read_it(tmp_path):
    tag = _zero1_tag(tmp_path, steps=2)  # saved by 1 rank: 2 ranks read its universal copy
    ckpt = tag.parent
    copy = ckpt / "step_00000002_universal"

    def evaluate(name):
        out = tmp_path / f"{name}.json"
        assert run_ranks(_eval_main, 2, ["--checkpoint", str(ckpt), "--split", "valid", "--output", str(out)],
                         timeout=240) == [0, 0]
        return json.loads(out.read_text())

    clean = evaluate("clean")
    assert checkpoint.verify_universal(copy, tag) is None
    weights = copy / "zero" / "word_emb.emb_layers.0.weight" / "fp32.pt"
    flip_bytes(weights)  # wrong numbers, no error, when read unverified
    (copy / "zero" / "layers.1.attn.r_w_bias" / "exp_avg.pt").unlink()  # a hang in DeepSpeed's load, unverified
    again = evaluate("again")
    assert again["loss"] == clean["loss"] and again["tokens"] == clean["tokens"]
    assert checkpoint.verify_universal(copy, tag) is None
    assert sorted(p.name for p in ckpt.iterdir() if "universal" in p.name) == [copy.name]  # the bad one removed


def test_a_fused_optimizers_steps_go_where_its_parameters_are():
    """An elastic resume loads DeepSpeed's universal copy, which puts each state's step as read from CPU files
    into the torch optimizer (no load_state_dict): steps_with_their_params does what load_state_dict would
    have done for a fused optimizer (its parameter's device, float32), and leaves a plain one's alone. On a GPU
    the misplaced step fails the fused step (tests/test_gpu.py); here the dtype shows the move."""
    import torch

    from txl_dist.checkpoint import steps_with_their_params

    fused, plain = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    optimizers = [torch.optim.AdamW([fused], fused=True), torch.optim.AdamW([plain], foreach=False)]
    for p, opt in zip((fused, plain), optimizers):
        p.grad = torch.randn(4)
        opt.step()
        opt.state[p]["step"] = torch.tensor(7.0, dtype=torch.float64)  # as a loader might leave it
    assert steps_with_their_params(optimizers[0]) == 1
    step = optimizers[0].state[fused]["step"]
    assert (step.item(), step.dtype, step.device) == (7.0, torch.float32, fused.device)
    assert steps_with_their_params(optimizers[0]) == 0  # in place already
    assert steps_with_their_params(optimizers[1]) == 0 and optimizers[1].state[plain]["step"].dtype == torch.float64


def _zero3_steps_after_a_load() -> tuple[int, int, list[str]]:
    """A ZeRO-3 engine of one rank with the presets' fused torch AdamW, after one step, its states' steps set
    to float64 as a loader might leave them: (states, params its groups name, dtypes after the move)."""
    import deepspeed
    import torch

    from txl_dist import distributed
    from txl_dist.checkpoint import steps_with_their_params
    from txl_dist.engine import skip_shm_comm_build

    skip_shm_comm_build()
    distributed.init_process_group(distributed.discover())
    try:
        deepspeed.init_distributed()
        ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}}}
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(3, 3), model_parameters=None, config=ds)
        engine.backward(engine(torch.randn(1, 3)).sum())
        engine.step()
        torch_optimizer = engine.optimizer.optimizer
        for state in torch_optimizer.state.values():
            state["step"] = state["step"].to(torch.float64)
        named = sum(len(group["params"]) for group in torch_optimizer.param_groups)
        moved = steps_with_their_params(torch_optimizer)
        return moved, named, sorted(str(s["step"].dtype) for s in torch_optimizer.state.values())
    finally:
        distributed.destroy_process_group()


def test_a_zero3_optimizers_steps_move_though_its_groups_name_no_parameter():
    """ZeRO-3 keeps its torch optimizer's param_groups["params"] empty between steps (and its universal load
    sets them to []): the steps are found through the optimizer's states, else an elastic resume at ZeRO-3
    with fused AdamW failed at its first step on a GPU ("cuda:0 and cpu")."""
    [(moved, named, dtypes)] = run_ranks(_zero3_steps_after_a_load, 1, timeout=240)
    assert named == 0  # what made the old walk over the groups' params find nothing
    assert moved >= 1 and dtypes == ["torch.float32"] * moved


def test_a_tied_aliass_weights_in_a_universal_copy_are_its_own_not_the_whole_model(tmp_path, caplog):
    """DeepSpeed's conversion writes the fp32 weights of a parameter without optimizer fragments (a tied alias:
    crit.out_layers.0.weight is the embedding's weight) from the tag's model states, whose tensors in an fp32
    ZeRO 1/2 run are views of one flat buffer of the whole model: each such file held all the model's weights
    (measured at 21M parameters, 3 aliases: a copy of 594 MB, 340 MB without them; configs/large.json has 7).
    Each file holds its own tensor's bytes now, with the same values. The conversion says when it starts and
    how long it took (at scale, minutes in which the job prints nothing else)."""
    import logging

    import torch

    tag = _zero1_tag(tmp_path)
    copy = tag.parent / (tag.name + checkpoint.UNIVERSAL_SUFFIX)
    with caplog.at_level(logging.INFO, logger="txl_dist"):
        assert checkpoint.convert_to_universal(tag, copy, zero_stage=1)
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("checkpoint: converting step_00000001 (") and said[0].endswith(
        f" of optimizer files) to DeepSpeed's universal form for a load at another world size: {copy}"), said
    assert said[1].startswith(f"checkpoint: {copy.name} converted in ") and len(said) == 2, said
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    alias = copy / "zero" / "crit.out_layers.0.weight" / "fp32.pt"
    assert alias.is_file() and not (alias.parent / "exp_avg.pt").exists()  # written from the model states
    assert torch.equal(torch.load(alias, weights_only=True)["param"], module["word_emb.emb_layers.0.weight"])
    for path in (copy / "zero").glob("*/fp32.pt"):
        weights = torch.load(path, weights_only=True)["param"]
        assert path.stat().st_size < weights.nbytes + 4096, f"{path}: {path.stat().st_size} bytes for {weights.nbytes}"


def _zero1_tag(root, steps: int = 1):
    """The tag of `steps` fp32 ZeRO-1 steps of the tiny model on 1 rank (a load on another world size converts it)."""
    corpus = write_corpus(root / "corpus", {"train": learnable_stream(4 * 49, VOCAB, 0),
                                            "valid": learnable_stream(80, VOCAB, 1),
                                            "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)
    raw = tiny_config(corpus, root / "run", train={"max_steps": steps}, eval={"at_end": False},
                      deepspeed={"zero_optimization": {"stage": 1}})
    run_ranks(train_jobs, 1, [(raw, "none")])
    return root / "run" / "checkpoints" / f"step_{steps:08d}"


def test_a_converter_killed_by_a_signal_is_said_so_not_by_its_last_line(tmp_path):
    """A converter the kernel's OOM killer ends (each worker holds a ZeRO shard) was reported by its last line on
    stderr: `conversion failed (no output)`, or a warning it had printed. The signal is named, nothing is left."""
    import threading
    import time

    import psutil
    import pytest

    tag = _zero1_tag(tmp_path)
    copy = tag.parent / (tag.name + checkpoint.UNIVERSAL_SUFFIX)

    def kill_the_converter():  # as soon as it runs: it is still importing torch, seconds from its end
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for p in psutil.Process().children(recursive=True):
                try:
                    if "ds_to_universal" in " ".join(p.cmdline()):
                        p.kill()
                        return
                except psutil.Error:
                    continue
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_converter)
    killer.start()
    try:
        with pytest.raises(checkpoint.ConversionFailed) as failed:
            checkpoint.convert_to_universal(tag, copy, zero_stage=1)
    finally:
        killer.join()
    assert str(failed.value) == (
        f"{tag}: universal checkpoint conversion failed (the converter was killed by SIGKILL: the kernel's OOM "
        "killer, if the node ran out of memory); nothing of it is left: start again, or resume with the world size "
        "it was saved with (zero_stage=1)")
    assert sorted(p.name for p in tag.parent.iterdir() if "universal" in p.name) == []
    assert checkpoint.verify(tag) is None


CONVERTING_RANK = """
import sys
from pathlib import Path
from txl_dist import checkpoint
try:
    checkpoint.convert_to_universal(Path(sys.argv[1]), Path(sys.argv[2]), zero_stage=1)
except checkpoint.ConversionFailed as e:
    print(e)
    sys.exit(1)
"""


def _converting_rank(tag, copy):
    """A process that converts `tag` as rank 0 does (a stand-in for it), its stdout piped: a failure's line."""
    import subprocess
    import sys

    project = Path(checkpoint.__file__).resolve().parents[1]  # the txl_dist under test
    return subprocess.Popen([sys.executable, "-c", CONVERTING_RANK, str(tag), str(copy)], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _frozen_conversion(rank):
    """The converter of `rank` (a process converting a tag), once it has live worker processes, stopped
    (SIGSTOP) where it is, and those workers: a stand-in for minutes of converting a large model. The workers
    go on (each one to its task's end, then waits for the next): stopped, one caught before its own set-up
    would never end by its parent's death, which no real process does."""
    import signal
    import time

    import psutil

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and rank.poll() is None:
        try:
            for converter in psutil.Process(rank.pid).children():
                converter.send_signal(signal.SIGSTOP)  # first: it then neither starts nor reaps workers
                workers = [w for w in converter.children() if w.status() != psutil.STATUS_ZOMBIE]
                if workers:
                    return [converter, *workers]
                converter.send_signal(signal.SIGCONT)  # before or between its two pools: let it go on
        except psutil.Error:
            pass
        time.sleep(0.01)
    raise AssertionError(f"no conversion with worker processes seen (the converting process: {rank.poll()=})")


def _ended(processes, wait_s):
    """Whether every process ended (a zombie holds no memory) within wait_s; polls."""
    import time

    import psutil

    def gone(p):
        try:
            return p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    deadline = time.monotonic() + wait_s
    while not all(gone(p) for p in processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_killed_ranks_converter_and_its_workers_end_with_it_and_the_next_start_converts(tmp_path):
    """Rank 0 killed outright while it converts (the OOM killer, torchrun restarting its workers) left its
    converter and worker processes converting on (and holding memory and its scratch folder's lock) while the
    restarted start converted again beside them. They end with it now (Linux: the kernel's parent-death signal,
    txl_dist/safe_load.py), the kernel drops the folder's lock, and the next conversion of the tag removes the
    killed one's folder and makes the same copy."""
    import json
    import sys
    import time

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's; elsewhere the converter runs to its end (documented)")
    tag = _zero1_tag(tmp_path)
    copy = tag.parent / (tag.name + checkpoint.UNIVERSAL_SUFFIX)
    record = copy / checkpoint.STATE_DIR / checkpoint.UNIVERSAL_RECORD
    assert checkpoint.convert_to_universal(tag, copy, zero_stage=1)
    clean = json.loads(record.read_text())["files"]
    copy.rename(tmp_path / "clean_copy")

    rank = _converting_rank(tag, copy)
    frozen = []
    try:
        frozen = _frozen_conversion(rank)
        rank.kill()  # SIGKILL: no handler, no `finally` of its own runs
        rank.wait()
        assert _ended(frozen, wait_s=60), [(p.pid, p.status(), p.cmdline()[-4:]) for p in frozen
                                           if p.is_running()]
    finally:
        for p in frozen:  # only ever when the assertion failed (a stopped converter ends only on SIGKILL)
            with contextlib.suppress(Exception):
                p.kill()
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    killed = [p.name for p in tag.parent.iterdir() if p.name.startswith(f".{copy.name}.")]
    assert len(killed) == 1 and not copy.exists(), killed  # its folder, left to the next start
    # A training start's removal: the lock is free, though not at once. The kernel closes a killed process's
    # files after its first thread shows it ended (the zombie psutil sees), for torch's many threads often
    # (a CI run's failure; measured with 30 threads: held in 196 of 200 kills, at most 0.3 ms after).
    deadline = time.monotonic() + 10
    while (removed := checkpoint.remove_leftovers(tag.parent)) != killed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert removed == killed

    assert checkpoint.convert_to_universal(tag, copy, zero_stage=1)
    assert json.loads(record.read_text())["files"] == clean
    assert checkpoint.verify_universal(copy, tag) is None
    assert sorted(p.name for p in tag.parent.iterdir() if "universal" in p.name) == [copy.name]


def test_a_converter_killed_amid_its_workers_fails_the_conversion_and_takes_them_along(tmp_path):
    """The OOM killer's choice is the converter itself, amid its worker processes: they went on (each to its
    task's end, then waiting for the next, forever) holding the converter's output pipes, so rank 0 never saw
    it end and hung in the conversion (measured: 10 minutes, until the workers were killed by hand), instead of
    the one line that says what happened. They end with the converter now (Linux: the parent-death signal)."""
    import subprocess
    import sys

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    tag = _zero1_tag(tmp_path)
    copy = tag.parent / (tag.name + checkpoint.UNIVERSAL_SUFFIX)
    rank = _converting_rank(tag, copy)
    frozen = []
    try:
        frozen = _frozen_conversion(rank)
        frozen[0].kill()  # the converter, as the OOM killer would
        try:
            said, _ = rank.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the converting process still waits; its converter's workers: {frozen[1:]}")
        assert _ended(frozen, wait_s=60), [(p.pid, p.status()) for p in frozen if p.is_running()]
    finally:
        for p in frozen:  # only ever when an assertion failed
            with contextlib.suppress(Exception):
                p.kill()
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert rank.returncode == 1 and said.strip() == (
        f"{tag}: universal checkpoint conversion failed (the converter was killed by SIGKILL: the kernel's OOM "
        "killer, if the node ran out of memory); nothing of it is left: start again, or resume with the world size "
        "it was saved with (zero_stage=1)"), said
    assert sorted(p.name for p in tag.parent.iterdir() if "universal" in p.name) == []
