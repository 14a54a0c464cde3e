"""Suite-wide settings (CPU DeepSpeed, no hub access, deterministic small thread pools) and shared fixtures."""
import os
import subprocess

import pytest

# Set before any test imports deepspeed or datasets.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def small_file_system(tmp_path):
    """A 256 KiB tmpfs (a real file system that fills up), or a skip where this process may not mount one."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
