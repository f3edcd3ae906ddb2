"""One proxied request's state, from its arrival to its ledger row, and the tokens it costs its key."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from deepserve.gateway.asgi import SendNow
from deepserve.gateway.errors import ClientGone
from deepserve.gateway.keys import ApiKey
from deepserve.gateway.limits import Admission
from deepserve.gateway.streaming import StreamTap
from deepserve.gateway.usage import NO_COUNTS, TokenCounts, read_usage
from deepserve.gateway.validation import ApiRoute, ParsedRequest

ANONYMOUS = "anonymous"  # the key name of requests on a gateway without keys


class Exchange:
    """One proxied request's state, from arrival to the ledger row."""

    __slots__ = (
        "admission",
        "arrival_ts",
        "client",
        "client_gone",
        "cut",
        "decode_sent_s",
        "endpoint",
        "error",
        "finished",
        "head_sent",
        "key",
        "logged_body",
        "method",
        "parsed",
        "prefill_upstream",
        "request_body",
        "response_id",
        "response_started",
        "send_now",
        "started_s",
        "status",
        "tap",
        "ttft_s",
        "upstream",
        "usage",
    )

    def __init__(self, endpoint: ApiRoute, client: Any = None, method: str = "POST") -> None:
        self.endpoint = endpoint
        self.client = client  # (host, port) of the client, and the method: for the access log
        self.method = method
        self.started_s = time.perf_counter()
        self.arrival_ts = time.time()
        self.key: ApiKey | None = None
        self.parsed: ParsedRequest | None = None
        self.admission: Admission | None = None
        self.status = 200
        self.error: str | None = None
        self.ttft_s: float | None = None
        self.upstream: str | None = None
        self.usage: dict[str, Any] | None = None
        self.response_started = False  # the first event (or the whole answer) went to the client
        self.head_sent = False  # a stream's 200 head went to the client (as soon as the upstream's did)
        self.finished = False
        self.client_gone = False
        self.cut: str | None = None  # why the gateway ended the request (shutdown), when it did
        self.logged_body: list[bytes] | None = None
        self.request_body: bytes | None = None  # as received, kept only with log_bodies
        self.tap: StreamTap | None = None  # a stream's relay state: usage, events delivered
        self.response_id: str | None = None  # a Responses API answer's id
        # The server's send without waiting (http_server.SEND_NOW_SCOPE_KEY), when it has one: how the stream
        # relay forwards events from the upstream's read callback (relay.py)
        self.send_now: SendNow | None = None
        self.prefill_upstream: str | None = None  # the prefill replica (prefill/decode disaggregation)
        self.decode_sent_s: float | None = None  # when the decode request went out, after its prefill

    @property
    def key_name(self) -> str:
        return self.key.name if self.key else ANONYMOUS

    @property
    def model(self) -> str:
        return self.parsed.client_model if self.parsed else "-"

    def token_counts(self) -> TokenCounts:
        """The request's tokens: the upstream's usage when it sent one; for a stream that ended without it (the
        client went away, the gateway cut it), the tokens it delivered, counted from the events relayed. Reasoning
        tokens from the usage when it says, else counted from the stream's reasoning events."""
        usage = self.usage if self.usage is not None or self.tap is None else self.tap.usage
        if usage is not None:
            counts = read_usage(usage)
        elif self.tap is not None and self.response_started:
            counts = TokenCounts(None, self.tap.delivered_tokens())
        else:
            return NO_COUNTS
        if counts.reasoning is None and self.tap is not None and self.tap.reasoning_events:
            counts = dataclasses.replace(counts, reasoning=self.tap.reasoning_events, reasoning_source="deltas")
        return counts

    def used_tokens(self, tokens: TokenCounts) -> int | None:
        """What the request cost its key's token bucket, from its TOKENS (`token_counts`): the usage, or the prompt
        estimate plus the tokens delivered."""
        prompt, completion = tokens.prompt, tokens.completion
        if prompt is None and completion is None:
            return None
        if prompt is None:
            prompt = self.parsed.prompt_tokens_estimate if self.parsed else 0
        return prompt + (completion or 0)


def billable_tokens(exchange: Exchange, tokens: TokenCounts) -> int | None:
    """The tokens to charge the key for in the end, from its TOKENS (`Exchange.token_counts`): the upstream's
    usage, or for a stream that ended early (client gone, cut at shutdown, upstream failure) the prompt estimate
    plus the tokens it delivered; none when the request failed before any engine answered it (refused upstream, no
    replica, queue timeout, cut while waiting); unknown (the estimate stays charged) when the client left before an
    answer, since the engine may have worked for it."""
    used = exchange.used_tokens(tokens)
    if used is None and exchange.ttft_s is None and exchange.status >= 400 and exchange.status != ClientGone.status:
        return 0
    return used
