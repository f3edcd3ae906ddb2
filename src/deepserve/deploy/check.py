"""`deepserve deploy check`: the preflight a user runs on each node before spending GPU hours. Every check gives a
plain verdict (ok, warn, fail, n/a) and, unless it is ok, the fix. The facts about the machine are gathered once
(`gather_facts`) and passed in, so each check is tested with facts made by hand."""

from __future__ import annotations

import os
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
from deepserve.deploy.source import checkpoint_bytes
from deepserve.engines.config import EngineConfig
from deepserve.engines.topology import MasterAddressError, check_master_address
from deepserve.errors import ConfigError, ModelError
from deepserve.hardware.catalog import Accelerator, get_accelerator, match_device_name
from deepserve.hardware.detect import LocalGpu, local_gpus, nvidia_driver_version
from deepserve.models.resolve import load_spec
from deepserve.models.tiny import is_tiny_model
from deepserve.plan.admission import check_gpu_fit
from deepserve.plan.formats import checkpoint_format

GIB = 1024**3
MIN_SHM_BYTES = 1 * GIB  # NCCL's troubleshooting guide: Docker's 64 MiB default breaks it; give at least 1 GiB
MIN_DRIVER = (525, 60)  # CUDA 12.x on Linux needs at least 525.60.13 (NVIDIA's CUDA compatibility table)
CURRENT_DRIVER = (570, 0)  # CUDA 12.8, which vLLM's wheels are built with, ships with 570.x
DISK_HEADROOM = 1.05
CONNECT_TIMEOUT_S = 3.0


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
    return HostFacts(
        gpus=local_gpus(),
        driver_version=nvidia_driver_version(),
        shm_bytes=_shm_bytes(),
        interfaces=local_interfaces(),
        environ=dict(os.environ),
        free_bytes=_free_bytes,
        connect=_connect,
    )


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
        return self.config.device == "cuda" or self.gpu is not None

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
        return Check(name, Verdict.NA, "no NVIDIA GPU (nvidia-smi lists none): the engine runs on CPU here")
    if not facts.gpus:
        return Check(
            name,
            Verdict.FAIL,
            f"the deployment needs {needed} GPU(s) on this node and nvidia-smi lists none",
            "install the NVIDIA driver (nvidia-smi must list the GPUs), or run this node on a GPU machine",
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


def check_disk(expected: Expected, facts: HostFacts) -> Check:
    name, kind = "disk for the weights", expected.model_kind
    if kind == "tiny":
        return Check(name, Verdict.NA, "the tiny model is generated on this machine (a few MB)")
    if kind == "local":
        return Check(name, Verdict.NA, "the weights are already on disk (a local model directory)")
    model = str(expected.config.model)
    size = _checkpoint_size(model)
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


def _checkpoint_size(model: str) -> int | None:
    """What the download takes: the checkpoint's own format (an on-the-fly --quantization happens at load)."""
    try:
        spec = load_spec(model)
    except (ModelError, ConfigError):
        return None
    return checkpoint_bytes(spec, checkpoint_format(spec))


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
    check_disk,
    check_shm,
    check_master,
    check_interfaces,
    check_model_access,
)
