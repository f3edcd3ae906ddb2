"""free_port chooses between Ray's worker ports and the kernel's ephemeral range, where no process's next connection
can take the port before the server it was chosen for binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deepserve import net


def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    low, _high = net._ephemeral_range()
    for _ in range(20):
        port = net.free_port()
        assert net.LOWEST_CHOSEN_PORT <= port < low
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        choices = iter([[taken, taken + 1]])
        monkeypatch.setattr(net.random, "sample", lambda population, k: next(choices))
        monkeypatch.setattr(net, "_ephemeral_range", lambda: (taken + 1001 + net.LOWEST_CHOSEN_PORT, 65535))
        assert net.free_port() == taken + 1


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("10500\t60999\n")
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", narrow)
    assert net._ephemeral_range() == (10500, 60999)
    assert net.free_port() >= 10500  # bind(0): from the ephemeral range itself
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    assert net._ephemeral_range() == net.DEFAULT_EPHEMERAL_RANGE
