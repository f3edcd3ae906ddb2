"""Property test: whatever body a client sends, validation either accepts it (and what is forwarded is valid UTF-8
JSON) or refuses it with a 4xx in OpenAI's shape. Nothing else may come out of it: anything else is a 500."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from deepserve.gateway.errors import GatewayError
from deepserve.gateway.validation import CHAT_COMPLETIONS, COMPLETIONS, ApiRoute, parse_request

MODELS = {"m": 1000}
ALIASES = {"alias": "m"}

# Text with what breaks encoders: lone surrogates, NUL, non-BMP characters.
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["\ud800", "\udfff", "a\ud83d", "\x00", "\U0001f600", "m", "alias", "user", "assistant"]
)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | texts
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n",
          "temperature", "stop", "logit_bias", "tools", "user", "seed"]  # fmt: skip
messages = st.lists(st.fixed_dictionaries({"role": texts}, optional={"content": values}), max_size=3)
bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "model": st.sampled_from(["m", "alias", "other"]) | values,
            "messages": messages | values,
            "prompt": values,
            "stream": st.booleans() | values,
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | values,
            **{name: values for name in FIELDS[5:]},
        },
    )
    | st.dictionaries(st.sampled_from(FIELDS) | texts, values, max_size=6)
    | values
)


def _encode(body: Any) -> bytes:
    """BODY as a client could send it: JSON text (lone surrogates as \\u escapes, NaN as Python writes it)."""
    return json.dumps(body, ensure_ascii=True).encode()


def _check(endpoint: ApiRoute, raw: bytes) -> None:
    try:
        parsed = parse_request(endpoint, raw, MODELS, ALIASES)
    except GatewayError as exc:
        assert 400 <= exc.status < 500, exc
        error = json.loads(exc.body())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        exc.ledger_text().encode("utf-8")  # the ledger can always store it
        return
    forwarded = json.loads(parsed.body.decode("utf-8"))  # what goes upstream is UTF-8 JSON
    assert forwarded["model"] == "m"


@settings(max_examples=200, database=None, deadline=None)
@given(body=bodies, chat=st.booleans())
def test_any_json_body_is_accepted_or_a_4xx(body: Any, chat: bool) -> None:
    _check(CHAT_COMPLETIONS if chat else COMPLETIONS, _encode(body))


@settings(max_examples=150, database=None, deadline=None)
@given(raw=st.binary(max_size=64) | st.builds(lambda body, cut: _encode(body)[:cut], bodies, st.integers(0, 40)))
def test_any_bytes_are_accepted_or_a_4xx(raw: bytes) -> None:
    _check(CHAT_COMPLETIONS, raw)
