"""Who am I in the job: rank and world discovery for the deepspeed launcher, torchrun and srun; the process
groups; the few collectives the trainer needs; CPU threads per rank; rank-0-only logging.

Two process groups: the default one (gloo on CPU; on CUDA "cpu:gloo,cuda:nccl", so DeepSpeed's device
collectives go to nccl) with the collective timeout, for device tensors; and a gloo "control" group for the
host-side helpers (flags and picklable objects on the CPU), whose waits may be long (checkpoint I/O, one
rank converting a checkpoint while the others wait). The lost-rank watchdog (watchdog.py) runs while the
groups are up.

No deepspeed here (docs/architecture.md): deepspeed.initialize finds the process group already initialized.
Every collective helper also works with a world of one and no process group.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import rendezvous, watchdog
from .errors import EXIT_FAILED, INTERRUPTED, LOGGER_NAME, Refused, RunFailed, one_line
from .host import cpus_per_rank, raise_open_file_limit

DEFAULT_MASTER_PORT = 29500
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 12000
"""Under Slurm the rendezvous port is SLURM_PORT_BASE + job id % SLURM_PORT_SPAN (launch/slurm/common.sh
computes the same): 20000-31999, below Linux's ephemeral range (32768-60999 by default), where any outgoing
connection of the first node may hold the port the store has to listen on."""
ANY_FREE_PORT = 0
"""DistEnv.master_port of a process without a launcher or MASTER_PORT: init_process_group opens its store on
a free port (and exports that one as MASTER_PORT)."""
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # config: train.collective_timeout_s
DEFAULT_CONTROL_TIMEOUT_S = 3600.0  # config: checkpoint.timeout_s
TEARDOWN_AFTER_FAILURE_S = 30.0
"""How long a rank that failed (alone, or in a collective a lost rank broke) waits for its groups to be torn
down before it exits anyway: NCCL's graceful teardown waits for this rank's collectives in flight, which a
stopped peer will never join, so a failing rank aborts its groups, and even an abort can hang."""
NCCL_TIMEOUT_MARGIN_S = 120.0
T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


class LaunchError(Refused, RuntimeError):
    """The environment does not describe a usable job; the message names the variable and the fix."""


class StartFailed(RunFailed):
    """Another rank's fault during the job's start (a full disk, a failed conversion, a bug), raised on the ranks
    that had none: the job ends as a fault on every rank (exit 1), as a refusal only when it was one."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """'torchrun', 'deepspeed' (both set RANK/WORLD_SIZE/LOCAL_RANK), 'slurm' (srun) or 'single'."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs to MLflow and writes shared files."""
        return self.rank == 0


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous address from the launcher's environment variables.

    torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun:
    LOCAL_WORLD_SIZE, deepspeed: LOCAL_SIZE). Under srun they are taken from SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID; the address from MASTER_ADDR, else the first node of the step (SLURM_STEP_NODELIST, else
    SLURM_JOB_NODELIST: where srun starts task 0; not SLURM_LAUNCH_NODE_IPADDR, the node srun was typed on,
    e.g. a login node under salloc); the port from MASTER_PORT, else slurm_port(SLURM_JOB_ID). No
    launcher at all: a world of one on 127.0.0.1, on MASTER_PORT if set, else ANY_FREE_PORT (picked by
    init_process_group).
    """
    env = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE")
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "deepspeed" if "LOCAL_SIZE" in env and "LOCAL_WORLD_SIZE" not in env else "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", default=rank)
        local_world = _int(env, "LOCAL_WORLD_SIZE", default=_int(env, "LOCAL_SIZE", default=world))
        addr = env.get("MASTER_ADDR", "127.0.0.1")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher, names = "slurm", ("SLURM_PROCID", "SLURM_NTASKS")
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", default=0)
        local_world = _slurm_tasks_on_this_node(env)
        addr = env.get("MASTER_ADDR") or _first_slurm_node(env)
    else:
        launcher, rank, world, local_rank, local_world = "single", 0, 1, 0, 1
        addr = env.get("MASTER_ADDR", "127.0.0.1")
    # Under Slurm, jobs sharing a node need distinct ports: derive one from the job id unless given. A
    # process on its own needs no agreed port: any free one (chosen when its store opens), so that two
    # single-process jobs on one machine do not both ask for 29500.
    default_port = DEFAULT_MASTER_PORT
    if launcher == "slurm" and env.get("SLURM_JOB_ID", "").isdigit():
        default_port = slurm_port(int(env["SLURM_JOB_ID"]))
    elif launcher == "single":
        default_port = ANY_FREE_PORT
    port = _int(env, "MASTER_PORT", default=default_port)
    if port != ANY_FREE_PORT and not 1 <= port <= 65535:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1..65535); choose a free one, e.g. 29500")
    if not 0 <= rank < world:
        raise LaunchError(f"{names[0]}={rank} is outside 0..{world - 1} ({names[1]}={world}); check how the job "
                          "was launched")
    if not 0 <= local_rank < local_world:
        raise LaunchError(f"local rank {local_rank} is outside 0..{local_world - 1}; check LOCAL_RANK / SLURM_LOCALID")
    return DistEnv(rank, world, local_rank, local_world, addr, port, launcher)


def slurm_port(job_id: int) -> int:
    """The rendezvous port of a Slurm job: jobs sharing a node get distinct ports (SLURM_PORT_BASE)."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise LaunchError(f"{name} is not set; start the job with deepspeed, torchrun or srun")
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _slurm_tasks_on_this_node(env: Mapping[str, str]) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else this node's entry of SLURM_TASKS_PER_NODE ('2(x3),1')."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 1
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"SLURM_TASKS_PER_NODE={spec!r}: cannot parse '{part}'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = _int(env, "SLURM_NODEID", default=0)
    return counts[node] if node < len(counts) else counts[-1]


def _first_slurm_node(env: Mapping[str, str]) -> str:
    """The first host of the step's node list: a plain list ('n1,n2') read here, a ranged one ('n[1-4]')
    expanded by `scontrol show hostnames`."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("under srun without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: set MASTER_ADDR")
    if "[" not in nodelist:
        return nodelist.split(",")[0]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` failed ({e}); set MASTER_ADDR") from None
    hosts = out.split()
    if not hosts:
        raise LaunchError(f"`scontrol show hostnames {nodelist}` printed no host; set MASTER_ADDR")
    return hosts[0]


def export(env: DistEnv) -> None:
    """Put the job's coordinates into os.environ in the names torch.distributed and DeepSpeed read."""
    os.environ.update({
        "RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size), "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    })


def configure_threads(env: DistEnv, environ: Mapping[str, str] | None = None) -> int:
    """Threads per rank = this rank's share of the CPUs (host.cpus_per_rank), unless OMP_NUM_THREADS says otherwise.

    The deepspeed launcher does not set OMP_NUM_THREADS; 2 threads per rank on 2 cores ran ~7x slower
    (docs/architecture.md), so the cores are shared out here. Returns the thread count in use.
    """
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" not in environ:
        torch.set_num_threads(cpus_per_rank(env.local_world_size, environ))
    return torch.get_num_threads()


def cpu_requested(environ: Mapping[str, str] | None = None) -> bool:
    """DS_ACCELERATOR=cpu: DeepSpeed's accelerator is the CPU, so the whole run is (its engine places the
    model there), also on a machine with GPUs."""
    env = os.environ if environ is None else environ
    return env.get("DS_ACCELERATOR", "").strip().lower() == "cpu"


def uses_cuda(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process trains on CUDA: a device is there and the CPU was not asked for (cpu_requested)."""
    return torch.cuda.is_available() and not cpu_requested(environ)


def device_for(env: DistEnv) -> torch.device:
    """cuda:<local rank> when the run uses CUDA (uses_cuda), else the CPU: the device of the engine's model, of
    the batches, the memory bank and the evaluator alike."""
    return torch.device("cuda", env.local_rank) if uses_cuda() else torch.device("cpu")


def check_visible_gpus(env: DistEnv) -> None:
    """Refuse a node whose ranks see fewer GPUs than it runs ranks: the device of a rank is cuda:<local rank>
    (DeepSpeed too picks it by LOCAL_RANK), so every rank of a node must see all of the node's GPUs. A per-task
    binding (srun --gpus-per-task, --gpu-bind, a CUDA_VISIBLE_DEVICES per rank) would otherwise fail inside
    torch with "invalid device ordinal". The same test on every rank of a node: they refuse together.
    A node that Slurm gave GPUs which torch cannot use is refused too (check_gpus_usable)."""
    if not uses_cuda():
        check_gpus_usable(f"rank {env.rank}", cuda_available=torch.cuda.is_available())
        return
    visible = torch.cuda.device_count()
    if visible < env.local_world_size:
        raise LaunchError(
            f"rank {env.rank}: {env.local_world_size} ranks on this node but each sees {visible} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): every rank must see all "
            "of the node's GPUs (its device is cuda:<local rank>); launch without per-task GPU binding "
            "(Slurm: --gpus-per-node=G with --ntasks-per-node=G, no --gpus-per-task or --gpu-bind), or run "
            "fewer ranks per node")


def slurm_gpus(environ: Mapping[str, str] | None = None) -> int:
    """The GPUs Slurm gave this step (SLURM_STEP_GPUS) or job (SLURM_JOB_GPUS: lists of GPU indices;
    SLURM_GPUS_ON_NODE: a count) on this node; 0 outside Slurm or without GPUs."""
    env = os.environ if environ is None else environ
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        listed = [g for g in env.get(name, "").split(",") if g.strip()]
        if listed:
            return len(listed)
    count = env.get("SLURM_GPUS_ON_NODE", "").strip()
    return int(count) if count.isdigit() else 0


def check_gpus_usable(who: str, *, cuda_available: bool, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a job that Slurm gave GPUs when torch cannot use them (a CPU build of torch, a driver older than
    its CUDA): every rank would pick the CPU and gloo and train at CPU speed, with nothing else amiss.
    DS_ACCELERATOR=cpu says the CPU is meant."""
    env = os.environ if environ is None else environ
    gpus = slurm_gpus(env)
    if cuda_available or not gpus or cpu_requested(env):
        return
    why = ("a CPU build" if torch.version.cuda is None
           else f"built for CUDA {torch.version.cuda}, and torch.cuda.is_available() is False: a driver older "
                "than that CUDA, or no GPU device visible to the process")
    raise LaunchError(f"{who}: Slurm gave this node {gpus} GPU(s) but torch {torch.__version__} cannot use them "
                      f"({why}); put a CUDA build of torch into the environment (README, \"Installing on a GPU "
                      "machine\"), or set DS_ACCELERATOR=cpu to train on the CPU on purpose")


def default_backend() -> str:
    """The default group's backend: gloo for CPU tensors and, when the run uses CUDA, nccl for CUDA tensors."""
    return "cpu:gloo,cuda:nccl" if uses_cuda() else "gloo"


_control_group: dist.ProcessGroup | None = None
_control_timeout_s: float | None = None  # checkpoint.timeout_s: the control group's waits (less its margin)
_collective_timeout: timedelta | None = None


def group_timeout(collective_timeout_s: float, backend: str) -> timedelta:
    """The default group's timeout: train.collective_timeout_s plus two beats, so that a lost rank is reported
    by the watchdog's one line, not by the backend's own abort; with NCCL at least NCCL_TIMEOUT_MARGIN_S more.
    NCCL's clock starts when a collective is queued, possibly long before the peer stopped (the watchdog's
    starts at the peer's last beat), and its abort is a SIGABRT after a multi-line report, without our abort
    callbacks (the MLflow run left open). A gloo collective that times out raises, and is explained in one line."""
    margin = _watchdog_first_margin_s(collective_timeout_s)
    if "nccl" in backend:
        margin = max(margin, NCCL_TIMEOUT_MARGIN_S)
    return timedelta(seconds=collective_timeout_s + margin)


def _watchdog_first_margin_s(collective_timeout_s: float) -> float:
    """Two beats: what a group's timeout adds to the watchdog's limit so that its one line comes first."""
    return 2 * watchdog.beat_period(collective_timeout_s)


def collective_timeout() -> timedelta | None:
    """The timeout of the default group (group_timeout); None before
    init_process_group. Groups made for device collectives (DeepSpeed's) should use it too."""
    return _collective_timeout


def init_process_group(env: DistEnv, *, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
                       control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S, backend: str | None = None) -> None:
    """Join the job: the rendezvous store, once every rank has joined it (rendezvous.join: a rank that never
    comes is named, within the group's timeout), the default group (`backend`, else default_backend(); timeout
    group_timeout()),
    the gloo control group of the host-side helpers (timeout control_timeout_s) and the lost-rank
    watchdog (a rank silent for collective_timeout_s ends the job). A no-op when already initialized; when
    someone else made the default group (deepspeed.init_distributed or a script's own init_process_group,
    NCCL-only on GPUs), the control group and the watchdog are added to it."""
    global _collective_timeout
    if dist.is_initialized():
        if _control_group is None:
            _join_existing(env, collective_timeout_s, control_timeout_s)
        return
    backend = backend or default_backend()
    timeout = group_timeout(collective_timeout_s, backend)
    store = None
    if env.master_port == ANY_FREE_PORT and env.world_size == 1:
        # Port 0: the kernel picks a free one as the store listens, so no other process can take it between a
        # probe and the bind.
        store = dist.TCPStore(env.master_addr, ANY_FREE_PORT, 1, is_master=True, timeout=timeout)
        env = dataclasses.replace(env, master_port=store.port)
    export(env)
    check_visible_gpus(env)
    raise_open_file_limit()
    if uses_cuda():
        torch.cuda.set_device(env.local_rank)
    _collective_timeout = timeout
    round_keys = None  # the round of torchrun's store the ranks joined, for the watchdog's keys
    if store is None:
        try:
            store, round_keys = rendezvous.join(env.master_addr, env.master_port, env.rank, env.world_size, timeout)
        except RuntimeError as e:  # DistNetworkError among them
            if env.rank == 0 and _port_taken(e):
                raise LaunchError(
                    f"MASTER_PORT {env.master_port} on {env.master_addr} is in use by another process (another "
                    "job?); choose a free port (deepspeed --master_port, torchrun --master-port, or MASTER_PORT)"
                ) from None
            raise
    # As env:// would: keys of other users of a shared store (torchrun's agent) stay apart.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=env.rank,
                            world_size=env.world_size, timeout=timeout)
    _start_control_group_and_watchdog(env, collective_timeout_s, control_timeout_s, round_keys)


def _join_existing(env: DistEnv, collective_timeout_s: float, control_timeout_s: float) -> None:
    """The control group and the watchdog beside a default group made elsewhere (its timeout is its maker's):
    without them the host-side helpers would send CPU tensors to an NCCL-only group, and no lost rank would
    be named."""
    if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
        raise LaunchError(f"torch.distributed was initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
                          f"but the launcher's environment says rank {env.rank} of {env.world_size}")
    _start_control_group_and_watchdog(env, collective_timeout_s, control_timeout_s)


def _start_control_group_and_watchdog(env: DistEnv, collective_timeout_s: float, control_timeout_s: float,
                                      round_keys: str | None = None) -> None:
    global _control_group, _control_timeout_s
    # As the default group: a rank stuck while the others wait in a save or a start-up phase (whose notes allow
    # control_timeout_s, checkpoint.timeout_s) is named by the watchdog before the control group times out.
    margin = _watchdog_first_margin_s(collective_timeout_s)
    _control_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s + margin))
    _control_timeout_s = control_timeout_s
    watchdog.start(env.rank, env.world_size, watchdog.store_address(env.master_addr, env.master_port),
                   collective_timeout_s, logging.getLogger(LOGGER_NAME), round_keys)


def _port_taken(error: BaseException) -> bool:
    """Whether rank 0's rendezvous store could not listen because its port is taken (its message is all the
    backend gives: "... EADDRINUSE ... address already in use")."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def destroy_process_group(error: BaseException | None = None) -> None:
    """Leave the job (at the end of main, so a process can exit or start another job): stop the watchdog,
    then tear down both groups.

    `error`: what this rank is failing with, when it caught it itself and fails alone; an exception that is
    still propagating (destroy called from a `finally`) counts too. The other ranks then stop at once with
    a line naming this rank. A refusal (raised on every rank together) and SystemExit(0) are no failure.
    A failing rank (or one whose collective failed, explain_failure) aborts its groups instead, and exits
    with status 1 when that takes over TEARDOWN_AFTER_FAILURE_S (logging its line first).
    """
    global _control_group, _control_timeout_s, _collective_timeout
    error = error if error is not None else sys.exc_info()[1]
    line = _failure_line(error)
    collective_failed = watchdog.explained()
    watchdog.stop(line)
    _control_group = _control_timeout_s = _collective_timeout = None
    if not dist.is_initialized():
        if line is not None and not isinstance(error, (KeyboardInterrupt, rendezvous.JoinFailed)):
            _tell_the_joined(line)
        return
    if (line is None and not collective_failed) or dist.get_world_size() < 2:
        dist.destroy_process_group()
        return
    teardown = threading.Thread(target=_abort_groups, daemon=True, name="txl-teardown")
    teardown.start()
    teardown.join(TEARDOWN_AFTER_FAILURE_S)
    if teardown.is_alive():
        if line is not None:  # (after a failed collective, the entry point has printed the lost rank's line)
            # The caller was about to end this process with its error anyway; the traceback of an unexpected
            # one would come after this call, so its line goes here.
            logging.getLogger(LOGGER_NAME).error(
                "error: %s (leaving the process group did not finish within %.0f s: a collective in flight that "
                "the stopped ranks will not join; exiting)", line, TEARDOWN_AFTER_FAILURE_S)
        logging.shutdown()
        os._exit(EXIT_FAILED)


def _abort_groups() -> None:
    """Tear every group down without waiting for collectives in flight (NCCL: ncclCommAbort, where a plain
    destroy finalizes, waiting for this rank's kernels); a plain destroy where torch has no abort, or where its
    abort left the groups in place (torch 2.6 aborts NCCL groups only: gloo's stay, with a warning), so that
    this rank takes part in no later collective (distributed.together's agreement on its way out)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
        except (RuntimeError, ValueError, NotImplementedError) as e:  # a backend without abort
            logging.getLogger(LOGGER_NAME).debug("aborting the process groups failed (%s); destroying them", e)
    if dist.is_initialized():
        dist.destroy_process_group()


def _tell_the_joined(line: str) -> None:
    """A failure before this rank joined the job: the ranks waiting for it to join stop at once with its line
    (rendezvous.tell_failure). Not a stop signal (KeyboardInterrupt: the launcher or scheduler sends it to every
    rank) nor a failed join (the others time out, or refused it themselves)."""
    try:
        env = discover()
    except Exception:  # noqa: BLE001 - no launch environment to read: nobody to tell
        return
    if env.world_size > 1:
        rendezvous.tell_failure(env.master_addr, env.master_port, env.rank,
                                f"rank {env.rank} (host {socket.gethostname()}) failed while starting, before it "
                                f"joined the others: {line}; stopping")


def _failure_line(error: BaseException | None) -> str | None:
    if error is None or isinstance(error, Refused) or (isinstance(error, SystemExit) and not error.code):
        return None
    if type(error) is KeyboardInterrupt:  # a bare Ctrl-C: its one_line would be the class name alone
        return INTERRUPTED
    return one_line(error)


def explain_failure(exc: BaseException) -> str | None:
    """After a collective raised `exc`: one line naming the lost rank(s) (rank, host, pid and why), or
    saying that contact with the rendezvous store was lost; None when `exc` is no collective failure.
    Takes a few seconds; every other rank then stops with the same line. See watchdog.explain_failure."""
    return watchdog.explain_failure(exc)


def on_abort(callback: Callable[[], None]) -> None:
    """Run `callback` (briefly: a few seconds for all of them) before the watchdog ends this process because
    a rank was lost; e.g. closing the MLflow run. Forgotten at destroy_process_group."""
    watchdog.on_abort(callback)


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def refused_alike_by_this_nodes_first_rank() -> bool:
    """True on a rank that is not its node's first while the ranks are not connected yet (no process group):
    what it refuses then (the configuration, the corpus' manifest, a checkpoint's files, DeepSpeed's ops) the
    node's first rank reads from the same files, arguments and environment and refuses alike, so the job prints
    one line per node instead of one per rank (64 of them on 8 nodes of 8 GPUs)."""
    if dist.is_initialized():
        return False
    try:
        return discover().local_rank != 0
    except Exception:  # noqa: BLE001 - a launch environment it cannot read: this rank speaks for itself
        return False


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns the tensor."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one (all ranks must call it)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)  # [1]
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control_group)
    return bool(t.item())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src` on every rank (picklable objects only)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_control_group)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_control_group)
    return out


def together(fn: Callable[[], T], done: str) -> T:
    """Run `fn` on every rank; if it raises on any rank, raise on all of them (collective). A phase of the
    job's start: `done` says it for people once this rank has done its part ("checkpoint step_00000002
    verified"), the watchdog's progress note before the ranks agree (watchdog.note_start_up), so that a rank
    stuck in `fn` (a read that never returns) is named by the others waiting here with `done` and its stack,
    before the control group times out.

    So no rank goes on into a collective that a failed rank will never join (and waits there until the
    timeout). Rank 0 reports: it raises its own error, or, when only other ranks failed, one with the first
    failed rank's message, its rank and host. The other ranks raise their own error (or that one) marked as
    reported (`reported_on_rank_zero`; the entry points then print nothing), unless their message is not the
    one rank 0 prints: one line per failure, not one per rank, and the line is in rank 0's log file too. The
    ranks without an error of their own raise a LaunchError (a refusal, exit 2) when every failure was a
    refusal, else a StartFailed (a fault, exit 1): the job's exit status is the failed rank's.
    """
    error: Exception | None = None
    try:
        result = fn()
    except Exception as e:  # re-raised below, after the ranks agree
        error = e
    watchdog.note_start_up(done, _control_timeout_s)
    if not any_rank(error is not None):
        return result
    mine = None if error is None else one_line(error)
    failures = gather_objects(None if mine is None else (mine, socket.gethostname(), isinstance(error, Refused)))
    refused = all(failure[2] for failure in failures if failure is not None)
    told = LaunchError if refused else StartFailed
    first = next(rank for rank, failure in enumerate(failures) if failure is not None and failure[2] == refused)
    reported = failures[0][0] if failures[0] is not None else failures[first][0]
    if (dist.get_rank() if _active() else 0) == 0 and error is None:
        message, host, _ = failures[first]
        raise told(f"rank {first} ({host}) failed while starting: {message}")
    if error is None:
        error = told("another rank failed while starting (rank 0 says why); stopping this one too")
        mine = None
    raise agreed(error) if mine in (None, reported) else error


def agreed(exc: E) -> E:
    """`exc`, which every rank raises alike (a decision the ranks agreed on), marked on ranks other than 0 as
    reported there: the entry points print one line for the job, not one per rank."""
    if _active() and dist.get_rank() != 0:
        exc._txl_reported_on_rank_zero = True  # type: ignore[attr-defined]
    return exc


def reported_on_rank_zero(exc: BaseException) -> bool:
    """True for an error rank 0 reports for this rank too (`agreed`): this rank prints nothing."""
    return getattr(exc, "_txl_reported_on_rank_zero", False)


RANK_ZERO_ONLY = {"rank_zero_only": True}
"""`extra=` of a warning every rank logs alike (a start-up check each rank makes): only rank 0 prints it."""


def barrier() -> None:
    """Wait for every rank (on the control group: the wait may be as long as a checkpoint's I/O)."""
    if _active():
        dist.barrier(group=_control_group)


def setup_logging(env: DistEnv, log_all_ranks: bool = False, level: int = logging.INFO) -> logging.Logger:
    """The project's logger: rank 0 prints (others only warnings and errors) unless log_all_ranks.

    DeepSpeed's own INFO chatter is muted to warnings on every rank: the progress lines are ours.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler()
    prefix = f"[rank {env.rank}] " if log_all_ranks and env.world_size > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    if not (env.is_main or log_all_ranks):
        handler.addFilter(lambda record: not getattr(record, "rank_zero_only", False))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(level if env.is_main or log_all_ranks else logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return logger
