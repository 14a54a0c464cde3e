"""A training job verifies each corpus file's sha256 once per run folder, not at every start: the record in
RUN/.corpus-hashes answers for files unchanged since (txl_dist/data/hash_record.py). A changed file is hashed
again, so corruption is still refused; a refused start records nothing. On more than one rank, each file is
hashed by one rank and the others take its digest (txl_dist/startup.py: share_corpus_hashing)."""
from __future__ import annotations

import json
import logging
import os

from dist_helpers import learnable_stream, run_ranks, tiny_config, write_corpus
from txl_dist.data import manifest as manifest_module
from txl_dist.data.hash_record import HashRecord


def test_a_record_answers_for_an_unchanged_file_and_hashes_a_changed_one(tmp_path):
    data = tmp_path / "tokens.arrow"
    data.write_bytes(b"a" * 1000)
    expected = manifest_module.sha256_file(data)  # no record in use: hashed
    first = HashRecord(tmp_path / "record")
    with first.in_use():
        assert manifest_module.sha256_file(data) == expected
    assert first.hashed == [str(data)] and not (tmp_path / "record").exists()  # nothing written before save()
    first.save()
    again = HashRecord(tmp_path / "record")
    with again.in_use():
        assert manifest_module.sha256_file(data) == expected
    assert again.hashed == [] and again.remembered == {str(data.resolve())}
    # Changed in place (same size, new bytes, new modification time): hashed again, the change is seen.
    data.write_bytes(b"b" * 1000)
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = HashRecord(tmp_path / "record")
    with changed.in_use():
        assert manifest_module.sha256_file(data) != expected
    assert changed.hashed == [str(data)]
    assert manifest_module.sha256_file(data) != expected  # outside the block: no record consulted


def _starts(raw: dict, corrupt: str | None) -> list[str]:
    """Three training starts on one run folder (the second unchanged, the third after `corrupt` changed, if
    given); what each logged about the corpus, or its refusal."""
    from txl_dist import distributed
    from txl_dist.config import config_from_dict
    from txl_dist.startup import start_training

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("corpus:"):
                lines.append(record.getMessage())

    env = distributed.discover()
    distributed.setup_logging(env)
    logging.getLogger(distributed.LOGGER_NAME).addHandler(Keep())
    distributed.init_process_group(env)
    try:
        for i in range(3):
            if i == 2 and corrupt:
                with open(corrupt, "r+b") as f:
                    f.seek(-8, os.SEEK_END)
                    f.write(b"\xff" * 8)
            try:
                start = start_training(config_from_dict(raw), env, "auto")
            except Exception as e:  # the refusal of the third start
                lines.append(f"refused: {e}")
                continue
            start.tracker.close()
            start.close()
        return lines
    finally:
        distributed.destroy_process_group()


def test_a_restart_does_not_hash_the_corpus_again_and_a_changed_file_is_still_refused(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 97, 64, 0),
                                                "valid": learnable_stream(80, 64, 1)})
    n_files = 1 + sum(len(s["files"]) for s in json.loads((corpus / "manifest.json").read_text())["splits"].values())
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False})
    victim = corpus / json.loads((corpus / "manifest.json").read_text())["splits"]["train"]["files"][-1]["path"]
    (first, second, third) = run_ranks(_starts, 1, raw, str(victim))[0]
    assert first == f"corpus: {n_files} file(s) verified by sha256, 0 unchanged since an earlier start of this run"
    assert second == f"corpus: 0 file(s) verified by sha256, {n_files} unchanged since an earlier start of this run"
    assert third.startswith(f"refused: {victim}: sha256 ") and "differs from the manifest" in third


def test_a_refused_start_records_nothing(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 97, 64, 0),
                                                "valid": learnable_stream(80, 64, 1)})
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False})
    from txl_dist.run_dir import acquire_lock

    (tmp_path / "run").mkdir()
    lock = acquire_lock(tmp_path / "run")  # another job holds the folder: the start is refused after the checks
    try:
        lines = run_ranks(_starts, 1, raw, None)[0]
    finally:
        lock.release()
    assert len(lines) == 3 and all("in use by another job" in line for line in lines), lines
    assert not (tmp_path / "run" / ".corpus-hashes").exists()


def test_a_rank_that_hashes_far_more_than_its_block_is_told_to_relayout(tmp_path):
    from txl_dist.config import config_from_dict
    from txl_dist.data import StreamLoader, read_manifest
    from txl_dist.startup import LAYOUT_WARNING_MIN_BYTES, layout_warning

    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 97, 64, 0),
                                                "valid": learnable_stream(80, 64, 1)}, layout=(1, 4))
    cfg = config_from_dict(tiny_config(corpus, tmp_path / "run"))
    manifest = read_manifest(corpus)
    with StreamLoader(corpus, "train", rank=1, world_size=2, n_streams=4, micro_batch=1, tgt_len=8) as loader:
        block_bytes = (loader.block[1] - loader.block[0]) * 2  # uint16
        big = max(4 * block_bytes, LAYOUT_WARNING_MIN_BYTES)
        line = layout_warning(cfg, manifest, loader, 2, big)
        assert line.startswith(f"corpus: this rank hashed {big / 1e9:.1f} GB of corpus files to read its ")
        assert "laid out for 1 rank(s) and 4 stream(s), this run has 2 and 4" in line
        assert f"`python -m data_prep relayout {corpus} --world-size 2 --n-streams 4`" in line
        assert layout_warning(cfg, manifest, loader, 2, big - 1) is None  # below 1 GiB (or 4 blocks): quiet


def test_another_ranks_digest_answers_only_for_the_file_it_saw(tmp_path):
    shared, local = tmp_path / "shared.arrow", tmp_path / "local.arrow"
    shared.write_bytes(b"a" * 1000)
    local.write_bytes(b"b" * 1000)
    other = HashRecord(tmp_path / "record")
    with other.in_use():
        manifest_module.sha256_file(shared)
        manifest_module.sha256_file(local)
    entries = other.hashed_entries()
    local.unlink()
    local.write_bytes(b"c" * 1000)  # this rank's copy is another file (a node-local copy, say): a new inode
    mine = HashRecord(tmp_path / "record")
    mine.take(entries)
    with mine.in_use():
        assert manifest_module.sha256_file(shared) == entries[str(shared.resolve())]["sha256"]
        assert manifest_module.sha256_file(local) != entries[str(local.resolve())]["sha256"]
    assert mine.taken == {str(shared.resolve())} and mine.hashed == [str(local)]
    mine.save()  # a taken digest is the hashing rank's to save
    assert not (tmp_path / "record").exists() or len(list((tmp_path / "record").iterdir())) == 1


def _first_start(raw: dict) -> tuple[list[str], str]:
    """One training start on this rank: the files it hashed itself, and its refusal ('' when it started)."""
    from txl_dist import distributed
    from txl_dist.config import config_from_dict
    from txl_dist.data.hash_record import HashRecord as Record
    from txl_dist.startup import start_training

    computed: list[str] = []
    answer = Record.sha256

    def counting(self, path, compute):
        return answer(self, path, lambda: (computed.append(os.path.realpath(path)), compute())[1])

    Record.sha256 = counting
    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        start = start_training(config_from_dict(raw), env, "auto")
    except Exception as e:
        return computed, str(e)
    finally:
        Record.sha256 = answer
    start.tracker.close()
    start.close()
    distributed.destroy_process_group()
    return computed, ""


def _two_rank_corpus(tmp_path, monkeypatch):
    """A corpus laid out for 1 rank (the default of prepare), its train block cut into 4 files by the file cap."""
    monkeypatch.setattr(manifest_module, "MAX_FILE_TOKENS", 97)
    corpus = write_corpus(tmp_path / "corpus", {"train": learnable_stream(4 * 97, 64, 0),
                                                "valid": learnable_stream(80, 64, 1)}, layout=(1, 4))
    listed = json.loads((corpus / "manifest.json").read_text())
    files = [corpus / listed["tokenizer"]["file"]] + [corpus / f["path"] for split in listed["splits"].values()
                                                      for f in split["files"]]
    return corpus, listed, {os.path.realpath(f) for f in files}


def test_two_ranks_hash_each_corpus_file_once_on_a_first_start(tmp_path, monkeypatch):
    corpus, listed, files = _two_rank_corpus(tmp_path, monkeypatch)
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False})
    (first, refused0), (second, refused1) = run_ranks(_first_start, 2, raw)
    assert not refused0 and not refused1
    # Without sharing both ranks hash the tokenizer, the valid file and every train file their blocks touch.
    assert sorted(first + second) == sorted(files), (first, second)
    train = {os.path.realpath(corpus / f["path"]) for f in listed["splits"]["train"]["files"]}
    assert len(train) == 4 and train & set(first) and train & set(second)
    saved = [json.loads(f.read_text())["path"] for f in (tmp_path / "run" / ".corpus-hashes").iterdir()]
    assert sorted(saved) == sorted(files)  # each digest saved by the rank that computed it


def test_a_corrupt_file_is_refused_by_a_rank_that_took_another_ranks_digest_of_it(tmp_path, monkeypatch):
    corpus, listed, _ = _two_rank_corpus(tmp_path, monkeypatch)
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False})
    victim = corpus / listed["tokenizer"]["file"]  # every rank reads it, one rank hashes it
    victim.write_bytes(victim.read_bytes() + b"changed")
    (first, refused0), (second, refused1) = run_ranks(_first_start, 2, raw)
    hashed_by = [rank for rank, computed in enumerate((first, second)) if os.path.realpath(victim) in computed]
    assert len(hashed_by) == 1, (first, second)
    took = (refused0, refused1)[1 - hashed_by[0]]
    assert took.startswith(f"{victim}: sha256 differs from the manifest's"), took


def _one_rank_start_hashing_two_files_at_once(raw: dict) -> int:
    """A one-rank training start whose first two corpus hashes must run at the same time (a barrier of 2: one
    after the other, the first would wait 20 s and fail); returns how many files it hashed."""
    import threading

    from txl_dist import distributed, startup
    from txl_dist.config import config_from_dict
    from txl_dist.data.hash_record import HashRecord as Record

    startup.usable_cpus = lambda: 4  # CI has 2 cores; any machine then hashes on 2 threads or more
    together = threading.Barrier(2, timeout=20)
    answer, calls = Record.sha256, []

    def meeting(self, path, compute):
        def computed():
            calls.append(path)
            if len(calls) <= 2:
                together.wait()
            return compute()
        return answer(self, path, computed)

    Record.sha256 = meeting
    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        start = startup.start_training(config_from_dict(raw), env, "auto")
    finally:
        distributed.destroy_process_group()
    start.tracker.close()
    start.close()
    return len(calls)


def test_one_rank_hashes_its_corpus_files_on_several_threads(tmp_path, monkeypatch):
    corpus, _, files = _two_rank_corpus(tmp_path, monkeypatch)
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False})
    assert run_ranks(_one_rank_start_hashing_two_files_at_once, 1, raw) == [len(files)]
