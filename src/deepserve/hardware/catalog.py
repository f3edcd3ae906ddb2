"""Accelerators the market sells, for the planner: memory, bandwidth, dense FLOP/s per dtype, interconnect.

Every figure is the vendor's datasheet value for one device, with sparsity removed (datasheets often quote
"with sparsity" Tensor Core figures, which are twice the dense ones; serving never uses 2:4 sparsity). Memory is the
datasheet's capacity read as GiB, which is what the HBM stacks hold (80 GB HBM3 = 5 x 16 GiB stacks). Link
bandwidths are per device and per direction. Collective latencies are typical NCCL/RCCL figures, not datasheet
values, and are marked as such.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for DTYPE; a dtype the device has no units for runs at its 16-bit rate (e.g. FP8 weights on
        an A100 are dequantized to BF16 by the engine's kernels)."""
        if dtype in self.dense_tflops:
            return self.dense_tflops[dtype]
        return self.dense_tflops.get("bf16") or self.dense_tflops["fp16"]

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)


_NVLINK4 = Link("nvlink4", 450.0, 10.0)  # 900 GB/s bidirectional per GPU (18 links)
_NVLINK3 = Link("nvlink3", 300.0, 12.0)  # 600 GB/s bidirectional per GPU
_NVLINK5 = Link("nvlink5", 900.0, 8.0)  # 1.8 TB/s bidirectional per GPU
_PCIE5 = Link("pcie5", 64.0, 20.0)  # x16 Gen5: 128 GB/s bidirectional
_PCIE4 = Link("pcie4", 32.0, 25.0)  # x16 Gen4: 64 GB/s bidirectional
_XGMI = Link("xgmi", 448.0, 12.0)  # 7 Infinity Fabric links x 64 GB/s per direction
_UPI = Link("upi", 62.0, 5.0)  # 4 UPI 2.0 links at 16 GT/s between two sockets

_HOPPER_SXM_TFLOPS = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "int8": 1978.9}
_AMPERE_TFLOPS = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0}
_CDNA3_TFLOPS = {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "int8": 2614.9}

ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator(
        name="a100-40gb",
        vendor="nvidia",
        hardware_class="ampere",
        memory_gib=40,
        memory_bandwidth_gb_s=1555,
        dense_tflops=_AMPERE_TFLOPS,
        intra_node=_NVLINK3,
        devices_per_node=8,
        sources=("NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)",),
        aliases=("a100-40", "a100-sxm4-40gb"),
        notes="no FP8 units: FP8 weights run as W8A16",
    ),
    Accelerator(
        name="a100-80gb",
        vendor="nvidia",
        hardware_class="ampere",
        memory_gib=80,
        memory_bandwidth_gb_s=2039,
        dense_tflops=_AMPERE_TFLOPS,
        intra_node=_NVLINK3,
        devices_per_node=8,
        sources=("NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",),
        aliases=("a100", "a100-80", "a100-sxm4-80gb"),
        notes="no FP8 units: FP8 weights run as W8A16",
    ),
    Accelerator(
        name="h100-sxm",
        vendor="nvidia",
        hardware_class="hopper",
        memory_gib=80,
        memory_bandwidth_gb_s=3350,
        dense_tflops=_HOPPER_SXM_TFLOPS,
        intra_node=_NVLINK4,
        devices_per_node=8,
        sources=("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",),
        aliases=("h100", "h100-sxm5", "h100-sxm5-80gb", "h100-80gb"),
    ),
    Accelerator(
        name="h100-pcie",
        vendor="nvidia",
        hardware_class="hopper",
        memory_gib=80,
        memory_bandwidth_gb_s=2000,
        dense_tflops={"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "int8": 1513.0},
        intra_node=_PCIE5,
        devices_per_node=8,
        sources=("NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)",),
        aliases=("h100-pcie-80gb",),
        notes="peers talk over PCIe Gen5 (no NVLink bridge assumed)",
    ),
    Accelerator(
        name="h200",
        vendor="nvidia",
        hardware_class="hopper",
        memory_gib=141,
        memory_bandwidth_gb_s=4800,
        dense_tflops=_HOPPER_SXM_TFLOPS,
        intra_node=_NVLINK4,
        devices_per_node=8,
        sources=("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",),
        aliases=("h200-sxm", "h200-sxm5", "h200-sxm5-141gb"),
    ),
    Accelerator(
        name="h20",
        vendor="nvidia",
        hardware_class="hopper",
        memory_gib=96,
        memory_bandwidth_gb_s=4000,
        dense_tflops={"fp32": 44.0, "tf32": 74.0, "bf16": 148.0, "fp16": 148.0, "fp8": 296.0, "int8": 296.0},
        intra_node=_NVLINK4,
        devices_per_node=8,
        sources=("NVIDIA H20 product brief (figures as published by OEMs; NVIDIA posts no public datasheet)",),
        aliases=("h20-96gb",),
    ),
    Accelerator(
        name="b200",
        vendor="nvidia",
        hardware_class="blackwell",
        memory_gib=180,
        memory_bandwidth_gb_s=8000,
        dense_tflops={"tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "int8": 4500.0, "fp4": 9000.0},
        intra_node=_NVLINK5,
        devices_per_node=8,
        sources=(
            "NVIDIA DGX B200 datasheet (1,440 GB and 64 TB/s per 8 GPUs; 72 PFLOPS FP8 with sparsity per 8 GPUs)",
            "NVIDIA HGX B200 datasheet",
        ),
        aliases=("b200-sxm", "hgx-b200"),
    ),
    Accelerator(
        name="mi300x",
        vendor="amd",
        hardware_class="cdna3",
        memory_gib=192,
        memory_bandwidth_gb_s=5300,
        dense_tflops=_CDNA3_TFLOPS,
        intra_node=_XGMI,
        devices_per_node=8,
        sources=("AMD Instinct MI300X accelerator data sheet",),
        aliases=("mi300x-192gb", "mi300"),
    ),
    Accelerator(
        name="mi325x",
        vendor="amd",
        hardware_class="cdna3",
        memory_gib=256,
        memory_bandwidth_gb_s=6000,
        dense_tflops=_CDNA3_TFLOPS,
        intra_node=_XGMI,
        devices_per_node=8,
        sources=("AMD Instinct MI325X accelerator data sheet",),
        aliases=("mi325x-256gb", "mi325"),
    ),
    Accelerator(
        name="l40s",
        vendor="nvidia",
        hardware_class="ada",
        memory_gib=48,
        memory_bandwidth_gb_s=864,
        dense_tflops={"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "int8": 733.0},
        intra_node=_PCIE4,
        devices_per_node=8,
        sources=("NVIDIA L40S GPU datasheet",),
        aliases=("l40s-48gb",),
        notes="no NVLink: tensor parallelism all-reduces over PCIe Gen4",
    ),
    Accelerator(
        name="rtx-6000-ada",
        vendor="nvidia",
        hardware_class="ada",
        memory_gib=48,
        memory_bandwidth_gb_s=960,
        dense_tflops={"fp32": 91.1, "bf16": 364.25, "fp16": 364.25, "fp8": 728.5, "int8": 728.5},
        intra_node=_PCIE4,
        devices_per_node=8,
        sources=("NVIDIA RTX 6000 Ada Generation datasheet (1,457 TFLOPS FP8 with sparsity)",),
        aliases=("rtx6000-ada", "rtx-6000", "rtx6000"),
        notes="no NVLink: tensor parallelism all-reduces over PCIe Gen4",
    ),
    Accelerator(
        name="cpu-xeon-8480",
        vendor="intel",
        hardware_class="cpu",
        memory_gib=512,
        memory_bandwidth_gb_s=307.2,
        # AMX: 1,024 BF16 FLOP per cycle per core, 56 cores, 2.0 GHz all-core; AVX-512 FP32: 64 FLOP/cycle/core.
        dense_tflops={"fp32": 7.2, "bf16": 114.7, "fp16": 114.7, "int8": 229.4},
        intra_node=_UPI,
        devices_per_node=2,
        sources=(
            "Intel Xeon Platinum 8480+ processor specifications (ark.intel.com): 56 cores, 8 channels DDR5-4800",
            "Intel Advanced Matrix Extensions (AMX) architecture guide: 1,024 BF16 FLOP per cycle per core",
        ),
        aliases=("cpu", "xeon-8480", "spr"),
        notes="one device = one socket with 512 GiB DDR5 (8 x 64 GiB, an assumed configuration)",
    ),
)


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
            + (f", {m.attention_gflops} GFLOP/s for prompt attention (PyTorch SDPA)" if attention else "")
            + " (hardware/host.py)",
        ),
        aliases=HOST_NAMES[1:],
        notes="this machine, measured; vLLM's CPU build",
        measured_compute_efficiency=attention,
    )


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
    ("h20", "h20"),
    ("b200", "b200"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100-pcie-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
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
