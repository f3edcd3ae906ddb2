"""Prefill/decode disaggregation on vLLM's CPU build: two `deepserve serve --role …` engines on loopback joined by
vLLM's ExampleConnector through a shared directory (the one connector that runs without a GPU or a transfer
library). The prefill engine computes a prompt's KV cache and writes it there (a request with
kv_transfer_params {"do_remote_decode": true} and max_tokens 1, as vLLM's P/D proxies send it); the decode engine,
given the prefill's kv_transfer_params, loads that KV instead of computing it ("External Cache Hit!" in its log) and
continues exactly as an engine that computed the prompt itself (the same log-probabilities). Direct to both engines;
the through-the-gateway variant comes with the gateway's prefill routing."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .conftest import ServedTiny, start_deepserve, stop_and_wait

CACHE_HIT = "External Cache Hit!"  # vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py
# Token ids of the tiny model's vocabulary: a prompt longer than two 64-token blocks (ExampleConnector keeps whole
# blocks of the prompt but its last token).
PROMPT = [(i * 11) % 250 + 3 for i in range(150)]


def post(engine: ServedTiny, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{engine.base_url}/completions",
        data=json.dumps({"model": engine.model, "prompt": PROMPT, "temperature": 0, **body}).encode(),
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
    for stored in shared.iterdir():
        shutil.rmtree(stored)
    hits_before = cache_hits(decode)

    first = post(prefill, {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first["usage"]["completion_tokens"] == 1
    assert "kv_transfer_params" in first  # ExampleConnector's prefill returns none; NIXL's names its blocks
    layers = list(shared.glob("*/*.safetensors"))
    assert layers, "the prefill engine wrote no KV files"
    assert {path.stem.split(".")[2] for path in layers} == {"0", "1", "2", "3"}  # every layer of the tiny model

    answer = post(decode, {"max_tokens": 3, "logprobs": 5, "kv_transfer_params": first["kv_transfer_params"]})
    assert cache_hits(decode) == hits_before + 1  # the decode engine loaded the prompt's KV instead of computing it
    assert answer["usage"]["completion_tokens"] == 3
    continued = answer["choices"][0]["logprobs"]["top_logprobs"]
    assert len(continued) == len(reference) == 3
    for got, want in zip(continued, reference, strict=True):
        assert got.keys() == want.keys()
        assert all(got[token] == pytest.approx(want[token], abs=1e-3) for token in want)
