"""Workloads on real vLLM (tiny model): the prompt length a workload claims is the `usage.prompt_tokens` vLLM
reports, on both endpoints, whether the prompts were measured with vLLM's own /tokenize or with the local
tokenizer; and ignore_eos / min_tokens give exactly the output length asked for. Bounded: 16 short requests."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from deepserve.bench.tokenizer import LocalTokenCounter, ServerTokenCounter, load_token_counter
from deepserve.bench.types import RequestSpec
from deepserve.bench.workloads import WorkloadConfig, build_workload
from deepserve.models.tiny import write_tiny_model
from tests.e2e.conftest import ServedTiny


def _send(client: httpx.Client, served: ServedTiny, spec: RequestSpec, chat: bool) -> dict:
    body: dict = {"model": served.model, "max_tokens": spec.output_len, "temperature": 0}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.min_output_len:
        body["min_tokens"] = spec.min_output_len
    if chat:
        body["messages"] = spec.prompt
    else:
        body["prompt"] = spec.prompt
    response = client.post(served.base_url + ("/chat/completions" if chat else "/completions"), json=body)
    response.raise_for_status()
    return response.json()["usage"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("source", ["vllm-tokenize", "local"])
def test_prompt_tokens_are_what_the_workload_says(
    served_tiny: ServedTiny, tmp_path: Path, source: str, chat: bool
) -> None:
    if source == "local":
        write_tiny_model(tmp_path / "tiny")
        # checked against the engine's /tokenize (the gateway in front has none)
        counter = load_token_counter(str(tmp_path / "tiny"), served_tiny.engine_url, served_tiny.model, None)
        assert isinstance(counter, LocalTokenCounter)
        assert counter.server_check is not None and counter.server_check.startswith("matches")
    else:
        counter = load_token_counter(None, served_tiny.engine_url, served_tiny.model, None)
        assert isinstance(counter, ServerTokenCounter)
    random = WorkloadConfig(
        num_prompts=2,
        random_input_len=120,
        random_range_ratio=0.5,
        random_prefix_len=10,
        random_output_len=3,
        ignore_eos=True,
        seed=3,
    )
    shared = WorkloadConfig(
        dataset_name="shared_prefix",
        num_prompts=2,
        random_input_len=200,
        shared_prefix_len=150,
        min_output_len=2,
        max_output_len=4,
        exact_output_len=True,
    )
    with httpx.Client(timeout=120) as client:
        for config in (random, shared):
            for spec in build_workload(config, counter, chat).requests:
                usage = _send(client, served_tiny, spec, chat)
                assert usage["prompt_tokens"] == spec.prompt_len
                assert usage["completion_tokens"] == spec.output_len
