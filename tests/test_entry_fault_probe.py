"""bench/entry_fault_probe.py: its verdicts on made-up outcomes, and one real case."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.entry_fault_probe import Case, Setup, check, draw_case, result_problems

REPO = Path(__file__).resolve().parents[1]
EXPORT = Case("export", "", 10, 0.5)


def outcome(raised: bool, exit_status: int, printed: bool = True, ended_after_s: float | None = 1.0) -> dict:
    return {"raised": raised, "exit": exit_status, "error_printed": printed, "ended_after_s": ended_after_s,
            "stdout": ""}


@pytest.fixture
def setup(tmp_path) -> Setup:
    """A set-up whose undisturbed export wrote two small folders."""
    s = Setup(tmp_path / "setup", tmp_path / "corpus")
    for folder, config in [("native", "model_config.json"), ("hf", "config.json")]:
        (s.reference(EXPORT) / folder).mkdir(parents=True)
        (s.reference(EXPORT) / folder / "model.safetensors").write_bytes(b"weights")
        (s.reference(EXPORT) / folder / config).write_text("{}")
    return s


def test_a_raised_error_must_fail_the_command_print_it_and_leave_no_finished_looking_folder(setup, tmp_path):
    out = tmp_path / "out"
    (out / "native").mkdir(parents=True)
    (out / "native" / "model.safetensors").write_bytes(b"new weights")  # no config: not an export
    assert check(setup, EXPORT, out, outcome(True, 1)) == []
    assert check(setup, EXPORT, out, outcome(True, 0, printed=False)) == [
        "the error was raised and the command succeeded without a word: swallowed"]
    assert check(setup, EXPORT, out, outcome(True, 0)) == [  # said so, but its result is not the export
        "its result differs from the undisturbed run's"]
    assert check(setup, EXPORT, out, outcome(True, 1, printed=False)) == [
        "the command failed (exit status 1) without printing the error"]
    assert check(setup, EXPORT, out, outcome(True, None, ended_after_s=None)) == [
        "the command had not ended 60 s after the error"]
    (out / "native" / "model_config.json").write_text("{}")  # a config beside other weights than the export's
    assert check(setup, EXPORT, out, outcome(True, 1)) == [
        "left native/model_config.json beside files unlike the undisturbed run's"]
    (out / "native" / "model.safetensors").write_bytes(b"weights")  # the finished export: fine to keep
    (out / "hf").mkdir()
    (out / "hf" / ".model.safetensors.123.tmp").write_bytes(b"half")
    assert check(setup, EXPORT, out, outcome(True, 1)) == ["left hf/.model.safetensors.123.tmp"]


def test_an_error_met_once_the_result_was_complete_may_end_in_success_if_it_said_so(setup, tmp_path):
    prepare = Case("prepare", "reuse", 10, 0.5)
    (setup.reference(prepare) / "corpus").mkdir(parents=True)
    (setup.reference(prepare) / "corpus" / "manifest.json").write_text(json.dumps({"splits": {"train": 1}}))
    out = tmp_path / "out"
    shutil.copytree(setup.reference(prepare), out)  # the finished corpus, its manifest included: no leftover
    assert check(setup, prepare, out, outcome(True, 0)) == []
    assert check(setup, prepare, out, outcome(True, 0, printed=False)) == [
        "the error was raised and the command succeeded without a word: swallowed"]
    assert check(setup, prepare, out, outcome(True, 1)) == ["left corpus/manifest.json"]
    (out / ".corpus.sources-x1").mkdir()  # prepare --source's scratch, which a failure must remove
    mixture = Case("prepare", "sources", 10, 0.5)
    assert check(setup, mixture, out, outcome(True, 1)) == ["left corpus/manifest.json", "left .corpus.sources-x1"]


def test_a_command_the_error_never_reached_must_succeed_with_the_undisturbed_result(setup, tmp_path):
    out = tmp_path / "out"
    assert check(setup, EXPORT, out, outcome(False, 1)) == ["failed (exit status 1) although no error was raised"]
    out.mkdir()
    assert result_problems(setup, EXPORT, out, "") == ["its result differs from the undisturbed run's"]
    for folder in ("native", "hf"):
        (out / folder).mkdir()
        for f in (setup.reference(EXPORT) / folder).iterdir():
            (out / folder / f.name).write_bytes(f.read_bytes())
    assert check(setup, EXPORT, out, outcome(False, 0)) == []


def test_the_draw_depends_on_the_seed_only():
    import random

    def draws_of(seed):
        rng = random.Random(f"entry faults {seed}")
        return [draw_case(rng, ("eval", "prepare")) for _ in range(20)]

    draws = [draws_of(seed) for seed in (1, 1, 2)]
    assert draws[0] == draws[1] != draws[2]
    assert {c.entry for c in draws[0]} == {"eval", "prepare"}
    assert {c.variant for c in draws[0] if c.entry == "eval"} <= {"rank 0", "rank 1"}


def test_a_real_case_of_export(tmp_path):
    """The set-up (a 2-rank training run, the undisturbed export) and two cases, end to end (~20 s)."""
    from corpus_helpers import make_corpus, synthetic_stream

    corpus = make_corpus(tmp_path / "corpus", {split: synthetic_stream(20_000, 4096, seed=i)
                                               for i, split in enumerate(("train", "valid", "test"))},
                         vocab_size=4096)  # configs/tiny.json's cutoffs: [1000, 2000]
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.entry_fault_probe", "--cases", "2", "--seed", "3", "--entries",
                        "export", "--corpus", str(corpus), "--out", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["verdict"] for r in rows] == ["pass", "pass"] and all(r["signalled"] for r in rows), rows
    assert "0 case(s) failed" in p.stdout
