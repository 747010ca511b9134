"""The in-memory store of finished responses (`store: true`), bounded in count and bytes, each
kept for a fixed time: what `previous_response_id`, `GET` and `DELETE /v1/responses/{id}` read."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferengine.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: the object `GET` returns, the conversation it answered (input items,
    earlier turns first, without `instructions`, which a follow-up does not inherit), and the
    KV session its turns share."""

    response: dict[str, Any]
    history: list[dict[str, Any]]
    session: str
    size: int = 0
    expires_at: float = 0.0

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up turn continues: the history, then this response's output items."""
        return [*self.history, *self.response["output"]]


class ResponseStore:
    """Responses by id, oldest first; `put` drops expired ones and then the oldest until both
    bounds hold. A response larger than `max_bytes` on its own is not kept (and logged)."""

    def __init__(
        self,
        max_responses: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_responses < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("a response store needs room for one response and a positive TTL")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict[str, Any], history: list[dict[str, Any]], session: str) -> bool:
        """Keep `response` (under its "id") for `ttl_s` seconds; False when it is too large."""
        size = _size(response) + _size(history)
        response_id = response["id"]
        if size > self.max_bytes:
            logger.warning(
                "response %s not stored: %d bytes, more than the store's %d (--responses-store-"
                "bytes)",
                response_id,
                size,
                self.max_bytes,
            )
            return False
        self.delete(response_id)
        entry = StoredResponse(response, history, session, size, self.clock() + self.ttl_s)
        self._expire()
        while self._entries and (
            len(self._entries) >= self.max_responses or self.num_bytes + size > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = entry
        self.num_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        """Drop the expired responses: all at the front, since every one lives `ttl_s`."""
        now = self.clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires_at > now:
                return
            self._drop(oldest_id)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self.num_bytes -= entry.size


def _size(value: Any) -> int:
    """Bytes of `value` as compact JSON: the measure of what a response holds."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
