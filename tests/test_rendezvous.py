"""txl_dist/rendezvous.py: every rank joins the job's store before the process group exists; a rank that never
comes is named (tests/test_faults.py runs it through launch/train.py)."""
from __future__ import annotations

import re
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from dist_helpers import free_port
from txl_dist.rendezvous import JoinFailed, _missing_line, join

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}


def _agent_store() -> dist.TCPStore:
    """A store that outlives the joins, as torchrun's agent's does."""
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def test_the_missing_ranks_are_named_up_to_eight():
    line = _missing_line("0,2,5,", 64, 3, timedelta(seconds=620), "the store")
    assert line.startswith("ranks 1, 3, 4, 6, 7, 8, 9, 10 and 53 more did not join the job within 620 s: 3 of 64 "
                           "joined the store; "), line
    assert _missing_line("1,0,", 3, 2, timedelta(seconds=8), "s").startswith("rank 2 did not join the job within 8 s")


def test_ranks_that_joined_name_the_one_that_did_not(caplog):
    agent = _agent_store()
    with pytest.raises(JoinFailed, match=r"^rank 1 did not join the job within 2 s: 1 of 2 joined the rendezvous "
                                         rf"store at 127\.0\.0\.1:{agent.port} \(MASTER_ADDR:MASTER_PORT\), hosted by "
                                         "torchrun; "):
        join("127.0.0.1", agent.port, 0, 2, timedelta(seconds=2), AGENT)
    # Half-way, once: rank 0 says whom it waits for while someone can still start it.
    (warning,) = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert re.fullmatch(r"warning: waiting for rank 1 to join \(1 of 2 joined, 1 s so far\); the job stops if they "
                        r"have not joined within 2 s", warning), warning


def test_an_agents_store_serves_one_join_after_another():
    """torchrun's store outlives a process group: a second join (another group in the same job, a restart)
    counts its own ranks, not the first join's."""
    agent = _agent_store()
    for _ in range(2):
        assert join("127.0.0.1", agent.port, 0, 1, timedelta(seconds=5), AGENT) is not None
    assert agent.add("txl_join/r/agent/generation", 0) == 1


def test_a_rank_that_finds_no_store_says_where_it_looked(caplog):
    port = free_port()
    with pytest.raises(JoinFailed) as failed:
        join("127.0.0.1", port, 1, 2, timedelta(seconds=1), {})
    # Half-way, once, from rank 1 (the lowest client rank): the job's one line while rank 0 can still start.
    (warning,) = [r.getMessage() for r in caplog.records if "has not reached" in r.getMessage()]
    assert re.fullmatch(rf"warning: rank 1 \(host [^)]+\) has not reached the rendezvous store at 127\.0\.0\.1:{port} "
                        r"\(MASTER_ADDR:MASTER_PORT\), hosted by rank 0, for [01] s: rank 0 has not started it, or "
                        r"this host cannot reach that address \(a wrong MASTER_ADDR, a firewall; last try: "
                        r"\[Errno 111\] Connection refused\); the job stops if it cannot within 1 s", warning), warning
    assert re.fullmatch(rf"rank 1 \(host [^)]+\) could not reach the rendezvous store at 127\.0\.0\.1:{port} "
                        r"\(MASTER_ADDR:MASTER_PORT\), hosted by rank 0, within 1 s: rank 0 has not started it, or "
                        r"this host cannot reach that address \(a wrong MASTER_ADDR, a firewall; last try: "
                        r"\[Errno 111\] Connection refused\); stopping",
                        str(failed.value)), failed.value


def test_only_the_lowest_client_rank_warns_of_a_store_it_cannot_reach(caplog):
    """Every other rank waits quietly (a job of 4096 ranks would print 4095 lines); under torchrun's agent every
    rank is a client, rank 0 included, and rank 0 warns."""
    port = free_port()
    for rank, environ in ((2, {}), (1, AGENT)):
        with pytest.raises(JoinFailed):
            join("127.0.0.1", port, rank, 3, timedelta(seconds=1), environ)
    assert not [r for r in caplog.records if "has not reached" in r.getMessage()]
    with pytest.raises(JoinFailed):
        join("127.0.0.1", port, 0, 3, timedelta(seconds=1), AGENT)
    (warning,) = [r.getMessage() for r in caplog.records if "has not reached" in r.getMessage()]
    assert re.match(r"warning: rank 0 \(host [^)]+\) has not reached the rendezvous store at .*, hosted by "
                    r"torchrun, for [01] s: torchrun has not started it", warning), warning


def test_a_store_that_goes_away_while_the_ranks_join_ends_the_join():
    import threading

    holder = [_agent_store()]
    port, failures = holder[0].port, []

    def joining():
        try:
            join("127.0.0.1", port, 0, 2, timedelta(seconds=20), AGENT)
        except JoinFailed as e:
            failures.append(str(e))

    thread = threading.Thread(target=joining)
    thread.start()
    threading.Event().wait(0.5)
    holder.clear()  # the store's host ends
    thread.join(15)
    assert not thread.is_alive()
    assert failures and failures[0].startswith(f"rank 0 lost the rendezvous store at 127.0.0.1:{port} (MASTER_ADDR:"
                                               "MASTER_PORT), hosted by torchrun, while the ranks joined ("), failures


def test_a_second_process_with_the_same_rank_fails_at_once_and_the_rank_nobody_took_is_named():
    """RANK from a per-node number (SLURM_LOCALID on 2 nodes: 0, 1, 0, 1): the second rank 0 must not count as
    the missing rank 1."""
    import threading

    agent, first = _agent_store(), []

    def joining():
        try:
            join("127.0.0.1", agent.port, 0, 2, timedelta(seconds=3), AGENT)
        except JoinFailed as e:
            first.append(str(e))

    thread = threading.Thread(target=joining)
    thread.start()
    threading.Event().wait(0.5)
    with pytest.raises(JoinFailed, match=r"^rank 0 \(host [^)]+\) joined the job twice: another process \(host "
                                         r"[^)]+\) has the same rank; each task needs a RANK of its own"):
        join("127.0.0.1", agent.port, 0, 2, timedelta(seconds=3), AGENT)
    thread.join(10)
    assert first and first[0].startswith("rank 1 did not join the job within 3 s: 1 of 2 joined"), first


def test_a_rank_started_with_another_world_size_stops_every_rank_at_once():
    """One task with the wrong WORLD_SIZE: without the check the others would wait out the timeout for ranks
    2 and 3, which do not exist, and name them as missing."""
    import threading
    import time

    agent, first = _agent_store(), []

    def joining():
        try:
            join("127.0.0.1", agent.port, 0, 2, timedelta(seconds=30), AGENT)
        except JoinFailed as e:
            first.append((str(e), time.monotonic()))

    thread = threading.Thread(target=joining)
    thread.start()
    threading.Event().wait(0.5)
    line = (r"rank 1 \(host [^)]+\) was started with a world size of 4, rank 0 \(host [^)]+\) with 2: every task "
            r"of a job must be started with the same world size \(WORLD_SIZE, or SLURM_NTASKS under srun: one "
            r"launcher command for all nodes\); stopping")
    with pytest.raises(JoinFailed, match=f"^{line}$"):
        join("127.0.0.1", agent.port, 1, 4, timedelta(seconds=30), AGENT)
    refused_at = time.monotonic()
    thread.join(10)
    assert first and re.fullmatch(line, first[0][0]), first
    assert first[0][1] - refused_at < 5  # at once, not at the 30 s timeout


def test_a_task_too_many_is_refused_at_once_by_a_store_rank_0_hosts():
    """Three tasks for a world of two (RANK from a per-node number on too many nodes): the third, with a rank
    already taken, is told so at once instead of waiting out the timeout while the job goes on without it."""
    import threading
    import time

    port, joined = free_port(), []

    def joining(rank):
        joined.append(join("127.0.0.1", port, rank, 2, timedelta(seconds=20), {}))

    threads = [threading.Thread(target=joining, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert len(joined) == 2  # the job's group is made; rank 0's store still serves it
    began = time.monotonic()
    with pytest.raises(JoinFailed, match=r"^rank 1 \(host [^)]+\) joined the job twice: another process \(host "):
        join("127.0.0.1", port, 1, 2, timedelta(seconds=20), {})
    assert time.monotonic() - began < 5


@pytest.mark.parametrize("agent", [True, False], ids=["torchruns-store", "rank-0s-store"])
def test_a_rank_that_fails_before_it_joins_stops_the_waiting_ranks_at_once_with_its_line(agent, monkeypatch):
    """Without the line, rank 0 would wait out the join's timeout (train.collective_timeout_s, ten minutes by
    default) for a rank that ended during its start-up, and then name it as missing without saying why."""
    import threading
    import time

    from txl_dist import rendezvous

    monkeypatch.setattr(rendezvous, "_joined", False)  # another test's join in this process
    environ = AGENT if agent else {}
    agents_store = _agent_store() if agent else None  # torchrun's, up before the workers start
    port = agents_store.port if agent else free_port()
    failed = []

    def joining():
        try:
            join("127.0.0.1", port, 0, 2, timedelta(seconds=30), environ)
        except JoinFailed as e:
            failed.append((str(e), time.monotonic()))

    thread = threading.Thread(target=joining)
    thread.start()
    threading.Event().wait(1.0)  # rank 0 waits in the join
    line = "rank 1 (host h) failed while starting, before it joined the others: CUDA error; stopping"
    told_at = time.monotonic()
    assert rendezvous.tell_failure("127.0.0.1", port, 1, line, environ)
    thread.join(10)
    assert failed and failed[0][0] == line and failed[0][1] - told_at < 5, failed
    # Rank 0 outside torchrun hosts the store: nobody waits in it for rank 0, and there is no store to reach.
    assert not rendezvous.tell_failure("127.0.0.1", free_port(), 0, line, {})
    # torchrun's store outlives a round: with nobody joined yet, a line would stop the round its restart starts.
    fresh = _agent_store()
    assert not rendezvous.tell_failure("127.0.0.1", fresh.port, 1, line, AGENT)
    assert join("127.0.0.1", fresh.port, 0, 1, timedelta(seconds=5), AGENT) is not None


LAUNCHER_GONE_BEFORE_THE_JOIN = """
import os, subprocess, sys, time
# torchrun: this process's command line names it, so its worker counts it as its launcher
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2], sys.argv[3]])
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
os._exit(0)  # torchrun dying of SIGUSR1 while its workers start: its agent's store goes with it
"""
WORKER_JOINING = """
import os, sys, time
from datetime import timedelta
from txl_dist import stop_request
stop_request.catch_stop_signals()  # the first line of launch/train.py
from txl_dist.rendezvous import JoinFailed, join
open(sys.argv[2], "w").close()
while os.getppid() == int(sys.argv[1]):
    time.sleep(0.01)
started = time.monotonic()
try:
    join("127.0.0.1", int(sys.argv[3]), 1, 2, timedelta(seconds=120), {"TORCHELASTIC_USE_AGENT_STORE": "True"})
except JoinFailed as e:
    print(f"{time.monotonic() - started:.1f} {e}", flush=True)
"""


def test_a_rank_whose_launcher_died_with_its_store_stops_at_once_naming_the_launcher(tmp_path):
    """torchrun killed while its workers start takes its agent's store along: a worker that cannot reach it
    stopped only at the join's timeout (10 minutes by default), with advice about MASTER_ADDR and firewalls."""
    done = subprocess.run([sys.executable, "-c", LAUNCHER_GONE_BEFORE_THE_JOIN, WORKER_JOINING,
                           str(tmp_path / "started"), str(free_port())], capture_output=True, text=True, timeout=180)
    waited, _, line = done.stdout.strip().partition(" ")
    assert re.match(r"^rank 1 \(host [^)]+\) could not reach the rendezvous store at 127\.0\.0\.1:\d+ .*: its launcher "
                    r"\(torchrun, host [^)]+\) is gone \(it ended before the ranks joined\); stopping$", line), \
        done.stdout + done.stderr
    assert float(waited) < 60  # not the join's 120 s
