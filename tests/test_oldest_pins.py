"""scripts/oldest_pins.py: the floors of pyproject.toml that scripts/test_oldest.sh installs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "oldest_pins.py"


def _pins(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def _write_pyproject(tmp_path: Path, dependencies: list[str], test: list[str] | None = None) -> Path:
    path = tmp_path / "pyproject.toml"
    lines = ["[project]", 'name = "x"', f"dependencies = {dependencies!r}".replace("'", '"')]
    if test is not None:
        lines += ["[project.optional-dependencies]", f"test = {test!r}".replace("'", '"')]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_dependency_of_the_project_and_its_test_extra_gets_its_floor():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    result = _pins()
    assert result.returncode == 0, result.stderr
    pins = result.stdout.split()
    assert len(pins) == len(declared)
    for requirement, pin in zip(declared, pins):
        name, version = pin.split("==")
        assert requirement.startswith(name)
        assert f">={version}" in requirement.replace(" ", "")


def test_floors_are_pinned_and_ceilings_dropped(tmp_path):
    pyproject = _write_pyproject(tmp_path, ["deepspeed>=0.19.6,<0.20", "numpy >= 1.26"], ["pytest-xdist>=3.8"])
    result = _pins("--pyproject", str(pyproject))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["deepspeed==0.19.6", "numpy==1.26", "pytest-xdist==3.8"]


def test_without_leaves_a_dependency_out(tmp_path):
    pyproject = _write_pyproject(tmp_path, ["torch>=2.6", "numpy>=1.26"])
    result = _pins("--pyproject", str(pyproject), "--without", "Torch")
    assert result.stdout.split() == ["numpy==1.26"]


def test_a_dependency_without_a_floor_is_refused_by_name(tmp_path):
    pyproject = _write_pyproject(tmp_path, ["numpy>=1.26", "pyarrow<26"])
    result = _pins("--pyproject", str(pyproject))
    assert result.returncode == 2
    assert result.stdout == ""
    assert "'pyarrow<26'" in result.stderr and "'>=' floor" in result.stderr
