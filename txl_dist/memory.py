"""MemoryBank: the Transformer-XL memory (mems) of one rank's streams, carried from segment to segment.

Gradient accumulation splits a rank's streams, not time (docs/architecture.md): micro step i of every optimizer
step feeds the same m streams, so the bank keeps one mems list per chunk of streams, keyed by the tuple of
their GLOBAL stream ids. The model takes one memory length for the whole batch; that is safe because the
loader wraps all streams together (every stream has the same length L and starts at the same offset), so
the streams of one chunk are always reset together. `get` checks that and refuses a mixed chunk.

Checkpoints store the mems per global stream id, so a job resumed with another world size (same number of
streams) hands every rank exactly the mems of the streams it owns now, whatever chunks they fall into.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

Mems = list[torch.Tensor]  # n_layer tensors [m, mlen, d_model]

STATE_VERSION = 1


class MemoryBank:
    """Mems per chunk of streams; reset when the streams wrap; saved and loaded per global stream id."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[int, ...], Mems] = {}
        # Per-stream mems restored from a checkpoint, stacked into their chunk on first use: the chunks of
        # the resumed run are only known when the loader hands them out.
        self._loose: dict[int, Mems] = {}
        # Chunks whose memory was thrown away (non-finite values): their next get() is an empty memory.
        self._forgotten: set[tuple[int, ...]] = set()

    def get(self, stream_ids: Sequence[int] | np.ndarray, reset: Sequence[bool] | np.ndarray) -> Mems | None:
        """The mems to feed with the next window of these streams; None (= empty memory) after a reset."""
        key = _key(stream_ids)
        flags = np.asarray(reset, dtype=bool)  # [m]
        if flags.shape != (len(key),):
            raise ValueError(f"MemoryBank.get: {len(key)} stream ids but reset flags of shape {flags.shape}")
        if flags.any():
            if not flags.all():
                raise ValueError(
                    f"MemoryBank.get: streams {list(key)} of one micro batch do not wrap together "
                    f"(reset={flags.tolist()}); the loader must wrap all streams at the same step")
            self._drop(key)
            return None
        if key in self._forgotten:
            return None
        if key in self._chunks:
            return self._chunks[key]
        have = [s for s in key if s in self._loose]
        if len(have) != len(key):
            missing = [s for s in key if s not in self._loose]
            raise KeyError(
                f"MemoryBank.get: no mems for streams {missing} and no reset; restore the bank from the "
                "checkpoint together with the loader (or start the loader from the beginning)")
        if any(not self._loose[s] for s in key):
            # A stream saved with no memory (forgotten): the chunk starts empty together (one mlen per batch).
            self.forget(key)
            return None
        n_layer = len(self._loose[key[0]])
        # The streams of a chunk may come from chunks of the saved run that were at different memory lengths (one
        # whose memory was forgotten grows back a segment at a time): the model takes one mlen per batch, so the
        # chunk keeps the last positions every stream has, as its streams' most recent context.
        mlen = min(self._loose[s][0].shape[0] for s in key)
        mems = [torch.stack([_last(self._loose[s][layer], mlen) for s in key])
                for layer in range(n_layer)]  # [m, mlen, d]
        for s in key:
            del self._loose[s]
        self._chunks[key] = mems
        return mems

    def put(self, stream_ids: Sequence[int] | np.ndarray, mems: Mems) -> None:
        """Keep the new mems of these streams (the model's out.mems, already detached)."""
        key = _key(stream_ids)
        for layer, t in enumerate(mems):
            if t.dim() != 3 or t.shape[0] != len(key):
                raise ValueError(
                    f"MemoryBank.put: mems[{layer}] has shape {tuple(t.shape)}, expected [{len(key)}, mlen, d_model]")
            if t.requires_grad:
                raise ValueError(f"MemoryBank.put: mems[{layer}] requires grad; mems must be detached (stop-gradient)")
        self._drop(key)
        self._chunks[key] = list(mems)

    def forget(self, stream_ids: Sequence[int] | np.ndarray) -> None:
        """Throw away the memory of the chunk holding these streams (it holds non-finite values); the next
        get() of the chunk is an empty memory, as after a wrap. The model takes one memory length per
        batch, so the whole micro batch restarts its memory, not only the poisoned streams."""
        key = _key(stream_ids)
        self._drop(key)
        self._forgotten.add(key)

    def _drop(self, key: tuple[int, ...]) -> None:
        self._forgotten.discard(key)
        self._chunks.pop(key, None)
        for s in key:
            self._loose.pop(s, None)
        overlapping = [k for k in self._chunks if set(k) & set(key)]
        if overlapping:
            raise ValueError(f"MemoryBank: streams {list(key)} were chunked differently before ({overlapping}); "
                             "the micro batches of a run must keep the same streams together")

    def clear(self) -> None:
        """Forget every stream's mems."""
        self._chunks.clear()
        self._loose.clear()
        self._forgotten.clear()

    def stream_ids(self) -> list[int]:
        """Global ids of the streams the bank knows (with mems, or forgotten), sorted."""
        return sorted([s for key in self._chunks for s in key] + list(self._loose)
                      + [s for key in self._forgotten for s in key])

    def stream_mems(self, stream_id: int) -> Mems | None:
        """The mems of one stream: n_layer tensors [mlen, d_model] (views), [] when forgotten, None when unknown."""
        if stream_id in self._loose:
            return self._loose[stream_id]
        if any(stream_id in key for key in self._forgotten):
            return []
        for key, mems in self._chunks.items():
            if stream_id in key:
                i = key.index(stream_id)
                return [t[i] for t in mems]  # [mlen, d_model] each
        return None

    def state_dict(self) -> dict[str, Any]:
        """{'version', 'mems': {global stream id: n_layer CPU tensors [mlen, d_model]}}; a forgotten stream
        has an empty list (its memory restarts after the resume too).

        Each stream's tensors are copies: saving a view would write the whole chunk's storage.
        """
        mems = {int(s): [t.detach().to("cpu", copy=True) for t in self.stream_mems(s)] for s in self.stream_ids()}
        return {"version": STATE_VERSION, "mems": mems}

    def load_state_dict(self, state: dict[str, Any], stream_ids: Iterable[int] | None = None,
                        device: torch.device | str = "cpu", mem_len: int | None = None) -> None:
        """Take the mems of `stream_ids` (default: all in `state`) onto `device`; a missing one is an error.

        mem_len: keep each stream's last mem_len positions (a run resumed with a shorter model.mem_len
        attends to that many from its first step, as an uninterrupted run with it would)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"MemoryBank state version {state.get('version')!r} is not {STATE_VERSION}")
        saved: dict[int, Mems] = state["mems"]
        wanted = sorted(saved) if stream_ids is None else sorted(int(s) for s in stream_ids)
        missing = [s for s in wanted if s not in saved]
        if missing:
            raise KeyError(
                f"MemoryBank.load_state_dict: the checkpoint has no mems for streams {missing}; it was saved "
                "with another number of streams (deepspeed.train_batch_size) or before the first step")
        self.clear()
        self._loose = {s: [_last(t, mem_len).to(device) for t in saved[s]] for s in wanted}


def merge_state_dicts(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One state holding the mems of every stream in `states` (the per-rank files of a checkpoint)."""
    merged: dict[int, Mems] = {}
    for state in states:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"MemoryBank state version {state.get('version')!r} is not {STATE_VERSION}")
        overlap = set(merged) & set(state["mems"])
        if overlap:
            raise ValueError(f"merge_state_dicts: streams {sorted(overlap)} appear in two rank states")
        merged.update(state["mems"])
    return {"version": STATE_VERSION, "mems": merged}


def _last(t: torch.Tensor, positions: int | None) -> torch.Tensor:
    """The last `positions` rows of t [mlen, d_model] (all of them for None)."""
    return t if positions is None else t[max(0, t.shape[0] - positions):]


def _key(stream_ids: Sequence[int] | np.ndarray) -> tuple[int, ...]:
    return tuple(int(s) for s in np.asarray(stream_ids).reshape(-1))
