"""Two `inferengine serve` processes, a producer and a consumer, driven with the router's
contract (`inferengine/kv_transfer/__init__.py`): the consumer's greedy tokens equal one
engine's, streamed or not, on both routes; it computes at most one page of each prompt itself
(its counters say so); a transfer that cannot finish falls back to recomputing the prompt."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer, sse_events

BLOCK = 16


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _start(path, role: str, connector: str | None, **extra) -> RemoteServer:
    config = {"kv_role": role, **extra}
    if connector is not None:
        config["kv_connector"] = connector
    return RemoteServer(path, "--kv-transfer-config", json.dumps(config), "--max-model-len", "256")


@pytest.fixture(scope="module", params=["SharedMemoryConnector", None])
def pair(request, tiny_checkpoint):
    """(producer, consumer); None: the connector left out, so NIXL where it loads."""
    path = tiny_checkpoint("qwen3")
    producer = _start(path, "kv_producer", request.param)
    consumer = _start(path, "kv_consumer", request.param, kv_load_timeout_s=2)
    try:
        yield producer.wait_ready(), consumer.wait_ready()
    finally:
        producer.stop()
        consumer.stop()


def _post(server: RemoteServer, route: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{route}", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed_text(server: RemoteServer, route: str, body: dict) -> str:
    with server.client() as client, client.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        events = [e for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    choices = [c for e in events for c in e["choices"]]
    if route.endswith("chat/completions"):
        return "".join(c["delta"].get("content") or "" for c in choices)
    return "".join(c["text"] for c in choices)


def _text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _body(route: str, prompt: list[int], **fields) -> dict:
    body = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    if route == "/v1/completions":
        body["prompt"] = prompt
    else:
        words = " ".join(map(str, prompt[:20]))  # the tiny tokenizer spells digits singly
        body["messages"] = [{"role": "user", "content": f"tokens {words}"}]
    return {**body, **fields}


def _disaggregated(producer, consumer, route: str, body: dict, stream: bool) -> tuple[str, dict]:
    """The router's two calls: (the consumer's text, the producer's kv_transfer_params)."""
    first = {**body, "max_tokens": 1, "stream": False}
    first["kv_transfer_params"] = {"do_remote_decode": True}
    params = _post(producer, route, first)["kv_transfer_params"]
    second = {**body, "kv_transfer_params": params, "stream": stream}
    if stream:
        return _streamed_text(consumer, route, second), params
    return _text(_post(consumer, route, second)), params


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_producer_and_consumer_give_one_engines_greedy_tokens(pair, route, stream):
    producer, consumer = pair
    prompt = _prompt(70, 1 + stream)
    body = _body(route, prompt)
    before = consumer.stats()["kv_transfer"]
    text, params = _disaggregated(producer, consumer, route, body, stream)
    plain = _text(_post(producer, route, body))  # a request without params: a plain engine
    assert text == plain and len(text) > 0
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    assert params["num_tokens"] == len(params["remote_block_ids"]) * BLOCK
    assert params["transport"] in ("NixlConnector", "SharedMemoryConnector")
    after = consumer.stats()["kv_transfer"]
    received = after["received_tokens"] - before["received_tokens"]
    local = after["local_prefill_tokens"] - before["local_prefill_tokens"]
    assert 0 < local <= BLOCK  # the consumer computed at most one page of the prompt
    assert received + local >= params["num_tokens"]  # the rest came from the producer
    assert after["fallbacks"] == before["fallbacks"]
    if route == "/v1/completions":
        assert (received, local) == (64, 6)  # 70 tokens: four pages fetched, six computed


def test_counters_on_metrics_and_the_producer_frees_its_pages(pair):
    producer, consumer = pair
    _disaggregated(
        producer, consumer, "/v1/completions", _body("/v1/completions", _prompt(40, 9)), False
    )
    _post(producer, "/v1/completions", _body("/v1/completions", [5, 6, 7], max_tokens=1))
    stats = producer.stats()["kv_transfer"]
    assert stats["held_blocks"] == 0 and stats["sent_tokens"] >= 32
    metrics = httpx.get(f"{consumer.url}/metrics", headers=consumer.headers).text
    for name in ("received_tokens_total", "fallback_total", "seconds_count", "bytes_sum"):
        assert f"inferengine:kv_transfer_{name}" in metrics


def test_a_transfer_that_cannot_finish_falls_back_to_recomputing(pair):
    producer, consumer = pair
    route, prompt = "/v1/completions", _prompt(50, 4)
    body = _body(route, prompt)
    first = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = _post(producer, route, first)["kv_transfer_params"]
    if params["transport"] == "SharedMemoryConnector":
        params["shm_path"] += "-never-written"  # the file never appears: the fetch times out
    else:
        params["remote_block_ids"] = [
            10**7 + b for b in params["remote_block_ids"]
        ]  # no such pages
    before = consumer.stats()["kv_transfer"]
    text = _text(_post(consumer, route, {**body, "kv_transfer_params": params}))
    assert text == _text(_post(producer, route, body))
    after = consumer.stats()["kv_transfer"]
    assert after["fallbacks"] == before["fallbacks"] + 1
    assert after["received_tokens"] == before["received_tokens"]
    assert after["local_prefill_tokens"] - before["local_prefill_tokens"] == 50
    assert after["waiting_requests"] == 0


def test_requests_without_params_reply_as_before(pair):
    producer, _ = pair
    reply = _post(producer, "/v1/completions", _body("/v1/completions", [5, 6, 7]))
    assert "kv_transfer_params" not in reply
