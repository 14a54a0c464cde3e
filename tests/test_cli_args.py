"""A bad command line is one `error:` line and exit status 2 in every entry point (txl_dist/cli_args.py), as
the README and docs/refusals.md say; --help still prints the whole help. `python -m txl_dist.trace_summary`
refuses a trace file it cannot read in one line too, and `launch/generate.py --model` a folder that does not
exist. Each case is a fresh process, as a user runs it; they all run at once (an entry point imports torch
before it parses: ~1.5 s each)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from txl_dist.cli_args import ArgumentParser
from txl_dist.errors import EXIT_REFUSED

REPO = Path(__file__).resolve().parents[1]

# (name, command after the interpreter, the message argparse gives (its start), the command its --help is of)
BAD = [
    ("generate-int", ["launch/generate.py", "--prompt", "x", "--max-new-tokens", "abc"],
     "argument --max-new-tokens: invalid int value: 'abc'", "launch/generate.py"),
    ("eval-unknown", ["launch/eval.py", "--checkpoint", "runs/x", "--bogus"],
     "unrecognized arguments: --bogus", "launch/eval.py"),
    ("export-required", ["launch/export.py", "--checkpoint", "runs/x"],
     "the following arguments are required: --out", "launch/export.py"),
    ("train-no-value", ["launch/train.py", "--config", "c.json", "--resume"],
     "argument --resume: expected one argument", "launch/train.py"),
    ("interop-sub-required", ["-m", "txl_dist.interop", "to-hf", "a"],
     "the following arguments are required: out_dir", "python -m txl_dist.interop to-hf"),
    ("tracking-required", ["-m", "txl_dist.tracking", "replay"],
     "the following arguments are required: RUN_DIR", "python -m txl_dist.tracking replay"),
    ("tracking-choice", ["-m", "txl_dist.tracking", "nope"],  # no torch: a cheap second sub-command case
     "argument COMMAND: invalid choice: 'nope'", "python -m txl_dist.tracking"),  # then the choices
    ("trace-summary-int", ["-m", "txl_dist.trace_summary", "--table", "x", "t.json"],
     "argument --table: invalid int value: 'x'", "python -m txl_dist.trace_summary"),
    ("config-reference-unknown", ["-m", "txl_dist.config_reference", "--bogus"],
     "unrecognized arguments: --bogus", "python -m txl_dist.config_reference"),
    ("unigram-float", ["-m", "txl_dist.unigram", "c", "--smoothing", "x"],
     "argument --smoothing: invalid float value: 'x'", "python -m txl_dist.unigram"),
    ("data-prep-sub-required", ["-m", "data_prep", "prepare"],
     "the following arguments are required: --out", "python -m data_prep prepare"),
    ("safe-load-choice", ["-m", "txl_dist.safe_load", "nope"],
     "argument COMMAND: invalid choice: 'nope'", "python -m txl_dist.safe_load"),
]

# (name, command, the whole line it must print on stderr with exit status 2; {cwd} is the folder it runs in)
REFUSED = [
    ("trace-summary-missing", ["-m", "txl_dist.trace_summary", "missing.json.gz"],
     "error: trace file missing.json.gz does not exist (expected a Chrome trace written by torch.profiler, "
     ".json or .json.gz)"),
    ("trace-summary-not-json", ["-m", "txl_dist.trace_summary", "notjson.json"],
     "error: trace file notjson.json is not JSON: Expecting value at line 1 col 1 (expected a Chrome trace "
     "written by torch.profiler, .json or .json.gz)"),
    ("trace-summary-not-gzip", ["-m", "txl_dist.trace_summary", "plain.json.gz"],
     "error: trace file plain.json.gz is not a whole gzip file: Not a gzipped file (b'he') (expected a Chrome "
     "trace written by torch.profiler, .json or .json.gz)"),
    ("generate-model-missing", ["launch/generate.py", "--model", "nowhere", "--prompt", "x"],
     "error: --model nowhere does not exist (looked for {cwd}/nowhere); pass a folder written by "
     "launch/export.py --out or save_pretrained"),
    ("generate-model-a-file", ["launch/generate.py", "--model", "notjson.json", "--prompt", "x"],
     "error: --model notjson.json is not a folder; pass a folder written by launch/export.py --out or "
     "save_pretrained"),
]

HELP = ("generate-help", ["launch/generate.py", "--help"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Every case's process, started together in one scratch folder (its only files: those it reads)."""
    cwd = tmp_path_factory.mktemp("cli")
    (cwd / "notjson.json").write_text("hello\n")
    (cwd / "plain.json.gz").write_text("hello\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cases = [(name, command) for name, command, *_ in BAD + REFUSED] + [HELP]
    started = {}
    for name, command in cases:
        if command[0].startswith("launch/"):
            command = [str(REPO / command[0]), *command[1:]]
        started[name] = subprocess.Popen([sys.executable, *command], cwd=cwd, env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert sorted(p.name for p in cwd.iterdir()) == ["notjson.json", "plain.json.gz"]  # nothing written
    return cwd, done


@pytest.mark.parametrize("name, command, message, prog", BAD, ids=[case[0] for case in BAD])
def test_a_bad_command_line_is_one_error_line_and_exit_status_2(runs, name, command, message, prog):
    proc = runs[1][name]
    assert proc.returncode == EXIT_REFUSED, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {message}") and lines[0].endswith(f" (see {prog} --help)"), lines[0]


@pytest.mark.parametrize("name, command, line", REFUSED, ids=[case[0] for case in REFUSED])
def test_an_unreadable_input_file_is_one_error_line_and_exit_status_2(runs, name, command, line):
    cwd, done = runs
    proc = done[name]
    assert proc.returncode == EXIT_REFUSED, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [line.format(cwd=cwd)], proc.stderr


def test_help_still_prints_the_whole_help(runs):
    proc = runs[1][HELP[0]]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: launch/generate.py") and "--clamp-len" in proc.stdout
    assert "examples:" in proc.stdout


def test_sub_commands_parse_with_the_same_class():
    parser = ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True).add_parser("run")
    assert isinstance(sub, ArgumentParser)


def test_a_multi_line_message_is_still_one_line(capsys):
    parser = ArgumentParser(prog="tool")
    with pytest.raises(SystemExit) as stop:
        parser.error("first\n  second")
    assert stop.value.code == EXIT_REFUSED
    assert capsys.readouterr().err == "error: first second (see tool --help)\n"


def test_every_entry_point_builds_the_one_line_parser():
    """Read from the sources (importing them all would import torch): no entry point of ours builds a stock
    argparse.ArgumentParser, whose errors are a usage block."""
    sources = [*sorted((REPO / "launch").glob("*.py")), *sorted((REPO / "launch" / "slurm").glob("*.py")),
               *sorted((REPO / "txl_dist").rglob("*.py")), *sorted((REPO / "data_prep").glob("*.py"))]
    stock = []
    for path in sources:
        relative = path.relative_to(REPO).as_posix()
        if re.search(r"\bargparse\.ArgumentParser\(", path.read_text(encoding="utf-8")):
            stock.append(relative)
    assert stock == [], f"stock argparse parsers (use txl_dist.cli_args.ArgumentParser): {stock}"
