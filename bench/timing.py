"""Side-by-side timing: the one rule every benchmark here measures by."""
from __future__ import annotations

import time
from typing import Callable


def interleaved(fns: dict[str, Callable[[], None]], reps: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter,
                settle_s: float = 0.0) -> dict[str, tuple[float, float]]:
    """Seconds per call of each function: (min over repetitions, the least disturbed by other load; median).

    Calls are interleaved so that load changes on a shared machine hit every function alike. `settle_s` of
    idle time before each timed call lets the OpenMP threads of the side that just ran stop spinning (they
    would slow the next side down, e.g. another process). `clock` may be time.process_time on a busy machine.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if settle_s:
                time.sleep(settle_s)
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: (min(t), sorted(t)[len(t) // 2]) for name, t in times.items()}
