"""`ServerConfig`: the HTTP server's settings (the engine's are `EngineArgs`); import-light for the CLI."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_body_bytes: int = 8 << 20
    uvicorn_log_level: str = "info"
    disable_log_requests: bool = False
    drain_timeout: float = 30.0  # seconds a SIGTERM waits for in-flight requests
