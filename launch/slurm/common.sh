# Shared by launch/slurm/*.sbatch (sourced, not run): the job's layout (nodes, ranks per node, rendezvous),
# the Python to run, and one srun step that survives signals sent to the batch shell. See docs/slurm.md.
#
# Environment read (all optional; sbatch passes the submitting shell's environment to the job):
#   TXL_PYTHON        the interpreter (default: <repo>/.venv/bin/python if present, else python3 on PATH)
#   TXL_MASTER_ADDR   rendezvous address (default: the NodeAddr of the allocation's first node)
#   TXL_MASTER_PORT   rendezvous port (default: 20000 + SLURM_JOB_ID % 12000, as txl_dist.distributed.slurm_port)
#   TXL_SRUN_OPTS     more srun options for the step, split at spaces (e.g. the site's --mpi=none or --network=...)
#   OMP_NUM_THREADS   threads per rank (default: SLURM_CPUS_PER_TASK, else the node's allocated CPUs / ranks per node)

# shellcheck disable=SC2034  # the variables set here are read by the scripts that source this file
true

txl_say() { echo "txl-slurm: $*"; }
txl_die() { echo "txl-slurm: error: $*" >&2; exit "${2:-2}"; }

# The interpreter that has txl_dist installed (PY), checked before anything runs on it: one line naming it and
# the fix, not a traceback from deep inside the first import. Arguments: packages the script's programs import.
txl_python() {
    if [ -n "${TXL_PYTHON:-}" ]; then
        PY="$TXL_PYTHON"
    elif [ -x "$REPO/.venv/bin/python" ]; then
        PY="$REPO/.venv/bin/python"
    else
        PY="$(command -v python3 || command -v python || true)"
    fi
    local fix="set TXL_PYTHON to the interpreter of your txl-dist environment, or run scripts/bootstrap.sh (it makes $REPO/.venv)"
    if [ -z "$PY" ] || ! command -v "$PY" >/dev/null 2>&1; then
        txl_die "no Python found${PY:+ ($PY)}; $fix"
    fi
    local missing
    # find_spec looks the packages up without importing them (torch and deepspeed take seconds to import).
    missing="$("$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@" 2>&1)" \
        || txl_die "python $PY does not run ($(tail -n 1 <<<"$missing")); $fix"
    [ -z "$missing" ] || txl_die "python $PY has no $missing (not a txl-dist environment); $fix"
}

# A count from the environment (TXL_MAX_RESTARTS, TXL_END_WAIT_S), checked when the job starts: anything but a
# whole number is refused in one line, where train.sbatch's `[ -ge ]` would print a bash error at the end of the
# run and requeue regardless of the cap, and srun would refuse --wait=VALUE as if the step had failed.
# Arguments: the variable's name, what it counts.
txl_whole_number() {
    case "${!1:-}" in
        *[!0-9]*) txl_die "$1=${!1} is not a whole number ($2); correct or unset it" ;;
    esac
}

# A positive integer from a Slurm count such as "4", "gpu:4", "a100:4" or "4(x2)" (the first node's).
txl_count() {
    local v="${1%%(*}"
    v="${v##*:}"
    case "$v" in '' | *[!0-9]*) echo 0 ;; *) echo "$v" ;; esac
}

# NNODES, TASKS_PER_NODE, WORLD, GPUS_PER_NODE, SRUN_LAYOUT (srun options), MASTER_ADDR, MASTER_PORT, threads.
txl_layout() {
    [ -n "${SLURM_JOB_ID:-}" ] || txl_die "not inside a Slurm job: submit this script with sbatch (see docs/slurm.md)"
    NNODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
    GPUS_PER_NODE="$(txl_count "${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}")"
    if [ "$GPUS_PER_NODE" -eq 0 ] && [ -n "${SLURM_JOB_GPUS:-}" ]; then
        GPUS_PER_NODE="$(tr ',' '\n' <<<"$SLURM_JOB_GPUS" | grep -c .)"
    fi
    SRUN_LAYOUT=(--nodes="$NNODES")
    if [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then  # the submitter chose it
        TASKS_PER_NODE="$(txl_count "$SLURM_NTASKS_PER_NODE")"
    elif [ -n "${SLURM_NTASKS:-}" ] && [ "${SLURM_NTASKS}" != "$NNODES" ]; then
        # --ntasks without --ntasks-per-node: srun spreads them as Slurm allocated them.
        case "${SLURM_TASKS_PER_NODE:-}" in
            *,*) TASKS_PER_NODE=0 ;;  # uneven
            *) TASKS_PER_NODE="$(txl_count "${SLURM_TASKS_PER_NODE:-1}")" ;;
        esac
        if [ "$TASKS_PER_NODE" -eq 0 ] || [ $((TASKS_PER_NODE * NNODES)) -ne "$SLURM_NTASKS" ]; then
            txl_die "--ntasks=$SLURM_NTASKS does not spread evenly over $NNODES node(s) (${SLURM_TASKS_PER_NODE:-?}); submit with --ntasks-per-node"
        fi
    elif [ "$GPUS_PER_NODE" -gt 0 ]; then  # one rank per GPU
        TASKS_PER_NODE="$GPUS_PER_NODE"
    else  # one rank per node
        TASKS_PER_NODE=1
    fi
    [ "$TASKS_PER_NODE" -gt 0 ] || txl_die "cannot tell how many ranks to run per node (SLURM_NTASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-})"
    [ "$GPUS_PER_NODE" -eq 0 ] || txl_no_gpu_per_task
    WORLD=$((NNODES * TASKS_PER_NODE))
    # block:block: consecutive ranks on consecutive CPUs of one socket, as GPUs are numbered (cuda:<local rank>
    # near its CPUs on the usual nodes); Slurm's default spreads consecutive tasks over the sockets.
    SRUN_LAYOUT+=(--ntasks="$WORLD" --ntasks-per-node="$TASKS_PER_NODE" --distribution=block:block)
    local cpus_on_node
    cpus_on_node="$(txl_count "${SLURM_CPUS_ON_NODE:-${SLURM_JOB_CPUS_PER_NODE:-0}}")"
    # srun (Slurm 22.05+) no longer takes --cpus-per-task from the batch job's environment: pass it on.
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
        if [ "$cpus_on_node" -gt 0 ] && [ $((TASKS_PER_NODE * SLURM_CPUS_PER_TASK)) -gt "$cpus_on_node" ]; then
            # --cpus-per-task without --ntasks-per-node allocates CPUs for one task per node; srun would refuse
            # the step ("More processors requested than permitted"), which would read as a fault.
            txl_die "$TASKS_PER_NODE ranks per node of --cpus-per-task=$SLURM_CPUS_PER_TASK need $((TASKS_PER_NODE * SLURM_CPUS_PER_TASK)) CPUs per node; the job has $cpus_on_node: submit with --ntasks-per-node=$TASKS_PER_NODE (and --cpus-per-task=$SLURM_CPUS_PER_TASK)"
        fi
        SRUN_LAYOUT+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    fi
    if [ -z "${SLURM_CPUS_PER_TASK:-}" ] && [ "$cpus_on_node" -gt 0 ] && [ "$cpus_on_node" -lt "$TASKS_PER_NODE" ]; then
        txl_say "warning: $cpus_on_node CPU(s) per node allocated for $TASKS_PER_NODE ranks per node; submit with --ntasks-per-node=$TASKS_PER_NODE (and --cpus-per-task) to give each rank its own CPUs"
        SRUN_LAYOUT+=(--overcommit)
    fi
    if [ -z "${OMP_NUM_THREADS:-}" ]; then
        if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
            OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK"
        elif [ "$cpus_on_node" -gt 0 ]; then
            OMP_NUM_THREADS=$((cpus_on_node / TASKS_PER_NODE))
            [ "$OMP_NUM_THREADS" -ge 1 ] || OMP_NUM_THREADS=1
        fi
    fi
    [ -z "${OMP_NUM_THREADS:-}" ] || export OMP_NUM_THREADS

    NODE_LIST="$(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" 2>/dev/null | tr '\n' ' ')"
    NODE_LIST="${NODE_LIST% }"
    local first="${NODE_LIST%% *}"
    if [ -n "${TXL_MASTER_ADDR:-}" ]; then
        MASTER_ADDR="$TXL_MASTER_ADDR"
    else
        # The address Slurm itself reaches the first node at (its NodeAddr; the node name where none is set).
        MASTER_ADDR="$(scontrol show node -o "$first" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)"
        MASTER_ADDR="${MASTER_ADDR:-$first}"
    fi
    [ -n "$MASTER_ADDR" ] || txl_die "cannot tell the allocation's first node (SLURM_JOB_NODELIST is empty); set TXL_MASTER_ADDR"
    MASTER_PORT="${TXL_MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 12000))}"  # below the ephemeral ports
    export MASTER_ADDR MASTER_PORT
    # Ranks come from srun's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID: a launcher's variables inherited from
    # the submitting shell would take precedence in txl_dist.distributed.discover().
    unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE LOCAL_SIZE TORCHELASTIC_USE_AGENT_STORE
    export PYTHONUNBUFFERED=1
    if [ -n "${TXL_SRUN_OPTS:-}" ]; then
        local extra
        read -r -a extra <<<"$TXL_SRUN_OPTS"
        SRUN_LAYOUT+=("${extra[@]}")
    fi
}

# Every rank of a node must see all of its GPUs (its device is cuda:<local rank>; txl_dist.distributed
# refuses otherwise once the ranks have started): a per-task GPU binding is refused here, before srun.
txl_no_gpu_per_task() {
    local set=""
    if [ -n "${SLURM_GPUS_PER_TASK:-}" ]; then
        set="--gpus-per-task (SLURM_GPUS_PER_TASK=$SLURM_GPUS_PER_TASK)"
    elif [ -n "${SLURM_NTASKS_PER_GPU:-}" ]; then
        set="--ntasks-per-gpu (SLURM_NTASKS_PER_GPU=$SLURM_NTASKS_PER_GPU)"
    elif [[ "${SLURM_TRES_PER_TASK:-}" == *gpu* ]]; then
        set="a GPU request per task (SLURM_TRES_PER_TASK=$SLURM_TRES_PER_TASK)"
    elif [ -n "${SLURM_GPU_BIND:-}" ] && [[ "$SLURM_GPU_BIND" != *none* ]]; then
        set="a GPU binding (SLURM_GPU_BIND=$SLURM_GPU_BIND, from --gpu-bind or the environment)"
    fi
    [ -z "$set" ] || txl_die "$set gives each rank only its own GPU(s), but every rank must see all of its node's GPUs (its device is cuda:<local rank>); submit with --gpus-per-node=G --ntasks-per-node=G and no per-task GPU option (unset SLURM_GPU_BIND, or set it to none)"
}

txl_print_layout() {
    local what="no GPU"
    [ "$GPUS_PER_NODE" -gt 0 ] && what="$GPUS_PER_NODE GPU(s) per node"
    txl_say "job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) restart ${SLURM_RESTART_COUNT:-0} on $NNODES node(s): $NODE_LIST"
    txl_say "world size $WORLD ($TASKS_PER_NODE rank(s) per node, $what, OMP_NUM_THREADS=${OMP_NUM_THREADS:-auto}) | rendezvous $MASTER_ADDR:$MASTER_PORT"
}

# SIGUSR1 for the whole of train.sbatch, not only while its step runs: Slurm sends it to the batch shell
# whenever it comes (`scancel --batch --signal=USR1`, a header's --signal=B:USR1@...), and bash's default for
# it is to die (the job ends FAILED, ExitCode 0:10, not requeued, whatever the ranks saved). Before the step a
# USR1 is kept and handed to the ranks as they start (txl_step: they save after their first step); during the
# step it is passed on; after the step it changes nothing (what the ranks saved decides). The .sbatch script
# sets `trap 'TXL_USR1_PENDING=1' USR1` on its first line, before this file is found; this takes over.
txl_keep_usr1() {
    TXL_STEP_STATE=before
    trap txl_on_usr1 USR1
    [ -z "${TXL_USR1_PENDING:-}" ] || txl_say "the batch shell got SIGUSR1 during start-up: the ranks will save after their first step"
}

txl_on_usr1() {
    BATCH_SIGNAL=USR1
    case "${TXL_STEP_STATE:-before}" in
        running)
            txl_say "the batch shell got SIGUSR1: passing it on to the ranks"
            kill -USR1 "$TXL_STEP_PID" 2>/dev/null || true
            ;;
        done) txl_say "the batch shell got SIGUSR1 after the training step ended: nothing left to stop" ;;
        *)
            TXL_USR1_PENDING=1
            txl_say "the batch shell got SIGUSR1 before the training step started: the ranks will save after their first step"
            ;;
    esac
}

# Run one srun step in the background and wait for it, whatever signals reach the batch shell:
#   USR1 (scancel --batch/--full --signal=USR1, or a header changed to --signal=B:USR1@...) is passed on to the
#     step, whose ranks then save at the next step boundary and exit 0; one kept from before the step
#     (txl_keep_usr1) reaches the ranks as TXL_STOP_SIGNAL=USR1 (txl_dist/stop_request.py), read as they start;
#   TERM (the time limit, a plain scancel, preemption) is noted and not passed on: srun turns a SIGTERM it
#     receives into SIGKILL for its tasks, and the tasks receive Slurm's SIGTERM themselves anyway.
# Sets STEP_RC (srun's exit status) and BATCH_SIGNAL (the last signal the batch shell got, or '').
txl_step() {
    BATCH_SIGNAL=""
    local pending="${TXL_USR1_PENDING:-}" stop=()
    if [ -n "$pending" ]; then
        BATCH_SIGNAL=USR1
        stop=(env TXL_STOP_SIGNAL=USR1)
    fi
    trap txl_on_usr1 USR1
    trap 'BATCH_SIGNAL=TERM; txl_say "the batch shell got SIGTERM (time limit, scancel or preemption): waiting for the ranks"' TERM
    "${stop[@]}" srun "$@" &
    TXL_STEP_PID=$!
    TXL_STEP_STATE=running
    # One that came while srun was being started was only noted (the ranks did not have it in their environment).
    if [ -z "$pending" ] && [ -n "${TXL_USR1_PENDING:-}" ]; then
        kill -USR1 "$TXL_STEP_PID" 2>/dev/null || true
    fi
    while kill -0 "$TXL_STEP_PID" 2>/dev/null; do
        wait "$TXL_STEP_PID" 2>/dev/null || true  # returns early when a trapped signal arrives
    done
    STEP_RC=0
    wait "$TXL_STEP_PID" || STEP_RC=$?
    TXL_STEP_STATE=done
    trap - TERM
}
