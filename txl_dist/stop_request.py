"""Why a run should stop at the next step boundary: a signal, or the launcher that started it is gone.

SIGTERM, SIGUSR1 (Slurm's warning before a time limit, `scancel --signal=USR1`) and SIGINT (Ctrl-C) only set
a flag; the trainer agrees with the other ranks at the next step boundary, saves a checkpoint and exits 0. The
entry point catches them from its first line on (catch_stop_signals): a signal that comes during start-up
(imports, the engine build) is kept and honoured after the first step, and one that comes after training
(while the MLflow run closes) does not kill the process. A second Ctrl-C, FORCE_AFTER_S or more after the
first, stops at once without saving (KeyboardInterrupt): the one that torchrun forwards on top of the
terminal's, milliseconds later, does not count. One that comes before the entry point's job has begun (the
imports of launch/train.py, seconds on a cold file system) ends the process in its handler, with the line and
the exit status entry.guarded gives it: nothing is there yet to unwind, and nothing to catch it.

The launchers handle signals sent to them alone badly: `deepspeed` (single node) has no handler and dies,
leaving its launch process and the workers running as orphans; torchrun dies of SIGUSR1 unless it is
started with `--signals-to-handle` naming it. So each worker also watches its launcher processes (the
ancestors whose command line is torchrun's, the deepspeed runner's or its launch module's): when one of
them has gone, the worker stops as if it had been signalled, saves, and exits 0, and no orphan stays. They are
noted as the entry point starts (catch_stop_signals): one that ends during the start-up is no ancestor any more
once the worker, reparented, looks for it.
Linux only (/proc); elsewhere only the signals are watched.

The jobs that have nothing to save (an evaluation, an export, generation, python -m data_prep) stop at once instead
(stop_at_once), on SIGTERM, on SIGUSR1 (a warning before a time limit is no use to a job that cannot
keep partial work) and when their launcher has gone (the same LauncherWatch, asked by a thread of its own:
the job has no step boundary to ask at): Terminated unwinds the job as Ctrl-C does, so that what it was
writing is removed, and the entry point says where it stopped and why, in one line, with exit status 143
(entry.guarded). Ctrl-C stays KeyboardInterrupt there (exit status 130).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from .errors import EXIT_INTERRUPTED, INTERRUPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
RANKS_NAMED = 4
"""Ranks a stop line names per reason; more are counted."""
FORCE_AFTER_S = 2.0
"""A Ctrl-C this long or longer after the first one aborts the job instead of waiting for its save."""
# Command-line fragments of the processes that launch workers (python -m ... or the console scripts).
LAUNCHER_MARKERS = ("torch.distributed.run", "torchrun", "deepspeed.launcher.launch", "bin/deepspeed",
                    "deepspeed.launcher.runner")
CHECK_EVERY_S = 1.0


PENDING_SIGNAL_ENV = "TXL_STOP_SIGNAL"
"""A stop signal (its name without SIG: USR1, TERM) that reached the job before this process existed, kept as if
it had come during start-up: launch/slurm/train.sbatch sets it for srun when its batch shell got SIGUSR1 before
the step started (the ranks cannot be signalled before they exist, nor safely before their handlers are set)."""

_early_signal: int | None = None
_early_launchers: LauncherWatch | None = None
"""The launchers noted by the first catch_stop_signals, for the StopRequests of this process."""
_first_interrupt: float | None = None
"""When the first Ctrl-C of this process came (time.monotonic())."""
_job_started = False
"""Whether the entry point's job has begun (note_job_started): from then on a KeyboardInterrupt is caught."""


def _note_interrupt(signum: int) -> None:
    """Ctrl-C: the first is a stop request (say so at once: the next step boundary may be far); one that comes
    FORCE_AFTER_S later is the user insisting."""
    global _first_interrupt
    if signum != signal.SIGINT:
        return
    now = time.monotonic()
    if _first_interrupt is None:
        _first_interrupt = now
        if os.environ.get("RANK", "0") == "0":
            os.write(2, b"\nCtrl-C: saving a checkpoint at the next step boundary, then exiting; press Ctrl-C again "
                        b"to stop at once without saving\n")
    elif now - _first_interrupt >= FORCE_AFTER_S:
        raise KeyboardInterrupt


def note_job_started() -> None:
    """The entry point's job begins (entry.guarded): a second Ctrl-C from now on raises KeyboardInterrupt, which
    unwinds the job and which the entry point turns into its line and exit status."""
    global _job_started
    _job_started = True


def _interrupted_before_the_job() -> NoReturn:
    """A second Ctrl-C before the job began (the entry point's imports): a KeyboardInterrupt there would end the
    process with a traceback, since no entry point catches it yet; the line and exit status it would give."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if os.environ.get("RANK", "0") == "0":  # as entry.guarded: every rank of a terminal's job has it
        os.write(2, f"error: {INTERRUPTED}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def _keep_early(signum, frame) -> None:
    global _early_signal
    try:
        _note_interrupt(signum)
    except KeyboardInterrupt:
        if not _job_started:
            _interrupted_before_the_job()
        raise
    _early_signal = signum


def launcher_gone_since_the_start() -> str | None:
    """'its launcher (...)' when one of the launchers noted by catch_stop_signals has ended, else None (and None
    before that call): for waits of the start-up that would otherwise outlast it, such as the rendezvous."""
    return _early_launchers.gone() if _early_launchers is not None else None


def catch_stop_signals() -> None:
    """From now on a stop signal is kept, not fatal: the next StopRequest picks it up (entry points call
    this first, so that a signal during start-up stops the job after its first step, with a checkpoint). The
    first call also notes the launchers of this process, so that one that ends during the start-up stops the
    job after its first step too."""
    global _early_signal, _early_launchers
    for sig in STOP_SIGNALS:
        signal.signal(sig, _keep_early)
    if _early_launchers is None:
        _early_launchers = LauncherWatch()
    pending = getattr(signal, "SIG" + os.environ.pop(PENDING_SIGNAL_ENV, ""), None)
    if pending in STOP_SIGNALS and _early_signal is None:
        _early_signal = pending


def ignore_stop_signals() -> None:
    """The job is over: SIGTERM and SIGUSR1 have nothing left to stop. Ignored at the system level, they stay
    ignored while the interpreter shuts down (which puts back the default action, death, of any signal Python
    handled): a second warning signal (scancel --signal=USR1 and Slurm's own --signal) arriving then would
    otherwise end a rank that saved, and Slurm would count the job as failed instead of requeueing it."""
    for sig in STOP_SIGNALS:
        if sig != signal.SIGINT:  # Ctrl-C during the exit still ends the process, as the user asks
            signal.signal(sig, signal.SIG_IGN)


class Terminated(KeyboardInterrupt):
    """SIGTERM (scancel, Slurm's time limit, `kill`), SIGUSR1 or the end of its launcher, to a job with nothing to
    save, raised in its main thread. A KeyboardInterrupt, so that what unwinds on Ctrl-C unwinds on it too
    (atomic.atomic_path removes its temporary file). The handler raises it bare, with `by` saying what stopped
    the job ('by SIGTERM', 'by the end of its launcher (torchrun, host h, pid 812)'); the job raises it again with its
    line: where it stopped, what it leaves."""

    def __init__(self, *args: object, by: str = "by SIGTERM") -> None:
        super().__init__(*args)
        self.by = by


AT_ONCE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What stops a job with nothing to save at once (stop_at_once); SIGINT stays Ctrl-C's KeyboardInterrupt."""

_kept_signal: int | None = None
_early_watch: LauncherWatch | None = None


def _keep_signal(signum, frame) -> None:
    global _kept_signal
    _kept_signal = signum


def catch_sigterm_early() -> None:
    """The first line of a job with nothing to save (before its slow imports): a SIGTERM, SIGUSR1 or Ctrl-C from
    now on is kept, not fatal (nor a traceback from the imports' depths); stop_at_once raises it as the job
    starts. Its launchers are noted now, so that one that ends during the imports is noticed too."""
    global _early_watch
    for sig in AT_ONCE_SIGNALS:
        signal.signal(sig, _keep_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where ignored (`job &` in a script)
        signal.signal(signal.SIGINT, _keep_signal)
    _early_watch = LauncherWatch()


class _AtOnce:
    """stop_at_once's handlers, and the thread that tells the main thread its launcher has gone."""

    def __init__(self, watch: LauncherWatch | None) -> None:
        self.watch = watch
        self.gone: str | None = None
        self.lock = threading.Lock()
        self.active = True
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        if watch is not None and watch.launchers:
            self.thread = threading.Thread(target=self._watch, name="launcher-watch", daemon=True)

    def handle(self, signum, frame) -> None:
        by = f"by the end of {self.gone}" if signum == signal.SIGTERM and self.gone else \
            f"by {signal.Signals(signum).name}"
        raise Terminated(by=by)

    def _watch(self) -> None:
        while not self.stopped.wait(CHECK_EVERY_S):
            gone = self.watch.check()
            if gone is None:
                continue
            with self.lock:  # not once the job left stop_at_once: its handler may be the default (death)
                if self.active:
                    self.gone = gone
                    # A signal, not a flag: it wakes the main thread from a wait (sleep, a socket's read) too.
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
            return

    def close(self) -> None:
        with self.lock:
            self.active = False
        self.stopped.set()


@contextmanager
def stop_at_once() -> Iterator[None]:
    """What an evaluation, an export and generation run in: SIGTERM and SIGUSR1 raise Terminated in the main
    thread (at once for one kept since catch_sigterm_early), and so does the end of a launcher of this process
    (see the module's docstring); after, the handlers the process had are back. Ctrl-C is Python's
    KeyboardInterrupt (one kept since catch_sigterm_early is raised at once)."""
    global _early_watch, _kept_signal
    watch = _early_watch or LauncherWatch()
    _early_watch = None
    if signal.getsignal(signal.SIGINT) is _keep_signal:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _kept_signal == signal.SIGINT:
        _kept_signal = None
        raise KeyboardInterrupt
    with _terminate_on(AT_ONCE_SIGNALS, watch):
        yield


@contextmanager
def _terminate_on(signals: tuple[int, ...], watch: LauncherWatch | None) -> Iterator[None]:
    """Elsewhere than in the main thread, nothing changes (Python runs handlers only there)."""
    global _kept_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    at_once = _AtOnce(watch)
    previous = {sig: signal.signal(sig, at_once.handle) for sig in signals}
    try:
        if _kept_signal in signals:
            kept, _kept_signal = _kept_signal, None
            at_once.handle(kept, None)
        if at_once.thread is not None:
            at_once.thread.start()
        yield
    finally:
        at_once.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def finish_despite_sigterm() -> None:
    """The job's result is complete (an evaluation's numbers, an export's folders): a SIGTERM or SIGUSR1 from now
    on, or the end of its launcher, is ignored, until stop_at_once puts the process's handlers back.
    Printing and writing the result take milliseconds; stopping then would lose a finished job, or leave its
    file written under a line that says nothing was."""
    if threading.current_thread() is threading.main_thread():
        for sig in AT_ONCE_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


class StopRequest:
    """Installed once per job on each rank; `reason()` says why to stop, or None."""

    def __init__(self) -> None:
        global _early_signal
        self.signal: int | None = _early_signal
        _early_signal = None
        # Noted later than the entry point's start, a launcher that has ended is not found among the ancestors.
        self._launchers = _early_launchers if _early_launchers is not None else LauncherWatch()
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        _note_interrupt(signum)
        self.signal = signum

    def reason(self) -> str | None:
        """'SIGTERM', 'the launcher ... is gone', or None; cheap enough to ask every step."""
        if self.signal is not None:
            return signal.Signals(self.signal).name
        gone = self._launchers.gone()
        return None if gone is None else f"{gone} is gone"

    def restore(self) -> None:
        """Put the previous signal handlers back (the job is over)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class LauncherWatch:
    """The launcher processes this one descends from (noted as it is made), and whether one of them has ended:
    training's StopRequest asks at each step boundary, a job with nothing to save from a thread (_AtOnce)."""

    def __init__(self) -> None:
        self.launchers = launcher_ancestors()
        self._gone: str | None = None
        self._next_check = 0.0

    def check(self) -> str | None:
        """'its launcher (torchrun, host h, pid 812)' once one of them has ended, else None (reads /proc). The host:
        on a job of several nodes, a pid alone does not say whose launcher it was."""
        if self._gone is None:
            for pid, start, name in self.launchers:
                if _start_time(pid) != start:
                    self._gone = f"its launcher ({name}, host {socket.gethostname()}, pid {pid})"
                    break
        return self._gone

    def gone(self) -> str | None:
        """check(), at most every CHECK_EVERY_S: cheap enough to ask every step."""
        now = time.monotonic()
        if self._gone is None and self.launchers and now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            return self.check()
        return self._gone


def launcher_ancestors(pid: int | None = None) -> list[tuple[int, str, str]]:
    """(pid, start time, short name) of every ancestor whose command line is a known launcher's."""
    found = []
    pid = os.getppid() if pid is None else pid
    seen = 0
    while pid > 1 and seen < 32:
        cmdline = _cmdline(pid)
        if cmdline is None:
            break
        marker = next((m for m in LAUNCHER_MARKERS if m in cmdline), None)
        if marker is not None:
            found.append((pid, _start_time(pid), marker.rsplit("/", 1)[-1]))
        pid = _parent(pid)
        seen += 1
    return found


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing parenthesis.
    return text[text.rindex(")") + 2:].split()


def _parent(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else 0


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process for good."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":  # a zombie has ended; only its exit status is left
        return None
    return fields[19]


def describe_reasons(reasons: list[str | None]) -> str:
    """The stop line's reason for the whole job from every rank's `reason()` (in rank order): the reason
    alone when every rank that has one shares it ('SIGUSR1'), else each with its ranks ('SIGTERM on rank 0;
    SIGINT on ranks 1-3'); a rank without one (told by the others) is not named."""
    by_reason: dict[str, list[int]] = {}
    for rank, reason in enumerate(reasons):
        if reason is not None:
            by_reason.setdefault(reason, []).append(rank)
    if len(by_reason) == 1:
        return next(iter(by_reason))
    return "; ".join(f"{reason} on {_ranks_text(ranks)}" for reason, ranks in by_reason.items()) or "a stop request"


def _ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1-3', 'ranks 0, 2, 5, 7 and 12 more'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:RANKS_NAMED]))
    return f"ranks {shown}" + (f" and {len(ranks) - RANKS_NAMED} more" if len(ranks) > RANKS_NAMED else "")
