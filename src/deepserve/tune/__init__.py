"""`deepserve tune`: the engine flags that serve the most under a latency target, measured on the real engine with
the planner as guide (grid, predict, engine, goodput, search, select, best, spec, run). Builds on sweep/."""
