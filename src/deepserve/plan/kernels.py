"""What a device achieves per kind of work: the kernel table in data/kernels.json.

Each kind of work in an engine step (dense GEMMs, grouped MoE GEMMs, MLA decode and prefill attention, collectives)
runs at a fraction of the device's datasheet bandwidth and dense FLOP rate. The fractions come from public kernel
measurements (DeepGEMM, FlashMLA, Marlin, FlashAttention, NCCL, DeepEP, the engines' own kernel benchmarks), each
recorded with its source next to the number; plan/perf.py turns them into seconds. Nothing here is fitted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import Accelerator, Link
from deepserve.plan.formats import get_format

KERNELS_PATH = Path(__file__).with_name("data") / "kernels.json"

# Kinds of computation, in the order a layer runs them.
WORK_KINDS = ("dense_gemm", "moe_gemm", "mla_decode", "mla_prefill")
FP8_CACHE_DECODE = "fp8_cache"  # an mla_decode entry for an FP8 KV cache, where the class's kernels differ for it
LAUNCH_MODES = ("cuda_graph", "stream", "host_synchronised", "cpu_eager")


@dataclass(frozen=True)
class KindRate:
    """One kind of work on one device class and weight family."""

    memory_efficiency: float
    compute_efficiency: float
    floor_us: float
    measured: bool
    source: str
    compute_dtype: str = ""  # the dtype the kernel's matrix units run in, where not the kind's usual one


@dataclass(frozen=True)
class KernelRates:
    """Everything the step model needs about one device for one weight format."""

    hardware_class: str
    family: str  # weight family the GEMM rates are for: fp8, int4, 16bit
    kinds: dict[str, KindRate]
    launch_us: dict[str, float]  # cost of one small kernel by launch mode
    all_to_all_efficiency: float
    network_efficiency: float
    collectives: dict[str, float]  # link kind -> all-reduce bus bandwidth (GB/s)
    class_measured: bool
    provenance: str  # where the figures come from, for `plan` and `validate`
    cross_node_all_reduce_us: float = 0.0  # a small all-reduce's latency over two nodes (grows with log2 of nodes)
    # link kind -> (latency us, bus bandwidth GB/s) of the engines' own all-reduce kernel inside one node, which
    # they run instead of NCCL's where it is faster (small messages)
    custom_all_reduce: dict[str, tuple[float, float]] = field(default_factory=dict)

    def rate(self, kind: str) -> KindRate:
        return self.kinds[kind]

    @property
    def measured(self) -> bool:
        """Whether the class has public measurements at all (a class that borrows another vendor's is not)."""
        return self.class_measured

    def all_reduce_bus_gb_s(self, link: Link) -> float:
        """NCCL-style bus bandwidth of an all-reduce over LINK: measured per NVLink generation, else the network's
        efficiency applied to the link's own bandwidth."""
        if link.kind in self.collectives:
            return min(self.collectives[link.kind], link.bandwidth_gb_s)
        return link.bandwidth_gb_s * self.network_efficiency

    def custom_all_reduce_s(self, link: Link, ranks: int, message_bytes: float) -> float | None:
        """The engines' own all-reduce of MESSAGE_BYTES over RANKS GPUs of one node on LINK (None where the table
        has no figures for the link): a latency plus the bytes at its bus bandwidth, NCCL's convention."""
        figures = self.custom_all_reduce.get(link.kind)
        if figures is None:
            return None
        latency_us, bus_gb_s = figures
        bus_gb_s = min(bus_gb_s, link.bandwidth_gb_s)  # a cut-down NVLink (H800) caps it, as it caps NCCL's
        return latency_us * 1e-6 + 2 * (ranks - 1) / ranks * message_bytes / (bus_gb_s * 1e9)

    def all_reduce_latency_us(self, link: Link, nodes: int, two_node_us: float = 0.0) -> float:
        """A small all-reduce's latency: the link's within a node; across NODES a two-node latency (TWO_NODE_US,
        else the table's measured one), growing with the inter-node hops of NCCL's tree (2 log2(nodes), NCCL's
        tuning model)."""
        two_node_us = two_node_us or self.cross_node_all_reduce_us
        if nodes <= 1 or not two_node_us:
            return link.collective_latency_us
        return two_node_us * math.log2(nodes)

    def with_overrides(self, overrides: dict[str, KindRate], provenance: str) -> KernelRates:
        return replace(self, kinds={**self.kinds, **overrides}, provenance=provenance)


def weight_family(format_name: str) -> str:
    """The kernel table's family for a weight format: fp8, fp4 (NVFP4, MXFP4), int4 (AWQ, GPTQ), 16bit."""
    if format_name.startswith("fp8"):
        return "fp8"
    if "fp4" in format_name:
        return "fp4"
    if "int4" in format_name:
        return "int4"
    return "16bit"


@lru_cache(maxsize=16)
def kind_families(format_name: str) -> dict[str, str]:
    """The weight family each kind of work's figures are for. A format whose routed experts have a 4-bit format of
    their own (DeepSeek-V4's MXFP4 experts, NVIDIA's NVFP4 exports) runs its experts on the fp4 figures and
    everything else on its FP8 figures; other formats run every kind on their one family."""
    family = weight_family(format_name)
    try:
        expert_format = get_format(format_name).expert_format
    except ConfigError:
        expert_format = None
    if expert_format is None:
        return {kind: family for kind in WORK_KINDS}
    return {kind: "fp4" if kind == "moe_gemm" else "fp8" for kind in WORK_KINDS}


@lru_cache(maxsize=4)
def _table(path: Path = KERNELS_PATH) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def kernel_rates(
    accelerator: Accelerator,
    format_name: str,
    path: Path = KERNELS_PATH,
    mla_decode_backend: str | None = None,
    dense_gemm_backend: str | None = None,
    kv_cache_dtype: str = "auto",
) -> KernelRates:
    """The table's figures for ACCELERATOR's class and FORMAT_NAME's weight family; with MLA_DECODE_BACKEND, the
    decode attention's figures for that kernel (an entry of the class's mla_decode table, e.g. "triton") in place
    of the class's best one; with DENSE_GEMM_BACKEND, the dense GEMMs' figures for that kernel on the weight family
    (the dense_gemm entry "<family>_<backend>", e.g. "fp8_triton"); with an FP8 KV_CACHE_DTYPE, the class's
    decode figures for an FP8 cache where it has them (Blackwell's kernels run it on FP8 matrix units)."""
    table = _table(path)
    classes = table["classes"]
    if accelerator.hardware_class not in classes:
        raise ConfigError(
            f"no kernel figures for hardware class {accelerator.hardware_class!r} in {path.name}; "
            f"known: {', '.join(sorted(classes))}"
        )
    entry = classes[accelerator.hardware_class]
    family = weight_family(format_name)
    families = kind_families(format_name)
    kinds = {kind: _kind_rate(entry, kind, families[kind], accelerator.hardware_class) for kind in WORK_KINDS}
    if mla_decode_backend is not None:
        kinds["mla_decode"] = _backend_rate(entry, "mla_decode", mla_decode_backend, accelerator.hardware_class)
    elif kv_cache_dtype.startswith("fp8") and FP8_CACHE_DECODE in entry["mla_decode"]:
        kinds["mla_decode"] = _record_rate(entry["mla_decode"][FP8_CACHE_DECODE], entry)
    if dense_gemm_backend is not None:
        backend = f"{families['dense_gemm']}_{dense_gemm_backend}"
        kinds["dense_gemm"] = _backend_rate(entry, "dense_gemm", backend, accelerator.hardware_class)
    for kind, efficiency in accelerator.measured_compute_efficiency:
        kinds[kind] = replace(
            kinds[kind], compute_efficiency=efficiency, measured=True, source=f"measured on {accelerator.name}"
        )
    for kind, efficiency in accelerator.measured_memory_efficiency:
        kinds[kind] = replace(
            kinds[kind], memory_efficiency=efficiency, measured=True, source=f"measured on {accelerator.name}"
        )
    collectives = table["collectives"]
    measured = bool(entry["measured"])
    provenance = f"{accelerator.hardware_class} kernel figures" + ("" if measured else " (carried over, not measured)")
    return KernelRates(
        hardware_class=accelerator.hardware_class,
        family=family,
        kinds=kinds,
        launch_us={mode: float(value["value"]) for mode, value in table["launch_us"].items()},
        all_to_all_efficiency=float(collectives["all_to_all_nvlink_efficiency"]["value"]),
        network_efficiency=float(collectives["network"]["efficiency"]),
        collectives={
            kind: float(value["bus_bandwidth_gb_s"])
            for kind, value in collectives.items()
            if isinstance(value, dict) and "bus_bandwidth_gb_s" in value
        },
        class_measured=measured,
        provenance=provenance,
        cross_node_all_reduce_us=float(collectives["cross_node_all_reduce"]["latency_us_two_nodes"]),
        custom_all_reduce={
            kind: (float(value["latency_us"]), float(value["bus_bandwidth_gb_s"]))
            for kind, value in collectives.get("custom_all_reduce", {}).get("links", {}).items()
        },
    )


def _kind_rate(entry: dict[str, Any], kind: str, family: str, hardware_class: str) -> KindRate:
    by_family = entry[kind]
    record = by_family.get(family) or by_family.get("any")
    if record is None:
        raise ConfigError(f"kernels.json: {hardware_class}/{kind} has no entry for weight family {family}")
    return _record_rate(record, entry)


def _backend_rate(entry: dict[str, Any], kind: str, backend: str, hardware_class: str) -> KindRate:
    """A named kernel's figures for KIND (an engine that runs a slower kernel than the class's best)."""
    not_kernels = ("any", FP8_CACHE_DECODE)  # the class's best kernel, by cache dtype
    record = entry[kind].get(backend)
    if record is None or backend in not_kernels:
        known = sorted(name for name in entry[kind] if name not in not_kernels)
        raise ConfigError(
            f"kernels.json: {hardware_class}/{kind} has no figures for the {backend!r} kernel; "
            f"known: {', '.join(known) or 'none'}"
        )
    return _record_rate(record, entry)


def _record_rate(record: dict[str, Any], entry: dict[str, Any]) -> KindRate:
    return KindRate(
        memory_efficiency=float(record["memory_efficiency"]),
        compute_efficiency=float(record["compute_efficiency"]),
        floor_us=float(record.get("floor_us", 0.0)),
        measured=bool(record.get("measured", True)) and bool(entry["measured"]),
        source=str(record["source"]),
        compute_dtype=str(record.get("compute_dtype", "")),
    )


def ideal_rates(rates: KernelRates) -> KernelRates:
    """RATES at the hardware's limit: every kind at full bandwidth and peak, no floors, free launches (a bound, not a
    prediction)."""
    perfect = KindRate(memory_efficiency=1.0, compute_efficiency=1.0, floor_us=0.0, measured=True, source="ideal")
    return replace(
        rates,
        kinds=dict.fromkeys(rates.kinds, perfect),
        launch_us=dict.fromkeys(rates.launch_us, 0.0),
        provenance="ideal (datasheet bandwidth and peak)",
    )


def kind_sources(rates: KernelRates) -> dict[str, str]:
    """Each kind's source, marked when it is carried over rather than measured."""
    return {kind: ("" if rate.measured else "(not measured) ") + rate.source for kind, rate in rates.kinds.items()}
