"""The simulator over loopback, driven by the OpenAI SDK and raw HTTP: API shapes, chunking, tokenizer, metrics,
faults, controls, and what a client that goes away does to the engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import openai
import pytest

from deepserve.bench.server_metrics import parse_metrics
from deepserve.engines.config import EngineConfig
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.server import SimulatorServer, running_simulator
from deepserve.simulate.setup import resolve
from deepserve.simulate.tokenizer import ByteTokenizer, generated_text
from tests.helpers import until

pytestmark = pytest.mark.timeout(120)
MODEL = "deepseek-ai/DeepSeek-V3"


def simulator(engine: dict[str, Any] | None = None, **sim: Any) -> AbstractAsyncContextManager[SimulatorServer]:
    """The planner-timed simulator of DeepSeek-V3 on 8 x H200, 50 times faster than real time."""
    config = SimulateConfig(**{"time_scale": 0.02, **sim})
    return running_simulator(resolve(EngineConfig(**{"model": MODEL, **(engine or {})}), config), config)


def client(server: SimulatorServer, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


async def stats(server: SimulatorServer) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        return (await http.get(server.root_url + "/simulate/stats")).json()


async def wait_for(server: SimulatorServer, check: Any) -> dict[str, Any]:
    """/simulate/stats once CHECK(stats) holds (the server settles asynchronously after a disconnect)."""
    assert server.app is not None
    app = server.app
    await until(lambda: check(app.stats_json()))
    return app.stats_json()


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            yield payload if payload == "[DONE]" else json.loads(payload)


async def test_a_streamed_completion_with_usage_and_token_ids() -> None:
    async with simulator() as server:
        prompt = "Hello, simulated world!"
        stream = await client(server).completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    tokens = [c for c in chunks if c.choices]
    # token_ids and prompt_token_ids are vLLM's extra fields (return_token_ids), absent from openai's types
    assert len(tokens) == 8 and all(len(c.choices[0].token_ids) == 1 for c in tokens)  # type: ignore[attr-defined]
    assert "".join(c.choices[0].text for c in tokens) == generated_text(0, 8)
    assert tokens[-1].choices[0].finish_reason == "length"
    # openai types finish_reason as never None, but every streamed chunk before the last has null: read the raw
    # field, since `finish_reason is None` would make mypy skip the rest of this test as unreachable
    assert tokens[0].choices[0].model_dump()["finish_reason"] is None
    assert tokens[0].choices[0].prompt_token_ids == ByteTokenizer().encode(prompt, True)  # type: ignore[attr-defined]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt) + 1, 8)


async def test_chat_streams_open_with_the_role_and_end_with_done() -> None:
    async with simulator() as server, httpx.AsyncClient() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        async with http.stream("POST", server.base_url + "/chat/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [event async for event in sse_events(response)]
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == generated_text(0, 5)
    assert not any("usage" in c for c in chunks)  # not asked for


async def test_whole_replies_and_the_end_of_sequence() -> None:
    async with simulator(natural_output_len=3) as server:
        api = client(server)
        natural = await api.completions.create(model=MODEL, prompt="x", max_tokens=10)
        forced = await api.completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body={"ignore_eos": True})
        longer = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10, extra_body={"min_tokens": 5}
        )
    assert (natural.choices[0].finish_reason, natural.usage and natural.usage.completion_tokens) == ("stop", 3)
    assert natural.choices[0].text == generated_text(0, 2)  # the end-of-sequence token has no text
    assert (forced.choices[0].finish_reason, forced.choices[0].text) == ("length", generated_text(0, 10))
    assert longer.choices[0].finish_reason == "stop" and longer.usage and longer.usage.completion_tokens == 5


async def test_tokens_per_chunk_streams_like_vllms_stream_interval() -> None:
    async with simulator(tokens_per_chunk=4) as server, httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True, "return_token_ids": True}
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            sizes = [len(e["choices"][0]["token_ids"]) async for e in sse_events(response) if isinstance(e, dict)]
    assert sizes == [1, 4, 4, 1]  # the first token at once, then every 4, then the rest


async def test_models_tokenize_health_version_and_metrics() -> None:
    async with simulator({"max_model_len": 8192}) as server, httpx.AsyncClient(base_url=server.root_url) as http:
        models = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 8192)]
        tokenized = (await http.post("/tokenize", json={"model": MODEL, "prompt": "héllo"})).json()
        assert tokenized["tokens"] == ByteTokenizer().encode("héllo", True) and tokenized["count"] == 7
        chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
        assert chat["tokens"] == ByteTokenizer().chat_ids([{"role": "user", "content": "hi"}])
        assert (await http.post("/detokenize", json={"tokens": tokenized["tokens"][1:]})).json() == {"prompt": "héllo"}
        assert (await http.get("/health")).status_code == 200
        assert "deepserve-simulate" in (await http.get("/version")).json()["version"]
        await client(server).completions.create(model=MODEL, prompt="abc", max_tokens=4)
        values = parse_metrics((await http.get("/metrics")).text)
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        assert values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
        assert values["vllm:prefix_cache_queries_total" + labels] == 4
        text = (await http.get("/metrics")).text
        assert f"vllm:generation_tokens_total{labels} 4.0" in text
        assert f"vllm:time_to_first_token_seconds_count{labels} 1.0" in text
        assert f"vllm:inter_token_latency_seconds_count{labels} 3.0" in text
        assert (await http.get("/nowhere")).status_code == 404


async def test_the_running_batch_and_the_cache_show_in_the_metrics_while_streams_run() -> None:
    async with simulator(fixed_step_ms=5, time_scale=1.0) as server, httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": "x" * 300, "max_tokens": 10_000, "stream": True}
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            await anext(response.aiter_lines())
            values = parse_metrics((await http.get(server.root_url + "/metrics")).text)
            assert values["vllm:num_requests_running"] == 1 and values["vllm:kv_cache_usage_perc"] > 0


async def test_bad_requests_get_openai_errors() -> None:
    async with simulator({"max_model_len": 64}, api_key="sekret") as server:
        api = client(server, api_key="sekret")
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await api.completions.create(model="other", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
            await api.completions.create(model=MODEL, prompt="x" * 70, max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            await client(server, api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert (await stats(server))["refused"] == 2
        async with httpx.AsyncClient(base_url=server.root_url) as http:
            assert (await http.post("/simulate/control", json={"healthy": False})).status_code == 401
            assert (await http.get("/health")).status_code == 200  # health and metrics stay open, as vLLM's


async def test_injected_errors_cuts_and_hangs() -> None:
    async with simulator(error_fraction=0.5) as server:
        api = client(server)
        results = []
        for _ in range(4):
            try:
                await api.completions.create(model=MODEL, prompt="x", max_tokens=2)
                results.append("ok")
            except openai.InternalServerError:
                results.append("error")
        assert sorted(results) == ["error", "error", "ok", "ok"]
    async with simulator(cut_fraction=1.0, cut_after_tokens=3) as server:
        with pytest.raises(openai.APIError):
            stream = await client(server).completions.create(model=MODEL, prompt="x", max_tokens=10, stream=True)
            [chunk async for chunk in stream]
        assert (await wait_for(server, lambda s: s["cut"] == 1))["engine"]["running"] == 0
    async with simulator(cut_fraction=1.0, cut_after_tokens=2, cut_mode="error_event") as server:
        async with httpx.AsyncClient() as http:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
            async with http.stream("POST", server.base_url + "/completions", json=body) as response:
                events = [e async for e in sse_events(response)]
        assert [("error" in e) for e in events if isinstance(e, dict)] == [False, False, True]
        assert events[-1] == "[DONE]"
    async with simulator(hang_fraction=1.0) as server:
        with pytest.raises(openai.APITimeoutError):
            await client(server, timeout=0.3).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert (await stats(server))["hung"] == 1


async def test_controls_change_health_faults_and_metric_values_at_runtime() -> None:
    async with simulator(unhealthy_after_requests=1) as server, httpx.AsyncClient(base_url=server.root_url) as http:
        assert (await http.get("/health")).status_code == 200
        await client(server).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert (await http.get("/health")).status_code == 503
        changes = {"healthy": True, "metric_overrides": {"vllm:num_requests_waiting": 12}}
        assert (await http.post("/simulate/control", json=changes)).status_code == 200
        assert (await http.get("/health")).status_code == 200
        assert parse_metrics((await http.get("/metrics")).text)["vllm:num_requests_waiting"] == 12
        assert (await http.post("/simulate/control", json={"faults": {"error_fraction": 1.0}})).status_code == 200
        with pytest.raises(openai.InternalServerError):
            await client(server).completions.create(model=MODEL, prompt="x", max_tokens=1)
        refused = await http.post("/simulate/control", json={"faults": {"cut_mode": "explode"}})
        assert refused.status_code == 400 and "cut_mode" in refused.json()["error"]["message"]


async def test_a_client_that_goes_away_aborts_its_request_and_frees_the_cache() -> None:
    async with simulator(fixed_step_ms=5, time_scale=1.0) as server, httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": "x" * 500, "max_tokens": 10_000, "stream": True}
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            lines = response.aiter_lines()
            await anext(lines)
        settled = await wait_for(server, lambda s: s["aborted"] == 1 and s["engine"]["running"] == 0)
    assert settled["active"] == 0 and settled["engine"]["kv_blocks_free"] == settled["engine"]["kv_blocks"]


async def test_requests_on_one_connection_are_answered_in_order() -> None:
    async with simulator() as server, httpx.AsyncClient(base_url=server.root_url) as http:
        for index in range(3):
            response = await http.post("/v1/completions", json={"model": MODEL, "prompt": str(index), "max_tokens": 2})
            assert response.json()["usage"]["prompt_tokens"] == 2
        assert (await stats(server))["completed"] == 3


async def test_fixed_latency_bursts_are_still_chunked_one_event_per_token() -> None:
    config = SimulateConfig(fixed_ttft_ms=0, fixed_itl_ms=0, tokens_per_chunk=3)
    deployment = resolve(EngineConfig(model="fake-model"), config)
    async with running_simulator(deployment, config) as server, httpx.AsyncClient() as http:
        body = {"model": "fake-model", "prompt": "x", "max_tokens": 100, "stream": True, "return_token_ids": True}
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            events = [e async for e in sse_events(response) if isinstance(e, dict)]
    sizes = [len(e["choices"][0]["token_ids"]) for e in events]
    assert sizes == [1, *[3] * 33] and events[-1]["choices"][0]["finish_reason"] == "length"


async def test_options_for_servers_that_behave_differently() -> None:
    async with simulator(usage_chunk="never", token_ids="always", tokenize_endpoints=False,
                         profiler_endpoints=True) as server, httpx.AsyncClient() as http:  # fmt: skip
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            events = [e async for e in sse_events(response) if isinstance(e, dict)]
        assert all("usage" not in e and len(e["choices"][0]["token_ids"]) == 1 for e in events)
        assert (await http.post(server.root_url + "/tokenize", json={"prompt": "x"})).status_code == 404
        assert (await http.post(server.root_url + "/start_profile")).status_code == 200
        assert (await stats(server))["profile_calls"] == ["/start_profile"]
    async with simulator(usage_chunk="always") as server, httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            events = [e async for e in sse_events(response) if isinstance(e, dict)]
        assert events[-1]["usage"]["completion_tokens"] == 3
        assert (await http.post(server.root_url + "/start_profile")).status_code == 404


async def test_pipelined_requests_are_answered_in_order_and_connection_close_is_honoured() -> None:
    async with simulator() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
        writer.write(request % (len(body), b"", body) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        writer.write(request % (len(body), b"Connection: close\r\n", body))
        data = await asyncio.wait_for(reader.read(), 30)  # the server closes after the third answer
        writer.close()
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"200 OK"] * 3
    assert b"text_completion" in answers[0] and b"content-length: 0" in answers[1]
    assert b"connection: close" in answers[2]
