"""Prefill/decode disaggregation (`--prefill-upstream`): each completion and chat request is prefilled on a prefill
replica and decoded on a decode replica (`--upstream`), joined by vLLM's KV-transfer protocol, as vLLM's toy proxy
does it (vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py; examples/online_serving/
disaggregated_serving/):

1. the prefill request is the client's with `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill":
   false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}`, `stream`
   false, `max_tokens` (and `max_completion_tokens`) 1, without `stream_options` and `min_tokens`: the prefill engine
   computes the prompt's KV cache, keeps it for the decode engine to pull, and answers with the
   `kv_transfer_params` that say where it is (vLLM's NIXL connector: remote_engine_id, remote_request_id,
   remote_block_ids, remote_host, remote_port, tp_size, …);
2. the decode request is the client's with those `kv_transfer_params`, sent to a decode replica, whose answer
   (streamed or not) goes to the client.

A prefill answered without `kv_transfer_params` (vLLM then sends `null`) is decoded with the client's request as it
is: a connector that finds the KV by the prompt itself (vLLM's ExampleConnector, through a shared directory)
returns none, and the decode engine's connector loads it all the same (counted in
deepserve_gateway_pd_handoffs_total as `none`; a prefill engine without a connector answers so too, and the decode
replica then prefills the prompt itself).

A request whose client already gives `kv_transfer_params` is sent as it is (the client runs the protocol itself). A
prefill that no replica can take (none healthy, every attempt failed) is left to the decode replica, which then
prefills the prompt itself (slower, but served; counted in deepserve_gateway_pd_fallbacks_total). A prefill the
engine refuses (4xx: a prompt too long) is the answer."""

from __future__ import annotations

import json
from typing import Any

PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What the decode request must not keep from the client's (the toy proxy's list), and what it sets.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(forwarded: bytes) -> tuple[dict[str, Any], bytes]:
    """(the request, the prefill request's body) from FORWARDED, the body the gateway would send upstream."""
    request: dict[str, Any] = json.loads(forwarded)
    prefill = {key: value for key, value in request.items() if key not in _PREFILL_DROPPED}
    prefill["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return request, _dumps(prefill)


def kv_transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The kv_transfer_params of a prefill's answer, or None when it has none (an engine without a connector)."""
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return None
    return params if isinstance(params, dict) else None


def decode_body(request: dict[str, Any], params: dict[str, Any]) -> bytes:
    return _dumps({**request, "kv_transfer_params": params})


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
