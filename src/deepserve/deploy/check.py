"""`deepserve deploy check`: the preflight a user runs on each node before spending GPU hours. Every check gives a
plain verdict (ok, warn, fail, n/a) and, unless it is ok, the fix. The facts about the machine are gathered once
(`gather_facts`) and passed in, so each check is tested with facts made by hand."""

from __future__ import annotations

import glob
import os
import resource
import shutil
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from deepserve.deploy.netif import (
    SOCKET_IFNAME_VARIABLES,
    Interface,
    ifname_selects,
    interface_holding,
    local_interfaces,
    routable_interfaces,
    route_source,
)
from deepserve.deploy.source import checkpoint_bytes_of
from deepserve.engines.config import EngineConfig
from deepserve.engines.topology import MasterAddressError, check_master_address
from deepserve.errors import ConfigError, ModelError
from deepserve.hardware.catalog import Accelerator, get_accelerator, match_device_name
from deepserve.hardware.detect import AMD, LocalGpu, local_gpus, nvidia_driver_version, rocm_version
from deepserve.hardware.network import NetworkProfile, get_network
from deepserve.models.tiny import is_tiny_model
from deepserve.plan.admission import check_gpu_fit

GIB = 1024**3
MIN_SHM_BYTES = 1 * GIB  # NCCL's troubleshooting guide: Docker's 64 MiB default breaks it; give at least 1 GiB
MIN_DRIVER = (525, 60)  # CUDA 12.x on Linux needs at least 525.60.13 (NVIDIA's CUDA compatibility table)
CURRENT_DRIVER = (570, 0)  # CUDA 12.8, which vLLM's wheels are built with, ships with 570.x
DISK_HEADROOM = 1.05
CONNECT_TIMEOUT_S = 3.0
SYSFS_INFINIBAND = "/sys/class/infiniband"
VERBS_DIR = "/dev/infiniband"
# vLLM supports ROCm 6.3 and newer; MI350-series GPUs (gfx950) need ROCm 7.0 (vllm
# docs/getting_started/installation/gpu.rocm.inc.md @ 06d0369d, "Requirements").
MIN_ROCM = (6, 3)
MIN_ROCM_GFX950 = (7, 0)
KFD = "/dev/kfd"  # ROCm's compute interface: one for the host
RENDER_NODES = "/dev/dri/renderD*"  # one per GPU
VISIBLE_DEVICES_VARIABLES = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


class Verdict(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    NA = "n/a"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class HcaPort:
    """One port of an RDMA adapter, as /sys/class/infiniband/<device>/ports/<port>/ describes it."""

    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE, DOWN, INIT, … (the word after "4: " in the state file)
    link_layer: str  # InfiniBand or Ethernet (RoCE)


@dataclass(frozen=True)
class HostFacts:
    """What the checks look at on this machine."""

    gpus: tuple[LocalGpu, ...]
    driver_version: str | None
    shm_bytes: int | None  # size of /dev/shm; None when there is none
    interfaces: tuple[Interface, ...]
    environ: Mapping[str, str]
    free_bytes: Callable[[Path], int]  # free space on the filesystem that holds (or would hold) a path
    connect: Callable[[str, int], str]  # "open", "refused", "timeout" or another reason it failed
    home: Path = field(default_factory=Path.home)
    hca_ports: tuple[HcaPort, ...] = ()
    verbs_devices: bool = False  # /dev/infiniband holds the verbs devices (uverbs*) a process opens
    memlock_bytes: int | None = None  # RLIMIT_MEMLOCK; None: unlimited
    rocm_version: str | None = None  # AMD hosts: ROCm's version (amd-smi, /opt/rocm/.info/version)
    device_files: dict[str, str] = field(default_factory=dict)  # AMD hosts: /dev/kfd and render nodes → ok, …

    @property
    def rdma_devices(self) -> tuple[str, ...]:
        """The RDMA NICs (InfiniBand HCAs or RoCE NICs) whose collectives NCCL or RCCL can use."""
        return tuple(sorted({port.device for port in self.hca_ports}))

    @property
    def amd(self) -> bool:
        return bool(self.gpus) and self.gpus[0].vendor == AMD

    @property
    def hf_home(self) -> Path:
        return Path(self.environ.get("HF_HOME") or self.home / ".cache" / "huggingface")

    @property
    def hf_hub_cache(self) -> Path:
        return Path(self.environ.get("HF_HUB_CACHE") or self.hf_home / "hub")

    @property
    def hf_token_file(self) -> Path:
        return Path(self.environ.get("HF_TOKEN_PATH") or self.hf_home / "token")


def gather_facts() -> HostFacts:
    gpus = local_gpus()
    amd = bool(gpus) and gpus[0].vendor == AMD
    return HostFacts(
        gpus=gpus,
        driver_version=None if amd else nvidia_driver_version(),
        shm_bytes=_shm_bytes(),
        interfaces=local_interfaces(),
        environ=dict(os.environ),
        free_bytes=_free_bytes,
        connect=_connect,
        hca_ports=hca_ports(),
        verbs_devices=any(Path(VERBS_DIR).glob("uverbs*")),
        memlock_bytes=_memlock_bytes(),
        rocm_version=rocm_version() if amd else None,
        device_files=_device_files() if amd else {},
    )


def hca_ports(root: Path = Path(SYSFS_INFINIBAND)) -> tuple[HcaPort, ...]:
    """Every port of every RDMA adapter the kernel lists (InfiniBand HCAs and RoCE NICs alike)."""
    ports = []
    for port_dir in sorted(root.glob("*/ports/*")):
        try:
            state = (port_dir / "state").read_text().split(":")[-1].strip()
            link_layer = (port_dir / "link_layer").read_text().strip()
        except OSError:
            continue
        ports.append(HcaPort(port_dir.parent.parent.name, int(port_dir.name), state, link_layer))
    return tuple(ports)


def _memlock_bytes() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _device_files() -> dict[str, str]:
    """ROCm's device files and whether this user may open them: ok, missing, or no access."""
    files = {}
    for path in [KFD, *sorted(glob.glob(RENDER_NODES))]:
        if not os.path.exists(path):
            files[path] = "missing"
        else:
            files[path] = "ok" if os.access(path, os.R_OK | os.W_OK) else "no access"
    return files


def _shm_bytes() -> int | None:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _connect(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


# ---- what the deployment expects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """The deployment a node is checked against: its engine config (with --gpu-type, the GPU type it was planned
    for)."""

    config: EngineConfig
    network: NetworkProfile = field(default_factory=lambda: get_network("ib"))

    @property
    def gpu(self) -> Accelerator | None:
        return get_accelerator(self.config.gpu_type) if self.config.gpu_type else None

    @property
    def gpus_on_this_node(self) -> int:
        if self.config.distributed_executor_backend == "ray":
            return 1  # Ray places the ranks over the cluster; the head needs one GPU of its own
        return self.config.world_size // self.config.nnodes

    @property
    def wants_gpus(self) -> bool:
        return self.config.device in ("cuda", "rocm") or self.gpu is not None

    @property
    def model_kind(self) -> str:
        """tiny (generated here), local (a directory), or hub (downloaded by the engine)."""
        model = self.config.model
        if model is None or is_tiny_model(model):
            return "tiny"
        if model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists():
            return "local"
        return "hub"


def run_checks(expected: Expected, facts: HostFacts) -> list[Check]:
    return [check(expected, facts) for check in CHECKS]


def failed(checks: list[Check]) -> bool:
    return any(check.verdict is Verdict.FAIL for check in checks)


def _on_cpu(expected: Expected, facts: HostFacts) -> bool:
    return not facts.gpus and not expected.wants_gpus


# ---- the checks -------------------------------------------------------------------------------------------------


def check_gpus(expected: Expected, facts: HostFacts) -> Check:
    name, needed = "GPUs", expected.gpus_on_this_node
    if _on_cpu(expected, facts):
        return Check(name, Verdict.NA, "no GPU (nvidia-smi and amd-smi list none): the engine runs on CPU here")
    if not facts.gpus:
        return Check(
            name,
            Verdict.FAIL,
            f"the deployment needs {needed} GPU(s) on this node and neither nvidia-smi nor amd-smi lists one",
            "install the GPU driver (NVIDIA's, with nvidia-smi; or AMD's amdgpu with ROCm, whose amd-smi lists "
            "the GPUs), or run this node on a GPU machine",
        )
    names = sorted({gpu.name for gpu in facts.gpus})
    have = f"{len(facts.gpus)} x {' + '.join(names)}"
    if len(facts.gpus) < needed:
        return Check(
            name,
            Verdict.FAIL,
            f"{have}; the layout needs {needed} on each node",
            "run on a node with more GPUs, or lower --tensor-parallel-size and raise --nnodes",
        )
    if expected.gpu is not None:
        wanted = expected.gpu.name
        wrong = [n for n in names if (found := match_device_name(n)) is None or found.name != wanted]
        if wrong:
            return Check(
                name,
                Verdict.FAIL,
                f"{have}; the plan was made for {expected.gpu.name}",
                f"run on {expected.gpu.name} nodes, or plan again for this node's GPUs (--gpu-type)",
            )
    if len(names) > 1:
        return Check(name, Verdict.WARN, f"{have}: mixed GPU types", "use one GPU type per node")
    idle = f" (the layout uses {needed})" if len(facts.gpus) > needed else ""
    return Check(name, Verdict.OK, have + idle)


def check_gpu_memory(expected: Expected, facts: HostFacts) -> Check:
    """The memory plan `serve` checks before it starts (plan/admission.py), on this node's GPU type."""
    name, config = "GPU memory", expected.config
    if _on_cpu(expected, facts) or not facts.gpus:
        return Check(name, Verdict.NA, "no GPU on this node")
    accelerator = match_device_name(facts.gpus[0].name)
    if accelerator is None:
        return Check(name, Verdict.NA, f"{facts.gpus[0].name} is not in deepserve's GPU catalog: no memory plan")
    if expected.model_kind == "tiny" or not config.model:
        return Check(name, Verdict.NA, "no model to plan (give --model)")
    try:
        fit = check_gpu_fit(config, config.model, accelerator)
    except (ConfigError, ModelError) as exc:
        return Check(name, Verdict.NA, f"no memory plan for {config.model}: {exc}")
    if fit.fits is None:
        return Check(name, Verdict.NA, fit.summary)
    if not fit.fits:
        return Check(name, Verdict.FAIL, fit.summary, fit.suggestion or "`deepserve plan` finds a layout that fits")
    return Check(name, Verdict.OK, fit.summary)


def check_driver(expected: Expected, facts: HostFacts) -> Check:
    name = "NVIDIA driver"
    if _on_cpu(expected, facts):
        return Check(name, Verdict.NA, "no NVIDIA GPU on this node")
    if facts.amd:
        return Check(name, Verdict.NA, "AMD GPUs: see the ROCm checks")
    if facts.driver_version is None:
        return Check(name, Verdict.FAIL, "nvidia-smi reports no driver version", "install the NVIDIA driver")
    version = _version_tuple(facts.driver_version)
    if version < MIN_DRIVER:
        return Check(
            name,
            Verdict.FAIL,
            f"driver {facts.driver_version}: CUDA 12 needs 525.60.13 or newer",
            "upgrade the NVIDIA driver (570 or newer for vLLM's CUDA 12.8 wheels)",
        )
    if version < CURRENT_DRIVER:
        return Check(
            name,
            Verdict.WARN,
            f"driver {facts.driver_version}: vLLM's wheels are built with CUDA 12.8 (driver 570+); older CUDA 12 "
            "drivers run them through CUDA's minor-version compatibility, without PTX JIT",
            "upgrade to a 570 or newer driver",
        )
    return Check(name, Verdict.OK, f"driver {facts.driver_version}")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


# ---- AMD (ROCm) ---------------------------------------------------------------------------------------------------


def check_rocm(expected: Expected, facts: HostFacts) -> Check:
    name = "ROCm"
    if not facts.amd:
        return Check(name, Verdict.NA, "no AMD GPU on this node")
    gfx950 = any(gpu.arch == "gfx950" for gpu in facts.gpus)
    needed = MIN_ROCM_GFX950 if gfx950 else MIN_ROCM
    wanted = ".".join(map(str, needed))
    if facts.rocm_version is None:
        return Check(
            name,
            Verdict.WARN,
            "ROCm's version is unknown here (amd-smi reports none, no /opt/rocm/.info/version): fine when the engine "
            "runs in vLLM's ROCm image, which brings its own ROCm, on the host's amdgpu driver",
            f"to run the engine on the host itself, install ROCm {wanted} or newer",
        )
    if _version_tuple(facts.rocm_version) < needed:
        why = "MI350-series GPUs (gfx950) need ROCm 7.0" if gfx950 else "vLLM supports ROCm 6.3 and newer"
        return Check(
            name,
            Verdict.FAIL,
            f"ROCm {facts.rocm_version}: {why}",
            f"upgrade ROCm to {wanted} or newer, or run the engine in the vllm/vllm-openai-rocm image",
        )
    return Check(name, Verdict.OK, f"ROCm {facts.rocm_version}")


def check_rocm_devices(expected: Expected, facts: HostFacts) -> Check:
    """ROCm's device files: /dev/kfd (compute) and one /dev/dri render node per GPU, open to this user (the
    video and render groups) or passed into the container (--device /dev/kfd --device /dev/dri)."""
    name = "ROCm devices"
    if not facts.amd:
        return Check(name, Verdict.NA, "no AMD GPU on this node")
    fix_access = (
        "add the user to the video and render groups (sudo usermod -aG video,render $USER, then log in again), or "
        "run the container with --device /dev/kfd --device /dev/dri --group-add video"
    )
    if facts.device_files.get(KFD, "missing") == "missing":
        return Check(
            name,
            Verdict.FAIL,
            f"{KFD} is missing: the amdgpu kernel driver is not loaded, or the container was not given the device",
            "load the amdgpu driver (modprobe amdgpu), or run the container with --device /dev/kfd --device /dev/dri",
        )
    render = {path: state for path, state in facts.device_files.items() if path != KFD}
    denied = [path for path, state in facts.device_files.items() if state == "no access"]
    if denied:
        return Check(name, Verdict.FAIL, f"no read/write access to {', '.join(denied[:3])}", fix_access)
    if len(render) < expected.gpus_on_this_node:
        return Check(
            name,
            Verdict.FAIL,
            f"{len(render)} render node(s) under /dev/dri for the {expected.gpus_on_this_node} GPU(s) the layout "
            "needs on this node",
            "run the container with --device /dev/dri (all of it), or on Kubernetes ask for amd.com/gpu",
        )
    return Check(name, Verdict.OK, f"{KFD} and {len(render)} render node(s) accessible")


def check_rccl(expected: Expected, facts: HostFacts) -> Check:
    """RCCL (ROCm's NCCL) reads the NCCL_* variables. What breaks a deployment: visible-device variables hiding GPUs
    the layout needs, and on several nodes an RDMA fabric left unused or RoCE without a GID index."""
    name = "RCCL environment"
    if not facts.amd:
        return Check(name, Verdict.NA, "no AMD GPU on this node")
    needed = expected.gpus_on_this_node
    for variable in VISIBLE_DEVICES_VARIABLES:
        value = facts.environ.get(variable)
        if value is not None and len([d for d in value.split(",") if d.strip()]) < needed:
            return Check(
                name,
                Verdict.FAIL,
                f"{variable}={value} shows fewer than the {needed} GPU(s) the layout needs on this node",
                f"unset {variable}, or list {needed} GPUs in it",
            )
    if not expected.config.is_multi_node:
        return Check(name, Verdict.OK, "one node: the collectives stay on Infinity Fabric inside it")
    if not facts.rdma_devices:
        return Check(
            name,
            Verdict.WARN,
            "no RDMA NIC (/sys/class/infiniband is empty): the nodes' collectives go over TCP sockets",
            "fine for pipeline parallelism over a few nodes; for expert or tensor parallelism across nodes use "
            "RoCE or InfiniBand NICs",
        )
    if facts.environ.get("NCCL_IB_DISABLE") == "1":
        return Check(
            name,
            Verdict.WARN,
            f"NCCL_IB_DISABLE=1 with RDMA NICs present ({', '.join(facts.rdma_devices)}): RCCL will not use them",
            "unset NCCL_IB_DISABLE unless the NICs are not on the nodes' fabric",
        )
    if not facts.environ.get("NCCL_IB_GID_INDEX"):
        return Check(
            name,
            Verdict.WARN,
            f"RDMA NICs {', '.join(facts.rdma_devices)} and NCCL_IB_GID_INDEX unset: over RoCE, RCCL may pick a "
            "GID that does not route between the nodes",
            "export NCCL_IB_GID_INDEX=3 (RoCE v2 on most hosts; `show_gids` lists them), and NCCL_IB_HCA to "
            "the NICs of the fabric",
        )
    return Check(name, Verdict.OK, f"RDMA NICs {', '.join(facts.rdma_devices)}, NCCL_IB_GID_INDEX set")


def check_disk(expected: Expected, facts: HostFacts) -> Check:
    name, kind = "disk for the weights", expected.model_kind
    if kind == "tiny":
        return Check(name, Verdict.NA, "the tiny model is generated on this machine (a few MB)")
    if kind == "local":
        return Check(name, Verdict.NA, "the weights are already on disk (a local model directory)")
    model = str(expected.config.model)
    size = checkpoint_bytes_of(model)
    cached = facts.hf_hub_cache / ("models--" + model.replace("/", "--"))
    if cached.is_dir() and any(cached.glob("snapshots/*/*.safetensors")):
        return Check(name, Verdict.OK, f"{model} is in the Hugging Face cache ({cached})")
    free = facts.free_bytes(facts.hf_hub_cache)
    where = f"{free / GIB:,.0f} GiB free at {facts.hf_hub_cache}"
    if size is None:
        return Check(
            name,
            Verdict.WARN,
            f"{where}; {model} is not a preset, so its size is unknown here",
            "compare with the size on its Hugging Face page",
        )
    if free < size * DISK_HEADROOM:
        return Check(
            name,
            Verdict.FAIL,
            f"{where}; the checkpoint takes about {size / GIB:,.0f} GiB",
            "free space there, or point HF_HOME (or HF_HUB_CACHE) at a larger disk",
        )
    return Check(name, Verdict.OK, f"{where}; the checkpoint takes about {size / GIB:,.0f} GiB")


def check_shm(expected: Expected, facts: HostFacts) -> Check:
    name = "/dev/shm"
    if facts.shm_bytes is None:
        return Check(name, Verdict.FAIL, "this machine has no /dev/shm", "mount a tmpfs at /dev/shm")
    size = f"{facts.shm_bytes / GIB:.1f} GiB"
    if facts.shm_bytes >= MIN_SHM_BYTES:
        return Check(name, Verdict.OK, size)
    verdict = Verdict.FAIL if expected.gpus_on_this_node > 1 else Verdict.WARN
    return Check(
        name,
        verdict,
        f"{size}: NCCL and vLLM's worker processes exchange tensors there (a container's default is 64 MiB)",
        "docker run --ipc=host (or --shm-size 16g); on Kubernetes an emptyDir with medium: Memory at /dev/shm",
    )


def check_master(expected: Expected, facts: HostFacts) -> Check:
    name, config = "node 0's address and ports", expected.config
    if not config.is_multi_node:
        if config.distributed_executor_backend == "ray":
            return Check(name, Verdict.NA, "Ray places the nodes: `deepserve cluster status` shows them")
        return Check(name, Verdict.NA, "one node")
    host = str(config.master_addr)
    ports = {"master port": config.master_port, "join port": config.effective_join_port}
    try:
        check_master_address(config)
    except MasterAddressError as exc:
        return Check(name, Verdict.FAIL, exc.problem, exc.fix)
    if config.is_head:
        busy = [f"{what} {port}" for what, port in ports.items() if facts.connect(host, port) == "open"]
        if busy:
            return Check(
                name,
                Verdict.FAIL,
                f"something already listens on {host}: {', '.join(busy)}",
                "stop it, or choose other ports with --master-port / --join-port on every node",
            )
        free = ", ".join(f"{what} {port}" for what, port in ports.items())
        return Check(name, Verdict.OK, f"{host} is this machine's; {free} free")
    answers = {f"{what} {port}": facts.connect(host, port) for what, port in ports.items()}
    blocked = [f"{where} ({how})" for where, how in answers.items() if how not in ("open", "refused")]
    if blocked:
        return Check(
            name,
            Verdict.FAIL,
            f"{host}: {', '.join(blocked)}",
            f"open ports {config.master_port} and {config.effective_join_port} (and NCCL's) between the nodes",
        )
    closed = [where for where, how in answers.items() if how == "refused"]
    if closed:
        return Check(
            name,
            Verdict.WARN,
            f"{host} answers, but nothing listens yet on {', '.join(closed)}",
            "start node 0 first (its deepserve listens on the join port once it runs), then check again",
        )
    return Check(name, Verdict.OK, f"{host}: {', '.join(answers)} reachable")


def check_interfaces(expected: Expected, facts: HostFacts) -> Check:
    name, config = "NCCL/Gloo interface", expected.config
    if not config.is_multi_node and config.distributed_executor_backend != "ray":
        return Check(name, Verdict.NA, "one node: the collectives stay inside it")
    candidates = routable_interfaces(facts.interfaces)
    up = [i.name for i in facts.interfaces if i.is_up]
    suggestion = _interface_towards(config, facts)
    settings = {var: facts.environ.get(var) for var in SOCKET_IFNAME_VARIABLES}
    wrong = [f"{var}={spec}" for var, spec in settings.items() if spec and not any(ifname_selects(spec, i) for i in up)]
    if wrong:
        return Check(
            name,
            Verdict.FAIL,
            f"{', '.join(wrong)} selects no interface that is up here ({', '.join(up)})",
            f"export {' '.join(f'{var}={suggestion}' for var in SOCKET_IFNAME_VARIABLES)}",
        )
    unset = [var for var, spec in settings.items() if not spec]
    if unset and len(candidates) > 1:
        return Check(
            name,
            Verdict.WARN,
            f"{len(candidates)} interfaces could carry the collectives ({', '.join(i.name for i in candidates)}) and "
            f"{', '.join(unset)} is not set: NCCL and Gloo may pick one the other nodes cannot reach",
            f"export {' '.join(f'{var}={suggestion}' for var in unset)}   (the interface that reaches node 0)",
        )
    chosen = ", ".join(f"{var}={spec}" for var, spec in settings.items() if spec) or "one interface, found by NCCL"
    return Check(name, Verdict.OK, chosen)


def _interface_towards(config: EngineConfig, facts: HostFacts) -> str:
    host = config.master_addr or ""
    source = host if config.is_head else route_source(host)
    interface = interface_holding(source or "", facts.interfaces)
    return interface.name if interface else "<interface>"


def check_rdma(expected: Expected, facts: HostFacts) -> Check:
    """The HCAs the network profile names: present, with an active port of the profile's link layer, their verbs
    devices visible, and memory lockable (RDMA registers memory)."""
    name, config, network = "RDMA (network profile)", expected.config, expected.network
    if not config.is_multi_node:
        return Check(name, Verdict.NA, "one node: the collectives stay inside it")
    if not network.rdma:
        return Check(name, Verdict.NA, f"the {network.name} profile uses sockets (NCCL_IB_DISABLE=1)")
    wanted = network.ib_hca or facts.environ.get("NCCL_IB_HCA")
    selected = [port for port in facts.hca_ports if hca_selects(wanted, port)]
    listed = ", ".join(f"{p.device}:{p.port} {p.state} {p.link_layer}" for p in facts.hca_ports) or "none"
    other = "roce" if network.link_layer == "InfiniBand" else "ib"
    if not selected:
        what = f"NCCL_IB_HCA={wanted} selects none of the HCAs here" if wanted else "no RDMA adapter is listed"
        return Check(
            name,
            Verdict.FAIL,
            f"the {network.name} profile needs HCAs; {what} ({SYSFS_INFINIBAND}: {listed})",
            "install the adapter's driver (MLNX_OFED/DOCA), name the HCAs with --ib-hca, or render and run with "
            "--network tcp",
        )
    usable = [p for p in selected if p.state == "ACTIVE" and p.link_layer == network.link_layer]
    if not usable:
        return Check(
            name,
            Verdict.FAIL,
            f"no selected port is ACTIVE with link layer {network.link_layer} ({listed})",
            f"bring the ports up (ibstat), or use --network {other} if the ports are {other}",
        )
    if not facts.verbs_devices:
        return Check(
            name,
            Verdict.FAIL,
            f"{len(usable)} active port(s), but {VERBS_DIR} has no verbs devices: processes here cannot open them",
            f"containers: pass --device={VERBS_DIR} (compose: devices), or the RDMA device plugin's resource",
        )
    ports = ", ".join(f"{p.device}:{p.port}" for p in usable)
    if facts.memlock_bytes is not None:
        return Check(
            name,
            Verdict.WARN,
            f"{ports} active; memlock is limited to {facts.memlock_bytes // 1024} KiB, too little to register "
            "NCCL's buffers",
            "ulimit -l unlimited (docker: --ulimit memlock=-1; Kubernetes: the IPC_LOCK capability)",
        )
    return Check(name, Verdict.OK, f"{ports} active ({network.link_layer}); memlock unlimited")


def hca_selects(spec: str | None, port: HcaPort) -> bool:
    """Whether NCCL_IB_HCA=SPEC takes PORT (NCCL's syntax: comma-separated prefixes, `=` for exact names, `^` to
    exclude, `:N` for one port; unset takes every HCA)."""
    if not spec:
        return True
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    matched = False
    for item in spec.lstrip("^").lstrip("=").split(","):
        device, _, number = item.strip().partition(":")
        name_ok = port.device == device if exact else port.device.startswith(device)
        if name_ok and (not number or int(number) == port.port):
            matched = True
    return matched != exclude


def check_model_access(expected: Expected, facts: HostFacts) -> Check:
    name, kind, model = "model access", expected.model_kind, str(expected.config.model)
    if kind == "tiny":
        return Check(name, Verdict.NA, "the tiny model is generated on this machine")
    if kind == "local":
        path = Path(model).expanduser()
        weights = [*path.glob("*.safetensors"), *path.glob("*.bin")] if path.is_dir() else []
        if not (path / "config.json").is_file() or not weights:
            return Check(
                name,
                Verdict.FAIL,
                f"{path} has no config.json or no weight files (*.safetensors)",
                "copy the checkpoint to the same path on every node, or use a Hugging Face id",
            )
        unreadable = [p.name for p in weights if not os.access(p, os.R_OK)]
        if unreadable:
            return Check(name, Verdict.FAIL, f"cannot read {', '.join(unreadable[:3])}", f"chmod a+r {path}/*")
        return Check(name, Verdict.OK, f"{path}: config.json and {len(weights)} weight file(s) readable")
    token = [var for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN") if facts.environ.get(var)]
    if token:
        return Check(name, Verdict.OK, f"Hugging Face token in {token[0]}")
    if facts.hf_token_file.is_file():
        return Check(name, Verdict.OK, f"Hugging Face token in {facts.hf_token_file}")
    return Check(
        name,
        Verdict.WARN,
        f"no Hugging Face token (HF_TOKEN, {facts.hf_token_file}): public models download without one, "
        "rate-limited; gated ones fail",
        "export HF_TOKEN=hf_... (or `huggingface-cli login`)",
    )


CHECKS: tuple[Callable[[Expected, HostFacts], Check], ...] = (
    check_gpus,
    check_gpu_memory,
    check_driver,
    check_rocm,
    check_rocm_devices,
    check_rccl,
    check_disk,
    check_shm,
    check_master,
    check_interfaces,
    check_rdma,
    check_model_access,
)
