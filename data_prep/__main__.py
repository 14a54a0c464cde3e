"""`python -m data_prep <command>`."""
import os

# datasets imports torch when it is installed (2+ s, ~300 MB) for features this job never uses. Only here,
# in the process entry point: code that imports data_prep as a library keeps its own torch settings.
os.environ.setdefault("USE_TORCH", "0")

from data_prep.cli import main  # noqa: E402  (after the environment is set)

if __name__ == "__main__":
    raise SystemExit(main())
