"""bench/gpu_check.sh --cpu-smoke: every phase of the device check runs at toy size, so the script cannot
rot between GPU runs (the GPU itself is not needed; the phases' code paths are the same)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import threading
from pathlib import Path

import pytest

import torch

from bench import gpu_check
from txl_dist.model.attention import ATTN_IMPLS, candidate_attn_impls, recompile_limit

REPO = Path(__file__).resolve().parents[1]
PHASES = ["env", "matmul", "attention", "model", "cuda_tests", "deepspeed", "train"]


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "out"
    # A generous overall time box: this checks that every phase runs to the end, not how fast, so the phases'
    # time boxes (shares of the total) must not cut any short on a busy machine. The smoke run needs 25-45 s
    # on an idle 2-core machine; under a load of 5 on 2 cores one phase alone took over 80 s.
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"DS_ACCELERATOR": "cpu", "GPU_CHECK_TOTAL_S": "1500"}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu-smoke", "--out", str(out)],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # What the device tool brings back: at most 8 files, 16 MiB each, 64 MiB in all, at most 2 folders
    # down, plain names; with more, nothing comes back at all.
    files = [f for f in out.rglob("*") if not f.is_dir()]
    assert len(files) <= 8, files
    assert all(f.is_file() and not f.is_symlink() for f in files), files
    assert all(len(f.relative_to(out).parts) <= 3 for f in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for f in out.rglob("*") for part in f.relative_to(out).parts)
    assert all(f.stat().st_size < 16 * 2**20 for f in files) and sum(f.stat().st_size for f in files) < 64 * 2**20
    assert {f.name for f in files} == {"gpu_check.jsonl", "gpu_check_table.txt", "deepspeed_zero1.log",
                                       "cuda_tests.log", "cuda_tests_flex.log"}
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    status = {r["phase"]: r["status"] for r in records if r["kind"] == "phase"}
    assert list(status) == PHASES, status
    assert all(s == "ok" for s in status.values()), [r for r in records if r["kind"] in ("phase", "trace")]

    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    assert {r["dtype"] for r in by_kind["matmul"]} == {"bf16", "fp16", "tf32", "fp32"}
    assert all(r["flop_per_s"] > 0 for r in by_kind["matmul"])
    # Every implementation was checked against the float64 oracle and timed, in both dtypes (forward only
    # where it has no backward on a CPU: FlexAttention).
    trainable = {"reference", *candidate_attn_impls(torch.device("cpu"), torch.float32, training=True, dropatt=0.0)}
    # triton's kernels run on CUDA only: not here.
    runs_here = gpu_check.impls_here(torch.device("cpu"))
    assert set(runs_here) == set(ATTN_IMPLS) - {"triton"}
    forward_only = {(r["impl"], r["forward_only"]) for r in by_kind["attention_error"] if "error" not in r}
    assert forward_only == {(i, i not in trainable) for i in runs_here}
    pairs = {(r["impl"], r["dtype"]) for r in by_kind["attention_error"] if "error" not in r}
    assert pairs == {(i, d) for i in runs_here for d in ("fp32", "bf16")}
    assert {(r["impl"], r["dtype"]) for r in by_kind["attention_time"]} == pairs
    fp32_err = [r["max_abs_out"] for r in by_kind["attention_error"] if r["dtype"] == "fp32"]
    assert max(fp32_err) < 1e-4, by_kind["attention_error"]
    # One profiled bf16 call of each: its busiest operators here (kernels on a GPU), each with a time.
    profiles = {r["impl"]: r for r in by_kind["attention_profile"]}
    assert set(profiles) == set(runs_here) and all(r["dtype"] == "bf16" for r in profiles.values())
    assert all(r["ops"] and all(op["self_ms"] >= 0 for op in r["ops"]) for r in profiles.values()), profiles
    model = {(r["impl"], r["dtype"]): r for r in by_kind["model_error"]}
    # flex in bf16 only there (its compiles per key length; the attention phase checks both dtypes)
    assert set(model) == {(i, d) for i in runs_here for d in ("fp32", "bf16")} - {("flex", "fp32")}
    assert all(r["ok"] for r in model.values()), model
    # The training matrix: every non-reference impl surveyed, then the best with checkpointing and compile.
    steps = [r for r in by_kind["train_step"] if "error" not in r and "skipped" not in r]
    assert not [r for r in by_kind["train_step"] if "error" in r], by_kind["train_step"]
    skipped = {r["impl"] for r in by_kind["train_step"] if " does not train on " in r.get("skipped", "")}
    assert skipped == set(ATTN_IMPLS) - trainable
    for shape in ("large", "base"):
        ran = {(r["impl"], r["checkpointing"], r["compile"]) for r in steps if r["shape"] == shape}
        assert {i for i, _, _ in ran} >= trainable - {"reference"}
        assert {(c, k) for _, c, k in ran} == {(False, False), (True, False), (False, True), (True, True)}
        assert all(r["tokens_per_s"] > 0 and r["mfu_measured_peak"] >= 0 for r in steps if r["shape"] == shape)
    # Compiled rows ran compiled code: dynamo made graphs for the first of each shape and never fell back to
    # eager past its recompile limit; eager rows made none. Every row says what its warm-up took.
    for shape in ("large", "base"):
        compiled = [r for r in steps if r["shape"] == shape and r["compile"]]
        assert compiled[0]["dynamo_graphs"] > 0, compiled
    assert all(r["recompile_limit_hits"] == 0 for r in steps), steps
    assert all(r["dynamo_graphs"] == 0 for r in steps if not r["compile"]), steps
    assert all(r["warmup_s"] >= r["compile_s"] >= 0 for r in steps)
    # Each shape's fastest case was profiled eager and compiled: its busiest operators by self CPU time here.
    profiles = {(r["shape"], r["compile"]): r for r in by_kind["train_profile"]}
    assert set(profiles) == {(s, c) for s in ("large", "base") for c in (False, True)}, by_kind["train_profile"]
    for (shape, _), r in profiles.items():
        assert r["impl"] == next(b["impl"] for b in by_kind["train_best"] if b["shape"] == shape)
        assert r["sorted_by"] == "self CPU time" and len(r["ops"]) == 15, r
        # Steps 2-3 timed without the profiler, then 4-5 under it; the two read side by side (no device here).
        assert r["summary"]["steps"] == [4, 5] and r["summary"]["device"] is None, r
        assert r["step_ms_unprofiled"] > 0 and r["step_ms_profiled"] == pytest.approx(
            sum(r["summary"]["step_ms"]) / 2, abs=1e-3)
        assert r["profiler_slowdown"] == pytest.approx(r["step_ms_profiled"] / r["step_ms_unprofiled"], rel=1e-2)
        assert "busy_share_unprofiled_est" not in r
        assert 0 < sum(op["share"] for op in r["ops"]) <= 1.0001 and any(op["name"] == "aten::mm" for op in r["ops"])
    assert "busiest in large/" in (out / "gpu_check_table.txt").read_text()
    # tests/test_gpu.py ran in both parts, every test of it skipped here (no CUDA), none failed or missing; the
    # trainer's host-sync test at ZeRO 2 ran in the first (on the CPU here).
    parts = {r["selection"]: r for r in by_kind["cuda_tests"]}
    assert set(parts) == {"not flex", "flex"} and all(r["exit"] == 0 and not r["failures"] for r in parts.values())
    assert parts["not flex"].get("passed") == 1 and parts["flex"].get("passed", 0) == 0, parts
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "tests/test_gpu.py"], cwd=REPO, capture_output=True, text=True).stdout
    n_tests = sum(1 for line in collected.splitlines() if line.startswith("tests/test_gpu.py::"))
    assert n_tests > 20 and parts["not flex"]["skipped"] + parts["flex"]["skipped"] == n_tests, (parts, n_tests)
    assert "CUDA tests (tests/test_gpu.py -k 'flex')" in (out / "gpu_check_table.txt").read_text()
    # The trainer's output streamed to its log in --out; the corpus and run folder went to a scratch folder
    # that is gone.
    (started,) = by_kind["deepspeed_started"]
    (ds,) = by_kind["deepspeed"]
    assert ds["exit"] == 0 and ds["tokens_per_s_last"] > 0, ds
    assert started["time"] <= ds["time"] and started["log"] == "deepspeed_zero1.log"
    assert ds["progress"] and ds["progress"][-1] in (out / "deepspeed_zero1.log").read_text()
    # The trainer profiled two of its steps (train.profile_steps) and logged its busiest operators.
    (profile,) = ds["profile"]
    # Which operators lead varies from run to run at this size (mm, bmm, softmax and norms within a few points).
    assert "profile of steps 2..3 written to" in profile and re.search(r"by self CPU time: .*aten::\w+ [\d.]+%",
                                                                       profile), ds
    # One progress line per step: steps 2-3 under the profiler say so, and the rates from step 3 on are kept
    # apart (here step 3 profiled, step 4 not), with the profile read against the unprofiled step.
    log = (out / "deepspeed_zero1.log").read_text()
    assert [ln.endswith("| profiled") for ln in log.splitlines() if " tok/s " in ln] == [False, True, True, False]
    assert ds["tokens_per_s_unprofiled"] == ds["tokens_per_s_last"] and ds["tokens_per_s_profiled"] > 0, ds
    assert ds["step_ms_unprofiled"] == pytest.approx(ds["step_s_unprofiled"] * 1e3) and ds["profiler_slowdown"] > 0
    (start,) = by_kind["start"]
    assert not Path(start["scratch"]).exists()
    table = (out / "gpu_check_table.txt").read_text()
    assert "| train | ok |" in table and "DeepSpeed trainer ZeRO 1: exit 0" in table


def test_train_matrix_compiles_layers_before_the_flex_survey(tmp_path, monkeypatch):
    # On a GPU: the first compiled case needs the most time left (FIRST_COMPILE_MIN_S), and flex's first case
    # compiles too; the compiled layers go first, with the fastest of the others, then flex joins the survey
    # and the fastest of all gets the rest. Only the order is checked here (a stand-in runs the cases).
    calls = []

    class StandIn:
        def __init__(self, p, name, cfg, box, warmup, steps, impls):
            self.name = name
            self.refused = {i: r for i in impls if (r := gpu_check.config_refusal(cfg, i))}

        def run(self, impl, batch, checkpointing, use_compile):
            calls.append((self.name, impl, batch, checkpointing, use_compile))
            return {"step_ms": {"flex": 1.0, "sdpa": 2.0, "matmul": 3.0, "triton": 2.5}[impl]}

        def profile(self, impl, batch, compiled=False):
            calls.append((self.name, "profile " + impl, batch, False, compiled))

        def close(self):
            pass

    monkeypatch.setattr(gpu_check, "TrainMatrix", StandIn)
    monkeypatch.setattr(gpu_check, "trains_here", lambda impl, device: True)
    p = gpu_check.Phase("train", gpu_check.Recorder(tmp_path), torch.device("cpu"), False, 100.0, {})
    gpu_check.train_matrix(p)
    base = [c[1:] for c in calls if c[0] == "base"]  # wt103_base: dropatt 0, flex allowed
    # The fastest is profiled once the survey has found it, before the rest of its cases.
    assert base[:6] == [("matmul", 8, False, False), ("sdpa", 8, False, False), ("triton", 8, False, False),
                        ("sdpa", 8, False, True), ("flex", 8, False, False), ("profile flex", 8, False, False)]
    # Then its other cases, and a profile of its compiled step at the presets' micro batch (16).
    assert base[6:-1] == [("flex", b, c, k) for k in (False, True) for b in (8, 16, 32) for c in (False, True)
                          if (b, c, k) != (8, False, False)]
    assert base[-1] == ("profile flex", 16, False, True)
    large = [c[1:] for c in calls if c[0] == "large"]  # dropatt 0.2: flex refused, timed last for information
    assert large[:4] == [("matmul", 8, False, False), ("sdpa", 8, False, False), ("triton", 8, False, False),
                         ("sdpa", 8, False, True)]
    assert large[4] == ("profile sdpa", 8, False, False)
    assert large[-2:] == [("profile sdpa", 16, False, True), ("flex", 8, False, False)]
    assert all(c[0] == "sdpa" for c in large[5:-2])
    assert len(large) == 3 + 1 + 11 + 1 + 1  # the survey, 2 profiles, sdpa's 12 cases less the one surveyed, flex

    # A focused call (--train-shapes large --train-batches 16 --train-impls matmul): the compiled step the large
    # presets run and its profile, with no other implementation's survey or compiles.
    calls.clear()
    gpu_check.train_matrix(p, ["large"], [16], ["matmul"])
    assert [c[1:] for c in calls] == [("matmul", 16, False, False), ("matmul", 16, False, True),
                                      ("profile matmul", 16, False, False), ("matmul", 16, True, False),
                                      ("matmul", 16, True, True), ("profile matmul", 16, False, True)]


def test_phase_budget_charges_overruns_and_keeps_the_deadline():
    # Time left over carries forward, an overrun is charged to the next phase, never past the deadline.
    assert gpu_check.phase_budget("model", 30, 10, False, 500) == 40
    assert gpu_check.phase_budget("model", 30, -25, False, 500) == 5
    assert gpu_check.phase_budget("model", 30, 10, False, 12) == 12
    # deepspeed (the product trainer's only run) keeps its share after overruns, within the deadline.
    assert "deepspeed" in gpu_check.GUARANTEED_PHASES
    assert gpu_check.phase_budget("deepspeed", 100, -60, False, 500) == 100
    assert gpu_check.phase_budget("deepspeed", 100, -60, False, 70) == 70
    assert gpu_check.phase_budget("deepspeed", 100, 20, False, 500) == 120
    # The last phase gets all that is left, whatever its share.
    assert gpu_check.phase_budget("train", 230, -60, True, 321) == 321


def test_dynamo_watch_counts_graphs_and_recompile_limit_fallbacks():
    torch._dynamo.reset()

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    fn = torch.compile(scaled, backend="eager", dynamic=False)
    with recompile_limit(2), gpu_check.DynamoWatch() as watch:
        for n in range(1, 6):  # five static shapes: two compile, then dynamo gives up and runs it eagerly
            assert torch.equal(fn(torch.ones(n)), torch.full((n,), 3.0))
    assert watch.stats() == {"dynamo_graphs": 2, "recompile_limit_hits": 1}
    with gpu_check.DynamoWatch() as eager:
        scaled(torch.ones(3))
    assert eager.stats() == {"dynamo_graphs": 0, "recompile_limit_hits": 0}


def test_log_copier_keeps_the_end_of_a_long_output(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "LOG_TAIL_BYTES", 1000)
    monkeypatch.setattr(gpu_check, "LOG_CUT_BYTES", 5000)
    read_fd, write_fd = os.pipe()
    lines = [f"line {i:05d}\n".encode() for i in range(3000)]  # 33 kB: cut several times while it runs
    writer = threading.Thread(target=lambda: (os.write(write_fd, b"".join(lines)), os.close(write_fd)))
    writer.start()
    path = tmp_path / "child.log"
    with open(read_fd, "rb") as stream:
        gpu_check.LogCopier(stream, path).join()
    writer.join()
    data = path.read_bytes()
    assert data.startswith(gpu_check.LogCopier.CUT)
    assert len(data) == len(gpu_check.LogCopier.CUT) + 1000
    assert b"".join(lines).endswith(data[len(gpu_check.LogCopier.CUT):])


def test_run_logged_kills_the_whole_group_on_timeout(tmp_path):
    # The child starts a grandchild that holds the output pipe; a timeout kills both, and what the child
    # printed before is in the log.
    script = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(120)']); print('grandchild', g.pid, flush=True); time.sleep(120)")
    path = tmp_path / "child.log"
    code = gpu_check.run_logged([sys.executable, "-c", script], dict(os.environ), path, timeout_s=6)
    assert code == "timeout"
    (pid,) = re.findall(r"grandchild (\d+)", path.read_text())

    def dead() -> bool:  # gone, or a zombie waiting for a parent that reaps (the kill was delivered)
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    # run_logged waited for the child only: the grandchild may still be on its way out (a loaded machine).
    deadline = time.monotonic() + 10
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead()


def test_table_never_recommends_a_setting_the_config_refuses(tmp_path):
    # large.json trains with dropatt 0.2, which flex does not have: flex is timed at dropatt 0 and may be the
    # fastest, but the recommendation is the fastest setting the config accepts that ran compiled code.
    large = gpu_check.load_config(REPO / "configs" / "large.json").model
    assert large.dropatt > 0
    refusal = gpu_check.config_refusal(large, "flex")
    assert refusal and "dropatt" in refusal
    assert gpu_check.config_refusal(large, "sdpa") is None
    base = gpu_check.load_config(REPO / "configs" / "wt103_base.json").model
    assert base.dropatt == 0 and gpu_check.config_refusal(base, "flex") is None

    rec = gpu_check.Recorder(tmp_path)
    row = dict(phase="train", kind="train_step", shape="large", micro_batch=8, checkpointing=False, warmup_s=1.0,
               compile_s=0.5, step_ms=10.0, dynamo_graphs=0, recompile_limit_hits=0, config_dropatt=large.dropatt)
    for impl, use_compile, tokens_per_s, hits in (("sdpa", False, 1000, 0), ("flex", False, 3000, 0),
                                                  ("sdpa", True, 2000, 3)):
        dropatt = 0.0 if impl == "flex" else large.dropatt
        refuses = gpu_check.config_refusal(large, impl)
        rec.write({**row, "impl": impl, "compile": use_compile, "tokens_per_s": tokens_per_s, "dropatt": dropatt,
                   "recompile_limit_hits": hits, **({"config_refuses": refuses} if refuses else {})})
    table = gpu_check.write_table(rec, tmp_path).read_text()
    assert "fastest for large: attn_impl sdpa, micro batch 8, activation checkpointing False, compile False" in table
    assert "flex (dropatt 0.0: the config refuses)" in table and "not a candidate for large: flex" in table


def test_table_names_the_tiles_the_triton_kernels_picked(tmp_path):
    rec = gpu_check.Recorder(tmp_path)
    tiles = {"fwd": "BLOCK_M: 64, BLOCK_N: 64, num_warps: 8", "dkdv": "BLOCK_M: 32, BLOCK_N: 64, num_warps: 4"}
    rec.write(dict(phase="attention", kind="attention_time", impl="matmul", dtype="bf16", ms=1.5))
    rec.write(dict(phase="attention", kind="attention_time", impl="triton", dtype="bf16", ms=0.5, tiles=tiles))
    table = gpu_check.write_table(rec, tmp_path).read_text()
    assert ("triton's tiles (bf16), picked by timing: fwd BLOCK_M: 64, BLOCK_N: 64, num_warps: 8, dkdv BLOCK_M: 32, "
            "BLOCK_N: 64, num_warps: 4") in table
    assert table.count("picked by timing") == 1


def test_deepspeed_is_not_imported_when_setup_found_it_broken(monkeypatch):
    # gpu_check.sh tried the import with a time limit; a hung import must not hang a phase without one.
    monkeypatch.setenv(gpu_check.NO_DEEPSPEED_ENV, "deepspeed did not import within 90 s (setup.log)")
    with pytest.raises(ImportError, match="within 90 s"):
        gpu_check.import_deepspeed()
    monkeypatch.delenv(gpu_check.NO_DEEPSPEED_ENV)
    assert gpu_check.import_deepspeed().__version__


def test_options_pick_the_trainer_config_stages_sets_and_test_parts(tmp_path, monkeypatch):
    # A focused second call (BENCHMARKS.md, run 2): another preset through the trainer at one ZeRO stage, with
    # further --set overrides last; the CUDA tests without flex's part, under DeepSpeed's CUDA accelerator on a
    # GPU (the CPU one here). A stand-in for run_logged records the commands.
    calls = []

    def run_logged(cmd, env, log_path, timeout_s):
        calls.append((cmd, env))
        log_path.write_text("")
        return 0

    monkeypatch.setattr(gpu_check, "run_logged", run_logged)
    p = gpu_check.Phase("deepspeed", gpu_check.Recorder(tmp_path), torch.device("cpu"), True, 100.0, {})
    gpu_check.phase_deepspeed(p, tmp_path, tmp_path / "scratch", config="configs/tiny.json", stages=[2], steps=3,
                              extra_sets=["train.compile=true", "model.attn_impl=sdpa"])
    [(cmd, _)] = calls
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert cmd[cmd.index("--config") + 1] == "configs/tiny.json"
    assert "deepspeed.zero_optimization.stage=2" in sets and "train.max_steps=3" in sets
    assert sets[-3:] == ["train.compile=true", "model.attn_impl=sdpa", "train.profile_steps=[1,2]"]
    calls.clear()
    gpu_check.phase_deepspeed(p, tmp_path, tmp_path / "scratch", config="configs/tiny.json", stages=[0], steps=2)
    [(cmd, _)] = calls
    assert not any(a.startswith("train.profile_steps") for a in cmd)  # [0, 1] would be refused: no window
    calls.clear()
    p = gpu_check.Phase("cuda_tests", gpu_check.Recorder(tmp_path), torch.device("cpu"), True, 100.0, {})
    gpu_check.phase_cuda_tests(p, tmp_path, ["not flex"])
    [(cmd, env)] = calls
    assert cmd[cmd.index("-k") + 1] == "not flex" and env.get("DS_ACCELERATOR") == os.environ.get("DS_ACCELERATOR")


def test_a_focused_call_shares_the_whole_budget_among_its_phases_in_its_order(tmp_path, monkeypatch):
    # --phases env train deepspeed: the three share --budget-s by their weights (not a third of the time, as
    # when the phases left out kept their shares), run in the order given, and the last gets what is left.
    ran = []
    monkeypatch.setattr(gpu_check, "run_phase", lambda name, fn, rec, device, smoke, budget, shared:
                        ran.append((name, budget)))
    weights = gpu_check.SMOKE_BUDGET
    total = weights["env"] + weights["train"] + weights["deepspeed"]
    assert gpu_check.main(["--cpu-smoke", "--out", str(tmp_path), "--budget-s", str(2 * total),
                           "--phases", "env", "train", "deepspeed"]) == 0
    assert [name for name, _ in ran] == ["env", "train", "deepspeed"]
    env, train, deepspeed = (budget for _, budget in ran)
    assert env == pytest.approx(2 * weights["env"], abs=0.5)
    assert train == pytest.approx(2 * (weights["train"] + weights["env"]), abs=1.0)  # env used none of its share
    assert deepspeed == pytest.approx(2 * total, abs=1.0)  # the last: all that is left (none was used)
    # env runs first whatever --phases says: its record names the device and versions in the table (a second
    # call of the CUDA tests alone printed "device None | torch None"), and train reads the device's name from it.
    ran.clear()
    assert gpu_check.main(["--cpu-smoke", "--out", str(tmp_path), "--budget-s", str(2 * total),
                           "--phases", "deepspeed", "train", "env"]) == 0
    assert [name for name, _ in ran] == ["env", "deepspeed", "train"]


def test_the_trainer_profile_window_leaves_unprofiled_steady_steps_and_the_reading_uses_them(tmp_path):
    # 8 steps (the GPU default): steps 3-4 and 7-8 time the trainer without the profiler, 5-6 under it.
    assert gpu_check.trainer_profile_window(8) == (5, 6)
    assert gpu_check.trainer_profile_window(6) == (3, 4)
    assert gpu_check.trainer_profile_window(4) == (2, 3) and gpu_check.trainer_profile_window(3) == (1, 2)
    assert gpu_check.trainer_profile_window(2) is None
    # A GPU summary: 2 steps of 150 ms under the profiler with 120 ms of device activity in all; unprofiled the
    # steps take 100 ms, so the device was busy ~60% of an unprofiled step (40% of a profiled one).
    summary = {"step_ms": [140.0, 160.0], "device": {"busy_ms": 120.0}}
    assert gpu_check.unprofiled_reading(summary, 100.0) == {
        "step_ms_unprofiled": 100.0, "step_ms_profiled": 150.0, "profiler_slowdown": 1.5,
        "busy_share_unprofiled_est": 0.6}
    # With the device time by kind: 80 ms of GEMMs in the window, 40 per step, 40% of an unprofiled step; 10
    # TFLOP per step of model FLOPs in 40 ms ran at 250 TFLOP/s.
    summary["device"]["kinds"] = [{"name": "matmul", "ms": 80.0}, {"name": "elementwise", "ms": 40.0}]
    assert gpu_check.unprofiled_reading(summary, 100.0, 10e12) == {
        "step_ms_unprofiled": 100.0, "step_ms_profiled": 150.0, "profiler_slowdown": 1.5,
        "busy_share_unprofiled_est": 0.6, "matmul_ms_per_step": 40.0, "matmul_share_unprofiled_est": 0.4,
        "matmul_tflops_est": 250.0}
    assert gpu_check.unprofiled_reading({"step_ms": [150.0], "device": None}, 100.0) == {
        "step_ms_unprofiled": 100.0, "step_ms_profiled": 150.0, "profiler_slowdown": 1.5}
    assert gpu_check.unprofiled_reading(summary, None) == {}
    assert gpu_check.unprofiled_text({"step_ms_unprofiled": 100.0, "step_ms_profiled": 150.0,
                                      "profiler_slowdown": 1.5, "busy_share_unprofiled_est": 0.6}) == (
        "unprofiled 100.0 ms/step, profiled 150.0 (x1.50); device busy ~60.0% of an unprofiled step")
    assert gpu_check.unprofiled_text(gpu_check.unprofiled_reading(summary, 100.0, 10e12)).endswith(
        "device busy ~60.0% of an unprofiled step, matmul kernels ~40.0% at 250 TFLOP/s")
    # The trainer's FLOPs per step from its progress lines (rate x step time), unprofiled steps only.
    log = tmp_path / "trainer.log"
    log.write_text("".join(f"12:00:0{i} step {i}/8 | loss 7.0 | lr 1e-4 | grad norm 1.0 | 1000 tok/s | "
                           f"{f} | MFU 1% | {t} s/step | ETA 0:00:01{' | profiled' if i in (5, 6) else ''}\n"
                           for i, f, t in ((1, "1.00 GFLOP/s", "9.000"), (3, "2.00 TFLOP/s", "0.500"),
                                           (4, "2.00 TFLOP/s", "0.500"), (5, "1.00 TFLOP/s", "1.000"),
                                           (6, "1.00 TFLOP/s", "1.000"))))
    progress = gpu_check.trainer_progress(log)
    assert progress["flops_per_step"] == 1e12 and progress["step_s_unprofiled"] == 0.5
    assert progress["tokens_per_s_unprofiled"] == 1000 and progress["step_s_profiled"] == 1.0


def test_a_smoke_run_fails_on_a_failed_phase_trainer_stage_or_test_part():
    # On a GPU these are measurements to record; in --cpu-smoke they mean the script has rotted (a trainer stage
    # that exits 2 on a config refusal once went unnoticed behind the run's exit 0).
    ok = [{"kind": "phase", "phase": "env", "status": "ok"}, {"kind": "phase", "phase": "train", "status": "skipped"},
          {"kind": "deepspeed", "zero_stage": 0, "exit": 0}, {"kind": "deepspeed", "zero_stage": 2, "skipped": "x"},
          {"kind": "cuda_tests", "selection": "flex", "exit": 0}]
    assert gpu_check.smoke_failures(ok) == []
    bad = ok + [{"kind": "phase", "phase": "model", "status": "error", "reason": "boom"},
                {"kind": "deepspeed", "zero_stage": 2, "exit": 2},
                {"kind": "cuda_tests", "selection": "not flex", "exit": "timeout"}]
    assert gpu_check.smoke_failures(bad) == ["phase model: boom", "trainer ZeRO 2 exit 2 (deepspeed_zero2.log)",
                                             "CUDA tests -k 'not flex' exit timeout"]
