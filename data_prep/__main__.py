"""`python -m data_prep <command>`."""
import os

from data_prep.cli import main  # light: datasets is imported by the commands that read inputs

if __name__ == "__main__":
    # datasets imports torch when it is installed (2+ s, ~300 MB) for features this job never uses. Set only
    # in the process that runs the job, never on import: tests import this module, and a test process must
    # keep its environment for the subprocesses it starts (the reference venv's transformers reads USE_TORCH).
    os.environ.setdefault("USE_TORCH", "0")
    raise SystemExit(main())
