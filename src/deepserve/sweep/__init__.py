"""Sweeps: the benchmark over a grid or one of the seeds' suites (grid, suites, resume, run, probe), one result
file per point. `deepserve tune` builds on it."""
