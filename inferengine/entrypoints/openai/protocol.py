"""Pydantic models of the HTTP API: OpenAI's request and response shapes plus our own endpoints.

Generating requests keep the fields they do not declare in `model_extra`: a field of OpenAI's or
vLLM's API that this server does not implement (`UNSUPPORTED_FIELDS`), sent with a value that asks
for something, is refused with a 400 naming it; any other unknown field is ignored with a warning,
as vLLM does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# Fields of OpenAI's or vLLM's request APIs that would change the reply but are not implemented
# here: name -> (values that ask for nothing besides None / False / [], why refused).
# (`tools` and `tool_choice` are fields of chat requests; elsewhere this table refuses them.)
_CHAT_ONLY_TOOLS = "tools work on /v1/chat/completions only"
_LEGACY_FUNCTIONS = (
    "the legacy function calling fields are not implemented; use tools and tool_choice"
)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((), _CHAT_ONLY_TOOLS),
    "tool_choice": (("none", "auto"), _CHAT_ONLY_TOOLS),
    "functions": ((), _LEGACY_FUNCTIONS),
    "function_call": (("none",), _LEGACY_FUNCTIONS),
    "audio": ((), "only text output is supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "web_search_options": ((), "there is no web search"),
    "reasoning_effort": (
        (),
        "a thinking switch, where the model's chat template has one, goes in "
        'chat_template_kwargs (e.g. {"enable_thinking": false})',
    ),
    "echo": ((), "echo works on /v1/completions only"),
    "best_of": ((1,), "use n"),
    "use_beam_search": ((), "beam search is not implemented"),
    "length_penalty": ((1, 1.0), "beam search is not implemented"),
    "guided_whitespace_pattern": ((), "JSON is always generated without whitespace between tokens"),
    "structural_tag": ((), "structural tags are not implemented"),
    "allowed_token_ids": ((), "favour or ban token ids with logit_bias"),
    "bad_words": ((), "ban their token ids with logit_bias -100"),
    "logits_processors": ((), "custom logits processors are not implemented"),
    "truncate_prompt_tokens": ((), "shorten the prompt instead"),
    "prompt_logprobs": ((), "on /v1/completions send echo with logprobs"),
    "return_tokens_as_token_ids": ((), "/v1/generate returns token ids"),
    "return_token_ids": ((), "/v1/generate returns token ids"),
    "add_special_tokens": ((), "the chat template already holds the special tokens"),
    "documents": ((), "put the documents in the messages"),
}


def unsupported_reason(name: str, value: Any) -> str | None:
    """Why a request field in `UNSUPPORTED_FIELDS` is refused; None when its value asks for
    nothing (or the field is not in the table)."""
    entry = UNSUPPORTED_FIELDS.get(name)
    if entry is None or value is None or value is False or value == [] or value in entry[0]:
        return None
    return entry[1]


INT64_MAX = 2**63 - 1  # the engine's requests carry their integers as int64 (msgpack)

# Arguments of the chat template's rendering (Transformers' `apply_chat_template` and ours), which
# `chat_template_kwargs` (variables for the template) must not set: they would change what the
# rendering returns or clash with the messages the request sends.
_RENDERING_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "processor",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)


def _template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    clash = sorted(set(value or ()) & _RENDERING_ARGUMENTS)
    if clash:
        raise ValueError(
            f"{', '.join(clash)} cannot be set here: chat_template_kwargs holds variables for the "
            "chat template, and these are set by the request itself or by the server."
        )
    return value


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_variables)]


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true


class SamplingFields(_Model):
    """Decoding settings every generating endpoint accepts (OpenAI's plus vLLM's extras).

    `None` means "the model's generation_config default, else SamplingParams' default".
    Undeclared fields are kept in `model_extra` (see the module docstring).
    """

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(default=0, ge=-INT64_MAX - 1, le=INT64_MAX)
    cache_salt: str | None = None
    # Sessions (`inferengine/retention.py`): OpenAI's name for the conversation, and how long
    # its KV pages outlive the request: "in_memory" (plain LRU) or a duration such as "1h".
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Structured output (`structured_outputs.py`): OpenAI's response_format, vLLM's
    # structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and its
    # older guided_* fields; at most one of them asks.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # Disaggregated prefill/decode (`inferengine/kv_transfer/__init__.py` has the contract)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("prompt_cache_retention", mode="wrap")
    @classmethod
    def _retention_shape(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                'prompt_cache_retention must be a string: "in_memory" or a duration such as '
                '"600s", "1h" or "24h"'
            ) from None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids, or a list of "
                "token-id lists"
            ) from None


class ChatMessage(_Model):
    """A message; each content part is kept whole, so Anthropic's `cache_control` on a part (or
    on the message) reaches `entrypoints/cache_breakpoints.py`."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (`tools.py`): function tools, "none" | "auto" | "required" | a named function.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: TemplateKwargs = None


class GenerateRequest(SamplingFields):
    """Our native endpoint: text or token ids in, token ids and text out."""

    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None  # None: generation_config.json's max_new_tokens, else 16
    logprobs: int | None = None
    add_special_tokens: bool = True


# ---- responses -----------------------------------------------------------------------------


class PromptTokensDetails(_Model):
    cached_tokens: int = 0


class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def _now() -> int:
    return int(time.time())


class CompletionLogprobs(_Model):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _KVTransferReply(_Model):
    """A reply that may carry a producer's `kv_transfer_params` (`inferengine/kv_transfer/`);
    without them the field is left out, so every other reply reads as before."""

    kv_transfer_params: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_transfer(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("kv_transfer_params") is None:
            data.pop("kv_transfer_params", None)
        return data


class CompletionResponse(_KVTransferReply):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatLogprobToken] | None = None


class _DropNone(_Model):
    """Fields left unset (None) are not sent."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(_Model):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(_Model):
    """The reply; `content` is null when the reply is only tool calls. `reasoning_content` (with
    --reasoning-parser) and `tool_calls` are sent only when there are some."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatChoice(_Model):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_KVTransferReply):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(_DropNone):
    """A streamed message increment; fields left unset are not sent, as OpenAI does."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Model):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "inferengine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # given to the chat template, as on chat
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: TemplateKwargs = None
    return_token_strs: bool = False


class TokenizeResponse(_Model):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


class DetokenizeResponse(_Model):
    prompt: str


class GenerateChoice(_Model):
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[str, float]] | None = None  # per token: {token id: logprob}
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class GenerateResponse(_Model):
    id: str
    object: Literal["generation"] = "generation"
    created: int = Field(default_factory=_now)
    model: str
    prompt_token_ids: list[int] | None = None
    choices: list[GenerateChoice]
    usage: UsageInfo | None = None
