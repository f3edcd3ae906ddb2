"""Parallel layouts: how a model's weights and requests are spread over GPUs, and which links each layout uses.

GPUs = tp x pp x dp. Tensor parallelism (tp) splits attention heads and every expert's matrices; pipeline
parallelism (pp) splits the layers into stages; data-parallel attention (dp > 1) replicates attention and gives
each replica its own requests. The routed experts are spread over all tp x dp GPUs of a stage: whole experts with
expert parallelism (ep: vLLM's --enable-expert-parallel, SGLang's --ep-size / DeepEP), or a slice of every expert
without it (vLLM's data parallelism shards a MoE's experts over the DP x TP group; SGLang's --enable-dp-attention
feeds TP-split experts through an all-gather).
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
        """How many GPUs of one stage share the routed experts (all of the stage's GPUs)."""
        return self.tp * self.dp

    @property
    def kind(self) -> str:
        """The layout's family, as validation reports it: tp, tp+pp, tp+ep, dp+ep, dp+tp-experts."""
        if self.dp > 1:
            return "dp-attention+ep" if self.ep else "dp-attention+tp-experts"
        family = "tp+ep" if self.ep and self.tp > 1 else "tp"
        return family + ("+pp" if self.pp > 1 else "")

    def describe(self) -> str:
        parts = [f"TP={self.tp}"]
        if self.pp > 1:
            parts.append(f"PP={self.pp}")
        if self.dp > 1:
            parts.append(f"DP-attention={self.dp}")
        if self.ep:
            parts.append(f"EP={self.expert_shards}")
        elif self.dp > 1:
            parts.append(f"experts split {self.expert_shards} ways")
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
    if layout.ep and (not spec.is_moe or spec.n_routed_experts < layout.expert_shards):
        raise ConfigError(
            f"expert parallelism over {layout.expert_shards} GPUs needs a MoE model with at least one routed expert "
            f"per GPU ({spec.name} has {spec.n_routed_experts}); where they do not divide evenly the engines add "
            "redundant experts (EPLB)"
        )
    if spec.moe_intermediate_size and not layout.ep and spec.moe_intermediate_size % layout.expert_shards:
        raise ConfigError(
            f"splitting every expert {layout.expert_shards} ways does not divide the expert width "
            f"{spec.moe_intermediate_size}; add --ep (whole experts per GPU) or use fewer GPUs per stage"
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

    tensor: Link  # all-reduce among the TP group
    pipeline: Link  # activations between consecutive stages
    experts_link: Link | None = None  # the routed experts' exchange among a stage's TP x DP GPUs (None: as tensor)
    tensor_nodes: int = 1  # nodes the TP group spans (a collective's latency grows with the hops between them)
    node_link: Link | None = None  # the fabric inside a node, for a group spread over nodes (None: as tensor)
    expert_nodes: int = 1  # nodes the experts of a stage are spread over

    @property
    def experts(self) -> Link:
        return self.experts_link or self.tensor


def layout_links(layout: Layout, accelerator: Accelerator, nodes: int, network: Network) -> Links:
    """A group that fits in one node (or one NVLink domain) talks over its fabric; a group spread over nodes is
    limited by the network, whose per-node bandwidth is shared by the node's GPUs."""
    gpus_per_node = max(layout.gpus // nodes, 1)
    per_gpu_network = Link(network.name, network.bandwidth_gb_s_per_node / gpus_per_node, network.collective_latency_us)
    tensor = accelerator.intra_node if layout.tp <= gpus_per_node else per_gpu_network
    experts = accelerator.intra_node if layout.expert_shards <= gpus_per_node else per_gpu_network
    pipeline = accelerator.intra_node if nodes == 1 else per_gpu_network
    tensor_nodes = max(-(-layout.tp // gpus_per_node), 1)
    expert_nodes = max(-(-layout.expert_shards // gpus_per_node), 1)
    return Links(tensor, pipeline, experts, tensor_nodes, accelerator.intra_node, expert_nodes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
