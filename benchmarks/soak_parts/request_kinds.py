"""One handler per traffic kind: it sends that kind's request and checks the answer (n choices
indexed 0..n-1, JSON that has the schema's required keys, the forced tool called with JSON
arguments, a stream that ends with [DONE] and a finish_reason, a bad input refused with a 4xx);
an agent session is two to four turns, a record each."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from .outcomes import Record
from .payloads import AGENT_SYSTEM, BAD_INPUTS, PROMPTS, SCHEMAS, SHARED_PREFIX, TOOLS, bad_request
from .traffic import (
    BadResponse,
    Traffic,
    error_detail,
    finish_and_message,
    guarded,
    post_json,
    stream,
)


async def do_chat_stream(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(16, 48),
    }
    rec.ok = await stream(c, "/v1/chat/completions", body, rec) is not None


async def do_completion(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    body = {"model": t.model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 32)}
    out = await post_json(c, "/v1/completions", body, rec)
    if out is not None:
        if not out["choices"] or not isinstance(out["choices"][0].get("text"), str):
            raise BadResponse("no text in the completion")
        rec.ok = True


async def do_n_choices(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    n = rng.choice((2, 3))
    body = {"model": t.model, "n": n, "max_tokens": 16, "temperature": 0.8}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    out = await post_json(c, path, body, rec)
    if out is not None:
        if sorted(ch["index"] for ch in out["choices"]) != list(range(n)):
            raise BadResponse(f"asked for n={n}, got {len(out['choices'])} choices")
        rec.ok = True


async def do_json_schema(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    schema = rng.choice(SCHEMAS)
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": f"Describe a {schema['name']} as JSON."}],
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    out = await post_json(c, "/v1/chat/completions", body, rec)
    if out is None:
        return
    finish, message = finish_and_message(out)
    if finish == "stop":
        try:
            value = json.loads(message.get("content") or "")
        except ValueError as e:
            raise BadResponse(f"content is not JSON ({e})") from None
        missing = [k for k in schema["schema"]["required"] if k not in value]
        if missing:
            raise BadResponse(f"JSON lacks required keys {missing}")
    rec.ok = True


async def do_tool_call(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    tool = rng.choice(TOOLS)
    name = tool["function"]["name"]
    question = "What is the weather in Oslo?" if name == "get_weather" else "What is 17 + 25?"
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 40,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": name}},
    }
    out = await post_json(c, "/v1/chat/completions", body, rec)
    if out is None:
        return
    finish, message = finish_and_message(out)
    if finish == "tool_calls":
        calls = message.get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != name:
            raise BadResponse(f"forced {name}, got {[x['function']['name'] for x in calls]}")
        try:
            json.loads(calls[0]["function"]["arguments"])
        except ValueError:
            raise BadResponse("tool arguments are not JSON") from None
    elif finish != "length":
        raise BadResponse(f"forced tool call finished with {finish!r}")
    rec.ok = True


async def do_cache_key(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    key = f"soak-shared-{rng.randrange(4)}"
    body = {
        "model": t.model,
        "prompt": f"{SHARED_PREFIX}\nCustomer: {rng.choice(PROMPTS)}\nAssistant:",
        "max_tokens": 16,
        "prompt_cache_key": key,
        "prompt_cache_retention": rng.choice(("in_memory", "120s")),
    }
    out = await post_json(c, "/v1/completions", body, rec)
    rec.ok = out is not None


async def do_disconnect(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    body = {
        "model": t.model,
        "messages": [
            {
                "role": "user",
                "content": "Tell me a long story about "
                + rng.choice(("a dragon", "the sea", "a robot", "a lighthouse")),
            }
        ],
        "max_tokens": 200,
        "ignore_eos": True,
    }
    chunks = await stream(c, "/v1/chat/completions", body, rec, stop_after=rng.randint(1, 8))
    rec.ok = chunks is not None


async def do_bad_input(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    rec.expect_4xx = True
    rec.variant = rng.choice(BAD_INPUTS)
    path, raw = bad_request(rec.variant, t.model)
    response = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
    rec.status = response.status_code
    rec.detail = error_detail(response) if response.status_code >= 500 else ""
    if response.status_code < 400:
        rec.error, rec.detail = "accepted", "a bad input was accepted"


async def do_agent_session(
    t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record
) -> Record:
    """Two to four turns of one session under prompt_cache_key, each turn a record of its own
    (`rec` is the first); the last turn's record."""
    t.sessions += 1
    key = f"soak-agent-{t.sessions}-{rng.randrange(1 << 30)}"
    system: dict[str, Any] = {"role": "system", "content": AGENT_SYSTEM + " " + SHARED_PREFIX}
    lease: dict[str, Any] = {"prompt_cache_key": key}
    if rng.random() < 0.5:
        lease["prompt_cache_retention"] = "60s"
    else:  # Anthropic's mark on the system message
        system["content"] = [
            {
                "type": "text",
                "text": system["content"],
                "cache_control": {"type": "ephemeral", "ttl": "5m"},
            }
        ]
    messages = [
        system,
        {
            "role": "user",
            "content": "Plan a trip to buy " + rng.choice(("bread", "a bike", "paint", "stamps")),
        },
    ]
    for turn in range(1, rng.randint(2, 4) + 1):
        if turn > 1:
            if t.done():
                break
            await asyncio.sleep(rng.uniform(0.2, 1.5))  # the agent runs its tool
            rec = Record("agent_session", t.now())
            t.records.append(rec)
        rec.turn = turn
        body = {"model": t.model, "messages": messages, "max_tokens": 24, **lease}
        reply: list[str] = []

        async def ask(rec: Record = rec, body: dict = body, reply: list = reply) -> None:
            out = await post_json(c, "/v1/chat/completions", body, rec)
            if out is not None:
                reply.append(finish_and_message(out)[1].get("content") or "")
                rec.ok = True

        await guarded(rec, t, ask())
        if not rec.ok:
            break
        messages = [
            *messages,
            {"role": "assistant", "content": reply[0]},
            {"role": "user", "content": f"Tool output: {rng.randrange(10**6)}. Next?"},
        ]
    return rec


HANDLERS = {
    "chat_stream": do_chat_stream,
    "completion": do_completion,
    "n_choices": do_n_choices,
    "json_schema": do_json_schema,
    "tool_call": do_tool_call,
    "agent_session": do_agent_session,
    "cache_key": do_cache_key,
    "disconnect": do_disconnect,
    "bad_input": do_bad_input,
}
