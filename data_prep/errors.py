"""The one error type of the data_prep jobs."""
from __future__ import annotations

from txl_dist.errors import Refused


class PrepError(Refused):
    """Bad input or a failed step; the message is one line that names the thing and says what to do."""
