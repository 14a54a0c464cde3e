"""Model FLOPs per token and the peak FLOP/s of a device: the two halves of MFU (docs/performance.md).

`flops_per_token` counts every matrix product of one training step (forward and backward) of the model a
ModelConfig describes, per trained token, in the steady state (a memory of mem_len positions in front of
each segment of tgt_len tokens). Counted (2 FLOPs per multiply-add):

- per layer: the q projection of the segment's T tokens, the k/v projection of all K = mem_len + tgt_len
  positions, the content scores q.k (T x K per head), the position scores against K + 1 distances (the
  matmul path's extra all-zero distance row that makes the rel-shift free), probabilities x values, the
  output projection, the two feed-forward products; the r_net projection of the K position rows once per
  segment (shared by the micro batch, so divided by micro_batch * tgt_len tokens);
- the adaptive input's projections (div_val > 1: every cluster projects every token, as the model does);
- the adaptive softmax as computed: the head (shortlist + one logit per cluster, and its projection) for
  every token; each tail with its projection for the tokens of its cluster only ("gather" tail mode:
  expected cluster shares) or for every token ("dense").

Backward costs twice the forward for every product (input and weight gradients), except r_net, whose
input (the sinusoid table) needs no gradient: forward + weight gradient only. Not counted: softmax,
layer norm, dropout, activations, embedding lookups, the rel-shift view, optimizer and gradient reduction
(elementwise work, well under 1% at the presets' sizes), and the forward that activation checkpointing
repeats in backward (model FLOPs, not hardware FLOPs: MFU does not reward recomputation).

`peak_flops(device, dtype)` is the documented dense peak of a known GPU (PEAK_TABLE, datasheet values),
else a matmul peak measured on the spot (`measure_matmul_peak`; on a CPU one thread's best rate times the
process's threads, which other processes on the machine disturb far less): CPUs differ from machine to
machine.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from .config import ModelConfig
from .model.softmax import logit_rows

TAIL_MODES = ("gather", "dense")


def cluster_token_shares(tokens: np.ndarray, cutoffs: Sequence[int], vocab_size: int) -> list[float]:
    """Fraction of `tokens` in each adaptive-softmax cluster: [head, tail 1, ..., tail C] (sums to 1)."""
    counts = np.bincount(np.searchsorted(np.asarray(cutoffs), np.asarray(tokens), side="right"),
                         minlength=len(cutoffs) + 1).astype(np.float64)
    total = counts.sum()
    if total == 0:
        return zipf_cluster_shares(cutoffs, vocab_size)
    return (counts / total).tolist()


def zipf_cluster_shares(cutoffs: Sequence[int], vocab_size: int) -> list[float]:
    """Cluster shares when no tokens are at hand: ids ordered by frequency with Zipf's law (p(id) ~ 1/(id+1)),
    the assumption the adaptive softmax's cutoffs are made under."""
    ends = [0, *cutoffs, vocab_size]

    def harmonic(n: int) -> float:  # H(n) = sum_{k=1..n} 1/k, Euler-Maclaurin beyond a few terms
        return sum(1.0 / k for k in range(1, n + 1)) if n < 64 else math.log(n) + 0.5772156649 + 0.5 / n

    total = harmonic(vocab_size)
    return [(harmonic(hi) - harmonic(lo)) / total for lo, hi in zip(ends[:-1], ends[1:])]


SMALL_HEAD_SHARE = 0.5
"""Below this share of the training tokens in the head cluster, start-up warns (small_head_warning). Adaptive
softmax setups hold most tokens in the head: 86% for the tiny preset on Shakespeare, more at larger cutoffs."""


def small_head_warning(cutoffs: Sequence[int], shares: Sequence[float] | None) -> str | None:
    """A line for the start-up log when the head cluster holds under SMALL_HEAD_SHARE of the sampled training
    tokens, else None. The cutoffs assume ids ordered by frequency, as data_prep numbers the tokenizers it
    trains; a tokenizer given with --tokenizer-model keeps SentencePiece's order: its fixed pieces first (the
    control pieces and, with byte fallback, 256 byte pieces), then by score or merge order. A small
    cutoffs[0] can then leave the head with rare pieces alone and send most tokens through a tail (the
    head's cluster logit, then a second softmax), learning and training slower."""
    if not cutoffs or not shares or shares[0] >= SMALL_HEAD_SHARE:
        return None
    return (f"model.cutoffs {list(cutoffs)}: the head cluster (ids below {cutoffs[0]}) holds only {shares[0]:.1%} of "
            f"a sample of the training tokens; the adaptive softmax expects most tokens in the head, at low ids. A "
            f"SentencePiece model given to data_prep (--tokenizer-model) keeps its own order, its control pieces "
            f"and 256 byte pieces first: raise cutoffs[0] well above them, prepare the corpus with a tokenizer "
            f"data_prep trains (numbered by frequency), or use no cutoffs ([])")


def sample_cluster_shares(reader, start: int, stop: int, cutoffs: Sequence[int], vocab_size: int, *,
                          max_tokens: int = 1 << 22, pieces: int = 64) -> list[float]:
    """Cluster shares of tokens [start, stop) of a split (`reader.read(a, b)`, e.g. txl_dist.data's
    TokenReader): all of them up to max_tokens, else `pieces` evenly spread windows totalling max_tokens."""
    n = stop - start
    if n <= max_tokens:
        return cluster_token_shares(reader.read(start, stop), cutoffs, vocab_size)
    width = max_tokens // pieces
    starts = np.linspace(start, stop - width, pieces).astype(np.int64)
    sample = np.concatenate([reader.read(int(a), int(a) + width) for a in starts])
    return cluster_token_shares(sample, cutoffs, vocab_size)


def flops_breakdown(cfg: ModelConfig, *, micro_batch: int, cluster_shares: Sequence[float] | None = None,
                    tail_mode: str = "gather", training: bool = True,
                    mem_len: int | None = None) -> dict[str, float]:
    """FLOPs per trained token by part ("layers", "r_net", "embedding", "softmax_head", "softmax_tails").

    micro_batch: sequences per forward (r_net runs once per segment for all of them). cluster_shares:
    fraction of tokens per cluster [head, tail 1, ...] (cluster_token_shares of the training tokens);
    None: zipf_cluster_shares. tail_mode: "gather" (each tail scores its cluster's tokens) or "dense"
    (every tail scores every token), as ProjectedAdaptiveLogSoftmax.resolved_tail_mode decides. training:
    forward + backward (False: forward only). mem_len: keys beyond the segment (None: cfg.mem_len).
    """
    if cfg.vocab_size is None:
        raise ValueError("flops_breakdown: model.vocab_size is null; resolve it from the corpus first")
    if tail_mode not in TAIL_MODES:
        raise ValueError(f"tail_mode {tail_mode!r} is unknown; use one of {', '.join(TAIL_MODES)}")
    d, hd, t = cfg.d_model, cfg.n_head * cfg.d_head, cfg.tgt_len
    k = t + (cfg.mem_len if mem_len is None else mem_len)
    n_clusters = len(cfg.cutoffs)
    if cluster_shares is None:
        cluster_shares = zipf_cluster_shares(cfg.cutoffs, cfg.vocab_size)
    if len(cluster_shares) != n_clusters + 1:
        raise ValueError(f"cluster_shares: {len(cluster_shares)} values for {n_clusters + 1} clusters")
    backward = 2 if training else 0  # input and weight gradients of a product cost one forward each
    weight_grad_only = 1 if training else 0

    # Per token of the segment (multiply-adds x 2).
    per_layer = (2 * d * hd                       # q: the segment's tokens only
                 + 2 * (k / t) * d * 2 * hd       # k and v: memory + segment
                 + 2 * hd * k                     # content scores (q + u) . k
                 + 2 * hd * (k + 1)               # position scores against K + 1 distances
                 + 2 * hd * k                     # probabilities x values
                 + 2 * hd * d                     # output projection
                 + 2 * 2 * d * cfg.d_inner)       # feed-forward in and out
    r_net = 2 * k * d * hd / (micro_batch * t)    # K position rows, once per segment

    d_embed = cfg.resolved_d_embed()
    if cfg.div_val == 1:
        d_embs = [d_embed] * (n_clusters + 1)
        has_proj = d_embed != d
        embedding = 2 * d_embed * d if has_proj else 0
    else:
        d_embs = [d_embed // cfg.div_val ** i for i in range(n_clusters + 1)]
        has_proj = True
        embedding = sum(2 * e * d for e in d_embs)  # every cluster embeds every token (a select keeps one)

    def cluster_cost(i: int, n_out: int) -> float:
        return (2 * d * d_embs[i] if has_proj else 0) + 2 * d_embs[i] * n_out

    rows = logit_rows(cfg.vocab_size, cfg.cutoffs, cfg.div_val, cfg.pad_vocab_multiple)  # padding is computed too
    head = cluster_cost(0, rows[0])
    tails = sum((1.0 if tail_mode == "dense" else cluster_shares[i]) * cluster_cost(i, rows[i])
                for i in range(1, n_clusters + 1))
    full = 1 + backward
    return {
        "layers": cfg.n_layer * per_layer * full,
        "r_net": cfg.n_layer * r_net * (1 + weight_grad_only),
        "embedding": embedding * full,
        "softmax_head": head * full,
        "softmax_tails": tails * full,
    }


def flops_per_token(cfg: ModelConfig, *, micro_batch: int, cluster_shares: Sequence[float] | None = None,
                    tail_mode: str = "gather", training: bool = True, mem_len: int | None = None) -> float:
    """Model FLOPs per trained token (forward + backward when training): the sum of flops_breakdown."""
    return sum(flops_breakdown(cfg, micro_batch=micro_batch, cluster_shares=cluster_shares, tail_mode=tail_mode,
                               training=training, mem_len=mem_len).values())


# ----------------------------------------------------------------------------------------------------
# Peak FLOP/s

# Dense (no structured sparsity) tensor-core peaks per GPU, FLOP/s, from NVIDIA's datasheets; "fp32" is
# the plain FP32 peak (torch does not use TF32 for matmuls unless asked). A name matches whole words of the
# device's name (table_peak), and the first match wins, so the longer names come first.
PEAK_TABLE: tuple[tuple[str, dict[str, float], str], ...] = (
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}, "NVIDIA GH200 datasheet (H100 SXM GPU)"),
    ("H200 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60.0e12}, "NVIDIA H200 datasheet (NVL)"),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}, "NVIDIA H200 datasheet (SXM)"),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60.0e12}, "NVIDIA H100 datasheet (NVL)"),
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "fp32": 51.2e12}, "NVIDIA H100 datasheet (PCIe)"),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}, "NVIDIA H100 datasheet (SXM)"),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 75e12}, "NVIDIA HGX B200 datasheet (per GPU)"),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, "NVIDIA A100 datasheet"),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "fp32": 91.6e12}, "NVIDIA L40S datasheet"),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}, "NVIDIA L4 datasheet"),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}, "NVIDIA A10 datasheet"),
    ("V100 PCIe", {"fp16": 112e12, "fp32": 14e12}, "NVIDIA V100 datasheet (PCIe)"),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}, "NVIDIA V100 datasheet (SXM2)"),
)

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def table_peak(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """(FLOP/s, source) of PEAK_TABLE for a device name (torch.cuda.get_device_name) and dtype, or None.
    Names match as whole words ("NVIDIA A100-SXM4-80GB" is an A100): as text, "L4" was in "NVIDIA L40" and
    "A10" in "NVIDIA A10G", GPUs of other peaks; an unknown one is measured instead."""
    precision = _DTYPE_NAMES.get(dtype)
    words = _words(device_name)
    for key, peaks, source in PEAK_TABLE:
        name = _words(key)
        if any(words[i:i + len(name)] == name for i in range(len(words) - len(name) + 1)):
            if precision in peaks:
                return peaks[precision], f"{source}, dense {precision}"
            return None
    return None


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, *,
               seconds: float = 0.3) -> tuple[float, str]:
    """(peak FLOP/s of one device for `dtype`, where the number comes from): the table entry of a known GPU,
    else a matmul peak measured now for about `seconds` (CPUs, unknown GPUs; `measure_matmul_peak`)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = table_peak(name, dtype)
        if found is not None:
            return found[0], f"table: {name}: {found[1]}"
    value, size = measure_matmul_peak(device, dtype, seconds=seconds)
    matmul = f"{size}x{size} {_DTYPE_NAMES.get(dtype, dtype)} matmul"
    if device.type == "cpu":
        return value, f"measured: best {matmul} on one cpu thread x {torch.get_num_threads()} thread(s)"
    return value, f"measured: best {matmul} on {device.type}"


CPU_PEAK_SIZES = (384, 512)
"""Square sizes of the CPU peak: a product takes ~1-3 ms on one thread, short enough that many of them run
between two preemptions on a loaded machine; larger ones were no faster (docs/performance.md)."""
GPU_PEAK_SIZES = (4096, 8192)


def measure_matmul_peak(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, *,
                        seconds: float = 0.3, sizes: Sequence[int] | None = None) -> tuple[float, int]:
    """(best FLOP/s, at which size) of square matmuls in `dtype` on `device`, over about `seconds`.

    sizes: the square sizes tried (default CPU_PEAK_SIZES on a CPU, GPU_PEAK_SIZES on a GPU); they take
    turns, product after product, and the best rate of any product is the peak (the least disturbed by
    other processes).

    On a CPU the products run on ONE thread and the peak is that rate times the threads this process uses
    (torch.get_num_threads()): a multi-threaded product waits at its barrier for every thread, so on a
    shared machine one preempted thread stalls them all and the rates of a few hundred milliseconds ranged
    over 10x; one thread's ranged over 1.3x (docs/performance.md). It is an upper bound where all cores
    together run at a lower clock than one, as a datasheet peak is.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return _best_matmul_rate(device, dtype, seconds, sizes or GPU_PEAK_SIZES)
    threads = torch.get_num_threads()
    with torch_threads(1):
        rate, size = _best_matmul_rate(device, dtype, seconds, sizes or CPU_PEAK_SIZES)
    return rate * threads, size


PRODUCTS_PER_TURN = 4
"""Products of one size in a row before the next size's turn: on an Intel with AMX (torch 2.13, bf16, one
thread) a product right after one of another size ran ~10% slower, so single alternating products measured
1448-1499 GFLOP/s where turns of 5 measured 1669-1692 (2 in a row: 1563-1601); fp32 did not move (224)."""


def _best_matmul_rate(device: torch.device, dtype: torch.dtype, seconds: float,
                      sizes: Sequence[int]) -> tuple[float, int]:
    """(best FLOP/s of one product, its size): the sizes take turns (PRODUCTS_PER_TURN products each) for about
    `seconds`, at least 3 rounds, so that a burst of load hits every size alike."""
    pairs = [(n, torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype))
             for n in sizes]                                                       # [n, n] x2 per size
    for _, a, b in pairs:
        torch.matmul(a, b)  # warm-up: kernel selection, page faults
    _sync(device)
    best, best_size = 0.0, sizes[0]
    end, rounds = time.perf_counter() + seconds, 0
    while rounds < 3 or time.perf_counter() < end:
        for n, a, b in pairs:
            for _ in range(PRODUCTS_PER_TURN):
                start = time.perf_counter()
                torch.matmul(a, b)
                _sync(device)
                rate = 2 * n ** 3 / (time.perf_counter() - start)
                if rate > best:
                    best, best_size = rate, n
        rounds += 1
    return best, best_size


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
