"""The documentation inside the repository stays true: the configuration reference is generated from the
config dataclasses (stale = a failure), every entry point's --help explains each option and shows an
example, every command in README.md and docs/*.md names an entry point and options that exist, and no
docstring or document points at a file outside the repository.

Entry points are found, not listed: every launch/*.py with a main(), every package with a __main__.py and
every module run as `python -m` (an `if __name__ == "__main__":` block) under txl_dist/ and data_prep/.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from txl_dist import config
from txl_dist.config_reference import DEFAULT_OUT, REGENERATE, render

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("txl_dist", "data_prep")


# ----------------------------------------------------------------------------------------------------
# The configuration reference


def test_configuration_reference_is_current():
    assert DEFAULT_OUT == REPO / "docs" / "configuration.md"
    current = DEFAULT_OUT.read_text(encoding="utf-8") if DEFAULT_OUT.is_file() else ""
    assert current == render(), f"docs/configuration.md is stale: run `{REGENERATE}`"


def test_configuration_reference_names_every_key_with_its_docstring():
    text = render()
    for section, cls in config.SECTIONS.items():
        for name in cls.__dataclass_fields__:
            assert f"| `{section}.{name}` |" in text, f"{section}.{name} missing"
    # A docstring, not just the key: two that are easy to recognise.
    assert "Adaptive softmax cluster boundaries" in text and "Relative distances beyond clamp_len" in text


def test_a_field_without_a_docstring_is_refused():
    import dataclasses

    from txl_dist.config_reference import section_fields

    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """It says what it is."""
        silent: int = 2

    with pytest.raises(ValueError, match=r"Section.silent \(config key demo.silent\) has no docstring"):
        section_fields("demo", Section)


def test_config_reference_check_mode_reports_a_stale_file(tmp_path, capsys):
    from txl_dist.config_reference import main

    out = tmp_path / "configuration.md"
    out.write_text("old\n")
    assert main(["--out", str(out), "--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--out", str(out)]) == 0 and main(["--out", str(out), "--check"]) == 0


# ----------------------------------------------------------------------------------------------------
# Entry points and their parsers


def entry_points() -> dict[str, str]:
    """How a user runs each entry point ('launch/train.py', 'python -m data_prep') -> the module with its main()."""
    found = {f"launch/{p.name}": f"launch.{p.stem}" for p in sorted((REPO / "launch").glob("*.py"))
             if re.search(r"^def main\(", p.read_text(), re.M)}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if path.name == "__main__.py":
                found[f"python -m {module.removesuffix('.__main__')}"] = module
            elif re.search(r'^if __name__ == "__main__":', path.read_text(), re.M):
                found[f"python -m {module}"] = module
    return found


class _Captured(Exception):
    pass


def parser_of(module: str) -> argparse.ArgumentParser:
    """The parser an entry point's main() builds (caught as it starts parsing; nothing else runs)."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Captured

    argparse.ArgumentParser.parse_known_args = capture
    try:
        with contextlib.suppress(_Captured):
            importlib.import_module(module).main([])
    finally:
        argparse.ArgumentParser.parse_known_args = original
    assert seen, f"{module}.main() parsed no command line"
    return seen[0]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def all_parsers(name: str, parser: argparse.ArgumentParser):
    """(command, parser) for the parser and each of its sub-commands, recursively."""
    yield name, parser
    for sub, p in subparsers(parser).items():
        yield from all_parsers(f"{name} {sub}", p)


def test_the_entry_points_are_all_found():
    names = set(entry_points())
    assert {"launch/train.py", "launch/eval.py", "launch/export.py", "python -m data_prep",
            "python -m txl_dist.interop", "python -m txl_dist.tracking", "python -m txl_dist.config_reference"} <= names


@pytest.mark.parametrize("name", sorted(entry_points()))
def test_every_option_of_every_entry_point_has_help_and_an_example(name):
    for command, parser in all_parsers(name, parser_of(entry_points()[name])):
        assert parser.description, f"{command}: no description"
        assert parser.epilog and "example" in parser.epilog, f"{command}: no example in the --help epilog"
        # The example names the command it is the help of.
        assert command.split()[-1] in parser.epilog, f"{command}: the example does not show `{command}`"
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            shown = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"{command} {shown}: no help text"


@pytest.mark.parametrize("name", sorted(entry_points()))
def test_help_exits_0_and_prints_the_example(name, capsys):
    module = importlib.import_module(entry_points()[name])
    for command, parser in all_parsers(name, parser_of(entry_points()[name])):
        argv = command.split()[len(name.split()):] + ["--help"]
        with pytest.raises(SystemExit) as stop:
            module.main(argv)
        assert stop.value.code == 0, command
        out = capsys.readouterr().out
        assert "usage:" in out and "example" in out, command


def test_python_m_data_prep_help_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "data_prep", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fetch-corpus" in out.stdout and "example" in out.stdout


# ----------------------------------------------------------------------------------------------------
# Commands in the documents


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LAUNCHERS = {"deepspeed", "torchrun", "srun", "sbatch"}  # their own options come before the script
PYTHONS = {"python", "python3", ".venv/bin/python"}
STANDARD_MODULES = {"venv", "pip"}
"""`python -m` modules of Python itself: the documents use them to set up, there is nothing of ours to check."""


def shell_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, words) of each command in the ```bash blocks of a markdown file (continuations joined,
    comments dropped)."""
    commands, block, pending, start = [], False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            block = line.strip() in ("```bash", "```sh", "```shell", "```console")
            continue
        if not block:
            continue
        if not pending:
            start = number
        pending += line.removesuffix("\\") + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        words = shlex.split(pending.removeprefix("$ "), comments=True)
        pending = ""
        if words:
            commands.append((start, words))
    return commands


def resolve_command(words: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(entry point name or None, a repository file the command runs or None, the arguments it gets)."""
    while words and words[0] in LAUNCHERS:
        launcher, words = words[0], words[1:]
        while words and words[0].startswith("-"):  # the launcher's own options, e.g. --num_gpus 8
            option = words.pop(0)
            if "=" not in option and words and not words[0].startswith("-") and not _is_target(words[0]):
                words.pop(0)
        if launcher == "sbatch" and words and words[0].endswith(".sbatch"):
            # launch/slurm/<job>.sbatch passes its arguments to launch/<job>.py
            batch = words[0]
            target = f"launch/{Path(batch).stem}.py"
            return (target if (REPO / target).is_file() else None), batch, words[1:]
    if words and words[0] in PYTHONS:
        words = words[1:]
        if words[:1] == ["-m"]:
            module = words[1] if len(words) > 1 else ""  # a bare `python -m` names no entry point: reported
            return (None, None, []) if module in STANDARD_MODULES else (f"python -m {module}", None, words[2:])
    if not words:
        return None, None, []
    if words[0] == "bash":
        return None, (words[1] if len(words) > 1 else None), words[2:]
    if words[0].startswith("launch/") and words[0].endswith(".py"):
        return words[0], words[0], words[1:]
    return None, None, words


def _is_target(word: str) -> bool:
    return word.endswith((".py", ".sbatch", ".sh")) or word in PYTHONS


def check_options(name: str, parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """What is wrong with `args` for this parser: unknown sub-commands, options, --set keys."""
    problems = []
    subs = subparsers(parser)
    if subs:
        if not args or args[0] not in subs:
            return [f"{name}: sub-command {args[:1]} is not one of {sorted(subs)}"]
        return check_options(f"{name} {args[0]}", subs[args[0]], args[1:])
    for i, word in enumerate(args):
        if not word.startswith("--"):
            continue
        option = word.split("=", 1)[0]
        if option not in parser._option_string_actions:
            problems.append(f"{name}: no option {option}")
        if option == "--set" and i + 1 < len(args):
            key = args[i + 1].split("=", 1)[0]
            section, _, field = key.partition(".")
            if section in config.SECTIONS and field.split(".")[0] not in config.SECTIONS[section].__dataclass_fields__:
                problems.append(f"{name}: --set {key}: no such config key")
            elif section not in config.SECTIONS and section != "deepspeed":
                problems.append(f"{name}: --set {key}: no such config section")
    return problems


def test_every_command_in_the_documents_names_an_entry_point_and_options_that_exist():
    points = entry_points()
    parsers: dict[str, argparse.ArgumentParser] = {}
    problems, checked = [], 0
    for doc in DOCUMENTS:
        for line, words in shell_commands(doc):
            name, file, args = resolve_command(list(words))
            where = f"{doc.relative_to(REPO)}:{line}: {' '.join(words)}"
            if file is not None and not (REPO / file).is_file():
                problems.append(f"{where}: {file} does not exist")
                continue
            if name is None:
                continue
            if name not in points:
                problems.append(f"{where}: {name} is not an entry point")
                continue
            parser = parsers.setdefault(name, parser_of(points[name]))
            problems += [f"{where}: {p}" for p in check_options(name, parser, args)]
            checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= 20, f"only {checked} commands were checked: is the parsing of the documents broken?"


def test_the_examples_in_every_help_use_options_that_exist():
    points = entry_points()
    problems, checked = [], 0
    for name, module in points.items():
        for command, parser in all_parsers(name, parser_of(module)):
            text = re.sub(r"\\\n\s*", " ", parser.epilog or "")
            for line in text.splitlines():
                if not line.startswith("  "):
                    continue
                example, _, args = resolve_command(shlex.split(line))
                if example is None:
                    continue
                if example not in points:
                    problems.append(f"{command} --help: {line.strip()}: {example} is not an entry point")
                    continue
                problems += [f"{command} --help: {line.strip()}: {p}"
                             for p in check_options(example, parser_of(points[example]), args)]
                checked += 1
    assert not problems, "\n".join(problems)
    assert checked >= len(points), checked


def test_the_command_check_catches_a_wrong_option_and_a_wrong_key():
    parser = parser_of(entry_points()["launch/train.py"])
    name, _, args = resolve_command(shlex.split("deepspeed --num_gpus 2 launch/train.py --config c.json --resum x "
                                                "--set model.n_layers=3"))
    assert name == "launch/train.py"
    assert check_options(name, parser, args) == ["launch/train.py: no option --resum",
                                                 "launch/train.py: --set model.n_layers: no such config key"]
    prep = parser_of(entry_points()["python -m data_prep"])
    name, _, args = resolve_command(shlex.split("python -m data_prep prepare --out x --vocab 3"))
    assert check_options(name, prep, args) == ["python -m data_prep prepare: no option --vocab"]
    # Truncated commands are reported as what they name, not raised on: a bare `python -m` is no entry point.
    assert resolve_command(["python", "-m"])[0] not in entry_points()
    assert resolve_command(["bash"]) == (None, None, [])


# ----------------------------------------------------------------------------------------------------
# References stay inside the repository


def test_no_docstring_or_document_points_outside_the_repository():
    outside = re.compile(r"\.\./shared|ARCHITECTURE\.md|FACTS\.md|/work/")
    files = [*DOCUMENTS, *(p for package in (*PACKAGES, "launch", "scripts", "tests", "configs")
                           for p in (REPO / package).rglob("*") if p.suffix in (".py", ".sh", ".md", ".json"))]
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if outside.search(line) and p.name != "test_docs.py"]
    assert not hits, "\n".join(hits)


def test_markdown_links_between_documents_resolve():
    broken = []
    for doc in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, "\n".join(broken)


def test_the_documented_slurm_port_formula_is_the_codes():
    from txl_dist.distributed import SLURM_PORT_BASE, SLURM_PORT_SPAN

    stated = {(doc.relative_to(REPO).as_posix(), m.group(0)) for doc in DOCUMENTS
              for m in re.finditer(r"(\d+) \+ job id % (\d+)", doc.read_text(encoding="utf-8"))
              if (int(m.group(1)), int(m.group(2))) != (SLURM_PORT_BASE, SLURM_PORT_SPAN)}
    assert not stated, f"the code says {SLURM_PORT_BASE} + job id % {SLURM_PORT_SPAN}: {sorted(stated)}"
    assert any("job id %" in doc.read_text(encoding="utf-8") for doc in DOCUMENTS)


def test_bench_scripts_the_documents_run_by_path_run_by_path():
    """`python bench/x.py ...` works only for scripts that need no `bench` package on the path; the others are
    documented as `python -m bench.x`."""
    scripts = sorted({m.group(1) for doc in DOCUMENTS
                      for m in re.finditer(r"`(?:python\S* )?(bench/\w+\.py) -", doc.read_text(encoding="utf-8"))})
    for script in scripts:
        done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"python {script} --help: {done.stderr.strip().splitlines()[-1:]}"
