"""`ServerConfig`: the HTTP server's settings (the engine's are `EngineArgs`); import-light for the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_body_bytes: int = 8 << 20
    uvicorn_log_level: str = "info"
    # uvicorn's access log (one line per HTTP request, /health polls included) is off by
    # default; vLLM has it on and offers --disable-uvicorn-access-log.
    enable_access_log: bool = False
    disable_uvicorn_access_log: bool = False  # vLLM's flag, accepted: it wins over the above
    # Request logging is off by default, as in vLLM: one line per request when on, its
    # parameters cut to max_log_len characters. Errors and start-up phases are always logged.
    enable_log_requests: bool = False
    disable_log_requests: bool = False  # deprecated no-op (vLLM's old flag; the default now)
    max_log_len: int = 2048
    # Fan-out bounds: n per prompt (OpenAI's 128), and sequences per request (prompts x n;
    # 0: 64 x --max-num-seqs).
    max_n: int = 128
    max_request_seqs: int = 0
    drain_timeout: float = 30.0  # seconds from SIGTERM to exit, in-flight requests included
    # Tool calling and reasoning on chat (vLLM's flags; parsers by name, see `tool_parsers/`
    # and `reasoning_parsers.py`).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None
    # The web page at / (`entrypoints/web/`): a chat playground and a live engine view.
    disable_web_ui: bool = False
    # The store of /v1/responses (`responses/store.py`): responses kept for previous_response_id
    # and GET, at most this many, this many bytes (as JSON), each this many seconds.
    responses_store_max: int = 10000
    responses_store_bytes: int = 256 << 20
    responses_store_ttl: float = 3600.0
    # Multi-LoRA adapters served by name (`name=path` or vLLM's JSON form); needs --enable-lora
    lora_modules: list[str] = field(default_factory=list)

    @property
    def access_log(self) -> bool:
        return self.enable_access_log and not self.disable_uvicorn_access_log

    def __post_init__(self) -> None:
        if self.disable_log_requests:
            logger.warning(
                "--disable-log-requests is deprecated and does nothing: request logging is off "
                "by default; --enable-log-requests turns it on."
            )
        for name, least in (
            ("max_log_len", 1),
            ("max_n", 1),
            ("max_request_seqs", 0),
            ("responses_store_max", 1),
            ("responses_store_bytes", 1),
        ):
            if getattr(self, name) < least:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}.")
        if not self.responses_store_ttl > 0:
            raise ConfigError("--responses-store-ttl must be more than 0 seconds.")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError(
                "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or "
                "mistral): the parser that finds tool calls in the model's text."
            )
