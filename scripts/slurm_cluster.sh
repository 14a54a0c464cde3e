#!/usr/bin/env bash
# A real 2-node Slurm cluster on this machine, for the tests of launch/slurm/ (tests/test_slurm.py) and for
# trying the batch scripts by hand: Slurm's own daemons (Debian packages slurmctld, slurmd, slurm-client,
# munge) with two slurmd processes, node1 and node2, on 127.0.0.1, each with its own port, spool and log.
#
#   bash scripts/slurm_cluster.sh start    # install (as root, when missing), configure, start; waits for 2 idle nodes
#   bash scripts/slurm_cluster.sh status   # the daemons and `sinfo`; exit 0 when the cluster answers
#   bash scripts/slurm_cluster.sh env      # prints `export SLURM_CONF=...`: eval "$(bash scripts/slurm_cluster.sh env)"
#   bash scripts/slurm_cluster.sh stop     # cancel the cluster's jobs, stop the daemons (by their pid files)
#
# Everything lives in one folder the script owns, $TXL_SLURM_DIR (default /tmp/txl-dist-slurm): slurm.conf,
# a munge key and socket of its own, controller state, per-node spool folders, logs and pid files. Nothing
# under /etc is changed and no system daemon is touched (the system's munged, if any, keeps running). Each
# `start` begins with an empty controller state (job ids restart at 1) unless the cluster is already up.
# Ports: $TXL_SLURM_PORT (default 17000) for slurmctld, +1 and +2 for the two slurmd. Job ids start at
# $TXL_SLURM_FIRST_JOB_ID (default 1). Several clusters can run side by side with distinct folders and ports.
#
# Exit status: 0 done; 3 the cluster cannot be had on this machine (not root, or Slurm is missing and cannot
# be installed: no apt-get), with one line saying why; 1 anything else (the daemons' log tails are printed).
# The test machine facts behind the settings are in docs/slurm.md ("The test cluster").
set -euo pipefail

DIR="${TXL_SLURM_DIR:-/tmp/txl-dist-slurm}"
PORT="${TXL_SLURM_PORT:-17000}"
NODES=(node1 node2)
CONF="$DIR/slurm.conf"
EXIT_UNAVAILABLE=3
# How long a requeued job waits before it may start again is AuthInfo's cred_expire (default 120 s); the test
# cluster shortens it so that a preemption test does not sit two minutes in Reason=BeginTime.
CRED_EXPIRE="${TXL_SLURM_CRED_EXPIRE:-10}"
# The first job id (the training rendezvous port is 20000 + job id % 12000: two clusters on one machine should
# not count from the same number).
FIRST_JOB_ID="${TXL_SLURM_FIRST_JOB_ID:-1}"

say() { echo "slurm_cluster: $*"; }
unavailable() { echo "slurm_cluster: unavailable: $*"; exit "$EXIT_UNAVAILABLE"; }

log_tails() {
    local f
    for f in "$DIR"/log/*.log; do
        [ -f "$f" ] || continue
        echo "----- $f (last 15 lines)"
        tail -n 15 "$f"
    done
}

fail() {
    echo "slurm_cluster: error: $*" >&2
    log_tails >&2
    exit 1
}

# A pid file's process, when it is alive and is the program named (pids are reused).
pid_of() {
    local file="$1" prog="$2" pid
    [ -f "$file" ] || return 1
    pid="$(tr -dc '0-9' <"$file")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$prog" || return 1
    echo "$pid"
}

install_packages() {
    local missing=()
    command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing+=(munge)
    command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
    command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || missing+=(slurmd)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
    [ ${#missing[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || unavailable "Slurm packages missing (${missing[*]}) and not root to install them"
    command -v apt-get >/dev/null 2>&1 || unavailable "Slurm packages missing (${missing[*]}) and no apt-get"
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! compgen -G "/var/lib/apt/lists/*_Packages" >/dev/null; then
        apt-get update -q >/dev/null || fail "apt-get update failed"
    fi
    # The packages' own post-install starts munge/slurm services only where systemd runs; nothing here needs it.
    apt-get install -y -q --no-install-recommends munge slurmctld slurmd slurm-client >/dev/null \
        || fail "apt-get install munge slurmctld slurmd slurm-client failed"
}

write_config() {
    local host
    host="$(hostname -s)"
    mkdir -p "$DIR"/{state,log,run,munge} "${NODES[@]/#/$DIR/spool/}"
    chmod 0755 "$DIR" "$DIR/spool" "${NODES[@]/#/$DIR/spool/}"
    chmod 0711 "$DIR/munge"  # munged wants its socket folder searchable; the key is 0600
    if [ ! -s "$DIR/munge/munge.key" ]; then
        (umask 077 && dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none)
    fi
    cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: a 2-node test cluster on 127.0.0.1 (see docs/slurm.md).
ClusterName=txltest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a container: processes are tracked by parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/builtin
# The main scheduling pass every 2 s (default 60 s): a requeued job starts as soon as its BeginTime passes.
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Finished jobs stay visible to scontrol for an hour (the tests read their state and restart count).
MinJobAge=3600
FirstJobId=$FIRST_JOB_ID
KillWait=30
InactiveLimit=0
Waittime=0
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1))-$((PORT + 2)) CPUs=1 State=UNKNOWN
# Preemption: a job of partition urgent (same nodes, higher PriorityTier) requeues the debug jobs it needs the
# nodes of, and cancels the graceful jobs after a grace time (their ranks get SIGTERM at its start). Jobs in one
# partition never preempt each other: nothing else submits to urgent.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=graceful Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
}

start_munge() {
    if pid_of "$DIR/run/munged.pid" munged >/dev/null; then return 0; fi
    rm -f "$DIR/munge/munge.socket" "$DIR/munge/munge.socket.lock"
    local munged
    munged="$(command -v munged || echo /usr/sbin/munged)"
    "$munged" --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
        >>"$DIR/log/munged.log" 2>&1 || fail "munged did not start"
}

cluster_answers() {
    SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null
}

wait_idle() {
    local deadline=$((SECONDS + ${1:-60})) state
    while [ $SECONDS -lt $deadline ]; do
        state="$(cluster_answers || true)"
        # One line per node and partition (debug, graceful, urgent): each node counted once.
        if [ "$(grep -E '^node[12] (idle|alloc|mix)' <<<"$state" | sort -u | wc -l)" -eq 2 ]; then
            return 0
        fi
        sleep 0.5
    done
    fail "the nodes did not come up within ${1:-60} s; sinfo says: ${state:-nothing}"
}

running() {
    pid_of "$DIR/run/munged.pid" munged >/dev/null \
        && pid_of "$DIR/run/slurmctld.pid" slurmctld >/dev/null \
        && pid_of "$DIR/run/slurmd-node1.pid" slurmd >/dev/null \
        && pid_of "$DIR/run/slurmd-node2.pid" slurmd >/dev/null
}

start() {
    [ "$(id -u)" -eq 0 ] || unavailable "the test cluster's daemons run as root (munged, slurmctld, slurmd); not root"
    install_packages
    if running && cluster_answers >/dev/null; then
        say "already running (SLURM_CONF=$CONF)"
        wait_idle 30
        return 0
    fi
    stop quiet
    rm -rf "$DIR/state" "$DIR/spool" "$DIR/log"
    write_config
    start_munge
    local slurmctld slurmd node
    slurmctld="$(command -v slurmctld || echo /usr/sbin/slurmctld)"
    slurmd="$(command -v slurmd || echo /usr/sbin/slurmd)"
    # -i: ignore state files that do not exist yet (a fresh StateSaveLocation).
    "$slurmctld" -f "$CONF" -i >>"$DIR/log/slurmctld.log" 2>&1 || fail "slurmctld did not start"
    for node in "${NODES[@]}"; do
        "$slurmd" -f "$CONF" -N "$node" >>"$DIR/log/slurmd-$node.log" 2>&1 || fail "slurmd -N $node did not start"
    done
    wait_idle 60
    say "started: 2 nodes on 127.0.0.1 (slurmctld port $PORT); SLURM_CONF=$CONF"
}

# Cancel every job of this cluster and wait for them to end (their processes are not the daemons' children).
cancel_jobs() {
    pid_of "$DIR/run/slurmctld.pid" slurmctld >/dev/null || return 0
    local jobs deadline=$((SECONDS + 60))
    jobs="$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null || true)"
    [ -n "$jobs" ] || return 0
    # shellcheck disable=SC2086
    SLURM_CONF="$CONF" scancel $jobs 2>/dev/null || true
    while [ $SECONDS -lt $deadline ] && [ -n "$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null)" ]; do
        sleep 0.5
    done
}

stop() {
    local quiet="${1:-}" name prog pid pids=()
    cancel_jobs
    for name in slurmd-node1:slurmd slurmd-node2:slurmd slurmctld:slurmctld munged:munged; do
        prog="${name#*:}"
        if pid="$(pid_of "$DIR/run/${name%%:*}.pid" "$prog")"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    local deadline=$((SECONDS + 20)) alive
    while [ $SECONDS -lt $deadline ]; do
        alive=()
        for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && alive+=("$pid"); done
        [ ${#alive[@]} -eq 0 ] && break
        sleep 0.2
    done
    for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    rm -f "$DIR"/run/*.pid
    [ -n "$quiet" ] || say "stopped ${#pids[@]} daemon(s)"
}

status() {
    local name prog pid
    for name in munged:munged slurmctld:slurmctld slurmd-node1:slurmd slurmd-node2:slurmd; do
        prog="${name#*:}"
        if pid="$(pid_of "$DIR/run/${name%%:*}.pid" "$prog")"; then
            echo "${name%%:*}: running (pid $pid)"
        else
            echo "${name%%:*}: not running"
        fi
    done
    if [ -f "$CONF" ] && command -v sinfo >/dev/null 2>&1 && SLURM_CONF="$CONF" sinfo -N 2>/dev/null; then
        return 0
    fi
    echo "the cluster does not answer"
    return 1
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: bash scripts/slurm_cluster.sh start|stop|status|env" >&2; exit 2 ;;
esac
