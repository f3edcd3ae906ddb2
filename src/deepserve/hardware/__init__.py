"""Accelerators: what this machine has (detect) and what the market sells (catalog, used by the planner)."""
