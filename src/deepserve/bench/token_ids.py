"""Whether to ask the server for each chunk's token ids (vLLM's `return_token_ids`), decided once before the run.

With the ids, every chunk's tokens are known exactly, however many it carries (speculative decoding, MTP,
--stream-interval), and ITL needs no estimate. vLLM 0.32 accepts the field on completions and chat; other servers
may reject it (HTTP 400) or ignore it, so `auto` sends one small probe request first (one output token) and adds
the field to the run's requests only if the probe's chunks listed their ids. A failed probe never fails the run: the
requests are then sent without the field, and the records say their counts are estimated. The probe runs before
the server-metrics scrapes start, so it is in no server-side figure either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from deepserve.bench.client import http_error_message
from deepserve.bench.config import TargetConfig

FIELD = "return_token_ids"
PROBE_TIMEOUT_S = 60.0  # a first generation on a cold engine can take a while
PROBE_PROMPT = "Hello"


@dataclass(frozen=True)
class TokenIdsDecision:
    """Whether the run's requests carry return_token_ids, and why (kept in the results)."""

    send: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"sent": self.send, "reason": self.reason}


def decide_token_ids(target: TargetConfig, model: str, request_id: str | None = None) -> TokenIdsDecision:
    """TARGET's --return-token-ids (auto: probe the server with one request, as REQUEST_ID); --extra-body wins."""
    extras = target.body_extras()
    if FIELD in extras:
        return TokenIdsDecision(bool(extras[FIELD]), f"{FIELD} set by --extra-body")
    if target.return_token_ids == "off":
        return TokenIdsDecision(False, "not asked (--return-token-ids off)")
    if target.return_token_ids == "on":
        return TokenIdsDecision(True, "asked without a probe (--return-token-ids on)")
    return probe_token_ids(target, model, request_id)


def probe_payload(target: TargetConfig, model: str) -> dict[str, Any]:
    """One output token, streamed, with the run's own body extras and the field."""
    payload: dict[str, Any] = {"model": target.request_model(model), "max_tokens": 1, "stream": True}
    if target.chat:
        payload["messages"] = [{"role": "user", "content": PROBE_PROMPT}]
    else:
        payload["prompt"] = PROBE_PROMPT
    payload.update(target.body_extras())
    payload[FIELD] = True
    return payload


def probe_token_ids(target: TargetConfig, model: str, request_id: str | None = None) -> TokenIdsDecision:
    """Send the probe; the field is used only if the answer's chunks list token ids."""
    headers = target.request_headers()
    if request_id:
        headers["x-request-id"] = request_id
    try:
        with httpx.Client(timeout=PROBE_TIMEOUT_S, verify=not target.insecure) as client:
            response = client.post(target.url, json=probe_payload(target, model), headers=headers)
    except httpx.HTTPError as exc:
        return TokenIdsDecision(False, f"not asked: the probe request failed ({exc.__class__.__name__}: {exc})")
    if response.status_code != 200:
        message = http_error_message(response.status_code, response.content)
        return TokenIdsDecision(False, f"not asked: the server refused {FIELD} ({message})")
    if lists_token_ids(response.content):
        return TokenIdsDecision(True, "asked: the server lists each chunk's token ids")
    return TokenIdsDecision(False, f"not asked: the server accepted {FIELD} but its chunks carry no token ids")


def lists_token_ids(body: bytes) -> bool:
    """Whether any SSE event of BODY has a choice with a `token_ids` list."""
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            event = orjson.loads(line[5:].strip())
        except orjson.JSONDecodeError:
            continue
        choices = event.get("choices") if isinstance(event, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict) and isinstance(choice.get("token_ids"), list):
                return True
    return False
