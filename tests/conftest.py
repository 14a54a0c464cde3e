"""Suite-wide settings (CPU DeepSpeed, no hub access, deterministic small thread pools) and shared fixtures."""
import glob
import logging
import os
import signal
import subprocess

import pytest

from txl_dist.errors import LOGGER_NAME  # os only: nothing heavy is imported before the settings below

# Set before any test imports deepspeed or datasets.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without an NVIDIA device the fused attention kernels (txl_dist/model/triton_attention.py) run in Triton's
# interpreter on CPU tensors: read when triton is first imported, so it is set before anything imports it.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def project_loggers_put_back():
    """distributed.setup_logging configures process-wide loggers: its own handler, and no propagation to the
    root logger, where pytest's caplog listens (pytest 9.1 and newer also listen on the logger that
    caplog.at_level names; 8.x does not). Put them back after every test, so that a test which ran
    setup_logging in this process (an in-process training job) hides no record from the tests after it."""
    loggers = [logging.getLogger(name) for name in (LOGGER_NAME, "DeepSpeed")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved):
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.fixture(autouse=True)
def stop_signals_put_back():
    """An entry point run in this process (launch/train.py's main) catches the stop signals and, at its end,
    ignores SIGTERM and SIGUSR1 for the rest of the process (stop_request.ignore_stop_signals). Put their
    handlers back after every test: a process started later inherits an ignored signal (the forkserver of
    dist_helpers.context, then its pool workers), and a pool that terminates its workers with SIGTERM would
    wait on them for ever."""
    signals = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
    saved = [signal.getsignal(sig) for sig in signals]
    yield
    for sig, handler in zip(signals, saved):
        signal.signal(sig, handler)


@pytest.fixture
def small_file_system(tmp_path):
    """A 256 KiB tmpfs (a real file system that fills up), or a skip where this process may not mount one."""
    from bench.fault_sweep import mount_tmpfs

    mount_point = tmp_path / "small"
    if why := mount_tmpfs(mount_point, 256 << 10):
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {why}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


LONGEST_FILES_FIRST = ("test_faults.py", "test_slurm.py", "test_presets.py", "test_model_transformer.py",
                       "test_trainer.py", "test_bench.py", "test_gpu_check.py", "test_safe_load.py",
                       "test_engine.py", "test_tracking_faults.py", "test_launch.py")
"""The files that take longest (minutes each on 2 cores: multi-process runs, timeouts, compiles, a Slurm
cluster), in the order the suite starts them. scripts/test.sh hands whole files to its workers in collection
order (--dist loadfile --no-loadscope-reorder), so that none of them starts last and runs alone at the end
(xdist's own order, by the number of tests in a file, put them last). Measured on an AVX2-only AMD EPYC:
33m29s against 33m27s in xdist's order, the sum of the tests' durations equal to the 2 workers' wall time
there: the order guards against a long tail; it does not shorten a suite that is work-bound."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order and test order kept
