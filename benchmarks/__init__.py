"""Benchmarks: `python -m benchmarks` regenerates benchmarks/RESULTS.md."""
