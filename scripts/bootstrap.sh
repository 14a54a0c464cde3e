#!/usr/bin/env bash
# Create or reuse .venv at the repository root and install the project with its test extras.
# Reinstalls only when pyproject.toml changed since the last successful install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[bootstrap] creating $VENV"
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.txl-dist-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
    echo "[bootstrap] installing dependencies into $VENV (first time: ~2 minutes)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned: the 2.13.0 CPU build; a bare 'torch' requirement would pull a multi-GB
    # CUDA build. On a GPU machine install your CUDA torch into .venv before running this.
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    fi
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    echo "$WANT" > "$STAMP"
fi
