"""Benchmarks: each a module with a CLI (``python -m perf.bench_x``), one results file."""
