#!/usr/bin/env bash
# The whole test suite on the oldest versions pyproject.toml promises (scripts/oldest_pins.py: every
# dependency at its '>=' floor, pip resolving the rest), in a clone of this checkout's HEAD under a temporary
# folder, so this checkout's .venv is left as it is. Run it after raising or adding a floor.
#
#   bash scripts/test_oldest.sh [pytest args]
#
# TORCH: the torch requirement of that venv. Default: torch==2.13.0, the CPU build (its floor from PyPI is a
# CUDA build of several GB); TORCH=oldest installs the floor itself (torch==2.6 from PyPI).
# TXL_OLDEST_DIR: where the clone goes (default: a new temporary folder, kept for a look afterwards).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="${TXL_OLDEST_DIR:-$(mktemp -d)}"
CLONE="$WORK/txl-dist"
echo "[test_oldest] cloning HEAD into $CLONE"
git clone --quiet "$ROOT" "$CLONE"
cd "$CLONE"
"$PY" -m venv .venv
if [ "${TORCH:-}" = oldest ]; then
    TORCH_PIN="$("$PY" scripts/oldest_pins.py | grep '^torch==')"
else
    TORCH_PIN="${TORCH:-torch==2.13.0}"
fi
"$PY" scripts/oldest_pins.py --without torch > .venv/oldest-pins.txt
echo "[test_oldest] installing $TORCH_PIN, then $(tr '\n' ' ' < .venv/oldest-pins.txt)"
.venv/bin/python -m pip install -q "$TORCH_PIN"
# A floor that no resolver can reach together with the others fails here, naming the conflict.
.venv/bin/python -m pip install -q -r .venv/oldest-pins.txt -e ".[test]"
.venv/bin/python -m pip list --format freeze 2>/dev/null \
    | grep -i -E "^($(sed 's/==.*//' .venv/oldest-pins.txt | paste -sd'|')|torch)==" || true
# scripts/test.sh keeps what is installed: every version here already satisfies pyproject.toml.
exec bash scripts/test.sh "$@"
