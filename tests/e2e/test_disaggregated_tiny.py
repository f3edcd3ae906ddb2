"""Prefill/decode disaggregation on vLLM's CPU build: two `deepserve serve --role …` engines on loopback joined by
vLLM's ExampleConnector through a shared directory (the one connector that runs without a GPU or a transfer
library). The prefill engine computes a prompt's KV cache and writes it there (a request with
kv_transfer_params {"do_remote_decode": true} and max_tokens 1, as vLLM's P/D proxies send it); the decode engine,
given the same prompt, loads that KV instead of computing it ("External Cache Hit!" in its log, the tokens in
vllm:external_prefix_cache_hits_total) and continues exactly as an engine that computed the prompt itself (the same
log-probabilities). First direct to both engines, then through `deepserve gateway --prefill-upstream PREFILL
--upstream DECODE` with the official openai client, as a user runs it (docs/GATEWAY.md, "Prefill/decode
disaggregation")."""

from __future__ import annotations

import contextlib
import json
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from deepserve.gateway.config import GatewayConfig
from deepserve.hardware.host import has_amx_tiles
from tests.helpers import metric_total, scrape, start_gateway, wait_until

from .conftest import ServedTiny, start_deepserve, stop_and_wait

SETTLE_S = 30  # a bound for a loaded machine
# How far a log-probability may move when the decode engine loads the prompt's KV instead of computing it. With AMX,
# vLLM's AMX MLA backend runs the prompt's last tokens through the same kernel either way: within 1e-3. Without AMX,
# its reference backend computes them against the loaded blocks (the context's attention merged with theirs) where
# the engine that computed the prompt itself ran one SDPA over it: the same bf16 values added in another order, and
# a logit may land one bf16 step away (0.0039 to 0.0078 at the tiny model's magnitudes, as measured on a 2-core EPYC
# without AMX on 2026-11-29; 0.02 allows two steps of a logit up to 4). A KV cache loaded wrong moves them by whole
# units and changes the top tokens, which the tests compare exactly.
LOGPROB_TOLERANCE = 1e-3 if has_amx_tiles() else 2e-2
CACHE_HIT = "External Cache Hit!"  # vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py
# Token ids of the tiny model's vocabulary: a prompt longer than 128 tokens, a whole KV block of vLLM's CPU MLA backend
# with AMX (eight of its reference backend's 16-token blocks): ExampleConnector keeps whole blocks of the prompt but
# its last token.
PROMPT = [(i * 11) % 250 + 3 for i in range(150)]


# A chat message whose prompt is over 128 tokens too (one token per byte, plus the template's).
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "".join(chr(ord("a") + (i * 7) % 26) for i in range(150))}
]


def post(engine: ServedTiny, body: dict[str, Any], path: str = "/completions") -> dict[str, Any]:
    prompt = {"messages": MESSAGES} if path == "/chat/completions" else {"prompt": PROMPT}
    request = urllib.request.Request(
        f"{engine.base_url}{path}",
        data=json.dumps({"model": engine.model, **prompt, "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.load(response)
    return answer


def cache_hits(engine: ServedTiny) -> int:
    return sum(path.read_text(errors="replace").count(CACHE_HIT) for path in (engine.home / "logs").glob("engine-*"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedTiny, ServedTiny, Path]]:
    shared = tmp_path_factory.mktemp("kv-transfer")
    flags = ["--kv-connector", "ExampleConnector", "--kv-connector-config", f"shared_storage_path={shared}"]
    homes = [tmp_path_factory.mktemp(role) for role in ("prefill", "decode")]
    with ThreadPoolExecutor(2) as pool:  # both engines start at once (each takes 1-2 minutes here)
        futures = [pool.submit(start_deepserve, home, "--role", role, *flags)
                   for home, role in zip(homes, ("prefill", "decode"), strict=True)]  # fmt: skip
        engines = [future.result() for future in futures]
    try:
        yield engines[0], engines[1], shared
    finally:
        for engine in engines:
            stop_and_wait(engine)


def test_the_decode_engine_continues_from_the_prefill_engines_kv_cache(
    pair: tuple[ServedTiny, ServedTiny, Path],
) -> None:
    prefill, decode, shared = pair
    # The reference: the prefill engine computes the prompt itself (and, being a producer, stores its KV).
    reference = post(prefill, {"max_tokens": 3, "logprobs": 5})["choices"][0]["logprobs"]["top_logprobs"]
    _clear(shared)
    hits_before = cache_hits(decode)

    first = post(prefill, {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" in first  # ExampleConnector's prefill returns none; NIXL's names its blocks
    layers = list(shared.glob("*/*.safetensors"))
    assert layers, "the prefill engine wrote no KV files"
    assert {path.stem.split(".")[2] for path in layers} == {"0", "1", "2", "3"}  # every layer of the tiny model

    loaded_before = _external_hits(decode)
    answer = post(decode, {"max_tokens": 3, "logprobs": 5, "kv_transfer_params": first["kv_transfer_params"]})
    # the decode engine loaded the prompt's KV instead of computing it: its whole blocks
    assert _settled(lambda: cache_hits(decode), hits_before + 1) == hits_before + 1
    assert _settled(lambda: _external_hits(decode), loaded_before + 128) >= loaded_before + 128
    assert answer["usage"]["completion_tokens"] == 3
    continued = answer["choices"][0]["logprobs"]["top_logprobs"]
    assert len(continued) == len(reference) == 3
    for got, want in zip(continued, reference, strict=True):
        assert got.keys() == want.keys()
        assert all(got[token] == pytest.approx(want[token], abs=LOGPROB_TOLERANCE) for token in want)


def test_the_gateway_prefills_on_the_prefill_engine_and_decodes_on_the_decode_engine(
    pair: tuple[ServedTiny, ServedTiny, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`deepserve gateway --prefill-upstream PREFILL --upstream DECODE` in front of the same two engines: a completion
    and a streamed chat, each prefilled on the prefill engine (its KV stored), loaded by the decode engine, and
    answered exactly as the decode engine answers when it computes the prompt itself.

    Each phase's requests carry their own cache_salt: where vLLM keeps prefix caching on (its AMX MLA backend, on
    CPUs with AMX), an engine would otherwise reuse the blocks of a prompt it saw before instead of loading them (and
    still log "External Cache Hit!", with nothing to load)."""
    prefill, decode, shared = pair
    _clear(shared)  # the references: the decode engine computes each prompt itself, with nothing stored to load
    hits_before = cache_hits(decode)
    reference = {"max_tokens": 3, "cache_salt": "reference"}
    completion_reference = post(decode, {**reference, "logprobs": 5})["choices"][0]["logprobs"]["top_logprobs"]
    chat_reference = post(decode, {**reference, "logprobs": True, "top_logprobs": 5}, "/chat/completions")
    assert cache_hits(decode) == hits_before
    _clear(shared)

    monkeypatch.setenv("DEEPSERVE_HOME", str(tmp_path))  # the gateway's ledger and keys: this test's own
    config = GatewayConfig.model_validate(
        {"upstream": [decode.base_url], "prefill_upstream": [prefill.base_url], "port": 0}
    )
    gateway = start_gateway(config, timeout_s=120)
    try:
        client = OpenAI(base_url=gateway.url, api_key="unused", timeout=180, max_retries=0)
        prefilled_before, loaded_before = _finished(prefill), _external_hits(decode)
        salted = {"cache_salt": "through-the-gateway"}

        completion = client.completions.create(
            model=decode.model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=5, extra_body=salted
        )
        assert _settled(lambda: cache_hits(decode), hits_before + 1) == hits_before + 1
        assert completion.usage is not None and completion.usage.completion_tokens == 3  # the decode's answer
        assert completion.choices[0].logprobs is not None
        _assert_same_logprobs(completion.choices[0].logprobs.top_logprobs or [], completion_reference)

        stream = client.chat.completions.create(
            model=decode.model,
            messages=MESSAGES,
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            stream=True,
            extra_body=salted,
        )
        streamed = [entry for chunk in stream for choice in chunk.choices for entry in _content_logprobs(choice)]
        assert _settled(lambda: cache_hits(decode), hits_before + 2) == hits_before + 2
        want = chat_reference["choices"][0]["logprobs"]["content"]
        assert [entry.token for entry in streamed] == [entry["token"] for entry in want]
        _assert_same_logprobs(
            [{top.token: top.logprob for top in entry.top_logprobs} for entry in streamed],
            [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in want],
        )

        # each request's prefill ran on the prefill engine
        assert _settled(lambda: _finished(prefill), prefilled_before + 2) == prefilled_before + 2
        # the decode engine loaded the prompts' KV instead of computing it: the whole blocks of each
        assert _settled(lambda: _external_hits(decode), loaded_before + 2 * 128) >= loaded_before + 2 * 128
        metrics = scrape(gateway.root_url + "/metrics")
        phases = {"prefill": 2, "decode_first_token": 1}  # a whole answer has no first token: only the stream's
        for phase, count in phases.items():
            assert metric_total(metrics, "deepserve_gateway_pd_phase_seconds_count", phase=phase) == count, phase
        assert metric_total(metrics, "deepserve_gateway_pd_fallbacks_total") == 0
        # ExampleConnector finds the KV by the prompt: its prefill answers with kv_transfer_params null
        assert metric_total(metrics, "deepserve_gateway_pd_handoffs_total", kv_transfer_params="none") == 2
    finally:
        gateway.stop()


def _settled(read: Callable[[], float], at_least: float) -> float:
    """READ() once it reached AT_LEAST, or after SETTLE_S: on a busy machine the engine's log reaches its file
    through `deepserve serve`'s log thread, and vLLM records its counters in its output loop, a moment after the
    answer left."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: read() >= at_least, timeout_s=SETTLE_S)
    return read()


def _clear(shared: Path) -> None:
    for stored in shared.iterdir():
        shutil.rmtree(stored)


def _finished(engine: ServedTiny) -> float:
    """Requests the engine finished (vLLM's counter, every finish reason)."""
    return metric_total(scrape(engine.root_url + "/metrics"), "vllm:request_success_total")


def _external_hits(engine: ServedTiny) -> float:
    """Prompt tokens the engine loaded through its KV connector (vLLM's counter)."""
    return metric_total(scrape(engine.root_url + "/metrics"), "vllm:external_prefix_cache_hits_total")


def _content_logprobs(choice: Any) -> list[Any]:
    return list(choice.logprobs.content or []) if choice.logprobs is not None else []


def _assert_same_logprobs(got: list[dict[str, float]], want: list[dict[str, float]]) -> None:
    assert len(got) == len(want) == 3
    for mine, theirs in zip(got, want, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(mine[token] == pytest.approx(theirs[token], abs=LOGPROB_TOLERANCE) for token in theirs)
