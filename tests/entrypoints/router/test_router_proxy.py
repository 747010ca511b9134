"""The router's happy paths over fake engines: the prefill/decode bodies of the contract, the
relay of answers and streams, cache-aware prefill choice, plain routing of n > 1, and its own
/health, /v1/models, /metrics and API key."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.entrypoints.router.fakes import TOKENS, engines, router_client

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(coro)


def events(text: str) -> list:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"inferengine:{name}") and want in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_non_streamed_completion_goes_prefill_then_decode():
    async def scenario():
        async with engines("p0", "d0") as (p, d), router_client([p], [d]) as client:
            body = {"model": "m", "prompt": "Hi there", "max_tokens": 5, "min_tokens": 2}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "".join(TOKENS)
            sent = p.bodies[0]
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert "min_tokens" not in sent
            assert sent["kv_transfer_params"] == {"do_remote_decode": True}
            assert d.bodies == [{**body, "kv_transfer_params": {"from": "p0"}}]
            scrape = (await client.get("/metrics")).text
            assert metric(scrape, "router_kv_transfers_total") == 1
            assert metric(scrape, "router_requests_total", role="prefill", url=p.url) == 1
            assert metric(scrape, "router_requests_total", role="decode", url=d.url) == 1
            assert metric(scrape, "router_requests_in_flight", role="decode", url=d.url) == 0

    run(scenario())


def test_streamed_chat_is_relayed_event_for_event():
    async def scenario():
        async with engines("p0", "d0") as (p, d), router_client([p], [d]) as client:
            body = {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 7,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            got = events(r.text)
            assert [e["choices"][0]["text"] for e in got[:-1]] == TOKENS
            assert got[-1] == "[DONE]"
            sent = p.bodies[0]
            assert (sent["max_tokens"], sent["max_completion_tokens"]) == (1, 1)
            assert sent["stream"] is False and "stream_options" not in sent
            assert d.bodies[0]["stream_options"] == {"include_usage": True}
            assert d.bodies[0]["kv_transfer_params"] == {"from": "p0"}

    run(scenario())


def test_prefill_goes_to_the_engine_holding_the_prefix():
    async def scenario():
        shared = "The same long system prompt, again and again. "
        async with engines("p0", "p1", "d0") as (p0, p1, d):
            p1.stored = [shared]
            async with router_client([p0, p1], [d]) as client:
                for i in range(3):
                    body = {"prompt": shared + f"question {i}", "max_tokens": 2}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                scrape = (await client.get("/metrics")).text
        assert (len(p0.bodies), len(p1.bodies)) == (0, 3)
        assert p1.tokenized + p0.tokenized == 3  # the prompt's ids came from /tokenize
        assert [b["kv_transfer_params"] for b in d.bodies] == [{"from": "p1"}] * 3
        assert metric(scrape, "router_prefill_decisions_total", reason="prefix") == 3

    run(scenario())


def test_token_id_prompts_need_no_tokenize_and_one_prefill_engine_none_at_all():
    async def scenario():
        async with engines("p0", "p1", "d0") as (p0, p1, d):
            p0.stored = ["abcdefgh"]
            async with router_client([p0, p1], [d]) as client:
                ids = [ord(c) for c in "abcdefghij"]
                r = await client.post("/v1/completions", json={"prompt": [ids]})
                assert r.status_code == 200
            assert (len(p0.bodies), p0.tokenized + p1.tokenized) == (1, 0)
            async with router_client([p1], [d]) as client:
                r = await client.post("/v1/completions", json={"prompt": "abc"})
                assert r.status_code == 200
            assert (len(p1.bodies), p1.tokenized) == (1, 0)

    run(scenario())


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"prompt": ["a", "b"]}, {"echo": True, "logprobs": 1}],
    ids=["n", "prompts", "echo_logprobs"],
)
def test_requests_the_protocol_cannot_split_go_whole_to_a_decode_engine(extra):
    async def scenario():
        async with engines("p0", "d0") as (p, d), router_client([p], [d]) as client:
            body = {"prompt": "Hi", "max_tokens": 3, "kv_transfer_params": {"x": 1}, **extra}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            scrape = (await client.get("/metrics")).text
        assert p.bodies == []
        assert "kv_transfer_params" not in d.bodies[0]  # a client's own is never passed on
        assert metric(scrape, "router_fallbacks_total", reason="unsupported") == 1

    run(scenario())


def test_health_models_and_api_key():
    async def scenario():
        async with engines("p0", "d0") as (p, d), router_client([p], [d], api_key="k") as client:
            health = await client.get("/health")
            assert health.json() == {"status": "ok", "prefill_up": 1, "decode_up": 1}
            body = {"prompt": "Hi"}
            assert (await client.post("/v1/completions", json=body)).status_code == 401
            auth = {"Authorization": "Bearer k"}
            models = await client.get("/v1/models", headers=auth)
            assert models.json()["data"][0]["id"] == "d0"
            r = await client.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200
            bad = await client.post("/v1/completions", content=b"[1", headers=auth)
            assert bad.status_code == 400 and "error" in bad.json()
            d.healthy = False
            await asyncio.sleep(0.6)  # a poll or two
            assert (await client.get("/health")).status_code == 503
            scrape = (await client.get("/metrics")).text
            assert metric(scrape, "router_engine_up", role="decode", url=d.url) == 0
            assert metric(scrape, "router_engine_up", role="prefill", url=p.url) == 1

    run(scenario())
