"""Host arrays to the device without a host sync: pinned, non-blocking copies (a no-op on the CPU)."""
from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor on `device` holding `array`; the host thread does not wait for the copy.

    On the CPU the tensor shares the array's memory (no copy at all). On an accelerator the array is first
    copied into page-locked memory (torch's caching host allocator reuses those buffers and keeps each alive
    until its copy has finished) so the device copy runs asynchronously; a pageable source would make
    `.to(device)` wait for the copy.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
