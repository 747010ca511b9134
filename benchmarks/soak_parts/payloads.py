"""What the soak's clients send: the traffic kinds and their weights, prompts, JSON schemas,
tools, the shared prefix, and the bad inputs that must get a 4xx."""

from __future__ import annotations

import json

# Traffic kinds and their default weights (a client picks one per iteration).
KINDS = {
    "chat_stream": 24,
    "completion": 14,
    "n_choices": 8,
    "json_schema": 8,
    "tool_call": 8,
    "agent_session": 10,
    "cache_key": 8,
    "disconnect": 8,
    "bad_input": 12,
}
BAD_INPUTS = (
    "malformed_json",
    "lone_surrogate_chat",
    "lone_surrogate_completion",
    "unknown_model",
    "negative_max_tokens",
    "messages_not_a_list",
    "prompt_over_context",
    "body_over_limit",
)
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about caches.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue? Answer briefly.",
    "Give me a short tip for writing clean Python.",
    "Translate 'good morning' into Spanish and German.",
    "What does a compiler do?",
    "Name a famous bridge and the city it is in.",
    "Summarise the plot of Cinderella in one sentence.",
)
SHARED_PREFIX = (
    "You are a support assistant for a company that sells garden tools. Policies: refunds "
    "within 30 days with a receipt; exchanges within 60 days; tools with a lifetime warranty "
    "are replaced free of charge when they break in normal use; shipping is free over 50 "
    "dollars; orders ship within two working days; the shop is open Monday to Saturday, 9 to "
    "6. Be brief and polite, and never promise anything the policies do not say. "
) * 3
AGENT_SYSTEM = (
    "You are an agent that plans small errands. You can call tools; their results come back "
    "as user messages starting with 'Tool output:'. Think step by step and keep answers short."
)
SCHEMAS = (
    {
        "name": "person",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
    {
        "name": "city",
        "schema": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "country": {"type": "string"},
                "population": {"type": "integer"},
            },
            "required": ["city", "country"],
        },
    },
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


def bad_request(variant: str, model: str) -> tuple[str, bytes]:
    """(path, raw body) of one bad input."""

    def dump(x: dict) -> bytes:
        return json.dumps(x).encode()

    chat = "/v1/chat/completions"
    if variant == "malformed_json":
        return chat, b'{"model": "x", "messages": [{"role": "user", "content": "hi"'
    if variant == "lone_surrogate_chat":  # valid JSON text, but not valid Unicode
        return (
            chat,
            b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 4}',
        )
    if variant == "lone_surrogate_completion":
        return "/v1/completions", b'{"prompt": "x \\udfff", "max_tokens": 4}'
    if variant == "unknown_model":
        msgs = [{"role": "user", "content": "hi"}]
        return chat, dump({"model": "no-such-model", "messages": msgs, "max_tokens": 4})
    if variant == "negative_max_tokens":
        return "/v1/completions", dump({"model": model, "prompt": "hi", "max_tokens": -5})
    if variant == "messages_not_a_list":
        return chat, dump({"model": model, "messages": "hello", "max_tokens": 4})
    if variant == "prompt_over_context":  # ~1 MB of text: far past max_model_len
        return "/v1/completions", dump({"model": model, "prompt": "word " * 200_000})
    if variant == "body_over_limit":  # past the default 8 MiB --max-request-body-bytes
        msgs = [{"role": "user", "content": "x" * (9 << 20)}]
        return chat, dump({"model": model, "messages": msgs, "max_tokens": 4})
    raise ValueError(variant)
