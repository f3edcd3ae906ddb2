"""The fastest decode the hardware allows: every decode step must read its bytes from memory at least once, so a step
takes at least (bytes it reads) / (memory bandwidth).

The bytes are the planner's (`deepserve.plan.perf.PerformanceModel`, its only implementation): the weights once per
step (for MoE only the experts the batch touches, `expected_distinct_experts`), plus each sequence's KV cache up to
its context, per GPU of the first pipeline stage of the deployment's layout. Here the planner's kernel figures are
set to the ideal (full bandwidth, no floors, no engine overhead), so the step time is the memory floor alone, not a
prediction; an engine reaches some fraction of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from deepserve.errors import DeepserveError
from deepserve.hardware.catalog import Accelerator, get_accelerator
from deepserve.models.spec import ModelSpec
from deepserve.plan.formats import WeightFormat, checkpoint_format
from deepserve.plan.kernels import ideal_rates, kernel_rates
from deepserve.plan.layout import Layout, Links, default_layout
from deepserve.plan.perf import PerformanceModel
from deepserve.plan.profiles import EngineParameters, select_profile

NO_ENGINE_OVERHEAD = EngineParameters(kernels_per_layer=0.0, prefill_efficiency=1.0)
KV_DTYPE = "auto"  # the engines' default: the cache in the model's 16-bit dtype


@dataclass(frozen=True)
class DecodeLimit:
    """Decode's memory floor for one model on one deployment."""

    spec: ModelSpec
    fmt: WeightFormat
    accelerator: Accelerator  # for a CPU host: the catalog's CPU entry with the measured bandwidth
    layout: Layout
    bandwidth_source: str  # "catalog (datasheet)" or "measured on the host …"
    is_host: bool = False  # a CPU host: one device, its bandwidth measured

    @property
    def bandwidth_gb_s(self) -> float:
        return self.accelerator.memory_bandwidth_gb_s

    def step_floor_s(self, batch: float, context_len: float) -> float:
        """The shortest decode step for BATCH sequences at CONTEXT_LEN tokens each: the time the busiest device
        needs to read its share of the weights and the cache once. With pipeline parallelism a token passes every
        stage while pp micro-batches share the work, so a token interval is pp stage steps of batch/pp."""
        pp = self.layout.pp
        micro = batch / pp if batch >= pp else 1.0
        return pp * self._model.step(micro, 0, context_len).memory_s

    def bytes_per_step(self, batch: float, context_len: float) -> float:
        """Bytes one device of the first stage reads in one decode step of BATCH sequences (all stages alike)."""
        pp = self.layout.pp
        micro = batch / pp if batch >= pp else 1.0
        return self._model.step(micro, 0, context_len).memory_s * self.bandwidth_gb_s * 1e9

    def tokens_per_s(self, batch: float, context_len: float) -> float:
        """The decode tokens/s ceiling at BATCH: each step emits one token per sequence."""
        return batch / self.step_floor_s(batch, context_len)

    def describe(self) -> str:
        """ "8x h100-sxm (3,350 GB/s each, catalog (datasheet)), TP=8, awq-int4 weights" ."""
        bandwidth = f"{self.bandwidth_gb_s:,.4g} GB/s"
        if self.is_host:
            return f"the CPU host ({bandwidth}, {self.bandwidth_source}), {self.fmt.name} weights"
        return (
            f"{self.layout.gpus}x {self.accelerator.name} ({bandwidth} each, {self.bandwidth_source}), "
            f"{self.layout.describe()}, {self.fmt.name} weights"
        )

    @cached_property
    def _model(self) -> PerformanceModel:
        links = Links(tensor=self.accelerator.intra_node, pipeline=self.accelerator.intra_node)
        rates = ideal_rates(kernel_rates(self.accelerator, self.fmt.name))
        engine = select_profile("vllm", self.accelerator.hardware_class)
        assert engine is not None  # the package's profiles cover GPUs and CPUs
        ideal = engine.with_parameters(NO_ENGINE_OVERHEAD, "ideal")
        return PerformanceModel(self.spec, self.fmt, self.layout, self.accelerator, links, rates, ideal, KV_DTYPE)


def gpu_limit(spec: ModelSpec, accelerator: Accelerator, gpus: int) -> DecodeLimit:
    """GPUs from the catalog: the datasheet bandwidth, tensor parallelism inside a node and pipeline parallelism
    across nodes (the layout both engines document for DeepSeek on several nodes)."""
    return DecodeLimit(spec, checkpoint_format(spec), accelerator, _layout(gpus, accelerator), "catalog (datasheet)")


def cpu_limit(spec: ModelSpec, bandwidth_gb_s: float, source: str) -> DecodeLimit:
    """A CPU host: one device whose bandwidth deepserve measured there (the datasheet of a virtual CPU says
    nothing useful)."""
    host = replace(get_accelerator("cpu"), name="CPU host", memory_bandwidth_gb_s=bandwidth_gb_s)
    return DecodeLimit(spec, checkpoint_format(spec), host, Layout(tp=1), source, is_host=True)


def _layout(gpus: int, accelerator: Accelerator) -> Layout:
    nodes = max(1, math.ceil(gpus / accelerator.devices_per_node))
    try:
        return default_layout(gpus, nodes)
    except DeepserveError:
        return Layout(tp=gpus)  # an uneven count: one tensor-parallel group is as good a floor as any
