"""Workloads counted by a server's /tokenize: the simulator, which answers as vLLM 0.32's entrypoints/serve/tokenize
does (TokenizeCompletionRequest / TokenizeChatRequest → TokenizeResponse, DetokenizeRequest → DetokenizeResponse,
OpenAI-shaped errors) with the tiny model's token ids and chat template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve.bench.tokenizer import LocalTokenCounter, ServerTokenCounter, TokenizerError, load_token_counter
from deepserve.bench.workloads import WorkloadConfig, build_workload
from deepserve.models.tiny import write_tiny_model
from deepserve.simulate.thread import SimulatorThread
from tests.helpers import simulator_thread

MODEL = "deepseek-v3-tiny"
API_KEY = "sk-bench"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenCounter:
    path: Path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path)
    return LocalTokenCounter.load(str(path))


@pytest.fixture
def server() -> Iterator[SimulatorThread]:
    with simulator_thread(model=MODEL, api_key=API_KEY) as simulator:
        yield simulator


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_workload_built_through_tokenize_is_exact(server, tiny: LocalTokenCounter, chat: bool) -> None:
    counter = load_token_counter(None, server.base_url, MODEL, API_KEY)
    assert isinstance(counter, ServerTokenCounter)
    config = WorkloadConfig(num_prompts=12, random_input_len=200, random_range_ratio=0.5, random_prefix_len=16)
    workload = build_workload(config, counter, chat)
    assert workload.tokenizer_source == counter_source(server.base_url)
    assert workload.definition["text_source"] == "pseudo_words"
    for spec in workload.requests:
        assert len(tiny.prompt_ids(spec.prompt)) == spec.prompt_len  # the server's own count, checked locally
    stats = server.call(lambda: server.app.stats)
    assert stats.tokenize_calls > 0
    assert stats.detokenize_calls > 0  # trimming to the exact count went through the server's detokenizer


def test_server_and_local_tokenizers_give_the_same_lengths(server, tiny: LocalTokenCounter) -> None:
    """Which tokenizer builds the text differs (pseudo-words vs the vocabulary), the lengths drawn do not."""
    config = WorkloadConfig(dataset_name="sampled", num_prompts=6, sampled_min_input_len=10, sampled_max_input_len=900)
    remote = build_workload(config, load_token_counter(None, server.base_url, MODEL, API_KEY), chat=False)
    local = build_workload(config, tiny, chat=False)
    assert [s.prompt_len for s in remote.requests] == [s.prompt_len for s in local.requests]


def test_wrong_model_is_reported_with_the_servers_words(server) -> None:
    with pytest.raises(TokenizerError, match="does not exist. Valid aliases: deepseek-v3-tiny.*--tokenizer"):
        load_token_counter(None, server.base_url, "gpt-4", API_KEY)


def test_a_local_tokenizer_is_checked_against_the_server(server, tiny: LocalTokenCounter) -> None:
    local_dir = tiny.source.removeprefix("local:")
    counter = load_token_counter(local_dir, server.base_url, MODEL, API_KEY)
    assert isinstance(counter, LocalTokenCounter)
    assert counter.server_check == f"matches {counter_source(server.base_url)}"
    workload = build_workload(WorkloadConfig(num_prompts=2, random_input_len=20), counter, chat=False)
    assert workload.definition["tokenizer_check"] == counter.server_check
    assert workload.definition["text_source"] == "vocab"


def test_a_local_tokenizer_that_counts_differently_is_refused(server, tiny: LocalTokenCounter, tmp_path: Path) -> None:
    """A local tokenizer that adds one more BOS than the server's (63 tokens there, 64 here) must be caught."""
    local_dir = tmp_path / "double-bos"
    shutil.copytree(tiny.source.removeprefix("local:"), local_dir)
    tokenizer = json.loads((local_dir / "tokenizer.json").read_text())
    single = tokenizer["post_processor"]["single"]
    single.insert(0, single[0])  # the BOS twice before the text
    (local_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(
        TokenizerError,
        match=r"does not count like the server.* is 64 tokens here and 63 there \(first difference at token 1\)",
    ):
        load_token_counter(str(local_dir), server.base_url, MODEL, API_KEY)


def counter_source(base_url: str) -> str:
    return "server:" + base_url.removesuffix("/v1") + "/tokenize"
