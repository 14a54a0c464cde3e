"""A lost rank ends the job promptly, with one line naming it (its rank, host and pid).

Why: on gloo, a dead peer makes the survivors' pending collective raise at once, but the error names a
socket address, not a rank; on nccl a dead peer leaves the survivors hanging until the collective timeout;
a hung (SIGSTOPped) peer hangs everyone on any backend.

How: every rank publishes its host and pid in the rendezvous store and beats there (a counter) from a daemon
thread. Each rank watches only its two ring neighbours, so the store's load grows with W, not W squared. A
neighbour silent for collective_timeout_s is reported in one line, and so is one silent for two beats whose
process has certainly ended (gone from this machine's process table, or its probe port refused at every
address): on nccl nothing else notices a dead peer, whose partners' kernels wait for it until the collective
timeout, minutes later. A neighbour that beats but is stuck (a deadlock, a read that never returns) is found by
its progress: the trainer notes where every rank is (note_progress: the micro batch or evaluation segment it
has begun, its input in hand; note_start_up: the phase of start-up it has done its part of), and a neighbour
that stays behind this rank while this rank has waited collective_timeout_s (checkpoint.timeout_s in a save or
a start-up phase) is reported stuck, and its own watch thread logs its main thread's stack before it ends; a
stuck rank whose partners' collective failed first (gloo) is named the same way by explain_failure. The line
goes to a shared "abort" key, and every rank that reads it (within a beat) logs it, runs the abort callbacks
(bounded) and ends with exit status 1 through os._exit: its main thread may be stuck inside a collective. The
store's host first waits (two beats at most) until the others have read the line: its exit ends the store. A
second thread judges contact with the store itself (a store client waits for ever on a stopped host); a third
answers probes on a socket of its own (its address published with the host and pid), so that explain_failure,
called after gloo's immediate error, learns within seconds which peers are gone. Probes go rank to rank, not
through the store: they add no load to the store, and no store call waits on a key, since a waiting store
client logs a C++ stack trace when the store's host dies (as it does when rank 0 is lost).

A rank that finishes says so in the store before it stops beating, so it is never reported; rank 0, when it
hosts the store, keeps it up until the others have left (at most the timeout), and once rank 0 has left
the others stop watching: no collective of the world can be pending any more.

The store is the TCPStore of env:// at MASTER_ADDR:MASTER_PORT: hosted by rank 0 under the deepspeed
launcher and srun, by torchrun's agent when TORCHELASTIC_USE_AGENT_STORE=True (torchrun then points
MASTER_ADDR/MASTER_PORT at it). Each thread opens its own client (torch.distributed.TCPStore with
is_master=False): a client runs one request at a time, so the process group's client (reachable only
through the private distributed_c10d._get_default_store) would queue a heartbeat behind a long wait of the
main thread; and torch.distributed.rendezvous("env://") would, on rank 0, start a second server once the
first is gone. Keys live under txl_watchdog/<the round's keys>/ where the ranks joined torchrun's store
(txl_dist/rendezvous.py: the same on every node), else txl_watchdog/<torchelastic run id>/<restart count>/
<generation>/.

Uses only torch.distributed, the standard library and txl_dist/rank_probe.py.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from . import rank_probe
from .errors import LOGGER_NAME

MAX_BEAT_PERIOD_S = 10.0
STORE_CALL_S = 3.0
"""Timeout of the main thread's store calls (explain_failure, stop): an answer within a few seconds."""
PROBE_WAIT_S = 3.0
"""How long explain_failure waits for a probed rank to answer before it counts the rank as gone."""
INFO_POLL_S = 0.1
"""How often the beat thread reads the store while a neighbour's or rank 0's host and pid are still unknown."""
INFO_START_WAIT_S = 5.0
"""How long start-up waits for the neighbours' and rank 0's host and pid (they publish within milliseconds)."""
ABORT_CALLBACK_BOUND_S = 5.0
EXIT_AFTER_FAILURE_S = 30.0
"""After explain_failure, the process ends with status 1 within max(collective timeout, this) even if tearing
down the groups hangs."""
ENDED_CHECK_AFTER_BEATS = 2
"""A neighbour (or the store's host) silent for this many beats is checked for an ended process each beat."""
READERS_WAIT_BEATS = 2
"""How long the store's host, ending the job, waits for the other ranks to read why: each reads within a beat."""
STUCK_AFTER_BEATS = 2
"""A beating neighbour behind this rank's progress is stuck once its position has not moved for this many
beats and this rank has waited its patience (collective_timeout_s unless its note says) since its own note."""
BEHIND_WARNING_SHARE = 0.5
"""A neighbour that would be reported stuck at this rank's patience is warned about at this share of it."""
START_LABEL = "start-up"
"""Where a rank that has noted no progress yet is."""
START_UP: tuple[int, ...] = (0, 0)
"""The positions of start-up's phases are START_UP + (k,): after no note, before evaluation segments (0, i)
and micro batches (n,)."""
Position = tuple[int, ...]
"""Where a rank is in the work all ranks do alike, ordered as tuples are (note_progress)."""
MAX_NAMED = 4
MAX_CANDIDATES = 64
STORE_ERRORS = (RuntimeError, OSError)  # dist.DistError (store and network errors) derives from RuntimeError
# A collective that failed says so in one of these (gloo's tcp transport, NCCL, the process group wrappers).
COLLECTIVE_MARKERS = ("gloo", "nccl", "processgroup", "connection closed by peer", "connection reset by peer")
_PEER_ADDRESS = re.compile(r"\[(?:::ffff:)?([0-9A-Fa-f:.]+)\]:\d+")
T = TypeVar("T")


def beat_period(collective_timeout_s: float) -> float:
    """Seconds between heartbeats: a sixth of the timeout, at most 10 s."""
    return min(MAX_BEAT_PERIOD_S, collective_timeout_s / 6)


def ring_neighbours(rank: int, world_size: int) -> list[int]:
    """The ranks `rank` watches: the one before and the one after it, around the ring."""
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})


@dataclass(frozen=True)
class StoreAddress:
    """Where the rendezvous store listens, and who hosts it."""

    host: str
    port: int
    hosted_by_rank0: bool
    """False under torchrun, whose agent hosts the store (and outlives the ranks)."""


def store_address(master_addr: str, master_port: int, environ=None) -> StoreAddress:
    """The env:// store at MASTER_ADDR:MASTER_PORT; the agent's when torchrun says so (as torch itself reads it)."""
    environ = os.environ if environ is None else environ
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return StoreAddress(master_addr, master_port, hosted_by_rank0=not agent)


@dataclass(frozen=True)
class RankInfo:
    """What a rank publishes at start, so a report can name it and, on the same machine, look at its process."""

    rank: int
    host: str
    pid: int
    machine: str | None
    """Boot id and pid namespace: equal on two ranks when their pids can be compared."""
    probe_port: int | None = None
    addresses: tuple[str, ...] = ()
    """Where its probe thread answers: this port at any of these addresses (txl_dist/rank_probe.py)."""

    def label(self) -> str:
        """'rank 1 (host h, pid 123)'."""
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    def probe_targets(self) -> list[tuple[str, int]]:
        """Where to probe it from this process: its host's addresses, and loopback on the same machine."""
        if self.probe_port is None:
            return []
        same_machine = self.machine is not None and self.machine == _this_machine()
        return [(a, self.probe_port) for a in [*self.addresses, *(["127.0.0.1"] if same_machine else [])]]


def _this_machine() -> str | None:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def process_state(info: RankInfo) -> str | None:
    """'ended', 'stopped' or 'running' when `info`'s process is visible from here (same machine and pid
    namespace), else None. An unreaped (zombie) or exiting process counts as ended."""
    if info.machine is None or info.machine != _this_machine():
        return None
    try:
        stat = Path(f"/proc/{info.pid}/stat").read_text()
    except FileNotFoundError:
        return "ended"
    except OSError:
        return None
    return state_of_stat(stat)


PF_EXITING = 0x4
"""Set in a process's flags (/proc/PID/stat field 9) when it starts to exit, before its sockets close."""


def state_of_stat(stat: str) -> str:
    """'ended', 'stopped' or 'running' from the text of /proc/PID/stat.

    A process killed while a peer waits on it closes its sockets (the peer's collective fails at once)
    before it becomes a zombie; in between its state letter still says running, but PF_EXITING is set, so
    the peer that looks in that moment names it as ended too (seen on a loaded machine)."""
    fields = stat.rsplit(")", 1)[-1].split()  # the command name (in parentheses) may hold spaces
    state, flags = fields[0], int(fields[6])
    if state in ("Z", "X") or flags & PF_EXITING:
        return "ended"
    return "stopped" if state in ("T", "t") else "running"


def has_ended(info: RankInfo, probe_wait_s: float) -> bool:
    """Whether `info`'s process has certainly ended: this machine's process table says so, or, on another
    machine, its probe port is refused at every address it published. A stopped or hung process, or a host
    that does not answer, is not certain: those wait for the timeout."""
    state = process_state(info)
    if state is not None:
        return state == "ended"
    answers = rank_probe.probe({info.rank: info.probe_targets()}, {info.rank: rank_probe.token(info.rank, info.pid)},
                               probe_wait_s)
    return answers[info.rank] == "its process ended"


class _Keys:
    """The store keys of one job (one generation of one torchelastic attempt)."""

    def __init__(self, namespace: str):
        self.ns = namespace
        self.abort = f"{namespace}/abort"
        self.abort_readers = f"{namespace}/abort_readers"
        """How many ranks will read the abort line (all but its writer and a rank it names lost)."""
        self.abort_read = f"{namespace}/abort_read"
        self.left_count = f"{namespace}/left_count"

    def beat(self, rank: int) -> str:
        return f"{self.ns}/beat/{rank}"

    def info(self, rank: int) -> str:
        return f"{self.ns}/info/{rank}"

    def left(self, rank: int) -> str:
        return f"{self.ns}/left/{rank}"

    def address(self, ip: str) -> str:
        return f"{self.ns}/address/{ip}"

    def progress(self, rank: int) -> str:
        return f"{self.ns}/progress/{rank}"

    def stuck(self, rank: int) -> str:
        return f"{self.ns}/stuck/{rank}"


def _connect(address: StoreAddress, timeout_s: float) -> dist.TCPStore:
    """A new client of the store. A plain socket tries the port first: against a closed port the store
    client retries for seconds and logs a stack trace each time; the socket fails at once, quietly."""
    with socket.create_connection((address.host, address.port), timeout=timeout_s):
        pass
    return dist.TCPStore(address.host, address.port, None, False, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _bounded(fn: Callable[[], T], seconds: float) -> T:
    """fn(), or TimeoutError after `seconds`: a store client waits for ever on a host that is stopped (SIGSTOP),
    whatever its timeout says, so the main thread makes its store calls through here."""
    box: dict[str, object] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="txl-watchdog-call")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip()[:300] if lines and lines[0].strip() else type(exc).__name__


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 8:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a failed collective or a lost rendezvous store."""
    for e in _exception_chain(exc):
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, RuntimeError) and any(m in str(e).lower() for m in COLLECTIVE_MARKERS):
            return True
    return False


def _peer_address(exc: BaseException) -> str | None:
    """The peer address gloo names ('Connection closed by peer [10.0.0.7]:41234'), if any."""
    for e in _exception_chain(exc):
        m = _PEER_ADDRESS.search(str(e))
        if m:
            return m.group(1)
    return None


def _local_addresses(master_addr: str, interfaces: list[str]) -> list[str]:
    """This host's addresses as a peer's error may name them: the route to the store's (loopback when the
    store is on this machine's loopback, as the peers here then see it), the host name's and its interfaces'."""
    found: set[str] = set(interfaces)
    outgoing = rank_probe.outgoing_address(master_addr)
    if outgoing:
        found.add(outgoing)
    try:
        found.update(sa[0] for *_, sa in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return sorted(found)[:rank_probe.MAX_ADDRESSES + 4]


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


class Watchdog:
    """One rank's heartbeat and watch (see the module docstring); start() and stop() drive it."""

    def __init__(self, rank: int, world_size: int, address: StoreAddress, collective_timeout_s: float,
                 log: logging.Logger, callbacks: list[Callable[[], None]], round_keys: str | None = None):
        self.rank, self.world_size, self.address = rank, world_size, address
        self.timeout_s = collective_timeout_s
        self.period = beat_period(collective_timeout_s)
        self.log = log
        self.callbacks = callbacks
        self.watched = ring_neighbours(rank, world_size)
        self.hosts_store = address.hosted_by_rank0 and rank == 0
        self.infos: dict[int, RankInfo] = {}
        self._claim_lock = threading.Lock()
        self._claimed_by: str | None = None  # "watchdog", "explain" or "finish": whoever reports first
        self._stopping = threading.Event()
        self._host_left_at: float | None = None  # when this rank saw rank 0, the store's host, leave
        self._store_lost = False
        self._last_contact = time.monotonic()
        # (position, label, when, patience) this rank noted last (note_progress, main thread); a tuple replaced
        # whole, so the beat thread reads one consistent value.
        self._progress: tuple[Position, str, float, float] = ((), START_LABEL, time.monotonic(), collective_timeout_s)
        self._published: Position = ()
        self._seen_progress: dict[int, tuple[Position, float]] = {}  # neighbour -> (its position, when first read)
        self._warned: set[tuple[int, Position, Position]] = set()  # (neighbour, its position, this rank's)
        self._probe_server = rank_probe.ProbeServer(rank_probe.token(rank, os.getpid()))
        self._threads = {name: threading.Thread(target=self._guard, args=(loop,), daemon=True,
                                                name=f"txl-watchdog-{name}")
                         for name, loop in [("beat", self._beat_loop), ("judge", self._judge_contact),
                                            ("probe", self._answer_probes)]}
        self._threads["probe"].start()  # answers from the moment this rank's address is published
        try:
            store = _connect(address, STORE_CALL_S)
            self.keys = _Keys(f"txl_watchdog/{round_keys}" if round_keys else self._namespace(store))
            self._publish(store)
            self._await_infos(store, INFO_START_WAIT_S)
        except BaseException:
            self._stopping.set()
            self._probe_server.close()
            raise
        self._threads["beat"].start()
        self._threads["judge"].start()

    # ---------------------------------------------------------------------------------------------
    # Start

    def _namespace(self, store: dist.TCPStore) -> str:
        """Keys of this job, without the round of an agent's store that its ranks joined (round_keys; a group
        made elsewhere): a process may init and destroy several times against one store (the agent's)."""
        base = (f"txl_watchdog/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        # Every rank joins once per process group, so the W joins of one group share one quotient.
        generation = (store.add(f"{base}/joined", 1) - 1) // self.world_size
        return f"{base}/{generation}"

    def _publish(self, store: dist.TCPStore) -> None:
        interfaces = self._probe_server.addresses(self.address.host)
        me = RankInfo(self.rank, socket.gethostname(), os.getpid(), _this_machine(), self._probe_server.port,
                      tuple(interfaces))
        self.infos[self.rank] = me
        # Before the info: a peer that knows this rank's info reads its progress with one call.
        store.set(self.keys.progress(self.rank), json.dumps([[], START_LABEL]))
        store.set(self.keys.info(self.rank), json.dumps({"host": me.host, "pid": me.pid, "machine": me.machine,
                                                         "probe_port": me.probe_port,
                                                         "addresses": list(me.addresses)}))
        for ip in _local_addresses(self.address.host, interfaces):
            store.append(self.keys.address(ip), f"{self.rank},")
        store.add(self.keys.beat(self.rank), 1)

    # ---------------------------------------------------------------------------------------------
    # The threads

    def _guard(self, loop: Callable[[], None]) -> None:
        """A bug in a loop must be seen, not end the watch silently."""
        try:
            loop()
        except Exception:
            self.log.exception("the lost-rank watchdog stopped")

    def _beat_loop(self) -> None:
        store: dist.TCPStore | None = None
        seen: dict[int, tuple[int, float]] = {}  # neighbour -> (its beat count, when that count was first read)
        while True:
            try:
                store = store or _connect(self.address, self.period)
                self._beat_once(store, seen)
                self._last_contact = time.monotonic()
            except STORE_ERRORS:
                store = None  # a call that failed half-way may leave a reply in flight: connect afresh
            if self._host_left_at is not None:
                return  # rank 0 has left: no collective of the world can wait on anyone now
            # Until every neighbour and rank 0 have published, read again soon: a rank lost in the first
            # seconds (even the first collective) must still be named by host and pid.
            if self._stopping.wait(self.period if self._infos_complete() else min(self.period, INFO_POLL_S)):
                return

    def _judge_contact(self) -> None:
        """Contact with the store, judged apart from the beat thread: that one may wait for ever on a
        stopped host."""
        while not self._stopping.wait(self.period):
            if self._host_left_at is not None:
                return
            silent = time.monotonic() - self._last_contact
            if silent >= self.timeout_s:
                self._stop_job(f"contact with the rendezvous store at {self.store_description()} was lost: "
                               f"no answer for {silent:.0f} s; stopping")
            elif silent >= ENDED_CHECK_AFTER_BEATS * self.period and self._store_host_ended():
                self._stop_job(f"{self.label(0)} was lost: its process ended; {self._hosted_store()}; stopping")

    def _store_host(self) -> RankInfo | None:
        """Rank 0's host and pid when rank 0 hosts the store (and has published them)."""
        return self.infos.get(0) if self.address.hosted_by_rank0 else None

    def _hosted_store(self) -> str:
        return f"it hosted the rendezvous store at {self.address.host}:{self.address.port}"

    def _store_host_ended(self) -> bool:
        host = self._store_host() if self.rank != 0 else None
        return host is not None and has_ended(host, self._probe_wait_s())

    def _probe_wait_s(self) -> float:
        """A probe from a watch thread: short, it delays this rank's own beat."""
        return min(PROBE_WAIT_S, self.period / 2)

    def _beat_once(self, store: dist.TCPStore, seen: dict[int, tuple[int, float]]) -> None:
        store.add(self.keys.beat(self.rank), 1)
        self._publish_progress(store)
        self._read_infos(store)
        if store.check([self.keys.abort]):
            self._stop_job(_abort_line(store.get(self.keys.abort)), store=store, read=True)
            return
        if self.address.hosted_by_rank0 and self.rank != 0 and store.check([self.keys.left(0)]):
            self._host_left_at = time.monotonic()
            return
        now = time.monotonic()
        for r in list(self.watched):
            count = store.add(self.keys.beat(r), 0)
            if r not in seen or seen[r][0] != count:
                seen[r] = (count, now)
            silent = now - seen[r][1]
            if silent < ENDED_CHECK_AFTER_BEATS * self.period:
                self._judge_progress(store, r, now)  # it beats: is it stuck?
                continue
            if store.check([self.keys.left(r)]):
                # It left: finished (its silence is expected) or failed (then it set the abort key first).
                self.watched.remove(r)
                continue
            if silent >= self.timeout_s:
                self._stop_job(f"{self.label(r)} stopped responding: no heartbeat for {silent:.0f} s; stopping",
                               store=store, readers=self.world_size - 2)
            elif r in self.infos and has_ended(self.infos[r], self._probe_wait_s()):
                self._stop_job(f"{self.label(r)} was lost: its process ended (no heartbeat for {silent:.0f} s); "
                               "stopping", store=store, readers=self.world_size - 2)

    def _publish_progress(self, store: dist.TCPStore) -> None:
        position, label, _, _ = self._progress
        if position != self._published:
            store.set(self.keys.progress(self.rank), json.dumps([position, label]))
            self._published = position

    def _read_progress(self, store: dist.TCPStore, rank: int) -> tuple[Position, str]:
        """The position and label `rank` noted last, as it published them (with its info)."""
        if rank not in self.infos:
            return (), START_LABEL
        position, label = json.loads(store.get(self.keys.progress(rank)))
        return tuple(position), label

    def _judge_progress(self, store: dist.TCPStore, r: int, now: float) -> None:
        """Report neighbour `r` stuck when it beats, its progress stays behind this rank's and has not moved for
        STUCK_AFTER_BEATS, and this rank has waited its patience since it noted its own (collective_timeout_s:
        on gloo the collective fails two beats later). Waiting that long, this rank is in a collective that `r`
        never reached: `r` is outside the collectives, alive and stuck."""
        position, label = self._read_progress(store, r)
        if r not in self._seen_progress or self._seen_progress[r][0] != position:
            self._seen_progress[r] = (position, now)
            return
        mine, my_label, my_since, patience = self._progress
        still, waited = now - self._seen_progress[r][1], now - my_since
        if position >= mine or still < STUCK_AFTER_BEATS * self.period or waited < BEHIND_WARNING_SHARE * patience:
            return
        if waited < patience:
            if (r, position, mine) not in self._warned:  # once: an operator may look at it while it lives
                self._warned.add((r, position, mine))
                self.log.warning("warning: %s has not gone past %s for %.0f s or more, while this rank waits in %s "
                                 "(%.0f s so far); if it does not move on, the job stops when this rank has waited "
                                 "%.0f s", self.label(r), label, still, my_label, waited, patience)
            return
        store.set(self.keys.stuck(r), "1")  # before the abort key: the stuck rank logs its stack on reading it
        self._stop_job(f"{self.label(r)} is stuck: its heartbeat goes on, but it has not gone past {label} for "
                       f"{still:.0f} s or more, while {self.label(self.rank)} has waited in {my_label} for "
                       f"{waited:.0f} s; its stack is in its log; stopping", store=store, readers=self.world_size - 1)

    def _log_main_stack(self) -> None:
        """Log where this process's main thread is: another rank found this one stuck."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame)).rstrip()
            self.log.error("this rank was found stuck; its main thread is here:\n%s", stack)

    def note_progress(self, position: Position, label: str, patience_s: float | None = None) -> None:
        """This rank has reached `position` (see the module function)."""
        self._progress = (position, label, time.monotonic(), patience_s or self.timeout_s)

    def note_start_up(self, done: str, patience_s: float | None = None) -> None:
        """This rank has done its part of the next phase of start-up (see the module function)."""
        position = self._progress[0]
        if position and position[:len(START_UP)] != START_UP:
            return  # the work has begun: a position never goes back
        phase = (position[-1] if position else 0) + 1
        self.note_progress(START_UP + (phase,), f"{START_LABEL}: {done}", patience_s)

    def _await_infos(self, store: dist.TCPStore, wait_s: float) -> None:
        """Read the neighbours' and rank 0's host and pid before the job goes on. They publish in the same
        moments (each rank right after the rendezvous), so this takes milliseconds, and a rank stopped in the
        job's first second is still named by host and pid, even rank 0, after which the store no longer
        answers. Bounded: a rank that does not publish in time is left to the beat loop's polling."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._read_infos(store)
            except STORE_ERRORS:
                return
            if self._infos_complete() or time.monotonic() >= deadline:
                return
            time.sleep(INFO_POLL_S / 5)

    def _named_ranks(self) -> list[int]:
        """The ranks whose host and pid this one keeps: its neighbours and rank 0."""
        return [*self.watched, 0]

    def _infos_complete(self) -> bool:
        return all(r in self.infos for r in self._named_ranks())

    def _read_infos(self, store: dist.TCPStore) -> None:
        """Neighbours' and rank 0's host and pid, kept here: needed to name them once the store is gone."""
        for r in self._named_ranks():
            if r not in self.infos and store.check([self.keys.info(r)]):
                self.infos[r] = self._parse_info(r, store.get(self.keys.info(r)))

    @staticmethod
    def _parse_info(rank: int, raw: bytes) -> RankInfo:
        d = json.loads(raw)
        return RankInfo(rank, d["host"], d["pid"], d.get("machine"), d.get("probe_port"),
                        tuple(d.get("addresses", ())))

    def _answer_probes(self) -> None:
        """Answer each probe (explain_failure on another rank) at once, until the watch stops."""
        self._probe_server.serve(self._stopping)

    # ---------------------------------------------------------------------------------------------
    # Reporting

    def label(self, rank: int) -> str:
        """'rank r (host h, pid p)', or 'rank r' when it never published."""
        info = self.infos.get(rank)
        return info.label() if info else f"rank {rank}"

    def store_description(self) -> str:
        """'ADDR:PORT (hosted by rank 0 (host h, pid p))' or 'ADDR:PORT (hosted by the launcher's agent)'."""
        host = self.label(0) if self.address.hosted_by_rank0 else "the launcher's agent"
        return f"{self.address.host}:{self.address.port} (hosted by {host})"

    def _claim(self, by: str) -> bool:
        """One report per process: the first claimant reports; the others stay silent."""
        with self._claim_lock:
            if self._claimed_by is not None:
                return False
            self._claimed_by = by
            return True

    def _stop_job(self, line: str, store: dist.TCPStore | None = None, readers: int | None = None,
                  read: bool = False) -> None:
        """Log `line`, run the abort callbacks, exit with status 1. With `store`: publish the line to every rank
        (`readers`: how many other ranks will read it), or, when `read` from there, count this rank as a reader
        and log its stack if it is the one found stuck. The store's host waits for the readers before it exits
        (at most READERS_WAIT_BEATS): its exit ends the store, and a rank that had not read the line yet would
        report the host lost instead."""
        if self._stopping.is_set() or not self._claim("watchdog"):
            return
        if read:
            try:
                if store.check([self.keys.stuck(self.rank)]):
                    self._log_main_stack()
                store.add(self.keys.abort_read, 1)
            except STORE_ERRORS:
                pass
        self.log.error("error: %s", line)
        if store is not None and readers is not None:
            try:
                _bounded(lambda: self._publish_abort(store, line, readers), STORE_CALL_S)
            except STORE_ERRORS:
                pass  # the other ranks find out through their own watch
        self._run_callbacks()
        if self.hosts_store and store is not None:
            try:
                _bounded(lambda: self._await_readers(store), READERS_WAIT_BEATS * self.period + STORE_CALL_S)
            except (TimeoutError, *STORE_ERRORS):
                pass
        _flush_std()
        os._exit(1)

    def _publish_abort(self, store: dist.TCPStore, line: str, readers: int) -> None:
        entry = self._abort_entry(line)
        if store.compare_set(self.keys.abort, "", entry).decode() == entry:  # the first line wins everywhere
            store.set(self.keys.abort_readers, str(readers))
        else:
            store.add(self.keys.abort_read, 1)  # another rank's line came first: this rank is one of its readers

    def _abort_entry(self, line: str) -> str:
        """What this rank writes to the abort key: its line, after the writer's rank, so that a rank whose line
        is word for word another's (two neighbours' "no heartbeat for 61 s") knows it lost the race."""
        return f"rank {self.rank}\n{line}"

    def _await_readers(self, store: dist.TCPStore) -> None:
        deadline = time.monotonic() + READERS_WAIT_BEATS * self.period
        while time.monotonic() < deadline:
            if self._abort_read_by_all(store):
                return
            time.sleep(min(0.05, self.period / 10))

    def _run_callbacks(self) -> None:
        def run_all():
            for fn in list(self.callbacks):
                try:
                    fn()
                except Exception as e:  # one failing callback must not keep the others from running
                    self.log.warning("abort callback %s failed: %s", getattr(fn, "__name__", fn), _first_line(e))

        t = threading.Thread(target=run_all, daemon=True, name="txl-watchdog-abort")
        t.start()
        t.join(ABORT_CALLBACK_BOUND_S)

    # ---------------------------------------------------------------------------------------------
    # Explaining a failed collective (main thread)

    def explain(self, exc: BaseException) -> str:
        """One line naming the rank(s) whose loss made `exc`; also tells every other rank (abort key)."""
        if not self._claim("explain"):
            # The watch thread is reporting already and ends the process within the callbacks' bound.
            time.sleep(ABORT_CALLBACK_BOUND_S + 2)
            return f"a collective failed: {_first_line(exc)}"
        line = self._lost_store_host_line()  # first: a dying host may still accept a connection for a moment
        if line is None:
            try:
                line = _bounded(lambda: self._explain_through_store(exc), 2 * STORE_CALL_S + PROBE_WAIT_S + 2)
            except STORE_ERRORS as e:
                line = self._lost_store_host_line() or (f"contact with the rendezvous store at "
                                                        f"{self.store_description()} was lost: {_first_line(e)}")
                self._store_lost = True
        else:
            self._store_lost = True
        # Tearing the groups down after a lost rank may hang (NCCL): the process ends regardless.
        _exit_later(max(self.timeout_s, EXIT_AFTER_FAILURE_S))
        return line

    def _explain_through_store(self, exc: BaseException) -> str:
        store = _connect(self.address, STORE_CALL_S)
        published = self._published_abort(store)
        if published:
            store.add(self.keys.abort_read, 1)  # a reader of it: the store's host need not wait for this rank
            return published
        line, lost = self._diagnose(store, exc)
        self._publish_abort(store, line, readers=self.world_size - 1 - lost)
        return _abort_line(store.get(self.keys.abort))  # the first explanation wins everywhere

    def _published_abort(self, store: dist.TCPStore) -> str | None:
        return _abort_line(store.get(self.keys.abort)) if store.check([self.keys.abort]) else None

    def _diagnose(self, store: dist.TCPStore, exc: BaseException) -> tuple[str, int]:
        """The line, and how many ranks it names lost (they will not read it)."""
        candidates = self._candidates(store, exc)
        gone = self._find_gone(store, candidates)
        named = gone or self._find_stuck(store, candidates)
        if not named:
            return (f"a collective failed while ranks {sorted(candidates)} still answer "
                    f"(the failure is elsewhere): {_first_line(exc)}"), 0
        parts = [f"{self.label(r)} {why}" for r, why in sorted(named.items())[:MAX_NAMED]]
        if len(named) > MAX_NAMED:
            parts.append(f"and {len(named) - MAX_NAMED} more")
        return "; ".join(parts), len(gone)

    def _find_stuck(self, store: dist.TCPStore, candidates: set[int]) -> dict[int, str]:
        """The candidates (all still answering) whose progress is behind this rank's: this rank's collective
        timed out waiting for them outside the collectives. Each is told to log its stack."""
        mine, my_label, _, _ = self._progress
        stuck: dict[int, str] = {}
        for r in sorted(candidates):
            position, label = self._read_progress(store, r)
            if position < mine:
                store.set(self.keys.stuck(r), "1")
                stuck[r] = (f"is stuck: its process answers, but it had not gone past {label} while "
                            f"{self.label(self.rank)} waited in {my_label} until the collective timed out; "
                            "its stack is in its log")
        return stuck

    def _candidates(self, store: dist.TCPStore, exc: BaseException) -> set[int]:
        """The neighbours (gloo's ring partners), plus the ranks on the host the error names (bounded)."""
        found = set(self.watched)
        ip = _peer_address(exc)
        if ip and store.check([self.keys.address(ip)]):
            ranks = store.get(self.keys.address(ip)).decode().split(",")
            found.update(int(r) for r in ranks[:MAX_CANDIDATES] if r)
        found.discard(self.rank)
        return found

    def _find_gone(self, store: dist.TCPStore, candidates: set[int]) -> dict[int, str]:
        """Which candidates are gone and why: left the job, process ended or stopped (same machine), or no
        answer to a probe within PROBE_WAIT_S."""
        gone: dict[int, str] = {}
        probed: list[int] = []
        for r in sorted(candidates):
            if r not in self.infos and store.check([self.keys.info(r)]):
                self.infos[r] = self._parse_info(r, store.get(self.keys.info(r)))
            if store.check([self.keys.left(r)]):
                left = store.get(self.keys.left(r)).decode()
                gone[r] = ("had left the job without reporting an error" if left == "finished"
                           else "left the job after an error (its own log says why)")
                continue
            state = process_state(self.infos[r]) if r in self.infos else None
            if state in ("ended", "stopped"):
                what = "its process ended" if state == "ended" else "its process is stopped"
                gone[r] = f"was lost during a collective ({what})"
                continue
            probed.append(r)
        answers = rank_probe.probe({r: self.infos[r].probe_targets() if r in self.infos else [] for r in probed},
                                   {r: rank_probe.token(r, self.infos[r].pid) for r in probed if r in self.infos},
                                   PROBE_WAIT_S)
        for r, answer in answers.items():
            if answer != "answered":
                gone[r] = f"was lost during a collective ({answer})"
        return gone

    def _lost_store_host_line(self) -> str | None:
        """When rank 0 hosts the store and its process, on this machine, has ended or is stopped: a line
        naming it."""
        host = self._store_host()
        state = process_state(host) if host else None
        if state not in ("ended", "stopped"):
            return None
        what = "its process ended" if state == "ended" else "its process is stopped"
        return f"{host.label()} was lost during a collective ({what}); {self._hosted_store()}"

    def explained(self) -> bool:
        """Whether this process explained a failed collective (its report, not the watch thread's)."""
        with self._claim_lock:
            return self._claimed_by == "explain"

    # ---------------------------------------------------------------------------------------------
    # Stop

    def stop(self, error: str | None) -> None:
        """Leave the watch: say this rank left (finished, or failed with `error`) so no one reports it."""
        with self._claim_lock:
            claimed_by = self._claimed_by
            if claimed_by is None:
                self._claimed_by = "finish"
        if claimed_by == "watchdog":
            return  # the watch thread is ending this process now
        self._stopping.set()
        self._threads["beat"].join(1.0)  # it may be waiting on the store; a late beat does no harm
        # The probe port closes only after this rank said it left: refused probes before that would read as
        # a process that ended.
        try:
            if self._store_lost or self._host_gone():
                return  # nobody is left to tell
            abort_line = None
            if error is not None and claimed_by is None:
                abort_line = f"{self.label(self.rank)} stopped after an error: {error}"
            left_as = "failed" if error is not None or claimed_by == "explain" else "finished"
            try:
                store = _bounded(lambda: self._leave(left_as, abort_line), 2 * STORE_CALL_S)
                if self.hosts_store:
                    self._linger(store)  # the store is in this process: no stopped host to wait on
            except STORE_ERRORS:
                pass  # the store is gone: nobody is left to tell
        finally:
            self._probe_server.close()
            self._threads["probe"].join(1.0)

    def _host_gone(self) -> bool:
        """Rank 0 left long enough ago that its store may be gone (it waits for the others for at most the
        timeout): a call now would only wait and make the store client log."""
        return (self._host_left_at is not None
                and time.monotonic() - self._host_left_at > self.timeout_s - 2 * self.period)

    def _leave(self, left_as: str, abort_line: str | None) -> dist.TCPStore:
        store = _connect(self.address, STORE_CALL_S)
        if abort_line:
            store.compare_set(self.keys.abort, "", self._abort_entry(abort_line))
        store.set(self.keys.left(self.rank), left_as)
        store.add(self.keys.left_count, 1)
        return store

    def _linger(self, store: dist.TCPStore) -> None:
        """The store lives in this process: keep it up until every rank has left (bounded by the timeout),
        or, after an abort, until every rank that will read why has read it (a lost rank never leaves nor reads:
        the abort's reader count leaves it out), for a couple of beats at most."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if store.add(self.keys.left_count, 0) >= self.world_size:
                return
            if store.check([self.keys.abort]):
                if self._abort_read_by_all(store):
                    return
                deadline = min(deadline, time.monotonic() + 2 * self.period)
            time.sleep(min(0.2, self.period))

    def _abort_read_by_all(self, store: dist.TCPStore) -> bool:
        """Every reader the abort's writer counted (the ranks not lost, but itself) has read it; every other
        rank while the writer has not counted them yet."""
        expected = (int(store.get(self.keys.abort_readers)) if store.check([self.keys.abort_readers])
                    else self.world_size - 1)
        return store.add(self.keys.abort_read, 0) >= expected


def _abort_line(entry: bytes) -> str:
    """The line of an abort key's entry (Watchdog._abort_entry)."""
    return entry.decode().split("\n", 1)[-1]


def _exit_later(seconds: float) -> None:
    """End the process with status 1 after `seconds` unless it has ended by then."""
    timer = threading.Timer(seconds, lambda: (_flush_std(), os._exit(1)))
    timer.daemon = True
    timer.start()


# -------------------------------------------------------------------------------------------------
# Module interface: one watchdog per process

_current: Watchdog | None = None
_callbacks: list[Callable[[], None]] = []


def start(rank: int, world_size: int, address: StoreAddress, collective_timeout_s: float,
          log: logging.Logger | None = None, round_keys: str | None = None) -> None:
    """Publish this rank and start beating and watching; a no-op for a world of one or when running.
    `round_keys`: the round of torchrun's store that the ranks joined (rendezvous.Joined), whose keys are
    the same on every rank (each node's TORCHELASTIC_RESTART_COUNT is its own)."""
    global _current
    if world_size < 2 or _current is not None:
        return
    _current = Watchdog(rank, world_size, address, collective_timeout_s, log or logging.getLogger(LOGGER_NAME),
                        _callbacks, round_keys)


def stop(error: str | None = None) -> None:
    """Stop watching (the job is ending on this rank); `error`: the line this rank fails with, if it fails
    alone, so the other ranks stop at once with it. Forgets the abort callbacks."""
    global _current
    watchdog, _current = _current, None
    if watchdog is not None:
        watchdog.stop(error)
    _callbacks.clear()


def running() -> bool:
    """Whether this process watches its peers."""
    return _current is not None


def explained() -> bool:
    """Whether explain_failure named the loss that broke a collective of this process (leaving the groups then
    must not wait for the lost rank)."""
    return _current is not None and _current.explained()


def note_progress(position: Position, label: str, patience_s: float | None = None) -> None:
    """This rank has begun the piece of work at `position` (increasing, compared as tuples: (micro batches
    begun,) for a micro batch, (micro batches begun, 0) once its forward is done, (micro batches begun, notes
    since) for an evaluation segment or a phase of a save after it), its input in hand; `label` says it for
    people ("step 12, micro batch 2/4"). Every rank must note the same positions at the same points, just
    before the piece's collectives: a rank left behind is then one that never reached them. `patience_s`: how
    long this rank may wait there before a neighbour behind it counts as stuck; collective_timeout_s unless
    the collectives that follow have a longer timeout (a save's wait on the control group:
    checkpoint.timeout_s). Only the position and a clock reading are kept here; the beat thread publishes
    them. A no-op without a watch."""
    if _current is not None:
        _current.note_progress(position, label, patience_s)


def note_start_up(done: str, patience_s: float | None = None) -> None:
    """This rank has done its part of the next phase of the job's start (`done`, e.g. "checkpoint
    step_00000002 verified", labelled "start-up: checkpoint step_00000002 verified") and goes to wait for the
    others (distributed.together calls it): the k-th such note is position START_UP + (k,). Every rank notes
    the same phases in the same order. Ignored once a micro batch or an evaluation segment has been noted:
    positions only go forward. A no-op without a watch."""
    if _current is not None:
        _current.note_start_up(done, patience_s)


def on_abort(callback: Callable[[], None]) -> None:
    """Run `callback` (bounded by ABORT_CALLBACK_BOUND_S for all of them) before the watchdog ends the process."""
    _callbacks.append(callback)


def explain_failure(exc: BaseException) -> str | None:
    """One line naming the rank(s) whose loss made the collective that raised `exc` fail, found within a few
    seconds; None when `exc` is not a collective failure. Every other rank stops within a beat with the
    same line. The caller prints it and ends with exit status 1 (this process ends by itself if tearing
    down the groups hangs)."""
    if not is_collective_failure(exc):
        return None
    if _current is None:
        return f"a collective failed: {_first_line(exc)}"
    return _current.explain(exc)
