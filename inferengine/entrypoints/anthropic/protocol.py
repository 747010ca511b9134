"""Pydantic models of Anthropic's Messages API requests; unknown fields are a 400, as Anthropic's.

Content blocks, tools and `tool_choice` stay plain dicts here: `translate.py` checks them block by
block, so that an error names the exact place (`messages.1.content.0.type`) and says what to send.
Fields of Anthropic's API that this server does not implement are declared (`REFUSED_FIELDS`) so
that sending one is a 400 saying why, not "Extra inputs are not permitted".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Anthropic's request fields this server does not implement: name -> why refused.
REFUSED_FIELDS: dict[str, str] = {
    "container": "there are no code-execution containers",
    "context_management": "context editing is not implemented",
    "mcp_servers": "MCP connectors are not implemented",
    "inference_geo": "there is one place of inference",
    "speed": "there is one inference speed",
    "diagnostics": "cache diagnostics are not implemented",
    "workspace_id": "there are no workspaces",
    "user_profile_id": "there are no user profiles",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Metadata(_Strict):
    user_id: str | None = None


class PromptFields(_Strict):
    """What makes the prompt: the fields `count_tokens` shares with `messages.create`."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # on the last block of the request
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", ...}}
    # refused with a reason when set (REFUSED_FIELDS)
    context_management: Any = None
    mcp_servers: Any = None
    speed: Any = None
    workspace_id: Any = None
    user_profile_id: Any = None


class CountTokensRequest(PromptFields):
    """`POST /v1/messages/count_tokens`."""


class MessagesRequest(PromptFields):
    """`POST /v1/messages`."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    # one tier serves every request: "standard"
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Any = None
    inference_geo: Any = None
    diagnostics: Any = None


def refused_fields(req: PromptFields) -> list[str]:
    """The fields of `REFUSED_FIELDS` that `req` sets."""
    return [name for name in REFUSED_FIELDS if getattr(req, name, None) is not None]
