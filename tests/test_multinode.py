"""Multi-node training without Slurm, simulated on this machine: two torchrun agents (`--nnodes 2`, one rank each)
that meet through torchrun's c10d rendezvous on loopback, as two nodes of a Kubernetes or plain-SSH cluster do.

Both "nodes" share this host's name, boot id and file system here. The node-local decisions follow the launcher's
LOCAL_RANK and LOCAL_WORLD_SIZE, not host names; what a real second node changes is tested elsewhere: a run folder
that is not one folder for all ranks (tests/test_launch_env.py), the lost-rank watchdog probing ranks on another
machine instead of reading /proc (tests/test_distributed_faults.py)."""
from __future__ import annotations

import json
import shlex
import sys

import pytest

from dist_helpers import Launch, REPO, free_port, learnable_corpus, run_ranks, tiny_config, venv_bin
from txl_dist.checkpoint import read_latest

VOCAB = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return learnable_corpus(tmp_path_factory.mktemp("multinode") / "corpus", 4 * 49, VOCAB)


def _agents(worker: str, rdzv_port: int, extra: list[str]) -> list[Launch]:
    """Two torchrun agents of one job, each a "node" of one rank, running `worker` (a bash command: --no-python)."""
    cmd = [venv_bin("torchrun"), "--nnodes", "2", "--nproc-per-node", "1", *extra, "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", f"multinode-{rdzv_port}", "--no-python",
           "bash", "-c", worker]
    return [Launch(cmd) for _ in range(2)]


def test_torchrun_restarts_the_workers_of_two_nodes_after_a_lost_rank(corpus, tmp_path):
    """`torchrun --max-restarts 1` on two nodes: rank 1 is killed in step 6 (after the save of step 4); both agents
    restart their workers, which meet again through the agent's store (torchrun keeps one TCPStore for every
    round of its rendezvous) and resume from step 4 to the end. Before, the restarted ranks read the first
    attempt's process-group keys there (gloo's addresses of the dead workers): rank 1 failed with `Gloo
    connectFullMesh failed ... Connection refused`, rank 0 waited in connectFullMesh until the group's timeout,
    and the job failed; with the keys apart by TORCHELASTIC_RESTART_COUNT, it still failed in about one run of
    two: the nodes' counts differed (the next test)."""
    run = tmp_path / "run"
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(corpus, run, train={"max_steps": 10, "collective_timeout_s": 30},
                                             checkpoint={"interval": 4}, eval={"at_end": False})))
    python, args = shlex.quote(sys.executable), f"--config {shlex.quote(str(config))}"
    # The fault in the first process of each rank only (the restarted rank 1 passes step 6 again); not by
    # TORCHELASTIC_RESTART_COUNT: each node counts its own restarts, and they differ when one node's workers were
    # still well (rank 0 naming the lost rank) as the other node's torchrun started the next round.
    first = shlex.quote(str(tmp_path / "first"))
    worker = (f'cd {shlex.quote(str(REPO))} && echo "rank $RANK: restart count $TORCHELASTIC_RESTART_COUNT" && '
              f'if mkdir -p {first} && mkdir {first}/$RANK 2>/dev/null; then '
              f"exec {python} tests/fault_job.py --fault kill-at-step:1:6 -- {args}; "
              f"else exec {python} launch/train.py {args}; fi")
    agents = _agents(worker, free_port(), ["--max-restarts", "1"])
    codes = [agent.wait(timeout=240) for agent in agents]
    node0, node1 = (agent.output for agent in agents)
    assert codes == [0, 0], node0[-4000:] + node1[-4000:]
    # Node 0's first attempt ends by whichever acts first: rank 0 names the killed rank and fails (its agent restarts
    # it, counting a restart), or node 0's agent sees node 1's agent waiting in the next round and restarts rank 0
    # before it noticed (a membership change, not counted: rank 0 starts again with restart count 0).
    named = "was lost" in node0
    restarted_for_the_other_node = node0.count("rank 0: restart count 0") == 2
    assert named or restarted_for_the_other_node, node0
    assert "resumed from" in node0 and "step_00000004" in node0, node0
    assert read_latest(run / "checkpoints") == "step_00000010"


def _join_a_round(agent_port: int, restart_counts: list[str]) -> tuple[float, list[int]]:
    """Join the job as a rank that torchrun started with this node's restart count, against torchrun's store:
    the sum of an all-reduce, and the ranks whose host and pid the lost-rank watchdog found at its start."""
    import os

    import torch

    from txl_dist import distributed, watchdog

    rank = int(os.environ["RANK"])
    os.environ.update({"MASTER_PORT": str(agent_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": restart_counts[rank]})
    distributed.init_process_group(distributed.discover(), collective_timeout_s=10)
    try:
        total = distributed.all_reduce_sum(torch.ones(1)).item()
        found = sorted(watchdog._current.infos)
    finally:
        distributed.destroy_process_group()
    return total, found


def test_the_ranks_of_a_round_meet_whatever_restart_count_each_node_gives_them():
    """TORCHELASTIC_RESTART_COUNT is each node's own: a node whose workers were still well when another node's
    failed restarts them without counting (seen in the test above: the restarted ranks 0 and 1 had restart counts
    0 and 1). Two rounds against one agent's store, the second with counts 1 and 0: the ranks meet, their process
    group works (not the first round's keys), and the watchdog of each finds the other. Before, the second round's
    ranks joined under their own counts and each waited for the other until the timeout (`rank 1 did not join the
    job within 13 s`)."""
    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # outlives the rounds
    assert run_ranks(_join_a_round, 2, agent.port, ["0", "0"], timeout=120) == [(2.0, [0, 1])] * 2
    assert run_ranks(_join_a_round, 2, agent.port, ["1", "0"], timeout=120) == [(2.0, [0, 1])] * 2
