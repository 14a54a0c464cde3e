#!/usr/bin/env bash
# The whole test suite on a fresh machine: sets up .venv (reused when present), then runs pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
# Triton's interpreter runs the fused attention kernels on the CPU (tests/test_triton_attention.py). CUDA builds
# of torch bring their own triton; a CPU build gets the newest one, 3.9 or later (3.6's interpreter cannot take
# loop bounds computed from the program id under numpy 2.4).
if ! "$ROOT/.venv/bin/python" -c "import triton" 2>/dev/null; then
    echo "[test] installing triton into .venv (for its interpreter)"
    "$ROOT/.venv/bin/python" -m pip install -q "triton>=3.9"
fi
export DS_ACCELERATOR=cpu HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Test files run on parallel workers (pytest-xdist), one file per worker at a time so that module fixtures
# (a Slurm cluster, a trained run) are made once: most tests wait on subprocesses, timeouts and start-up, so
# two workers on two cores halve the wall time (a third on 2 cores was slower: the long tests are CPU-bound).
# Files start in collection order, the longest first (tests/conftest.py), so that the workers end together.
# Workers: min(cores, 4); pass -n 0 (or -p no:xdist) for one process, or -n N yourself. The slowest tests are
# listed at the end (--durations).
WORKERS=(-n "$(( $(nproc) < 4 ? $(nproc) : 4 ))" --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
    case "$arg" in -n|-n[0-9]*|--numprocesses*|no:xdist|-pno:xdist) WORKERS=() ;; esac
done
exec "$ROOT/.venv/bin/python" -m pytest "${WORKERS[@]}" --durations=15 "$@"
