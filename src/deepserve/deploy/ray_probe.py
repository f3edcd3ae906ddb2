"""`python -m deepserve.deploy.ray_probe ADDRESS`: print the Ray cluster's nodes (`ray.nodes()`) as one JSON line,
or `{"error": …}`. Run in a child process by `ray_cluster.cluster_status`, so that the caller never becomes a Ray
driver (ray.init installs signal handlers, threads and a job of its own)."""

from __future__ import annotations

import json
import logging
import os
import sys


def main(address: str) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        print(json.dumps({"error": "Ray is not installed in deepserve's environment: `pip install ray`"}))
        return 1
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(json.dumps({"error": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}))
        return 1
    try:
        print(json.dumps({"nodes": ray.nodes()}, default=str))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
