"""Facts and limits of this host process that every package needs: the CPUs it may use, its open-file limit.

Standard library only, so data_prep (which never imports torch) shares it with the training side.
"""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: what Slurm or taskset gave it), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
