"""Projected adaptive log-softmax (Grave et al. 2017; Transformer-XL reference code), log-probs in float32.

The head scores the shortlist (tokens below cutoffs[0]) plus one logit per tail cluster; cluster i
(1-based) is head column cutoffs[0] + i - 1 (natural order). A token of cluster i has
log p = head_logprob[cluster column] + tail_logprob_i[token - cutoff_ends[i]].

Padding to tensor-core multiples (pad_multiple > 1) stores more rows than there are logits and never lets
the extra ones into a softmax: their bias is replaced by -inf in every forward (a [rows] vector op, no
copy of a weight), so their probability is exactly 0 and their weights get exactly zero gradients. The head
(cluster 0) is padded through the cluster rows: cluster_weight / cluster_bias hold round_up(S + C, m) - S rows,
so the head's logits [S + C, padding] keep the shortlist and the cluster columns where they were. Each tail
table is padded at its end (div_val > 1: every tail; div_val 1: the one shared table, which pads the last
cluster; the middle clusters are slices of it whose sizes the cutoffs decide). Without clusters the one
table is padded. Embedding tables share these shapes (tie_weight) and never look up a padded row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from txl_dist.host_copy import to_device

TailMode = Literal["auto", "dense", "gather"]
TablePieces = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
"""div_val 1: the shared table's weight and bias pieces, one per cluster (ProjectedAdaptiveLogSoftmax's split)."""

DENSE_TAIL_MAX_RATIO = 0.25
"""'auto' scores the tails densely when that costs at most this fraction of the head's FLOPs (see
ProjectedAdaptiveLogSoftmax.tail_mode)."""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return -(-n // multiple) * multiple


IGNORED_TARGET = -100
"""The target of a padding row in the gather tail mode (cross_entropy's ignore_index: NLL and gradient 0)."""

TAIL_ROW_BUCKETS_PER_OCTAVE = 8


def bucketed_rows(n: int) -> int:
    """n tokens rounded up to one of TAIL_ROW_BUCKETS_PER_OCTAVE row counts per power of two (at least 8;
    0 stays 0): at most 1/8 more rows than tokens for n >= 64.

    The gather tail mode scores each cluster's tokens, a count that changes with every batch. On the CPU,
    oneDNN's bf16 (AMX) matmul builds a kernel for each new shape on its first call, ~10 ms against a
    0.2-0.6 ms product (docs/performance.md); with buckets a run meets a handful of shapes per cluster.
    """
    if n <= 0:
        return 0
    step = max(8, (1 << (n.bit_length() - 1)) // TAIL_ROW_BUCKETS_PER_OCTAVE)  # octave [2^b, 2^(b+1))
    return round_up(n, step)


def padded_table_rows(vocab_size: int, cutoffs: list[int], div_val: int, pad_multiple: int) -> list[int]:
    """Rows stored in each output/embedding table (div_val 1: one table; div_val > 1: one per cluster).

    Cluster 0's table is padded only when there are no tail clusters (else the cluster rows pad the head).
    """
    ends = [0] + list(cutoffs) + [vocab_size]
    if div_val == 1:
        return [round_up(vocab_size, pad_multiple)]
    sizes = [ends[i + 1] - ends[i] for i in range(len(ends) - 1)]
    return [size if i == 0 and cutoffs else round_up(size, pad_multiple) for i, size in enumerate(sizes)]


def logit_rows(vocab_size: int, cutoffs: list[int], div_val: int, pad_multiple: int) -> list[int]:
    """Rows of each cluster's logits matmul as computed, padding included: the head's shortlist + cluster
    logits rounded up (the whole padded table without tails), then each tail's size, the last tail with the
    shared table's padding when div_val is 1 (what the FLOP count must count)."""
    table = padded_table_rows(vocab_size, cutoffs, div_val, pad_multiple)
    if not cutoffs:
        return [table[0]]
    ends = [0] + list(cutoffs) + [vocab_size]
    tails = [ends[i + 1] - ends[i] for i in range(1, len(ends) - 1)]
    if div_val == 1:
        tails[-1] += table[0] - vocab_size
    else:
        tails = table[1:]
    return [round_up(ends[1] + len(cutoffs), pad_multiple), *tails]


@dataclass(frozen=True)
class TailPlan:
    """How a batch's targets fall into the clusters, computed on the host from the labels (see tail_plan),
    so that the gather tail mode needs no host sync. Must describe exactly the targets it is passed with."""

    counts: list[int]
    """Tokens per cluster, the head (0) first: len(cutoffs) + 1 entries summing to the number of targets."""
    order: torch.Tensor
    """int64 [N] on the targets' device: positions of the flattened targets, grouped by cluster (head
    first), in their natural order within a cluster (a stable sort by cluster)."""


def tail_plan(labels: np.ndarray, cutoffs: list[int], device: torch.device) -> TailPlan:
    """The TailPlan of integer labels [...] (flattened in C order, as the model flattens its labels).

    Cluster ids come from np.searchsorted on the cutoffs and the order from a stable argsort, the same
    permutation torch.argsort(stable=True) gives on the device; the order is copied non-blocking.
    """
    flat = np.asarray(labels).reshape(-1)
    cluster = np.searchsorted(np.asarray(cutoffs, dtype=np.int64), flat, side="right")  # [N] 0 = head
    order = np.argsort(cluster, kind="stable").astype(np.int64)                 # [N]
    counts = np.bincount(cluster, minlength=len(cutoffs) + 1).tolist()
    return TailPlan(counts=counts, order=to_device(order, torch.device(device)))


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Adaptive softmax over vocab_size tokens from d_model hidden states.

    div_val == 1: one output layer [vocab_size, d_embed] (+ bias), sliced per cluster; a projection per
    cluster [d_model, d_embed] only when d_model != d_embed. div_val > 1: cluster i has its own output layer
    of width d_embed // div_val**i and projection [d_model, d_emb_i]. Tying to the input embedding is done
    by the owner (TransformerXL) by sharing Parameters.

    tail_mode picks how tail clusters are scored for the NLL:
    - "dense": every token through every tail, then a select by cluster. No host sync at all (good for
      GPUs and graph capture), but FLOPs grow with the tails' size.
    - "gather": only the tokens of each cluster go through its tail, their rows padded to a bucket size
      (bucketed_rows) so that the matmuls meet few shapes. Given a TailPlan (the counts and order from the
      host labels) it has no host sync; without one it has one for all clusters together (one
      bincount(...).tolist()), none per cluster.
    - "auto" (default): "gather" when a TailPlan is given; else "dense" when the dense tails cost at most
      DENSE_TAIL_MAX_RATIO of the head (see dense_tail_cost_ratio) and the tensors are not on the CPU, where
      a sync costs nothing; else "gather".

    pad_multiple > 1 stores the head's and the tails' rows padded to multiples of it (see the module
    docstring); the math is unchanged.
    """

    def __init__(self, vocab_size: int, d_embed: int, d_model: int, cutoffs: list[int], div_val: int,
                 pad_multiple: int = 1):
        super().__init__()
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.div_val = div_val
        self.cutoff_ends = [0] + list(cutoffs) + [vocab_size]
        self.shortlist_size = self.cutoff_ends[1]
        self.n_clusters = len(cutoffs)
        self.pad_multiple = pad_multiple
        self.tail_mode: TailMode = "auto"
        # Stored row counts as ints: a partitioned parameter (ZeRO-3) does not show its shape.
        self.cluster_rows = 0
        if self.n_clusters:
            self.cluster_rows = round_up(self.shortlist_size + self.n_clusters, pad_multiple) - self.shortlist_size
            self.cluster_weight = nn.Parameter(torch.empty(self.cluster_rows, d_embed))
            self.cluster_bias = nn.Parameter(torch.empty(self.cluster_rows))
        self.table_rows = table_rows = padded_table_rows(vocab_size, cutoffs, div_val, pad_multiple)
        self.out_layers = nn.ModuleList()
        # Projections [d_model, d_emb_i], applied as hidden @ proj (the input embedding's F.linear transposed).
        self.out_projs = nn.ParameterList()
        self.d_embs = []
        if div_val == 1:
            self.out_layers.append(nn.Linear(d_embed, table_rows[0]))
            self.d_embs = [d_embed] * (self.n_clusters + 1)
            if d_model != d_embed:
                for _ in range(self.n_clusters + 1):
                    self.out_projs.append(nn.Parameter(torch.empty(d_model, d_embed)))
        else:
            for i in range(self.n_clusters + 1):
                d_emb_i = d_embed // div_val ** i
                self.d_embs.append(d_emb_i)
                self.out_layers.append(nn.Linear(d_emb_i, table_rows[i]))
                self.out_projs.append(nn.Parameter(torch.empty(d_model, d_emb_i)))

    def borrowed_parameters(self) -> list[nn.Parameter]:
        """The submodules' parameters that forward reads itself, never calling their modules: the output
        tables (out_layers) and the projections (out_projs). A wrapper that gathers a module's weights when
        the module is called (DeepSpeed's ZeRO-3) must be told of them."""
        return [*self.out_layers.parameters(), *self.out_projs]

    # ------------------------------------------------------------------------------------------------
    # Parameters of one cluster

    def n_logits(self, i: int) -> int:
        """Real logits of cluster i: the head S + C (shortlist and cluster columns), a tail its size."""
        if i == 0 and self.n_clusters:
            return self.shortlist_size + self.n_clusters
        return self.cutoff_ends[i + 1] - self.cutoff_ends[i]

    def padded_rows(self) -> dict[str, int]:
        """State-dict names (relative to this module) of the tensors stored padded -> their real row count."""
        rows = {}
        if self.cluster_rows != self.n_clusters:
            rows["cluster_weight"] = rows["cluster_bias"] = self.n_clusters
        sizes = [self.vocab_size] if self.div_val == 1 else [self.cutoff_ends[i + 1] - self.cutoff_ends[i]
                                                             for i in range(self.n_clusters + 1)]
        for i, size in enumerate(sizes):
            if self.table_rows[i] != size:
                rows[f"out_layers.{i}.weight"] = rows[f"out_layers.{i}.bias"] = size
        return rows

    def _shared_table_pieces(self) -> TablePieces | None:
        """div_val 1: the one output table's weight and bias split into the clusters' rows (the last cluster
        with the padding rows), once per forward; None for div_val > 1 (a table per cluster).

        One split for all clusters, not a slice per cluster: a slice's backward fills a zero tensor of the
        whole table and adds it to the table's gradient, once per cluster (and once more for the tied input
        embedding); the split's backward concatenates the pieces' gradients once."""
        if self.div_val != 1:
            return None
        weight, bias = self.out_layers[0].weight, self.out_layers[0].bias
        if not self.n_clusters:
            return (weight,), (bias,)  # the whole table: no split, nothing to concatenate in backward
        ends = self.cutoff_ends[:-1] + [self.table_rows[0]]
        sizes = [ends[i + 1] - ends[i] for i in range(self.n_clusters + 1)]
        return weight.split(sizes), bias.split(sizes)

    def _cluster_params(self, i: int, pieces: TablePieces | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weight [rows_i, d_emb_i], bias [rows_i], proj [d_model, d_emb_i] or None) of cluster i; the head
        (i=0) gets the cluster logits appended after the shortlist. rows_i >= n_logits(i): the padding rows'
        bias is -inf, so they never carry probability. pieces: this forward's _shared_table_pieces()
        (made here when not given)."""
        if self.div_val == 1:
            weights, biases = pieces if pieces is not None else self._shared_table_pieces()
            weight, bias = weights[i], biases[i]
            rows = weight.shape[0]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
            rows = self.table_rows[i]
        if i == 0 and self.n_clusters:
            weight = torch.cat([weight, self.cluster_weight], dim=0)               # [S + C (+ pad), d_emb_0]
            bias = torch.cat([bias, self.cluster_bias], dim=0)                      # [S + C (+ pad)]
            rows = self.shortlist_size + self.cluster_rows
        n_real = self.n_logits(i)
        if rows != n_real:
            bias = torch.cat([bias[:n_real], bias.new_full((rows - n_real,), float("-inf"))])  # [rows]
        proj = self.out_projs[i] if len(self.out_projs) else None
        return weight, bias, proj

    def _logits(self, hidden: torch.Tensor, i: int, pieces: TablePieces | None = None) -> torch.Tensor:
        """hidden [N, d_model] -> float32 logits [N, rows_i] of cluster i (the head: [N, S + C (+ pad)]).
        pieces: this forward's _shared_table_pieces()."""
        weight, bias, proj = self._cluster_params(i, pieces)
        if proj is not None:
            hidden = hidden @ proj                                                 # [N, d_emb_i]
        # The matmul runs in the compute dtype; log-softmax and everything after it in float32.
        return F.linear(hidden, weight, bias).float()                             # [N, n_i]

    # ------------------------------------------------------------------------------------------------
    # Costs and the tail strategy

    def dense_tail_cost_ratio(self) -> float:
        """FLOPs per token of scoring every tail densely, divided by the head's FLOPs per token."""
        def cost(i: int, n_out: int) -> int:
            proj = self.d_model * self.d_embs[i] if len(self.out_projs) else 0
            return proj + self.d_embs[i] * n_out
        head = cost(0, self.shortlist_size + self.n_clusters)
        tails = sum(cost(i, self.cutoff_ends[i + 1] - self.cutoff_ends[i]) for i in range(1, self.n_clusters + 1))
        return tails / head

    def resolved_tail_mode(self, device: torch.device, planned: bool = False) -> str:
        """"dense" or "gather": what tail_mode means for tensors on `device`, with or without a TailPlan."""
        if self.tail_mode not in ("auto", "dense", "gather"):
            raise ValueError(f"tail_mode {self.tail_mode!r} is unknown; use 'auto', 'dense' or 'gather'")
        if self.tail_mode != "auto":
            return self.tail_mode
        if planned:  # gather without a sync: the fewest FLOPs
            return "gather"
        if device.type != "cpu" and self.dense_tail_cost_ratio() <= DENSE_TAIL_MAX_RATIO:
            return "dense"
        return "gather"

    # ------------------------------------------------------------------------------------------------
    # NLL and full log-probabilities

    def forward(self, hidden: torch.Tensor, target: torch.Tensor, plan: TailPlan | None = None) -> torch.Tensor:
        """hidden [N, d_model], target [N] -> float32 NLL [N] (natural order). plan: the targets' TailPlan
        (tail_plan of the same labels on the host), or None to compute it here."""
        if hidden.shape[:-1] != target.shape:
            raise ValueError(f"adaptive softmax: hidden {tuple(hidden.shape)} and target {tuple(target.shape)} "
                             "must agree on the token dimension")
        if plan is not None and (len(plan.counts) != self.n_clusters + 1 or sum(plan.counts) != target.numel()
                                 or plan.order.shape != target.shape):
            raise ValueError(f"adaptive softmax: the tail plan (counts {plan.counts}, order "
                             f"{tuple(plan.order.shape)}) does not describe {target.numel()} targets in "
                             f"{self.n_clusters + 1} clusters; make it with tail_plan(labels, cutoffs, device) "
                             "from these labels")
        pieces = self._shared_table_pieces()
        head_logits = self._logits(hidden, 0, pieces)                              # [N, S + C (+ pad)]
        if not self.n_clusters:
            return F.cross_entropy(head_logits, target, reduction="none")         # [N]
        # Cluster id per token from python-int comparisons: no small tensor to copy to the device.
        cluster = sum((target >= c).long() for c in self.cutoff_ends[1:-1])        # [N] 0 = head
        # Head column: the token itself in the shortlist, else its cluster's logit.
        head_target = torch.where(cluster == 0, target, self.shortlist_size + cluster - 1)  # [N]
        nll = F.cross_entropy(head_logits, head_target, reduction="none")          # [N]
        if self.resolved_tail_mode(hidden.device, planned=plan is not None) == "dense":
            return nll + self._tail_nll_dense(hidden, target, cluster, pieces)
        return nll + self._tail_nll_gather(hidden, target, cluster, plan, pieces)

    def _tail_nll_dense(self, hidden: torch.Tensor, target: torch.Tensor, cluster: torch.Tensor,
                        pieces: TablePieces | None = None) -> torch.Tensor:
        tail_nll = torch.zeros(target.shape, dtype=torch.float32, device=target.device)  # [N]
        for i in range(1, self.n_clusters + 1):
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            local = (target - lo).clamp(0, hi - lo - 1)                            # [N]
            nll_i = F.cross_entropy(self._logits(hidden, i, pieces), local, reduction="none")  # [N]
            tail_nll = tail_nll + torch.where(cluster == i, nll_i, 0.0)            # [N]
        return tail_nll

    def _tail_nll_gather(self, hidden: torch.Tensor, target: torch.Tensor, cluster: torch.Tensor,
                         plan: TailPlan | None, pieces: TablePieces | None = None) -> torch.Tensor:
        if plan is None:
            # The one host sync: how many tokens each cluster has, for all clusters at once.
            counts = torch.bincount(cluster, minlength=self.n_clusters + 1).tolist()
            order = torch.argsort(cluster, stable=True)                            # [N] head tokens first
        else:
            counts, order = plan.counts, plan.order                                # [N] head tokens first
        groups = order.split(counts)
        indices, values = [], []
        # An empty cluster still runs (on zero rows): its parameters must get a (zero) gradient on every
        # rank, or data-parallel gradient reduction (ZeRO 2/3 buckets) sees different sizes per rank.
        for i in range(1, self.n_clusters + 1):
            idx, n_i = groups[i], counts[i]                                        # [n_i]
            local = target.index_select(0, idx) - self.cutoff_ends[i]              # [n_i]
            # Padded to a row bucket: the matmuls see a few shapes, not one per token count. A padding
            # row scores token 0's hidden state against IGNORED_TARGET: its NLL and gradients are exactly 0.
            rows = bucketed_rows(n_i)
            idx_rows = F.pad(idx, (0, rows - n_i))                                 # [rows]
            local = F.pad(local, (0, rows - n_i), value=IGNORED_TARGET)           # [rows]
            logits = self._logits(hidden.index_select(0, idx_rows), i, pieces)     # [rows, size_i]
            indices.append(idx)
            values.append(F.cross_entropy(logits, local, reduction="none",
                                          ignore_index=IGNORED_TARGET)[:n_i])     # [n_i]
        tail_nll = torch.zeros(target.shape, dtype=torch.float32, device=target.device)  # [N]
        return tail_nll.index_copy(0, torch.cat(indices), torch.cat(values))      # [N]

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_model] -> float32 log-probabilities of the whole vocabulary [N, vocab_size]."""
        pieces = self._shared_table_pieces()
        head_logprob = F.log_softmax(self._logits(hidden, 0, pieces), dim=-1)      # [N, S + C (+ pad)]
        if not self.n_clusters:
            return head_logprob[:, :self.vocab_size].contiguous()                  # [N, vocab_size]
        parts = [head_logprob[:, :self.shortlist_size]]                            # [N, S]
        for i in range(1, self.n_clusters + 1):
            cluster_logprob = head_logprob[:, self.shortlist_size + i - 1, None]   # [N, 1]
            tail_logprob = F.log_softmax(self._logits(hidden, i, pieces), dim=-1)[:, :self.n_logits(i)]  # [N, size_i]
            parts.append(cluster_logprob + tail_logprob)                           # [N, size_i]
        return torch.cat(parts, dim=-1)                                            # [N, vocab_size]
