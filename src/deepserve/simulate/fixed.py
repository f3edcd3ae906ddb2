"""The simulator with fixed timings in one call: the OpenAI server that tests and benchmarks start where they need
an engine with known behaviour (the gateway's upstreams, the benchmark's server, the supervisor's engine process).
No planner is involved: any model name is served, and every option of SimulateConfig (faults, chunking, servers
that differ from vLLM) and of the engine section (max_model_len, max_num_seqs, …) is at hand.

    deployment, config = fixed_timing(ttft_ms=20, itl_ms=5, record_bodies=True)
    async with running_simulator(deployment, config) as server: ...      # in this event loop
    with SimulatorThread(deployment, config) as server: ...              # on its own loop, for sync code
    subprocess.Popen(simulate_command(port, "--fixed-itl-ms", "5"))      # its own process (READY line on stdout)
"""

from __future__ import annotations

import sys
from typing import Any

from deepserve.engines.config import EngineConfig
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.setup import SimulatedDeployment, resolve

FAKE_MODEL = "fake-model"  # the name tests and benchmarks serve when the model does not matter


def fixed_timing(
    ttft_ms: float = 0.0,
    itl_ms: float = 0.0,
    *,
    step_ms: float | None = None,
    model: str = FAKE_MODEL,
    engine: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[SimulatedDeployment, SimulateConfig]:
    """A simulated deployment of MODEL where each stream's first token comes TTFT_MS after its request and the
    next ones every ITL_MS (0: as fast as the client reads); or, with STEP_MS, vLLM's scheduler (max_num_seqs,
    token budget, KV blocks) with every engine step taking STEP_MS, so that running streams get their tokens
    together. ENGINE: fields of the engine section; OPTIONS: fields of SimulateConfig."""
    timing: dict[str, Any] = {"fixed_step_ms": step_ms} if step_ms is not None else {}
    if step_ms is None:
        timing = {"fixed_ttft_ms": ttft_ms, "fixed_itl_ms": itl_ms}
    config = SimulateConfig.model_validate({**timing, **options})
    return resolve(EngineConfig.model_validate({"model": model, **(engine or {})}), config), config


def simulate_command(port: int, *flags: str, model: str = FAKE_MODEL, host: str = "127.0.0.1") -> list[str]:
    """The command line of `deepserve simulate --model MODEL` on HOST:PORT with FLAGS (give it --fixed-* timings,
    or a model the planner knows), under this Python (`python -m deepserve.simulate`: that command alone, which
    starts sooner). It prints `READY <base URL> <model> <base URL>` on stdout once it listens."""
    return [sys.executable, "-m", "deepserve.simulate", "--model", model, "--host", host, "--port", str(port), *flags]
