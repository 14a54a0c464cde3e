"""MemoryBank: chunks of streams keep their own mems, reset together, and save/load by global stream id."""
import numpy as np
import pytest
import torch

from txl_dist.memory import MemoryBank, merge_state_dicts


def _mems(n_layer, m, mlen, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, mlen, d, generator=g) for _ in range(n_layer)]  # n_layer x [m, mlen, d]


def test_reset_chunk_gives_empty_memory_and_put_get_round_trip():
    bank = MemoryBank()
    ids = np.array([4, 5])
    assert bank.get(ids, np.array([True, True])) is None
    mems = _mems(2, 2, 3, 8, seed=0)
    bank.put(ids, mems)
    got = bank.get(ids, np.array([False, False]))
    assert all(g is t for g, t in zip(got, mems))
    # Another chunk is independent of this one.
    assert bank.get([6, 7], [True, True]) is None
    assert bank.get(ids, [False, False]) is not None
    # A wrap drops the chunk's mems.
    assert bank.get(ids, [True, True]) is None
    assert bank.stream_mems(4) is None


def test_mixed_reset_flags_in_one_chunk_are_refused():
    bank = MemoryBank()
    with pytest.raises(ValueError, match="do not wrap together"):
        bank.get([0, 1], [True, False])


def test_missing_mems_without_reset_is_an_error():
    bank = MemoryBank()
    with pytest.raises(KeyError, match=r"no mems for streams \[0, 1\]"):
        bank.get([0, 1], [False, False])


def test_put_refuses_mems_that_carry_gradients_or_wrong_batch():
    bank = MemoryBank()
    with pytest.raises(ValueError, match="detached"):
        bank.put([0], [torch.zeros(1, 2, 4, requires_grad=True)])
    with pytest.raises(ValueError, match=r"expected \[2, mlen, d_model\]"):
        bank.put([0, 1], [torch.zeros(3, 2, 4)])


def test_state_is_keyed_by_global_stream_and_reslices_into_other_chunks():
    # Rank layout A: one rank, chunks (0,1) and (2,3). Layout B: two ranks of one chunk of 2 streams each;
    # also layout C: chunks of 1 stream (another micro batch). Each must get exactly its streams' rows.
    chunk_a, chunk_b = _mems(3, 2, 5, 4, seed=1), _mems(3, 2, 5, 4, seed=2)
    bank = MemoryBank()
    bank.put([0, 1], chunk_a)
    bank.put([2, 3], chunk_b)
    state = bank.state_dict()
    assert sorted(state["mems"]) == [0, 1, 2, 3]
    # Copies, not views of the chunk: a saved stream costs its own bytes only.
    saved = state["mems"][2][0]
    assert saved.untyped_storage().nbytes() == saved.numel() * saved.element_size()

    rank1 = MemoryBank()
    rank1.load_state_dict(state, stream_ids=[2, 3])
    assert rank1.stream_ids() == [2, 3]
    got = rank1.get([2, 3], [False, False])
    for layer in range(3):
        torch.testing.assert_close(got[layer], chunk_b[layer], rtol=0, atol=0)

    singles = MemoryBank()
    singles.load_state_dict(state, stream_ids=[1])
    torch.testing.assert_close(singles.get([1], [False])[0], chunk_a[0][1:2], rtol=0, atol=0)


def test_merge_of_rank_states_and_missing_streams():
    a, b = MemoryBank(), MemoryBank()
    a.put([0, 1], _mems(1, 2, 2, 4, seed=3))
    b.put([2, 3], _mems(1, 2, 2, 4, seed=4))
    merged = merge_state_dicts([a.state_dict(), b.state_dict()])
    assert sorted(merged["mems"]) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="appear in two rank states"):
        merge_state_dicts([a.state_dict(), a.state_dict()])
    bank = MemoryBank()
    with pytest.raises(KeyError, match=r"no mems for streams \[4\]"):
        bank.load_state_dict(merged, stream_ids=[3, 4])


def test_bf16_mems_round_trip_bitwise():
    bank = MemoryBank()
    mems = [t.bfloat16() for t in _mems(2, 2, 3, 4, seed=5)]
    bank.put([0, 1], mems)
    other = MemoryBank()
    other.load_state_dict(bank.state_dict())
    got = other.get([0, 1], [False, False])
    assert got[0].dtype == torch.bfloat16
    assert all(torch.equal(g, t) for g, t in zip(got, mems))


def test_a_shorter_mem_len_at_resume_keeps_each_streams_last_positions():
    bank = MemoryBank()
    mems = _mems(2, 2, 5, 4, seed=6)  # 2 layers, 2 streams, 5 positions
    bank.put([0, 1], mems)
    for mem_len, kept in ((3, 3), (8, 5), (0, 0)):
        other = MemoryBank()
        other.load_state_dict(bank.state_dict(), mem_len=mem_len)
        got = other.get([0, 1], [False, False])
        assert [tuple(t.shape) for t in got] == [(2, kept, 4)] * 2
        for layer in range(2):
            torch.testing.assert_close(got[layer], mems[layer][:, 5 - kept:], rtol=0, atol=0)


def test_streams_saved_at_different_memory_lengths_join_one_chunk_at_the_shortest():
    # A chunk whose memory was forgotten (non-finite values) grows it back one segment at a time while the others
    # stay at mem_len; an elastic resume that put its streams into a micro batch with others raised torch.stack's
    # "stack expects each tensor to be equal size" at the first step. The model takes one mlen per batch.
    full, regrowing = _mems(2, 2, 8, 4, seed=7), _mems(2, 2, 3, 4, seed=8)
    bank = MemoryBank()
    bank.put([0, 1], full)
    bank.forget([2, 3])
    assert bank.get([2, 3], [False, False]) is None
    bank.put([2, 3], regrowing)
    one_chunk = MemoryBank()  # the resumed run: one micro batch of all four streams
    one_chunk.load_state_dict(bank.state_dict())
    got = one_chunk.get([0, 1, 2, 3], [False] * 4)
    assert [tuple(t.shape) for t in got] == [(4, 3, 4)] * 2
    for layer in range(2):
        torch.testing.assert_close(got[layer], torch.cat([full[layer][:, -3:], regrowing[layer]]), rtol=0, atol=0)
