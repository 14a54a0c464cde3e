"""The package's exceptions: a refused start or replay (TrackingError), a store failing midway through a
replay (ReplayError)."""
from __future__ import annotations

from txl_dist.errors import Refused, RunFailed


class TrackingError(Refused, RuntimeError):
    """Tracking could not start (unreachable store, unknown run to resume); the message names the fix."""


class ReplayError(RunFailed):
    """The store failed in the middle of a replay; what was sent is recorded, running it again goes on."""
