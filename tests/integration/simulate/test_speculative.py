"""Speculative decoding in the simulator over loopback: chunks of accepted drafts plus one token, as vLLM streams
them, and vLLM's spec-decode counters, differenced over the requests sent."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve.engines import vllm_metrics as names
from deepserve.simulate.fixed import FAKE_MODEL, fixed_timing
from deepserve.simulate.server import SimulatorServer, running_simulator

pytestmark = pytest.mark.timeout(120)


def speculating(tokens: int, acceptance: str, **options: Any) -> AbstractAsyncContextManager[SimulatorServer]:
    """Engine steps of 2 ms (time_scale 0.5: 1 ms of wall time) with TOKENS drafts a step."""
    deployment, config = fixed_timing(
        step_ms=2, engine={"num_speculative_tokens": tokens}, spec_acceptance=acceptance, time_scale=0.5, **options
    )
    return running_simulator(deployment, config)


async def stream_chunks(server: SimulatorServer, max_tokens: int) -> list[list[int]]:
    """The token ids of each streamed chunk of one completion."""
    body = {
        "model": FAKE_MODEL, "prompt": "spec", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
        "return_token_ids": True,
    }  # fmt: skip
    chunks: list[list[int]] = []
    async with httpx.AsyncClient() as http, http.stream("POST", server.base_url + "/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["token_ids"])
    return chunks


async def spec_counters(server: SimulatorServer) -> dict[str, float]:
    """The spec-decode counters in /metrics, read with Prometheus' own parser (positions as pos0, pos1, ...)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(server.root_url + "/metrics")).text
    wanted = (
        names.SPEC_DECODE_DRAFTS, names.SPEC_DECODE_DRAFT_TOKENS, names.SPEC_DECODE_ACCEPTED_TOKENS,
    )  # fmt: skip
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = sample.value
            elif sample.name == names.SPEC_DECODE_ACCEPTED_PER_POSITION:
                values[f"pos{sample.labels[names.SPEC_DECODE_POSITION_LABEL]}"] = sample.value
    return values


def differenced(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


async def test_every_draft_accepted_streams_k_plus_one_tokens_a_chunk() -> None:
    async with speculating(3, "1.0") as server:
        before = await spec_counters(server)
        chunks = await stream_chunks(server, 18)
        counted = differenced(await spec_counters(server), before)
    sizes = [len(chunk) for chunk in chunks]
    # the prompt's step samples one token; each later step verifies 3 drafts, all accepted: 4 tokens; the last
    # step's output stops at max_tokens (vLLM counts what the sampler accepted, before the stop)
    assert sizes == [1, 4, 4, 4, 4, 1]
    assert sum(sizes) == 18
    assert counted[names.SPEC_DECODE_DRAFTS] == 5
    assert counted[names.SPEC_DECODE_DRAFT_TOKENS] == 15
    assert counted[names.SPEC_DECODE_ACCEPTED_TOKENS] == 15
    assert (counted["pos0"], counted["pos1"], counted["pos2"]) == (5, 5, 5)


async def test_no_draft_accepted_streams_one_token_a_step() -> None:
    async with speculating(2, "0.0") as server:
        before = await spec_counters(server)
        chunks = await stream_chunks(server, 6)
        counted = differenced(await spec_counters(server), before)
    assert [len(chunk) for chunk in chunks] == [1] * 6
    assert counted[names.SPEC_DECODE_DRAFTS] == 5  # every step after the first verified drafts
    assert counted[names.SPEC_DECODE_ACCEPTED_TOKENS] == 0
    assert counted[names.SPEC_DECODE_DRAFT_TOKENS] == 10


async def test_measured_acceptance_per_position_is_the_one_asked_for() -> None:
    """vLLM's per-position rate, accepted_per_pos / drafts, over many verifications comes out as given; the draws
    are seeded, so the same run gives the same counts."""
    runs = []
    for _ in range(2):
        async with speculating(3, "0.8,0.6,0.4", spec_seed=7) as server:
            for _ in range(8):
                await stream_chunks(server, 240)
            runs.append(await spec_counters(server))
    assert runs[0] == runs[1]
    counted = runs[0]
    drafts = counted[names.SPEC_DECODE_DRAFTS]
    assert drafts > 500
    rates = [counted[f"pos{position}"] / drafts for position in range(3)]
    assert rates == pytest.approx([0.8, 0.6, 0.4], abs=0.05)
    mean_length = 1 + counted[names.SPEC_DECODE_ACCEPTED_TOKENS] / drafts
    assert mean_length == pytest.approx(2.8, abs=0.1)


async def test_stream_interval_gathers_outputs_as_vllm_does() -> None:
    """With --stream-interval 5 vLLM sends the first token at once, then what has gathered once it is 5 or more."""
    async with speculating(3, "1.0", tokens_per_chunk=5) as server:
        chunks = await stream_chunks(server, 18)
    assert [len(chunk) for chunk in chunks] == [1, 8, 8, 1]


async def test_without_speculation_there_are_no_spec_decode_series() -> None:
    deployment, config = fixed_timing(step_ms=2, time_scale=0.5)
    async with running_simulator(deployment, config) as server:
        assert await spec_counters(server) == {}
        assert [len(chunk) for chunk in await stream_chunks(server, 3)] == [1, 1, 1]
