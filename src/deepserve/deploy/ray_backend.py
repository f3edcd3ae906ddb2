"""`deepserve serve --distributed-executor-backend ray`: what serve checks before it starts vLLM on a Ray cluster,
and the wait (with progress) until the cluster holds the GPUs the layout needs. With Ray, one `serve` runs on the
Ray head and vLLM places its workers on the cluster's nodes; the cluster is started with `deepserve cluster`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from deepserve.deploy.ray_cluster import ClusterError, ClusterStatus, cluster_address, cluster_status, where
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError, EngineError

POLL_INTERVAL_S = 5.0
# vLLM's CPU platform has no Ray device key; its executor raises this (vllm/v1/executor/ray_utils.py).
CPU_REFUSAL = "current platform cpu does not support ray"

StatusReader = Callable[[str], ClusterStatus]


def uses_ray(config: EngineConfig) -> bool:
    return config.distributed_executor_backend == "ray"


def check_ray_backend(config: EngineConfig, on_cpu: bool) -> None:
    """Refuse, before anything starts, what cannot run on Ray: vLLM on CPU, and --nnodes (Ray places the workers
    itself: one `serve` on the head, every other node joins the Ray cluster instead)."""
    if not uses_ray(config):
        return
    if on_cpu:
        raise ConfigError(
            f'--distributed-executor-backend ray needs GPUs: vLLM\'s CPU build refuses it ("{CPU_REFUSAL}"). '
            "On CPU, run several nodes with vLLM's own runtime instead: --nnodes N --node-rank R --master-addr HOST"
        )
    if config.is_multi_node:
        raise ConfigError(
            f"--nnodes {config.nnodes} is for vLLM's own multi-node runtime; with --distributed-executor-backend "
            "ray start one `deepserve serve` on the Ray head without --nnodes (the other nodes join the Ray cluster "
            "with `deepserve cluster start --address HEAD:PORT`), or drop --distributed-executor-backend ray"
        )


def wait_for_ray_gpus(
    config: EngineConfig,
    on_progress: Callable[[str, float], None],
    read_status: StatusReader = cluster_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    address: str | None = None,
) -> ClusterStatus | None:
    """Block until the Ray cluster has the GPUs the layout needs (TP x PP x DP), reporting progress; raise after
    --join-timeout-s saying what is there and how to add nodes. Returns None when the engine does not use Ray. Sets
    RAY_ADDRESS for the engine (which inherits this process's environment) when it is not set, so that vLLM's
    ray.init() joins this cluster whatever temp dir it was started with."""
    if not uses_ray(config):
        return None
    address = cluster_address(address)
    needed = config.world_size
    started = clock()
    while True:
        elapsed = clock() - started
        problem = ""
        try:
            status = read_status(address)
        except ClusterError as exc:
            status, problem = None, str(exc)
        if status is not None and status.gpus >= needed:
            if address != "auto":
                os.environ.setdefault("RAY_ADDRESS", address)
            return status
        have = (
            "not reachable yet" if status is None else f"{status.gpus} of {needed} GPUs on {len(status.alive)} node(s)"
        )
        if elapsed > config.join_timeout_s:
            raise EngineError(_timeout_message(config, address, status, problem))
        on_progress(f"waiting for the Ray cluster {where(address)}: {have}", elapsed)
        sleep(POLL_INTERVAL_S)


def _timeout_message(config: EngineConfig, address: str, status: ClusterStatus | None, problem: str) -> str:
    layout = (
        f"TP {config.tensor_parallel_size} x PP {config.pipeline_parallel_size} x DP {config.data_parallel_size} "
        f"= {config.world_size} GPUs"
    )
    if status is None:
        return (
            f"the Ray cluster {where(address)} was not reachable within {config.join_timeout_s:.0f} s ({problem}); "
            "start it with `deepserve cluster start --head` on this node"
        )
    join = "HEAD_IP:PORT" if address == "auto" else address
    nodes = ", ".join(f"{node.address} ({node.gpus:g} GPUs)" for node in status.alive) or "none"
    return (
        f"the Ray cluster {where(address)} has {status.gpus} GPUs after {config.join_timeout_s:.0f} s (nodes: "
        f"{nodes}); the layout {layout} needs {config.world_size}. Start the missing nodes with `deepserve cluster "
        f"start --address {join}` on each, or raise --join-timeout-s for slow starts"
    )
