"""`deepserve simulate` as a process: its READY line, an engine that fails to start, one that ignores SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from deepserve.net import free_port

pytestmark = pytest.mark.timeout(60)


def simulate(*args: str) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    command = [sys.executable, "-m", "deepserve.cli.main", "simulate", "--port", str(port), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, port


def test_ready_line_then_a_clean_stop_on_sigterm() -> None:
    process, port = simulate("--model", "fake", "--fixed-itl-ms", "1", "--startup-delay-s", "0.2")
    try:
        assert process.stdout is not None
        line = process.stdout.readline().split()
        assert line == ["READY", f"http://127.0.0.1:{port}/v1", "fake", f"http://127.0.0.1:{port}/v1"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
        assert process.stderr is not None
        log = process.stderr.read()
        assert "Loading weights" in log and "Application startup complete" in log
    finally:
        if process.poll() is None:
            process.kill()


def test_a_failed_start_exits_1_with_the_message() -> None:
    process, _ = simulate("--model", "fake", "--fixed-itl-ms", "1", "--fail-startup", "CUDA out of memory")
    _, err = process.communicate(timeout=30)
    assert process.returncode == 1 and "CUDA out of memory" in err


def test_max_seconds_ends_a_simulator_nobody_stops() -> None:
    process, _ = simulate("--model", "fake", "--fixed-itl-ms", "1", "--max-seconds", "0.5")
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert out.startswith("READY")


def test_an_engine_that_ignores_sigterm_needs_a_kill() -> None:
    process, _ = simulate("--model", "fake", "--fixed-itl-ms", "1", "--ignore-sigterm", "--max-seconds", "30")
    try:
        assert process.stdout is not None and process.stdout.readline().startswith("READY")
        process.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(1.0)
    finally:
        process.kill()
        process.wait(10)
