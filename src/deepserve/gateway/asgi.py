"""The ASGI plumbing the gateway's app stands on, apart from what it does with a request: the message types, the
headers it reads, the request body read within a limit (with the body timeout and the client's disconnect told
apart), and whole JSON answers and OpenAI-shaped errors."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

from deepserve.gateway.connections import BODY_TIMEOUT_SCOPE_KEY
from deepserve.gateway.errors import BodyTooLarge, ClientGone, GatewayError, RequestTimeout

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# The gateway's own server's send without waiting (http_server.SEND_NOW_SCOPE_KEY): False, nothing sent, when the
# client's connection pushes back and the caller must await send instead.
SendNow = Callable[[Message], bool]
App = Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]]

JSON_HEADER = (b"content-type", b"application/json")


class RequestHeaders:
    """The request headers the proxied routes read, found in one pass."""

    __slots__ = ("authorization", "content_length", "session")

    def __init__(self) -> None:
        self.authorization: bytes | None = None
        self.content_length: int | None = None
        self.session: str | None = None


def request_headers(scope: Scope, session_header: bytes) -> RequestHeaders:
    found = RequestHeaders()
    for name, value in scope["headers"]:
        if name == b"authorization":
            found.authorization = value
        elif name == b"content-length":
            with contextlib.suppress(ValueError):
                found.content_length = int(value)
        elif name == session_header:
            found.session = value.decode("latin-1")
    return found


def header(scope: Scope, wanted: bytes) -> bytes | None:
    """The first value of the header named WANTED (lower case, as ASGI gives names), or None."""
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


async def read_request_body(receive: Receive, content_length: int | None, limit: int, scope: Scope) -> bytes:
    """The whole request body; BodyTooLarge over LIMIT bytes (at once when CONTENT_LENGTH says so), RequestTimeout
    or ClientGone when it stops arriving (`gone_while_reading`)."""
    if content_length is not None and content_length > limit:
        raise BodyTooLarge(f"the request body is {content_length} bytes; the limit is {limit}")
    message = await receive()
    body = message.get("body", b"")
    if not message.get("more_body"):
        if message["type"] == "http.disconnect":
            raise gone_while_reading(scope)
        if len(body) > limit:
            raise BodyTooLarge(f"the request body is over the limit of {limit} bytes")
        return bytes(body)
    parts = [body]
    size = len(body)
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise gone_while_reading(scope)
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > limit:
            raise BodyTooLarge(f"the request body is over the limit of {limit} bytes")
    return b"".join(parts)


def gone_while_reading(scope: Scope) -> GatewayError:
    """The server's body timeout (connections.py marks the scope) or the client's own disconnect."""
    timeout_s = scope.get(BODY_TIMEOUT_SCOPE_KEY)
    if timeout_s is not None:
        return RequestTimeout(f"the request body did not arrive within {timeout_s:g} s")
    return ClientGone("the client went away before its request was complete")


async def send_json(send: Send, status: int, body: bytes) -> None:
    headers = [JSON_HEADER, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, exc: GatewayError) -> None:
    body = exc.body()
    headers = [JSON_HEADER, (b"content-length", str(len(body)).encode()), *exc.headers()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
