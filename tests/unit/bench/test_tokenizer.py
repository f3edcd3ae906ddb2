"""Token counting: the local Hugging Face path (tiny model's byte-level tokenizer) and the server path over HTTP
(httpx MockTransport answering in vLLM's /tokenize and /detokenize shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from deepserve.bench.tokenizer import (
    LocalTokenCounter,
    ServerTokenCounter,
    TokenCounter,
    TokenizerError,
    load_token_counter,
)
from deepserve.errors import ConfigError
from deepserve.models.tiny import write_tiny_model

BOS_ID, USER_ID, ASSISTANT_ID = 0, 259, 260  # the tiny tokenizer's <｜begin▁of▁sentence｜>, <｜User｜>, <｜Assistant｜>


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def local(tiny_dir: Path) -> LocalTokenCounter:
    return LocalTokenCounter.load(str(tiny_dir))


def test_local_counts_text_without_and_prompts_with_special_tokens(local: LocalTokenCounter) -> None:
    assert isinstance(local, TokenCounter)
    assert local.encode("héllo") == [107, 198, 172, 111, 111, 114]  # byte-level: é is two tokens
    assert local.count("héllo") == 6
    assert local.prompt_ids("héllo") == [BOS_ID, *local.encode("héllo")]
    assert local.decode(local.encode("a b\nc")) == "a b\nc"


def test_local_chat_prompt_is_the_rendered_template(local: LocalTokenCounter) -> None:
    ids = local.prompt_ids([{"role": "user", "content": "hi"}])
    assert ids == [BOS_ID, USER_ID, *local.encode("hi"), ASSISTANT_ID]


def test_render_chat_leaves_the_bos_to_the_server(local: LocalTokenCounter) -> None:
    text = local.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<｜User｜>hi<｜Assistant｜>"
    assert local.prompt_ids(text).count(BOS_ID) == 1


def test_vocab_pieces_are_printable_single_tokens_that_reencode(local: LocalTokenCounter) -> None:
    pieces = local.vocab_pieces()
    assert len(pieces) >= 90  # printable ASCII bytes
    for piece in pieces:
        assert piece.isascii() and piece.isprintable() and piece.strip()
        assert len(local.encode(piece)) == 1


def test_load_prefers_the_local_directory(tiny_dir: Path) -> None:
    counter = load_token_counter(str(tiny_dir), "http://127.0.0.1:9/v1", "m", None)
    assert counter.source == f"local:{tiny_dir.resolve()}"
    by_model = load_token_counter(None, "http://127.0.0.1:9/v1", str(tiny_dir), None)
    assert by_model.source.startswith("local:")
    # nothing listens on port 9: the counts cannot be compared with the server's, and the results say so
    assert isinstance(counter, LocalTokenCounter)
    assert counter.server_check is not None and counter.server_check.startswith("unverified (cannot reach")


def test_load_rejects_a_tokenizer_that_is_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a local directory"):
        load_token_counter(str(tmp_path / "missing"), "http://127.0.0.1:9/v1", "m", None)


def test_load_falls_back_to_the_server_and_says_how_to_fix_it() -> None:
    # port 9 (discard) on loopback: nothing listens, the connection is refused at once
    with pytest.raises(TokenizerError, match="--tokenizer"):
        load_token_counter(None, "http://127.0.0.1:9/v1", "m", None)


def _vllm_like(local: LocalTokenCounter, seen: list[tuple[str, dict]]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if body.get("model") != "tiny":
            message = f"The model `{body.get('model')}` does not exist. Valid aliases: tiny."
            error = {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
            return httpx.Response(404, json={"error": error})
        if request.url.path == "/tokenize":
            if "messages" in body:
                tokens = local.prompt_ids(body["messages"])
            else:
                tokens = (
                    local.prompt_ids(body["prompt"])
                    if body.get("add_special_tokens", True)
                    else local.encode(body["prompt"])
                )
            return httpx.Response(
                200, json={"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}
            )
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": local.decode(body["tokens"])})
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


def test_server_counter_speaks_vllms_tokenize_api(local: LocalTokenCounter) -> None:
    seen: list[tuple[str, dict]] = []
    server = ServerTokenCounter("http://127.0.0.1:8000/v1", "tiny", None, transport=_vllm_like(local, seen))
    assert server.source == "server:http://127.0.0.1:8000/tokenize"
    assert server.encode("ab") == local.encode("ab")
    assert server.prompt_ids("ab") == local.prompt_ids("ab")
    chat = [{"role": "user", "content": "ab"}]
    assert server.prompt_ids(chat) == local.prompt_ids(chat)
    assert server.decode([100, 101]) == "ab"
    assert server.vocab_pieces() is None
    assert seen[0] == ("/tokenize", {"model": "tiny", "prompt": "ab", "add_special_tokens": False})
    assert seen[2] == ("/tokenize", {"model": "tiny", "messages": chat, "add_generation_prompt": True})
    assert seen[3] == ("/detokenize", {"model": "tiny", "tokens": [100, 101]})


def test_server_errors_carry_the_servers_message(local: LocalTokenCounter) -> None:
    server = ServerTokenCounter("http://127.0.0.1:8000/v1", "wrong", None, transport=_vllm_like(local, []))
    with pytest.raises(TokenizerError, match=r"HTTP 404: The model `wrong` does not exist"):
        server.check()


def test_server_answer_that_is_not_json_is_a_clear_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text="<html>hi</html>"))
    server = ServerTokenCounter("http://127.0.0.1:8000", "m", None, transport=transport)
    with pytest.raises(TokenizerError, match="not JSON"):
        server.encode("x")


def test_server_sends_the_api_key() -> None:
    headers: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"count": 1, "max_model_len": 8, "tokens": [5]})

    server = ServerTokenCounter("http://127.0.0.1:8000/v1", "m", "sk-test", transport=httpx.MockTransport(handle))
    assert server.count("x") == 1
    assert headers == ["Bearer sk-test"]


@pytest.mark.parametrize("name", ["deepserve/tiny-deepseek-v3", "tiny"])
def test_the_tiny_model_needs_no_tokenize_endpoint(name: str) -> None:
    """deepserve's gateway does not serve /tokenize; the tiny model's tokenizer is generated locally instead."""
    counter = load_token_counter(None, "http://127.0.0.1:9/v1", name, None)
    assert isinstance(counter, LocalTokenCounter)
    assert counter.source.startswith("local:") and "tiny-deepseek-v3" in counter.source
    assert counter.server_check is not None and counter.server_check.startswith("unverified (cannot reach")
    assert counter.prompt_ids("ab") == [BOS_ID, 100, 101]
