"""Every rank joins the job's store before the process group is made, so that a rank that never comes is named.

Why: with torch's env:// rendezvous, rank 0 ends with "Timed out after 620 seconds waiting for clients. 63/64
clients joined" (which one is missing?), and a rank that cannot reach rank 0 logs a C++ stack trace for each
failed try of its store client before "The client socket has timed out". Both are common on a cluster: a node
that did not start its task, a wrong MASTER_ADDR, a firewall between nodes.

Here, within the process group's timeout:
- a rank that does not host the store first tries its port with a plain socket (retried while the port
  refuses, as when rank 0 starts later), and fails with one line naming the address and what to check; quietly
  but for one warning half-way, from the lowest rank that is a client (rank 1, or rank 0 when torchrun's agent
  hosts the store): one line for the job while its rank 0 can still be started;
- the first rank to join sets the job's world size; a rank started with another one stops at once, and so
  do the others, with its line (instead of waiting for ranks that do not exist);
- every rank then takes its rank's slot (a second process with the same rank fails at once, saying so),
  writes its rank to a roster in the store and counts itself, and waits until the count is
  the world size; half-way, rank 0 names those it still waits for in a warning, and at the timeout the ranks
  that joined name those that did not.
The store is then what env:// would make: hosted by rank 0 at MASTER_ADDR:MASTER_PORT, or torchrun's agent's
when TORCHELASTIC_USE_AGENT_STORE=True (every rank is a client then). A store rank 0 hosts serves one process
group: keys under txl_join/<torchelastic run id>/<restart count>/0, so that a task too many meets a taken slot.
An agent's store outlives its workers (torchrun restarts them against it): keys under
txl_join/<torchelastic run id>/agent/<generation>, one generation per round of ranks (_join_agent_round), and
the process group's own keys and the watchdog's live under that round's too (group_store, Joined).

Uses only torch.distributed and the standard library.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from .errors import LOGGER_NAME, RunFailed, one_line
from .stop_request import launcher_gone_since_the_start

WARNING_SHARE = 0.5
"""Rank 0 names the ranks it still waits for once this share of the timeout has passed."""
LOOPBACK = "127.0.0.1"
CONNECT_RETRY_S = 0.2
"""How often a rank retries the store's port while it refuses (its host has not started listening yet)."""
MAX_NAMED = 8
ROUND_QUIET_S = 2.5
"""A generation of an agent's store where ranks joined and none has beaten for this long (a waiting rank beats
at least once a second) is an earlier round's: its processes are gone."""


TELL_WITHIN_S = 3.0
"""How long a rank that failed before joining tries to leave its line in the store (tell_failure)."""


class JoinFailed(RunFailed):
    """Not every rank of the job joined its store within the timeout."""


class Joined(NamedTuple):
    """What join gives: the store for the process group, and the keys of the round of an agent's store the ranks
    joined (None in a store rank 0 hosts): the watchdog's keys go under them, the same on every rank."""

    store: dist.Store
    round_keys: str | None


def join(master_addr: str, master_port: int, rank: int, world_size: int, timeout: timedelta,
         environ: Mapping[str, str] | None = None) -> Joined:
    """The job's store once all `world_size` ranks have joined it (this rank hosts it when it is rank 0 and no
    agent does); JoinFailed when they have not within `timeout`. A store that cannot listen (its port taken)
    raises the store's own error. An agent's store comes back under this group's keys (group_store)."""
    environ = os.environ if environ is None else environ
    agent = _uses_agent_store(environ)
    hosts = rank == 0 and not agent
    deadline = time.monotonic() + timeout.total_seconds()
    host = socket.gethostname()
    starter = "torchrun" if agent else "rank 0"
    where = f"the rendezvous store at {master_addr}:{master_port} (MASTER_ADDR:MASTER_PORT), hosted by {starter}"
    if not hosts:
        def why(last: str) -> str:
            return (f"{starter} has not started it, or this host cannot reach that address (a wrong MASTER_ADDR, "
                    f"a firewall; last try: {last})")

        def warn(waited: float, last: str) -> None:
            logging.getLogger(LOGGER_NAME).warning(
                "warning: rank %d (host %s) has not reached %s, for %.0f s: %s; the job stops if it cannot within "
                "%.0f s", rank, host, where, waited, why(last), timeout.total_seconds())

        # One line for the job half-way, from the lowest rank that is a client (rank 0 hosts the store unless
        # torchrun's agent does): the others wait as quietly as it does.
        lowest_client = 0 if agent else 1
        _await_port(master_addr, master_port, deadline, lambda last: JoinFailed(
            f"rank {rank} (host {host}) could not reach {where}, within {timeout.total_seconds():.0f} s: "
            f"{why(last)}; stopping"),
            warn_at=deadline - timeout.total_seconds() * WARNING_SHARE, warn=warn if rank == lowest_client else None,
            launcher_gone=lambda gone: JoinFailed(f"rank {rank} (host {host}) could not reach {where}: {gone} is "
                                                  "gone (it ended before the ranks joined); stopping"))
    # The host's own client goes over loopback (its server listens on every interface): a MASTER_ADDR that
    # does not lead back to it (a name it cannot resolve) is then told by the ranks that cannot reach it.
    store = dist.TCPStore(LOOPBACK if hosts else master_addr, master_port, world_size, is_master=hosts,
                          timeout=timeout, wait_for_workers=False, multi_tenant=True)
    try:
        if agent:
            keys = _join_agent_round(store, environ, rank, world_size, host, deadline, timeout, where)
        else:
            base = _base(environ)
            _agree_on_world_size(store, base, rank, world_size, host)
            keys = f"{base}/0"
            _take_slot(store, keys, rank, host)
            _await_everyone(store, keys, rank, world_size, deadline, timeout, where, refusal=f"{base}/refused")
    except dist.DistError as e:  # the store's host went away meanwhile
        raise JoinFailed(f"rank {rank} lost {where}, while the ranks joined ({type(e).__name__}: {one_line(e)}); "
                         "stopping") from None
    global _joined
    _joined = True
    return Joined(group_store(store, keys), keys) if agent else Joined(store, None)


_joined = False
"""Whether this process has joined the job's store with every other rank (join returned)."""


def tell_failure(master_addr: str, master_port: int, rank: int, line: str,
                 environ: Mapping[str, str] | None = None) -> bool:
    """Leave `line` (why this rank fails, before it has joined) where the ranks waiting in join read it: they stop
    at once with it, where they would wait for this rank until the join's timeout (train.collective_timeout_s,
    ten minutes by default; under srun nothing else ends them). The key is the one a refused world size uses; the
    first line left there wins. Within TELL_WITHIN_S, and False, where no store answers (rank 0 hosts it outside
    torchrun: then nobody waits in it yet; or it is gone) or, in torchrun's, where no rank has joined this round.
    A rank that has joined tells nobody here: the others are past the join, and the watchdog names it."""
    environ = os.environ if environ is None else environ
    agent = _uses_agent_store(environ)
    if _joined or (rank == 0 and not agent):
        return False
    try:
        store = dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=TELL_WITHIN_S))
        if agent:
            base = _agent_base(environ)
            keys = f"{base}/{store.add(f'{base}/generation', 0)}"
            if not store.add(f"{keys}/count", 0):
                # Nobody waits in this generation yet, and torchrun's store outlives the round: a line left now
                # would stop the round its restart starts. The ones to come wait out the timeout, as before.
                return False
            refusal = f"{keys}/refused"
        else:
            refusal = f"{_base(environ)}/refused"
        store.compare_set(refusal, "", line)
        return True
    except (RuntimeError, OSError):  # no store there (DistNetworkError, a timeout): nobody to tell
        return False


def group_store(store: dist.Store, keys: str) -> dist.Store:
    """`store` with the keys of one process group apart (`keys`: its round, _join_agent_round).

    torchrun keeps one store for every round of its rendezvous (--max-restarts: the workers restarted after a
    lost rank meet at the same MASTER_ADDR:MASTER_PORT), and the process group's keys there (gloo's address of
    each rank) would be the first attempt's, of processes that are gone: measured with torch 2.13 and gloo, the
    restarted ranks failed in `Gloo connectFullMesh ... Connection refused` or waited there until the group's
    timeout (plain torch.distributed with env:// does the same)."""
    return dist.PrefixStore(f"{keys}/group", store)


def _agree_on_world_size(store: dist.TCPStore, base: str, rank: int, world_size: int, host: str) -> None:
    """The first rank to join sets the job's world size; a rank started with another one stops at once and
    leaves its line for the others (who would otherwise wait, in vain, for ranks that do not exist)."""
    first = store.compare_set(f"{base}/world_size", "", f"{world_size} {rank} {host}").decode()
    agreed, first_rank, first_host = first.split(" ", 2)
    if int(agreed) != world_size:
        line = (f"rank {rank} (host {host}) was started with a world size of {world_size}, rank {first_rank} "
                f"(host {first_host}) with {agreed}: every task of a job must be started with the same world "
                "size (WORLD_SIZE, or SLURM_NTASKS under srun: one launcher command for all nodes); stopping")
        store.set(f"{base}/refused", line)
        raise JoinFailed(line)


def _take_slot(store: dist.TCPStore, keys: str, rank: int, host: str) -> None:
    """Join as `rank`: its slot, the roster and the count. A second process with this rank (RANK set from a
    per-node number, such as SLURM_LOCALID) leaves the slot to the first and says so, before it counts: the
    ranks nobody took are then named at the timeout."""
    if store.add(f"{keys}/rank/{rank}", 1) > 1:
        raise JoinFailed(f"rank {rank} (host {host}) joined the job twice: another process (host "
                         f"{_host_of(store, keys, rank)}) has the same rank; each task needs a RANK of its own "
                         "(a launcher's global task number, e.g. SLURM_PROCID, not a per-node one); stopping")
    store.set(f"{keys}/host/{rank}", host)
    store.append(f"{keys}/roster", f"{rank},")
    store.add(f"{keys}/count", 1)


def _join_agent_round(store: dist.TCPStore, environ: Mapping[str, str], rank: int, world_size: int, host: str,
                      deadline: float, timeout: timedelta, where: str) -> str:
    """Join this round of torchrun's rendezvous in its store; the round's keys once every rank has.

    The store outlives the workers: torchrun restarts them against it (--max-restarts, a node that joins or
    leaves), and TORCHELASTIC_RESTART_COUNT is each node's own count (a node whose workers were well when
    another's failed restarts them without counting), so it cannot name the round: measured, the ranks of two
    nodes joined under restart counts 0 and 1 and waited for each other until the timeout. The round is a
    generation in the store instead, the newest one: where ranks joined before, they are of this round while
    they beat (each beats as it waits for the others). A generation whose ranks no longer beat is an earlier
    round's (torchrun stops its processes before it starts the next round, which then takes seconds to import),
    so the rank opens the next generation, and any that joined the old one move on to it. In this round's
    generation, a rank taken twice or another world size is refused as under a store rank 0 hosts."""
    base = _agent_base(environ)
    while True:
        generation = store.add(f"{base}/generation", 0)
        keys = f"{base}/{generation}"
        if (store.add(f"{keys}/count", 0) or store.check([f"{keys}/world_size"])) and \
                not _beats(store, f"{keys}/alive"):
            store.compare_set(f"{base}/generation", str(generation), str(generation + 1))  # the first to see it
            continue
        _agree_on_world_size(store, keys, rank, world_size, host)
        _take_slot(store, keys, rank, host)
        if _await_everyone(store, keys, rank, world_size, deadline, timeout, where, refusal=f"{keys}/refused",
                           beat=f"{keys}/alive", moved=lambda: store.add(f"{base}/generation", 0) != generation):
            return keys


def _beats(store: dist.TCPStore, key: str) -> bool:
    """Whether some rank beats at `key` within ROUND_QUIET_S (a rank that waits beats each poll)."""
    start = store.add(key, 0)
    until = time.monotonic() + ROUND_QUIET_S
    while time.monotonic() < until:
        time.sleep(CONNECT_RETRY_S)
        if store.add(key, 0) != start:
            return True
    return False


def _await_everyone(store: dist.TCPStore, keys: str, rank: int, world_size: int, deadline: float,
                    timeout: timedelta, where: str, refusal: str, beat: str | None = None,
                    moved: Callable[[], bool] | None = None) -> bool:
    """True once `world_size` ranks have joined; JoinFailed naming the others at the deadline, or at once
    with the line a refused rank left at `refusal`. Rank 0 names them in a warning half-way too, while someone
    can still start them. Adds to `beat` at each poll; False when `moved()` says the ranks have moved on to a
    newer generation."""
    poll_s = min(1.0, 0.05 + world_size / 2000)  # 4096 ranks: each asks once a second
    warn_at = None if rank else deadline - timeout.total_seconds() * WARNING_SHARE
    while (joined := store.add(f"{keys}/count", 0)) < world_size:
        if beat is not None:
            store.add(beat, 1)
        if store.check([refusal]):
            raise JoinFailed(store.get(refusal).decode())
        if moved is not None and moved():
            return False
        now = time.monotonic()
        if now >= deadline:
            raise JoinFailed(_missing_line(store.get(f"{keys}/roster").decode(), world_size, joined, timeout, where))
        if warn_at is not None and now >= warn_at:
            warn_at = None
            missing = _missing(store.get(f"{keys}/roster").decode(), world_size)
            logging.getLogger(LOGGER_NAME).warning(
                "warning: waiting for %s to join (%d of %d joined, %.0f s so far); the job stops if they have not "
                "joined within %.0f s", _ranks_text(missing), joined, world_size,
                timeout.total_seconds() - (deadline - now), timeout.total_seconds())
        time.sleep(poll_s)
    return True


def _host_of(store: dist.TCPStore, keys: str, rank: int) -> str:
    """The host of the first process that joined as `rank` (a moment after its slot was taken)."""
    for _ in range(50):
        if store.check([f"{keys}/host/{rank}"]):
            return store.get(f"{keys}/host/{rank}").decode()
        time.sleep(0.02)
    return "unknown"


def _await_port(host: str, port: int, deadline: float, failure: Callable[[str], Exception], *,
                warn_at: float = math.inf, warn: Callable[[float, str], None] | None = None,
                launcher_gone: Callable[[str], Exception] | None = None) -> None:
    """Return once `host:port` accepts a connection; raise failure(the last try's error) at the deadline.
    warn(seconds waited, the last try's error) is called once, at the first failed try after `warn_at`.
    launcher_gone('its launcher (...)') is raised at a failed try once a launcher of this process has ended
    (torchrun killed while its workers started takes its store along: waiting out the deadline, 10 minutes by
    default, would end in advice about addresses)."""
    start = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                return
        except OSError as e:
            now = time.monotonic()
            if launcher_gone is not None and (gone := launcher_gone_since_the_start()) is not None:
                raise launcher_gone(gone) from None
            if now + CONNECT_RETRY_S >= deadline:
                raise failure(one_line(e)) from None
            if warn is not None and now >= warn_at:
                warn(now - start, one_line(e))
                warn = None
            time.sleep(CONNECT_RETRY_S)


def _uses_agent_store(environ: Mapping[str, str]) -> bool:
    """Whether the ranks meet in torchrun's agent's store (which outlives them) rather than one rank 0 hosts."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _agent_base(environ: Mapping[str, str]) -> str:
    """Keys of this launch in torchrun's agent's store; the rounds of its restarts are generations under it."""
    return f"txl_join/{environ.get('TORCHELASTIC_RUN_ID', '')}/agent"


def _base(environ: Mapping[str, str]) -> str:
    """Keys of this launch, in a store rank 0 hosts: it serves one process group."""
    return f"txl_join/{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _missing(roster: str, world_size: int) -> list[int]:
    present = {int(r) for r in roster.split(",") if r}
    return [r for r in range(world_size) if r not in present]


def _ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1, 3', 'ranks 1, 2, ... 8 and 56 more'."""
    named = ", ".join(map(str, ranks[:MAX_NAMED])) + (f" and {len(ranks) - MAX_NAMED} more"
                                                      if len(ranks) > MAX_NAMED else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {named}"


def _missing_line(roster: str, world_size: int, joined: int, timeout: timedelta, where: str) -> str:
    return (f"{_ranks_text(_missing(roster, world_size))} did not join the job within "
            f"{timeout.total_seconds():.0f} s: {joined} of {world_size} joined {where}; each rank's task must "
            "start (the launcher's host list, that node's log) and reach MASTER_ADDR:MASTER_PORT; stopping")
