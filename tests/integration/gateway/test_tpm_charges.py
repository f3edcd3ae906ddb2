"""A key's tokens-per-minute charge: capped by the model's context, given back when no engine generated, and for a
stream that ended early (client gone, cut at shutdown) the prompt estimate plus the tokens it delivered. The app's
clock is a fake one where buckets must not refill while a test runs."""

from __future__ import annotations

import asyncio

import httpx

from deepserve.gateway.keys import KeyStore
from deepserve.gateway.limits import KeyLimits
from tests.helpers import FAKE_MODEL, FakeClock, until

from .conftest import prompt_estimate, upstream_and_gateway

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10}


async def test_an_absurd_max_tokens_against_an_unknown_context_does_not_lock_the_key() -> None:
    """The engine does not list its context, so the gateway cannot refuse max_tokens 10^15 itself; the engine
    refuses it (400). Before the fix the 10^15-token charge stayed on the key: Retry-After of 1.9 billion years."""
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {secret}"}
    async with upstream_and_gateway(upstream_options={"models_max_model_len": False}) as (fake, app, client):
        assert app.pool.models == {FAKE_MODEL: None}
        refused = await client.post("/chat/completions", json={**CHAT, "max_tokens": 10**15}, headers=headers)
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
        after = await client.post("/chat/completions", json=CHAT, headers=headers)
        assert after.status_code == 200, after.text
        assert fake.app.stats.requests == 2


async def test_a_request_that_reached_no_engine_is_not_charged_but_a_completed_one_is() -> None:
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {secret}"}
    failing = {"error_fraction": 1.0, "error_status": 503}
    async with upstream_and_gateway(upstream_options=failing, max_retries=0) as (_, _, client):
        for _ in range(5):  # each charged about 900 on admission, each given back when the engine failed
            failed = await client.post("/chat/completions", json={**CHAT, "max_tokens": 900}, headers=headers)
            assert failed.status_code == 502
    _, other = KeyStore().create("others", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {other}"}
    async with upstream_and_gateway() as (_, _, client):
        done = await client.post("/chat/completions", json={**CHAT, "max_tokens": 900}, headers=headers)
        assert done.status_code == 200  # it used its 900 (and the prompt's): the key is nearly spent
        spent = await client.post("/chat/completions", json={**CHAT, "max_tokens": 900}, headers=headers)
        assert spent.status_code == 429 and isinstance(spent, httpx.Response)


async def _probe_tokens_left(client: httpx.AsyncClient, headers: dict[str, str], left: int) -> None:
    """Assert that the key has exactly LEFT tokens in its bucket: one more is refused, exactly LEFT is admitted."""
    estimate = prompt_estimate(CHAT)
    over = await client.post("/chat/completions", json={**CHAT, "max_tokens": left - estimate + 1}, headers=headers)
    assert over.status_code == 429, over.text
    exact = await client.post("/chat/completions", json={**CHAT, "max_tokens": left - estimate}, headers=headers)
    assert exact.status_code == 200, exact.text


async def test_a_stream_the_client_dropped_is_billed_the_tokens_it_delivered() -> None:
    """Charged on admission for its prompt estimate and 900 tokens; the client hangs up after 3 events (the role
    chunk and two tokens, which the gateway's count takes for three tokens): the key pays the estimate and those 3,
    the rest goes back."""
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {secret}"}
    stalls = {"cut_fraction": 1.0, "cut_mode": "stall", "cut_after_tokens": 2}  # two tokens, then silence
    async with upstream_and_gateway(FakeClock(), stalls) as (_, app, client):
        received = b""
        stream = {**CHAT, "max_tokens": 900, "stream": True}
        async with client.stream("POST", "/chat/completions", json=stream, headers=headers) as response:
            async for chunk in response.aiter_raw():
                received += chunk
                if received.count(b"data:") == 3:
                    break  # three tokens, then hang up
        await until(lambda: app.requests_in_flight == 0)
        await _probe_tokens_left(client, headers, 1000 - (prompt_estimate(CHAT) + 3))


async def test_at_shutdown_a_cut_stream_is_billed_what_it_delivered_and_a_cut_wait_nothing() -> None:
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {secret}"}
    stalls = {"cut_fraction": 1.0, "cut_mode": "stall", "cut_after_tokens": 1}  # the role and a token, then silence
    async with upstream_and_gateway(FakeClock(), stalls, max_concurrency=1) as (_, app, client):
        received = b""
        stream = {**CHAT, "max_tokens": 900, "stream": True}
        async with client.stream("POST", "/chat/completions", json=stream, headers=headers) as response:
            chunks = response.aiter_raw()
            while received.count(b"data:") < 2:
                received += await anext(chunks)
            queued = asyncio.create_task(client.post("/chat/completions", json=CHAT, headers=headers))
            await until(lambda: app.limiter.waiting == 1)
            assert app.cut_in_flight("the test ends it") == 2
            received += b"".join([chunk async for chunk in chunks])
        assert (await queued).status_code == 503
        await until(lambda: app.requests_in_flight == 0)
        await _probe_tokens_left(client, headers, 1000 - (prompt_estimate(CHAT) + 2))
