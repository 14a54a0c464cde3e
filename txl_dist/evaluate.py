"""Distributed perplexity with long memory (the paper's evaluation).

Evaluation has its own tgt_len, mem_len, clamp_len and same_length; the memory settings go to every forward
(the model's own stay the training ones). The split is cut into eval.n_streams streams (default: one per rank); each
rank evaluates its contiguous block of them, carrying their mems from segment to segment, and predicts every
token of each stream except the first exactly once (partial last window). A rank runs its streams in equal
groups of at most eval.micro_batch, each group through the whole split before the next (a group's streams
are the block of a rank of a world eval.micro_batch times larger: the same streams, read by the same loader):
memory holds one group's mems and activations, so one GPU can evaluate the streams of a run trained on many.
Sums of NLL and token counts are all-reduced in float64, so the numbers depend on the number of streams,
not on the world size.

A mixture (`python -m data_prep mix`) keeps each source's held-out text as a split `<split>/<name>` beside
its own; `parts(split)` lists them, and the trainer reports each (`valid/<name>/<metric>`).

Bits per byte / per character convert the per-token loss with the split's token/byte and token/char
ratios from the manifest (n_tokens / n_bytes): the cost of the whole text at the model's per-token rate.
"""
from __future__ import annotations

import itertools
import math
import os
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from . import distributed
from .config import EvalConfig
from .data import SplitTooShort, StreamLoader, hash_record
from .data.format import split_parts
from .host_copy import to_device
from .memory import MemoryBank
from .model.softmax import TailPlan, tail_plan
from .progress import Progress
from .streams import group_size, streams_per_rank


class Evaluator:
    """Evaluates a model on any split of one corpus; builds (and verifies) each split's loader once."""

    def __init__(self, corpus_dir: str | os.PathLike, eval_cfg: EvalConfig, *, rank: int, world_size: int,
                 n_streams: int, micro_batch: int | None = None, device: torch.device | str = "cpu",
                 splits: Iterable[str] = ()):
        """micro_batch: at most this many streams per forward pass (None: all of the rank's at once; the run's
        is RunConfig.eval_micro_batch). `splits` (and their per-source parts) are opened (and verified) now, so
        that a split too short for the evaluation's streams fails the start of a run, not its first evaluation
        hours later; others open on first use."""
        per_rank = streams_per_rank(n_streams, world_size, streams="eval.n_streams")
        self.corpus_dir, self.cfg = corpus_dir, eval_cfg
        self.rank, self.world_size, self.n_streams = rank, world_size, n_streams
        self.group = group_size(per_rank, per_rank if micro_batch is None else micro_batch)
        """Streams per forward pass: the groups' size."""
        self.groups = per_rank // self.group
        self.device = torch.device(device)
        self._loaders: dict[str, list[tuple[StreamLoader, dict]]] = {}
        for split in splits:
            for name in [split, *self.parts(split)]:
                self._group_loaders(name)

    def parts(self, split: str) -> list[str]:
        """The per-source parts `<split>/<name>` of a mixture's split (none for other corpora)."""
        return split_parts(self._group_loaders(split)[0].manifest.splits, split)

    def _group_loaders(self, split: str) -> list[StreamLoader]:
        """One loader per group of the rank's streams, each at the split's beginning."""
        if split not in self._loaders:
            # The groups' blocks share files (and the tokenizer): each is hashed once, by a record of this
            # start's digests (training's own, else one never saved: its folder is no folder).
            record = hash_record.active() or hash_record.HashRecord(os.devnull)
            with record.in_use():
                self._loaders[split] = self._open_groups(split)
        for loader, start in self._loaders[split]:
            loader.load_state_dict(start)  # every evaluation reads the split from its beginning
        return [loader for loader, _ in self._loaders[split]]

    def _open_groups(self, split: str) -> list[tuple[StreamLoader, dict]]:
        """Each group's loader and its starting state; none left open when one cannot be made."""
        opened: list[tuple[StreamLoader, dict]] = []
        try:
            for group in range(self.groups):
                loader = StreamLoader(self.corpus_dir, split, rank=self.rank * self.groups + group,
                                      world_size=self.world_size * self.groups, n_streams=self.n_streams,
                                      micro_batch=self.group, tgt_len=self.cfg.tgt_len, epochs=1, partial_last=True)
                opened.append((loader, loader.state_dict()))
        except BaseException as e:
            for loader, _ in opened:
                loader.close()
            if isinstance(e, SplitTooShort):  # the loader cannot know which settings made its streams: name them
                raise SplitTooShort(f"{e} (evaluation: eval.n_streams {self.n_streams}, "
                                    f"eval.tgt_len {self.cfg.tgt_len})") from None
            raise
        return opened

    def _windows(self, loader: StreamLoader) -> int:
        """Segments per stream of an evaluation with one of its group loaders (eval.max_segments caps them)."""
        total = loader.steps_per_epoch  # one micro batch (a group's streams) per window
        return total if self.cfg.max_segments is None else min(total, self.cfg.max_segments)

    def segments(self, split: str) -> int:
        """How many segments (forward passes) an evaluation of `split` runs: the same on every rank."""
        return self._windows(self._group_loaders(split)[0]) * self.groups

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str,
                 on_segment: Callable[[int], None] | None = None) -> dict[str, float]:
        """loss, perplexity, bits per token/byte/char and the token count, the same on every rank (collective).
        on_segment(i): called as segment i (from 0) begins, its input in hand; every rank has as many."""
        loaders = self._group_loaders(split)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # [nll sum, tokens]
        memory = self.cfg.memory()
        cutoffs = model.config.cutoffs
        windows = self._windows(loaders[0])
        label = f"evaluating {split}" + (f" ({self.groups} groups of {self.group} streams)" if self.groups > 1 else "")
        progress = Progress(label, windows * self.groups, "segments", quiet=self.rank != 0)
        tokens_read = 0  # from the host shapes: counting from `sums` would sync with the device
        segment = 0
        with eval_mode(model):
            for loader in loaders:
                bank = MemoryBank()  # a new one per group: the last group's mems are freed
                for mb in itertools.islice(loader, windows):
                    if segment:  # not after the last segment: the result follows at once
                        progress.update(segment, tokens_read * self.world_size)  # every rank holds equal streams
                    if on_segment is not None:
                        on_segment(segment)
                    segment += 1
                    # Non-blocking copies, and the softmax's cluster counts from the host labels: no sync here.
                    input_ids, labels, plan = batch_to_device(mb.input_ids, mb.labels, self.device, cutoffs)  # [n, T]
                    out = model(input_ids, labels=labels, mems=bank.get(mb.stream_ids, mb.reset), memory=memory,
                                tail_plan=plan)
                    bank.put(mb.stream_ids, out.mems)
                    sums[0] += out.nll.double().sum()
                    sums[1] += out.nll.numel()
                    tokens_read += mb.labels.size
                del bank
        distributed.all_reduce_sum(sums)
        nll, tokens = sums.tolist()
        split_info = loaders[0].manifest.splits[split]
        return summarize(nll, int(tokens), n_tokens=split_info.n_tokens, n_bytes=split_info.n_bytes,
                         n_chars=split_info.n_chars)

    def close(self) -> None:
        """Unmap the splits' files."""
        for group_loaders in self._loaders.values():
            for loader, _ in group_loaders:
                loader.close()
        self._loaders.clear()


def summarize(nll_sum: float, tokens: int, *, n_tokens: int, n_bytes: int, n_chars: int) -> dict[str, float]:
    """The evaluation numbers from a sum of NLL (nats) over `tokens` predicted tokens."""
    if tokens <= 0:
        raise ValueError("evaluation predicted no token; the split is too short for its eval streams")
    loss = nll_sum / tokens
    bits = loss / math.log(2)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
        "bits_per_token": bits,
        "bits_per_byte": bits * n_tokens / n_bytes if n_bytes else float("nan"),
        "bits_per_char": bits * n_tokens / n_chars if n_chars else float("nan"),
        "tokens": float(tokens),
    }


def batch_to_device(input_ids: np.ndarray, labels: np.ndarray, device: torch.device,
                    cutoffs: list[int]) -> tuple[torch.Tensor, torch.Tensor, TailPlan | None]:
    """A micro batch [m, T] on `device` with the adaptive softmax's TailPlan made from the host labels (None
    without tail clusters): what the evaluator and the trainer feed the model, with no host sync."""
    plan = tail_plan(labels, cutoffs, device) if cutoffs else None
    return to_device(input_ids, device), to_device(labels, device), plan


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout); its training mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
