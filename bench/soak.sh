#!/usr/bin/env bash
# The long-run check: 2 ranks on configs/tiny.json for --steps steps (default 2000) with a checkpoint every
# --ckpt-interval steps (default 100, keep 3) and one simulated crash and resume. Rank 1 is SIGKILLed in the
# middle of step --crash-step (default: half way through the checkpoint interval after the run's middle, 1050
# of 2000; tests/fault_job.py kill-at-step), job 1 ends (rank 0: exit status 1 and one line naming rank 1),
# then the job is restarted with --resume auto and runs to the end. bench/soak_report.py samples each training
# process (RSS, open fds, threads; the RSS floor of every step) and the size of <run>/checkpoints while they
# run, then prints per rank the RSS and open-file slopes (least squares over the second half of each job),
# the disk high-water mark against (keep + 1) checkpoints, the loss around the resume, wall time and steps/s.
# Exit status 0 when every check passes, else 1 with what failed (2: bad arguments).
#
#     bash bench/soak.sh                                  # 2000 steps, ~4 min on 2 cores
#     bash bench/soak.sh --steps 300 --ckpt-interval 50   # a short run (crash at 175): checks the crash and resume;
#                                                         # its RSS slopes see the allocator's warm-up (~20-35 MiB
#                                                         # over the first 1000 steps): expect FAIL on them
#     bash bench/soak.sh --record bench/results/soak.txt  # also write the result there (the docs quote it)
#
# Options: --steps N, --ckpt-interval N, --keep N, --eval-interval N, --crash-step N, --scratch DIR (must not
# exist or be empty; default a new /tmp/txl-soak.XXXXXX, kept afterwards), --no-tracking (tracking.enabled=false;
# default: MLflow on, the run folder's local sqlite store), --interval S (sampling, default 0.5),
# --rss-bound MIB (per 1000 steps, default 5), --fd-bound N (per 1000 steps, default 1), --deadline S (per
# job, default 3600: a hung job is killed), --record FILE.
# The two ranks are plain processes (RANK/WORLD_SIZE/MASTER_* as srun or torchrun would set them) so that the
# sampler follows the training processes themselves, and the fault can be injected into one of them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

STEPS=2000 INTERVAL=100 KEEP=3 EVAL=500 CRASH="" SCRATCH="" TRACKING=1 SAMPLE_S=0.5 RSS_BOUND=5 FD_BOUND=1
DEADLINE=3600 RECORD=""
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) STEPS="$2"; shift 2 ;;
        --ckpt-interval) INTERVAL="$2"; shift 2 ;;
        --keep) KEEP="$2"; shift 2 ;;
        --eval-interval) EVAL="$2"; shift 2 ;;
        --crash-step) CRASH="$2"; shift 2 ;;
        --scratch) SCRATCH="$2"; shift 2 ;;
        --no-tracking) TRACKING=0; shift ;;
        --interval) SAMPLE_S="$2"; shift 2 ;;
        --rss-bound) RSS_BOUND="$2"; shift 2 ;;
        --fd-bound) FD_BOUND="$2"; shift 2 ;;
        --deadline) DEADLINE="$2"; shift 2 ;;
        --record) RECORD="$2"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "soak.sh: unknown option $1" >&2; usage ;;
    esac
done
if [ -z "$CRASH" ]; then
    CRASH=$(( STEPS / 2 / INTERVAL * INTERVAL + INTERVAL / 2 ))
fi
if [ "$CRASH" -le 1 ] || [ "$CRASH" -ge "$STEPS" ] || [ "$INTERVAL" -ge "$CRASH" ]; then
    echo "soak.sh: --crash-step $CRASH must lie after the first checkpoint ($INTERVAL) and before the end ($STEPS)" >&2
    exit 2
fi

bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export DS_ACCELERATOR=cpu HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT OMP_NUM_THREADS MLFLOW_TRACKING_URI
PY="$ROOT/.venv/bin/python"
DATA=data/shakespeare
bash scripts/shakespeare_corpus.sh 2

if [ -z "$SCRATCH" ]; then
    SCRATCH="$(mktemp -d /tmp/txl-soak.XXXXXX)"
elif [ -e "$SCRATCH" ] && [ -n "$(ls -A "$SCRATCH")" ]; then
    echo "soak.sh: --scratch $SCRATCH is not empty; choose a new folder" >&2
    exit 2
fi
mkdir -p "$SCRATCH"
SCRATCH="$(cd "$SCRATCH" && pwd)"
RUN="$SCRATCH/run"
TRACK_DESC="the run folder's local sqlite store (sqlite:///$RUN/mlflow.db)"
TRAIN_ARGS=(--config configs/tiny.json --set data.path="$DATA" --set run.dir="$RUN"
            --set train.max_steps="$STEPS" --set train.log_interval=1
            --set checkpoint.interval="$INTERVAL" --set checkpoint.keep="$KEEP" --set eval.interval="$EVAL")
if [ "$TRACKING" = 0 ]; then
    TRAIN_ARGS+=(--set tracking.enabled=false)
    TRACK_DESC="off (tracking.enabled=false)"
fi
echo "[soak] $STEPS steps, checkpoint every $INTERVAL (keep $KEEP), eval every $EVAL, crash of rank 1 in step $CRASH"
echo "[soak] scratch folder $SCRATCH (run folder $RUN); MLflow: $TRACK_DESC"

now() { date +%s.%N; }

# job SEGMENT [fault args...]: start both ranks and the sampler, wait for all of them, write seg<k>.rc.
job() {
    local seg="$1"; shift
    local port pids=() rcs=() start end r
    port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    start="$(now)"
    for r in 0 1; do
        RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
            OMP_NUM_THREADS=1 "$PY" tests/fault_job.py "$@" -- "${TRAIN_ARGS[@]}" --resume auto \
            > "$SCRATCH/seg$seg-rank$r.out" 2>&1 &
        pids+=($!)
    done
    "$PY" bench/soak_report.py sample --segment "$seg" --pid "0:${pids[0]}" --pid "1:${pids[1]}" \
        --run-dir "$RUN" --out "$SCRATCH/samples.jsonl" --interval "$SAMPLE_S" --deadline "$DEADLINE" &
    local sampler=$!
    for r in 0 1; do
        rcs[$r]=0
        wait "${pids[$r]}" || rcs[$r]=$?
    done
    end="$(now)"
    wait "$sampler" || echo "[soak] the sampler of job $seg failed" >&2
    printf '{"0": %s, "1": %s, "wall_s": %s}\n' "${rcs[0]}" "${rcs[1]}" \
        "$("$PY" -c "print(round($end - $start, 2))")" > "$SCRATCH/seg$seg.rc"
    echo "[soak] job $seg ended: exit status rank 0 ${rcs[0]}, rank 1 ${rcs[1]} ($(cat "$SCRATCH/seg$seg.rc"))"
}

T0="$(now)"
echo "[soak] job 1: training from scratch, rank 1 killed in step $CRASH"
job 1 --fault "kill-at-step:1:$CRASH"
"$PY" bench/soak_report.py inventory "$RUN" > "$SCRATCH/after-crash.json"
echo "[soak] checkpoints after the crash: $(cat "$SCRATCH/after-crash.json")"
echo "[soak] job 2: --resume auto"
job 2
TOTAL="$("$PY" -c "print(round($(now) - $T0, 2))")"

echo
set +e
"$PY" bench/soak_report.py report --scratch "$SCRATCH" --run-dir "$RUN" --steps "$STEPS" --crash-step "$CRASH" \
    --ckpt-interval "$INTERVAL" --keep "$KEEP" --eval-interval "$EVAL" --tracking "$TRACK_DESC" \
    --interval "$SAMPLE_S" --rss-bound "$RSS_BOUND" --fd-bound "$FD_BOUND" --total-wall "$TOTAL" \
    | tee "$SCRATCH/report.txt"
STATUS=${PIPESTATUS[0]}
set -e
if [ -n "$RECORD" ]; then
    mkdir -p "$(dirname "$RECORD")"
    {
        echo "# bench/soak.sh $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')," \
             "$(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
        echo "# bash bench/soak.sh --steps $STEPS --ckpt-interval $INTERVAL --keep $KEEP --eval-interval $EVAL" \
             "--crash-step $CRASH$([ "$TRACKING" = 0 ] && echo ' --no-tracking')"
        echo
        cat "$SCRATCH/report.txt"
        echo
        echo "exit status $STATUS"
    } > "$RECORD"
    echo "[soak] result written to $RECORD"
fi
exit "$STATUS"
