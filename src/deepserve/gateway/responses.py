"""The Responses API's stored responses, and where they live.

vLLM keeps a stored response (`store`, with VLLM_ENABLE_RESPONSES_API_STORE) in its own API server's memory, so a
response can only be retrieved (`GET /v1/responses/{id}`), cancelled (`POST …/{id}/cancel`) or continued
(`previous_response_id`) on the replica that answered it. The gateway remembers which replica that was, and which key
asked, for the last MAX_REMEMBERED responses it relayed: retrieval goes there, a continuation is routed there, and
another key is told the response does not exist. A response this gateway process did not relay (another worker, a
restart) is looked for on every healthy replica in turn."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_REMEMBERED = 100_000  # about 200 bytes each


@dataclass(frozen=True)
class StoredResponse:
    replica: str  # the upstream URL that answered it
    key_id: str | None  # the key that asked for it (None: an anonymous request on an open gateway)


class ResponseRoutes:
    """{response id: StoredResponse} for the responses most recently relayed (least recently used forgotten)."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self.capacity = capacity
        self._routes: OrderedDict[str, StoredResponse] = OrderedDict()

    def remember(self, response_id: str, replica: str, key_id: str | None) -> None:
        self._routes[response_id] = StoredResponse(replica, key_id)
        self._routes.move_to_end(response_id)
        if len(self._routes) > self.capacity:
            self._routes.popitem(last=False)

    def find(self, response_id: str) -> StoredResponse | None:
        return self._routes.get(response_id)

    def __len__(self) -> int:
        return len(self._routes)
