"""StreamLoader: rank blocks, micro steps over streams, exact resume, resets at the wrap, roll, partial_last.

Expected windows come from a plain reference: the global stream cut to S*L and reshaped to [S, L];
window k of epoch e of stream s is streams[s, o_e + k*T : o_e + (k+1)*T + 1].
"""
from __future__ import annotations

import itertools
import json
import os
import re

import numpy as np
import pytest
from corpus_helpers import (edit_manifest, flip_bytes, make_corpus, mapped_rss, open_as_an_unprivileged_user,
                            synthetic_stream)

from txl_dist.data import CorpusError, Layout, StreamLoader

N_TOKENS = 1003  # S = 8 -> L = 125, and 3 tokens past S*L that no stream owns


def reference_streams(tokens: np.ndarray, n_streams: int) -> np.ndarray:
    L = len(tokens) // n_streams
    return tokens[:n_streams * L].reshape(n_streams, L)  # [S, L]


def take(loader: StreamLoader, n: int) -> list:
    return list(itertools.islice(loader, n))


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for field in ("input_ids", "labels", "stream_ids", "reset"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
        assert (x.micro_step, x.step, x.epoch, x.position) == (y.micro_step, y.step, y.epoch, y.position)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Files cut for W=2, S=8 (three files: rank 0, rank 1, the untrained tail), small record batches."""
    tokens = synthetic_stream(N_TOKENS, seed=3)
    root = make_corpus(tmp_path_factory.mktemp("loader") / "c2", {"train": tokens, "valid": synthetic_stream(400)},
                       layout=Layout(2, 8), batch_tokens=48)
    return root, tokens


def loader(root, split="train", **kw) -> StreamLoader:
    args = dict(rank=0, world_size=1, n_streams=8, micro_batch=2, tgt_len=10)
    args.update(kw)
    return StreamLoader(root, split, **args)


# ----------------------------------------------------------------------------------------------------
# Which tokens each rank reads


@pytest.mark.parametrize("hint", [Layout(2, 8), Layout(4, 8), Layout(1, 4)])
@pytest.mark.parametrize("world_size, micro_batch", [(1, 8), (1, 2), (2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("file_cap", [None, 37])  # 37: the files cut smaller than a rank block (MAX_FILE_TOKENS)
def test_ranks_together_read_the_global_stream_cut_to_s_times_l(tmp_path, monkeypatch, hint, world_size, micro_batch,
                                                                 file_cap):
    if file_cap:
        from txl_dist.data import manifest
        monkeypatch.setattr(manifest, "MAX_FILE_TOKENS", file_cap)
    tokens = synthetic_stream(N_TOKENS, seed=3)
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=hint, batch_tokens=40)
    T = 10
    rebuilt = {}
    for rank in range(world_size):
        with loader(root, rank=rank, world_size=world_size, micro_batch=micro_batch, tgt_len=T,
                    epochs=1, partial_last=True) as ld:
            for mb in ld:
                assert mb.input_ids.dtype == mb.labels.dtype == mb.stream_ids.dtype == np.int64
                for row, s in enumerate(mb.stream_ids):
                    if mb.position == 0:
                        rebuilt[int(s)] = [mb.input_ids[row, :1]]
                    np.testing.assert_array_equal(mb.input_ids[row, 1:], mb.labels[row, :-1])  # labels = next tokens
                    rebuilt[int(s)].append(mb.labels[row])
    assert list(rebuilt) == list(range(8))  # ranks in order, each its streams in order
    union = np.concatenate([np.concatenate(rebuilt[s]) for s in range(8)])
    np.testing.assert_array_equal(union, tokens[:8 * (N_TOKENS // 8)])


def test_micro_steps_split_streams_not_time(corpus):
    root, tokens = corpus
    ref = reference_streams(tokens, 8)
    with loader(root, rank=1, world_size=2, micro_batch=2, tgt_len=10) as ld:
        assert (ld.accumulation_steps, ld.stream_len, ld.steps_per_epoch) == (2, 125, 12)
        batches = take(ld, 6)
    assert [(b.step, b.micro_step, b.position) for b in batches] == \
        [(0, 0, 0), (0, 1, 0), (1, 0, 10), (1, 1, 10), (2, 0, 20), (2, 1, 20)]
    assert [b.stream_ids.tolist() for b in batches[:2]] == [[4, 5], [6, 7]]
    for b in batches:
        np.testing.assert_array_equal(b.input_ids, ref[b.stream_ids, b.position:b.position + 10])
        np.testing.assert_array_equal(b.labels, ref[b.stream_ids, b.position + 1:b.position + 11])
        assert b.input_ids.flags.c_contiguous and b.labels.flags.c_contiguous


@pytest.mark.parametrize("world_size, rank, expected", [
    (2, 0, ["train/00000.arrow"]), (2, 1, ["train/00001.arrow"]),    # the planned run: its own file only
    (4, 1, ["train/00000.arrow"]), (4, 2, ["train/00001.arrow"]),    # smaller blocks inside those files
    (1, 0, ["train/00000.arrow", "train/00001.arrow"]),              # the tail file is never opened
])
def test_a_rank_opens_only_the_files_of_its_block(corpus, world_size, rank, expected):
    root, _ = corpus
    with loader(root, rank=rank, world_size=world_size, micro_batch=1) as ld:
        take(ld, 3 * ld.accumulation_steps)
        assert ld.files_opened == expected


# ----------------------------------------------------------------------------------------------------
# Exact resume


@pytest.mark.parametrize("roll", [False, True])
@pytest.mark.parametrize("k", [0, 3, 8, 23, 24, 25, 49])  # mid-step, step boundaries, around the epoch wrap
def test_resume_gives_identical_next_batches(corpus, roll, k):
    root, _ = corpus
    kw = dict(rank=1, world_size=2, micro_batch=2, tgt_len=10, roll=roll, seed=5)
    with loader(root, **kw) as ld:
        straight = take(ld, 60)  # 12 steps * 2 micro steps = 24 per epoch (or 22 with a roll offset)
    assert len({b.epoch for b in straight}) >= 3
    with loader(root, **kw) as first:
        assert_same_batches(take(first, k), straight[:k])
        state = json.loads(json.dumps(first.state_dict()))  # it must survive a checkpoint as plain data
    with loader(root, **kw) as resumed:
        resumed.load_state_dict(state)
        assert_same_batches(take(resumed, 60 - k), straight[k:])


def test_state_from_two_ranks_resumes_one_rank_at_a_step_boundary(corpus):
    root, _ = corpus
    two = [loader(root, rank=r, world_size=2, micro_batch=2, roll=True, seed=1) for r in range(2)]
    for ld in two:
        take(ld, 2 * 13)  # 13 optimizer steps: into the second epoch
    state = two[0].state_dict()
    assert two[1].state_dict() == state  # the position is global, not per rank
    expected = [b for ld in two for b in take(ld, 2)]  # the next step: rank 0's streams, then rank 1's
    with loader(root, world_size=1, micro_batch=2, roll=True, seed=1) as one:
        one.load_state_dict(state)
        got = take(one, 4)
    assert [b.stream_ids.tolist() for b in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for b, e in zip(got, expected):
        np.testing.assert_array_equal(b.input_ids, e.input_ids)
        assert (b.step, b.epoch, b.position) == (e.step, e.epoch, e.position)
    take(two[0], 1)  # mid-step now
    with loader(root, world_size=1, micro_batch=2, roll=True, seed=1) as one:
        with pytest.raises(ValueError, match="saved mid-step .* resume another layout only from an optimizer-step"):
            one.load_state_dict(two[0].state_dict())


@pytest.mark.parametrize("change, message", [
    (dict(n_streams=4, micro_batch=1), "n_streams is 8 but this loader has 4"),
    (dict(tgt_len=12), "tgt_len is 10 but this loader has 12"),
    (dict(split="valid", n_streams=2, micro_batch=1), "digest|split"),
    (dict(roll=True), "roll is False but this loader has True"),
])
def test_state_from_another_layout_is_refused(corpus, change, message):
    root, _ = corpus
    with loader(root) as ld:
        take(ld, 5)
        state = ld.state_dict()
    with loader(root, **change) as other:
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(state)


def test_state_whose_rolled_epoch_offset_this_numpy_draws_elsewhere_is_refused(corpus, monkeypatch):
    """With data.roll the epoch offsets come from numpy's generator, whose streams numpy may change between
    versions: a state saved at a position this loader would not read from is refused, not resumed elsewhere."""
    root, _ = corpus
    with loader(root, roll=True, seed=3) as ld:
        take(ld, 5)
        state = ld.state_dict()
    with loader(root, roll=True, seed=3) as same:
        same.load_state_dict(state)  # the same numpy: the same offsets
    real = np.random.default_rng

    class AnotherNumpy:  # draws each offset one further on than this numpy does
        def __init__(self, seed):
            self.generator = real(seed)

        def integers(self, high):
            return (self.generator.integers(high) + 1) % high

    monkeypatch.setattr(np.random, "default_rng", AnotherNumpy)
    with loader(root, roll=True, seed=3) as other:
        with pytest.raises(ValueError, match=r"saved at token position \d+ .* its epoch offsets \(data.roll\) "
                                             r"differ from the saving run's"):
            other.load_state_dict(state)


def test_state_from_another_corpus_is_refused(corpus, tmp_path):
    root, tokens = corpus
    other_root = make_corpus(tmp_path / "other", {"train": tokens[::-1].copy()}, layout=Layout(2, 8))
    with loader(root) as ld:
        state = ld.state_dict()
    with loader(other_root) as other:
        with pytest.raises(ValueError, match="digest .* another corpus"):
            other.load_state_dict(state)


# ----------------------------------------------------------------------------------------------------
# Epochs: reset at the wrap, roll offsets, partial_last


def test_reset_exactly_at_the_wrap(corpus):
    root, tokens = corpus
    ref = reference_streams(tokens, 8)
    with loader(root, world_size=1, micro_batch=4, tgt_len=10, epochs=3) as ld:
        batches = list(ld)
        assert ld.finished and list(ld) == []
    assert len(batches) == 3 * 12 * 2  # (L - 1) // T = 12 windows per epoch, g = 2
    first_step = {}  # epoch -> its first optimizer step, seen from the batches themselves
    for prev, b in zip([None] + batches, batches):
        if prev is None or b.epoch != prev.epoch:
            first_step[b.epoch] = b.step
            if prev is not None:
                assert prev.position + 2 * 10 + 1 > 125  # the window after the last one would not fit
        wraps = b.step == first_step[b.epoch]  # both micro steps (all 8 streams) of that step
        assert b.reset.tolist() == [wraps] * 4
        assert (b.position == 0) == wraps
        np.testing.assert_array_equal(b.input_ids, ref[b.stream_ids, b.position:b.position + 10])
    assert [b.epoch for b in batches[::24]] == [0, 1, 2]
    assert batches[-1].step == 35


def test_roll_offsets_are_reproducible_and_vary(corpus):
    root, tokens = corpus
    ref = reference_streams(tokens, 8)
    T = 10
    with loader(root, roll=True, seed=7, tgt_len=T) as a, loader(root, roll=True, seed=7, tgt_len=T) as b, \
            loader(root, roll=True, seed=8, tgt_len=T) as c:
        offsets = [a.epoch_offset(e) for e in range(8)]
        assert offsets == [b.epoch_offset(e) for e in range(8)]
        assert offsets != [c.epoch_offset(e) for e in range(8)]
        assert len(set(offsets)) > 1 and all(0 <= o < T for o in offsets)
        n = sum(a.steps_in_epoch(e) for e in range(4)) * a.accumulation_steps
        batches = take(a, n)
    starts = {}
    for mb in batches:
        first = starts.setdefault(mb.epoch, mb.position)
        assert mb.reset.all() == (mb.position == first)
        assert (mb.position - offsets[mb.epoch]) % T == 0 and mb.position + T + 1 <= 125
        np.testing.assert_array_equal(mb.labels, ref[mb.stream_ids, mb.position + 1:mb.position + T + 1])
    assert [starts[e] for e in range(4)] == offsets[:4]
    # Every stream wraps together: an epoch holds exactly the windows that fit after its offset.
    for e in range(4):
        assert sum(1 for mb in batches if mb.epoch == e) == (124 - offsets[e]) // T * a.accumulation_steps


def test_partial_last_predicts_every_token_once(corpus):
    root, tokens = corpus
    ref = reference_streams(tokens, 8)
    with loader(root, rank=1, world_size=2, micro_batch=4, tgt_len=16, epochs=1, partial_last=True) as ld:
        assert ld.steps_per_epoch == 8  # 124 = 7 * 16 + 12
        batches = list(ld)
    assert [b.input_ids.shape for b in batches] == [(4, 16)] * 7 + [(4, 12)]
    labels = np.concatenate([b.labels for b in batches], axis=1)  # [m, L - 1]
    np.testing.assert_array_equal(labels, ref[4:8, 1:])


# ----------------------------------------------------------------------------------------------------
# Refusals: one line each, naming the thing


@pytest.mark.parametrize("kw, message", [
    (dict(world_size=3, micro_batch=1), "8 streams cannot be split over 3 ranks"),
    (dict(world_size=2, micro_batch=3), "micro_batch: 3 does not divide the 4 streams of each of 2 ranks"),
    (dict(tgt_len=125), "streams of 125 tokens, too short for tgt_len 125"),
    (dict(tgt_len=63, roll=True), "too short for roll with tgt_len 63"),
    # One stream: no "1 streams", and no advice to use fewer of them.
    (dict(n_streams=1, micro_batch=1, tgt_len=N_TOKENS), f"{N_TOKENS} tokens in one stream, too short for tgt_len "
     f"{N_TOKENS} \\(needs {N_TOKENS + 1}\\); use a shorter tgt_len or a split with more text$"),
    (dict(rank=2, world_size=2), "rank 2 is outside 0..1"),
    (dict(roll=True, partial_last=True), "partial_last .* cannot be combined with roll"),
])
def test_impossible_layouts_are_refused(corpus, kw, message):
    root, _ = corpus
    with pytest.raises(ValueError, match=message) as e:
        loader(root, **kw)
    assert "\n" not in str(e.value)


def test_unknown_split_is_refused(corpus):
    root, _ = corpus
    with pytest.raises(CorpusError, match="no split 'tset'; the corpus has train, valid"):
        loader(root, split="tset")


def test_bad_files_are_refused_at_open_naming_the_file(tmp_path):
    tokens = synthetic_stream(N_TOKENS, seed=3)
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=Layout(2, 8))
    rank1 = root / "train" / "00001.arrow"
    flip_bytes(rank1)
    with pytest.raises(CorpusError, match=f"{rank1}: sha256 .* corrupt"):
        loader(root, rank=1, world_size=2)
    loader(root, rank=0, world_size=2).close()  # rank 0 never touches the damaged file
    os.truncate(rank1, rank1.stat().st_size // 2)
    with pytest.raises(CorpusError, match=f"{rank1}: not a readable Arrow IPC file"):
        loader(root, rank=1, world_size=2, verify=False)
    (root / "tokenizer.model").write_bytes(b"a different model")
    with pytest.raises(CorpusError, match="tokenizer.model: sha256 differs"):
        loader(root, rank=0, world_size=2)
    edit_manifest(root, lambda d: d["splits"]["train"]["files"][0].update(path="../x.arrow"))
    with pytest.raises(CorpusError, match="manifest.json: .*'../x.arrow' points outside the corpus folder"):
        loader(root, rank=0, world_size=2)


def test_a_token_id_outside_the_vocabulary_is_a_corpus_fault_naming_its_position(tmp_path):
    from txl_dist.data.manifest import CorpusFault

    tokens = synthetic_stream(N_TOKENS, seed=4)  # ids < 1000, the helper's vocabulary
    bad_at = 5 * (N_TOKENS // 8) + 23  # inside stream 5
    tokens[bad_at] = 1000
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=Layout(2, 8))
    streams = loader(root)
    with pytest.raises(CorpusFault, match=rf"token {bad_at} of the split's stream is id 1000, outside \[0, 1000\)"):
        take(streams, 8)
    take(loader(make_corpus(tmp_path / "ok", {"train": synthetic_stream(N_TOKENS, seed=4)}, layout=Layout(2, 8))), 8)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident set from /proc/self/smaps")
def test_resident_memory_stays_flat_while_streaming_through_the_block(tmp_path):
    # A mapped page stays resident until its file is closed: without unmapping what the streams have passed,
    # a rank's resident set grew by 2 bytes per token read, to its whole block (tens of GB) by an epoch's end.
    tokens = np.random.default_rng(0).integers(0, 1000, 24 << 20, dtype=np.uint16)  # 48 MiB of uint16
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=Layout(1, 4), batch_tokens=4 << 20)
    ref = reference_streams(tokens, 4)  # [4, L]
    streams = loader(root, n_streams=4, micro_batch=4, tgt_len=8192, verify=False, epochs=2)
    peak = 0
    for mb in streams:  # two epochs: the second reads the unmapped pages again, and must read the same tokens
        p = mb.position
        np.testing.assert_array_equal(mb.input_ids, ref[:, p:p + 8192])
        np.testing.assert_array_equal(mb.labels, ref[:, p + 1:p + 8193])
        if mb.step % 64 == 0:
            peak = max(peak, mapped_rss(root))
    streams.close()
    assert 0 < peak < 16 << 20, f"{peak / 2**20:.1f} MiB of the corpus resident while streaming 48 MiB"


def _start_and_measure_mapped(raw: dict, corpus: str) -> int:
    """One training start on this rank: bytes of the corpus resident in it once the start is done."""
    from txl_dist import distributed
    from txl_dist.config import config_from_dict
    from txl_dist.startup import start_training

    env = distributed.discover()
    distributed.init_process_group(env)
    try:
        start = start_training(config_from_dict(raw), env, "auto")
        mapped = mapped_rss(corpus)
        start.tracker.close()
        start.close()
        return mapped
    finally:
        distributed.destroy_process_group()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident set from /proc/self/smaps")
def test_the_start_up_sample_of_the_training_tokens_leaves_no_pages_resident(tmp_path):
    # Rank 0 samples 4 M tokens in 64 windows spread over its block (the softmax clusters' shares); their pages
    # stayed mapped for the whole run (130 MiB on a 3.2 GB block), though no step reads them soon.
    from dist_helpers import run_ranks, tiny_config

    tokens = np.random.default_rng(0).integers(4, 64, 16 << 20, dtype=np.uint16)  # a 32 MiB block
    corpus = make_corpus(tmp_path / "c", {"train": tokens, "valid": tokens[:4096]}, Layout(1, 4), vocab_size=64,
                         batch_tokens=4 << 20)
    raw = tiny_config(corpus, tmp_path / "run", eval={"at_end": False})
    [mapped] = run_ranks(_start_and_measure_mapped, 1, raw, str(corpus))
    assert mapped < 4 << 20, f"{mapped / 2**20:.1f} MiB of the corpus resident after the start (8 MiB sampled)"


def _read_on_after_truncating(root: str, victim: str) -> str:
    """A loader that has read one batch; `victim` cut to 4 KiB in place; what reading on raises."""
    from txl_dist.data.manifest import CorpusFault

    streams = loader(root, n_streams=4, micro_batch=4, tgt_len=64, verify=False)
    take(streams, 1)
    os.truncate(victim, 4096)
    try:
        take(streams, 2000)  # past the first read-ahead piece of each stream
    except CorpusFault as e:
        return str(e)
    return "read on"


def test_a_file_cut_shorter_during_the_run_is_one_line_not_a_bus_error(tmp_path):
    # The pages past a file's new end give SIGBUS when read: the rank died with "Bus error", no line said
    # which file (a child process: without the check, the test's own process would die).
    from dist_helpers import run_ranks

    tokens = np.random.default_rng(0).integers(0, 1000, 1 << 20, dtype=np.uint16)
    root = make_corpus(tmp_path / "c", {"train": tokens}, layout=Layout(1, 4), batch_tokens=1 << 16)
    victim = root / "train" / "00000.arrow"
    [said] = run_ranks(_read_on_after_truncating, 1, str(root), str(victim))
    assert re.match(rf"{re.escape(str(victim))}: the file shrank from \d+ to 4096 bytes while this run read it", said)
    assert "put the prepared file back" in said and "\n" not in said, said


def test_a_corpus_folder_this_user_may_not_search_is_one_line(tmp_path):
    # Path.is_file() raises for EACCES (not for a missing file): the loader let a bare PermissionError out, and a
    # training start said only "error: <file>: Permission denied".
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(N_TOKENS, seed=3)}, layout=Layout(2, 8))
    said = open_as_an_unprivileged_user(root, root / "train")
    assert said.startswith(f"refused: {root / 'train' / '00000.arrow'}: cannot be read ("), said
    assert "Permission denied" in said and "folders above it" in said


@pytest.mark.parametrize("victim, fix", [("manifest.json", "of the file and of the folders above it"),
                                         ("tokenizer.model", "of the file and of the folders above it"),
                                         ("..", "of the folders above it")])
def test_a_manifest_or_tokenizer_this_user_may_not_read_is_one_line(tmp_path, victim, fix):
    # read_manifest caught a missing manifest but not EACCES, and the tokenizer's check none: a training start
    # ended in a PermissionError traceback where the corpus' Arrow files are refused in one line.
    root = make_corpus(tmp_path / "c", {"train": synthetic_stream(N_TOKENS, seed=3)}, layout=Layout(2, 8))
    path = (root / victim).resolve()
    named = root if victim == ".." else path  # a folder above the corpus: the corpus folder cannot be read
    said = open_as_an_unprivileged_user(root, path)
    assert said.startswith(f"refused: {named}: cannot be read ("), said
    assert "Permission denied" in said and said.rstrip().endswith(f"check the permissions {fix}")
