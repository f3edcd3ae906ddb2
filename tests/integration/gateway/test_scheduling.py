"""The gateway processes that `deepserve gateway` starts run with the short slice asked for (one process, or each of
`--workers N`), and `--sched-slice-us 0` leaves the kernel's own."""

from __future__ import annotations

import pytest

from deepserve.gateway.config import DEFAULT_SLICE_US
from deepserve.gateway.scheduling import current_time_slice_us
from tests.helpers import Child, needs_custom_slices

from .conftest import gateway_config, start_gateway, start_upstream
from .test_workers import worker_processes

pytestmark = needs_custom_slices


def _event_loop_slices(gateway: Child) -> list[int | None]:
    """The slices of the main threads (the event loops') of GATEWAY's processes: itself, or its workers."""
    pids = [worker.pid for worker in worker_processes(gateway)] or [gateway.pid]
    return [current_time_slice_us(pid) for pid in pids]


@pytest.mark.parametrize("workers", [1, 2])
def test_every_gateway_process_runs_with_the_default_short_slice(children: list[Child], workers: int) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, workers=workers))
    children.append(gateway)
    assert _event_loop_slices(gateway) == [DEFAULT_SLICE_US] * workers
    assert gateway.stop() == 0


def test_zero_keeps_the_kernels_slice(children: list[Child]) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, sched_slice_us=0))
    children.append(gateway)
    assert _event_loop_slices(gateway) == [current_time_slice_us()]  # the test's own, inherited unchanged
    assert gateway.stop() == 0
