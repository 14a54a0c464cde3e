"""Print `name==floor` for every dependency of pyproject.toml (and its test extra): the oldest versions the
project promises to work with. scripts/test_oldest.sh installs exactly these (pip resolves the rest) and runs
the whole suite on them, so a floor that no resolver can reach, or that the code has outgrown, fails there.

    python scripts/oldest_pins.py [--without torch ...]

Standard library only: it runs before any venv exists. Refuses a dependency without a `>=` floor, since
"any version" is a promise nobody has tested.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name, then its version clauses (PEP 508 without markers or extras: all this project uses).
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*([^;]*)$")


def declared_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    return list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))


def oldest_pin(requirement: str) -> str:
    match = _REQUIREMENT.match(requirement)
    if not match:
        raise ValueError(f"{requirement!r}: not a plain 'name>=version' requirement")
    name, clauses = match.group(1), match.group(2)
    floors = [c.strip()[2:].strip() for c in clauses.split(",") if c.strip().startswith(">=")]
    if len(floors) != 1:
        raise ValueError(f"{requirement!r}: give it one '>=' floor, the oldest version the suite has run with")
    return f"{name}=={floors[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--without", nargs="*", default=[], metavar="NAME",
                        help="leave these out (e.g. torch, when the venv brings its own build)")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args(argv)
    left_out = {n.lower() for n in args.without}
    try:
        pins = [oldest_pin(r) for r in declared_requirements(args.pyproject)]
    except ValueError as err:
        print(f"error: {args.pyproject}: {err}", file=sys.stderr)
        return 2
    for pin in pins:
        if pin.split("==")[0].lower() not in left_out:
            print(pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
