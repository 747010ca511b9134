"""`ServerConfig`: the HTTP server's settings (the engine's are `EngineArgs`); import-light for the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from inferengine.errors import ConfigError


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_body_bytes: int = 8 << 20
    uvicorn_log_level: str = "info"
    disable_log_requests: bool = False
    drain_timeout: float = 30.0  # seconds a SIGTERM waits for in-flight requests
    # Tool calling and reasoning on chat (vLLM's flags; parsers by name, see `tool_parsers/`
    # and `reasoning_parsers.py`).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError(
                "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or "
                "mistral): the parser that finds tool calls in the model's text."
            )
