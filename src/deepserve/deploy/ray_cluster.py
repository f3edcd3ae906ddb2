"""A Ray cluster for vLLM's Ray executor, as seed 001 runs it: `ray start --head` on one node, `ray start --address`
on the others, with the settings multi-node vLLM needs on every node (the node's IP, VLLM_HOST_IP, and NCCL's and
Gloo's socket interface set to the interface that holds that IP).

Each node runs `ray start --block` as one child of its own session, whose pid deepserve records under
DEEPSERVE_HOME/cluster/: stopping the node is a SIGTERM to that pid (Ray then drains and stops every process of that
node) rather than `ray stop`, which stops every Ray process on the machine, whoever started it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from deepserve.config import deepserve_home
from deepserve.deploy.netif import (
    SOCKET_IFNAME_VARIABLES,
    Interface,
    interface_holding,
    local_interfaces,
    resolve_host,
    route_source,
)
from deepserve.errors import ConfigError, DeepserveError
from deepserve.hardware.detect import local_gpus

DEFAULT_RAY_PORT = 6379  # Ray's own default GCS port
RAY_STARTED_MARKER = "Ray runtime started."  # what `ray start` prints once the node is up
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 45.0  # Ray drains a node for up to 30 s on SIGTERM
PROBE_TIMEOUT_S = 90.0


class ClusterError(DeepserveError):
    """The Ray cluster could not be started, reached or stopped."""


@dataclass(frozen=True)
class RayNodeSettings:
    """One `ray start`, resolved: what runs and the environment the node's processes (and vLLM's Ray workers,
    which inherit it) get."""

    head: bool
    port: int  # the head's GCS port (on a worker: the port of --address)
    head_address: str  # HOST:PORT every node joins
    node_ip: str
    interface: str
    num_gpus: int | None = None  # None: Ray counts them itself
    num_cpus: int | None = None
    temp_dir: str | None = None
    environment: dict[str, str] = field(default_factory=dict)

    def argv(self, ray: str = "ray") -> list[str]:
        argv = [ray, "start"]
        argv += ["--head", "--port", str(self.port)] if self.head else ["--address", self.head_address]
        argv += ["--node-ip-address", self.node_ip]
        if self.num_gpus is not None:
            argv += ["--num-gpus", str(self.num_gpus)]
        if self.num_cpus is not None:
            argv += ["--num-cpus", str(self.num_cpus)]
        if self.temp_dir:
            argv += ["--temp-dir", self.temp_dir]
        return [*argv, "--disable-usage-stats", "--block"]


def ray_node_settings(
    head: bool,
    address: str | None = None,
    port: int | None = None,
    node_ip: str | None = None,
    num_gpus: int | None = None,
    num_cpus: int | None = None,
    temp_dir: str | None = None,
    interfaces: tuple[Interface, ...] | None = None,
    environ: dict[str, str] | None = None,
) -> RayNodeSettings:
    """Resolve a node's settings: its IP (given, else the address that routes to the head, or on the head the
    default route's), the interface holding it, and the variables vLLM and NCCL/Gloo read. Variables the user has
    already set are kept."""
    if head == (address is not None):
        raise ConfigError("give either --head (this node starts the cluster) or --address HOST:PORT (join one)")
    _check_counts(head, port, num_gpus, num_cpus)
    environ = dict(os.environ) if environ is None else environ
    head_host, port = (None, port or DEFAULT_RAY_PORT) if address is None else _split_address(address)
    node_ip = node_ip or _default_node_ip(head_host)
    interfaces = local_interfaces() if interfaces is None else interfaces
    interface = interface_holding(node_ip, interfaces)
    if interface is None:
        held = ", ".join(f"{i.name} {'/'.join(i.addresses)}" for i in interfaces if i.addresses) or "none"
        raise ConfigError(
            f"--node-ip-address {node_ip} is not an address of this machine (its interfaces: {held}); give the "
            "address of this node that the other nodes reach"
        )
    if num_gpus is None:
        num_gpus = len(local_gpus()) or None  # explicit, so that Ray's count cannot differ from nvidia-smi's
    wanted = {"VLLM_HOST_IP": node_ip, **dict.fromkeys(SOCKET_IFNAME_VARIABLES, interface.name)}
    environment = {key: environ.get(key) or value for key, value in wanted.items()}
    head_address = f"{node_ip}:{port}" if head else str(address)
    return RayNodeSettings(head, port, head_address, node_ip, interface.name, num_gpus, num_cpus, temp_dir, environment)


def _check_counts(head: bool, port: int | None, num_gpus: int | None, num_cpus: int | None) -> None:
    if port is not None and not head:
        raise ConfigError("--port is the head's own port; a worker joins the port given in --address HOST:PORT")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port: give one from 1 to 65535 (Ray's default: 6379)")
    for flag, count in (("--num-gpus", num_gpus), ("--num-cpus", num_cpus)):
        if count is not None and count < 0:
            raise ConfigError(f"{flag} {count} cannot be negative: give 0 or more (or leave it out for the default)")


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--address {address!r} must be the head's HOST:PORT, e.g. 10.0.0.1:{DEFAULT_RAY_PORT}")
    if resolve_host(host.strip("[]")) is None:
        raise ConfigError(f"--address {address}: {host} does not resolve; give the head node's IP address")
    return host.strip("[]"), int(port)


def _default_node_ip(head_host: str | None) -> str:
    ip = route_source(head_host)
    if ip is None:
        towards = f"to the head {head_host}" if head_host else "(no default route)"
        raise ConfigError(
            f"cannot tell this node's address: no route {towards}; give it with --node-ip-address (the address "
            "of this node on the network the nodes share)"
        )
    return ip


# ---- the node this machine runs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayNodeRecord:
    """What `deepserve cluster start` leaves behind for `status` and `stop`."""

    pid: int
    create_time: float  # with the pid: the process, even after the pid is reused
    role: str  # head | worker
    head_address: str
    node_ip: str
    log_path: str
    argv: list[str]
    environment: dict[str, str]


def record_path() -> Path:
    return deepserve_home() / "cluster" / "ray-node.json"


def read_record() -> RayNodeRecord | None:
    """The node this DEEPSERVE_HOME started, if its process still runs (a stale record is removed)."""
    record = _load_record()
    if record is not None and _process_of(record) is None:
        record_path().unlink(missing_ok=True)
        return None
    return record


def _load_record() -> RayNodeRecord | None:
    """The record as written, or None when there is none; one that does not parse (a crash mid-write, an older
    deepserve) is reported with the file to remove, not as a traceback."""
    path = record_path()
    if not path.is_file():
        return None
    try:
        return RayNodeRecord(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ClusterError(
            f"cannot read {path} ({exc}); if no Ray node of yours runs here, remove that file and try again"
        ) from None


def _process_of(record: RayNodeRecord) -> psutil.Process | None:
    try:
        process = psutil.Process(record.pid)
        if abs(process.create_time() - record.create_time) > 1 or process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process
    except psutil.NoSuchProcess:
        return None


def ray_executable() -> str:
    """`ray` beside this Python (deepserve's environment), else on PATH."""
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise ClusterError(
            "Ray is not installed in deepserve's environment: `pip install ray` (or `pip install 'deepserve[ray]'`)"
        )
    return found


def start_node(
    settings: RayNodeSettings,
    on_progress: Callable[[str, float], None] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> RayNodeRecord:
    """Start the node in the background (its own session, surviving this command) and return once Ray says it runs;
    a node that exits or stays silent is stopped and its log's last lines raised."""
    existing = read_record()
    if existing is not None:
        raise ClusterError(
            f"a Ray node started by deepserve already runs here (pid {existing.pid}, {existing.role} of "
            f"{existing.head_address}); stop it first with `deepserve cluster stop`"
        )
    log_path = (
        deepserve_home() / "logs" / f"ray-{'head' if settings.head else 'worker'}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = settings.argv(ray_executable())
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            env={**os.environ, **settings.environment, "RAY_USAGE_STATS_ENABLED": "0"},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    record = RayNodeRecord(
        process.pid,
        psutil.Process(process.pid).create_time(),
        "head" if settings.head else "worker",
        settings.head_address,
        settings.node_ip,
        str(log_path),
        argv,
        settings.environment,
    )
    record_path().parent.mkdir(parents=True, exist_ok=True)
    record_path().write_text(json.dumps(asdict(record), indent=2))
    try:
        _wait_started(process, log_path, on_progress, timeout_s)
    except BaseException:
        stop_node()
        raise
    return record


def _wait_started(
    process: subprocess.Popen[bytes],
    log_path: Path,
    on_progress: Callable[[str, float], None] | None,
    timeout_s: float,
) -> None:
    started = time.monotonic()
    while RAY_STARTED_MARKER not in log_path.read_text(errors="replace"):
        elapsed = time.monotonic() - started
        if process.poll() is not None:
            raise ClusterError(f"`ray start` exited with code {process.returncode}:\n{_tail(log_path)}")
        if elapsed > timeout_s:
            raise ClusterError(f"the Ray node did not start within {timeout_s:.0f} s:\n{_tail(log_path)}")
        if on_progress:
            on_progress("starting the Ray node", elapsed)
        time.sleep(0.5)


def run_node_in_foreground(settings: RayNodeSettings) -> int:
    """`--block`: the node runs as long as this command (a container's or a Slurm task's main process); Ctrl-C or
    SIGTERM stops it."""
    process = subprocess.Popen(
        settings.argv(ray_executable()), env={**os.environ, **settings.environment, "RAY_USAGE_STATS_ENABLED": "0"}
    )
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: process.terminate())
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        return process.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_node(grace_s: float = STOP_GRACE_S) -> RayNodeRecord | None:
    """Stop the node this DEEPSERVE_HOME started: SIGTERM (Ray drains and stops the node's processes), then, past the
    grace period, SIGKILL to its whole session. Returns the stopped node, None when none ran."""
    record = _load_record()
    if record is None:
        return None
    process = _process_of(record)
    if process is not None:
        members = _session_members(record.pid)
        process.terminate()
        _, alive = psutil.wait_procs([process, *members], timeout=grace_s)
        for survivor in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                survivor.kill()
        psutil.wait_procs(alive, timeout=5)
    _forget_ray_address(record)
    record_path().unlink(missing_ok=True)
    return record


def _session_members(session_id: int) -> list[psutil.Process]:
    """The processes of the session we started `ray start` in (Ray's daemons are its children, or orphans that kept
    its session)."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != session_id and os.getsid(process.pid) == session_id:
                members.append(process)
    return members


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join("  | " + line for line in path.read_text(errors="replace").splitlines()[-lines:])


# ---- cluster status ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RayNode:
    node_id: str
    address: str
    hostname: str
    alive: bool
    is_head: bool
    gpus: float
    cpus: float
    memory_bytes: int


@dataclass(frozen=True)
class ClusterStatus:
    address: str
    nodes: tuple[RayNode, ...]

    @property
    def alive(self) -> list[RayNode]:
        return [node for node in self.nodes if node.alive]

    @property
    def gpus(self) -> int:
        return int(sum(node.gpus for node in self.alive))


def cluster_address(explicit: str | None = None) -> str:
    """Which cluster to ask: --address, else RAY_ADDRESS, else the node this DEEPSERVE_HOME started, else Ray's own
    discovery (`auto`: the cluster started on this machine with Ray's default temp dir)."""
    if explicit:
        return explicit
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    record = read_record()
    return record.head_address if record else "auto"


def where(address: str) -> str:
    """ "at HOST:PORT" in messages; for Ray's own discovery (`auto`), where that looks."""
    return "started on this machine (no --address or RAY_ADDRESS given)" if address == "auto" else f"at {address}"


def cluster_status(address: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> ClusterStatus:
    """The nodes and resources of the cluster at ADDRESS, from Ray's own API (`ray.nodes()`), asked in a child
    process so that this one never becomes a Ray driver."""
    address = cluster_address(address)
    _require_listener(address)
    command = [sys.executable, "-m", "deepserve.deploy.ray_probe", address]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"the Ray cluster {where(address)} did not answer within {timeout_s:.0f} s") from None
    try:
        answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ClusterError(f"could not read the Ray cluster {where(address)}: {done.stderr.strip()[-800:]}") from None
    if "error" in answer:
        reason = str(answer["error"]).rstrip(".")
        raise ClusterError(
            f"could not reach the Ray cluster {where(address)}: {reason}. Start it with `deepserve cluster start "
            "--head` (and `--address HEAD:PORT` on the other nodes), or give --address / RAY_ADDRESS"
        )
    return ClusterStatus(address, tuple(node_from_ray(node) for node in answer["nodes"]))


def _require_listener(address: str) -> None:
    """Fail at once when nothing listens at ADDRESS: Ray's client retries a dead address for minutes. For `auto`,
    the address is the one Ray recorded for the cluster on this machine (none recorded: Ray itself fails fast)."""
    if "://" in address:
        return
    recorded = address
    if address == "auto":
        recorded = _recorded_ray_address(None) or ""
        if not recorded:
            return
    host, port = _split_address(recorded)
    try:
        with socket.create_connection((host, port), timeout=5):
            return
    except OSError as exc:
        stale = f" (recorded in {ray_address_file(None)}: that cluster is gone)" if address == "auto" else ""
        raise ClusterError(
            f"nothing answers at {recorded}{stale} ({exc.strerror or type(exc).__name__}): start the head with "
            "`deepserve cluster start --head`, or give the head's address with --address / RAY_ADDRESS"
        ) from None


def ray_address_file(temp_dir: str | None) -> Path:
    """Where Ray records the address of the cluster a node on this machine belongs to (`ray stop` removes it; a
    node stopped by signal leaves it behind). Ray's own rule: TEMP_DIR, else RAY_TMPDIR or TMPDIR or /tmp, + ray."""
    if temp_dir:
        return Path(temp_dir) / "ray_current_cluster"
    system = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(system) / "ray" / "ray_current_cluster"


def _recorded_ray_address(temp_dir: str | None) -> str | None:
    try:
        return ray_address_file(temp_dir).read_text().strip() or None
    except OSError:
        return None


def _forget_ray_address(record: RayNodeRecord) -> None:
    """What `ray stop` does after stopping a node: drop Ray's record of the cluster, if it is this node's (the same
    head port: Ray may record the head by another of its addresses than the one the node was given)."""
    argv = record.argv
    temp_dir = argv[argv.index("--temp-dir") + 1] if "--temp-dir" in argv[:-1] else None
    recorded = _recorded_ray_address(temp_dir)
    if recorded is not None and recorded.rpartition(":")[2] == record.head_address.rpartition(":")[2]:
        ray_address_file(temp_dir).unlink(missing_ok=True)


def node_from_ray(node: dict[str, Any]) -> RayNode:
    """One entry of `ray.nodes()`."""
    resources = node.get("Resources") or {}
    return RayNode(
        node_id=str(node.get("NodeID", "")),
        address=str(node.get("NodeManagerAddress", "")),
        hostname=str(node.get("NodeManagerHostname", "")),
        alive=bool(node.get("Alive")),
        is_head="node:__internal_head__" in resources,
        gpus=float(resources.get("GPU", 0)),
        cpus=float(resources.get("CPU", 0)),
        memory_bytes=int(resources.get("memory", 0)),
    )
