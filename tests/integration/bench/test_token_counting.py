"""Every dataset against any OpenAI-compatible server: exact prompt lengths through the server's /tokenize and
/detokenize where both exist, through /tokenize alone where /detokenize answers 404 (SGLang's shape), through a local
tokenizer, else by the stated approximation, checked against the server's usage; each run says which. The simulator
counts with the tiny model's tokenizer, so a local copy of it checks every length."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.output import console_block
from deepserve.bench.runner import run_benchmark
from deepserve.bench.tokenizer import LocalTokenCounter, TokenizerError, TokenizerOptions, load_token_counter
from deepserve.bench.workloads import WorkloadConfig, build_workload
from deepserve.models.tiny import write_tiny_model
from tests.helpers import simulator_thread

pytestmark = pytest.mark.timeout(120)
TRACE = Path(__file__).parents[2] / "fixtures" / "traces" / "mooncake_small.jsonl"
RANDOM = {"dataset_name": "random", "num_prompts": 6, "random_input_len": 120, "random_range_ratio": 0.5}
MOONCAKE = {"dataset_name": "mooncake", "dataset_path": str(TRACE), "trace_block_size": 16, "trace_time_scale": 0.01}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenCounter:
    path: Path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path)
    return LocalTokenCounter.load(str(path))


def bench(root_url: str, workload: dict, endpoint: str = "/v1/completions", **extra) -> dict:
    config = BenchConfig.model_validate(
        {
            "target": {"base_url": root_url, "endpoint": endpoint},
            "workload": {**workload, **extra},
            "load": {"max_concurrency": 4},
            "output": {"save_detailed": True},
        }
    )
    result = run_benchmark(config, display=False)
    data = result.to_json()
    assert data["failed"] == 0, data["errors_by_message"]
    data["console"] = console_block(result)
    return data


@pytest.mark.parametrize("workload", [RANDOM, MOONCAKE], ids=["random", "mooncake"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_without_detokenize_lengths_stay_exact_through_tokenize(workload, endpoint, tiny):
    """/detokenize answers 404: prompts are cut at words and measured again, so every length is still exact."""
    with simulator_thread(detokenize_endpoint=False) as server:
        counter = load_token_counter(None, server.root_url, "fake-model", None)
        built = build_workload(WorkloadConfig.model_validate(workload), counter, endpoint.endswith("chat/completions"))
        data = bench(server.root_url, workload, endpoint)
    assert all(len(tiny.prompt_ids(spec.prompt)) == spec.prompt_len for spec in built.requests)
    counting = data["token_counting"]
    assert (counting["method"], counting["exact"]) == ("server-tokenize-only", True)
    assert "without /detokenize" in counting["check"]
    assert "Prompt lengths: exact, by the server's /tokenize (it has no /detokenize" in data["console"]
    assert sorted(data["input_lens"]) == sorted(spec.prompt_len for spec in built.requests)  # the server's usage


@pytest.mark.parametrize("workload", [RANDOM, MOONCAKE], ids=["random", "mooncake"])
def test_without_tokenize_the_approximation_is_stated_and_checked_against_the_servers_usage(workload):
    with simulator_thread(tokenize_endpoints=False) as server:
        data = bench(server.root_url, workload)
    counting = data["token_counting"]
    assert (counting["method"], counting["exact"]) == ("approximate", False)
    # The simulator's byte-level tokenizer counts a common word as its bytes: the check says so, in numbers.
    assert "server tokens per word" in counting["check"] and "1 template tokens" in counting["check"]
    assert "Prompt lengths: APPROXIMATE: one token per common English word" in data["console"]
    assert data["completed"] == data["num_prompts"] and data["total_input_tokens"] > 0  # measured by usage


def test_a_local_tokenizer_when_the_server_cannot_count(tiny):
    with simulator_thread(tokenize_endpoints=False) as server:
        data = bench(server.root_url, RANDOM, tokenizer=tiny.source.removeprefix("local:"))
    assert data["token_counting"]["method"] == "local" and data["token_counting"]["check"].startswith("unverified")
    built = build_workload(WorkloadConfig.model_validate(RANDOM), tiny, chat=False)
    assert sorted(data["input_lens"]) == sorted(spec.prompt_len for spec in built.requests)  # the server's usage
    assert data["console"].count("Prompt lengths: exact, by a local tokenizer") == 1


def test_exact_prompt_lengths_refuse_the_approximation():
    with simulator_thread(tokenize_endpoints=False) as server:
        options = TokenizerOptions(endpoint_url=server.root_url + "/v1/completions", exact_lengths=True)
        with pytest.raises(TokenizerError, match=r"/tokenize answered HTTP 404.*pass --tokenizer DIR"):
            load_token_counter(None, server.root_url, "fake-model", None, options)
