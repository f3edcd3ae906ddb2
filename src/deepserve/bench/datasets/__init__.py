"""Workload datasets: synthetic prompts of exact token counts, and request files."""
