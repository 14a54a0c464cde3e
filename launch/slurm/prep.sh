#!/usr/bin/env bash
# Prepare a corpus on a Slurm cluster: submits up to four jobs of launch/slurm/prep.sbatch and returns.
#
#   bash launch/slurm/prep.sh --shards N --out CORPUS [--world-size W --n-streams S [--eval-streams E]]
#       [--tokenizer-model TOK.model] [--parts DIR] [--logs DIR] [--cpus-per-task C] [--sbatch OPTION ...]
#       [--overwrite] [--no-space-check] INPUTS AND TOKENIZER OPTIONS (as for `python -m data_prep prepare`)
#
# 1. train-tokenizer (only when no --tokenizer-model is given): one job, writes PARTS/tokenizer.model;
# 2. prepare --plan: one job, beside 1, reads every input once into PARTS/plan.json (sizes, checksums,
#    document counts, seek points), so that no task of 3 reads all inputs;
# 3. prepare --shard i/N: an array job of N tasks (--dependency=afterok on 1 and 2), writes
#    PARTS/shard-i-of-N, each task reading only its own documents;
# 4. finalize PARTS --out CORPUS: one job that starts when every task of 3 has succeeded
#    (--dependency=afterok:<array job>); the corpus is laid out for the run's --world-size/--n-streams.
# The token streams are those a single `prepare` with the same inputs and tokenizer writes.
# PARTS defaults to CORPUS.parts (remove it once the corpus is verified). Job logs go to --logs (default: the
# current folder). Jobs that depend on a failed one are cancelled (--kill-on-invalid-dep=yes).
# Every option is checked by data_prep's own parser before anything is submitted (exit 2 on a bad one).
# --sbatch passes one option to every sbatch call (repeatable), e.g. --sbatch --partition=cpu; sbatch's
# own environment variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, ...) work too.
# Prints one line per job: "txl-prep: <what> job <id> ..."; the last one is the finalize job.
# Exit status: 0 all four jobs queued; 2 refused (an option, or jobs the cluster refuses before any is
# submitted: sbatch --test-only, e.g. --shards above MaxArraySize, --cpus-per-task more than a node has);
# 1 a submission that failed all the same (sbatch's error is named; the jobs submitted before it are cancelled).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

die() { echo "txl-prep: error: $*" >&2; exit 2; }
need() { if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }

SHARDS="" OUT="" PARTS="" TOK="" LOGS="." CPUS=""
LAYOUT=() OVERWRITE=() NO_SPACE_CHECK=() SBATCH_OPTS=() PASS=() PREPARE_ONLY=()
while [ $# -gt 0 ]; do
    case "$1" in
        --shards) need "$@"; SHARDS="$2"; shift 2 ;;
        --shards=*) SHARDS="${1#*=}"; shift ;;
        --out) need "$@"; OUT="$2"; shift 2 ;;
        --out=*) OUT="${1#*=}"; shift ;;
        --parts) need "$@"; PARTS="$2"; shift 2 ;;
        --parts=*) PARTS="${1#*=}"; shift ;;
        --tokenizer-model) need "$@"; TOK="$2"; shift 2 ;;
        --tokenizer-model=*) TOK="${1#*=}"; shift ;;
        --logs) need "$@"; LOGS="$2"; shift 2 ;;
        --logs=*) LOGS="${1#*=}"; shift ;;
        --cpus-per-task) need "$@"; CPUS="$2"; shift 2 ;;
        --cpus-per-task=*) CPUS="${1#*=}"; shift ;;
        --sbatch) need "$@"; SBATCH_OPTS+=("$2"); shift 2 ;;
        --sbatch=*) SBATCH_OPTS+=("${1#*=}"); shift ;;
        --world-size | --n-streams | --eval-streams) need "$@"; LAYOUT+=("$1" "$2"); shift 2 ;;
        --world-size=* | --n-streams=* | --eval-streams=*) LAYOUT+=("$1"); shift ;;
        --overwrite) OVERWRITE=(--overwrite); shift ;;
        --no-space-check) NO_SPACE_CHECK=(--no-space-check); shift ;;  # prepare's and finalize's, not the tokenizer's
        --eod-piece | --work-dir) need "$@"; PREPARE_ONLY+=("$1" "$2"); shift 2 ;;
        --eod-piece=* | --work-dir=*) PREPARE_ONLY+=("$1"); shift ;;
        --shard | --shard=*) die "--shard is set per array task; give --shards N" ;;
        -h | --help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) PASS+=("$1"); shift ;;
    esac
done
case "$SHARDS" in '' | *[!0-9]* | 0) die "--shards N (N >= 1 tasks in the array) is required" ;; esac
[ -n "$OUT" ] || die "--out CORPUS is required"
[ -z "$CPUS" ] || case "$CPUS" in *[!0-9]* | 0) die "--cpus-per-task must be a positive integer" ;; esac
command -v sbatch >/dev/null 2>&1 || die "sbatch not found: run this on a Slurm login node"
PARTS="${PARTS:-${OUT%/}.parts}"
OWN_TOKENIZER=0
if [ -z "$TOK" ]; then
    TOK="$PARTS/tokenizer.model"
    OWN_TOKENIZER=1
fi

PY="${TXL_PYTHON:-}"
[ -n "$PY" ] || { [ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"; } || PY="$(command -v python3)"
# The arguments each job will run with, checked now by data_prep's parser (not after hours in the queue).
TOKENIZER_ARGS=(--out "$TOK" "${PASS[@]}" "${OVERWRITE[@]}")
PREPARE_ARGS=(--out "$PARTS" --tokenizer-model "$TOK" "${PASS[@]}" "${PREPARE_ONLY[@]}" "${OVERWRITE[@]}"
    "${NO_SPACE_CHECK[@]}")
FINALIZE_ARGS=("$PARTS" --out "$OUT" "${LAYOUT[@]}" "${OVERWRITE[@]}" "${NO_SPACE_CHECK[@]}")
check() {
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$@" <<'EOF' || exit 2
import sys
from data_prep.cli import build_parser
build_parser().parse_args(sys.argv[1:])
EOF
}
[ "$OWN_TOKENIZER" = 0 ] || check train-tokenizer "${TOKENIZER_ARGS[@]}"
check prepare "${PREPARE_ARGS[@]}" --plan
check prepare "${PREPARE_ARGS[@]}" --shard "0/$SHARDS"
check finalize "${FINALIZE_ARGS[@]}"
if [ "$OWN_TOKENIZER" = 0 ] && [ ! -f "$TOK" ]; then
    die "--tokenizer-model $TOK: no such file"
fi

mkdir -p "$LOGS"
LOGS="$(cd "$LOGS" && pwd)"
# The jobs run this repository's scripts (prep.sbatch would find it too; this way a copy of it elsewhere cannot).
export TXL_REPO="$REPO"
SBATCH=(sbatch --parsable --kill-on-invalid-dep=yes "${SBATCH_OPTS[@]}")
CPU_OPTS=()
[ -z "$CPUS" ] || CPU_OPTS=(--cpus-per-task="$CPUS")
SCRIPT="$HERE/prep.sbatch"

# The widest request (the array, with the CPUs and --sbatch options) asked of the cluster without submitting
# anything: what it refuses (too many shards, CPUs no node has, a bad partition) stops here, nothing queued.
preflight() {
    local err
    if ! err="$("${SBATCH[@]}" --test-only "${CPU_OPTS[@]}" --array="0-$((SHARDS - 1))" "$SCRIPT" prepare 2>&1 >/dev/null)"; then
        die "the cluster refuses these jobs (--shards $SHARDS${CPUS:+, --cpus-per-task $CPUS}${SBATCH_OPTS[*]:+, --sbatch ${SBATCH_OPTS[*]}}): $(grep . <<<"$err" | tail -n 1)"
    fi
}

SUBMITTED=()
# sbatch WHAT ARGS...: sets JOB to the new job's id. A submission that fails cancels the jobs submitted before
# it (a chain missing a link would wait, or fail, hours later) and ends this script with sbatch's own error.
submit() {
    local what="$1" out err rc=0
    shift
    err="$(mktemp)"
    out="$("${SBATCH[@]}" "$@" 2>"$err")" || rc=$?
    JOB="${out%%;*}"  # --parsable prints "id" or "id;cluster"
    if [ "$rc" -ne 0 ] || [ -z "$JOB" ] || [ -n "${JOB//[0-9]/}" ]; then
        local why
        why="$(grep . "$err" | tail -n 1)"
        rm -f "$err"
        [ ${#SUBMITTED[@]} -eq 0 ] || scancel "${SUBMITTED[@]}" 2>/dev/null || true
        echo "txl-prep: error: sbatch failed for the $what job (status $rc): ${why:-no job id in its output '$out'}${SUBMITTED[*]:+; cancelled job(s) ${SUBMITTED[*]} submitted before it}" >&2
        exit 1
    fi
    rm -f "$err"
    SUBMITTED+=("$JOB")
}

preflight
mkdir -p "$PARTS"
AFTER=""
if [ "$OWN_TOKENIZER" = 1 ]; then
    submit tokenizer "${CPU_OPTS[@]}" --job-name=txl-prep-tokenizer --output="$LOGS/%x-%j.out" \
        "$SCRIPT" train-tokenizer "${TOKENIZER_ARGS[@]}"
    tok_job="$JOB"
    echo "txl-prep: tokenizer job $tok_job: train-tokenizer -> $TOK"
    AFTER=":$tok_job"
fi
# The plan job gets the tasks' own arguments (it reads only the inputs and how to read them; the tokenizer it
# names may not exist yet) and runs beside the tokenizer job: both read every input, neither needs the other.
submit plan "${CPU_OPTS[@]}" --job-name=txl-prep-plan --output="$LOGS/%x-%j.out" \
    "$SCRIPT" prepare "${PREPARE_ARGS[@]}" --plan
plan_job="$JOB"
echo "txl-prep: plan job $plan_job: prepare --plan -> $PARTS/plan.json"
submit array "${CPU_OPTS[@]}" --dependency="afterok:$plan_job$AFTER" --job-name=txl-prep-shard \
    --array="0-$((SHARDS - 1))" --output="$LOGS/%x-%A_%a.out" "$SCRIPT" prepare "${PREPARE_ARGS[@]}"
array_job="$JOB"
echo "txl-prep: array job $array_job ($SHARDS task(s), after job(s) ${plan_job}${AFTER//:/ }):" \
    "prepare --shard i/$SHARDS -> $PARTS"
submit finalize --dependency="afterok:$array_job" --job-name=txl-prep-finalize --output="$LOGS/%x-%j.out" \
    "$SCRIPT" finalize "${FINALIZE_ARGS[@]}"
final_job="$JOB"
echo "txl-prep: finalize job $final_job (after every task of $array_job succeeds): finalize -> $OUT"
