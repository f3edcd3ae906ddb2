"""A key's tokens-per-minute charge: capped by the model's context, and given back when no engine generated."""

from __future__ import annotations

import httpx

from deepserve.gateway.fake_upstream import FAKE_MODEL, FakeBehaviour
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.limits import KeyLimits

from .conftest import fake_and_gateway

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10}


async def test_an_absurd_max_tokens_against_an_unknown_context_does_not_lock_the_key() -> None:
    """The engine does not list its context, so the gateway cannot refuse max_tokens 10^15 itself; the engine
    refuses it (400). Before the fix the 10^15-token charge stayed on the key: Retry-After of 1.9 billion years."""
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {secret}"}
    async with fake_and_gateway(FakeBehaviour(advertise_max_model_len=False)) as (fake, app, client):
        assert app.pool.models == {FAKE_MODEL: None}
        refused = await client.post("/chat/completions", json={**CHAT, "max_tokens": 10**15}, headers=headers)
        assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
        after = await client.post("/chat/completions", json=CHAT, headers=headers)
        assert after.status_code == 200, after.text
        assert fake.stats.requests == 2


async def test_a_request_that_reached_no_engine_is_not_charged_but_a_completed_one_is() -> None:
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {secret}"}
    async with fake_and_gateway(FakeBehaviour(fail_status=503), max_retries=0) as (_, _, client):
        for _ in range(5):  # each charged about 900 on admission, each given back when the engine failed
            failed = await client.post("/chat/completions", json={**CHAT, "max_tokens": 900}, headers=headers)
            assert failed.status_code == 502
    _, other = KeyStore().create("others", KeyLimits(tpm=1000))
    headers = {"Authorization": f"Bearer {other}"}
    async with fake_and_gateway() as (_, _, client):
        done = await client.post("/chat/completions", json={**CHAT, "max_tokens": 900}, headers=headers)
        assert done.status_code == 200  # it used its 900 (and the prompt's): the key is nearly spent
        spent = await client.post("/chat/completions", json={**CHAT, "max_tokens": 900}, headers=headers)
        assert spent.status_code == 429 and isinstance(spent, httpx.Response)
