"""The supervisor against an engine process on loopback (`deepserve simulate` with an engine core child, as vLLM's
API server has): phases, readiness, death with a hint, and a stop that leaves no process behind (even one that
ignores SIGTERM)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from deepserve.engines.base import LaunchSpec
from deepserve.engines.registry import get_engine
from deepserve.engines.supervisor import ProcessDied, SupervisedProcess
from deepserve.net import free_port
from deepserve.simulate.fixed import simulate_command


def fake_engine(tmp_path: Path, *args: str) -> SupervisedProcess:
    """The simulator as the engine: half a second of simulated weight loading, then serving; ARGS add to that."""
    port = free_port()
    flags = ("--fixed-itl-ms", "1", "--engine-core-process", "--startup-delay-s", "0.5", *args)
    spec = LaunchSpec(argv=simulate_command(port, *flags), base_url=f"http://127.0.0.1:{port}/v1")
    return SupervisedProcess("engine", spec, get_engine("vllm").phase_of, tmp_path / "logs" / "engine.log")


def child_pid(process: SupervisedProcess) -> int:
    """The engine's own child (the simulator's engine core process)."""
    assert process.pid is not None
    (core,) = psutil.Process(process.pid).children()
    return core.pid


def test_ready_after_phases_then_stop_kills_the_whole_tree(tmp_path: Path) -> None:
    phases: list[str] = []
    # Two seconds of weight loading: wait_ready samples the phase every half second (further apart on a
    # loaded machine), so that several samples fall within it; the later --startup-delay-s wins.
    with fake_engine(tmp_path, "--startup-delay-s", "2") as process:
        ready_s = process.wait_ready(30, lambda phase, elapsed: phases.append(phase))
        assert 1.9 < ready_s < 30
        grandchild = child_pid(process)
        assert psutil.pid_exists(grandchild)
    assert "loading weights" in phases
    assert not psutil.pid_exists(grandchild)
    assert "Application startup complete" in (tmp_path / "logs" / "engine.log").read_text()


def test_engine_has_a_process_group_of_its_own_in_our_session(tmp_path: Path) -> None:
    """Its own group: a terminal's Ctrl-C (sent to the foreground group) is ours to handle, and a stop signals the
    group whole. Our session: a new session is a new scheduling group under the kernel's autogroup, in which the
    engine's busy workers starved a benchmark client beside it for a second at a time (Python 3.11 and later; 3.10's
    Popen can only make a new session)."""
    with fake_engine(tmp_path) as process:
        process.wait_ready(30)
        assert process.pid is not None
        assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
        if sys.version_info >= (3, 11):
            assert os.getsid(process.pid) == os.getsid(0)


def test_engine_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    process = fake_engine(tmp_path, "--ignore-sigterm")
    process.start()
    process.wait_ready(30)
    grandchild = child_pid(process)
    process.stop(grace_s=1)
    assert not psutil.pid_exists(grandchild)
    assert process.pid is not None and not psutil.pid_exists(process.pid)


def test_engine_death_carries_log_tail_and_a_hint(tmp_path: Path) -> None:
    died_engine = fake_engine(tmp_path, "--fail-startup", "torch.OutOfMemoryError: CUDA out of memory")
    with died_engine as process, pytest.raises(ProcessDied) as died:
        process.wait_ready(30)
    message = str(died.value)
    assert died.value.returncode == 1
    assert message.startswith("the engine exited with code 1")
    assert "CUDA out of memory" in message
    assert "lower --max-model-len" in message
    assert str(tmp_path / "logs" / "engine.log") in message


def test_not_ready_in_time_is_an_error(tmp_path: Path) -> None:
    from deepserve.errors import EngineError

    slow = fake_engine(tmp_path, "--startup-delay-s", "30")  # the later flag wins
    with slow as process, pytest.raises(EngineError, match="not ready after"):
        process.wait_ready(1)
