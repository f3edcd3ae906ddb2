"""Gateway errors in OpenAI's shape. Every error a client sees is one of these: status, type, code, message.

Upstream failures are caught at the edge of the upstream client and re-raised as an `UpstreamError` subclass with
`raise … from`, so the cause stays in the traceback while the client sees a stable shape."""

from __future__ import annotations

import json

# The longest error text the usage ledger keeps for one request (an upstream's message is cut to this).
MAX_LEDGER_ERROR_CHARS = 300


class GatewayError(Exception):
    """MESSAGE is what the client reads. LEDGER_MESSAGE, when given, is what the usage ledger keeps instead: the
    same error without the client's own text (a model name, a parameter's value), which the ledger only stores with
    --log-bodies."""

    status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, ledger_message: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.ledger_message = ledger_message

    def ledger_text(self) -> str:
        """What the usage ledger records: bounded, and free of request text when the error names it."""
        text = self.ledger_message if self.ledger_message is not None else self.message
        return bound_text(text)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()

    def sse_event(self) -> bytes:
        """The same error as a final server-sent event, for a stream that already started."""
        return b"data: " + self.body() + b"\n\n"


class InternalError(GatewayError):
    """A bug in the gateway (logged with its traceback); the client still gets OpenAI's error shape."""

    code = "internal_error"


class InvalidRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class RequestTimeout(GatewayError):
    """The client did not finish sending its request in time (the server's body read timeout)."""

    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class AuthenticationFailed(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    error_type = "permission_error"
    code = "model_not_allowed"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class BodyTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    """429: a per-key limit; Retry-After says when the request would be admitted."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float, *, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(max(1, int(self.retry_after_s + 0.999))).encode())]


class Overloaded(GatewayError):
    """503: the gateway's queue is full or the wait timed out; the client should back off and retry."""

    status = 503
    error_type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, *, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(max(1, int(self.retry_after_s + 0.999))).encode())]


class LimiterUnavailable(Overloaded):
    """503: the limits are shared through Redis and Redis cannot be reached, so nothing can be admitted without
    breaking them (the gateway fails closed unless started with --redis-fail-open)."""

    code = "limiter_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="limiter_unavailable")


class UpstreamError(GatewayError):
    """The engine failed us. `retryable` failures are tried on another replica while the client has seen nothing."""

    status = 502
    error_type = "server_error"
    code = "upstream_error"
    retryable = True


class UpstreamUnavailable(UpstreamError):
    """Could not connect, or the connection dropped. `refused` (nothing listens) is proof that the replica is down;
    a dropped or slow connection alone is not (an overloaded replica is slow, not dead)."""

    status = 503
    code = "upstream_unavailable"

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamBadStatus(UpstreamError):
    """The engine answered 5xx."""

    code = "upstream_bad_status"


class NoHealthyUpstream(UpstreamError):
    status = 503
    code = "no_healthy_upstream"
    retryable = False


class GatewayShuttingDown(GatewayError):
    """The gateway stopped (SIGTERM) and its grace period ended before this request did."""

    status = 503
    error_type = "server_error"
    code = "gateway_shutdown"


class ClientGone(GatewayError):
    """The client closed the connection; nothing can be sent (nginx's 499, for the ledger and metrics)."""

    status = 499
    error_type = "client_closed_request"
    code = "client_closed_request"


def bound_text(text: str, limit: int = MAX_LEDGER_ERROR_CHARS) -> str:
    """TEXT cut to LIMIT characters (marked with an ellipsis) and made encodable as UTF-8 (a lone surrogate becomes
    '?'), so that it can always be stored."""
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text
