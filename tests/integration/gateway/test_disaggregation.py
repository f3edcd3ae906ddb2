"""Prefill/decode disaggregation through the gateway (issue 21, point 7): each completion and chat request is
prefilled on a prefill replica (`--prefill-upstream`) with vLLM's kv_transfer_params and decoded on a decode replica
with the prefill's answer, as vLLM's toy proxy does. The replicas are simulators that speak the protocol: a prefill
answers with kv_transfer_params, a decode given them skips its prompt's prefill (its first token after one ITL)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.disaggregation import PREFILL_KV_TRANSFER_PARAMS
from deepserve.gateway.server import running_gateway
from deepserve.net import free_port
from deepserve.simulate.server import SimulatorServer
from tests.helpers import FAKE_MODEL

from .conftest import gateway_config, ledger_rows, upstream

CHAT: dict[str, Any] = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
DECODE_TTFT_MS = 3000.0  # what the decode replica takes when it has to prefill the prompt itself


@contextlib.asynccontextmanager
async def disaggregated(
    prefill_options: dict[str, Any] | None = None, **fields: object
) -> AsyncIterator[tuple[SimulatorServer, SimulatorServer, GatewayApp, httpx.AsyncClient]]:
    """A prefill replica, a decode replica (slow to prefill, fast to decode) and a gateway joining them."""
    async with (
        upstream(ttft_ms=20.0, **(prefill_options or {})) as prefill,
        upstream(ttft_ms=DECODE_TTFT_MS, itl_ms=10.0) as decode,
    ):
        config = gateway_config(decode.base_url, prefill_upstream=[prefill.base_url], **fields)
        async with (
            running_gateway(config) as (app, url),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield prefill, decode, app, client


async def test_a_stream_is_prefilled_on_one_replica_and_decoded_on_the_other() -> None:
    async with disaggregated() as (prefill, decode, app, client):
        started = time.perf_counter()
        async with client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as response:
            chunks = response.aiter_raw()
            first = await chunks.__anext__()
            ttft_s = time.perf_counter() - started
            rest = b"".join([chunk async for chunk in chunks])
        assert (first + rest).endswith(b"data: [DONE]\n\n") and (first + rest).count(b'"content":') == 6
        assert ttft_s < DECODE_TTFT_MS / 1000 / 2  # the decode did not prefill (a bound for a loaded machine)
        prefill_body, decode_body = prefill.app.stats.bodies[-1], decode.app.stats.bodies[-1]
        assert prefill_body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
        assert "stream_options" not in prefill_body
        assert decode_body["kv_transfer_params"]["do_remote_prefill"] is True  # what the prefill answered
        assert decode_body["kv_transfer_params"]["remote_engine_id"] == prefill.app.engine_id
        assert decode_body["stream_options"] == {"include_usage": True} and decode_body["max_tokens"] == 5
        assert (prefill.app.stats.kv_prefills, decode.app.stats.kv_remote_prefills) == (1, 1)
        assert app.ledger is not None and app.ledger.flush()
        assert ledger_rows("upstream, prefill_upstream, completion_tokens") == [(decode.base_url, prefill.base_url, 5)]
        metrics = app.metrics.render().decode()
        for phase in ("prefill", "decode_first_token"):
            assert f'deepserve_gateway_pd_phase_seconds_count{{model="fake-model",phase="{phase}"}} 1.0' in metrics
        assert 'deepserve_gateway_pd_handoffs_total{kv_transfer_params="returned"} 1.0' in metrics
        assert "deepserve_gateway_pd_fallbacks_total{" not in metrics
        assert f'deepserve_gateway_prefill_upstream_healthy{{replica="{prefill.base_url}"}} 1.0' in metrics


async def test_whole_answers_of_chat_and_completions_go_the_same_way() -> None:
    async with disaggregated() as (prefill, decode, _, client):
        chat = await client.post("/chat/completions", json=CHAT)
        completion = await client.post("/completions", json={"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 3})
        assert chat.status_code == completion.status_code == 200
        assert "kv_transfer_params" not in completion.json()  # the decode's answer, not the prefill's
        assert (prefill.app.stats.kv_prefills, decode.app.stats.kv_remote_prefills) == (2, 2)


async def test_without_a_prefill_replica_the_decode_replica_prefills_itself() -> None:
    async with upstream(ttft_ms=20.0) as decode:
        nothing = f"http://127.0.0.1:{free_port()}/v1"
        config = gateway_config(decode.base_url, prefill_upstream=[nothing])
        async with running_gateway(config) as (app, url), httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
            assert "kv_transfer_params" not in decode.app.stats.bodies[-1]
            metrics = app.metrics.render().decode()
            assert 'deepserve_gateway_pd_fallbacks_total{reason="no_prefill_replica"} 1.0' in metrics


async def test_a_prefill_the_engine_refuses_is_the_answer() -> None:
    async with disaggregated({"engine": {"max_model_len": 64}}) as (_, decode, _, client):
        too_long = {**CHAT, "messages": [{"role": "user", "content": "x" * 100}]}
        response = await client.post("/chat/completions", json=too_long)
        assert response.status_code == 400 and "maximum context length" in response.json()["error"]["message"]
        assert decode.app.stats.requests == 0


async def test_a_client_that_runs_the_protocol_itself_goes_straight_to_decode() -> None:
    async with disaggregated() as (prefill, decode, _, client):
        own = {
            **CHAT,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]},
        }
        assert (await client.post("/chat/completions", json=own)).status_code == 200
        assert prefill.app.stats.requests == 0 and decode.app.stats.bodies[-1] == own
