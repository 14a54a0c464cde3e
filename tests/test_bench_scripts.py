"""The stand-alone benchmark scripts of bench/ that the suite (bench/suite.py) does not run: each runs at its
smallest size and prints what its docstring, BENCHMARKS.md and docs/ describe. Smoke tests: the figures at
these sizes mean nothing, so none is judged (no timing assertion); what is checked is that every script still
runs against the library as it is now, and that each row and column it documents is printed.

bench/soak.sh at its smallest still takes ~45 s on 2 cores (two jobs of two DeepSpeed ranks): here only its
argument checks run, and its sampler and report (bench/soak_report.py) on a process of this test."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def bench_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", DS_ACCELERATOR="cpu")


def run(cmd: list[str], timeout: float = 120, expect: int = 0) -> str:
    """Run a command from the repository root; its stdout (stderr joins the message of a failure)."""
    proc = subprocess.run(cmd, cwd=REPO, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=timeout)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_bench(name: str, *args: str, timeout: float = 120, expect: int = 0) -> str:
    return run([sys.executable, "-m", f"bench.{name}", *map(str, args)], timeout, expect)


def one_sweep_case(sweep: str, seed: int, tmp_path: Path, *options: str) -> dict:
    """bench.<sweep> (a sweep that trains) run for one case of `seed` on 1 rank, on a synthetic corpus, with the
    sweep's `options`; the case must pass. Its record."""
    from corpus_helpers import make_corpus, synthetic_stream

    corpus = make_corpus(tmp_path / "corpus", {split: synthetic_stream(20_000, 1000, seed=i)
                                               for i, split in enumerate(("train", "valid", "test"))})
    out = run_bench(sweep, "--cases", 1, "--seed", seed, "--world", 1, "--corpus", corpus, "--out", tmp_path / "out",
                    *options, timeout=600)
    assert "1 passed, 0 refused, 0 failed" in out, out
    return json.loads((tmp_path / "out" / "results.jsonl").read_text())


RATIO = r"\d+\.\d+x"


def test_bench_attention_prints_every_path_against_the_reference():
    """BENCHMARKS.md's command: attention fwd+bwd, forward only (flex included) and the model step, each path
    with its ratio to the reference measured in the same run."""
    out = run_bench("bench_attention", "--reps", "1", "--batch", "1", "--dtypes", "fp32", "--forward-mlens", "16")
    lines = out.splitlines()
    assert lines[0].startswith("torch ") and "wall clock" in lines[0]
    fwd_bwd = lines.index(next(line for line in lines if line.startswith("relative attention fwd+bwd, B 1")))
    assert re.fullmatch(rf"  fp32 \(min\): reference [\d.]+ ms \(1\.00x; median 1\.00x\), "
                        rf"seq-first [\d.]+ ms \({RATIO}; median {RATIO}\), matmul [\d.]+ ms \({RATIO}; "
                        rf"median {RATIO}\), sdpa [\d.]+ ms \({RATIO}; median {RATIO}\)", lines[fwd_bwd + 1])
    fwd = lines.index("relative attention forward only (no grad, same_length), B 1, H 8, q 128, k 144, d 32")
    assert lines[fwd + 1].startswith("  fp32 (min): reference ") and all(
        f" {impl} " in lines[fwd + 1] for impl in ("matmul", "sdpa", "flex"))
    step = next(i for i, line in enumerate(lines) if line.startswith("training step fwd+bwd, 9.24M params"))
    assert re.fullmatch(rf"  fp32 \(best\): reference \d+ tok/s \(1\.00x; median 1\.00x\), matmul \d+ tok/s "
                        rf"\({RATIO}; median {RATIO}\), sdpa \d+ tok/s \({RATIO}; median {RATIO}\)", lines[step + 1])


@pytest.mark.slow
def test_bench_data_prints_prepare_against_sentencepiece_and_the_loader_against_a_step():
    """The three figures of its docstring at 1 and 2 MB: prepare against plain SentencePiece (the same tokens,
    checked by the script), peak RSS at both sizes, the loader's share of a tiny training step."""
    out = run_bench("bench_data", "--sizes-mb", "1", "2", "--repeat", "1", "--num-proc", "1", timeout=180)
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["corpus", "tokens"])
    for col in ("sp tok/s", "prepare tok/s", "ratio", "ratio w/o start-up", "prepare s", "peak RSS MiB",
                "+training"):
        assert col in lines[head], col
    rows = [line.split() for line in lines[head + 1:head + 3]]
    assert [r[0] for r in rows] == ["1MB", "2MB"] and all(len(r) == 8 for r in rows)  # no +training column
    assert all(float(r[4]) > 0 and float(r[6]) > 0 and float(r[7]) > 0 for r in rows)
    assert re.search(r"^peak RSS, largest / smallest corpus \([\d.]+x the text\): [\d.]+ \(target: flat, ~1\)$",
                     out, re.M)
    assert re.search(r"^loader: [\d.]+ us per optimizer step \(rank 0 of 2, \d+ micro batch\(es\) of \d+x64\)$",
                     out, re.M)
    assert re.search(r"^training step \(tiny config, fp32 eager, \d+ threads, this process\): [\d.]+ ms -> "
                     r"loader / step = [\d.]+% \(target < 1%\)$", out, re.M)


def test_bench_data_refuses_a_vocabulary_the_tiny_model_cannot_take_before_it_starts():
    """Its last measurement trains configs/tiny.json's model (cutoffs [1000, 2000]): a vocabulary of 2000 or
    less was refused there, by a traceback after every other measurement had run."""
    proc = subprocess.run([sys.executable, "-m", "bench.bench_data", "--vocab-size", "500", "--sizes-mb", "1"],
                          cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--vocab-size 500" in proc.stderr and "[1000, 2000]" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_generate_prints_incremental_against_recompute_with_the_same_tokens():
    out = run_bench("bench_generate", "--lengths", "16", "--reps", "1")
    lines = out.splitlines()
    assert lines[0].startswith("tiny.json model, vocab 4096, ") and lines[0].endswith("greedy, best of 1")
    assert [c.strip() for c in lines[1].split("|")] == [
        "tokens", "incremental, mem=N", "incremental, mem=128", "full recompute", "speed-up (mem=N)", "same tokens"]
    assert re.fullmatch(r" +16 \| +\d+ tok/s \| +\d+ tok/s \| +\d+ tok/s \| +[\d.]+x \| yes", lines[2])


MIX_COLUMNS = ["mixture MB", "documents", "mode", "mix s", "mix cpu s", "MB/cpu s", "cp s", "cp cpu s",
               "mix/cp cpu", "dd s", "mix/dd s", "peak anon MiB", "peak RSS MiB", "index MB", "loader Mtok/cpu s"]


def mix_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    for col in MIX_COLUMNS:
        assert col in lines[0], col
    return [line.split() for line in lines[1:] if line.strip()]


@pytest.mark.slow
def test_bench_mix_runs_as_a_module_and_prints_both_modes():
    """`python -m bench.bench_mix` (was: ModuleNotFoundError: bench_data, an import that worked only as
    `python bench/bench_mix.py`), line documents, the smallest mixture: a row per mode, every column filled."""
    rows = mix_rows(run_bench("bench_mix", "--sizes-mb", "1", timeout=180))
    assert [r[2] for r in rows] == ["copy", "index"]
    assert all(len(r) == len(MIX_COLUMNS) and int(r[1].replace(",", "")) > 0 for r in rows)
    assert all(float(r[-1]) > 0 for r in rows)  # the loader read the result


@pytest.mark.slow
def test_bench_mix_runs_as_the_documented_script_path_with_long_documents():
    """docs/mixtures.md's form, `python bench/bench_mix.py`, with the synthetic long documents."""
    out = run([sys.executable, "bench/bench_mix.py", "--sizes-mb", "1", "--documents", "long", "--modes", "index"],
              timeout=180)
    rows = mix_rows(out)
    assert len(rows) == 1 and rows[0][2] == "index" and len(rows[0]) == len(MIX_COLUMNS)


def test_bench_softmax_prints_each_variant_against_its_base(tmp_path):
    result = tmp_path / "softmax.jsonl"
    out = run_bench("bench_softmax", "--reps", "1", "--batch", "1", "--dtypes", "fp32", "--json", result)
    assert out.startswith("machine: ") and "step fp32 batch 1\n" in out
    for shortlist in (2000, 20000):
        assert f"head fp32 N 1024 d 256 S {shortlist} C 3\n" in out
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert [(r["section"], r["variant"]) for r in rows] == [
        ("step", "no plan"), ("step", "plan"), ("step", "plan+pad64"),
        *[("head", v) for _ in range(2) for v in ("cat", "split", "one tensor")]]
    for r in rows:
        base = next(b for b in rows if b["case"] == r["case"] and b["variant"] == r["ratio_to"])
        assert r["ratio"] == pytest.approx(r["min_s"] / base["min_s"]) and r["min_s"] <= r["median_s"]
        assert f"{r['variant']} / {r['ratio_to']} (min) {r['ratio']:.3f}" in out


def synthetic(root: Path, splits: dict[str, int], vocab_size: int = 4096) -> Path:
    from bench.synthetic_corpus import write_corpus
    from txl_dist.data.format import Layout

    return write_corpus(root, splits, vocab_size, Layout(2, 8))


def test_dropatt_study_trains_and_evaluates_each_dropatt(tmp_path):
    corpus = synthetic(tmp_path / "corpus", {"train": 8 * 64 * 3 + 8, "valid": 2 * 64 * 3 + 2})
    out = run_bench("dropatt_study", "--corpus", corpus, "--steps", "3", "--seeds", "0", "--dropatt", "0", "0.2")
    lines = out.splitlines()
    assert lines[0].endswith("3 steps x 8 streams x 64 tokens; valid: 2 streams, tgt 64, mem 128, same_length")
    rows = [json.loads(line) for line in lines[1:3]]
    assert [(r["seed"], r["dropatt"]) for r in rows] == [(0, 0.0), (0, 0.2)]
    assert all(np.isclose(r["valid_ppl"], np.exp(r["valid_loss"]), rtol=1e-3) for r in rows)
    assert lines[3:] == [f"dropatt {d}: mean valid loss {r['valid_loss']:.4f} over seeds [0]"
                         for d, r in zip((0.0, 0.2), rows)]


def test_synthetic_corpus_reads_back_through_the_loader(tmp_path):
    """bench/synthetic_corpus.py (no command line: the corpus of the suite's ZeRO and learning sections)."""
    from bench.synthetic_corpus import EOD
    from txl_dist.data import StreamLoader, read_manifest
    from txl_dist.data.format import split_reader

    corpus = synthetic(tmp_path / "corpus", {"train": 5000, "valid": 300})
    m = read_manifest(corpus)
    assert m.tokenizer.vocab_size == 4096 and m.tokenizer.eod_id == EOD
    for name, n in (("train", 5000), ("valid", 300)):
        tokens = np.asarray(split_reader(corpus, m, name).read(0, n))
        assert m.splits[name].n_tokens == n and tokens[-1] == EOD
        assert m.splits[name].n_documents == int(np.sum(tokens == EOD))
        assert ((tokens >= 4) | (tokens == EOD)).all() and (tokens < 4096).all()
    batch = next(iter(StreamLoader(corpus, "train", rank=0, world_size=2, n_streams=8, micro_batch=4, tgt_len=16)))
    assert batch.input_ids.shape == (4, 16)


def test_timing_interleaves_the_calls_and_keeps_min_and_median():
    """bench/timing.py (no command line: the rule every benchmark here measures by), on a fake clock."""
    from bench.timing import interleaved

    calls, now = [], [0.0]
    cost = {"a": [5, 1, 3, 9], "b": [2, 2, 7, 4]}  # seconds of the warm-up call, then of each repetition

    def fn(name):
        def call():
            now[0] += cost[name][sum(c == name for c in calls)]
            calls.append(name)
        return call

    times = interleaved({"a": fn("a"), "b": fn("b")}, reps=3, clock=lambda: now[0])
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert times == {"a": (1, 3), "b": (2, 4)}


def test_soak_sh_checks_its_arguments_before_it_starts():
    usage = subprocess.run(["bash", "bench/soak.sh", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "bash bench/soak.sh --steps 300 --ckpt-interval 50" in usage.stderr
    proc = subprocess.run(["bash", "bench/soak.sh", "--steps", "300", "--ckpt-interval", "50", "--crash-step", "40"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must lie after the first checkpoint (50)" in proc.stderr


def test_soak_report_samples_a_process_and_reports_what_is_missing(tmp_path):
    """The sampler follows a live process until it ends; the inventory of a run folder without checkpoints;
    the report of that scratch folder (no training ran) names every check it could not pass, exit 1."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    assert json.loads(run_bench("soak_report", "inventory", run_dir)) == {
        "complete": [], "incomplete": [], "leftovers": [], "latest": None}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        run_bench("soak_report", "sample", "--segment", "1", "--pid", f"0:{child.pid}", "--run-dir", run_dir,
                  "--out", tmp_path / "samples.jsonl", "--interval", "0.1")
    finally:
        child.wait(timeout=30)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    procs = [s for s in samples if s["kind"] == "proc"]
    assert procs and all(s["pid"] == child.pid and s["rss"] > 0 and s["fds"] > 0 for s in procs)
    assert samples[-1]["kind"] == "disk" and samples[-1]["final"]
    out = run_bench("soak_report", "report", "--scratch", tmp_path, "--run-dir", run_dir, "--steps", 40,
                    "--crash-step", 25, "--ckpt-interval", 10, "--keep", 3, "--eval-interval", 40, expect=1)
    assert out.startswith("txl-dist soak: configs/tiny.json on 2 CPU ranks")
    for section in ("\ncrash and resume\n", "\nmemory and open files per rank", "\nresult: FAIL\n"):
        assert section in out
    assert "  - train.log holds 0 job(s), not 2\n" in out and "  - no disk samples" in out


def test_config_sweep_runs_a_case_through_train_twin_resume_eval_generate_and_export(tmp_path):
    """One drawn case (seed 3 on 1 rank: ZeRO 0, bf16, AdamW with weight decay) through every step the sweep
    takes; a tool that failed, a resumed loss that differed from the straight run's, or an update unlike its fp32
    twin's would make it FAIL and exit 1 (as it did before DeepSpeed's optimizer state initialization step was
    undone: the twin's 4th-6th steps moved the weights ~5% further)."""
    from bench.twin_check import BOUNDS

    record = one_sweep_case("config_sweep", 3, tmp_path)
    assert record["verdict"] == "pass" and record["case"]["world"] == 1 and record["failed"] == []
    twin, (low, high) = record["twin"], BOUNDS["bf16"][3]
    assert (record["case"]["stage"], twin["precision"], twin["skipped_steps"]) == (0, "bf16", 0)
    assert twin["problems"] == [] and low <= twin["update_norm_ratio"] <= high, twin
    assert not (tmp_path / "out" / "seed3_case000").exists()  # a passing case's folder goes (no --keep)


def test_config_sweep_runs_only_the_cases_drawn_in_the_precision_asked(tmp_path, monkeypatch):
    from bench import config_sweep

    seen = []
    monkeypatch.setattr(config_sweep, "corpus_vocab", lambda corpus: 1000)
    monkeypatch.setattr(config_sweep, "run_case", lambda case, folder, corpus, port: seen.append(case) or
                        {"case": {}, "failed": [], "verdict": "pass"})
    assert config_sweep.main(["--cases", "4", "--seed", "5", "--precision", "fp16", "--out", str(tmp_path)]) == 0
    assert len(seen) == 4 and {case.precision for case in seen} == {"fp16"}


def test_config_sweep_refuses_a_folder_that_is_no_corpus(tmp_path):
    err = subprocess.run([sys.executable, "-m", "bench.config_sweep", "--corpus", str(tmp_path)], cwd=REPO,
                         env=bench_env(), capture_output=True, text=True, timeout=60)
    assert err.returncode == 2 and "no prepared corpus with its tokenizer" in err.stderr
    assert "scripts/shakespeare_corpus.sh" in err.stderr


def _fake_sweep_process(cmd, log, *, off_at_resumed_step_5=False, problems=(), commands=None) -> int:
    """config_sweep.run's stand-in: each "train" appends its steps' losses to its run's metrics journal (the
    resumed run's step 5 one last bit off if asked), the twin's comparison prints `problems`; exit status 0."""
    if commands is not None:
        commands.append(cmd)
    log.write_text(json.dumps({"problems": list(problems)}) + "\n" if "bench.twin_check" in cmd else "")
    run_dir = next((Path(a.split("=", 1)[1]) for a in cmd if a.startswith("run.dir=")), None)
    if run_dir is not None:
        journal = run_dir / "tracking" / "metrics.jsonl"
        journal.parent.mkdir(parents=True, exist_ok=True)
        stopped = any(a.startswith("train.exit_step=") for a in cmd)
        steps = range(1, 4) if stopped else range(4 if journal.exists() else 1, 7)
        with open(journal, "a") as f:
            for s in steps:
                off = off_at_resumed_step_5 and s == 5 and run_dir.name == "resumed"
                f.write(json.dumps({"step": s, "metrics": {"train/loss": 8.0 - s / 10 + (1e-15 if off else 0.0)}})
                        + "\n")
    return 0


def test_config_sweep_fails_a_case_whose_resumed_losses_differ(tmp_path, monkeypatch):
    """The verdict's own logic, with the processes replaced: each "train" writes a metrics journal, and the
    resumed run's step 5 differs from the straight run's in the last bit."""
    import random

    from bench import config_sweep

    monkeypatch.setattr(config_sweep, "run",
                        lambda cmd, log: _fake_sweep_process(cmd, log, off_at_resumed_step_5=True))
    case = config_sweep.draw(random.Random(1), 1000, 1)
    assert case.twin() == case  # fp32 at ZeRO 0: no twin to train
    record = config_sweep.run_case(case, tmp_path, tmp_path / "corpus", port=29999)
    assert record["verdict"] == "fail"
    assert [f.split(":")[0] for f in record["failed"]] == ["resumed losses differ"]


def test_config_sweep_fails_a_case_that_learns_unlike_its_fp32_twin(tmp_path, monkeypatch):
    """The verdict's own logic, with the processes replaced: the runs agree with each other, and the twin's
    comparison (bench/twin_check.py) reports a problem, or cannot compare."""
    import random

    from bench import config_sweep

    commands = []
    case = config_sweep.draw(random.Random(3), 1000, 1)  # bf16 at ZeRO 0
    twin = case.twin()
    assert (twin.precision, twin.stage, twin.activation_checkpointing, twin.model) == ("fp32", 0, False, case.model)
    for problems, failed in (([], []), (["steps 4-6 moved the weights 0.95x as far as the twin's"],
                                        ["learns unlike fp32 at ZeRO 0: steps 4-6 moved the weights 0.95x as far "
                                         "as the twin's"])):
        monkeypatch.setattr(config_sweep, "run",
                            lambda cmd, log: _fake_sweep_process(cmd, log, problems=problems, commands=commands))
        folder = tmp_path / str(len(failed))
        folder.mkdir()
        record = config_sweep.run_case(case, folder, tmp_path / "corpus", port=29999)
        assert record["failed"] == failed and record["verdict"] == ("fail" if failed else "pass")
        assert any("train.precision=fp32" in cmd and f"run.dir={folder / 'twin'}" in cmd for cmd in commands)
    monkeypatch.setattr(config_sweep, "run", lambda cmd, log: log.write_text("Traceback\n") and 1)
    record = config_sweep.learns_like_twin(twin, tmp_path / "a", tmp_path / "b", [], 29999)
    assert record["problems"] == ["the twin's run: exit status 1"]


def test_data_sweep_runs_a_case_through_every_data_prep_command(tmp_path):
    """One drawn case (seed 6: JSON Lines, a char model, 4 ranks, 7 shards) through train-tokenizer, prepare,
    plan + shards + finalize (the same tokens), verify, inspect, a mixture with a second corpus, and
    relayout + verify."""
    out = run_bench("data_sweep", "--cases", 1, "--seed", 6, "--out", tmp_path / "out", timeout=600)
    assert "1 passed, 0 refused, 0 failed" in out, out
    record = json.loads((tmp_path / "out" / "results.jsonl").read_text())
    assert record["verdict"] == "pass" and record["shards"] > 1 and record["failed"] == []
    assert record["mix"] and "relayout_refusal" not in record


def test_data_sweep_fails_a_case_whose_sharded_corpus_differs(tmp_path, monkeypatch):
    """The verdict's own logic, with the processes replaced: every command succeeds and writes what its output
    would hold, but finalize's corpus has other tokens than the one-shot prepare's."""
    import random

    from bench import data_sweep

    def fake_run(cmd, log):
        log.write_text("")
        command = cmd[3]
        out = Path(cmd[cmd.index("--out") + 1]) if "--out" in cmd else None
        if command in ("prepare", "finalize") and "--plan" not in cmd and "--shard" not in cmd:
            out.mkdir(parents=True)
            sha = "a" * 64 if command == "prepare" else "b" * 64
            (out / "manifest.json").write_text(json.dumps(
                {"splits": {"train": {"n_tokens": 10, "n_documents": 2, "tokens_sha256": sha}}}))
        return 0

    monkeypatch.setattr(data_sweep, "run", fake_run)
    record, _ = data_sweep.run_case(random.Random(6), tmp_path)
    assert record["verdict"] == "fail"
    assert [f.split(":")[0] for f in record["failed"]] == ["sharded corpus differs from the one-shot one"]
