"""Before any work: the server is reachable, accepts our key and serves the model (and the LoRA adapters)."""

from __future__ import annotations

import time

import httpx

from deepserve.bench.config import BenchConfig, TargetConfig
from deepserve.errors import DeepserveError, unknown_name

SERVER_CHECK_TIMEOUT_S = 10.0
READY_CHECK_INTERVAL_S = 1.0


class BenchError(DeepserveError):
    """The benchmark cannot start: the server is unreachable, rejects us, or does not serve the model."""


def check_server(config: BenchConfig) -> str:
    """Check the server before any work: reachable, accepts our key, serves the model (and the LoRA adapters).
    Returns --model, else the server's first model."""
    target = config.target
    response = _list_models(target)
    if response.status_code in (401, 403):
        raise BenchError(
            f"the server at {target.root_url} rejected the request with HTTP {response.status_code}; "
            "pass a valid --api-key (or set OPENAI_API_KEY)"
        )
    served = _served_models(response)
    if target.model is None and not target.served_model_name and not served:
        raise BenchError(f"{response.url} lists no models (HTTP {response.status_code}); pass --model")
    model = target.model or target.served_model_name or served[0]
    for name in (target.request_model(model), *target.lora_modules):
        if served and name not in served:
            raise BenchError(unknown_name("model", name, served) + " (as listed by the server's /v1/models)")
    return model


def _list_models(target: TargetConfig) -> httpx.Response:
    """GET /v1/models. With --ready-check-timeout-sec, asked again every second for that long while the server
    cannot be reached, fails (5xx) or lists no model (an engine still loading, a gateway without a healthy
    upstream yet)."""
    url = target.root_url + "/v1/models"
    deadline_s = time.monotonic() + target.ready_check_timeout_sec
    while True:
        try:
            response = httpx.get(
                url, headers=target.request_headers(), timeout=SERVER_CHECK_TIMEOUT_S, verify=not target.insecure
            )
        except httpx.HTTPError as exc:
            if time.monotonic() < deadline_s:
                time.sleep(READY_CHECK_INTERVAL_S)
                continue
            waited = f"; waited {target.ready_check_timeout_sec} s" if target.ready_check_timeout_sec else ""
            raise BenchError(
                f"cannot reach the server at {target.root_url} ({exc.__class__.__name__}: {exc}); "
                f"is it running? Check --base-url (or --host/--port){waited}"
            ) from exc
        ready = response.status_code < 500 and (response.status_code != 200 or bool(_served_models(response)))
        if ready or time.monotonic() >= deadline_s:
            return response
        time.sleep(READY_CHECK_INTERVAL_S)


def _served_models(response: httpx.Response) -> list[str]:
    if response.status_code != 200:
        return []
    try:
        data = response.json().get("data", [])
        return [str(item["id"]) for item in data if isinstance(item, dict) and "id" in item]
    except (ValueError, AttributeError):
        return []
