"""Small network helpers every part shares: a free loopback port, a check that a port can be bound."""

from __future__ import annotations

import socket

from deepserve.errors import ConfigError


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has just found free on HOST (another process may still take it before we bind it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def ensure_port_free(host: str, port: int) -> None:
    """Raise ConfigError, with how to find the holder, when PORT on HOST cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"port {port} on {host} is already in use ({exc.strerror}); stop what listens there "
                f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another with --port"
            ) from None
