"""The network between nodes, as one profile that the planner and every renderer share: the link figures the planner
prices collectives with (bandwidth per node, latency of a small collective), and what a pod, container or batch job
needs to use that network (RDMA devices and the Kubernetes resource that grants them, IPC_LOCK and an unlimited
memlock for registered memory, and the NCCL, Gloo and NVSHMEM settings that pick the HCAs and interfaces).

Three profiles: `ib` (InfiniBand), `roce` (RDMA over Converged Ethernet, v2) and `tcp` (sockets only). The planner's
earlier names stay as aliases: infiniband-ndr = ib, roce-400g = roce, ethernet-100g = tcp.

Settings sources: NCCL's environment variables (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html:
NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_IB_DISABLE, NCCL_SOCKET_IFNAME); NVSHMEM's (NVSHMEM_HCA_LIST,
NVSHMEM_IB_GID_INDEX, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME, used by DeepEP's inter-node all-to-all); the NVIDIA Network
Operator's shared RDMA device plugin (resource `rdma/rdma_shared_device_a`, pods add IPC_LOCK; docs.nvidia.com
network-operator and Red Hat OpenShift 4.18 "Creating workload pods that use RDMA").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import Field, field_validator

from deepserve.config import Section, parse_key_values
from deepserve.errors import ConfigError, unknown_name

ProfileName = Literal["ib", "ib-xdr", "roce", "tcp"]
DEFAULT_RDMA_RESOURCE = "rdma/rdma_shared_device_a"  # the Network Operator's shared RDMA device plugin's default
ROCE_V2_GID_INDEX = 3  # the GID of RoCE v2 over IPv4 on a default ConnectX port (NCCL's docs' RoCE example)
POD_INTERFACE = "eth0"  # a pod's own network (its first interface) carries bootstrap and Gloo traffic


@dataclass(frozen=True)
class NetworkProfile:
    """How nodes talk to each other: the planner's link figures and what a pod needs to use the link."""

    name: str
    bandwidth_gb_s_per_node: float  # all NICs of a node together, per direction
    collective_latency_us: float
    sources: tuple[str, ...] = field(default_factory=tuple)
    rdma: bool = False  # the collectives use verbs (HCAs), not sockets
    link_layer: str | None = None  # what /sys/class/infiniband/*/ports/*/link_layer says: InfiniBand or Ethernet
    rdma_resource: str | None = None  # the Kubernetes extended resource that grants the HCAs to a pod
    ib_hca: str | None = None  # NCCL_IB_HCA: which HCAs (None: NCCL takes every HCA it finds)
    socket_ifname: str | None = None  # NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME: bootstrap, Gloo and TCP traffic
    gid_index: int | None = None  # NCCL_IB_GID_INDEX: RoCE picks the v2 GID
    pod_networks: str | None = None  # Multus attachments for the RDMA NICs (k8s.v1.cni.cncf.io/networks)
    extra_env: tuple[tuple[str, str], ...] = ()  # passed through as given (--network-env)
    extra_resources: tuple[tuple[str, str], ...] = ()  # passed through as given (--network-resource)

    def env(self, default_ifname: str | None = None) -> dict[str, str]:
        """The variables every engine process of a multi-node deployment gets (extra ones win). DEFAULT_IFNAME is
        the socket interface where none was named: a pod's eth0; on hosts, where names differ, none (NCCL picks one,
        or compose's per-node network.env names it)."""
        values: dict[str, str] = {}
        ifname = self.socket_ifname or default_ifname
        if ifname:
            values.update(
                NCCL_SOCKET_IFNAME=ifname, GLOO_SOCKET_IFNAME=ifname, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=ifname
            )
        # Sockets only: never try an HCA the other nodes cannot reach.
        values["NCCL_IB_DISABLE"] = "0" if self.rdma else "1"
        if self.rdma and self.ib_hca:
            values.update(NCCL_IB_HCA=self.ib_hca, NVSHMEM_HCA_LIST=self.ib_hca)
        if self.rdma and self.gid_index is not None:
            values.update(NCCL_IB_GID_INDEX=str(self.gid_index), NVSHMEM_IB_GID_INDEX=str(self.gid_index))
        return {**values, **dict(self.extra_env)}

    def resources(self) -> dict[str, str]:
        """Extended resources a pod asks for (requests = limits): the HCAs, then what was passed through."""
        granted = {self.rdma_resource: "1"} if self.rdma and self.rdma_resource else {}
        return {**granted, **dict(self.extra_resources)}

    def describe(self) -> str:
        return f"{self.name}: {self.sources[0] if self.sources else ''}".rstrip(": ")


NETWORKS: tuple[NetworkProfile, ...] = (
    NetworkProfile(
        "ib",
        8 * 50.0,
        25.0,
        ("NVIDIA ConnectX-7 datasheet: 400 Gb/s NDR per adapter, one adapter per GPU",),
        rdma=True,
        link_layer="InfiniBand",
        rdma_resource=DEFAULT_RDMA_RESOURCE,
    ),
    NetworkProfile(
        "ib-xdr",
        8 * 100.0,
        25.0,
        (
            "NVIDIA ConnectX-8 SuperNIC: 800 Gb/s per GPU in DGX B300 and GB300 NVL72 (https://www.nvidia.com/en-us/data-center/dgx-b300/)",
        ),
        rdma=True,
        link_layer="InfiniBand",
        rdma_resource=DEFAULT_RDMA_RESOURCE,
    ),
    NetworkProfile(
        "roce",
        8 * 50.0,
        35.0,
        ("400 GbE RoCE, one NIC per GPU (as in HGX reference designs)",),
        rdma=True,
        link_layer="Ethernet",
        rdma_resource=DEFAULT_RDMA_RESOURCE,
        gid_index=ROCE_V2_GID_INDEX,
    ),
    NetworkProfile(
        "tcp",
        12.5,
        60.0,
        ("one 100 Gb/s Ethernet port per node, TCP sockets (seed 001's setup)",),
    ),
)

NETWORK_ALIASES = {
    "infiniband-ndr": "ib",
    "infiniband": "ib",
    "infiniband-xdr": "ib-xdr",
    "cx8": "ib-xdr",
    "roce-400g": "roce",
    "ethernet-100g": "tcp",
    "ethernet": "tcp",
    "sockets": "tcp",
}


def get_network(name: str) -> NetworkProfile:
    """The profile named NAME (ib, roce, tcp) or by an alias (the planner's earlier names)."""
    wanted = name.strip().lower()
    wanted = NETWORK_ALIASES.get(wanted, wanted)
    for profile in NETWORKS:
        if profile.name == wanted:
            return profile
    raise ConfigError(unknown_name("network", name, [p.name for p in NETWORKS] + list(NETWORK_ALIASES)))


class NetworkConfig(Section):
    """The network between the nodes (section `network`): a profile, what to change in it, what to pass through."""

    network: str = Field(
        "ib",
        description="between nodes: ib (InfiniBand), roce (RDMA over Ethernet) or tcp (sockets); also "
        + ", ".join(NETWORK_ALIASES),
    )
    ib_hca: str | None = Field(
        None, description="NCCL_IB_HCA: the HCAs to use, e.g. mlx5 or =mlx5_0,mlx5_1 (default: every HCA found)"
    )
    socket_ifname: str | None = Field(
        None,
        description=f"NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME (default: {POD_INTERFACE} in pods; on hosts, what "
        "network.env names or NCCL finds)",
    )
    ib_gid_index: int | None = Field(None, ge=0, description="NCCL_IB_GID_INDEX (default: 3 for roce, unset for ib)")
    rdma_resource: str | None = Field(
        None, description=f"Kubernetes resource granting the HCAs (default for ib/roce: {DEFAULT_RDMA_RESOURCE})"
    )
    pod_networks: str | None = Field(
        None, description="Multus networks for the RDMA NICs (the pods' k8s.v1.cni.cncf.io/networks annotation)"
    )
    network_env: list[str] = Field(
        default_factory=list, description="KEY=VALUE added to every engine's environment (e.g. NCCL_IB_TC=106)"
    )
    network_resource: list[str] = Field(
        default_factory=list, description="NAME=COUNT added to every engine pod's resources (e.g. nvidia.com/hostdev=8)"
    )

    @field_validator("network")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        try:
            return get_network(value).name
        except ConfigError as exc:  # a ValueError, so that pydantic reports it with the field
            raise ValueError(str(exc)) from None

    @field_validator("network_resource")
    @classmethod
    def _counts(cls, value: list[str]) -> list[str]:
        for pair in value:
            name, _, count = pair.partition("=")
            if not name or not count.isdigit() or int(count) < 1:
                raise ValueError(f"network resource {pair!r} must look like NAME=COUNT, e.g. nvidia.com/hostdev=8")
        return value

    def profile(self) -> NetworkProfile:
        """The named profile with this section's changes."""
        base = get_network(self.network)
        rdma_only = {"--ib-hca": self.ib_hca, "--ib-gid-index": self.ib_gid_index}
        rdma_only["--rdma-resource"] = self.rdma_resource
        used = [flag for flag, value in rdma_only.items() if value is not None]
        if used and not base.rdma:
            raise ConfigError(f"{', '.join(used)} configure RDMA, which --network tcp does not use; drop them")
        env = parse_key_values("--network-env", self.network_env, "NCCL_IB_TC=106")
        resources = parse_key_values("--network-resource", self.network_resource, "nvidia.com/hostdev=8")
        return replace(
            base,
            ib_hca=self.ib_hca or base.ib_hca,
            socket_ifname=self.socket_ifname,
            gid_index=base.gid_index if self.ib_gid_index is None else self.ib_gid_index,
            rdma_resource=self.rdma_resource or base.rdma_resource,
            pod_networks=self.pod_networks,
            extra_env=tuple(env.items()),
            extra_resources=tuple(resources.items()),
        )
