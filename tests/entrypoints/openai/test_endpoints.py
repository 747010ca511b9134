"""Our own endpoints over raw HTTP: tokenize, detokenize, generate, stats, metrics, health."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN
from tests.entrypoints.openai.server import SERVED_NAME, sse_events


def test_health_and_version_need_no_key(tiny_server):
    import httpx

    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{tiny_server.url}/version").json()
    assert tiny_server.saw_503_before_ready  # /health said 503 while the engine started


def test_tokenize_detokenize_round_trip(tiny_server):
    with tiny_server.client() as c:
        out = c.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
        body = out.json()
        assert out.status_code == 200 and body["count"] == len(body["tokens"]) > 0
        assert body["max_model_len"] == MAX_MODEL_LEN and len(body["token_strs"]) == body["count"]
        text = c.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
        assert text == "Hello world"
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        prompt = c.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
        assert prompt == "<s>user: Hi\n<s>assistant:"


def test_generate_native(tiny_server):
    with tiny_server.client() as c:
        ids = c.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
        body = {"prompt_token_ids": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        out = c.post("/v1/generate", json=body).json()
        choice = out["choices"][0]
        assert out["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
        assert choice["finish_reason"] == "length"
        text = c.post("/v1/generate", json=body | {"prompt_token_ids": None, "prompt": "Hello"})
        assert text.json()["choices"][0]["token_ids"] == choice["token_ids"]
        with c.stream("POST", "/v1/generate", json=body | {"stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        streamed = [t for e in events[:-1] for c_ in e["choices"] for t in c_["token_ids"]]
        assert streamed == choice["token_ids"]
        assert "".join(c_["text"] for e in events[:-1] for c_ in e["choices"]) == choice["text"]


def test_stats(tiny_server):
    stats = tiny_server.stats()
    for key in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_pages_used",
        "kv_pages_free",
        "kv_pages_cached",
        "prefix_cache_hit_rate",
        "generation_tokens_per_s",
        "uptime_s",
        "attention_backend",
        "attention_backend_timings_ms",
        "engine_pid",
    ):
        assert key in stats, key
    assert stats["model"] == SERVED_NAME


def _metrics(server) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{server.url}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "le")
            if "le" in labels:
                continue
            values[sample.name + (f"{{{suffix}}}" if suffix else "")] = sample.value
            assert sample.labels.get("model_name") == SERVED_NAME
    return values


def test_metrics_move_after_requests(tiny_server):
    before = _metrics(tiny_server)
    with tiny_server.client() as c:
        prompt = "The quick brown fox jumps over the lazy dog. " * 4  # > 2 KV pages
        n_prompt = c.post("/tokenize", json={"prompt": prompt}).json()["count"]
        body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        for _ in range(2):
            assert c.post("/v1/completions", json=body).status_code == 200
    after = _metrics(tiny_server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("inferengine:prompt_tokens_total") == 2 * n_prompt
    assert moved("inferengine:generation_tokens_total") == 12
    assert moved("inferengine:request_success_total{finished_reason=length}") == 2
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert moved(f"inferengine:{histogram}_count") == 2, histogram
    assert moved("inferengine:inter_token_latency_seconds_count") == 10
    assert moved("inferengine:iteration_tokens_total_count") >= 6
    # The second request reused the first one's prompt pages.
    hits = moved("inferengine:prefix_cache_hits_total")
    assert 0 < hits <= moved("inferengine:prefix_cache_queries_total")
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"inferengine:{gauge}" in after
    assert "inferengine:gpu_memory_used_bytes" not in after  # CPU: no device memory gauge


def test_grafana_dashboard_uses_exported_metrics(tiny_server):
    import json
    import re
    from pathlib import Path

    import httpx

    dashboard = Path(__file__).parents[3] / "docs" / "grafana-dashboard.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"inferengine:[a-z0-9_]+", e)}
    text = httpx.get(f"{tiny_server.url}/metrics").text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = used - exported - {"inferengine:gpu_memory_used_bytes"}  # CUDA only
    assert not missing, missing
