"""`RouterServerConfig`: the prefill/decode router's settings (`inferengine router`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferengine.config import ROUTER_POLICIES
from inferengine.errors import ConfigError


@dataclass
class RouterServerConfig:
    prefill: list[str] = field(default_factory=list)  # base URLs of kv_producer engines
    decode: list[str] = field(default_factory=list)  # base URLs of kv_consumer engines
    host: str = "127.0.0.1"
    port: int = 8000
    # Clients must send it (`Authorization: Bearer <key>`); the router sends it to the engines.
    # Without it, a client's Authorization header goes to the engines as it came.
    api_key: str | None = None
    policy: str = "cache-aware"  # how prefill engines are picked (config.ROUTER_POLICIES)
    connect_timeout: float = 5.0  # seconds to connect to an engine
    prefill_timeout: float = 300.0  # seconds for a prefill engine's whole answer
    # Seconds without a byte from a decode engine before its request fails (between stream
    # events; for a whole answer when not streaming).
    request_timeout: float = 600.0
    health_check_interval: float = 1.0  # seconds between polls of /health and /kv_events
    uvicorn_log_level: str = "info"

    def __post_init__(self) -> None:
        self.prefill = [_url(u, "--prefill") for u in self.prefill]
        self.decode = [_url(u, "--decode") for u in self.decode]
        for name, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            if not urls:
                raise ConfigError(f"the router needs at least one {name} engine URL.")
            if len(set(urls)) != len(urls):
                raise ConfigError(f"{name} names an engine twice.")
        if self.policy not in ROUTER_POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}.")
        for name in ("connect_timeout", "prefill_timeout", "request_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive.")
        if self.health_check_interval <= 0:
            raise ConfigError("--health-check-interval must be positive.")


def _url(url: str, flag: str) -> str:
    """An engine's base URL, without a trailing slash or `/v1`."""
    url = url.strip().rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{flag} {url!r}: give the engine's URL, e.g. http://10.0.0.5:8000.")
    return url
