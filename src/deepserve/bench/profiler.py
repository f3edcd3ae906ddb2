"""vLLM's --profile: POST the server's /start_profile after the warm-ups (as vLLM starts it) and /stop_profile after
the run, also when the run fails."""

from __future__ import annotations

import httpx

from deepserve.bench.config import BenchConfig
from deepserve.bench.server_check import SERVER_CHECK_TIMEOUT_S, BenchError


class Profiler:
    """vLLM's --profile: the server's profiler runs from after the warm-ups (as vLLM starts it) to the run's end."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.started = False

    async def start(self) -> None:
        await _profile_call(self.config, "/start_profile")
        self.started = True

    async def stop(self) -> str | None:
        """What happened to the profile, for the results (None: never started)."""
        if not self.started:
            return None
        try:
            await _profile_call(self.config, "/stop_profile")
        except BenchError as exc:  # the run's data stands; say why the profile may be incomplete
            return f"started, but stopping failed: {exc}"
        return "started after the warm-ups, stopped after the run"


async def _profile_call(config: BenchConfig, path: str) -> None:
    """vLLM's profiler endpoints (the server needs a profiler config, else they are 404)."""
    target = config.target
    url = target.root_url + path
    try:
        async with httpx.AsyncClient(timeout=SERVER_CHECK_TIMEOUT_S * 6, verify=not target.insecure) as client:
            response = await client.post(url, headers=target.request_headers())
    except httpx.HTTPError as exc:
        raise BenchError(f"--profile: POST {url} failed ({exc.__class__.__name__}: {exc})") from exc
    if response.status_code != 200:
        raise BenchError(
            f"--profile: POST {url} answered HTTP {response.status_code}; start vLLM with a profiler config "
            "(--profiler-config) and send the benchmark to the engine itself, not through a gateway"
        )
