"""Faults of a 2-rank job on real processes: a rank killed or stopped, the store's host stopped or killed, a
rank failing alone, ranks that finish at different times, and helpers that must not need the default group.

Each rank is a fresh `python -c` running one scenario function of this module (plain processes: the test
sends them SIGKILL and SIGSTOP and reads their exit status and stderr). A rank reports with JSON lines on
stdout; the test waits for them.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from txl_dist import distributed

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 6.0  # collective_timeout_s of the fault scenarios: a beat every second
MARGIN_S = 5.0  # start-up of the watch, one beat, a loaded 2-core machine


# ----------------------------------------------------------------------------------------------------
# Inside the ranks


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _join(collective_timeout_s: float) -> distributed.DistEnv:
    env = distributed.discover()
    distributed.setup_logging(env)
    distributed.init_process_group(env, collective_timeout_s=collective_timeout_s, control_timeout_s=60)
    return env


def wait_in_all_reduce() -> None:
    """Rank WAITER waits in an all_reduce on the default group that the other rank never joins; explains the
    error."""
    env = _join(TIMEOUT_S)
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    if env.rank != int(os.environ["WAITER"]):
        time.sleep(60)  # the test kills this rank
        return
    try:
        distributed.all_reduce_sum(torch.ones(1))
        _say(error=None)
    except RuntimeError as e:
        start = time.monotonic()
        line = distributed.explain_failure(e)
        _say(error=str(e), explained=line, explain_s=time.monotonic() - start)
    finally:
        distributed.destroy_process_group()


def wait_outside_collectives() -> None:
    """Both ranks start, then wait without a collective that could fail (as a rank does whose nccl kernel
    waits for a dead peer: nothing raises until the collective timeout)."""
    env = _join(float(os.environ["COLLECTIVE_TIMEOUT_S"]))
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    time.sleep(120)  # the test kills the other rank meanwhile
    _say(error=None)


def wait_in_control_barrier() -> None:
    """Both ranks start; then every rank that is not stopped waits in a control-group barrier (60 s)."""
    env = _join(TIMEOUT_S)
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    time.sleep(1.0)  # the test stops the other rank meanwhile
    distributed.barrier()
    _say(error=None)


def fail_alone_on_rank_1() -> None:
    """Rank 1 raises while rank 0 waits in a control-group barrier; rank 0 does what an entry point does."""
    env = _join(TIMEOUT_S)
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    try:
        if env.rank == 1:
            raise ValueError("the shard is corrupt")
        distributed.barrier()
    except RuntimeError as e:
        line = distributed.explain_failure(e)
        if line is None:
            raise
        logging.getLogger(distributed.LOGGER_NAME).error("error: %s", line)
        sys.exit(1)
    finally:
        distributed.destroy_process_group()


def interrupted_on_rank_1() -> None:
    """Both ranks run as an entry point does (entry.guarded); rank 1 stops at once on a second Ctrl-C while rank 0
    waits in a control-group barrier, where its own Ctrl-C would wait too (Python runs a signal's handler between
    bytecodes, not inside a collective)."""
    from txl_dist.entry import exit_process, guarded

    def scenario() -> int:
        env = _join(TIMEOUT_S)
        distributed.barrier()
        _say(ready=env.rank, pid=os.getpid())
        if env.rank == 1:
            raise KeyboardInterrupt  # what stop_request raises on a Ctrl-C 2 s or more after the first
        distributed.barrier()
        return 0

    exit_process(guarded(scenario, logging.getLogger(distributed.LOGGER_NAME)))


def leave_then_call_the_helpers() -> None:
    """Rank 1 leaves the job after its own failure where torch's abort leaves the groups initialized (torch 2.6
    aborts NCCL groups only: gloo's stay, with a warning), then calls the helpers that distributed.together
    calls on its way out; rank 0 waits in a barrier that rank 1 never joins."""
    import torch.distributed as dist

    env = _join(TIMEOUT_S)
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    if env.rank == 0:
        distributed.barrier()
        return
    dist.distributed_c10d._abort_process_group = lambda group=None: None  # torch 2.6 on a gloo group
    distributed.destroy_process_group(ValueError("the shard is corrupt"))
    began = time.monotonic()
    flag, everyone = distributed.any_rank(True), distributed.gather_objects("mine")
    _say(flag=flag, everyone=everyone, seconds=time.monotonic() - began)


def _make_the_teardown_hang() -> None:
    """Tearing the groups down (destroy or abort) never returns in this process; the bound is 2 s."""
    torch.distributed.destroy_process_group = lambda *args: time.sleep(600)
    torch.distributed.distributed_c10d._abort_process_group = lambda *args: time.sleep(600)
    distributed.TEARDOWN_AFTER_FAILURE_S = 2.0


def explain_then_hang_in_teardown() -> None:
    """Rank 0's all_reduce fails as the test kills rank 1; rank 0 explains it as an entry point does, and its
    groups' teardown never returns (as NCCL's may, waiting for a collective of the dead rank)."""
    env = _join(TIMEOUT_S)
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    if env.rank == 1:
        time.sleep(60)  # the test kills this rank
        return
    _make_the_teardown_hang()
    try:
        distributed.all_reduce_sum(torch.ones(1))
    except RuntimeError as e:
        logging.getLogger(distributed.LOGGER_NAME).error("error: %s", distributed.explain_failure(e))
    finally:
        distributed.destroy_process_group()
    _say(returned=True)


def fail_alone_with_a_teardown_that_hangs() -> None:
    """Rank 1 fails alone and its groups' teardown never returns (as NCCL's may, waiting for a collective in
    flight that the stopped ranks will not join)."""
    env = _join(TIMEOUT_S)
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    if env.rank == 0:
        distributed.barrier()  # rank 1 never comes: its error ends this rank within a beat
        return
    _make_the_teardown_hang()
    distributed.destroy_process_group(ValueError("the shard is corrupt"))
    _say(returned=True)


def finish_at_different_times() -> None:
    """After the last collective, rank LATE_RANK works on alone for longer than the collective timeout."""
    env = _join(float(os.environ["COLLECTIVE_TIMEOUT_S"]))
    total = distributed.all_reduce_sum(torch.ones(1))
    if env.rank == int(os.environ["LATE_RANK"]):
        time.sleep(float(os.environ["LATE_BY_S"]))
    distributed.destroy_process_group()
    _say(done=env.rank, total=total.item())


def _stuck_for_ever_here() -> None:
    """Where a stuck rank's main thread stays, as in a read that never returns; its log must show it."""
    threading.Event().wait()


def _creeping_for_ever_here() -> None:
    """The rank begins parts of unit 3 for ever (positions (2, 1), (2, 2), ...; every half second), never unit 3
    itself."""
    from txl_dist import watchdog

    for part in itertools.count(1):
        watchdog.note_progress((2, part), f"part {part} of unit 3")
        time.sleep(0.5)


def count_units_of_work() -> None:
    """Both ranks begin units of work 1..4 (note_progress with positions (1,), (2,), ...) and meet in an all_reduce
    after each; at unit 3, with WAIT_IN=sleep, the other rank waits outside any collective instead (as a host
    blocked on an nccl kernel: nothing fails before the timeout). Before unit 3 rank ODD (1 unless set) does
    what ODD_ONE says:
      slow      sleeps SLOW_S, then goes on;
      stuck     stays stuck for ever, alive and beating;
      creeping  moves on in parts of unit 3 for ever: its position never stays put long enough for the watch."""
    from txl_dist import watchdog

    env = _join(float(os.environ.get("COLLECTIVE_TIMEOUT_S", TIMEOUT_S)))
    distributed.barrier()
    _say(ready=env.rank, pid=os.getpid())
    try:
        for unit in range(1, 5):
            odd = env.rank == int(os.environ.get("ODD", "1"))
            if odd and unit == 3:
                behaviour = os.environ["ODD_ONE"]
                if behaviour == "slow":
                    time.sleep(float(os.environ["SLOW_S"]))
                elif behaviour == "stuck":
                    _stuck_for_ever_here()
                else:
                    _creeping_for_ever_here()
            watchdog.note_progress((unit,), f"unit {unit}")
            if not odd and unit == 3 and os.environ["WAIT_IN"] == "sleep":
                time.sleep(60)
            distributed.all_reduce_sum(torch.ones(1))
    except RuntimeError as e:
        line = distributed.explain_failure(e)
        _say(explained=line)
        logging.getLogger(distributed.LOGGER_NAME).error("error: %s", line)
        sys.exit(1)
    finally:
        distributed.destroy_process_group()
    _say(done=env.rank)


def helpers_with_a_device_only_default_group() -> None:
    """The default group serves CUDA tensors only (as nccl would on GPUs); the host-side helpers still work,
    also when the default group was made before (MADE_BY=caller: deepspeed.init_distributed, a script)."""
    env = distributed.discover()
    if os.environ["MADE_BY"] == "caller":
        torch.distributed.init_process_group("cuda:gloo", init_method="env://", rank=env.rank,
                                             world_size=env.world_size)
    distributed.init_process_group(env, collective_timeout_s=30, control_timeout_s=30, backend="cuda:gloo")
    from txl_dist import watchdog

    watching = watchdog.running()
    try:
        torch.distributed.all_reduce(torch.ones(1))
        default_group_on_cpu = "worked"
    except RuntimeError as e:
        default_group_on_cpu = str(e)
    out = {
        "default_group_on_cpu": default_group_on_cpu,
        "any_rank": [distributed.any_rank(env.rank == 1), distributed.any_rank(False)],
        "broadcast": distributed.broadcast_object({"from": env.rank}, src=1),
        "gathered": distributed.gather_objects(env.rank * 10),
        "together": distributed.together(lambda: env.rank + 100, "a check"),
        "watching": watching,
    }
    distributed.barrier()
    distributed.destroy_process_group()
    _say(**out)


# ----------------------------------------------------------------------------------------------------
# The test side


class Rank:
    """One rank's process, its JSON lines (stdout) and its stderr, both kept in files."""

    def __init__(self, scenario: str, rank: int, world: int, port: int, folder: Path, extra_env: dict[str, str]):
        from dist_helpers import rank_env

        self.out, self.err = folder / f"rank{rank}.out", folder / f"rank{rank}.err"
        code = f"import sys; sys.path.insert(0, 'tests'); import test_distributed_faults as t; t.{scenario}()"
        env = os.environ | rank_env(rank, world, port) | extra_env
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=out, stderr=err)

    def messages(self) -> list[dict]:
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.startswith("{")]

    def wait_for(self, key: str, timeout: float = 60.0) -> dict:
        """The first message holding `key`; fails when the rank ends or the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in self.messages() if key in m]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                found = [m for m in self.messages() if key in m]
                if found:
                    return found[0]
                pytest.fail(f"the rank ended ({self.proc.returncode}) before saying {key!r}:\n{self.stderr()}")
            time.sleep(0.05)
        pytest.fail(f"no {key!r} from the rank within {timeout:.0f} s:\n{self.stderr()}")

    def exit_status(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the rank did not end within {timeout:.0f} s:\n{self.stderr()}")

    def stderr(self) -> str:
        return self.err.read_text()

    def lines_naming(self, rank: int) -> list[str]:
        return [line for line in self.stderr().splitlines() if f"rank {rank} " in line]


@pytest.fixture
def job(tmp_path):
    """Start the ranks of a scenario: job(scenario, world=2, **env) -> [rank 0, rank 1, ...]; killed at the end of
    the test."""
    from dist_helpers import free_port

    started: list[Rank] = []

    def start(scenario: str, world: int = 2, **extra_env: str) -> list[Rank]:
        port = free_port()
        ranks = [Rank(scenario, r, world, port, tmp_path, extra_env) for r in range(world)]
        started.extend(ranks)
        return ranks

    yield start
    for r in started:
        if r.proc.poll() is None:
            r.proc.kill()  # works on a stopped process too
            r.proc.wait(10)


def test_a_killed_rank_is_named_by_the_rank_whose_collective_failed(job):
    rank0, rank1 = job("wait_in_all_reduce", WAITER="0")
    pid1 = rank1.wait_for("ready")["pid"]
    rank0.wait_for("ready")
    time.sleep(0.5)  # rank 0 is in the all_reduce by now
    killed_at = time.monotonic()
    os.kill(pid1, signal.SIGKILL)
    report = rank0.wait_for("error", timeout=30)
    elapsed = time.monotonic() - killed_at
    assert "Connection closed by peer" in report["error"]  # gloo names an address, not a rank
    assert report["explained"].startswith("rank 1 (host ")
    assert f"pid {pid1})" in report["explained"]
    assert "was lost during a collective (its process ended)" in report["explained"]
    assert report["explain_s"] < 3.0 and elapsed < 8.0, (report, elapsed)
    assert rank0.exit_status(timeout=3 * TIMEOUT_S) == 0
    assert rank0.lines_naming(1) == [], rank0.stderr()  # the watchdog stayed silent: the explanation is the report


def signal_one_rank(ranks: list[Rank], victim: int, sig: int, timeout_s: float) -> tuple[int, float, str]:
    """Once both ranks are ready, send `sig` to rank `victim`; the other rank must end with status 1 within the
    timeout plus margins, with one line naming the victim. Returns the victim's pid, the seconds the other
    rank took and that line."""
    pid = ranks[victim].wait_for("ready")["pid"]
    survivor = ranks[1 - victim]
    survivor.wait_for("ready")
    sent_at = time.monotonic()
    os.kill(pid, sig)
    status = survivor.exit_status(timeout=timeout_s + MARGIN_S + 10)
    elapsed = time.monotonic() - sent_at
    assert status == 1, survivor.stderr()
    lines = survivor.lines_naming(victim)
    assert len(lines) == 1, survivor.stderr()
    return pid, elapsed, lines[0]


def test_a_stopped_rank_ends_the_others_within_the_timeout_with_one_line(job):
    pid1, elapsed, line = signal_one_rank(job("wait_in_control_barrier"), 1, signal.SIGSTOP, TIMEOUT_S)
    assert "rank 1 (host " in line and f"pid {pid1}) stopped responding: no heartbeat for" in line
    assert line.endswith("; stopping")
    assert TIMEOUT_S - 1 < elapsed < TIMEOUT_S + MARGIN_S, elapsed


def test_a_stopped_store_host_ends_the_others_within_the_timeout(job):
    pid0, elapsed, line = signal_one_rank(job("wait_in_control_barrier"), 0, signal.SIGSTOP, TIMEOUT_S)
    assert "contact with the rendezvous store at 127.0.0.1:" in line
    assert "(hosted by rank 0 (host " in line and f"pid {pid0})) was lost: no answer for" in line
    assert elapsed < TIMEOUT_S + MARGIN_S + 2, elapsed  # store calls time out a beat late each


def test_a_killed_store_host_is_named_by_the_rank_whose_collective_failed(job):
    rank0, rank1 = job("wait_in_all_reduce", WAITER="1")
    pid0 = rank0.wait_for("ready")["pid"]
    rank1.wait_for("ready")
    time.sleep(0.5)
    killed_at = time.monotonic()
    os.kill(pid0, signal.SIGKILL)
    report = rank1.wait_for("error", timeout=30)
    elapsed = time.monotonic() - killed_at
    # The store went with rank 0; rank 0's host and pid were read while it lived.
    assert report["explained"].startswith("rank 0 (host "), report
    assert f"pid {pid0}) was lost during a collective (its process ended); it hosted the rendezvous store at " \
           "127.0.0.1:" in report["explained"]
    assert report["explain_s"] < 3.0 and elapsed < 8.0, (report, elapsed)
    assert rank1.exit_status(timeout=3 * TIMEOUT_S) == 0
    # No store call was waiting when the store went: a waiting one makes the store client log its C++ stack.
    assert "TCPStore.cpp" not in rank1.stderr() and "frame #" not in rank1.stderr(), rank1.stderr()


def test_a_rank_failing_alone_exits_when_leaving_the_group_hangs(job):
    rank0, rank1 = job("fail_alone_with_a_teardown_that_hangs")
    rank0.wait_for("ready")
    rank1.wait_for("ready")
    assert rank1.exit_status(timeout=2.0 + MARGIN_S + 5) == 1, rank1.stderr()
    assert "returned" not in rank1.out.read_text()
    lines = [line for line in rank1.stderr().splitlines() if "error: " in line]
    assert len(lines) == 1 and "the shard is corrupt" in lines[0], rank1.stderr()
    assert "(leaving the process group did not finish within 2 s:" in lines[0], lines
    assert rank0.exit_status(timeout=TIMEOUT_S) == 1, rank0.stderr()
    assert "pid " in rank0.stderr() and ") stopped after an error: the shard is corrupt" in rank0.stderr(), \
        rank0.stderr()


def test_leaving_the_group_after_a_collective_failed_is_bounded(job):
    rank0, rank1 = job("explain_then_hang_in_teardown")
    rank0.wait_for("ready")
    pid1 = rank1.wait_for("ready")["pid"]
    time.sleep(0.5)  # rank 0 is in the all_reduce by now
    killed_at = time.monotonic()
    os.kill(pid1, signal.SIGKILL)
    # Before: the watchdog's own end of such a process, max(the timeout, 30 s) after the explanation.
    assert rank0.exit_status(timeout=30) == 1, rank0.stderr()
    elapsed = time.monotonic() - killed_at
    assert elapsed < 2.0 + 3.0 + MARGIN_S, elapsed  # the bound, explain's probes, a loaded machine
    assert "returned" not in rank0.out.read_text()
    lines = [line for line in rank0.stderr().splitlines() if "error: " in line]
    assert len(lines) == 1 and "rank 1 (host " in lines[0] and "was lost during a collective" in lines[0], \
        rank0.stderr()


SLOW_TIMEOUT_S = 30.0  # a beat every 5 s: a process that ended is found after 2-3 beats, the timeout is 30 s


@pytest.mark.parametrize("killed", [1, 0], ids=["a_rank", "the_store_host"])
def test_a_killed_rank_ends_the_others_within_three_beats_where_no_collective_fails(job, killed):
    """On nccl a dead peer makes no collective fail: the others' kernels wait for it until the timeout. A
    neighbour whose beats stop and whose process has ended is reported after two beats, not the timeout."""
    # As launch/train.py runs ranks: the store client's warning as the store goes (C++ frames) stays quiet.
    ranks = job("wait_outside_collectives", COLLECTIVE_TIMEOUT_S=str(SLOW_TIMEOUT_S), TORCH_CPP_LOG_LEVEL="ERROR")
    pid, elapsed, line = signal_one_rank(ranks, killed, signal.SIGKILL, SLOW_TIMEOUT_S)
    survivor = ranks[1 - killed]
    assert f"rank {killed} (host " in line and f"pid {pid}) was lost: its process ended" in line, line
    if killed == 0:
        assert "it hosted the rendezvous store at 127.0.0.1:" in line, line
    assert line.endswith("; stopping")
    period = SLOW_TIMEOUT_S / 6
    assert elapsed < 3 * period + MARGIN_S < SLOW_TIMEOUT_S, elapsed
    assert "frame #" not in survivor.stderr(), survivor.stderr()


def test_a_rank_failing_alone_stops_the_others_at_once_with_its_error(job):
    rank0, rank1 = job("fail_alone_on_rank_1")
    rank0.wait_for("ready")
    pid1 = rank1.wait_for("ready")["pid"]
    assert rank1.exit_status(timeout=30) == 1 and "ValueError: the shard is corrupt" in rank1.stderr()
    failed_at = time.monotonic()
    assert rank0.exit_status(timeout=30) == 1
    assert time.monotonic() - failed_at < 3.0  # not the 6 s timeout: rank 1 said why it left
    # Whichever sees it first (gloo's error, then explain_failure; or the watchdog): one line, naming rank 1.
    lines = rank0.lines_naming(1)
    assert len(lines) == 1, rank0.stderr()
    assert f"pid {pid1}) stopped after an error: the shard is corrupt" in lines[0]


def test_a_rank_stopped_by_ctrl_c_is_named_as_interrupted_not_as_an_error_called_keyboardinterrupt(job):
    """Before, the rank still in the barrier ended with `rank 1 (...) stopped after an error: KeyboardInterrupt`
    (found with a terminal's second Ctrl-C during a slow save of a 2-rank job)."""
    rank0, rank1 = job("interrupted_on_rank_1")
    rank0.wait_for("ready")
    pid1 = rank1.wait_for("ready")["pid"]
    assert rank1.exit_status(timeout=30) == 130
    assert rank0.exit_status(timeout=30) == 1
    lines = rank0.lines_naming(1)
    assert len(lines) == 1, rank0.stderr()
    assert lines[0].endswith(f"pid {pid1}) stopped after an error: interrupted (Ctrl-C): stopped at once, without "
                             "saving"), lines[0]
    assert "Traceback" not in rank0.stderr() + rank1.stderr()


def test_a_rank_that_left_the_job_runs_no_more_collectives(job):
    """On torch 2.6 a rank whose load failed inside DeepSpeed left the job, then agreed on its failure
    (distributed.together) in a collective of a group its abort had left alive: rank 0, stopped meanwhile,
    closed the connection, and rank 1's line said "a collective failed: ... Connection closed by peer"
    instead of its own error."""
    rank0, rank1 = job("leave_then_call_the_helpers")
    rank0.wait_for("ready")
    said = rank1.wait_for("flag", timeout=30)
    assert said["flag"] is True and said["everyone"] == ["mine"] and said["seconds"] < 1, said
    assert rank1.exit_status(timeout=30) == 0, rank1.stderr()
    assert rank0.exit_status(timeout=30) != 0  # its barrier ends (the watchdog, or gloo's closed connection)


@pytest.mark.parametrize("late_rank", [0, 1])
def test_ranks_finishing_at_different_times_end_cleanly(job, late_rank):
    timeout = 3.0
    ranks = job("finish_at_different_times", COLLECTIVE_TIMEOUT_S=str(timeout), LATE_RANK=str(late_rank),
                LATE_BY_S=str(timeout + 1.5))
    for r in ranks:
        assert r.exit_status(timeout=60) == 0, r.stderr()
        assert r.wait_for("done")["total"] == 2.0
        assert r.lines_naming(0) == [] and r.lines_naming(1) == [], r.stderr()
        assert "stopped responding" not in r.stderr() and "rendezvous store" not in r.stderr()


def _stack_logged_by(rank: Rank) -> str:
    assert rank.exit_status(timeout=MARGIN_S + 5) == 1, rank.stderr()
    err = rank.stderr()
    assert "this rank was found stuck; its main thread is here:" in err, err
    return err


@pytest.mark.parametrize("stuck", [1, 0], ids=["a_rank", "the_store_host"])
def test_a_stuck_rank_that_still_beats_is_named_with_its_stack(job, stuck):
    """A rank alive and beating but stuck outside the collectives (a deadlock, a read that never returns; rank 0
    waiting on an MLflow server), while the other waits where nothing fails before the timeout (a host blocked
    on an nccl kernel): before, nothing named it, and on nccl the job ended by nccl's own abort. The stuck
    rank must read why before the store goes (when rank 0 finds rank 1 stuck, its exit ends the store)."""
    ranks = job("count_units_of_work", WAIT_IN="sleep", ODD=str(stuck), ODD_ONE="stuck")
    waiter = ranks[1 - stuck]
    waiter.wait_for("ready")
    pid = ranks[stuck].wait_for("ready")["pid"]
    start = time.monotonic()
    assert waiter.exit_status(timeout=TIMEOUT_S + MARGIN_S + 10) == 1, waiter.stderr()
    elapsed = time.monotonic() - start
    warning, *lines = waiter.lines_naming(stuck)  # half-way, while it lives: someone may look at it
    assert f"warning: rank {stuck} (host " in warning and f"pid {pid}) has not gone past unit 2 for " in warning
    assert re.search(r"while this rank waits in unit 3 \([3-5] s so far\); if it does not move on, the job stops "
                     rf"when this rank has waited {TIMEOUT_S:.0f} s$", warning), warning
    assert len(lines) == 1, waiter.stderr()
    assert f"rank {stuck} (host " in lines[0] and f"pid {pid}) is stuck: its heartbeat goes on, but it has not " \
        "gone past unit 2 for " in lines[0], lines
    assert f"while rank {1 - stuck} (host " in lines[0] and ") has waited in unit 3 for " in lines[0], lines
    assert lines[0].endswith("; its stack is in its log; stopping"), lines
    assert TIMEOUT_S - 1 < elapsed < TIMEOUT_S + MARGIN_S, elapsed
    err = _stack_logged_by(ranks[stuck])
    assert "in _stuck_for_ever_here" in err and "in count_units_of_work" in err, err
    assert lines[0].split("error: ", 1)[1] in err  # the same line ends it
    assert err.index("its main thread is here:") < err.index("error: "), err


def test_both_neighbours_of_a_stuck_rank_stop_the_job_with_one_line_each(job):
    """3 ranks: ranks 0 and 2 both watch rank 1 and report it within a beat of each other. Each ends with one
    line naming rank 1 (its own, or the other's read from the store); rank 2 never reports rank 0, the store's
    host, as lost, and the stuck rank reads why before the store goes."""
    ranks = job("count_units_of_work", world=3, WAIT_IN="sleep", ODD="1", ODD_ONE="stuck")
    pid1 = [r.wait_for("ready") for r in ranks][1]["pid"]
    start = time.monotonic()
    ended = {}
    for r in (0, 2):
        assert ranks[r].exit_status(timeout=TIMEOUT_S + MARGIN_S + 10) == 1, ranks[r].stderr()
        ended[r] = time.monotonic() - start
    for r in (0, 2):
        errors = [line for line in ranks[r].stderr().splitlines() if "error: " in line]
        assert len(errors) == 1, ranks[r].stderr()
        assert "rank 1 (host " in errors[0] and f"pid {pid1}) is stuck: its heartbeat goes on" in errors[0], errors
        assert "was lost" not in ranks[r].stderr() and "rendezvous store" not in ranks[r].stderr()
    assert ended[0] < TIMEOUT_S + MARGIN_S, ended
    assert "in _stuck_for_ever_here" in _stack_logged_by(ranks[1])


def test_a_stuck_rank_is_named_when_the_others_collective_times_out_first(job):
    """gloo: the waiting rank's all_reduce times out two beats after the timeout. A rank behind it whose count
    moved within the last two beats is not judged by the watch; explain_failure then names it from its
    progress, where it said 'the failure is elsewhere'."""
    rank0, rank1 = job("count_units_of_work", WAIT_IN="all_reduce", ODD_ONE="creeping")
    rank0.wait_for("ready")
    pid1 = rank1.wait_for("ready")["pid"]
    report = rank0.wait_for("explained", timeout=TIMEOUT_S + 2 * MARGIN_S + 10)
    assert report["explained"].startswith("rank 1 (host "), report
    assert f"pid {pid1}) is stuck: its process answers, but it had not gone past part " in report["explained"]
    assert " of unit 3 while rank 0 (host " in report["explained"], report
    assert "waited in unit 3 until the collective timed out; its stack is in its log" in report["explained"]
    assert rank0.exit_status(timeout=MARGIN_S + 5) == 1, rank0.stderr()
    assert "in _creeping_for_ever_here" in _stack_logged_by(rank1)


def test_a_slow_rank_is_warned_about_but_not_called_stuck(job):
    """Rank 1 sleeps 3/4 of the timeout P (beats every p = P/6). Rank 0 sees rank 1's note of unit 2 at one of its
    beats, up to 2p after the note (one beat to publish it, one to read it), and warns at the first beat from
    which it has not moved for 2 beats and rank 0 has waited P/2: by 4p = 2P/3 at the latest. Rank 1 must still be
    asleep then, and awake well before P, when rank 0 would call it stuck: a sleep of 4p (the test's first
    version) left the warning no time on a loaded machine, so the margin is p/2 on the one side and 3p/2 on the
    other, at a timeout of 12 s (p = 2 s) rather than the scenarios' 6 s."""
    timeout_s = 2 * TIMEOUT_S
    ranks = job("count_units_of_work", WAIT_IN="all_reduce", ODD_ONE="slow", COLLECTIVE_TIMEOUT_S=str(timeout_s),
                SLOW_S=str(0.75 * timeout_s))
    for r in ranks:
        assert r.exit_status(timeout=60) == 0, r.stderr()
        assert r.wait_for("done")
        assert "stuck" not in r.stderr() and "error" not in r.stderr(), r.stderr()
    # Rank 0 waited 9 of its 12 s: past half, so it said so once.
    (warning,) = ranks[0].lines_naming(1)
    assert "has not gone past unit 2 for " in warning and "the job stops when this rank has waited 12 s" in warning


@pytest.mark.parametrize("made_by", ["us", "caller"])
def test_host_side_helpers_work_when_the_default_group_serves_devices_only(job, made_by):
    ranks = job("helpers_with_a_device_only_default_group", MADE_BY=made_by)
    results = [r.wait_for("default_group_on_cpu") for r in ranks]
    for rank, out in enumerate(results):
        assert out["watching"] is True
        # What nccl-only default groups do to CPU tensors on GPUs: the helpers must not go there.
        assert "No backend type associated with device type cpu" in out["default_group_on_cpu"]
        assert out["any_rank"] == [True, False]
        assert out["broadcast"] == {"from": 1}
        assert out["gathered"] == [0, 10]
        assert out["together"] == rank + 100


# ----------------------------------------------------------------------------------------------------
# The pieces, without processes


def test_each_rank_watches_its_two_ring_neighbours():
    from txl_dist.watchdog import ring_neighbours

    assert ring_neighbours(0, 2) == [1] and ring_neighbours(1, 2) == [0]
    assert ring_neighbours(0, 4096) == [1, 4095] and ring_neighbours(7, 8) == [0, 6]


def test_the_beat_period_follows_the_timeout_up_to_ten_seconds():
    from txl_dist.watchdog import beat_period

    assert beat_period(6.0) == 1.0 and beat_period(600.0) == 10.0


def test_start_up_phases_come_before_any_work_and_never_after_it():
    """distributed.together notes each phase of start-up (watchdog.note_start_up): positions that follow
    one another and stay before the first evaluation segment (launch/eval.py's (0, 1)) and micro batch ((1,));
    a phase noted once the work has begun (a position going back) is ignored, else the ranks ahead of a stuck
    one would look behind it."""
    from txl_dist.watchdog import START_LABEL, Watchdog

    watch = Watchdog.__new__(Watchdog)  # its notes only: no store, no threads
    watch.timeout_s, watch._progress = 6.0, ((), START_LABEL, 0.0, 6.0)
    watch.note_start_up("the corpus checked", 12.0)
    assert watch._progress[0] == (0, 0, 1) and watch._progress[3] == 12.0
    watch.note_start_up("the engine built")
    assert watch._progress[:2] == ((0, 0, 2), "start-up: the engine built") and watch._progress[3] == 6.0
    first_segment, first_micro_batch = (0, 1), (1,)
    assert () < (0, 0, 1) < (0, 0, 2) < (0, 0, 10**6) < first_segment < first_micro_batch
    watch.note_progress(first_segment, "evaluation of test, segment 1")
    watch.note_start_up("too late")
    assert watch._progress[:2] == (first_segment, "evaluation of test, segment 1")


def test_a_rank_whose_abort_line_is_word_for_word_anothers_counts_itself_a_reader():
    """Two neighbours of a silent rank report it in the same second with the same words: the second must know
    its line lost the race and count itself as a reader of the first, or the store's host waits out its bound
    (READERS_WAIT_BEATS) before it exits. Every rank reads the line alone, without the writer's mark."""
    from txl_dist.watchdog import Watchdog, _Keys

    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    line = "rank 1 (host h, pid 7) stopped responding: no heartbeat for 61 s; stopping"
    reporters = []
    for rank in (0, 2):
        watch = Watchdog.__new__(Watchdog)  # its store calls only: no threads
        watch.rank, watch.keys = rank, _Keys("test")
        reporters.append(watch)
    reporters[0]._publish_abort(store, line, readers=1)
    reporters[1]._publish_abort(store, line, readers=1)
    assert store.add(reporters[0].keys.abort_read, 0) == 1  # the second reporter, as a reader of the first
    assert store.get(reporters[0].keys.abort_readers) == b"1"
    assert reporters[1]._published_abort(store) == line


def test_the_default_groups_timeout_leaves_the_first_report_to_the_watchdog():
    """Two beats over train.collective_timeout_s; with NCCL, whose clock starts when a collective is queued
    and whose own abort is a SIGABRT, two minutes at least."""
    assert distributed.group_timeout(6.0, "gloo").total_seconds() == 8.0
    assert distributed.group_timeout(600.0, "gloo").total_seconds() == 620.0
    assert distributed.group_timeout(600.0, "cpu:gloo,cuda:nccl").total_seconds() == 720.0
    assert distributed.group_timeout(3600.0, "nccl").total_seconds() == 3720.0


def test_collective_failures_are_told_from_other_errors():
    from txl_dist.watchdog import is_collective_failure

    assert is_collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert is_collective_failure(torch.distributed.DistNetworkError("Connection reset by peer"))
    wrapped = ValueError("while saving")
    wrapped.__cause__ = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error")
    assert is_collective_failure(wrapped)
    # NCCL's own words (torch raises most of them as DistBackendError, a DistError, anyway).
    for text in ("NCCL communicator was aborted on rank 1.",
                 "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran "
                 "for 620000 milliseconds before timing out.",
                 "NCCL error: remote process exited or there was a network error, NCCL version 2.27.3\n"
                 "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting",
                 "NCCL error in: ProcessGroupNCCL.cpp:2, unhandled system error (run with NCCL_DEBUG=INFO for "
                 "details), ncclSystemError"):
        assert is_collective_failure(RuntimeError(text)), text
        assert is_collective_failure(torch.distributed.DistBackendError(text)), text
    assert not is_collective_failure(RuntimeError("No backend type associated with device type cpu"))
    assert not is_collective_failure(KeyError("step"))


def test_the_store_is_the_agents_under_torchrun():
    from txl_dist.watchdog import store_address

    assert store_address("10.0.0.1", 29500, {}).hosted_by_rank0
    assert not store_address("10.0.0.1", 29500, {"TORCHELASTIC_USE_AGENT_STORE": "True"}).hosted_by_rank0


def test_a_process_state_is_read_on_this_machine_only():
    from txl_dist.watchdog import RankInfo, _this_machine, process_state

    here = _this_machine()
    assert process_state(RankInfo(0, "h", os.getpid(), here)) == "running"
    assert process_state(RankInfo(0, "h", os.getpid(), "another-boot/1")) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_state(RankInfo(0, "h", child.pid, here)) == "ended"


def test_peers_that_published_are_known_when_start_up_returns():
    """Start-up waits (bounded) for the neighbours' and rank 0's host and pid: a store host stopped right after
    start-up is named by host and pid (the beat thread's first read once came after such a stop)."""
    from datetime import timedelta

    from dist_helpers import free_port
    from txl_dist import watchdog

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    address = watchdog.StoreAddress("127.0.0.1", port, hosted_by_rank0=False)
    keys = watchdog._Keys("txl_watchdog//0/0")  # the namespace of the first group of the store
    store.set(keys.info(0), json.dumps({"host": "h0", "pid": 4321, "machine": None}))
    wd = watchdog.Watchdog(1, 2, address, 60.0, logging.getLogger("test"), callbacks=[])
    try:
        assert wd.keys.info(0) == keys.info(0)
        assert wd.label(0) == "rank 0 (host h0, pid 4321)"  # at once, not at the beat thread's first read
    finally:
        wd.stop(None)


def test_a_peer_that_publishes_late_is_known_within_a_fraction_of_a_beat(monkeypatch):
    """The beat thread reads a neighbour's and rank 0's host and pid soon after they publish, not a beat later:
    a rank that publishes after start-up stopped waiting for it is still named by host and pid."""
    from datetime import timedelta

    from dist_helpers import free_port
    from txl_dist import watchdog

    monkeypatch.setattr(watchdog, "INFO_START_WAIT_S", 0.1)  # start-up's own wait ends before rank 0 publishes
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    address = watchdog.StoreAddress("127.0.0.1", port, hosted_by_rank0=False)
    timeout_s = 60.0
    assert watchdog.beat_period(timeout_s) == 10.0
    wd = watchdog.Watchdog(1, 2, address, timeout_s, logging.getLogger("test"), callbacks=[])
    try:
        time.sleep(0.3)  # rank 1 has beaten and found nothing of rank 0
        assert 0 not in wd.infos
        store.set(wd.keys.info(0), json.dumps({"host": "h0", "pid": 4321, "machine": None}))
        deadline = time.monotonic() + 2.0
        while 0 not in wd.infos and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 0 in wd.infos and wd.label(0) == "rank 0 (host h0, pid 4321)"
    finally:
        wd.stop(None)


def test_a_process_that_is_exiting_counts_as_ended():
    """Between closing its sockets and becoming a zombie, an exiting process still shows state R: its
    PF_EXITING flag says it is going (field 9 of /proc/PID/stat)."""
    from txl_dist.watchdog import state_of_stat

    line = "4242 (python -m x) {state} 1 4242 4242 0 -1 {flags} 10 0 0 0 5 3 0 0 20 0 3 0 100 0 0"
    assert state_of_stat(line.format(state="R", flags=0x400040)) == "running"
    assert state_of_stat(line.format(state="S", flags=0x400040)) == "running"
    assert state_of_stat(line.format(state="R", flags=0x400044)) == "ended"
    assert state_of_stat(line.format(state="Z", flags=0x40040c)) == "ended"
    assert state_of_stat(line.format(state="T", flags=0x400040)) == "stopped"
    assert state_of_stat(f"{os.getpid()} (me) S 1 1 1 0 -1 4194560 1 0 0 0") == "running"


def test_probes_tell_a_live_rank_from_an_ended_and_a_stopped_one():
    """Probes go rank to rank (a store call that waits logs a C++ stack trace when the store's host dies): a
    rank whose watch runs answers at once, one that left has nobody listening, a stopped one never answers.
    The probe path is what names ranks on other machines, whose processes cannot be looked at."""
    from datetime import timedelta

    from dist_helpers import free_port
    from txl_dist import rank_probe, watchdog

    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    address = watchdog.StoreAddress("127.0.0.1", port, hosted_by_rank0=False)
    code = ("import json, logging, time; from txl_dist import watchdog as w; "
            f"wd = w.Watchdog(2, 3, w.StoreAddress('127.0.0.1', {port}, False), 60.0, logging.getLogger('t'), []); "
            "time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    wd = watchdog.Watchdog(1, 3, address, 60.0, logging.getLogger("test"), callbacks=[])
    try:
        deadline = time.monotonic() + 30
        while 2 not in wd.infos and time.monotonic() < deadline:
            wd._read_infos(store)
            time.sleep(0.1)
        me, peer = wd.infos[1], wd.infos[2]
        assert peer.pid == other.pid and peer.probe_port and me.probe_port
        targets = {1: me.probe_targets(), 2: peer.probe_targets()}
        answers = {1: rank_probe.token(1, os.getpid()), 2: rank_probe.token(2, other.pid)}
        assert ("127.0.0.1", peer.probe_port) in targets[2]  # the same machine: loopback too
        started = time.monotonic()
        assert rank_probe.probe(targets, answers, 2.0) == {1: "answered", 2: "answered"}
        assert time.monotonic() - started < 1.0
        # An answer counts only from the process probed: the same port answering with another token does not.
        assert rank_probe.probe({2: targets[2]}, {2: rank_probe.token(2, other.pid + 1)}, 0.5) == \
            {2: "no answer within 0 s to a probe"}
        os.kill(other.pid, signal.SIGSTOP)
        wd.stop(None)
        started = time.monotonic()
        assert rank_probe.probe({**targets, 3: []}, answers, 1.0) == {
            1: "its process ended", 2: "no answer within 1 s to a probe", 3: "it never said where to probe it"}
        assert time.monotonic() - started < 2.0
    finally:
        other.kill()
        other.wait(10)
        wd.stop(None)


def test_a_process_on_another_machine_has_ended_only_when_its_probe_port_refuses():
    """has_ended on a rank whose process cannot be looked at: a live probe server, one that does not answer
    (stopped, or its host gone) and a closed port; on this machine, the process table decides."""
    import threading

    from txl_dist import rank_probe, watchdog

    elsewhere = "another-boot-id/4026531836"
    live = rank_probe.ProbeServer(rank_probe.token(5, 4242))
    stopping = threading.Event()
    threading.Thread(target=live.serve, args=(stopping,), daemon=True).start()
    silent = rank_probe.ProbeServer(b"never sent")  # listens, never answers: a stopped process
    closed = rank_probe.ProbeServer(b"")
    closed.close()
    try:
        def info(port: int) -> watchdog.RankInfo:
            return watchdog.RankInfo(5, "h", 4242, elsewhere, port, ("127.0.0.1",))

        assert not watchdog.has_ended(info(live.port), 1.0)
        assert not watchdog.has_ended(info(silent.port), 0.3)
        assert watchdog.has_ended(info(closed.port), 1.0)
        here = watchdog._this_machine()
        assert not watchdog.has_ended(watchdog.RankInfo(5, "h", os.getpid(), here, closed.port, ()), 1.0)
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait(30)
        assert watchdog.has_ended(watchdog.RankInfo(5, "h", ended.pid, here, live.port, ("127.0.0.1",)), 1.0)
    finally:
        stopping.set()
        live.close()
        silent.close()


def test_a_rank_publishes_the_addresses_other_hosts_reach_it_by():
    """Not loopback (a peer on another host would reach its own machine), the route to the store first."""
    import ipaddress

    from txl_dist import rank_probe

    server = rank_probe.ProbeServer(b"x")
    try:
        addresses = server.addresses("127.0.0.1")
        assert addresses and not any(ipaddress.ip_address(a).is_loopback for a in addresses)
        via_route = rank_probe.outgoing_address("192.0.2.1")  # TEST-NET-1: only the route is looked up
        if via_route is not None:
            assert server.addresses("192.0.2.1")[0] == via_route
    finally:
        server.close()


def test_the_store_host_leaves_at_once_when_every_rank_left_or_read_the_abort_but_the_lost(monkeypatch):
    """Rank 0 hosts the store and lingers after its own exit until the others left or read why the job ends.
    A lost rank never does either: rank 0 waited out two beats (20 s at the presets' beat) after explaining a
    killed rank to nobody. Counted: the abort's readers leave the lost out, and a rank that finds the abort
    published when its own collective fails counts as a reader."""
    from txl_dist import watchdog
    from txl_dist.watchdog import Watchdog, _Keys

    def make(rank: int, world_size: int, store) -> Watchdog:
        watch = Watchdog.__new__(Watchdog)  # its store calls only: no threads
        watch.rank, watch.world_size, watch.keys = rank, world_size, _Keys(f"test-{world_size}")
        watch.timeout_s, watch.period, watch.address = 600.0, 10.0, None
        return watch

    def no_wait(seconds):
        raise AssertionError("lingered")

    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    # 2 ranks, rank 1 killed: rank 0 explains it to no reader and leaves.
    host = make(0, 2, store)
    host._publish_abort(store, "rank 1 (host h, pid 7) was lost during a collective (its process ended)", readers=0)
    store.add(host.keys.left_count, 1)
    monkeypatch.setattr(watchdog.time, "sleep", no_wait)
    host._linger(store)

    # 4 ranks, rank 3 killed, rank 0 explains it: ranks 1 and 2 find it published when their collectives fail.
    host, others = make(0, 4, store), [make(r, 4, store) for r in (1, 2)]
    host._publish_abort(store, "rank 3 (host h, pid 9) was lost during a collective (its process ended)", readers=2)
    store.add(host.keys.left_count, 1)
    monkeypatch.setattr(watchdog, "_connect", lambda address, timeout_s: store)
    for other in others:
        assert other._explain_through_store(RuntimeError("Connection closed by peer")).startswith("rank 3 ")
    host._linger(store)

    # A reader that has not read it yet keeps the store up (for two beats at most).
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    host = make(0, 4, store)
    host._publish_abort(store, "rank 3 (host h, pid 9) was lost during a collective (its process ended)", readers=2)
    store.add(host.keys.left_count, 1)
    store.add(host.keys.abort_read, 1)
    with pytest.raises(AssertionError, match="lingered"):
        host._linger(store)
