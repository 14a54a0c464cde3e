"""Checkpoint files: what a folder holds (whatever `latest` says), retention, interrupted saves and rollbacks,
checksums, RNG states, export of consolidated fp32 weights (ZeRO-3, and the fp32 masters of a bf16 stage-0
run) to native and HF folders."""
from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import learnable_corpus, learnable_stream, run_ranks, tiny_config, train_jobs, write_corpus
from txl_dist import checkpoint
from txl_dist.checkpoint import CheckpointError


def _tag(ckpt, step, complete=True, universal=False):
    """A tag as a save leaves it: a file, its rank state and (when complete) run.json with checksums."""
    tag = ckpt / checkpoint.tag_for(step)
    (tag / checkpoint.STATE_DIR).mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"weights of step %d" % step)
    if complete:
        files = {"mp_rank_00_model_states.pt": checkpoint.hash_file(tag / "mp_rank_00_model_states.pt")}
        (tag / checkpoint.STATE_DIR / checkpoint.RUN_FILE).write_text(json.dumps(_run_info(step, files)))
    if universal:
        (ckpt / (tag.name + checkpoint.UNIVERSAL_SUFFIX)).mkdir()
    return tag


def _run_info(step, files):
    """The fields of a run.json that a resume, an evaluation and an export read (checkpoint.RUN_INFO_FIELDS)."""
    return {"version": checkpoint.RUN_INFO_VERSION, "step": step, "files": files, "world_size": 1, "n_streams": 4,
            "zero_stage": 0, "tokenizer_sha256": "0" * 64, "manifest_digest": "1" * 64,
            "config": {"model": {}, "train": {}, "data": {}}}


def _names(ckpt):
    return sorted(p.name for p in ckpt.iterdir())


def test_tags_sort_by_step():
    assert checkpoint.tag_for(12) == "step_00000012"
    assert checkpoint.step_of("step_00000012") == 12
    assert checkpoint.step_of("global_step12") is None and checkpoint.step_of("step_x") is None


def test_inventory_reads_the_folder_not_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _tag(ckpt, step)
    _tag(ckpt, 40, complete=False)
    (ckpt / ".saving-step_00000050").mkdir()
    (ckpt / "latest").write_text("step_00000020\n")
    inv = checkpoint.inventory(ckpt)
    assert inv.complete == ["step_00000010", "step_00000020", "step_00000030"]
    assert inv.incomplete == ["step_00000040"] and inv.leftovers == [".saving-step_00000050"]
    assert inv.latest == "step_00000020"
    # auto takes the newest complete tag whatever `latest` says; a missing `latest` changes nothing.
    assert checkpoint.candidate_tags("auto", ckpt)[0].name == "step_00000030"
    (ckpt / "latest").unlink()
    assert [p.name for p in checkpoint.candidate_tags("auto", ckpt)] == ["step_00000030", "step_00000020",
                                                                         "step_00000010"]
    assert checkpoint.candidate_tags("none", ckpt) == []


def test_prune_keeps_the_newest_complete_tags_only(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _tag(ckpt, step, universal=step == 10)
    _tag(ckpt, 40, complete=False)  # not ours to judge: never removed by retention
    assert checkpoint.prune(ckpt, keep=2) == ["step_00000010"]
    assert _names(ckpt) == ["step_00000020", "step_00000030", "step_00000040"]  # step 10's universal copy too
    assert checkpoint.prune(ckpt, keep=0) == []
    assert checkpoint.prune(ckpt, keep=1) == ["step_00000020"]
    assert _names(ckpt) == ["step_00000030", "step_00000040"]


READER = """
import sys
from txl_dist import checkpoint
tag_dir, hold = checkpoint.resolve_and_hold(sys.argv[1])
print(tag_dir.name, flush=True)
sys.stdin.read()  # holds the tag until the test closes our stdin
"""


def _reader(path) -> subprocess.Popen:
    """Another process that chose the tag `path` names and holds it for reading (as evaluation and export do);
    the tag it chose is its first line."""
    return subprocess.Popen([sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def test_retention_keeps_a_tag_another_process_reads_until_the_next_save_after_it(tmp_path, caplog):
    import logging

    ckpt = tmp_path / "ckpt"
    for step in (10, 20):
        _tag(ckpt, step, universal=True)
    reader = _reader(ckpt)
    try:
        assert reader.stdout.readline().strip() == "step_00000020"
        _tag(ckpt, 30)  # a save while the reader loads step 20
        with caplog.at_level(logging.INFO, logger="txl_dist"):
            assert checkpoint.prune(ckpt, keep=1) == ["step_00000010"]
        assert _names(ckpt) == ["step_00000020", "step_00000020_universal", "step_00000030"]
        assert "checkpoint: keeping step_00000020 for now: another job (an evaluation, export or fork) is reading " \
               "it; the first save's retention after that job lets it go removes it" in [r.getMessage() for r in
                                                                                        caplog.records]
    finally:
        reader.communicate("", timeout=30)
    assert checkpoint.prune(ckpt, keep=1) == ["step_00000020"]  # read no more: the next save's retention
    assert _names(ckpt) == ["step_00000030"]


def test_a_tag_held_across_saves_is_said_kept_once_and_said_removed_when_it_goes(tmp_path, caplog):
    """Before, every save's retention repeated the 'keeping ... for now' line while an evaluation held the tag."""
    import logging

    ckpt = tmp_path / "ckpt"
    for step in (10, 20):
        _tag(ckpt, step)
    reader = _reader(ckpt)
    with caplog.at_level(logging.INFO, logger="txl_dist"):
        try:
            assert reader.stdout.readline().strip() == "step_00000020"
            for step in (30, 40, 50):  # three saves while the reader holds step 20
                _tag(ckpt, step)
                checkpoint.prune(ckpt, keep=1)
            assert _names(ckpt) == ["step_00000020", "step_00000050"]
        finally:
            reader.communicate("", timeout=30)
        _tag(ckpt, 60)
        assert checkpoint.prune(ckpt, keep=1) == ["step_00000020", "step_00000050"]
        _tag(ckpt, 70)
        assert checkpoint.prune(ckpt, keep=1) == ["step_00000060"]
    lines = [r.getMessage() for r in caplog.records if "step_00000020" in r.getMessage()]
    assert lines == [
        "checkpoint: keeping step_00000020 for now: another job (an evaluation, export or fork) is reading it; the "
        "first save's retention after that job lets it go removes it",
        "checkpoint: removed step_00000020, kept since an earlier save while another job read it"]


def test_a_reader_whose_tag_retention_removed_meanwhile_takes_the_newest_or_refuses_a_named_tag(tmp_path,
                                                                                               monkeypatch):
    ckpt = tmp_path / "run" / "checkpoints"
    for step in (10, 20):
        _tag(ckpt, step)
    resolve = checkpoint.resolve_path
    saves = iter([30, 40])

    def save_and_prune_after_the_choice(path):
        chosen = resolve(path)
        if chosen.name == "step_00000020":  # the choice, then a save and its retention (keep=1)
            _tag(ckpt, next(saves))
            checkpoint.prune(ckpt, keep=1)
        return chosen

    monkeypatch.setattr(checkpoint, "resolve_path", save_and_prune_after_the_choice)
    tag_dir, hold = checkpoint.resolve_and_hold(tmp_path / "run")
    hold.release()
    assert tag_dir == ckpt / "step_00000030"

    _tag(ckpt, 20)  # (a rollback's copy, say) named by the user, then removed as it is chosen
    with pytest.raises(CheckpointError, match=r"^\S+/step_00000020: removed by its run's retention \(checkpoint.keep\) "
                       r"while this job started; name a newer tag, or the run folder \(its newest tag\)$"):
        checkpoint.resolve_and_hold(ckpt / "step_00000020")


def test_a_tag_removed_between_a_readers_open_and_its_lock_is_not_held(tmp_path, monkeypatch):
    import fcntl

    ckpt = tmp_path / "ckpt"
    _tag(ckpt, 10)
    _tag(ckpt, 20)
    flock = fcntl.flock

    def prune_first(fd, op):  # retention locked, removed and let go of step 10 right after the reader's open
        if op & fcntl.LOCK_SH:
            monkeypatch.setattr(fcntl, "flock", flock)
            checkpoint.prune(ckpt, keep=1)
        return flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", prune_first)
    assert checkpoint.hold_for_reading(ckpt / "step_00000010") is None
    assert _names(ckpt) == ["step_00000020"]


def test_without_locks_retention_removes_as_before_and_a_reader_goes_on(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    ckpt = tmp_path / "ckpt"
    _tag(ckpt, 10)
    _tag(ckpt, 20)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    hold = checkpoint.hold_for_reading(ckpt / "step_00000010")
    assert hold is not None and "does not support locks" in caplog.text
    assert checkpoint.prune(ckpt, keep=1) == ["step_00000010"]
    hold.release()


def test_leftovers_are_removed_and_a_tag_moved_aside_mid_replace_comes_back(tmp_path):
    ckpt = tmp_path / "ckpt"
    _tag(ckpt, 10)
    (ckpt / ".saving-step_00000020" / "txl_state").mkdir(parents=True)  # a crash mid-save
    # A crash between moving the old step_30 aside and renaming its replacement in.
    aside = _tag(ckpt, 30)
    aside.rename(ckpt / ".replaced-step_00000030-123")
    (ckpt / "step_00000077_universal").mkdir()  # a universal copy whose tag is gone
    # A kill between retention's rename and its removal: the old tag stays gone (it still holds its run.json).
    _tag(ckpt, 5).rename(ckpt / ".replaced-step_00000005-pruned")
    (ckpt / ".latest.x1y2.tmp").write_text("step_00000030\n")  # a kill between writing `latest` and its rename
    removed = checkpoint.remove_leftovers(ckpt)
    assert sorted(removed) == [".latest.x1y2.tmp", ".replaced-step_00000005-pruned", ".replaced-step_00000030-123",
                               ".saving-step_00000020", "step_00000077_universal"]
    assert _names(ckpt) == ["step_00000010", "step_00000030"]
    assert checkpoint.verify(ckpt / "step_00000030") is None
    kinds = {name: checkpoint.leftover_kind(name) for name in removed}
    assert kinds == {".latest.x1y2.tmp": "save", ".replaced-step_00000005-pruned": "removal",
                     ".replaced-step_00000030-123": "save", ".saving-step_00000020": "save",
                     "step_00000077_universal": None}


def test_the_start_reports_a_half_pruned_tag_as_an_interrupted_removal(caplog):
    import logging

    from txl_dist.startup import _report_leftovers

    with caplog.at_level(logging.WARNING, logger="txl_dist"):
        _report_leftovers(Path("ckpt"), [".saving-step_00000020", ".replaced-step_00000005-pruned"])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["checkpoint folder ckpt: removed 1 interrupted save(s): .saving-step_00000020",
                     "checkpoint folder ckpt: finished 1 interrupted removal(s): .replaced-step_00000005-pruned"]


HOLDER = """
import sys, time
from pathlib import Path
from txl_dist.scratch import owned_scratch
with owned_scratch(Path(sys.argv[1]), "tmp") as folder:
    (folder / "output").mkdir()
    print(folder, flush=True)
    time.sleep(600)
"""


def test_a_conversion_in_progress_is_kept_and_a_killed_ones_folder_removed(tmp_path):
    """A training job's start removes a universal conversion's scratch folder only when its job is gone: an
    evaluation job (which holds no lock on the run folder) may be converting the tag right now."""
    ckpt = tmp_path / "checkpoints"
    for step in (10, 20):
        _tag(ckpt, step)
    holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt / f"step_000000{s}_universal")],
                                stdout=subprocess.PIPE, text=True) for s in (10, 20)]
    try:
        folders = [Path(h.stdout.readline().strip()) for h in holders]
        assert all(f.is_dir() and f.name.startswith(".step_000000") for f in folders)
        assert checkpoint.inventory(ckpt).leftovers == sorted(f.name for f in folders)
        holders[0].kill()
        holders[0].wait(30)
        assert checkpoint.remove_leftovers(ckpt) == [folders[0].name]
        assert not folders[0].exists() and folders[1].is_dir()
    finally:
        for h in holders:
            h.kill()
            h.wait(30)


def test_a_conversion_finished_meanwhile_by_another_job_is_used(tmp_path, monkeypatch):
    """Two jobs convert the same tag at once (two evaluations of another world size): the second to finish
    keeps the first one's copy and cleans up after itself."""
    ckpt = tmp_path / "checkpoints"
    tag = _tag(ckpt, 10)
    out = ckpt / "step_00000010_universal"

    def converter_racing_another_job(cmd, **kwargs):
        mine = Path(cmd[cmd.index("--output_folder") + 1])
        (mine / "zero").mkdir(parents=True)
        (mine.parent / "latest_universal").write_text(mine.name)
        (out / "zero").mkdir(parents=True)  # the other job's rename, while this one still converts
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(checkpoint.subprocess, "run", converter_racing_another_job)
    assert checkpoint.convert_to_universal(tag, out, zero_stage=2) is False  # theirs kept: the caller verifies it
    assert (out / "zero").is_dir()
    assert _names(ckpt) == ["step_00000010", "step_00000010_universal"]  # no scratch, no latest_universal


def test_rollback_moves_newer_tags_aside_and_never_deletes_them(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _tag(ckpt, step, universal=step == 30)
    dest, moved = checkpoint.supersede_newer(ckpt, 10)
    assert moved == ["step_00000020", "step_00000030"]
    assert dest.parent == ckpt / checkpoint.SUPERSEDED_DIR
    assert sorted(p.name for p in dest.iterdir()) == ["step_00000020", "step_00000030", "step_00000030_universal"]
    assert checkpoint.inventory(ckpt).complete == ["step_00000010"]
    assert checkpoint.supersede_newer(ckpt, 10) is None


def test_a_rollback_waits_for_a_reader_to_finish_loading_a_tag_it_moves(tmp_path, caplog):
    import threading

    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _tag(ckpt, step)
    hold = checkpoint.hold_for_reading(ckpt / "step_00000030")  # an evaluation loading step 30
    reader_done = threading.Timer(1.0, hold.release)
    reader_done.start()
    with caplog.at_level(logging.INFO):
        dest, moved = checkpoint.supersede_newer(ckpt, 10, reader_wait_s=30)
    reader_done.join()
    assert moved == ["step_00000020", "step_00000030"]
    assert sorted(p.name for p in dest.iterdir()) == moved
    assert "waiting for another job (an evaluation, export or fork) to finish loading step_00000030" in caplog.text


def test_a_rollback_past_a_stuck_reader_moves_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        _tag(ckpt, step)
    hold = checkpoint.hold_for_reading(ckpt / "step_00000030")
    with pytest.raises(CheckpointError, match=r"step_00000030: another job .* loading it for more than 0 s.*"
                                              r"nothing was moved"):
        checkpoint.supersede_newer(ckpt, 10, reader_wait_s=0.3)
    assert checkpoint.inventory(ckpt).complete == ["step_00000010", "step_00000020", "step_00000030"]
    assert not (ckpt / checkpoint.SUPERSEDED_DIR).exists()
    hold.release()
    assert checkpoint.supersede_newer(ckpt, 10, reader_wait_s=0)[1] == ["step_00000020", "step_00000030"]


def test_verify_names_a_missing_truncated_or_corrupted_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    tag = _tag(ckpt, 5)
    weights = tag / "mp_rank_00_model_states.pt"
    assert checkpoint.verify(tag) is None
    data = weights.read_bytes()
    weights.write_bytes(data[:-3])
    assert "truncated" in checkpoint.verify(tag) and str(weights) in checkpoint.verify(tag)
    weights.write_bytes(data[:-1] + b"X")
    assert "corrupted" in checkpoint.verify(tag)
    weights.unlink()
    assert "missing" in checkpoint.verify(tag)


def test_checksum_work_is_shared_by_size_and_a_listed_path_cannot_leave_the_tag(tmp_path):
    files = [("a", 100), ("b", 60), ("c", 50), ("d", 10)]
    shares = [checkpoint.share_of(files, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == ["a", "b", "c", "d"] and shares == [["a", "d"], ["b", "c"]]
    tag = _tag(tmp_path, 1)
    info = json.loads((tag / "txl_state" / "run.json").read_text())
    for bad in ("../../etc/passwd", "/etc/passwd", "txl_state/../../x"):
        info["files"] = {bad: {"bytes": 1, "sha256": "0" * 64}}
        (tag / "txl_state" / "run.json").write_text(json.dumps(info))
        with pytest.raises(CheckpointError, match="not a path inside the tag"):
            checkpoint.verify(tag)


def test_a_rank_forces_each_file_of_its_share_to_disk_while_it_hashes_them(tmp_path, monkeypatch):
    """The save's checksum pass fsyncs every file of this rank's share (on a second thread, beside the hashing)
    and returns the same digests as hashing alone; a failed fsync fails the pass instead of being lost."""
    import hashlib
    import os

    contents = {"a.pt": os.urandom(3 << 20), "b.pt": b"", "sub/c.pt": b"state" * 1000}
    for name, data in contents.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    files = [(name, len(data)) for name, data in contents.items()]
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    got = checkpoint._hash_share(tmp_path, files, 0, 1, fsync=True)
    assert got == {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                   for name, data in contents.items()}
    assert sorted(synced) == sorted(str((tmp_path / name).resolve()) for name in contents)
    assert checkpoint._hash_share(tmp_path, files, 1, 2, fsync=False) == {
        name: got[name] for name in checkpoint.share_of(files, 1, 2)}

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        checkpoint._hash_share(tmp_path, files, 0, 1, fsync=True)


def test_resolve_path_takes_a_tag_a_checkpoint_folder_or_a_run_folder(tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    _tag(ckpt, 5)
    newest = _tag(ckpt, 7)
    _tag(ckpt, 9, complete=False)
    for path in (newest, ckpt, run):
        assert checkpoint.resolve_path(path) == newest
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        checkpoint.resolve_path(ckpt / "step_00000009")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint.resolve_path(tmp_path)



@pytest.mark.parametrize("latest", ["garbage\n", "", b"\xff\xfe"])
def test_a_latest_that_names_no_tag_is_ignored_not_refused(tmp_path, latest):
    """Nothing depends on `latest`: an empty, garbage or unreadable one blocks neither resume (the newest complete
    tag), nor eval and export (resolve_path); inventory says why it is ignored, and the next save rewrites it."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    _tag(ckpt, 5)
    newest = _tag(ckpt, 7)
    path = ckpt / "latest"
    path.write_bytes(latest) if isinstance(latest, bytes) else path.write_text(latest)
    inv = checkpoint.inventory(ckpt)
    assert inv.complete == ["step_00000005", "step_00000007"] and inv.latest is None
    assert str(path) in inv.latest_problem
    assert checkpoint.read_latest(ckpt) is None
    assert checkpoint.candidate_tags("auto", ckpt)[0] == newest
    assert checkpoint.resolve_path(run) == newest and checkpoint.resolve_path(ckpt) == newest


def test_run_info_of_another_version_is_refused(tmp_path):
    tag = _tag(tmp_path, 1)
    (tag / "txl_state" / "run.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(CheckpointError, match="version 99") as refused:
        checkpoint.read_run_info(tag)
    # Read by eval, export and generate as well as by a resume: the advice names no one of them.
    assert str(refused.value) == (f"{tag / 'txl_state' / 'run.json'}: version 99 is not 2 (saved by another version "
                                  "of txl-dist); use the version that wrote it")


@pytest.mark.parametrize("content, what", [
    (b"{}", "no version"),
    (b'{"step": 1, "version": null}', "version None is not an integer"),
    (b'{"version": "2"}', "version '2' is not an integer"),
    (b'{"version": true}', "version True is not an integer"),
    (b"[2]", "not a JSON object"),
])
def test_a_run_info_without_an_integer_version_is_damaged_not_old(tmp_path, content, what):
    tag = _tag(tmp_path, 1)
    path = tag / "txl_state" / "run.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.read_run_info(tag)
    assert str(refused.value) == (f"{path}: damaged ({what}; every run.json txl-dist writes has its integer "
                                  "version); use another tag")
    assert checkpoint.verify(tag) == str(refused.value)  # eval and export report it as the tag's damage


@pytest.mark.parametrize("damage, what", [
    (lambda info: info.pop("step"), "no step"),  # a key's name with a flipped bit: "stfp"
    (lambda info: info.update(world_size="1"), "world_size '1' is not an integer"),
    (lambda info: info.update(zero_stage=True), "zero_stage True is not an integer"),
    (lambda info: info["config"].pop("model"), "its config has no model section"),
    (lambda info: info.update(step=7), "step 7, but the tag is step_00000006"),
    (lambda info: info["files"]["mp_rank_00_model_states.pt"].pop("bytes"),
     "its entry of 'mp_rank_00_model_states.pt' is not a size and a sha256"),
])
def test_a_run_info_that_parses_but_lacks_what_a_resume_reads_is_damaged(tmp_path, damage, what):
    """run.json is not in its own checksums: a damaged one that still parses passed verify, and the resume
    failed with a traceback (KeyError: 'step', in setting newer tags aside) where its field was read. It is
    now the tag's damage (refused in one line, or passed over by checkpoint.fallback)."""
    tag = _tag(tmp_path, 6)
    path = tag / "txl_state" / "run.json"
    info = json.loads(path.read_text())
    damage(info)
    path.write_text(json.dumps(info))
    expected = f"{path}: damaged ({what}); use another tag"
    assert checkpoint.verify(tag) == expected
    with pytest.raises(CheckpointError) as refused:
        checkpoint.checked_run_info(tag)
    assert str(refused.value) == expected


def test_a_run_info_that_is_not_utf8_cannot_be_read(tmp_path):
    tag = _tag(tmp_path, 1)
    (tag / "txl_state" / "run.json").write_bytes(b'{"version": 2, "x": "\xff"}')
    with pytest.raises(CheckpointError, match=r"run.json: cannot read \(.*\); use another tag"):
        checkpoint.read_run_info(tag)


def test_needs_universal_only_for_partitioned_state_of_another_world_size():
    assert checkpoint.needs_universal({"zero_stage": 2, "world_size": 2}, 1)
    assert not checkpoint.needs_universal({"zero_stage": 2, "world_size": 2}, 2)
    assert not checkpoint.needs_universal({"zero_stage": 0, "world_size": 2}, 1)


@pytest.mark.parametrize("n_streams, saved, now, rank, holders", [
    (8, 4, 2, 1, [2, 3]),     # 4 -> 2 ranks: rank 1's streams 4-7 were saved by ranks 2 and 3
    (12, 4, 3, 1, [1, 2]),    # blocks of 3 -> blocks of 4: streams 4-7 straddle saved ranks 1 and 2
    (8, 2, 4, 3, [1]),        # 2 -> 4 ranks: streams 6-7 lie in saved rank 1's block
])
def test_an_elastic_resume_reads_only_the_rank_files_that_held_its_streams(tmp_path, n_streams, saved, now, rank,
                                                                           holders):
    from txl_dist.memory import MemoryBank, merge_state_dicts
    from txl_dist.streams import streams_of_rank

    tag = tmp_path / checkpoint.tag_for(2)
    (tag / checkpoint.STATE_DIR).mkdir(parents=True)
    for r in range(saved):
        bank = MemoryBank()
        ids = list(streams_of_rank(r, n_streams, saved))
        bank.put(ids, [torch.arange(len(ids) * 6, dtype=torch.float32).reshape(len(ids), 3, 2) + 100 * ids[0]])
        path = checkpoint.rank_file(tag, r)
        if r in holders:
            torch.save({"rank": r, "mems": bank.state_dict()}, path)
        else:  # a file the resume must not open: reading it would fail
            path.write_bytes(b"not a checkpoint")
    wanted = streams_of_rank(rank, n_streams, now)
    states = checkpoint.load_holders_of(tag, wanted, n_streams=n_streams, saved_world_size=saved)
    assert [s["rank"] for s in states] == holders
    bank = MemoryBank()
    bank.load_state_dict(merge_state_dicts(s["mems"] for s in states), stream_ids=wanted)
    for s in wanted:  # stream s of saved rank r is row s - first(r) of r's chunk
        first = streams_of_rank(s * saved // n_streams, n_streams, saved)[0]
        expected = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 6 * (s - first) + 100 * first
        assert torch.equal(bank.stream_mems(s)[0], expected)


def test_a_rank_file_that_cannot_be_unpickled_is_refused_but_running_out_of_memory_is_not(tmp_path, monkeypatch):
    tag = tmp_path / checkpoint.tag_for(2)
    (tag / checkpoint.STATE_DIR).mkdir(parents=True)
    checkpoint.rank_file(tag, 0).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read .*; resume another tag"):
        checkpoint.load_rank_states(tag, [0])
    torch.save({"rank": 0}, checkpoint.rank_file(tag, 0))

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(torch, "load", out_of_memory)
    with pytest.raises(MemoryError):  # the file is fine: "resume another tag" would be wrong advice
        checkpoint.load_rank_states(tag, [0])


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    checkpoint.seed_rng(5, rank=1)
    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    torch.save(state, tmp_path / "rng.pt")
    checkpoint.seed_rng(99, rank=0)  # move every generator elsewhere
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_cuda_rng_state_is_the_current_devices_alone(monkeypatch):
    # No GPU here: torch.cuda's RNG functions stand in, to check which device's state is saved and restored.
    # A list of every visible device's state (get_rng_state_all) would not load where a rank sees fewer GPUs
    # (a per-task CUDA_VISIBLE_DEVICES) and would restore another device's state where it sees more.
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or torch.ones(4))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", device, state)))
    state = checkpoint.rng_state()
    checkpoint.set_rng_state(state)
    assert calls[0] == ("get", 3) and calls[1][:2] == ("set", 3) and torch.equal(calls[1][2], torch.ones(4))


def test_seeded_rng_differs_per_rank_and_repeats():
    checkpoint.seed_rng(1, rank=0)
    a = torch.rand(2)
    checkpoint.seed_rng(1, rank=1)
    b = torch.rand(2)
    checkpoint.seed_rng(1, rank=0)
    assert torch.equal(torch.rand(2), a) and not torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------
# Export


def _train_and_gather(raw):
    """Train a short run on this rank; return the weights its engine holds at the end (gathered, as fp32)."""
    import deepspeed

    from dist_helpers import Recorder
    from txl_dist import distributed, trainer
    from txl_dist.config import config_from_dict

    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        t = trainer.build(config_from_dict(raw), env, resume="none")
        t.tracker = Recorder()
        assert t.train() == 0
        with deepspeed.zero.GatheredParameters(list(t.engine.module.parameters())):
            weights = {k: v.detach().float().clone() for k, v in t.engine.module.state_dict().items()}
        t.close()
        return weights
    finally:
        distributed.destroy_process_group()


# One projection under three names: with div_val 1 and d_embed != d_model, the default tie_projs ties both tail
# clusters' output projections to the embedding's (crit.out_projs.1 and .2, word_emb.emb_projs.0).
THREE_NAMES_ONE_PROJECTION = {"d_embed": 16, "div_val": 1, "cutoffs": [20, 40]}


@pytest.mark.parametrize("stage, bf16, model", [(3, False, {}), (1, False, {}), (0, True, {}),
                                                (2, False, THREE_NAMES_ONE_PROJECTION)])
def test_export_writes_the_fp32_weights(tmp_path, stage, bf16, model):
    from launch.export import main
    from txl_dist.interop import load_native

    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 49, 64, 0),
                                                "valid": learnable_stream(80, 64, 1),
                                                "test": learnable_stream(80, 64, 2)})
    ds = {"zero_optimization": {"stage": stage}} | ({"bf16": {"enabled": True}} if bf16 else {})
    raw = tiny_config(corpus, tmp_path / "ckpt", train={"max_steps": 3}, eval={"at_end": False}, deepspeed=ds,
                      model=model)
    engine_weights = run_ranks(_train_and_gather, 2, raw)[0]
    assert main(["--checkpoint", str(tmp_path / "ckpt" / "checkpoints"), "--out", str(tmp_path / "native"),
                 "--hf", str(tmp_path / "hf")]) == 0
    exported = load_native(tmp_path / "native").state_dict()
    assert set(exported) == set(engine_weights)
    for name, value in exported.items():
        assert value.dtype == torch.float32, name
        if bf16:
            # The engine's module holds bf16 copies of the fp32 masters the export wrote.
            torch.testing.assert_close(value.bfloat16().float(), engine_weights[name], rtol=0, atol=0)
        else:
            torch.testing.assert_close(value, engine_weights[name], rtol=0, atol=0)
    if bf16:  # masters, not the bf16 copies: some weights carry more precision than bf16 has
        assert any(not torch.equal(v, v.bfloat16().float()) for v in exported.values())
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


def _fork_while_the_source_run_saves(raw: dict, source_ckpt: Path) -> dict:
    """A training start from another run folder (a fork) on this rank, while that run saves and prunes to one tag
    (checkpoint.keep 1) between the fork's choice of its tag and its load; what retention removed then and after."""
    import shutil

    from txl_dist import distributed, startup, trainer
    from txl_dist.config import config_from_dict

    env = distributed.discover()
    distributed.init_process_group(env)
    check_loadable, pruned = startup._check_loadable, {}

    def the_source_run_saves_and_prunes(source):
        if env.is_main:
            shutil.copytree(source_ckpt / "step_00000001", source_ckpt / "step_00000002")
            pruned["during"] = checkpoint.prune(source_ckpt, keep=1)
        return check_loadable(source)

    startup._check_loadable = the_source_run_saves_and_prunes
    try:
        t = trainer.build(config_from_dict(raw), env, resume=str(source_ckpt.parent))
        distributed.barrier()  # every rank's load has ended: their holds are gone
        if env.is_main:
            pruned["after"] = checkpoint.prune(source_ckpt, keep=1)
        t.tracker.close()
        t.close()
        return {"step": t.step, "resumed_from": str(t.resumed_from)} | pruned
    finally:
        distributed.destroy_process_group()


def test_a_fork_holds_the_other_runs_tag_until_it_is_loaded(tmp_path):
    """A run started from another run folder's tag while that run trains: its retention removed the tag between
    the fork's choice and its load, which failed ("DeepSpeed's load failed (AssertionError); its files verified at
    start: check the file system"). The fork now holds the tag as an evaluation does, on every rank."""
    corpus = learnable_corpus(tmp_path / "corpus", 4 * 49)
    source = tiny_config(corpus, tmp_path / "source", train={"max_steps": 1}, eval={"at_end": False})
    run_ranks(train_jobs, 1, [(source, "none")])
    fork = tiny_config(corpus, tmp_path / "fork", train={"max_steps": 1}, eval={"at_end": False})
    source_ckpt = tmp_path / "source" / "checkpoints"
    results = run_ranks(_fork_while_the_source_run_saves, 2, fork, source_ckpt)
    assert [r["step"] for r in results] == [1, 1]
    assert results[0]["resumed_from"] == str(source_ckpt / "step_00000001")
    assert results[0]["during"] == [] and results[0]["after"] == ["step_00000001"]


def test_prune_never_removes_the_newest_good_tag(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step, streak in ((10, 0), (20, 0), (30, 2), (40, 3)):
        tag = _tag(ckpt, step)
        info = json.loads((tag / "txl_state" / "run.json").read_text())
        (tag / "txl_state" / "run.json").write_text(json.dumps(info | {"nonfinite_streak": streak}))
    assert checkpoint.prune(ckpt, keep=2) == ["step_00000010"]
    assert checkpoint.inventory(ckpt).complete == ["step_00000020", "step_00000030", "step_00000040"]


def test_a_tag_saved_again_replaces_the_old_one_only_once_the_new_one_is_complete(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = _tag(ckpt, 5)
    staging = ckpt / ".saving-step_00000005"
    (staging / "txl_state").mkdir(parents=True)
    (staging / "new-file").write_bytes(b"new")
    (ckpt / "step_00000005_universal").mkdir()  # made from the old tag: stale once it is replaced
    checkpoint._move_into_place(ckpt, staging, old)
    assert (old / "new-file").read_bytes() == b"new" and not (old / "mp_rank_00_model_states.pt").exists()
    assert _names(ckpt) == ["step_00000005"]


# ----------------------------------------------------------------------------------------------------
# Universal copies: recorded, verified, made again when they do not verify


def _fake_converter(cmd, **kwargs):
    """ds_to_universal's output: model states and per-parameter fragments."""
    out = Path(cmd[cmd.index("--output_folder") + 1])
    for name, data in {"mp_rank_00_model_states.pt": b"states", "zero/w/fp32.pt": b"w" * 1000,
                       "zero/w/exp_avg.pt": b"m" * 1000, "zero/b/fp32.pt": b"b" * 10}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return subprocess.CompletedProcess(cmd, 0, "", "")


def test_a_universal_copy_records_its_files_and_is_verified_against_them(tmp_path, monkeypatch):
    """The copy's record (written last, inside the copy before its rename) lists every file's size and sha256
    and the tag's run.json it was made from; every way the copy can be wrong is a problem, shared by rank."""
    ckpt = tmp_path / "checkpoints"
    tag = _tag(ckpt, 10)
    out = ckpt / "step_00000010_universal"
    monkeypatch.setattr(checkpoint.subprocess, "run", _fake_converter)
    assert "missing" in checkpoint.verify_universal(out, tag)
    assert checkpoint.convert_to_universal(tag, out, zero_stage=2) is True
    record = json.loads((out / "txl_state" / "universal.json").read_text())
    assert sorted(record["files"]) == ["mp_rank_00_model_states.pt", "zero/b/fp32.pt", "zero/w/exp_avg.pt",
                                       "zero/w/fp32.pt"]
    assert record["files"]["zero/b/fp32.pt"] == checkpoint.hash_file(out / "zero/b/fp32.pt")
    assert checkpoint.verify_universal(out, tag) is None
    assert all(checkpoint.verify_universal(out, tag, rank=r, world_size=2) is None for r in range(2))
    assert _names(ckpt) == ["step_00000010", "step_00000010_universal"]

    flipped = out / "zero/w/fp32.pt"
    flipped.write_bytes(b"x" + b"w" * 999)
    problems = [checkpoint.verify_universal(out, tag, rank=r, world_size=2) for r in range(2)]
    assert [p for p in problems if p] == [f"{flipped}: sha256 differs from the one recorded at save time (corrupted)"]
    flipped.write_bytes(b"w" * 1000)
    (out / "zero/b/fp32.pt").unlink()
    assert "zero/b/fp32.pt: missing" in checkpoint.verify_universal(out, tag)
    (out / "zero/b/fp32.pt").write_bytes(b"b" * 10)
    run_json = tag / "txl_state" / "run.json"
    run_json.write_text(run_json.read_text() + " ")  # the tag saved again since the copy was made
    assert "made from another save of step_00000010" in checkpoint.verify_universal(out, tag)
    (out / "txl_state" / "universal.json").unlink()  # a copy made by an older version, or never finished
    assert "a copy made by an older version, or unfinished" in checkpoint.verify_universal(out, tag)


def test_a_copy_that_does_not_verify_is_converted_again_and_the_bad_one_discarded(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    tag = _tag(ckpt, 10)
    out = ckpt / "step_00000010_universal"
    (out / "zero" / "w").mkdir(parents=True)
    (out / "zero" / "w" / "fp32.pt").write_bytes(b"bad weights")  # no record: an older version's copy
    monkeypatch.setattr(checkpoint.subprocess, "run", _fake_converter)
    assert checkpoint.convert_to_universal(tag, out, zero_stage=1) is True
    assert (out / "zero" / "w" / "fp32.pt").read_bytes() == b"w" * 1000
    assert checkpoint.verify_universal(out, tag) is None
    assert _names(ckpt) == ["step_00000010", "step_00000010_universal"]  # the bad copy went with the scratch


def test_sizes_read_right_at_any_scale_and_the_pre_save_refusal_uses_them(tmp_path, monkeypatch):
    import errno
    import shutil

    assert [checkpoint.size_text(n) for n in (0, 900, 15360, 5 << 20, 3 << 30)] == [
        "0 bytes", "900 bytes", "15.0 KiB", "5.0 MiB", "3.0 GiB"]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=15360))
    with pytest.raises(OSError) as refused:
        checkpoint._prepare_staging(tmp_path / "ckpt", tmp_path / "ckpt" / ".saving-step_00000004", 1536 << 10)
    assert refused.value.errno == errno.ENOSPC
    assert str(refused.value) == (f"[Errno 28] No space left on device: 15.0 KiB free on the file system of "
                                  f"{tmp_path / 'ckpt'}, a checkpoint needs about 1.5 MiB; free space or lower "
                                  "checkpoint.keep")


TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 15360 vs 15254"


class _FailingEngine:
    """DeepSpeed's checkpoint engine whose torch.save fails as torch's zip writer does on a full disk."""

    def save(self, state_dict, path):
        Path(path).write_bytes(b"half a file")
        raise RuntimeError(TORCH_FULL_DISK + "\nframe #0: c10::detail::torchCheckFail")


@pytest.mark.parametrize("free, expected", [
    (4096, "{path}: [Errno 28] No space left on device (" + TORCH_FULL_DISK + ")"),
    (10 << 30, "{path}: " + TORCH_FULL_DISK)])  # room enough: not a full disk, torch's words as they are
def test_a_write_that_fails_on_a_full_file_system_says_no_space_left(tmp_path, monkeypatch, free, expected):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=free))
    recorder = checkpoint._WriteRecorder(_FailingEngine())
    path = tmp_path / "mp_rank_00_model_states.pt"
    assert recorder.save({"module": {"w": torch.zeros(4096)}}, str(path)) is None
    assert recorder.error == expected.format(path=path)
    assert not path.exists()


def test_a_save_onto_a_really_full_file_system_says_no_space_left(small_file_system):
    """torch.save through the recorder (DeepSpeed's files) and the rank file's own write, on a file system too
    small for them: both name ENOSPC, with torch's words."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    recorder = checkpoint._WriteRecorder(TorchCheckpointEngine())
    path = small_file_system / "mp_rank_00_model_states.pt"
    assert recorder.save({"module": {"w": torch.zeros(1 << 17)}}, str(path)) is None  # 512 KiB
    assert recorder.error.startswith(f"{path}: [Errno 28] No space left on device (")
    assert not path.exists()
    state = small_file_system / "rank-00000.pt"
    with pytest.raises(OSError, match=r"rank-00000.pt: \[Errno 28\] No space left on device \("):
        checkpoint.write_rank_state(state, {"mems": torch.zeros(1 << 17)})
    assert list(small_file_system.iterdir()) == []


def _staged(ckpt: Path, tag: str) -> Path:
    staging = ckpt / (checkpoint.STAGING_PREFIX + tag)
    (staging / checkpoint.STATE_DIR).mkdir(parents=True)
    (staging / "mp_rank_00_model_states.pt").write_bytes(b"w" * 100)
    return staging


def test_a_commit_on_a_full_disk_names_the_file_it_could_not_write(small_file_system, tmp_path, monkeypatch):
    """Found by the fault sweep's full disk (seed 1006 case 7): the save of step 10 failed in its commit with
    `could not be committed: rank 0: [Errno 28] No space left on device`, naming no file: a write's ENOSPC
    carries none. run.json on a really full tmpfs, and `latest` after the tag went into place."""
    ckpt = small_file_system / "checkpoints"
    staging = _staged(ckpt, "step_00000010")
    with open(small_file_system / "filler", "wb", buffering=0) as f:  # every byte left
        with pytest.raises(OSError):
            while True:
                f.write(b"f" * 4096)
    run_file = staging / checkpoint.STATE_DIR / checkpoint.RUN_FILE
    big = {"files": {f"f{i}": "0" * 64 for i in range(200)}}  # more than a page's slack
    with pytest.raises(OSError, match="^" + re.escape(f"{run_file}: [Errno 28] No space left on device")):
        checkpoint._commit(ckpt, staging, "step_00000010", big)
    assert not (ckpt / "step_00000010").exists() and not (ckpt / checkpoint.LATEST).exists()

    ckpt = tmp_path / "checkpoints"
    staging = _staged(ckpt, "step_00000010")
    written = checkpoint.atomic_write

    def latest_on_a_full_disk(path, data):
        if Path(path).name == checkpoint.LATEST:
            raise OSError(28, "No space left on device")  # as write() raises it: no file named
        return written(path, data)

    monkeypatch.setattr(checkpoint, "atomic_write", latest_on_a_full_disk)
    with pytest.raises(OSError) as failed:
        checkpoint._commit(ckpt, staging, "step_00000010", {"files": {}})
    assert str(failed.value) == f"{ckpt / checkpoint.LATEST}: [Errno 28] No space left on device"
    assert (ckpt / "step_00000010").is_dir()  # complete: the next start resumes from it and writes `latest`


def test_deepspeeds_tensor_parallel_warning_on_an_elastic_load_is_not_shown(tmp_path):
    from deepspeed.utils import logger as ds_logger

    class Engine:  # stands in for DeepSpeed's: its ZeRO 1/2 load on another world size logs this warning
        lr_scheduler = None

        def load_checkpoint(self, load_dir, **kw):
            ds_logger.warning("MPU is not provided, setting tp size to 1 in checkpoint loading.")
            ds_logger.warning("another DeepSpeed warning")
            return load_dir, {}

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    ds_logger.addHandler(handler)  # DeepSpeed's logger does not propagate to the root logger
    try:
        checkpoint.load_engine(Engine(), checkpoint.EngineSource(tmp_path, "step_00000001", universal=False))
    finally:
        ds_logger.removeHandler(handler)
    assert seen == ["another DeepSpeed warning"]


def test_resuming_a_tag_the_run_set_aside_says_how_to_go_back_to_it(tmp_path):
    from txl_dist.checkpoint import RUN_FILE, STATE_DIR, CheckpointError, check_resume_request

    ckpt = tmp_path / "run" / "checkpoints"
    aside = ckpt / "superseded" / "20261205-120000" / "step_00000008"
    (aside / STATE_DIR).mkdir(parents=True)
    (aside / STATE_DIR / RUN_FILE).write_text("{}")
    with pytest.raises(CheckpointError) as refused:
        check_resume_request(str(aside), ckpt, ["step_00000004"])
    assert str(refused.value) == (
        f"--resume {aside}: a tag this run set aside when it rolled back; to go back to it, move it into {ckpt} "
        f"(`mv {aside} {ckpt}/`, after moving a tag of the same name there out of the way) and resume from it "
        f"there (--resume {ckpt / 'step_00000008'}): the tags newer than it are then set aside in turn")
    other = tmp_path / "other" / "checkpoints" / "step_00000008"
    (other / STATE_DIR).mkdir(parents=True)
    (other / STATE_DIR / RUN_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match="a checkpoint of another run folder"):
        check_resume_request(str(other), ckpt, ["step_00000004"])


def test_a_universal_copy_that_cannot_be_written_is_one_line_naming_the_way_out(tmp_path, monkeypatch):
    import errno

    import txl_dist.scratch as scratch
    from txl_dist.checkpoint import CheckpointError, convert_to_universal

    def read_only(prefix, dir):  # what a read-only mount gives, naming the folder mkdtemp tried
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), f"{dir}/{prefix}x1y2z3")

    monkeypatch.setattr(scratch.tempfile, "mkdtemp", read_only)
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_00000004").mkdir(parents=True)
    with pytest.raises(CheckpointError) as refused:
        convert_to_universal(ckpt / "step_00000004", ckpt / "step_00000004_universal", zero_stage=1)
    assert str(refused.value) == (
        f"{ckpt / 'step_00000004'}: cannot write the universal copy that a load at another world size reads beside "
        f"it (Read-only file system); make {ckpt} writable (or copy the run folder to where it can be), or load it "
        "with the world size it was saved with")


def test_a_disk_that_fills_after_the_converter_is_a_full_disk_not_a_folder_to_make_writable(tmp_path, monkeypatch):
    """The converter's output fitted, its record (written last) did not: the start was refused (exit 2) with
    the advice to make the folder writable, where a full disk midway is a fault naming ENOSPC (exit 1)."""
    import errno

    ckpt = tmp_path / "checkpoints"
    tag = _tag(ckpt, 10)
    out = ckpt / "step_00000010_universal"
    monkeypatch.setattr(checkpoint.subprocess, "run", _fake_converter)

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "atomic_write", full)
    with pytest.raises(checkpoint.ConversionFailed) as failed:
        checkpoint.convert_to_universal(tag, out, zero_stage=2)
    assert not isinstance(failed.value, CheckpointError)
    assert str(failed.value).startswith(f"{tag}: [Errno 28] No space left on device: the universal copy that a load "
                                        f"at another world size reads beside the tag does not fit on the file "
                                        f"system of {ckpt} (")
    assert " free after it stopped); " in str(failed.value)
    assert _names(ckpt) == ["step_00000010"]  # nothing of the conversion left


def test_a_zero3_export_gathers_one_tensor_at_a_time(tmp_path):
    """Found exporting a 114M-parameter ZeRO-3 tag: load_state_dict of zero_to_fp32's whole consolidated dict
    held it beside the model and the memory-mapped partitions (1.55 GiB peak for 435 MiB of weights, three
    copies). load_fp32_weights gathers each tensor just before its copy into the model and drops it after: no
    gathered tensor is alive when the next one is gathered. The weights are those of load_state_dict."""
    import gc
    import weakref

    from deepspeed.utils import zero_to_fp32

    from txl_dist.config import config_from_dict
    from txl_dist.model import TransformerXL
    from txl_dist.safe_load import fp32_state_dict_from_zero

    raw, tag = _one_step_tag(tmp_path, zero_stage=3, ranks=2)
    model_cfg = config_from_dict(raw).model
    model_cfg.vocab_size = 64

    gathered, most_alive = [], 0
    contiguous = zero_to_fp32.GatheredTensor.contiguous

    def counted(self):
        nonlocal most_alive
        gc.collect()
        most_alive = max(most_alive, sum(ref() is not None for ref in gathered))
        out = contiguous(self)
        gathered.append(weakref.ref(out))
        return out

    zero_to_fp32.GatheredTensor.contiguous = counted
    try:
        model = TransformerXL(model_cfg)
        checkpoint.load_fp32_weights(model, tag, zero_stage=3)
    finally:
        zero_to_fp32.GatheredTensor.contiguous = contiguous
    assert len(gathered) >= len(list(model.parameters())) and most_alive == 0
    whole = TransformerXL(model_cfg)
    whole.load_state_dict(fp32_state_dict_from_zero(tag), strict=True)
    for (name, a), b in zip(model.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(a, b), name


# ----------------------------------------------------------------------------------------------------
# A universal conversion onto a file system without room for the copy


def _one_step_tag(root: Path, *, zero_stage: int, ranks: int) -> tuple[dict, Path]:
    """(the config, the tag) of a tiny model trained one step at `zero_stage` on `ranks` ranks under root."""
    from dist_helpers import train_jobs

    splits = {"train": learnable_stream(4 * 49, 64, 0), "valid": learnable_stream(80, 64, 1),
              "test": learnable_stream(80, 64, 2)}
    corpus = write_corpus(root / "corpus", splits, vocab_size=64)
    raw = tiny_config(corpus, root / "run", train={"max_steps": 1}, eval={"at_end": False},
                      deepspeed={"zero_optimization": {"stage": zero_stage}})
    run_ranks(train_jobs, ranks, [(raw, "none")])
    return raw, root / "run" / "checkpoints" / "step_00000001"


@pytest.fixture(scope="module")
def real_zero1_tag(tmp_path_factory):
    """A real ZeRO-1 tag of a tiny model, saved by 1 rank (a load on 2 ranks converts it)."""
    return _one_step_tag(tmp_path_factory.mktemp("zero1"), zero_stage=1, ranks=1)[1]


def _tmpfs(where: Path, size_bytes: int) -> Path:
    from bench.fault_sweep import mount_tmpfs

    if why := mount_tmpfs(where, size_bytes):
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {why}")
    return where


@pytest.mark.parametrize("room", ["fits-the-optimizer-files", "less-than-the-optimizer-files"])
def test_a_conversion_onto_a_full_file_system_is_one_line_naming_enospc_and_leaves_nothing(
        real_zero1_tag, tmp_path, room):
    """Found converting a 114M-parameter tag on a tmpfs with 774 MiB free: the real converter stops with torch's
    `unexpected pos ...` and the job said `conversion failed (RuntimeError: ...)` and exited 2 (a refusal). A
    full disk is a fault (exit 1: ConversionFailed, a RunFailed) that says ENOSPC and the room the copy needs,
    found before converting when the file system cannot even hold the copy's own files; nothing of the
    conversion is left, the tag is untouched and still verifies."""
    from txl_dist.errors import RunFailed

    files = checkpoint.read_run_info(real_zero1_tag)["files"]
    need = sum(entry["bytes"] for name, entry in files.items() if name.endswith("optim_states.pt"))
    assert need > 0
    tag_bytes = checkpoint.tag_bytes(real_zero1_tag)
    free = need + need // 4 if room == "fits-the-optimizer-files" else need // 2
    small = _tmpfs(tmp_path / "small", tag_bytes + free + (64 << 10))  # tmpfs's own blocks and folders
    try:
        ckpt = small / "checkpoints"
        subprocess.run(["cp", "-a", str(real_zero1_tag.parent), str(ckpt)], check=True)
        tag = ckpt / real_zero1_tag.name
        with pytest.raises(RunFailed) as failed:  # before: CheckpointError, a refusal
            checkpoint.convert_to_universal(tag, ckpt / (tag.name + "_universal"), zero_stage=1)
        line = str(failed.value)
        assert "\n" not in line
        assert line.startswith(f"{tag}: [Errno 28] No space left on device: the universal copy that a load at "
                               "another world size reads beside the tag does not fit on the file system of "
                               f"{ckpt} ("), line
        assert ("before converting; it stopped with RuntimeError: " if room == "fits-the-optimizer-files"
                else "free before converting); it takes more than") in line
        assert sorted(p.name for p in ckpt.iterdir() if "universal" in p.name) == []  # no half copy, no scratch
        assert checkpoint.verify(tag) is None
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_conversion_without_room_for_the_copy_stops_before_converting(real_zero1_tag, tmp_path, monkeypatch):
    """The check before converting, where no tmpfs can be mounted (above): a file system reporting less free
    space than the tag's optimizer files is a fault naming ENOSPC, and the converter never starts."""
    import collections
    import shutil

    from txl_dist.errors import RunFailed

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(real_zero1_tag.parent, ckpt)
    tag = ckpt / real_zero1_tag.name
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 0))
    monkeypatch.setattr(checkpoint.subprocess, "run", lambda *a, **k: pytest.fail("the converter started"))
    with pytest.raises(RunFailed) as failed:
        checkpoint.convert_to_universal(tag, ckpt / (tag.name + "_universal"), zero_stage=1)
    assert str(failed.value).startswith(f"{tag}: [Errno 28] No space left on device: "), failed.value
    assert " free before converting); it takes more than" in str(failed.value)
    assert sorted(p.name for p in ckpt.iterdir() if "universal" in p.name) == []


def test_a_conversion_that_refuses_a_file_stays_a_refusal(real_zero1_tag, tmp_path):
    """The converter's exit 2 (a file weights-only unpickling refuses) stays a refusal naming the file and the
    global, while any other failure of the conversion is a fault (above)."""
    import argparse
    import shutil

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(real_zero1_tag.parent, ckpt)
    tag = ckpt / real_zero1_tag.name
    optim = next(tag.glob("*optim_states.pt"))
    torch.save({"optimizer_state_dict": argparse.Namespace(x=1)}, optim)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.convert_to_universal(tag, ckpt / (tag.name + "_universal"), zero_stage=1)
    line = str(refused.value)
    assert line.startswith(f"{tag}: universal checkpoint conversion refused it ({optim}: refused: unpickling it "
                           "needs global argparse.Namespace"), line
    assert "error:" not in line and "\n" not in line
    assert sorted(p.name for p in ckpt.iterdir() if "universal" in p.name) == []
