"""StreamLoader: a rank's contiguous block of streams, read as ordered, resumable Transformer-XL windows.

A split's global stream is cut into S streams of L = n_tokens // S tokens; rank r of W owns streams
[r*S/W, (r+1)*S/W) (see format.rank_token_range). Gradient accumulation splits those streams, not time:
with g = S / (m * W) micro steps per optimizer step, micro step i of a step reads the rank's local
streams [i*m, (i+1)*m) at the same time position, so every stream advances by tgt_len tokens per
optimizer step and its mems line up from one segment to the next.

Window k of epoch e covers stream tokens [o_e + k*T, o_e + (k+1)*T + 1): input_ids are the first T of
them, labels the last T (the next tokens). o_e = 0, or with `roll` a seeded offset in [0, T) drawn per
epoch, the same for all streams so they all wrap together. The first window of each epoch has reset set:
the mems of those streams must be cleared, the text before it is not their context.

The position is the same on every rank (epoch, window, micro step), so a state saved by any rank resumes
any world size that divides S, at an optimizer-step boundary.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .arrow_io import MAPPED_AROUND_BYTES
from .index_split import split_reader
from ..streams import micro_steps_per_rank, streams_of_rank
from .manifest import CorpusError, CorpusFault, read_manifest, tokenizer_file_sha256

STATE_VERSION = 1
READ_AHEAD_TOKENS = 1 << 15
"""Tokens of a stream read at once and kept while its windows pass through them (one piece per stream of
the rank: 64 KiB of uint16 each, a copy: its pages are unmapped once it is read). On an index split
(`mix --index`) a read gathers its documents from the sources' files, and its fixed cost per call (the
documents' lookup, one gather per source) is paid once per piece instead of once per window: 0.5 -> 18 M
tokens per CPU second with 11-token documents (bench/results/mix.txt)."""



class SplitTooShort(CorpusError):
    """A split too short for the streams asked of it (the caller knows which settings asked: it names them)."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro step of one rank: windows of m streams at the same time position."""

    input_ids: np.ndarray
    """int64 [m, T]: tokens [position, position + T) of each stream."""
    labels: np.ndarray
    """int64 [m, T]: the next tokens, [position + 1, position + T + 1)."""
    stream_ids: np.ndarray
    """int64 [m]: GLOBAL stream ids (mems are keyed by these; they do not depend on the world size)."""
    micro_step: int
    """Index of this micro batch within its optimizer step, 0..g-1."""
    step: int
    """Optimizer step index since the first epoch (counts across epochs)."""
    epoch: int
    """Pass over the streams, from 0."""
    reset: np.ndarray
    """bool [m]: this window starts a new pass over the stream; clear its mems before using them."""
    position: int
    """Offset inside each stream of input_ids[:, 0]."""


class StreamLoader:
    """Ordered, resumable Transformer-XL windows over one rank's block of a prepared split.

    Iterating yields one MicroBatch per micro step, in order: step 0 micro 0..g-1, step 1, ... The
    loader is stateful: iterating again continues where the last iteration stopped, and state_dict()
    always describes the next micro batch. `epochs=None` runs forever; `partial_last` (for evaluation,
    not with roll) adds one shorter last window per epoch so that every token of each stream except its
    first is predicted exactly once. `verify` checks the sha256 of the tokenizer and of the rank's files
    when the loader is built (one read of the rank's block); turn it off only for data already verified.
    """

    def __init__(self, corpus_dir: str | os.PathLike, split: str, *, rank: int, world_size: int, n_streams: int,
                 micro_batch: int, tgt_len: int, roll: bool = False, seed: int = 0, epochs: int | None = None,
                 partial_last: bool = False, verify: bool = True):
        _check_layout(rank, world_size, n_streams, micro_batch, tgt_len)
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None (forever), got {epochs}")
        if roll and partial_last:
            raise ValueError("partial_last (evaluation: every token once) cannot be combined with roll; turn roll off")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.corpus_dir = Path(corpus_dir)
        self.manifest = read_manifest(self.corpus_dir)
        self.digest = self.manifest.digest()
        self.split, self.rank, self.world_size = split, rank, world_size
        self.n_streams, self.micro_batch, self.tgt_len = n_streams, micro_batch, tgt_len
        self.roll, self.seed, self.epochs, self.partial_last = roll, seed, epochs, partial_last
        if verify:
            self._verify_tokenizer()
        self.reader = split_reader(self.corpus_dir, self.manifest, split, verify=verify)  # names unknown splits
        self.stream_len = self._stream_length(self.reader.n_tokens)
        """L: tokens per stream."""
        self.accumulation_steps = n_streams // (micro_batch * world_size)
        """g: micro steps per optimizer step."""
        self.stream_ids = np.asarray(streams_of_rank(rank, n_streams, world_size), dtype=np.int64)
        """GLOBAL ids of this rank's streams, in local order."""
        self.block = (int(self.stream_ids[0]) * self.stream_len, int(self.stream_ids[-1] + 1) * self.stream_len)
        """Global-stream tokens [start, stop) owned by this rank."""
        # Open (and verify) the rank's files now: a bad file fails the start, not step 10,000.
        self.reader.open_range(*self.block)
        self._stream_starts = [int(s) * self.stream_len for s in self.stream_ids]
        self._read_ahead: dict[int, tuple[int, np.ndarray]] = {}  # local stream -> (first token, tokens)
        self._epoch_cache: dict[int, tuple[int, int]] = {}
        self._epoch = self._window = self._micro = self._step = 0

    def _stream_length(self, n_tokens: int) -> int:
        """L, refused (CorpusError naming the split) when a stream cannot hold one window."""
        where = f"split '{self.split}' of {self.corpus_dir}"
        if n_tokens == 0:
            raise CorpusError(f"{where} is empty (0 tokens); prepare the corpus with documents in it, "
                              "or use another split")
        stream_len = n_tokens // self.n_streams
        need = 2 * self.tgt_len if self.roll else self.tgt_len + 1  # with roll, the latest offset must fit too
        if stream_len < need:
            if self.n_streams > 1:
                cut = f"give {self.n_streams} streams of {stream_len} tokens"
                remedy = "fewer streams or a shorter tgt_len"
            else:
                cut, remedy = "in one stream", "a shorter tgt_len or a split with more text"
            raise SplitTooShort(f"{where}: {n_tokens} tokens {cut}, too short for {'roll with ' if self.roll else ''}"
                                f"tgt_len {self.tgt_len} (needs {need}); use {remedy}")
        return stream_len

    # ------------------------------------------------------------------------------------------------
    # Epoch geometry

    def epoch_offset(self, epoch: int) -> int:
        """o_e: where epoch e's first window starts in every stream (0 unless roll)."""
        return self._epoch_geometry(epoch)[0]

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps (= windows per stream) of epoch e; with roll it may be one less than offset 0 gives."""
        return self._epoch_geometry(epoch)[1]

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of an epoch starting at offset 0 (every epoch without roll)."""
        full, rest = divmod(self.stream_len - 1, self.tgt_len)
        return full + int(self.partial_last and rest > 0)

    def _epoch_geometry(self, epoch: int) -> tuple[int, int]:
        geo = self._epoch_cache.get(epoch)
        if geo is None:
            offset = int(np.random.default_rng([self.seed, epoch]).integers(self.tgt_len)) if self.roll else 0
            full, rest = divmod(self.stream_len - 1 - offset, self.tgt_len)
            geo = (offset, full + int(self.partial_last and rest > 0))
            self._epoch_cache[epoch] = geo
        return geo

    # ------------------------------------------------------------------------------------------------
    # Iteration

    def __iter__(self) -> Iterator[MicroBatch]:
        while not self.finished:
            batch = self._micro_batch(self._epoch, self._window, self._micro)
            self._advance()  # before yielding: state_dict() after k batches names batch k+1
            yield batch

    @property
    def finished(self) -> bool:
        """True once `epochs` epochs have been yielded (never with epochs=None)."""
        return self.epochs is not None and self._epoch >= self.epochs

    @property
    def files_opened(self) -> list[str]:
        """Manifest paths of the files this loader has opened (only those overlapping its block)."""
        return list(self.reader.files_opened)

    def _micro_batch(self, epoch: int, window: int, micro: int) -> MicroBatch:
        offset = self.epoch_offset(epoch)
        position = offset + window * self.tgt_len
        t = min(self.tgt_len, self.stream_len - 1 - position)  # < tgt_len only for the partial last window
        m = self.micro_batch
        rows = slice(micro * m, (micro + 1) * m)
        buf = np.empty((m, t + 1), dtype=np.int64)  # [m, T+1]
        for j in range(rows.start, rows.stop):
            start = self._stream_starts[j] + position
            buf[j - rows.start] = self._read(j, start, start + t + 1)  # [t+1], one cast
        return MicroBatch(
            input_ids=np.ascontiguousarray(buf[:, :-1]),  # [m, T]
            labels=np.ascontiguousarray(buf[:, 1:]),  # [m, T]
            stream_ids=self.stream_ids[rows].copy(),  # [m]
            micro_step=micro, step=self._step, epoch=epoch,
            reset=np.full(m, window == 0, dtype=np.bool_),  # [m]; all streams wrap together
            position=position,
        )

    def _read(self, local_stream: int, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of one of the rank's streams, from its read-ahead piece (refilled from `start`
        to at most READ_AHEAD_TOKENS further, never past the stream's end, when the window leaves it)."""
        first, piece = self._read_ahead.get(local_stream, (0, None))
        if piece is None or not first <= start <= stop <= first + len(piece):
            stream_end = self._stream_starts[local_stream] + self.stream_len
            first, end = start, max(stop, min(stream_end, start + READ_AHEAD_TOKENS))
            # The piece is a copy, its pages unmapped at once: a rank's resident memory does not grow with the
            # tokens it has read (a mapped page stays resident until its file is closed), and a file cut shorter
            # under the run is one line (the check), not SIGBUS at a later window of a view into it.
            self.reader.check_unchanged(first, end)
            piece = self.reader.read(first, end)
            if not piece.flags.owndata:
                piece = piece.copy()
            # From MAPPED_AROUND_BYTES back: a fault maps pages around the faulting one (fault-around, a whole
            # large folio of the page cache), also pages the stream has passed.
            behind = MAPPED_AROUND_BYTES // np.dtype(self.manifest.dtype).itemsize
            self.reader.release(max(self._stream_starts[local_stream], first - behind), end)
            self._check_ids(piece, first)
            self._read_ahead[local_stream] = (first, piece)
        return piece[start - first:stop - first]

    def _check_ids(self, tokens: np.ndarray, first: int) -> None:
        """CorpusFault for a token id outside the tokenizer's vocabulary (one min and max per read-ahead piece):
        checksums prove the files are the ones prepared, not that their writer was data_prep; such an id would
        fail deep inside the model, or, on a GPU, read another row of a table."""
        vocab = self.manifest.tokenizer.vocab_size
        if not len(tokens) or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab):
            return
        at = int(np.argmax((tokens < 0) | (tokens >= vocab)))
        raise CorpusFault(f"split '{self.split}' of {self.corpus_dir}: token {first + at} of the split's stream is id "
                          f"{int(tokens[at])}, outside [0, {vocab}) of its tokenizer; the corpus was not written by "
                          f"data_prep or is damaged: `python -m data_prep verify {self.corpus_dir}` names the file")

    def _advance(self) -> None:
        self._micro += 1
        if self._micro < self.accumulation_steps:
            return
        self._micro = 0
        self._window += 1
        self._step += 1
        # An epoch with no window cannot happen (stream_len checked), but loop rather than assume.
        while not self.finished and self._window >= self.steps_in_epoch(self._epoch):
            self._epoch += 1
            self._window = 0

    # ------------------------------------------------------------------------------------------------
    # Resume

    def state_dict(self) -> dict[str, Any]:
        """The position of the next micro batch plus what it is only valid for (JSON-serializable)."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch, "window": self._window, "micro_step": self._micro, "step": self._step,
            "position": None if self.finished else self.epoch_offset(self._epoch) + self._window * self.tgt_len,
            "split": self.split, "digest": self.digest,
            "n_streams": self.n_streams, "stream_len": self.stream_len, "tgt_len": self.tgt_len,
            "roll": self.roll, "seed": self.seed, "partial_last": self.partial_last,
            "world_size": self.world_size, "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses (one line) a state this loader cannot continue exactly."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"loader state: version {got!r} is not {STATE_VERSION}; "
                             "it was not saved by this StreamLoader")
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"loader state: '{missing[0]}' is missing")
        for key, why in (("digest", "it was saved for another corpus (or another preparation of it)"),
                         ("split", "it was saved for another split"),
                         ("n_streams", "keep train_batch_size (the number of streams) when resuming"),
                         ("stream_len", "the stream length differs: another corpus or number of streams"),
                         ("tgt_len", "keep tgt_len when resuming"),
                         ("roll", "keep data.roll when resuming"),
                         ("seed", "keep data.seed when resuming (it decides the epoch offsets)"),
                         ("partial_last", "keep partial_last when resuming")):
            if key == "seed" and not self.roll:
                continue  # the seed places the epochs' offsets only when they roll
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state: {key} is {state[key]!r} but this loader has {getattr(self, key)!r}; {why}")
        epoch, window, micro, step = (state[k] for k in ("epoch", "window", "micro_step", "step"))
        if micro and (state["world_size"], state["micro_batch"]) != (self.world_size, self.micro_batch):
            raise ValueError(
                f"loader state: saved mid-step (micro step {micro}) with world size {state['world_size']} and micro "
                f"batch {state['micro_batch']}, but this loader has {self.world_size} and {self.micro_batch}; "
                "resume another layout only from an optimizer-step boundary")
        if not all(isinstance(v, int) and v >= 0 for v in (epoch, window, micro, step)):
            raise ValueError(f"loader state: epoch/window/micro_step/step must be integers >= 0, got "
                             f"{epoch!r}/{window!r}/{micro!r}/{step!r}")
        done = self.epochs is not None and epoch >= self.epochs
        if not done and (window >= self.steps_in_epoch(epoch) or micro >= self.accumulation_steps):
            raise ValueError(f"loader state: window {window}, micro step {micro} do not exist in epoch {epoch} "
                             f"({self.steps_in_epoch(epoch)} windows, {self.accumulation_steps} micro steps)")
        if not done and state["position"] is not None \
                and state["position"] != self.epoch_offset(epoch) + window * self.tgt_len:
            # With data.roll each epoch's offset is drawn from numpy's generator, whose streams numpy does not
            # promise to keep across versions: a resume must read the tokens the saved run would have read.
            raise ValueError(
                f"loader state: saved at token position {state['position']!r} (epoch {epoch}, window {window}), but "
                f"this loader puts that window at {self.epoch_offset(epoch) + window * self.tgt_len}: its epoch "
                f"offsets (data.roll) differ from the saving run's (another numpy, {np.__version__} here?); "
                "resume with the versions that saved it")
        self._epoch, self._window, self._micro, self._step = epoch, window, micro, step

    # ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the rank's files."""
        self._read_ahead.clear()
        self.reader.close()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _verify_tokenizer(self) -> None:
        tok = self.manifest.tokenizer
        path = self.corpus_dir / tok.file
        if tokenizer_file_sha256(self.corpus_dir, tok) != tok.sha256:
            raise CorpusError(f"{path}: sha256 differs from the manifest's {tok.sha256[:12]}...: this is not the "
                              "tokenizer the corpus was made with; re-run prepare")


def _check_layout(rank: int, world_size: int, n_streams: int, micro_batch: int, tgt_len: int) -> None:
    """One line per impossible layout, naming the numbers and what would work."""
    for name, v in (("world_size", world_size), ("n_streams", n_streams), ("micro_batch", micro_batch),
                    ("tgt_len", tgt_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    micro_steps_per_rank(n_streams, micro_batch, world_size)
