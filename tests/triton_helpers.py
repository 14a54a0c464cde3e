"""Whether Triton's interpreter can run the fused attention kernels on this CPU (tests/conftest.py sets
TRITON_INTERPRET=1 where the machine has no NVIDIA device). One answer for every test file that interprets them."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os


def _version(package: str) -> tuple[int, int]:
    return tuple(int(part) for part in importlib.metadata.version(package).split(".")[:2])


def why_the_interpreter_cannot_run_the_kernels() -> str | None:
    """None where it can; else the reason, for a skip. A CUDA build of torch on a machine without a GPU brings its
    own, older triton (3.6 with torch 2.11), whose interpreter fails on loops bounded by program-id values under
    numpy 2.4 or later ("only 0-dimensional arrays can be converted to Python scalars"); 3.9 fixed it, and
    scripts/test.sh installs 3.9 or later where torch brings no triton."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (scripts/test.sh installs it: its interpreter runs these kernels on a CPU)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)"
    if _version("triton") < (3, 9) and _version("numpy") >= (2, 4):
        return (f"triton {importlib.metadata.version('triton')}'s interpreter cannot run loops bounded by program-id "
                f"values under numpy {importlib.metadata.version('numpy')} (fixed in triton 3.9)")
    return None
