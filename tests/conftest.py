"""Suite-wide settings: CPU DeepSpeed, no hub access, deterministic small thread pools."""
import os

# Set before any test imports deepspeed or datasets.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
