"""Accelerators the market sells, for the planner: memory, bandwidth, dense FLOP/s per dtype, interconnect.

Every figure is the vendor's datasheet value for one device, with sparsity removed (datasheets often quote
"with sparsity" Tensor Core figures, which are twice the dense ones; serving never uses 2:4 sparsity). Memory is the
datasheet's capacity read as GiB, which is what the HBM stacks hold (80 GB HBM3 = 5 x 16 GiB stacks). Link
bandwidths are per device and per direction. Collective latencies are typical NCCL/RCCL figures, not datasheet
values, and are marked as such. The figures, each with its datasheet's URL, are in data/accelerators.json.

A GB200 / GB300 NVL72 rack is one NVLink domain of 72 GPUs: its entry's devices_per_node is 72 (a tensor- or
expert-parallel group anywhere in the rack talks over NVLink), devices_per_host 4 (the GPUs of one compute tray,
which is what a multi-node launcher counts as a node).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from deepserve.errors import ConfigError, unknown_name

# The network between nodes lives in hardware/network.py (one profile for the planner and the renderers); its
# names stay importable from here, where the planner has always found them.
from deepserve.hardware.network import NETWORKS as NETWORKS
from deepserve.hardware.network import NetworkProfile
from deepserve.hardware.network import get_network as get_network

if TYPE_CHECKING:
    from deepserve.hardware.host import HostMeasurement

Network = NetworkProfile  # the planner's name for the network between nodes


@dataclass(frozen=True)
class Link:
    """A device's link to its peers: bandwidth per device per direction, latency of one small collective."""

    kind: str  # nvlink4, pcie5, xgmi, infiniband, ethernet, ...
    bandwidth_gb_s: float
    collective_latency_us: float


@dataclass(frozen=True)
class Accelerator:
    name: str
    vendor: str
    hardware_class: str  # efficiency factors are fitted per class: ampere, hopper, blackwell, ada, cdna3, cpu
    memory_gib: float
    memory_bandwidth_gb_s: float
    dense_tflops: dict[str, float]  # per dtype, without sparsity
    intra_node: Link
    devices_per_node: int
    sources: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    notes: str = ""
    # Work kinds whose rate was measured on this very device, as a fraction of dense_tflops (the host's attention,
    # hardware/host.py); they replace the kernel table's figures for the device's class.
    measured_compute_efficiency: tuple[tuple[str, float], ...] = ()
    measured_memory_efficiency: tuple[tuple[str, float], ...] = ()  # (kind, fraction of memory_bandwidth_gb_s)
    architecture: str = ""  # sm80, sm90, sm100, sm103, sm120, gfx942, gfx950: decides native weight formats
    devices_per_host: int = 0  # GPUs one machine holds, where the scale-up domain spans several (NVL72: 4)

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for DTYPE; a dtype the device has no units for runs at its 16-bit rate (e.g. FP8 weights on
        an A100 are dequantized to BF16 by the engine's kernels)."""
        if dtype in self.dense_tflops:
            return self.dense_tflops[dtype]
        return self.dense_tflops.get("bf16") or self.dense_tflops["fp16"]

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)

    @property
    def gpus_per_machine(self) -> int:
        """GPUs one machine holds: a compute tray of an NVL72 rack (4), else the whole node (the measured host's
        entry states no devices_per_host)."""
        return self.devices_per_host or self.devices_per_node

    def nvlink_domains(self, gpus: int, machines: int) -> int:
        """GPUS on MACHINES as the planner counts nodes: scale-up (NVLink) domains. Users, launchers and published
        setups count machines, and an NVL72 rack's 18 compute trays of 4 GPUs are one domain (LMSYS's 48-GPU
        decode on 12 trays ran its all-to-all over NVLink); on an 8-GPU HGX node the two counts are the same."""
        machines_per_domain = max(self.devices_per_node // self.gpus_per_machine, 1)
        return max(-(-machines // machines_per_domain), -(-gpus // self.devices_per_node), 1)


def _load_accelerators() -> tuple[Accelerator, ...]:
    """data/accelerators.json: every figure with the vendor page it comes from."""
    text = resources.files("deepserve.hardware").joinpath("data/accelerators.json").read_text()
    data = json.loads(text)
    links = {
        name: Link(entry["kind"], float(entry["bandwidth_gb_s"]), float(entry["collective_latency_us"]))
        for name, entry in data["links"].items()
    }
    return tuple(
        Accelerator(
            name=entry["name"],
            vendor=entry["vendor"],
            hardware_class=entry["hardware_class"],
            memory_gib=float(entry["memory_gib"]),
            memory_bandwidth_gb_s=float(entry["memory_bandwidth_gb_s"]),
            dense_tflops={dtype: float(value) for dtype, value in entry["dense_tflops"].items()},
            intra_node=links[entry["intra_node"]],
            devices_per_node=int(entry["devices_per_node"]),
            sources=tuple(entry["sources"]),
            aliases=tuple(entry.get("aliases", ())),
            notes=entry.get("notes", ""),
            architecture=entry.get("architecture", ""),
            devices_per_host=int(entry.get("devices_per_host") or entry["devices_per_node"]),
        )
        for entry in data["accelerators"]
    )


ACCELERATORS = _load_accelerators()


def accelerator_names() -> list[str]:
    return [acc.name for acc in ACCELERATORS]


def class_vendor(hardware_class: str) -> str:
    """The vendor whose kernel stack a hardware class runs (CUDA for nvidia, ROCm for amd)."""
    for acc in ACCELERATORS:
        if acc.hardware_class == hardware_class:
            return acc.vendor
    raise ConfigError(unknown_name("hardware class", hardware_class, sorted({a.hardware_class for a in ACCELERATORS})))


HOST_NAMES = ("host", "this-host", "local-cpu")


def host_accelerator(measurement: HostMeasurement | None = None) -> Accelerator:
    """This machine's CPU as an accelerator, from deepserve's own measurement of it (hardware/host.py, cached
    per host; or MEASUREMENT, e.g. one stored with a benchmark): copy bandwidth and the rate vLLM's CPU build computes a
    bf16 model at."""
    from deepserve.hardware.host import measured_host, physical_memory_gib

    m = measurement or measured_host()
    gemm = m.engine_gflops
    attention = (("mla_prefill", round(m.attention_gflops / gemm, 3)),) if m.attention_gflops and m.bf16_gflops else ()
    decode_compute = (("mla_decode", round(m.decode_attention_gflops / gemm, 3)),) if m.decode_attention_gflops else ()
    decode_memory = (
        (("mla_decode", round(m.decode_attention_gb_s / m.memory_bandwidth_gb_s, 3)),)
        if m.decode_attention_gb_s
        else ()
    )
    return Accelerator(
        name="host",
        vendor="host",
        hardware_class="cpu",
        memory_gib=physical_memory_gib(),
        memory_bandwidth_gb_s=m.memory_bandwidth_gb_s,
        dense_tflops={"bf16": gemm / 1e3, "fp16": gemm / 1e3, "fp32": m.fp32_gflops / 1e3},
        intra_node=Link("host", 5.0, 50.0),
        devices_per_node=1,
        sources=(
            f"measured by deepserve on {m.host} ({m.cpu_model}, {m.cores} cores) at {m.measured_at}, on the "
            f"{m.engine_threads} thread(s) vLLM's CPU worker gets: copy bandwidth "
            f"{m.memory_bandwidth_gb_s} GB/s, {gemm} GFLOP/s for a bf16 model "
            f"({'PyTorch bf16 linear' if m.bf16_gflops else 'fp32 BLAS: no torch'})"
            + (
                f", {m.attention_gflops} GFLOP/s for prompt attention ({_kernel_name(m.attention_kernel)})"
                if attention
                else ""
            )
            + (
                f", {_decode_kernel_name(m.decode_attention_kernel)} at {m.decode_attention_gb_s} GB/s of cache "
                f"(4 heads) and "
                f"{m.decode_attention_gflops} GFLOP/s (128 heads)"
                if decode_memory
                else ""
            )
            + _probe_words(m)
            + " (hardware/host.py)",
        ),
        aliases=HOST_NAMES[1:],
        notes="this machine, measured; vLLM's CPU build",
        measured_compute_efficiency=attention + decode_compute,
        measured_memory_efficiency=decode_memory,
        architecture=HOST_AMX_ARCHITECTURE if m.amx else "",
    )


HOST_AMX_ARCHITECTURE = "x86-amx"  # vLLM's CPU build runs MLA with its AMX kernels here (engines/vllm.py)
_ATTENTION_KERNELS = {"sdpa": "PyTorch SDPA", "amx_mla": "vLLM's AMX MLA kernel"}


def _probe_words(m: HostMeasurement) -> str:
    """How many probes the rates are the median of, and how far the linear's spread."""
    if m.probes < 2:
        return ""
    spread = f", the linear from {m.bf16_gflops_range[0]} to {m.bf16_gflops_range[1]}" if m.bf16_gflops_range else ""
    return f"; each rate the median of {m.probes} probes{spread}"


_DECODE_KERNELS = {"amx_mla": "vLLM's AMX MLA decode kernel", "cpu_mla": "vLLM's reference CPU MLA decode kernel"}


def _decode_kernel_name(kernel: str) -> str:
    return _DECODE_KERNELS.get(kernel, kernel)


def _kernel_name(kernel: str) -> str:
    return _ATTENTION_KERNELS.get(kernel, kernel)


def get_accelerator(name: str) -> Accelerator:
    """Case-insensitive lookup by name or alias (h100 is the SXM part); `host` is this machine's CPU as measured
    (hardware/host.py); unknown names list the valid ones."""
    wanted = name.strip().lower().replace("_", "-").replace(" ", "-")
    if wanted in HOST_NAMES:
        return host_accelerator()
    for acc in ACCELERATORS:
        if wanted == acc.name or wanted in acc.aliases:
            return acc
    valid = [f"{acc.name} ({', '.join(acc.aliases)})" if acc.aliases else acc.name for acc in ACCELERATORS]
    valid.append(f"host ({', '.join(HOST_NAMES[1:])}: this machine's CPU, measured)")
    raise ConfigError(unknown_name("GPU", name, valid))


# Substrings of the names drivers report (torch.cuda.get_device_name, nvidia-smi, rocm-smi), most specific first.
_DEVICE_NAME_RULES = (
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100-sxm"),
    ("h200", "h200"),
    ("h20-3e", "h20-141gb"),
    ("h20", "h20"),
    ("h800", "h800"),
    ("gb300", "gb300"),
    ("gb200", "gb200"),
    ("b300", "b300"),
    ("b200", "b200"),
    ("rtx pro 6000", "rtx-pro-6000"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100-pcie-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
    ("mi355x", "mi355x"),
    ("mi350x", "mi355x"),
    ("mi325x", "mi325x"),
    ("mi300x", "mi300x"),
    ("l40s", "l40s"),
    ("rtx 6000 ada", "rtx-6000-ada"),
)


def match_device_name(reported: str) -> Accelerator | None:
    """The catalog entry for a device name as the driver reports it (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    lowered = reported.lower()
    for needle, name in _DEVICE_NAME_RULES:
        if needle in lowered:
            return get_accelerator(name)
    return None
