"""Benchmarks: each module has a CLI (``python -m perf.bench_x``) and appends to one results file."""
