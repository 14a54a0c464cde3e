"""Create or reuse `.venv-ref`: a separate venv holding the reference HuggingFace Transformer-XL.

transformers 4.37.2 is the newest release whose TransfoXLLMHeadModel runs, and it cannot share a venv
with datasets 5.x, so the reference lives in its own venv and runs as a subprocess.

Creation is atomic: the venv is built in `.venv-ref.partial-<pid>` and renamed to `.venv-ref` only when
the install finished and the reference imports; a killed run leaves no half venv behind (leftover partial
folders are removed by the next creation). A stamp file inside the venv records what it holds, so a
change of the pins below rebuilds it. Only `.venv-ref/bin/python -m ...` is used: console scripts in
bin/ carry the partial folder's path in their shebang.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VENV_NAME = ".venv-ref"
STAMP_NAME = ".txl-ref-ready"
TRANSFORMERS_PIN = "transformers==4.37.2"


def requirements() -> list[str]:
    """What `.venv-ref` holds: the torch release of the project's venv (so both sides run the same
    kernels) and the reference transformers. torch is pinned and installed in the same command: an
    unpinned torch would pull a multi-GB CUDA build."""
    public_version = torch.__version__.split("+")[0]
    return [f"torch=={public_version}", TRANSFORMERS_PIN]


def _stamp_matches(venv: Path, wanted: list[str]) -> bool:
    try:
        stamp = json.loads((venv / STAMP_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return stamp.get("requirements") == wanted and (venv / "bin" / "python").exists()


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def ensure_reference_venv(root: Path = ROOT) -> Path:
    """Return the python of `<root>/.venv-ref`, creating the venv first when it is missing or stale."""
    venv = root / VENV_NAME
    wanted = requirements()
    if _stamp_matches(venv, wanted):
        return venv / "bin" / "python"
    # One creator at a time (parallel pytest workers, two checkouts' runs): the lock lives outside the
    # tree so it never shows up in git status.
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"txl-dist-venv-ref-{tag}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp_matches(venv, wanted):
            return venv / "bin" / "python"
        for stale in root.glob(f"{VENV_NAME}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial = root / f"{VENV_NAME}.partial-{os.getpid()}"
        start = time.perf_counter()
        # Run from the project's venv, `-m venv` bases the new venv on the same base python3.
        _run([sys.executable, "-m", "venv", str(partial)], "creating the reference venv")
        py = partial / "bin" / "python"
        _run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *wanted],
             f"installing {' '.join(wanted)} into {partial}")
        _run([str(py), "-c", "import torch, transformers; "
              "from transformers import TransfoXLLMHeadModel"], "importing the reference")
        seconds = time.perf_counter() - start
        (partial / STAMP_NAME).write_text(json.dumps({"requirements": wanted, "created_s": round(seconds, 1)}))
        if venv.exists():  # stale pins: swap, then delete the old one
            old = root / f"{VENV_NAME}.partial-old-{os.getpid()}"
            venv.rename(old)
            partial.rename(venv)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(venv)
        print(f"[hf_reference] created {venv} in {seconds:.0f} s ({' '.join(wanted)})", file=sys.stderr)
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def reference_python() -> Path:
    """The python of the reference venv (created on first use; a creation failure fails the test)."""
    return ensure_reference_venv()


HF_SIDE = Path(__file__).resolve().parent / "hf_side.py"


def run_hf_side(python: Path, jobs_file: Path, timeout: float = 600) -> None:
    """Run hf_side.py on a jobs file inside the reference venv; raise with its output on failure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(python), str(HF_SIDE), str(jobs_file)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"hf_side.py failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
