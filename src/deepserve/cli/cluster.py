"""`deepserve cluster`: a Ray cluster for vLLM's Ray executor (start a head or join one, status, stop)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from deepserve.cli.output import console
from deepserve.deploy.ray_cluster import (
    DEFAULT_RAY_PORT,
    RayNodeSettings,
    cluster_status,
    ray_node_settings,
    run_node_in_foreground,
    start_node,
    stop_node,
)

GIB = 1024**3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="a Ray cluster for vLLM's Ray executor: start a head or join one, status, stop",
        description=(
            "Wrap `ray start` with what multi-node vLLM needs on every node: the node's IP, VLLM_HOST_IP, and "
            "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME set to the interface holding that IP (values you set yourself "
            "are kept). Then serve on the head with `deepserve serve --distributed-executor-backend ray`."
        ),
    )
    actions = parser.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)

    start = actions.add_parser("start", help="start this node: the head (--head) or a worker (--address HEAD:PORT)")
    role = start.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true", help="start the cluster on this node")
    role.add_argument("--address", help="join the cluster whose head is at HOST:PORT")
    start.add_argument("--port", type=int, help=f"with --head: the head's port (default: {DEFAULT_RAY_PORT})")
    start.add_argument("--node-ip-address", help="this node's IP on the network the nodes share (default: routed)")
    start.add_argument("--num-gpus", type=int, help="GPUs this node offers (default: what nvidia-smi lists)")
    start.add_argument("--num-cpus", type=int, help="CPUs this node offers (default: Ray counts them)")
    start.add_argument("--temp-dir", help="Ray's temp dir on this node (default: Ray's, /tmp/ray)")
    start.add_argument(
        "--block", action="store_true", help="run in the foreground until stopped (containers, Slurm tasks)"
    )
    start.set_defaults(handler=_start)

    status = actions.add_parser("status", help="the cluster's nodes and GPUs")
    status.add_argument("--address", help="HOST:PORT of the head (default: RAY_ADDRESS, or the node started here)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(handler=_status)

    stop = actions.add_parser("stop", help="stop the Ray node that `deepserve cluster start` started here")
    stop.set_defaults(handler=_stop)


def _start(args: argparse.Namespace) -> int:
    settings = ray_node_settings(
        head=args.head,
        address=args.address,
        port=args.port,
        node_ip=args.node_ip_address,
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
        temp_dir=args.temp_dir,
    )
    out = console()
    _describe(out, settings)
    if args.block:
        return run_node_in_foreground(settings)
    with out.status("starting the Ray node"):
        record = start_node(settings)
    out.print(f"Ray {record.role} started: pid {record.pid}, log {record.log_path}", highlight=False)
    if settings.head:
        out.print(f"join from every other node:  deepserve cluster start --address {settings.head_address}")
        out.print("then serve on this node:     deepserve serve --model MODEL … --distributed-executor-backend ray")
        if settings.temp_dir:
            out.print(f"other Ray clients here need: export RAY_ADDRESS={settings.head_address}")
    out.print("status: deepserve cluster status   stop: deepserve cluster stop", highlight=False)
    return 0


def _describe(out: Console, settings: RayNodeSettings) -> None:
    role = "head" if settings.head else f"worker of {settings.head_address}"
    gpus = "counted by Ray" if settings.num_gpus is None else str(settings.num_gpus)
    out.print(f"Ray {role}: node IP {settings.node_ip} on {settings.interface}, GPUs {gpus}", highlight=False)
    for key, value in sorted(settings.environment.items()):
        out.print(f"  {key}={value}", highlight=False)


def _status(args: argparse.Namespace) -> int:
    status = cluster_status(args.address)
    if args.json:
        print(json.dumps({"address": status.address, "nodes": [asdict(node) for node in status.nodes]}, indent=2))
        return 0
    table = Table(title=f"Ray cluster at {status.address}")
    for column in ("node", "address", "host", "role", "alive", "GPUs", "CPUs", "memory GiB"):
        table.add_column(column, justify="right" if column in ("GPUs", "CPUs", "memory GiB") else "left")
    for node in status.nodes:
        table.add_row(
            node.node_id[:12],
            node.address,
            node.hostname,
            "head" if node.is_head else "worker",
            "yes" if node.alive else "no",
            f"{node.gpus:g}",
            f"{node.cpus:g}",
            f"{node.memory_bytes / GIB:.1f}",
        )
    out = console()
    out.print(table)
    out.print(f"{len(status.alive)} node(s) alive, {status.gpus} GPU(s)", highlight=False)
    return 0


def _stop(args: argparse.Namespace) -> int:
    record = stop_node()
    if record is None:
        print("no Ray node started by deepserve runs here (DEEPSERVE_HOME has no record of one)")
        return 0
    print(f"stopped the Ray {record.role} (pid {record.pid}) of {record.head_address}")
    return 0
