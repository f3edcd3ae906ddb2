"""The gateway's short scheduler slice: asked for per thread, read back, refused where it cannot be had."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deepserve.gateway import scheduling, server
from deepserve.gateway.config import DEFAULT_SLICE_US, GatewayConfig
from deepserve.gateway.scheduling import MIN_SLICE_US, current_time_slice_us, request_time_slice
from tests.helpers import in_a_thread, needs_custom_slices


@needs_custom_slices
def test_the_slice_asked_for_is_the_calling_threads_and_reads_back() -> None:
    before = current_time_slice_us()
    assert in_a_thread(lambda: (request_time_slice(250), current_time_slice_us())) == (None, 250)
    assert current_time_slice_us() == before  # the test's own thread kept its slice


@needs_custom_slices
def test_threads_started_after_the_request_inherit_the_slice() -> None:
    def ask_then_start_one() -> int | None:
        request_time_slice(400)
        return in_a_thread(current_time_slice_us)

    assert in_a_thread(ask_then_start_one) == 400


def test_zero_leaves_the_kernels_slice_alone() -> None:
    assert in_a_thread(lambda: (request_time_slice(0), current_time_slice_us())) == (None, current_time_slice_us())


def test_another_platform_is_named_in_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduling.platform, "machine", lambda: "riscv64")
    reason = request_time_slice(MIN_SLICE_US)
    assert reason is not None and "riscv64" in reason
    assert current_time_slice_us() is None


def test_a_slice_below_what_linux_grants_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"below the shortest slice Linux grants \(100 µs\); give 100 or more"):
        GatewayConfig(sched_slice_us=50)
    with pytest.raises(ValidationError, match="less than or equal to 100000"):
        GatewayConfig(sched_slice_us=200_000)
    assert GatewayConfig(sched_slice_us=0).sched_slice_us == 0
    assert GatewayConfig().sched_slice_us == DEFAULT_SLICE_US == MIN_SLICE_US


def test_a_slice_that_cannot_be_had_is_said_only_when_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(server, "request_time_slice", lambda slice_us: "this kernel ignores custom slices")
    server._ask_for_time_slice(GatewayConfig())
    assert capsys.readouterr().err == ""  # the default: nothing to say on an older kernel
    server._ask_for_time_slice(GatewayConfig(sched_slice_us=300))
    assert capsys.readouterr().err == (
        "deepserve gateway: --sched-slice-us 300 not applied: this kernel ignores custom slices; "
        "the kernel's default slice stays\n"
    )
