"""KV retention for sessions: how long a conversation's pages should outlive its request.

OpenAI's `prompt_cache_retention` ("in_memory", or a duration such as "600s", "1h", "24h") and
Anthropic's `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` both become a lease in
seconds; the scheduler evicts leased pages only after every unleased one, and spills them to
the CPU tier before dropping them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inferengine.errors import InvalidRequestError, excerpt

MAX_TTL_S = 7 * 24 * 3600.0  # a week: a lease longer than that is almost surely a mistake
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_retention(value: str | None, field: str = "prompt_cache_retention") -> float | None:
    """Seconds of lease for `value`; None for "in_memory" (the plain LRU) or no value."""
    if value is None or value == "in_memory":
        return None
    if not isinstance(value, str):
        raise InvalidRequestError(
            f'{field} must be a string: "in_memory" or a duration such as "600s", "1h".',
            param=field,
        )
    match = _DURATION.match(value)
    if match is None:
        raise InvalidRequestError(
            f'{field} {excerpt(value)!r} is not understood: use "in_memory" or a positive duration '
            'with a unit (ms, s, m, h, d), such as "600s", "5m", "1h" or "24h".',
            param=field,
        )
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0 or seconds > MAX_TTL_S:
        raise InvalidRequestError(
            f"{field} {excerpt(value)!r} is out of range: a lease lasts more than 0 s and at most "
            f"{MAX_TTL_S / 86400:.0f} days.",
            param=field,
        )
    return seconds


@dataclass(frozen=True, slots=True)
class Retention:
    """What one request asks the KV cache to keep; it becomes `EngineCoreRequest.cache_key`,
    `cache_ttl_s` and `cache_breakpoints`."""

    key: str | None = None  # the session's name (OpenAI's `prompt_cache_key`)
    ttl_s: float | None = None  # a lease on every page of the request; None: plain LRU
    # (number of leading prompt tokens, lease in seconds), by token count
    breakpoints: tuple[tuple[int, float], ...] = ()

    @classmethod
    def parse(cls, key: str | None, retention: str | None) -> Retention:
        """OpenAI's `prompt_cache_key` and `prompt_cache_retention`, checked."""
        if key is not None and not isinstance(key, str):
            raise InvalidRequestError(
                f"prompt_cache_key must be a string, got {type(key).__name__}.",
                param="prompt_cache_key",
            )
        return cls(key=key, ttl_s=parse_retention(retention, "prompt_cache_retention"))
