"""The serving benchmark: workload ▶ arrivals ▶ streaming client ▶ request records ▶ summary ▶ outputs."""
