"""The package's exceptions: a refused start or replay (TrackingError), a store failing midway through a
replay (ReplayError)."""
from __future__ import annotations

from pathlib import Path

from txl_dist.errors import Refused, RunFailed

_PACKAGE = Path(__file__).resolve().parents[1]


class TrackingError(Refused, RuntimeError):
    """Tracking could not start (unreachable store, unknown run to resume); the message names the fix."""


class ReplayError(RunFailed):
    """The store failed in the middle of a replay; what was sent is recorded, running it again goes on."""


def not_the_stores(error: BaseException) -> bool:
    """Whether an error met while opening a store is the process's own, not the store's answer: out of memory,
    or raised in this package's code (its traceback's innermost frame under txl_dist/), a bug. Those propagate
    as failures; refusing them would tell the user to start a server or fix a URI that are fine. What MLflow
    and the libraries under it raise (an unreachable server, a database it cannot use) is the store's."""
    if isinstance(error, MemoryError):
        return True
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
