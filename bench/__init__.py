"""Benchmarks of txl-dist: `python -m bench [--quick]` writes BENCHMARKS.md; bench/gpu_check.sh is the
device check. Every figure is a ratio measured side by side in one run."""
