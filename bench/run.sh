#!/usr/bin/env bash
# The CPU benchmark suite in one command: rewrites the table of BENCHMARKS.md (see bench/suite.py).
#   bash bench/run.sh [--quick] [--threads N] [--sections reference longmem memory zero checkpoint]
#   bash bench/run.sh --sections learning   # learning per second against the reference (~10 min; not in the default set)
#   bash bench/run.sh --sections learning_comparison   # the same at the comparison model's shape (~20 min)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" \
       HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m bench "$@"
