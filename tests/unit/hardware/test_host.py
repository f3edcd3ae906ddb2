"""The host measurement is made once per machine and reused; a different machine's file is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.hardware import host


@pytest.fixture
def quick_measure(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def fake() -> host.HostMeasurement:
        calls.append(1)
        return host.HostMeasurement("h", "cpu", 2, 40.0, 100.0, None, "2026-11-22T00:00:00Z")

    monkeypatch.setattr(host, "measure_host", fake)
    return calls


def test_measured_once_then_reused(isolated_home: Path, quick_measure: list[int]) -> None:
    first = host.measured_host()
    second = host.measured_host()
    assert first == second and len(quick_measure) == 1
    assert json.loads(host.cache_path().read_text())["key"] == host.host_key()


def test_another_hosts_file_is_measured_again(isolated_home: Path, quick_measure: list[int]) -> None:
    host.measured_host()
    data = json.loads(host.cache_path().read_text())
    host.cache_path().write_text(json.dumps({**data, "key": "elsewhere|cpu|64"}))
    host.measured_host()
    assert len(quick_measure) == 2


def test_real_measurement_is_positive() -> None:
    bandwidth = host.copy_bandwidth_gb_s(nbytes=8 * 1024**2, repeats=2)
    gflops = host.numpy_matmul_gflops(size=128, repeats=2)
    assert bandwidth > 0.1 and gflops > 0.01
