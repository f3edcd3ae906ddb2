"""Workloads counted by a server's /tokenize: a loopback fake that answers exactly as vLLM 0.32's
entrypoints/serve/tokenize does (TokenizeCompletionRequest / TokenizeChatRequest → TokenizeResponse,
DetokenizeRequest → DetokenizeResponse, OpenAI-shaped errors), tokenizing with the tiny model's real tokenizer."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deepserve.bench.tokenizer import LocalTokenCounter, ServerTokenCounter, TokenizerError, load_token_counter
from deepserve.bench.workloads import WorkloadConfig, build_workload
from deepserve.models.tiny import write_tiny_model

MODEL = "deepseek-v3-tiny"
API_KEY = "sk-bench"
MAX_MODEL_LEN = 4096


def _error(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class FakeVLLMTokenizer(BaseHTTPRequestHandler):
    tokenizer: LocalTokenCounter
    calls: list[str]
    double_bos = False  # a server whose tokenizer adds one more BOS than ours: must be caught

    def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:
        self.calls.append(self.path)
        if self.headers.get("Authorization") != f"Bearer {API_KEY}":
            return self._send(401, _error("Unauthorized", "AuthenticationError", 401))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("model") not in (None, MODEL):
            message = f"The model `{body['model']}` does not exist. Valid aliases: {MODEL}."
            return self._send(404, _error(message, "NotFoundError", 404, "model"))
        if self.path == "/tokenize":
            return self._tokenize(body)
        if self.path == "/detokenize":
            return self._send(200, {"prompt": self.tokenizer.decode(body["tokens"])})
        return self._send(404, {"detail": "Not Found"})

    def _tokenize(self, body: dict) -> None:
        if "messages" in body:  # TokenizeChatRequest: add_generation_prompt defaults to True
            tokens = self.tokenizer.prompt_ids(body["messages"])
        elif "prompt" in body:  # TokenizeCompletionRequest: add_special_tokens defaults to True
            add_special = body.get("add_special_tokens", True)
            prompt = body["prompt"]
            tokens = self.tokenizer.prompt_ids(prompt) if add_special else self.tokenizer.encode(prompt)
            tokens = tokens[:1] + tokens if self.double_bos and add_special else tokens
        else:
            return self._send(400, _error("Field required: prompt", "BadRequestError", 400))
        self._send(200, {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenCounter:
    path: Path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path)
    return LocalTokenCounter.load(str(path))


@pytest.fixture
def server(tiny: LocalTokenCounter, request) -> Iterator[tuple[str, list[str]]]:
    calls: list[str] = []
    double_bos = getattr(request, "param", False)
    handler = type("Handler", (FakeVLLMTokenizer,), {"tokenizer": tiny, "calls": calls, "double_bos": double_bos})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", calls
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_workload_built_through_tokenize_is_exact(server, tiny: LocalTokenCounter, chat: bool) -> None:
    base_url, calls = server
    counter = load_token_counter(None, base_url, MODEL, API_KEY)
    assert isinstance(counter, ServerTokenCounter)
    config = WorkloadConfig(num_prompts=12, random_input_len=200, random_range_ratio=0.5, random_prefix_len=16)
    workload = build_workload(config, counter, chat)
    assert workload.tokenizer_source == f"{base_url.removesuffix('/v1')}/tokenize".replace("http", "server:http", 1)
    assert workload.definition["text_source"] == "pseudo_words"
    for spec in workload.requests:
        assert len(tiny.prompt_ids(spec.prompt)) == spec.prompt_len  # the server's own count, checked locally
    assert "/detokenize" in calls  # trimming to the exact count went through the server's detokenizer
    assert all(path in ("/tokenize", "/detokenize") for path in calls)  # at the root, not under /v1


def test_server_and_local_tokenizers_give_the_same_lengths(server, tiny: LocalTokenCounter) -> None:
    """Which tokenizer builds the text differs (pseudo-words vs the vocabulary), the lengths drawn do not."""
    config = WorkloadConfig(dataset_name="sampled", num_prompts=6, sampled_min_input_len=10, sampled_max_input_len=900)
    remote = build_workload(config, load_token_counter(None, server[0], MODEL, API_KEY), chat=False)
    local = build_workload(config, tiny, chat=False)
    assert [s.prompt_len for s in remote.requests] == [s.prompt_len for s in local.requests]


def test_wrong_model_is_reported_with_the_servers_words(server) -> None:
    with pytest.raises(TokenizerError, match="does not exist. Valid aliases: deepseek-v3-tiny.*--tokenizer"):
        load_token_counter(None, server[0], "gpt-4", API_KEY)


def test_missing_api_key_is_a_401(server) -> None:
    with pytest.raises(TokenizerError, match="HTTP 401: Unauthorized"):
        load_token_counter(None, server[0], MODEL, None)


def test_a_local_tokenizer_is_checked_against_the_server(server, tiny: LocalTokenCounter) -> None:
    local_dir = tiny.source.removeprefix("local:")
    counter = load_token_counter(local_dir, server[0], MODEL, API_KEY)
    assert isinstance(counter, LocalTokenCounter)
    assert counter.server_check == f"matches {counter_source(server[0])}"
    workload = build_workload(WorkloadConfig(num_prompts=2, random_input_len=20), counter, chat=False)
    assert workload.definition["tokenizer_check"] == counter.server_check
    assert workload.definition["text_source"] == "vocab"


@pytest.mark.parametrize("server", [True], indirect=True, ids=["server-adds-a-second-bos"])
def test_a_local_tokenizer_that_counts_differently_is_refused(server, tiny: LocalTokenCounter) -> None:
    local_dir = tiny.source.removeprefix("local:")
    with pytest.raises(
        TokenizerError,
        match=r"does not count like the server.* is 63 tokens here and 64 there \(first difference at token 1\)",
    ):
        load_token_counter(local_dir, server[0], MODEL, API_KEY)


def counter_source(base_url: str) -> str:
    return "server:" + base_url.removesuffix("/v1") + "/tokenize"
