"""This machine's network interfaces as multi-node engines see them: which interface holds an address (NCCL's and
Gloo's socket-interface variables name it), and which local address the kernel would use to reach a peer."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import psutil

# The variables that pin NCCL's and Gloo's (torch.distributed's CPU backend) sockets to one interface; without them
# each picks an interface itself, and on a machine with several (docker0, ib0, eth0) it may pick one the peers
# cannot reach.
SOCKET_IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Any routable address: a UDP connect only consults the routing table, nothing is sent.
_PUBLIC_PROBE_ADDRESS = "198.51.100.1"  # TEST-NET-2 (RFC 5737): off every local network, reached by the default route


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]
    is_up: bool

    @property
    def is_loopback(self) -> bool:
        return self.name == "lo" or any(_is_loopback(address) for address in self.addresses)


def local_interfaces() -> tuple[Interface, ...]:
    stats = psutil.net_if_stats()
    interfaces = []
    for name, entries in sorted(psutil.net_if_addrs().items()):
        addresses = tuple(
            entry.address.split("%")[0] for entry in entries if entry.family in (socket.AF_INET, socket.AF_INET6)
        )
        interfaces.append(Interface(name, addresses, name in stats and stats[name].isup))
    return tuple(interfaces)


def interface_holding(address: str, interfaces: tuple[Interface, ...]) -> Interface | None:
    """The interface that owns ADDRESS (an IP of this machine), or None."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for interface in interfaces:
        for held in interface.addresses:
            try:
                if ipaddress.ip_address(held) == wanted:
                    return interface
            except ValueError:
                continue
    return None


def route_source(host: str | None = None) -> str | None:
    """The local address the kernel would send from to reach HOST (default: the default route's), or None when
    there is no route or HOST does not resolve."""
    target = host or _PUBLIC_PROBE_ADDRESS
    try:
        family, _, _, _, address = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def resolve_host(host: str) -> str | None:
    """HOST's first address, or None when it does not resolve."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return None


def ifname_selects(spec: str, name: str) -> bool:
    """Whether NCCL's interface list SPEC (comma-separated prefixes; a leading `^` excludes them, a leading `=`
    makes them exact names) selects the interface NAME."""
    exclude = spec.startswith("^")
    spec = spec.removeprefix("^")
    exact = spec.startswith("=")
    spec = spec.removeprefix("=")
    listed = [part.strip() for part in spec.split(",") if part.strip()]
    hit = any(name == part if exact else name.startswith(part) for part in listed)
    return not hit if exclude else hit


def routable_interfaces(interfaces: tuple[Interface, ...]) -> list[Interface]:
    """Interfaces that are up, not loopback, and hold an address: the ones NCCL and Gloo might choose."""
    return [i for i in interfaces if i.is_up and not i.is_loopback and i.addresses]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
