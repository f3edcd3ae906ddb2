"""MTP speculative decoding on real vLLM (CPU build) with the tiny V3s whose drafts are accepted at a known rate
(models/tiny/markov.py): every greedy draft for tiny-mtp, the rate the model predicts for tiny-mtp-partial; streamed
chunks of K+1 tokens; and sampled output drawn from the model's distribution with speculation on, which needs
deepserve's fix of vLLM's CPU rejection sampler (engines/vllm_workarounds/cpu_expand.py: without it the same test
measured a chi-square of 636 and tokens off the chain).

Speculation is passed after `--` for now (typed speculative options are coming to EngineConfig)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from deepserve.bench.config import BenchConfig
from deepserve.bench.runner import run_benchmark, save_result
from deepserve.models.tiny.markov import (
    START_BYTE,
    byte_token,
    greedy_next,
    simulate_greedy_speculation,
    successor_probabilities,
)
from deepserve.models.tiny.tokenizer import BYTE_TOKEN_OFFSET, special_token_id
from tests.e2e.conftest import ServedTiny, start_deepserve, stop_and_wait

FULL_K, PARTIAL_K = 2, 3
ASSISTANT = special_token_id("<｜Assistant｜>")  # what a chat prompt ends with
# 2 degrees of freedom: exceeded with probability 1e-6 when the output follows the model's distribution
CHI_SQUARE_LIMIT = 27.6
SPEC_METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
BENCH_REQUESTS, BENCH_OUTPUT_LEN = 4, 48


def _serve_with_mtp(tmp_path_factory: pytest.TempPathFactory, model: str, k: int) -> ServedTiny:
    speculation = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    return start_deepserve(tmp_path_factory.mktemp(model), "--model", model, "--", "--speculative-config", speculation)


# Class scope: each server is stopped before the next starts (two engines would share the two cores).
@pytest.fixture(scope="class")
def served_full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTiny]:
    served = _serve_with_mtp(tmp_path_factory, "tiny-mtp", FULL_K)
    yield served
    stop_and_wait(served)


@pytest.fixture(scope="class")
def served_partial(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTiny]:
    served = _serve_with_mtp(tmp_path_factory, "tiny-mtp-partial", PARTIAL_K)
    yield served
    stop_and_wait(served)


class TestFullAcceptance:
    def test_full_mtp_accepts_every_draft_and_streams_k_plus_1_tokens(self, served_full: ServedTiny) -> None:
        before = _spec_counters(served_full)
        chunks, text = _stream_chat(served_full, max_tokens=24)
        after = _spec_counters(served_full)
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        assert drafted > 0 and after["num_accepted_tokens"] - before["num_accepted_tokens"] == drafted
        for position in range(FULL_K):
            accepted = after[f"position {position}"] - before.get(f"position {position}", 0)
            assert accepted == after["num_drafts"] - before["num_drafts"]
        assert _whole_steps(chunks, FULL_K), chunks  # the prompt's token, then K+1 per step
        assert greedy_next(ASSISTANT) == byte_token(START_BYTE + 1)  # a chat continues as after `a`
        assert text == "".join(chr(START_BYTE + i) for i in range(1, 25))  # greedy counts up: bcd…

    def test_sampled_output_with_speculation_follows_the_models_distribution(self, served_full: ServedTiny) -> None:
        """Each sampled step adds 1, 2 or 3 to the byte with the model's probabilities, whatever came before: so the
        increments of many sampled completions, drafted and verified by speculative decoding, must fit those
        probabilities (the distribution the model samples from without speculation)."""
        client = OpenAI(base_url=served_full.base_url, api_key="unused", timeout=180, max_retries=0)

        def increments(_: int) -> list[int]:
            response = client.completions.create(
                model=served_full.model,
                prompt=chr(START_BYTE),
                max_tokens=16,
                temperature=1.0,
                top_p=1.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            tokens = [byte_token(START_BYTE), *response.choices[0].model_extra["token_ids"]]  # type: ignore[index]
            return [(b - a) % 256 if 0 <= b - BYTE_TOKEN_OFFSET < 256 else -1 for a, b in pairwise(tokens)]

        with ThreadPoolExecutor(8) as pool:
            counts = Counter(step for steps in pool.map(increments, range(64)) for step in steps)
        total = sum(counts.values())
        off_chain = total - sum(counts[step] for step in (1, 2, 3))
        expected = {step: total * p for step, p in zip((1, 2, 3), successor_probabilities(), strict=True)}
        chi_square = sum((counts[step] - count) ** 2 / count for step, count in expected.items())
        assert off_chain <= 2, counts  # the other 317 tokens share about 2e-5 of the probability
        assert chi_square < CHI_SQUARE_LIMIT, counts

    def test_bench_reports_full_acceptance_from_the_engines_counters(
        self, served_full: ServedTiny, tmp_path: Path
    ) -> None:
        data, records, engine = _bench_spec_decode(served_full, tmp_path)
        spec = data["server_metrics"]["spec_decode"]
        assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] == FULL_K + 1
        assert spec["acceptance_by_position"] == [1.0] * FULL_K
        _assert_spec_decode_matches(spec, engine, FULL_K)
        drafts_per_request = spec["drafts"] / BENCH_REQUESTS
        assert data["mean_tokens_per_chunk"] >= BENCH_OUTPUT_LEN / (1 + drafts_per_request)
        for chunks in records:
            assert _whole_steps(chunks, FULL_K) and sum(chunks) == BENCH_OUTPUT_LEN, chunks


class TestPartialAcceptance:
    def test_partial_mtp_acceptance_is_what_the_model_predicts(self, served_partial: ServedTiny) -> None:
        before = _spec_counters(served_partial)
        for _ in range(3):
            _stream_chat(served_partial, max_tokens=48)
        after = _spec_counters(served_partial)
        predicted = simulate_greedy_speculation(ASSISTANT, 48, PARTIAL_K, "partial")
        measured = {name: after[name] - before[name] for name in SPEC_METRICS}
        rate = measured["num_accepted_tokens"] / measured["num_draft_tokens"]
        assert 0 < rate < 1
        # measured equal to the prediction for K = 1, 2, 3 (docs/TINY_MODELS.md); a draft more or less per request
        assert rate == pytest.approx(predicted.acceptance_rate, abs=0.03), (measured, predicted)
        assert measured["num_drafts"] == pytest.approx(3 * predicted.drafts, abs=3)
        for position in range(PARTIAL_K):
            accepted = after[f"position {position}"] - before.get(f"position {position}", 0)
            assert accepted == pytest.approx(3 * predicted.accepted_per_position[position], abs=3)

    def test_bench_reports_the_predicted_acceptance_from_the_engines_counters(
        self, served_partial: ServedTiny, tmp_path: Path
    ) -> None:
        data, _, engine = _bench_spec_decode(served_partial, tmp_path)
        spec = data["server_metrics"]["spec_decode"]
        _assert_spec_decode_matches(spec, engine, PARTIAL_K)
        predicted = simulate_greedy_speculation(ASSISTANT, BENCH_OUTPUT_LEN, PARTIAL_K, "partial")
        assert 0 < spec["acceptance_rate"] < 1
        assert spec["acceptance_rate"] == pytest.approx(predicted.acceptance_rate, abs=0.03), (spec, predicted)
        assert spec["drafts"] == pytest.approx(BENCH_REQUESTS * predicted.drafts, abs=BENCH_REQUESTS)
        predicted_length = 1 + predicted.accepted_tokens / predicted.drafts
        assert spec["mean_acceptance_length"] == pytest.approx(predicted_length, abs=0.1)
        for position in range(PARTIAL_K):
            rate = predicted.accepted_per_position[position] / predicted.drafts
            assert spec["acceptance_by_position"][position] == pytest.approx(rate, abs=0.05)
        # one chunk per step at most (merged steps make fewer): at least the step's mean tokens per chunk
        assert data["mean_tokens_per_chunk"] >= BENCH_OUTPUT_LEN / (1 + spec["drafts"] / BENCH_REQUESTS)


def _bench_spec_decode(served: ServedTiny, tmp_path: Path) -> tuple[dict[str, Any], list[list[int]], dict[str, float]]:
    """`deepserve bench` (the library's run) through the gateway: greedy chat, BENCH_REQUESTS requests of exactly
    BENCH_OUTPUT_LEN tokens, each chunk's token ids asked for. Its JSON result, each request's tokens per chunk,
    and the engine's own counters' growth over the run (read from the engine, not through the gateway)."""
    config = BenchConfig.model_validate(
        {
            "target": {"base_url": served.base_url, "endpoint": "/v1/chat/completions", "temperature": 0},
            "workload": {
                "dataset_name": "random",
                "random_input_len": 16,
                "random_output_len": BENCH_OUTPUT_LEN,
                "num_prompts": BENCH_REQUESTS,
                "ignore_eos": True,
            },
            "load": {"max_concurrency": 2, "num_warmups": 0},  # warm-ups would count in the server's figures
        }
    )
    before = _spec_counters(served)
    result = run_benchmark(config, display=False)
    after = _spec_counters(served)
    data = json.loads(save_result(result, tmp_path / "result.json").read_text())
    assert data["completed"] == BENCH_REQUESTS, data["errors_by_message"]
    assert data["total_output_tokens"] == BENCH_REQUESTS * BENCH_OUTPUT_LEN
    assert data["return_token_ids"]["sent"] is True and data["token_attribution"] == "exact"
    assert data["server_metrics"]["available"] is True, data["server_metrics"]["note"]
    assert data["server_metrics"]["spec_decode"]["source"] == "counters"
    grown = {name: after[name] - before.get(name, 0) for name in after}
    return data, [record.chunk_tokens for record in result.records], grown


def _whole_steps(chunks: list[int], k: int) -> bool:
    """Whether CHUNKS (tokens per streamed chunk) are whole engine steps of full acceptance: the prompt's step yields
    one token, each later one K+1 (the last may be cut by max_tokens). A chunk holds one step, or several that vLLM
    merged while its API server was behind (its RequestOutputCollector merges a request's outputs that wait to be
    sent, as on a busy machine), never part of one."""
    return chunks[0] % (k + 1) == 1 and all(count % (k + 1) == 0 for count in chunks[1:-1])


def _assert_spec_decode_matches(spec: dict[str, Any], engine: dict[str, float], k: int) -> None:
    """The bench's figures are the engine's counters differenced over the run, with vLLM's definitions."""
    assert spec["drafts"] == engine["num_drafts"] > 0
    assert spec["draft_tokens"] == engine["num_draft_tokens"]
    assert spec["accepted_tokens"] == engine["num_accepted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(engine["num_accepted_tokens"] / engine["num_draft_tokens"])
    assert spec["mean_acceptance_length"] == pytest.approx(1 + engine["num_accepted_tokens"] / engine["num_drafts"])
    by_position = [engine[f"position {position}"] / engine["num_drafts"] for position in range(k)]
    assert spec["acceptance_by_position"] == pytest.approx(by_position)


def _stream_chat(served: ServedTiny, max_tokens: int) -> tuple[list[int], str]:
    """Greedy chat: the tokens each streamed chunk carried, and the text."""
    body = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    chunks, text = [], ""
    with httpx.stream("POST", served.base_url + "/chat/completions", json=body, timeout=180) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice.get("token_ids"):
                    chunks.append(len(choice["token_ids"]))
                text += choice["delta"].get("content") or ""
    return chunks, text


def _spec_counters(served: ServedTiny) -> dict[str, float]:
    """vLLM's speculative-decoding counters, from the engine's own /metrics."""
    text = httpx.get(served.engine_url.removesuffix("/v1") + "/metrics", timeout=30).text
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_") or "_total" not in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
        if "position=" in name:
            key = "position " + name.split('position="')[1].split('"')[0]
        counters[key] = counters.get(key, 0) + float(value)
    return counters
