"""Benchmarks: run from the repository root as modules, e.g. `python -m bench.bench`."""
