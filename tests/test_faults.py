"""Faults injected into real training jobs (2 plain processes on gloo, as srun or a launcher starts them), and
what must hold after each: one line and a non-zero exit on every rank, the newest complete checkpoint intact,
the partial one reported and removed at the next start, and a restart that ends bitwise where a run without
the fault ends. The faults themselves live in tests/fault_job.py."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from dist_helpers import (Launch, REPO, free_port, launch_ranks as _launch, launcher_env, learnable_corpus,
                          tiny_config, venv_bin)
from txl_dist.checkpoint import inventory, read_latest

VOCAB = 64
STEPS = 8
TIMEOUT_S = 20  # train.collective_timeout_s of these jobs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults") / "corpus"
    return learnable_corpus(root, 4 * 97, VOCAB)


def _config(corpus, run_dir, **sections) -> str:
    raw = tiny_config(corpus, run_dir, **{
        "train": {"max_steps": STEPS, "collective_timeout_s": TIMEOUT_S, "max_nonfinite": 3,
                  **sections.pop("train", {})},
        "checkpoint": {"interval": 2, "keep": 3, **sections.pop("checkpoint", {})},
        "eval": {"at_end": False, **sections.pop("eval", {})},
        # ZeRO-1: every rank writes a file of its own into a checkpoint (stage 0: rank 0 alone).
        "deepspeed": {"zero_optimization": {"stage": 1}, **sections.pop("deepspeed", {})}, **sections})
    path = run_dir.parent / f"{run_dir.name}.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _start(config: str, *faults: str, resume: str = "auto", world: int = 2, extra=()) -> list[Launch]:
    """`world` plain processes of launch/train.py (through tests/fault_job.py), each told its rank as srun would."""
    return _launch("train", ["--config", config, "--resume", resume, *extra], faults, world)


def _finish(procs: list[Launch], timeout: float = 300) -> list[int]:
    return [p.wait(timeout) for p in procs]


def _errors(proc: Launch) -> list[str]:
    return [line for line in proc.lines if "error:" in line]


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    from txl_dist.safe_load import load_weights_only

    path = run_dir / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
    return load_weights_only(path)["module"]


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The weights after STEPS steps of a run without faults."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    codes = _finish(_start(_config(corpus, run_dir)))
    assert codes == [0, 0]
    return _weights(run_dir, STEPS)


@pytest.mark.parametrize("killed", [1, 0])  # rank 0 hosts the rendezvous store: it goes too
def test_a_rank_killed_mid_step_ends_its_peer_with_one_line_and_the_restart_is_exact(corpus, tmp_path, straight,
                                                                                     killed):
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir)
    procs = _start(config, f"kill-at-step:{killed}:5")
    survivor = procs[1 - killed]
    assert procs[killed].wait(120) == -signal.SIGKILL
    killed_at = time.monotonic()
    assert survivor.wait(TIMEOUT_S + 30) == 1, survivor.output[-3000:]
    assert time.monotonic() - killed_at < TIMEOUT_S + 10
    (line,) = _errors(survivor)
    assert f"rank {killed}" in line and "lost" in line, line
    assert "TCPStore.cpp" not in survivor.output and "frame #" not in survivor.output, survivor.output[-3000:]
    assert inventory(run_dir / "checkpoints").complete == ["step_00000002", "step_00000004"]
    assert _finish(_start(config)) == [0, 0]
    _assert_same_weights(_weights(run_dir, STEPS), straight)


def test_a_job_killed_in_its_final_test_leaves_no_checkpoint_that_skips_it(corpus, tmp_path, straight):
    # The final test runs before the final save: a kill during it leaves the newest periodic checkpoint, and
    # the restart trains the last steps again and tests them (a save first made it find "nothing to do").
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, eval={"at_end": True})
    procs = _start(config, f"kill-in-test:0:{STEPS}")
    assert procs[0].wait(120) == -signal.SIGKILL
    assert procs[1].wait(TIMEOUT_S + 60) == 1
    assert inventory(run_dir / "checkpoints").complete[-1] == f"step_{STEPS - 2:08d}"
    restart = _start(config)
    assert _finish(restart) == [0, 0], restart[0].output[-3000:]
    assert "nothing to do" not in restart[0].output
    assert f"test at step {STEPS}: loss" in restart[0].output
    _assert_same_weights(_weights(run_dir, STEPS), straight)


def test_a_job_killed_before_its_last_save_wrote_latest_is_mended_by_the_restart_with_nothing_to_do(
        corpus, tmp_path, straight):
    # Found by bench/fault_sweep.py (seed 1003 case 17): the save of the last step renamed its folder, then its
    # job ended; the restart had nothing to train, so no save mended `latest` (still naming the tag before, which
    # DeepSpeed's zero_to_fp32.py in the folder would convert) or removed the tag past checkpoint.keep.
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir)  # a checkpoint every 2 steps, keep 3
    procs = _start(config, f"kill-before-latest:0:{STEPS}")
    assert procs[0].wait(120) == -signal.SIGKILL
    assert procs[1].wait(TIMEOUT_S + 60) == 1
    ckpt = run_dir / "checkpoints"
    tags = [f"step_{s:08d}" for s in range(2, STEPS + 1, 2)]
    assert inventory(ckpt).complete == tags and read_latest(ckpt) == tags[-2]
    restart = _start(config)
    assert _finish(restart) == [0, 0], restart[0].output[-3000:]
    assert f"nothing to do: the checkpoint is at step {STEPS}" in restart[0].output
    assert f"`latest` named {tags[-2]}; it names {tags[-1]} now" in restart[0].output
    assert f"removed {tags[0]}: checkpoint.keep keeps the newest 3 tag(s)" in restart[0].output
    assert read_latest(ckpt) == tags[-1] and inventory(ckpt).complete == tags[1:]
    _assert_same_weights(_weights(run_dir, STEPS), straight)
    # The next restart finds nothing to mend and says nothing of it.
    again = _start(config)
    assert _finish(again) == [0, 0] and "`latest` named" not in again[0].output and "removed" not in again[0].output


@pytest.mark.parametrize("fault, rank", [("kill-in-save", 1), ("enospc-in-save", 1), ("enospc-in-save", 0),
                                         ("enospc-in-script-copy", 0)])
def test_a_fault_in_the_middle_of_a_save_keeps_the_previous_checkpoint(corpus, tmp_path, straight, fault, rank):
    """enospc-in-script-copy: before, rank 0's failed copy of DeepSpeed's zero_to_fp32.py raised out of DeepSpeed's
    save while rank 1 waited in its last barrier, and the job hung for checkpoint.timeout_s (an hour)."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    config = _config(corpus, run_dir)
    procs = _start(config, f"{fault}:{rank}:4")
    codes = _finish(procs, timeout=TIMEOUT_S + 120)
    survivors = [p for r, p in enumerate(procs) if not (fault == "kill-in-save" and r == rank)]
    assert all(code != 0 for code in codes), codes
    for survivor in survivors:  # one line each, no C++ trace of the backend or the store
        assert "TCPStore.cpp" not in survivor.output and "frame #" not in survivor.output, survivor.output[-3000:]
    (line,) = _errors(procs[0])
    if fault.startswith("enospc"):
        # The ranks agree on the failure; rank 0 says it for the job, once (rank 1 prints nothing).
        assert f"checkpoint step_00000004 could not be saved: rank {rank}" in line and "No space left" in line
        assert _errors(procs[1]) == []
    else:
        assert "rank 1" in line and "lost" in line, line
    if fault == "enospc-in-script-copy":
        assert f"{ckpt / 'zero_to_fp32.py'}: [Errno 28] No space left on device (DeepSpeed's recovery script)" in line
        assert not (ckpt / "zero_to_fp32.py").exists()  # not a script cut short
    assert read_latest(ckpt) == "step_00000002"
    assert inventory(ckpt).complete == ["step_00000002"]
    # ENOSPC: rank 0 gave the space back at once; a crash leaves the partial tag to the next start.
    expected = [".saving-step_00000004"] if fault == "kill-in-save" else []
    assert [p.name for p in ckpt.glob(".saving-*")] == expected
    restart = _start(config)
    assert _finish(restart) == [0, 0], restart[0].output[-3000:]
    if fault == "kill-in-save":
        assert "removed 1 interrupted save(s): .saving-step_00000004" in restart[0].output
    assert not list(ckpt.glob(".saving-*"))
    _assert_same_weights(_weights(run_dir, STEPS), straight)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_save_that_fails_on_one_rank_outside_its_writes_ends_the_job_at_once(corpus, tmp_path, straight, rank):
    """An error inside DeepSpeed's save that is not a write (out of memory gathering the state): the rank leaves
    DeepSpeed's save between its barriers. Before, it went on to agree on the failure, its collective met the
    others' barrier, and every rank waited for checkpoint.timeout_s, then ended with a traceback."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    config = _config(corpus, run_dir, checkpoint={"timeout_s": 120})
    procs = _start(config, f"fail-in-save:{rank}:4")
    assert _finish(procs, timeout=300) == [1, 1], procs[0].output[-3000:]
    failed_at = float(next(line for line in procs[rank].lines if line.startswith("fail-in-save at ")).split()[-1])
    assert time.time() - failed_at < TIMEOUT_S / 2
    for p in procs:
        (line,) = _errors(p)
        assert (f"checkpoint step_00000004 could not be saved: DeepSpeed's save failed on rank {rank} (RuntimeError: "
                "fail-in-save: out of memory gathering this rank's state); the checkpoint before it is kept") in line
        assert "Traceback" not in p.output and "frame #" not in p.output, p.output[-3000:]
    if rank == 1:
        assert "rank 1 (host" in _errors(procs[0])[0]
    assert read_latest(ckpt) == "step_00000002" and inventory(ckpt).complete == ["step_00000002"]
    restart = _start(config)
    assert _finish(restart) == [0, 0], restart[0].output[-3000:]
    assert not list(ckpt.glob(".saving-*"))
    _assert_same_weights(_weights(run_dir, STEPS), straight)


def test_a_rank_that_fails_before_it_joins_ends_the_waiting_rank_at_once_naming_it(corpus, tmp_path):
    """Rank 1 fails in its start-up before the rendezvous (srun's layout: rank 0 hosts the store). Before, rank 0
    waited in the join for the timeout (train.collective_timeout_s, ten minutes by default; under srun nothing
    else ends it), then said rank 1 did not join, not why."""
    procs = _start(_config(corpus, tmp_path / "run"), "fail-before-join:1:0")
    codes = _finish(procs, timeout=TIMEOUT_S + 120)
    failed_at = float(next(line for line in procs[1].lines if line.startswith("fail-before-join at ")).split()[-1])
    assert codes == [1, 1], procs[0].output[-3000:]
    (line,) = _errors(procs[0])
    assert re.search(r"error: rank 1 \(host [^)]+\) failed while starting, before it joined the others: "
                     r"fail-before-join: CUDA error: no CUDA-capable device is detected; stopping$", line), line
    assert time.time() - failed_at < TIMEOUT_S / 2  # the join's timeout is longer than TIMEOUT_S
    assert "fail-before-join: CUDA error" in procs[1].output  # rank 1 says it too (its traceback)


def test_a_save_slower_than_the_collective_timeout_completes(corpus, tmp_path):
    """Rank 0 writes its 2 DeepSpeed files (ZeRO 1) for longer than train.collective_timeout_s: the other rank waits
    for it within checkpoint.timeout_s (every wait of a save, DeepSpeed's barrier inside it included, is on the
    control group), and the run goes on."""
    from fault_job import SLOW_SAVE_S

    timeout_s = 6
    assert 2 * SLOW_SAVE_S > timeout_s + 2 * 2  # beyond the default group's timeout (collective_timeout_s + 2 beats)
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"collective_timeout_s": timeout_s, "max_steps": 3},
                     checkpoint={"interval": 2, "timeout_s": 120})
    procs = _start(config, "slow-save:0:2")
    assert _finish(procs, timeout=SLOW_SAVE_S + 180) == [0, 0], procs[1].output[-3000:]
    assert inventory(run_dir / "checkpoints").complete == ["step_00000002", "step_00000003"]
    assert not any(_errors(p) for p in procs)


def test_a_resume_refused_on_one_rank_is_refused_on_every_rank(corpus, tmp_path):
    """A refusal while one rank restores (its rank file gone since start-up verified the tag) ends every rank
    at once with exit 2; the other rank does not go on to wait in the first step's collectives. Saved by 1 rank,
    so that 2 ranks load its universal copy: DeepSpeed's load has collectives then."""
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"exit_step": 2})
    assert _finish(_start(config, world=1)) == [0]
    procs = _start(config, "refuse-load:1:2", extra=["--set", "train.exit_step=null"])
    assert _finish(procs, timeout=TIMEOUT_S + 60) == [2, 2], procs[0].output[-3000:]
    # One line for the job, on rank 0 (and so in its log file): the rank that refused, its host and message.
    (line,) = _errors(procs[0])
    assert re.search(r"error: rank 1 \(\S+\) failed while starting: .*rank-00001.pt: missing \(refuse-load\)", line)
    assert _errors(procs[1]) == []
    assert inventory(run_dir / "checkpoints").complete == ["step_00000002"]
    # A failure inside DeepSpeed's load, whose collectives rank 0 has entered: one line each, exit 1, at once
    # (not after train.collective_timeout_s, nor with a traceback).
    procs = _start(config, "fail-in-load:1:2", extra=["--set", "train.exit_step=null"])
    assert _finish(procs, timeout=TIMEOUT_S + 60) == [1, 1], procs[0].output[-3000:]
    failed_at = float(next(line for line in procs[1].lines if line.startswith("fail-in-load at ")).split()[-1])
    assert time.time() - failed_at < TIMEOUT_S / 2
    for p in procs:
        (line,) = _errors(p)
        assert "DeepSpeed's load failed ([Errno 2] file gone in fail-in-load" in line, line
        assert "Traceback" not in p.output
    assert "rank 1" in _errors(procs[0])[0]


def test_a_hung_rank_is_named_within_the_collective_timeout(corpus, tmp_path):
    run_dir = tmp_path / "run"
    procs = _start(_config(corpus, run_dir, train={"collective_timeout_s": 8}), "stop-at-step:1:3")
    try:
        deadline = time.monotonic() + 120
        while psutil.Process(procs[1].proc.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, procs[1].output[-2000:]
            time.sleep(0.2)
        stopped_at = time.monotonic()
        assert procs[0].wait(60) == 1, procs[0].output[-3000:]
        assert time.monotonic() - stopped_at < 8 + 15
        (line,) = _errors(procs[0])
        assert "rank 1" in line, line
    finally:
        procs[1].kill()


def _assert_rank_1_named_stuck(procs: list[Launch], stuck_past: str, waiting_in: str, waited_s: str,
                               frames: list[str]) -> None:
    """Rank 0 ends with one line naming rank 1 stuck past `stuck_past` while it waited `waited_s` (patterns) in
    `waiting_in`; rank 1 logs its stack (holding `frames`) and ends with the same line."""
    assert procs[0].wait(120) == 1, procs[0].output[-3000:]
    (line,) = _errors(procs[0])
    assert re.search(rf"rank 1 \(host [^)]+, pid \d+\) is stuck: its heartbeat goes on, but it has not gone past "
                     rf"{stuck_past} for \d+ s or more, while rank 0 \(host [^)]+\) has waited in {waiting_in} "
                     rf"for {waited_s} s; its stack is in its log; stopping", line), line
    assert procs[1].wait(30) == 1, procs[1].output[-3000:]
    assert "this rank was found stuck; its main thread is here:" in procs[1].output
    assert all(frame in procs[1].output for frame in frames), procs[1].output[-3000:]
    assert _errors(procs[1])[-1].endswith(line.split("error: ", 1)[1])


@pytest.mark.parametrize("fault, eval_interval, stuck_past, waiting_in, frames", [
    # Step 2 saved a checkpoint: its last phase is where rank 1 was before it read step 3's first batch. The
    # other rank waits in step 3's first collective: ZeRO 1 reduces in the last micro batch's backward.
    ("hang-at-step:1:3", 0, "saving step 2: older checkpoints pruned",
     r"step 3, micro batch (\d+)/\1, its forward done",
     ["in _hang_reading_a_batch", "in train_step"]),
    ("hang-in-eval:1:2", 2, "evaluation of valid after step 2, segment 1",
     "evaluation of valid after step 2, segment 3", ["in _hang_reading_a_batch", "in run_eval"]),
    # The other rank waits in the same collective, past rank 1's last note.
    ("hang-in-forward:1:3", 0, r"step 3, micro batch (\d+)/\1", r"step 3, micro batch (\d+)/\2, its forward done",
     ["in _deadlocked_in_the_forward", "in train_step"]),
], ids=["reading_its_batch", "in_an_evaluation", "in_its_forward"])
def test_a_stuck_rank_is_named_with_where_it_is(corpus, tmp_path, fault, eval_interval, stuck_past, waiting_in,
                                                frames):
    """Its process lives and beats, so no heartbeat goes missing: its progress names it (before: on gloo, 'a
    collective failed while ranks [1] still answer'; on nccl, nccl's own abort)."""
    run_dir = tmp_path / "run"
    procs = _start(_config(corpus, run_dir, train={"collective_timeout_s": 8}, eval={"interval": eval_interval}),
                   fault)
    try:
        _assert_rank_1_named_stuck(procs, stuck_past, waiting_in, r"\d+", frames)
        # The evaluation comes before the save of its step.
        assert read_latest(run_dir / "checkpoints") == (None if eval_interval else "step_00000002")
    finally:
        procs[1].kill()


def test_a_rank_stuck_writing_its_checkpoint_is_named_after_checkpoint_timeout(corpus, tmp_path):
    """The others wait in the save for checkpoint.timeout_s (a slow write is no fault: see the slow-save test),
    then the one line names the stuck rank and where it is; before, the save's barrier timed out with 'a
    collective failed while ranks [1] still answer', after checkpoint.timeout_s without a word."""
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"collective_timeout_s": 6, "max_steps": 3},
                     checkpoint={"interval": 2, "timeout_s": 12})
    procs = _start(config, "hang-in-save:1:2")
    try:
        _assert_rank_1_named_stuck(procs, "saving step 2: DeepSpeed's save, barrier 1",
                                   "saving step 2: DeepSpeed's save, barrier 2", "1[2-9]",
                                   ["in _hang_writing_a_file", "in save"])
        assert inventory(run_dir / "checkpoints").complete == []
    finally:
        procs[1].kill()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nonfinite_step_is_skipped_and_the_poisoned_memory_reset(corpus, tmp_path, precision):
    # bf16: DeepSpeed's mixed-precision ZeRO optimizer finds the overflow itself (fp32: the trainer's own check).
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    # Stop right after the poisoned step 3 (a save at exit_step happens even during non-finite steps).
    train = {"precision": precision}
    first = _start(_config(corpus, run_dir, train={"exit_step": 3, **train}, checkpoint={"interval": 1, "keep": 0}),
                   "nan-at-step:1:3")
    assert _finish(first) == [0, 0], first[0].output[-3000:]
    assert "step 3: non-finite loss or gradient norm; the step was skipped" in first[0].output
    # Skipped: the weights after step 3 are those after step 2.
    _assert_same_weights(_weights(run_dir, 3), _weights(run_dir, 2))
    # The poisoned micro batch of rank 1 restarted its memory; the other streams kept theirs.
    rank1 = torch.load(ckpt / "step_00000003" / "txl_state" / "rank-00001.pt", weights_only=True)
    forgotten = [s for s, mems in rank1["mems"]["mems"].items() if not mems]
    assert forgotten == [2], rank1["mems"]["mems"].keys()
    assert rank1["trainer"]["nonfinite_steps"] == 1 and rank1["trainer"]["nonfinite_streak"] == 1
    # The run goes on from there (the forgotten memory starts empty), the next step moves the weights again.
    rest = _start(_config(corpus, run_dir, train=train, checkpoint={"interval": 1, "keep": 0}))
    assert _finish(rest) == [0, 0], rest[0].output[-3000:]
    with pytest.raises(AssertionError):
        _assert_same_weights(_weights(run_dir, 4), _weights(run_dir, 3))
    final = json.loads((ckpt / f"step_{STEPS:08d}" / "txl_state" / "run.json").read_text())
    assert final["nonfinite_steps"] == 1 and final["nonfinite_streak"] == 0


def test_a_diverged_run_stops_with_exit_1_and_keeps_its_checkpoints(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    procs = _start(_config(corpus, run_dir, checkpoint={"interval": 1, "keep": 2}), "nan-from-step:0:4")
    assert _finish(procs) == [1, 1], procs[0].output[-3000:]
    (line,) = _errors(procs[0])
    assert "training diverged: steps 4..6 (3 in a row, train.max_nonfinite 3)" in line, line
    assert "the weights are those after step 3" in line and "step_00000003" in line
    assert _errors(procs[1]) == []  # the ranks agreed: one line for the job
    # No periodic save during the non-finite steps: the last good checkpoint is the newest one.
    assert inventory(ckpt).complete == ["step_00000002", "step_00000003"]
    assert "no periodic checkpoint during a run of non-finite steps" in procs[0].output


def test_a_second_job_on_the_run_folder_is_refused_until_the_first_is_gone(corpus, tmp_path):
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"max_steps": 1000})
    first = _start(config)
    first[0].wait_for("step 2/1000")
    second = _start(config)
    assert _finish(second) == [2, 2]
    (line,) = _errors(second[0])
    assert f"run.dir {run_dir} is in use by another job" in line and f"pid {first[0].proc.pid}" in line
    for p in first:
        p.kill()  # SIGKILL: the lock must not outlive its holder
    third = _start(config, extra=["--set", "train.max_steps=4"])
    assert _finish(third) == [0, 0], third[0].output[-3000:]


def test_a_damaged_checkpoint_is_refused_unless_fallback_and_nothing_is_deleted(corpus, tmp_path, straight):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    config = _config(corpus, run_dir, train={"exit_step": 6})
    assert _finish(_start(config)) == [0, 0]
    shard = ckpt / "step_00000006" / "txl_state" / "rank-00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    config = _config(corpus, run_dir)
    refused = _start(config)
    assert _finish(refused) == [2, 2]
    (line,) = _errors(refused[0])
    assert f"checkpoint step_00000006 is damaged: {shard}: sha256 differs" in line, line
    assert "checkpoint.fallback=true" in line
    fallback = _start(config, extra=["--set", "checkpoint.fallback=true"])
    assert _finish(fallback) == [0, 0], fallback[0].output[-3000:]
    assert "falling back to step_00000004" in fallback[0].output
    superseded = list((ckpt / "superseded").glob("*/step_00000006"))
    assert len(superseded) == 1  # the damaged tag is moved aside, not deleted
    _assert_same_weights(_weights(run_dir, STEPS), straight)


def test_auto_resume_does_not_trust_latest_and_none_or_a_rollback_never_delete(corpus, tmp_path, straight):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    config = _config(corpus, run_dir, train={"exit_step": 6})
    assert _finish(_start(config)) == [0, 0]
    (ckpt / "latest").unlink()
    none = _start(config, resume="none")
    assert _finish(none) == [2, 2]
    assert "already holds checkpoints up to step_00000006" in _errors(none[0])[0]
    config = _config(corpus, run_dir)
    rollback = _start(config, resume=str(ckpt / "step_00000004"))
    assert _finish(rollback) == [0, 0], rollback[0].output[-3000:]
    assert "moved 1 newer tag(s) (step_00000006)" in rollback[0].output
    assert len(list((ckpt / "superseded").glob("*/step_00000006/txl_state/run.json"))) == 1
    _assert_same_weights(_weights(run_dir, STEPS), straight)


def test_a_rollback_refused_at_its_mlflow_run_leaves_the_newer_tags_in_place(corpus, tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    assert _finish(_start(_config(corpus, run_dir, train={"exit_step": 6}))) == [0, 0]
    refused = _start(_config(corpus, run_dir), resume=str(ckpt / "step_00000004"),
                     extra=["--set", "tracking.enabled=true", "--set", f"tracking.uri=http://127.0.0.1:{free_port()}"])
    assert _finish(refused) == [2, 2]
    (line,) = _errors(refused[0])
    assert "cannot open an MLflow run" in line, line
    assert "moved step_00000006 back from" in refused[0].output
    assert inventory(ckpt).complete == ["step_00000002", "step_00000004", "step_00000006"]
    assert not (ckpt / "superseded").exists()
    resumed = _start(_config(corpus, run_dir, train={"exit_step": 8}))
    assert _finish(resumed) == [0, 0], resumed[0].output[-3000:]
    assert "step_00000006 at step 6" in resumed[0].output


def test_a_rollback_with_a_lower_lr_continues_in_a_new_mlflow_run(corpus, tmp_path):
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    tracking = {"enabled": True, "experiment": "rollback", "system_metrics": False}
    first = _start(_config(corpus, run_dir, train={"exit_step": 6}, tracking=tracking))
    assert _finish(first) == [0, 0], first[0].output[-3000:]
    r1 = (run_dir / "tracking" / "run_id").read_text().strip()
    # After a divergence, say: back to step 4 with a tenth of the learning rate.
    lower = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.0, "torch_adam": True}}}
    rollback = _start(_config(corpus, run_dir, tracking=tracking, deepspeed=lower),
                      resume=str(run_dir / "checkpoints" / "step_00000004"))
    assert _finish(rollback) == [0, 0], rollback[0].output[-3000:]
    r2 = (run_dir / "tracking" / "run_id").read_text().strip()
    assert r2 != r1 and f"MLflow run {r1} went past step 4" in rollback[0].output
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")

    def by_step(run_id, key):
        values = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert len(values) == len({s for s, _ in values}), (key, values)  # each step once
        return dict(values)

    lr1, lr2 = by_step(r1, "train/lr"), by_step(r2, "train/lr")
    assert sorted(lr1) == [1, 2, 3, 4, 5, 6] and sorted(lr2) == list(range(1, STEPS + 1))
    assert [lr2[s] for s in (1, 2, 3, 4)] == [lr1[s] for s in (1, 2, 3, 4)]
    assert all(lr2[s] < lr1[s] / 5 for s in (5, 6))  # the new schedule, not the rolled-back values
    assert sorted(by_step(r2, "train/loss")) == list(range(1, STEPS + 1))
    assert client.get_run(r2).data.tags["txl.continues_run"] == r1
    # How each job ended, on its run (the MLflow status alone says KILLED for a planned stop too).
    assert client.get_run(r1).data.tags["txl.ended"] == ("stopped at train.exit_step 6; the next job resumes "
                                                          "from step_00000006")
    assert client.get_run(r2).data.tags["txl.ended"] == f"finished at step {STEPS}"
    # The checkpoints saved after the rollback name the continuation.
    assert json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "txl_state" / "run.json").read_text())[
        "mlflow_run_id"] == r2


def _no_worker_left(config: str) -> bool:
    for p in psutil.process_iter(["cmdline"]):
        if config in " ".join(p.info["cmdline"] or []):
            return False
    return True


@pytest.mark.parametrize("launcher, sig, to_group", [
    ("torchrun", signal.SIGUSR1, False), ("deepspeed", signal.SIGTERM, False),
    # Ctrl-C in a terminal: SIGINT to the launcher and its workers at once (torchrun forwards another one)
    ("torchrun", signal.SIGINT, True), ("deepspeed", signal.SIGINT, True)])
def test_a_signal_to_the_launcher_saves_and_leaves_no_orphan(corpus, tmp_path, launcher, sig, to_group):
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"max_steps": 1000})
    script = str(REPO / "launch" / "train.py")
    count = "--nproc_per_node" if launcher == "torchrun" else "--num_gpus"
    proc = Launch([venv_bin(launcher), count, "2", "--master_port", str(free_port()), script, "--config", config])
    proc.wait_for("step 3/1000")
    if to_group:
        os.killpg(proc.proc.pid, sig)
    else:
        proc.proc.send_signal(sig)
    proc.wait(120)
    deadline = time.monotonic() + 60
    while not _no_worker_left(config):
        assert time.monotonic() < deadline, "a worker outlived its launcher"
        time.sleep(0.5)
    tags = inventory(run_dir / "checkpoints").complete
    assert tags, proc.output[-3000:]
    step = int(tags[-1][5:])
    assert step >= 3
    info = json.loads((run_dir / "checkpoints" / tags[-1] / "txl_state" / "run.json").read_text())
    assert info["step"] == step
    log = (run_dir / "logs" / "train.log").read_text()
    assert "is gone" in log or "SIGTERM" in log or "SIGUSR1" in log or "SIGINT" in log, log[-2000:]
    assert f"stopping after step {step}" in log
    if to_group:
        assert "Ctrl-C: saving a checkpoint at the next step boundary" in proc.output


def test_ctrl_c_asks_for_a_save_and_a_second_one_later_stops_at_once(monkeypatch):
    import txl_dist.stop_request as stop_request

    clock = [100.0]
    monkeypatch.setattr(stop_request.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(stop_request, "_first_interrupt", None)
    monkeypatch.setattr(stop_request, "_early_signal", None)
    previous = signal.getsignal(signal.SIGINT)
    request = stop_request.StopRequest()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # a real signal: the handler runs before the next line
        assert request.reason() == "SIGINT"
        clock[0] += 0.05  # torchrun forwards the terminal's Ctrl-C: the same press, not an insistent user
        os.kill(os.getpid(), signal.SIGINT)
        assert request.reason() == "SIGINT"
        clock[0] += stop_request.FORCE_AFTER_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # (the handler raises here at the latest)
    finally:
        request.restore()
    assert signal.getsignal(signal.SIGINT) is previous


def test_the_stop_line_gives_the_jobs_reasons_with_their_ranks_when_they_differ():
    from txl_dist.stop_request import describe_reasons

    assert describe_reasons(["SIGUSR1", "SIGUSR1"]) == "SIGUSR1"
    assert describe_reasons([None, "SIGUSR1"]) == "SIGUSR1"  # told by the others: not named
    assert describe_reasons(["SIGTERM", "SIGINT", "SIGINT", "SIGINT"]) == "SIGTERM on rank 0; SIGINT on ranks 1-3"
    assert describe_reasons(["x" if r % 2 else None for r in range(20)]) == "x"
    mixed = ["y" if r % 3 == 0 else "x" for r in range(20)]
    assert describe_reasons(mixed) == "y on ranks 0, 3, 6, 9 and 3 more; x on ranks 1, 2, 4, 5 and 9 more"
    assert describe_reasons([None, None]) == "a stop request"


def test_a_stop_signal_during_start_up_is_kept_and_honoured_after_the_first_step(corpus, tmp_path):
    run_dir = tmp_path / "run"
    procs = _start(_config(corpus, run_dir, train={"max_steps": 1000}))
    time.sleep(1.0)  # inside the imports of torch and DeepSpeed, long before the first step
    for p in procs:
        p.proc.send_signal(signal.SIGUSR1)
    assert _finish(procs) == [0, 0], procs[0].output[-3000:]
    assert "stopping after step 1 (SIGUSR1): saving a checkpoint" in procs[0].output
    assert inventory(run_dir / "checkpoints").complete == ["step_00000001"]


LAUNCHER_GONE_IN_START_UP = """
import os, subprocess, sys, time
# torchrun: this process's command line names it, so its worker counts it as its launcher
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
os._exit(0)  # gone while its worker starts (SIGUSR1 to torchrun, any signal to the deepspeed runner)
"""
WORKER_IN_START_UP = """
import os, sys, time
from txl_dist import stop_request
stop_request.catch_stop_signals()  # the first line of launch/train.py
open(sys.argv[2], "w").close()
while os.getppid() == int(sys.argv[1]):  # the imports, the corpus' hashing: its launcher dies meanwhile
    time.sleep(0.01)
print(stop_request.StopRequest().reason(), flush=True)  # what the first step asks
"""


def test_a_launcher_gone_during_the_start_up_stops_training_after_its_first_step(tmp_path):
    """Before, the launchers were looked for as training began; the worker, reparented by then, had none: killing
    the deepspeed runner while its workers started (measured: 1 s after they existed) left them training every
    step to the end, orphans."""
    done = subprocess.run([sys.executable, "-c", LAUNCHER_GONE_IN_START_UP, WORKER_IN_START_UP,
                           str(tmp_path / "started")], cwd=REPO, capture_output=True, text=True, timeout=120)
    said = done.stdout.strip()
    assert said.startswith("its launcher (torchrun, host ") and said.endswith(" is gone"), done.stdout + done.stderr


def _with_evals(corpus, run_dir) -> str:
    """Validation at step 4 and at the end, test and final_eval.json at the end, an MLflow run (sqlite in run_dir)."""
    return _config(corpus, run_dir, eval={"interval": 4, "at_end": True},
                   tracking={"enabled": True, "experiment": "evals", "system_metrics": False})


def _mlflow(run_dir):
    from mlflow import MlflowClient

    run_id = (run_dir / "tracking" / "run_id").read_text().strip()
    return MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}"), run_id


def _evaluations(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every valid/* and test/* metric of the run folder's MLflow run: its (step, value) points, repeats kept."""
    client, run_id = _mlflow(run_dir)
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith(("valid/", "test/"))]
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def _final_eval(run_dir, dst) -> dict | None:
    client, run_id = _mlflow(run_dir)
    if "final_eval.json" not in {a.path for a in client.list_artifacts(run_id)}:
        return None
    return json.loads(open(client.download_artifacts(run_id, "final_eval.json", str(dst))).read())


def _owed(run_dir, step: int) -> bool:
    return json.loads((run_dir / "checkpoints" / f"step_{step:08d}" / "txl_state" / "run.json").read_text())[
        "evals_owed"]


@pytest.fixture(scope="module")
def evaluated(corpus, tmp_path_factory):
    """A run with evaluations and no fault: its run folder, evaluation metrics and final_eval.json."""
    run_dir = tmp_path_factory.mktemp("evaluated") / "run"
    procs = _start(_with_evals(corpus, run_dir))
    assert _finish(procs) == [0, 0], procs[0].output[-3000:]
    metrics = _evaluations(run_dir)
    assert sorted(s for s, _ in metrics["valid/loss"]) == [4, STEPS] and [s for s, _ in metrics["test/loss"]] == [STEPS]
    return run_dir, metrics, _final_eval(run_dir, run_dir.parent)


def test_a_stop_in_the_last_step_saves_first_and_the_restart_runs_the_final_evaluation(corpus, tmp_path, evaluated):
    """Before, the stop saved and the job ended FINISHED without valid/test at the last step or final_eval.json,
    and the restart said "nothing to do: the checkpoint is at step 8"."""
    straight_dir, straight, straight_final = evaluated
    run_dir = tmp_path / "run"
    config = _with_evals(corpus, run_dir)
    stopped = _start(config, f"sigterm-at-step:0:{STEPS - 1}")  # seen by the ranks in step STEPS
    assert _finish(stopped) == [0, 0], stopped[0].output[-3000:]
    out = stopped[0].output
    assert (f"stopping after step {STEPS} (SIGTERM): saving a checkpoint; its evaluation is left to the next job"
            in out), out[-3000:]
    assert f"valid at step {STEPS}" not in out and "test at step" not in out
    assert _owed(run_dir, STEPS)
    client, run_id = _mlflow(run_dir)
    assert client.get_run(run_id).info.status == "KILLED"  # not finished: its final evaluation is owed
    assert client.get_run(run_id).data.tags["txl.ended"] == (
        f"stopped after step {STEPS} (SIGTERM); the next job resumes from step_{STEPS:08d}, evaluating its step first")
    assert _final_eval(run_dir, tmp_path) is None
    resumed = _start(config)
    assert _finish(resumed) == [0, 0], resumed[0].output[-3000:]
    out = resumed[0].output
    assert "nothing to do" not in out
    assert out.count(f"valid at step {STEPS}:") == 1 and out.count(f"test at step {STEPS}:") == 1, out[-3000:]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["txl.ended"] == f"finished at step {STEPS}"
    assert _evaluations(run_dir) == straight  # each evaluation once, with the uninterrupted run's numbers
    final = _final_eval(run_dir, tmp_path)
    assert final.pop("checkpoint") == str(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert straight_final.pop("checkpoint") == str(straight_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert final == straight_final


def test_a_stop_at_an_eval_interval_step_leaves_its_validation_to_the_restart(corpus, tmp_path, evaluated):
    """Before, the validation at that step was never run: the restart went on with the next step."""
    straight_dir, straight, _ = evaluated
    run_dir = tmp_path / "run"
    config = _with_evals(corpus, run_dir)
    stopped = _start(config, "sigterm-at-step:0:3")  # seen in step 4, an eval.interval step
    assert _finish(stopped) == [0, 0], stopped[0].output[-3000:]
    assert "stopping after step 4 (SIGTERM): saving a checkpoint; its evaluation is left" in stopped[0].output
    assert "valid at step" not in stopped[0].output
    assert _owed(run_dir, 4)
    resumed = _start(config)
    assert _finish(resumed) == [0, 0], resumed[0].output[-3000:]
    assert resumed[0].output.count("valid at step 4:") == 1
    assert _evaluations(run_dir) == straight  # valid at 4 once (and at 8, test at 8) with the straight numbers
    assert not _owed(run_dir, STEPS)
    # The evaluation before step 5 changed nothing of the training: bitwise the straight run's weights.
    _assert_same_weights(_weights(run_dir, STEPS), _weights(straight_dir, STEPS))


def test_a_token_id_outside_the_vocabulary_stops_every_rank_with_one_line_naming_it(tmp_path):
    """A corpus whose checksums are right but whose writer was not data_prep: an id >= the vocabulary in rank
    1's streams. Rank 1 stops with one line naming the position (not an IndexError deep in the model), and
    rank 0 with the line rank 1 told it (`stopped after an error`), not by its own watch of a silent rank after
    train.collective_timeout_s."""
    from dist_helpers import learnable_stream, write_corpus

    train = learnable_stream(4 * 97, VOCAB, 0)
    bad_at = 2 * 97 + 30  # stream 2 of 4: rank 1's
    train[bad_at] = VOCAB + 5
    corpus = write_corpus(tmp_path / "corpus", {"train": train, "valid": learnable_stream(80, VOCAB, 1),
                                               "test": learnable_stream(80, VOCAB, 2)}, vocab_size=VOCAB)
    run_dir = tmp_path / "run"
    procs = _start(_config(corpus, run_dir, train={"collective_timeout_s": 120}))
    assert _finish(procs, timeout=400) == [1, 1], procs[1].output[-3000:]
    (line,) = _errors(procs[1])
    told = f"token {bad_at} of the split's stream is id {VOCAB + 5}, outside [0, {VOCAB}) of its tokenizer"
    assert told in line and "Traceback" not in procs[1].output
    (line,) = _errors(procs[0])
    assert re.search(r"rank 1 \(.*\) stopped after an error: .*" + re.escape(told), line), line


@pytest.mark.parametrize("fault, stuck_past, waiting_in, frames", [
    ("hang-in-verify:1:2", "start-up: the checkpoint folder surveyed",
     "start-up: its share of checkpoint step_00000002 verified", ["in hanging_verify", "in _verified"]),
    ("hang-in-load:1:2", "start-up: the engine built", "start-up: checkpoint step_00000002 loaded",
     ["in hanging_load", "in load_engine"]),
], ids=["verifying_the_checkpoint", "reading_its_optimizer_file"])
def test_a_rank_stuck_while_resuming_is_named_with_where_it_is(corpus, tmp_path, fault, stuck_past, waiting_in,
                                                               frames):
    """Start-up's phases wait on the control group (checkpoint.timeout_s): a rank stuck in one, its process
    alive (a file system that stopped answering), is named with its stack once the others have waited that
    long; before, the control group's timeout ended the job with 'a collective failed while ranks [1] still
    answer (the failure is elsewhere)'."""
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"collective_timeout_s": 6, "exit_step": 2},
                     checkpoint={"interval": 2, "timeout_s": 12})
    assert _finish(_start(config)) == [0, 0]
    procs = _start(config, fault, extra=["--set", "train.exit_step=null"])
    try:
        _assert_rank_1_named_stuck(procs, stuck_past, waiting_in, "1[2-9]", frames)
        assert inventory(run_dir / "checkpoints").complete == ["step_00000002"]
    finally:
        procs[1].kill()


def test_a_rank_stuck_loading_the_checkpoint_it_evaluates_is_named(corpus, tmp_path):
    """launch/eval.py notes its start-up and segments too: the other rank, in the evaluation's collectives,
    names the rank whose read never returns."""
    run_dir = tmp_path / "run"
    config = _config(corpus, run_dir, train={"collective_timeout_s": 6, "exit_step": 2},
                     checkpoint={"interval": 2, "timeout_s": 12})
    assert _finish(_start(config)) == [0, 0]
    procs = _launch("eval", ["--checkpoint", str(run_dir)], ["hang-in-load:1:2"], world=2)
    try:
        _assert_rank_1_named_stuck(procs, "start-up: the engine built", r"evaluation of test, segment \d+", r"\d+",
                                   ["in hanging_load", "in load_engine"])
    finally:
        procs[1].kill()


def _task_of_its_own_node(config: str, rank: int, world: int, address: str, port: str) -> Launch:
    """launch/train.py as the one task of a node, told its rank, world and rendezvous as a launcher would."""
    return Launch([sys.executable, "launch/train.py", "--config", config], launcher_env() | {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": address, "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("started, address", [([0], "127.0.0.1"), ([1], "127.0.0.1"), ([0, 1], "no-such-host.invalid")],
                         ids=["rank_1_never_starts", "rank_0_never_starts", "a_wrong_master_addr"])
def test_a_rank_that_never_joins_is_named_in_one_line(corpus, tmp_path, started, address):
    """A node whose task did not start, or that cannot reach rank 0: before, rank 0 ended with torch's 'Timed
    out after 9 seconds waiting for clients. 1/2 clients joined' (which rank?), and a rank that could not
    reach rank 0 logged a C++ stack trace for every try of its store client (rank 0 too, for a MASTER_ADDR it
    could not resolve)."""
    config = _config(corpus, tmp_path / "run", train={"collective_timeout_s": 6})
    port = str(free_port())
    began = time.monotonic()
    procs = [_task_of_its_own_node(config, rank, 2, address, port) for rank in started]
    assert [p.wait(120) for p in procs] == [1] * len(procs), procs[0].output[-3000:]
    assert time.monotonic() - began < 8 + 30  # the process group's timeout (T + 2 beats), and the start-up
    store = rf"the rendezvous store at {re.escape(address)}:{port} \(MASTER_ADDR:MASTER_PORT\), hosted by rank 0"
    for rank, proc in zip(started, procs):
        (line,) = _errors(proc)
        if rank == 0:
            assert re.search(rf"error: rank 1 did not join the job within 8 s: 1 of 2 joined {store}; each rank's "
                             r"task must start \(the launcher's host list, that node's log\) and reach "
                             "MASTER_ADDR:MASTER_PORT; stopping$", line.strip()), line
        else:
            assert re.search(rf"error: rank 1 \(host [^)]+\) could not reach {store}, within 8 s: rank 0 has not "
                             r"started it, or this host cannot reach that address \(a wrong MASTER_ADDR, a firewall; "
                             r"last try: [^)]+\); stopping$", line.strip()), line
            # Half-way, while rank 0 can still be started: the job's one warning (the lowest client rank's).
            assert len(re.findall(rf"warning: rank 1 \(host [^)]+\) has not reached {store}, for \d+ s: rank 0 has "
                                  r"not started it", proc.output)) == 1, proc.output[-3000:]
        assert "frame #" not in proc.output and "c10d" not in proc.output and "Traceback" not in proc.output


def test_a_task_started_with_another_world_size_stops_every_rank_at_once(corpus, tmp_path):
    """A hand-set WORLD_SIZE that differs between tasks: before, the ranks waited out the group's timeout for
    ranks that do not exist and named them as missing (or the one with the smaller world went on alone)."""
    config = _config(corpus, tmp_path / "run", train={"collective_timeout_s": 60}, eval={"n_streams": 4})
    port = str(free_port())
    began = time.monotonic()
    procs = [_task_of_its_own_node(config, rank, world, "127.0.0.1", port) for rank, world in ((0, 2), (1, 4))]
    assert [p.wait(120) for p in procs] == [1, 1], (procs[0].output[-3000:], procs[1].output[-3000:])
    assert time.monotonic() - began < 45  # at once after start-up, not after the group's 60 s timeout
    lines = [_errors(proc)[0].strip() for proc in procs]
    assert lines[0].split("error: ", 1)[1] == lines[1].split("error: ", 1)[1], lines  # the refused rank's line
    assert re.search(r"error: rank (1|0) \(host [^)]+\) was started with a world size of (4|2), rank (0|1) \(host "
                     r"[^)]+\) with (2|4): every task of a job must be started with the same world size \(WORLD_SIZE, "
                     r"or SLURM_NTASKS under srun: one launcher command for all nodes\); stopping$", lines[0]), lines
    for proc in procs:
        assert len(_errors(proc)) == 1 and "Traceback" not in proc.output and "frame #" not in proc.output


# ----------------------------------------------------------------------------------------------------
# SIGTERM to a job with nothing to save (an evaluation, an export): one line on each rank it reached, exit
# status 143 (128 + SIGTERM, as data_prep and a shell report it), and no partial output left behind.


@pytest.fixture(scope="module")
def saved_run(corpus, tmp_path_factory):
    """A run folder with a 2-rank ZeRO-1 checkpoint of step 2."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    config = _config(corpus, run_dir, train={"exit_step": 2}, checkpoint={"interval": 2})
    assert _finish(_start(config)) == [0, 0]
    return run_dir


@pytest.mark.parametrize("world, signalled, sig", [(1, [0], "SIGTERM"), (2, [0, 1], "SIGTERM"), (2, [1], "SIGTERM"),
                                                  (1, [0], "SIGUSR1")],
                         ids=["one_rank", "every_rank_scancel", "one_of_two_ranks", "sigusr1"])
def test_sigterm_to_an_evaluation_says_where_on_each_rank_it_reached_and_writes_nothing(saved_run, tmp_path, world,
                                                                                          signalled, sig):
    """Before, the evaluation died of the signal (status 143 from a shell, -15 here) without a word; of SIGUSR1
    (Slurm's --signal=USR1@..., scancel --signal=USR1), silently with status 138, until it was taken as SIGTERM."""
    out = tmp_path / "out"
    out.mkdir()
    faults = [f"{sig.lower()}-in-eval:{rank}:2" for rank in signalled]
    procs = _launch("eval", ["--checkpoint", str(saved_run), "--split", "valid", "--json-out", str(out / "r.json")],
                    faults, world)
    codes = _finish(procs)
    # The checkpoint's run evaluated 2 streams of 3 segments; one rank runs them one after the other (eval
    # groups of at most the training micro batch, 1): 6 segments.
    segments = 3 * 2 // world
    for rank, (proc, code) in enumerate(zip(procs, codes)):
        if rank in signalled:
            assert code == 128 + signal.SIGTERM, proc.output[-3000:]
            assert [line.split("error: ", 1)[1].strip() for line in _errors(proc)] == [
                f"evaluation stopped by {sig} at segment 2 of {segments} of split valid; no result written"
            ], proc.output[-3000:]
        else:  # its peer, stopped: told at once, in one line naming the rank
            assert code == 1, proc.output[-3000:]
            (line,) = _errors(proc)
            assert re.search(r"error: rank 1 \(host [^)]+\) stopped after an error: evaluation stopped by SIGTERM at "
                             r"segment 2 of 3 of split valid; no result written$", line.strip()), line
        assert "Traceback" not in proc.output, proc.output[-3000:]
    assert list(out.iterdir()) == []  # no result, no temporary file


@pytest.mark.parametrize("launcher, sig", [("torchrun", signal.SIGUSR1), ("deepspeed", signal.SIGTERM)])
def test_an_evaluation_whose_launcher_is_gone_stops_with_one_line_and_leaves_no_orphan(saved_run, tmp_path, launcher,
                                                                                      sig):
    """torchrun dies of SIGUSR1, the deepspeed runner of SIGTERM (docs/reliability.md). Before, their evaluation's
    workers went on as orphans to the end of the evaluation (hours on a GPU) and printed a result nobody asked
    for any more; now they watch their launcher as training's do, and stop at once as on SIGTERM."""
    result = tmp_path / "r.json"
    count = "--nproc_per_node" if launcher == "torchrun" else "--num_gpus"
    proc = Launch([venv_bin(launcher), count, "2", "--master_port", str(free_port()),
                   str(REPO / "tests" / "fault_job.py"), "--entry", "eval", "--fault", "slow-eval:0:2", "--fault",
                   "slow-eval:1:2", "--", "--checkpoint", str(saved_run), "--split", "valid",
                   "--json-out", str(result)])
    try:
        proc.wait_for("slow-eval: segment 2")
        while proc.output.count("slow-eval: segment 2") < 2:  # both ranks in segment 2, SLOW_EVAL_S long
            assert proc.proc.poll() is None, proc.output[-3000:]
            time.sleep(0.05)
        proc.proc.send_signal(sig)
        proc.wait(120)
        deadline = time.monotonic() + 60
        while not _no_worker_left(str(result)):
            assert time.monotonic() < deadline, "a worker outlived its launcher"
            time.sleep(0.5)
        proc._reader.join(10)  # the workers' last lines
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher's group: orphans included
            os.killpg(proc.proc.pid, signal.SIGKILL)
    # One line a rank: each that saw the launcher gone says so. A rank that had not seen it yet when the first one
    # ended (a loaded machine) may be told by its peer, or under deepspeed by the launch process (alive: only the
    # runner died), which sends SIGTERM to the others once one rank has ended.
    lines = [line.split("error: ", 1)[1].strip() for line in _errors(proc)]
    gone = rf"the end of its launcher \({launcher}, host {re.escape(socket.gethostname())}, pid \d+\)"
    said = (rf"(rank \d \(host [^)]+\) stopped after an error: )?evaluation stopped by ({gone}|SIGTERM) at segment 2 "
            r"of 3 of split valid; no result written")
    assert len(lines) == 2 and all(re.fullmatch(said, line) for line in lines), proc.output[-3000:]
    assert any(line.startswith("evaluation stopped by the end of its launcher") for line in lines), proc.output[-3000:]
    assert '"perplexity"' not in proc.output and not result.exists()
    assert "Traceback" not in proc.output, proc.output[-3000:]


EVAL_SIGNALLED_EARLY = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
# Ctrl-C as in a terminal, also where pytest runs as a shell's background job (`pytest &`), which starts with SIGINT
# ignored: the evaluation keeps that, as a script's `eval ... &` asks, and would finish as if never interrupted.
signal.signal(signal.SIGINT, signal.default_int_handler)
from txl_dist.stop_request import catch_sigterm_early
catch_sigterm_early()  # as launch/eval.py starts
os.kill(os.getpid(), getattr(signal, sys.argv.pop(1)))  # during the slow imports that follow
from launch.eval import main
from txl_dist.entry import exit_process
exit_process(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, status, said", [
    ("SIGINT", 130, "interrupted (Ctrl-C): stopped at once, without saving"),
    ("SIGUSR1", 143, "evaluation stopped by SIGUSR1 during start-up; no result written")])
def test_a_signal_during_the_imports_of_an_evaluation_is_its_one_line(saved_run, sig, status, said):
    """Before, Ctrl-C in the first seconds (torch's import) printed a KeyboardInterrupt traceback on every rank, and
    SIGUSR1 ended the evaluation without a word."""
    proc = Launch([sys.executable, "-c", EVAL_SIGNALLED_EARLY, sig, "--checkpoint", str(saved_run), "--split",
                   "valid"], launcher_env())
    assert proc.wait(300) == status, proc.output[-3000:]
    assert [line.split("error: ", 1)[1].strip() for line in _errors(proc)] == [said], proc.output[-3000:]
    assert "Traceback" not in proc.output and '"perplexity"' not in proc.output


def test_sigterm_to_an_export_leaves_no_partial_file_and_no_config(saved_run, tmp_path):
    """Before, the export died of the signal without a word, leaving its half-written weights beside the folder's
    (.model.safetensors.*.tmp, as large as the model)."""
    out = tmp_path / "exported"
    argv = ["--checkpoint", str(saved_run), "--out", str(out)]
    (first,) = _launch("export", argv, [], 1)
    assert first.wait(300) == 0, first.output[-3000:]
    (stopped,) = _launch("export", argv, ["sigterm-in-export:0:0"], 1)
    assert stopped.wait(300) == 128 + signal.SIGTERM, stopped.output[-3000:]
    assert [line.split("error: ", 1)[1].strip() for line in _errors(stopped)] == [
        f"export stopped by SIGTERM while writing {out}; {out} hold(s) no complete export (no config), run the "
        "export again"], stopped.output[-3000:]
    assert "Traceback" not in stopped.output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # the former weights, without a config
    (again,) = _launch("export", argv, [], 1)  # no --overwrite needed for its own unfinished folder
    assert again.wait(300) == 0, again.output[-3000:]
    assert "model_config.json" in {p.name for p in out.iterdir()}


GENERATE_STOPPED = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from txl_dist import generation
sig = getattr(signal, sys.argv.pop(1))

def generate_and_stop(*args, **kwargs):
    os.kill(os.getpid(), sig)  # the handler runs before the next bytecode
    raise AssertionError("not stopped")

generation.generate = generate_and_stop
from launch.generate import main
from txl_dist.entry import exit_process
exit_process(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_sigterm_to_generation_says_so_in_one_line(saved_run, sig):
    """Before, launch/generate.py died of the signal without a word (of SIGUSR1 until it was taken as SIGTERM)."""
    proc = Launch([sys.executable, "-c", GENERATE_STOPPED, sig, "--checkpoint", str(saved_run), "--prompt", "",
                   "--max-new-tokens", "4"], launcher_env())
    assert proc.wait(300) == 128 + signal.SIGTERM, proc.output[-3000:]
    assert [line.split("error: ", 1)[1].strip() for line in _errors(proc)] == [
        f"generation stopped by {sig}; no sample printed"], proc.output[-3000:]
    assert "Traceback" not in proc.output
