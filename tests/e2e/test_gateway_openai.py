"""The official `openai` client through the gateway, in front of real vLLM serving the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.ledger import UsageSummary, default_ledger_path, summarise
from deepserve.net import free_port
from tests.e2e.conftest import ServedTiny


@pytest.fixture
def gateway_url(served_tiny: ServedTiny) -> Iterator[str]:
    config = GatewayConfig.model_validate(
        {
            # straight in front of vLLM (served_tiny's public URL is itself a gateway, wired by `deepserve serve`)
            "upstream": [served_tiny.engine_url or served_tiny.base_url],
            "port": free_port(),
            "require_keys": True,
            "model_alias": ["v3=" + served_tiny.model],
        }
    )
    process = subprocess.Popen(
        gateway_argv(config, sys.executable),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ,
    )
    lines: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.startswith("GATEWAY READY "):
                url.append(line.split()[-1])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(30) and url, "the gateway did not start:\n" + "".join(lines)
        yield url[0]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0


def test_openai_client_through_the_gateway(served_tiny: ServedTiny, gateway_url: str) -> None:
    _, secret = KeyStore().create("e2e")
    client = openai.OpenAI(base_url=gateway_url, api_key=secret, max_retries=0, timeout=120)

    models = {model.id for model in client.models.list()}
    assert models == {served_tiny.model, "v3"}

    chat = client.chat.completions.create(
        model="v3", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    assert chat.model == served_tiny.model

    stream = client.chat.completions.create(
        model=served_tiny.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert chunks and all(chunk.usage is None for chunk in chunks)  # the usage chunk the gateway asked for is hidden
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")

    completion_stream = client.completions.create(
        model=served_tiny.model, prompt="abc", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in completion_stream if chunk.usage is not None]
    assert usage and usage[-1].completion_tokens <= 5

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=served_tiny.model, messages=[{"role": "user", "content": "x"}], max_tokens=10**7
        )
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway_url, api_key="wrong", max_retries=0).models.list()

    metrics = httpx.get(gateway_url.removesuffix("/v1") + "/metrics").text
    assert 'deepserve_gateway_requests_total{key="e2e"' in metrics

    if served_tiny.engine_url:  # `deepserve serve` put a gateway in front of its engine: it is ready and proxies
        assert httpx.get(served_tiny.root_url + "/ready").json()["healthy_upstreams"] == 1
        public = openai.OpenAI(base_url=served_tiny.base_url, api_key="unused", max_retries=0, timeout=120)
        assert public.completions.create(model=served_tiny.model, prompt="a", max_tokens=2).usage is not None


def test_ledger_counts_tokens_but_keeps_no_text(served_tiny: ServedTiny, gateway_url: str) -> None:
    _, secret = KeyStore().create("ledger")
    client = openai.OpenAI(base_url=gateway_url, api_key=secret, max_retries=0, timeout=120)
    answer = client.completions.create(model=served_tiny.model, prompt="secret words", max_tokens=3)
    assert answer.usage is not None
    deadline = time.monotonic() + 5
    rows: list[UsageSummary] = []
    while time.monotonic() < deadline and not rows:
        time.sleep(0.2)  # the ledger writes in batches, off the request path
        rows = [row for row in summarise() if row.key == "ledger"]
    assert rows and rows[0].requests == 1
    assert rows[0].completion_tokens == answer.usage.completion_tokens
    stored = b"".join(path.read_bytes() for path in default_ledger_path().parent.glob("usage.sqlite*"))
    assert b"secret words" not in stored
