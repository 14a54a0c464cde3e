#!/usr/bin/env bash
# The device check: one GPU, under 8 minutes including set-up (see bench/gpu_check.py for the phases).
#
#   bash bench/gpu_check.sh [--out DIR] [--cpu-smoke]    # default DIR: $OUT when set
#
# GPU_CHECK_TOTAL_S overrides the overall time box (470 s on a GPU, 110 s for --cpu-smoke); the phases
# share it minus 25 s for imports and the table, under one deadline (bench/gpu_check.py --budget-s).
# DIR receives 7 small files at most (setup.log, gpu_check.jsonl, gpu_check_table.txt, one capped log per
# DeepSpeed stage, two of tests/test_gpu.py's): the device tool brings back at most 8 files of at most 16 MiB. Scratch work
# (the synthetic corpus, the trainer's run folders and checkpoints) goes to a temporary folder under
# $TMPDIR (else /tmp) that gpu_check.py removes.
# The GPU machine has torch but not DeepSpeed and no network; its python3 is itself a venv, so a
# `python3 -m venv --system-site-packages` on top of it would not see torch. The wheels that
# scripts/fetch_gpu_wheels.sh leaves in .gpu-wheels/ (run beforehand, where there is a network) are
# installed with `pip install --target` into $TMPDIR/txl-gpu-check-site, put on PYTHONPATH. If that
# install fails, the phases that need nothing but torch still run (the deepspeed phase records why not).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-$ROOT/gpu-check-out}"
SMOKE=0
PASS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --cpu-smoke) SMOKE=1; PASS+=("--cpu-smoke"); shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
mkdir -p "$OUT_DIR"
SETUP_LOG="$OUT_DIR/setup.log"
START=$(date +%s)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
       HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ "$SMOKE" = 1 ]; then
    # On the development machines: their own interpreter, DeepSpeed on the CPU.
    PY="${PYTHON:-}"
    [ -z "$PY" ] && [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
    PY="${PY:-python3}"
    export DS_ACCELERATOR=cpu
    TOTAL_S="${GPU_CHECK_TOTAL_S:-110}"
else
    PY="${PYTHON:-python3}"
    SITE="${TMPDIR:-/tmp}/txl-gpu-check-site"
    WHEELS="$ROOT/.gpu-wheels"
    {
        echo "[gpu_check] setup $(date -u +%FT%TZ): $PY is $(command -v "$PY"), wheels in $WHEELS: $(ls "$WHEELS" 2>/dev/null | wc -l)"
        if ls "$WHEELS"/*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl; then
            export PYTHONPATH="$PYTHONPATH:$SITE"
            echo "[gpu_check] wheels installed into $SITE (on PYTHONPATH)"
            if ! timeout 90 "$PY" -c "import deepspeed; print('[gpu_check] deepspeed', deepspeed.__version__)"; then
                echo "[gpu_check] deepspeed does not import (or not within 90 s): the others run"
                export TXL_GPU_CHECK_NO_DEEPSPEED="deepspeed did not import within 90 s (setup.log)"
            fi
        else
            echo "[gpu_check] deepspeed NOT installed: the deepspeed phase will say so; the others run"
            export TXL_GPU_CHECK_NO_DEEPSPEED="the DeepSpeed wheels did not install (setup.log)"
        fi
    } >"$SETUP_LOG" 2>&1
    cat "$SETUP_LOG"
    TOTAL_S="${GPU_CHECK_TOTAL_S:-470}"  # 8 minutes, set-up included, with a margin
fi

LEFT=$(( TOTAL_S - ($(date +%s) - START) ))
BUDGET=$(( LEFT - 25 ))  # the phases' own budget; the rest covers imports and the table
if [ "$BUDGET" -lt 30 ]; then  # (timeout 0 would mean no limit at all)
    echo "[gpu_check] only ${LEFT} s of the ${TOTAL_S} s left after set-up: nothing measured" >&2
    exit 124
fi
echo "[gpu_check] python $PY, out $OUT_DIR, ${LEFT} s left, phase budget ${BUDGET} s"
# --end-epoch: the phases end by the shell's clock, so Python's own start-up (torch, CUDA) counts too.
timeout --signal=TERM --kill-after=10 "$LEFT" "$PY" "$ROOT/bench/gpu_check.py" --out "$OUT_DIR" \
    --budget-s "$BUDGET" --end-epoch "$(( START + TOTAL_S - 25 ))" ${PASS[@]+"${PASS[@]}"}  # (an empty array under set -u: bash < 4.4)
code=$?
echo "[gpu_check] exit $code after $(( $(date +%s) - START )) s; results in $OUT_DIR"
exit $code
