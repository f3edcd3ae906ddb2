"""Checks of a deployment's shape across nodes, made before anything starts: the layout against the nodes and the
GPUs each holds, this node's rank, and the master address (resolvable, this machine's own on node 0, routable from
the others). Every error names the flags to change."""

from __future__ import annotations

import ipaddress
import socket

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError


def check_layout_fits_nodes(config: EngineConfig, gpus_per_node: int | None, on_this_machine: bool = True) -> list[str]:
    """Raise for a layout the nodes cannot hold; return notes for one that leaves devices idle. GPUS_PER_NODE is
    None on CPU, where vLLM runs one worker process per rank whatever the cores. ON_THIS_MACHINE False: the nodes are
    elsewhere (a rendered deployment), which the message says."""
    world, nodes = config.world_size, config.nnodes
    layout = (
        f"TP {config.tensor_parallel_size} x PP {config.pipeline_parallel_size} x DP {config.data_parallel_size} "
        f"= {world}"
    )
    if world % nodes:
        raise ConfigError(
            f"the layout {layout} does not split evenly over --nnodes {nodes}: make tensor x pipeline x data "
            f"parallel a multiple of {nodes} (e.g. --pipeline-parallel-size {nodes} with the GPUs of one node as TP)"
        )
    if gpus_per_node is None or config.distributed_executor_backend == "ray":
        return []  # on Ray the ranks go to the cluster's GPUs: serve waits until the cluster has them
    per_node = world // nodes
    if per_node > gpus_per_node:
        where = "this machine has" if nodes == 1 and on_this_machine else "each node has"
        raise ConfigError(
            f"the layout {layout} needs {per_node} GPUs per node over {nodes} node(s), but {where} {gpus_per_node}: "
            f"lower --tensor-parallel-size, or add nodes (--nnodes {world // gpus_per_node} with "
            f"--pipeline-parallel-size {max(world // gpus_per_node, 1)})"
        )
    if per_node < gpus_per_node:
        return [f"the layout uses {per_node} of the {gpus_per_node} GPUs on each node"]
    return []


class MasterAddressError(ConfigError):
    """A master address this node cannot use: what is wrong, and the fix (apart, for checks that show both)."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


def check_master_address(config: EngineConfig) -> None:
    """Node 0 must own the master address (it listens there); other nodes must have a route to it."""
    if not config.is_multi_node:
        return
    host = config.master_addr or ""
    try:
        infos = socket.getaddrinfo(host, config.master_port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise MasterAddressError(
            f"--master-addr {host!r} does not resolve ({exc.strerror})",
            "give node 0's IP address or a host name every node can resolve",
        ) from None
    family, _, _, _, address = infos[0]
    if config.is_head:
        _require_own_address(host, family, address)
    else:
        _require_route(host, family, address)


def _require_own_address(host: str, family: int, address: tuple[object, ...]) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0))
        except OSError:
            raise MasterAddressError(
                f"--master-addr {host} is not an address of this machine, and node 0 (--node-rank 0) listens there",
                "run node 0 on that machine, or give this machine's own address on the network the nodes share",
            ) from None


def _require_route(host: str, family: int, address: tuple[object, ...]) -> None:
    """A UDP connect sends nothing but fails at once when the kernel has no route to the address."""
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(address)
        except OSError as exc:
            raise MasterAddressError(
                f"--master-addr {host} is unreachable from this node ({exc.strerror})",
                "check the network between the nodes, or give node 0's address on a network both reach",
            ) from None


def nodes_share_this_host(config: EngineConfig) -> bool:
    """A master on a loopback address: every node runs on this one host (how the tests run several nodes)."""
    try:
        return config.is_multi_node and ipaddress.ip_address(config.master_addr or "").is_loopback
    except ValueError:
        return config.master_addr == "localhost"
