"""Benchmark results: points on a grid, sweep directories, and the SQLite results store."""
