"""OpenAI's Responses API through the gateway (issue 18, point 3), with the official `openai` client: created streamed
and not, with the keys, limits, ledger and metrics of chat completions; stored responses retrieved, and conversations
continued, on the replica that holds them (vLLM keeps them in its own memory)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.keys import KeyRing, KeyStore
from deepserve.gateway.ledger import UsageLedger
from deepserve.gateway.limits import KeyLimits
from deepserve.gateway.server import running_gateway
from deepserve.simulate.server import SimulatorServer
from deepserve.simulate.tokenizer import generated_text
from tests.helpers import FAKE_MODEL

from .conftest import gateway_config, ledger_rows, upstream, upstream_and_gateway


async def test_a_response_is_created_whole_and_accounted() -> None:
    async with upstream_and_gateway(upstream_options={"reasoning_tokens": 2}) as (_, app, client):
        openai_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused")
        response = await openai_client.responses.create(model=FAKE_MODEL, input="hello", max_output_tokens=7)
        assert response.output_text == generated_text(2, 5) and response.id.startswith("resp_")
        assert response.usage is not None and response.usage.output_tokens == 7
        assert app.ledger is not None and app.ledger.flush()
        rows = ledger_rows("endpoint, stream, status, prompt_tokens, completion_tokens, reasoning_tokens")
        assert rows == [("/v1/responses", 0, 200, response.usage.input_tokens, 7, 2)]
        metrics = app.metrics.render().decode()
        assert 'deepserve_gateway_completion_tokens_total{key="anonymous",model="fake-model"} 7.0' in metrics


async def test_a_streamed_response_arrives_event_by_event_and_is_accounted() -> None:
    async with upstream_and_gateway(upstream_options={"reasoning_tokens": 2}) as (_, app, client):
        openai_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused")
        stream = await openai_client.responses.create(
            model=FAKE_MODEL, input=[{"role": "user", "content": "hi"}], max_output_tokens=6, stream=True
        )
        kinds, text, reasoning = [], "", ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.reasoning_text.delta":
                reasoning += event.delta
            elif event.type == "response.completed":
                assert event.response.usage is not None and event.response.usage.output_tokens == 6
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert reasoning == generated_text(0, 2) and text == generated_text(2, 4)
        assert app.ledger is not None and app.ledger.flush()
        assert ledger_rows("endpoint, stream, completion_tokens, reasoning_tokens, reasoning_source") == [
            ("/v1/responses", 1, 6, 2, "usage")
        ]


async def test_responses_need_a_key_and_count_against_its_limits(tmp_path: Path) -> None:
    keys = KeyStore(tmp_path / "keys.sqlite")
    _, secret = keys.create("team", KeyLimits(rpm=1))
    ledger = UsageLedger(tmp_path / "usage.sqlite")
    try:
        async with upstream() as served:
            config = gateway_config(served.base_url, require_keys=True)
            app = GatewayApp(config, keyring=KeyRing(keys), ledger=ledger)
            async with running_gateway(config, app) as (_, url):
                anonymous = openai.AsyncOpenAI(base_url=url, api_key="not-a-key", max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await anonymous.responses.create(model=FAKE_MODEL, input="x", max_output_tokens=2)
                team = openai.AsyncOpenAI(base_url=url, api_key=secret, max_retries=0)
                await team.responses.create(model=FAKE_MODEL, input="x", max_output_tokens=2)
                with pytest.raises(openai.RateLimitError):
                    await team.responses.create(model=FAKE_MODEL, input="x", max_output_tokens=2)
    finally:
        ledger.close()
        keys.close()


@contextlib.asynccontextmanager
async def two_replicas() -> AsyncIterator[tuple[list[SimulatorServer], GatewayApp, openai.AsyncOpenAI]]:
    """Two simulated replicas (each keeps its own stored responses) behind a round-robin gateway."""
    async with upstream() as first, upstream() as second:
        config = gateway_config(first.base_url, second.base_url, balancing="round_robin")
        async with running_gateway(config) as (app, url):
            yield [first, second], app, openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


async def test_stored_responses_are_retrieved_and_continued_on_the_replica_that_holds_them() -> None:
    async with two_replicas() as (replicas, _, client):
        created = [await client.responses.create(model=FAKE_MODEL, input="x", max_output_tokens=3) for _ in range(2)]
        held = [list(replica.app.stored) for replica in replicas]
        assert sorted(held) == sorted([[response.id] for response in created])  # round robin: one on each replica
        for response in created:
            assert (await client.responses.retrieve(response.id)).output_text == response.output_text
            for _ in range(3):  # round robin alone would send every other one to the replica without it
                follow_up = await client.responses.create(
                    model=FAKE_MODEL, input="more", previous_response_id=response.id, max_output_tokens=2
                )
                assert follow_up.status == "completed"


async def test_a_response_this_gateway_did_not_relay_is_looked_for_on_every_replica() -> None:
    async with two_replicas() as (replicas, _, client):
        async with httpx.AsyncClient(base_url=replicas[1].base_url) as direct:
            made = await direct.post("/responses", json={"model": FAKE_MODEL, "input": "x", "max_output_tokens": 2})
        response_id = made.json()["id"]
        assert (await client.responses.retrieve(response_id)).id == response_id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_nobody_has_it")


async def test_another_keys_response_does_not_exist_for_it(tmp_path: Path) -> None:
    keys = KeyStore(tmp_path / "keys.sqlite")
    _, alice = keys.create("alice")
    _, bob = keys.create("bob")
    ledger = UsageLedger(tmp_path / "usage.sqlite")
    try:
        async with upstream() as served:
            config = gateway_config(served.base_url, require_keys=True)
            async with running_gateway(config, GatewayApp(config, keyring=KeyRing(keys), ledger=ledger)) as (_, url):
                mine = await openai.AsyncOpenAI(base_url=url, api_key=alice).responses.create(
                    model=FAKE_MODEL, input="x", max_output_tokens=2
                )
                theirs = openai.AsyncOpenAI(base_url=url, api_key=bob, max_retries=0)
                with pytest.raises(openai.NotFoundError):
                    await theirs.responses.retrieve(mine.id)
                with pytest.raises(openai.NotFoundError):
                    await theirs.responses.create(
                        model=FAKE_MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2
                    )
    finally:
        ledger.close()
        keys.close()


async def test_methods_the_engine_does_not_serve_get_405_in_openai_shape() -> None:
    async with upstream_and_gateway() as (_, _, client):
        response = await client.delete("/responses/resp_1")
        assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
        invalid = await client.post("/responses", json={"model": FAKE_MODEL, "input": 5})
        assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "input"
