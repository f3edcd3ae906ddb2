"""Helpers shared by the test tiers, defined once: a clock a test moves by hand, waiting for what another task, thread
or process brings about, processes that announce themselves with a READY line, the simulator (the one fake OpenAI
server) started in-process or as its own process, and the metric names the installed vLLM exports.

Import them as `from tests.helpers import …` (pytest's importlib mode resolves `tests` from the rootdir)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve._compat import timeout
from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.gateway.scheduling import MIN_SLICE_US, request_time_slice
from deepserve.models.tiny import tiny_config
from deepserve.net import free_port
from deepserve.simulate.fixed import FAKE_MODEL, fixed_timing, simulate_command
from deepserve.simulate.server import SimulatorServer, running_simulator
from deepserve.simulate.thread import SimulatorThread

__all__ = [
    "FAKE_MODEL",
    "SAMPLE_SUFFIXES",
    "Child",
    "FakeClock",
    "in_a_thread",
    "metric_total",
    "needs_custom_slices",
    "present",
    "samples",
    "scrape",
    "simulator",
    "simulator_thread",
    "start_child",
    "start_gateway",
    "start_simulator",
    "tiny_config_dir",
    "until",
    "vllm_exported_samples",
    "wait_until",
]

T = TypeVar("T")

# How long a test waits for something that takes milliseconds when the machine is idle: a bound for a shared,
# loaded machine, never a measurement.
SETTLE_BOUND_S = 10.0


class FakeClock:
    """A clock that moves only when the test moves it (`now_s += …`, advance, or sleep): pass it where code takes a
    `Callable[[], float]` clock (and, for code that sleeps through its clock, its `sleep`)."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


def present(value: T | None, what: str = "the value") -> T:
    """VALUE, which the test expects to be there: an assertion that fails on None (naming WHAT), and the type
    without None for what the test does with it next."""
    assert value is not None, f"{what} is missing"
    return value


async def until(condition: Callable[[], bool], timeout_s: float = SETTLE_BOUND_S, interval_s: float = 0.005) -> None:
    """Wait in the event loop for CONDITION, which the network, another task or another process brings about
    (looking every INTERVAL_S); fail after TIMEOUT_S."""
    async with timeout(timeout_s):
        while not condition():
            await asyncio.sleep(interval_s)


def wait_until(condition: Callable[[], bool], timeout_s: float = SETTLE_BOUND_S, interval_s: float = 0.02) -> None:
    """`until` for synchronous tests: events that cross threads and sockets."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout_s:g} s"
        time.sleep(interval_s)


def in_a_thread(work: Callable[[], T]) -> T:
    """WORK's result, run in a thread of its own (for what is a thread's own, such as its scheduler slice)."""
    results: list[T] = []
    thread = threading.Thread(target=lambda: results.append(work()))
    thread.start()
    thread.join()
    return results[0]


def _custom_slices_work() -> bool:
    return in_a_thread(lambda: request_time_slice(MIN_SLICE_US)) is None


needs_custom_slices = pytest.mark.skipif(
    not _custom_slices_work(), reason="this kernel has no custom slices (Linux 6.12 or later on x86_64/aarch64)"
)


# ---- processes that print a READY line ----------------------------------------------------------------------------


@dataclass
class Child:
    """A process that announces its URL with a READY line on stdout (the last field of that line)."""

    process: subprocess.Popen[str]
    url: str = ""
    output: list[str] = field(default_factory=list)  # stdout and stderr, line by line, as they came
    pump: threading.Thread | None = None  # reads the process's output into `output`

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def root_url(self) -> str:
        return self.url.removesuffix("/v1")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait()

    def wait(self) -> int:
        """The exit code, once the process ended and all of its output is in `output` (killed after 90 s: a bound
        for a loaded machine, where a drain and the ledger's last writes take seconds instead of milliseconds)."""
        try:
            code = self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(timeout=5)
        if self.pump is not None:
            self.pump.join(timeout=10)
        return code


def start_child(argv: list[str], ready_prefix: str = "READY ", timeout_s: float = 30) -> Child:
    """Start ARGV and return once it printed a line starting with READY_PREFIX (its last field is the URL)."""
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, env=os.environ
    )
    child = Child(process)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            child.output.append(line.rstrip())
            if line.startswith(ready_prefix):
                child.url = line.split()[-1]
                ready.set()
        ready.set()

    child.pump = threading.Thread(target=pump, daemon=True)
    child.pump.start()
    if not ready.wait(timeout_s) or not child.url:
        child.kill()
        raise AssertionError(f"{argv} did not become ready:\n" + "\n".join(child.output[-30:]))
    return child


def start_gateway(config: GatewayConfig, timeout_s: float = 30) -> Child:
    """`deepserve gateway` in its own process, with the command line `deepserve serve` runs it with (gateway_argv);
    its url is the OpenAI base URL (…/v1)."""
    return start_child(gateway_argv(config, sys.executable), "GATEWAY READY", timeout_s)


def start_simulator(*flags: str, model: str = FAKE_MODEL) -> Child:
    """`deepserve simulate --model MODEL FLAGS` in its own process on a free port (give it --fixed-* timings or a
    model the planner knows); its url is the OpenAI base URL (…/v1)."""
    return start_child(simulate_command(free_port(), *flags, model=model))


# ---- the simulator in this process --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def simulator(
    ttft_ms: float = 0.0, itl_ms: float = 0.0, clock: Any = None, **options: Any
) -> AsyncIterator[SimulatorServer]:
    """The simulator with fixed timings serving in the test's event loop (options: fixed_timing's); CLOCK, e.g. a
    ManualClock, times its tokens instead of the loop."""
    deployment, config = fixed_timing(ttft_ms, itl_ms, **options)
    async with running_simulator(deployment, config, clock=clock) as server:
        yield server


@contextlib.contextmanager
def simulator_thread(
    ttft_ms: float = 0.0, itl_ms: float = 0.0, port: int = 0, **options: Any
) -> Iterator[SimulatorThread]:
    """The simulator with fixed timings on its own loop in a thread, for synchronous tests."""
    deployment, config = fixed_timing(ttft_ms, itl_ms, **options)
    with SimulatorThread(deployment, config, port=port) as server:
        yield server


# ---- the tiny model ----------------------------------------------------------------------------------------------


def tiny_config_dir(directory: Path) -> Path:
    """DIRECTORY holding the tiny model's config.json alone: what the launcher and the planner read (no weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_config()))
    return directory


# ---- what the installed vLLM exports ------------------------------------------------------------------------------

SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
_VLLM_DEFINITION = re.compile(r'self\._(counter|gauge|histogram)_cls\(\s*name="(vllm:[a-z0-9_]+)"')


def samples(kind: str, name: str) -> set[str]:
    """The sample names a Prometheus metric of KIND called NAME is exposed under."""
    return {name + suffix for suffix in SAMPLE_SUFFIXES[kind]}


def scrape(url: str, timeout_s: float = 30) -> list[tuple[str, dict[str, str], float]]:
    """The samples (name, labels, value) that the Prometheus endpoint at URL exposes now, read with
    prometheus_client's own parser (not deepserve's, which some tests check)."""
    text = httpx.get(url, timeout=timeout_s).raise_for_status().text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def metric_total(scraped: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of the samples called NAME whose labels include LABELS (0 when there is none)."""
    return sum(value for sample, tags, value in scraped if sample == name and labels.items() <= tags.items())


def vllm_exported_samples() -> set[str]:
    """Every sample name the installed vLLM's V1 engine defines (read from its loggers.py); skips without vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed here: its metric names cannot be read")
    source = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    names: set[str] = set()
    for kind, name in _VLLM_DEFINITION.findall(source.read_text()):
        names |= samples(kind, name)
    assert len(names) > 20, f"found too few vLLM metrics in {source}: the pattern no longer matches"
    return names


BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark_script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/NAME.py as a module (the scripts are not a package), registered in sys.modules for this test only:
    dataclasses look their module up there."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
