"""`python -m bench [--quick]`: the CPU benchmark suite (bench/suite.py)."""
import sys

from bench.suite import main

sys.exit(main())
