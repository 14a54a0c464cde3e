"""train.profile_steps / train.profile_ranks on 2 real gloo ranks: the chosen ranks write a Chrome trace of
exactly the window's steps and an operator table, the others nothing; the losses are those of an unprofiled
run; a job that stops inside the window writes what it recorded; bad windows are refused."""
from __future__ import annotations

import gzip
import json
import re

import pytest

from dist_helpers import learnable_corpus, run_ranks, tiny_config, train_jobs
from txl_dist.config import ConfigError, config_from_dict
from txl_dist.profiling import window_folder

VOCAB = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiling") / "corpus"
    return learnable_corpus(root, 4 * 49, VOCAB)


def _steps_in_trace(path) -> list[int]:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted(int(m.group(1)) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name")))))


def test_the_chosen_ranks_profile_the_window_and_the_numbers_do_not_change(corpus, tmp_path):
    plain = tiny_config(corpus, tmp_path / "plain")
    every_rank = tiny_config(corpus, tmp_path / "every_rank", train={"profile_steps": [2, 3], "profile_ranks": None})
    rank_1 = tiny_config(corpus, tmp_path / "rank_1", train={"profile_steps": [2, 2], "profile_ranks": [1]})
    stopped = tiny_config(corpus, tmp_path / "stopped", train={"profile_steps": [3, 4], "exit_step": 3})
    resumed = tiny_config(corpus, tmp_path / "stopped", train={"profile_steps": [3, 4]})
    rank0, rank1 = run_ranks(train_jobs, 2, [(plain, "none"), (every_rank, "none"), (rank_1, "none"),
                                             (stopped, "none"), (resumed, "auto")], timeout=600)
    assert [r["code"] for r in rank0 + rank1] == [0] * 10
    assert rank0[1]["losses"] == rank0[0]["losses"]  # bitwise: the profiler only observes
    assert rank0[2]["losses"] == rank0[0]["losses"]
    assert len(rank0[0]["losses"]) == 4
    # The profiled steps are flagged (train/profiled) on every rank, also where only a peer records: the others
    # wait for it in the step's collectives, so their step times are a profiled step's too.
    for job, steps in ((0, []), (1, [2, 3]), (2, [2])):
        for rank in (rank0, rank1):
            assert [s for s, m in rank[job]["metrics"].items() if m.get("train/profiled") == 1.0] == steps

    assert not (tmp_path / "plain" / "profile").exists()
    folder = window_folder(tmp_path / "every_rank", 2, 3)
    for rank in (0, 1):
        assert _steps_in_trace(folder / f"rank{rank:05d}.trace.json.gz") == [2, 3]
        table = (folder / f"rank{rank:05d}.ops.txt").read_text()
        assert table.startswith(f"rank {rank}, steps 2..3\nhost: operators by self CPU time")
        assert "aten::mm" in table and "ProfilerStep*" in table and "device:" not in table  # no device here
        summary = json.loads((folder / f"rank{rank:05d}.summary.json").read_text())
        assert summary["rank"] == rank and summary["summary"]["steps"] == [2, 3]
        assert summary["summary"]["device"] is None  # a CPU run: no device activity
    # The operator table and the summary go to the tracker (MLflow on rank 0); the trace (MBs) stays in the run
    # folder.
    assert rank0[1]["artifacts"] == [(str(folder / name), "profile/steps_00000002-00000003")
                                     for name in ("rank00000.ops.txt", "rank00000.summary.json")]
    assert rank0[0]["artifacts"] == [] and rank0[2]["artifacts"] == []

    folder = window_folder(tmp_path / "rank_1", 2, 2)
    assert sorted(p.name for p in folder.iterdir()) == ["rank00001.ops.txt", "rank00001.summary.json",
                                                         "rank00001.trace.json.gz"]
    assert _steps_in_trace(folder / "rank00001.trace.json.gz") == [2]

    # exit_step 3 inside the window [3, 4]: the job stops after step 3 and writes what it recorded.
    folder = window_folder(tmp_path / "stopped", 3, 4)
    assert sorted(p.name for p in folder.iterdir()) == ["rank00000.ops.txt", "rank00000.summary.json",
                                                         "rank00000.trace.json.gz"]
    assert _steps_in_trace(folder / "rank00000.trace.json.gz") == [3]
    assert (folder / "rank00000.ops.txt").read_text().startswith("rank 0, steps 3..3\n")
    assert rank0[3]["artifacts"][0] == (str(folder / "rank00000.ops.txt"), "profile/steps_00000003-00000004")
    # Resumed inside the window: the rest of it goes to a folder (and MLflow path) of its own, beside the first.
    after = window_folder(tmp_path / "stopped", 4, 4)
    assert _steps_in_trace(after / "rank00000.trace.json.gz") == [4]
    assert _steps_in_trace(folder / "rank00000.trace.json.gz") == [3]
    assert rank0[4]["artifacts"][0] == (str(after / "rank00000.ops.txt"), "profile/steps_00000004-00000004")


@pytest.mark.parametrize("train, message", [
    ({"profile_steps": [0, 2]}, "train.profile_steps: [0, 2] must be [first, last] with 1 <= first <= last"),
    ({"profile_steps": [3, 2]}, "train.profile_steps: [3, 2] must be"),
    ({"profile_steps": [2, 5]}, "<= train.max_steps (4)"),
    ({"profile_steps": [2]}, "train.profile_steps: [2] must be"),
    ({"profile_steps": [1, 2], "profile_ranks": []}, "train.profile_ranks: [] must name ranks"),
    ({"profile_steps": [1, 2], "profile_ranks": [-1]}, "train.profile_ranks: [-1] must name ranks"),
])
def test_a_bad_profile_window_is_refused_with_one_line(tmp_path, train, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(tiny_config(tmp_path / "corpus", tmp_path / "run", train=train))


def test_the_profile_settings_may_change_on_resume(tmp_path):
    plain = config_from_dict(tiny_config(tmp_path / "corpus", tmp_path / "run"))
    profiled = config_from_dict(tiny_config(tmp_path / "corpus", tmp_path / "run",
                                            train={"profile_steps": [1, 2], "profile_ranks": None}))
    assert plain.digest() == profiled.digest()


def test_profile_ranks_absent_at_this_world_size_say_no_profile(tmp_path, caplog):
    """train.profile_ranks [5] on one rank (an elastic resume may shrink the world): a warning at the start,
    no false "profiling steps ... on rank(s) 5" line and nothing written."""
    import logging

    import torch

    from txl_dist.profiling import StepProfiler

    profiler = StepProfiler([1, 2], [5], rank=0, is_main=True, world_size=1, run_dir=tmp_path,
                            device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="txl_dist"):
        profiler.announce(1)
        for step in (1, 2, 3):
            profiler.before_step(step)
            assert profiler.after_step(step) == []
        assert profiler.close(3) == []
    lines = [r.getMessage() for r in caplog.records]
    assert not any(line.startswith("profiling steps") for line in lines), lines
    assert sum("no profile" in line for line in lines) == 1, lines
    assert list(tmp_path.iterdir()) == []


def test_a_failed_analysis_keeps_the_trace_and_the_job(tmp_path, monkeypatch, caplog):
    """The trace is written first; an analysis of it that fails (a trace format this code does not know) is
    a warning, not the end of the training."""
    import logging

    import torch

    from txl_dist import profiling

    def broken(trace, rows):
        raise KeyError("traceEvents")

    monkeypatch.setattr(profiling, "analyze", broken)
    profiler = profiling.StepProfiler([1, 1], None, rank=0, is_main=True, world_size=1, run_dir=tmp_path,
                                      device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        profiler.before_step(1)
        torch.randn(8, 8).matmul(torch.randn(8, 8))
        assert profiler.after_step(1) == []
    folder = window_folder(tmp_path, 1, 1)
    assert [p.name for p in folder.iterdir()] == ["rank00000.trace.json.gz"]
    assert any("was not analysed" in r.getMessage() and "traceEvents" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("shapes", [False, True])
def test_profile_shapes_records_the_operators_input_shapes_only_when_asked(tmp_path, shapes):
    """train.profile_shapes: record_shapes costs a host-bound step under the profiler ~1.15x more time and the
    trace ~1.5x the size (docs/performance.md), so it is off unless asked for."""
    import torch

    from txl_dist.profiling import StepProfiler

    profiler = StepProfiler([1, 1], None, rank=0, is_main=True, world_size=1, run_dir=tmp_path,
                            device=torch.device("cpu"), shapes=shapes)
    assert profiler.covers(1) and not profiler.covers(2)
    profiler.before_step(1)
    torch.randn(8, 8).matmul(torch.randn(8, 8))
    profiler.after_step(1)
    with gzip.open(window_folder(tmp_path, 1, 1) / "rank00000.trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    (mm,) = [e for e in events if e.get("name") == "aten::mm"]
    assert ("Input Dims" in mm.get("args", {})) == shapes
    if shapes:
        assert mm["args"]["Input Dims"] == [[8, 8], [8, 8]]


def test_profiled_steps_are_covered_on_every_rank_unless_no_recording_rank_exists(tmp_path):
    import torch

    from txl_dist.profiling import StepProfiler

    def covered(ranks, rank, world_size):
        profiler = StepProfiler([2, 3], ranks, rank=rank, is_main=rank == 0, world_size=world_size,
                                run_dir=tmp_path, device=torch.device("cpu"))
        return [s for s in range(1, 5) if profiler.covers(s)]

    assert covered([1], 0, 2) == [2, 3]  # rank 0 waits for rank 1's profiled steps
    assert covered(None, 1, 2) == [2, 3]
    assert covered([5], 0, 2) == []  # no such rank at this world size: nothing runs under the profiler
    assert StepProfiler(None, [0], rank=0, is_main=True, world_size=1, run_dir=tmp_path,
                        device=torch.device("cpu")).covers(1) is False
