"""The `POST /v1/responses` request (pydantic) and which of OpenAI's fields this server refuses.

OpenAI's API answers an unknown top-level field with a 400 "Unknown parameter"; so does this
server. OpenAI's fields that ask for what this server cannot do (background runs, hosted
conversations, saved prompts, ...) are refused with a 400 naming them unless their value asks
for nothing (`REFUSED_FIELDS`). A few of our own sampling fields are accepted beside OpenAI's
(`EXTENSION_FIELDS`, as vLLM accepts them): the official SDK sends them through `extra_body`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from inferengine.entrypoints.openai.protocol import INT64_MAX, TemplateKwargs
from inferengine.errors import InvalidRequestError, excerpt

_TEXT_ONLY = "this server serves text-only models and runs no hosted tools"
# name -> (values that ask for nothing besides None / False / [] / {}, why refused)
REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((), "background responses are not supported; leave background out"),
    "background_options": ((), "background responses are not supported"),
    "conversation": (
        (),
        "the Conversations API is not implemented; chain responses with previous_response_id",
    ),
    "include": ((), "none of the extra output data `include` names can be produced here"),
    "prompt": ((), "saved prompt templates are not implemented; send input and instructions"),
    "prompt_cache_options": (
        (),
        "send prompt_cache_retention for a lease on the prompt's KV cache instead",
    ),
    "top_logprobs": ((0,), "logprobs are not implemented on /v1/responses; use chat completions"),
    "truncation": (
        ("disabled",),
        "input is never truncated: an input longer than the context is a 400",
    ),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "stream_options": (
        ({"include_obfuscation": False},),
        "stream obfuscation is not implemented (send include_obfuscation false or leave "
        "stream_options out)",
    ),
    "context_management": ((), "context compaction is not implemented"),
    "moderation": ((), "there is no moderation"),
    "image": ((), _TEXT_ONLY),
    "access_programs": ((), "there are no access programs"),
}
# Ours, not OpenAI's: decoding settings of chat completions, passed to the engine as they are.
EXTENSION_FIELDS = (
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "priority",
    "cache_salt",
    "chat_template_kwargs",
)


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # deprecated name of `summary`


class ResponsesRequest(BaseModel):
    """OpenAI's request body; undeclared fields land in `model_extra` (refused or unknown)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    # Calls of built-in tools only, of which this server makes none: a bound that always holds.
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    store: bool | None = None  # None: true, as OpenAI's
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    # Identifiers of the end user (for OpenAI's abuse checks and cache routing): echoed only.
    user: str | None = None
    safety_identifier: str | None = None
    # Extensions (`EXTENSION_FIELDS`).
    seed: int | None = None
    top_k: int | None = Field(default=None, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    cache_salt: str | None = None
    chat_template_kwargs: TemplateKwargs = None

    @property
    def stored(self) -> bool:
        return self.store is not False

    def check_fields(self) -> None:
        """A 400 for an unknown top-level field (OpenAI's "Unknown parameter"), for a refused
        one that asks for something, and for metadata beyond OpenAI's bounds."""
        for name, value in (self.model_extra or {}).items():
            entry = REFUSED_FIELDS.get(name)
            if entry is None:
                raise InvalidRequestError(
                    f"Unknown parameter: '{excerpt(name, 64)}'.",
                    param=name,
                    code="unknown_parameter",
                )
            if value in (None, False, [], {}) or value in entry[0]:
                continue
            raise InvalidRequestError(f"{name} is not supported: {entry[1]}.", param=name)
        if self.input is None:
            raise InvalidRequestError(
                "input is required: a string, or a list of input items.", param="input"
            )
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError(
                f"max_output_tokens must be at least 1, got {self.max_output_tokens}.",
                param="max_output_tokens",
            )
        _check_metadata(self.metadata)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise InvalidRequestError(
            f"metadata has {len(metadata)} keys; at most 16 are allowed.", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise InvalidRequestError(
                f"metadata key {excerpt(key, 64)!r}: keys are at most 64 characters and values "
                "at most 512.",
                param=f"metadata.{excerpt(key, 64)}",
            )
