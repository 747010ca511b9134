"""The router's failure handling over fake engines: prefill retries and fallbacks to recompute,
decode retries before a stream starts, an error event after, no engine at all, and a client
that leaves. Nothing hangs: every test runs under a short timeout."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.entrypoints.router.fakes import TOKENS, engines, free_port, router_client, running_router
from tests.entrypoints.router.test_router_proxy import events, metric

pytestmark = pytest.mark.timeout(60)

COMPLETION = {"prompt": "Hi", "max_tokens": 5}
STREAM = {**COMPLETION, "stream": True}


def run(coro):
    return asyncio.run(coro)


async def post(url: str, body: dict) -> tuple[httpx.Response, str]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        r = await client.post("/v1/completions", json=body)
        return r, (await client.get("/metrics")).text


@pytest.mark.parametrize("fail", ["500", "close"])
def test_a_failed_prefill_engine_is_replaced_by_another(fail):
    async def scenario():
        async with engines("p0", "p1", "d0") as (p0, p1, d):
            p0.fail = fail  # p0 is tried first: nothing cached anywhere, ties go to the lower id
            async with running_router([p0, p1], [d]) as url:
                r, scrape = await post(url, COMPLETION)
        assert r.status_code == 200
        assert (len(p0.bodies), len(p1.bodies)) == (1, 1)
        assert d.bodies[0]["kv_transfer_params"] == {"from": "p1"}
        assert metric(scrape, "router_retries_total", role="prefill") == 1
        assert metric(scrape, "router_upstream_failures_total", role="prefill", url=p0.url) == 1

    run(scenario())


@pytest.mark.parametrize(
    ("fail", "params", "reason"),
    [
        ("500", None, "prefill_failed"),
        ("400", None, "prefill_refused"),
        (None, {}, "no_kv_params"),  # the producer answers kv_transfer_params: null
        (None, {"do_remote_prefill": False, "error": "no pages"}, "no_kv_params"),
    ],
)
def test_without_a_transfer_handle_the_decode_engine_computes_the_prompt(fail, params, reason):
    async def scenario():
        async with engines("p0", "d0") as (p, d):
            p.fail, p.params = fail, params
            async with running_router([p], [d]) as url:
                for body in (COMPLETION, STREAM):
                    r, scrape = await post(url, body)
                    assert r.status_code == 200
        assert [b.get("kv_transfer_params") for b in d.bodies] == [None, None]
        assert metric(scrape, "router_fallbacks_total", reason=reason) == 2
        assert events(r.text)[-1] == "[DONE]"

    run(scenario())


def test_no_prefill_engine_up_still_serves_and_a_hung_one_times_out():
    async def scenario():
        async with engines("p0", "d0") as (p, d):
            dead = f"http://127.0.0.1:{free_port()}"
            async with running_router([dead], [d]) as url:
                r, scrape = await post(url, COMPLETION)
            assert r.status_code == 200
            assert metric(scrape, "router_fallbacks_total", reason="prefill_failed") == 1
            p.fail = "hang"
            async with running_router([p], [d], prefill_timeout=0.5) as url:
                r, _ = await post(url, STREAM)
            assert r.status_code == 200 and events(r.text)[-1] == "[DONE]"
            assert d.bodies[-1].get("kv_transfer_params") is None

    run(scenario())


@pytest.mark.parametrize("fail", ["500", "close", "dead"])
def test_a_decode_engine_failing_before_the_stream_starts_is_retried(fail):
    async def scenario():
        async with engines("p0", "d0", "d1") as (p, d0, d1):
            d0.fail = fail
            if fail == "dead":
                await d0.stop()
            async with running_router([p], [d0, d1]) as url:
                for body in (COMPLETION, STREAM):
                    r, scrape = await post(url, body)
                    assert r.status_code == 200, r.text
                    if fail == "dead":
                        continue
                    d0.fail = fail  # the router now prefers d0 again (less served)
            got = events(r.text)
            assert [e["choices"][0]["text"] for e in got[:-1]] == TOKENS
            # the handle goes on only when d0 never took the request
            expected = {"from": "p0"} if fail == "dead" else None
            assert d1.bodies[-1].get("kv_transfer_params") == expected
            if fail != "dead":
                assert metric(scrape, "router_retries_total", role="decode") == 2
                assert metric(scrape, "router_fallbacks_total", reason="decode_retried") == 2

    run(scenario())


def test_a_stream_that_breaks_after_it_started_ends_with_an_error_event():
    async def scenario():
        async with engines("p0", "d0", "d1") as (p, d0, d1):
            d0.fail = "break"
            async with running_router([p], [d0, d1]) as url:
                r, scrape = await post(url, STREAM)
        assert r.status_code == 200
        got = events(r.text)
        assert [e["choices"][0]["text"] for e in got[:2]] == TOKENS[:2]
        assert got[2]["error"]["code"] == 502 and "broke off" in got[2]["error"]["message"]
        assert got[3:] == ["[DONE]"]
        assert d1.bodies == []  # not retried: the client had its first events
        assert metric(scrape, "router_errors_total", reason="stream_broken") == 1

    run(scenario())


def test_no_decode_engine_or_all_failing_is_a_prompt_5xx():
    async def scenario():
        async with engines("p0", "d0") as (p, d):
            dead = f"http://127.0.0.1:{free_port()}"
            async with running_router([p], [dead]) as url:
                r, scrape = await post(url, STREAM)
            assert r.status_code == 503 and "decode engine" in r.json()["error"]["message"]
            assert metric(scrape, "router_errors_total", reason="no_decode_engine") == 1
            d.fail = "500"
            async with running_router([p], [d]) as url:
                r, scrape = await post(url, COMPLETION)
            assert r.status_code == 500 and r.json()["error"]["message"] == "d0 says no"
            assert metric(scrape, "router_errors_total", reason="decode_failed") == 1

    run(scenario())


def test_a_client_that_leaves_mid_stream_aborts_the_decode_engines_request():
    async def scenario():
        async with engines("p0", "d0") as (p, d), router_client([p], [d]) as client:
            async with client.stream("POST", "/v1/completions", json=STREAM) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # one event, then hang up
            for _ in range(50):
                if d.aborted:
                    break
                await asyncio.sleep(0.05)
            assert d.aborted == 1
            scrape = (await client.get("/metrics")).text
            assert metric(scrape, "router_requests_in_flight", role="decode", url=d.url) == 0

    run(scenario())
