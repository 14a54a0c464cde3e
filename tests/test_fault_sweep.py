"""bench/fault_sweep.py: real cases (a crash mid-run, a full disk; the restart continuing each), and its checks,
which must flag what the product promises not to do after a fault (a resumed step that differs, a leftover of a
save)."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from test_bench_scripts import one_sweep_case

from bench import fault_sweep
from txl_dist import checkpoint


def test_a_job_killed_after_step_2_restarts_and_ends_as_the_straight_run(tmp_path):
    """Seed 8 on 1 rank draws one fault: the whole job SIGKILLed right after step 2's progress line (its save
    of step 2 in flight or done). The restart must resume from the newest complete tag and give every metric
    of the straight run bit for bit, in the journal and in MLflow, with a clean checkpoint folder."""
    record = one_sweep_case("fault_sweep", 8, tmp_path, "--raise-share", "0")
    (fault,) = record["faults"]
    assert fault["fault"].startswith("kill-job after step 2") and fault["landed"] and fault["exit"] == -9, fault
    assert record["failed"] == []


def _journal(run_dir: Path, rows: list[tuple[int, dict]]) -> None:
    path = run_dir / "tracking" / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "metrics": m}) + "\n" for s, m in rows))


def _straight(tmp_path: Path) -> dict:
    return fault_sweep.journal_values(tmp_path / "straight" / "tracking" / "metrics.jsonl")


def test_the_metrics_check_flags_a_step_trained_again_unlike_the_first_time(tmp_path):
    straight = [(s, {"train/loss": 8.0 - s / 10, "train/tokens_per_s": 100.0 * s}) for s in (1, 2, 3)]
    _journal(tmp_path / "straight", straight + [(3, {"valid/loss": 7.5})])
    # A crash after step 3, resumed from step 2: step 3 logged twice; timings differ, which is allowed.
    again = [(3, {"train/loss": 8.0 - 3 / 10, "train/tokens_per_s": 1.0})]
    _journal(tmp_path / "faulty", straight + again + [(3, {"valid/loss": 7.5})])
    assert fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty") == []

    off = [(3, {"train/loss": 8.0 - 3 / 10 + 1e-15})]
    _journal(tmp_path / "faulty", straight + off + [(3, {"valid/loss": 7.5})])
    (problem,) = fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty")
    assert "1 journal value(s) differ" in problem and "train/loss at step 3" in problem

    _journal(tmp_path / "faulty", straight)  # the validation of step 3 never logged
    (problem,) = fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty")
    assert "missing from the journal, first (3, 'valid/loss')" in problem


def test_after_an_elastic_resume_only_the_steps_before_it_must_repeat_exactly(tmp_path):
    steps = range(1, fault_sweep.STEPS + 1)
    _journal(tmp_path / "straight", [(s, {"train/loss": 8.0 - s / 10}) for s in steps])
    # 2 ranks trained steps 1-3, 1 rank resumed from step 2's checkpoint: from step 3 on, sums in another order.
    two_ranks = [(s, {"train/loss": 8.0 - s / 10}) for s in (1, 2, 3)]
    one_rank = [(s, {"train/loss": 8.0 - s / 10 + 1e-5}) for s in steps if s > 2]
    _journal(tmp_path / "faulty", two_ranks + one_rank)
    assert fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty", exact_through=2) == []
    (problem,) = fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty", exact_through=3)
    assert "differ from the straight run's, first train/loss at step 3" in problem
    one_rank[1] = (4, {"train/loss": float("nan")})
    _journal(tmp_path / "faulty", two_ranks + one_rank)
    (problem,) = fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty", exact_through=2)
    assert "no finite loss at steps [4]" in problem


def test_the_folder_check_flags_leftovers_a_stale_latest_and_a_stray_universal_copy(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / f".saving-step_{fault_sweep.STEPS:08d}").mkdir(parents=True)
    (ckpt / "step_00000004_universal").mkdir()
    (ckpt / "latest").write_text("step_00000008")
    problems = fault_sweep.check_folder(tmp_path / "run")
    assert any("leftovers ['.saving-step_00000010']" in p for p in problems), problems
    assert any("latest names step_00000008, not step_00000010" in p for p in problems), problems
    assert any("universal copies of tags no longer kept: ['step_00000004_universal']" in p for p in problems)


def test_one_rank_draws_neither_launcher_faults_nor_hangs_and_no_case_times_its_choices():
    for seed in range(60):
        case, faults, elastic = fault_sweep.draw_case(random.Random(seed), 1000, 1)
        assert case.world == 1 and case.precision != "auto" and case.model["attn_impl"] != "auto" and not elastic
        assert all(f.kind not in fault_sweep.LAUNCHER_ONLY for f in faults)
    draws = [fault_sweep.draw_case(random.Random(seed), 1000, 2) for seed in range(200)]
    assert {f.kind for _, faults, _ in draws for f in faults} == set(fault_sweep.KILLS + fault_sweep.STOPS)
    # A restart on 1 rank meets only the faults a job on 1 rank can have.
    later = [f for _, faults, elastic in draws if elastic for f in faults[1:]]
    assert later and all(f.kind not in fault_sweep.LAUNCHER_ONLY for f in later)


def test_a_lost_rank_counts_as_named_by_a_peer_or_by_torchruns_root_cause():
    peer = "07:07:20 error: rank 0 (host vm, pid 12608) stopped responding: no heartbeat for 30 s; stopping\n"
    assert fault_sweep.names_the_rank(peer, 0) and not fault_sweep.names_the_rank(peer, 1)
    torchrun = ("Failures:\n  time      : 2026-12-07_08:01:16\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9\n"
                "Root Cause (first observed failure):\n  time      : 2026-12-07_08:00:46\n"
                "  rank      : 0 (local_rank: 0)\n  exitcode  : -9 (pid: 19067)  (SIGKILL)\n")
    assert fault_sweep.names_the_rank(torchrun, 0) and not fault_sweep.names_the_rank(torchrun, 1)


def test_a_disk_filled_after_step_1_ends_the_job_in_one_line_and_the_restart_ends_as_the_straight_run(tmp_path):
    """Seed 9 turns its one fault into a full disk: the faulted run's folder on a tmpfs of its own, filled to the
    last byte once step 1's progress line is out, freed only once the job has ended. The sweep polls the job's
    output, so on a loaded machine the fill may land after step 2's line or later; the record says after which
    step it landed and which checkpoint was complete then. The first save after it cannot be written: the job
    must end saying so in an `error:` line, and the restart (space freed) must give every metric of the straight
    run."""
    if why := fault_sweep.tmpfs_unavailable():
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {why}")
    record = one_sweep_case("fault_sweep", 9, tmp_path, "--raise-share", "0")
    (fault,) = record["faults"]
    assert fault["fault"].startswith("fill-disk to 0 bytes free, freed at the end, after step 1"), fault
    assert fault["landed"] and fault["exit"] == 1 and fault["full_after_step"] >= 1, fault
    assert fault["saved_before_full"] <= fault["full_after_step"], fault
    first_unsaved = checkpoint.tag_for(fault["saved_before_full"] + fault_sweep.CHECKPOINT_INTERVAL)
    # The fill may land while that save writes: its files or its commit (run.json) then meet the full disk.
    assert re.search(rf"{first_unsaved} could not be (saved|committed): rank 0: (\S+: )?\[Errno 28\] No space left "
                     "on device", fault["last_line"]), fault["last_line"]
    assert record["failed"] == [] and record["may_miss"] == []  # the restart trained every step again


def test_an_error_raised_on_the_rank_after_step_2_ends_the_job_with_it_and_the_restart_ends_as_the_straight_run(
        tmp_path):
    """Seed 8's fault turned into an error: right after step 2's progress line, the rank's main thread raises at
    its next call into txl_dist, launch/ or DeepSpeed (bench/sweep_hooks/sitecustomize.py, armed by SIGUSR2). The
    job must end at once printing the error, and the restart must give every metric of the straight run."""
    record = one_sweep_case("fault_sweep", 8, tmp_path, "--raise-share", "1", "--disk-share", "0")
    (fault,) = record["faults"]
    assert re.match(r"raise-rank of rank 0 at its call \d+ after step 2 ", fault["fault"]), fault
    assert fault["landed"] and fault["raised"] and fault["exit"] == 1 and fault["ended_after_s"] < 30, fault
    assert record["failed"] == []  # among the checks: the job's output holds the error (here in its traceback)


def test_a_machine_without_fp16_runs_the_cases_drawn_in_fp16_in_bf16_with_the_same_faults():
    """DeepSpeed refuses fp16 on a CPU without fp16 kernels (an AMD EPYC): there a case drawn in fp16 would be
    refused, not faulted, so it runs in bf16, without fp16's loss-scaling options, the rest of it as drawn."""
    converted = 0
    for seed in range(200):
        drawn = fault_sweep.draw_case(random.Random(seed), 1000, None)
        here = fault_sweep.draw_case(random.Random(seed), 1000, None, fp16=False)
        if drawn[0].precision != "fp16":
            assert here == drawn
            continue
        converted += 1
        assert here[0].precision == "bf16" and "deepspeed.fp16" not in here[0].engine, here[0]
        assert here[0].engine.get("deepspeed.data_types") in (None, {"grad_accum_dtype": "fp32"},
                                                              {"grad_accum_dtype": "bf16"}), here[0]
        assert (here[0].model, here[0].world, here[0].stage, here[1], here[2]) == \
            (drawn[0].model, drawn[0].world, drawn[0].stage, drawn[1], drawn[2])
    assert converted >= 10


def test_a_disk_draw_of_its_own_leaves_every_other_case_as_drawn_without_it():
    """Full-disk faults come from a stream of their own: a machine that cannot mount a tmpfs (or --disk-share 0) runs
    the same cases with their other faults, and the disk takes the first fault's moment."""
    turned = raises = 0
    for seed in range(80):
        plain = fault_sweep.draw_case(random.Random(seed), 1000, None)
        case, faults, elastic = fault_sweep.draw_case(random.Random(seed), 1000, None, random.Random(f"disk {seed}"))
        assert (case, faults[1:], elastic) == (plain[0], plain[1][1:], plain[2])
        # Errors raised on a rank come from a stream of their own too, and only where the disk was not drawn.
        raised = fault_sweep.draw_case(random.Random(seed), 1000, None, random.Random(f"disk {seed}"), 0.25,
                                       random.Random(f"raise {seed}"), 0.25)
        assert (raised[0], raised[1][1:], raised[2]) == (plain[0], plain[1][1:], plain[2])
        if faults[0].kind == "fill-disk" or raised[1][0].kind != "raise-rank":
            assert raised[1][0] == faults[0]
        else:
            assert replace(raised[1][0], kind=plain[1][0].kind, rank=plain[1][0].rank, raise_after_calls=0) \
                == plain[1][0] and raised[1][0].raise_after_calls >= 1
            raises += 1
        if faults[0].kind == "fill-disk":
            turned += 1
            before = plain[1][0]
            assert (faults[0].trigger, faults[0].at, faults[0].delay_s) == (before.trigger, before.at, before.delay_s)
            assert (faults[0].leave_bytes > 0) + (faults[0].leave_of_tag > 0) <= 1
        else:
            assert faults[0] == plain[1][0]
    assert 8 <= turned <= 32  # DISK_SHARE of 80
    assert 6 <= raises <= 26  # RAISE_SHARE of the rest


def test_steps_a_full_disk_kept_from_the_journal_may_be_missing_and_no_other(tmp_path):
    steps = range(1, fault_sweep.STEPS + 1)
    _journal(tmp_path / "straight", [(s, {"train/loss": 8.0 - s / 10}) for s in steps] + [(4, {"valid/loss": 7.0})])
    # Full after step 3, the job ended (its save of step 4 failed), and the restart resumed from step 2: steps 3..
    # logged again. Had it finished on the full disk instead, steps 4-10 stay missing and may.
    _journal(tmp_path / "faulty", [(s, {"train/loss": 8.0 - s / 10}) for s in (1, 2, 3)])
    missing = fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty", may_miss=frozenset(range(4, 11)))
    assert missing == []
    (problem,) = fault_sweep.check_metrics(_straight(tmp_path), tmp_path / "faulty", may_miss=frozenset(range(5, 11)))
    assert "missing from the journal, first (4, 'train/loss')" in problem


def test_a_full_disk_counts_as_said_only_by_an_error_line_naming_it():
    said = ("10:25:23 error: checkpoint step_00000002 could not be saved: rank 0: [Errno 28] No space left on device: "
            "0 bytes free on the file system of /r/checkpoints, a checkpoint needs about 946.5 KiB; free space or "
            "lower checkpoint.keep")
    assert fault_sweep.FULL_DISK.search(said)
    assert not fault_sweep.FULL_DISK.search("10:25:23 error: a collective failed: a rank was lost or stopped")
    warning = "warning: the run's log file R/logs/train.log cannot be written ([Errno 28] No space left on device)"
    assert not fault_sweep.FULL_DISK.search(warning)


def test_raise_rank_waits_for_its_hook_seen_in_the_process_signal_mask():
    """SIGUSR2 before the hook is installed (a rank just started) would end the process by its default action."""
    assert fault_sweep.catches(os.getpid(), signal.SIGINT)  # Python's own handler
    bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        assert not fault_sweep.catches(bare.pid, signal.SIGUSR2)
    finally:
        bare.kill()
        bare.wait()


def test_a_sweep_stopped_by_sigterm_ends_its_jobs_and_unmounts_its_disk(tmp_path):
    """The jobs run in sessions of their own (a Ctrl-C to the sweep stays the sweep's) and the faulted run's folder
    on a tmpfs: a sweep ended by SIGTERM (or Ctrl-C) ends its jobs' processes and unmounts its tmpfs first."""
    import psutil

    from corpus_helpers import make_corpus, synthetic_stream

    corpus = make_corpus(tmp_path / "corpus", {split: synthetic_stream(20_000, 1000, seed=i)
                                               for i, split in enumerate(("train", "valid", "test"))})
    out = tmp_path / "out"
    disk = fault_sweep.tmpfs_unavailable() is None
    sweep = subprocess.Popen([sys.executable, "-m", "bench.fault_sweep", "--cases", "1", "--seed", "9", "--world", "1",
                              "--corpus", str(corpus), "--out", str(out), "--raise-share", "0"], cwd=fault_sweep.REPO,
                             env=fault_sweep.child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def mounted() -> bool:
        return str(out) in Path("/proc/mounts").read_text()

    def trainers() -> list:
        return [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]

    deadline = time.monotonic() + 240
    while not (mounted() if disk else trainers()):  # seed 9's faulted run on its tmpfs, or the straight run
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()[0][-3000:]
        time.sleep(0.2)
    assert trainers()
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(120) == 130, sweep.communicate()[0][-3000:]
    assert "interrupted: the case's jobs ended" in sweep.communicate()[0]
    assert not trainers() and not mounted()


def test_a_raised_error_must_be_said_unless_the_job_ended_before_it_came():
    fault = fault_sweep.Fault("raise-rank", "step", 2, 0.0, 1, raise_after_calls=40)
    came = "raise-rank: raising in f (x.py:1)\n"
    said = came + "12:00:00 error: rank 1 (host h, pid 1) stopped after an error: raise-rank: injected in f (x.py:1)\n"
    assert fault_sweep.raise_problems(fault, {"exit": 1}, said) == []
    warned = came + "12:00:00 warning: tracking: raise-rank: injected in f (x.py:1); training goes on\n"
    assert fault_sweep.raise_problems(fault, {"exit": 0}, warned) == []
    assert fault_sweep.raise_problems(fault, {"exit": 0}, "the job ended first\n") == []  # the call never came
    (swallowed,) = fault_sweep.raise_problems(fault, {"exit": 0}, came)
    assert "the job went on without saying what the rank raised" in swallowed
    (unsaid,) = fault_sweep.raise_problems(fault, {"exit": 1}, came)
    assert "ended (exit status 1) without saying what the rank raised" in unsaid
    (early,) = fault_sweep.raise_problems(fault, {"exit": 1}, "")
    assert "failed (exit status 1) before the error was raised" in early
