from __future__ import annotations

import json

import pytest

from deepserve.gateway.errors import InvalidRequest, ModelNotFound, NoHealthyUpstream
from deepserve.gateway.validation import CHAT_COMPLETIONS, COMPLETIONS, ApiRoute, parse_request, resolve_model

MODELS = {"m": 1000}


def chat(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], **fields}).encode()


def test_valid_body_is_forwarded_as_the_same_bytes() -> None:
    raw = chat(max_tokens=5, temperature=0.5)
    parsed = parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert parsed.body is raw
    assert parsed.model == "m" and parsed.max_tokens == 5 and not parsed.stream


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (chat(max_tokens="5"), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(temperature=3), "temperature"),
        (chat(stream="yes"), "stream"),
        (chat(best_of_everything=1), "best_of_everything"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        (chat(max_tokens=1000), "max_tokens"),
        (json.dumps({"model": "m"}).encode(), "messages"),
        (json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode(), "messages"),
        (json.dumps({"model": 5, "messages": [{"role": "user"}]}).encode(), "model"),
    ],
)
def test_bad_requests_are_400_with_the_param(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert caught.value.status == 400
    assert caught.value.param == param
    body = json.loads(caught.value.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404_listing_the_models() -> None:
    with pytest.raises(ModelNotFound) as caught:
        parse_request(CHAT_COMPLETIONS, chat(model="gpt-9"), MODELS, {"alias": "m"})
    assert caught.value.status == 404
    assert "m" in caught.value.message and "alias" in caught.value.message


def test_completion_prompt_forms() -> None:
    for prompt in ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]]:
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        assert parse_request(COMPLETIONS, raw, MODELS, {}).body is raw
    with pytest.raises(InvalidRequest):
        parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": [1, "a"]}).encode(), MODELS, {})
    with pytest.raises(InvalidRequest):  # a chat field on the completions endpoint
        parse_request(COMPLETIONS, json.dumps({"model": "m", "prompt": "x", "tools": []}).encode(), MODELS, {})


def test_alias_is_the_only_change_to_the_body() -> None:
    raw = chat(model="fast", max_tokens=3, top_k=5)
    parsed = parse_request(CHAT_COMPLETIONS, raw, MODELS, {"fast": "m"})
    forwarded = json.loads(parsed.body)
    assert forwarded == {**json.loads(raw), "model": "m"}
    assert parsed.client_model == "fast" and parsed.model == "m"


def test_stream_asks_for_usage_only_when_the_client_did_not() -> None:
    parsed = parse_request(CHAT_COMPLETIONS, chat(stream=True), MODELS, {})
    assert parsed.strip_usage_chunk
    assert json.loads(parsed.body)["stream_options"] == {"include_usage": True}
    raw = chat(stream=True, stream_options={"include_usage": True})
    asked = parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert not asked.strip_usage_chunk and asked.body is raw


def test_charge_is_prompt_estimate_plus_max_tokens() -> None:
    raw = json.dumps({"model": "m", "prompt": "x" * 400, "max_tokens": 50}).encode()
    parsed = parse_request(COMPLETIONS, raw, MODELS, {})
    assert parsed.prompt_tokens_estimate == 100
    assert parsed.charged_tokens == 150


def test_unknown_context_length_skips_the_check() -> None:
    parse_request(CHAT_COMPLETIONS, chat(max_tokens=10**6), {"m": None}, {})


def test_one_resolve_function_maps_aliases_and_names_the_valid_models() -> None:
    models, aliases = {"tiny": 4096, "big": None}, {"t": "tiny", "gone": "missing"}
    assert resolve_model("tiny", models, aliases) == "tiny"
    assert resolve_model("t", models, aliases) == "tiny"
    for unknown in ("nope", "gone"):
        with pytest.raises(ModelNotFound, match="available: big, gone, t, tiny"):
            resolve_model(unknown, models, aliases)
    with pytest.raises(NoHealthyUpstream):  # nobody is up to say what is served: not the client's mistake
        resolve_model("tiny", {}, aliases)


# ---- malformed bodies: always a 4xx in OpenAI's shape, never an exception of another kind ----------------------


def deep(depth: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()[:-1] + (
        b', "metadata": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
    )


@pytest.mark.parametrize(
    ("endpoint", "raw", "param"),
    [
        (COMPLETIONS, b'{"model": "m", "prompt": null}', "prompt"),
        (CHAT_COMPLETIONS, b'{"model": "m", "messages": null}', "messages"),
        (CHAT_COMPLETIONS, b'{"model": null, "messages": [{"role": "user"}]}', "model"),
        (CHAT_COMPLETIONS, b'{"model": "m", "messages": "hello"}', "messages"),
        (COMPLETIONS, b'{"model": "m", "prompt": {"text": "x"}}', "prompt"),
    ],
)
def test_null_or_mistyped_required_fields_are_400(endpoint: ApiRoute, raw: bytes, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(endpoint, raw, MODELS, {})
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (deep(100_000), "nested too deeply"),  # beyond the decoder's stack
        (deep(500), "more than 100 deep"),  # decodable, but re-encoding it could exhaust the stack
        (chat(stream=True)[:-1] + b', "user": "\\ud800"}', "lone UTF-16 surrogate"),  # re-encoded: stream usage
        (chat()[:-1] + b', "user": "\\uDC00x"}', "lone UTF-16 surrogate"),  # forwarded as is
        (chat()[:-1] + b', "temperature": NaN}', "NaN is not a JSON value"),
        (chat()[:-1] + b', "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (chat().replace(b"hello", b"h\xc3\x28llo"), "not UTF-8"),
        (chat().replace(b"hello", b"\xed\xa0\x80"), "not UTF-8"),  # a surrogate encoded as UTF-8 bytes
        (json.dumps({"model": "m", "messages": [{"role": "user"}]}).encode("utf-16"), "not UTF-8"),
    ],
)
def test_bodies_that_cannot_be_forwarded_are_400(raw: bytes, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as caught:
        parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert caught.value.status == 400
    json.loads(caught.value.body())  # the answer itself is valid JSON


def test_a_complete_surrogate_pair_and_a_byte_order_mark_are_fine() -> None:
    raw = b"\xef\xbb\xbf" + chat(stream=True)[:-1] + b', "user": "\\ud83d\\ude00"}'
    parsed = parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert json.loads(parsed.body)["user"] == "\U0001f600"


def test_null_optional_fields_mean_absent() -> None:
    raw = chat(max_completion_tokens=None, max_tokens=7, stream_options=None)
    parsed = parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert parsed.max_tokens == 7


def test_errors_quote_a_bounded_value_and_the_ledger_copy_quotes_none() -> None:
    secret = "my secret prompt " * 1000
    with pytest.raises(InvalidRequest) as caught:
        parse_request(CHAT_COMPLETIONS, chat(max_tokens=secret), MODELS, {})
    assert len(caught.value.message) < 300
    assert "secret" not in caught.value.ledger_text() and "max_tokens" in caught.value.ledger_text()
    with pytest.raises(InvalidRequest) as caught:
        parse_request(CHAT_COMPLETIONS, chat(**{secret: 1}), MODELS, {})
    assert len(caught.value.message) < 300 and "secret" not in caught.value.ledger_text()
    with pytest.raises(ModelNotFound) as not_found:
        parse_request(CHAT_COMPLETIONS, chat(model=secret), MODELS, {})
    assert len(not_found.value.message) < 300 and "secret" not in not_found.value.ledger_text()


def test_a_streams_usage_option_is_spliced_into_the_clients_bytes() -> None:
    """The gateway asks every stream for its usage; the option goes in front of the client's own bytes instead of
    re-encoding the whole body (which cost more than the rest of the validation)."""
    raw = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "x \\u00e9"}]}'
    parsed = parse_request(CHAT_COMPLETIONS, raw, MODELS, {})
    assert parsed.body == b'{"stream_options":{"include_usage":true},' + raw[1:]
    assert json.loads(parsed.body)["stream_options"] == {"include_usage": True} and parsed.strip_usage_chunk
    with_bom = parse_request(CHAT_COMPLETIONS, b"\xef\xbb\xbf" + raw, MODELS, {}).body
    assert not with_bom.startswith(b"\xef\xbb\xbf") and json.loads(with_bom)["stream_options"]["include_usage"]
    asked = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert json.loads(parse_request(CHAT_COMPLETIONS, asked, MODELS, {}).body)["stream_options"] == {
        "continuous_usage_stats": True,
        "include_usage": True,
    }
