"""Parallel layouts: how a model's weights and requests are spread over GPUs, and which links each layout uses.

GPUs = tp x pp x dp. Tensor parallelism (tp) splits attention heads and every expert's matrices; pipeline
parallelism (pp) splits the layers into stages; data-parallel attention (dp > 1, with ep) replicates attention and
gives each replica its own requests, while expert parallelism (ep) spreads whole experts over the tp x dp GPUs of a
stage (as SGLang's --enable-dp-attention and vLLM's --data-parallel-size with --enable-expert-parallel serve
DeepSeek).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import Accelerator, Link, Network
from deepserve.models.spec import ModelSpec


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_shards(self) -> int:
        """How many GPUs of one stage share the routed experts."""
        return self.tp * self.dp if self.ep else self.tp

    def describe(self) -> str:
        parts = [f"TP={self.tp}"]
        if self.pp > 1:
            parts.append(f"PP={self.pp}")
        if self.dp > 1:
            parts.append(f"DP-attention={self.dp}")
        if self.ep:
            parts.append(f"EP={self.expert_shards}")
        return " ".join(parts)


def default_layout(gpus: int, nodes: int) -> Layout:
    """TP inside a node, PP across nodes: the layout both engines document for DeepSeek on several nodes."""
    if gpus % nodes:
        raise ConfigError(f"--gpus {gpus} is not a multiple of --nodes {nodes}; give the total GPU count")
    return Layout(tp=gpus // nodes, pp=nodes)


def check_layout(layout: Layout, spec: ModelSpec, gpus: int) -> None:
    """Fail fast on layouts an engine would reject, with the fix in the message."""
    if layout.gpus != gpus:
        raise ConfigError(
            f"layout {layout.describe()} uses TP x PP x DP = {layout.tp} x {layout.pp} x {layout.dp} = "
            f"{layout.gpus} GPUs but --gpus is {gpus}; make the product equal the GPU count"
        )
    heads = spec.num_attention_heads
    if heads % layout.tp:
        raise ConfigError(
            f"tensor-parallel size {layout.tp} does not divide {spec.name}'s {heads} attention heads; "
            f"choose a TP that divides {heads} (e.g. {', '.join(str(d) for d in _divisors(heads) if d <= 16)})"
        )
    if layout.pp > spec.num_layers:
        raise ConfigError(f"pipeline-parallel size {layout.pp} exceeds the model's {spec.num_layers} layers")
    if layout.dp > 1 and not layout.ep and spec.is_moe:
        raise ConfigError("data-parallel attention (--dp > 1) on a MoE model needs expert parallelism: add --ep")
    if layout.ep and (not spec.is_moe or spec.n_routed_experts % layout.expert_shards):
        raise ConfigError(
            f"expert parallelism over {layout.expert_shards} GPUs needs a MoE model whose routed experts divide "
            f"evenly ({spec.name} has {spec.n_routed_experts})"
        )
    if spec.moe_intermediate_size and not layout.ep and spec.moe_intermediate_size % layout.tp:
        raise ConfigError(
            f"tensor-parallel size {layout.tp} does not divide the expert width {spec.moe_intermediate_size}"
        )


def stage_layers(spec: ModelSpec, pp: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage, the remainder going to the first stages."""
    base, extra = divmod(spec.num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class Links:
    """The link each kind of communication crosses in a layout."""

    tensor: Link  # all-reduce among the TP (and EP) group
    pipeline: Link  # activations between consecutive stages


def layout_links(layout: Layout, accelerator: Accelerator, nodes: int, network: Network) -> Links:
    """A group that fits in one node talks over the node's fabric; a group spread over nodes is limited by the
    network, whose per-node bandwidth is shared by the node's GPUs."""
    gpus_per_node = max(layout.gpus // nodes, 1)
    per_gpu_network = Link(network.name, network.bandwidth_gb_s_per_node / gpus_per_node, network.collective_latency_us)
    group = layout.tp * layout.dp if layout.ep else layout.tp
    tensor = accelerator.intra_node if group <= gpus_per_node else per_gpu_network
    pipeline = accelerator.intra_node if nodes == 1 else per_gpu_network
    return Links(tensor=tensor, pipeline=pipeline)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
