"""Facts and limits of this host process that every package needs: the CPUs it may use, its open-file limit,
torch's C++ log level.

Standard library only, so data_prep (which never imports torch) shares it with the training side.
"""
from __future__ import annotations

import os
from collections.abc import Mapping


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: what Slurm or taskset gave it), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpus_per_rank(local_world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """This rank's share of the CPUs: usable_cpus() when they are its own already (srun bound the task to its
    --cpus-per-task: the affinity has exactly SLURM_CPUS_PER_TASK CPUs), else usable_cpus() / the node's
    ranks (the launcher left every rank the same CPUs; dividing a per-task binding again would give 12 CPUs
    of 8 ranks one each)."""
    env = os.environ if environ is None else environ
    cpus = usable_cpus()
    if env.get("SLURM_CPUS_PER_TASK", "").strip() == str(cpus) and "SLURM_PROCID" in env:
        return cpus
    return max(1, cpus // max(1, local_world_size))


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the soft limit now in force.

    Rank 0 holds about 5 sockets per rank (the rendezvous store's clients: the process group's and the
    watchdog's two; the two groups' gloo meshes): at a soft limit of 1024, a common default that Slurm passes
    on from the submitting shell, a job of ~200 ranks would fail to connect; data_prep's readers keep a
    descriptor per Arrow file they touch (a mixture of many sources). The hard limit is the site's."""
    try:
        import resource
    except ImportError:  # not POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux's default nr_open
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass  # a limit the kernel refuses (above nr_open): keep the one in force
    return soft


def quiet_torch_cpp_warnings() -> None:
    """torch's C++ warnings off (TORCH_CPP_LOG_LEVEL=ERROR) unless the environment sets a level; to be called
    before torch is imported (c10 reads it then). The ranks report a lost peer in one line (watchdog.py), but
    any call on the rendezvous store of a rank that has just died (the heartbeat thread's, seconds apart)
    makes c10d print a warning with ~20 C++ stack frames first (torch 2.11 and 2.13 alike); errors still print."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
