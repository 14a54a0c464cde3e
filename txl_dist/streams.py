"""The one rule of the stream layout: S streams split over W ranks, each rank's streams over micro batches.

Config, the data package, the loader, evaluation and data_prep all ask here, each naming its own keys in
the message, so the rule and its wording cannot drift apart. Standard library only.
"""
from __future__ import annotations


def streams_per_rank(n_streams: int, world_size: int, *, streams: str = "n_streams", ranks: str = "ranks",
                     error: type[Exception] = ValueError, fix: str | None = None) -> int:
    """S / W, or `error` naming `streams` (the key or flag that set S) and `fix` (default: a world size that
    divides S) when W does not divide S."""
    if world_size < 1:
        raise error(f"world size must be >= 1, got {world_size}")
    if n_streams < 1:
        raise error(f"{streams}: must be >= 1, got {n_streams}")
    per_rank, rest = divmod(n_streams, world_size)
    if rest:
        raise error(f"{streams}: {n_streams} streams cannot be split over {world_size} {ranks}; "
                    f"{fix or f'use a world size that divides {n_streams}'}")
    return per_rank


def micro_steps_per_rank(n_streams: int, micro_batch: int, world_size: int, *, streams: str = "n_streams",
                         micro: str = "micro_batch", error: type[Exception] = ValueError) -> int:
    """g with micro_batch * g * W == S (the micro steps of one optimizer step), or `error` naming the key."""
    per_rank = streams_per_rank(n_streams, world_size, streams=streams, error=error)
    if micro_batch < 1:
        raise error(f"{micro}: must be >= 1, got {micro_batch}")
    steps, rest = divmod(per_rank, micro_batch)
    if rest:
        raise error(f"{micro}: {micro_batch} does not divide the {per_rank} streams of each of {world_size} ranks "
                    f"({streams} {n_streams}); use a micro batch that divides {per_rank} (the same training: "
                    f"fewer streams per micro step, no accumulation to add), or a multiple of {micro_batch} x "
                    f"{world_size} streams")
    return steps


def group_size(per_rank: int, at_most: int) -> int:
    """The most streams per group, at most `at_most`, that split a rank's `per_rank` streams into equal groups:
    the largest divisor of per_rank not above it (1 at worst)."""
    if per_rank < 1 or at_most < 1:
        raise ValueError(f"group_size: per_rank and at_most must be >= 1, got {per_rank} and {at_most}")
    return max(d for d in range(1, min(per_rank, at_most) + 1) if per_rank % d == 0)


def streams_of_rank(rank: int, n_streams: int, world_size: int) -> range:
    """The global ids of rank `rank`'s streams: the contiguous block [rank * S/W, (rank + 1) * S/W)."""
    per_rank = streams_per_rank(n_streams, world_size)
    return range(rank * per_rank, (rank + 1) * per_rank)


def ranks_holding(stream_ids, n_streams: int, world_size: int) -> list[int]:
    """The ranks of a world of `world_size` whose blocks hold `stream_ids` (global ids), sorted."""
    per_rank = streams_per_rank(n_streams, world_size)
    holders = set()
    for s in stream_ids:
        if not 0 <= int(s) < n_streams:
            raise ValueError(f"stream {int(s)} is not one of the {n_streams} streams")
        holders.add(int(s) // per_rank)
    return sorted(holders)
